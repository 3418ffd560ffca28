"""mode="ops": every aten op is checked from the start; the op is known even without a replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


class ExpOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.exp(self.a(x) * 100))


class SqrtAtZero(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * 0).sum(-1, keepdim=True) + x


@pytest.mark.parametrize("replay", [True, False])
def test_ops_mode_names_the_forward_op(replay):
    torch.manual_seed(0)
    model = ExpOverflow()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, mode="ops", replay=replay):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.op, f.cause) == ("forward", "", "aten.exp.default", "created" if replay else "unknown")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_ops_mode_names_the_backward_node_without_replay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, mode="ops", replay=False):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    f = ei.value.finding
    assert f.phase == "backward" and f.op == "SqrtBackward0"


def test_ops_mode_clean_run_is_bit_identical():
    def run(watch: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.GELU(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters())
        hunt = nanhunt.watch(model, optimizer=opt, mode="ops") if watch else None
        for _ in range(3):
            loss = model(torch.randn(5, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if hunt:
            hunt.close()
            assert hunt.findings == []
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_ops_mode_keeps_a_compiled_model_compiled(how):
    # the op mode on the dispatch stack made dynamo run every frame eagerly: the user's compiled
    # model silently ran uncompiled while watched (Inductor's outputs no longer bit for bit, a NaN
    # only the compiled graph makes never made); the compiled graph now runs, and a NaN it makes
    # is still found at its module
    import warnings

    ran: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
        def run(*args):
            ran.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ExpOverflow()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if how == "torch.compile":
        fn = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        fn = model
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanhunt.watch(model, optimizer=opt, mode="ops", on_find="record") as hunt:
                for step in range(3):
                    fn(torch.randn(3, 4) * (0.01 if step < 2 else 100.0)).sum().backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        torch._dynamo.reset()
    assert len(ran) >= 3  # every call ran the compiled graph
    f = hunt.first
    assert f is not None and (f.phase, f.step, f.op) == ("forward", 2, "aten.exp.default"), f
    assert torch._C._len_torch_dispatch_stack() == 0
