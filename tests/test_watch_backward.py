"""Backward and gradients: the module whose backward made the first non-finite gradient, and
accumulated ``.grad`` that overflowed. In raise mode the weights are never updated from them."""

from __future__ import annotations

import copy
import linecache
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

from . import zoo
from .zoo import Recorder, assert_finding, same_state, snapshot


def _batches(bad_at: int, n: int = 4) -> list[torch.Tensor]:
    """DistNet inputs; at ``bad_at`` row 1 has equal halves, so a == b and d sqrt/dx = inf."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g) for _ in range(n)]
    xs[bad_at][1, 2:] = xs[bad_at][1, :2]
    return xs


def _reference_distnet(xs: list[torch.Tensor], lr: float) -> tuple[Recorder, list[dict[str, torch.Tensor]]]:
    ref = zoo.distnet()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    rec = Recorder(ref)
    states = []
    for x in xs:
        ref(x).sum().backward()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(ref))
        rec.new_step()
    return rec, states


def test_sqrt_at_zero_backward_is_found_and_the_step_is_not_applied() -> None:
    xs = _batches(bad_at=2)
    rec, _ = _reference_distnet(xs[:3], lr=0.1)
    expected = rec.grad_in("dist", step=2)
    assert torch.isfinite(rec.out("dist", step=2)).all(), "test set-up: the forward stays finite"

    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for i, x in enumerate(xs):
            m(x).sum().backward()
            if i == 2:
                before = snapshot(m)
            opt.step()
            opt.zero_grad()
    assert_finding(ei.value.finding, phase="backward", module="dist", module_type="PairDistance",
                   tensor="grad_input[0]", step=2, call=0, cause="created", expected=expected)
    assert same_state(snapshot(m), before), "a step with non-finite gradients was applied"
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_without_a_backward_replay_a_gradient_is_not_said_born_in_the_weight_gradient() -> None:
    """replay=False (and FSDP2, where nothing is replayed): the sqrt-at-0 NaN made in `dist`'s backward
    was reported as the `proj` weight gradient's own, "born here", its hint saying every module's
    gradients were finite: none had been judged. Its origin is unknown, and grad_hooks=True names it."""
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, replay=False):
        m(_batches(bad_at=0)[0]).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.cause) == ("grad", "proj", "weight.grad", "unknown"), f
    assert "were finite" not in f.hint and "grad_hooks=True" in f.hint and "replay=False" in f.hint, f.hint
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, replay=False, grad_hooks=True):
        m(_batches(bad_at=0)[0]).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause) == ("backward", "dist", "created"), f


def test_training_resumes_after_the_error() -> None:
    xs = _batches(bad_at=1)
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError), nanhunt.watch(m, opt):
        for x in xs:
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    opt.zero_grad()
    with nanhunt.watch(m, opt) as hunt:  # skip the bad batch, go on
        for x in xs[2:]:
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == []
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("two_optimizers", [False, True])
def test_a_loop_that_catches_the_error_and_goes_on_keeps_its_step_numbers(two_optimizers: bool) -> None:
    # the step that raised never reached the update; the loop that catches the error goes on with
    # its next iteration, and every later finding's step is the loop's own count (it fell one
    # behind for each resume: the second NaN, at loop step 5, was reported at step 4)
    xs = _batches(bad_at=2, n=7)
    xs[5][1, 2:] = xs[5][1, :2]  # a == b again: sqrt's gradient at 0
    m = zoo.distnet()
    params = list(m.parameters())
    opts = [torch.optim.SGD(params[:1], lr=0.1), torch.optim.SGD(params[1:], lr=0.1)] if two_optimizers else \
        [torch.optim.SGD(params, lr=0.1)]
    raised = []
    with nanhunt.watch(m, opts if two_optimizers else opts[0]) as hunt:
        for step, x in enumerate(xs):
            try:
                m(x).sum().backward()
                for opt in opts:
                    opt.step()
            except nanhunt.NonFiniteError as e:
                raised.append((step, e.finding.step))
            for opt in opts:
                opt.zero_grad()
    assert raised == [(2, 2), (5, 5)]
    assert {f.step for f in hunt.findings} == {2, 5}
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_torch_where_gradient_trap() -> None:
    m = zoo.wherenet()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(x).sum().backward()
    assert torch.isfinite(rec.out("safe")).all() and not torch.isfinite(rec.grad_in("safe")).all()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        m(x).sum().backward()
        opt.step()
    assert_finding(ei.value.finding, phase="backward", module="safe", module_type="SafeSqrt",
                   tensor="grad_input[0]", step=0, call=0, cause="created", expected=rec.grad_in("safe"))
    assert ei.value.finding.op == "SqrtBackward0"
    # inside a submodule too, the hint names the trap and its fix (not "the gradient of sqrt at 0")
    assert "where trap" in ei.value.finding.hint and "double-where" in ei.value.finding.hint
    assert same_state(snapshot(m), before)


class _RatioHead(nn.Module):
    """``torch.where(d > 0, x / d, 0)`` with ``d`` computed from ``x`` by a child: the module's input is
    the child's input too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.relu(self.fc(x))
        return torch.where(d > 0, x / d, 0.0)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_where_trap_on_a_division_in_a_module_whose_input_a_child_shares_is_told_as_the_trap(mode: str) -> None:
    # x / d at d = 0 is inf in the untaken branch, and its backward 0 / 0 = nan. The finding (module,
    # op, line) was right, but the node's facts were left behind when the finding was handed to the
    # call that owns the node: the hint read "the gradient of a division by (nearly) 0 overflows"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _RatioHead(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        m(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause, f.step) == ("backward", "1", "DivBackward0", "created", 0), f
    assert "where trap" in f.hint and "double-where" in f.hint, f.hint


class _GuardedHead(nn.Module):
    """A where (or masked_fill) that guards an unsafe op with arithmetic in between."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc, self.how = nn.Linear(4, 4), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.relu(self.fc(x))
        p = p / (p.sum(-1, keepdim=True) + 1e-6)  # exact zeros (and a NaN gradient there reaches every row)
        if self.how == "scaled log":
            return torch.where(p > 0, 2.0 * torch.log(p), torch.zeros_like(p))
        if self.how == "poisson":
            return torch.where(p > 0, p - 3.0 * torch.log(p), torch.zeros_like(p))
        if self.how == "sqrt minus 1":
            return torch.where(p > 0, torch.sqrt(p) - 1.0, torch.zeros_like(p))
        return (torch.log(p) + 1.0).masked_fill(p == 0, 0.0)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["scaled log", "poisson", "sqrt minus 1", "masked_fill"])
def test_a_where_trap_with_arithmetic_between_the_where_and_the_unsafe_op_is_told_as_the_trap(how: str, mode: str) -> None:
    # the trap was recognised only where the where consumed the unsafe op's output itself: with a
    # scale or a subtraction between them the hint read "the gradient of log at 0 is infinite",
    # which the where seems to guard against, not the double-where fix
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _GuardedHead(how))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        m(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause) == ("backward", "1", "created"), f
    assert "where trap" in f.hint and "double-where" in f.hint, f.hint


class _ArcFace(nn.Module):
    """An additive angular margin head: acos of the clamped cosine, the target's logit cos(theta + m)."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))

    def forward(self, e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cos = F.normalize(e, dim=-1) @ F.normalize(self.W, dim=-1).t()
        theta = torch.acos(cos.clamp(-1.0, 1.0))  # @arcface-acos
        return 64.0 * torch.where(F.one_hot(y, 3).bool(), torch.cos(theta + 0.2), cos)  # (s = 64, the usual scale)


def test_acos_at_1_fed_a_zero_by_a_saturated_softmax_through_a_wheres_taken_branch_is_not_the_trap() -> None:
    # an embedding on its class centre: cos is exactly 1, and the target's softmax is exactly 1.0, so
    # the gradient reaching acos is 0 there (0 * inf): the where above passed it on (its taken
    # branch), it masked nothing. The clamp to [-1, 1] is what to change
    m = _ArcFace()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    e, y = torch.tensor([[0.5, 0.2, -0.1, 0.3], [2.0, 0.0, 0.0, 0.0]]), torch.tensor([0, 2])
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        F.cross_entropy(m(e, y), y).backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op) == ("backward", "AcosBackward0"), f
    assert "where trap" not in f.hint and "1 - eps" in f.hint, f.hint  # (the clamp to [-1, 1] lets 1 through)


def test_a_sqrt_at_0_whose_gradient_a_masked_fill_above_let_through_is_not_the_trap() -> None:
    # the masked_fill keeps the row whose sqrt is at 0: its gradient reached the sqrt (not 0): no trap
    torch.manual_seed(0)
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        o = m(torch.randn(6, 4)).squeeze(-1)
        d = torch.sqrt((o - o[0].detach()) ** 2)  # 0 at row 0
        (2.0 * d + 1.0).masked_fill(torch.arange(6) == 5, 0.0).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op) == ("backward", "SqrtBackward0"), f
    assert "where trap" not in f.hint and "sqrt at 0" in f.hint and "sqrt(x + eps)" in f.hint, f.hint


def _entropy_bonus_loss(logits: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(-1)  # (exact zeros: the logits are far apart)
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1).mean()


@pytest.mark.parametrize("options", [{}, {"mode": "sentinel"}, {"grad_hooks": True}])
@pytest.mark.parametrize("how, op, words", [
    ("sqrt minus 1", "SqrtBackward0", ("gradient of sqrt, 1/(2 sqrt(x)), is infinite at x = 0",
                                       "torch.where(x > 0, torch.sqrt(torch.where(x > 0, x, 1.)), 0.)")),
    ("scaled log", "LogBackward0", ("gradient of log, 1/x, is infinite at x = 0",
                                    "torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.)), 0.)")),
    ("ratio", "DivBackward0", ("infinite at b = 0", "torch.where(b != 0, a / torch.where(b != 0, b, 1.), 0.)")),
    ("entropy", "MulBackward0", ("log(0) = -inf", "p * torch.log(torch.where(p > 0, p, 1.))")),
])
def test_the_where_trap_hint_names_the_ops_infinite_gradient_and_its_double_where(
        how: str, op: str, words: tuple[str, ...], options: dict[str, Any]) -> None:
    # the hint named the trap with a generic f(torch.where(cond, x, safe_x)): not why this op's gradient
    # is not finite in the untaken branch (sqrt's and log's at 0), nor the double where written for it
    torch.manual_seed(0)
    head: nn.Module = _RatioHead() if how == "ratio" else nn.Identity() if how == "entropy" else _GuardedHead(how)
    m = nn.Sequential(nn.Linear(4, 4), head)
    if how == "entropy":
        with torch.no_grad():
            m[0].weight.mul_(100.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, **options):
        out = m(x)
        (_entropy_bonus_loss(out) if how == "entropy" else out.sum()).backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op, f.cause) == ("backward", op, "created"), f
    assert f.module == ("<outside>" if how == "entropy" else "1"), f
    assert "where trap" in f.hint and "double-where" in f.hint and "where() does not stop it" in f.hint, f.hint
    assert all(w in f.hint for w in words), f.hint


class _Repulsion(nn.Module):
    """A point cloud's repulsion term over every pair of its points, the diagonal (a point and
    itself, distance 0) included."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.dec, self.how = nn.Linear(8, 3 * 6), how

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        p = self.dec(z).view(-1, 6, 3)
        sq = ((p.unsqueeze(2) - p.unsqueeze(1)) ** 2).sum(-1)
        d = sq.sqrt() if self.how == "sqrt" else sq ** 0.5
        return torch.exp(-d).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["sqrt", "pow"])
def test_a_pairwise_distance_at_its_diagonal_is_told_with_its_exponent_and_the_diagonal(how: str, mode: str) -> None:
    # sq ** 0.5 at 0 read "the gradient of x**p is infinite at 0 when p < 1 (...), and overflows for a large x
    # when p > 1": both cases, not which, nor the pairwise distance; sqrt's named two equal points, not the
    # diagonal every pairwise-distance matrix has (a point and itself), nor torch.cdist
    torch.manual_seed(0)
    m = _Repulsion(how)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        m(torch.randn(2, 8)).backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op, f.cause) == ("backward", "SqrtBackward0" if how == "sqrt" else "PowBackward0", "created"), f
    assert "diagonal of a pairwise-distance matrix" in f.hint and "torch.cdist" in f.hint, f.hint
    if how == "pow":
        assert "x ** 0.5 (0.5 * x ** -0.5) is infinite at x = 0" in f.hint and "p > 1" not in f.hint, f.hint


def test_the_pow_hint_names_an_overflow_for_an_exponent_above_1() -> None:
    # a cube's gradient 3 x ** 2 times a gradient of 2e38 past float32's range: an overflow, not a value at 0
    class Cube(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x ** 3 * 2e38

    m = nn.Sequential(nn.Linear(1, 1), Cube())
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[0].bias.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        m(torch.ones(1, 1)).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.op) == ("backward", "PowBackward0"), f
    assert "x ** 3 (3 * x ** 2) passed the dtype's largest finite value" in f.hint, f.hint


def test_a_norm_of_another_ord_in_float16_is_told_as_its_range_not_the_zero_vector() -> None:
    # torch's norm backward gives 0 at the zero vector (ord >= 1): the hint said "the gradient of a norm at
    # the zero vector is 0/0" of a vector far from 0, whose norm ** (ord - 1) underflowed in float16
    class L3(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h / torch.linalg.vector_norm(h, ord=3, dim=-1, keepdim=True).clamp_min(1e-3)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), L3(), nn.Linear(4, 1)).half()
    with torch.no_grad():
        m[0].weight.mul_(1e-3)
        m[0].bias.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        m(torch.randn(4, 4).half()).float().sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.verdict) == ("backward", "1", "LinalgVectorNormBackward0", "precision"), f
    assert "zero vector is 0/0" not in f.hint and "float32" in f.hint and "underflows" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_decay_that_makes_the_weights_grow_is_told_by_the_backward_overflow_it_causes(mode: str) -> None:
    # SGD with lr * weight_decay = 30: each step multiplies the weights by about -29, until the
    # backward's grad_output @ W passes float32's max (the loss is float64, the forward finite).
    # The hint read "Inf from finite inputs: an overflow past the dtype's max, x/0 or log(0)"
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=3.0, weight_decay=10.0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for _ in range(40):
            x = torch.randn(16, 4, generator=g)
            F.mse_loss(m(x).double(), x[:, :1].double()).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.op, f.cause) == ("backward", "AddmmBackward0", "created") and math.isinf(f.value), f
    assert "learning rate" in f.hint and "weight_decay" in f.hint and "log(0)" not in f.hint, f.hint


class _HiddenMaskedRow(nn.Module):
    """Attention with an additive -inf padding bias; the nan of a fully padded row is hidden after
    the softmax (``hide``: torch.where or nan_to_num), so the forward is finite."""

    def __init__(self, hide: str) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 8)
        self.hide = hide

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        bias = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, :]
        p = (q @ k.transpose(-1, -2) + bias).softmax(-1)
        p = torch.where(p.isnan(), 0.0, p) if self.hide == "where" else torch.nan_to_num(p)
        return p @ x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("hide", ["where", "nan_to_num"])
def test_a_fully_masked_softmax_row_hidden_after_it_is_told_as_the_softmax_forward_nan(mode: str, hide: str) -> None:
    # the forward looks finite, the softmax's backward multiplies by its saved nan. The hint read
    # "the branch that is not taken still gets a zero gradient, and 0 * inf" (where) or the generic
    # "NaN from finite inputs" (nan_to_num); and the forward hint of a masked row advised "zero those
    # rows after the softmax", which is exactly this backward nan
    torch.manual_seed(0)
    m = _HiddenMaskedRow(hide)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, pad = torch.randn(2, 3, 4), torch.tensor([[False, False, True], [True, True, True]])
    before = snapshot(m)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        out = m(x, pad)
        assert torch.isfinite(out).all()
        out.pow(2).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op) == ("backward", "", "SoftmaxBackward0"), f
    assert "forward was already nan" in f.hint and "before the softmax" in f.hint, f.hint
    assert same_state(snapshot(m), before)


def test_custom_autograd_function_with_a_bad_backward() -> None:
    m = zoo.badgradnet()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(x).sum().backward()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x).sum().backward()
    assert_finding(hunt.first, phase="backward", module="bad", module_type="BadGrad", tensor="grad_input[0]",
                   step=0, call=0, cause="created", expected=rec.grad_in("bad"))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.k, None


class _HugeGrad(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(x, self.k)


@pytest.mark.parametrize("k", [2e38, math.inf])
@pytest.mark.parametrize("how", ["grad_hooks", "ops"])
def test_finite_gradients_whose_sum_passes_float32s_range_are_no_finding(how: str, k: float) -> None:
    # each gradient element 2e38, finite: the gradient probes (sums) overflowed, the replay was
    # finite, and a finding "born here in backward, not reproduced: suspect the hardware" stopped
    # a healthy run; a real inf gradient is still found
    model = nn.Sequential(nn.Linear(4, 4), _HugeGrad(k), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    options: dict[str, Any] = {"grad_hooks": True} if how == "grad_hooks" else {"mode": "ops"}
    with nanhunt.watch(model, opt, on_find="record", **options) as hunt:
        for _ in range(2):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    if math.isfinite(k):
        assert hunt.findings == [], hunt.first
    else:
        f = hunt.first
        assert f is not None and (f.phase, f.module, f.step, f.cause) == ("backward", "1", 0, "created"), f
        assert f.reproducible is True


def test_nan_gradient_in_the_second_micro_batch() -> None:
    xs = _batches(bad_at=1, n=2)
    ref = zoo.distnet()
    rec = Recorder(ref)
    for x in xs:
        ref(x).sum().backward()
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for x in xs:  # two micro-batches, one optimizer step
            m(x).sum().backward()
        opt.step()
    assert_finding(ei.value.finding, phase="backward", module="dist", module_type="PairDistance",
                   tensor="grad_input[0]", step=0, call=1, cause="created", expected=rec.grad_in("dist", call=1))
    assert same_state(snapshot(m), before)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class ScaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x).float()


def test_accumulated_fp16_grad_overflows_in_phase_grad() -> None:
    """Each micro-batch's gradient is finite (4e4 < 65504); their sum in .grad is not."""
    x = torch.tensor([4e4, 1.0, -5e4, 2.0], dtype=torch.float16)
    ref = ScaleNet()
    for _ in range(2):
        ref(x).sum().backward()
    expected = ref.scale.weight.grad
    assert not torch.isfinite(expected).all()
    m = ScaleNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = snapshot(m)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for _ in range(2):
            m(x).sum().backward()
        opt.step()
    assert_finding(ei.value.finding, phase="grad", module="scale", module_type="Scale", tensor="weight.grad",
                   step=0, call=0, cause="created", expected=expected)
    assert same_state(snapshot(m), before)


class _FF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.wi = nn.Linear(16, 64, bias=False)
        self.wo = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.relu(self.wi(self.ln(x))))


class _T5ish(nn.Module):
    """T5-style feed-forward blocks with large activations, in float16, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_FF() for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # @head-call


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_fp16_weight_gradient_that_overflows_first_is_the_finding(mode: str) -> None:
    # the head's weight gradient (x^T @ g over the batch) overflows float16 in the head's backward,
    # before a block's input gradient does (later in the backward): the first is the head's, not
    # the block's that the module-level analysis of input gradients would blame
    torch.manual_seed(0)
    m = _T5ish()
    with torch.no_grad():
        for b in m.blocks:
            b.wi.weight.mul_(60)
            b.wo.weight.mul_(60)
    m = m.half()
    x = torch.randn(4, 16).half()
    order: list[str] = []  # plain autograd: which non-finite gradient comes first
    ref = copy.deepcopy(m)
    ref.head.weight.register_post_accumulate_grad_hook(
        lambda p: order.append("head") if not torch.isfinite(p.grad).all() else None)
    ref.blocks[2].wi.register_full_backward_hook(
        lambda mod, gi, go: order.append("wi") if not torch.isfinite(gi[0]).all() else None)
    ref(x).float().pow(2).mean().backward()
    assert order[:2] == ["head", "wi"]
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        m(x).float().pow(2).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause, f.value) == ("backward", "head", "AddmmBackward0", "created", float("inf"))
    assert f.source is not None
    file, line = f.source.rsplit(":", 1)
    assert linecache.getline(file, int(line)).rstrip().endswith("# @head-call")


def test_inplace_relu_models_train_and_fail_correctly() -> None:
    """Global full backward hooks break nn.ReLU(inplace=True); the watch must not."""
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), zoo.PairDistance(), nn.Linear(1, 1))
    with torch.no_grad():
        m[0].bias.fill_(5.0)
    ref = copy.deepcopy(m)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(x).sum().backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x).sum().backward()
    assert hunt.findings == []
    assert all(zoo.bit_equal(p.grad, g) for p, g in zip(m.parameters(), ref_grads))
    # a == b for the first row: the in-place ReLU sits right before the failing sqrt
    x2 = x.clone()
    with torch.no_grad():
        m[0].weight[3:].copy_(m[0].weight[:3])
        m[0].bias[3:].copy_(m[0].bias[:3])
    ref = copy.deepcopy(m)
    rec = Recorder(ref)
    ref(x2).sum().backward()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x2).sum().backward()
    assert_finding(hunt.first, phase="backward", module="2", module_type="PairDistance", tensor="grad_input[0]",
                   step=0, call=0, cause="created", expected=rec.grad_in("2"))


def test_a_gradient_made_inside_a_module_whose_input_needs_none_is_named_by_its_node() -> None:
    # sqrt at 0 in a module's own code; the module's input (the data) needs no gradient, so the
    # first non-finite gradient is no grad_input of the module: it is the sqrt node's own
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h + (h - h).pow(2).sum(-1, keepdim=True).sqrt()

    torch.manual_seed(0)
    model = nn.Sequential(Normed(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt):
            model(x).mean().backward()
            opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "0", "SqrtBackward0", "created")
    assert f.tensor == "SqrtBackward0.grad_input[0]" and f.shape == (3, 1)  # not the module's (3, 4) input


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loop_that_leaves_before_step_still_gets_its_backward_finding(mode: str) -> None:
    # clip_grad_norm_(error_if_nonfinite=True) raises torch's error before step(): the hunt closes
    # with the exception, and still judges the gradients that backward left
    class Gate(nn.Module):
        def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return h * torch.sqrt(gate + 0 * h)  # sqrt at 0: an infinite gradient

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.gate, self.c = nn.Linear(4, 8), Gate(), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return self.c(self.gate(self.a(x), gate))

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="non-finite"):
        with nanhunt.watch(m, opt, mode=mode) as hunt:
            for i in range(3):
                gate = torch.ones(5, 8)
                if i == 1:
                    gate[2, 2] = 0.0
                m(torch.randn(5, 4), gate).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
                opt.zero_grad()
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.step, f.op, f.cause) == ("backward", "gate", 1, "SqrtBackward0", "created")


class _CkptBlock(nn.Module):
    """A residual block whose ``bad`` step takes sqrt at 0 (backward: inf) or log of 0 (forward)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, d), nn.Linear(d, d), nn.GELU()
        self.bad: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.bad == "backward":
            h = torch.sqrt(h - h.min())  # one element at 0: d sqrt = inf
        elif self.bad == "forward":
            h = torch.log(h - h.max())  # log of 0 and of negatives
        return x + self.fc2(h)


class _CkptNet(nn.Module):
    def __init__(self, reentrant: bool, d: int = 8) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, d), nn.Linear(d, 2)
        self.blocks = nn.ModuleList(_CkptBlock(d) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h)


def _ckpt_train(model: _CkptNet, bad: str | None, **watch: Any) -> tuple[Any, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three steps with activation checkpointing; block 1 is bad at step 2. (hunt or None,
    outputs, the state when the loop stopped)."""
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(3)]
    hunt = nanhunt.watch(model, opt, **watch) if watch else None
    outs: list[torch.Tensor] = []
    try:
        for i, (x, y) in enumerate(data):
            model.blocks[1].bad = bad if i == 2 else None
            out = model(x)
            outs.append(out.detach().clone())
            ((out - y) ** 2).mean().backward()
            outs.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            opt.step()
            opt.zero_grad()
    except nanhunt.NonFiniteError:
        pass
    finally:
        if hunt is not None:
            hunt.close()
    return hunt, outs, snapshot(model)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("bad", ["backward", "forward"])
def test_a_nan_inside_an_activation_checkpointed_block_is_named_by_its_module(
        reentrant: bool, mode: str, bad: str) -> None:
    """``checkpoint(block, h, use_reentrant=True)`` (also HF's default ``gradient_checkpointing``)
    runs the block without grad, then again inside a nested backward: a backward NaN born in the
    block was blamed on the block before it ("blocks.0 grad_output, input") in full mode and on
    the first layer's weight.grad in sentinel mode. The block's recomputation during the backward
    is not a new call, and the replay runs the block itself."""
    torch.manual_seed(0)
    _, plain, _ = _ckpt_train(_CkptNet(reentrant), bad)  # unwatched
    torch.manual_seed(0)
    hunt, outs, state = _ckpt_train(_CkptNet(reentrant), bad, mode=mode)
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.step, f.cause) == (bad, "blocks.1", 2, "created"), f
    if bad == "backward":
        assert (f.tensor, f.op) == ("grad_input[0]", "SqrtBackward0")
    else:
        assert (f.tensor, f.op) == ("output", "aten.log.default")
    assert f.source is not None and f.source.endswith(f"test_watch_backward.py:{_line_of(bad)}")
    # every output and gradient up to the error is the unwatched run's, bit for bit
    assert len(outs) == 6 and all(zoo.bit_equal(a, b) for a, b in zip(outs, plain))
    # the bad step was not applied: the weights are those after step 1 ...
    torch.manual_seed(0)
    two = _CkptNet(reentrant)
    opt = torch.optim.Adam(two.parameters(), 1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        ((two(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert same_state(state, snapshot(two))
    # ... and the replay put torch's checkpoint back as it was
    from torch.utils.checkpoint import CheckpointFunction

    assert "apply" not in CheckpointFunction.__dict__


def _line_of(bad: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(_CkptBlock.forward)
    word = "torch.sqrt" if bad == "backward" else "torch.log"
    return start + next(i for i, line in enumerate(src) if word in line)


def test_hf_gpt2_reentrant_gradient_checkpointing_names_the_module_of_a_backward_nan() -> None:
    """transformers' ``gradient_checkpointing_enable`` (``use_reentrant=True``): a sqrt at 0 in
    one block's MLP activation is found there, in the backward."""
    pytest.importorskip("transformers")

    class SqrtAct(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x - x.amin(-1, keepdim=True))

    model = zoo.gpt2(dropout=0.0)
    model.transformer.h[1].mlp.act = SqrtAct()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.tensor, f.op, f.cause) == (
        "backward", "transformer.h.1.mlp.act", "grad_input[0]", "SqrtBackward0", "created"), f


def _one_step_finding(model: nn.Module, loss: Any, mode: str = "full") -> nanhunt.Finding:
    """The finding of one watched SGD step whose ``loss()`` backward goes non-finite (it must raise)."""
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        loss().backward()
        opt.step()
    return err.value.finding


class _GatedBlock(nn.Module):
    """``fc(h) * sqrt(gate + 0 * h)``: with a gate of 0, d sqrt = inf in the block's own code, and
    ``0 * inf`` = NaN reaches ``h`` through ``0 * h``; ``fc``'s own input gradient stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.fc(h) * torch.sqrt(gate + 0 * h)


class _GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.blk, self.c = nn.Linear(4, 8), _GatedBlock(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.blk(torch.relu(self.a(x[:, :4])), x[:, 4:5]))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_born_in_a_parents_own_code_is_not_blamed_on_the_child_sharing_its_input(mode: str) -> None:
    """``h``'s gradient is the sum over its uses: the child ``fc`` takes ``h`` too, but its
    backward made nothing non-finite (its output's gradient and its own share of ``h``'s are
    finite): the block's own sqrt did."""
    torch.manual_seed(0)
    model = _GatedNet()
    x = torch.randn(6, 5)
    x[:, 4] = 1.0
    x[3, 4] = 0.0
    f = _one_step_finding(model, lambda: (model(x) ** 2).mean(), mode)
    assert (f.phase, f.module, f.module_type, f.op, f.cause) == (
        "backward", "blk", "_GatedBlock", "SqrtBackward0", "created"), f
    assert f.tensor == "SqrtBackward0.grad_input[0]" and f.value == float("inf")
    assert f.source is not None
    file, line = f.source.rsplit(":", 1)
    assert "torch.sqrt(gate + 0 * h)" in linecache.getline(file, int(line))


def test_a_gradient_born_in_the_first_child_of_a_container_stays_the_childs() -> None:
    """The container's input is its first child's: that child still owns what its backward made."""
    torch.manual_seed(0)

    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    class Gate(nn.Module):  # exact zeros, and a backward that passes 0 * inf = NaN on
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (x > 0)

    # the inner container's input is Sqrt's
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Sequential(Sqrt(), nn.Linear(4, 4)), nn.Linear(4, 1))
    f = _one_step_finding(model, lambda: model(torch.randn(8, 4)).sum())
    assert (f.phase, f.module, f.tensor, f.op) == ("backward", "2.0", "grad_input[0]", "SqrtBackward0"), f


class _SqrtOfZero(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h * 0)  # d sqrt at 0 = inf, times the 0: NaN into h's gradient


class _Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), _SqrtOfZero()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.a(h) + self.b(h)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_born_in_one_of_two_siblings_sharing_an_input_is_named_by_that_sibling(mode: str) -> None:
    """``a(h) + b(h)``: h's gradient is the sum of both; ``b`` made the NaN, not ``a``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Siblings(), nn.Linear(8, 1))
    f = _one_step_finding(model, lambda: model(torch.randn(4, 8)).sum(), mode)
    assert (f.phase, f.module, f.op, f.cause) == ("backward", "1.b", "SqrtBackward0", "created"), f


class _RootDistances(nn.Module):
    """The root's own code takes ``h`` too: ``b(h)`` plus the sum of pairwise distances of ``h``'s
    rows, whose sqrt at a distance of 0 (each row's own) has an infinite derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) + torch.sqrt(((h[:, None] - h[None]) ** 2).sum(-1)).sum(1, keepdim=True)  # the root's sqrt


@pytest.mark.parametrize(("mode", "grad_hooks"), [("full", False), ("full", True), ("sentinel", False), ("ops", True)])
def test_a_gradient_born_in_the_roots_own_code_is_not_blamed_on_a_child_sharing_its_tensor(
        mode: str, grad_hooks: bool) -> None:
    """``b`` takes ``h`` and the root's own code takes it too: ``h``'s gradient (what a hook on the
    tensor sees) sums both uses, but ``b``'s backward made nothing non-finite: the root's sqrt did.
    No other call takes ``h``, so only the graph tells that its gradient has another use."""
    torch.manual_seed(0)
    model = _RootDistances()
    before = snapshot(model)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode, grad_hooks=grad_hooks):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.module_type, f.op, f.cause) == ("backward", "", "_RootDistances", "SqrtBackward0",
                                                                 "created"), f
    assert f.source is not None and "the root's sqrt" in linecache.getline(*_file_line(f.source))
    assert same_state(before, snapshot(model))


class _Remembers(nn.Module):
    """Reads a tensor kept on it (a memory the caller set), not given as an argument."""

    mem: torch.Tensor

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + torch.sqrt(((self.mem[:, None] - self.mem[None]) ** 2).sum(-1)).sum(1, keepdim=True)  # its sqrt


class _WithMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(3, 1), _Remembers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.c.mem = h
        return self.c(self.b(h))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_born_in_a_module_reading_a_tensor_kept_on_it_is_that_modules(mode: str) -> None:
    """``c`` reads ``h`` from an attribute, ``b`` takes it as its input: ``c``'s sqrt made the NaN in
    ``h``'s gradient, and ``b`` (which no other call shares ``h`` with) is innocent."""
    torch.manual_seed(0)
    model = _WithMemory()
    f = _one_step_finding(model, lambda: model(torch.randn(5, 4)).sum(), mode)
    assert (f.phase, f.module, f.module_type, f.op, f.cause) == ("backward", "c", "_Remembers", "SqrtBackward0",
                                                                 "created"), f
    assert f.source is not None and "its sqrt" in linecache.getline(*_file_line(f.source))


def _file_line(source: str) -> tuple[str, int]:
    file, line = source.rsplit(":", 1)
    return file, int(line)


@pytest.mark.parametrize("where", ["ff", "sa"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_born_in_a_pre_norm_encoder_layers_own_code_is_the_layers(mode: str, where: str) -> None:
    """nn.TransformerEncoderLayer(norm_first=True): the layer's own ``_ff_block`` / ``_sa_block``
    takes ``norm2``'s / ``norm1``'s output as ``linear1`` / ``self_attn`` do; a sqrt at 0 there made
    the NaN, and the sibling that only shares that tensor (it was blamed) is innocent."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    own = model.layers[1]
    block = own._ff_block if where == "ff" else own._sa_block

    def with_sqrt(y: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return block(y, *args, **kwargs) + torch.sqrt(y * y * 0)  # the layer's own sqrt

    setattr(own, f"_{where}_block", with_sqrt)
    x = torch.randn(4, 6, 16)
    f = _one_step_finding(model, lambda: model(x).pow(2).mean(), mode)
    assert (f.phase, f.module, f.module_type, f.op, f.cause) == (
        "backward", "layers.1", "TransformerEncoderLayer", "SqrtBackward0", "created"), f
    assert f.source is not None and "the layer's own sqrt" in linecache.getline(*_file_line(f.source))


def _gpt2_block_with_sqrt(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """GPT2Block's forward with one more term in its own code, on the residual stream that ``ln_2``
    takes too."""
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), *args, **kwargs)
    residual = attn_output + residual
    return residual + self.mlp(self.ln_2(residual)) + torch.sqrt(residual * residual * 0)  # the block's sqrt


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_born_in_a_gpt2_blocks_own_code_is_the_blocks_not_its_layer_norms(mode: str) -> None:
    pytest.importorskip("transformers")
    model = zoo.gpt2(dropout=0.0)
    blk = model.transformer.h[0]
    blk.forward = _gpt2_block_with_sqrt.__get__(blk)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    f = _one_step_finding(model, lambda: model(input_ids=ids, labels=ids).loss, mode)
    assert (f.phase, f.module, f.module_type, f.op, f.cause) == (
        "backward", "transformer.h.0", "GPT2Block", "SqrtBackward0", "created"), f  # (was: transformer.h.0.ln_2)
    assert f.source is not None and "the block's sqrt" in linecache.getline(*_file_line(f.source))


class _SqrtAtZeroAct(nn.Module):
    """An activation whose backward is 0 * inf = NaN: sqrt(x * x * 0) is 0, its derivative inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x * 0) + torch.tanh(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_bert_backward_nan_is_localized_despite_its_integer_buffers(mode: str) -> None:
    """BERT's embedding saves a view of its ``token_type_ids`` buffer for the backward; the replay
    put the buffers back with a version bump before running its backward, which then failed
    ("modified by an inplace operation"): every BERT backward NaN was only a weight.grad finding."""
    pytest.importorskip("transformers")
    model = zoo.bert(dropout=0.0)
    model.encoder.layer[1].intermediate.intermediate_act_fn = _SqrtAtZeroAct()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.op, f.cause) == (
        "backward", "encoder.layer.1.intermediate.intermediate_act_fn", "SqrtBackward0", "created"), f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_left_from_before_are_not_judged_by_an_inference_loop(mode: str) -> None:
    # a model whose .grad still holds NaN from an earlier, diverged run, watched while it only
    # predicts: every root call was a 'grad' finding "created ... while being accumulated", and raise
    # mode stopped the inference loop
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].weight.grad = torch.full_like(model[0].weight, float("nan"))
    model.eval()
    with torch.no_grad(), nanhunt.watch(model, mode=mode) as hunt:
        for _ in range(4):
            model(torch.randn(4, 4))
    assert hunt.findings == []
    with nanhunt.watch(model, mode=mode, on_find="record") as hunt:  # a backward in the step: judged
        model.train()
        model(torch.randn(4, 4)).sum().backward()
        model(torch.randn(4, 4))
    assert [f.phase for f in hunt.findings] == ["grad"]


class _RMSE(nn.Module):
    """Returns (loss, preds) as Hugging Face models do with labels=: the loss made from the
    predictions inside the forward. A batch with no labelled rows: sqrt(0), whose gradient is inf."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        preds = self.body(x).squeeze(-1)
        mse = ((preds - labels) ** 2 * mask).sum() / mask.sum().clamp(min=1)
        return torch.sqrt(mse), preds


def test_a_gradient_born_in_the_loss_a_model_computes_itself_is_the_models() -> None:
    # the predictions are an output and are used inside the forward: their gradient comes from the
    # model's own sqrt. It was "fed in by the loss code after the model" (cause input, no op, and a
    # hint to hunt.check the loss) though no code ran after the model
    torch.manual_seed(0)
    model = _RMSE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for step in range(3):
            mask = torch.zeros(16) if step == 1 else (torch.rand(16) > 0.3).float()
            loss, _ = model(torch.randn(16, 6), torch.randn(16), mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("backward", "", 1, "created", "SqrtBackward0"), f
    assert f.source is not None and f.source.endswith(f":{_RMSE.forward.__code__.co_firstlineno + 3}"), f


class _GapRoot(nn.Module):
    """sqrt(|a - b|^2) in the root's own code: a row with a == b gives sqrt at 0 in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 3)
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(x[:, :2]), self.proj(x[:, 2:4])
        return self.head(((a - b) ** 2).sum(-1, keepdim=True).sqrt())


class _Gap(nn.Module):
    """sqrt at 0 in the module's own code when its input's halves are equal; its input is data
    (needs no gradient), so the finding is named by the sqrt node, not by a grad_input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + ((x[:, :2] - x[:, 2:]) * h).pow(2).sum(-1, keepdim=True).sqrt()


class _TwoGaps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gap = _Gap()
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gap(x[:, :4]) + self.gap(x[:, 4:]))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize(("where", "module", "call"), [("root", "", 1), ("first", "gap", 2), ("second", "gap", 3)])
def test_a_gradient_named_by_its_node_in_the_second_micro_batch_has_that_calls_number(
        mode: str, where: str, module: str, call: int) -> None:
    # two micro-batches, one optimizer step; sqrt at 0 only in micro-batch 2's backward, in the
    # root's own code or in one of the two calls of a shared child. Findings named by their
    # autograd node said call=0, as if made by micro-batch 1 (the forward numbers them 1, 2, 3)
    torch.manual_seed(0)
    model: nn.Module = _GapRoot() if where == "root" else _TwoGaps()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 8, generator=g) for _ in range(2)]
    at = 4 if where == "second" else 0
    xs[1][1, at + 2:at + 4] = xs[1][1, at:at + 2]
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for x in xs:
            model(x).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause, f.step) == ("backward", module, "SqrtBackward0", "created", 0)
    assert f.call == call


def test_a_retry_of_the_same_batch_after_the_error_is_the_same_step() -> None:
    # a loop that catches the error and runs the same batch again (a lower learning rate, say),
    # then goes on to the next batch: a retry is the same step, the batch it gave up on counts
    xs = _batches(bad_at=2, n=6)
    xs[4][1, 2:] = xs[4][1, :2]
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    raised = []
    with nanhunt.watch(m, opt) as hunt:
        for step, x in enumerate(xs):
            for _attempt in range(2):
                try:
                    m(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    break
                except nanhunt.NonFiniteError as e:
                    raised.append((step, e.finding.step))
                    opt.zero_grad()
    assert raised == [(2, 2), (2, 2), (4, 4), (4, 4)]
    assert hunt.step == 6 and all(torch.isfinite(p).all() for p in m.parameters())


class _SqrtEmbedding(nn.Module):
    """A bag-of-words model whose embedding takes sparse gradients (``sparse=True``) and a sqrt of
    its rows: a row that reaches exactly 0 has a finite output and an infinite gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sqrt(self.emb(idx)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("watched", [True, False])
def test_a_sparse_gradient_made_infinite_by_sqrt_at_zero_is_found(mode: str, watched: bool) -> None:
    # sparse gradients (nn.Embedding(sparse=True), SGD takes them) are judged by their values as
    # the dense ones are, whether the optimizer is given to watch() or not (then judged as its
    # step begins): never an internal fault that switches the hunt off (raise mode: InternalError
    # out of the user's run), never an update from them
    torch.manual_seed(0)
    m = _SqrtEmbedding()
    with torch.no_grad():
        m.emb.weight.abs_()
        m.emb.weight[7, 2] = 0.0  # sqrt(0) = 0, d sqrt/dx = inf
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    batches = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), torch.tensor([1, 7, 2]), torch.tensor([0, 1])]
    before = None
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt if watched else None, mode=mode):
        for i, idx in enumerate(batches):
            m(idx).sum().backward()
            if i == 2:
                before = snapshot(m)
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert f.phase == "backward" and f.step == 2, f
    assert math.isinf(f.value), f
    assert before is not None and same_state(snapshot(m), before), "a step with non-finite gradients was applied"


class _ExpLSTM(nn.Module):
    """exp of a projection into an LSTM: a large input overflows exp to +inf, the LSTM's gates
    saturate and its output stays finite; its backward multiplies a 0 gradient by that inf."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.lstm = nn.LSTM(6, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.proj(x).exp())[0]


class _ExpTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x).exp()))


def _saturated_finding(model: Any, mode: str, at: tuple[int, ...], value: float) -> Any:
    """Train ``model`` 3 steps on (2, 5, 4) batches, ``value`` written at ``at`` in step 1's: the
    first finding (raise mode)."""
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for step in range(3):
            x = torch.randn(2, 5, 4)
            if step == 1:
                x[at] = value
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return ei.value.finding


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("model", [_ExpLSTM, _ExpTanh], ids=["exp->LSTM", "exp->tanh"])
def test_a_forward_overflow_a_saturating_op_hid_is_fed_into_the_backward_not_born_there(model: Any, mode: str) -> None:
    # the forward's +inf never reaches a module output (tanh, the LSTM's gates saturate), so the
    # first non-finite value any probe sees is the backward's 0 * inf: it was reported 'created'
    # there, with the '0/0 from finite inputs' hint. It came in with the forward's value
    f = _saturated_finding(model, mode, at=(0, 2), value=200.0)
    assert (f.phase, f.step, f.cause) == ("backward", 1, "input"), str(f)
    assert "overflow" in f.hint and "from finite inputs" not in f.hint, f.hint


class _DataLSTM(nn.Module):
    """An LSTM over the data itself: a +inf in the data saturates its gates (its output stays finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("model", [_DataLSTM, _ExpLSTM], ids=["data->LSTM", "exp->LSTM"])
def test_an_inf_in_the_data_that_the_lstm_gates_hid_is_told_as_the_data_not_as_an_overflow(model: Any, mode: str) -> None:
    # a corrupt sample (+inf) fed to an LSTM: its gates saturate, the forward is finite and the
    # backward's 0 * inf is the first NaN; the hint sent the user to find "the forward op that
    # overflowed" (clamp it, softplus) when no op overflowed: the data held the inf
    if model is _DataLSTM:
        f = _saturated_finding(model, mode, at=(1, 2, 0), value=float("inf"))  # a corrupt value in the data
    else:
        f = _saturated_finding(model, mode, at=(0, 2), value=200.0)  # exp overflows to +inf in the model
    assert (f.phase, f.step, f.cause) == ("backward", 1, "input"), str(f)
    if model is _DataLSTM:
        assert "non-finite input (the data" in f.hint and "overflowed" not in f.hint, f.hint
    else:  # (an overflow in the model: the hint stays the overflow's)
        assert "overflowed" in f.hint and "the data" not in f.hint, f.hint


def test_a_gradient_that_explodes_through_a_gru_is_told_as_exploding_gradients_to_clip() -> None:
    # recurrent weights grown large (a diverging run, condensed) and a huge gradient reaching the
    # output: the backward through time multiplies it past float32's max at a MulBackward0 inside
    # the GRU; the hint was the generic "an overflow, x/0 or log(0)", no word of clipping
    torch.manual_seed(0)
    gru = nn.GRU(4, 16, batch_first=True)
    with torch.no_grad():
        gru.weight_hh_l0.mul_(25.0)
        gru.weight_ih_l0.mul_(25.0)
    with nanhunt.watch(gru, on_find="record") as hunt:
        (gru(torch.randn(2, 50, 4))[0].mean() * 1e36).backward()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.module_type, f.cause) == ("backward", "", "GRU", "created"), f
    assert math.isinf(f.value) and "exploding gradients" in f.hint and "clip_grad_norm_" in f.hint, f.hint


def test_a_gradient_that_explodes_inside_a_fused_lstm_kernel_is_told_as_exploding_gradients_to_clip() -> None:
    # the LSTM's backward runs in one kernel (MkldnnRnnLayerBackward0 on the CPU): the overflow inside
    # it comes out as nan, and the hint was the generic "0/0, inf - inf ... a fully masked row"
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 16, batch_first=True)
    with torch.no_grad():
        lstm.weight_hh_l0.mul_(30.0)
    with nanhunt.watch(lstm, on_find="record") as hunt:
        (lstm(torch.randn(2, 60, 4, generator=torch.Generator().manual_seed(0)))[0].mean() * 1e36).backward()
    f = hunt.first
    assert f is not None and (f.phase, f.module_type, f.cause) == ("backward", "LSTM", "created"), f
    assert math.isnan(f.value) and "exploding gradients" in f.hint and "clip_grad_norm_" in f.hint, f.hint


def test_a_relu_rnn_whose_hidden_state_explodes_along_the_sequence_is_told_as_such() -> None:
    # nn.RNN(nonlinearity="relu") with recurrent weights grown large: the hidden state is multiplied
    # by weight_hh at every time step and passes float32's max in the forward. The remedy read "look
    # for exploding weights or inputs", no word of the recurrence, its nonlinearity or its init
    torch.manual_seed(0)
    rnn = nn.RNN(4, 16, nonlinearity="relu", batch_first=True)
    with torch.no_grad():
        rnn.weight_hh_l0.mul_(10.0)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(rnn, opt):
        rnn(torch.randn(2, 300, 4, generator=torch.Generator().manual_seed(0)))[0].sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module_type, f.cause, f.step) == ("forward", "RNN", "created", 0) and math.isinf(f.value), f
    assert "at every time step" in f.hint and "nonlinearity='relu'" in f.hint and "orthogonal_" in f.hint, f.hint


class _RMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)  # @rms-sqrt: its gradient at 0 is inf


class _DecoderStep(nn.Module):
    """One time step of a decoder, called by the loop once per target token with the hidden state
    it returned (teacher forcing); a padding token's all-zero embedding (its row zeroed by hand, no
    padding_idx) makes the norm's input 0."""

    def __init__(self, into_hidden: bool) -> None:
        super().__init__()
        self.into_hidden = into_hidden
        self.emb = nn.Embedding(10, 8)
        with torch.no_grad():
            self.emb.weight[0] = 0.0
        self.lin = nn.Linear(8, 8)
        self.norm = _RMSNorm()
        self.cell = nn.GRUCell(8, 8)

    def forward(self, tok: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        e = self.emb(tok)
        z = self.norm(e + self.lin(h) * (tok != 0)[:, None] if self.into_hidden else e)
        return self.cell(z, h)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("into_hidden", [False, True], ids=["into-embedding", "into-hidden"])
def test_a_backward_nan_born_in_a_later_call_of_a_decoder_stepped_by_the_loop_is_found_there(
        mode: str, into_hidden: bool) -> None:
    # the model is called once per time step, each call given the hidden state the call before
    # returned. Each call's backward replay ran into the step's graph through that input, already
    # run and freed ("backward through the graph a second time"): the finding was the embedding's
    # weight.grad with no op. With the NaN handed on to the hidden state, the first call (its
    # gradient bad last) was blamed: "made by the code after the model (the loss)"
    torch.manual_seed(0)
    m = _DecoderStep(into_hidden)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    tgt = torch.tensor([[3, 4, 0, 5], [2, 6, 7, 1]])  # a padding token at time step 2
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        h, loss = torch.zeros(2, 8), torch.zeros(())
        for t in range(tgt.shape[1]):
            h = m(tgt[:, t], h)
            loss = loss + h.pow(2).mean()
        loss.backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.call, f.cause, f.op) == ("backward", "norm", 0, 2, "created", "SqrtBackward0"), str(f)
    import inspect

    src, start = inspect.getsourcelines(_RMSNorm.forward)
    want = start + next(i for i, text in enumerate(src) if "@rms-sqrt" in text)
    assert f.source is not None and f.source.endswith(f"test_watch_backward.py:{want}"), f.source
    assert "gradient of sqrt at 0" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_inf_gradient_that_clip_grad_norm_turns_into_nan_is_found_at_the_backward_with_a_line(mode: str) -> None:
    # a huge loss scale: the last layer's bias gradient passes float32's max, and clip_grad_norm_
    # (error_if_nonfinite=False) multiplies every gradient by max_norm / inf = 0, inf * 0 = nan. The
    # finding is the backward's inf, not the clip; its node was made inside nn.Linear (torch's own
    # code), and its source was None where a forward finding names the line that called the model
    import inspect

    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    before = snapshot(m)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        out = m(x)
        at = f"{__file__}:{inspect.currentframe().f_lineno - 1}"  # (the line above)
        (out * 3e37).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=False)
        assert torch.isnan(m[3].bias.grad).all(), "set-up: the clip made nan of the inf"
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause, f.step) == ("backward", "3", "AddmmBackward0", "created", 0), f
    assert f.value == math.inf and f.source == at, (f.source, at)
    assert same_state(snapshot(m), before)


def _nan_grad_input(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    g = grad_input[0]
    return (g / (g - g),)  # 0/0 and x/0: the hook's own arithmetic


def _nan_grad_output(module: nn.Module, grad_output: Any) -> Any:
    return (grad_output[0].log() * 0,)  # log of a negative gradient: nan


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("kind", ["register_full_backward_hook", "register_full_backward_pre_hook"])
def test_a_gradient_made_non_finite_by_a_users_backward_hook_names_that_module_and_hook(mode: str, kind: str) -> None:
    """A module's full backward (pre-)hook that returns non-finite gradients: the finding is that
    module's, at the hook's line, with a hint naming the hook. It was the root's ('' , no line):
    the node the hook runs in wraps the module's inputs (or outputs), outside its own graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    hook = _nan_grad_input if kind == "register_full_backward_hook" else _nan_grad_output
    getattr(model[2], kind)(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause, f.op) == ("backward", "2", "created", "BackwardHookFunctionBackward"), f
    line = hook.__code__.co_firstlineno
    assert f.source == f"{__file__}:{line}", f.source
    assert hook.__qualname__ in f.hint, f.hint
    assert same_state(snapshot(model), before)  # raise: the step was not applied


def _normalize(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm()  # 0/0 for a zero gradient


def _normalize_in_place(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.div_(p.grad.norm())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_made_non_finite_by_a_hook_on_the_parameter_names_the_hook(mode: str, kind: str) -> None:
    """A hook of the user's on a weight that normalises its gradient (0/0 on a batch whose loss is
    masked to 0): the grad finding's source is the hook's line and its hint names the hook. It had
    no line, and its hint blamed gradient accumulation over several backward passes, of which the
    step had one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    hook = _normalize if kind == "register_hook" else _normalize_in_place
    getattr(model[2].weight, kind)(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        for step in range(3):
            loss = model(torch.randn(5, 4)).sum() * (0.0 if step == 1 else 1.0)  # a batch masked out
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.tensor, f.step, f.cause) == ("grad", "2", "weight.grad", 1, "created"), f
    assert f.source == f"{__file__}:{hook.__code__.co_firstlineno}", f.source
    assert hook.__qualname__ in f.hint and "accumulated" not in f.hint, f.hint


def _scale_by_inf(g: torch.Tensor) -> torch.Tensor:
    return g * float("inf")  # a gradient-scaling hook with its scale gone to inf


class _HookedBlock(nn.Module):
    """A residual block whose forward hooks its LayerNorm's input (``h.register_hook``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 2
        if h.requires_grad:
            h.register_hook(_scale_by_inf)
        return self.ln(h) + x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_made_non_finite_by_a_hook_on_an_activation_names_the_hook_not_the_module_it_feeds(mode: str) -> None:
    """A hook registered in a forward on an activation (the LayerNorm's input) that scales its
    gradient by inf: the finding was the LayerNorm's grad_input, "born here", with no line and a
    hint of an overflow or x/0 in its backward, which made a finite gradient. It now names the
    hook and its line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _HookedBlock(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        F.cross_entropy(model(torch.randn(6, 4)), torch.randint(0, 2, (6,))).backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.tensor, f.cause) == ("backward", "1.ln", "grad_input[0]", "created"), f
    assert f.source == f"{__file__}:{_scale_by_inf.__code__.co_firstlineno}", f.source
    assert "_scale_by_inf" in f.hint and "overflow" not in f.hint, f.hint
    assert same_state(snapshot(model), before)  # raise: the step was not applied


def _unit_rows(g: torch.Tensor) -> torch.Tensor:
    return g / g.norm(dim=1, keepdim=True)  # a per-row gradient normaliser: 0/0 on a row whose gradient is 0


class _MaskedPool(nn.Module):
    """Its own forward hooks an activation that only its own code takes (the mask), not a child."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        h.register_hook(_unit_rows)  # @mask-hook
        return self.head(torch.tanh(h) * keep)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_hook_on_an_activation_that_only_the_module_s_own_code_takes_is_named_with_its_line(mode: str) -> None:
    """A row masked out by the module's own code has a zero gradient, which the hook normalises to
    0/0. nanhunt's hook on ``enc``'s output saw the gradient before the user's hook ran, so every
    module's gradients looked finite and the finding was ``enc.weight.grad``, "inf * 0 in a weight
    gradient, or a gradient written after backward". It now names the hook and the line that
    registered it."""
    torch.manual_seed(0)
    model = _MaskedPool()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    keep = torch.tensor([[1.0], [0.0], [1.0]])
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        model(torch.randn(3, 4), keep).sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause) == ("backward", "", "created"), f
    want = next(i for i in range(1, 10**5) if linecache.getline(__file__, i).rstrip().endswith("# @mask-hook"))
    assert f.source == f"{__file__}:{want}", f.source
    assert "_unit_rows" in f.hint and "register_hook" in f.hint, f.hint
    assert same_state(snapshot(model), before)  # raise: the step was not applied


def _log_norm(g: torch.Tensor) -> None:  # a harmless hook: it reads the gradient, returns None
    float(g.norm())


def test_a_harmless_hook_on_a_parameter_is_not_blamed_alone_for_a_gradient_summed_past_float16s_max() -> None:
    """Four float16 backward passes summed into a weight gradient past 65504, a logging hook on that
    weight: the finding named the hook's line as its source and told the user to check the hook
    first. Several backward passes were summed: the hint now names both, and no source is claimed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(0.01)
        model[0].bias.zero_()
    model[0].weight.register_hook(_log_norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.full((2, 4), 100.0, dtype=torch.float16)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for _ in range(4):
            (model(x).sum() * 100.0).backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.tensor) == ("grad", "weight.grad"), f
    assert f.source is None and "4 backward passes" in f.hint and "_log_norm" in f.hint, (f.source, f.hint)


class _Whiten(nn.Module):
    """ZCA whitening of a batch: its covariance's eigenvectors (``eigh``, or ``svd``'s singular vectors)
    scaled by 1/sqrt(eigenvalue)."""

    def __init__(self, how: str = "eigh") -> None:
        super().__init__()
        self.how = how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        hc = h - h.mean(0, keepdim=True)
        cov = hc.T @ hc / h.shape[0] + 1e-3 * torch.eye(h.shape[1])
        if self.how == "eigh":
            vals, vecs = torch.linalg.eigh(cov)
        else:
            vecs, vals, _ = torch.linalg.svd(cov)
        return hc @ (vecs @ torch.diag(vals.rsqrt()) @ vecs.T)


@pytest.mark.parametrize("how", ["eigh", "svd"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_eigh_backward_at_a_degenerate_spectrum_is_told_as_equal_eigenvalues(mode: str, how: str) -> None:
    # a batch of one sample repeated: its covariance is eps * I, every eigenvalue equal, and the
    # eigenvectors' gradient divides by their gaps (0). The hint was the generic "typically 0/0,
    # inf - inf or inf * 0 ... a softmax over a fully masked row"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), _Whiten(how), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(2):
            x = torch.randn(16, 8) if step == 0 else torch.randn(1, 8).expand(16, 8).clone()
            F.mse_loss(model(x), torch.randn(16, 1)).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    node = "LinalgEighBackward0" if how == "eigh" else "LinalgSvdBackward0"
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("backward", "1", 1, "created", node), str(f)
    assert ("eigenvalues" if how == "eigh" else "singular values") in f.hint and "fully masked" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_regulariser_computed_before_the_forward_is_named_in_the_grad_hint(mode: str) -> None:
    # a condition-number penalty s_max / s_min on fc.weight, computed before the model's call (code
    # nanhunt does not record), at a weight with a zero row: s_min = 0, the term inf, its gradient nan.
    # Only fc.weight.grad holds it; the hint named only "inf * 0 in a weight gradient, or a gradient
    # written after backward", no word of a loss term on the weight itself
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    model[0].weight[3].zero_()
            s = torch.linalg.svdvals(model[0].weight)
            penalty = s[0] / s[-1]
            (model(torch.randn(8, 6)).pow(2).mean() + 1e-3 * penalty).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step) == ("grad", "0", "weight.grad", 1), str(f)
    assert "regulariser" in f.hint and "before the model's call" in f.hint, f.hint


class _TreeCell(nn.Module):
    """A recursive tree net's cell: a parent call begins before its children and ends after them.
    ``bad``: which internal node (in the order they end) takes log(h - h), whose -inf a tanh hides
    from the forward: its backward makes 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.comb, self.leaf = nn.Linear(16, 8), nn.Linear(4, 8)

    def forward(self, tree: Any, bad: list[int]) -> torch.Tensor:
        if isinstance(tree, torch.Tensor):
            return torch.tanh(self.leaf(tree))
        h = self.comb(torch.cat([self(tree[0], bad), self(tree[1], bad)], -1))
        if bad[0] == 0:
            h = torch.log(h - h)
        bad[0] -= 1
        return torch.tanh(h)


@pytest.mark.parametrize("grad_hooks", [False, True])
@pytest.mark.parametrize(("bad", "call"), [(0, 3), (1, 1), (2, 6), (3, 0)])
def test_a_backward_nan_in_a_recursive_module_names_its_call_as_the_forward_does(bad: int, call: int, grad_hooks: bool) -> None:
    # calls begin in the order 0 (root), 1, 2 (leaf), 3, 4, 5, 6, 7, 8 and end in the order 2, 4, 5,
    # 3, 1, 7, 8, 6, 0: the backward finding counted the module's calls in the order they ended
    # (call 7 for the node that began sixth), a forward finding in the order they began
    class Tree(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell, self.out = _TreeCell(), nn.Linear(8, 1)

        def forward(self, tree: Any, bad: int) -> torch.Tensor:
            return self.out(self.cell(tree, [bad]))

    torch.manual_seed(0)
    model = Tree()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, grad_hooks=grad_hooks):
        for step in range(2):
            leaves = [torch.randn(1, 4) for _ in range(5)]
            tree = ((leaves[0], (leaves[1], leaves[2])), (leaves[3], leaves[4]))
            model(tree, bad if step == 1 else -1).sum().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.call, f.op) == ("backward", "cell", 1, call, "LogBackward0"), str(f)


class _LSQ(nn.Module):
    """An LSQ fake-quantizer (quantization-aware training): round(x / s) * s with a learned step
    size s and a straight-through round."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.clamp(x / self.s, -8, 7)
        return ((q.round() - q).detach() + q) * self.s


class _QATNet(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.inline = nn.Linear(8, 16), nn.Linear(16, 1), inline
        self.wq = _LSQ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inline:  # (the quantizer's code in the root's own forward)
            q = torch.clamp(self.fc1.weight / self.wq.s, -8, 7)
            w = ((q.round() - q).detach() + q) * self.wq.s
        else:
            w = self.wq(self.fc1.weight)
        return self.fc2(torch.tanh(F.linear(x, w, self.fc1.bias)))


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fake_quant_scale_that_reached_0_is_told_as_a_learned_scale_in_backward(mode: str, inline: bool) -> None:
    # the weight's x/0 = inf is clamped to the quantization range, so the forward is finite; the
    # backward divides clamp's 0 gradient by s = 0. The hint was DivBackward0's "overflows (-x/d^2
    # in d, 1/d in x)": no word of the learned scale, nor of keeping it positive
    torch.manual_seed(0)
    model = _QATNet(inline)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model.wq.s.zero_()
            F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("backward", "" if inline else "wq", 2, "created",
                                                          "DivBackward0"), str(f)
    assert math.isnan(f.value) and "learned parameter" in f.hint and "clamp_min(eps)" in f.hint, f.hint
    assert model.wq.s.item() == 0.0 and torch.isfinite(model.fc1.weight).all()  # (never updated from it)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_division_by_a_learned_scale_that_reached_0_is_told_as_such_in_forward(mode: str) -> None:
    # an activation quantizer after a ReLU: its zeros divided by s = 0 are 0/0 in the forward. The hint
    # was the generic "dividing by a count that is 0, ... clamp(min=1) for a count"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _LSQ(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model[2].s.zero_()
            F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "2", 2, "created", "aten.div.Tensor"), str(f)
    assert "learned parameter" in f.hint and "count" not in f.hint, f.hint
