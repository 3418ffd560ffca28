"""The project's own hygiene: lint and types on the package, and the public surface it promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nanhunt

ROOT = Path(__file__).resolve().parents[1]


def test_public_surface_is_the_contract():
    # pinned exactly: a name added to the public surface is added here on purpose
    assert sorted(nanhunt.__all__) == sorted(
        ["watch", "Hunt", "Finding", "Report", "NonFiniteError", "NonFiniteWarning", "SilentRankError", "replay",
         "audit", "__version__"]
    )
    assert issubclass(nanhunt.NonFiniteError, FloatingPointError)
    assert (ROOT / "nanhunt" / "py.typed").exists()


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff not installed")
def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    r = subprocess.run([ruff, "check", "nanhunt", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean():
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", "nanhunt"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
