"""The user's own NaN check (clip_grad_norm_(error_if_nonfinite=True), an assert on the loss) raises
inside `with nanhunt.watch(...)` before the step ends: the hunt closed with the finding recorded
but said nothing, so the traceback the user reads had none of nanhunt's answer."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


def _run(on_find: str = "raise") -> tuple[BaseException, nanhunt.Hunt]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
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
    exc, hunt = _run()
    assert not isinstance(exc, nanhunt.NonFiniteError)  # the user's error stays the user's
    assert hunt.first is not None and hunt.first.step == 1
    notes = getattr(exc, "__notes__", [])
    assert any("nanhunt" in n and "step 1" in n and "`0` (Linear)" in n for n in notes), notes


def test_record_mode_adds_no_note() -> None:
    exc, hunt = _run("record")
    assert hunt.first is not None and not getattr(exc, "__notes__", [])
