"""The public surface: arguments, on_find modes, close(), what is left behind, plain-data findings
and reports."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import pickle
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as _module_mod

import nanhunt

from . import zoo


def _zero_batch() -> torch.Tensor:
    return torch.zeros(2, 4)


def _log_model() -> nn.Module:
    """Linear -> Log with zero weights and bias: log(0) = -inf on every call."""
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.weight.zero_()
        m.lin.bias.zero_()
    return m


# ---------------------------------------------------------------------------- arguments
def test_public_names() -> None:
    for name in ("watch", "Hunt", "Finding", "Report", "NonFiniteError", "NonFiniteWarning", "SilentRankError"):
        assert name in nanhunt.__all__ and hasattr(nanhunt, name)
    assert issubclass(nanhunt.NonFiniteError, FloatingPointError)
    assert issubclass(nanhunt.NonFiniteWarning, Warning)
    assert issubclass(nanhunt.SilentRankError, RuntimeError)


@pytest.mark.parametrize("bad", [lambda x: x, "model", torch.zeros(3), None])
def test_model_must_be_a_module(bad: Any) -> None:
    with pytest.raises(TypeError) as ei:
        nanhunt.watch(bad)
    assert type(bad).__name__ in str(ei.value)


@pytest.mark.parametrize("bad", ["loud", "", None, 3, lambda: None, lambda finding, extra: None])
def test_bad_on_find(bad: Any) -> None:
    # a callable that cannot take the Finding is refused at watch(), not at the first finding
    with pytest.raises(ValueError, match="on_find"):
        nanhunt.watch(zoo.mlp(), on_find=bad)


@pytest.mark.parametrize("ok", [lambda f: None, lambda *a: None, lambda f, extra=1: None, print])
def test_on_find_callables_that_take_the_finding(ok: Any) -> None:
    nanhunt.watch(zoo.mlp(), on_find=ok).close()


@pytest.mark.parametrize("bad", ["adam", 3, [torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0), "sgd"]])
def test_bad_optimizer(bad: Any) -> None:
    with pytest.raises(TypeError, match="optimizer"):
        nanhunt.watch(zoo.mlp(), bad)


@pytest.mark.parametrize(("kw", "error", "named"), [
    ({"guard_saves": "false"}, TypeError, "guard_saves"),  # a truthy string must not switch the guard on
    ({"replay": "no"}, TypeError, "replay"),
    ({"grad_hooks": "False"}, TypeError, "grad_hooks"),
    ({"distributed": 1.0}, TypeError, "distributed"),
    ({"ignore": 5}, TypeError, "ignore"),
    ({"ignore": b"ab"}, TypeError, "ignore"),
    ({"ignore": ["enc.*", 3]}, TypeError, "ignore"),
    ({"history": 10**30}, ValueError, "history"),
    ({"history": -1}, ValueError, "history"),
    ({"dist_timeout": float("inf")}, ValueError, "dist_timeout"),
    ({"dist_timeout": 1e300}, ValueError, "dist_timeout"),
    ({"dist_timeout": float("nan")}, ValueError, "dist_timeout"),
    ({"dist_timeout": 0}, ValueError, "dist_timeout"),
    # (sentinel records no module calls: the option was silently ignored, an absorbed backward inf unfound)
    ({"grad_hooks": True, "mode": "sentinel"}, ValueError, "grad_hooks=True needs mode='full'"),
])
def test_a_bad_option_is_refused_at_watch_naming_it(kw: dict[str, Any], error: type, named: str) -> None:
    with pytest.raises(error, match=named):
        nanhunt.watch(zoo.mlp(), **kw)


def test_boolean_options_take_booleans() -> None:
    m = zoo.mlp()
    with nanhunt.watch(m, replay=False, grad_hooks=True, guard_saves=False, distributed=False) as hunt:
        m(torch.randn(2, 4))
    assert hunt.findings == []


def test_bad_report_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.json"):
        nanhunt.watch(zoo.mlp(), report=tmp_path / "report.pdf")


def test_bad_arguments_leave_nothing_behind() -> None:
    before = dict(_module_mod._global_forward_hooks)
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for kw in ({"on_find": "nope"}, {"report": "x.pdf"}):
        with pytest.raises(ValueError):
            nanhunt.watch(m, opt, **kw)
    assert dict(_module_mod._global_forward_hooks) == before
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


# ---------------------------------------------------------------------------- on_find
def test_on_find_raise_error_carries_finding_and_report() -> None:
    m = _log_model()
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m):
        m(_zero_batch())
    e = ei.value
    assert isinstance(e.finding, nanhunt.Finding) and isinstance(e.report, nanhunt.Report)
    assert e.report.first == e.finding
    msg = str(e)
    assert "\n" not in msg.strip() and "log" in msg and "step 0" in msg and "output" in msg
    assert msg == e.finding.summary()


def test_on_find_warn_keeps_recording() -> None:
    m = _log_model()
    with pytest.warns(nanhunt.NonFiniteWarning) as rec, nanhunt.watch(m, on_find="warn") as hunt:
        for _ in range(3):
            with torch.no_grad():
                m(_zero_batch())
    assert len(hunt.findings) >= 3 and [f.step for f in hunt.findings][:1] == [0]
    # each warning points at the user's line that ended the step, not inside nanhunt or torch
    assert rec and all(os.path.realpath(w.filename) == os.path.realpath(__file__) for w in rec), [w.filename for w in rec]
    assert {f.step for f in hunt.findings} == {0, 1, 2}
    assert any("log" in str(w.message) for w in rec)


def test_on_find_record_is_silent() -> None:
    m = _log_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanhunt.watch(m, on_find="record") as hunt:
            with torch.no_grad():
                m(_zero_batch())
                m(_zero_batch())
    assert [f.step for f in hunt.findings if f.module == "log"] == [0, 1]
    assert hunt.first is hunt.findings[0]


def test_on_find_callable_gets_each_finding() -> None:
    got: list[nanhunt.Finding] = []
    m = _log_model()
    with nanhunt.watch(m, on_find=got.append) as hunt:
        with torch.no_grad():
            m(_zero_batch())
    assert got and got == hunt.findings


def test_no_finding_no_error() -> None:
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.watch(m, opt) as hunt:
        for _ in range(3):
            m(torch.randn(4, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [] and hunt.first is None and hunt.report.findings == []


# ---------------------------------------------------------------------------- close and leftovers
def _all_global_hooks() -> dict[str, list[Any]]:
    names = [n for n in dir(_module_mod) if n.startswith("_global_") and isinstance(getattr(_module_mod, n), dict)]
    return {n: list(getattr(_module_mod, n).keys()) for n in names}


def _leftovers(m: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    out = []
    for name, mod in m.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(mod, attr):
                out.append(f"{name}.{attr}")
    for name, p in m.named_parameters():
        if p._backward_hooks:
            out.append(f"{name}._backward_hooks")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            out.append(f"{name}._post_accumulate_grad_hooks")
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        out.append("optimizer step hooks")
    return out


def test_close_is_idempotent_and_leaves_no_hook() -> None:
    before = _all_global_hooks()
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    hunt = nanhunt.watch(m, opt)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    hunt.close()
    hunt.close()
    assert _leftovers(m, opt) == []
    assert _all_global_hooks() == before, "global hook tables (incl. _global_forward_hooks_with_kwargs)"


def test_custom_functions_are_routed_to_the_recorder_only_while_outside_code_runs() -> None:
    # the outside-code recorder sees custom autograd Functions (below torch's Function.apply, on the
    # class its super().apply reaches) only between a root call's return and the step's end; inside
    # watched calls and after close() torch's own classes are as they were
    below = torch.autograd.function._SingleLevelFunction
    apply = torch.autograd.Function.__dict__["apply"]
    seen = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append("apply" not in below.__dict__)
            return x * 2

    m = nn.Sequential(nn.Linear(4, 4), Probe())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    hunt = nanhunt.watch(m, opt)
    loss = m(torch.randn(2, 4)).sum()
    assert "apply" in below.__dict__  # loss code runs now: routed
    loss.backward()
    opt.step()
    m(torch.randn(2, 4))
    hunt.close()  # closed while outside code ran
    assert seen == [True, True]
    assert "apply" not in below.__dict__ and torch.autograd.Function.__dict__["apply"] is apply


def test_torchs_with_kwargs_flag_is_not_left_behind() -> None:
    """torch's RemovableHandle for register_module_forward_hook(with_kwargs=True) does not clean
    _global_forward_hooks_with_kwargs; nanhunt must not leave its entry there."""
    before = set(_module_mod._global_forward_hooks_with_kwargs)
    m = _log_model()
    with nanhunt.watch(m, on_find="record"):
        m(_zero_batch())  # a hit: the replay registers hooks too
    assert set(_module_mod._global_forward_hooks_with_kwargs) == before


def _run_and_exit(how: str) -> tuple[weakref.ref, nanhunt.Hunt, torch.optim.Optimizer, Any]:
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.bias.fill_(3.0)  # positive pre-activations: no log(0) unless zeroed
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    ref = weakref.ref(m)
    hunt = nanhunt.watch(m, opt)
    caught: Any = None
    try:
        with hunt:
            for i in range(3):
                x = torch.rand(2, 4) * 0.1
                if how == "nonfinite" and i == 1:
                    with torch.no_grad():
                        m.lin.weight.zero_()
                        m.lin.bias.zero_()
                out = m(x)
                if how == "error" and i == 1:
                    raise RuntimeError("user bug")
                if how == "interrupt" and i == 1:
                    raise KeyboardInterrupt
                out.sum().backward()
                opt.step()
                opt.zero_grad()
    except (nanhunt.NonFiniteError, RuntimeError, KeyboardInterrupt) as e:
        caught = (type(e), getattr(e, "finding", None), getattr(e, "report", None))
    return ref, hunt, opt, caught


@pytest.mark.parametrize("how", ["normal", "nonfinite", "error", "interrupt"])
def test_every_exit_leaves_nothing_and_frees_the_model(how: str) -> None:
    before = _all_global_hooks()
    ref, hunt, opt, caught = _run_and_exit(how)
    expected = {"normal": None, "nonfinite": nanhunt.NonFiniteError, "error": RuntimeError,
                "interrupt": KeyboardInterrupt}[how]
    assert (caught[0] if caught else None) is expected
    assert hunt.closed
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert _all_global_hooks() == before
    hunt.close()  # still idempotent
    m_alive = ref()
    if m_alive is not None:
        assert _leftovers(m_alive, opt) == []
    del m_alive
    opt.param_groups.clear()
    opt.state.clear()
    gc.collect()
    assert ref() is None, "the hunt (or its error and report) keeps the model alive"
    del hunt, caught


def test_exception_in_a_module_mid_forward_then_normal_use() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad shape")

    m = nn.Sequential(nn.Linear(4, 4), Boom())
    with pytest.raises(ValueError), nanhunt.watch(m):
        m(torch.ones(1, 4))
    m2 = _log_model()
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m2):
        m2(_zero_batch())
    assert ei.value.finding.module == "log"


def test_another_exception_is_not_replaced_by_the_pending_finding() -> None:
    m = _log_model()
    with pytest.raises(KeyError), nanhunt.watch(m):
        m(_zero_batch())
        raise KeyError("user")


def test_no_optimizer_raise_at_the_latest_at_close() -> None:
    m = _log_model()
    hunt = nanhunt.watch(m)
    with torch.no_grad():
        out = m(_zero_batch())
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        hunt.close()
    assert out.shape == (2, 1)
    assert ei.value.finding.module == "log" and hunt.closed
    hunt.close()  # idempotent: no second error


# ---------------------------------------------------------------------------- plain data
def test_finding_is_plain_frozen_data() -> None:
    m = _log_model()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(_zero_batch())
    f = hunt.first
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.step = 3  # type: ignore[misc]
    d = dataclasses.asdict(f)
    for k in ("phase", "module", "module_type", "tensor", "step", "call", "index", "value", "counts", "shape",
              "dtype", "cause", "op", "source", "chain", "rank", "reproducible", "hint"):
        assert k in d

    def plain(v: Any) -> bool:
        if isinstance(v, (str, int, float, type(None))):
            return True
        if isinstance(v, (tuple, list)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        return False

    assert all(plain(v) for v in d.values()), d
    assert f.value == -math.inf
    text = json.dumps(f.to_dict(), allow_nan=False)
    assert json.loads(text)["module"] == "log"
    assert f.phase in ("forward", "backward", "grad", "optimizer", "check")
    assert f.cause in ("created", "input", "parameter", "unknown")


def test_report_to_dict_and_files(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.bias.fill_(3.0)
    with nanhunt.watch(m, on_find="record", report=path) as hunt:
        with torch.no_grad():
            m(torch.rand(2, 4) * 0.1)  # step 0: fine (weights zeroed after this call)
            m.lin.weight.zero_()
            m.lin.bias.zero_()
            m(_zero_batch())  # step 1
            m(_zero_batch())  # step 2 ends this step: the first finding is made
        assert path.exists(), "written when the first finding is made"
        early = json.loads(path.read_text())
        assert early["first"]["module"] == "log"
    final = json.loads(path.read_text())
    d = hunt.report.to_dict()
    assert {"schema", "first", "findings"} <= d.keys()
    assert d["first"] == d["findings"][0] and d["first"]["step"] == 1
    assert final["findings"] == json.loads(json.dumps(d["findings"]))
    assert len(final["findings"]) == len(hunt.findings) >= 2
    json.dumps(d, allow_nan=False)
    txt = tmp_path / "nan.txt"
    hunt.report.save(txt)
    assert "log" in txt.read_text() and str(hunt.report)


def test_report_txt_written_on_close(tmp_path: Path) -> None:
    path = tmp_path / "r.txt"
    m = zoo.mlp()
    with nanhunt.watch(m, report=path):
        m(torch.randn(2, 4))
    assert path.exists()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_watched_model_can_be_deep_copied_and_saved_whole(mode: str, tmp_path: Path) -> None:
    # an EMA or a teacher made with copy.deepcopy while the hunt is open, torch.save of the whole
    # module: the copy is not watched (its hooks, if any, do nothing) and the hunt is not copied
    import copy

    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with nanhunt.watch(m, opt, mode=mode) as hunt:
        m(x).sum().backward()
        opt.step()
        ema = copy.deepcopy(m)
        torch.save(m, tmp_path / "whole.pt")
        with torch.no_grad():
            saved_out = m(x)
        with torch.no_grad():
            ema[0].weight.fill_(float("nan"))  # a poisoned copy is no finding of this hunt
            ema(x)
        m(x).sum().backward()
        opt.step()
    assert hunt.findings == []
    back = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(back(x), saved_out) and _leftovers(m, opt) == []
    # the copy, once called, holds nothing of nanhunt: no hook (torch's fast path again), and a
    # pickle of it needs no nanhunt to load (sentinel's root hooks came along as no-op hooks before)
    for mod in ema.modules():
        assert not (mod._forward_hooks or mod._forward_pre_hooks or mod._forward_hooks_with_kwargs
                    or mod._forward_pre_hooks_with_kwargs or mod._forward_hooks_always_called), mod
    assert b"nanhunt" not in pickle.dumps(ema)


def _global_hooks() -> tuple[int, int, int]:
    return (len(_module_mod._global_forward_hooks), len(_module_mod._global_forward_pre_hooks),
            len(_module_mod._global_module_registration_hooks))


def test_a_watch_that_fails_to_start_leaves_nothing_and_frees_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the first hooks went on (here: registering the optimizer's post-hook) takes
    them off again: the global hooks stayed and kept the model alive."""
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _global_hooks()

    def refuse(*a: Any, **k: Any) -> Any:
        raise RuntimeError("refused")

    monkeypatch.setattr(torch.optim.Optimizer, "register_step_post_hook", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        nanhunt.watch(model, opt)
    monkeypatch.undo()
    assert _global_hooks() == before
    assert not opt._optimizer_step_pre_hooks and torch.save.__module__ == "torch.serialization"
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None


def test_an_optimizer_torch_never_set_up_is_refused_by_name() -> None:
    class NoInit(torch.optim.SGD):
        def __init__(self) -> None:  # forgets super().__init__
            pass

    before = _global_hooks()
    with pytest.raises(TypeError, match="NoInit was never set up by torch.optim.Optimizer.__init__"):
        nanhunt.watch(zoo.mlp(), NoInit())
    assert _global_hooks() == before


def test_an_optimizer_that_holds_none_of_the_models_parameters_is_named_in_a_warning() -> None:
    """watch(G, optimizer=opt_D), a GAN's discriminator's optimizer given for the generator, was
    accepted silently: its steps counted the steps while G's own optimizer went unwatched."""
    G, D = zoo.mlp(seed=0), zoo.mlp(seed=1)
    opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    with pytest.warns(UserWarning, match=r"the optimizer \(Adam, 4 parameters\) holds none of the parameters "
                                         r"of the watched model \(MLP\)") as got, nanhunt.watch(G, optimizer=opt_d):
        pass
    assert [os.path.basename(w.filename) for w in got] == ["test_watch_api.py"]  # the user's watch() line
    with pytest.warns(UserWarning, match=r"optimizer\[1\] \(Adam"):
        nanhunt.watch(G, optimizer=[opt_g, opt_d]).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanhunt.watch(G, optimizer=opt_g).close()  # the right one: no warning
        frozen = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)], zoo.mlp(seed=2))  # fine-tuning a head
        nanhunt.watch(frozen, optimizer=torch.optim.SGD(frozen[-1].parameters(), lr=0.1)).close()
        before = _global_hooks()
        with pytest.raises(UserWarning, match="holds none"):  # (as an error: nothing left behind)
            nanhunt.watch(G, optimizer=opt_d)
        assert _global_hooks() == before and not opt_d._optimizer_step_pre_hooks


def test_accelerates_wrapped_optimizer_is_watched_through_the_optimizer_it_steps() -> None:
    """accelerate's AcceleratedOptimizer never runs Optimizer.__init__: watch() failed with an
    AttributeError. Its inner optimizer is watched; with gradient accumulation the wrapper steps
    it every third micro-batch, which counts the step."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(gradient_accumulation_steps=3, cpu=True)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    assert "_optimizer_step_pre_hooks" not in vars(opt), "test set-up: the wrapper torch never set up"
    data = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    data[7][2, 1] = float("nan")  # micro-batch 1 of step 2
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt):
            for x in data:
                with acc.accumulate(model):
                    acc.backward(model(x).square().mean())
                    opt.step()
                    opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.step, f.call, f.cause) == ("forward", 2, 1, "input"), f
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_watched_accelerated_optimizer_copies_and_pickles_without_the_hunt() -> None:
    """While a hunt is open, the AcceleratedOptimizer's step() is wrapped on the instance (its writes
    after the inner step() are part of the step); accelerate pickles the wrapper's whole __dict__:
    a copy or a pickle must get a plain step() of its own, not the hunt's weak references."""
    import copy
    import io

    accelerate = pytest.importorskip("accelerate")
    # (a Trainer run earlier in the process leaves weak references in accelerate's shared
    # GradientState, which the optimizer holds: it cannot be pickled then, nanhunt or not)
    accelerate.state.GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True)
    model = zoo.mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    with nanhunt.watch(model, opt):
        twin = copy.deepcopy(opt)
        buf = io.BytesIO()
        torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for o in (twin, loaded):
        assert getattr(o.step, "__self__", None) is o, o.step
        model(torch.randn(2, 4)).sum().backward()
        o.step()  # (steps its own copy of the optimizer)
    assert "step" not in vars(opt)


@pytest.mark.parametrize("when", ["open", "mid-step", "closed"])
def test_copying_or_pickling_a_hunt_is_refused_at_once(when: str) -> None:
    """copy.deepcopy of a trainer that holds the hunt: between the forward and step() the loss-code
    recorder recorded deepcopy's own tensor copies into the log being copied, and it never ended;
    before a forward it failed with "cannot pickle '_thread.lock' object"."""
    import copy
    import pickle

    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hunt = nanhunt.watch(model, opt)
    try:
        if when == "mid-step":
            model(torch.randn(2, 4)).sum().backward()
        if when == "closed":
            hunt.close()
        for copier in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match="a nanhunt Hunt cannot be copied or pickled"):
                copier({"trainer": [hunt]} if copier is not copy.copy else hunt)
    finally:
        hunt.close()


def _hand_update(model: nn.Module, how: str) -> None:
    with torch.no_grad():
        if how == "p -= lr * p.grad":
            for p in model.parameters():
                p -= 0.01 * p.grad
        elif how == "p.data.add_":
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.01)
        elif how == "p.data = p.data - lr * p.grad":  # (no in-place op: the data descriptor's write)
            for p in model.parameters():
                p.data = p.data - 0.01 * p.grad
        elif how == "updates computed first":
            ps = list(model.parameters())
            updates = [0.01 * p.grad for p in ps]
            for p, u in zip(ps, updates):
                p.sub_(u)
        else:
            ps = list(model.parameters())
            torch._foreach_add_(ps, [p.grad for p in ps], alpha=-0.01)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["p -= lr * p.grad", "p.data.add_", "p.data = p.data - lr * p.grad", "_foreach_add_"])
def test_a_hand_written_update_without_an_optimizer_is_judged_before_it_writes(how: str, mode: str) -> None:
    """watch(model) and an SGD update by hand: the step used to be judged at the model's next call,
    after the update had written the NaN gradients into every weight; the replay then ran on
    those weights (sentinel blamed the first Linear's parameters for a log(0) two modules later,
    full mode could not tell the cause) and raise mode let the weights be written. Now the first
    in-place write into a parameter after a backward (or ``p.data = ...``) judges the step, before it runs."""
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.weight.zero_()
        m.lin.bias.zero_()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, mode=mode):
        m(_zero_batch()).sum().backward()
        _hand_update(m, how)
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.step) == ("forward", "log", "created", 0), str(f)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())), "the update wrote a NaN gradient"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["p -= lr * p.grad", "p.data.add_", "p.data = p.data - lr * p.grad", "_foreach_add_",
                                 "updates computed first"])
def test_skip_drops_a_hand_written_update_of_a_bad_batch(how: str, mode: str) -> None:
    """on_find="skip" with an SGD update by hand: the step is judged at its first write, after the
    loop computed that write's operand from the NaN gradients. Dropping the gradients then left
    that write (and every update computed before it) to go in: the weights went NaN, and the loop's
    next ``lr * p.grad`` failed on None. Now the update's writes into the parameters are dropped
    until the model's next call: the run ends bit-identical to one that never saw the batch."""
    def train(bad: int | None, watch: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        g = torch.Generator().manual_seed(1)
        with nanhunt.watch(m, on_find="skip", mode=mode) if watch else contextlib.nullcontext() as hunt:
            for step in range(4):
                x = torch.randn(4, 8, generator=g)
                if step == bad:
                    x[0, 0] = float("nan")
                elif bad is None and step == 1:
                    continue  # the reference: the same batches without the bad one
                m(x).pow(2).mean().backward()
                _hand_update(m, how)
                m.zero_grad()
        if watch:
            assert hunt.skipped == [1], hunt.skipped
        return m

    got, ref = train(1, True), train(None, False)
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), ref.parameters())), "the skipped update was applied"


@pytest.mark.parametrize("how", ["p -= lr * p.grad", "p.data = p.data - lr * p.grad"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_data_nan_before_a_hand_written_update_is_fed_in_not_the_weights(mode: str, how: str) -> None:
    """...and the update, and an EMA written after it, are no outside code of the next step: one
    host read a step (a second, for a log of the update's own writes, came with the early
    judgement at first) and no finding of the update's write of the NaN gradient."""
    from tests.test_syncs import counting_reads

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    ema = copy.deepcopy(m).requires_grad_(False)
    reads = []
    with nanhunt.watch(m, on_find="record", mode=mode) as hunt, counting_reads() as n:
        for step in range(5):
            before = n[0]
            x = torch.randn(4, 8)
            if step == 3:
                x[0, 0] = float("nan")
            m.zero_grad()
            m(x).pow(2).mean().backward()
            _hand_update(m, how)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), m.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)
            reads.append(n[0] - before)
    assert reads[:3] == [1, 1, 1], reads
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "0", 3, "input"), str(f)
    assert f.counts["nan"] == 8, str(f)  # one row, as the call saw it (not the replay on written weights)
    assert not any(g.module == "<outside>" for g in hunt.findings), [str(g) for g in hunt.findings]


def test_an_error_raised_after_the_run_went_on_does_not_call_itself_the_first() -> None:
    """A run that catches NonFiniteError and goes on: the next error said "First NaN: ... at step
    3" while the hunt's first finding was at step 1. Its finding is its own step's; its message
    heads it by its kind only."""
    import pickle

    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    errors = []
    with nanhunt.watch(m, opt) as hunt:
        for i in range(4):
            x = torch.randn(3, 4)
            if i in (1, 3):
                x[0, 0] = float("nan")
            try:
                m(x).sum().backward()
                opt.step()
            except nanhunt.NonFiniteError as e:
                errors.append(e)
            opt.zero_grad()
    assert [e.finding.step for e in errors] == [1, 3] and hunt.first is not None and hunt.first.step == 1
    assert str(errors[0]).startswith("First NaN: forward of `<model>` (Linear) at step 1"), str(errors[0])
    assert str(errors[1]).startswith("NaN: forward of `<model>` (Linear) at step 3"), str(errors[1])
    again = pickle.loads(pickle.dumps(errors[1]))
    assert str(again) == str(errors[1]) and again.first is False


def test_a_with_block_of_the_hunt_inside_another_leaves_it_watching_the_outer_one() -> None:
    # `with hunt:` inside `with hunt:` (a helper that wraps its own part of the loop): the inner
    # block's end closed the hunt, and the outer block's steps ran unwatched without a word
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt) as hunt:
        with hunt:
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert not hunt.closed
        bad = x.clone()
        bad[1, 2] = float("nan")
        m(bad).sum().backward()
        opt.step()
    assert hunt.closed
    assert (ei.value.finding.module, ei.value.finding.step, ei.value.finding.cause) == ("0", 1, "input")
