"""Files are data from someone else: every report field is checked on reading and escaped on
writing, a name that cannot be encoded never breaks the run, report paths are checked as the OS
resolves them, and a bad bundle is one clear line."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
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
    # right types, values no finding can hold (show printed 'First NaN: exploded ...', exit 0)
    ("findings.0.phase unknown", lambda d: d["findings"][0].__setitem__("phase", "exploded"), "findings[0]: ValueError: phase"),
    ("findings.0.step negative", lambda d: d["findings"][0].__setitem__("step", -7), "findings[0]: ValueError: step -7"),
    ("findings.0.step huge", lambda d: d["findings"][0].__setitem__("step", 10**400), "findings[0]"),
    ("findings.0.counts negative", lambda d: d["findings"][0].__setitem__("counts", {"nan": -5}), "counts['nan'] = -5"),
    ("findings.0.counts key", lambda d: d["findings"][0].__setitem__("counts", {"evil": 1}), "counts['evil']"),
    ("findings.0.index long", lambda d: d["findings"][0].__setitem__("index", [0] * 100), "index of 100 dimensions"),
    ("findings.0.cause unknown", lambda d: d["findings"][0].__setitem__("cause", "gremlins"), "cause 'gremlins'"),
    # another version's report: said so, not a field error that says nothing of versions
    ("schema of another version", lambda d: d.__setitem__("schema", "nanhunt.report/99"), "another nanhunt version"),
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


def test_a_report_that_cannot_be_written_never_replaces_the_finding(tmp_path, caplog) -> None:
    # pytest runs with filterwarnings=error, as `python -W error` does: the warning that the file could
    # not be written was raised from the step's hook and became nanhunt's InternalError in place of
    # the NonFiniteError of the finding
    out = tmp_path / "out"
    out.mkdir()
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = zoo.snapshot(model)
    hunt = nanhunt.watch(model, opt, on_find="raise", report=out / "r.json")
    out.rmdir()  # the folder goes away mid-run (a cleaned scratch disk)
    x = torch.randn(8, 4)
    x[3] = 1000.0
    with pytest.raises(nanhunt.NonFiniteError) as err:
        model(x).sum().backward()
        opt.step()
    assert err.value.finding.module == "1" and err.value.finding.phase == "forward"
    assert zoo.same_state(before, zoo.snapshot(model))  # the step was never applied
    said = [r.getMessage() for r in caplog.records if "could not write the report" in r.getMessage()]
    assert said and str(out) in said[0]  # the log still says what was not written
    assert said[0] in getattr(err.value, "__notes__", [])  # and so does the error
    hunt.close()  # the report is tried again, and again only said
    assert not out.exists()


def test_the_warning_that_a_report_was_not_written_points_at_the_users_line(tmp_path) -> None:
    """It pointed at nanhunt's own hunt.py (`self._handle(found, ...)` shown as the user's source)."""
    out = tmp_path / "out"
    out.mkdir()
    model = nn.Sequential(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hunt = nanhunt.watch(model, on_find="record", report=out / "r.json")
        out.rmdir()
        model(torch.full((2, 4), float("nan")))
        model(torch.ones(2, 4))  # (the step with the finding ends here: the report is written now)
        hunt.close()
    said = [w for w in seen if "could not write the report" in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, w.lineno) for w in said]


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


def test_replay_prints_a_bundles_names_escaped(tmp_path, cli) -> None:
    """A bundle is someone else's file: its module name went raw to the terminal in replay's first line."""
    d = copy.deepcopy(_good_bundle(tmp_path))
    d["finding"]["module"] = "lin\x1b]0;owned\x07\nReproduced: fake"
    path = tmp_path / "b.pt"
    torch.save(d, path)
    rc, out, err = cli("replay", str(path))
    assert rc in (0, 3), err
    assert "\x1b" not in out and "\x07" not in out and "\nReproduced: fake" not in out, out
    assert "lin\\x1b]0;owned\\x07\\x0aReproduced: fake" in out.splitlines()[0], out


def test_nanhunt_run_checks_its_report_path_the_same_way(tmp_path, cli, monkeypatch) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("run", "--report", "missing/../r.json", str(script))
    assert rc == 2 and "does not exist" in err and "ran" not in out


def test_nanhunt_run_never_says_it_wrote_a_report_it_could_not_write(tmp_path, cli, monkeypatch) -> None:
    """A report path that takes nothing when the run ends (a full disk; here a FIFO nobody reads):
    `nanhunt run` said it could not write the report, then ``report written to`` that path."""
    script = tmp_path / "s.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.tensor([[float('inf'), 0.0]]))\n")
    os.mkfifo(tmp_path / "r.json")
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the report at the first finding is not written either: said)
        rc, out, err = cli("run", "--on-find", "record", "--report", "r.json", str(script))
    assert rc == 3 and "First" in err, err
    assert "cannot write the report to" in err and "nobody reads" in err, err
    assert "report written to" not in err, err


# ---------------------------------------------------------------- report paths that are links
def _record_a_finding(model: nn.Module, report: Any) -> None:
    hunt = nanhunt.watch(model, report=report, on_find="record")
    x = torch.randn(8, 4)
    x[3] = 1000.0
    model(x)
    hunt.close()
    assert hunt.first is not None


def test_a_report_path_that_is_a_link_writes_the_link_target(tmp_path, monkeypatch) -> None:
    """latest.json -> runs/42/report.json: the target is written (atomically), the link stays a link, and
    the target keeps its own mode (today: the link was replaced by a plain file)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "42").mkdir(parents=True)
    target = tmp_path / "runs" / "42" / "report.json"
    target.write_text("{}")
    os.chmod(target, 0o600)
    link = tmp_path / "latest.json"
    link.symlink_to("runs/42/report.json")
    _record_a_finding(zoo.expnet(), "latest.json")
    assert link.is_symlink() and os.readlink(link) == "runs/42/report.json"
    assert Report.load(target).first is not None
    assert os.stat(target).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.rglob(".nanhunt-*")] == []
    # a link to a file not written yet: the file is made where the link points
    (tmp_path / "runs" / "43").mkdir()
    fresh = tmp_path / "next.json"
    fresh.symlink_to(tmp_path / "runs" / "43" / "report.json")
    _record_a_finding(zoo.expnet(), fresh)
    assert fresh.is_symlink() and Report.load(tmp_path / "runs" / "43" / "report.json").first is not None
    # a link into a folder that does not exist: refused at watch(), as for a plain path
    (tmp_path / "nowhere.json").symlink_to(tmp_path / "missing" / "r.json")
    with pytest.raises(ValueError, match="does not exist"):
        nanhunt.watch(zoo.expnet(), report=tmp_path / "nowhere.json")


def test_a_read_only_file_is_never_replaced_by_a_report(tmp_path, monkeypatch) -> None:
    """A report path onto a file that open() may not write (chmod 444, someone else's file in a
    folder of ours), directly or through a link: the write is refused and the file stays as it was.
    The rename replaced it, as it needs only the folder's permission. (The test runs as root, which
    may write anything: os.access answers as an unprivileged user's would.)"""
    keep = tmp_path / "keep.json"
    keep.write_text('{"precious": 1}')
    os.chmod(keep, 0o444)
    link = tmp_path / "latest.json"
    link.symlink_to(keep)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: not (mode & os.W_OK and os.path.realpath(p) == str(keep))
                        and access(p, mode, **kw))
    for path in (keep, link):
        with pytest.raises(PermissionError, match="Permission denied"):
            Report([_finding()]).save(path)
        assert keep.read_text() == '{"precious": 1}' and link.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".nanhunt-")] == []


def test_a_replaced_report_is_never_more_permissive_than_a_fresh_file(tmp_path) -> None:
    report = Report([_finding()])
    path = tmp_path / "r.json"
    path.write_text("{}")
    os.chmod(path, 0o666)  # world-writable: the new report is not
    link = tmp_path / "link.json"
    link.symlink_to(path)
    old = os.umask(0o022)
    try:
        report.save(path)
        assert os.stat(path).st_mode & 0o777 == 0o644
        os.chmod(path, 0o666)
        report.save(link)
        assert link.is_symlink() and os.stat(path).st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_a_report_linked_to_dev_null_is_written_there_not_replaced(tmp_path) -> None:
    """Today: the link became a world-writable 0666 file (the mode of /dev/null)."""
    link = tmp_path / "devnull.json"
    link.symlink_to(os.devnull)
    _record_a_finding(zoo.expnet(), link)
    assert link.is_symlink() and os.readlink(link) == os.devnull
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["devnull.json"]


# ---------------------------------------------------------------- reports that are not reports
def test_report_load_raises_the_loaders_own_error_for_any_bad_file(tmp_path) -> None:
    from nanhunt._files import FileFormatError

    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(bytes(range(128, 256)) * 4)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    nested = tmp_path / "nested.json"
    nested.write_text('{"schema": "nanhunt.report/1", "meta": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}")
    for f, says in ((garbage, "not a text file"), (deep, "nested too deeply"), (nested, "nested more than")):
        with pytest.raises(FileFormatError, match=says) as e:  # a ValueError, never UnicodeDecodeError/RecursionError
            Report.load(f)
        assert str(f) in str(e.value)


@pytest.mark.parametrize("given", [123, None, ["r.json"]])
def test_report_load_and_save_of_no_path_say_what_they_were_given_and_take(given: Any) -> None:
    # Report.load(123) raised os.fspath's bare "expected str, bytes or os.PathLike object, not int"
    with pytest.raises(TypeError, match=rf"Report.load\(\) takes the path of a report saved as .json .*"
                                        rf"got {type(given).__name__}"):
        Report.load(given)
    with pytest.raises(TypeError, match=rf"Report.save\(\) takes a path ending in .json, .html or .txt .*"
                                        rf"got {type(given).__name__}"):
        Report([]).save(given)


def test_show_of_deeply_nested_json_is_one_line_exit_2(tmp_path, cli) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    rc, out, err = cli("show", str(deep))
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "RecursionError" not in err, err
    assert str(deep) in err and "nested too deeply" in err


def test_show_refuses_a_report_larger_than_the_cap_without_reading_it(tmp_path, cli) -> None:
    import resource

    from nanhunt._files import MAX_REPORT_BYTES

    big = tmp_path / "big.json"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(MAX_REPORT_BYTES + 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc, out, err = cli("show", str(big))
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert str(big) in err and "larger than any report" in err, err
    assert grew_kib < 64 * 1024  # today: the whole file was read (4.4 GB for 2 GiB)


def _show_in_a_box(path: Any) -> subprocess.CompletedProcess[str]:
    """`nanhunt show PATH` in a child with 2 GiB of address space and a time limit: reading /dev/zero
    or blocking on a FIFO fails the test instead of the machine."""
    import resource

    def box() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    return subprocess.run([sys.executable, "-m", "nanhunt", "show", str(path)], capture_output=True, text=True,
                          timeout=120, preexec_fn=box)


@pytest.mark.parametrize("kind", ["folder", "dev-zero", "fifo"])
def test_show_refuses_what_is_not_a_regular_file_without_reading_it(tmp_path, kind) -> None:
    path = tmp_path / "r.json"
    if kind == "folder":
        path.mkdir()
        says = "is a folder"
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # endless: today it grew without bound
        says = "is a character device"
    else:
        os.mkfifo(path)  # nobody writes: today it blocked for good
        says = "is a FIFO"
    p = _show_in_a_box(path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"nanhunt: cannot read report {str(path)!r}: it {says}" + \
        (" (named pipe)" if kind == "fifo" else "") + ", not a report file"
    if kind != "folder":
        from nanhunt._files import FileFormatError

        with pytest.raises(FileFormatError, match=says):
            Report.load(path)


def test_saving_a_report_where_it_cannot_go_names_the_users_path(tmp_path: Any) -> None:
    """Report.save into a missing folder named our temporary file ('.nanhunt-a6923fc14b32.json');
    a file name past the file system's limit passed watch(report=) and was never written."""
    hunt = nanhunt.watch(zoo.mlp())
    hunt.close()
    report = hunt.report
    missing = str(tmp_path / "nodir" / "x.json")
    with pytest.raises(FileNotFoundError) as ei:
        report.save(missing)
    assert repr(missing) in str(ei.value) and ".nanhunt-" not in str(ei.value)
    long = str(tmp_path / ("a" * 300 + ".json"))
    with pytest.raises(OSError) as oi:
        report.save(long)
    assert ".nanhunt-" not in str(oi.value) and "too long" in str(oi.value)
    with pytest.raises(ValueError, match="longer than its file system allows"):
        nanhunt.watch(zoo.mlp(), report=long)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d["findings"][0].update(value=1.0), "value 1.0 is finite"),
    (lambda d: d["first"].update(step=d["first"]["step"] + 1), "report.first is not findings\\[0\\]"),
    (lambda d: d.update(first=None), "report.first is not findings\\[0\\]"),
])
def test_an_edited_report_that_contradicts_itself_is_refused(tmp_path, cli, edit, says) -> None:
    """`nanhunt show` read a finding whose value was finite ("First +Inf ... = 1") and a report
    whose `first` disagreed with findings[0] (the one shown) without a word."""
    from nanhunt._files import FileFormatError

    path = tmp_path / "r.json"
    Report([_finding()]).save(path)
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(FileFormatError, match=says):
        Report.load(path)
    rc, out, err = cli("show", str(path))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err


def test_a_report_of_many_findings_is_read_without_evaluating_annotations_per_finding(tmp_path, monkeypatch) -> None:
    """Reading a report back evaluated every Finding annotation anew for each finding (compiling
    each type string): 0.4 s for the 1000 findings of a default `max_findings`, 40 s for the 100000
    that fit under the size cap. The types are worked out once per class now."""
    import typing

    path = tmp_path / "r.json"
    Report([_finding(step=i) for i in range(200)]).save(path)
    calls = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda *a, **k: calls.append(a) or real(*a, **k))
    loaded = Report.load(path)
    assert [f.step for f in loaded.findings] == list(range(200))
    assert len(calls) <= 2, len(calls)


def test_two_open_hunts_never_write_one_report(tmp_path, monkeypatch) -> None:
    """A GAN's generator and discriminator watched with the same report=: the discriminator's clean
    hunt, closed last, wrote "no NaN found" over the generator's finding, without a word. The second
    watch() is refused; the path is free again once the first hunt is closed, also through a link."""
    monkeypatch.chdir(tmp_path)
    gen, disc = zoo.expnet(), zoo.mlp()
    hunt = nanhunt.watch(gen, report="r.json", on_find="record")
    (tmp_path / "latest.json").symlink_to("r.json")
    for same in ("r.json", str(tmp_path / "r.json"), "latest.json"):
        with pytest.raises(ValueError, match="another open hunt"):
            nanhunt.watch(disc, report=same)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in disc.modules())  # nothing stays behind
    x = torch.randn(8, 4)
    x[3] = 1000.0
    gen(x)
    hunt.close()
    assert Report.load(tmp_path / "r.json").first is not None
    with nanhunt.watch(disc, report="latest.json"):  # the first hunt is closed: free
        disc(torch.randn(2, 4))
    (tmp_path / "null.json").symlink_to(os.devnull)
    with nanhunt.watch(gen, report="null.json", on_find="record"), nanhunt.watch(disc, report="null.json"):
        pass  # a device is written in place by each: shared freely
