"""Full mode's `forward` wrappers (nanhunt/_record/forwards.py): the calls inside a top-level call
run on torch's fast path (no global hook while they run), the record is the same, and what the
user's module holds is the user's again at close — copies and pickles never carry the wrapper."""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_mod

import nanhunt
from tests.zoo import Log, lognet, mlp


class _SeesHooks(nn.Module):
    """Notes, from inside a watched call, how many global forward hooks torch would run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(len(module_mod._global_forward_hooks) + len(module_mod._global_forward_pre_hooks))
        return self.lin(x)


def test_calls_inside_a_watched_call_run_without_global_hooks_and_are_still_recorded():
    torch.manual_seed(0)
    part = _SeesHooks()
    model = nn.Sequential(nn.Linear(4, 4), part, nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        # inside the watched forward (from the second step: the first builds the name map), torch's
        # fast path for every call; between calls the hunt's hooks are back on
        assert part.seen[1:] == [0, 0] and _ours_on(hunt)
        with torch.no_grad():
            part.lin.weight[0, 0] = float("nan")
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    f = hunt.first
    assert (f.phase, f.module, f.cause, f.step) == ("forward", "1.lin", "parameter", 3)
    assert part.seen[3] == 0  # (the replays of the analysis come after: hooks of their own)


def _ours_on(hunt) -> bool:
    pre, post = hunt._global._handles
    return pre.id in module_mod._global_forward_pre_hooks and post.id in module_mod._global_forward_hooks


def test_close_gives_every_module_its_own_forward_back():
    model = lognet()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with nanhunt.watch(model, on_find="record"):
        model(torch.rand(4, 4))
        assert all("forward" in m.__dict__ for m in model.modules())
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, name
        assert m.__dict__.keys() == before[name].keys()


def test_a_forward_set_on_the_instance_before_watch_is_kept_and_put_back():
    model = mlp()
    calls = []
    orig = model[0].forward

    def logged(x):
        calls.append(x.shape)
        return orig(x)

    model[0].forward = logged  # what accelerate and others do
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(2, 4))
    assert model[0].__dict__["forward"] is logged and calls == [torch.Size([2, 4])]
    assert hunt.findings == []


def test_the_signature_of_a_watched_forward_is_the_modules():
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    want = inspect.signature(model.forward)
    with nanhunt.watch(model, on_find="record"):
        model(torch.randn(2, 3, 8))
        assert inspect.signature(model.forward) == want  # Hugging Face's Trainer reads it to drop columns
        assert model.forward.__name__ == "forward"


def test_a_deep_copy_made_while_watched_runs_its_own_weights_and_carries_no_wrapper():
    torch.manual_seed(0)
    model = mlp()
    with nanhunt.watch(model, on_find="record"):
        model(torch.randn(2, 4))
        ema = copy.deepcopy(model)  # an EMA / SWA copy
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    x = torch.randn(2, 4)
    assert not torch.equal(ema(x), model(x))  # the copy computes with its own (halved) weights
    for m in ema.modules():
        fwd = m.__dict__.get("forward")
        assert fwd is None or (getattr(fwd, "__self__", None) is m and not hasattr(type(fwd), "__nanhunt__"))


def test_a_model_pickled_while_watched_loads_with_its_own_forward():
    torch.manual_seed(0)
    model = mlp()
    with nanhunt.watch(model, on_find="record"):
        model(torch.randn(2, 4))
        data = pickle.dumps(model)
        buf = io.BytesIO()
        torch.save(model, buf)
    assert b"nanhunt" not in data
    for loaded in (pickle.loads(data), torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        x = torch.randn(2, 4)
        assert torch.equal(loaded(x), model(x))
        assert all(getattr(m.__dict__.get("forward"), "__self__", m) is m for m in loaded.modules())


def test_a_forward_replaced_after_watch_is_still_recorded_by_the_hooks():
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # log(1) = 0: finite
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.rand(4, 4))
        inner = model[1]
        inner.forward = lambda x: torch.log(x - 1)  # replaces the wrapper (log(0) = -inf): the hooks take over
        model(torch.rand(4, 4))
    f = hunt.first
    assert f is not None and (f.module, f.cause, f.op, f.call) == ("1", "created", "aten.log.default", 0)
    assert "forward" in inner.__dict__  # the user's own replacement stays


class _GrowsAChild(nn.Module):
    """Registers a new submodule during its own forward on the second call (a lazily built head)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            self.head = Log0()
        h = self.lin(x)
        return self.head(h) if hasattr(self, "head") else h


class Log0(nn.Module):
    def forward(self, x):
        return torch.log(x * 0)  # -inf


def test_a_module_added_during_a_watched_forward_is_recorded_at_once():
    model = _GrowsAChild()
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    f = hunt.first
    assert f is not None and (f.module, f.cause, f.op) == ("head", "created", "aten.log.default")


def test_an_exception_inside_a_wrapped_call_leaves_the_hunt_and_hooks_whole():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("user bug")

    model = nn.Sequential(nn.Linear(4, 4), Fails())
    with nanhunt.watch(model, on_find="record") as hunt:
        for _ in range(2):
            try:
                model(torch.randn(2, 4))
            except ValueError:
                pass
        assert _ours_on(hunt) and not hunt._stack and not hunt._inner
        model[1] = nn.Identity()
        out = model(torch.randn(2, 4))
    assert out.shape == (2, 4) and hunt.findings == [] and not hunt._stack


def test_two_hunts_on_one_model_closed_in_either_order_leave_no_wrapper():
    for first_closed in (0, 1):
        model = lognet()
        hunts = [nanhunt.watch(model, on_find="record") for _ in range(2)]
        model(torch.rand(4, 4) + 0.5)
        hunts[first_closed].close()
        model(torch.rand(4, 4) + 0.5)
        hunts[1 - first_closed].close()
        assert all("forward" not in m.__dict__ for m in model.modules()), first_closed


def test_another_thread_calling_the_model_as_a_step_begins_never_mixes_into_it():
    """The step's thread arms its top-level call for the wrappers; a thread that calls the model
    right then (before the step's own forward starts) must not take it: its calls are none of the
    step's. Its NaN (fed in by its input) is judged on its own: one finding, of that call."""
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # log(1) = 0: finite, whatever the input
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    bad = torch.full((2, 4), float("nan"))
    main = threading.get_ident()

    def other_thread_runs(module, args):
        if threading.get_ident() == main and not getattr(module, "_ran", False):
            module._ran = True
            t = threading.Thread(target=lambda: model(bad))
            t.start()
            t.join()

    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for i in range(3):
            if i == 2:
                handle = model.register_forward_pre_hook(other_thread_runs)
            model(torch.rand(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        handle.remove()
        calls = len(hunt._log.calls)
    assert calls == 0
    assert [(f.phase, f.module, f.cause, f.step) for f in hunt.findings] == [("forward", "", "input", 2)], hunt.findings


class _Pair(nn.Module):
    """Returns a tuple: its call takes the general record between lean ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y.detach()


class _SoftLog(nn.Module):
    """log(softplus(.)): softplus underflows to 0 for a very negative input, and log(0) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.sp = nn.Softplus()
        self.log = Log()

    def forward(self, x):
        return self.log(self.sp(self.lin(x)))


class _LeanNet(nn.Module):
    def __init__(self, check=None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.pair = _Pair()
        self.soft = _SoftLog()
        self.head = nn.Linear(8, 1)
        self.check = check

    def forward(self, x):
        h, _ = self.pair(self.inp(x))
        h = self.soft(h)
        if self.check is not None:
            self.check(h, "inside")  # a hunt.check inside the forward, after the calls that made h
        h = self.soft(h)  # called twice: the second is call 1
        return self.head(h)


def _train_lean(model, hunt, opt, bad_step: int) -> None:
    for step in range(bad_step + 1):
        torch.manual_seed(step)
        x = torch.randn(16, 4) * (1e4 if step == bad_step else 1.0)  # huge inputs: softplus underflows
        if step == bad_step:  # by now the wrappers only note their calls (the lean path)
            lean = sorted(n for n in (w.name for w in hunt._fwds.values() if w.lean))
            assert {"inp", "soft.lin", "soft.sp", "soft.log", "head"} <= set(lean)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_the_lean_path_records_what_the_hooks_record():
    torch.manual_seed(0)
    model = _LeanNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        _train_lean(model, hunt, opt, bad_step=4)
    f = hunt.first
    assert (f.phase, f.module, f.call, f.step, f.cause, f.value) == ("forward", "soft.log", 0, 4, "created", -math.inf)
    assert f.op == "aten.log.default"
    # the same run with the hooks recording every call (another global hook keeps them on)
    torch.manual_seed(0)
    model2 = _LeanNet()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1e-3)
    other = module_mod.register_module_forward_hook(lambda *a: None)
    try:
        with nanhunt.watch(model2, optimizer=opt2, on_find="record", history=0) as hunt2:
            _train_lean(model2, hunt2, opt2, bad_step=4)
    finally:
        other.remove()
    g = hunt2.first
    assert (g.module, g.call, g.step, g.index, g.value, g.op) == (f.module, f.call, f.step, f.index, f.value, f.op)


def test_a_check_inside_a_lean_forward_comes_after_the_calls_before_it():
    torch.manual_seed(0)
    hunt_box = []
    model = _LeanNet(check=lambda t, name: hunt_box[0].check(t, name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        hunt_box.append(hunt)
        _train_lean(model, hunt, opt, bad_step=3)
    # the module that made the -inf comes first; the check of the same values after it
    assert [(f.phase, f.module) for f in hunt.findings[:1]] == [("forward", "soft.log")]
    assert any(f.phase == "check" and f.module == "inside" for f in hunt.findings)


class _Block(nn.Module):
    """A container (never lean: it hands on its child's output) around lean children."""

    def __init__(self) -> None:
        super().__init__()
        self.soft = _SoftLog()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.soft(x))


class _PairFirst(nn.Module):
    """A tuple's first element, from a call that returns a tuple (recorded at once amid lean calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()

    def forward(self, x):
        return self.pair(x)[0]


def _records(monkeypatch, model, extra_hook: bool) -> tuple[list, int]:
    """Each step's record (calls and entries) as `_end_step` releases it, and how many calls the
    lean path noted (another global hook keeps the hooks on: every call goes through them)."""
    from nanhunt import _steplog
    from nanhunt._record.hunt import Hunt

    seen: list = []
    noted = [0]
    release, flush = _steplog.StepLog.release, Hunt._flush

    def keep(log):
        seen.append(([(c.name, c.depth, c.parent, c.top, c.ordinal, c.index, len(c.outs)) for c in log.calls],
                     [(type(e).__name__, getattr(e, "call", None), getattr(e, "out", None)) for e in log.meta],
                     [s is None for s in log.sums]))
        release(log)

    def counted(hunt):
        noted[0] += sum(type(x).__name__ == "Forward" for x in hunt._evbuf)
        flush(hunt)

    monkeypatch.setattr(_steplog.StepLog, "release", keep)
    monkeypatch.setattr(Hunt, "_flush", counted)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    other = module_mod.register_module_forward_hook(lambda *a: None) if extra_hook else None
    try:
        with nanhunt.watch(model, optimizer=opt, on_find="record", history=4):
            for step in range(12):  # (steps 0 and 10 are sampled: statistics too)
                torch.manual_seed(step)
                model(torch.randn(16, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        if other is not None:
            other.remove()
        monkeypatch.setattr(_steplog.StepLog, "release", release)
        monkeypatch.setattr(Hunt, "_flush", flush)
    return seen, noted[0]


def test_the_lean_path_writes_the_same_record_as_the_hooks(monkeypatch):
    # containers that are never lean around lean children, and a call that returns a tuple amid them
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), _Block(), _PairFirst(), _Block(), nn.Linear(8, 1))

    lean, noted = _records(monkeypatch, model(), extra_hook=False)
    hooked, noted_hooked = _records(monkeypatch, model(), extra_hook=True)
    assert noted > 50 and noted_hooked == 0  # (the first run's calls went the lean way, the second's never)
    assert len(lean) >= 12
    assert lean == hooked  # calls (name, depth, parent, top-level call, ordinal, index), entries, deferred probes


def test_mode_ops_names_each_op_by_the_call_it_ran_in(monkeypatch):
    # mode="ops" probes every aten op into the step's record under the innermost watched call on
    # the stack as it runs: its wrappers must never take the lean path, which stacks calls later
    # (they do not: ops mode hooks every module's gradients, and the lean path needs none)
    from nanhunt import _steplog

    seen: list = []
    release = _steplog.StepLog.release

    def keep(log):
        seen.extend((e.op, log.calls[e.call].name) for e in log.meta
                    if type(e).__name__ == "Op" and e.op in ("aten.log.default", "aten.relu.default") and e.call >= 0)
        release(log)

    monkeypatch.setattr(_steplog.StepLog, "release", keep)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Block(), nn.ReLU(), nn.Linear(8, 1))  # (ReLU: a passthrough)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", mode="ops"):
        for _ in range(4):
            model(torch.randn(16, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert set(seen) == {("aten.log.default", "1.soft.log"), ("aten.relu.default", "2")}


class _Mends(nn.Module):
    """log(softplus(.)) whose -inf the module mends in place right after its child returned, on
    long batches only (short ones never write the child's output after it returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.sp = nn.Softplus()
        self.log = Log()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.log(self.sp(self.lin(x)))
        if len(h) > 1000:
            h.nan_to_num_(neginf=0.0)  # (the -inf from log is gone by the time the forward returns)
        return self.head(h)


def test_a_large_output_mended_in_place_after_it_returned_is_still_judged_as_it_returned():
    # the child's short outputs got it deferred (lean); then a long batch makes its output large,
    # and log(0) there (softplus(-200) underflows to 0) is mended in place by the parent: the
    # output is judged as it was when the child returned
    torch.manual_seed(0)
    model = _Mends()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        for step in range(5):
            x = torch.randn(16 if step < 4 else 4096, 4)
            if step == 4:
                with torch.no_grad():
                    model.lin.weight.zero_()
                    model.lin.bias.fill_(-200.0)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.value) == ("forward", "log", 4, -math.inf)


class _Peek(nn.Module):
    """Notes how many outputs wait for the lean path's flush as it is called."""

    def __init__(self, box: list) -> None:
        super().__init__()
        self.box = box

    def forward(self, x):
        if self.box and self.box[0] is not None:
            self.box.append(sum(isinstance(e, torch.Tensor) for e in self.box[0]._evbuf))
        return x * 1.0


def test_the_lean_path_holds_a_bounded_number_of_outputs():
    from nanhunt._record.forwards import NOTED_CAP

    box: list = [None]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)], _Peek(box), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        for step in range(4):
            box[0] = hunt if step == 3 else None
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    waiting = box[1:]
    assert waiting and 0 < waiting[0] <= NOTED_CAP // 3  # (300 calls before it: some flushed on the way)


class _Swaps(nn.Module):
    """Registers a new child in the middle of its own forward (a schedule swapping a Dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)
        self.swap = False

    def forward(self, x):
        h = self.lin(x)
        if self.swap:
            self.drop = nn.Dropout(0.0)
        return torch.log(F.softplus(h))  # -inf where h << 0: softplus underflows


class _Parent(nn.Module):
    def __init__(self, child: nn.Module, mend: bool = False) -> None:
        super().__init__()
        self.a = child
        self.out = nn.Linear(8, 4)
        self.mend = mend

    def forward(self, x):
        h = self.a(x)
        if self.mend and torch.is_inference_mode_enabled():
            h.nan_to_num_(neginf=0.0)  # (gone once the forward returns)
        return self.out(h)


def _eye(model: _Parent) -> _Parent:
    with torch.no_grad():
        model.a.lin.weight.copy_(torch.eye(8))
        model.a.lin.bias.zero_()
    return model


def test_a_child_registered_mid_forward_leaves_the_running_call_recorded():
    # the lean path ends inside a's call (a new child: the hooks take the rest); a's own output is
    # still judged as it returns
    torch.manual_seed(0)
    model = _eye(_Parent(_Swaps()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        for step in range(5):
            model.a.swap = step == 4
            model(torch.randn(4, 8) - (200.0 if step == 4 else 0.0)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert (f.phase, f.module, f.step, f.value, f.op, f.cause) == (
        "forward", "a", 4, -math.inf, "aten.log.default", "created")


def test_an_inference_pass_output_is_judged_as_it_returns():
    # inference tensors have no version counter: such an output is probed as it returns, not
    # later, when the parent may have mended it in place
    torch.manual_seed(0)
    model = _eye(_Parent(_Swaps(), mend=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nanhunt.watch(model, optimizer=opt, on_find="record", history=0) as hunt:
        for step in range(5):
            if step == 4:
                model.eval()
                with torch.inference_mode():
                    model(torch.randn(4, 8) - 200.0)
                model.train()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.value) == ("forward", "a", -math.inf)


class _Patched(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 100


def _user_hook(module: nn.Module, args: Any, out: Any) -> None:
    return None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_copies_and_saves_of_a_watched_model_are_what_they_would_be_unwatched(mode: str) -> None:
    """A deep copy (an EMA copy), a pickle or torch.save(model) of a watched model gave every module
    an instance ``forward`` (a bound method) for good, and the hunt's hooks (sentinel's on the root,
    the late hook behind a user's hook) as no-op hooks: after close(), in the loaded file, in a
    process without nanhunt. A class patched later (a flash-attention monkeypatch, a swapped
    __class__) then never reached the copy, and torch.save wrote other bytes. Now each is what an
    unwatched copy or save gives, and the copyreg entries go with the hunt."""
    import copyreg
    import io
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].register_forward_hook(_user_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dict(copyreg.dispatch_table)
    hooks = [(list(m._forward_pre_hooks.values()), list(m._forward_hooks.values())) for m in model.modules()]

    def saved(m: nn.Module) -> bytes:
        buf = io.BytesIO()
        torch.save(m, buf)
        return buf.getvalue()

    with nanhunt.watch(model, opt, mode=mode):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        assert ("forward" in model[0].__dict__) is (mode == "full")  # (the hunt's wrapper is on)
        assert [(list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
                for m in model.modules()] != hooks  # (and hooks of its own)
        ema, shallow = copy.deepcopy(model), copy.copy(model[0])
        watched = (saved(model), pickle.dumps(model))
        loaded = torch.load(io.BytesIO(watched[0]), weights_only=False)
    assert watched == (saved(model), pickle.dumps(model))  # byte for byte what an unwatched save writes
    assert all("forward" not in m.__dict__ for c in (ema, loaded) for m in c.modules())
    for c in (ema, loaded):
        assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in c.modules()] == [
            (len(a), len(b)) for a, b in hooks]
        assert not any(getattr(type(h), "__nanhunt__", False) or "nanhunt" in getattr(h, "__module__", "")
                       for m in c.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values())
    assert "forward" not in shallow.__dict__
    assert dict(copyreg.dispatch_table) == before
    ema[0].__class__ = _Patched  # a class swapped (or patched) after the copy reaches it
    x = torch.ones(1, 4)
    assert torch.equal(ema[0](x), nn.functional.linear(x, ema[0].weight, ema[0].bias) * 100)


@pytest.mark.parametrize("how", ["class", "instance_class"])
def test_a_class_forward_patched_after_watch_runs_as_it_would_unwatched(how: str) -> None:
    """A library patching a module class (or swapping an instance's ``__class__``) after watch():
    the watched model runs the patched forward, as torch would, and a NaN it makes is found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4)

    class Doubled(nn.ReLU):
        def forward(self, t):
            return torch.relu(t) * 2

    class Broken(nn.ReLU):
        def forward(self, t):
            return torch.relu(t) / 0  # 0/0 = nan, x/0 = inf

    def patch(cls: type) -> Any:
        if how == "class":
            saved = nn.ReLU.forward
            nn.ReLU.forward = cls.forward
            return lambda: setattr(nn.ReLU, "forward", saved)
        model[1].__class__ = cls
        twin[1].__class__ = cls
        return lambda: None

    hunt = nanhunt.watch(model, on_find="record")
    try:
        model(x)
        undo = patch(Doubled)
        try:
            same = torch.equal(model(x), twin(x))
        finally:
            undo()
        undo = patch(Broken)
        try:
            model(x)
            hunt.close()  # (the step is judged, and replayed, while the patch stands)
        finally:
            undo()
    finally:
        hunt.close()
    assert same
    f = hunt.first
    assert f is not None and (f.module, f.phase, f.op) == ("1", "forward", "aten.div.Tensor")
