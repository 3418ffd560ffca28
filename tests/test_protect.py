"""Protect and recover: on_find="skip", buffers put back after a finding, Report.damage.

Real training loops (a CNN with BatchNorm and an MLP with BatchNorm1d, AdamW) fed a poisoned batch;
each is compared bit for bit with a reference loop that drops that batch by hand.
"""

from __future__ import annotations

import logging
import math
import pickle
import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from tests import zoo


def _batches(n: int, poisoned: Iterable[int], shape: tuple[int, ...], classes: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 8; a poisoned one has a NaN in sample 2 (a corrupt record)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(8, *shape, generator=g)
        y = torch.randint(0, classes, (8,), generator=g)
        if i in set(poisoned):
            x[2].view(-1)[0] = float("nan")
        out.append((x, y))
    return out


def _models() -> list[tuple[str, Any, tuple[int, ...]]]:
    return [("cnn", zoo.bncnn, (1, 8, 8)), ("mlp", zoo.bnmlp, (6,))]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any], drop: Iterable[int] = (),
           hunt: Any = None) -> list[int]:
    """The user's loop; returns the batches on which NonFiniteError was raised (and caught)."""
    raised = []
    for i, (x, y) in enumerate(batches):
        if i in set(drop):
            continue
        try:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        except nanhunt.NonFiniteError:
            raised.append(i)
        opt.zero_grad()
    return raised


def _same(a: nn.Module, oa: torch.optim.Optimizer, b: nn.Module, ob: torch.optim.Optimizer) -> None:
    assert zoo.same_state(zoo.snapshot(a), zoo.snapshot(b))
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n in sa[k]:
            assert zoo.bit_equal(sa[k][n], sb[k][n]), (k, n)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("name,build,shape", _models())
def test_skip_is_bit_identical_to_dropping_the_batch_by_hand(name: str, build: Any, shape: tuple[int, ...],
                                                             mode: str) -> None:
    batches = _batches(6, {3}, shape, 3)
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, batches, drop={3})

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="skip", mode=mode) as hunt:
        assert _train(model, opt, batches, hunt=hunt) == []
    assert hunt.skipped == [3] and hunt.report.skipped == [3]
    assert hunt.step == 6  # a skipped step() still counts: the user's step numbers
    f = hunt.first
    assert f is not None and f.step == 3
    if mode == "full":
        assert (f.phase, f.cause) == ("forward", "input")
    _same(model, opt, ref, ref_opt)
    assert hunt.report.damage == {"grads": [], "parameters": [], "buffers": [], "optimizer_state": []}


@pytest.mark.parametrize("mode", ["full", "sentinel", "ops"])
@pytest.mark.parametrize("on_find", ["skip", "raise"])
def test_a_batchnorm_swapped_in_while_watched_gets_its_statistics_back(on_find: str, mode: str) -> None:
    """Model surgery under a hunt: the BatchNorm replaced by a fresh one after the first step (a
    re-initialised head, a fine-tuning swap). The buffers to put back were listed once, at the
    first step, so the new module's were none of them: after a skipped (or raised) step its
    running statistics stayed NaN, and every later eval() prediction was NaN."""
    batches = _batches(4, {2}, (6,), 3)
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find=on_find, mode=mode) as hunt:
        for i, (x, y) in enumerate(batches):
            if i == 1:
                model.bn = nn.BatchNorm1d(16)
                opt.add_param_group({"params": list(model.bn.parameters())})
            if i == 2:
                before = zoo.snapshot(model)
            try:
                F.cross_entropy(model(x), y).backward()
                opt.step()
            except nanhunt.NonFiniteError:
                assert on_find == "raise"
                assert zoo.same_state(zoo.snapshot(model), before)
            opt.zero_grad()
    assert hunt.first is not None and hunt.first.step == 2
    assert torch.isfinite(model.bn.running_mean).all() and torch.isfinite(model.bn.running_var).all()


def test_skip_without_the_buffer_restore_would_differ() -> None:
    """The comparison above is sharp: the failing forward did write NaN into the running stats."""
    batches = _batches(4, {2}, (1, 8, 8), 3)
    model = zoo.bncnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches[:3]:
        F.cross_entropy(model(x), y).backward()
        opt.zero_grad()
    assert not torch.isfinite(model.bn.running_mean).all()


def test_raise_then_resume_with_clean_batches_stays_finite_in_eval() -> None:
    batches = _batches(6, {2}, (1, 8, 8), 3)
    ref = zoo.bncnn()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, batches, drop={2})

    model = zoo.bncnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hunt = nanhunt.watch(model, opt)
    try:
        assert _train(model, opt, batches) == [2]
    finally:
        hunt.close()
    d = hunt.report.damage
    assert d["buffers"] == [] and d["parameters"] == [] and d["optimizer_state"] == []
    assert "conv.weight" in d["grads"]  # raise keeps the gradients for inspection
    _same(model, opt, ref, ref_opt)
    model.eval()
    with torch.no_grad():
        out = model(batches[0][0])
    assert torch.isfinite(out).all()


def test_max_skips_consecutive_then_raise(caplog: Any) -> None:
    batches = _batches(8, {2, 3, 4, 5}, (6,), 3)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="nanhunt"):
        with nanhunt.watch(model, opt, on_find="skip", max_skips=3) as hunt:
            raised = _train(model, opt, batches)
    assert raised == [5] and hunt.skipped == [2, 3, 4]
    assert sum("skipped step" in r.getMessage() for r in caplog.records) == 3
    assert torch.isfinite(model.bn.running_var).all()
    # the error says why the run stops at step 5, and its finding is the first (step 2's)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, on_find="skip", max_skips=3) as hunt:
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    e = err.value
    assert e.finding == hunt.first and e.finding.step == 2
    assert "dropped 3 steps in a row (2, 3, 4; max_skips=3)" in str(e) and "step 5" in str(e)
    assert str(e).endswith(hunt.first.summary())
    assert pickle.loads(pickle.dumps(e)).why == e.why


def test_max_skips_0_raises_the_first_finding_as_raise_mode_does() -> None:
    # the error said "dropped 0 steps in a row (; max_skips=0) and step 2 has a finding again"
    batches = _batches(4, {2}, (6,), 3)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, on_find="skip", max_skips=0) as hunt:
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert hunt.skipped == [] and err.value.finding.step == 2 and err.value.why is None
    assert str(err.value).startswith("First NaN: forward of `fc1`"), str(err.value)


def test_skips_that_are_not_consecutive_never_raise() -> None:
    batches = _batches(9, {1, 3, 5, 7}, (6,), 3)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="skip", max_skips=1) as hunt:
        assert _train(model, opt, batches) == []
    assert hunt.skipped == [1, 3, 5, 7]


def test_skip_cannot_undo_the_optimizers_own_overflow() -> None:
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"))  # an exploding learning rate
    batches = _batches(4, (), (6,), 3)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, on_find="skip"):
            for x, y in batches:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert ei.value.finding.phase == "optimizer"
    assert ei.value.report.skipped == []


@pytest.mark.parametrize("closure", [False, True])
def test_damage_in_record_mode_is_the_state_when_the_step_ended(closure: bool) -> None:
    # step(closure) (Lightning's automatic optimization): the damage was read before the update
    # the closure's check let through, and named no weight
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        if closure:
            for x, y in _batches(3, {1}, (6,), 3):
                def loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    opt.zero_grad()
                    out = F.cross_entropy(model(x), y)
                    out.backward()
                    return out
                opt.step(loss)
        else:
            _train(model, opt, _batches(3, {1}, (6,), 3))
    # read when step 1 ended: the forward wrote the stats, backward the grads, and record mode let
    # the optimizer apply them (the weights and AdamW's moments are damaged too)
    d = hunt.report.damage
    assert d["buffers"] == ["bn.running_mean", "bn.running_var"] and "fc1.weight" in d["grads"]
    assert not torch.isfinite(model.fc1.weight).all() and "fc1.weight" in d["parameters"]
    assert "fc1.weight.exp_avg" in d["optimizer_state"]


def test_damage_after_the_optimizer_overflowed_names_weights_and_state() -> None:
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"), momentum=0.9)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        _train(model, opt, _batches(3, (), (6,), 3))
    f = hunt.first
    assert f is not None and f.phase == "optimizer"
    d = hunt.report.damage
    assert "fc1.weight" in d["parameters"] and d["optimizer_state"] == []  # the momentum itself is finite
    assert "contained" not in str(hunt.report) and "weights: fc1.weight" in str(hunt.report)


def test_damage_names_optimizer_state_by_parameter_and_key() -> None:
    from nanhunt._locate.damage import damage

    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters())
    F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    opt.state[model.fc2.bias]["exp_avg_sq"][1] = float("nan")
    assert damage(model, [opt])["optimizer_state"] == ["fc2.bias.exp_avg_sq"]


def test_damage_is_in_every_report_format(tmp_path: Any) -> None:
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="skip") as hunt:
        _train(model, opt, _batches(3, {1}, (6,), 3))
    r = hunt.report
    assert r.to_dict()["damage"] == r.damage and r.to_dict()["skipped"] == [1]
    assert "contained" in str(r) and "skipped steps: 1" in str(r)
    assert "contained" in r.to_html()
    back = nanhunt.Report.from_dict(r.to_dict())
    assert back.damage == r.damage and back.skipped == [1]
    rich = pytest.importorskip("rich.console")
    import io

    con = rich.Console(width=120, record=True, file=io.StringIO())
    con.print(r)
    assert "contained" in con.export_text()



@pytest.mark.parametrize("on_find", ["record", "raise"])
def test_a_buffer_replaced_by_assignment_is_the_one_a_replay_starts_from(on_find: str) -> None:
    """Resetting BatchNorm statistics by assigning new tensors (``bn.running_var = torch.ones(6)``)
    between steps: the state a later call starts from (cause, replays) is taken of the new
    buffers, as they were before the call; in raise mode from the copies the step's restore keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with nanhunt.watch(model, optimizer=opt, on_find=on_find) as hunt:
        for step in range(3):
            if step == 2:
                model[1].running_mean = torch.full((6,), 5.0)  # a reset by assignment: new objects
                model[1].running_var = torch.full((6,), 7.0)
            model(torch.randn(8, 4)).sum().backward()
            top = hunt._log.tops[0]
            seen.append({k: v.clone() for k, v in top.saved.items()})
            opt.step()
            opt.zero_grad()
    bn = model[1]
    # (and its small integer counter: a replay starts from the count the call began with)
    assert set(seen[2]) == {id(bn.running_mean), id(bn.running_var), id(bn.num_batches_tracked)}
    assert torch.equal(seen[2][id(bn.running_mean)], torch.full((6,), 5.0))  # before the call wrote them
    assert torch.equal(seen[2][id(bn.running_var)], torch.full((6,), 7.0))
    assert int(seen[2][id(bn.num_batches_tracked)]) == 2 and int(bn.num_batches_tracked) == 3


def _bn_model() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _bn_train(model: torch.nn.Module, opt: torch.optim.Optimizer, huge_at: tuple[int, ...], steps: int,
              done: list[int] | None = None) -> None:
    """``steps`` steps; at ``huge_at`` one sample of 3e19: finite, but its square is not, so the
    running variance overflows while every output stays finite."""
    for i in range(steps):
        x = torch.randn(8, 4)
        if i in huge_at:
            x[0, 0] = 3e19
        out = model(x)
        mask = getattr(model, "mask", None)
        (out if mask is None else out + mask.clamp_min(-1e4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if done is not None:
            done.append(i)


def _bn_steps(hunt_kw: dict[str, Any], huge_at: int, steps: int = 3) -> tuple[torch.nn.Module, Any, list[int]]:
    model, opt = _bn_model()
    done: list[int] = []
    hunt = nanhunt.watch(model, opt, **hunt_kw)
    try:
        _bn_train(model, opt, (huge_at,), steps, done)
    except nanhunt.NonFiniteError:
        pass
    finally:
        hunt.close()
    return model, hunt, done


def test_damage_of_a_refused_checkpoint_names_the_poisoned_buffer(tmp_path: Any) -> None:
    # a BatchNorm whose running_var overflowed (one sample of 3e19: its square is past float32's
    # max) while every output stayed finite, its module ignored (so the step's own buffer check
    # passes it): the first finding is the refused save, and the damage names the buffer
    model, opt = _bn_model()
    with nanhunt.watch(model, opt, on_find="record", ignore=["0"]) as hunt:
        _bn_train(model, opt, (1,), 2)
        with pytest.raises(nanhunt.NonFiniteError):
            torch.save({"model": model.state_dict()}, tmp_path / "bn.pt")
    assert hunt.first is not None and hunt.first.phase == "checkpoint"
    assert hunt.report.damage["buffers"] == ["0.running_var"]


def test_a_running_statistic_that_overflows_with_finite_outputs_is_found_in_its_step() -> None:
    model, hunt, done = _bn_steps({"on_find": "record"}, huge_at=1)
    assert not torch.isfinite(model[0].running_var).all()  # record mode leaves it, as torch made it
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.module_type, f.tensor, f.step, f.cause) == (
        "forward", "0", "BatchNorm1d", "running_var", 1, "created")
    assert f.index == (0,) and f.value == float("inf") and "running statistic" in f.hint
    assert [g.tensor for g in hunt.findings] == ["running_var"]  # non-finite from then on: found once



@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_running_statistic_overflowing_in_one_micro_batch_names_that_call(mode: str) -> None:
    """Gradient accumulation, four forwards per optimizer step: one sample of 1e21 in the third
    micro-batch of step 1 overflows the CNN's BatchNorm running_var; the finding said call 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        for step in range(3):
            for micro in range(4):
                x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
                if (step, micro) == (1, 2):
                    x[0, 0, 0, 0] = 1e21
                (torch.nn.functional.cross_entropy(model(x), y) / 4).backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.tensor, f.step, f.call, f.cause) == ("forward", "1", "running_var", 1, 2, "created"), f

def test_a_running_statistic_overflowed_by_weights_an_exploding_learning_rate_made_says_so() -> None:
    """A CNN trained with a learning rate far too large: the update of step 0 makes the conv's
    weights ~1e35, and step 1's BatchNorm variance overflows on the conv's (finite) output. The
    hint sent the user after "a batch with huge values" and the bad sample; the data is fine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e36)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for _ in range(3):
            x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("forward", "1", "running_var", 1, "created"), f
    assert "'0.weight' reaches" in f.hint and "learning rate" in f.hint and "bad sample" not in f.hint, f.hint
    # a huge sample with sane weights: the data hint, as before
    model2, hunt2, _ = _bn_steps({"on_find": "record"}, huge_at=1)
    assert hunt2.first is not None and "find the bad sample" in hunt2.first.hint


def test_raise_mode_puts_an_overflowed_running_statistic_back() -> None:
    model, hunt, done = _bn_steps({"on_find": "raise"}, huge_at=1)
    assert done == [0] and hunt.first is not None and hunt.first.tensor == "running_var"
    assert torch.isfinite(model[0].running_var).all() and torch.isfinite(model[0].running_mean).all()


def test_buffers_non_finite_from_the_start_or_ignored_are_not_findings() -> None:
    # an intended -inf mask buffer, and a BatchNorm under an ignore glob
    model, opt = _bn_model()
    model.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.0]))
    with nanhunt.watch(model, opt, on_find="record", ignore=["0"]) as hunt:
        _bn_train(model, opt, (1,), 3)
    assert hunt.findings == []


def test_skip_mode_drops_each_step_whose_running_statistic_overflows() -> None:
    # the restore puts the buffers back after each: the next overflow is new again, and found
    model, opt = _bn_model()
    with nanhunt.watch(model, opt, on_find="skip") as hunt:
        _bn_train(model, opt, (1, 2), 5)
    assert hunt.skipped == [1, 2]
    assert torch.isfinite(model[0].running_var).all()


def _train_and_validate(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any],
                        val: list[Any]) -> None:
    """The usual epoch: a training step, then a validation batch in eval mode under no_grad, then
    ``model.train()`` again before the next step's forward."""
    for (x, y), (vx, _) in zip(batches, val):
        model.train()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(vx)
    model.train()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_validation_batch_skips_no_training_step(mode: str) -> None:
    """A corrupt validation sample: the finding is made (at the next forward: the validation call's
    own eval/no_grad state says so, although the loop already called ``model.train()``), but
    skip mode drops no training step for it: the run is the unwatched run, bit for bit."""
    batches = _batches(5, (), (6,), 3)
    val = _batches(5, {2}, (6,), 3, seed=2)
    ref = zoo.bnmlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_and_validate(ref, ref_opt, batches, val)

    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="skip", mode=mode) as hunt:
        _train_and_validate(model, opt, batches, val)
    assert hunt.skipped == []
    f = hunt.first
    assert f is not None and (f.phase, f.step, f.cause) == ("forward", 3, "input"), f
    _same(model, opt, ref, ref_opt)
    # raise mode: raised by the next training step's forward, not at its step()
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped = []
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for i, ((x, y), (vx, _)) in enumerate(zip(batches, val)):
            model.train()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            stepped.append(i)
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(vx)
    assert stepped == [0, 1, 2] and err.value.finding.step == 3


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


def test_skip_in_a_gan_loop_leaves_the_generators_graph_usable() -> None:
    """The usual GAN loop: ``fake = G(z)``, the discriminator's step, then the generator's loss
    through ``D(fake)`` backpropagates into ``fake``'s graph. A NaN in a real batch makes skip mode
    drop the discriminator's step and put the buffers back at its ``step()``; G's BatchNorm buffers
    (saved by ``fake``'s graph) went back with a version bump, and the generator's backward then
    failed ("modified by an inplace operation"), which the unwatched loop never does."""
    torch.manual_seed(0)
    gan = _GAN()
    opt_g = torch.optim.Adam(gan.G.parameters(), 1e-3)
    opt_d = torch.optim.Adam(gan.D.parameters(), 1e-3)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(5)]
    data[3][0][1, 1] = float("nan")
    bce = F.binary_cross_entropy_with_logits
    with nanhunt.watch(gan, [opt_d, opt_g], on_find="skip") as hunt:
        for real, z in data:
            fake = gan.G(z)
            loss_d = bce(gan.D(real), torch.ones(16, 1)) + bce(gan.D(fake.detach()), torch.zeros(16, 1))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = bce(gan.D(fake), torch.ones(16, 1))
            opt_g.zero_grad()
            loss_g.backward()  # fake's graph: G's BatchNorm saved its buffers
            opt_g.step()
    assert hunt.skipped == [3]
    assert (hunt.first.phase, hunt.first.module, hunt.first.step) == ("forward", "D.0", 3)
    assert all(torch.isfinite(t).all() for t in gan.state_dict().values() if t.is_floating_point())


def _scaled_loop(bad: set[int], n: int, scaler_to_watch: bool) -> tuple[Any, list[int], Any]:
    """A GradScaler loop in skip mode, NaN inputs on the ``bad`` batches (the scaler skips those
    steps itself too). (hunt, batches whose step() returned, the error or None)."""
    torch.manual_seed(0)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    batches = _batches(n, bad, (6,), 3)
    stepped, err = [], None
    hunt = nanhunt.watch(model, opt, on_find="skip", scaler=scaler if scaler_to_watch else None)
    try:
        for i, (x, y) in enumerate(batches):
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            stepped.append(i)
    except nanhunt.NonFiniteError as e:
        err = e
    finally:
        hunt.close()
    return hunt, stepped, err


@pytest.mark.parametrize("passed", [True, False])
def test_skip_with_a_gradscaler_numbers_and_counts_the_skipped_steps(passed: bool) -> None:
    """A skipped step still counts, also when the GradScaler skipped it first (its step() never
    reached the optimizer): skipped steps are the loop's, and max_skips consecutive ones raise."""
    hunt, stepped, err = _scaled_loop({2, 5}, 8, passed)
    assert err is None and stepped == list(range(8))
    assert hunt.skipped == [2, 5]
    assert sorted({f.step for f in hunt.findings}) == [2, 5]
    hunt, stepped, err = _scaled_loop({2, 3, 4, 5, 6}, 8, passed)
    assert err is not None and hunt.skipped == [2, 3, 4] and "step 5 has a finding again" in str(err)
    # with the scaler given to watch() the 4th skip raises from its own step(); without it, at the
    # model's next forward (nanhunt sees the skipped iteration only when the next one begins)
    assert stepped == ([0, 1, 2, 3, 4] if passed else [0, 1, 2, 3, 4, 5])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_with_a_gradscaler_and_two_optimizers_runs_on_as_if_the_batch_was_never_seen(mode: str) -> None:
    """Two optimizers stepped through one GradScaler: skip mode drops the round's gradients at the
    first ``scaler.step``; the second one found no gradients and the scaler failed ("No inf checks
    were recorded for this optimizer"). The run goes on, bit-identical to one that never saw the
    bad batches, and the skipped steps are numbered as the loop's."""
    batches = _batches(7, {2, 5}, (6,), 3)

    def run(watched: bool) -> tuple[Any, nn.Module, list[torch.optim.Optimizer]]:
        model = zoo.bnmlp()
        params = list(model.parameters())
        opts = [torch.optim.AdamW(params[:2], lr=1e-2), torch.optim.AdamW(params[2:], lr=1e-2)]
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        hunt = nanhunt.watch(model, opts, on_find="skip", scaler=scaler, mode=mode) if watched else None
        for i, (x, y) in enumerate(batches):
            if not watched and i in (2, 5):
                continue
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
            for o in opts:
                o.zero_grad()
        if hunt is not None:
            hunt.close()
        return hunt, model, opts

    hunt, model, opts = run(True)
    _, ref, ref_opts = run(False)
    assert hunt.skipped == [2, 5]
    assert sorted({f.step for f in hunt.findings}) == [2, 5]
    for o, ro in zip(opts, ref_opts):
        _same(model, o, ref, ro)


@pytest.mark.parametrize("bad", ["overflowed running statistic", "nan input"])
def test_raise_then_resume_with_a_gradscaler_applies_unscaled_gradients_after(bad: str) -> None:
    """README's resume (catch NonFiniteError, zero_grad, train on) with a GradScaler given to watch().
    A finding raised from inside the optimizer's step() (its scaled gradients were finite: a running
    variance that overflowed on one huge sample) left the scaler's stage "unscaled": the next
    iteration's scaler.step() skipped unscale_ and applied gradients still multiplied by the scale
    (here 1024), silently. A step the scaler skipped itself (a NaN input) left it "stepped": the
    next scaler.step() failed. Now the run goes on as one that never saw the batch."""
    def run(watched: bool) -> tuple[nn.Module, list[int], float]:
        model, opt = _bn_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        g = torch.Generator().manual_seed(0)
        raised = []
        hunt = nanhunt.watch(model, opt, scaler=scaler) if watched else None
        for i in range(5):
            x = torch.randn(8, 4, generator=g)
            if i == 1:
                x[0, 0] = 3e19 if bad == "overflowed running statistic" else float("nan")
                if not watched:
                    continue
            try:
                scaler.scale(model(x).sum()).backward()
                scaler.step(opt)
                scaler.update()
            except nanhunt.NonFiniteError:
                raised.append(i)
            opt.zero_grad()
        if hunt is not None:
            hunt.close()
        return model, raised, scaler.get_scale()

    model, raised, scale = run(True)
    ref, _, ref_scale = run(False)
    assert raised == [1] and scale == ref_scale
    assert zoo.same_state(zoo.snapshot(model), zoo.snapshot(ref))


class _SqrtTrap(nn.Module):
    """``torch.where(x > 0, x.sqrt(), 0)``: finite outputs, a NaN gradient wherever x < 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x.sqrt(), torch.zeros_like(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_in_backward_under_a_gradscaler_is_found_once_the_scale_is_down_to_1(mode: str) -> None:
    """A NaN gradient made by the backward itself has the scaler skip every step, halving its scale
    towards 0: the run never trains again. Every skipped step was taken for the scaler's calibration,
    so nothing was ever reported. Once the scale is 1 (the gradients no longer magnified), the
    non-finite gradients are judged as without a scaler: the op that made them is found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), _SqrtTrap(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = zoo.snapshot(model)
    batches = _batches(8, (), (6,), 3)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, scaler=scaler, mode=mode) as hunt:
        for i, (x, y) in enumerate(batches):
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    f = err.value.finding
    assert i == 3 and (f.step, f.phase, f.module, f.op) == (3, "backward", "1", "SqrtBackward0")
    assert hunt.findings[0] is f and zoo.same_state(zoo.snapshot(model), before)
    # an overflow of a scale above 1 is still the scaler's business
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, scaler=scaler, mode=mode) as hunt:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert hunt.findings == [] and scaler.get_scale() < 2.0 ** 40


def _amp_gan(seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, Any]:
    """A GAN's generator and discriminator, each with its optimizer, and ONE GradScaler for both,
    its scale too high at first (its calibration overflows float16, as intended)."""
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    return G, D, opt_g, opt_d, torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)


def _amp_gan_round(G: nn.Module, D: nn.Module, opt_g: Any, opt_d: Any, scaler: Any, g_first: bool,
                   nan: bool = False, g_weight: float = 1.0) -> bool:
    """One round of the usual AMP GAN loop (``nan``: a corrupt real batch; ``g_weight``: of the
    generator's loss); True if the scaler applied it."""
    bce = F.binary_cross_entropy_with_logits
    real, z = torch.randn(16, 8), torch.randn(16, 4)
    if nan:
        real[1, 2] = float("nan")
    with torch.autocast("cpu", dtype=torch.float16):
        fake = G(z)

    def d_step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss_d = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
        opt_d.zero_grad()
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)

    def g_step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = g_weight * bce(D(fake), torch.ones(16, 1))  # through the discriminator: its gradients too
        opt_g.zero_grad()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)

    for f in ((g_step, d_step) if g_first else (d_step, g_step)):
        f()
    scale = scaler.get_scale()
    scaler.update()
    return scaler.get_scale() >= scale


@pytest.mark.parametrize("g_first", [False, True])
@pytest.mark.parametrize("close_g_first", [True, False])
def test_two_hunts_share_one_gradscaler_and_close_in_either_order(g_first: bool, close_g_first: bool) -> None:
    """A GAN's two models watched each with its optimizer and the ONE GradScaler of the loop: the
    second hunt wrapped the first one's wrapper, and each took the other's ``scaler.step`` for a
    skip of its own (twice the skipped steps, its step ended at the other's); the first close()
    deleted whichever wrapper was on top (the other hunt's): its calibration overflows became
    findings. Now the steps the scaler skips are no findings and are counted once, a hunt left
    open keeps working, and the scaler is left exactly as it was."""
    G, D, opt_g, opt_d, scaler = _amp_gan()
    step = scaler.step
    hunts = {"G": nanhunt.watch(G, opt_g, scaler=scaler, on_find="record"),
             "D": nanhunt.watch(D, opt_d, scaler=scaler, on_find="record")}
    applied = [_amp_gan_round(G, D, opt_g, opt_d, scaler, g_first) for _ in range(4)]
    first, second = ("G", "D") if close_g_first else ("D", "G")
    hunts[first].close()
    applied += [_amp_gan_round(G, D, opt_g, opt_d, scaler, g_first, nan=(i == 2 and second == "D"))
                for i in range(3)]
    hunts[second].close()
    assert applied == [False] * 7, "test set-up: the scaler skips every step of its calibration"
    assert hunts[first].findings == [] and hunts[first].report.meta["skipped_steps"] == 4
    assert hunts[first].step == 4 and hunts[second].step == 7
    if second == "D":  # the corrupt batch: found in the discriminator's step 6, nothing else
        assert [(f.phase, f.module, f.step, f.cause) for f in hunts["D"].findings] == [("forward", "0", 6, "input")]
    else:
        assert hunts["G"].findings == []
    assert hunts[second].report.meta["skipped_steps"] == 7
    assert "step" not in scaler.__dict__ and scaler.step == step


@pytest.mark.parametrize("g_weight", [1.0, 30.0])
def test_a_hunt_lets_another_optimizers_gradscaler_step_pass(g_weight: float) -> None:
    """The discriminator watched with the GradScaler; the generator's optimizer steps through the
    same scaler, unwatched. Each ``scaler.step(opt_g)`` that did not step a watched optimizer was
    taken for a skip of the hunt's own step (ending it there), also once the scaler applied the
    steps: every round counted a skip. Now only the discriminator's steps the scaler skipped
    count; the scaled gradients the generator's loss left in the discriminator (a weighted
    adversarial loss overflows them while the generator's fit: its step is applied) are still
    the scaler's business, never judged (they were, at close)."""
    G, D, opt_g, opt_d, scaler = _amp_gan()
    stepped = []
    opt_d.register_step_post_hook(lambda *a: stepped.append(1))
    with nanhunt.watch(D, opt_d, scaler=scaler) as hunt:
        applied = [_amp_gan_round(G, D, opt_g, opt_d, scaler, False, g_weight=g_weight) for _ in range(40)]
    assert not all(applied) and any(applied), "test set-up: the scaler calibrates, then applies steps"
    assert hunt.findings == [] and hunt.step == 40
    assert hunt.report.meta["skipped_steps"] == 40 - len(stepped)


def test_a_gradscaler_given_without_an_optimizer_still_takes_its_calibration_overflows() -> None:
    """``watch(model, scaler=scaler)`` with no optimizer: each ``scaler.step`` was taken for a
    skip (no watched optimizer ever stepped), also once the scaler applied the steps; the step
    ended there with no root call left to end the next one (the step stayed 0), and the gradients
    of the skipped steps were still judged (the model's, after the loss's backward): calibration
    overflows were findings. Now the steps the scaler skipped are no findings, counted once, and
    the steps are the model's calls, as without the scaler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    applied = []
    with nanhunt.watch(model, scaler=scaler) as hunt:
        for x, y in _batches(30, (), (16,), 4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            applied.append(scaler.get_scale() >= scale)
            opt.zero_grad()
    assert not all(applied) and any(applied), "test set-up: the scaler calibrates, then applies steps"
    assert hunt.findings == [] and hunt.step == 29
    assert hunt.report.meta["skipped_steps"] == applied.count(False)


class _SparseMix(nn.Module):
    """A fixed sparse mixing matrix kept as a buffer (graph models, sparse attention patterns)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mix", torch.eye(4).to_sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.sparse.mm(self.mix, x.t()).t()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_with_a_sparse_buffer_is_watched_and_protected(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    # the buffer checks and the restore after a skipped step had no sparse kernels (torch.equal,
    # vector_norm): the hunt switched itself off at the first step and watched nothing after it
    torch.manual_seed(0)
    model = _SparseMix()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.ERROR, logger="nanhunt"), nanhunt.watch(model, opt, mode=mode, on_find="skip") as hunt:
        for step in range(4):
            x = torch.randn(2, 4)
            if step == 2:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert not hunt.closed
    assert hunt.skipped == [2]
    assert hunt.first is not None and (hunt.first.module, hunt.first.cause) == ("lin", "input")
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    assert model.mix.layout is torch.sparse_coo and torch.equal(model.mix.to_dense(), torch.eye(4))


@pytest.mark.parametrize("on_find", ["raise", "skip"])
def test_a_validation_pass_under_inference_mode_that_begins_a_step_harms_nothing(on_find: str) -> None:
    """A loop that validates first (``model.eval()`` and ``torch.inference_mode()``, as Lightning's
    sanity check does) and then trains: the buffer copies taken at that step's start were
    inference tensors, the next step's in-place refresh failed and the hunt switched itself off
    (in skip mode the bad batch then reached the weights). Now the bad batch is found and, in
    skip mode, dropped."""
    batches = _batches(4, {2}, (6,), 3)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found = None
    with nanhunt.watch(model, opt, on_find=on_find) as hunt:
        model.eval()
        with torch.inference_mode():
            model(batches[0][0])
        model.train()
        try:
            for x, y in batches:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        except nanhunt.NonFiniteError as e:
            found = e.finding
    f = found if on_find == "raise" else hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "fc1", 2, "input"), f
    assert hunt.skipped == ([2] if on_find == "skip" else [])
    assert all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())


def test_skip_with_a_gan_drops_the_generators_step_fed_the_same_bad_batch_too() -> None:
    """A GAN: D's step() finds the bad noise batch and skips the step; G's half of the same
    iteration then makes non-finite G gradients, found again at G's step(): they were kept and
    applied (the step counted as skipped already)."""
    torch.manual_seed(0)

    class GAN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)

    gan = GAN()
    og, od = torch.optim.Adam(gan.g.parameters(), 1e-3), torch.optim.Adam(gan.d.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(0)
    with nanhunt.watch(gan, [og, od], on_find="skip") as hunt:
        for step in range(5):
            x, z = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
            if step == 3:
                z[0, 0] = float("nan")
            fake = gan.g(z).detach()
            ld = F.softplus(-gan.d(x)).mean() + F.softplus(gan.d(fake)).mean()
            od.zero_grad()
            ld.backward()
            od.step()
            lg = F.softplus(-gan.d(gan.g(z))).mean()
            og.zero_grad()
            lg.backward()
            og.step()
            assert all(torch.isfinite(p).all() for p in gan.parameters()), f"step {step}"
    assert hunt.skipped == [3]
    assert any(f.phase == "grad" and f.module == "g" for f in hunt.findings), hunt.findings


def test_an_in_place_write_that_makes_nan_of_a_minus_inf_mask_is_still_found() -> None:
    # the carried-accumulator rule (below) must not hide a NaN an in-place op makes this step of a
    # tensor holding only a -inf mask before it: s.sub_(max) on a fully masked row is -inf - -inf
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for i in range(3):
            mask = torch.zeros(3, 5, dtype=torch.bool)
            mask[0] = i == 1  # a fully masked row at step 1
            s = model(torch.randn(3, 4)).masked_fill(mask, float("-inf"))
            with torch.no_grad():
                top = s.amax(-1, keepdim=True)
            s.sub_(top)
            s.exp().sum().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.step, f.module, f.cause) == (1, "<outside>", "created") and math.isnan(f.value), f
    assert [c.split(" @ ")[0] for c in f.chain] == ["aten.masked_fill.Scalar", "aten.sub_.Tensor"], f.chain


@pytest.mark.parametrize("on_find", ["skip", "raise"])
def test_a_running_loss_kept_by_the_loop_does_not_poison_the_steps_after_a_nan(on_find: str) -> None:
    # the loop sums its losses into a tensor (Hugging Face's Trainer: tr_loss += tr_loss_step): after
    # the one bad batch it holds NaN for good; every later step was a new finding "born" in that
    # add_, so skip mode dropped clean steps until max_skips stopped the run, and raise mode could
    # not resume
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    running = torch.zeros(())
    raised = []
    with nanhunt.watch(model, opt, on_find=on_find) as hunt:
        for step in range(8):
            x = torch.randn(2, 4)
            if step == 2:
                x[0, 0] = float("nan")
            try:
                loss = model(x).pow(2).mean()
                loss.backward()
                running += loss.detach()
                opt.step()
            except nanhunt.NonFiniteError:
                raised.append(step)
            opt.zero_grad()
    assert bool(running.isnan())  # the loop's own tensor, left as the loop made it
    assert {f.step for f in hunt.findings} == {2} and all(f.module != "<outside>" for f in hunt.findings)
    assert hunt.skipped == ([2] if on_find == "skip" else []) and raised == ([] if on_find == "skip" else [2])
    assert all(bool(p.isfinite().all()) for p in model.parameters())


class _CtrlCInReplay(nn.Module):
    """Ctrl-C arrives while nanhunt replays the failing step (the analysis can take seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from nanhunt import _hooks

        if _hooks.REPLAYING:
            raise KeyboardInterrupt
        return self.out(self.bn(self.lin(x)))


def test_ctrl_c_during_the_analysis_still_puts_the_buffers_back(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = _CtrlCInReplay()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(4, 4)
        x[0, 0] = float("nan")
        model(x).sum().backward()  # BatchNorm's running statistics take the NaN
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # weights never updated, statistics back
        torch.save(model.state_dict(), tmp_path / "interrupted.pt")  # the user's emergency save is clean
        assert not hunt.closed


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_half_cnns_running_var_overflowing_names_float16_and_keeping_batchnorm_in_float32(mode: str) -> None:
    # a model.half() CNN on CPU, one batch of unnormalised pixels (x 3000): the convolution's outputs stay
    # finite in float16, their variance (past 65504) does not, and BatchNorm's running_var is inf while the
    # step's outputs are finite. The hint spoke of a bad sample only, not of float16's range and the usual
    # remedy (BatchNorm in float32); raise mode puts the running statistics back
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 3, 8, 8, generator=g).half() for _ in range(3)]
    xs[2] = xs[2] * 3000
    y = torch.randint(0, 5, (6,), generator=g)
    kept = None
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for x in xs:
            kept = model[1].running_var.clone()
            F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause, f.dtype) == (
        "forward", "1", "running_var", 2, "created", "float16"), f
    assert "running statistic" in f.hint and "float16" in f.hint and ".float() each BatchNorm" in f.hint, f.hint
    assert torch.equal(model[1].running_var, kept)


def _qat_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Eager quantization-aware training: prepare_qat's fake-quants, whose per-channel weight
    scale, zero_point and observer min_val/max_val are resized in place (resize_) at their first call."""
    import torch.ao.quantization as Q

    torch.manual_seed(0)
    model = nn.Sequential(Q.QuantStub(), nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4), Q.DeQuantStub())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own: reduce_range's deprecation, prepare_qat's)
        model.qconfig = Q.get_default_qat_qconfig("x86")
        Q.prepare_qat(model, inplace=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_buffers_resized_in_place_by_a_qat_fake_quant_are_backed_up_and_put_back(mode: str) -> None:
    # the step's buffer backup copied into copies of the shapes they had at the first step, so the
    # second step's first call failed ("output with shape [1] doesn't match the broadcast shape [8]")
    # and the hunt switched itself off with an InternalError in raise mode, on a healthy run
    def run(model: nn.Module, opt: torch.optim.Optimizer, bad: int | None) -> None:
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            x = torch.randn(4, 3, 6, 6, generator=g)
            if step == bad:
                x[1, 0, 2, 2] = float("nan")  # a corrupt sample
            F.cross_entropy(model(x), torch.arange(4)).backward()
            opt.step()
            opt.zero_grad()

    model, opt = _qat_model()
    run(model, opt, None)
    plain = zoo.snapshot(model)
    model, opt = _qat_model()
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        run(model, opt, None)
    assert hunt.first is None and zoo.same_state(plain, zoo.snapshot(model))
    # a finding at the very first step, which resized them: put back with the shapes they had before it
    model, opt = _qat_model()
    before = zoo.snapshot(model)
    with pytest.raises(nanhunt.NonFiniteError), nanhunt.watch(model, opt, mode=mode):
        run(model, opt, 0)
    assert zoo.same_state(before, zoo.snapshot(model))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_with_a_gradscaler_leaves_its_scale_as_a_loop_that_never_saw_the_batch(mode: str) -> None:
    """Under float16 autocast with a GradScaler: a skipped step (a NaN input, whose gradients the
    scaler saw as an overflow; a batch whose labels are all ignore_index, a NaN loss with finite
    gradients) must not halve the scale or count towards its growth. It did: the scale fell
    1024 -> 256, so the gradients of every later step were rounded differently and the weights
    and Adam's moments were no longer those of the loop that left the batches out."""
    batches = _batches(8, {2}, (6,), 3)
    batches[5] = (batches[5][0], torch.full((8,), -100))  # every target ignored: the mean is 0/0

    def run(watched: bool) -> tuple[Any, nn.Module, torch.optim.Optimizer, Any]:
        model = zoo.bnmlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        hunt = nanhunt.watch(model, opt, on_find="skip", scaler=scaler, mode=mode) if watched else None
        for i, (x, y) in enumerate(batches):
            if not watched and i in (2, 5):
                continue
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if hunt is not None:
            hunt.close()
        return hunt, model, opt, scaler

    hunt, model, opt, scaler = run(True)
    _, ref, ref_opt, ref_scaler = run(False)
    assert hunt.skipped == [2, 5]
    assert scaler.state_dict() == ref_scaler.state_dict()
    _same(model, opt, ref, ref_opt)
    assert "update" not in scaler.__dict__ and "step" not in scaler.__dict__


def test_a_skipped_steps_dropout_draws_are_dropped_too() -> None:
    """A model with Dropout, no seed set per step: the skipped step's forward drew its dropout
    mask from torch's stream, so every later step drew other masks than a loop that never saw the
    batch, and all the weights differed. The stream goes back with the step."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(6)]
    batches[2][0][3, 1] = float("nan")  # a corrupt record

    def run(drop: set[int], on_find: str | None) -> tuple[nn.Module, torch.Tensor]:
        model = zoo.mlp(p=0.5)
        torch.manual_seed(7)  # (once, before the loop: as a user does)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hunt = nanhunt.watch(model, opt, on_find=on_find) if on_find else None
        try:
            for i, (x, y) in enumerate(batches):
                if i in drop:
                    continue
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            if hunt is not None:
                hunt.close()
                assert hunt.skipped == [2]
        return model, torch.get_rng_state()

    clean, clean_rng = run({2}, None)
    skipped, skipped_rng = run(set(), "skip")
    assert zoo.same_state(zoo.snapshot(skipped), zoo.snapshot(clean))
    assert torch.equal(skipped_rng, clean_rng)  # the loop's own draws after it go on as they would
