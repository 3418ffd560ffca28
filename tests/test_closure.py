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


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_lbfgs_state_mid_line_search_is_not_an_optimizer_finding_of_the_last_step(mode: str) -> None:
    """LBFGS calls the closure several times inside one step(); a NaN batch at step 3 is found at
    each call, and from the second call on its state (prev_flat_grad) holds what this step's
    update made of the NaN gradients: sentinel mode reported that as an 'optimizer' finding of
    step 2, first in the list."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        for step in range(5):
            x = torch.randn(4, 8)

            def closure(x: torch.Tensor = x, step: int = step) -> torch.Tensor:
                opt.zero_grad()
                xx = x.clone()
                if step == 3:
                    xx[0, 0] = float("nan")
                loss = model(xx).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "0", 3, "input"), hunt.findings[:3]
    assert not any(g.phase == "optimizer" and g.step < 3 for g in hunt.findings), hunt.findings
