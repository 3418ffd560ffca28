"""`nanhunt demo`: a real blow-up, caught, shown, and written as HTML."""

from __future__ import annotations

import subprocess
import sys

from nanhunt import Report
from nanhunt._cli import main


def test_demo_blows_up_and_writes_the_page(tmp_path):
    out, rep = tmp_path / "demo.html", tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "nanhunt", "demo", "--out", str(out), "--report", str(rep)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("First NaN: forward of `blocks.0.attn` (Attention) at step "), p.stdout
    assert "tinygpt.py:" in first  # the model's own line, not nanhunt's
    assert "training [" in p.stderr
    page = out.read_text()
    assert "<svg" in page and "blocks.0.attn" in page and "<script src" not in page
    f = Report.load(rep).first
    assert f is not None and f.phase == "forward" and f.module == "blocks.0.attn" and f.dtype == "float16"
    assert f.cause == "created"


def test_demo_without_enough_steps_says_so(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "d.html")]) == 1
    assert "needs more steps" in capsys.readouterr().err
    assert not (tmp_path / "d.html").exists()
