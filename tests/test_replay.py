"""The replay: faithful when the value is reproducible, honest when it is not, invisible to the run."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

import nanhunt
from tests import zoo


class Flaky(nn.Module):
    """A transient fault: NaN on one call only (a flaky device, a race) — a replay sees finite values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        y = self.lin(x)
        self.calls += 1
        if self.calls == 2:
            y = y.clone()
            y[1, 2] = float("nan")
        return y


def test_a_value_the_replay_cannot_reproduce_is_reported_as_such():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Flaky(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for _ in range(3):
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert (f.phase, f.module, f.module_type, f.step) == ("forward", "1", "Flaky", 1)
    assert f.reproducible is False
    assert "nondeterminism" in f.hint and "hardware" in f.hint
    assert f.op is None  # no op-level claim from a replay that did not see it


def test_replay_restores_batchnorm_statistics_and_the_rng_stream():
    def run(watch: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 1))
        xs = [torch.randn(6, 4) for _ in range(3)]
        xs[1][2, 1] = float("inf")  # a hit at step 1: the analysis replays this step (written before
        # the watch: an inf written by the loop's own code is itself a finding, born outside)
        hunt = nanhunt.watch(model, on_find="record") if watch else None  # no optimizer: step = root call
        for x in xs:
            model(x).sum().backward()
            model.zero_grad()  # the bad gradients are dropped, training goes on
        if hunt is not None:
            hunt.close()
            assert hunt.first is not None and hunt.first.step == 1
        return model[1].running_mean.clone(), model[1].num_batches_tracked.clone(), torch.rand(3)

    plain, watched = run(False), run(True)
    assert torch.equal(plain[0], watched[0]) or (plain[0].isnan() == watched[0].isnan()).all()
    assert torch.equal(plain[1], watched[1])
    assert torch.equal(plain[2], watched[2])  # the user's RNG stream goes on exactly as without us


class _DropThenScale(nn.Module):
    """Divides by each row's smallest magnitude: 0/0 where dropout zeroed it (training mode only)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop, self.out = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)
        self.frozen = nn.BatchNorm1d(8)

    def forward(self, x):
        y = self.drop(self.frozen(self.lin(x)))
        return self.out(y / y.abs().amin(-1, keepdim=True))


@pytest.mark.parametrize("loop", ["validation before step", "no optimizer"])
def test_a_replay_runs_in_the_mode_of_the_call_when_the_model_was_switched_since(loop):
    # the step ends after model.eval() (a validation pass): a replay in eval mode has no dropout,
    # finds finite values and used to call it a hardware fault ("transient")
    torch.manual_seed(0)
    model = _DropThenScale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if loop != "no optimizer" else None
    model.train()
    model.frozen.eval()  # a frozen BatchNorm keeps its own mode
    modes: list[tuple[bool, bool]] = []  # (dropout's, the frozen BatchNorm's) at each run of the block
    model.frozen.register_forward_pre_hook(lambda m, a: modes.append((model.drop.training, m.training)))
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        model(torch.randn(4, 4)).sum().backward()
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 4))
        if opt is not None:
            opt.step()
    # the two calls, (True, False) then (False, False), and every replay as the first: dropout
    # trains, the BatchNorm stays frozen
    assert modes[0] == (True, False) and modes.count((False, False)) == 1 and len(modes) > 2, modes
    assert set(modes) == {(True, False), (False, False)}, modes
    f = hunt.first
    assert f is not None and f.phase == "forward" and f.module == "" and f.step == 0, f
    assert f.reproducible is True and f.verdict == "numerics" and f.op == "aten.div.Tensor", f
    assert f.source is not None and f.source.endswith(f"test_replay.py:{_DropThenScale.forward.__code__.co_firstlineno + 2}")
    assert not any(m.training for m in model.modules())  # the user's modes, as they left them


class _UserState(nn.Module):
    """A forward with Python state of its own: a warm-up counter, Python's and NumPy's random
    streams (LayerDrop), a running average kept in a plain tensor attribute, a cache built on
    first use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.t = 0
        self.avg = torch.zeros(4)
        self.gen = torch.Generator().manual_seed(1)  # a noise stream of its own

    def forward(self, x):
        import numpy as np

        self.t += 1
        x = x + torch.randn(x.shape, generator=self.gen) * 0.01
        y = self.lin(x) * min(1.0, self.t / 10)
        if self.training and random.uniform(0, 1) < 0.3:
            y = y * 0.5
        y = y + torch.from_numpy(np.random.randn(*y.shape).astype("float32")) * 0.01
        with torch.no_grad():
            self.avg.mul_(0.9).add_(y.mean(0).nan_to_num() * 0.1)
        if not hasattr(self, "cache"):
            self.cache = torch.ones(4)
        return self.head(y - self.avg * self.cache)


@pytest.mark.parametrize("on_find", ["record", "warn"])
def test_the_analysis_leaves_the_users_python_state_random_streams_and_dispatch_modes_alone(on_find):
    import numpy as np
    from torch.utils.flop_counter import FlopCounterMode

    def run(watch: bool):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        model = _UserState()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hunt = nanhunt.watch(model, opt, on_find=on_find) if watch else None
        outs, flops = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(6):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
                if i == 2:
                    x[1, 1] = float("nan")  # a hit: the analysis replays this step
                with FlopCounterMode(display=False) as counter:
                    y = model(x)
                    y.nan_to_num().pow(2).mean().backward()
                    for p in model.parameters():
                        p.grad.nan_to_num_(0.0)  # the user's own guard
                    opt.step()  # the step's sync: the analysis runs in here
                opt.zero_grad()
                outs.append(y.detach())
                flops.append(counter.get_total_flops())
        if hunt is not None:
            hunt.close()
            assert [f.step for f in hunt.findings][:1] == [2]
        return outs, flops, model.state_dict(), model.t, sorted(vars(model)), random.random(), np.random.rand()

    plain, watched = run(False), run(True)
    for a, b in zip(plain[0], watched[0]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    assert plain[1] == watched[1]  # FlopCounterMode counted no replay
    assert all(torch.equal(plain[2][k], watched[2][k]) for k in plain[2])
    assert plain[3:] == watched[3:]


@pytest.mark.parametrize("stream", ["random", "numpy.random"])
def test_a_forward_that_draws_from_pythons_random_is_told_as_such_when_no_replay_reproduces(stream):
    # LayerDrop in a random order, decided with Python's (or NumPy's) random stream, which a replay
    # cannot put back as it was at the call: the replay ran other layers and the NaN did not come
    # back. The hint blamed "nondeterminism, a race or a hardware fault" on a CPU run
    import numpy as np

    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
            self.head = nn.Linear(8, 1)

        def forward(self, x, bad=False):
            order = list(range(6))
            random.shuffle(order) if stream == "random" else np.random.shuffle(order)
            for j in order:
                if (random.random() if stream == "random" else np.random.rand()) < 0.3:
                    continue
                x = torch.relu(self.layers[j](x)) + x
                if bad:  # after the first layer that runs: the next one is fed the NaN
                    bad, x = False, torch.sqrt(x - x.detach() - 1)
            return self.head(x)

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = LayerDrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(3):
            model(torch.randn(3, 8), step == 2).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.step, f.reproducible) == ("forward", 2, False), f
    assert f"{'Python' if stream == 'random' else 'NumPy'}'s random stream" in f.hint and "torch.rand" in f.hint and "hardware" not in f.hint, f.hint


def test_an_input_buffer_refilled_in_place_says_why_the_origin_is_unknown():
    # a static input buffer refilled for every micro-batch (CUDA-graph style): the failing call's
    # input holds another batch by the step's end, so no replay can run it as it ran
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buf = torch.empty(3, 4)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        for step in range(3):
            for micro in range(3):
                data = torch.randn(3, 4)
                if (step, micro) == (1, 0):
                    data[2, 3] = float("inf")
                buf.copy_(data)
                (model(buf).pow(2).mean() / 3).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.call, f.cause, f.reproducible) == ("forward", "0", 1, 0, "unknown", None), f
    assert "written in place after the call" in f.hint and "clone()" in f.hint, f.hint


def test_a_state_buffer_the_model_writes_while_reading_a_view_of_it_is_told_as_such() -> None:
    # a streaming model called on a view of its own memory (model(model.mem)), which its forward
    # updates in place: the input is written by the call itself, not after it; the hint said only
    # "after the call (a reused input buffer: buf.copy_(batch))", which the loop does not do
    class Memory(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mem", torch.ones(4, 8))
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = 1.0 / (x - 1.0)
            self.mem.mul_(0.5).add_(self.lin(x))
            return y

    torch.manual_seed(0)
    model = nn.Sequential(Memory(), nn.Linear(8, 1))
    with nanhunt.watch(model, on_find="record") as hunt, torch.no_grad():
        for step in range(3):
            model(model[0].mem[:])  # step 0: 1 / 0
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "0", 0, "unknown"), f
    assert "self.mem" in f.hint and "clone()" in f.hint, f.hint


class _WithTemplate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.template = torch.empty(4, device="meta")  # a shape template: no values to compare or keep

    def forward(self, x):
        return torch.log(self.lin(x))  # nan for negative values


def test_a_meta_tensor_attribute_does_not_break_the_replay_or_its_restores():
    def run(watch: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _WithTemplate())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        hunt = nanhunt.watch(model, opt, on_find="record") if watch else None
        draws = []
        for _ in range(2):
            model(torch.randn(3, 4)).nan_to_num(0.0).sum().backward()
            opt.step()
            opt.zero_grad()
            draws.append(float(torch.rand(())))  # the user's RNG stream after the step
        if hunt is not None:
            hunt.close()
        return draws, hunt

    plain, _ = run(False)
    watched, hunt = run(True)
    assert watched == plain
    f = hunt.first
    assert f is not None and (f.module, f.op, f.cause, f.verdict) == ("1", "aten.log.default", "created", "numerics"), f


class _LogBlock64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return self.inner(x).log()  # log of negatives: NaN


class _HighPrecision(nn.Module):
    """A forward that switches the default dtype around a section, without try/finally."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.hp, self.head = nn.Linear(4, 4), _LogBlock64(), nn.Linear(4, 1)

    def forward(self, x):
        x = self.pre(x)
        torch.set_default_dtype(torch.float64)
        h = self.hp(x.double()).nan_to_num(0.0)
        torch.set_default_dtype(torch.float32)
        return self.head(h.float())


def test_a_replay_runs_the_users_forward_to_its_end():
    # the replays stopped the forward right after the failing call by raising from a hook: the
    # user's code after it (switching the default dtype back) never ran, and the next step's
    # torch.randn was float64 (a crash in record mode)
    def run(watch: bool):
        torch.manual_seed(0)
        model = _HighPrecision()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hunt = nanhunt.watch(model, opt, on_find="record") if watch else None
        outs = []
        try:
            for _ in range(3):
                y = model(torch.randn(2, 4))
                outs.append(y.detach())
                y.sum().backward()
                opt.step()
                opt.zero_grad()
                assert torch.get_default_dtype() is torch.float32
        finally:
            torch.set_default_dtype(torch.float32)
            if hunt is not None:
                hunt.close()
        return outs, hunt

    plain, _ = run(False)
    watched, hunt = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert hunt.first is not None and hunt.first.module == "hp" and hunt.first.op == "aten.log.default", hunt.first


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_replayed_calls_output_is_judged_finite_exactly():
    """Each replayed call's "all finite when it returned" flag: exact for every value (a sum of
    large finite values that overflows is still finite), any floating or complex dtype, any layout
    of strides."""
    from nanhunt._locate.replay import _all_finite

    big = torch.full((4, 3), 3e38)
    assert bool(_all_finite(big)) and bool(_all_finite(big.t())) and bool(_all_finite(big.half().clamp(-6e4, 6e4)))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            t = torch.ones(5, 4, dtype=dtype)
            t[3, 1] = bad
            assert not bool(_all_finite(t)) and not bool(_all_finite(t.t()[1:])), (bad, dtype)
        for ctype in (torch.complex64, torch.complex32):  # (torch has no sum of complex32)
            z = torch.ones(3, dtype=ctype)
            z[1] = complex(0.0, bad)
            assert not bool(_all_finite(z)), (bad, ctype)
            assert bool(_all_finite(torch.ones(3, 2, dtype=ctype).t()))


class _Remembers(nn.Module):
    """Keeps what it saw in a list, a dict and a set of its own (a KV cache, a feature store): a
    replay of its forward appended to them again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[int] = []
        self.by_size: dict[int, int] = {}
        self.sizes: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.seen)
        self.seen.append(x.shape[0])
        self.by_size[n] = x.shape[0]
        self.sizes.add(n)
        return torch.log(self.lin(x))  # log of a negative: NaN


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_puts_back_what_the_modules_forward_appended_to_its_own_containers(mode: str) -> None:
    """record/warn/skip runs: each finding's replays ran the module's forward again, and a list the
    module keeps grew by three entries per finding (12 where the run made 3), as did a dict and a set.
    Their items are put back after each replay; the run's own calls are all there, in order."""
    torch.manual_seed(0)
    model = nn.Sequential(_Remembers(), nn.Linear(4, 2))
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        for i in range(3):
            model(torch.randn(5 + i, 4))
    m = model[0]
    assert hunt.findings and m.seen == [5, 6, 7], m.seen
    assert m.by_size == {0: 5, 1: 6, 2: 7} and m.sizes == {0, 1, 2}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_replays_leave_the_kv_cache_the_user_passed_in_as_the_calls_left_it(mode: str) -> None:
    # generation with a transformers KV cache passed in: each call appends its keys to it. The
    # analysis of a hit replays the call with what it was given, and every replay appended to the
    # user's own cache (6 tokens + 2 calls read 13): the run went on generating from a corrupted
    # cache. Replays now run on a copy of every non-tensor input

    pytest.importorskip("transformers")
    m = zoo.gpt2(dropout=0.0).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = m(input_ids=ids, use_cache=True).past_key_values
        m.transformer.wte.weight[5, 0] = float("nan")  # the next token's embedding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(m, on_find="record", mode=mode) as hunt, torch.no_grad():
            m(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
            m(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    f = hunt.first
    assert f is not None and (f.module, f.cause) == ("transformer.wte", "parameter"), str(f)
    assert cache.get_seq_length() == 8


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_hit_replays_the_forward_once_when_only_calls_after_the_nan_are_written_in_place(mode: str) -> None:
    # log(0) of a ReLU's zeros in the middle of a CNN: every BatchNorm after it returns NaN that
    # its ReLU(inplace) then writes over. Only the calls up to the first NaN need their values as
    # they returned: one replay of the forward, not a second one keeping copies of the rest. And
    # the op trace's replay of the failing call is the verdict's second replay (do replays agree?),
    # not one more
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), zoo.Log(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    runs: list[int] = []
    model[8].register_forward_pre_hook(lambda m, a: runs.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 1, 8, 8)
    with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
        model(x).sum().backward()
        opt.step()
    f = hunt.findings[0]
    assert (f.phase, f.module, f.cause, f.value) == ("forward", "3", "created", float("-inf"))
    assert f.verdict == "numerics" and f.op == "aten.log.default"
    assert runs == [1, 1, 1]  # the step's forward, one replay, the op trace
