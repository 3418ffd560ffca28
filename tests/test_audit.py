"""nanhunt.audit() and `nanhunt audit`: non-finite tensors of a checkpoint; a malicious file is refused."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt._cli.main import main
from tests import zoo


class _Payload:
    """Unpickling this runs a shell command: what a booby-trapped checkpoint does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _files(tmp_path: Any) -> dict[str, Any]:
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters())
    good = tmp_path / "good.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "callbacks": {"kth_value": torch.tensor(float("inf"))}}, good)
    sd = model.state_dict()
    sd["fc2.bias"][1] = float("nan")
    sd["bn.running_var"][0] = float("inf")
    bad = tmp_path / "bad.pt"
    torch.save({"global_step": 12, "state_dict": sd, "loops": {"x": torch.tensor(float("nan"))}}, bad)
    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "x": _Payload(str(tmp_path / "pwned"))}, evil)
    return {"good": good, "bad": bad, "evil": evil, "marker": tmp_path / "pwned"}


def test_audit_good_and_poisoned(tmp_path: Any) -> None:
    files = _files(tmp_path)
    assert nanhunt.audit(files["good"]) == []
    found = nanhunt.audit(files["bad"])
    assert [(f.phase, f.tensor, f.step) for f in found] == [
        ("checkpoint", "['state_dict']['bn.running_var']", 12),
        ("checkpoint", "['state_dict']['fc2.bias']", 12),
    ]
    assert found[1].index == (1,) and found[1].counts == {"nan": 1, "+inf": 0, "-inf": 0}
    assert found[0].module == os.fspath(files["bad"])
    assert [f.tensor for f in nanhunt.audit(files["bad"], ignore=["*running_var*"])] == ["['state_dict']['fc2.bias']"]
    obj = torch.load(files["bad"], weights_only=True)
    assert len(nanhunt.audit(obj)) == 2


def test_audit_refuses_a_file_that_would_run_code(tmp_path: Any) -> None:
    files = _files(tmp_path)
    with pytest.raises(ValueError, match="refused"):
        nanhunt.audit(files["evil"])
    assert not files["marker"].exists()


def test_cli_exit_codes(tmp_path: Any, capsys: Any) -> None:
    files = _files(tmp_path)
    assert main(["audit", str(files["good"])]) == 0
    assert main(["audit", str(files["bad"])]) == 3
    out = capsys.readouterr().out
    assert "['state_dict']['fc2.bias']" in out and "1 nan" in out
    assert main(["audit", str(files["bad"]), "--ignore", "*.bias", "--ignore", "*running_var"]) == 0
    assert main(["audit", str(files["evil"])]) == 2
    assert "refused" in capsys.readouterr().err
    assert not files["marker"].exists()
    assert main(["audit", str(tmp_path / "missing.pt")]) == 2
