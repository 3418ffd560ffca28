"""The hook stages never harm the run (issue 9): threads, the user's own forward hooks, models
that change while watched, torch.func transforms, and faults inside nanhunt's own code."""

from __future__ import annotations

import copy
import gc
import logging
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nanhunt
from nanhunt._record import copies as nanhunt_copies
from nanhunt._record import hunt as hunt_mod
from nanhunt._record.faults import InternalError
from nanhunt._steplog import StepLog

from . import zoo


# ---------------------------------------------------------------------------- threads
def test_a_model_called_from_several_threads_never_raises_in_them() -> None:
    model = zoo.mlp(d_in=4, d_hidden=16)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            start.wait()
            for _ in range(150):
                model(torch.randn(8, 4, generator=g))
        except BaseException as e:  # noqa: BLE001  (collected for the assertion)
            errors.append(e)

    with nanhunt.watch(model, on_find="raise") as hunt:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert not hunt.closed and hunt.findings == []
        # still watching afterwards: a NaN born in a later call on this thread is found
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            model(torch.full((2, 4), float("nan")))
            model(torch.randn(2, 4))  # the next root call ends the step
    assert ei.value.finding.phase == "forward"


def test_training_thread_owns_its_steps_while_another_thread_runs_inference() -> None:
    train, other = zoo.mlp(seed=0), zoo.mlp(seed=0)
    opt = torch.optim.SGD(train.parameters(), lr=0.01)
    stop = threading.Event()
    errors: list[BaseException] = []

    def eval_loop() -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    train(torch.randn(3, 4))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with nanhunt.watch(train, optimizer=opt, on_find="record") as hunt:
        t = threading.Thread(target=eval_loop)
        t.start()
        try:
            for i in range(30):
                x = torch.randn(4, 4)
                if i == 20:  # (the analysis after a hit is not for threads: stop the other one first)
                    stop.set()
                    t.join()
                    x[1, 2] = float("inf")
                train(x).sum().backward()
                opt.step()
                opt.zero_grad()
        finally:
            stop.set()
            t.join()
    assert errors == []
    assert hunt.first is not None and hunt.first.step in (20, 21)
    del other


def _run_on_a_new_thread(fn: Any, not_ident: int | None) -> None:
    """Run ``fn`` on a new thread whose ident is not ``not_ident`` (an ended thread's ident is
    given to the next thread started, which then passes for it)."""
    held: list[tuple[threading.Thread, threading.Event]] = []
    while True:
        go, run = threading.Event(), threading.Event()
        t = threading.Thread(target=lambda go=go, run=run: go.wait() and run.is_set() and fn())
        t.start()
        if t.ident != not_ident:
            break
        held.append((t, go))  # (alive, it keeps that ident from the next one)
    run.set()
    go.set()
    t.join()
    for h, g in held:
        g.set()
        h.join()


def test_a_new_thread_trains_on_after_the_first_one_ended() -> None:
    # thread 1 trains some steps and ends; thread 2 trains on. Thread 1 kept the step until thread 2's
    # first step(): thread 2's first forward was never recorded, and its overflow was reported as
    # the gradients' only
    model = zoo.expnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first: list[int] = []

    def train(bad: int) -> None:
        first.append(threading.get_ident())
        for i in range(3):
            x = torch.randn(8, 4)
            if i == bad:
                x[3] = 1000.0  # exp overflows in module 1
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    with nanhunt.watch(model, opt, on_find="record") as hunt:
        _run_on_a_new_thread(lambda: train(-1), None)
        _run_on_a_new_thread(lambda: train(0), first[0])
    assert first[0] != first[1]
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "1", 3, "created"), hunt.findings[:2]


# ---------------------------------------------------------------------------- user hooks
def test_a_users_forward_hook_that_changes_a_childs_output_is_blamed_on_the_child() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[0, 0] = float("nan")
        return out

    handle = model[0].register_forward_hook(poison)
    try:
        with nanhunt.watch(model, on_find="record") as hunt:
            model(torch.randn(2, 4))
        f = hunt.first
        assert f is not None and (f.phase, f.module) == ("forward", "0")
        assert model[0]._forward_hooks.keys() == {handle.id}  # ours came off at close
    finally:
        handle.remove()


def test_a_hook_the_user_adds_after_the_watch_still_runs_before_ours() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    seen: list[str] = []
    with nanhunt.watch(model, on_find="record") as hunt:
        h1 = model[0].register_forward_hook(lambda m, a, o: seen.append("first"))
        model(torch.randn(2, 4))
        h2 = model[0].register_forward_hook(lambda m, a, o: o * float("inf"))
        model(torch.randn(2, 4))
    h1.remove()
    h2.remove()
    assert seen[:2] == ["first", "first"]  # (a replay after the hit runs the user's hooks again)
    assert [(f.module, f.step) for f in hunt.findings if f.phase == "forward"][:1] == [("0", 1)]


def test_a_root_with_a_forward_hook_of_the_users_and_no_optimizer_is_replayed() -> None:
    # no optimizer: each root call is a step. The root's record waits for its late hook (after the
    # user's); the step's thread was let go before it, so the root call was never recorded, and
    # without its record no replay: the finding had no element, no op, no cause
    model = nn.Sequential(nn.Linear(4, 4), zoo.Log(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.0)
        model[0].bias.fill_(-1.0)  # log of -1: nan
    handle = model.register_forward_hook(lambda m, a, o: None)
    try:
        with nanhunt.watch(model, on_find="record") as hunt:
            model(torch.randn(2, 4))  # the output is dropped, as an evaluation loop may do
            model(torch.randn(2, 4))
        f = hunt.first
        assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "1", 0, "created")
        assert f.index == (0, 0) and f.op == "aten.log.default"
    finally:
        handle.remove()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_by_a_users_forward_hook_is_found_at_its_op_and_line(mode: str) -> None:
    """A forward hook that normalises a ReLU's rows (``out / out.sum(-1)``): a row the ReLU zeroed
    gives 0/0. The live hunt judges the output after the user's hooks, but the replay judged it
    before them (its hook ran first) and called the NaN a transient fault with no op; and the
    ReLU's hooked output was not probed at all (an activation cannot make a NaN: its hook can)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        model[0].bias.fill_(-5.0)  # most rows dead after the ReLU

    def rows_to_one(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out / out.sum(-1, keepdim=True)

    handle = model[1].register_forward_hook(rows_to_one)
    try:
        with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
            model(torch.randn(4, 4)).sum().backward()
        f = hunt.first
        assert f is not None
        assert (f.phase, f.module, f.cause, f.op, f.verdict) == ("forward", "1", "created", "aten.div.Tensor", "numerics")
        assert f.source is not None and f.source.endswith(f":{rows_to_one.__code__.co_firstlineno + 1}")
        assert list(model[1]._forward_hooks) == [handle.id]  # the replay's own hook came off too
    finally:
        handle.remove()


def _standardize(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    x = args[0]
    return ((x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True),)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_by_a_users_forward_pre_hook_is_the_hooked_modules(mode: str) -> None:
    """A forward pre-hook that standardises a layer's input, (x - mean) / std: a LayerNorm whose
    weight went to 0 makes every feature equal, std 0, 0/0. The replay judged the layer's inputs
    as its pre-hook passed them on (non-finite: "fed in") and blamed the enclosing encoder layer;
    the NaN was born in the hooked layer's call, from the finite inputs it was called with."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(4, 8), layer, nn.Linear(8, 2))
    handle = layer.linear1.register_forward_pre_hook(_standardize)
    with torch.no_grad():
        layer.norm1.weight.zero_()
        layer.norm1.bias.fill_(0.5)  # the feed-forward's input: all features equal
    try:
        with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
            model(torch.randn(2, 3, 4)).sum().backward()
        f = hunt.first
        assert f is not None
        assert (f.phase, f.module, f.cause, f.op) == ("forward", "1.linear1", "created", "aten.div.Tensor"), f
        assert f.source is not None and f.source.endswith(f":{_standardize.__code__.co_firstlineno + 2}")
        assert list(layer.linear1._forward_pre_hooks) == [handle.id]
    finally:
        handle.remove()


# ---------------------------------------------------------------------------- models that change
class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head: nn.Module = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class LogHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - x)  # -inf: born here


def test_a_head_swapped_in_while_watched_is_named_and_the_old_one_is_freed() -> None:
    torch.manual_seed(0)
    model = Growing()
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(2, 4))
        old = weakref.ref(model.head)
        model.head = nn.Sequential(nn.Linear(4, 4), LogHead())  # fine-tuning: a new head
        model(torch.randn(2, 4))  # ends the step that used the old head
        gc.collect()
        assert old() is None  # the hunt kept no reference to the replaced module
        model(torch.randn(2, 4))
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.module_type) == ("forward", "head.1", "LogHead")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_torch_jit_trace_of_a_watched_model_works_and_the_hunt_goes_on(mode: str) -> None:
    # the trace records every op the model runs: the hunt's probes and reads were recorded into it,
    # and its check ('graphs differed across invocations') failed (sentinel's root hooks: until
    # they stood aside during a trace too)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), zoo.Log())
    x = torch.rand(2, 8)
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        with warnings.catch_warnings():
            warnings.simplefilter("error", torch.jit.TracerWarning)
            traced = torch.jit.trace(model, x)
        assert torch.equal(traced(x), model(x))
        assert hunt.findings == []  # the traced calls are no steps of the model's
        model(torch.full((2, 8), 1e4))  # sigmoid underflows to 0: log gives -inf
    assert hunt.first is not None and (hunt.first.module, hunt.first.op) == ("2", "aten.log.default")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_torch_jit_trace_of_a_part_between_calls_gets_no_warning_of_nanhunt(mode: str) -> None:
    # traced after the root's call returned (an export of the encoder mid-run): the loss-code
    # recorder was on and probed the trace's ops (TracerWarning: 'Converting a tensor to a Python
    # boolean', from nanhunt's code: an error under -W error)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Sigmoid()), zoo.Log())
    x = torch.rand(2, 8)
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        model(x).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("error", torch.jit.TracerWarning)
            traced = torch.jit.trace(model[0], x)
        assert torch.equal(traced(x), model[0](x)) and hunt.findings == []
        model(torch.full((2, 8), -1e4))  # sigmoid underflows to 0: log gives -inf
    assert hunt.first is not None and (hunt.first.module, hunt.first.op) == ("1", "aten.log.default")


def _doubled(module: nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return out * 2.0  # (a user's forward hook that TorchScript compiles with its module)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_torch_jit_script_of_a_watched_model_works_and_the_hunt_goes_on(mode: str) -> None:
    # an export in the middle of a run: TorchScript compiled every module's forward and forward
    # hooks, the hunt's wrappers and hooks too ('Forward' object has no attribute '__globals__';
    # '_OnModule' object has no attribute '__name__')
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sigmoid(), zoo.Log(), zoo.transformer_encoder(dropout=0.0), nn.Linear(16, 1))
    model[3].register_forward_hook(_doubled)
    unwatched = copy.deepcopy(model)
    x = torch.rand(2, 5, 16)
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        model(x)
        hooks = [(dict(m._forward_pre_hooks), dict(m._forward_hooks), m.__dict__.get("forward")) for m in model.modules()]
        scripted = torch.jit.script(model)
        assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks), m.__dict__.get("forward"))
                for m in model.modules()] == hooks  # all put back, in their order
        assert torch.equal(scripted(x), unwatched(x)) and torch.equal(model(x), unwatched(x))
        assert hunt.findings == []
        bad = x.clone()
        bad[1, 2, 3] = -1e4  # sigmoid underflows to 0: log gives -inf
        model(bad)
    f = hunt.first
    assert f is not None and (f.module, f.op, f.index, f.step) == ("1", "aten.log.default", (1, 2, 3), 2)
    assert torch.jit._recursive.create_script_module is nanhunt_copies._CREATE  # (put back at close)


class _TracesItsPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.traced = torch.jit.trace(self.sub, x)  # a trace made inside a watched step
        return self.traced(x) + self.sub(x)


def test_a_jit_trace_made_inside_a_watched_forward_is_left_alone() -> None:
    model = _TracesItsPart()
    with nanhunt.watch(model) as hunt, warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        for _ in range(2):
            model(torch.randn(2, 4))
    assert not hunt.findings


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, temp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) / temp


class _Softmax(nn.Module):
    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        return torch.softmax(x, -1)


def test_meta_dry_runs_with_a_cpu_scalar_first_or_keyword_arguments_harm_nothing() -> None:
    model = _Scaled().to("meta")
    with nanhunt.watch(model) as hunt:  # the first positional tensor is a CPU scalar, the input on meta
        assert model(torch.tensor(2.0), torch.empty(2, 4, device="meta")).is_meta
    assert hunt.findings == []
    soft = _Softmax()
    with nanhunt.watch(soft, on_find="record") as hunt:
        assert soft(x=torch.empty(2, 4, device="meta")).is_meta  # keyword arguments only
        soft(x=torch.tensor([[0.0, float("nan")]]))
    assert [f.module for f in hunt.findings] == [""]
    # meta tensors made between calls (the loop's own code, recorded as the loss code is): no values to read
    with nanhunt.watch(soft, on_find="raise") as hunt:
        for _ in range(2):
            assert soft(x=torch.randn(2, 4, device="meta")).is_meta
    assert hunt.findings == [] and not hunt._faulted


def test_a_dry_run_on_the_meta_device_is_no_step_and_harms_nothing() -> None:
    # a model built on the meta device (shapes, FLOPs, deferred init) and run there has no values:
    # the hunt read them (.item() on meta) and raised an internal error into the user's run
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), zoo.Log())
    with nanhunt.watch(model) as hunt:
        assert model(torch.empty(2, 8, device="meta")).shape == (2, 8)
        model.to_empty(device="cpu")  # materialised: watched from its first real call
        torch.manual_seed(0)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        model(torch.rand(2, 8))
        with pytest.raises(nanhunt.NonFiniteError) as err:
            model(torch.full((2, 8), 1e4))  # sigmoid underflows to 0: log gives -inf
            model(torch.rand(2, 8))  # (no optimizer: the next call ends the step)
    assert (err.value.finding.module, err.value.finding.step) == ("2", 1)
    assert hunt.findings == [err.value.finding]


def test_a_training_dry_run_on_the_meta_device_with_its_optimizer_and_checks() -> None:
    """The whole loop run on meta (shapes, memory planning): backward gives meta gradients, and
    hunt.check of a meta placeholder. The step's probes were meta, and the step's one read
    (.item() on meta), or stacking a meta probe with real ones, raised nanhunt's InternalError
    into the run (raise mode) or switched the hunt off, so a real inf checked later was lost."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        for _ in range(2):
            loss = model(torch.randn(2, 4, device="meta")).sum()
            hunt.check(torch.empty(3, device="meta"), "placeholder")
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert hunt.findings == [] and not hunt._faulted
    real = zoo.mlp()
    opt = torch.optim.SGD(real.parameters(), lr=0.1)
    with nanhunt.watch(real, opt, on_find="record") as hunt:
        for step in range(2):
            loss = real(torch.randn(2, 4)).sum()
            hunt.check(torch.empty(3, device="meta"), "placeholder")
            hunt.check(loss * (float("inf") if step == 1 else 1.0), "scaled")
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert not hunt._faulted and [(f.phase, f.module, f.step) for f in hunt.findings] == [("check", "scaled", 1)]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("step", [True, False])
def test_a_model_moved_to_the_meta_device_mid_run_is_a_dry_run_in_every_mode(mode: str, step: bool) -> None:
    """``model.to("meta")`` after some real steps (freeing memory, sizing a variant), then a forward
    and backward there: sentinel mode recorded the meta call as a step's top-level call and read its
    probe (.item() on meta) at step() or close(): nanhunt's InternalError raised into the run."""
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        model.to("meta")
        model(torch.randn(3, 4, device="meta")).sum().backward()
        if step:
            opt.step()
    assert hunt.findings == [] and not hunt._faulted


# ---------------------------------------------------------------------------- torch.func
def test_per_sample_gradients_with_torch_func_on_a_watched_model() -> None:
    torch.manual_seed(0)
    model = zoo.mlp(d_in=4, d_hidden=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (x.unsqueeze(0),)) - y) ** 2).mean()

    with nanhunt.watch(model, optimizer=opt, on_find="raise", stats_every=1) as hunt:
        for _ in range(3):  # the DP-SGD/Opacus pattern: per-sample gradients, then one step
            params = {k: v.detach() for k, v in model.named_parameters()}
            x, y = torch.randn(5, 4), torch.randn(5, 1)
            g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
            for k, p in model.named_parameters():
                p.grad = g[k].mean(0)
            opt.step()
            opt.zero_grad()
        assert hunt.findings == [] and not hunt.closed
        next(model.parameters()).grad = torch.full_like(next(model.parameters()), float("nan"))
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            opt.step()
    assert ei.value.finding.phase == "grad"


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_per_sample_gradients_after_a_no_grad_call_of_the_model_in_the_same_step(on_find: str) -> None:
    # a no_grad call of the model (a metric, EMA targets) turns the loss-code recorder on until the
    # step's end; the per-sample gradients then ran through it and its probes of functorch-wrapped
    # tensors leaked into the step log: stacking them raised torch's internal assert
    # (maybe_level.has_value()), nanhunt's InternalError in raise mode, a hunt switched off in record
    torch.manual_seed(0)
    model = zoo.mlp(d_in=4, d_hidden=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (x.unsqueeze(0),)) - y) ** 2).mean()

    hunt = nanhunt.watch(model, optimizer=opt, on_find=on_find)
    try:
        for step in range(4):
            params = {k: v.detach() for k, v in model.named_parameters()}
            x, y = torch.randn(5, 4), torch.randn(5, 1)
            if step == 3:
                y[2, 0] = float("nan")  # a corrupt label: only sample 2's gradients are NaN
            with torch.no_grad():
                model(x)
            g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
            for k, p in model.named_parameters():
                p.grad = g[k].mean(0)
            opt.step()
            opt.zero_grad()
            assert hunt.findings == [] or step == 3
    except nanhunt.NonFiniteError:
        assert on_find == "raise"
    finally:
        hunt.close()
    assert not hunt._faulted
    f = hunt.first  # the loop's own .mean(0) of the per-sample gradients, fed sample 2's NaN
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "<outside>", 3, "input"), f


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_a_nan_born_inside_vmap_in_a_forward_is_found_by_its_module(on_find: str) -> None:
    # calls inside torch.func transforms are not recorded; the replay after the hit must not see
    # them either (their tensors are wrapped and die with the transform: reading one is a torch
    # internal assert) — the finding is the module that called vmap, at exp
    class Rowwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return vmap(lambda r: self.lin(r).abs().exp())(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Rowwise())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    hunt = nanhunt.watch(model, opt, on_find=on_find)
    try:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model[0].bias.fill_(1e4)  # exp(|x| ~ 1e3) overflows float32 inside the vmapped function
        model(x).sum().backward()
        opt.step()
    except nanhunt.NonFiniteError:
        assert on_find == "raise"
    finally:
        hunt.close()
    f = hunt.first
    assert f is not None  # an internal fault would have switched the hunt off with no finding
    assert (f.phase, f.module, f.step, f.op, f.cause) == ("forward", "1", 1, "aten.exp.default", "created")
    assert torch.isfinite(model[1].lin.weight).all() or on_find == "record"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_run_only_under_vmap_says_so_not_that_the_gradient_was_born_in_accumulation(mode: str) -> None:
    # vmap(model)(x): every call of the model ran inside the transform, none was recorded; the
    # log(0) of its forward reaches the gradients. The finding was "created" in the gradient with
    # the accumulation hint (full) or sentinel's "its parts were called directly": both send the
    # user away from the forward that made it
    model = zoo.lognet(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        vmap(model)(torch.rand(3, 8, 4)).sum().backward()  # ReLU zeros: log(0) = -inf inside vmap
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.cause) == ("grad", "unknown"), f
    assert "torch.func transform" in f.hint and "accumulated" not in f.hint, f.hint


# ---------------------------------------------------------------------------- internal faults
def _boom(*args: Any, **kwargs: Any) -> Any:
    raise ZeroDivisionError("injected")


# each hook stage and the nanhunt function it calls there
STAGES = {
    "pre-hook (top capture)": (hunt_mod, "_capture_top"),
    "forward hook (record)": (hunt_mod.Hunt, "_record"),
    "forward hook (history stats)": (hunt_mod, "stats"),
    "gradient hook (key)": (hunt_mod.Hunt, "_key"),
    "check() (probe)": (hunt_mod, "probe"),
    "optimizer pre-hook (fused probe)": (hunt_mod.GradProbe, "probe"),
    "optimizer post-hook (state)": (hunt_mod.OptimizerProbe, "current"),
    "step end (sync)": (StepLog, "poison"),
}


def _train(hunt_kw: dict[str, Any] | None, steps: int = 4) -> tuple[list[torch.Tensor], list[float], Any]:
    model = zoo.cnn(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    hunt = nanhunt.watch(model, optimizer=opt, **hunt_kw) if hunt_kw is not None else None
    try:
        for _ in range(steps):
            x = torch.randn(4, 1, 8, 8, generator=g)
            loss = model(x).square().mean()
            if hunt is not None:
                hunt.check(loss, "loss")
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if hunt is not None:
            hunt.close()
    return [p.detach().clone() for p in model.state_dict().values()], losses, hunt


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("on_find", ["record", "warn"])
def test_an_internal_fault_is_logged_once_and_the_run_is_bit_identical(
    stage: str, on_find: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ref_state, ref_losses, _ = _train(None)
    owner, attr = STAGES[stage]
    monkeypatch.setattr(owner, attr, _boom)
    with caplog.at_level(logging.ERROR, logger="nanhunt"):
        state, losses, hunt = _train({"on_find": on_find, "stats_every": 1})
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state))
    records = [r for r in caplog.records if r.name == "nanhunt"]
    assert len(records) == 1 and "internal error" in records[0].getMessage()
    assert hunt.closed and hunt.findings == []


def test_a_fault_in_a_gradient_hook_during_backward(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    model = zoo.mlp()
    x = torch.randn(3, 4)
    ref = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    monkeypatch.setattr(hunt_mod, "probe", _boom)
    with caplog.at_level(logging.ERROR, logger="nanhunt"):
        with nanhunt.watch(model, on_find="record", grad_hooks=True) as hunt:
            got = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert hunt.closed and len([r for r in caplog.records if r.name == "nanhunt"]) == 1


@pytest.mark.parametrize("stage", list(STAGES))
def test_an_internal_fault_in_raise_mode_is_an_internal_error_not_a_finding(
    stage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    owner, attr = STAGES[stage]
    monkeypatch.setattr(owner, attr, _boom)
    with caplog.at_level(logging.CRITICAL, logger="nanhunt"), pytest.raises(InternalError) as ei:
        _train({"on_find": "raise", "stats_every": 1})
    assert not isinstance(ei.value, nanhunt.NonFiniteError)
    assert isinstance(ei.value.__cause__, ZeroDivisionError)


def test_the_users_own_on_find_exception_is_theirs_not_an_internal_fault(caplog: pytest.LogCaptureFixture) -> None:
    model = zoo.lognet()

    def stop(f: nanhunt.Finding) -> None:
        raise KeyError("stop training")

    with caplog.at_level(logging.ERROR, logger="nanhunt"), pytest.raises(KeyError):
        with nanhunt.watch(model, on_find=stop):
            model(torch.zeros(2, 4) - 1.0)
            model(torch.randn(2, 4))
    assert not [r for r in caplog.records if r.name == "nanhunt"]


def test_warn_under_warnings_as_errors_reaches_the_user_and_the_hunt_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    # -W error, or pytest's filterwarnings = error: the warning is raised where it is issued (the
    # optimizer's step pre-hook); it is the user's to see, not nanhunt's internal fault
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = []
    with caplog.at_level(logging.ERROR, logger="nanhunt"), warnings.catch_warnings():
        warnings.simplefilter("error", nanhunt.NonFiniteWarning)
        with nanhunt.watch(model, opt, on_find="warn") as hunt:
            for i in range(4):
                x = torch.randn(2, 4)
                if i in (1, 3):
                    x[0, 0] = float("nan")
                before = [p.detach().clone() for p in model.parameters()]
                model(x).sum().backward()
                try:
                    opt.step()
                except nanhunt.NonFiniteWarning:
                    raised.append(i)
                    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # not applied
                opt.zero_grad()
            assert not hunt.closed
    assert raised == [1, 3]
    assert [f.phase for f in hunt.findings] == ["forward", "grad", "forward", "grad"]
    assert not [r for r in caplog.records if r.name == "nanhunt" and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_root_call_on_a_worker_thread_leaves_no_mode_on_that_threads_stack(mode: str) -> None:
    # the outside recorder is a torch function mode: pushed on a worker thread's own stack it
    # could only be popped there, and a thread that ended with it aborted the process at exit
    m = zoo.mlp()
    seen = {}

    def work() -> None:
        with torch.no_grad():
            m(torch.randn(2, 4))
        seen["stack"] = torch._C._len_torch_function_stack()

    with nanhunt.watch(m, mode=mode):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert seen == {"stack": 0}
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_thread_running_the_model_during_the_analysis_is_left_alone(mode: str) -> None:
    """Background inference on the watched model while the main thread trains: the replays after
    the hit hook every module globally, and their hooks acted on the background thread's calls
    (it died of the op trace's internal stop signal, or 'pop from empty mode stack', and a dispatch
    mode stayed on the main thread)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stop, errors, calls = threading.Event(), [], [0]

    def background() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    model(torch.randn(2, 4))
                calls[0] += 1
            except BaseException as e:  # noqa: BLE001 - the test reports whatever killed it
                errors.append(repr(e))
                return

    thread = threading.Thread(target=background)
    thread.start()
    try:
        with nanhunt.watch(model, opt, on_find="record", mode=mode) as hunt:
            for step in range(40):
                x = torch.randn(4, 4)
                if step in (10, 20, 30):
                    x[1, 1] = float("nan")
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        stop.set()
        thread.join()
    assert errors == [] and calls[0] > 0
    f = hunt.first
    assert f is not None and (f.phase, f.step, f.index, f.cause) == ("forward", 10, (1, 0), "input"), f
    assert _get_current_dispatch_mode_stack() == [] and not torch.overrides._get_current_function_mode_stack()


class _LoggingTensor(torch.Tensor):
    """A tensor subclass that logs every torch call made on it (quantisation simulators and
    tracing tools do; some implement only the ops their model needs)."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_users_tensor_subclass_never_sees_nanhunts_probes(mode: str) -> None:
    def run(watch: bool, bad: bool = False) -> tuple[list[str], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hunt = nanhunt.watch(model, opt, mode=mode, on_find="record") if watch else None
        _LoggingTensor.seen = []
        for i in range(2):
            x = torch.randn(2, 4)
            if bad and i == 1:
                x[0, 0] = float("nan")
            model(x.as_subclass(_LoggingTensor)).sum().backward()
            opt.step()
            opt.zero_grad()
        seen = list(_LoggingTensor.seen)
        if hunt is not None:
            hunt.close()
        return seen, hunt

    plain, _ = run(False)
    watched, hunt = run(True)
    assert watched == plain  # is_inference, numel, aminmax, linalg_vector_norm ... were the hunt's
    _, hunt = run(True, bad=True)
    assert hunt.first is not None and (hunt.first.step, hunt.first.cause) == (1, "input")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_value_born_on_a_users_tensor_subclass_is_named_at_its_op_and_line(mode: str) -> None:
    # a units/metadata subclass whose __torch_function__ hands every op on (super()): each result is
    # another object than the op made (as_subclass), so the replay's op trace lost every producer and
    # log(0) in the parent's code between two children was blamed on the Linear after it ("created",
    # no op); and the line was the subclass's own __torch_function__, not the forward's
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, bad: bool) -> torch.Tensor:
            h = torch.relu(self.a(x))
            if bad:
                h = torch.log(h * 0)
            return self.b(h)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        for step in range(3):
            model(torch.randn(3, 4).as_subclass(_LoggingTensor), step == 2).sum().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "", 2, "created", "aten.log.default"), f
    assert f.source is not None and f.source.endswith(f":{Net.forward.__code__.co_firstlineno + 3}"), f.source


def test_a_nan_in_the_tensors_given_to_functional_call_is_their_finding_not_a_hardware_fault() -> None:
    # a meta-learning inner step runs the model on adapted weights through functional_call; the
    # replays ran it with the module's own (finite) weights and said 'transient' (a hardware fault)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    fast = {k: v.detach().clone() for k, v in model.named_parameters()}
    fast["0.weight"][0, 0] = float("nan")
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model):
        functional_call(model, fast, (torch.randn(2, 3),))
        model(torch.randn(2, 3))  # the step ends at the model's next call
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.reproducible) == ("forward", "0", "parameter", True), f
    assert f.verdict is None and "'0.weight', given to torch.func.functional_call" in f.hint, f
    assert all(bool(p.isfinite().all()) for p in model.parameters())  # the module's own, untouched


class _MAML(nn.Module):
    """One inner step inside the forward: the query batch runs on adapted weights (functional_call
    of a child), whose gradient is an L2 distance's: sqrt at 0 (a support pair fitted exactly)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())
        inner = torch.sqrt(((functional_call(self.net, params, (xs,)) - ys) ** 2).sum(1)).mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
        return functional_call(self.net, fast, (xq,))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_child_run_on_non_finite_adapted_weights_inside_the_forward_names_them(mode: str) -> None:
    # the cause was judged on the child's own (finite) parameters after the call: "created" from
    # finite inputs, with the 0/0 hint, for a Linear fed NaN weights by the inner step
    torch.manual_seed(0)
    model = _MAML()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        for step in range(2):
            xs, xq = torch.randn(3, 4), torch.randn(3, 4)
            with torch.no_grad():
                ys = model.net(xs) + 0.1
                if step == 1:
                    ys[1] = model.net(xs)[1]
            model(xs, ys, xq).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "net.0", 1, "parameter"), f
    assert "'net.0.weight', given to torch.func.functional_call" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_overflow_on_fast_weights_an_inner_learning_rate_blew_up_names_them_not_the_outer_lr(mode: str) -> None:
    # MAML with an inner learning rate gone wrong: the inner updates p - lr * g make fast weights
    # of 1e20 and more, the query's Linear overflows. The hint said "a lower learning rate", which
    # sends the user to the outer optimizer, whose weights are small: the fast weights are the cause
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(6):
            a, ph = torch.rand(1, generator=g) * 4 + 0.1, torch.rand(1, generator=g) * 3  # a sine task
            xs, xq = torch.rand(10, 1, generator=g) * 10 - 5, torch.rand(10, 1, generator=g) * 10 - 5
            ys, yq = a * torch.sin(xs + ph), a * torch.sin(xq + ph)
            fast = dict(model.named_parameters())
            for _ in range(3):
                gs = torch.autograd.grad((functional_call(model, fast, (xs,)) - ys).pow(2).mean(),
                                         list(fast.values()), create_graph=True)
                fast = {n: p - 0.01 * 10 ** step * gr for (n, p), gr in zip(fast.items(), gs)}
            (functional_call(model, fast, (xq,)) - yq).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.cause, f.op) == ("forward", "created", "aten.addmm.default"), f
    assert "given through torch.func.functional_call are huge" in f.hint and "inner learning rate" in f.hint, f.hint
    assert "weights are huge" not in f.hint, f.hint  # (the model's own are not)


class _Amplified(torch.Tensor):
    """A subclass whose linear is 1e30 times larger (a scaled tensor type): its semantics matter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 1e30 if func is torch.nn.functional.linear else out


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_analysis_and_on_find_run_with_the_users_tensor_subclass(mode: str) -> None:
    # without an optimizer the step ends in the next root call's pre-hook: the replays and on_find ran
    # with subclass dispatch switched off there (a replay of other semantics: a wrong verdict)
    seen: list[float] = []

    def on_find(f: nanhunt.Finding) -> None:
        x = torch.ones(2).as_subclass(_Amplified)
        seen.append(float(torch.nn.functional.linear(x, torch.ones(1, 2)).sum()))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Softmax(-1))
    with nanhunt.watch(model, mode=mode, on_find=on_find) as hunt:
        for i in range(3):
            model((torch.randn(3, 2) * (1e10 if i == 1 else 1)).as_subclass(_Amplified))  # 1e40: inf
    f = hunt.first
    assert f is not None and (f.step, f.module, f.cause, f.reproducible) == (1, "0", "created", True), f
    assert seen and seen[0] == pytest.approx(2e30)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_functional_call_tied_weights_and_the_verdicts_replay_with_the_given_tensors() -> None:
    # functional_call ties weights by default: the given embedding is the head's weight too. The
    # replays re-applied the tensors untied (the head ran its own finite weight: 'transient')
    torch.manual_seed(0)
    model = _TiedLM()
    fast = {"embed.weight": model.embed.weight.detach().clone()}
    fast["embed.weight"][9, 0] = float("nan")  # a row never looked up: the NaN shows first in the head
    ids = torch.tensor([[1, 2, 3]])
    with nanhunt.watch(model, on_find="record") as hunt:
        functional_call(model, fast, (ids,))
        model(ids)
    f = hunt.first
    assert f is not None and (f.module, f.cause, f.reproducible) == ("head", "parameter", True), f
    assert "'embed.weight', given to torch.func.functional_call" in f.hint, f.hint
    # float16: the verdict's float32 replays run the given tensors too
    half = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).half()
    big = {k: v.detach().clone() for k, v in half.named_parameters()}
    big["0.weight"].fill_(3e4)
    with nanhunt.watch(half, on_find="record") as hunt:
        functional_call(half, big, (torch.ones(2, 4, dtype=torch.float16),))
        half(torch.ones(2, 4, dtype=torch.float16))
    f = hunt.first
    assert f is not None and f.module == "0" and f.verdict == "precision" and f.reference["value"] > 65504, f


class _MetaPlaceholder(nn.Module):
    """A CPU model holding a meta buffer (a shape placeholder for a dry run)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("shape_probe", torch.empty(3, 4, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x))


@pytest.mark.parametrize("on_find", ["raise", "skip", "record"])
def test_a_meta_buffer_in_a_real_model_is_left_alone(on_find: str) -> None:
    # the step's buffer check and the raise/skip backup read it: InternalError at the first clean step
    # (record mode: the hunt switched itself off and missed the NaN)
    torch.manual_seed(0)
    model = _MetaPlaceholder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find=on_find) as hunt:
        zoo.train_with_a_nan_batch(model, opt, (4, 4))
    assert not hunt._faulted and hunt.first is not None, hunt.findings
    assert (hunt.first.step, hunt.first.module, hunt.first.cause) == (2, "a", "input"), hunt.first


# ---------------------------------------------------------------------------- TorchScript
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_model_is_refused_with_a_clear_error(how: str) -> None:
    """watch() took a ScriptModule, and its first NaN raised nanhunt's InternalError into the run
    (get_submodule is not supported on ScriptModules): TorchScript runs its submodules where no
    hook reaches them, so watch() says so at once."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    sm = torch.jit.script(model) if how == "script" else torch.jit.trace(model, torch.randn(2, 4))
    with pytest.raises(TypeError, match="TorchScript"):
        nanhunt.watch(sm)


def test_a_scripted_submodule_of_an_eager_model_is_found_with_its_element() -> None:
    """A scripted block inside an eager model is one call to the hooks; its log(0) was "origin
    unknown" with no element: the replay failed on the block's C++ state dicts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.ReLU(), zoo.Log())), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    plain = model(x)
    with nanhunt.watch(model, on_find="record") as hunt:
        out = model(x)
    f = hunt.first
    assert f is not None and (f.module, f.cause, f.reproducible, f.op) == ("1", "created", True, "aten.log.default")
    assert f.index is not None and f.value == float("-inf")
    assert zoo.bit_equal(out, plain)


def _with_nan(at: tuple[int, int]) -> torch.Tensor:
    """A (2, 4) batch of rand with one NaN at ``at``."""
    x = torch.rand(2, 4)
    x[at] = float("nan")
    return x


class _Gate(nn.Module):
    """Identity; while ``during`` is set, the main thread's call runs it in another thread first
    and waits for it (a call from that thread while the main thread's call is in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.during: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.during is not None and threading.current_thread() is threading.main_thread():
            fn, self.during = self.during, None
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        return x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("optimizer", [False, True], ids=["inference", "training"])
def test_a_nan_in_another_threads_call_made_meanwhile_is_found_in_that_thread(mode: str, optimizer: bool) -> None:
    """A server's concurrent requests, or an evaluation thread beside training: a call from a
    thread that does not own the step, made while the owner's call is in flight (or between its
    calls), was not recorded at all; a NaN in it went unfound. Now such a call is judged on its
    own as it returns (one read) and raised in its thread; the owner's call, its outputs and its
    step are untouched, and so is the process's RNG (no replay runs on the model in use)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Gate(), nn.ReLU(), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if optimizer else None
    bad = _with_nan((1, 2))
    raised: list[BaseException] = []

    def other() -> None:
        try:
            with torch.no_grad():
                model(bad)
        except nanhunt.NonFiniteError as e:
            raised.append(e)

    xs = [torch.rand(3, 4) for _ in range(4)]
    rng = torch.get_rng_state()
    with nanhunt.watch(model, opt, on_find="raise", mode=mode) as hunt:
        outs = []
        for i, x in enumerate(xs):
            if i == 2:
                model[1].during = other  # while the main thread's call is in flight
            if i == 3 and opt is not None:  # between the steps' calls (without an optimizer the
                # thread takes the next step itself, judged at the model's next call)
                t = threading.Thread(target=other)
                t.start()
                t.join()
            out = model(x)
            outs.append(out.detach().clone())
            if opt is not None:
                out.sum().backward()
                opt.step()
                opt.zero_grad()
    n = 2 if opt is not None else 1
    assert len(raised) == n and len(hunt.findings) == n, hunt.findings
    for e in raised:
        f = e.finding
        # the call's own module (the model): not replayed, as the model is the step's thread's meanwhile
        assert (f.phase, f.module, f.module_type, f.cause, f.index) == ("forward", "", "Sequential", "input", (1, 0)), str(f)
    assert torch.equal(torch.get_rng_state(), rng)
    if opt is None:
        assert all(torch.equal(o, ref(x)) for o, x in zip(outs, xs))
    assert all("forward" not in m.__dict__ for m in model.modules())


class _LogAt(nn.Module):
    """log(x + shift): with shift 0, log(0) = -inf where the input is 0."""

    def __init__(self, shift: float = 1.0) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + self.shift)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("on_find", ["record", "warn"])
def test_another_threads_calls_leave_the_steps_own_finding_first(mode: str, on_find: str) -> None:
    """The step's thread makes a log(0) in its forward; while that call runs, another thread
    calls the model with a NaN input, and runs a model of its own (unwatched) whose -inf is by
    design. The step's finding stays first (the other thread's comes second, at the same step),
    each warns once, and the unwatched model is none of the hunt's business (no finding, and its
    calls never take the step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Gate(), nn.ReLU(), _LogAt(), nn.Linear(4, 1))
    mine = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _LogAt(0.0))  # log(0) where the ReLU cut: by design here
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    bad = _with_nan((0, 1))
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with torch.no_grad():
                mine(torch.randn(8, 4))
                model(bad)
        except BaseException as e:  # noqa: BLE001  (collected for the assertion)
            errors.append(e)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanhunt.watch(model, opt, on_find=on_find, mode=mode) as hunt:
            for i in range(3):
                x = torch.rand(3, 4) + 0.5
                if i == 2:
                    model[1].during = other
                    model[3].shift = 0.0
                    with torch.no_grad():
                        model[0].weight.zero_()
                        model[0].bias.zero_()  # ReLU(0) = 0, log(0) = -inf: born in `3`
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    assert errors == []
    got = [(f.phase, f.module, f.cause, f.step) for f in hunt.findings]
    assert got[0] == ("forward", "3", "created", 2), [str(f) for f in hunt.findings]
    assert got[1:].count(("forward", "", "input", 2)) == 1, got  # the other thread's, after the step's
    assert all(f.module_type != "_LogAt" or f.module == "3" for f in hunt.findings)
    if on_find == "warn":
        assert sum(issubclass(w.category, nanhunt.NonFiniteWarning) for w in caught) == 2


def test_a_threads_call_being_recorded_as_step_takes_the_step_is_cut_short_quietly(caplog: Any) -> None:
    """Before the first step(), a worker thread trains (its grad-enabled call owns the step); its
    call's hook is recording the call into the step's log when the main thread's step() takes the
    step and ends that log. The hook went on writing into the ended log (an internal IndexError:
    the hunt switched itself off, the main thread's later NaN went unfound)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    paused, resume = threading.Event(), threading.Event()
    done: list[str] = []
    with caplog.at_level(logging.ERROR, logger="nanhunt"), nanhunt.watch(model, opt, on_find="record") as hunt:
        orig = hunt._resolve

        def held(log: StepLog) -> None:  # the worker records its call's deferred outputs: held there
            if threading.current_thread().name == "worker" and not paused.is_set() and (log.stats_lazy or log.lazy):
                paused.set()
                resume.wait(20)
            orig(log)

        hunt._resolve = held  # type: ignore[method-assign]

        def worker() -> None:
            for _ in range(4):
                model(torch.rand(4, 8))
            done.append("ok")

        t = threading.Thread(target=worker, name="worker")
        t.start()
        took = paused.wait(20)  # (full mode: the worker's lean calls are resolved as its call returns)
        model(torch.rand(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        resume.set()
        t.join()
        del hunt._resolve
        x = torch.rand(4, 8)
        x[2, 3] = float("nan")
        model(x).sum().backward()
        opt.step()
    assert took and done == ["ok"]
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    assert hunt.first is not None and (hunt.first.phase, hunt.first.step) == ("forward", 1), str(hunt.first)


class _Tap(nn.Module):
    """Identity; runs ``at[n]()`` at its n-th call on the main thread."""

    def __init__(self) -> None:
        super().__init__()
        self.at: dict[int, Any] = {}
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():
            self.n += 1
            fn = self.at.pop(self.n, None)
            if fn is not None:
                fn()
        return x


def test_close_from_another_thread_while_the_analysis_replays_leaves_no_wrapper_behind() -> None:
    """A server shutting down: close() runs on another thread while the step's analysis replays a
    call. The replay's restore of the modules' own attributes put the `forward` wrappers close()
    had just taken off back on every module, for good."""
    torch.manual_seed(0)
    tap = _Tap()
    model = nn.Sequential(nn.Linear(4, 4), tap, nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    hunt = nanhunt.watch(model, opt, on_find="record")
    model(torch.rand(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    x = torch.rand(3, 4)
    x[2, 3] = float("nan")
    model(x).sum().backward()

    closed_in_replay = []

    def close_elsewhere() -> None:
        t = threading.Thread(target=hunt.close)
        t.start()
        t.join()
        closed_in_replay.append(True)

    tap.at[3] = close_elsewhere  # (call 3: the step-end analysis replays the NaN call)
    opt.step()
    # (the replay's restore puts the tap's own dict and counter back: what fired is seen outside it)
    assert hunt.closed and closed_in_replay
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []


def _closer_on_another_thread(hunt: nanhunt.Hunt, errors: list[BaseException]) -> Any:
    """A function that closes ``hunt`` on a thread of its own and waits for it (a server's
    shutdown), keeping what close() raised there in ``errors``."""
    def close_elsewhere() -> None:
        def close() -> None:
            try:
                hunt.close()
            except BaseException as exc:  # (the test's own report of it)
                errors.append(exc)

        t = threading.Thread(target=close)
        t.start()
        t.join()
    return close_elsewhere


@pytest.mark.parametrize("mode", ["full", "sentinel", "ops"])
def test_close_from_another_thread_mid_forward_leaves_nothing_behind(mode: str) -> None:
    """A server's shutdown: close() runs on another thread while the training thread is inside the
    model's forward. In ops mode close() popped the op mode from the closing thread's own (empty)
    dispatch stack: RuntimeError, and every hook and wrapper of the hunt stayed on. Now the mode
    passes ops through until the training thread's next module call takes it off its stack."""
    torch.manual_seed(0)
    tap = _Tap()
    model = nn.Sequential(nn.Linear(4, 4), tap, nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    hunt = nanhunt.watch(model, opt, mode=mode)
    model(torch.rand(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    errors: list[BaseException] = []
    close_elsewhere = _closer_on_another_thread(hunt, errors)

    tap.at[tap.n + 1] = close_elsewhere
    model(torch.rand(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model(torch.rand(3, 4)).sum().backward()  # (the next module call takes the op mode out)
    opt.step()
    assert errors == [] and hunt.closed
    assert torch._C._len_torch_dispatch_stack() == 0
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__ or m._forward_hooks
            or m._forward_pre_hooks] == []
    assert not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
    assert not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks)


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_close_from_another_thread_mid_step_does_not_judge_the_training_threads_step(
        mode: str, caplog: Any) -> None:
    """Gradient accumulation: the step's first micro-batch made a NaN, the second is in its forward
    when a shutdown thread calls close(). close() judged the half-written step there, replaying the
    first call on the model the training thread was running, and raised the finding in the closing
    thread. Now that step is left unjudged, with a warning; nothing of the hunt is left."""
    torch.manual_seed(0)
    tap = _Tap()
    model = nn.Sequential(nn.Linear(4, 4), tap, nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    hunt = nanhunt.watch(model, opt, mode=mode)
    errors: list[BaseException] = []
    close_elsewhere = _closer_on_another_thread(hunt, errors)

    x = torch.rand(3, 4)
    x[1, 2] = float("nan")
    with caplog.at_level(logging.WARNING, logger="nanhunt"):
        model(x).sum().backward()
        tap.at[tap.n + 1] = close_elsewhere
        model(torch.rand(3, 4)).sum().backward()
    assert errors == [] and hunt.closed and hunt.findings == []
    assert any("another thread" in r.getMessage() for r in caplog.records)
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__ or m._forward_hooks] == []
    assert torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0


def test_two_ops_hunts_closed_first_opened_first_leave_no_mode_or_hook() -> None:
    """The first hunt's op mode sits under the second's: close() popped the top, the second's."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    first, second = nanhunt.watch(model, mode="ops"), nanhunt.watch(model, mode="ops")
    model(torch.rand(2, 4))
    first.close()
    second.close()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_of_a_forward_run_on_a_worker_thread_says_so_not_torch_compile(mode: str) -> None:
    """The model's forward runs on a worker thread, backward and step() on the main thread. The
    step's non-finite gradient had nothing of the step seen, and its hint sent the user to a
    torch.compile'd training step (full) or to a GAN's parts called directly (sentinel)."""
    model = zoo.cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        for s in range(3):
            x = torch.randn(4, 1, 8, 8)
            if s == 2:
                x[0, 0, 0, 0] = float("nan")
            got: list[torch.Tensor] = []
            t = threading.Thread(target=lambda x, got: got.append(model(x)), args=(x, got))
            t.start()
            t.join()
            got[0].float().sum().backward()
            opt.step()
            opt.zero_grad()
    grads = [f for f in hunt.findings if f.phase == "grad" and f.step == 2]
    assert grads and grads[0].cause == "unknown", [str(f) for f in hunt.findings]
    assert "another thread" in grads[0].hint and "compile" not in grads[0].hint and "GAN" not in grads[0].hint
    assert any(f.phase == "forward" and f.step == 2 and f.cause == "input" for f in hunt.findings)


def test_an_on_find_callback_that_steps_the_optimizer_gets_a_clear_error() -> None:
    """A callback calling ``opt.step()`` re-entered the step's judgement, which called the callback
    again: RecursionError after 166 findings of the same step. Now a RuntimeError saying what
    happened; the NaN gradient was never applied and the hunt goes on."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen: list[int] = []

    def cb(f: nanhunt.Finding) -> None:
        seen.append(f.step)
        opt.step()

    before = [p.detach().clone() for p in m.parameters()]
    with nanhunt.watch(m, opt, on_find=cb) as hunt:
        x = torch.randn(5, 4)
        x[0, 0] = float("nan")
        m(x).sum().backward()
        with pytest.raises(RuntimeError, match="optimizer.step\\(\\) was called from inside the on_find callback"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        opt.zero_grad()
        m(torch.randn(5, 4)).sum().backward()
        opt.step()  # the next, finite step is taken as usual
    assert seen == [0] and {f.step for f in hunt.findings} == {0}
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


class _RaisesOnOddBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if x.shape[0] == 3:
            raise ValueError("a batch of 3")
        return y


@pytest.mark.parametrize("other", ["a second hunt", "a global forward hook of the user's"])
def test_the_users_exception_in_a_forward_reaches_them_with_another_global_hook_after_ours(other: str) -> None:
    """After an exception in a forward, torch runs the always-called global forward hooks while it
    iterates its live dict of them; the root call's hook turned the outside-code recorder on, which
    adds global hooks of its own: with another global hook after ours (a second hunt of the model,
    any hook of the user's) the user got "RuntimeError: OrderedDict mutated during iteration" in
    place of their own exception."""
    model = _RaisesOnOddBatch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hunt = nanhunt.watch(model, opt)
    more = (nanhunt.watch(model, opt) if other == "a second hunt"
            else torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            with pytest.raises(ValueError, match="a batch of 3"):
                model(torch.randn(3, 4))
    finally:
        (more.close if other == "a second hunt" else more.remove)()  # type: ignore[union-attr]
        hunt.close()
    assert hunt.findings == [] and all("forward" not in m.__dict__ for m in model.modules())


class _LogOfRelu(nn.Module):
    """log of a ReLU's output: log(0) = -inf wherever the ReLU cut a value, and the next Linear
    mixes -inf with +inf terms into NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, logs: bool = False) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(torch.log(h) if logs else h)


@pytest.mark.parametrize("first", ["raise", "record"])
def test_two_hunts_of_one_optimizer_keep_the_same_steps_when_one_raises_out_of_step(first: str) -> None:
    """Two hunts of one model and optimizer, one in raise mode (a callback's and the user's own):
    when it raises out of step()'s pre-hook, torch runs no hook after it nor any post-hook. The
    other hunt never judged that step (or judged it and never saw it end), fell one step behind for
    each raise, and named the next NaN's step one too early (3 for step 5)."""
    torch.manual_seed(0)
    model = _LogOfRelu()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hunts = {first: nanhunt.watch(model, opt, on_find=first)}
    second = "record" if first == "raise" else "raise"
    hunts[second] = nanhunt.watch(model, opt, on_find=second)
    raised = []
    try:
        for step in range(7):
            try:
                model(torch.randn(16, 4), logs=step in (2, 5)).pow(2).mean().backward()
                opt.step()
            except nanhunt.NonFiniteError:
                raised.append(step)
            opt.zero_grad()
    finally:
        for h in hunts.values():
            h.close()
    assert raised == [2, 5]
    firsts = {name: sorted({f.step for f in h.findings}) for name, h in hunts.items()}
    assert firsts == {"raise": [2, 5], "record": [2, 5]}
    assert hunts["raise"].step == hunts["record"].step
    assert all(f.phase == "forward" for h in hunts.values() for f in h.findings if f.module == "")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_training_loop_on_a_thread_of_its_own_has_its_loss_code_recorded(mode: str) -> None:
    """watch(), the loop and close() all on one worker thread (a trainer run in a thread of its
    own): the loss code there is recorded as on the main thread, so a hand-written binary
    cross-entropy over a sigmoid rounded to 0 or 1 is found at aten.log on its line. It was 'backward of <model>, fed in' with no
    op: the recorder was pushed on the main thread only."""
    got: dict[str, Any] = {}

    def train() -> None:
        torch.manual_seed(0)
        model = zoo.mlp(d_in=4, d_hidden=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
            for step in range(4):
                z = model(torch.randn(8, 4)) * (1e4 if step == 2 else 1.0)  # confident logits at step 2
                p, y = torch.sigmoid(z), torch.randint(0, 2, z.shape).float()
                # a binary cross-entropy written by hand: p rounds to 0 or 1, and log(0) = -inf
                loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        got["first"] = hunt.first
        got["stack"] = torch._C._len_torch_function_stack()

    t = threading.Thread(target=train)
    t.start()
    t.join()
    f = got["first"]
    assert f is not None and (f.module, f.op, f.phase, f.step) == ("<outside>", "aten.log.default", "forward", 2), f
    assert got["stack"] == 0 and torch._C._len_torch_function_stack() == 0
