"""torch.compile: watching a compiled model adds no graph break or retrace and still localises the finding."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from tests import zoo

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning"),
    # dynamo itself touches .grad of non-leaf tensors while wrapping them (a torch-internal warning)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))


def _step(fn, opt, x):
    loss = fn(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _fresh(how: str, counters) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """No graph from an earlier test, dynamo's counters at zero; the model, its optimizer, the model compiled ``how``."""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), zoo.compiled(model, how)


def _poison(model: nn.Module) -> None:
    """A poisoned LayerNorm weight: what every test here must find at its module."""
    with torch.no_grad():
        model[1].weight[3] = float("nan")


def _assert_found_at_layernorm(hunt) -> None:
    first = hunt.first
    assert first is not None
    assert (first.phase, first.module, first.module_type, first.cause) == ("forward", "1", "LayerNorm", "parameter")


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compiled_model_no_graph_break_and_module_level_finding(how):
    from torch._dynamo.utils import counters

    model, opt, fn = _fresh(how, counters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(fn, opt, torch.randn(4, 8))  # compiled before watch(): the watch must force a retrace
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for _ in range(3):
            _step(fn, opt, torch.randn(4, 8))
        assert not hunt.findings
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        _poison(model)
        _step(fn, opt, torch.randn(4, 8))
    _assert_found_at_layernorm(hunt)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_graphs_forget_the_hunt_after_close():
    torch._dynamo.reset()
    model = _model()
    fn = torch.compile(model, backend="aot_eager")
    with nanhunt.watch(model, on_find="record") as hunt:
        fn(torch.randn(2, 8))
    assert hunt._compiled is None  # no buffer, no slot map left for a compiled graph to write into
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    fn(torch.randn(2, 8))  # runs without the hunt: nothing recorded, nothing raised
    assert hunt.findings == []


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_watched_compiled_model_is_traced_once(how):
    """The in-graph checks' slots exist before the first trace: the graph's guards hold from its
    first call (a slot made while tracing made dynamo trace every frame again on the second call)."""
    from torch._dynamo.utils import counters

    model, opt, fn = _fresh(how, counters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
            _step(fn, opt, torch.randn(4, 8))
            traced = counters["stats"]["unique_graphs"]
            for _ in range(3):
                _step(fn, opt, torch.randn(4, 8))
            assert counters["stats"]["unique_graphs"] == traced >= 1
            with torch.no_grad():
                model[0].weight[0, 0] = float("inf")  # a poisoned Linear weight: its slot, not a later one's
            _step(fn, opt, torch.randn(4, 8))
    assert hunt.first is not None and hunt.first.module == "0"
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_sentinel_adds_no_graph_break_and_still_finds_the_nan(how):
    """Sentinel's root hooks are traced into the graph: they must not break it (they read the RNG
    state and thread id eagerly). Under torch.compile(model) the wrapper's eager call is caught from
    the first step end on, under model.compile() around the compiled call: the finding names the
    poisoned module as in eager."""
    from torch._dynamo.utils import counters

    model, opt, fn = _fresh(how, counters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(model, optimizer=opt, on_find="record", mode="sentinel") as hunt:
            for _ in range(3):
                _step(fn, opt, torch.randn(4, 8))
            assert not hunt.findings
            _poison(model)
            loss = fn(torch.randn(4, 8)).pow(2).mean()
            hunt.check(loss, "loss")
            loss.backward()
            opt.step()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_found_at_layernorm(hunt)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_watching_the_compiled_wrapper_names_modules_as_the_model_does(mode):
    """``model = torch.compile(model); watch(model)``: names are the model's own (no ``_orig_mod.``
    prefix) and the finding is localised, as when the inner model is watched."""
    torch._dynamo.reset()
    model = _model()
    wrapper = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(wrapper.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(wrapper, optimizer=opt, on_find="record", mode=mode) as hunt:
            for _ in range(2):
                _step(wrapper, opt, torch.randn(4, 8))
            _poison(model)
            _step(wrapper, opt, torch.randn(4, 8))
    _assert_found_at_layernorm(hunt)
    torch._dynamo.reset()


def test_sentinel_watching_the_compiled_wrapper_sees_its_first_step():
    """``watch(torch.compile(model), mode="sentinel")``: the wrapper is known from watch() on, so a
    log(0) at the very first step is found at its module, op and line (it was a gradient "of
    unknown origin", the wrapper caught only from the first step's end), and nothing retraces."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = zoo.lognet()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    wrapper = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(wrapper, optimizer=opt, on_find="record", mode="sentinel") as hunt:
            _step(wrapper, opt, torch.ones(2, 4))
            traced = counters["stats"]["unique_graphs"]
            _step(wrapper, opt, torch.ones(2, 4))
    first = hunt.first
    assert first is not None
    assert (first.phase, first.module, first.step, first.cause, first.op) == (
        "forward", "log", 0, "created", "aten.log.default")
    assert counters["stats"]["unique_graphs"] == traced >= 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("order", ["first opened closes first", "last opened closes first"])
def test_two_hunts_on_a_model_compiled_model_leave_its_compiled_call_as_it_was(order):
    """Each hunt wraps model.compile()'s compiled call; closing them in any order takes each
    wrapper out of the chain, and both hunts see the finding meanwhile."""
    torch._dynamo.reset()
    model = _model()
    model.compile(backend="aot_eager")
    own = model._compiled_call_impl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = nanhunt.watch(model, on_find="record")
        b = nanhunt.watch(model, on_find="record", mode="sentinel")
        model(torch.randn(2, 8))
        _poison(model)
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
        first, second = (a, b) if order.startswith("first") else (b, a)
        first.close()
        model(torch.randn(2, 8))  # the other hunt still watches
        second.close()
    assert model._compiled_call_impl is own
    for hunt in (a, b):
        assert hunt.first is not None and (hunt.first.module, hunt.first.cause) == ("1", "parameter")
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_compiled_after_watch_is_watched_from_the_next_step(mode):
    """``watch(model)`` then ``model.compile()``: the first step's graphs traced hooks with nothing
    to write into; from its end on the hunt catches the compiled call (and full mode's graphs are
    traced once more with their slots), so a later NaN is localised as in eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
            model.compile(backend="aot_eager")
            for _ in range(3):
                _step(model, opt, torch.randn(4, 8))
            assert not hunt.findings
            _poison(model)
            _step(model, opt, torch.randn(4, 8))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_found_at_layernorm(hunt)
    assert "_compiled_call_impl" not in model.__dict__ or not hasattr(model._compiled_call_impl, "__nanhunt_root__")
    torch._dynamo.reset()


@pytest.mark.parametrize(("how", "mode", "order"), [("torch.compile", "sentinel", "before"),
                                                  ("module.compile", "full", "after"),
                                                  ("module.compile", "sentinel", "after")])
def test_a_nan_in_the_first_step_of_a_graph_not_hooked_yet_is_not_blamed_on_a_weight_gradient(how, mode, order):
    # the first step's calls ran in a graph the hunt catches from the step after: the NaN its
    # forward made reached a weight gradient, reported "created" there ("summed past the dtype's
    # max while being accumulated") or, in sentinel, as a GAN's parts called directly
    torch._dynamo.reset()
    model = _LogInOwnCode()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    keep = torch.ones(4, 8)
    keep[1, 0] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = zoo.compiled(model, how, "aot_eager") if order == "before" else None
        with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
            if fn is None:
                fn = zoo.compiled(model, how, "aot_eager")
            fn(torch.randn(4, 8), keep).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    torch._dynamo.reset()
    first = hunt.first
    assert first is not None and first.step == 0
    if first.phase == "grad":
        assert first.cause == "unknown" and "compiled graph" in first.hint, first
        assert "accumulated" not in first.hint and "GAN" not in first.hint, first.hint
    else:
        assert (first.phase, first.op) == ("forward", "aten.log.default"), first


class _LogInOwnCode(nn.Module):
    """A root whose own forward makes -inf (log of 0) that its child then consumes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(self.fc(x).abs() * keep))


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_value_born_in_the_compiled_roots_own_code_is_the_roots(how):
    # the log saw only the root's call (the children ran in the graph): the replay finds the
    # child fed first, and the cause climbs back to the root's own code, which is named
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LogInOwnCode()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fn = zoo.compiled(model, how)
    x = torch.randn(4, 8)
    keep = torch.ones(4, 8)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(3):
            if step == 1:
                keep[1, 0] = 0.0
            fn(x, keep).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    torch._dynamo.reset()
    first = hunt.first
    assert first is not None
    assert (first.phase, first.module, first.module_type, first.step, first.cause) == (
        "forward", "", "_LogInOwnCode", 1, "created")
    assert first.op == "aten.log.default"


class _Huge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3e38  # finite: 16 of them sum past float32's largest value


class _HugeThenBack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = _Huge()
        self.lin = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.lin(self.big(x) / 3e38) - shift)  # nan when shift is large


def test_huge_finite_values_inside_a_compiled_graph_are_no_finding():
    # the graph's own check added the outputs' sums: a finite 3e38 activation flagged its module at
    # every step, with no replay to clear it (a clean run stopped in raise mode); the real NaN at
    # step 1 is still found
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _HugeThenBack()
    fn = zoo.compiled(model, "torch.compile")
    x = torch.ones(1, 16)
    with nanhunt.watch(model, on_find="record") as hunt:
        for step in range(3):
            fn(x, torch.tensor(100.0 if step == 1 else -10.0))
    torch._dynamo.reset()
    assert [(f.phase, f.module, f.step, f.op) for f in hunt.findings] == [("forward", "", 1, "aten.sqrt.default")]


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_finding_and_its_analysis_do_not_recompile_the_graph(how):
    # the analysis replays the compiled call while the hunt is paused: a traced read of that flag
    # would have guarded the graph on it and recompiled it once (seconds under Inductor)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _LogInOwnCode()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fn = zoo.compiled(model, how)
    x, keep = torch.randn(4, 8), torch.ones(4, 8)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(4):
            if step == 1:
                traced = counters["stats"]["unique_graphs"]
            keep[1, 0] = 0.0 if step == 2 else 1.0
            fn(x, keep).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert hunt.first is not None and hunt.first.step == 2
        assert counters["stats"]["unique_graphs"] == traced, "recompiled after the finding"
    torch._dynamo.reset()


def test_compiling_a_watched_module_shows_no_warning_about_the_hunts_hooks_and_the_users_stays() -> None:
    """torch.compile(module) warned at every call that global hooks 'fire an extra time' (they
    are nanhunt's, which stand aside for that call); a global hook of the user's keeps the warning."""
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        with nanhunt.watch(compiled, on_find="record"):
            compiled(torch.randn(2, 8))
        assert not [w for w in seen if "global hooks" in str(w.message)]
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        try:
            with nanhunt.watch(compiled, on_find="record"):
                compiled(torch.randn(2, 8))
        finally:
            handle.remove()
        assert [w for w in seen if "global hooks" in str(w.message)]
    assert not [f for f in warnings.filters if f[1] is not None and "global hooks" in f[1].pattern]
    torch._dynamo.reset()


def test_nanhunt_run_of_a_compiled_module_shows_no_warning_about_its_hooks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`nanhunt run` of a script compiling its model printed torch's "global hooks on modules"
    warning (its discovery hooks are global hooks too, which the filter did not count), where
    `python script.py` and watch() print none."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        print("done")
    """))
    p = subprocess.run([sys.executable, "-W", "default", "-m", "nanhunt", "run", str(script)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr
    assert "global hooks on modules" not in p.stderr, p.stderr


def test_the_compile_warning_filter_goes_with_the_hunt_also_when_closed_inside_catch_warnings() -> None:
    before = list(warnings.filters)
    hunt = nanhunt.watch(_model())
    with warnings.catch_warnings():
        hunt.close()  # the block's copy of the list holds the filter too
    assert [f for f in warnings.filters if f not in before] == []


class _SqrtBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        return h + torch.sqrt(h - h.detach() + 1 - (x[:, :1] > 50).float())  # sqrt(0) on flagged rows: inf grad


class _SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), _SqrtBlock(), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.relu(self.a(x)) + x))


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_a_gradient_eager_makes_too_gets_the_numerics_verdict_under_compile(how: str) -> None:
    """A gradient born in the backward that eager reproduces (sqrt at 0): under torch.compile the
    verdict was skipped as if only the compiled backward made it (None); eager gave 'numerics'."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = zoo.compiled(model, how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            with nanhunt.watch(run, optimizer=opt):
                for step in range(4):
                    x = torch.randn(8, 16)
                    if step == 2:
                        x[5, 0] = 100.0
                    run(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.step, f.verdict) == ("backward", "b", "SqrtBackward0", 2, "numerics"), f
    torch._dynamo.reset()


def test_a_gradient_born_in_a_roots_own_code_gets_the_numerics_verdict() -> None:
    """Found at its autograd node (no module input to name): the verdict was None."""
    torch.manual_seed(0)
    model = nn.Sequential(_SqrtBlock(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt):
            x = torch.randn(8, 16)
            x[5, 0] = 100.0
            model(x).pow(2).mean().backward()
            opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.verdict) == ("backward", "0", "SqrtBackward0.grad_input[0]", "numerics"), f
    assert f.reference["dtype"] == "float32" and f.reference["op"] == "SqrtBackward0"


class _LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.log(x[:, :1].abs())  # log(0) = -inf where x[:, 0] is 0


class _WithCompiledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 4), _LogBlock(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.block(x) + self.inp(x)))


@pytest.mark.parametrize("bad_step", [2, 0])
@pytest.mark.parametrize("when", ["before watch", "after watch", "module.compile"])
def test_a_compiled_submodule_runs_and_its_nan_is_found_at_its_op_and_line(when: str, bad_step: int) -> None:
    # net.block = torch.compile(net.block): dynamo, tracing the hunt's forward hook, met the block
    # twice (itself, and inside its wrapper in the hunt's slot map) and failed the user's forward.
    # net.block.compile(): the block's own hooks ran traced inside its graph, so its call was never
    # recorded, and a NaN it made at the first step was blamed on the module after it, with no op
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _WithCompiledBlock()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    if when == "before watch":
        net.block = torch.compile(net.block, backend="eager")  # type: ignore[assignment]
    elif when == "module.compile":
        net.block.compile(backend="eager")
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(net, opt):
            if when == "after watch":
                net.block = torch.compile(net.block, backend="eager")  # type: ignore[assignment]
            for step in range(4):
                x = torch.randn(4, 4)
                if step == bad_step:
                    x[1, 0] = 0.0
                _step(net, opt, x)
    f = ei.value.finding
    assert (f.phase, f.step, f.cause, f.op) == ("forward", bad_step, "created", "aten.log.default"), f
    assert f.module.startswith("block") and f.index == (1, 0), f
    assert f.module_type == "_LogBlock", f  # the user's class, never torch's OptimizedModule wrapper
    if when == "module.compile":
        assert f.module == "block", f
    assert f.source is not None and f.source.endswith(f":{_LogBlock.forward.__code__.co_firstlineno + 1}"), f


class _DivBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / x[:, :1]  # x/0 where x[:, 0] is 0


class _Absorbs(nn.Module):
    """The parent cleans its child's output (nan_to_num): only the child's own output shows the NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.out = _DivBlock(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nan_to_num(self.block(x), nan=0.0, posinf=0.0, neginf=0.0))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager", "eager"])
def test_a_nan_the_compiled_model_absorbs_is_found_in_its_module_as_in_eager(backend: str) -> None:
    # Inductor folded the in-graph check ((t * 0).sum(): a product with 0 is 0) and saw nothing: the
    # first finding was a backward one; with the eager backends the verdict replay compared the
    # model's finite output and said 'transient' (a hardware fault)
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _Absorbs()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    run = torch.compile(net, backend=backend)
    with nanhunt.watch(net, opt, on_find="record") as hunt:
        for step in range(4):
            x = torch.randn(4, 4) + 3
            if step == 2:
                x[1, 0] = 0.0
            _step(run, opt, x)
    f = hunt.first
    assert f is not None and (f.step, f.phase, f.module, f.tensor) == (2, "forward", "block", "output"), f
    assert f.op == "aten.div.Tensor" and f.verdict == "numerics" and f.reproducible is True, f


def test_a_compiled_model_with_a_compiled_part_is_watched_and_left_as_it_was() -> None:
    # model.compile() and model.block.compile(): watch() itself failed (AttributeError: the hunt
    # caught the compiled part while building its slots, before its own handles existed)
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _WithCompiledBlock()
    net.block.compile(backend="eager")
    net.compile(backend="eager")
    own = (net.__dict__["_compiled_call_impl"], net.block.__dict__["_compiled_call_impl"])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x[1, 0] = 0.0
    with nanhunt.watch(net, opt, on_find="record") as hunt:
        _step(net, opt, x)
    f = hunt.first
    assert f is not None and (f.module, f.module_type, f.op, f.cause) == ("block", "_LogBlock", "aten.log.default",
                                                                         "created"), f
    assert (net.__dict__["_compiled_call_impl"], net.block.__dict__["_compiled_call_impl"]) == own
    torch._dynamo.reset()


class _AddLog(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + torch.log(mask)  # -inf where the mask is 0


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.addlog = _AddLog()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.addlog(self.fc(x), mask))


def _compiled(m: nn.Module, how: str) -> Any:
    """What the loop calls: ``torch.compile(m)``'s wrapper, or ``m`` compiled in place."""
    if how == "torch.compile":
        return torch.compile(m, backend="aot_eager")
    m.compile(backend="aot_eager")
    return m


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_a_compiled_module_is_judged_after_the_users_forward_hook_as_eagerly(how: str) -> None:
    # "your own forward hooks run first: nanhunt judges the output your program sees". Compiled,
    # the in-graph check took the output before the user's hook cleaned it (nan_to_num): a healthy
    # run raised. Eagerly and now compiled: nothing; and a hook that makes a -inf is found in it
    torch.manual_seed(0)
    m = _Masked()
    m.addlog.register_forward_hook(lambda mod, i, o: torch.nan_to_num(o, neginf=0.0))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    fn = _compiled(m, how)
    with nanhunt.watch(m, optimizer=opt, on_find="record") as hunt:
        for step in range(3):
            mask = torch.ones(2, 1)
            if step == 1:
                mask[0] = 0
            out = fn(torch.randn(2, 4), mask)
            assert torch.isfinite(out).all()
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [], [str(f) for f in hunt.findings]

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    keep = [torch.ones(2, 1)]
    seq[0].register_forward_hook(lambda mod, i, o: o + torch.log(keep[0]))  # the user's hook makes -inf; tanh hides it
    opt = torch.optim.SGD(seq.parameters(), lr=1e-2)
    fn = torch.compile(seq, backend="aot_eager")
    with nanhunt.watch(seq, optimizer=opt, on_find="record") as hunt:
        for step in range(3):
            keep[0] = torch.ones(2, 1)
            if step == 1:
                keep[0][0] = 0
            fn(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.op) == ("forward", "0", 1, "aten.log.default"), str(f)


class _Net(nn.Module):
    """A custom root (not a Sequential): torch runs its ``_call_impl`` untraced under torch.compile,
    so each global hook around the compiled forward is a frame dynamo compiles on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inp(x)) * 2)


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_a_watched_compiled_model_compiles_as_many_graphs_as_unwatched_when_the_batch_size_changes(how: str) -> None:
    # full mode wrote the root's in-graph slot from its post-hook, a frame of its own here: one
    # graph more than unwatched, guarded on the output's shape, compiled again at each new batch
    # size. The root's call is seen eagerly around the compiled call, its output judged there
    from torch._dynamo.utils import counters

    def graphs(watch: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        m = _Net()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        fn = _compiled(m, how)
        hunt = nanhunt.watch(m, optimizer=opt) if watch else None
        try:
            for b in (4, 4, 5, 6):
                fn(torch.randn(b, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            if hunt is not None:
                hunt.close()
        return int(counters["stats"]["unique_graphs"])

    assert graphs(True) == graphs(False)


@pytest.mark.parametrize("watched", ["watched", "unwatched by watch()"])
def test_a_compiled_optimizer_step_compiles_as_many_graphs_as_unwatched_and_still_stops_a_nan(watched: str) -> None:
    # torch.compile(opt.step): dynamo traced the hunt's step hooks: their reads of the hunt's state
    # were guards that changed every step (51 graphs where the unwatched step compiled 1, the
    # recompile limit hit on nanhunt's own functions). They run eagerly at a clean graph break now
    from torch._dynamo.utils import counters

    def run(watch: bool) -> tuple[int, list[torch.Tensor], Any]:
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = torch.compile(opt.step, backend="aot_eager")
        hunt = nanhunt.watch(model, optimizer=opt if watched == "watched" else None) if watch else None
        err = None
        try:
            for i in range(5):
                x = torch.randn(4, 8)
                model(x).pow(2).mean().div(0.0 if i == 4 else 1.0).mul(0.0).backward()  # 0 * inf: nan
                if i == 4:  # (unwatched, the update would apply it)
                    if watch:
                        with pytest.raises(nanhunt.NonFiniteError) as err:
                            step()
                    break
                step()
                opt.zero_grad()
        finally:
            if hunt is not None:
                hunt.close()
        return int(counters["stats"]["unique_graphs"]), [p.detach().clone() for p in model.parameters()], err

    plain, before, _ = run(False)
    graphs, after, err = run(True)
    torch._dynamo.reset()
    assert graphs == plain
    assert err is not None and err.value.finding.step == 4
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the 4 clean updates as unwatched; not the 5th


def test_a_compiled_update_with_a_custom_backend_compiles_as_many_graphs_as_unwatched() -> None:
    # a backend that returns dynamo's graph itself (the usual graph counter): dynamo calls it through
    # a module wrapper of its own, whose global hooks it traces. Full mode took that call for one of
    # the model's modules traced without in-graph slots and dropped every compiled graph at the
    # step's end: 2 graphs where unwatched compiled 1
    from torch._dynamo.utils import counters

    def run(watch: bool) -> tuple[int, int, Any]:
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        backend_calls = []

        def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            backend_calls.append(gm)
            return gm

        @torch.compile(backend=counting)
        def update() -> None:
            opt.step()
            opt.zero_grad()

        hunt = nanhunt.watch(model, optimizer=opt) if watch else None
        err = None
        try:
            for i in range(5):
                model(torch.randn(4, 8)).pow(2).mean().div(0.0 if i == 4 else 1.0).mul(0.0).backward()
                if i == 4 and watch:
                    with pytest.raises(nanhunt.NonFiniteError) as err:
                        update()
                    break
                update()
        finally:
            if hunt is not None:
                hunt.close()
        return int(counters["stats"]["unique_graphs"]), len(backend_calls), err

    plain = run(False)[:2]
    graphs, calls, err = run(True)
    torch._dynamo.reset()
    assert (graphs, calls) == plain
    assert err is not None and (err.value.finding.step, err.value.finding.module) == (4, "<outside>")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_compiled_training_step_that_calls_the_model_and_the_loss_gets_no_accumulation_guess(mode):
    # one compiled function runs the model and a masked mean (0/0 when every row is masked): no
    # call of the model and no loss code is seen, the first finding is a gradient's. It said
    # cause "created" and blamed accumulation over several backward passes (full mode), which
    # sent the user away from the forward; it now says it was not seen, and why
    def masked_ce(logits: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        return (ce * valid).sum() / valid.sum()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)

    @torch.compile(backend="aot_eager")
    def train_fwd(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return masked_ce(net(x), y, valid)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(net, optimizer=opt, on_find="record", mode=mode) as hunt:
            for step in range(4):
                valid = torch.zeros(4) if step == 2 else torch.ones(4)
                train_fwd(torch.randn(4, 8), torch.randint(0, 5, (4,)), valid).backward()
                opt.step()
                opt.zero_grad()
    torch._dynamo.reset()
    f = hunt.first
    assert f is not None and (f.phase, f.step) == ("grad", 2), f
    assert f.cause == "unknown" and "accumulated" not in f.hint and "GAN" not in f.hint, f
    assert "compile" in f.hint, f.hint


def test_a_nan_the_model_makes_inside_a_compiled_training_step_says_why_only_its_module_is_known():
    # Lightning's fit(torch.compile(module)) compiles training_step, which calls the model: no call
    # of it runs eagerly, the graph's own check finds the module and nothing can be replayed. The
    # hint blamed replay=False or inputs changed in place (neither was so); it now says why, and to
    # compile the model itself
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Softplus(), zoo.Log(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    @torch.compile(backend="aot_eager")
    def training_step(x: torch.Tensor) -> torch.Tensor:
        return net(x).pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(net, optimizer=opt, on_find="record") as hunt:
            for step in range(4):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                training_step(x * 1e4 if step == 2 else x).backward()  # softplus underflows to 0: log(0)
                opt.step()
                opt.zero_grad()
    torch._dynamo.reset()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.module_type, f.step, f.cause) == ("forward", "2", "Log", 2, "unknown"), f
    assert "replay=False" not in f.hint and "compiled training step" in f.hint and "model.compile()" in f.hint, f.hint


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_nan_in_a_later_micro_batch_of_a_compiled_model_has_its_call_index(how):
    # gradient accumulation over 3 micro-batches, the NaN in the second of step 2: the part's calls
    # ran inside the graph (only the root's were recorded), so its earlier calls of the step went
    # uncounted and the finding said call 0, the first micro-batch
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Softplus(), zoo.Log(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    fn = zoo.compiled(net, how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(net, optimizer=opt, on_find="record") as hunt:
            for step in range(3):
                for micro in range(3):
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3 * step + micro))
                    fn(x * 1e4 if (step, micro) == (2, 1) else x).pow(2).mean().backward()  # softplus underflows: log(0)
                opt.step()
                opt.zero_grad()
    torch._dynamo.reset()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.call, f.op) == ("forward", "2", 2, 1, "aten.log.default"), f


def _cross_entropy_by_hand(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    logp = torch.log(p)  # a softmax underflowed to 0: -inf, then 0 * -inf = nan below
    return -(target * logp).sum(-1).mean()


def test_a_nan_born_in_a_compiled_loss_function_is_at_its_op_and_the_line_in_its_graph() -> None:
    # a loss function compiled on its own runs as one call of the loss code: its ops took that
    # call's line (the function's def line), and dynamo, tracing the outside recorder's mode
    # into the graph, gave every node nanhunt's own line as its innermost frame
    import inspect

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    loss_fn = torch.compile(_cross_entropy_by_hand, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(net, optimizer=opt, on_find="record") as hunt:
            for step in range(3):
                x = torch.randn(6, 4) * (300 if step == 2 else 1)
                target = nn.functional.one_hot(torch.randint(0, 5, (6,)), 5).float()
                loss_fn(net(x), target).backward()
                opt.step()
                opt.zero_grad()
    torch._dynamo.reset()
    first = inspect.getsourcelines(_cross_entropy_by_hand)[1]
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.op) == ("forward", "<outside>", 2, "aten.log.default"), f
    assert f.source == f"{__file__}:{first + 2}", f.source
    assert f.chain[1] == f"aten.mul.Tensor @ {__file__}:{first + 3}", f.chain
    assert f.verdict == "numerics", f
