"""mode="sentinel" (probes at the model's boundary only; the failing call replayed on a hit) gives
the same first finding as full mode, also when the loop checks its loss (a value fed from a
poisoned forward makes the loss and the loss code's backward non-finite first in the log)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from tests import zoo


def _poisoned_ln() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))

    def poison(m: nn.Module) -> None:
        with torch.no_grad():
            m[1].weight[3] = float("nan")

    return model, poison


def _log0() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    def zero_bias(m: nn.Module) -> None:  # ReLU zeros -> log(0) = -inf
        with torch.no_grad():
            m.lin.weight.zero_()
            m.lin.bias.zero_()

    return zoo.lognet(0), zero_bias


def _sqrt0() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    return zoo.distnet(0), lambda m: None  # equal halves below: sqrt at 0 in backward


class _LogHead(nn.Module):
    """log features in the model's own code (between two children), then a linear head: a -inf
    from log(0) becomes NaN in the head (-inf times weights of both signs, summed)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(self.lin(x).clamp(min=0)))


def _log0_own_code() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    torch.manual_seed(0)

    def zero_lin(m: nn.Module) -> None:  # every feature 0: log(0) = -inf in the model's own code
        with torch.no_grad():
            m.lin.weight.zero_()
            m.lin.bias.zero_()

    return _LogHead(), zero_lin


CASES: dict[str, Callable[[], tuple[nn.Module, Callable[[nn.Module], None]]]] = {
    "poisoned LayerNorm weight": _poisoned_ln,
    "log(0)": _log0,
    "log(0) in the model's own code, NaN in the head": _log0_own_code,
    "sqrt at 0 (backward)": _sqrt0,
}
# what both modes must name: (phase, module, module_type, tensor, cause)
EXPECTED = {
    "poisoned LayerNorm weight": ("forward", "1", "LayerNorm", "output", "parameter"),
    "log(0)": ("forward", "log", "Log", "output", "created"),
    "log(0) in the model's own code, NaN in the head": ("forward", "", "_LogHead", "output", "created"),
    "sqrt at 0 (backward)": ("backward", "dist", "PairDistance", "grad_input[0]", "created"),
}


def _run(case: str, mode: str, check: bool, sanitize: bool = False) -> list[Any]:
    model, poison = CASES[case]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    d_in = model[0].in_features if isinstance(model, nn.Sequential) else 4

    def batch() -> torch.Tensor:
        x = torch.randn(4, d_in, generator=g)
        if case.startswith("sqrt"):
            x[1, 2:] = x[1, :2]  # equal halves: a == b exactly
        return x

    with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
        for step in range(3):
            if step == 2:
                poison(model)
            out = model(batch())
            loss = (out.nan_to_num() if sanitize else out).pow(2).mean()
            if check:
                hunt.check(loss, "loss")
            loss.backward()
            opt.step()
            opt.zero_grad()
    return hunt.findings


@pytest.mark.parametrize("check", [True, False], ids=["check(loss)", "no check"])
@pytest.mark.parametrize("case", list(CASES))
def test_sentinel_names_what_full_mode_names(case: str, check: bool) -> None:
    full = _run(case, "full", check)
    sentinel = _run(case, "sentinel", check)
    assert full and sentinel
    keys = ("phase", "module", "module_type", "tensor", "step", "cause", "index", "op")
    f, s = full[0], sentinel[0]
    assert {k: getattr(s, k) for k in keys} == {k: getattr(f, k) for k in keys}, (str(f), str(s))
    assert (s.phase, s.module, s.module_type, s.tensor, s.cause) == EXPECTED[case], str(s)


@pytest.mark.parametrize("case", ["log(0)", "poisoned LayerNorm weight"])
def test_a_loss_that_sanitizes_the_output_does_not_hide_the_models_nan_in_sentinel_mode(case: str) -> None:
    """The loss code runs nan_to_num over the model's output (a common "fix") and squares it: the
    -inf become -3.4e38, whose square overflows to inf in the loss code. Sentinel mode (which does
    not probe a training call's outputs) reported that loss-code inf as the first finding and
    never replayed the model, where the log(0) came first; full mode names the model's."""
    full = _run(case, "full", False, sanitize=True)
    sentinel = _run(case, "sentinel", False, sanitize=True)
    keys = ("phase", "module", "module_type", "tensor", "step", "cause", "index", "op")
    assert full and sentinel
    f, s = full[0], sentinel[0]
    assert (f.phase, f.module, f.module_type, f.tensor, f.cause) == EXPECTED[case], str(f)
    assert {k: getattr(s, k) for k in keys} == {k: getattr(f, k) for k in keys}, (str(f), str(s))
    assert [x.phase for x in sentinel if x.step == s.step].count("forward") == 1, [str(x) for x in sentinel]


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_an_optimizer_step_that_poisons_the_weights_comes_first_in_sentinel_mode(on_find: str) -> None:
    # a float16 Adam whose eps rounds to 0: the first step divides by sqrt(0) and writes -inf weights.
    # Sentinel mode reads parameters only on a hit (the next step's forward is poisoned); the
    # optimizer finding of the step before is still the first, as it happened first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8, foreach=False)
    xs = [torch.randn(8, 4).half() for _ in range(3)]
    hunt = nanhunt.watch(model, optimizer=opt, on_find=on_find, mode="sentinel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for x in xs:
                (model(x).float().pow(2).mean() * 1e-3).backward()
                opt.step()
                opt.zero_grad()
        except nanhunt.NonFiniteError as e:
            assert e.finding.phase == "optimizer" and "optimizer step" in str(e)
        finally:
            hunt.close()
    # the replays' reads (a float() of a value that requires grad) do not warn in the user's program
    assert not [w for w in caught if "nanhunt" in w.filename], [str(w.message) for w in caught]
    first = hunt.first
    assert first is not None
    assert (first.phase, first.step, first.module, first.tensor, first.cause) == ("optimizer", 0, "0", "weight", "created")
    assert first.op == "aten.addcdiv_.default"
    steps = [f.step for f in hunt.findings]
    assert steps == sorted(steps), [(f.step, f.phase) for f in hunt.findings]
    assert any(f.phase == "forward" and f.step == 1 and f.cause == "parameter" for f in hunt.findings)


@pytest.mark.parametrize("grad", [True, False])
def test_sentinel_with_no_optimizer_judges_the_models_outputs(grad: bool) -> None:
    # inference or evaluation: no gradients or optimizer state to judge, so the root's outputs
    # are, and the hit is localised by replay (it found nothing at all before). LogNet's ReLU
    # zeros make its Log emit -inf.
    model, _ = _log0()
    with nanhunt.watch(model, on_find="record", mode="sentinel") as hunt:
        with torch.set_grad_enabled(grad):
            model(torch.randn(2, 4))
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "log", 0, "created",
                                                                            "aten.log.default")


@pytest.mark.parametrize("bad_micro", [0, 2])
def test_sentinel_numbers_the_call_of_a_micro_batch_as_full_mode_does(bad_micro: int) -> None:
    # gradient accumulation: three micro-batches per step; the NaN is in micro-batch `bad_micro`
    def first_call(mode: str) -> int:
        model, _ = _poisoned_ln()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xs = [torch.randn(4, 8) for _ in range(3)]
        xs[bad_micro][1, 2] = float("nan")
        with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
            for x in xs:
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        f = next(f for f in hunt.findings if f.phase == "forward")
        assert (f.module, f.step) == ("0", 0)
        return f.call

    assert first_call("sentinel") == first_call("full") == bad_micro


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_the_model_computes_itself_is_judged_though_its_gradients_are_finite(mode: str) -> None:
    """Hugging Face's labels= pattern: GPT-2 computes its own loss. A batch whose labels are all
    -100 (a prompt that fills the window) makes it a mean over zero tokens, 0/0 = nan, with zero
    gradients: sentinel mode, which judges a training call by its gradients, found nothing."""
    model = zoo.gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, mode=mode):
            for i in range(3):
                ids = torch.randint(0, 100, (2, 16), generator=g)
                labels = ids.clone()
                labels[:, : (16 if i == 2 else 4)] = -100
                out = model(input_ids=ids, labels=labels)
                out.loss.backward()
                assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
                opt.step()
                opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("forward", "", "output['loss']", 2, "created"), f
    assert f.op == "aten.nll_loss_forward.default" and "zero" in f.hint, f


@pytest.mark.parametrize("case", ["log(0)", "poisoned LayerNorm weight"])
def test_a_forward_born_nan_costs_sentinel_no_backward_replay(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient arriving at the model's output is non-finite too (the forward's NaN carried
    on): sentinel's replayed forward finds where it was born, and the step's backward is not
    replayed as well (two more forwards and a backward: a CNN's hit cost 6.9 plain steps, 2.9
    without). Its first finding is full mode's, and as there, no backward finding follows it."""
    analyze_mod = importlib.import_module("nanhunt._locate.analyze")  # (the package exports the function)
    backward: list[bool] = []
    real = analyze_mod.replay_top

    def counted(*args: Any, **kwargs: Any) -> Any:
        backward.append(kwargs.get("backward") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(analyze_mod, "replay_top", counted)
    sentinel = _run(case, "sentinel", True)
    assert backward and not any(backward), backward
    full = _run(case, "full", True)
    s0, f0 = sentinel[0], full[0]
    assert (s0.step, s0.phase, s0.module, s0.cause) == (f0.step, f0.phase, f0.module, f0.cause) == (
        f0.step, "forward", EXPECTED[case][1], EXPECTED[case][4])
    for found in (sentinel, full):  # the backward only carried the forward's NaN on: no finding of its own
        assert not any(f.phase == "backward" and f.step == f0.step for f in found), [str(f) for f in found]


def _accumulate(mode: str, on_find: str, backward_between: bool | str) -> list[Any]:
    """Two micro-batches into one step of a siamese distance: micro-batch 0 has a row with equal
    halves (sqrt at 0: its backward makes nan gradients, its forward is finite); micro-batch 1
    holds a NaN from the data (a forward finding, fed in: `proj` is called twice a forward)."""
    model = zoo.distnet(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x0, x1 = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    x0[1, 2:] = x0[1, :2]
    x1[2, 0] = float("nan")
    found: list[Any] = []
    try:
        with nanhunt.watch(model, optimizer=opt, on_find=on_find, mode=mode) as hunt:
            if backward_between == "again":  # micro-batch 0's graph is kept and run once more later
                loss0 = model(x0).pow(2).mean()
                loss0.backward(retain_graph=True)
                model(x1).pow(2).mean().backward()
                loss0.backward()
            elif backward_between:  # the usual accumulation loop
                model(x0).pow(2).mean().backward()
                model(x1).pow(2).mean().backward()
            else:  # both forwards first, one backward
                (model(x0).pow(2).mean() + model(x1).pow(2).mean()).backward()
            opt.step()
        found = hunt.findings
    except nanhunt.NonFiniteError as e:
        found = [e.finding]
    return found


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_earlier_micro_batchs_backward_goes_before_a_later_micro_batchs_forward(mode: str) -> None:
    """Gradient accumulation: the first non-finite value of the step is micro-batch 0's backward
    (sqrt at 0), made before micro-batch 1's forward met a NaN from its data. The later forward's
    finding used to take the step, and the backward that came first was never named. When both
    forwards run before one backward, the forward's NaN came first and stays first."""
    raised = _accumulate(mode, "raise", backward_between=True)
    assert len(raised) == 1
    f = raised[0]
    assert (f.phase, f.module, f.tensor, f.cause, f.call) == ("backward", "dist", "grad_input[0]", "created", 0), str(f)
    recorded = _accumulate(mode, "record", backward_between=True)
    assert [(x.phase, x.module, x.call, x.cause) for x in recorded[:2]] == [
        ("backward", "dist", 0, "created"), ("forward", "proj", 2, "input")], [str(x) for x in recorded]
    again = _accumulate(mode, "record", backward_between="again")  # its first backward is what came first
    assert [(x.phase, x.module, x.call) for x in again[:2]] == [("backward", "dist", 0), ("forward", "proj", 2)], [
        str(x) for x in again]
    together = _accumulate(mode, "record", backward_between=False)
    assert (together[0].phase, together[0].module, together[0].call) == ("forward", "proj", 2), str(together[0])
    assert not any(x.phase == "backward" for x in together), [str(x) for x in together]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_a_second_order_backward_after_a_later_forward_does_not_go_before_it(mode: str, on_find: str) -> None:
    """MAML: the inner loss's gradient (``autograd.grad(create_graph=True)``, finite) reaches call
    0's output before call 1 (the fast weights) meets a NaN from its data; the outer backward later
    brings a NaN gradient to call 0's output through the second-order graph. That NaN arrived after
    call 1's forward: the forward goes first. It used to be named after call 0's first, finite
    gradient and go first as a backward "made by the loss", the forward second."""
    from torch.func import functional_call

    model = zoo.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
    x1 = x.clone()
    x1[2, 0] = float("nan")
    found: list[Any] = []
    try:
        with nanhunt.watch(model, optimizer=opt, on_find=on_find, mode=mode) as hunt:
            params = dict(model.named_parameters())
            inner = (functional_call(model, params, (x,)) - y).pow(2).mean()
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {k: v - 0.1 * gr for (k, v), gr in zip(params.items(), grads)}
            (functional_call(model, fast, (x1,)) - y).pow(2).mean().backward()
            opt.step()
        found = hunt.findings
    except nanhunt.NonFiniteError as e:
        found = [e.finding]
    f = found[0]
    assert (f.phase, f.module, f.call, f.cause) == ("forward", "0", 1, "input"), [str(x) for x in found]
    assert not any(x.phase == "backward" for x in found), [str(x) for x in found]


def test_sentinel_walks_the_optimizers_state_at_the_first_step_and_still_finds_it_poisoned_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A gradient of 1e22 is finite, its square is not: Adam's exp_avg_sq becomes inf, the update
    # m / (sqrt(inf) + eps) is 0, the weights stay finite and training silently stalls. Sentinel
    # mode reads parameters and state every 10th step; working out which tensors those are (a walk
    # over every parameter's state) is done once, at the first step, and the later probes still
    # see the state the optimizer holds then.
    from nanhunt._record import probe as probe_mod

    walks: list[int] = []
    real = probe_mod.optimizer_tensors
    step = [0]
    monkeypatch.setattr(probe_mod, "optimizer_tensors", lambda opt: walks.append(step[0]) or real(opt))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 4)
    with nanhunt.watch(model, optimizer=opt, mode="sentinel", on_find="record") as hunt:
        for step[0] in range(12):
            loss = model(x).pow(2).mean() * (1e22 if step[0] == 5 else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert walks == [0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.tensor) == ("optimizer", "2", "state['exp_avg_sq']"), str(f)
    assert f.step == 9 and f.op == "aten.addcmul_.default"  # (read at the 10th step: sentinel's promise)


def _adam_stall(steps: int, big_at: int, two: bool, on_find: str = "record") -> tuple[Any, nn.Module, list[Any]]:
    """A gradient of 1e30 at step ``big_at`` overflows Adam's exp_avg_sq of the first layer (its
    weights stay finite: training stalls). ``two``: one Adam per layer, stepped in turn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opts = ([torch.optim.Adam(model[0].parameters(), lr=1e-3), torch.optim.Adam(model[2].parameters(), lr=1e-3)]
            if two else [torch.optim.Adam(model.parameters(), lr=1e-3)])
    x = torch.randn(16, 4)
    hunt = nanhunt.watch(model, optimizer=opts, mode="sentinel", on_find=on_find)
    with hunt:
        for step in range(steps):
            model(x).pow(2).mean().backward()
            if step == big_at:
                model[0].weight.grad.mul_(1e30)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return hunt, model, opts


def test_sentinel_reads_the_state_of_each_of_several_optimizers() -> None:
    # the every-10th-step reading counted the optimizers' step() calls together: of two stepped in
    # turn only the second's state was ever read, and the first's overflow was never reported.
    # Once found, the state it carries is not found again at the next readings (record mode)
    hunt, model, opts = _adam_stall(25, 3, two=True)
    assert not torch.isfinite(opts[0].state[model[0].weight]["exp_avg_sq"]).all()
    opt = [f for f in hunt.findings if f.phase == "optimizer"]
    assert [(f.module, f.tensor, f.step, f.cause) for f in opt] == [("0", "state['exp_avg_sq']", 9, "created")], \
        [str(f) for f in opt]
    # the step it names is the reading's; the hint says where in between it was made
    assert "made at one of steps 0 to 9" in opt[0].hint and "optimizer_every=1" in opt[0].hint, opt[0].hint


def test_sentinel_reads_the_state_once_more_at_close() -> None:
    # a run that ends between two readings (here before the first) with its state overflowed was
    # reported clean (nanhunt run exited 0 on a stalled run); close() reads it once more
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        _adam_stall(8, 3, two=False, on_find="raise")
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step) == ("optimizer", "0", "state['exp_avg_sq']", 7), str(f)
    assert "made at one of steps 0 to 7" in f.hint, f.hint
    hunt, _, _ = _adam_stall(10, 3, two=False)  # read at the 10th step: nothing left to read at close
    assert [f.step for f in hunt.findings] == [9], [str(f) for f in hunt.findings]


def test_sentinel_claims_no_birth_for_a_gradient_of_a_step_it_never_saw_the_model_run() -> None:
    # a GAN watched as one container (ModuleDict) whose parts the loop calls directly: sentinel
    # sees the model only through its own calls, and there were none; it said the gradient was
    # "created" in the backward (full mode, which sees every call, names the generator fed a NaN)
    torch.manual_seed(0)
    root = nn.ModuleDict({"g": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), "d": nn.Sequential(nn.Linear(4, 1))})
    og = torch.optim.SGD(root["g"].parameters(), lr=0.1)
    od = torch.optim.SGD(root["d"].parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(root, [og, od], mode="sentinel"):
        for step in range(3):
            z = torch.randn(4, 4)
            if step == 1:
                z[0, 0] = float("nan")
            root["d"](root["g"](z)).mean().backward()
            od.step()
            og.step()
            od.zero_grad()
            og.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("grad", 1, "unknown"), str(f)
    assert "mode='full'" in f.hint and "nanhunt.watch(g, opt_g)" in f.hint, f.hint


# A weight made non-finite by an update between two readings of sentinel's optimizer check:
# A weight made non-finite by an update between two readings of sentinel's optimizer check (rows
# of an embedding the next batches never use: no forward shows it) is reported at the reading; its
# hint must say in which steps it was made (it named the reading's step as if exact) and keep the
# reason the settings give (Adam's eps=0) although the gradient is gone by then.

def _eps0_run(mode: str, steps: int = 3) -> nanhunt.Finding:
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), head=nn.Linear(4, 1)))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0)
    idx = torch.tensor([1, 2, 3])  # rows 0, 4..9 get a gradient of exactly 0: 0/0 in their update
    with nanhunt.watch(m, optimizer=opt, on_find="record", mode=mode) as hunt:
        for _ in range(steps):
            m["head"](m["emb"](idx)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.tensor, f.cause) == ("optimizer", "emb", "weight", "created"), f
    return f


def test_sentinel_names_the_window_a_weight_was_made_in() -> None:
    f = _eps0_run("sentinel")
    assert f.step == 2, f  # (the reading's, at close())
    assert "made at one of steps 0 to 2" in f.hint, f.hint


def test_sentinel_keeps_the_eps_zero_reason_when_the_gradient_is_gone() -> None:
    f = _eps0_run("sentinel")
    assert "eps is 0" in f.hint, f.hint


def test_sentinel_keeps_the_eps_zero_reason_when_the_next_gradient_is_nan() -> None:
    # nn.Embedding(padding_idx=0) with Adam(eps=0): the padding row's gradient is always 0, so step
    # 0 makes it 0/0 = nan; the next batch looks it up, and sentinel judges step 0's update at step
    # 1's end, where that row's gradient is NaN: the hint fell back to 'an update that overflowed'
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Softmax(0), nn.Linear(4, 1))  # (mixes the rows)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0)
    idx = torch.tensor([1, 2, 0])
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode="sentinel"):
        for _ in range(3):
            m(idx).sum().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("optimizer", "0", "weight", 0, "created"), f
    assert "eps is 0" in f.hint, f.hint


def test_full_mode_names_the_exact_step() -> None:
    f = _eps0_run("full")
    assert f.step == 0 and "one of steps" not in f.hint and "eps is 0" in f.hint, f.hint
