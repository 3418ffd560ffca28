"""`nanhunt demo`: a real blow-up, caught, shown, and written as HTML — and the README's
transcript of it, which this test holds to the real output (``NANHUNT_REGEN_README=1`` rewrites it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from nanhunt import Report
from nanhunt._cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- demo-output:[^\n]*-->\n```\n)(.*?)(```\n<!-- /demo-output -->)", re.S)


def test_demo_blows_up_and_writes_the_page(tmp_path):
    out, rep = tmp_path / "demo.html", tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "nanhunt", "demo", "--out", str(out), "--report", str(rep)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("First NaN: forward of `blocks.0.attn` (Attention) at step "), p.stdout
    assert "tinygpt.py:" in first  # the model's own line, not nanhunt's
    assert "training [" in p.stderr and f"HTML report: {out}" in p.stderr
    assert set(tmp_path.iterdir()) == {out, rep}  # nothing written into the current folder
    f = Report.load(rep).first
    assert f is not None and f.phase == "forward" and f.module == "blocks.0.attn" and f.dtype == "float16"
    assert f.cause == "created"

    # the page shows the answer: the finding's module has its row, and its cell is drawn and outlined
    page = out.read_text()
    assert "<svg" in page and "<script src" not in page
    assert 'font-weight="bold"><title>blocks.0.attn</title>' in page
    assert re.search(r'<title>blocks\.0\.attn @ step \d+ · abs-max nan · the finding</title>', page)
    assert page.count('class="finding"') == 1
    # the source line's text, in the page and in the JSON
    line = "logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)  # can overflow float16"
    assert re.search(r"^  line +" + re.escape(line) + "$", p.stdout, re.M)
    assert "logits = (q @ k.transpose(-2, -1))" in page
    assert Report.load(rep).to_dict()["first"]["source_text"] == line

    # the README shows exactly this run's stdout
    readme = README.read_text(encoding="utf-8")
    m = BLOCK.search(readme)
    assert m is not None, "README.md lost its demo-output block"
    if os.environ.get("NANHUNT_REGEN_README") == "1":
        README.write_text(readme[: m.start(2)] + p.stdout.rstrip("\n") + "\n" + readme[m.end(2):], encoding="utf-8")
    else:
        assert m.group(2).rstrip("\n") == p.stdout.rstrip("\n"), (
            "README.md's demo transcript differs from `nanhunt demo`; rerun with NANHUNT_REGEN_README=1")


def test_the_demo_prints_the_same_report_whatever_float_kernels_the_cpu_has(tmp_path):
    # MKL and ATen pick their kernels by CPU (AVX2, AVX-512), and those round differently: the blow-up
    # step moved with the machine and the README's transcript held only on some. The demo's process
    # takes the portable kernels whatever the environment asks for.
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    p = subprocess.run([sys.executable, "-m", "nanhunt", "demo", "--out", str(tmp_path / "demo.html")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    m = BLOCK.search(README.read_text(encoding="utf-8"))
    assert m is not None
    assert p.stdout.splitlines()[0] == m.group(2).splitlines()[0]


def test_demo_without_enough_steps_says_so(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "d.html")]) == 1
    assert "needs more steps" in capsys.readouterr().err
    assert not (tmp_path / "d.html").exists()


def test_demo_page_goes_to_the_temp_folder_by_default(tmp_path, monkeypatch):
    from nanhunt._cli import demo

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    got = {}
    monkeypatch.setattr(demo, "main", lambda **kw: got.update(kw) or 0)
    assert main(["demo"]) == 0
    assert got["out"] == str(tmp_path / "nanhunt-demo.html")
    assert "nanhunt-demo.html" in (Path(__file__).resolve().parents[1] / ".gitignore").read_text()


def test_demo_that_cannot_write_its_page_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """A page path that takes nothing once the demo has run (a full disk; here a FIFO nobody reads):
    the demo ended in a traceback from nanhunt's own report writer."""
    from nanhunt import Finding
    from nanhunt._cli import demo

    found = Finding(phase="forward", module="blocks.0", module_type="Block", tensor="output", step=3, call=0,
                    index=(0,), value=float("inf"), counts={"nan": 0, "+inf": 1, "-inf": 0}, shape=(1,),
                    dtype="float16", cause="created")
    monkeypatch.setattr(demo, "train", lambda steps, progress=None: Report([found]))
    os.mkfifo(tmp_path / "page.html")
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "page.html")]) == 2
    err = capsys.readouterr().err
    assert "nanhunt: cannot write" in err and "nobody reads" in err and "Traceback" not in err, err
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "d.html"), "--report", str(tmp_path / "page.html")]) == 2
    err = capsys.readouterr().err
    assert "HTML report:" in err and "nanhunt: cannot write" in err, err
