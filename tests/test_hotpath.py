"""What the cheap hot path leaves out must still be found: passthrough modules, containers handing
on a child's output, backward without per-module hooks, and the opt-in per-module hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from tests import zoo


class LogThenReLU(nn.Module):
    """Its own code makes -inf (log of 0), then a ReLU (not probed on the hot path) hands it on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(torch.log(torch.relu(self.lin(x))) * -1.0)  # -log(0) = +inf


def test_value_born_before_a_passthrough_module_is_found_where_it_was_born():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogThenReLU(), nn.Linear(4, 1))
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(8, 4))
    f = hunt.first
    assert (f.phase, f.module, f.module_type, f.cause) == ("forward", "1", "LogThenReLU", "created")
    assert f.op == "aten.log.default" and f.value == float("inf")


class SqrtAtZero(nn.Module):
    def forward(self, x):
        return x + torch.sqrt(x * 0)  # finite forward; d sqrt at 0 = inf, times 0 = nan


@pytest.mark.parametrize("grad_hooks", [False, True])
def test_backward_creator_found_with_and_without_per_module_hooks(grad_hooks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, grad_hooks=grad_hooks):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.cause) == ("backward", "1", "grad_input[0]", "created")
    assert f.op == "SqrtBackward0"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    message = str(ei.value)  # the one-paragraph summary a person reads
    assert message == f.summary() and message.startswith("First NaN: backward of `1` (SqrtAtZero) at step 0")
    assert "SqrtBackward0" in message and "float32" in message


def test_per_module_hooks_locate_backward_even_without_a_replay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    with nanhunt.watch(model, on_find="record", grad_hooks=True, replay=False) as hunt:
        model(torch.randn(3, 4)).sum().backward()
    f = hunt.first
    assert (f.phase, f.module, f.tensor) == ("backward", "1", "grad_input[0]")
    assert f.index is None  # no replay: the module is known, the element is not


def test_container_handing_on_its_childs_output_is_not_a_second_finding():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), LogThenReLU())
    model = nn.Sequential(inner, nn.Identity())
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(8, 4))
    assert [f.module for f in hunt.findings if f.phase == "forward"] == ["0.1"]


# ---------------------------------------------------------------- small outputs probed at the root's return
def _positive_then(bad: torch.Tensor, steps: int = 3):
    """Batches a model with non-negative first-layer weights and bias 1 keeps positive, then ``bad``."""
    torch.manual_seed(1)
    return [torch.rand(8, 4) for _ in range(steps)] + [bad]


def _train(model: nn.Module, batches, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", **kw) as hunt:
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if hunt.first is not None:
                break
        deferred = set(getattr(hunt, "_defer", ()))
    return hunt.first, deferred


def _log_model() -> nn.Sequential:
    from tests.zoo import Log

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Log(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.fill_(1.0)
    return model


def test_a_value_born_in_a_deferred_probe_is_found_as_if_probed_at_once(monkeypatch):
    """After one step in which no output was written after its module returned, small outputs are
    probed together at the top-level call's return: the finding (log of a negative) is the same,
    element for element, as with every probe taken at once."""
    from nanhunt._record import hunt as hunt_mod

    batches = _positive_then(torch.full((8, 4), -100.0))
    first, deferred = _train(_log_model(), batches)
    model = _log_model()
    assert first is not None and (first.phase, first.module, first.cause, first.step) == ("forward", "1", "created", 3)
    assert first.op == "aten.log.default" and first.index == (0, 0) and first.value != first.value  # NaN
    assert len(deferred) == 3  # both Linears and the Log were probed at the return
    monkeypatch.setattr(hunt_mod, "_LAZY_NUMEL", 0)  # every probe at once
    eager, none = _train(model, batches)
    assert not none
    assert eager is not None and eager.to_dict() | {"hint": None} == first.to_dict() | {"hint": None}


class Healed(nn.Module):
    """log, then its output clamped in place in the parent's code: a -inf made finite again."""

    def __init__(self) -> None:
        super().__init__()
        from tests.zoo import Log

        self.log = Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.log(x)
        return y.clamp_(min=-10.0)


def test_an_output_written_after_its_module_returned_is_still_probed_at_once():
    """A module whose output the caller writes in place (a ReLU(inplace) after a BatchNorm; here a
    clamp_ that turns log(0)'s -inf into -10) keeps its probe at the moment it returns: deferred,
    the -inf would be read after the clamp and never seen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Healed(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.fill_(1.0)
    first, deferred = _train(model, _positive_then(torch.full((8, 4), -100.0)))
    assert id(model[2].log) not in deferred and id(model[0]) in deferred
    assert first is not None and (first.phase, first.module, first.cause, first.step) == ("forward", "2.log", "created", 3)
    assert first.value == float("-inf") and first.op == "aten.log.default"


class _ScaledInPlace(nn.Module):
    """The root's own code scales a child's output in place on a bad batch: an overflow born in the
    root (``mul_``), after the child returned a finite value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if bool(x.sum() < -1e3):
            y.mul_(1e39)  # @scaled-in-place
        return self.b(y)


def test_an_in_place_write_after_a_deferred_childs_return_is_the_writers_finding():
    # the child's output was deferred (clean steps), so its probe read the value after the root's
    # own mul_ overflowed it: the child was blamed, and its replay (finite at its return) made it a
    # "transient: suspect the device" finding. The root's own line made it.
    torch.manual_seed(0)
    first, deferred = _train(_ScaledInPlace(), _positive_then(torch.full((8, 4), -1e3)))
    assert deferred  # the child's outputs were probed at the return
    assert first is not None and (first.phase, first.module, first.cause, first.step) == ("forward", "", "created", 3)
    assert first.op == "aten.mul_.Tensor" and first.reproducible is True and first.verdict != "transient"


def test_more_small_outputs_than_are_held_at_once():
    """Past the cap of held outputs they are probed early, in the middle of the call; positions stay right."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)])
    batches = [torch.randn(2, 4) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for i, x in enumerate(batches):
            if i == 2:
                with torch.no_grad():
                    model[280].weight[1, 2] = float("nan")  # poisoned between steps
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert len(hunt._defer) == 300
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.cause, f.step) == ("forward", "280", "parameter", 2)


# ----------------------------------------------------------------- probes cut below ATen's grain
# With an intra-op thread pool the probes' copies and reductions are cut in pieces that run on the
# calling thread (`_tensors.grain`); with one thread they are not. Either way a value in any piece
# must be found at its own entry.


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


class PaddedSoftmax(nn.Module):
    """Softmax over features under a padding mask the loop sets each step (``module.pad = ...``):
    a sample whose positions are all padded is a row of -inf, which softmax makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.pad: torch.Tensor | None = None

    def forward(self, x):
        return x.masked_fill(self.pad, float("-inf")).softmax(-1)


def _deep(n: int = 40, at: int = 33) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64),
                            PaddedSoftmax() if i == at else nn.GELU()) for i in range(n)]
    return nn.Sequential(*blocks, nn.Linear(64, 64))


def test_a_late_block_of_a_deep_model_is_found_where_its_probe_is_cut(threads):
    """80 same-shape outputs (164k elements) are several pieces with a thread pool; the masked
    softmax of block 33, fed a fully padded sample at step 3 (its output deferred by then), is
    found at its own call and element."""
    model = _deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    soft = model[33][2]
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(5):
            pad = torch.zeros(32, 64, dtype=torch.bool)
            if step == 3:
                pad[5] = True
            soft.pad = pad
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if hunt.findings:
                break
    f = hunt.first
    assert f is not None, "a NaN from a fully padded row was missed"
    assert (f.phase, f.module, f.step, f.index, f.cause) == ("forward", "33.2", 3, (5, 0), "created"), f


def test_an_optimizer_update_in_a_late_piece_is_found_at_its_parameter(threads):
    """Adam with eps=0 on a deep model whose loss reads 7 of the head's 64 outputs: the head's
    other rows have 0 gradient, 0/0 at the first step. The head is the 81st of 82 parameters (its
    state in the last pieces of the probe)."""
    model = _deep(at=-1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    x, y = torch.randn(32, 64), torch.randn(32, 7)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        torch.nn.functional.mse_loss(model(x)[:, :7], y).backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.tensor, f.step, f.index) == ("optimizer", "40", "weight", 0, (7, 0)), f


def test_a_fused_probe_flags_each_tensor_in_whichever_piece_it_lies(threads):
    from nanhunt._record.probe import fused_probe
    from nanhunt._tensors import GRAIN

    torch.manual_seed(0)
    ts = [torch.randn(64, 64) for _ in range(40)] + [torch.randn(64) for _ in range(40)] + [torch.randn(300, 300)]
    clean = fused_probe(ts)
    assert bool(torch.isfinite(clean.summary).all()) and not any(clean.flags())
    ts[37][3, 5] = float("nan")
    ts[71][2] = float("inf")
    got = fused_probe(ts)
    assert not bool(torch.isfinite(got.summary).all())
    assert [i for i, b in enumerate(got.flags()) if b] == [37, 71]
    if threads > 1:  # each piece is below the grain: its copy and sum never wake the pool
        from nanhunt._record.probe import _plan
        plan = _plan(ts)
        assert plan.groups is not None and len(plan.groups) > 2
        assert all(sum(ts[i].numel() for i in g) < GRAIN for g in plan.groups)


def test_a_fused_probe_leaves_its_tensors_as_they_were():
    """The small tensors are checked by a kernel that writes each one back in place: the bits, the
    version counters (a tensor saved for a backward still to run stays valid) and a NaN's payload
    are as before, and a tensor that overlaps itself (an expanded gradient) is still judged."""
    from nanhunt._record.probe import fused_probe

    torch.manual_seed(0)
    w = torch.randn(8, requires_grad=True)
    ts = [torch.randn(16, 4) for _ in range(6)] + [torch.randn(5, requires_grad=True) * 2]
    ts[2].view(torch.int32)[1, 1] = 0x7FC0_1234  # a NaN with a payload
    ts[4] = ts[4].t()  # not contiguous
    pending = (w[:4] * ts[3][0]).sum()  # ts[3] is saved for this backward
    before = [(t.clone().view(torch.int32), t._version) for t in ts]
    got = fused_probe(ts)
    assert [i for i, b in enumerate(got.flags()) if b] == [2]
    for t, (bits, version) in zip(ts, before, strict=True):
        assert t._version == version and torch.equal(t.view(torch.int32), bits)
    pending.backward()  # (a moved version counter fails here)
    assert torch.equal(w.grad[:4], ts[3][0])
    ts[2][1, 1] = 0.0
    ts.append(torch.tensor([1.0, float("inf")]).expand(3, 2))  # (its elements overlap: summed instead)
    assert [i for i, b in enumerate(fused_probe(ts).flags()) if b] == [7]


# ------------------------------------ a NaN from a parent's own code, through a passthrough child


def _poisoned_at_step_2(model, opt, poisoned, loss, x, **watch):
    """Three training steps under a hunt, ``poisoned.poison`` set on the last: its first finding."""
    with nanhunt.watch(model, opt, on_find="record", **watch) as hunt:
        for step in range(3):
            poisoned.poison = step == 2
            loss(model(x)).backward()
            opt.step()
            opt.zero_grad()
    return hunt.first


class LogThroughPassthrough(nn.Module):
    """Its own code takes the log of a convolution (NaN where it is negative, from step 2 on),
    then a passthrough child (ReLU or MaxPool: not probed on the hot path) hands it to a probed
    sibling: the first probed output that is non-finite is the sibling's."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = act
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.poison = False

    def forward(self, x):
        y = self.conv0(x)
        if self.poison:
            y = torch.log(y)
        return self.conv(self.act(y))


@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6, lambda: nn.MaxPool2d(1)], ids=["relu", "relu6", "maxpool"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_from_a_parents_code_through_a_passthrough_child_is_the_parents(mode, act):
    """Full mode blamed the probed sibling ('0.conv', cause unknown, verdict 'nondeterministic':
    the analysis moved a finding only to a replayed call the log had not seen at all, and the
    passthrough call was in the log, unprobed)."""
    torch.manual_seed(0)
    block = LogThroughPassthrough(act())
    model = nn.Sequential(block, nn.Flatten(), nn.Linear(8 * 8 * 8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, 3, 8, 8)
    f = _poisoned_at_step_2(model, opt, block, lambda out: out.square().mean(), x=x, mode=mode)
    assert f is not None
    assert (f.phase, f.module, f.step, f.cause, f.reproducible) == ("forward", "0", 2, "created", True), f
    assert f.op is not None and "log" in f.op, f
    assert f.verdict != "nondeterministic", f


def test_a_passthrough_modules_forward_replaced_after_watch_is_blamed_for_what_it_writes():
    """A forward put on a ReLU after watch() (a patching library, a debugging plant) that writes a
    NaN into its output: the finding is the ReLU's, not the next probed module's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, 3, 8, 8)
    relu = model[2]
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(3):
            if step == 2:
                inner = relu.forward

                def planted(*args, _inner=inner):
                    out = _inner(*args).clone()
                    out.view(-1)[out.numel() // 2] = float("nan")
                    return out

                relu.forward = planted
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        del relu.forward
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "2", 2, "created"), f


class PooledMaskAttention(nn.Module):
    """An ignored causal -inf mask goes through a max-pool (a passthrough module: not probed), as a
    view, into attention; from step 2 the block's Log child takes the log of a negative value."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = zoo.CausalMask()
        self.pool = nn.MaxPool1d(1)
        self.lin = nn.Linear(8, 8)
        self.log = zoo.Log()
        self.poison = False

    def forward(self, x):
        m = self.pool(self.mask(x)[None])[0]
        s = (x @ x.transpose(-1, -2)) / 8 ** 0.5 + m
        return self.log(self.lin(s.softmax(-1) @ x) - (10.0 if self.poison else -100.0))


def test_an_ignored_mask_handed_on_by_a_passthrough_module_is_not_the_finding():
    """The replay's first non-finite output is the pool's (the ignored mask, pooled): it hands on
    what it was given, so the finding is the Log's own, not the pool's nor the root's."""
    torch.manual_seed(0)
    model = PooledMaskAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 5, 8)
    f = _poisoned_at_step_2(model, opt, model, lambda out: out.nan_to_num().sum(), x=x, ignore=["*mask"])
    assert f is not None and (f.phase, f.module, f.step, f.cause, f.reproducible) == ("forward", "log", 2, "created", True), f
    assert f.op is not None and "log" in f.op, f


# ------------------------------- an intended -inf mask through an unprobed call is not the NaN's start


class _Fc(nn.Linear):
    """A linear layer that can fail once (``flaky``: a racy kernel the replay does not repeat)."""

    flaky = False

    def forward(self, x):
        y = super().forward(x)
        if _Fc.flaky:
            _Fc.flaky = False
            y = y.clone()
            y.view(-1)[3] = float("nan")
        return y


class _MaskedBlock(nn.Module):
    written = False  # the block writes a NaN into its child's output after the child returned

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv, self.proj, self.fc = nn.Linear(d, 3 * d), nn.Linear(d, d), _Fc(d, d)

    def forward(self, x, m):
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + self.proj(((q @ k.transpose(-1, -2)) / 4 + m).softmax(-1) @ v)
        y = self.fc(x)
        if _MaskedBlock.written:
            y.view(-1)[3] = float("nan")
        return x + y


class _MaskHookGPT(nn.Module):
    """The root builds a causal -inf mask in its own code and hands it through ``mask_hook`` (an
    nn.Identity hook point, as GPT-style code has: a passthrough call, never probed) or a plain
    function; every row keeps a key, so attention is finite."""

    def __init__(self, identity: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mask_hook = nn.Identity() if identity else (lambda t: t)
        self.blocks = nn.ModuleList([_MaskedBlock(), _MaskedBlock()])
        self.head = nn.Linear(16, 50)

    def forward(self, idx):
        t = idx.shape[1]
        m = self.mask_hook(torch.full((t, t), float("-inf")).triu(1))
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, m)
        return self.head(x)


@pytest.mark.parametrize("fault, expected", [
    ("overflow", ("blocks.1.fc", "created", "aten.addmm.default", True)),   # weights 1e38: addmm overflows
    ("written", ("blocks.0", "created", "aten.copy_.default", True)),       # the caller's in-place write
    ("flaky", ("blocks.0.fc", "unknown", None, False)),                     # not repeated by the replay
])
@pytest.mark.parametrize("identity", [True, False], ids=["identity-hook", "function"])
def test_an_intended_mask_through_an_identity_hook_point_changes_no_finding(fault, expected, identity):
    """After the fix for a parent's log(y) through a ReLU, the mask's Identity call (the replay's
    first non-finite output, never probed) took every later forward finding: the root 'created'
    the overflow, the in-place write; the flaky NaN became the mask's '-inf, reproduced'."""
    torch.manual_seed(0)
    model = _MaskHookGPT(identity)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 50, (2, 6))
    try:
        with nanhunt.watch(model, opt, on_find="record") as hunt:
            for step in range(3):
                if step == 2:
                    if fault == "overflow":
                        with torch.no_grad():
                            model.blocks[1].fc.weight.fill_(1e38)
                    _MaskedBlock.written = fault == "written"
                    _Fc.flaky = fault == "flaky"
                torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
                opt.step()
                opt.zero_grad()
    finally:
        _MaskedBlock.written = _Fc.flaky = False
    f = hunt.first
    assert f is not None and (f.phase, f.step) == ("forward", 2), f
    assert (f.module, f.cause, f.op, f.reproducible) == expected, f


def test_poison_is_nan_exactly_when_a_value_is_non_finite():
    from nanhunt._tensors import any_bad, poison

    big = torch.full((4,), 3e38)  # finite, but their sum overflows float32
    assert poison(big).item() == 0 and not any_bad(big)
    assert not any_bad(torch.full((4,), 60000.0, dtype=torch.float16))
    assert not any_bad(torch.zeros(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        v = torch.tensor([1.0, bad, -2.0])
        assert torch.isnan(poison(v)) and any_bad(v)
        assert any_bad(v.half()) and any_bad(v.double())


def test_finite_probes_that_add_up_past_float32s_range_raise_no_alarm(monkeypatch):
    """The step's sync reads one value for all probes: finite probes whose total overflows
    (large activations checked in several places) must not start an analysis."""
    from nanhunt._record import hunt as hunt_mod

    ran: list[int] = []
    real = hunt_mod.locate
    monkeypatch.setattr(hunt_mod, "locate", lambda view: ran.append(1) or real(view))
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, model[0].in_features)
    with nanhunt.watch(model, optimizer=opt, on_find="raise") as h:
        for _ in range(3):
            loss = model(x).square().mean()
            for name in ("a", "b", "c"):
                h.check(torch.full((20000,), 1e34), name)  # each sums to 2e38: finite; together 6e38
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert not ran and h.first is None


def test_watching_leaves_the_users_backward_as_cheap_as_it_was():
    # torch._C._functorch.maybe_current_level() makes the thread's functorch state on its first
    # call; from then on the autograd engine copies it for every node of every backward (+2 % of
    # the benchmark MLP's backward, for the life of the thread, hunt closed or not). Whether a call
    # runs inside torch.func transforms is read from the dispatch keys instead: a fresh process,
    # the call counted, the hooks run in every mode and in an evaluation pass
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        calls = []
        real = torch._C._functorch.maybe_current_level
        torch._C._functorch.maybe_current_level = lambda: calls.append(1) or real()
        import nanhunt
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters())
        for mode in ("full", "sentinel"):
            with nanhunt.watch(model, optimizer=opt, mode=mode, on_find="record") as hunt:
                for _ in range(3):
                    model(torch.randn(5, 4)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                with torch.no_grad():
                    model(torch.randn(5, 4))
                assert hunt.first is None
        print(len(calls))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0"
