"""Bounded memory between steps: a no_grad loop keeps no input batch once it is known finite, and
`report=` is not rewritten at every finding."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import pytest
import torch

import nanhunt
from nanhunt._record import hunt as hunt_mod
from nanhunt._report import Report

from . import zoo


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_no_grad_validation_loop_keeps_no_batch(mode: str) -> None:
    """400 validation batches between two optimizer steps: today every one stayed alive until the
    next step(); now at most the latest (its successor has not begun yet)."""
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        _train_step(model, opt)
        batches = []
        with torch.no_grad():
            for _ in range(400):
                x = torch.randn(8, 4)
                batches.append(weakref.ref(x))
                hunt.check(model(x).mean(), "val_loss")
                del x
        gc.collect()
        alive = sum(r() is not None for r in batches)
        assert alive <= 1, f"{alive} validation batches kept alive"
        _train_step(model, opt)
    assert hunt.findings == []


def _validation_loop(model: torch.nn.Module, after: Any = None) -> torch.Tensor:
    """300 no_grad batches; the 201st has a row of 1000 (the model's exp overflows there): that batch.
    ``after(i)`` runs after batch ``i``."""
    torch.manual_seed(3)
    bad = torch.empty(0)
    with torch.no_grad():
        for i in range(300):
            x = torch.randn(8, 4)
            if i == 200:
                x[2] = 1000.0
                bad = x.clone()
            model(x)
            if after is not None:
                after(i)
    return bad


def test_a_non_finite_validation_batch_is_kept_and_localised() -> None:
    """The batch whose forward overflowed is the one kept: its finding is as exact as ever."""
    model = zoo.expnet()
    ref = zoo.expnet()  # an unwatched copy: the expected tensor
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        _train_step(model, opt)
        ref.load_state_dict(model.state_dict())
        bad = _validation_loop(model)
        _train_step(model, opt)
    with torch.no_grad():  # computed after the watch: inside it, this exp would be the program's first inf
        expected = torch.exp(ref[0](bad))
    f = hunt.first
    assert f is not None
    zoo.assert_finding(f, phase="forward", module="1", module_type="Exp", tensor="output", step=1, call=200,
                       cause="created", expected=expected)
    assert f.op == "aten.exp.default" and f.reproducible is True


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_eval_mode_validation_loop_keeps_no_call_of_its_earlier_batches(mode: str) -> None:
    """Each eval-mode no_grad batch is judged on its own; the calls of the step's earlier batches
    (kept only to number a later finding's `call`) were all kept, and copied, until the next
    step(): 600 Calls alive after 150 batches of a 2-module model, growing with the loop. Now
    they are counted once past a few, and the finding's `call` is the same."""
    from nanhunt._steplog import Call

    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alive = -1
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        _train_step(model, opt)
        model.eval()

        def count(i: int) -> None:
            nonlocal alive
            if i == 150:
                gc.collect()
                alive = sum(type(o) is Call for o in gc.get_objects())

        _validation_loop(model, count)
        model.train()
        _train_step(model, opt)
    assert 0 <= alive <= 50, f"{alive} calls of earlier validation batches kept"
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.op) == ("forward", "1", 1, "aten.exp.default"), hunt.findings
    if mode == "full":  # (sentinel numbers a submodule's calls within the replayed batch's log only)
        assert f.call == 200


def test_grad_enabled_calls_are_kept_for_a_backward_replay() -> None:
    """Calls with gradients enabled stay until the step ends: a gradient that goes bad in backward
    is still localised by replaying its micro-batch (gradient accumulation)."""
    model = zoo.distnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(0)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for micro in range(3):
            x = torch.randn(4, 4)
            if micro == 1:
                x[:, 2:] = x[:, :2]  # the two halves coincide: sqrt at 0 in backward
            model(x).sum().backward()
        opt.step()
    assert hunt.first is not None and hunt.first.phase == "backward", hunt.findings
    assert hunt.first.op == "SqrtBackward0"


def test_report_is_not_rewritten_at_every_finding(tmp_path, monkeypatch) -> None:
    """Record mode, a finding at every step: the report is written at the first finding, then at
    most every few seconds, and on close (today: at every finding, quadratic in their number)."""
    saves: list[int] = []
    real_save = Report.save

    def save(self: Report, path: object) -> str:
        saves.append(len(self.findings))
        return real_save(self, path)  # type: ignore[arg-type]

    monkeypatch.setattr(Report, "save", save)
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, 4)
    x[3] = 1000.0
    path = tmp_path / "r.json"
    with nanhunt.watch(model, opt, on_find="record", report=path, replay=False) as hunt:
        for step in range(40):
            model(x).sum().backward()
            for p in model.parameters():
                p.grad = None
            opt.step()
            clock[0] += 0.5  # 20 s in all
    n = len(hunt.findings)
    assert n == 40
    assert saves[0] == 1 and saves[-1] == n
    assert len(saves) <= 2 + 20 / getattr(hunt_mod, "_REPORT_EVERY", float("inf")), saves
    assert len(Report.load(path).findings) == n


def test_a_flag_that_cannot_be_read_without_waiting_keeps_the_call() -> None:
    """Off the CPU the flag is read only once its copy has landed (no sync); a device where that
    cannot be arranged keeps the call to the step's end instead of failing."""
    from nanhunt._record.retain import _when_ready

    assert _when_ready(torch.tensor([1.0, 2.0]))() is True
    assert _when_ready(torch.tensor([1.0, float("inf")]))() is False
    assert _when_ready(torch.ones(1, device="meta"))() is None
    assert _when_ready(None)() is True  # no probes: nothing to wait for


def _tracked() -> tuple[int, int]:
    gc.collect()
    objs = gc.get_objects()
    return len(objs), sum(1 for o in objs if isinstance(o, torch.Tensor))


@pytest.mark.slow
def test_ten_thousand_record_mode_steps_keep_memory_flat(tmp_path) -> None:
    """A long record-mode run (findings early on, a report file, a validation loop every 1000
    steps): after the warm-up, the number of live Python objects and tensors does not grow.
    (Step time belongs in benchmarks/, not in a timed unit test.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add contention (x5 on a busy 2-core machine)
    try:
        _ten_thousand_steps(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _ten_thousand_steps(tmp_path) -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    samples: dict[int, tuple[int, int]] = {}
    with nanhunt.watch(model, opt, on_find="record", report=tmp_path / "r.json") as hunt:
        for step in range(10_000):
            loss = (model(x) - y).pow(2).mean()
            hit = step % 500 == 0 and step < 2000  # a metric that is log(0) now and then: a finding, nothing else
            hunt.check(torch.log(torch.zeros(()) if hit else loss.detach()), "log_loss")
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 1000 == 999:
                with torch.no_grad():
                    for _ in range(20):
                        model(torch.randn(16, 4))
            if step % 2000 == 1999:
                samples[step] = _tracked()
    assert len(hunt.findings) == 4 and all(f.phase == "check" for f in hunt.findings)
    objects = [o for o, _ in samples.values()]
    tensors = [t for _, t in samples.values()]
    assert max(objects) - min(objects) <= 50, samples
    assert max(tensors) - min(tensors) <= 2, samples
    assert len(Report.load(tmp_path / "r.json").findings) == 4
