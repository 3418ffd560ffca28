"""watch(bundle=...): the first finding's failing call is saved and replays in isolation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.norm(x))


def test_bundle_is_written_at_the_first_finding_and_reproduces(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Block(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "first.pt"
    with torch.no_grad():
        model[1].norm.weight[2] = float("inf")  # poisoned: LayerNorm output gets inf/nan
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, bundle=path):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    f = ei.value.finding
    assert (f.module, f.cause) == ("1.norm", "parameter")
    assert path.exists()
    result = nanhunt.replay(path)  # LayerNorm is a standard layer: rebuilt from the bundle alone
    assert result.reproduced
    assert result.finding is not None and result.finding.index == f.index


def test_unwritable_bundle_path_is_an_error_at_watch_time(tmp_path):
    with pytest.raises(ValueError, match="bundle"):
        nanhunt.watch(nn.Linear(2, 2), bundle=tmp_path / "missing-dir" / "b.pt")
    with pytest.raises(ValueError, match="bundle"):
        nanhunt.watch(nn.Linear(2, 2), bundle=tmp_path / "b.json")


def test_no_bundle_for_a_first_finding_outside_every_module_says_why(tmp_path):
    # a bundle holds one watched module's forward call: a NaN born in the loss code has none
    path = tmp_path / "b.pt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.warns(UserWarning, match="no repro bundle"):
        with nanhunt.watch(model, on_find="record", bundle=path) as hunt:
            out = model(torch.randn(2, 4))
            torch.log(out - out).sum()  # log(0) in the loop's own code
    assert hunt.first is not None and hunt.first.module == "<outside>"
    assert not path.exists()


def test_a_bundle_that_cannot_be_written_names_its_path_in_the_warning_and_the_log(tmp_path, monkeypatch, caplog):
    """A bundle whose write fails at the finding (a full disk: torch's own words are 'unexpected pos
    3712 vs 3600'): the warning named neither the file nor the error, and the "nanhunt" logger had
    nothing. The finding is raised as ever and no half file is left."""
    from nanhunt._locate import bundle as bundle_mod

    path = tmp_path / "first.pt"
    model = nn.Sequential(nn.Linear(4, 8), Block())
    with torch.no_grad():
        model[1].norm.weight[2] = float("inf")

    def full(obj, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3712 vs 3600")

    monkeypatch.setattr(bundle_mod.torch, "save", full)
    with pytest.warns(UserWarning, match="could not write the repro bundle") as said:
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            with nanhunt.watch(model, bundle=path):
                model(torch.randn(3, 4))
    assert ei.value.finding.module == "1.norm"
    msg = str(next(w.message for w in said if "repro bundle" in str(w.message)))
    assert str(path) in msg and "RuntimeError" in msg, msg
    assert any(str(path) in r.getMessage() for r in caplog.records if r.name == "nanhunt")
    assert not path.exists() and not list(tmp_path.glob(".nanhunt-*"))
