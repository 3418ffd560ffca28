"""Backward and gradients: the module whose backward made the first non-finite gradient, and
accumulated ``.grad`` that overflowed. In raise mode the weights are never updated from them."""

from __future__ import annotations

import copy

import pytest
import torch
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
