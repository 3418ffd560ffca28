"""A closed hunt says so, and a hunt closed from inside its own `on_find` leaves nothing behind."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import nanhunt

from . import zoo


@pytest.mark.parametrize("use", ["check", "sync", "with"])
def test_a_closed_hunt_refuses_to_be_used(use: str) -> None:
    model = zoo.expnet()
    hunt = nanhunt.watch(model)
    model(torch.randn(2, 4))
    hunt.close()
    hunt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        if use == "check":
            hunt.check(torch.ones(3), "loss")
        elif use == "sync":
            hunt.sync()
        else:
            with hunt:
                pass
    assert hunt.report.findings == []  # still readable


def _planted(step: int) -> torch.Tensor:
    x = torch.randn(8, 4)
    if step == 1:
        x[3] = 1000.0  # Exp overflows: a forward finding at step 1
    return x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_kept_error_keeps_neither_the_model_nor_its_batch_alive_after_close(mode: str) -> None:
    """A NonFiniteError kept after the loop (a list of errors, a notebook's sys.last_value) holds
    its traceback's frames: nanhunt's step end held the step's log and view there, and with them the
    model and the batch, after close() and del."""
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    kept = []
    hunt = nanhunt.watch(model, opt, mode=mode)
    x = _planted(1)
    batch = weakref.ref(x)
    try:
        model(x).pow(2).mean().backward()
        opt.step()
    except nanhunt.NonFiniteError as e:
        kept.append(e)
    hunt.close()
    assert kept and kept[0].__traceback__ is not None and kept[0].finding.step == 0
    ref = weakref.ref(model)
    del model, x
    gc.collect()
    assert ref() is None, "a kept NonFiniteError kept the model alive"
    assert batch() is None, "a kept NonFiniteError kept the input batch alive"


@pytest.mark.parametrize("closes", [False, True])
@pytest.mark.parametrize("raised", ["own", "NonFiniteError"])
def test_an_on_find_error_is_not_kept_by_the_closed_hunt(closes: bool, raised: str) -> None:
    """A callable on_find that raises (the Hugging Face callback closes the hunt, then raises
    NonFiniteError): the closed hunt kept that error, whose traceback held the training function's
    frame, and with it the model, for as long as the user kept the hunt for its report."""

    class Stop(Exception):
        pass

    box: dict[str, Any] = {}

    def on_find(f: nanhunt.Finding) -> None:
        if closes:
            box["hunt"].close(raise_pending=False)
        raise Stop if raised == "own" else nanhunt.NonFiniteError(f, box["hunt"].report)

    def train() -> tuple[nanhunt.Hunt, Any]:
        model = zoo.expnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hunt = box["hunt"] = nanhunt.watch(model, opt, on_find=on_find)
        try:
            with hunt:
                for step in range(3):
                    model(_planted(step)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
        except (Stop, nanhunt.NonFiniteError):
            pass
        return hunt, weakref.ref(model)

    hunt, ref = train()
    box.clear()
    gc.collect()
    assert hunt.closed and hunt.first is not None and hunt.first.step == 1
    assert ref() is None, "the closed hunt kept on_find's error, and through its traceback the model"


@pytest.mark.parametrize("with_optimizer", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_on_find_that_closes_the_hunt_leaves_nothing_behind(with_optimizer: bool, mode: str) -> None:
    """Without an optimizer the step ends in the root's next pre-hook: today the hook went on to
    record that call into the closed hunt (its inputs, the model) after on_find closed it."""
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    box: dict[str, Any] = {}
    seen: list[nanhunt.Finding] = []

    def on_find(f: nanhunt.Finding) -> None:
        seen.append(f)
        box["hunt"].close()

    hunt = nanhunt.watch(model, opt if with_optimizer else None, on_find=on_find, mode=mode)
    box["hunt"] = hunt
    torch.manual_seed(1)
    inputs = []
    for step in range(4):
        x = _planted(step)
        inputs.append(weakref.ref(x))
        loss = model(x).pow(2).mean()
        loss.backward()
        if with_optimizer:
            opt.step()
            opt.zero_grad()
        del x, loss
    assert hunt.closed and seen and seen[0].step == 1
    assert not hunt._handles and hunt._root is None and not hunt._stack
    assert not hunt._log.tops and not hunt._log.calls and not hunt._log.sums
    ref = weakref.ref(model)
    box.clear()
    del model, opt
    gc.collect()
    assert ref() is None, "the closed hunt kept the model alive"
    assert all(r() is None for r in inputs), "the closed hunt kept an input batch alive"
    assert len(hunt.findings) == len(seen)


@pytest.mark.parametrize("then_raise", [False, True])
def test_on_find_closing_inside_step_with_a_later_user_hook(then_raise: bool) -> None:
    """on_find closes the hunt from the optimizer's pre-hook while torch iterates the pre-hooks and
    a user hook comes after ours: today "OrderedDict mutated during iteration" out of opt.step().
    Now the step goes on (or the user's own exception leaves it), the user's hook runs, and none
    of nanhunt's hooks are left afterwards."""

    class Stop(Exception):
        pass

    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    box: dict[str, Any] = {}

    def on_find(f: nanhunt.Finding) -> None:
        box["hunt"].close()
        if then_raise:
            raise Stop

    box["hunt"] = nanhunt.watch(model, opt, on_find=on_find)
    ran: list[int] = []
    user = opt.register_step_pre_hook(lambda o, a, k: ran.append(1))
    x = torch.randn(8, 4)
    x[3] = 1000.0
    model(x).sum().backward()
    if then_raise:
        with pytest.raises(Stop):
            opt.step()
        assert ran == []
    else:
        opt.step()
        assert ran == [1]
    assert box["hunt"].closed
    assert list(opt._optimizer_step_pre_hooks) == [user.id] and not opt._optimizer_step_post_hooks
    assert "_optimizer_step_code" not in opt.__dict__
    opt.step()
    assert ran[-1:] == [1]


def test_close_from_a_backward_hook_leaves_no_mode_on_the_stack() -> None:
    """close() from inside the backward (a tensor hook): the outside-code mode was inside its own
    handler (`loss.backward()` passes through it), so torch pushed it back when the backward
    returned, and it stayed on the main thread's stack, passing every torch call through Python,
    until the next watch(). It now comes off at the next module call, with the hook that takes it off."""
    hooks = dict(torch.nn.modules.module._global_forward_pre_hooks)
    model = zoo.mlp()
    hunt = nanhunt.watch(model, on_find="record")
    y = model(torch.randn(3, 4))

    def close(g: torch.Tensor) -> torch.Tensor:
        hunt.close()
        return g

    y.register_hook(close)
    y.sum().backward()
    assert hunt.closed
    model(torch.randn(3, 4))  # the user's loop goes on
    assert not torch.overrides._get_current_function_mode_stack(), "the closed hunt's mode is still on the stack"
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == hooks, "a hook was left behind"


# The user's own NaN check (clip_grad_norm_(error_if_nonfinite=True), an assert on the loss) raises
# inside `with nanhunt.watch(...)` before the step ends: the hunt closed with the finding recorded
# but said nothing, so the traceback the user reads had none of nanhunt's answer.

def _run_with_own_check(on_find: str = "raise") -> tuple[BaseException, nanhunt.Hunt]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as ei:
        with nanhunt.watch(m, optimizer=opt, on_find=on_find) as hunt:
            for step in range(3):
                x = torch.randn(6, 4)
                if step == 1:
                    x[0, 0] = float("inf")
                m(x).mean().backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
                opt.zero_grad()
    return ei.value, hunt


def test_the_users_own_error_carries_the_finding_as_a_note() -> None:
    exc, hunt = _run_with_own_check()
    assert not isinstance(exc, nanhunt.NonFiniteError)  # the user's error stays the user's
    assert hunt.first is not None and hunt.first.step == 1
    notes = getattr(exc, "__notes__", [])
    assert any("nanhunt" in n and "step 1" in n and "`0` (Linear)" in n for n in notes), notes


def test_record_mode_adds_no_note() -> None:
    exc, hunt = _run_with_own_check("record")
    assert hunt.first is not None and not getattr(exc, "__notes__", [])


class _GaussianPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.mu, self.sigma = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2), torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.mu(h), torch.sqrt(self.sigma(h))  # (a negative pre-activation: nan) @policy-scale


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_the_model_returned_to_a_distributions_argument_check_is_a_note_in_every_mode(mode: str) -> None:
    # torch.distributions.Normal(mu, sigma) checks its arguments and raises ValueError on a NaN scale
    # before any loss or backward: full mode put the model's finding on that error, sentinel (which
    # judges the training call's outputs through their gradients) had no finding at all.
    # (validate_args=True: torch.compile's first use turns the process-wide default off)
    torch.manual_seed(0)
    m = _GaussianPolicy()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with pytest.raises(ValueError) as ei:
        with nanhunt.watch(m, optimizer=opt, mode=mode) as hunt:
            mu, sigma = m(torch.randn(4, 8))
            torch.distributions.Normal(mu, sigma, validate_args=True).log_prob(torch.zeros(4, 2)).mean().backward()
            opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.op, f.step) == ("forward", "", "aten.sqrt.default", 0), hunt.findings
    assert f.tensor == "output[1]" and f.source is not None, f
    want = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith("@policy-scale"))
    assert f.source.endswith(f"test_closed.py:{want}"), f
    assert any("nanhunt" in n and "aten.sqrt.default" in n for n in getattr(ei.value, "__notes__", [])), ei.value
    assert not hunt.findings[1:], hunt.findings
