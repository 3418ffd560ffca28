"""The README stays true: every `watch()` option and every exit status in its tables, every
command shown, steps said to be 0-based, and no references to the project's internal notes.
(The demo transcript is held to a real run by tests/test_demo.py.)"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import nanhunt
from nanhunt._cli.main import EXIT_CLEAN, EXIT_FAILED, EXIT_FOUND, EXIT_USAGE, _parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_options_table_lists_every_watch_option():
    params = [p for p in inspect.signature(nanhunt.watch).parameters if p not in ("model", "optimizer")]
    rows = re.findall(r"^\| `(\w+)` \|", README, re.M)
    missing = [p for p in params if p not in rows]
    assert not missing, f"README's options table lacks {missing}"


def test_exit_status_table():
    codes = dict(re.findall(r"^\| (\d) \| (.+) \|$", README, re.M))
    assert sorted(map(int, codes)) == sorted([EXIT_CLEAN, EXIT_FAILED, EXIT_USAGE, EXIT_FOUND])
    assert codes[str(EXIT_FOUND)].startswith("a NaN/Inf was found")
    assert codes[str(EXIT_USAGE)].startswith("usage error")
    assert codes[str(EXIT_FAILED)].startswith("the script's own failure")
    assert "`demo`: no blow-up within `--steps`" in codes[str(EXIT_FAILED)]  # (tests/test_demo.py: --steps 3 exits 1)


def test_every_command_and_option_is_shown():
    sub = next(a for a in _parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():  # type: ignore[union-attr]
        assert f"nanhunt {name}" in README, name
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in README, f"nanhunt {name} {flag} is not in the README"
    assert "nanhunt --version" in README


def test_steps_are_said_to_be_zero_based():
    assert "Steps are counted from 0" in README
    # counted from watch(): a hunt opened inside the loop numbers every iteration 0
    assert "since `watch()`" in README and "Open the hunt once, around the loop" in README


def test_no_internal_references():
    for path in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        text = path.read_text(encoding="utf-8")
        bad = re.findall(r"\bissues? (?:#?\d+|notes?)\b|the article", text, re.I)
        assert not bad, f"{path.name}: {bad}"
