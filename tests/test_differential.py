"""Differential replay: every replayable finding gets a verdict a user can act on.

float16 overflow (precision, with the float32 value of the op that overflowed), 0/0 and log(0) in
float32 (numerics), a NaN only a compiled graph makes (compiler, at its op and line from the
graph), a call that fails only on its first run (transient), identical replays that disagree
(nondeterministic), and ``on_find="breakpoint"`` stopping inside a replay of the failing op.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt import Finding

from . import breakpoint_recorder, zoo

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_float16_overflow_in_linear_is_precision_with_the_float32_value(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).half()
    with torch.no_grad():
        model[2].weight.fill_(900.0)  # a head whose fp16 output passes 65504
    x = (torch.randn(3, 16) * 30).half()
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        y = model(x)
        if mode == "sentinel":
            hunt.check(y, "logits")  # sentinel probes only checked tensors, then localises by replay
    f = hunt.first
    assert f is not None
    assert (f.module, f.op, f.dtype, f.verdict) == ("2", "aten.addmm.default", "float16", "precision")
    ref = f.reference
    with torch.no_grad():  # the failing Linear's own computation on the inputs it got, in float32
        h = model[1](model[0](x))
        assert h.dtype == torch.float16 and bool(torch.isfinite(h).all())
        expected = F.linear(h.float(), model[2].weight.float(), model[2].bias.float())[f.index]
    assert ref["op"] == "aten.addmm.default"
    assert ref["dtype"] == "float32" and ref["limit"] == 65504.0
    assert ref["value"] == float(expected) and abs(ref["value"]) > 65504.0
    assert ref["failing"] == f.value
    assert model[0].weight.dtype == torch.float16  # the user's model is untouched


class Normalize(nn.Module):
    """Row-normalise by the row's sum: an all-zero row is 0/0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", ["0/0", "log(0)"])
def test_float32_nan_is_numerics(case):
    if case == "0/0":
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Normalize())
        with torch.no_grad():
            model[0].weight.abs_()
        x = torch.full((2, 4), -10.0)  # a dead ReLU: every row is zero
        op, module = "aten.div.Tensor", "2"
    else:
        model = zoo.lognet(0)
        x = torch.full((2, 4), -10.0)
        op, module = "aten.log.default", "log"
        with torch.no_grad():
            model.lin.bias.fill_(-1.0)
    with nanhunt.watch(model, on_find="record") as hunt:
        model(x)
    f = hunt.first
    assert f is not None and (f.module, f.op) == (module, op)
    assert f.verdict == "numerics"
    assert f.reference["dtype"] == "float32" and f.reference["op"] == op
    # the value is the reported element's, and says so: not a value the op made (log gives -inf, and
    # the reported element is what later ops made of it)
    assert f.reference["tensor"] == f.tensor
    assert str(f.reference["value"]) == str(f.value)
    assert f"float32 eager gives {f.value} in {f.tensor} too" in str(nanhunt.NonFiniteError(f))
    d = f.to_dict()
    json.dumps(d, allow_nan=False)  # the reference's nan/inf are written as strings
    assert Finding.from_dict(d).to_dict() == d and Finding.from_dict(d).verdict == "numerics"


@pytest.mark.parametrize("cause", ["input", "parameter"])
def test_a_nan_fed_in_or_from_poisoned_weights_gets_no_verdict_on_the_math(cause):
    # a blank image normalised by its own std (0/0) before the model: the model's math is fine;
    # a replay reproduces the NaN only because it is fed the same NaN
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(3, 1, 8, 8)
    if cause == "input":
        x[1] = (x[1] * 0 - x[1].mean() * 0) / (x[1] * 0).std()
    else:
        with torch.no_grad():
            model[0].weight[2, 0, 1, 1] = float("nan")
    with nanhunt.watch(model, on_find="record") as hunt:
        model(x)
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.cause) == ("forward", "0", cause), f
    assert f.verdict is None and f.reference == {}, f
    assert "numerics" not in str(nanhunt.NonFiniteError(f)) and "domain" not in f.hint, f.hint


class Flaky(nn.Module):
    """A layer that writes an inf on its first run only: what a bit flip on a device looks like."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.runs += 1
        if self.runs == 1:
            y = y.clone()
            y[0, 1] = float("inf")
        return y


def test_failure_on_the_first_run_only_is_transient_and_names_the_host():
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), nn.Linear(4, 2))
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(3, 4))
    f = hunt.first
    assert f is not None and f.reproducible is False
    assert f.verdict == "transient"
    assert f.reference["device"] == "cpu" and f.reference["host"] == socket.gethostname()
    assert f.reference["replays"] >= 2


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_a_compiled_failure_no_replay_reproduces_is_transient_at_the_module_its_graph_flagged(how):
    # no replay reproduces it, so there is no op trace: the finding stayed at the root's output,
    # though the failing run's own in-graph checks named the flaky layer
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Flaky(), nn.Linear(4, 2))
    run = zoo.compiled(model, how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(model, on_find="record") as hunt:
            run(torch.randn(3, 4))
    torch._dynamo.reset()
    f = hunt.first
    assert f is not None and (f.verdict, f.reproducible) == ("transient", False), f
    assert (f.module, f.module_type, f.tensor) == ("1", "Flaky", "output"), f
    # the checks flag Flaky's output and keep none of it: not the element (0, 0) of the root's (3, 2)
    # output told as Flaky's (its inf is at (0, 1))
    assert (f.index, f.value, f.counts, f.shape, f.dtype) == (None, None, {}, (), ""), f
    assert "has shape" not in f.summary()


class EveryOther(nn.Module):
    """inf on every other run: identical replays disagree. The count lives outside the model (a
    flaky device's state, not the module's: a replay puts the module's own attributes back)."""

    runs = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs[0] += 1
        return x / 0 if self.runs[0] % 2 else x


def test_replays_that_disagree_are_nondeterministic():
    EveryOther.runs[0] = 0
    model = nn.Sequential(nn.Linear(4, 4), EveryOther())
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.ones(2, 4))
    f = hunt.first
    assert f is not None and f.verdict == "nondeterministic"
    assert 0 < f.reference["reproduced"] < f.reference["replays"]


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
@pytest.mark.parametrize("run", ["python", "interpreter"])
def test_nan_only_the_compiled_graph_makes_is_compiler_at_its_op_and_line(run, how):
    torch._dynamo.reset()
    model, x = zoo.sharp_scores(0)
    assert bool(torch.isfinite(model(x)).all())  # eager: finite
    compiled = zoo.compiled(model, how, zoo.naive_softmax_backend(run))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, on_find="record") as hunt:
                compiled(x)
    finally:
        torch._dynamo.reset()
    f = hunt.first
    assert f is not None
    assert f.verdict == "compiler"
    assert (f.module, f.module_type, f.op) == ("attn", "SharpAttention", "aten.exp.default")
    assert f.source is not None and f.source.endswith(f"zoo.py:{zoo.SHARP_SOFTMAX_LINE}")
    assert f.chain[0].startswith("aten.exp.default") and any(c.startswith("aten.div") for c in f.chain)
    assert not any(c.startswith("aten.addmm") for c in f.chain)  # ends at attn's output, not in the head after it
    assert f.reference["config"] == "eager"
    assert f.reproducible is True
    # nothing of the replays is left behind: hooks, modes, the deterministic flag, the stance
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
    assert not _get_current_dispatch_mode_stack()
    assert not torch.are_deterministic_algorithms_enabled()
    assert bool(torch.isnan(compiled(x)).any())  # the stance is back: the user's call still runs compiled


def test_nan_only_the_compiled_graph_makes_without_its_op_names_its_module_and_none_of_the_roots_element(monkeypatch):
    # no graph node found (an opaque backend's kernels; a bisection past its budget): the finding moves
    # to the module the in-graph checks flagged, whose output they never keep; the element, counts,
    # shape, dtype and reference values were the root's output's, (4, 2), for attn's (4, 8)
    from nanhunt._locate import differential

    monkeypatch.setattr(differential, "locate_graph", lambda *a, **k: None)
    torch._dynamo.reset()
    model, x = zoo.sharp_scores(0)
    compiled = torch.compile(model, backend=zoo.naive_softmax_backend())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, on_find="record") as hunt:
                y = compiled(x)  # (kept: the root's output, whose element the finding had)
    finally:
        torch._dynamo.reset()
    assert y.shape == (4, 2)
    f = hunt.first
    assert f is not None and (f.verdict, f.module, f.module_type, f.tensor, f.op) == (
        "compiler", "attn", "SharpAttention", "output", None), f
    assert (f.index, f.value, f.counts, f.shape, f.dtype) == (None, None, {}, (), ""), f
    assert f.reference == {"config": "eager", "dtype": "float32"}, f.reference
    assert "eager is finite" in f.summary() and "has shape" not in f.summary()


# ---------------------------------------------------------------- Inductor (the default backend)
def _analysed(compiled, model, x):
    """A watched compiled call analysed (``sync``) inside the watch, after two finite steps (the
    watch's own traces settle at the second); then the user's compiled callable runs its own
    compiled code on: the analysis's re-compile lives on a code object of its own."""
    from torch._dynamo.utils import counters

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(model, on_find="record") as hunt:
            for _ in range(2):
                assert bool(torch.isfinite(compiled(x * 1e-3)).all())
                hunt.sync()
            compiled(x)
            hunt.sync()
            graphs = counters["stats"]["unique_graphs"]
            assert not bool(torch.isfinite(compiled(x)).all())
            assert counters["stats"]["unique_graphs"] == graphs  # no retrace
    return hunt.first


def _nan_at(f: Finding, bad: torch.Tensor) -> None:
    """The finding's element is the first of ``bad`` (an independent computation's NaNs)."""
    assert f.index == tuple(int(i) for i in bad.nonzero()[0])
    assert f.value is not None and f.value != f.value  # NaN
    assert f.counts == {"nan": int(bad.sum()), "+inf": 0, "-inf": 0}


def _left_behind(compiled, x) -> None:
    """Nothing of the analysis is left (hooks, modes, Inductor settings); the user's callable
    still runs compiled."""
    from torch._inductor import config as inductor_config
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
    assert not _get_current_dispatch_mode_stack()
    assert inductor_config.cpp.inject_relu_bug_TESTING_ONLY is None
    assert not bool(torch.isfinite(compiled(x)).all())  # eager is finite: compiled code ran


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_nan_only_inductor_makes_is_compiler_at_its_op_and_line(how):
    """A wrong softmax decomposition handed to Inductor itself: the fused C++ kernel dispatches
    nothing, the captured aten graph names the op, its module and line. ``model.compile()`` too:
    its top-level call is seen around the compiled call (and the model's own is put back)."""
    torch._dynamo.reset()
    model, x = zoo.sharp_scores(0)
    assert bool(torch.isfinite(model(x)).all())
    compiled = zoo.compiled(model, how, zoo.naive_softmax_inductor())
    own = model.__dict__.get("_compiled_call_impl")  # model.compile()'s own compiled call, else None
    try:
        f = _analysed(compiled, model, x)
        assert f is not None and f.verdict == "compiler"
        assert (f.module, f.module_type, f.op) == ("attn", "SharpAttention", "aten.exp.default")
        assert f.source is not None and f.source.endswith(f"zoo.py:{zoo.SHARP_SOFTMAX_LINE}")
        assert f.chain[0].startswith("aten.exp.default") and any(c.startswith("aten.div") for c in f.chain)
        assert f.reference["config"] == "eager" and f.reference["op"] == "aten.exp.default"
        assert f.reproducible is True
        # the element: where the wrong softmax's output (the module's last op on the chain) is NaN
        with torch.no_grad():
            e = (model.attn.q(x) * 30.0).exp()
            naive = e / e.sum(-1, keepdim=True)
        _nan_at(f, torch.isnan(naive))
        _left_behind(compiled, x)
        assert model.__dict__.get("_compiled_call_impl") is own
    finally:
        torch._dynamo.reset()


def test_nan_only_inductor_codegen_makes_is_bisected_to_its_op():
    """Inductor's testing-only relu bug (the generated C++ computes ``h + 1``): the aten graph run
    node by node is finite, the compiled prefixes are bisected to the first op whose compiled
    value is non-finite where the graph's is finite."""
    torch._dynamo.reset()
    model, x = zoo.relu_log(0)
    assert bool(torch.isfinite(model(x)).all())
    compiled = torch.compile(model, options={"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"})
    try:
        f = _analysed(compiled, model, x)
        assert f is not None and f.verdict == "compiler"
        assert (f.module, f.module_type, f.op) == ("", "ReluLog", "aten.log.default")
        assert f.source is not None and f.source.endswith(f"zoo.py:{zoo.RELU_LOG_LINE}")
        assert f.reference["node"] == "log"
        with torch.no_grad():
            bad = model.lin(x) + 1.0 + 1e-3 < 0  # log of the bugged relu's h + 1, plus 1e-3
        _nan_at(f, bad)
        _left_behind(compiled, x)
    finally:
        torch._dynamo.reset()


class _Broken(nn.Module):
    """A graph break before SharpScores: its graph is the second, reached through a stack slot."""

    def __init__(self) -> None:
        super().__init__()
        self.body = zoo.SharpScores()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.0
        torch._dynamo.graph_break()
        return self.body(x)


def test_nan_only_inductor_makes_after_a_graph_break_in_training_names_its_module():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Broken(), torch.randn(4, 8) * 3
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    compiled = torch.compile(model, backend=zoo.naive_softmax_inductor())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
                compiled(x).sum().backward()
                opt.step()
        f = hunt.first
        assert f is not None and (f.phase, f.verdict) == ("forward", "compiler")
        assert (f.module, f.module_type, f.op) == ("body.attn", "SharpAttention", "aten.exp.default")
        assert f.source is not None and f.source.endswith(f"zoo.py:{zoo.SHARP_SOFTMAX_LINE}")
    finally:
        torch._dynamo.reset()


class KeptMean(nn.Module):
    """The mean of the features dropout keeps: a row with none kept is 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        keep = F.dropout(torch.ones_like(h), 0.5, training=self.training)
        return (h * keep).sum(-1) / keep.sum(-1)


KEPT_MEAN_LINE = inspect.getsourcelines(KeptMean.forward)[1] + 3  # the 0/0 (the mask is drawn a line above)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_from_a_dropout_mask_only_inductor_drew_is_the_math_at_its_op_and_row(mode):
    """Inductor draws dropout's mask with its own generator (fallback_random off): the eager replay
    draws another mask, finite, which made it "compiler" (at another row). The captured graph runs
    node by node on the mask the compiled code drew: the 0/0 at its op, line and row, numerics.
    Sentinel, the loss taking nan_to_num of it: the backward's 0/0 (g / keep.sum), from the mask
    the compiled forward saved."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = KeptMean()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
                for _ in range(40):
                    y = compiled(torch.randn(8, 4))
                    (y if mode == "full" else torch.nan_to_num(y)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if hunt.first is not None:
                        break
        f = hunt.first
        phase = "forward" if mode == "full" else "backward"
        assert f is not None and (f.phase, f.module, f.op, f.verdict) == (phase, "", "aten.div.Tensor", "numerics"), f
        if mode == "full":
            assert f.source == f"{__file__}:{KEPT_MEAN_LINE}", f.source
        assert f.reference["random"] == f"{__file__}:{KEPT_MEAN_LINE - 1}", f.reference
        _nan_at(f, torch.isnan(y.detach()))  # the row the compiled run made 0/0
        _left_behind_modes()
    finally:
        torch._dynamo.reset()


def test_a_nan_from_random_numbers_only_inductor_draws_gets_no_verdict_where_they_cannot_be_had(monkeypatch):
    """The compiled draws cannot be had again: no "compiler" for an eager replay that drew another
    mask, no op of a graph run on a mask of its own; the hint says how to have them (fallback_random)."""
    from nanhunt._locate import inductor

    def fails(*a):
        raise RuntimeError("no prefix compile")

    monkeypatch.setattr(inductor, "_draws", fails)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = KeptMean()
    compiled = torch.compile(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, on_find="record") as hunt:
                for _ in range(40):
                    compiled(torch.randn(8, 4))
                    if hunt.first is not None:
                        break
        f = hunt.first
        assert f is not None and (f.phase, f.module, f.op, f.verdict) == ("forward", "", None, None), f
        assert f.reference == {"config": "eager", "random": f"{__file__}:{KEPT_MEAN_LINE - 1}"}, f.reference
        assert "torch._inductor.config.fallback_random = True" in f.hint and f.reference["random"] in f.hint, f.hint
    finally:
        torch._dynamo.reset()


def _left_behind_modes() -> None:
    from torch.nn.modules import module as module_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
    assert not _get_current_dispatch_mode_stack()


def test_inductor_finite_model_no_finding_no_graph_break():
    """The default ``torch.compile(model)``, finite: the watch adds no graph break and no finding."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, x = zoo.relu_log(0)
    compiled = torch.compile(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, on_find="record") as hunt:
                for _ in range(2):
                    assert bool(torch.isfinite(compiled(x)).all())
        assert hunt.findings == []
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def test_inductor_settings_are_the_users():
    from nanhunt._locate.inductor import inductor_settings

    model = nn.Linear(2, 2)
    assert inductor_settings(torch.compile(model, backend="aot_eager")) is None
    assert inductor_settings(torch.compile(model)) == {"config_patches": {}}
    got = inductor_settings(torch.compile(model, options={"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}))
    assert got == {"config_patches": {"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}}
    got = inductor_settings(torch.compile(model, backend=zoo.naive_softmax_inductor()))
    assert got is not None and got["decompositions"][torch.ops.aten._softmax.default] is zoo.naive_softmax
    assert inductor_settings(model) is None


@pytest.mark.parametrize("how,backend", [("torch.compile", "aot"), ("model.compile", "aot"),
                                         ("torch.compile", "inductor")])
def test_nan_only_the_compiled_backward_makes_is_compiler_at_its_node_and_line(how, backend):
    """A wrong tanh_backward decomposition in the backward graph: eager's gradient is finite, the
    compiled one NaN where tanh saturated. The finding is the backward node's op, the forward op's
    module and line, with verdict compiler; the element is an independent computation's NaN."""
    torch._dynamo.reset()
    model, x = zoo.sat_tanh(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():  # where tanh saturates as the compiled forward computes it (Inductor's tanh differs in the last bit)
        y = torch.tanh(model.lin(x)) if backend == "aot" else torch.compile(lambda v: torch.tanh(model.lin(v)))(x)
    torch._dynamo.reset()
    saturated = (1 - y * y) == 0
    assert bool(saturated.any())
    compiler = zoo.wrong_tanh_backward_backend() if backend == "aot" else zoo.wrong_tanh_backward_inductor()
    compiled = zoo.compiled(model, how, compiler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
                compiled(x).pow(2).mean().backward()
                opt.step()
    finally:
        torch._dynamo.reset()
    f = hunt.first
    assert f is not None and f.phase == "backward" and f.verdict == "compiler"
    assert (f.module, f.module_type, f.op) == ("", "SatTanh", "aten.div.Tensor")
    assert f.source is not None and f.source.endswith(f"zoo.py:{zoo.SAT_TANH_LINE}")
    assert f.reference["config"] == "eager" and f.reference["op"] == "aten.div.Tensor"
    _nan_at(f, saturated)


# ---------------------------------------------------------------- breakpoint
def test_breakpoint_stops_inside_a_replay_of_the_failing_op(monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "tests.breakpoint_recorder.record")
    breakpoint_recorder.CALLS.clear()
    model = zoo.lognet(0)
    with torch.no_grad():
        model.lin.bias.fill_(-1.0)
    x = torch.full((2, 4), -10.0)
    with pytest.raises(nanhunt.NonFiniteError) as err:
        with nanhunt.watch(model, on_find="breakpoint"):
            model(x)
    assert len(breakpoint_recorder.CALLS) == 1
    got = breakpoint_recorder.CALLS[0]
    assert {"finding", "op", "args", "out"} <= set(got)
    assert got["finding"] == err.value.finding
    assert got["op"] is torch.ops.aten.log.default
    assert bool(torch.isfinite(got["args"][0]).all()) and not bool(torch.isfinite(got["out"]).all())
    assert torch.equal(got["op"](*got["args"]), got["out"])


def test_breakpoint_off_with_pythonbreakpoint_0(monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    model = zoo.lognet(0)
    with torch.no_grad():
        model.lin.bias.fill_(-1.0)
    with pytest.raises(nanhunt.NonFiniteError):
        with nanhunt.watch(model, on_find="breakpoint"):
            model(torch.full((2, 4), -10.0))


def test_nanhunt_run_pdb_stops_at_the_failing_op_then_exits_3(tmp_path, monkeypatch, capsys):
    from nanhunt._cli.main import main

    from .test_cli import LOG_OF_ZERO

    (tmp_path / "helper.py").write_text("GATE_STEP = 2\n")
    script = tmp_path / "train.py"
    script.write_text(LOG_OF_ZERO)
    monkeypatch.setenv("PYTHONBREAKPOINT", "tests.breakpoint_recorder.record")
    monkeypatch.delitem(__import__("sys").modules, "helper", raising=False)
    breakpoint_recorder.CALLS.clear()
    rc = main(["run", "--pdb", str(script)])
    _, err = capsys.readouterr()
    assert rc == 3, err
    assert len(breakpoint_recorder.CALLS) == 1
    got = breakpoint_recorder.CALLS[0]
    assert got["op"] is torch.ops.aten.log.default and got["finding"].module == "head"
    assert not bool(torch.isfinite(got["out"]).all())
    assert "verdict" in err and "numerics" in err, err


def test_backward_sqrt_at_zero_is_numerics():
    model = zoo.distnet(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.tensor([[1.0, 2.0, 1.0, 2.0], [0.5, -1.0, 3.0, 0.0]])  # row 0: equal halves, distance 0
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        model(x).sum().backward()
        opt.step()
    f = hunt.first
    assert f is not None and f.phase == "backward" and f.module == "dist"
    assert f.verdict == "numerics" and f.reference["dtype"] == "float32"


def test_float16_overflow_in_backward_is_precision():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).half()
    with torch.no_grad():
        model[1].weight.fill_(1000.0)  # the gradient through it is 1000x the one arriving
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8).half()
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        (model(x).float() * 100.0).sum().backward()  # 100 * 8 * 1000 = 8e5 > 65504
        opt.step()
    f = hunt.first
    assert f is not None and f.phase == "backward", f
    assert f.verdict == "precision", f
    assert abs(f.reference["value"]) > 65504.0 and f.reference["limit"] == 65504.0


@pytest.mark.parametrize("what", ["activation", "weight"])
def test_autocast_float16_overflow_names_the_op_or_the_cast(what):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(3, 16)
    with torch.no_grad():
        if what == "activation":
            model[2].weight.mul_(150000.0)  # each weight fits float16; their products' sums do not
        else:
            model[2].weight.mul_(300000.0)  # some weights pass 65504: autocast's float16 copy is inf
    with nanhunt.watch(model, on_find="record") as hunt:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
    f = hunt.first
    assert f is not None and f.module == "2" and f.dtype == "float16"
    assert f.verdict == "precision"
    ref = f.reference
    assert ref["limit"] == 65504.0 and ref["failing_dtype"] == "float16" and abs(ref["value"]) > 65504.0
    if what == "activation":
        assert ref["op"] == f.op == "aten.addmm.default"
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.float16):
                h = model[1](model[0](x))  # the input the failing Linear got
            expected = F.linear(h.float(), model[2].weight, model[2].bias)[f.index]
        assert ref["value"] == float(expected)
    else:
        assert ref["op"] == "aten._to_copy.default"
        assert ref["value"] in model[2].weight


# ---------------------------------------------------------------- every report format
def test_verdict_reference_and_remedy_in_every_format(tmp_path):
    import io
    import re

    from nanhunt import Report
    from nanhunt._report.render import html, text

    f = Finding(
        phase="forward", module="mlp.fc", module_type="Linear", tensor="output", step=7, call=0, index=(1, 3),
        value=float("inf"), counts={"nan": 0, "+inf": 2, "-inf": 0}, shape=(4, 8), dtype="float16",
        cause="created", op="aten.mm.default", source="model.py:12", reproducible=True,
        verdict="precision",
        reference={"dtype": "float32", "op": "aten.mm.default", "value": 90112.0, "limit": 65504.0,
                   "failing_dtype": "float16", "failing": float("inf")},
    )
    report = Report([f], history={}, warnings=[], meta={"steps": 8})
    want = ("precision", "aten.mm.default = 90112", "largest value 65504", "(failing run: inf)", "bfloat16")
    page = html(report)
    buf = io.StringIO()
    rich = pytest.importorskip("rich.console")
    rich.Console(file=buf, width=200, force_terminal=False).print(report)
    outs = {"text": text(report), "html": page, "rich": re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()),
            "summary": f.summary()}
    for name, out in outs.items():
        for w in want[:4]:
            assert w in out, (name, w)
    for name in ("text", "html", "rich"):
        assert "remedy" in outs[name] and want[4] in outs[name], name  # float16: bfloat16 has float32's range
    path = tmp_path / "r.json"
    report.save(path)
    d = json.loads(path.read_text())["first"]
    assert d["verdict"] == "precision" and d["reference"]["value"] == 90112.0 and d["reference"]["failing"] == "inf"
    assert "bfloat16" in d["remedy"]
    back = Report.load(path).first
    assert back is not None and back.verdict == "precision" and back.reference == f.reference


def test_breakpoint_for_a_backward_finding_stops_in_the_backward_op(monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "tests.breakpoint_recorder.record")
    breakpoint_recorder.CALLS.clear()
    model = zoo.distnet(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.tensor([[1.0, 2.0, 1.0, 2.0], [0.5, -1.0, 3.0, 0.0]])
    with pytest.raises(nanhunt.NonFiniteError) as err:
        with nanhunt.watch(model, optimizer=opt, on_find="breakpoint"):
            model(x).sum().backward()
            opt.step()
    assert err.value.finding.phase == "backward" and err.value.finding.op == "SqrtBackward0"
    (got,) = breakpoint_recorder.CALLS
    assert got["finding"] == err.value.finding and got["op"] is not None
    assert not bool(torch.isfinite(got["out"]).all())
    assert all(bool(torch.isfinite(a).all()) for a in got["args"] if isinstance(a, torch.Tensor) and a.dim())


@pytest.mark.parametrize("how", ["half", "autocast"])
def test_float16_overflow_of_a_weight_gradient_is_precision(how):
    # a weight's gradient sums over the batch (x^T @ grad_out): it passes float16's range while every
    # activation and every gradient between modules stays finite; no module input to replay at, the
    # autograd node that made it is replayed in float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    if how == "half":
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.rand(4096, 16) * 30 + 200
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        with torch.autocast("cpu", dtype=torch.float16, enabled=how == "autocast"):
            out = model(x.half() if how == "half" else x)
        (out.float().sum() * 0.2).backward()
        opt.step()
    f = hunt.first
    assert f is not None and f.phase == "backward" and f.module == "2", f
    assert f.op == "AddmmBackward0" and f.dtype == "float16" and f.value == math.inf, f
    assert f.verdict == "precision", f
    ref = f.reference
    assert ref["dtype"] == "float32" and ref["op"] == "AddmmBackward0" and ref["limit"] == 65504.0, ref
    assert 65504.0 < ref["value"] < 1e7 and ref["failing_dtype"] == "float16", ref


class _HandBCE(nn.Module):
    """A hand-written BCE under bfloat16 autocast: sigmoid rounds to exactly 1.0, log(1 - p) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, feats: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.fc(feats)).squeeze(-1)
        return (-(target * torch.log(p) + (1 - target) * torch.log(1 - p))).mean()


class _Det(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.obj = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), _HandBCE()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.obj(self.backbone(x), target)


def test_a_precision_reference_without_an_overflow_names_the_subtraction_not_the_log():
    # no op passes bfloat16's range (its rounding does the harm): the float32 number was printed as
    # the value of aten.log ("float32 at aten.log.default = 3.06"); the harm is 1 - p, which bfloat16
    # rounds to 0 (p rounds to 1.0): the reference names that subtraction and its float32 value
    torch.manual_seed(0)
    model = _Det()
    with torch.no_grad():
        model.obj.fc.weight.mul_(30.0)  # a confident head: |logits| up to ~10
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for _ in range(3):
            x, target = torch.randn(32, 8), (torch.rand(32) > 0.5).float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and f.module == "obj" and f.verdict == "precision" and f.op == "aten.log.default", f
    ref = f.reference
    assert ref["op"] == "aten.rsub.Scalar" and ref["failing_dtype"] == "bfloat16" and 0 < ref["value"] < 1, ref
    text = str(nanhunt.NonFiniteError(f))
    assert f"float32 at aten.rsub.Scalar = {ref['value']:.7g}" in text and "at aten.log.default =" not in text, text


def test_a_cast_overflow_references_the_value_its_hint_names() -> None:
    # autocast's float16 copy of an input that passes 65504: the hint named the value on the path to
    # the finding's element, the reference the largest of the cast's input (another row's), whose
    # shape is not the finding's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    x[0, 3], x[1, 0] = 81018.8, 98009.7  # both past float16's largest; row 0 holds the first bad element
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().pow(2).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.verdict, f.index[0]) == ("0", "aten._to_copy.default", "precision", 0), f
    assert f.reference["value"] == pytest.approx(81018.8, rel=1e-6), f.reference
    assert f"{f.reference['value']:.6g}" in f.hint, f.hint


class _MuLawVocoder(nn.Module):
    """A vocoder's tanh output, mu-law decoded: sign(y) * ((1 + mu) ** |y| - 1) / mu."""

    def __init__(self, mu: float) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 8, 16, stride=16)
        self.out = nn.Conv1d(8, 1, 7, padding=3)
        self.mu = mu

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.out(F.leaky_relu(self.up(F.leaky_relu(self.c1(mel))))))
        return torch.sign(y) * ((1 + self.mu) ** y.abs() - 1) / self.mu


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_python_number_past_the_dtypes_range_is_named_with_its_op(mode: str, dtype: str) -> None:
    """A mu-law decode's (1 + mu) ** |y|: 1 + mu = 65536 is inf in float16 (mu = 2 ** 16 - 1 under
    autocast), 2 ** 256 inf in float32, before pow runs. The hint was pow's generic line, and under
    float16 the reference named an unrelated underflow of a conv (no traced float32 value passes
    65504: pow's are small), with the remedy to run that conv in float32."""
    torch.manual_seed(0)
    mu = 65535.0 if dtype == "float16" else 2.0 ** 256 - 1
    m = _MuLawVocoder(mu)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == "float16"):
            wav = m(torch.randn(2, 8, 16))
        F.l1_loss(wav.float(), torch.randn(2, 1, 256) * 0.1).backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.cause, f.dtype) == ("", "aten.pow.Scalar", "created", dtype), f
    assert f"the Python number it was given, {1 + mu:.6g}, is inf there" in f.hint and "mu-law" in f.hint, f.hint
    if dtype == "float16":
        assert f.verdict == "precision" and f.reference["op"] == "aten.pow.Scalar", f.reference
        assert f.reference["value"] == 65536.0 and "underflow" not in f.reference, f.reference
    else:
        assert f.verdict == "numerics", f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_op_overflow_of_another_shape_references_the_value_its_hint_names(mode: str) -> None:
    # a Linear on (batch, seq, features) runs addmm on a 2-d view: its shape is not the finding's, so
    # the reference took the largest element (another token's, 2.9e5) while the hint named the one on
    # the finding's path (9.6e4): two values for one op in one report
    model = nn.Sequential(nn.Linear(4, 2)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    x = torch.zeros(2, 3, 4, dtype=torch.float16)
    x[0, 1] = 24000.0  # 96000: past 65504, the first non-finite element
    x[1, 2] = 60000.0  # 240000: past it further
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        model(x).float().sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.verdict, f.index) == ("0", "aten.addmm.default", "precision", (0, 1, 0)), f
    assert f.reference["value"] == 96000.0 and f.reference["failing"] == math.inf, f.reference
    assert "reached 96000 " in f.hint, f.hint


class _Residuals(nn.Module):
    """Two float16 residual adds: the first reaches 65504.03 in float32 (rounds to 65504, finite),
    the second overflows (a Llama's residual stream in float16)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.tensor([0.03, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.shift
        return h + h * 0.5


def test_a_float32_value_that_rounds_to_float16s_largest_is_not_the_overflow() -> None:
    # the reference named the first add (float32 65504.03, failing 65504: finite) as the op that
    # passed float16's range, while the finding's op and hint named the second (98256)
    model = _Residuals().half()
    x = torch.tensor([65504.0, 1.0], dtype=torch.float16)
    with nanhunt.watch(model, on_find="record") as hunt:
        model(x)
    f = hunt.first
    assert f is not None and (f.op, f.verdict, f.index) == ("aten.add.Tensor", "precision", (0,)), f
    assert f.reference["failing"] == math.inf and f.reference["value"] > 65520, f.reference
    assert f"{f.reference['value']:.6g}" in f.hint, (f.reference, f.hint)


class _InnerAutocast(nn.Module):
    """Enters autocast in its own forward and hands its float16 result on as float32."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return (h @ h.T).float()


def test_float16_overflow_under_autocast_entered_inside_the_forward_is_precision():
    """autocast entered inside a module's own forward: a float16 mm overflowed (76,600 > 65,504) and
    the verdict was "numerics", "more precision will not help" (the call's autocast was off, and
    the float32 reference ran the forward's own autocast again: inf). The op's own dtype says
    float16, and the reference runs with every autocast off: "precision", its float32 value."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _InnerAutocast(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for i in range(3):
            x = torch.rand(8, 6) * (1000.0 if i == 2 else 1.0)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.module, f.step, f.op, f.verdict) == ("1", 2, "aten.mm.default", "precision"), str(f)
    assert f.reference["failing_dtype"] == "float16" and 65504 < f.reference["value"] < 1e6, f.reference
    assert torch.is_autocast_enabled("cpu") is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (autocast itself is as it was)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_float16_attention_overflow_with_a_kv_cache_is_precision_and_leaves_the_cache(mode):
    """A transformers GPT-2 as configured by default (use_cache=True): the attention call is given
    a DynamicCache it appends its keys to. Run alone, the call got the cache as the replay left it
    after the call (its 12 keys in), and the second run that one with 12 more: both failed (a size
    mismatch) and the finding had no verdict. Each run now starts from its own copy of the cache
    as the call got it; the user's cache (the output's) is not touched."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(3000.0)  # q.k passes 65504 in float16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 12))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(input_ids=ids, labels=ids)
        cache = out.past_key_values
        layers = [(layer.keys, layer.values, layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        out.loss.backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.verdict) == ("transformer.h.0.attn", "aten.bmm.default", "precision"), str(f)
    assert f.reference["failing_dtype"] == "float16" and abs(f.reference["value"]) > 65504.0, f.reference
    assert len(cache.layers) == len(layers) == 2
    for layer, (k, v, k0, v0) in zip(cache.layers, layers):
        assert layer.keys is k and layer.values is v  # (an update replaces them)
        assert k.shape[-2] == v.shape[-2] == 12
        torch.testing.assert_close((k, v), (k0, v0), rtol=0, atol=0, equal_nan=True)  # (layer 1's are NaN)


def test_a_bfloat16_overflow_that_float32_shares_is_not_told_to_move_to_float32_or_bfloat16() -> None:
    # exp of 100 under bfloat16 autocast: float32 overflows too (verdict numerics); the remedy said
    # "keep this module in float32/bfloat16", which it already is, and which would not help
    class ExpHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).exp()

    torch.manual_seed(0)
    m = ExpHead()
    with torch.no_grad():
        m.fc.bias.fill_(100.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(torch.randn(2, 4))
        y.float().sum().backward()
        opt.step()
    f = ei.value.finding
    assert f.verdict == "numerics", str(f)
    assert "values themselves are too large" in f.hint and "float32/bfloat16" not in f.hint, f.hint


class _SquareLog(nn.Module):
    """log of a square: a float16 square of 1e-5 rounds to 0, and the log of it is -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log((self.a(x) * 1e-3) ** 2)


@pytest.mark.parametrize("how", ["autocast", "half"])
def test_a_float16_underflow_is_precision_with_the_op_that_rounded_to_zero_and_its_remedy(how: str) -> None:
    """A square that float16 rounds to 0 (then log(0) = -inf): the verdict was right (precision),
    but its reference spoke of a value passing 65504 and the remedy said to keep the inputs smaller,
    which makes an underflow worse. It now names the op whose float32 value is below float16's
    smallest normal number, that value, and a remedy for an underflow."""
    torch.manual_seed(0)
    model = nn.Sequential(_SquareLog(), nn.Linear(8, 1))
    if how == "half":
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        x = torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.float16, enabled=how == "autocast"):
            out = model(x.half() if how == "half" else x)
        out.float().sum().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("0", "aten.log.default", "precision"), f
    ref = f.reference
    assert ref.get("underflow") and ref["op"] == "aten.pow.Tensor_Scalar" and ref["failing_dtype"] == "float16", ref
    assert 0 < abs(ref["value"]) < ref["smallest"] == torch.finfo(torch.float16).tiny, ref
    text = str(nanhunt.NonFiniteError(f))
    assert "smallest normal value" in text and "65504" not in text and "inputs smaller" not in text, text


class _HalfLogSoftmax(nn.Module):
    """A float32 model's log-probabilities computed in float16 by hand, to save memory."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.cast = cast

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.half() if self.cast == "half" else z.to(torch.float16)
        return z.softmax(-1).log()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("cast", ["half", "to"])
def test_a_cast_to_float16_inside_the_forward_is_widened_in_the_float32_reference(mode: str, cast: str) -> None:
    """``z.half().softmax(-1).log()`` in a float32 model: a probability of 2e-9 rounds to 0 in
    float16, and log(0) = -inf. The float32 reference ran the module's own ``.half()`` as written,
    so it made the same -inf and the verdict was "numerics" (the math itself), where float32 gives
    log(2e-9) = -20: the cast is the reference's to widen, as autocast is, and the verdict is
    "precision", naming the softmax that rounded to 0."""
    model = nn.Sequential(nn.Linear(4, 10), _HalfLogSoftmax(cast))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.linspace(0.0, -20.0, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
        out = model(torch.randn(3, 4))
        out.float().sum().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.dtype, f.value) == ("1", "aten.log.default", "float16", -math.inf), f
    assert f.verdict == "precision", f
    ref = f.reference
    assert ref.get("underflow") and ref["op"] == "aten._softmax.default" and ref["failing_dtype"] == "float16", ref
    assert 0 < ref["value"] < ref["smallest"], ref


class _CancelThenTiny(nn.Module):
    """A float16 variance E[x^2] - E[x]^2 below 0 (cancellation) makes the NaN (sqrt or log of it);
    a harmless float16 underflow (exp(-18) rounds to 0) is added after it."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return getattr(torch, self.op)(v) + torch.exp(-x * 0.09).mean(-1, keepdim=True)


@pytest.mark.parametrize("op", ["sqrt", "log"])
def test_a_harmless_float16_underflow_is_not_named_as_the_cause_of_a_precision_nan(op: str) -> None:
    """The underflow reference named the harmless exp's 0 (`aten.mean.dim`, computed after the NaN
    was born, or feeding no op that a 0 can blow up) and told the user to run that op in float32:
    only an op before the birth, and only for an op a 0 can make non-finite, is an underflow's."""
    x = torch.tensor([[200.125, 200.375, 200.125, 200.25, 200.0, 200.375, 200.25, 200.0]]).half()
    model = nn.Sequential(nn.Identity(), _CancelThenTiny(op))
    assert torch.isnan(model(x)).all() and torch.isfinite(model.float()(x.float())).all(), "set-up"
    with nanhunt.watch(model, on_find="record") as hunt:
        model(x)
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("1", f"aten.{op}.default", "precision"), f
    assert not f.reference.get("underflow") and f.reference.get("op") != "aten.mean.dim", f.reference


def _hand_bce(z: torch.Tensor) -> torch.Tensor:
    """A binary cross-entropy written by hand, for the label 0: -log(1 - sigmoid(z))."""
    return -torch.log(1 - torch.sigmoid(z))


class _HandBCELabel0(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return _hand_bce(z)


@pytest.mark.parametrize("where", ["module", "loss code"])
def test_a_bfloat16_difference_rounded_to_0_is_precision_with_the_subtraction_and_its_remedy(where: str) -> None:
    """Under bfloat16 autocast, sigmoid(14) rounds to 1.0, so 1 - p is 0 and log(1 - p) = -inf
    (a cross-entropy written by hand, in a module or in the loss code); float32 has 1 - p = 8.3e-07.
    The verdict was right (precision), but its reference spoke of a value passing bfloat16's largest
    value or a variance below 0, and the remedy said to keep the inputs smaller. It now names the
    subtraction that bfloat16 rounded to 0, with its float32 value, and a remedy that avoids it."""
    model = nn.Sequential(nn.Linear(4, 1), _HandBCELabel0()) if where == "module" else nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(14.0)
    with nanhunt.watch(model, on_find="record") as hunt:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 4))
            if where == "loss code":
                _hand_bce(out).mean()
    f = hunt.first
    module = "1" if where == "module" else "<outside>"
    assert f is not None and (f.module, f.op, f.verdict) == (module, "aten.log.default", "precision"), f
    ref = f.reference
    assert ref.get("cancelled") and ref["op"].startswith("aten.rsub") and ref["failing"] == 0.0, ref
    assert ref["value"] == pytest.approx(1 - torch.sigmoid(torch.tensor(14.0)).item(), rel=1e-3), ref
    text = str(hunt.report)
    assert "rounds to the same number" in text and "E[x^2]" not in text, text
    assert "binary_cross_entropy_with_logits" in text and "inputs smaller" not in text, text


def test_a_numerics_remedy_defers_to_the_hint_that_names_the_fix_in_every_format(tmp_path) -> None:
    # eigh's backward at a degenerate spectrum (a batch of one sample repeated): the hint says an
    # epsilon on the diagonal shifts every eigenvalue alike, and the remedy row under it said "guard
    # the op's domain (clamp or add an epsilon before a log/sqrt/division ...)": the fix it refutes
    import io
    import re

    from nanhunt._report.render import html, text
    from nanhunt._words import remedy

    class Whiten(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            hc = h - h.mean(0, keepdim=True)
            vals, vecs = torch.linalg.eigh(hc.T @ hc / h.shape[0] + 1e-3 * torch.eye(h.shape[1]))
            return hc @ (vecs @ torch.diag(vals.rsqrt()) @ vecs.T)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), Whiten(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        F.mse_loss(model(torch.randn(1, 8).expand(16, 8).clone()), torch.randn(16, 1)).backward()
        opt.step()
    f, report = ei.value.finding, ei.value.report
    assert (f.op, f.verdict) == ("LinalgEighBackward0", "numerics") and "+ eps * I" in f.hint, str(f)
    buf = io.StringIO()
    rich = pytest.importorskip("rich.console")
    rich.Console(file=buf, width=400, force_terminal=False).print(report)
    report.save(tmp_path / "r.json")
    outs = {"text": text(report), "html": html(report), "rich": re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()),
            "json": json.loads((tmp_path / "r.json").read_text())["first"]["remedy"]}
    for name, out in outs.items():
        assert "More precision will not help" in out and "the hint" in out, name
        assert "add an epsilon" not in out, name
    # a hint that names only the mechanism (log of 0): the remedy still gives the usual fix
    bare = dataclasses.replace(f, op="aten.log.default", hint="Log of 0 gives -inf and log of a negative number gives nan.")
    assert "guard the op's domain" in remedy(bare)


class _LogitScale(nn.Module):
    """CLIP's head: ``logit_scale.exp() * img @ txt.T`` with a learned temperature, its exponent grown."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(8, 8), nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(10.9))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.img(a), dim=-1), F.normalize(self.txt(b), dim=-1)
        return self.logit_scale.exp() * a @ b.t()


_LOGIT_SCALE_LINE = inspect.getsourcelines(_LogitScale.forward)[1] + 2


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["autocast", "half"])
def test_a_learned_logit_scale_past_float16s_range_names_clips_clamp(how: str, mode: str) -> None:
    """A contrastive model's logit scale raised by each step past log(65504) = 11.09: ``.half()``
    overflows its exp, autocast (exp in float32, 66171) the 0-dim operand the float16 mul casts
    down. The hints were the generic "keep this module in float32 or scale before it" and "inf * 0
    gives nan, and a product can overflow", with no word of the temperature, nor of the clamp that
    CLIP applies to it (logit_scale at most log(100))."""
    torch.manual_seed(0)
    model = _LogitScale().half() if how == "half" else _LogitScale()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dt = torch.float16 if how == "half" else torch.float32
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16, enabled=how == "autocast"):
                logits = model(torch.randn(4, 8, dtype=dt), torch.randn(4, 8, dtype=dt))
            F.cross_entropy(logits.float(), torch.arange(4)).backward()
            with torch.no_grad():
                model.logit_scale.add_(0.1)  # (what the contrastive loss's gradient does, made sure)
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.module, f.step, f.verdict) == ("", 2, "precision"), str(f)
    assert f.op == ("aten.exp.default" if how == "half" else "aten.mul.Tensor"), str(f)
    assert f.source is not None and f.source.endswith(f"test_differential.py:{_LOGIT_SCALE_LINE}")
    assert f.reference["value"] > 65504, f.reference
    assert "learned temperature or logit scale" in f.hint and "math.log(100)" in f.hint, f.hint
    if how == "autocast":
        assert "0-dim operand" in f.hint and "product can overflow" not in f.hint, f.hint


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.temperature = nn.Parameter(torch.tensor(0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.temperature


def test_a_weight_written_in_place_before_step_is_no_transient_fault() -> None:
    """The loop lowers a learned temperature under no_grad between backward and ``step()``: the
    forward that divided by it at 0 is judged at the step's end, after the loop wrote it again, so
    every replay ran on -0.125 and was finite. The verdict was "transient" and the hint "suggests
    nondeterminism, a race or a hardware fault": a user sent to check the device."""
    torch.manual_seed(0)
    model = _Tempered()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for _ in range(4):
            F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 5, (4,))).backward()
            with torch.no_grad():
                model.temperature.sub_(0.125)  # (written before step(): the next forward sees it)
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step) == ("forward", "", 2), str(f)
    assert f.verdict != "transient" and "hardware" not in f.hint, str(f)
    assert "'temperature'" in f.hint and "written in place" in f.hint, f.hint
