"""The command line's contract: `--version`, exit codes 0 clean / 1 the script's own failure /
2 usage / 3 finding, every error in one clear line, paths checked before any work, and replaying a
bundle of the user's own module class."""

from __future__ import annotations

import fractions
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt._cli.main import EXIT_CLEAN, EXIT_FAILED, EXIT_FOUND, EXIT_USAGE, main


def test_exit_codes_are_the_documented_ones():
    assert (EXIT_CLEAN, EXIT_FAILED, EXIT_USAGE, EXIT_FOUND) == (0, 1, 2, 3)


@pytest.fixture
def cli(capsys):
    def run(*args: str) -> tuple[int, str, str]:
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


def test_version(cli):
    rc, out, err = cli("--version")
    assert rc == 0 and err == ""
    assert out.strip() == f"nanhunt {nanhunt.__version__} (torch {torch.__version__})"
    p = subprocess.run([sys.executable, "-m", "nanhunt", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == out.strip()


def test_no_command_shows_help_and_exits_2(cli):
    rc, out, err = cli()
    assert rc == 2 and "usage: nanhunt" in err and "Exit status: 0 clean" in err


@pytest.mark.parametrize(("args", "says"), [
    (("run",), "nanhunt run: error: the following argument is required: script (or -m MODULE) (see 'nanhunt run --help')"),
    (("demo", "--steps", "-5"), "nanhunt demo: error: argument --steps: must be >= 1; got -5"),
    (("demo", "--steps", "0"), "nanhunt demo: error: argument --steps: must be >= 1; got 0"),
    (("demo", "--steps", "many"), "nanhunt demo: error: argument --steps: must be a whole number >= 1; got 'many'"),
    (("bogus",), "nanhunt: error: argument {run,demo,show,replay,audit}: invalid choice: 'bogus'"),
    (("run", "--mode", "fast", "x.py"), "nanhunt run: error: argument --mode: invalid choice: 'fast'"),
    # (an option of the script's given before it: named by `run`, whose --help lists nanhunt's own)
    (("run", "--lr", "1", "x.py"), "nanhunt run: error: unrecognized arguments: --lr (see 'nanhunt run --help')"),
    (("show", "r.json", "--pdf"), "nanhunt show: error: unrecognized arguments: --pdf (see 'nanhunt show --help')"),
    (("--bogus",), "nanhunt: error: unrecognized arguments: --bogus (see 'nanhunt --help')"),
])
def test_usage_errors_are_one_line_and_exit_2(cli, args, says):
    rc, out, err = cli(*args)
    assert rc == 2 and out == ""
    assert one_line(err).startswith(says)
    assert "args" not in one_line(err) or args[0] != "run"


@pytest.mark.parametrize("timeout", ["inf", "nan", "1e300", "0"])
def test_a_dist_timeout_that_cannot_be_a_timeout_is_a_usage_error(cli, tmp_path, timeout):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    rc, _, err = cli("run", "--dist-timeout", timeout, str(script))
    assert rc == 2 and "--dist-timeout" in one_line(err) and not marker.exists()


def test_paths_are_checked_before_any_work(cli, tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    rc, _, err = cli("run", "--report", str(tmp_path / "no" / "r.json"), str(script))
    assert rc == 2 and "does not exist" in one_line(err) and not marker.exists()
    rc, _, err = cli("run", "--bundle", str(tmp_path / "no" / "b.pt"), str(script))
    assert rc == 2 and "does not exist" in one_line(err) and not marker.exists()
    rc, _, err = cli("demo", "--out", str(tmp_path / "no" / "d.html"))
    assert rc == 2 and "does not exist" in one_line(err) and "training" not in err
    rc, _, err = cli("demo", "--out", str(tmp_path / "d.png"))
    assert rc == 2 and ".html" in one_line(err)
    rc, _, err = cli("demo", "--report", str(tmp_path / "no" / "r.json"))
    assert rc == 2 and "does not exist" in one_line(err) and "training" not in err


# ---------------------------------------------------------------- show
@pytest.fixture
def saved_report(tmp_path):
    from .test_render import report

    return report().save(tmp_path / "r.json")


def test_show_checks_the_html_path_before_printing(cli, saved_report):
    rc, out, err = cli("show", saved_report, "--html", "/no/such/dir/x.html")
    assert rc == 2 and out == ""
    assert one_line(err) == "nanhunt: --html '/no/such/dir/x.html': folder '/no/such/dir' does not exist"
    rc, out, err = cli("show", saved_report, "--html", "x.txt")
    assert rc == 2 and out == "" and "must end in .html" in one_line(err)


def test_show_on_a_bundle_points_to_replay(cli, tmp_path):
    path = tmp_path / "first.pt"
    torch.save({"format": "nanhunt.bundle/1"}, path)
    rc, out, err = cli("show", str(path))
    assert rc == 2 and out == ""
    assert one_line(err) == (f"nanhunt: {path} is a torch.save file (a bundle?), not a report: "
                             f"replay a bundle with `nanhunt replay {path}`")


def test_show_on_binary_or_broken_files_is_one_line(cli, tmp_path):
    binary = tmp_path / "x.json"
    binary.write_bytes(b"\x80\x81\xff" * 10)
    rc, _, err = cli("show", str(binary))
    assert rc == 2 and "not a text file" in one_line(err)
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": "nanhunt.report/1",\n "findings": [\n')
    rc, _, err = cli("show", str(broken))
    assert rc == 2 and "not a JSON report" in one_line(err)
    rc, _, err = cli("show", str(tmp_path))
    assert rc == 2 and one_line(err).startswith("nanhunt: cannot read report")


# ---------------------------------------------------------------- replay
def test_replay_on_non_bundles_is_one_clear_line(cli, tmp_path, saved_report):
    rc, _, err = cli("replay", saved_report)
    assert rc == 2 and one_line(err) == (f"nanhunt: {saved_report} is not a nanhunt bundle "
                                         f"(it looks like a JSON report: `nanhunt show {saved_report}`)")
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    rc, _, err = cli("replay", str(text))
    assert rc == 2 and one_line(err) == f"nanhunt: {text} is not a nanhunt bundle (not a file written by torch.save)"
    state = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, state)
    rc, _, err = cli("replay", str(state))
    assert rc == 2 and "is not a nanhunt bundle (format 'nanhunt.bundle/1' expected)" in one_line(err)
    objects = tmp_path / "objects.pt"
    torch.save({"a": fractions.Fraction(1, 3)}, objects)
    rc, _, err = cli("replay", str(objects))
    line = one_line(err)
    assert rc == 2 and "refused: it holds a fractions.Fraction object" in line
    assert "Please file an issue" not in line
    rc, _, err = cli("replay", str(tmp_path / "missing.pt"))
    assert rc == 2 and one_line(err) == f"nanhunt: no such bundle file: {str(tmp_path / 'missing.pt')!r}"


class _Payload:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_replay_refusal_names_the_global_and_never_relays_torchs_advice(cli, tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    torch.save({"a": torch.ones(2), "evil": _Payload(str(marker))}, evil)
    rc, _, err = cli("replay", str(evil))
    line = one_line(err)
    assert rc == 2 and line.startswith(f"nanhunt: {evil} was refused") and "posix.system" in line, line
    assert "will likely succeed" not in line and "weights_only` set to `False" not in line, line
    assert not marker.exists()


def _bundle(tmp_path):
    from nanhunt._locate import bundle as bundle_mod

    path = tmp_path / "b.pt"
    bundle_mod.save(path, module=nn.Linear(4, 2), module_name="lin", args=(torch.full((1, 4), 1e38),), kwargs={},
                    rng_state=torch.get_rng_state(), cuda_rng=None, finding=None)
    return path


def test_replay_of_a_bundle_without_its_inputs_is_a_usage_error(cli, tmp_path):
    """Today: accepted, the module called with no input, exit 1 ("module raised")."""
    d = torch.load(_bundle(tmp_path), weights_only=True)
    del d["args"]
    path = tmp_path / "no_args.pt"
    torch.save(d, path)
    rc, out, err = cli("replay", str(path))
    assert rc == 2 and out == "" and one_line(err) == f"nanhunt: {path}: bundle.args is missing"


def test_replay_of_a_truncated_bundle_says_so(cli, tmp_path):
    data = _bundle(tmp_path).read_bytes()
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(data[: len(data) // 2])
    rc, _, err = cli("replay", str(trunc))
    line = one_line(err)
    assert rc == 2 and line.startswith(f"nanhunt: {trunc} ") and "truncated" in line.removeprefix(f"nanhunt: {trunc} ")


@pytest.mark.parametrize("device, says", [("bogus", "cannot replay on device 'bogus': Expected one of cpu"),
                                          ("cuda:x", "cannot replay on device 'cuda:x': Invalid device string"),
                                          ("meta", "cannot replay on device 'meta': its tensors hold no values")])
def test_replay_on_a_device_that_is_none_or_holds_no_values_is_one_line(cli, tmp_path, device, says):
    """Today: torch's traceback from nanhunt itself (a device string torch refuses; meta: at the
    output's isfinite)."""
    rc, out, err = cli("replay", str(_bundle(tmp_path)), "--device", device)
    assert rc == 2 and out == "" and one_line(err).startswith(f"nanhunt: {says}"), err


@pytest.mark.parametrize("kind", ["folder", "dev-zero", "fifo"])
def test_replay_names_a_folder_a_device_or_a_fifo(cli, tmp_path, kind):
    """Today: "no such bundle file" for all three."""
    path = tmp_path / "b.pt"
    if kind == "folder":
        path.mkdir()
        says = "is a folder"
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
        says = "is a character device"
    else:
        os.mkfifo(path)
        says = "is a FIFO (named pipe)"
    rc, _, err = cli("replay", str(path))
    assert rc == 2 and one_line(err) == f"nanhunt: {path} {says}, not a bundle file"
    from nanhunt._locate.bundle import BundleError, load

    with pytest.raises(BundleError, match=re.escape(says)):
        load(path)


MODELS = '''
import torch
from torch import nn


class LogHead(nn.Module):
    def __init__(self, gate=1.0):
        super().__init__()
        self.gate = gate
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.lin(x).abs().sum(-1) * self.gate)  # log(0) once the gate is shut


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = LogHead()

    def forward(self, x):
        return self.head(self.body(x)).mean()


def fresh_head():
    return LogHead()  # gate open: finite on the same inputs


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("the module's own bug")
'''

TRAIN = '''
import torch
from mymodels import Net

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(4):
    if step == 2:
        net.head.gate = 0.0
    loss = net(torch.randn(8, 4))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.fixture
def user_bundle(tmp_path, monkeypatch, cli):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("mymodels", "_nanhunt_user_mymodels"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    rc, _, err = cli("run", "--bundle", "first.pt", "train.py")
    assert rc == 3 and "forward of `head` (LogHead) at step 2" in err
    yield tmp_path / "first.pt"
    for name in ("mymodels", "_nanhunt_user_mymodels"):
        sys.modules.pop(name, None)


def test_replay_of_a_custom_module_class_from_the_command_line(cli, user_bundle):
    rc, _, err = cli("replay", str(user_bundle))
    assert rc == 2
    assert one_line(err).endswith("(command line: nanhunt replay BUNDLE --module mymodels:LogHead)")
    for spec in ("mymodels:LogHead", "mymodels.py:LogHead"):
        rc, out, err = cli("replay", str(user_bundle), "--module", spec)
        assert rc == 3, err
        assert out.startswith("Reproduced: `head` (LogHead) gives output[0] = -inf again"), out
    # a function that builds the module: the user's own instance, gate open: the saved weights, finite
    rc, out, _ = cli("replay", str(user_bundle), "--module", "mymodels:fresh_head")
    assert rc == 0 and out.startswith("Not reproduced")


def test_replay_module_errors(cli, user_bundle):
    for spec, says in [
        ("mymodels", "--module must be MODULE:NAME or FILE.py:NAME"),
        ("mymodels:Nope", "'mymodels' has no 'Nope'"),
        ("nosuchpkg:X", "cannot import 'nosuchpkg': ModuleNotFoundError"),
        ("missing.py:X", "no such file 'missing.py'"),
        ("mymodels:Net", "the bundle's failing module is a LogHead, not a Net"),
        ("mymodels:torch", "is a module, not an nn.Module class or a function"),
    ]:
        rc, _, err = cli("replay", str(user_bundle), "--module", spec)
        assert rc == 2 and says in one_line(err), (spec, err)


def test_replay_exit_1_when_the_module_itself_fails(cli, user_bundle, monkeypatch):
    import mymodels  # type: ignore[import-not-found]

    monkeypatch.setattr(mymodels.LogHead, "forward", mymodels.Broken.forward)
    rc, out, _ = cli("replay", str(user_bundle), "--module", "mymodels:LogHead")
    assert rc == 1 and "Replaying `head` (LogHead) failed: RuntimeError: the module's own bug" in out


@pytest.mark.parametrize("suffix", [".html", ".txt"])
def test_show_of_a_rendered_report_says_it_reads_the_json(cli, tmp_path, suffix):
    path = tmp_path / f"r{suffix}"
    path.write_text("<html>a rendering</html>\n" if suffix == ".html" else "First NaN: ...\n")
    rc, out, err = cli("show", str(path))
    assert rc == 2 and out == "" and "reads the .json report" in one_line(err)
