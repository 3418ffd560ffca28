"""`nanhunt run` on untouched scripts, `show`, and `python -m nanhunt`."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optim_mod

from nanhunt import NonFiniteError, Report
from nanhunt._cli.auto import AutoWatch
from nanhunt._cli.main import main, rank_path
from tests import zoo

LOG_OF_ZERO = '''
import sys
import torch
from torch import nn

from helper import GATE_STEP  # a sibling module: sys.path[0] is the script's folder


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class LogHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = 1.0

    def forward(self, x):
        return torch.log(x.abs().sum(-1) * self.gate)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = LogHead()

    def forward(self, x):
        return self.head(self.body(x)).mean()


assert __name__ == "__main__"
torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(8):
    if step == GATE_STEP:
        net.head.gate = 0.0  # log(0) from here on
    loss = net(torch.randn(8, 4))
    opt.zero_grad()
    loss.backward()
    opt.step()
print("finished", sys.argv[1:])
'''

CLEAN = '''
import sys
import torch
from torch import nn

model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loss_fn = nn.MSELoss()
for _ in range(4):
    loss = loss_fn(model(torch.randn(5, 3)), torch.zeros(5, 1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print("argv", sys.argv)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
'''


def nanhunt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command, in a fresh process (`python -m nanhunt`)."""
    return subprocess.run([sys.executable, "-m", "nanhunt", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture
def cli(capsys, monkeypatch):
    """The same command in this process (faster): returns (status, stdout, stderr)."""
    monkeypatch.delitem(sys.modules, "helper", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    yield run
    sys.modules.pop("helper", None)


@pytest.fixture
def fault_script(tmp_path):
    (tmp_path / "helper.py").write_text("GATE_STEP = 5\n")
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(LOG_OF_ZERO))
    return path


def test_run_finds_a_planted_log_of_zero(fault_script, tmp_path, cli):
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    p = nanhunt("run", "--report", str(report), str(fault_script), "--lr", "1")
    assert p.returncode == 3, p.stderr
    assert "finished" not in p.stdout  # raise mode stops the script
    first = next(line for line in p.stderr.splitlines() if line.startswith("First"))
    assert first.startswith("First -Inf: forward of `head` (LogHead) at step 5"), p.stderr
    assert "train.py:24" in first  # the line of torch.log in the script
    r = Report.load(report)
    assert r.first is not None and r.first.module == "head" and r.first.step == 5
    rc, out, _ = cli("show", str(report))
    assert rc == 0
    assert out.splitlines()[0] == first


def test_run_record_lets_the_script_finish_and_still_exits_3(fault_script, cli):
    rc, out, err = cli("run", "--on-find", "record", "--mode", "full", str(fault_script), "a", "b")
    assert rc == 3, err
    assert "finished ['a', 'b']" in out
    assert "forward of `head` (LogHead) at step 5" in err


@pytest.mark.parametrize("on_find", ["record", "warn", "raise"])
def test_run_writes_its_report_at_the_first_finding_as_watch_does(tmp_path, on_find):
    """A run killed after its first finding (a job's time limit, ``os._exit``) still leaves its
    report, as ``watch(report=...)`` does. Today: written only once the script has ended."""
    (tmp_path / "helper.py").write_text("GATE_STEP = 5\n")
    script = tmp_path / "train.py"
    killed = textwrap.dedent(LOG_OF_ZERO).replace("    opt.step()\n", "    opt.step()\n    if step == 6:\n"
                                                 "        import os; os._exit(9)  # killed\n")
    if on_find == "raise":  # (a loop that goes on past its errors)
        killed = killed.replace("    loss = net(", "    try:\n        loss = net(").replace(
            "    opt.step()\n", "        opt.step()\n    except FloatingPointError:\n        pass\n").replace(
            "    opt.zero_grad()\n    loss.backward()\n", "        opt.zero_grad()\n        loss.backward()\n")
    script.write_text(killed)
    report = tmp_path / "report.json"
    p = nanhunt("run", "--on-find", on_find, "--report", str(report), str(script))
    assert p.returncode == 9, p.stderr
    r = Report.load(report)
    assert r.first is not None and (r.first.module, r.first.step) == ("head", 5), p.stderr


NAN_SCALE = """
import torch
from torch import nn


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.mu, self.sigma = nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.mu(h), torch.sqrt(self.sigma(h))


torch.manual_seed(0)
m = Policy()
opt = torch.optim.SGD(m.parameters(), lr=0.01)
mu, sigma = m(torch.randn(4, 8))
torch.distributions.Normal(mu, sigma, validate_args=True).log_prob(torch.zeros(4, 2)).mean().backward()  # ValueError: a NaN scale
opt.step()
"""


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_run_of_a_script_that_its_own_argument_check_stops_reports_the_models_nan(tmp_path, cli, mode):
    # torch.distributions' validate_args raises ValueError on the NaN scale the model returned, before
    # any backward: sentinel said "no NaN/Inf found; exit status 1 is the script's own"
    script = tmp_path / "policy.py"
    script.write_text(NAN_SCALE)
    rc, out, err = cli("run", "--mode", mode, str(script))
    assert rc == 3, err
    assert "ValueError" in err and "born here in aten.sqrt.default" in err and "no NaN/Inf found" not in err, err


def test_run_clean_script_passes_its_status_and_argv(tmp_path, cli):
    script = tmp_path / "clean.py"
    script.write_text(CLEAN)
    rc, out, err = cli("run", str(script))
    assert rc == 0, err
    assert f"argv ['{script}']" in out
    seven = nanhunt("run", "--report", str(tmp_path / "r.json"), str(script), "7")
    assert seven.returncode == 7, seven.stderr
    assert f"argv ['{script}', '7']" in seven.stdout
    assert Report.load(tmp_path / "r.json").first is None  # a clean report is written too



def test_run_passes_a_double_dash_after_the_script_on_as_python_does(tmp_path, cli):
    # `python train.py -- -x` gives the script ['--', '-x'] (its argparse then reads -x as a value);
    # `nanhunt run train.py -- -x` gave it ['-x']: argparse dropped the `--` right after the script
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:])\n")
    for args, want in [(["--", "-x"], "['--', '-x']"), (["--", "--", "a"], "['--', '--', 'a']"),
                       (["a", "--", "b"], "['a', '--', 'b']"), (["--"], "['--']")]:
        rc, out, err = cli("run", str(script), *args)
        assert rc == 0 and out.strip() == f"argv {want}", (args, out, err)
        rc, out, err = cli("run", "--", str(script), *args)  # nanhunt's own `--` before the script: its own
        assert rc == 0 and out.strip() == f"argv {want}", (args, out, err)


@pytest.mark.parametrize("status", ["3", "2", "1"])
def test_run_script_own_exit_status_is_passed_on_and_told_from_a_finding(tmp_path, cli, status):
    # a script's own sys.exit(3) came back as a bare 3: the same status as a finding, with no word
    # on stderr that nanhunt had found nothing (and a 2 read as a usage error)
    script = tmp_path / "clean.py"
    script.write_text(CLEAN)
    rc, out, err = cli("run", str(script), status)
    assert rc == int(status), err
    assert f"argv ['{script}', '{status}']" in out
    assert err.strip().splitlines()[-1] == f"nanhunt: no NaN/Inf found; exit status {status} is the script's own"
    assert "First" not in err
    rc, out, err = cli("run", str(script), "0")
    assert rc == 0 and "nanhunt" not in err, err


COMPILED = """
import sys, torch, torch.nn as nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
if sys.argv[1] == "fn":
    run = torch.compile(m, backend="aot_eager")
else:
    m.compile(backend="aot_eager")
    run = m
for step in range(3):
    x = torch.randn(4, 8)
    if step == 1 and sys.argv[2] == "nan":
        x[0, 0] = float("nan")
    run(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("finished")
"""


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # dynamo's, tracing
@pytest.mark.parametrize("how", ["fn", "method"])
def test_run_a_script_that_compiles_its_model(tmp_path, cli, how):
    # the discovery hooks are traced into torch.compile(model)'s graph: they must stay out of it
    # (a mutation there broke the script), and still find a model.compile()d root
    import torch._dynamo

    script = tmp_path / "compiled.py"
    script.write_text(COMPILED)
    try:
        rc, out, err = cli("run", str(script), how, "clean")
        assert rc == 0 and "finished" in out, err
        torch._dynamo.reset()
        rc, out, err = cli("run", str(script), how, "nan")
        assert rc == 3, err
        assert "forward of `0` (Linear) at step 1" in err
    finally:
        torch._dynamo.reset()


COMPILED_STEP = """
import sys, torch, torch.nn as nn
from torch._dynamo.utils import counters
torch._dynamo.reset()
counters.clear()
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(m.parameters(), lr=1e-2)
opt.step = torch.compile(opt.step, backend="aot_eager")
try:
    for step in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        if step == 2 and sys.argv[1] == "nan":
            loss = loss.div(0.0).mul(0.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
finally:
    print("graphs", counters["stats"]["unique_graphs"])
"""


def test_run_a_script_that_compiles_its_optimizer_step_compiles_as_many_graphs_as_unwatched(
        tmp_path, cli, capsys, monkeypatch):
    # aot_eager's runtime calls its graph as a module, at the top level: each was discovered as a
    # root, its new hunt reset dynamo's caches, and every step compiled again (12 graphs for 1)
    import runpy

    import torch._dynamo

    script = tmp_path / "compiled_step.py"
    script.write_text(COMPILED_STEP)
    try:
        monkeypatch.setattr(sys, "argv", [str(script), "clean"])
        runpy.run_path(str(script), run_name="__main__")
        plain = capsys.readouterr().out
        rc, out, err = cli("run", str(script), "clean")
        assert rc == 0 and out == plain, (plain, out, err)
        rc, out, err = cli("run", str(script), "nan")
        assert rc == 3 and out == plain, (plain, out, err)
        assert "forward of `<outside>`" in err and "at step 2" in err and "aten.div.Tensor" in err, err
    finally:
        torch._dynamo.reset()


def test_run_script_that_crashes(tmp_path, cli):
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('the script broke')\n")
    rc, _, err = cli("run", str(script))
    assert rc == 1
    assert "the script broke" in err
    # the traceback `python boom.py` prints: the script's frames, not nanhunt's and runpy's that ran it
    assert err.splitlines()[:3] == ["Traceback (most recent call last):", f'  File "{script}", line 1, in <module>',
                                    "    raise RuntimeError('the script broke')"], err
    script.write_text("print(1\n")
    rc, _, err = cli("run", str(script))
    assert rc == 1 and err.splitlines()[0] == f'  File "{script}", line 1', err  # as python shows a syntax error


def test_run_usage_errors(tmp_path, cli):
    rc, _, err = cli("run", str(tmp_path / "missing.py"))
    assert rc == 2 and "no such script" in err
    rc, _, err = cli("run", str(tmp_path))  # it exists: a folder, not a missing script
    assert rc == 2 and "is a folder, not a script" in err and "no such" not in err
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # it exists, but is no script: named as what it is
    rc, _, err = cli("run", str(tmp_path / "loop"))
    assert rc == 2 and "symbolic links" in err and "no such" not in err, err
    rc, _, err = cli("run", os.devnull)
    assert rc == 2 and "is a character device" in err and "no such" not in err, err
    nb = tmp_path / "train.ipynb"  # python runs its JSON: nothing (a dict literal) or NameError: 'null'
    nb.write_text('{"cells": [{"cell_type": "code", "execution_count": null, "source": ["1 / 0"]}], "nbformat": 4}\n')
    rc, _, err = cli("run", str(nb))
    assert rc == 2 and "is a Jupyter notebook" in err and "nbconvert --to script train.ipynb" in err, err
    nb.write_text('{"cells": [], "nbformat": 4}\n')
    assert cli("run", str(nb))[0] == 2
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    rc, _, err = cli("run", "--report", str(tmp_path / "r.csv"), str(script))
    assert rc == 2 and ".json, .html or .txt" in err
    assert cli()[0] == 2


def test_run_of_a_folder_with_a_main_runs_it_as_python_does(tmp_path, cli, monkeypatch):
    """`python app/` runs app/__main__.py with the folder first on sys.path; `nanhunt run app/`
    refused it as "a folder, not a script"."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("GATE_STEP = 5\n")  # a sibling of __main__.py: the folder is on sys.path
    (app / "__main__.py").write_text(textwrap.dedent(LOG_OF_ZERO))
    monkeypatch.setattr(sys, "path", list(sys.path))
    rc, _, err = cli("run", str(app))
    assert rc == 3 and "First -Inf: forward of `head` (LogHead) at step 5" in err, err


def test_show_refuses_bad_files(tmp_path, cli):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = cli("show", str(bad))
    assert rc == 2 and "cannot read report" in err and "Traceback" not in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    assert cli("show", str(other))[0] == 2
    assert cli("show", str(tmp_path / "nope.json"))[0] == 2


def test_rank_suffix():
    assert rank_path("out/r.json", "3") == "out/r.rank3.json"
    assert rank_path("r.html", "") == "r.html"


def test_rank_suffix_under_torchrun_env(fault_script, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    rc, _, err = cli("run", "--report", str(tmp_path / "r.json"), str(fault_script))
    assert rc == 3, err
    assert (tmp_path / "r.rank1.json").exists()


# ---------------------------------------------------------------- AutoWatch in-process
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train(model, opt, steps=3):
    for _ in range(steps):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def hooks_now():
    return (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks),
            len(optim_mod._global_optimizer_pre_hooks), torch.optim.Optimizer.__init__)


@pytest.mark.parametrize("opt_first", [True, False])
def test_autowatch_counts_steps_from_the_first_optimizer_step(opt_first):
    before = hooks_now()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if opt_first else None
    with AutoWatch(on_find="raise") as auto:
        if opt is None:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt)
        ((name, hunt),) = auto.hunts
        assert name == "Net"
        assert hunt.step == 3
    assert hooks_now() == before
    assert hunt.closed


def test_autowatch_prefers_the_outer_tree():
    model = Net()
    with AutoWatch(on_find="record") as auto:
        model.a(torch.randn(2, 3))  # a part first
        model(torch.randn(2, 3))  # then the whole
        model(torch.randn(2, 3))
        assert [n for n, _ in auto.hunts] == ["Linear", "Net"]
        assert auto.hunts[0][1].closed and not auto.hunts[1][1].closed


def test_autowatch_finding_names_are_relative_to_the_root():
    model = Net()
    with torch.no_grad():
        model.b.weight.fill_(float("inf"))
        model.b.bias.fill_(float("-inf"))
    with AutoWatch(on_find="record") as auto:
        model(torch.ones(2, 3))
        model(torch.ones(2, 3))
    f = auto.report().first
    assert f is not None and f.module == "b" and f.phase == "forward"
    assert auto.report().meta["roots"] == ["Net"]


GRADSCALER = """
import sys, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # too high: its first steps overflow float16
for step in range(6):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if step == int(sys.argv[1]):
        x[3, 2] = float("nan")  # a corrupt record
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("scale", scaler.get_scale())
"""


GAN_GRADSCALER = """
import sys, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # one for both, too high at first
bce = F.binary_cross_entropy_with_logits
for step in range(6):
    real, z = torch.randn(16, 8), torch.randn(16, 4)
    if step == int(sys.argv[1]):
        real[1, 2] = float("nan")  # a corrupt record
    with torch.autocast("cpu", dtype=torch.float16):
        fake = G(z)
        loss_d = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
    opt_d.zero_grad()
    scaler.scale(loss_d).backward()
    scaler.step(opt_d)
    with torch.autocast("cpu", dtype=torch.float16):
        loss_g = bce(D(fake), torch.ones(16, 1))
    opt_g.zero_grad()
    scaler.scale(loss_g).backward()
    scaler.step(opt_g)
    scaler.update()
print("scale", scaler.get_scale())
"""


@pytest.mark.parametrize("script_text", [GRADSCALER, GAN_GRADSCALER], ids=["one model", "gan, one scaler"])
def test_run_of_a_gradscaler_script_reports_no_calibration_overflow_but_a_real_nan(tmp_path, cli, script_text):
    # `nanhunt run` cannot be told the scaler: the inf gradients of its scale calibration (steps
    # the scaler skips, as intended) were each a finding, the first at "step 0", exit status 3.
    # A GAN's generator and discriminator through one scaler: only the hunt of the first optimizer
    # stepped took it (the generator's overflows were findings), and the discriminator's hunt took
    # the generator's step for a skip of its own
    script = tmp_path / "amp.py"
    script.write_text(script_text)
    step = torch.amp.GradScaler.step
    rc, out, err = cli("run", str(script), "-1")
    assert rc == 0 and "First" not in err, err
    assert float(out.split()[-1]) < 2.0 ** 40  # the scaler did skip steps
    rc, out, err = cli("run", "--on-find", "record", str(script), "4")
    assert rc == 3, err
    first = next(line for line in err.splitlines() if line.startswith("First"))
    assert first.startswith("First NaN: forward of `0` (Linear) at step 4"), err
    assert "All findings" not in err or "backward" not in err.split("All findings")[1], err
    assert torch.amp.GradScaler.step is step


LAYERNORM_OVERFLOW = '''
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(3, 4) * (1e25 if step == 2 else 1.0)  # LayerNorm's variance overflows float32
    net(x).sum().backward()
    opt.step()
    opt.zero_grad()
'''


def test_run_bundle_then_replay_reproduces(tmp_path, cli):
    script = tmp_path / "ln.py"
    script.write_text(LAYERNORM_OVERFLOW)
    bundle = tmp_path / "first.pt"
    rc, out, err = cli("run", "--bundle", str(bundle), str(script))
    assert rc == 3, err
    assert "`1` (LayerNorm)" in out + err and "step 2" in out + err
    assert bundle.exists()
    rc, out, err = cli("replay", str(bundle))
    assert rc == 3, out + err  # reproduced: a NaN/Inf found again
    assert cli("run", "--bundle", str(tmp_path / "b.json"), str(script))[0] == 2


OWN_WATCH_FIRST = '''
import torch, nanhunt
from torch import nn

class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, k):
        return torch.sqrt(self.lin(x).abs() - k)  # nan when k is large

torch.manual_seed(0)
m, aux = Bad(), Bad()
opt = torch.optim.SGD(m.parameters(), lr=0.0)
h = nanhunt.watch(m, optimizer=opt, on_find="record")  # the script's own hunt
for s in range(5):
    x = torch.randn(2, 4)
    with torch.no_grad():
        aux(x, torch.tensor(100.0 if s == 3 else 0.0))  # only auto-watched: nan at step 3
    m(x, torch.tensor(100.0 if s == 1 else 0.0)).sum().backward()  # nan at step 1
    opt.step()
    opt.zero_grad()
h.close()
'''


def test_run_orders_the_scripts_own_findings_with_the_auto_ones(tmp_path, cli):
    script = tmp_path / "own.py"
    script.write_text(OWN_WATCH_FIRST)
    report = tmp_path / "r.json"
    rc, _, err = cli("run", "--report", str(report), str(script))
    assert rc == 3, err
    first = next(line for line in err.splitlines() if line.startswith("First"))
    assert "at step 1" in first, err
    r = Report.load(report)
    assert r.first is not None and r.first.step == 1 and r.first.phase == "forward"
    steps = [f.step for f in r.findings]
    assert steps == sorted(steps) and steps[-1] == 3, steps  # aux's step-3 finding comes after m's step-1 ones


SPLIT_ROOTS = '''
import sys
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

torch.manual_seed(0)
model = Model()
if sys.argv[1] == "late":
    with torch.no_grad():  # parts called before the optimizer exists
        model.head(model.enc(torch.randn(2, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    for micro in range(2):  # gradient accumulation: two forwards per step
        out = model.head(torch.relu(model.enc(torch.randn(2, 4))))  # the parts, called one by one
        loss = out.pow(2).mean()
        if step == 2 and micro == 1:
            loss = loss / torch.zeros(())  # inf, born in the loop's own code
        loss.backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.parametrize("when", ["early", "late"])
def test_run_watches_a_model_whose_parts_the_loop_calls(tmp_path, cli, when):
    script = tmp_path / "split.py"
    script.write_text(SPLIT_ROOTS)
    report = tmp_path / "r.json"
    rc, _, err = cli("run", "--on-find", "record", "--report", str(report), str(script), when)
    assert rc == 3, err
    r = Report.load(report)
    assert r.meta["roots"][-1] == "Model"
    outside = [f for f in r.findings if f.module == "<outside>"]
    assert [(f.step, f.op) for f in outside] == [(2, "aten.div.Tensor")]  # once, at the optimizer's step
    assert r.first is outside[0]
    assert all(f.module.startswith(("enc", "head")) for f in r.findings[1:]), [f.module for f in r.findings]
    steps = [f.step for f in r.findings]
    assert steps == sorted(steps) and max(steps) == 3, steps


TWO_MODELS = '''
import torch
from torch import nn

torch.manual_seed(0)
a, b = nn.Linear(4, 2), nn.Linear(4, 2)
oa = torch.optim.SGD(a.parameters(), lr=0.01)
ob = torch.optim.SGD(b.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(3, 4)
    loss = a(x).pow(2).mean() + b(x).pow(2).mean()
    if step == 2:
        loss = loss / torch.zeros(())  # inf, born in the loop's own code: both hunts record it
    loss.backward()
    oa.step(); ob.step(); oa.zero_grad(); ob.zero_grad()
'''


def test_run_reports_an_outside_event_once_across_hunts(tmp_path, cli):
    script = tmp_path / "two.py"
    script.write_text(TWO_MODELS)
    report = tmp_path / "r.json"
    rc, _, err = cli("run", "--on-find", "record", "--report", str(report), str(script))
    assert rc == 3, err
    r = Report.load(report)
    assert r.meta["roots"] == ["Linear", "Linear"]
    assert [f.step for f in r.findings if f.module == "<outside>"] == [2]
    assert r.first is not None and r.first.module == "<outside>"


def test_run_gives_the_script_an_absolute_file_as_python_does(tmp_path, cli, monkeypatch):
    """`python sub/train.py` gives ``__file__`` as an absolute path (Python 3.9+); `nanhunt run
    sub/train.py` gave it as typed, so a script that changed directory and then read a file beside
    itself (``os.path.dirname(os.path.abspath(__file__))``) failed with FileNotFoundError."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "cfg.txt").write_text("7")
    (sub / "train.py").write_text(textwrap.dedent("""
        import os, sys
        here = os.path.dirname(os.path.abspath(__file__))
        os.chdir(os.path.dirname(here))
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cfg.txt")) as fh:
            print("cfg", fh.read(), os.path.isabs(__file__), os.path.basename(sys.argv[0]))
    """))
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("run", "sub/train.py")
    assert rc == 0, err
    assert out.strip() == "cfg 7 True train.py"  # (argparse's usage line names the same script)


def test_run_of_a_linked_script_imports_its_siblings_as_python_does(tmp_path, cli):
    """`python bin/train.py`, a link to ``src/train.py``, puts ``src`` (the folder the link points into)
    first on ``sys.path``; `nanhunt run bin/train.py` put ``bin`` there, and the script's
    ``import helper`` of its sibling failed with ModuleNotFoundError (exit 1)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "src" / "helper.py").write_text("GATE_STEP = 5\n")
    (tmp_path / "src" / "train.py").write_text(textwrap.dedent(LOG_OF_ZERO))
    (tmp_path / "bin" / "train.py").symlink_to(tmp_path / "src" / "train.py")
    rc, _, err = cli("run", str(tmp_path / "bin" / "train.py"))
    assert rc == 3, err
    assert "forward of `head` (LogHead) at step 5" in err


SPAWNED = """
import sys
import torch
import torch.multiprocessing as mp
from torch import nn


def worker(i, gate):
    torch.manual_seed(i)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(4):
        loss = torch.log(net(torch.randn(8, 4)).abs() * (0.0 if step == gate else 1.0)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=1)
    print("finished")
"""


def test_run_watches_the_processes_of_torch_multiprocessing_spawn(tmp_path, cli):
    # the training ran in mp.spawn's processes, which nothing watched: a log(0) there gave exit 0 and
    # "no NaN/Inf" (or, the script failing for another reason, exit 1)
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    report = tmp_path / "r.json"
    rc, out, err = cli("run", "--report", str(report), str(script), "2")
    assert rc == 3, err
    assert "First -Inf: forward of `<outside>` (worker) at step 2" in err and "aten.log.default" in err
    r = Report.load(report)
    assert r.first is not None and r.first.source == f"{script}:13"  # the line of torch.log
    assert torch.multiprocessing.spawn is torch.multiprocessing.spawn  # (put back: the name is still the function)
    assert sys.modules["torch.multiprocessing.spawn"].start_processes.__module__ == "torch.multiprocessing.spawn"
    rc, out, err = cli("run", str(script), "99")
    assert rc == 0 and "finished" in out, err


PROCESS = """
import sys
import torch
import multiprocessing
from torch import nn


def train(gate):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=8, num_workers=1)
    for step, x in enumerate(loader):
        loss = torch.log(net(x).abs() * (0.0 if step == gate else 1.0)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    p = multiprocessing.get_context(sys.argv[1]).Process(target=train, args=(int(sys.argv[2]),))
    p.start()
    assert p._target is train  # (the script's own object keeps its own target)
    p.join()
    print("child exit", p.exitcode)
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_run_watches_a_multiprocessing_process_the_script_starts(tmp_path, cli, method):
    # a multiprocessing.Process of the script's own function trained unwatched (spawn: exit 0, "no
    # NaN/Inf"), or (fork) under the inherited watch whose finding never reached the run: "no NaN/Inf
    # found; exit status 1 is the script's own"
    script = tmp_path / "process.py"
    script.write_text(PROCESS)
    start = multiprocessing.process.BaseProcess.start
    rc, out, err = cli("run", str(script), method, "2")
    assert rc == 3, err
    assert "First -Inf: forward of `<outside>` (train) at step 2" in err and "aten.log.default" in err
    assert "no NaN/Inf found" not in err
    assert multiprocessing.process.BaseProcess.start is start  # put back
    rc, out, err = cli("run", str(script), method, "99")  # a clean child (and its DataLoader worker)
    assert rc == 0 and "child exit 0" in out, err


# ---------------------------------------------------------------- several models: order of occurrence
class _Gen(nn.Module):
    """A generator that normalises its features without an epsilon: 0/0 once they are all zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, z):
        h = self.fc(z)
        return self.out(h / h.norm(dim=-1, keepdim=True))


def _gan(steps: int = 5) -> None:
    """The usual GAN loop: the discriminator's step comes first and judges the generator's
    output it was fed, before the generator's own step judges the forward that made it."""
    torch.manual_seed(0)
    G = _Gen()
    D = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    og = torch.optim.Adam(G.parameters(), 1e-3)
    od = torch.optim.Adam(D.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    for step in range(steps):
        if step == 3:
            with torch.no_grad():  # (a layer zeroed by hand, as pruning or a bad init does)
                G.fc.weight.zero_()
                G.fc.bias.zero_()
        fake = G(torch.randn(32, 8))
        d_loss = bce(D(torch.randn(32, 4)), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
        od.zero_grad()
        d_loss.backward()
        od.step()
        g_loss = bce(D(fake), torch.ones(32, 1))
        og.zero_grad()
        g_loss.backward()
        og.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_run_of_a_gan_reports_the_generators_value_not_the_discriminators_input(mode, on_find):
    with AutoWatch(on_find=on_find, mode=mode) as auto:
        if on_find == "raise":
            with pytest.raises(NonFiniteError) as ei:
                _gan()
            raised = ei.value.finding
        else:
            _gan()
    f = auto.report().first
    assert f is not None and (f.phase, f.step, f.cause, f.module_type) == ("forward", 3, "created", "_Gen"), f
    assert f.op == "aten.div.Tensor"
    assert auto.report().meta["root"] == "_Gen"
    if on_find == "raise":
        assert raised == f
    later = auto.findings()[1:]
    assert later and all(g.step >= 3 for g in later)


class _Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.log(x))


def _distill(teacher: nn.Module, student: nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(4):
        x = torch.rand(4, 3) + 0.1
        if step == 2:
            x[1, 2] = 0.0  # log(0) in the teacher
        y = student(x)
        with torch.no_grad():
            target = teacher(x)
        loss = (y - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_run_of_a_teacher_and_student_puts_the_teachers_no_grad_value_first(on_find):
    """Distillation: the teacher (no optimizer, no_grad) makes -inf at step 2; the student's
    step judges its NaN loss first, before the teacher's next call judges the teacher."""
    torch.manual_seed(0)
    teacher, student = _Teacher(), Net()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    with AutoWatch(on_find=on_find) as auto:
        if on_find == "raise":
            with pytest.raises(NonFiniteError) as ei:
                _distill(teacher, student, opt)
            assert ei.value.finding == auto.report().first
            assert all(p.isfinite().all() for p in student.parameters())  # never updated from the NaN
        else:
            _distill(teacher, student, opt)
    f = auto.report().first
    assert f is not None and (f.phase, f.step, f.module_type, f.cause, f.op) == (
        "forward", 2, "_Teacher", "created", "aten.log.default"), f
    assert auto.report().meta["root"] == "_Teacher"


def test_run_of_a_gan_in_warn_mode_calls_the_generators_value_the_first():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AutoWatch(on_find="warn") as auto:
            _gan()
    firsts = [str(w.message) for w in caught if str(w.message).startswith("First NaN")]
    assert len(firsts) == 1 and "(_Gen)" in firsts[0] and "aten.div.Tensor" in firsts[0], firsts
    assert auto.report().first is not None and auto.report().first.module_type == "_Gen"
    assert all(w.filename == __file__ for w in caught if "NaN" in str(w.message))  # the loop's line


def test_run_raises_the_generators_value_when_the_script_watches_the_generator_itself():
    import nanhunt as nh

    def gan_with_own_hunt() -> None:
        torch.manual_seed(0)
        G = _Gen()
        D = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
        with nh.watch(G, og, on_find="record"):  # the script's own hunt, on the generator
            for step in range(5):
                if step == 3:
                    with torch.no_grad():
                        G.fc.weight.zero_()
                        G.fc.bias.zero_()
                zoo.gan_round(D, G(torch.randn(32, 8)), od, og)

    with AutoWatch(on_find="raise") as auto:
        with pytest.raises(NonFiniteError) as ei:
            gan_with_own_hunt()
    f = ei.value.finding
    assert (f.module_type, f.step, f.cause, f.op) == ("_Gen", 3, "created", "aten.div.Tensor"), f
    assert auto.report().first == f


def test_run_lists_a_nan_made_in_the_loops_code_once_though_every_hunt_recorded_it():
    """0/0 in the loop's own code (a normalisation outside every model): each hunt whose root
    returned records it; the report lists it once (NaN values never compare equal)."""
    torch.manual_seed(0)
    G, D = nn.Linear(8, 4), nn.Linear(4, 1)
    og, od = torch.optim.SGD(G.parameters(), 0.0), torch.optim.SGD(D.parameters(), 0.0)
    with AutoWatch(on_find="record") as auto:
        for step in range(3):
            h = G(torch.randn(6, 8)) * (step != 1)
            fake = h / h.norm(dim=1, keepdim=True)  # 0/0 at step 1, seen by G's hunt and D's (called last)
            zoo.gan_round(D, fake, od, og)
    outside = [f for f in auto.findings() if f.module == "<outside>" and f.cause == "created"]
    assert len(outside) == 1 and outside[0].op == "aten.div.Tensor", [(f.module, f.step, f.op) for f in auto.findings()]


def test_run_in_warn_mode_calls_the_first_the_first_beside_a_model_called_once():
    """A model called once before the loop (embeddings precomputed) keeps its hunt's step open for
    good; it does not stop the training model's first finding from being warned as the first."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AutoWatch(on_find="warn"):
            encoder, model = nn.Linear(3, 3), Net()
            with torch.no_grad():
                features = encoder(torch.randn(16, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(3):
                x = features[step * 4:(step + 1) * 4].clone()
                if step == 1:
                    x[0, 0] = float("inf") - float("inf")  # a NaN batch
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    firsts = [str(w.message) for w in caught if str(w.message).startswith("First NaN")]
    assert len(firsts) == 1 and "at step 1" in firsts[0], [str(w.message)[:80] for w in caught]


def test_run_bundle_says_why_none_was_written_when_the_script_watches_the_model_itself(tmp_path, cli):
    """The script's own hunt holds the first finding: `--bundle` cannot apply to it (a model the
    script watches is left to its hunt). The run ended with exit 3, the report, and no bundle, saying
    nothing about it; an old bundle at that path does not count as written."""
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent('''
        import torch, nanhunt
        from torch import nn
        m = nn.Linear(4, 4)
        with nanhunt.watch(m):  # the script's own hunt
            torch.sqrt(m(torch.randn(2, 4)) - 100.0).sum()
        '''))
    bundle = tmp_path / "first.pt"
    bundle.write_bytes(b"an old bundle")
    rc, out, err = cli("run", "--bundle", str(bundle), str(script))
    assert rc == 3, err
    assert f"no repro bundle written to {bundle}" in err and "bundle=" in err, err
    assert bundle.read_bytes() == b"an old bundle"


def test_run_m_runs_a_module_of_a_package_as_python_m_does(tmp_path):
    """`python -m trainer.train --report mine.json` is how many projects start training (relative
    imports need the package); `nanhunt run -m trainer.train` was refused ("unrecognized arguments:
    -m"). The module runs as __main__ with its package imported, the arguments after it are its
    own (its --report too), and nanhunt's options come before -m."""
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("GATE_STEP = 5\n")
    (pkg / "train.py").write_text(textwrap.dedent(LOG_OF_ZERO).replace("from helper import", "from .helper import"))
    report = tmp_path / "nh.json"
    got = subprocess.run([sys.executable, "-m", "nanhunt", "run", "--on-find", "record", "--report", str(report),
                          "-m", "trainer.train", "--report", "mine.json"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert got.returncode == 3, got.stderr
    assert "finished ['--report', 'mine.json']" in got.stdout, got.stdout
    assert "forward of `head` (LogHead) at step 5" in got.stderr, got.stderr
    assert json.loads(report.read_text())["first"]["module"] == "head"
    missing = subprocess.run([sys.executable, "-m", "nanhunt", "run", "-m", "trainer.nosuch"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert missing.returncode == 2 and "no module named 'trainer.nosuch'" in missing.stderr, missing.stderr


def test_run_reads_the_started_processes_findings_when_one_was_stopped_while_writing_them(tmp_path, monkeypatch, capsys):
    """A started process stopped in the middle of writing its findings for the run (a second Ctrl-C,
    torch's spawn terminating the others when one fails) left half a JSON file, and `nanhunt run`
    ended in a JSONDecodeError traceback instead of the other processes' findings."""
    cli_main = importlib.import_module("nanhunt._cli.main")  # (the package's `main` is the function)
    folder = tmp_path / "spawned"
    folder.mkdir()
    options = {"on_find": "record", "mode": "full", "history": 32, "dist_timeout": 300.0}

    def train():
        nn.Linear(2, 2)(torch.tensor([[float("inf"), 0.0]]))

    def stopped(data, fh):
        fh.write(json.dumps(data)[:20])
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(json, "dump", stopped)
        with pytest.raises(KeyboardInterrupt):
            cli_main._watched(str(folder / "spawn-0.json"), options, train)
    cli_main._watched(str(folder / "spawn-1.json"), options, train)
    spawned = object.__new__(cli_main._Spawned)
    spawned.folder = str(folder)
    report = spawned.report(Report())
    assert [(f.phase, f.module_type, f.cause) for f in report.findings] == [("forward", "Linear", "input")]
    assert "spawn-0" not in capsys.readouterr().err  # (no half file was left to read)
    assert not folder.exists()
