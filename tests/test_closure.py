"""optimizer.step(closure): forward and backward run inside step(); the check must still come
after them and before the update (LBFGS, Lightning's automatic optimization)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from tests import zoo


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


class _LogBarrier(nn.Module):
    """A fit to a target with a log barrier: finite for positive weights, NaN where a step takes one
    below zero (an LBFGS trial point past the barrier)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([5.0, 4.0, 6.0]))

    def forward(self, target: torch.Tensor) -> torch.Tensor:
        return (self.w - target).pow(2).sum() - 0.1 * torch.log(self.w).sum()


def _lbfgs_run(on_find: str | None, line_search: str | None, targets: list[float]) -> tuple[nn.Module, Any, Any, list[Any]]:
    model = _LogBarrier()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=4, line_search_fn=line_search)
    hunt = nanhunt.watch(model, opt, on_find=on_find) if on_find else None
    errors = []
    for target in targets:
        def closure(target: float = target) -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.tensor(target))
            loss.backward()
            return loss

        try:
            opt.step(closure)
        except nanhunt.NonFiniteError as e:
            errors.append(e)
    if hunt is not None:
        hunt.close()
    return model, opt, hunt, errors


# (not skip with strong_wolfe: torch's line search itself fails on the NaN loss, an IndexError)
@pytest.mark.parametrize(("on_find", "line_search"), [("raise", None), ("raise", "strong_wolfe"), ("skip", None)])
def test_lbfgs_weights_stay_where_they_stood_after_a_nan_at_a_trial_point(on_find: str, line_search: str | None) -> None:
    """The batch of step 2 pulls the weights far below zero: the first closure call (at the
    weights the step began from) is finite, the call at LBFGS's next point (the fixed step or the
    line search's trial point) is NaN. The weights were left at that point after the error
    (moved from the first call's gradient), and LBFGS's state mid-update; training resumed from
    there. Now the step leaves weights and state as they were, and the run goes on exactly as
    a run that never saw that batch."""
    model, opt, hunt, errors = _lbfgs_run(on_find, line_search, [3.0, 2.0, -50.0, 1.0])
    clean, clean_opt, _, _ = _lbfgs_run(None, line_search, [3.0, 2.0, 1.0])
    assert [f.step for f in hunt.findings] == [2] and hunt.first.cause == "created"
    assert len(errors) == (on_find == "raise") and hunt.skipped == ([2] if on_find == "skip" else [])
    assert torch.equal(model.w, clean.w), (model.w, clean.w)
    a, b = opt.state_dict()["state"], clean_opt.state_dict()["state"]
    assert a.keys() == b.keys() and all(a[k].keys() == b[k].keys() for k in a)
    for k in a:
        for name, v in a[k].items():
            w = b[k][name]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), name
            elif isinstance(v, list):
                assert len(v) == len(w) and all(torch.equal(x, y) for x, y in zip(v, w) if isinstance(x, torch.Tensor)), name
            else:
                assert v == w, name


@pytest.mark.parametrize("opt_first", [True, False])
def test_autowatch_whose_model_is_first_called_inside_the_closure_checks_that_step_before_update(opt_first):
    # nanhunt run / pytest --nanhunt on Lightning (or LBFGS): the model's first call is inside the
    # first step(closure), so the hunt it opens missed that step's pre-hook, which wraps the closure.
    # The update applied the log(0) gradient, and the first finding was an "optimizer" one on `lin`'s
    # weight "although the step was given finite gradients", the forward's -inf only at step 1
    from nanhunt._cli.auto import AutoWatch

    model = zoo.lognet()
    x = torch.randn(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if opt_first else None
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nanhunt.NonFiniteError) as ei, AutoWatch(on_find="raise"):
        opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()  # ReLU's zeros: log(0) = -inf
            loss.backward()
            return loss

        opt.step(closure)
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "log", 0, "created", "aten.log.default"), f
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # never applied
