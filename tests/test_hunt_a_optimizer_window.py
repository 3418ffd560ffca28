"""A weight made non-finite by an update between two readings of sentinel's optimizer check (rows
of an embedding the next batches never use: no forward shows it) is reported at the reading; its
hint must say in which steps it was made (it named the reading's step as if exact) and keep the
reason the settings give (Adam's eps=0) although the gradient is gone by then."""
from __future__ import annotations

import torch
from torch import nn

import nanhunt


def _eps0_run(mode: str, steps: int = 3) -> nanhunt.Finding:
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), head=nn.Linear(4, 1)))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0)
    idx = torch.tensor([1, 2, 3])  # rows 0, 4..9 get a gradient of exactly 0: 0/0 in their update
    with nanhunt.watch(m, optimizer=opt, on_find="record", mode=mode) as hunt:
        for _ in range(steps):
            m["head"](m["emb"](idx)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.tensor, f.cause) == ("optimizer", "emb", "weight", "created"), f
    return f


def test_sentinel_names_the_window_a_weight_was_made_in() -> None:
    f = _eps0_run("sentinel")
    assert f.step == 2, f  # (the reading's, at close())
    assert "made at one of steps 0 to 2" in f.hint, f.hint


def test_sentinel_keeps_the_eps_zero_reason_when_the_gradient_is_gone() -> None:
    f = _eps0_run("sentinel")
    assert "eps is 0" in f.hint, f.hint


def test_full_mode_names_the_exact_step() -> None:
    f = _eps0_run("full")
    assert f.step == 0 and "one of steps" not in f.hint and "eps is 0" in f.hint, f.hint
