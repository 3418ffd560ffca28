"""optimizer.step(closure): forward and backward run inside step(); the check must still come
after them and before the update (LBFGS, Lightning's automatic optimization)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("as_kwarg", [False, True])
def test_closure_step_checked_before_update(as_kwarg):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt) as hunt:
            for step in range(4):
                x = torch.randn(3, 4)
                if step == 2:
                    x[1, 2] = float("nan")

                def closure(x=x):
                    opt.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    return loss

                before = [p.detach().clone() for p in model.parameters()]
                if as_kwarg:
                    opt.step(closure=closure)
                else:
                    opt.step(closure)
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "0", 2, "input")
    assert hunt.step == 2
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # never applied


def test_lbfgs_runs_clean_with_its_many_closure_calls():
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    with nanhunt.watch(model, optimizer=opt) as hunt:
        for _ in range(3):
            opt.step(closure)
    assert hunt.findings == [] and hunt.step == 3
