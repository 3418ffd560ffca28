"""The step log: what the hot path records during one step, as typed records, and the one
read-only view of it that the analysis after a hit is given.

``_record`` writes it; ``_locate`` reads it (through :class:`StepView`); nothing here reads a
value from the device except :meth:`StepLog.bad_flags`, which runs only after the step's single
sync (:meth:`StepLog.bad_flag`) said something was non-finite.

Entries, one per device-side probe in ``StepLog.sums`` (``StepLog.meta`` holds them in order):
:class:`Fwd` (a watched call's output), :class:`Chk` (``hunt.check``), :class:`Bwd` (a gradient
arriving at a hooked tensor), :class:`Op` (an aten op, ``mode="ops"``). Fused checks, one probe
vector each (``StepLog.vectors``): :class:`Grads` (accumulated ``.grad``), :class:`OptimState`
(parameters and optimizer state after a ``step()``), :class:`CompiledSlots` (outputs checked
inside compiled graphs), :class:`Buffers` (the root's buffers that became non-finite in the step).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch import nn

from ._tensors import Path, grain, poison, stack_probes, tensors

_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)
_SHAPE = attrgetter("shape")
_VERSION = attrgetter("_version")

__all__ = [
    "Call", "Top", "TensorInfo", "StepLog", "StepView", "Entry", "Vector",
    "Fwd", "Chk", "Bwd", "Op", "Out", "OutRec", "Grads", "OptimState", "CompiledSlots", "Buffers", "add_to_group",
    "PASSTHROUGH",
]


class Call:
    """One call of one watched module during the step."""

    __slots__ = (
        "module", "name", "call", "depth", "parent", "top", "ordinal", "index",
        "paths", "outs", "in_keys", "out_keys",
    )

    def __init__(self, module: nn.Module, name: str, call: int, depth: int, parent: int, top: int, ordinal: int,
                 index: int) -> None:
        self.module = module
        self.name = name
        self.call = call  # this module's calls before it in the step (-1 until `StepLog.number_calls`)
        self.depth = depth
        self.parent = parent  # index of the enclosing Call in StepLog.calls, -1 at top level
        self.top = top  # index into StepLog.tops
        self.ordinal = ordinal  # watched-module calls since its top-level call began
        self.index = index  # this call's index in StepLog.calls
        # filled when the call returns (empty tuples until then: one call is made per module call,
        # most never need a list)
        self.paths: Sequence[Path] = ()
        self.outs: Sequence[tuple[weakref.ref[torch.Tensor], int]] = ()
        self.in_keys: Sequence[tuple[int, Path]] = ()
        self.out_keys: Sequence[tuple[int, Path]] = ()


TIE_KEY = "\0tie_weights"  # in Top.reparam: functional_call's tie_weights (no tensor name holds a NUL)


def given(top: Top, prefix: str = "") -> tuple[dict[str, Any], bool]:
    """The tensors ``torch.func.functional_call`` gave ``top``'s call, keyed relative to its
    submodule ``prefix`` (``""``: the module itself), and whether tied weights follow them."""
    r = top.reparam or {}
    p = f"{prefix}." if prefix else ""
    return {k[len(p):]: v for k, v in r.items() if k != TIE_KEY and k.startswith(p)}, bool(r.get(TIE_KEY, True))


class Top:
    """A top-level call of a watched module: enough to replay it faithfully."""

    __slots__ = (
        "module", "args", "kwargs", "versions", "rng", "cuda_rng", "autocast", "grad_enabled",
        "out_keys", "compiled", "saved", "training", "reparam", "odd_modes", "outside_at", "src", "clock",
    )

    def __init__(self, module: nn.Module, args: tuple[Any, ...], rng: torch.Tensor,
                 cuda_rng: list[torch.Tensor] | None, autocast: tuple[Any, ...], grad_enabled: bool):
        self.module = module
        self.args = args
        self.kwargs: dict[str, Any] | None = None
        self.versions: list[int] = []
        self.rng = rng
        self.cuda_rng = cuda_rng
        self.autocast = autocast
        self.grad_enabled = grad_enabled
        self.out_keys: list[int] = []
        self.compiled: Any = None  # the torch.compile wrapper that ran it (what failed), else None
        self.saved: dict[int, torch.Tensor] = {}  # id -> value before the call, of the root's floating buffers
        self.training = module.training  # its mode when called (an evaluation call: see Hunt._iteration_over)
        self.reparam: dict[str, Any] | None = None  # torch.func.functional_call's tensors for this call
        self.odd_modes: tuple[nn.Module, ...] = ()  # submodules whose train/eval mode was not the module's (a frozen BatchNorm)
        self.outside_at = 0  # torch calls outside watched calls recorded before it in the step (StepLog.outside)
        self.src: str | None = None  # the user's line that made the call (an op in torch's own layers has no other)
        self.clock = 0  # when it began (`_hooks.tick`: the order of events across hunts)

    def batch(self) -> int | None:
        """The length of the first dimension of its first tensor input with one (the batch size,
        for a hint that names rows of a reduction as samples); None when it has none."""
        for _, t in tensors((self.args, self.kwargs or {})):
            if t.dim():
                return int(t.shape[0])
        return None


@dataclass
class TensorInfo:
    """A tensor that got a gradient hook: who made it and who used it."""

    producers: list[tuple[int, Path]] = field(default_factory=list)  # (call index, output path)
    consumers: list[tuple[int, Path]] = field(default_factory=list)  # (call index, input path)
    grad: torch.Tensor | None = None  # kept only for gradients arriving at a top-level output
    keep_grad: bool = False
    ref: Any = None
    # (a top-level output's) top-level calls begun and outside calls recorded when its gradient
    # arrived: what of the step came before that backward (see analyze's `_earlier_backward`)
    arrived: tuple[int, int] | None = None
    last: tuple[int, int] | None = None  # ... the same when ``grad`` (the latest to arrive) arrived


# ------------------------------------------------------------------ entries (one probe each)
class Fwd:
    """Output number ``out`` of the watched call ``StepLog.calls[call]``."""

    kind = "fwd"
    __slots__ = ("call", "out")

    def __init__(self, call: int, out: int) -> None:
        self.call = call  # this module's calls before it in the step (-1 until `StepLog.number_calls`)
        self.out = out


class Chk:
    """A tensor given to ``hunt.check(tensor, name)``."""

    kind = "chk"
    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self.tensor = tensor


class Bwd:
    """A gradient arriving at the hooked tensor ``StepLog.tensors[tensor]``."""

    kind = "bwd"
    __slots__ = ("tensor",)

    def __init__(self, tensor: int) -> None:
        self.tensor = tensor


class Op:
    """Output ``out`` of one aten op (``mode="ops"``): in backward, ``node`` is the autograd node."""

    kind = "op"
    __slots__ = ("op", "node", "call", "out")

    def __init__(self, op: str, node: str | None, call: int, out: int) -> None:
        self.op = op
        self.node = node
        self.call = call  # the innermost watched call in forward, else -1
        self.out = out


class Out:
    """Output ``out`` of the torch call ``StepLog.outside[rec]``, made outside every watched call."""

    kind = "out"
    __slots__ = ("rec", "out")

    def __init__(self, rec: int, out: int) -> None:
        self.rec = rec
        self.out = out


class OutRec:
    """A torch call made outside every watched module call: enough to replay it after a hit.

    ``args``/``kwargs``/``out`` are the call's own objects, by reference; ``src`` the user's
    ``file:line``, ``fn`` the name of the user's function that made the call.
    """

    __slots__ = ("func", "args", "kwargs", "out", "src", "fn", "rng", "autocast", "clock")

    def __init__(self, func: Any, args: Any, kwargs: Any, out: Any, src: str | None, fn: str,
                 rng: torch.Tensor | None, autocast: tuple[tuple[str, torch.dtype], ...] = (), clock: int = 0) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.out = out
        self.src = src
        self.fn = fn
        self.rng = rng  # the CPU RNG state before the call, for the first call after a root call
        self.autocast = autocast  # (device type, dtype) of each autocast on at the call: a replay runs under it
        self.clock = clock  # when it was made (`_hooks.tick`)


Entry = Fwd | Chk | Bwd | Op | Out


# ------------------------------------------------------------------ fused checks (a vector each)
class Grads:
    """The accumulated ``.grad`` of ``params`` (optimizer ``opt``'s, or the model's when -1)."""

    kind = "grad"
    __slots__ = ("opt", "params")

    def __init__(self, opt: int, params: Sequence[torch.Tensor]) -> None:
        self.opt = opt
        self.params = params


class OptimState:
    """Parameters and state of optimizer ``opt`` after its ``step()`` number ``step``."""

    kind = "optim"
    __slots__ = ("opt", "step", "items", "tensors", "fed", "before", "clock", "since")

    def __init__(self, opt: int, step: int, items: list[tuple[torch.Tensor, str]],
                 tensors: list[torch.Tensor], fed: bool, clock: int = 0) -> None:
        self.opt = opt
        self.step = step
        self.clock = clock  # when that step() ended (`_hooks.tick`)
        self.items = items  # (parameter, state key or "") per tensor
        self.tensors = tensors
        self.fed = fed  # the step was given non-finite gradients (not raise mode)
        # the parameters as that step() began, and their probe (one element each, non-finite where
        # the parameter was; None: all finite), to tell a parameter the user's code wrote before the
        # update from one the update made (`before_bad`); None: not probed
        self.before: tuple[list[torch.Tensor], torch.Tensor | None] | None = None
        # the step whose update was probed before this one (-1: none since the watch began), when
        # not the step before (`optimizer_every` > 1): the state may have gone non-finite at any
        # step after it. None: not known (the analysis's reading at a hit; see StepView.probed_at)
        self.since: int | None = None

    def before_bad(self, p: torch.Tensor) -> bool:
        """Was ``p`` non-finite already when this step() began (after a hit: reads back)?"""
        if self.before is None:
            return False
        params, vec = self.before
        if vec is None:
            return False
        j = next((j for j, q in enumerate(params) if q is p), None)
        return j is not None and not bool(torch.isfinite(vec[j]))


class CompiledSlots:
    """Slots of the compiled-graph buffer: (module name, class name, output path) each."""

    kind = "compiled"
    __slots__ = ("slots",)

    def __init__(self, slots: list[tuple[str, str, Path]]) -> None:
        self.slots = slots

    def first(self, flags: list[bool]) -> tuple[str, str, Path] | None:
        """The module where the non-finite values began, from the slots' flags: the first flagged
        module (``named_modules`` order) none of whose submodules is flagged (its parents only
        handed the values on)."""
        bad = [s for s, b in zip(self.slots, flags) if b]
        for s in bad:
            prefix = s[0] + "." if s[0] else ""
            if not any(o[0] != s[0] and o[0].startswith(prefix) for o in bad):
                return s
        return bad[0] if bad else None


class Buffers:
    """The root's floating buffers that became non-finite during the step (finite when it began):
    ``names`` (qualified) and the buffers, one flag each."""

    kind = "buffers"
    __slots__ = ("names", "tensors")

    def __init__(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.names = names
        self.tensors = tensors


Vector = Grads | OptimState | CompiledSlots | Buffers


# Modules whose output can be non-finite only if their input is: their outputs are not probed
# (a memory pass each) when they run inside a watched module. A non-finite input was either
# probed as the output of the module that made it, or is caught further on (the next module, the
# enclosing one, the gradients) and localised by the replay, which checks every call (the analysis
# reads it too: a passthrough call hands on what it was given, an ignored module's mask included).
# (Not here: anything that scales (SELU, LeakyReLU/PReLU with a slope that may exceed 1) or writes a
# user constant (Threshold), which can overflow or write an infinity from finite inputs.)
PASSTHROUGH: frozenset[type[nn.Module]] = frozenset({
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Tanh, nn.Sigmoid, nn.Hardsigmoid, nn.Softsign, nn.GELU,
    nn.SiLU, nn.Mish, nn.ELU, nn.CELU, nn.Hardswish,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.Flatten, nn.Unflatten, nn.Identity,
})


def add_to_group(groups: dict[Any, tuple[list[int], list[torch.Tensor]]], t: torch.Tensor, at: int,
                 cut: int = 0) -> None:
    """Group ``t`` (with its position ``at``) by shape: one stacked reduction per shape.

    On the CPU a group is cut before its stack reaches ``cut`` elements (`_tensors.grain`), so the
    stack and its reduction run on the calling thread: waking the intra-op pool for the benchmark
    MLP's 73 same-shape outputs (150k elements) cost ~280 us a step, more than the work."""
    shape = t.shape
    g = groups.get(shape)
    if g is None:
        groups[shape] = g = ([], [])
    elif cut and (len(g[1]) + 1) * t.numel() >= cut and t.is_cpu:
        groups[(shape, len(groups))] = g  # full: kept under a key of its own
        groups[shape] = g = ([], [])
    g[0].append(at)
    g[1].append(t)


class StepLog:
    """Everything recorded since the last sync.

    ``sums[i]`` is the probe of entry ``meta[i]``, or ``None`` for a deferred probe: a small output
    kept in ``lazy`` until `resolve` reduces all of them at once (one stack per shape, at the
    top-level call's return), whose values then sit in ``chunks``."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor | None] = []
        self.meta: list[Entry] = []
        self.lazy: list[tuple[torch.Tensor, int, int, int]] = []  # (output, its version, position in sums, module id)
        self.trial: list[tuple[torch.Tensor, int, int]] = []  # probed now, kept to learn: (output, version, module id)
        self.late: set[int] = set()  # positions in sums of deferred outputs probed after an in-place write
        self.chunks: list[tuple[list[int], torch.Tensor]] = []  # (positions in sums, one value each)
        # fused checks (grads, params, state): a vector, one value per tensor, or a `_record.probe.Fused`
        self.vectors: list[tuple[Any, Vector]] = []
        self.calls: list[Call] = []
        self.tops: list[Top] = []
        self.tensors: list[TensorInfo] = []
        self.keys: dict[tuple[int, int], int] = {}
        self.handles: list[Any] = []
        self.ignored: dict[tuple[int, int], Any] = {}  # (id, version) -> weakref: an ignored module's outputs
        self.probed: dict[tuple[int, int], Any] = {}  # (id, version) -> weakref: probed this step
        self.stats: list[torch.Tensor | int | None] = []  # sampled steps only: see _history
        self.stats_rows: list[tuple[str, str, int]] = []
        # sampled steps: a probed output's statistics, or the row that will hold them (`stats_lazy`)
        self.stats_of: dict[tuple[int, int], torch.Tensor | int] = {}
        # sampled steps: (output, its version, its row in `stats`) computed together at the
        # top-level call's return, one reduction per shape (`Hunt._resolve`); a row handed on from
        # another (a container returning its child's output) is that row's index until then
        self.stats_lazy: list[tuple[torch.Tensor, int, int]] = []
        self.root_calls = 0
        self.backward = False  # a gradient arrived at a top-level output (a backward ran)
        self.bwd_clock = 0  # when the latest one arrived (`_hooks.tick`), else 0
        self.found_in_evaluation = False  # (set by the analysis: its findings are all in evaluation passes)
        # the model ran as a compiled graph whose hooks the hunt had not prepared (compiled after watch(),
        # sentinel under torch.compile(model)): its calls in this step were not recorded (see Hunt._after_trace)
        self.traced = False
        self.transformed = False  # the model was called inside torch.func transforms (vmap/grad): not recorded
        self.foreign = False  # the model was called with grad on another thread than the step's: not recorded
        self.span = 0  # where the probes of the latest top-level call begin (see _record.retain)
        self.out_span = 0  # where the outside calls recorded since the latest top-level call begin
        self.pending: list[Any] = []  # no_grad top-level calls whose finiteness is not on the host yet
        self.outside: list[OutRec] = []  # torch calls outside every watched call (see _record.outside)
        self.seeds: list[tuple[Any, Any, str | None]] = []  # (args, kwargs, line) of each backward() there
        self.grads_out: list[Any] = []  # weakrefs to what torch.autograd.grad returned there (gradients)
        self.second_order = False  # one of them with create_graph=True: a backward() through it takes second derivatives
        self.cut = False  # judged as the root's next call begins (no step()): that call runs on the weights as they are now

    def __len__(self) -> int:
        return len(self.sums) + len(self.vectors)

    def number_calls(self, before: dict[tuple[bool, int], int] | None = None) -> None:
        """Each call's number among its module's calls this step (`Call.call`; after a hit only).
        ``before``: calls per (evaluation pass?, module id) in the step's earlier logs (a step
        checked in parts). An evaluation pass's calls (no_grad, eval mode) are counted apart: a
        validation loop inside the step's window does not shift the micro-batches' numbers."""
        counts: dict[tuple[bool, int], int] = dict(before) if before else {}
        for c in self.calls:
            k = (self.evaluation(c), id(c.module))
            n = counts.get(k, 0)
            c.call = n
            counts[k] = n + 1

    def is_ignored(self, t: torch.Tensor) -> bool:
        """``t`` (this very tensor, at this version) is an ignored module's output of this step.
        (By identity: a key alone, ids being reused once a tensor is freed, made a later module's
        output look ignored, and its NaN was never probed.)"""
        ref = self.ignored.get((id(t), -1 if t.is_inference() else t._version))
        return ref is not None and ref() is t

    def evaluation(self, c: Call) -> bool:
        """``c`` is part of an evaluation pass: its top-level call ran without gradients in eval mode."""
        top = self.tops[c.top] if 0 <= c.top < len(self.tops) else None
        return top is not None and not top.grad_enabled and not top.training

    def resolve(self) -> tuple[list[int], list[int]]:
        """Probe the deferred outputs (device-side, no host read): one reduction per shape.

        Returns the ids of the modules whose outputs were (``changed``) or were not (``kept``)
        written in place after their call returned: ``kept`` from the trial outputs, whose
        probes were taken at once. A deferred output written since is probed as it is now (the
        module is then probed at once from the next call on)."""
        lazy, trial = self.lazy, self.trial
        if not lazy and not trial:
            return [], []
        changed: list[int] = []
        kept: list[int] = []
        for t, ver, mid in trial:  # (a sparse or nested output is never deferred: no plain stack and sum)
            plain = t._version == ver and not t.is_nested and t.layout is torch.strided
            (kept if plain else changed).append(mid)
        self.trial = []
        if not lazy:
            return changed, kept
        self.lazy = []
        sums = self.sums
        groups: dict[Any, tuple[list[int], list[torch.Tensor]]] = {}
        cut = grain()
        with torch.no_grad():
            outs = list(map(_FIRST, lazy))
            shapes = list(map(_SHAPE, outs))
            if (list(map(_VERSION, outs)) == list(map(_SECOND, lazy)) and shapes.count(shapes[0]) == len(shapes)
                    and outs[0].is_cpu):
                # the common case, in C-level passes: none written since, all of one shape (the
                # benchmark MLP's 82 outputs: 16 us where grouping them one by one took 30 us)
                n = outs[0].numel()
                per = max(1, (cut - 1) // n) if cut and n else len(outs)  # (as `add_to_group` cuts)
                where = list(map(_THIRD, lazy))
                for j in range(0, len(outs), per):
                    groups[j] = (where[j:j + per], outs[j:j + per])
            else:
                for t, ver, at, mid in lazy:
                    if t._version != ver:
                        changed.append(mid)
                        sums[at] = t.sum()
                        self.late.add(at)  # (what it was at its call's return: a replay tells)
                        continue
                    add_to_group(groups, t, at, cut)
            for pos, ts in groups.values():
                try:
                    v = torch.stack(ts).view(len(ts), -1).sum(1) if len(ts) > 1 else ts[0].sum().view(1)
                except RuntimeError:  # on several devices
                    for at, t in zip(pos, ts):
                        sums[at] = t.sum()
                    continue
                self.chunks.append((pos, v))
        return changed, kept

    def probes(self, start: int = 0, end: int | None = None) -> torch.Tensor | None:
        """Every probe of entries ``start:end`` in one float vector (order not kept), else None."""
        end = len(self.sums) if end is None else end
        part = [x for x in self.sums[start:end] if x is not None]
        vecs = [stack_probes(part)] if part else []
        for pos, v in self.chunks:
            if start <= pos[0] and pos[-1] < end:
                vecs.append(v)
            elif pos[-1] >= start and pos[0] < end:
                vecs.append(v[torch.tensor([start <= p < end for p in pos], device=v.device)])
        if not vecs:
            return None
        if len(vecs) == 1:
            return vecs[0]
        try:
            return torch.cat(vecs)
        except RuntimeError:  # probes on several devices (model parallel) meet on the first one
            return torch.cat([v.to(vecs[0].device) for v in vecs])

    def keep(self, keep: list[int]) -> None:
        """Keep only entries ``keep`` (ascending) of ``sums``/``meta``; deferred probes stay."""
        new = {old: i for i, old in enumerate(keep)}
        self.sums = [self.sums[i] for i in keep]
        self.meta = [self.meta[i] for i in keep]
        self.chunks = [([new[p] for p in pos], v) for pos, v in self.chunks]
        self.lazy = [(t, ver, new[p], mid) for t, ver, p, mid in self.lazy]

    def poison(self) -> torch.Tensor | None:
        """A device-side 0-dim float, NaN iff some recorded value is non-finite (else 0; see
        `_tensors.poison`), or None when nothing was recorded. No host read here."""
        self.resolve()
        sums = self.probes()
        vecs = [sums] if sums is not None else []
        # a fused probe (`_record.probe.Fused`) is read by its summary
        vecs += [v if isinstance(v, torch.Tensor) else v.summary for v, _ in self.vectors]
        if not vecs:
            return None
        try:
            return poison(torch.cat(vecs) if len(vecs) > 1 else vecs[0])  # one device: 3 dispatches
        except RuntimeError:  # probes on several devices (model parallel)
            pass
        dev = vecs[0].device
        return torch.stack([poison(v).to(dev, non_blocking=True) for v in vecs]).sum()

    def bad_flag(self) -> torch.Tensor | None:
        """A device-side 0-dim bool: is any recorded value non-finite? No host read here."""
        p = self.poison()
        return None if p is None else torch.isnan(p)

    def bad_flags(self) -> tuple[list[bool], list[list[bool]]]:
        """After a hit: which entries are non-finite (more syncs, allowed now)."""
        self.resolve()
        s = [False] * len(self.sums)
        at = [i for i, x in enumerate(self.sums) if x is not None]
        if at:
            now = [x for x in self.sums if x is not None]
            for i, b in zip(at, (~torch.isfinite(stack_probes(now))).tolist()):
                s[i] = b
        for pos, vec in self.chunks:
            for i, b in zip(pos, (~torch.isfinite(vec)).tolist()):
                s[i] = b
        v = [(~torch.isfinite(t)).tolist() if isinstance(t, torch.Tensor) else t.flags() for t, _ in self.vectors]
        return s, v

    def release(self) -> None:
        """Drop every reference and remove every tensor hook of the step."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.sums.clear()
        self.meta.clear()
        self.lazy.clear()
        self.trial.clear()
        self.chunks.clear()
        self.vectors.clear()
        self.calls.clear()
        self.tops.clear()
        self.tensors.clear()
        self.keys.clear()
        self.ignored.clear()
        self.probed.clear()
        self.stats.clear()
        self.stats_rows.clear()
        self.stats_of.clear()
        self.stats_lazy.clear()
        self.pending.clear()
        self.outside.clear()
        self.seeds.clear()
        self.grads_out.clear()
        self.second_order = False
        self.cut = False



@dataclass(frozen=True)
class StepView:
    """What the analysis after a hit may see of the hunt: one step's log and the watch's settings.

    Built by the hunt only on a hit; ``_locate`` reads it and nothing else (never the ``Hunt``).
    """

    log: StepLog
    step: int  # the training step the log belongs to
    root: nn.Module | None
    names: dict[nn.Module, str]  # qualified name of every watched module
    ignored: frozenset[nn.Module]  # modules matching `ignore` globs
    mode: str
    replay: bool  # re-run the failing call to localise (element, cause, op)
    rank: int | None
    optimizers: tuple[torch.optim.Optimizer, ...]
    after_step: dict[int, dict[int, int]]  # per optimizer: parameter id -> version after its last step()
    steps_applied: int  # step() calls that ran (all optimizers)
    bad_grads_step: int  # the last step that was given non-finite gradients, else -1
    bundle: str | None  # where to save the failing call (only for the hunt's first finding)
    breakpoint: bool = False  # on_find="breakpoint": stop in a replay of the first finding's op
    grad_hooks: bool = False  # every module's gradients judged as backward made them (no backward replay needed)
    sharded: bool = False  # FSDP2 shards the model: nothing is replayed (`replay` is False)
    scratch: tuple[torch.Tensor, ...] = ()  # nanhunt's own buffers a compiled graph writes into
    step_lines: dict[int, str | None] = field(default_factory=dict)  # per optimizer: the user's line of its last step()
    bad_at_start: tuple[torch.Tensor, ...] = ()  # parameters, buffers, optimizer state non-finite when the watch began
    start_versions: dict[int, int] = field(default_factory=dict)  # parameter id -> its version when the first step began
    known_bad: tuple[torch.Tensor, ...] = ()  # state an earlier finding already showed non-finite (carried since)
    stale_grads: tuple[torch.Tensor, ...] = ()  # parameters' .grad an earlier finding left non-finite
    judged: frozenset[int] = frozenset()  # optimizers whose last step()'s update was already judged (CPU: at once)
    mid_step: frozenset[int] = frozenset()  # optimizers inside a step() that called its closure again: state mid-update
    # under torch.distributed: another rank's gradients were non-finite before the reduction, this rank's
    # finite: its own "grad" findings were received through the reduction (`dist.judge` drops them)
    received: bool = False
    # the analysis's one output besides its findings: per finding returned, when its value was made
    # (`_hooks.tick`; 0: not known from the log), for ordering the findings of several hunts
    occurred: list[int] = field(default_factory=list)
    # and per finding returned, (leading size, rows) of the non-finite values of the op that created it,
    # or of the gradient a replay made for it (or None)
    born_rows: list[tuple[int, list[int]] | None] = field(default_factory=list)
    # and per finding returned, the index in `StepLog.tops` of the top-level call (micro-batch) whose
    # forward or backward made it, where the analysis placed it there (or None)
    born_tops: list[int | None] = field(default_factory=list)
    step_clocks: dict[int, int] = field(default_factory=dict)  # per optimizer: when its last step() ended (`_hooks.tick`)
    step_of: dict[int, int] = field(default_factory=dict)  # per optimizer: the training step of its last step()
    # per (optimizer, group index): the last step() that ran with a non-finite float lr, and that lr
    bad_lrs: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    # per (optimizer, group index): the step of its last step() and the float lr it ran with
    last_lrs: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    # per (optimizer, group index): the step() that ran with the largest finite float lr, and that lr
    peak_lrs: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    probed_at: dict[int, int] = field(default_factory=dict)  # per optimizer: the step of its last probed update
    optimizer_every: int = 1
