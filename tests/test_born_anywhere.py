"""Born anywhere (issue 10): NaNs made outside every watched module call, in the root's own code,
in graphs of bare parameters, in the optimizer and in BatchNorm — each with op, line, element,
cause and a hint chosen from the numbers.

Every scenario first proves that the mechanism really gives a non-finite value in plain PyTorch
on this torch, and compares nanhunt's answer with an independent referee: a dispatch mode that
sees every aten op (the first one to make a non-finite value from finite inputs, and the line of
this file that ran it) and hooks on every autograd node (the first node to make a non-finite
gradient from finite ones). The referee uses no nanhunt code.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import subprocess
import sys
import textwrap
import traceback
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nanhunt
from tests import zoo

HERE = os.path.abspath(__file__)
with open(HERE) as _f:
    _LINES = _f.read().splitlines()


def line(marker: str) -> str:
    hits = [i + 1 for i, s in enumerate(_LINES) if s.rstrip().endswith(f"# @{marker}")]
    assert len(hits) == 1, marker
    return f"{HERE}:{hits[0]}"


def same_source(got: str | None, want: str) -> bool:
    if got is None:
        return False
    gf, gl = got.rsplit(":", 1)
    wf, wl = want.rsplit(":", 1)
    return gl == wl and os.path.realpath(gf) == os.path.realpath(wf)


@pytest.fixture(autouse=True)
def _no_mode_left() -> Any:
    before = torch._C._len_torch_function_stack()
    yield
    assert torch._C._len_torch_function_stack() == before, "a torch function mode survived the test"


# ---------------------------------------------------------------- the referee (no nanhunt code)
def _bad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


class Referee(TorchDispatchMode):
    """Forward: the first aten op whose output is non-finite while its inputs are all finite, and
    the line of this file that ran it. Backward: ``nodes()`` hooks every autograd node of a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None
        self.line: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.op is None and torch._C._current_graph_task_id() == -1:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            floats = [t for t in ins if t.is_floating_point()]
            if (any(_bad(t) for t in tree_leaves(out)) and floats and not any(_bad(t) for t in floats)
                    and "empty" not in str(func)):  # factories, uninitialised memory: not values
                self.op = str(func)
                here = [f for f in traceback.extract_stack()
                        if os.path.realpath(f.filename) == os.path.realpath(HERE) and f.name != "__torch_dispatch__"]
                self.line = f"{HERE}:{here[-1].lineno}" if here else None
        return out


def referee_backward(root: torch.Tensor) -> str | None:
    """Run ``root.backward()`` with a hook on every node: the first to make a non-finite gradient
    from finite ones."""
    seen, todo, nodes = set(), [root.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nodes.append(fn)
        todo.extend(n for n, _ in fn.next_functions)
    first: list[str] = []
    hs = [fn.register_hook(lambda gi, go, fn=fn: first.append(fn.name())
                           if not first and any(_bad(g) for g in gi) and not any(_bad(g) for g in go) else None)
          for fn in nodes]
    root.backward()
    for h in hs:
        h.remove()
    return first[0] if first else None


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def run_steps(m: nn.Module, loss_fn: Any, steps: int = 1, **watch: Any) -> nanhunt.Finding:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(steps)]
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, optimizer=opt, **watch):
            for i, (x, y) in enumerate(batches):
                loss = loss_fn(m(x), y, i)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return ei.value.finding


# ---------------------------------------------------------------- losses as plain functions
def positives_loss(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """A contrastive-style loss that divides by the count of positives: 0/0 when there are none."""
    pos = (y == 2).float()
    per = (out.softmax(-1)[:, 2] * pos).sum() / pos.sum()  # @div-by-count
    return -per.log()


def test_loss_function_outside_the_model() -> None:
    y = torch.zeros(6, dtype=torch.long)  # no positives
    out = model()(torch.randn(6, 4))
    ref = Referee()
    with ref:
        plain = positives_loss(out, y, 0)
    assert math.isnan(plain.item())
    assert ref.op == "aten.div.Tensor" and same_source(ref.line, line("div-by-count"))

    f = run_steps(model(), lambda o, _y, i: positives_loss(o, y, i))
    assert f.module == "<outside>" and f.phase == "forward" and f.cause == "created"
    assert f.op == ref.op and same_source(f.source, line("div-by-count"))
    assert f.index == () and math.isnan(f.value)
    assert f.chain[0].startswith("aten.div.Tensor")
    assert "0/0" in f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_ignore_outside_silences_a_metric_that_overflows_but_not_the_loss_gradient(mode: str) -> None:
    """A perplexity logged from a summed loss (exp(230) = inf in float32) is a metric, not a bug of
    training: ``ignore=("<outside>",)`` lets a raise-mode run go on with weights exactly as without
    nanhunt. Without it, the metric is found at its op; with it, a loss-code gradient that goes
    non-finite (log at 0) is still found."""
    def train(watch: dict[str, Any] | None, poison: bool = False) -> tuple[nn.Module, Any]:
        m = zoo.transformer_encoder(dropout=0.0)
        head = nn.Linear(16, 50)
        opt = torch.optim.SGD([*m.parameters(), *head.parameters()], lr=0.01)
        g = torch.Generator().manual_seed(1)
        hunt = nanhunt.watch(m, opt, **watch) if watch is not None else contextlib.nullcontext()
        with hunt:
            for _ in range(3):
                x, y = torch.randn(4, 6, 16, generator=g), torch.randint(0, 50, (4, 6), generator=g)
                logits = head(m(x))
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                ppl = torch.exp(loss.detach())  # @ppl
                assert math.isinf(ppl.item())
                if poison:
                    loss = loss + torch.log(logits.softmax(-1).amax() * 0).mul(0)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return m, hunt

    with pytest.raises(nanhunt.NonFiniteError) as ei:
        train({"mode": mode})
    f = ei.value.finding
    assert (f.module, f.op, f.step) == ("<outside>", "aten.exp.default", 0) and same_source(f.source, line("ppl"))
    plain, _ = train(None)
    quiet, hunt = train({"mode": mode, "ignore": ("<outside>",)})
    assert hunt.findings == [] and all(map(zoo.bit_equal, plain.parameters(), quiet.parameters()))
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        train({"mode": mode, "ignore": ("<outside>",)}, poison=True)
    f = ei.value.finding
    assert f.step == 0 and f.phase in ("backward", "grad") and f.value != 0, f


def test_loss_code_inside_record_function_under_the_profiler_is_found_at_its_line() -> None:
    """record_function's own ops (the user's ranges, Optimizer.step()'s) pass the loss-code
    recorder by; the user's ops inside a range are still its own."""
    y = torch.zeros(6, dtype=torch.long)

    def loss_fn(o: torch.Tensor, _y: Any, i: int) -> torch.Tensor:
        with torch.autograd.profiler.record_function("my_loss"):
            return positives_loss(o, y, i)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f = run_steps(model(), loss_fn)
    assert f.module == "<outside>" and f.phase == "forward" and f.cause == "created"
    assert f.op == "aten.div.Tensor" and same_source(f.source, line("div-by-count"))
    assert any(e.name == "my_loss" for e in prof.events())


@pytest.mark.parametrize("inplace_relu", [False, True])
def test_an_overflow_written_in_place_into_the_models_output_is_found_at_its_op(inplace_relu: bool) -> None:
    # the outside replay started from the output as it is now (already inf): the in-place op saw a
    # non-finite input and got no op or chain. It starts from the value the model returned (a ReLU
    # that wrote its input in place inside the model included)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=inplace_relu), nn.Linear(4, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(net, opt):
        out = net(torch.randn(2, 4))
        out.mul_(1e39)  # @mul-in-place
        out.sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause) == ("forward", "<outside>", "created")
    assert f.op == "aten.mul_.Tensor" and same_source(f.source, line("mul-in-place"))
    assert f.chain and f.chain[0].startswith("aten.mul_.Tensor")


class FocalLoss(nn.Module):
    """A loss module that is not part of the watched model."""

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = out.softmax(-1).gather(1, y[:, None]).squeeze(1)
        return -(torch.log(p - p.detach().max()) * (1 - p) ** 2).mean()  # @focal-log


def test_loss_module_outside_the_model() -> None:
    crit = FocalLoss()
    y = torch.randint(0, 3, (6,))
    out = model()(torch.randn(6, 4))
    ref = Referee()
    with ref:
        assert not math.isfinite(crit(out, y).item())
    f = run_steps(model(), lambda o, yy, i: crit(o, yy))
    assert f.module == "<outside>" and f.op == ref.op == "aten.log.default"
    assert same_source(f.source, line("focal-log")) and same_source(ref.line, line("focal-log"))
    assert f.index is not None and f.value is not None and not math.isfinite(f.value)


def test_loss_code_only_on_some_steps() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        loss = F.cross_entropy(out, y)
        if step == 3:  # an auxiliary term only every few steps
            loss = loss + torch.sqrt(out.detach().sum() * 0 - 1)  # @aux-sqrt
        return loss

    f = run_steps(model(), loss_fn, steps=5)
    assert f.step == 3 and f.module == "<outside>" and f.op == "aten.sqrt.default"
    assert same_source(f.source, line("aux-sqrt"))


def dist_loss(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    target = out.detach().clone()
    target[1:] += 1.0
    d = ((out - target) ** 2).sum(-1)
    return torch.sqrt(d).mean()  # @sqrt-at-0


def test_backward_only_nan_in_loss_code() -> None:
    out = model()(torch.randn(6, 4))
    assert math.isfinite(dist_loss(out, None, 0).item())
    assert referee_backward(dist_loss(out, None, 0)) == "SqrtBackward0"

    f = run_steps(model(), dist_loss)
    assert f.module == "<outside>" and f.phase == "backward" and f.op == "SqrtBackward0"
    assert f.tensor == "SqrtBackward0.grad_input[0]"  # the node's gradient, not the model output's
    assert same_source(f.source, line("sqrt-at-0"))
    assert f.index == (0,) and f.value == math.inf


class _DistHead(nn.Module):
    """The model with dist_loss's sqrt in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dist_loss(self.body(x), None, 0)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_backward_nan_in_loss_code_gets_the_verdict_the_model_would(mode: str) -> None:
    """API.md: verdict "numerics" when the float32 eager reference reproduces it. The same sqrt at
    0 in float32 got it inside the model and verdict=None in the loss code outside it, whose
    eager float32 replay is that reference too (its forward findings get "numerics")."""
    inside = run_steps(_DistHead(), lambda o, y, i: o, mode=mode)
    outside = run_steps(model(), dist_loss, mode=mode)
    assert (inside.module, inside.op, inside.verdict) == ("", "SqrtBackward0", "numerics"), inside
    assert (outside.module, outside.op, outside.verdict) == ("<outside>", "SqrtBackward0", "numerics"), outside
    assert outside.reference == {"dtype": "float32", "op": "SqrtBackward0", "tensor": outside.tensor,
                                 "value": outside.value}, outside.reference


class _ClampedLog(torch.autograd.Function):
    """log(max(x, 1e-6)), whose hand-written backward forgot the clamp: g / x at x = 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(1e-6).log()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g / x  # @clamped-log-backward


def clamped_log_loss(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    p = out.softmax(-1) * (y[:, None] == torch.arange(3)).float()  # the true class's probability, 0 elsewhere
    return -_ClampedLog.apply(p).sum(-1).mean()  # @custom-fn


_clamped_log = _ClampedLog.apply  # bound at import, before any watch (``grad_reverse = GradReverse.apply``)


def prebound_clamped_log_loss(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    p = out.softmax(-1) * (y[:, None] == torch.arange(3)).float()
    return -_clamped_log(p).sum(-1).mean()  # @prebound-fn


@pytest.mark.parametrize("loss, at", [(clamped_log_loss, "custom-fn"), (prebound_clamped_log_loss, "prebound-fn")])
def test_custom_autograd_function_in_loss_code_is_its_own_backward_node(loss: Any, at: str) -> None:
    # the Function's forward is finite (clamped); only its own backward makes inf: replaying the
    # ops of its forward would give finite gradients, so the loss code's Function is replayed as itself.
    # Bound before the watch (`_clamped_log = _ClampedLog.apply`), it was not seen at all: the finding
    # was the gradient arriving at the model's output, cause "input", with no op
    out = model()(torch.randn(6, 4))
    y = torch.randint(0, 3, (6,))
    assert math.isfinite(loss(out, y, 0).item())
    assert referee_backward(loss(out, y, 0)) == "_ClampedLogBackward"

    apply = torch.autograd.Function.__dict__["apply"]
    f = run_steps(model(), loss)
    # op and line: the division of its backward that made the inf (where a user fixes it), first in
    # the chain; then its node, at the line that applied it; the gradient named by that node
    assert (f.module, f.phase, f.op, f.cause) == ("<outside>", "backward", "aten.div.Tensor", "created")
    assert f.tensor == "_ClampedLogBackward.grad_input[0]"
    assert same_source(f.source, line("clamped-log-backward"))
    assert [c.split(" @ ")[0] for c in f.chain][:2] == ["aten.div.Tensor", "_ClampedLogBackward"]
    assert f.chain[0] == f"{f.op} @ {f.source}" and same_source(f.chain[1].split(" @ ")[1], line(at))
    assert "division by 0" in (f.hint or "")
    assert f.value is not None and math.isinf(f.value)
    assert torch.autograd.Function.__dict__["apply"] is apply  # nothing of the recorder left on torch
    assert "apply" not in torch.autograd.function._SingleLevelFunction.__dict__


def test_check_carries_op_source_chain_and_the_row() -> None:
    def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = out.softmax(-1) * (y > 0)
        return -p.sum(-1).log().mean()  # @row-log

    y = torch.ones(6, 3)
    y[4] = 0
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, optimizer=opt, on_find="record") as hunt:
            loss = nll(m(torch.randn(6, 4)), y)
            hunt.check(loss, "loss")
            loss.backward()
            opt.step()
        raise nanhunt.NonFiniteError(hunt.findings[-1], hunt.report)
    checks = [f for f in ei.value.report.findings if f.phase == "check"]
    assert checks and checks[0].op == "aten.log.default" and same_source(checks[0].source, line("row-log"))
    assert "row 4" in checks[0].hint


# ---------------------------------------------------------------- backward in the root's own code
class CosineHead(nn.Module):
    """Angle between two projections of the input, computed in the root's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.load_state_dict(self.a.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = F.cosine_similarity(self.a(x), self.b(x), dim=-1).clamp(-1, 1)
        return torch.acos(c)  # @acos


def test_backward_nan_in_the_roots_own_code() -> None:
    torch.manual_seed(0)
    m = CosineHead()
    x = torch.randn(3, 4)
    assert torch.isfinite(m(x)).all()
    assert referee_backward(m(x).sum()) == "AcosBackward0"

    f = run_steps(m, lambda o, y, i: o.sum())
    assert f.phase == "backward" and f.module == "" and f.op == "AcosBackward0"
    assert same_source(f.source, line("acos")) and f.value == -math.inf and f.index is not None


class BareSqrt(nn.Module):
    """Only a bare parameter needs a gradient: a torch.where trap on it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([-1.0, 4.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.where(self.scale > 0, torch.sqrt(self.scale), torch.zeros(()))  # @where-trap
        return x[:, :3] * s


def test_where_trap_on_a_bare_parameter() -> None:
    m = BareSqrt()
    x = torch.randn(6, 4)
    assert torch.isfinite(m(x)).all()
    assert referee_backward(m(x).sum()) == "SqrtBackward0"
    f = run_steps(BareSqrt(), lambda o, y, i: o.sum())
    assert f.phase == "backward" and f.op == "SqrtBackward0" and f.module == ""
    assert same_source(f.source, line("where-trap"))
    assert f.index == (0,) and math.isnan(f.value)
    assert "torch.where" in f.hint and "double" in f.hint


class PaddedDistances(nn.Module):
    """Distances of each token's embedding to the first token's, the padding masked out after the
    sqrt; the first token's own distance is 0 and is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        d = ((e[:, :1] - e) ** 2).sum(-1)
        return self.head(torch.sqrt(d).masked_fill(pad, 0))  # @kept-sqrt


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_masked_fill_on_a_sqrt_at_0_it_kept_is_no_where_trap(mode: str) -> None:
    """torch.sqrt(d).masked_fill(pad, 0) with d = 0 where pad is False: the sqrt's gradient at 0
    is inf there, no masked-out element's 0 * inf. A where or masked_fill right on the unsafe op
    was called the where trap whichever element it masked: the hint sent the user to the
    double-where fix, which does not help."""
    torch.manual_seed(0)
    m = PaddedDistances()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randint(1, 20, (4, 6))
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[:, 4:] = True
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, optimizer=opt, mode=mode):
        m(x, pad).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op, f.index) == ("backward", "SqrtBackward0", (0, 0)), f
    assert same_source(f.source, line("kept-sqrt")), f
    assert "sqrt at 0" in f.hint and "double-where" not in f.hint, f.hint


# ---------------------------------------------------------------- cause: state at the start of the call
def test_batchnorm_fed_a_bad_sample_is_not_blamed_on_its_buffers() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    x[3, 1] = math.nan  # one bad sample from the data
    plain = nn.BatchNorm1d(4)
    assert not torch.isfinite(plain(x)).all() and not torch.isfinite(plain.running_mean).all()

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, optimizer=opt):
            m(x).sum().backward()
            opt.step()
    f = ei.value.finding
    assert f.module == "0" and f.cause == "input"
    assert "optimizer" not in f.hint


# ---------------------------------------------------------------- hints from the numbers
def test_float16_overflow_in_a_gpt2_mlp() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).half()
    with torch.no_grad():  # the MLP's first matmul reaches 64000 + 100 * 32 > 65504
        m.transformer.h[0].ln_2.bias.fill_(1.0)
        m.transformer.h[0].mlp.c_fc.weight.fill_(100.0)
        m.transformer.h[0].mlp.c_fc.bias.fill_(64000.0)
    ids = torch.randint(0, 64, (2, 8))
    ref = Referee()
    with ref, torch.no_grad():
        m(input_ids=ids)
    assert ref.op is not None

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, optimizer=opt):
            m(input_ids=ids).logits.float().mean().backward()
            opt.step()
    f = ei.value.finding
    assert f.module == "transformer.h.0.mlp.c_fc" and f.op == ref.op == "aten.addmm.default"
    assert f.value == math.inf and f.cause == "created"
    assert "65504" in f.hint and "67" in f.hint and "float32" in f.hint


def test_float16_overflow_in_a_sub_is_called_an_overflow() -> None:
    class Diff(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - (-x)  # @sub-overflow

    x = torch.full((2,), 60000.0, dtype=torch.float16)
    assert torch.isinf(Diff()(x)).all()
    m = nn.Sequential(nn.Identity(), Diff())
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m):
            m(x)
            m(x)
    f = ei.value.finding
    assert f.op == "aten.sub.Tensor" and "65504" in f.hint and "inf - inf" not in f.hint.lower()


def test_adam_in_float16() -> None:
    w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
    plain = torch.optim.Adam([w], lr=1e-3)
    w.grad = torch.tensor([0.0, 1e-4], dtype=torch.float16)
    plain.step()
    assert not torch.isfinite(w).all()  # eps=1e-8 is 0 in float16: 0/0 and x/0

    m = nn.Linear(2, 1).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x = torch.zeros(4, 2, dtype=torch.float16)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, optimizer=opt):
            for _ in range(3):
                m(x).float().sum().backward()
                opt.step()  # @adam-step
                opt.zero_grad()
    f = ei.value.finding
    assert f.phase == "optimizer"
    assert same_source(f.source, line("adam-step"))
    assert f.op is not None and "addcdiv" in f.op
    assert "eps" in f.hint and "float16" in f.hint


@pytest.mark.parametrize("case", ["ignored", "ignored sum", "class weight", "count", "std", "ctc", "lgamma", "digamma", "beta",
                                  "softplus", "poisson", "saturated", "saturated metric"])
def test_hints_name_the_remedy(case: str) -> None:
    # lgamma / digamma at a Gamma NLL's shape parameter of 0 (a relu), a Beta log_prob at a target of
    # exactly 1, softplus(beta=100) with a threshold past exp's overflow: the hint was the generic
    # "Inf from finite inputs: an overflow past the dtype's max, x/0 or log(0)" (or its NaN twin)
    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        if case in ("lgamma", "digamma"):
            alpha = F.relu(out[:, 0] - 10.0)  # a concentration from a relu: 0
            return getattr(torch, case)(alpha).mean()
        if case == "beta":
            ab = F.softplus(out[:, :2]) + 0.1
            value = torch.tensor([0.3, 0.5, 1.0, 0.2, 0.7, 0.4])  # a target of exactly 1
            return -torch.distributions.Beta(ab[:, 0], ab[:, 1]).log_prob(value).mean()
        if case == "poisson":  # a Poisson NLL whose rate is a ReLU dead on the whole batch: all 0, not a 0/1 mask
            rate = F.relu(out[:, 0] - 10.0)
            return (rate - y * torch.log(rate)).mean()
        if case == "saturated":  # a cross entropy by hand over a softmax so sharp that its probabilities are
            # exactly 0 and 1: the outside replay runs under no_grad, where they read as a 0/1 mask made
            # additive (mask.log()), and the hint was the generic "log of 0 gives -inf ..."
            p = torch.softmax(out * 1e4, -1)
            return -torch.log(p.gather(-1, y[:, None])).mean()
        if case == "saturated metric":  # the same as a metric under no_grad, the log taken of every probability:
            # exactly 0s and 1s that no gradient reaches read as a 0/1 mask, and the hint was the generic one
            with torch.no_grad():
                p = torch.softmax(out * 1e4, -1)
                nll = -torch.log(p).gather(-1, y[:, None]).mean()  # (logged by the loop)
            return F.cross_entropy(out, y) + 0 * nll.detach().zero_()
        if case == "softplus":
            return F.softplus(out * 1e3, beta=100, threshold=1e6).mean()
        if case == "ignored":
            return F.cross_entropy(out, torch.full_like(y, -100))
        if case == "class weight":  # a tagger's "O" class weighted 0, a batch of only "O" (one ignored): the
            # weighted mean divides by a total weight of 0. The hint was the generic "NaN from finite inputs"
            labels = torch.zeros_like(y).index_fill(0, torch.tensor([1]), -100)
            return F.cross_entropy(out, labels, weight=torch.tensor([0.0, 1.0, 2.0]))
        if case == "ignored sum":  # transformers' loss under its Trainer: summed, divided by num_items_in_batch
            labels = torch.full_like(y, -100)
            return F.cross_entropy(out, labels, reduction="sum") / (labels.ne(-100).sum() / 1)
        if case == "count":  # a mean over the positives by hand, their count an integer
            pos = y > 2  # none
            return (out[:, 0] * pos).sum() / pos.sum()
        if case == "std":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns "degrees of freedom is <= 0"
                return out[:1, 0].std()
        lp = out.log_softmax(-1)[:, None, :].expand(6, 1, 3)
        return F.ctc_loss(lp, torch.ones(1, 9, dtype=torch.long), torch.tensor([6]), torch.tensor([9]))

    f = run_steps(model(), loss_fn)
    assert f.module == "<outside>"
    want = {"ignored": "ignore", "ignored sum": "every label of the batch is ignored (-100)",
            "class weight": "a class whose weight (the loss's weight=) is 0",
            "count": "divided by the number of its elements", "std": "one element", "ctc": "zero_infinity=True", "lgamma": "lgamma is +inf at 0",
            "digamma": "(lgamma's derivative) is non-finite at 0", "beta": "Beta log_prob at a value of exactly",
            "softplus": "threshold at the default 20", "poisson": "Log of exactly 0", "saturated": "Log of exactly 0",
            "saturated metric": "Log of exactly 0"}[case]
    assert want in f.hint


# ---------------------------------------------------------------- warn / record
def test_warn_once_per_step_and_max_findings() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with nanhunt.watch(m, optimizer=opt, on_find="warn", max_findings=3) as hunt:
            for _ in range(5):
                out = m(torch.randn(6, 4))
                loss = (out * torch.tensor(math.nan)).sum()
                hunt.check(loss, "loss")
                loss.backward()
                opt.step()
                opt.zero_grad()
    ours = [w for w in got if issubclass(w.category, nanhunt.NonFiniteWarning)]
    assert len(ours) <= 5
    assert str(ours[0].message).startswith("First")
    assert not any(str(w.message).startswith("First") for w in ours[1:])
    d = hunt.report.to_dict()
    assert len(d["findings"]) == 3 and d["meta"]["dropped_findings"] > 0


# ---------------------------------------------------------------- nanhunt run
def test_nanhunt_run_finds_a_loss_function_bug(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def loss_fn(out, y):
            return (out - y).pow(2).sum() / (y > 5).sum()

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.zeros(8, 1)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    """))
    r = subprocess.run([sys.executable, "-m", "nanhunt", "run", "--report", str(tmp_path / "r.json"), str(script)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(nanhunt.__file__))})
    assert r.returncode == 3, r.stderr
    rep = nanhunt.Report.load(tmp_path / "r.json")
    f = rep.first
    assert f.module == "<outside>" and f.op == "aten.div.Tensor"
    assert f.source is not None and f.source.endswith("train.py:6")


# ---------------------------------------------------------------- the user's run is untouched
def test_outside_code_with_rng_and_a_hit_is_bit_identical() -> None:
    """Loss code that draws random numbers, and an outside hit replayed in record mode: losses,
    gradients, weights and the RNG stream are exactly those of the plain run."""

    def run(watch: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, Any]:
        torch.manual_seed(0)
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        xs = [torch.randn(6, 4) for _ in range(3)]
        hunt = nanhunt.watch(m, optimizer=opt, on_find="record") if watch else None
        losses, grads = [], []
        for i, x in enumerate(xs):
            out = m(x)
            noisy = F.dropout(out, 0.5)  # outside code consuming the RNG
            loss = noisy.pow(2).mean()
            if i == 1:  # a metric term born -inf (no gradient: training goes on)
                loss = loss + torch.log(out.detach().abs() * 0).sum()
            losses.append(loss.detach().clone())
            loss.backward()
            grads.append(m[0].weight.grad.clone())
            opt.step()
            opt.zero_grad()
        if hunt is not None:
            hunt.close()
        return losses, grads, torch.rand(3), hunt

    a, b = run(False), run(True)
    assert all(torch.equal(x, y) or (x.isnan() == y.isnan()).all() for x, y in zip(a[0], b[0]))
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert torch.equal(a[2], b[2])
    f = b[3].first
    assert (f.module, f.op, f.step) == ("<outside>", "aten.log.default", 1)


def test_a_non_finite_value_handed_back_unchanged_by_a_later_step_is_not_born_there() -> None:
    # a logger keeps step 0's -inf metric and moves it "to the device" at step 1 (Lightning's
    # apply_to_collection: .to() its own device returns the same tensor): nothing is made there
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    kept = []
    with nanhunt.watch(m, optimizer=opt, on_find="record") as hunt:
        for step in range(3):
            out = m(torch.randn(6, 4))
            if step == 0:
                kept.append(torch.log(torch.zeros(1)))  # a metric of -inf, made here at step 0
            else:
                kept[0].to("cpu").contiguous()
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert [(f.step, f.module, f.op) for f in hunt.findings] == [(0, "<outside>", "aten.log.default")]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor and fast-path remarks
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_teachers_native_fast_path_in_loss_code_is_bit_identical(mode: str) -> None:
    # distillation: an unwatched TransformerEncoder teacher in eval under no_grad, called between
    # the student's forward and backward. Its native fast path runs only with no torch function
    # mode on: the outside recorder must step aside for it, or padded rows come out as values
    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        teacher = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
        student = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        x = torch.randn(4, 7, 16)
        pad = torch.arange(7)[None] >= torch.tensor([7, 5, 3, 6])[:, None]
        got = []
        hunt = nanhunt.watch(student, opt, mode=mode) if watched else None
        for _ in range(3):
            out = student(x)
            with torch.no_grad():
                target = teacher(x, src_key_padding_mask=pad)
            got += [out.detach().clone(), target.clone()]
            ((out - target) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        if hunt is not None:
            hunt.close()
            assert hunt.findings == []
        return got + [p.detach().clone() for p in student.parameters()]

    plain, watched = run(False), run(True)
    assert all(zoo.bit_equal(a, b) for a, b in zip(plain, watched))
    assert float(plain[1][2, 5].abs().sum()) == 0.0  # the fast path's padded row: zeros


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor and fast-path remarks
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_teacher_called_by_another_thread_during_the_loops_teacher_call_is_untouched(mode: str) -> None:
    """The loop's unwatched teacher runs with the outside recorder set aside; another thread
    (an evaluation worker) calls the same teacher meanwhile. Its return must not put the loop's
    recorder on that thread (its fast path then computed otherwise) nor take it from the loop
    (whose loss-code log(0) then went unfound)."""
    import threading

    torch.manual_seed(0)
    teacher = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2).eval()
    student = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(4, 7, 16)
    with torch.no_grad():
        ref = teacher(x)
    seen: list[Any] = []
    main = threading.current_thread()

    def other() -> None:
        with torch.no_grad():
            seen.append(teacher(x))
        seen.append(torch._C._len_torch_function_stack())

    def inside(module: nn.Module, args: Any) -> None:  # the loop's teacher call is under way
        if threading.current_thread() is main and not seen:
            t = threading.Thread(target=other)
            t.start()
            t.join()

    handle = teacher.layers[0].register_forward_pre_hook(inside)
    try:
        with nanhunt.watch(student, opt, mode=mode, on_find="record") as hunt:
            out = student(x)
            with torch.no_grad():
                target = teacher(x)
            loss = ((out - target) ** 2).mean() + torch.log(out.detach() * 0).mean()  # @log-of-zero
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        handle.remove()
    assert len(seen) == 2 and zoo.bit_equal(seen[0], ref) and seen[1] == 0, seen[1:]
    f = hunt.first
    assert f is not None and f.module == "<outside>" and f.op == "aten.log.default", str(f)
    assert same_source(f.source, line("log-of-zero"))


def _info_nce(z: torch.Tensor) -> torch.Tensor:
    z = z.float()  # "keep the loss in float32": autocast still runs the matmul in float16
    sim = z @ z.T / 0.07
    return F.cross_entropy(sim.float(), torch.arange(z.shape[0]))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_loss_code_under_autocast_is_replayed_under_it(mode: str) -> None:
    """Loss code inside ``torch.autocast(float16)``: its similarity matmul overflows float16 only
    because autocast runs it there. The outside code's replay ran without autocast (float32:
    finite), so the finding had no op, no line, and was not reproducible."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 32, generator=g) * (1 + 6 * s) for s in range(6)]  # growing scale
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for x in xs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _info_nce(model(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.op, f.dtype, f.reproducible) == (
        "forward", "<outside>", "aten.mm.default", "float16", True), f
    assert f.source is not None and "sim = z @ z.T / 0.07" in linecache.getline(*_file_line(f.source))
    assert f.value == float("inf") or f.value == float("-inf")
    # the replay put autocast back as it was: off
    assert not torch.is_autocast_enabled("cpu")


def _file_line(source: str) -> tuple[str, int]:
    file, line = source.rsplit(":", 1)
    return file, int(line)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_reduction_over_a_fully_masked_row_in_loss_code_is_found(mode: str) -> None:
    """A partial-label loss: logsumexp over each sample's candidate labels, the others filled with
    -inf. A sample with no candidate makes logsumexp of a row of -inf = -inf, and the loss +inf,
    while every gradient stays finite: nothing was found (the -inf went in, an intended mask's
    value, so logsumexp was called 'fed')."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for step in range(3):
            x = torch.randn(5, 6, generator=g)
            candidates = torch.rand(5, 4, generator=g) > 0.5
            candidates[:, 0] = True
            if step == 2:
                candidates[1] = False  # a sample with no candidate label
            logits = model(x)
            loss = -(logits.masked_fill(~candidates, float("-inf")).logsumexp(-1) - logits.logsumexp(-1)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "<outside>", 2, "created"), f
    assert any("logsumexp" in c for c in f.chain) and f.index == (1,)
    # told as the row with nothing to sum, not as "-inf * 0, inf - inf, a sum or mean over masked positions"
    assert "logsumexp over a fully masked row" in f.hint and "-inf * 0" not in f.hint, f.hint


# ---------------------------------------------------------------- fed from outside the model
def _fed_run(mode: str, *, poison: str) -> nanhunt.Finding:
    """Three SGD steps of a small regressor whose loss code is fed a NaN at step 1 that nothing
    watched made: a target from the data (``poison="target"``), or an unwatched mean teacher whose
    EMA update after step() divides by the step number (``"teacher"``: 1 - 1/0 at step 0)."""
    import copy

    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(student, opt, mode=mode):
        for step in range(3):
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            if poison == "target" and step == 1:
                y[2, 1] = float("nan")  # a broken label in the data
            s = student(x)
            if poison == "target":
                loss = F.mse_loss(s, y)  # @fed-target
            else:
                loss = F.mse_loss(s.softmax(1), teacher(x).softmax(1))  # @fed-teacher
            assert step < 2 or not loss.isnan(), "the poison never reached the loss"
            loss.backward()
            opt.step()
            opt.zero_grad()
            if poison == "teacher":
                alpha = torch.clamp(1 - 1 / torch.tensor(float(step)), max=0.99)  # the warm-up ramp's bug at 0
                with torch.no_grad():
                    for pt, ps in zip(teacher.parameters(), student.parameters()):
                        pt.mul_(alpha).add_(ps, alpha=float(1 - alpha))
    return err.value.finding


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("poison", ["target", "teacher"])
def test_loss_code_fed_a_nan_nothing_watched_made_is_reported_as_fed(mode: str, poison: str) -> None:
    """A NaN target, or an unwatched EMA teacher's NaN weights: the loss code was fed a value that
    nothing watched made. Its first use is the finding, cause 'input', at the loss line, with the
    argument's element in the hint. (It was a backward finding at MseLossBackward0, 'created
    from finite inputs': false, and it blamed the loss function for the data's NaN.)"""
    f = _fed_run(mode, poison=poison)
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "<outside>", 1, "input", None), f
    assert same_source(f.source, line(f"fed-{poison}")), f.source
    assert "nothing watched made" in f.hint
    if poison == "target":
        assert "argument 1 (shape (8, 3)) holds nan at index (2, 1)" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("micro", [1, 3, "view"])
def test_a_nan_target_taken_apart_by_indexing_is_fed_also_in_a_later_micro_batch(mode: str, micro: Any) -> None:
    """The batch's targets are indexed per micro-batch (``Y[k]``: a view the loss code made from
    the data) and the NaN sits in the last micro-batch, after the step's earlier backward()
    calls. Still fed from the data: cause 'input' at the loss line (it was 'created', at the
    loss or at MseLossBackward0). "view": one micro-batch, its target then reshaped to the shape
    it has (``y.view(-1, 1)`` of an (n, 1) target: an alias that the records cannot tell from its
    input); it was a backward finding, 'created' in PowBackward0, with a hint about x ** p at 0."""
    view = micro == "view"
    micro = 1 if view else micro
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(micro, 16, 8, generator=g), torch.randn(micro, 16, 1, generator=g)) for _ in range(3)]
    data[1][1][micro - 1, 5, 0] = float("nan")
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for xs, ys in data:
            for k in range(micro):
                if view:
                    loss = ((m(xs[k]) - ys[k].view(-1, 1)) ** 2).mean()  # @fed-view
                else:
                    loss = F.mse_loss(m(xs[k]), ys[k]) / micro  # @fed-indexed
                loss.backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.call) == ("forward", "<outside>", 1, "input", micro - 1), f
    assert same_source(f.source, line("fed-view" if view else "fed-indexed")) and "holds nan at index (5, 0)" in f.hint, f


class _LogTargets(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A regression set whose targets are log-transformed in __getitem__; one target is 0."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(16, 8, generator=g)
        self.y = torch.rand(16, generator=g).mul(5).add(0.5)
        self.y[13] = 0.0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], torch.log(self.y[i:i + 1])  # log(0) = -inf for sample 13


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("loss", ["mse_loss", "by hand"])
def test_a_minus_inf_target_from_the_datas_log_of_0_is_fed_not_a_mask(mode: str, loss: str) -> None:
    """A log-transformed target with a 0 gives -inf in the data; the loss makes +inf of it. A -inf
    among other finite values than 0 is no additive mask: fed from the data, cause 'input' at the
    loss line, the argument's element and log of 0 in the hint. (It was 'created' at mse_loss, with
    a hint about a -inf mask: use torch.finfo(dtype).min instead of -inf.)"""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_LogTargets(), batch_size=8)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for x, y in loader:
            pred = m(x)
            if loss == "mse_loss":
                l_ = F.mse_loss(pred, y)  # @fed-log-target
            else:
                l_ = ((pred - y.view(-1, 1)) ** 2).mean()  # @fed-log-target-by-hand
            l_.backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.value) == ("forward", "<outside>", 1, "input", math.inf), f
    assert same_source(f.source, line("fed-log-target" if loss == "mse_loss" else "fed-log-target-by-hand")), f
    assert "holds -inf at index (5, 0)" in f.hint and "log of 0" in f.hint and "mask" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_bias_with_a_minus_inf_slot_made_before_the_loop_is_no_finding(mode: str) -> None:
    """The loss code adds a bias built once before the loop, -inf at a class never to predict, among
    other finite values than 0: the sum carries the -inf on, the cross entropy is finite. Not the
    data's log of 0 (that is a -inf turned into +inf or NaN), and no finding."""
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    bias = torch.tensor([0.3, -0.2, 0.5])
    bias[2] = float("-inf")
    with nanhunt.watch(m, opt, mode=mode) as hunt:
        for _ in range(2):
            loss = F.cross_entropy(m(torch.randn(6, 4)) + bias, torch.tensor([0, 1, 0, 1, 1, 0]))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.first is None, hunt.first


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("form", ["smooth_l1", "hand_l1", "target_minus_out"])
def test_a_minus_inf_box_target_from_the_data_pipeline_is_fed_not_a_mask(mode: str, form: str) -> None:
    """Box regression targets log(w_gt / w_anchor) encoded in the data pipeline, one ground-truth box
    of width 0: its target is -inf, and the regression loss is +inf. Written |target - out| by hand,
    the -inf went through the subtraction with the model's output and only abs made +inf of it: no
    finding at all (the gradients finite), the loss inf."""
    gt = torch.tensor([[0.0, 0.0, 3.0, 3.0], [1.0, 1.0, 1.0, 2.0], [0.0, 0.0, 4.0, 5.0]] * 2)  # box 1: width 0
    anchor = torch.tensor([2.0, 2.0, 4.0] * 2)
    target = torch.log((gt[:, 2] - gt[:, 0]) / anchor)  # the data pipeline's encoding, before the step

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        if form == "smooth_l1":
            return F.smooth_l1_loss(out[:, 0], target)  # @box-target-smooth_l1
        if form == "hand_l1":
            return (out[:, 0] - target).abs().mean()  # @box-target-hand_l1
        return (target - out[:, 0]).abs().mean()  # @box-target-target_minus_out

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.step, f.cause, f.value) == ("forward", "<outside>", 0, "input", math.inf), f
    assert same_source(f.source, line(f"box-target-{form}")), f.source
    assert "holds -inf at index (1,)" in f.hint and "log of 0" in f.hint and "finfo" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_models_own_minus_inf_turned_into_nan_by_loss_code_is_the_models(mode: str) -> None:
    """A model returns log(1 - sigmoid(z)), -inf where the sigmoid saturates; the loss code's
    ``(1 - y) * lq`` turns 0 * -inf into NaN. The -inf was born in the model (its log line), not
    in the loss code: sentinel mode, which does not probe the model's output in training,
    reported the loss line 'created' (a -inf alone passed for an intended mask)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            z = self.body(x)
            return torch.log(torch.sigmoid(z)), torch.log(1 - torch.sigmoid(z))  # @model-log

    torch.manual_seed(0)
    m = Net()
    with torch.no_grad():
        m.body[2].bias.fill_(20.0)  # sigmoid(z) rounds to 1 in float32
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(6, 4), torch.ones(6, 1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        lp, lq = m(x)
        loss = -(y * lp + (1 - y) * lq).mean()
        loss.backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.tensor, f.cause, f.op) == ("forward", "", "output[1]", "created", "aten.log.default"), f
    assert same_source(f.source, line("model-log")), f.source


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_the_model_made_in_a_no_grad_training_pass_is_not_reported_as_fed(mode: str) -> None:
    """FixMatch-style pseudo-labels: the watched model runs under no_grad in training mode and its
    output (NaN from a log of 0 in its own code) feeds the loss code. That NaN was made by the
    model, not fed from outside: the finding names the model's module, never '<outside>'."""

    class LogHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return torch.log(h.relu()) - torch.log(h.relu())  # log(0) - log(0): -inf - -inf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogHead())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(6, 4)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        with torch.no_grad():
            pseudo = model(x).argmax(1).float()  # NaN rows: argmax of NaN
            weight = model(x).sum(1)
        loss = (model[0](x).sum(1) * weight - pseudo).mean()
        loss.backward()
        opt.step()
    f = err.value.finding
    assert f.module != "<outside>" and f.module.startswith("1"), f
    assert f.phase == "forward" and f.cause == "created", f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_warnings_raised_by_loss_code_point_at_the_users_line(mode: str) -> None:
    """Torch's warnings from code outside the model (a Python ``warn(stacklevel=2)`` in
    ``mse_loss``, a C++ ``TORCH_WARN`` in ``std``) point at the user's line, as without nanhunt:
    they pointed at nanhunt's recorder (``outside.py``), which looked like nanhunt's fault."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def compute_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)  # @warn-python

    with warnings.catch_warnings(record=True) as got, nanhunt.watch(m, opt, mode=mode, on_find="record") as hunt:
        warnings.simplefilter("always")
        loss = compute_loss(m(torch.randn(8, 4)), torch.randn(8))
        spread = torch.randn(1).std()  # @warn-cpp
        loss.backward()
        opt.step()
    assert spread.isnan()
    assert hunt.first is not None and hunt.first.index == () and hunt.first.op == "aten.std.correction"
    assert "output = nan" in str(hunt.report) and "output[]" not in str(hunt.report)  # a 0-dim tensor
    where = {("target size" in str(w.message), "degrees of freedom" in str(w.message)): f"{w.filename}:{w.lineno}"
             for w in got}
    assert same_source(where.get((True, False)), line("warn-python")), where
    assert same_source(where.get((False, True)), line("warn-cpp")), where


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_fed_to_a_no_grad_training_pass_is_found_at_the_model_not_in_batchnorm(mode: str) -> None:
    """Pseudo-labels from a no_grad pass in training mode on an unlabelled batch holding a NaN:
    the model was fed it (its first module, cause 'input'). Sentinel mode did not judge that
    pass, released its inputs, and then blamed the BatchNorm's running_mean the NaN reached."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for step in range(3):
            x, xu = torch.randn(6, 4), torch.randn(6, 4)
            if step == 1:
                xu[3, 2] = float("nan")
            with torch.no_grad():
                pseudo = m(xu).argmax(1)
            loss = F.cross_entropy(m(x), pseudo)
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.index) == ("forward", "0", 1, "input", (3, 0)), f


def _hand_bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # @hand-bce


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("loss", ["BCELoss", "by hand"])
def test_a_gan_discriminator_saturated_to_0_or_1_is_no_finding_under_bce_loss_and_log_of_0_by_hand(
        mode: str, loss: str) -> None:
    """A GAN whose over-confident discriminator's Sigmoid rounds to exactly 0 and 1: nn.BCELoss clamps its
    log at -100 (no finding), a hand-written BCE takes log(0) in the discriminator's step. The hint told of
    a softmax or sigmoid and F.logsigmoid, no word of the usual fix: BCE on the logits."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    with torch.no_grad():
        d[2].weight.mul_(500.0)
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    bce = nn.BCELoss() if loss == "BCELoss" else _hand_bce
    with nanhunt.watch(g, og, mode=mode, on_find="record") as hg, nanhunt.watch(d, od, mode=mode) as hd:
        for _ in range(2):
            fake = g(torch.randn(6, 4))
            pr, pf = d(torch.randn(6, 8) * 3), d(fake.detach())
            assert bool(((pr == 0) | (pr == 1) | (pf == 0) | (pf == 1)).any())  # saturated
            ld = bce(pr, torch.ones_like(pr)) + bce(pf, torch.zeros_like(pf))
            od.zero_grad()
            ld.backward()
            before = [p.detach().clone() for p in d.parameters()]
            try:
                od.step()
            except nanhunt.NonFiniteError:
                assert all(torch.equal(a, b) for a, b in zip(before, d.parameters()))  # not applied
                break
            pg = d(fake)
            og.zero_grad()
            bce(pg, torch.ones_like(pg)).backward()
            og.step()
    if loss == "BCELoss":
        assert hd.first is None and hg.first is None, (hd.first, hg.first)
        return
    f = hd.first
    assert f is not None and (f.phase, f.module, f.op, f.step, f.cause) == (
        "forward", "<outside>", "aten.log.default", 0, "created"), f
    assert same_source(f.source, line("hand-bce")) and f.value == -math.inf, f
    assert "binary_cross_entropy_with_logits" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_penalty_whose_norm_is_zero_is_found_at_its_sqrt(mode: str) -> None:
    """WGAN-GP with a hand-written norm: an interpolate where every ReLU of the critic is dead has
    a zero input gradient, and sqrt(sum(g**2)) at 0 has an infinite derivative; its double
    backward poisons the critic's gradients. torch.autograd.grad fills no .grad, so the critic's
    next call looked like a new iteration: the step was cut there, the penalty's code was lost,
    and only the critic's weight.grad was reported."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        critic[0].bias.fill_(-0.5)
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    g = torch.Generator().manual_seed(14)
    real, fake = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    real[2], fake[2] = 0.0, 0.0  # a pair at the origin: every ReLU dead for that interpolate
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(critic, opt, mode=mode):
        eps = torch.rand(6, 1, generator=g)
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        norm = torch.sqrt((grad ** 2).sum(1))  # @gp-sqrt
        loss = critic(fake).mean() - critic(real).mean() + 10 * ((norm - 1) ** 2).mean()
        loss.backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "SqrtBackward0", "created"), f
    assert same_source(f.source, line("gp-sqrt")) and "sqrt at 0" in f.hint, f


class _Pow15(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() ** 1.5  # its derivative is finite (0) at 0, its second derivative infinite


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_penalty_whose_second_derivative_is_infinite_names_the_second_order_backward(mode: str) -> None:
    """WGAN-GP over a critic whose activation is |x| ** 1.5: the input gradient is finite, and the
    penalty's backward takes the activation's second derivative, infinite at a hidden unit of exactly
    0: inf * 0 in the first layer's weight gradient, every module's gradient finite. The hint said
    "the step's one backward ... or a gradient written after backward", no word of the second order."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 16), _Pow15(), nn.Linear(16, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    real = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    real[0] = 0.0
    with torch.no_grad():
        critic[0].bias[3] = 0.0  # hidden unit 3 of sample 0 exactly 0
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(critic, opt, mode=mode):
        x = real.clone().requires_grad_(True)
        grad, = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        assert bool(grad.isfinite().all())
        (critic(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()).backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("grad", "0", "weight.grad", 0, "created"), f
    assert "second-order" in f.hint and "create_graph=True" in f.hint, f.hint


class _NormPool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(h - h.mean(1, keepdim=True), dim=1, keepdim=True)  # a spread pooling


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_penalty_through_a_norm_of_a_zero_vector_in_the_model_names_the_norm(mode: str) -> None:
    """WGAN-GP over a critic that pools by the norm of its centred features: a sample whose features
    are all equal (a constant row) makes that norm's input exactly zero. Its first derivative there is
    0 (the input gradient is finite), its second 0/0: the penalty's backward makes NaN in the first
    layer's weight gradient. The hint named only |x| ** p, no word of a norm, the usual culprit."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _NormPool(), nn.Linear(1, 1))
    with torch.no_grad():
        critic[0].weight[:, 1:] = 0.0
        critic[0].weight[:, 0] = 1.0
        critic[0].bias.zero_()  # every feature of a sample equal: the centred row is all 0
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4)
    real = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(critic, opt, mode=mode):
        x = real.clone().requires_grad_(True)
        grad, = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        assert bool(grad.isfinite().all())
        (critic(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()).backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("grad", "0", 0, "created"), f
    assert "second-order" in f.hint and "norm of a zero vector" in f.hint, f.hint


@pytest.mark.parametrize("xlogy", [torch.xlogy, torch.special.xlogy])
def test_an_entropy_by_xlogy_at_a_zero_probability_has_a_hint_of_its_own(xlogy: Any) -> None:
    """An entropy bonus xlogy(p, p) over a saturated softmax (exact zeros): its gradient in the
    second argument is p / p = 0/0. The hint was the generic NaN text, no word of xlogy's remedy."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    f = run_steps(m, lambda o, y, i: xlogy(F.softmax(o * 1e3, -1), F.softmax(o * 1e3, -1)).sum(-1).mean())
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "XlogyBackward0", "created"), f
    assert "xlogy(p, p)" in f.hint and "log_softmax" in f.hint, f.hint


class _Counting(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _user_modes() -> list[Any]:
    return [m for m in torch.overrides._get_current_function_mode_stack() if type(m).__module__ != "nanhunt._record.outside"]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("around", ["forward", "loss and step"])
def test_a_users_torch_function_mode_enters_and_leaves_as_without_the_hunt(mode: str, around: str) -> None:
    """``with torch.device(...)`` (a torch function mode) around the watched forward: the
    recorder, pushed on top when the root call returned, was what the block's exit popped, so the
    user's mode stayed on (``torch.device('meta')``: every later tensor on meta) and the NaN loss
    went unseen. A mode around the loss code and step() switched the recorder off for good."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counting = _Counting()
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, mode=mode):
            for step in range(4):
                x = torch.randn(8, 4)
                if around == "forward":
                    with torch.device("meta"):
                        out = model(x)
                    assert _user_modes() == [] and torch.zeros(1).device.type == "cpu"
                    with counting:
                        loss = torch.log(out.mean() - (10.0 if step == 2 else -10.0))  # log of a negative
                    loss.backward()
                    opt.step()
                else:
                    out = model(x)
                    with counting:
                        loss = torch.log(out.mean() - (10.0 if step == 2 else -10.0))
                        loss.backward()
                        opt.step()
                    assert _user_modes() == []
                opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.op) == ("forward", "<outside>", 2, "aten.log.default"), f
    assert counting.n > 0 and _user_modes() == [] and not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how, op", [
    ("where nan default, mean", "aten.where.self"),
    ("plus full_like inf, mean", "aten.full_like.default"),
    ("times a nan literal", "aten.mul.Tensor"),
])
def test_a_constant_nan_or_inf_the_loss_code_writes_into_the_loss_is_found(mode: str, how: str, op: str) -> None:
    """A NaN/Inf the loss code wrote as a constant (a metric's nan default, an inf filler) that
    reaches the loss: the constant was taken as intended and its consumer as 'fed', so nothing
    was reported while every loss was nan or inf (the where: with zero gradients)."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, mode=mode):
            for _ in range(2):
                out = model(torch.randn(4, 4))
                if how.startswith("where"):
                    loss = torch.where(out > 100, out, torch.tensor(float("nan"))).mean()
                elif how.startswith("plus"):
                    loss = (out + torch.full_like(out, float("inf"))).mean()
                else:
                    loss = out.mean() * float("nan")
                loss.backward()
                opt.step()
                opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.op) == ("forward", "<outside>", 0, op), f
    assert f.source is not None and f.source.startswith(__file__)


_MARKERS = {
    "where nan tensor, nanmean": lambda out: torch.where(out >= out.median(), out, torch.tensor(float("nan"))).nanmean(),
    "masked_fill nan, nanmean rows": lambda out: out.masked_fill(out < out.median(1, keepdim=True).values,
                                                                 float("nan")).nanmean(1).mean(),
    "where nan scalar, nansum": lambda out: torch.where(out > 0, out, float("nan")).nansum(),
    "inf cap, minimum": lambda out: torch.minimum(out, torch.full_like(out, float("inf"))).mean(),
    "where inf, amin, filtered": lambda out: _finite_mean(torch.where(out > 10, out, float("inf")).amin(1)),
    "a nan metric beside the loss": lambda out: (out.detach().masked_fill(out.detach() > -1e9, float("nan")).nanmean(),
                                                 out.mean())[1],
}


def _finite_mean(v: torch.Tensor) -> torch.Tensor:
    ok = torch.isfinite(v)
    return torch.where(ok, v, 0.0).sum() / ok.sum().clamp(min=1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("pattern", list(_MARKERS))
def test_intended_nan_markers_that_the_loss_code_reduces_away_are_not_findings(mode: str, pattern: str) -> None:
    """NaN markers and inf caps the loss code writes and handles (nanmean, nansum, minimum, a
    filter, a metric that never reaches the loss): the loss is finite, nothing is reported."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for _ in range(2):
            out = model(torch.randn(4, 4))
            loss = _MARKERS[pattern](out)
            assert torch.isfinite(loss), "test set-up: a finite loss"
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == []


def _precision(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pred, tgt = F.one_hot(logits.argmax(-1), 3).float(), F.one_hot(y, 3).float()
    tp, n = (pred * tgt).sum(0), pred.sum(0)  # a class never predicted: 0 / 0
    return torch.where(n > 0, tp / n, torch.zeros_like(n))


def _entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits * 1e3, -1)  # exact zeros: 0 * log 0 = nan, dropped by the where
    return -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1).mean()


_GUARDED = {
    "precision under where": _precision,
    "entropy under where": _entropy,
    "log, nan_to_num": lambda logits, y: torch.nan_to_num(torch.log(torch.softmax(logits * 1e3, -1)), neginf=0.0).mean(),
}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("metric", list(_GUARDED))
def test_a_metric_that_drops_its_own_nan_is_no_finding(mode: str, metric: str) -> None:
    """Metric code that makes a NaN or -inf and drops it again (a precision's 0/0 for a class
    never predicted under torch.where, p * log p at p = 0): every value it hands on is finite. The
    0/0 was reported as born in the loss code, and raise mode stopped a healthy run at step 0."""
    model = zoo.mlp(d_out=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for _ in range(2):
            x, y = torch.randn(6, 4, generator=g), torch.zeros(6, dtype=torch.long)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            with torch.no_grad():
                m = _GUARDED[metric](logits, y)
            assert torch.isfinite(m).all(), "test set-up: a finite metric"
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == []


def test_a_metric_that_keeps_its_nan_is_still_found() -> None:
    model = zoo.mlp(d_out=3)
    with nanhunt.watch(model, on_find="record") as hunt:
        logits = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
        pred = F.one_hot(logits.argmax(-1), 3).float()
        # 0 / 0 for a class never predicted, kept as it is
        precision = pred[:, 0].sum() / pred.sum(0)  # @unguarded
        kept = [precision]
    f = hunt.first
    assert kept and f is not None and (f.phase, f.module, f.op) == ("forward", "<outside>", "aten.div.Tensor"), f
    assert f.source == line("unguarded"), f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_the_loop_only_looks_at_is_still_found(mode: str) -> None:
    """The usual guard, ``if not torch.isfinite(loss): continue``: the batch is skipped, no backward
    runs, and the log(0) born in the loss code was taken for dropped (a mask made of it is no call
    that drops its values): a run whose guard fired found nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].bias.fill_(-200.0)  # the sigmoid underflows to exactly 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        for _ in range(2):
            loss = -torch.log(model(torch.randn(8, 4))).mean()  # @guarded
            if not torch.isfinite(loss):
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.op) == ("forward", "<outside>", 0, "aten.log.default"), f
    assert f.source == line("guarded"), f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_float32_value_born_in_loss_code_gets_the_numerics_verdict(mode: str) -> None:
    """Its replay is float32 eager already: the verdict is the math itself, as for a module's
    float32 finding (it was None for every finding outside the model)."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        out = model(torch.randn(4, 4))
        torch.log(out.mean() - 10.0).backward()  # log of a negative number
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("<outside>", "aten.log.default", "numerics"), f
    assert f.reference["dtype"] == "float32" and f.reference["op"] == "aten.log.default" and math.isnan(f.reference["value"])


class _EncHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


_BETWEEN = {  # the user's own code between two watched calls, as a Lightning training_step has it;
    # the op, and the text of the line the finding names (the forward's line, a Function's backward)
    "sqrt at 0": (lambda h: torch.sqrt(h * 0), "SqrtBackward0", "torch.sqrt(h * 0)"),
    "bad custom Function": (lambda h: zoo._BadBackward.apply(h), None, "torch.where(x < 0"),
}


@pytest.mark.parametrize("kind", list(_BETWEEN))
def test_a_backward_nan_born_in_code_between_two_watched_calls_is_found_at_its_line(kind: str) -> None:
    """``h = model.enc(x)``, then the user's code, then ``model.head(h)``: the gradient that code
    made from finite ones was reported as the first call's ``grad_output`` fed in ("made by the code
    after the model: pass the loss to hunt.check"), with no op and no line: the outside backward's
    replay started at the loss and stopped at the second call. The watched calls between are now
    run again on the replayed values, so the backward reaches that code. The replay leaves the
    model's buffers and the run as they would be unwatched (record mode)."""
    make, op, text = _BETWEEN[kind]

    def run(watch: bool) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = _EncHead()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hunt = nanhunt.watch(model, opt, on_find="record") if watch else None
        for step in range(3):
            x = torch.randn(8, 4)
            h = model.enc(x)
            if step == 1:
                h = make(h)
            loss = model.head(h).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if hunt is not None:
            hunt.close()
        return model, hunt

    watched, hunt = run(True)
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("backward", "<outside>", 1, "created"), f
    assert f.op == op if op else f.op.startswith("aten."), f.op  # (a Function's: the op of its backward)
    path, line = f.source.rsplit(":", 1)
    assert text in linecache.getline(path, int(line)), f.source
    plain, _ = run(False)
    for a, b in zip(watched.state_dict().values(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # (bit for bit, NaN where NaN)


_LOW_LOSSES = {
    # a squared error summed in float16: 300 ** 2 = 90000 is past float16's 65504
    "pow of a float16 difference": lambda out, y: ((out.half() - y.half()) ** 2).sum(),
    # the cast itself overflows: 1e5 has no float16
    "cast to float16": lambda out, y: ((out - y) * 1e3).to(torch.float16).sum(),
    # a float16 sum of finite squares overflows
    "float16 sum": lambda out, y: (out - y).half().pow(2).sum(),
    # the legacy spellings of the cast: the reference kept them float16 ("numerics", an inf)
    "type(torch.HalfTensor)": lambda out, y: (out - y).type(torch.HalfTensor).pow(2).sum(),
    "type('torch.HalfTensor')": lambda out, y: (out - y).type("torch.HalfTensor").pow(2).sum(),
}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("pattern", list(_LOW_LOSSES))
def test_a_float16_overflow_in_loss_code_gets_the_precision_verdict(mode: str, pattern: str) -> None:
    """Loss code computed in float16 overflowed: the recorded calls replayed in float32 (float16
    tensors and casts widened) are finite, so the verdict is "precision", with the float32 value
    and the limit. (No verdict was given outside the model before.) The user's tensors are untouched
    by that replay."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(16, 4), torch.full((16, 4), 300.0)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        out = model(x)
        loss = _LOW_LOSSES[pattern](out, y)
        assert not torch.isfinite(loss), "test set-up: the float16 loss overflows"
        kept = (out.detach().clone(), y.clone())
        loss.float().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(out.detach(), kept[0]) and torch.equal(y, kept[1])
    f = hunt.first
    assert f is not None and f.module == "<outside>" and f.dtype == "float16", f
    assert f.verdict == "precision", f
    ref = f.reference
    assert ref["dtype"] == "float32" and ref["failing_dtype"] == "float16" and ref["limit"] == 65504.0, ref
    assert math.isfinite(ref["value"]) and abs(ref["value"]) > 65504.0, ref
    assert "float32" in f.hint and "this module" not in f.hint, f.hint



def test_the_float32_reference_of_loss_code_keeps_a_cast_s_copy_apart_from_its_source() -> None:
    """``h = out.half()`` is a copy, but its float32 reference ``out.float()`` is ``out`` itself: a
    write into ``h`` (``h.mul_(1000)``) changed ``out`` in the reference, so ``exp(out.half() * 20)``
    (6.6e7: a float16 overflow) was exp(18000) there, and the verdict "numerics" with an inf."""
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(0.1)
        model.bias.fill_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        out = model(torch.ones(2, 4))
        h = out.half()
        h.mul_(1000.0)
        z = torch.exp(out.half() * 20)
        (z.float().sum() + h.float().sum()).backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.dtype) == ("<outside>", "aten.exp.default", "float16"), f
    assert f.verdict == "precision" and math.isfinite(f.reference["value"]) and f.reference["value"] > 65504, f.reference


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_float16_underflow_in_loss_code_names_the_op_that_rounded_to_0(mode: str) -> None:
    """Log-probabilities computed in float16 in the loss code, ``out.half().softmax(-1).log()``: a
    probability of 2e-9 rounds to 0 and log(0) = -inf. The verdict was right (precision), but its
    reference gave log's float32 value against float16's largest value 65504 and the remedy said to
    keep the inputs smaller, which makes an underflow worse: it names the softmax that rounded to 0,
    its float32 value below float16's smallest normal one, and a remedy for an underflow."""
    model = nn.Linear(4, 10)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.linspace(0.0, -20.0, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        out = model(torch.randn(3, 4))
        logp = out.half().softmax(-1).log()
        (-logp * 0.1).float().sum().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.dtype, f.verdict) == ("<outside>", "aten.log.default", "float16",
                                                                      "precision"), f
    ref = f.reference
    assert ref.get("underflow") and not ref.get("cancelled") and ref["op"] == "aten.softmax", ref
    assert 0 < ref["value"] < ref["smallest"] == torch.finfo(torch.float16).tiny, ref
    text = str(nanhunt.NonFiniteError(f))
    assert "smallest normal value" in text and "65504" not in text and "inputs smaller" not in text, text


def test_a_float16_value_that_float32_cannot_hold_either_gets_the_numerics_verdict() -> None:
    """log of a zero in float16 loss code is -inf in float32 too: the math itself."""
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        out = model(torch.randn(4, 4))
        (out.half() * 0).abs().log().sum().float().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("<outside>", "aten.log.default", "numerics"), f
    assert f.reference["dtype"] == "float32" and f.reference["value"] == -math.inf, f.reference


@pytest.mark.parametrize("how", ["set_default_device between steps", "DeviceContext around the forward"])
def test_torchs_default_device_context_stays_at_the_bottom_of_the_mode_stack(how: str) -> None:
    """torch.set_default_device's DeviceContext keeps itself at the very bottom of the mode stack
    and asserts so when it leaves: with the recorder put under it, set_default_device and leaving a
    DeviceContext raised 'Found nested DeviceContext on the mode stack where none expected'."""
    from torch.utils._device import DeviceContext

    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with nanhunt.watch(model, opt) as hunt:
            for step in range(3):
                if how.startswith("set_default"):
                    out = model(torch.randn(4, 4))
                    torch.set_default_device("cpu" if step < 2 else None)
                else:
                    with DeviceContext("cpu"):
                        out = model(torch.randn(4, 4))
                out.sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        torch.set_default_device(None)
    assert hunt.findings == [] and not torch.overrides._get_current_function_mode_stack()


def test_checking_a_sparse_tensor_with_a_nan_is_a_finding_not_an_internal_fault() -> None:
    model = zoo.mlp()
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(2, 4))
        s = torch.tensor([[0.0, float("nan")], [1.0, 0.0]]).to_sparse()
        hunt.check(s, "sparse")
        model(torch.randn(2, 4))
    assert [(f.phase, f.module) for f in hunt.findings] == [("check", "sparse")]
    assert (hunt.first.index, hunt.first.shape) == ((0, 1), (2, 2))  # s.to_dense()[0, 1], not values()[0]
    assert not hunt._faulted


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fully_masked_rows_logsumexp_that_the_loss_code_filters_out_is_not_a_finding(mode: str) -> None:
    """A -inf mask reducing a row to -inf (logsumexp over no candidate) that the code then filters
    out (l[isfinite(l)]): the loss is finite and no gradient is harmed, yet it was reported."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for _ in range(2):
            out = model(torch.randn(5, 4))
            keep = torch.ones_like(out, dtype=torch.bool)
            keep[0] = False
            lse = out.masked_fill(~keep, float("-inf")).logsumexp(1)
            loss = lse[torch.isfinite(lse)].mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == []


def _allowed_only(scores: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    # transformers' PrefixConstrainedLogitsProcessor: a -inf mask, opened in place where allowed
    mask = torch.full_like(scores, -math.inf)
    mask[:, allowed] = 0
    return scores + mask


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_minus_inf_mask_opened_in_place_where_allowed_is_not_born_there(mode: str) -> None:
    """``mask = full_like(x, -inf); mask[:, allowed] = 0``: the in-place write of 0 was reported
    as where the -inf was born (with full_like as its op), stopping a healthy run in raise mode and
    ``model.generate(prefix_allowed_tokens_fn=...)`` under a watch. It only carries the mask on."""
    torch.manual_seed(0)
    model = zoo.mlp(d_out=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for _ in range(2):
            s = _allowed_only(model(torch.randn(2, 4)), [1, 3])
            loss = F.cross_entropy(s, torch.tensor([1, 3]))
            assert torch.isfinite(loss), "test set-up: a finite loss"
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == []
    with nanhunt.watch(model, on_find="record") as hunt:  # a -inf that this write turns into a NaN still is
        mask = torch.full_like(model(torch.randn(2, 4)), -math.inf)
        mask.mul_(0)  # @mask-times-0
        kept = [mask]
    f = hunt.first
    assert kept and f is not None and (f.phase, f.module, f.cause) == ("forward", "<outside>", "created"), f
    mul = [c for c in f.chain if c.startswith("aten.mul_.Tensor @ ")]  # (op: the mask's full_like, as for a softmax)
    assert mul and same_source(mul[0].split(" @ ")[1], line("mask-times-0")), f


@pytest.mark.parametrize("foreach", [None, False])
def test_a_gradient_norm_that_overflows_in_clip_grad_norm_is_found_at_its_op(foreach: bool | None) -> None:
    # finite gradients of 1e20: their norm's sum of squares passes float32's max. clip_grad_norm_
    # then scales the gradients by max_norm / inf = 0 in place, so a replay of the norm is finite:
    # the finding had no op, no chain
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        (model(torch.ones(2, 4)) * 1e20).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)  # @clip
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.value, f.cause) == ("forward", "<outside>", math.inf, "created"), f
    op = "aten._foreach_norm.Scalar" if foreach is None else "aten.linalg_vector_norm.default"
    assert f.op == op and f.chain == (f"{op} @ {f.source}",) and f.source == line("clip"), f
    assert "norm" in f.hint and "overflows" in f.hint and f.reproducible is None, f


def _masked_classes_loss(mode: str, loss: Any) -> nanhunt.Finding:
    """The first finding of 3 steps of a Linear(4, 5) whose last two classes the loss code masks
    with -inf: ``loss(logits, mask, step)``, where step 1 is the one that goes wrong."""
    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mask = torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for step in range(3):
            loss(m(torch.randn(8, 4)), mask, step).backward()
            opt.step()
            opt.zero_grad()
    return ei.value.finding


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_label_smoothing_over_a_minus_inf_mask_is_told_as_the_mask_meeting_a_sum(mode: str) -> None:
    # classes masked with -inf in the loss code are harmless until label smoothing takes a share of
    # every class: the smoothing term sums the masked -inf log-probabilities, the loss is +inf. The
    # hint read "the mask fills -inf; harmless unless a whole row is masked" (it spoke only to NaN)
    def loss(out: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
        logits = out.masked_fill(mask, float("-inf"))
        return F.cross_entropy(logits, torch.randint(0, 3, (8,)), label_smoothing=0.1 if step == 1 else 0.0)

    f = _masked_classes_loss(mode, loss)
    assert (f.module, f.step) == ("<outside>", 1) and f.value == math.inf, str(f)
    assert "label smoothing" in f.hint and "harmless unless" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_soft_target_on_a_minus_inf_masked_class_names_the_target(mode: str) -> None:
    # distillation: the student's vocabulary masked with -inf in the loss code, the teacher's soft
    # targets still on the masked classes: F.kl_div's p * (log p - log q) is inf there. The hint
    # spoke of -inf * 0, inf - inf and label smoothing, not of a target on a masked class
    def loss(out: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
        p = torch.randn(8, 5).softmax(-1)
        logq = F.log_softmax(out.masked_fill(mask & (step == 1), float("-inf")), -1)  # (a restricted batch)
        return F.kl_div(logq, p, reduction="batchmean")

    f = _masked_classes_loss(mode, loss)
    assert (f.module, f.step, f.op) == ("<outside>", 1, "aten.masked_fill.Scalar") and f.value == math.inf, str(f)
    assert "kl_div" in f.hint and "mask the target" in f.hint and "finfo(dtype).min" in f.hint, f.hint


class _PaddedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fully_padded_row_in_multihead_attentions_fast_path_is_told_as_a_fully_masked_softmax(mode: str) -> None:
    # eval under no_grad takes the fused kernel (_native_multi_head_attention): a sample whose keys
    # are all padding gets a NaN row. The hint was p * log p's ("-inf * 0 ... xlogy"): the mask
    # check knew only the softmax ops, not the fused attention's own softmax over its mask
    torch.manual_seed(0)
    m = _PaddedAttention().eval()
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[2, :] = True
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, mode=mode), torch.no_grad():
        m(torch.randn(3, 5, 8), torch.zeros(3, 5, dtype=torch.bool))
        m(torch.randn(3, 5, 8), pad)
    f = ei.value.finding
    assert (f.module, f.step, f.index) == ("attn", 1, (2, 0, 0)), str(f)
    assert "fully masked row" in f.hint and "xlogy" not in f.hint, f.hint


def test_attention_scores_past_float32s_max_are_told_as_an_overflow_not_a_mask() -> None:
    # a post-LN encoder fed activations ~3e19 (exploding embeddings): q @ k^T passes float32's max
    # inside the fused attention, whose softmax then makes inf - inf. The hint was the generic
    # "0/0 ... e.g. a softmax over a fully masked row", sending the user to look for a mask
    torch.manual_seed(0)
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1,
                              enable_nested_tensor=False)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(torch.randn(4, 5, 16) * 3e19)
    f = hunt.first
    assert f is not None and (f.module, f.cause) == ("layers.0.self_attn", "created"), f
    assert f.op is not None and "scaled_dot_product" in f.op
    assert "Attention scores too large" in f.hint and "float32's largest finite value" in f.hint, f.hint
    assert "masked" not in f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_nan_born_after_a_second_call_fed_by_the_loop_s_own_code_is_found_at_its_line(mode: str) -> None:
    """Two forwards a step, the second on a tensor the loop's code made (``model(x + noise)``: a
    consistency loss), and a gradient born in the code after that second call (sqrt at 0). The
    second call is run again in the outside backward's replay (it took a recorded value); its
    outputs hold no leaf of the replay, so the backward pruned the code after it and the finding
    was the model's ``grad_output``, "fed in", with no op and no line."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        out = m(x)
        out2 = m(x + 0.5)
        loss = out.mean() + torch.sqrt((out2 - out2.detach()).abs()).sum()  # @second-call-sqrt
        loss.backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "SqrtBackward0", "created"), f
    assert same_source(f.source, line("second-call-sqrt")), f.source


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_overflow_after_an_exploding_learning_rate_names_the_grown_weights_and_the_lr(mode: str) -> None:
    # SGD at lr=2 with momentum diverges: the weights grow step after step until the squared error
    # passes float32's max in the loss code. The hint was the generic "an overflow past the dtype's
    # max, x/0 or log(0)", which says nothing of the learning rate that the user has to lower
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=2.0, momentum=0.9)
    x = torch.randn(64, 8) * 3
    y = (x**2).sum(1, keepdim=True)
    with nanhunt.watch(m, optimizer=opt, mode=mode, on_find="record") as hunt:
        for _ in range(100):
            loss = ((m(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if hunt.first is not None:
                break
    f = hunt.first
    assert f is not None and f.phase == "forward" and f.cause == "created" and f.step > 10, f
    big = max((p.detach().abs().max().item(), n) for n, p in m.named_parameters())
    assert big[0] > 1e10  # (what the run really did: the weights grew)
    assert f"The model's weights are huge ('{big[1]}' reaches" in f.hint and "SGD lr=2" in f.hint, f.hint
    assert "learning rate" in f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_overflow_in_a_module_after_a_one_cycle_lr_too_large_names_the_grown_weights_and_the_lr(mode: str) -> None:
    """OneCycleLR with max_lr=1e37: after one step the weights are ~1e35 and the next forward's addmm
    overflows float32 inside a module. The hint's generic remedy ("a lower learning rate, gradient
    clipping, ...") held the words "learning rate", so the sentence naming the grown weight and the lr
    the schedule had set was never added."""
    m = zoo.bnmlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e37, total_steps=10, pct_start=0.5)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for _ in range(4):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.cause, f.op) == ("forward", "created", "aten.addmm.default"), f
    assert "The model's weights are huge" in f.hint and "SGD lr=" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batchnorm_output_of_huge_finite_values_is_not_the_finding_the_overflow_after_it_is(mode: str) -> None:
    """OneCycleLR with max_lr=3e38 on a CNN: after one step BatchNorm's output is finite, its values
    ~3e35 in both signs, so the hot path's probe (a sum) overflowed where the replay's sum of the
    same values, in another order, stayed finite (1.6e38): full mode reported the BatchNorm, with no
    element, "from a non-finite parameter or buffer" (none was), "not reproduced". The first
    non-finite value is the Linear's addmm after it."""
    m = zoo.cnn()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e38, total_steps=20, pct_start=0.3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for _ in range(3):
            x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "fc", 1, "created", "aten.addmm.default"), f
    assert f.reproducible and "weights are huge" in f.hint and "SGD lr=" in f.hint, f.hint


def test_an_overflow_with_sane_weights_says_nothing_of_the_learning_rate() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=2.0)
    with nanhunt.watch(m, optimizer=opt, on_find="record") as hunt:
        torch.exp(m(torch.randn(2, 4)) + 100).sum().backward()
    f = hunt.first
    assert f is not None and f.cause == "created" and "aten.exp" in (f.op or ""), f
    assert "weights are huge" not in f.hint and "lr=" not in f.hint, f.hint


@pytest.mark.parametrize("with_opt", [True, False])
def test_huge_weights_before_any_update_are_not_said_to_have_grown_by_the_learning_rate(with_opt: bool) -> None:
    # a float16 model run (T5's tied embedding, loaded huge) overflowing at its first call: the hint
    # said the weights had "grown step after step" by a learning rate too large, with no step taken
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[1].weight.fill_(3e4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1) if with_opt else None
    with nanhunt.watch(m, optimizer=opt, on_find="record") as hunt:
        m(torch.ones(2, 4, dtype=torch.float16))
    f = hunt.first
    assert f is not None and (f.module, f.cause) == ("1", "created"), f
    assert "'1.weight' reaches 3e+04" in f.hint and "grown step after step" not in f.hint, f.hint
    assert ("before any update" if with_opt else "no optimizer is watched") in f.hint, f.hint


def _unit_grad(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm(dim=1, keepdim=True)  # a gradient normaliser: 0/0 on a row whose gradient is 0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_hook_registered_in_the_loss_code_is_named_with_its_line(mode: str) -> None:
    # the loss code hooks the logits' gradient to normalise it per row; a row whose loss term is
    # multiplied by 0 has a zero gradient, so the hook makes 0/0. The finding was the gradient
    # arriving at the model's output, cause "input", with "pass the loss to hunt.check(loss)",
    # which would not find it either (the loss is finite)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    weight = torch.tensor([1.0, 0.0, 1.0, 1.0]).unsqueeze(1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, optimizer=opt, mode=mode):
        logits = m(torch.randn(4, 4)) * 1.0
        logits.register_hook(_unit_grad)  # @unit-hook
        (logits.log_softmax(1) * weight).sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause) == ("backward", "<outside>", "created"), f
    assert f.source == line("unit-hook"), f.source
    assert "_unit_grad" in f.hint and "register_hook" in f.hint, f.hint
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # raise: the step was not applied


def normalised_advantages(returns: torch.Tensor) -> torch.Tensor:
    return (returns - returns.mean()) / returns.std()  # @adv-norm


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_advantages_normalised_by_a_std_of_0_are_told_so(mode: str) -> None:
    """A policy gradient whose advantages are normalised by their std: a batch of episodes that all
    got the same return has a std of 0, and (A - A.mean()) / A.std() is 0/0. The hint was the
    generic 0/0 one (a zero vector divided by its norm, F.normalize's eps), no word of the std."""
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        logp = torch.distributions.Categorical(logits=logits).log_prob(y)
        returns = torch.randn(6) if step == 0 else torch.ones(6)  # every episode got the same return
        return -(logp * normalised_advantages(returns)).mean()

    f = run_steps(policy, loss_fn, steps=2, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.step) == ("forward", "<outside>", "aten.div.Tensor", "created", 1), f
    assert same_source(f.source, line("adv-norm")) and math.isnan(f.value), f
    assert f.hint.startswith("A division by a standard deviation of 0") and "x.std() + 1e-8" in f.hint, f.hint


@pytest.mark.parametrize("gap", [100.0, 1000.0])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_ppo_ratio_that_overflows_is_told_as_a_log_ratio_to_clamp(mode: str, gap: float) -> None:
    """PPO's ratio exp(logp - old_logp) after the policy moved far from the one that collected the data
    (old_logp of actions it had given e^-100 or e^-1000): exp overflows. The hint was a VAE's
    logvar.clamp (gap 100), or, past float64's range too (gap 1000), only "exp overflows past the
    dtype's largest value", with neither the argument nor a remedy."""

    def loss_fn(logits: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        logp = torch.distributions.Categorical(logits=logits).log_prob(y)
        old_logp = logp.detach() - gap  # (a stale buffer's log-probabilities)
        ratio = torch.exp(logp - old_logp)  # @ppo-ratio
        adv = torch.linspace(-1.0, 1.0, 6)
        return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.value) == ("forward", "<outside>", "aten.exp.default", "created", math.inf), f
    assert same_source(f.source, line("ppo-ratio")), f.source
    assert "exp(logp - old_logp)" in f.hint and "(logp - old_logp).clamp(max=20)" in f.hint, f.hint
    assert f"its input, {gap:.4g}" in f.hint and "logvar" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_tanh_squashed_policys_log_correction_at_saturation_is_told_so(mode: str) -> None:
    """SAC's log-probability of a tanh-squashed action, log(1 - tanh(u)^2) written plainly: once |u|
    passes about 9, tanh(u) is exactly ±1 in float32 and the log -inf. The hint spoke of a softmax's
    underflow, a ReLU output or a distribution's scale, none of which is here."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        u = out[:, :2] * 100.0  # pre-squash actions far out on tanh's flat tails
        a = torch.tanh(u)
        logp = torch.distributions.Normal(u.detach(), 1.0).log_prob(u).sum(-1)
        logp = logp - torch.log(1 - a.pow(2)).sum(-1)  # @tanh-correction
        return (0.2 * logp + (a ** 2).sum(-1)).mean()

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.value) == ("forward", "<outside>", "aten.log.default", "created", -math.inf), f
    assert same_source(f.source, line("tanh-correction")), f.source
    assert f.hint.startswith("Log of exactly 0 at a saturated tanh") and "F.softplus(-2 * u)" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gaussian_policys_scale_exp_underflowed_to_0_names_the_log_std_to_clamp(mode: str) -> None:
    """A Gaussian policy's Normal(mu, log_std.exp()) whose log_std head fell below -104: the exp is 0,
    and log_prob's log(scale) -inf. The hint named a softmax, a ReLU or a softplus as what made the 0,
    not the exp, and no clamp of log_std."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        mu, log_std = out[:, :1], out[:, 1:2] - 200.0  # a log_std head that collapsed
        dist = torch.distributions.Normal(mu, log_std.exp(), validate_args=False)
        return -dist.log_prob(torch.zeros(6, 1)).mean()  # @policy-log-prob

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.value) == ("forward", "<outside>", "aten.log.default", "created", -math.inf), f
    assert same_source(f.source, line("policy-log-prob")), f.source
    assert f.hint.startswith("Log of exactly 0 after an exp that underflowed") and "log_std.clamp(-20, 2)" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_td_loss_whose_sum_of_squares_overflows_though_its_mean_does_not_is_told_as_an_overflow(mode: str) -> None:
    """A critic's TD loss against targets on a huge scale (rewards near 1e19): mse_loss sums the squared
    errors in float32, and the sum passes float32's max although the mean (6.7e37) does not. The hint
    was the generic 'Inf from finite inputs: an overflow past the dtype's max, x/0 or log(0)'."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        target = torch.linspace(-1.2e19, 1.2e19, 6)  # TD targets: r + gamma * V(s'), the rewards' scale huge
        return F.mse_loss(out[:, 0], target)  # @td-mse

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.value) == ("forward", "<outside>", "aten.mse_loss.default", "created", math.inf), f
    assert same_source(f.source, line("td-mse")), f.source
    assert f.hint.startswith("Overflow inside aten.mse_loss.default") and "inputs reach 1.2e+19" in f.hint, f.hint
    assert "x/0" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_of_a_negative_box_width_is_told_with_its_value_and_remedy(mode: str) -> None:
    """A detection loss that takes log(w_pred / w_anchor) of a width the head predicts without a
    constraint: once it goes below 0, the log is nan. The hint was the op's generic "log of 0 gives
    -inf and log of a negative number gives nan", with neither the value nor a remedy."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        w_pred = out[:, 0] - 10.0  # a width gone negative
        return (torch.log(w_pred / 2.0) - 0.3).abs().mean()  # @log-width

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause) == ("forward", "<outside>", "aten.log.default", "created"), f
    assert same_source(f.source, line("log-width")) and math.isnan(f.value), f
    assert f.hint.startswith("Log of a negative number, -") and "F.softplus" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_of_a_zero_ground_truth_width_in_loss_code_names_the_target_encoding(mode: str) -> None:
    """The loss code encodes the box targets itself, log(w_gt / w_anchor), and one ground-truth box has
    width 0: found at that log, whose hint spoke of a softmax or sigmoid that underflowed and of
    F.binary_cross_entropy_with_logits, none of which is in a value computed from the data alone."""
    gt_w = torch.tensor([3.0, 0.0, 4.0, 1.0, 2.0, 5.0])  # box 1: width 0

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        target = torch.log(gt_w / 2.0)  # @log-gt-width
        return F.smooth_l1_loss(out[:, 0], target)

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.index, f.value) == (
        "forward", "<outside>", "aten.log.default", "created", (1,), -math.inf), f
    assert same_source(f.source, line("log-gt-width")), f.source
    assert "computed from the data alone" in f.hint and "log(w_gt / w_anchor)" in f.hint, f.hint
    assert "sigmoid" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_of_a_mixup_lam_of_exactly_1_names_the_lam_not_a_box_target(mode: str) -> None:
    """Mixup's lam = np.random.beta(a, a) is exactly 1.0 now and then for a small a (more often as a
    float32): a loss that weighs a term by -log(1 - lam) is -inf there. The hint spoke of a box
    regression target log(w_gt / w_anchor) and of dropping such boxes: there is no box, only the lam."""
    lams = [0.3, 1.0]

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        lam = torch.tensor(lams[step])
        perm = torch.arange(5, -1, -1)
        return lam * F.cross_entropy(out, y) - torch.log(1 - lam) * F.cross_entropy(out, y[perm])  # @mixup-log

    f = run_steps(model(), loss_fn, steps=2, mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.step, f.value) == (
        "forward", "<outside>", "aten.log.default", "created", 1, -math.inf), f
    assert same_source(f.source, line("mixup-log")), f.source
    assert "a scalar coefficient of the loop (mixup's" in f.hint and "box" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_condition_number_of_a_rank_deficient_weight_names_its_singular_value_of_0(mode: str) -> None:
    """A condition-number regulariser s_max / s_min on the first layer's weight, one of whose columns is
    0: its smallest singular value is 0, the term inf. The hint was the generic "dividing by a count that is
    0, or by a learned temperature ... clamp(min=1) for a count"."""
    m = model()
    with torch.no_grad():
        m[0].weight[:, 3].zero_()  # (an input feature it no longer reads: rank 3)

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        s = torch.linalg.svdvals(m[0].weight)
        return F.cross_entropy(out, y) + 1e-3 * s[0] / s[-1]  # @cond-number

    f = run_steps(m, loss_fn, mode=mode)
    assert (f.module, f.op, f.cause, f.value) == ("<outside>", "aten.div.Tensor", "created", math.inf), f
    assert same_source(f.source, line("cond-number")), f
    assert f.hint.startswith("A division by a singular value or eigenvalue of 0") and "rank-deficient" in f.hint, f.hint
    assert "clamp(min=1)" not in f.hint, f.hint


def iou_loss(boxes: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - IoU of (x1, y1, x2, y2) boxes, by hand."""
    wh = (torch.min(boxes[:, 2:], target[:, 2:]) - torch.max(boxes[:, :2], target[:, :2])).clamp(min=0)
    inter = wh[:, 0] * wh[:, 1]
    area = (boxes[:, 2:] - boxes[:, :2]).prod(1) + (target[:, 2:] - target[:, :2]).prod(1)
    return (1 - inter / (area - inter)).mean()  # @iou


def test_an_iou_of_zero_area_boxes_names_it_in_its_hint() -> None:
    """A predicted box and a point annotation, both of area 0: the union is 0 and the IoU 0/0."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        corner = out[:, :2]
        target = torch.tensor([[0.0, 0.0, 1.0, 1.0]]).repeat(6, 1)
        target[3] = torch.cat([corner[3].detach(), corner[3].detach()])  # a point annotation on the predicted corner
        return iou_loss(torch.cat([corner, corner], 1), target)

    f = run_steps(model(), loss_fn)
    assert (f.module, f.op, f.cause, f.index) == ("<outside>", "aten.div.Tensor", "created", (3,)), f
    assert same_source(f.source, line("iou")) and math.isnan(f.value), f
    assert "IoU of zero-area boxes" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_dice_loss_of_an_empty_mask_names_its_smoothing_term(mode: str) -> None:
    """A Dice loss without a smoothing term, of a prediction clipped at 0 (relu) on images whose mask is
    empty: intersection 0 and both sums 0, 0/0. The hint named an IoU and a zero vector's norm, not the
    Dice score's own remedy; with the smoothing term the same run is healthy."""

    def dice(out: torch.Tensor, smooth: float) -> torch.Tensor:
        p, t = F.relu(out - 10.0), torch.zeros_like(out)  # nothing predicted, nothing in the mask
        return 1 - (2 * (p * t).sum(1) + smooth) / (p.sum(1) + t.sum(1) + smooth)  # @dice

    f = run_steps(model(), lambda out, y, step: dice(out, 0.0).mean(), mode=mode)
    assert (f.phase, f.module, f.op, f.cause, f.index) == ("forward", "<outside>", "aten.div.Tensor", "created", (0,)), f
    assert same_source(f.source, line("dice")) and math.isnan(f.value), f
    assert "Dice score of an empty mask" in f.hint and "smoothing term" in f.hint, f.hint
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.watch(m, optimizer=opt, mode=mode) as hunt:
        for _ in range(2):
            dice(m(torch.randn(6, 4)), 1.0).mean().backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [], hunt.findings


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("op", [torch.atan, torch.tanh, torch.sigmoid])
def test_an_inf_a_saturating_function_makes_finite_again_is_no_finding(mode: str, op: Any) -> None:
    """A detection metric's aspect-ratio angle atan(w / h) of a box of height 0: w / 0 is inf and
    atan(inf) = pi/2, finite, as meant; every value the code hands on is finite and the gradients
    are untouched. The run was stopped with a forward finding at the division."""
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.watch(m, optimizer=opt, mode=mode) as hunt:
        for step in range(2):
            out = m(torch.randn(6, 4))
            loss = out.pow(2).mean()
            with torch.no_grad():
                h = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 1.0])  # a box of height 0 in the batch
                angle = op(out[:, 0].abs() / h).mean()
            assert math.isfinite(angle.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [], hunt.findings


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gumbel_noise_of_a_uniform_draw_of_0_that_a_softmax_takes_is_no_finding(mode: str) -> None:
    """Gumbel-softmax by hand, -log(-log(u)) with u = 0 (torch.rand's [0, 1) holds 0): a noise of -inf
    gives that class probability 0 in the softmax, as meant; outputs and gradients are finite, as
    they are unwatched. The run was stopped with a forward finding at the log."""
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.watch(m, optimizer=opt, mode=mode) as hunt:
        for step in range(2):
            logits = m(torch.randn(6, 4))
            u = torch.rand(logits.shape)
            u[2, 1] = 0.0 if step == 1 else u[2, 1]
            y = ((logits - torch.log(-torch.log(u))) / 0.5).softmax(-1)
            loss = (y * torch.arange(float(y.shape[-1]))).sum(-1).mean()
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in m.parameters())
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [], hunt.findings


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_of_0_a_softmax_hides_in_forward_is_found_at_its_gradient_with_the_remedy(mode: str) -> None:
    """softmax(log(h)) with one h exactly 0: the softmax gives that position 0, finite, but the
    gradient of log there is 0 * 1/0 = nan. Found at LogBackward0 and its line; the hint only said
    "The gradient of log at 0 is infinite." with no remedy."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        h = (out.abs() + 0.1) * torch.tensor([1.0, 0.0, 1.0])  # a rate that reached exactly 0
        p = torch.log(h).softmax(-1)  # @log-softmax
        return (p * torch.arange(3.0)).sum(-1).mean()

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "LogBackward0", "created"), f
    assert same_source(f.source, line("log-softmax")) and f.index == (0, 1), f
    assert "clamp_min(eps)" in f.hint and "log space" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_inf_atan_hides_in_forward_is_found_where_its_gradient_is_nan(mode: str) -> None:
    """CIoU's atan(w / h) of a box of height 0, differentiated: the forward is finite (atan(inf) =
    pi/2), the gradient of the division by 0 is nan: found there, at its line."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        w, h = out[:, 0].abs() + 0.1, out[:, 1].abs() * (y != 0)  # a box of height 0 where y is 0
        return (torch.atan(w / h) - 0.7).pow(2).mean()  # @ciou-atan

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "DivBackward0", "created"), f
    assert same_source(f.source, line("ciou-atan")), f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_infonce_written_with_exp_at_a_tiny_temperature_is_told_as_the_temperature_not_as_exploding_weights(mode: str) -> None:
    """SimCLR's InfoNCE by hand, exp(sim / T) / exp(sim / T).sum(1) of normalised embeddings at T =
    0.001: a cosine of 1 is 1000, past exp's 88.72. The hint said to clamp what goes into exp (a
    VAE's logvar) or to look for exploding weights, which a cosine cannot have; the fix is the
    loss's form, F.cross_entropy(sim / T) or logsumexp, which is healthy at the same T."""
    model = zoo.mlp(d_out=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)

    def loss_of(how: str) -> torch.Tensor:
        x = torch.randn(8, 4, generator=g)
        z1 = F.normalize(model(x), dim=-1)
        z2 = F.normalize(model(x + 0.01 * torch.randn(8, 4, generator=g)), dim=-1)
        sim = z1 @ z2.t() / 0.001
        if how == "cross_entropy":
            return F.cross_entropy(sim, torch.arange(8))
        e = torch.exp(sim)  # @infonce-exp
        return -torch.log(e.diag() / e.sum(1)).mean()

    with nanhunt.watch(model, opt, mode=mode) as hunt:  # the same loss at the same T, stable: no finding
        for _ in range(2):
            loss_of("cross_entropy").backward()
            opt.step()
            opt.zero_grad()
    assert hunt.first is None, hunt.first
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        loss_of("exp").backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("forward", "<outside>", "aten.exp.default", "created"), f
    assert same_source(f.source, line("infonce-exp")) and f.value == math.inf, f
    assert "small temperature" in f.hint and "F.cross_entropy(sim / T" in f.hint, f.hint
    assert "exploding weights" not in f.hint and "logvar" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_simclr_loss_with_one_row_masked_entirely_names_that_row_not_every_masked_diagonal(mode: str) -> None:
    """SimCLR's NT-Xent: the similarity's diagonal filled with -inf (an anchor is not its own
    negative), and one anchor's row masked entirely (a bad mask of positives): its log_softmax row
    is nan, and cross_entropy's mean is nan. The hint's row sentence named every row (each held its
    diagonal's -inf, an intended mask), not row 3, the one to look at."""
    model = zoo.mlp(d_out=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        z = F.normalize(model(torch.cat([x, x + 0.01])), dim=-1)
        mask = torch.eye(16, dtype=torch.bool)
        mask[3] = True
        sim = (z @ z.t() / 0.1).masked_fill(mask, float("-inf"))  # @simclr-mask
        F.cross_entropy(sim, torch.cat([torch.arange(8, 16), torch.arange(8)])).backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause) == ("forward", "<outside>", "created") and math.isnan(f.value), f
    assert same_source(f.source, line("simclr-mask")) and "fully masked row" in f.hint, f
    assert "non-finite at row 3 " in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_perplexity_that_overflows_in_the_loop_names_the_metric_not_a_learned_temperature(mode: str) -> None:
    """perplexity = exp(loss) in the loop's code, of a large loss: the hint told to clamp a learned
    temperature or logit scale as CLIP does, which this run has none of."""
    model = zoo.mlp(d_out=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        logits = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(0))) * 1e3
        loss = F.cross_entropy(logits, logits.argmin(-1))  # every target the least likely class: a large loss
        with torch.no_grad():
            ppl = torch.exp(loss)  # @perplexity
        loss.backward()
        opt.step()
        opt.zero_grad()
    f = hunt.first
    assert not torch.isfinite(ppl) and f is not None, "test set-up: the perplexity overflows"
    assert (f.module, f.op, f.source, f.value) == ("<outside>", "aten.exp.default", line("perplexity"), math.inf), f
    assert f.hint is not None and "perplexity" in f.hint and "CLIP" not in f.hint, f.hint


class _TwoHeads(nn.Module):
    """A Gaussian policy: a mean head and a scale head on one shared body (both take the same ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.mu, self.s = nn.Linear(16, 2), nn.Linear(16, 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.mu(h), self.s(h)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_the_loss_made_nan_at_one_head_is_not_blamed_on_the_head_beside_it(mode: str) -> None:
    """Normal(mu, softplus(s)).log_prob(mu.detach()) with a scale of 1e-21 (softplus of a scale head
    driven to -48): the variance scale ** 2 is 2e-42, so the backward of (value - loc) ** 2 / (2 * var)
    is inf, and inf * 0 = nan at the mean head's output. The mean head and the scale head take the
    same body output, whose gradient sums both: the scale head (its own gradients finite) was blamed
    as having made the nan in its backward ("born here", no op, no line)."""
    m = _TwoHeads()
    with torch.no_grad():
        m.s.bias.fill_(-48.0)
        m.s.weight.mul_(0.01)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    obs = torch.randn(8, 6)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        mu, s = m(obs)
        dist = torch.distributions.Normal(mu, F.softplus(s), validate_args=False)
        (-dist.log_prob(mu.detach()).mean()).backward()  # @tiny-scale-log-prob
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "<outside>", "DivBackward0", "created"), f
    assert same_source(f.source, line("tiny-scale-log-prob")), f
    assert m.s.weight.grad is not None and torch.isfinite(m.s.weight.grad).all()
    assert not torch.isfinite(m.mu.weight.grad).all()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gumbel_noise_of_a_bfloat16_uniform_draw_of_0_is_told_as_such(mode: str) -> None:
    """Gumbel-softmax by hand in bfloat16, -log(-log(u)) with u = torch.rand(..., dtype=bfloat16): one
    draw in 256 is exactly 0, so the noise is -inf and the log_softmax of the class that drew it -inf,
    0 * -inf = nan in the one-hot loss. Found at the log and its line; the hint was a box regression
    target's ("a ground-truth box of width or height 0 ... where the targets are encoded")."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        logits = out.bfloat16()
        u = torch.rand(64, 3, dtype=torch.bfloat16)  # (run_steps seeds the RNG: two draws of 0)
        assert bool((u == 0).any())  # the mechanism: a bfloat16 draw of exactly 0
        g = -torch.log(-torch.log(u))  # @bf16-gumbel
        logp = F.log_softmax((logits.repeat(11, 1)[:64] + g) / 0.5, -1)
        return -(F.one_hot(y.repeat(11)[:64], 3) * logp).sum(-1).float().mean()

    f = run_steps(model(), loss_fn, mode=mode)
    assert (f.phase, f.module, f.op, f.cause) == ("forward", "<outside>", "aten.log.default", "created"), f
    assert same_source(f.source, line("bf16-gumbel")), f
    assert "uniform random draw" in f.hint and "clamp_min(torch.finfo(u.dtype).tiny)" in f.hint, f.hint
    assert "box" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_categorical_over_a_row_with_no_legal_action_names_that_row_not_a_masked_position(mode: str) -> None:
    """Categorical(logits=logits.masked_fill(~legal, -inf)) over a batch whose row 4 has no legal action:
    the logits - logsumexp(logits) it normalises are nan in row 4, -inf at every other row's masked
    positions, and its argument check raises ValueError. The finding named the first masked position
    of row 0 (output[0, 1] = -inf, as meant) instead of the nan of row 4."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    legal = torch.ones(6, 3, dtype=torch.bool)
    legal[:, 1] = False
    legal[4] = False
    with pytest.raises(ValueError), nanhunt.watch(m, optimizer=opt, mode=mode) as hunt:
        logits = m(torch.randn(6, 4)).masked_fill(~legal, float("-inf"))  # @no-legal-action
        torch.distributions.Categorical(logits=logits, validate_args=True).log_prob(torch.zeros(6)).mean().backward()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.op) == ("forward", "<outside>", "aten.masked_fill.Scalar"), f
    assert f.index == (4, 0) and f.value is not None and math.isnan(f.value), f
    assert same_source(f.source, line("no-legal-action")) and "fully masked row" in f.hint, f
