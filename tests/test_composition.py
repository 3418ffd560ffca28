"""Hunts that run at once see only their own program: one hunt's replays are invisible to the others.

Each case runs every hunt alone first, then all of them together on the same model and data: each
hunt's findings (and step count) must be the same as alone. Today's failure modes were replays
counted as root calls (extra steps, findings at steps that never ran) and recorded into the other
hunt's step (wrong module, cause "unknown").
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optimizer_mod

import nanhunt
from nanhunt import Report

from . import zoo

BAD_STEP = 2


def _fields(h: Any) -> list[tuple[Any, ...]]:
    return [(f.phase, f.module, f.tensor, f.step, f.call, f.index, f.cause, f.op, f.reproducible) for f in h.findings]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> list[torch.Tensor]:
    """A batch with a huge row at BAD_STEP makes Exp overflow (created there, from finite inputs);
    the weights are put back after each step so later steps are clean again."""
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 4)
        if step == BAD_STEP:
            x[3] = 1000.0
        good = zoo.snapshot(model)
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        model.load_state_dict(good)
    return losses


# (target, with optimizer): "m" the model, "c" its first Linear
CASES = {
    "same model twice": [("m", True), ("m", True)],
    "parent then child": [("m", True), ("c", False)],
    "child then parent": [("c", False), ("m", True)],
    "parent and child, no optimizer": [("m", False), ("c", False)],
}


def _hunts(spec: list[tuple[str, bool]], model: nn.Module, opt: torch.optim.Optimizer, mode: str) -> list[Any]:
    return [nanhunt.watch(model if t == "m" else model[0], opt if o else None, on_find="record", mode=mode)
            for t, o in spec]


@pytest.mark.parametrize("mode", ["full", "sentinel", "ops"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_hunt_sees_only_its_own_program(case: str, mode: str) -> None:
    spec = CASES[case]
    alone = []
    for one in spec:
        model = zoo.expnet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        (h,) = _hunts([one], model, opt, mode)
        _train(model, opt)
        h.close()
        alone.append((h.step, _fields(h)))
    assert any(f for _, f in alone), "set-up: the planted overflow is found"
    plain = zoo.expnet()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    plain_losses = _train(plain, plain_opt)
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hunts = _hunts(spec, model, opt, mode)
    losses = _train(model, opt)
    for h in hunts:
        h.close()
    together = [(h.step, _fields(h)) for h in hunts]
    assert together == alone
    # and the run itself is the unwatched one, bit for bit
    assert all(zoo.bit_equal(a, b) for a, b in zip(losses, plain_losses))
    assert zoo.same_state(zoo.snapshot(model), zoo.snapshot(plain))


# ---------------------------------------------------------------- nanhunt run + the script's own watch
OWN_WATCH = '''
import json
import sys

import torch
from torch import nn
from torch.optim import optimizer as optimizer_mod

import nanhunt

mode, warmup = sys.argv[1], sys.argv[2] == "warmup"


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if warmup:  # nanhunt run starts watching here, before the script's own watch
    with torch.no_grad():
        model(torch.randn(2, 4))
hunt = nanhunt.watch(model, opt, on_find=mode)
caught = []
for step in range(4):
    x = torch.randn(8, 4)
    if step == 2:
        x[3] = 1000.0
    good = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    except nanhunt.NonFiniteError as e:
        caught.append(e.finding.step)
    opt.zero_grad()
    model.load_state_dict(good)
hunt.close()
print("OWN", json.dumps({"caught": caught, "findings": [[f.phase, f.module, f.step, f.op] for f in hunt.findings]}))
'''


@pytest.fixture
def run_cli(capsys):
    from nanhunt._cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.mark.parametrize("warmup", ["warmup", "no-warmup"])
@pytest.mark.parametrize("mode", ["record", "raise"])
def test_nanhunt_run_leaves_a_script_its_own_watch(tmp_path, run_cli, mode: str, warmup: str) -> None:
    """The script's hunt wins for its model: it behaves as the script asked (record never raises
    into the script; raise is caught by the script at the bad step), and `nanhunt run` reports its
    findings once and exits 3."""
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(OWN_WATCH))
    report = tmp_path / "r.json"
    rc, out, err = run_cli("run", "--report", str(report), str(script), mode, warmup)
    line = next((ln for ln in out.splitlines() if ln.startswith("OWN ")), None)
    assert line is not None, (out, err)
    own = json.loads(line[4:])
    assert own["caught"] == ([BAD_STEP] if mode == "raise" else [])
    if mode == "record":
        # record mode lets step() apply the non-finite gradients: the weights it wrote are judged
        # at once (before the script's load_state_dict puts them back), an optimizer finding
        assert [f[:3] for f in own["findings"]] == [["forward", "1", 2], ["grad", "0", 2], ["optimizer", "0", 2]]
    assert own["findings"][0] == ["forward", "1", BAD_STEP, "aten.exp.default"]
    assert rc == 3, err
    saved = Report.load(report)
    assert [[f.phase, f.module, f.step, f.op] for f in saved.findings] == own["findings"]


def test_an_on_find_that_opens_a_hunt_on_the_stepping_optimizer_does_not_break_its_step() -> None:
    """Two hunts; the first one's callback opens a third hunt on an optimizer finding, made while
    torch iterates the optimizer's step post-hooks: registering the new hunt's hooks mutated that
    dict ('OrderedDict mutated during iteration' out of the user's opt.step()). The new hunt takes
    the optimizer at the model's next call and counts its steps from there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opened: list[nanhunt.Hunt] = []

    def open_another(f: nanhunt.Finding) -> None:
        if f.phase == "optimizer" and not opened:
            opened.append(nanhunt.watch(model, opt, on_find="record"))

    try:
        with nanhunt.watch(model, opt, on_find=open_another), nanhunt.watch(model, opt, on_find="record"):
            for step in range(4):
                x = torch.randn(4, 4)
                model(x).pow(2).mean().backward()
                if step == 1:
                    opt.param_groups[0]["lr"] = float("inf")  # the update makes inf/nan weights
                opt.step()
                opt.param_groups[0]["lr"] = 0.1
                opt.zero_grad()
                with torch.no_grad():
                    for p in model.parameters():
                        p.nan_to_num_(0.0, 0.0, 0.0)
        assert opened and opened[0].step == 2, "the new hunt counts the steps after it took the optimizer"
    finally:
        for h in opened:
            h.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("then", ["opens a hunt", "closes another hunt", "closes one on another thread"])
def test_an_on_find_that_opens_or_closes_a_hunt_at_an_unwatched_optimizers_step_does_not_break_it(then: str) -> None:
    """A hunt not given the optimizer judges its step from torch's global optimizer pre-hook, which
    torch iterates live: a hunt opened or closed from its on_find (or on another thread meanwhile)
    added or removed a hook of that dict, and the user's opt.step() raised 'OrderedDict mutated
    during iteration'. Now the step goes on; nothing is left behind."""
    import threading

    model, other, third = zoo.lognet(), zoo.mlp(), zoo.mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opened: list[nanhunt.Hunt] = []

    def on_find(f: nanhunt.Finding) -> None:
        if then == "opens a hunt":
            opened.append(nanhunt.watch(third, on_find="record"))
        elif then == "closes another hunt":
            second.close()
        else:
            t = threading.Thread(target=second.close)
            t.start()
            t.join()

    first = nanhunt.watch(model, on_find=on_find)  # the optimizer not given: judged as its step() begins
    second = nanhunt.watch(other, on_find="record")
    before = zoo.snapshot(model)
    try:
        x = torch.rand(4, 4)
        x[0] = -100.0  # ReLU zeros the row: log(0)
        model(x).sum().backward()
        opt.step()
    finally:
        for h in (first, second, *opened):
            h.close()
    assert [f.module for f in first.findings][:1] == ["log"]
    assert not zoo.same_state(zoo.snapshot(model), before), "the step was taken (on_find, not raise)"
    assert not optimizer_mod._global_optimizer_pre_hooks


@pytest.mark.parametrize("where", ["step", "forward"])
def test_a_hunt_the_on_find_opens_and_calls_does_not_take_the_judged_step_as_its_outside_code(where: str) -> None:
    """A callback that opens a hunt on a second model and calls it (a probe of a healthy reference
    model) turned the loss-code recorder on in the middle of the first hunt's judgement: the new
    hunt recorded the rest of the judged step, the optimizer's update of the first model with its
    -inf gradients, as its own outside code, and its close() raised a NonFiniteError ('add_ was fed
    a non-finite value') about a model it does not watch. As opened anywhere else, it sees nothing
    of the other model's step."""
    model, reference = zoo.lognet(), zoo.mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opened: list[nanhunt.Hunt] = []

    def on_find(f: nanhunt.Finding) -> None:
        if not opened:
            opened.append(nanhunt.watch(reference))  # on_find="raise"
            reference(torch.randn(2, 4))

    hunt = nanhunt.watch(model, opt if where == "step" else None, on_find=on_find)
    try:
        x = torch.rand(8, 4)
        x[0] = -100.0  # ReLU zeros the row: log(0)
        for _ in range(2):
            model(x).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        hunt.close()
        for h in opened:
            h.close()  # raised for the other model's step
    assert [f.module for f in hunt.findings][:1] == ["log"]
    assert opened and opened[0].findings == []


class _Normalize(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h / h.norm(dim=-1, keepdim=True)  # no epsilon: 0/0 for an all-zero row


def test_hunt_occurred_orders_the_findings_of_one_hunt_per_model() -> None:
    """A GAN watched with one hunt per model: the discriminator's step judges the generator's NaN
    output (fed in) before the generator's step judges the forward that made it; `occurred` puts
    the generator's finding first."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 4), _Normalize()), nn.Linear(4, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.0), torch.optim.SGD(d.parameters(), lr=0.0)
    with nanhunt.watch(g, og, on_find="record") as hg, nanhunt.watch(d, od, on_find="record") as hd:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    g[0].weight.zero_()
                    g[0].bias.zero_()
            zoo.gan_round(d, g(torch.randn(8, 4)), od, og)
    assert hd.findings and hg.findings
    d0, g0 = hd.findings[0], hg.findings[0]
    assert (d0.step, d0.module, d0.cause) == (1, "", "input")
    assert (g0.step, g0.phase, g0.module, g0.cause, g0.op) == (1, "forward", "1", "created", "aten.div.Tensor")
    both = [(hg.occurred(f), f) for f in hg.findings] + [(hd.occurred(f), f) for f in hd.findings]
    assert all(c > 0 for c, _ in both)
    assert min(both, key=lambda x: x[0])[1] is g0
    assert hd.occurred(g0) == 0  # not one of its findings
