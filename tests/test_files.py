"""Files are data from someone else: every report field is checked on reading and escaped on
writing, a name that cannot be encoded never breaks the run, report paths are checked as the OS
resolves them, and a bad bundle is one clear line."""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import Finding, Report
from nanhunt._cli.main import main
from nanhunt._locate import bundle as bundle_mod

from . import zoo

EVIL = "<script>alert(1)</script>"


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> tuple[int, str, str]:
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def _finding(**over: Any) -> Finding:
    base: dict[str, Any] = dict(
        phase="forward", module="enc.attn", module_type="Attn", tensor="output", step=3, call=0, index=(1, 2),
        value=float("inf"), counts={"nan": 0, "+inf": 1, "-inf": 0}, shape=(2, 4), dtype="float32", cause="created",
        op="aten.exp.default", source="train.py:12", chain=("aten.exp.default @ train.py:12",), hint="overflow",
    )
    base.update(over)
    return Finding(**base)


def _valid_report_dict() -> dict[str, Any]:
    f = _finding()
    history = {"steps": [0, 1], "modules": ["enc.attn"], "dtype": {"enc.attn": "float32"},
               "absmax": [[1.0, "inf"]], "rms": [[0.5, None]], "zeros": [[0.0, 0.0]], "headroom": [[1e38, None]]}
    return Report([f, _finding(phase="grad", tensor="weight.grad")], history=history,
                  warnings=[{"step": 1, "module": "enc.attn", "message": "headroom"}], meta={"steps": 4}).to_dict()


# ---------------------------------------------------------------- HTML: everything escaped
def test_html_escapes_every_field_of_a_report() -> None:
    """Strings from any field, and a step that is not even an int (a Report built by hand), are
    written as text, never as markup (today a str step went raw into the findings table)."""
    fields = {k: EVIL for k in ("module", "module_type", "tensor", "dtype", "cause", "op", "source", "hint", "phase")}
    evil = [_finding(**fields, chain=(EVIL,)), _finding(step=EVIL, module=EVIL)]  # type: ignore[arg-type]
    history = {"steps": [0, 1], "modules": [EVIL], "dtype": {EVIL: EVIL}, "absmax": [[1.0, 2.0]]}
    report = Report(evil, history=history, warnings=[{"step": EVIL, "module": EVIL, "message": EVIL}],
                    meta={"steps": EVIL, "mode": EVIL, "torch": EVIL, "rank": EVIL})
    page = report.to_html()
    assert "<script" not in page.lower()
    assert "&lt;script&gt;" in page


# ---------------------------------------------------------------- reading a report back
MALFORMED = [
    ("findings.0.step", lambda d: d["findings"][0].__setitem__("step", EVIL), "findings[0].step"),
    ("findings.1.index", lambda d: d["findings"][1].__setitem__("index", ["a"]), "findings[1].index"),
    ("findings.0.value", lambda d: d["findings"][0].__setitem__("value", "big"), "findings[0].value"),
    ("findings.0.counts", lambda d: d["findings"][0].__setitem__("counts", [1]), "findings[0].counts"),
    ("findings.0.shape", lambda d: d["findings"][0].__setitem__("shape", None), "findings[0].shape"),
    ("findings.0.chain", lambda d: d["findings"][0].__setitem__("chain", 5), "findings[0].chain"),
    ("findings.0 missing module", lambda d: d["findings"][0].pop("module"), "findings[0].module"),
    ("findings.0 not an object", lambda d: d["findings"].__setitem__(0, "x"), "findings[0]"),
    ("findings not a list", lambda d: d.__setitem__("findings", {"a": 1}), "report.findings"),
    ("history.steps", lambda d: d["history"].__setitem__("steps", [0, EVIL]), "report.history.steps"),
    ("history.absmax", lambda d: d["history"].__setitem__("absmax", [1.0]), "report.history.absmax"),
    ("history not an object", lambda d: d.__setitem__("history", [1]), "report.history"),
    ("warnings", lambda d: d.__setitem__("warnings", ["w"]), "report.warnings"),
    ("meta", lambda d: d.__setitem__("meta", 3), "report.meta"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_show_refuses_a_malformed_report_in_one_line_naming_the_field(tmp_path, cli, case) -> None:
    _, mutate, field = case
    d = _valid_report_dict()
    mutate(d)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    page = tmp_path / "r.html"
    rc, out, err = cli("show", str(path), "--html", str(page))
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert field in err, err
    assert not page.exists() and "<script" not in out


def test_show_reads_a_valid_report_and_prints_no_terminal_commands(tmp_path, cli) -> None:
    d = _valid_report_dict()
    d["findings"][0]["module"] = "enc\x1b]0;owned\x07.attn\u202e"
    d["first"] = d["findings"][0]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    rc, out, err = cli("show", str(path), "--html", str(tmp_path / "r.html"))
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "enc\\x1b]0;owned\\x07.attn" in out
    loaded = Report.load(path)
    assert loaded.findings[0].index == (1, 2) and loaded.history["absmax"] == [[1.0, "inf"]]


# ---------------------------------------------------------------- a name that cannot be encoded
def _surrogate_net() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("lin", nn.Linear(4, 8))
    m.add_module("e\udcffx", zoo.Exp())  # a lone surrogate: not encodable as UTF-8
    m.add_module("head", nn.Linear(8, 1))
    return m


@pytest.mark.parametrize("on_find", ["record", "warn", "raise"])
@pytest.mark.parametrize("suffix", [".json", ".html", ".txt"])
def test_a_name_that_cannot_be_encoded_never_escapes_the_step(tmp_path, suffix: str, on_find: str) -> None:
    """Today: UnicodeEncodeError out of opt.step() for .html and .txt reports."""
    model = _surrogate_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    path = tmp_path / f"r{suffix}"
    x = torch.randn(8, 4)
    x[3] = 1000.0
    hunt = nanhunt.watch(model, opt, on_find=on_find, report=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanhunt.NonFiniteWarning)
        model(x).sum().backward()
        if on_find == "raise":
            with pytest.raises(nanhunt.NonFiniteError):
                opt.step()
        else:
            opt.step()
        hunt.close()
    assert hunt.first is not None and hunt.first.module == "e\udcffx"
    text = path.read_text(encoding="utf-8")
    assert "udcff" in text  # written escaped
    if suffix == ".json":
        assert Report.load(path).first.module == "e\udcffx"  # type: ignore[union-attr]


# ---------------------------------------------------------------- report paths
def test_report_paths_are_checked_as_the_os_resolves_them(tmp_path, monkeypatch) -> None:
    model = zoo.expnet()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        nanhunt.watch(model, report="missing/../r.json")  # today: accepted, then never written
    (tmp_path / "adir.json").mkdir()
    with pytest.raises(ValueError, match="folder"):
        nanhunt.watch(model, report="adir.json")
    with pytest.raises(ValueError, match="NUL"):
        nanhunt.watch(model, report="r\0.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="does not exist"):
        nanhunt.watch(model, report="file/r.json")


def test_a_relative_report_path_survives_a_chdir(tmp_path, monkeypatch) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    model = zoo.expnet()
    hunt = nanhunt.watch(model, report="out/../out/r.json", on_find="record")
    os.chdir(tmp_path / "elsewhere")
    x = torch.randn(8, 4)
    x[3] = 1000.0
    model(x)
    hunt.close()
    assert (tmp_path / "out" / "r.json").exists()
    assert not (tmp_path / "elsewhere" / "out").exists()


# ---------------------------------------------------------------- bundles
def _good_bundle(tmp_path) -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    p = tmp_path / "ok.pt"
    bundle_mod.save(p, module=m, module_name="lin", args=(torch.full((1, 4), 1e38),), kwargs={},
                    rng_state=torch.get_rng_state(), cuda_rng=None, finding=_finding(module="lin"))
    return torch.load(p, weights_only=True)


BAD_BUNDLES = [
    ("no tree", lambda d: d.pop("tree"), "tree"),
    ("tree not an object", lambda d: d.__setitem__("tree", "x"), "bundle.tree"),
    ("params a list", lambda d: d["tree"].__setitem__("params", [1]), "bundle.tree.params"),
    ("param a string", lambda d: d["tree"]["params"].__setitem__("weight", "abc"), "bundle.tree.params"),
    ("dotted parameter name", lambda d: d["tree"]["params"].__setitem__("a.b", None), "cannot be rebuilt"),
    ("child not an object", lambda d: d["tree"].__setitem__("children", {"a": 5}), "bundle.tree.children"),
    ("finding phase", lambda d: d["finding"].__setitem__("phase", 3), "bundle.finding.phase"),
    ("finding partial", lambda d: d.__setitem__("finding", {"phase": "forward"}), "bundle.finding.module"),
    ("args an int", lambda d: d.__setitem__("args", 5), "bundle.args"),
    ("kwargs a list", lambda d: d.__setitem__("kwargs", [1]), "bundle.kwargs"),
    ("rng float", lambda d: d.__setitem__("rng_state", torch.zeros(3)), "bundle.rng_state"),
    ("autocast", lambda d: d.__setitem__("autocast", [1]), "bundle.autocast"),
    ("device", lambda d: d.__setitem__("device", 5), "bundle.device"),
    ("state_dict", lambda d: d.__setitem__("state_dict", {"x": 1}), "bundle.state_dict"),
]


@pytest.mark.parametrize("case", BAD_BUNDLES, ids=[c[0] for c in BAD_BUNDLES])
def test_replay_of_a_bundle_with_wrong_fields_is_one_clear_line(tmp_path, cli, case) -> None:
    """It loads safely (weights_only) but is not what nanhunt writes: today 16-22 line tracebacks."""
    _, mutate, field = case
    d = copy.deepcopy(_good_bundle(tmp_path))
    mutate(d)
    path = tmp_path / "bad.pt"
    torch.save(d, path)
    rc, out, err = cli("replay", str(path))
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert field in err, err


def test_nanhunt_run_checks_its_report_path_the_same_way(tmp_path, cli, monkeypatch) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("run", "--report", "missing/../r.json", str(script))
    assert rc == 2 and "does not exist" in err and "ran" not in out
