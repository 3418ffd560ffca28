"""After a hit: turn a step's log into findings (module, tensor, element, cause, hint).

Runs only when the step's sync said something was non-finite, so host reads are allowed here.
The log says *which* call and tensor went bad first; the replay (`_replay`) recovers the tensors
themselves, the inputs and parameters, and whether the value is reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._files import warn_unwritten
from .._finding import Finding
from .._steplog import (
    PASSTHROUGH,
    Buffers,
    Bwd,
    Chk,
    CompiledSlots,
    Fwd,
    Grads,
    Op,
    OptimState,
    Out,
    StepLog,
    StepView,
    TensorInfo,
    Top,
    given,
)
from .._tensors import (
    Path,
    dtype_name,
    element,
    format_path,
    is_bad,
    joined,
    optimizer_tensors,
    own_tensors,
    shape_of,
    sum_may_overflow,
    tensors,
    values,
    version,
)
from .._words import fmt
from . import bundle as _bundle
from . import debug as _debug
from . import differential as _differential
from . import graph as _graph
from . import hints as _hints
from . import inductor as _inductor
from . import nodes as _nodes
from . import oplevel as _oplevel
from . import optim as _optim
from . import outside as _outside
from .checkpoint import all_bad
from .replay import Replay, ReplayCall, replay_top

__all__ = ["analyze"]


class _Ctx:
    """What the analysis of one step needs from the hunt."""

    def __init__(self, view: StepView):
        self.view = view
        self.log = view.log
        self.step = view.step
        self.names = view.names
        self._params: dict[int, tuple[str, str, nn.Module]] | None = None
        self._replays: dict[tuple[int, bool], Replay | None] = {}
        self._fresh: dict[int, None] | None = None
        self._written: int | None = -1  # the loop's first non-finite in-place write into the root's state (-1: not looked up yet)
        # what op-level localisation needs, per finding: (phase, top index, call ordinal, path)
        self.where: dict[int, tuple[str, int, int, Path]] = {}
        self.stopped = False  # on_find="breakpoint" stopped already
        self.facts: dict[int, dict[str, Any]] = {}  # per finding: the numbers its hint is chosen from
        self.bundled = False  # the repro bundle was written (or its writing failed, with a warning)
        self._sentinel: list[Finding] | None = None  # `sentinel_findings`, once
        self.out_recs: dict[int, int] = {}  # per outside finding: its torch call (StepLog.outside)
        self.clocks: dict[int, int] = {}  # per finding, when its value was made where no entry says (`_occurred`)
        self.born_rows: dict[int, tuple[int, list[int]]] = {}  # per finding: its creator op's (or its replayed gradient's) non-finite rows
        self.born_tops: dict[int, int] = {}  # per backward finding a replay made: its top-level call's index

    def sentinel_findings(self) -> list[Finding]:
        """`_sentinel_findings`, made once (asked first by a gradient at a root output, then to
        place the forward's finding)."""
        if self._sentinel is None:
            self._sentinel = _sentinel_findings(self)
        return self._sentinel

    def param_owner(self, p: torch.Tensor) -> tuple[str, str, nn.Module | None]:
        if self._params is None:
            self._params = {}
            root = self.view.root
            if root is not None:
                for mname, m in root.named_modules():
                    for pname, q in m.named_parameters(recurse=False):
                        self._params.setdefault(id(q), (mname, pname, m))
        got = self._params.get(id(p))
        if got is not None:
            return got
        # not the watched model's (a loss's learnable temperature, an optimizer of another model):
        # it lives outside the model; named by its place in the optimizer that holds it
        for oi, opt in enumerate(self.view.optimizers):
            for gi, g in enumerate(opt.param_groups):
                for pi, q in enumerate(g["params"]):
                    if q is p:
                        where = f"optimizer[{oi}]." if len(self.view.optimizers) > 1 else ""
                        return _outside.OUTSIDE, f"{where}param_groups[{gi}][{pi}]", None
        return _outside.OUTSIDE, "parameter", None

    def replay(self, top_i: int, backward: bool,
               focus: Callable[[Replay], list[ReplayCall | None]] | None = None) -> Replay | None:
        """The replay of top-level call ``top_i`` (made once; again, keeping every copy, when a
        reader needs values the first did not keep: `replay_top`'s ``focus``)."""
        key = (top_i, backward)
        if key in self._replays:
            r = self._replays[key]
            if r is None or not r.needs_exact(focus):
                return r
        r = None
        top = self.log.tops[top_i]
        if self.view.replay and _replayable(top) and not self.written_after(top):
            grads = None
            params = None
            if backward:
                grads = [self.log.tensors[k].grad for k in top.out_keys]
                params = list(top.module.parameters())
            r = replay_top(top, self.names, backward=grads, params=params, before={**top.saved, **self.fresh()},
                           focus=focus)
        self._replays[key] = r
        return r

    def written_after(self, top: Top) -> bool:
        """The loop's own code wrote a non-finite value into the root's weights or buffers in place
        after ``top`` began and before a later call of the step (a load_state_dict between two
        calls of one step: the GAN's discriminator called for the generator's loss first): a
        replay would run it on them, not on what it ran with, and blame it for the later call's
        NaN. (Written after the step's last call, before step(): the replay on them is what
        names the weight. Judged as the root's next call begins, `StepLog.cut`: that call is the
        later one, SAM's second pass after its perturbation p += rho * g / ||g|| wrote NaN.)"""
        if self._written == -1:
            root = self.view.root
            self._written = _outside.written_at(self.log, [*root.parameters(), *root.buffers()]) if root is not None else None
        w = self._written
        return w is not None and top.outside_at <= w and (self.log.cut or any(t.outside_at > w for t in self.log.tops))

    def fresh(self) -> dict[int, None]:
        """At the first step, before any update: the parameters that were finite when it began.
        Non-finite now, the step's own code wrote them (a data-dependent init, Glow's ActNorm:
        loc/scale from the first batch), so they are judged by their finite value before the call,
        never "parameter" (a weight poisoned before the step: loaded, or set before the watch)."""
        if self._fresh is None:
            view, root = self.view, self.view.root
            self._fresh = {}
            if view.step == 0 and view.steps_applied == 0 and root is not None:
                # (and not written in place since, by a write torch counts: p[3] = nan under no_grad
                # between two calls; a data-dependent init writes through .data, which moves no counter)
                known = {id(t) for t in (*view.bad_at_start, *view.known_bad)}
                self._fresh = {id(p): None for p in root.parameters()
                               if id(p) not in known and (v := view.start_versions.get(id(p))) is not None
                               and v == version(p)}  # (a lazy module's parameter had no counter then: not in it)
        return self._fresh


def _replayable(top: Top) -> bool:
    return top.kwargs is not None and [version(t) for _, t in tensors(top.args)] == top.versions


def analyze(view: StepView) -> list[Finding]:
    """Findings of one step, in order of occurrence: at most one per phase."""
    ctx = _Ctx(view)
    log = view.log
    sbad, vbad = log.bad_flags()
    out: list[Finding] = []
    # post-step checks of the previous step happened before anything else in this log
    for (_vec, entry), flags in zip(log.vectors, vbad):
        if isinstance(entry, OptimState) and any(flags):
            f = _optimizer_finding(ctx, entry, flags)
            if f is not None:
                ctx.clocks[id(f)] = entry.clock
                out.append(f)
                break
    else:  # not read at the last step (optimizer_every): read now, exactly
        f = _optimizer_now(ctx)
        if f is not None:
            out.append(f)
    earlier = len(out)  # the previous step's optimizer finding stays first: findings go in order of occurrence
    firsts: dict[str, int] = {}
    checked = _checked(log, sbad)
    for i, bad in enumerate(sbad):
        if bad and log.meta[i].kind not in firsts and i not in checked:
            firsts[log.meta[i].kind] = i
    op_call = None
    out_rec = -1  # the outside finding's torch call (StepLog.outside), if one was made
    if "op" in firsts and "fwd" in firsts:  # mode="ops": the first bad op says which call made it
        op_entry = log.meta[firsts.pop("op")]
        assert isinstance(op_entry, Op)
        ci = op_entry.call
        op_call = log.calls[ci] if ci >= 0 else None
        own = next((i for i, m in enumerate(log.meta) if isinstance(m, Fwd) and m.call == ci and sbad[i]), None)
        if own is not None and own > firsts["fwd"]:
            firsts["fwd"] = own
    firsts.pop("op", None)
    for kind in sorted(firsts, key=firsts.__getitem__):
        i = firsts[kind]
        f = None
        if kind in ("bwd", "fwd", "out") and any(g.phase == "forward" for g in out):
            continue  # after a non-finite forward, later values only carry it on: no second replay
        if kind == "fwd":
            # a probe is a sum: finite values whose sum overflowed are no finding, and a NaN after
            # them is still to be found (a 3e38 activation before a LayerNorm that makes nan of it)
            for j in range(i, len(sbad)):
                if sbad[j] and isinstance(log.meta[j], Fwd) and j not in checked:
                    f = _forward_finding(ctx, j)
                    if f is not None:
                        break
            if f is not None and op_call is not None and not f.reproducible and f.module != op_call.name:
                # no replay to tell: the op ran in this call's own code (its output was handed on)
                f = dataclasses.replace(f, module=op_call.name, module_type=type(op_call.module).__name__)
        elif kind == "out":  # the first outside value born there (not fed a non-finite input)
            grads = _grad_ids(view)
            returned = _returned(ctx)
            for j in range(i, len(sbad)):
                e = log.meta[j]
                if sbad[j] and isinstance(e, Out) and j not in checked:
                    f = _outside.forward_finding(log, ctx.step, e.rec, e.out, grads, returned)
                    if f is not None:
                        out_rec = ctx.out_recs[id(f)] = e.rec
                        break
        elif kind == "chk":
            f = _check_finding(ctx, i)
        elif kind == "bwd":
            if view.mode == "sentinel" and any(g.phase == "forward" for g in ctx.sentinel_findings()):
                # the replayed forward went non-finite first (its finding goes first, below): the
                # backward only carries it on, as in full mode. (Replaying the backward as well
                # made a sentinel hit cost two more forwards and a backward.)
                continue
            f = _backward_finding(ctx, i, sbad)
        if f is not None:
            out.append(f)
    compiled = [(e, flags) for (_v, e), flags in zip(log.vectors, vbad) if isinstance(e, CompiledSlots) and any(flags)]
    # sentinel: the forward is judged by a replay of its top-level calls, also when the loss code's
    # backward already went non-finite (a value fed from a poisoned forward: the forward goes first)
    # (an outside finding does not stop it: the root's outputs were not probed, the loss code's
    # nan_to_num may have hidden them, and its finding then came after the model's)
    if ((view.mode == "sentinel" and not any(f.phase == "forward" and f.module != _outside.OUTSIDE for f in out))
            or (compiled and not any(f.phase in ("forward", "backward") for f in out))):
        # (its backward replay only where no backward finding was made: one per phase)
        got = [f for f in ctx.sentinel_findings() if f.phase == "forward" or not any(g.phase == f.phase for g in out)]
        if out_rec >= 0:  # an outside value was found: only a model forward made before it goes first
            fwd = next((f for f in got if f.phase == "forward"), None)
            got = []
            if fwd is not None and log.tops[ctx.where[id(fwd)][1]].outside_at <= out_rec:
                got = [fwd]  # the outside value only carried the model's on
                out = [g for g in out if not (g.phase == "forward" and g.module == _outside.OUTSIDE)]
        out[earlier:earlier] = got
    if compiled and not any(f.phase == "forward" for f in out):
        out[earlier:earlier] = [_compiled_finding(ctx, *compiled[0])]
    written = [(e, flags) for (_v, e), flags in zip(log.vectors, vbad) if isinstance(e, Buffers) and any(flags)]
    if written and not any(f.phase == "forward" for f in out):  # written by the forward: before its backward
        fw = _buffer_finding(ctx, *written[0])
        if fw is not None:
            at = next((j for j, g in enumerate(out) if j >= earlier and g.phase in ("backward", "grad")), len(out))
            out.insert(at, fw)
    grads_bad = any(isinstance(e, Grads) and any(flags) for (_v, e), flags in zip(log.vectors, vbad))
    if grads_bad and not any(f.phase in ("forward", "backward") for f in out):
        # no per-module gradient hooks (the default): find the backward's creator by replay
        for ti in _blame_order(log, 0):
            top = log.tops[ti]
            if top.out_keys:
                r = ctx.replay(ti, backward=True)
                fb = _backward_from_replay(ctx, ti, r)
                if (fb is None and top.compiled is not None and r is not None and r.error is None
                        and not any(is_bad(g) for _, g in r.grads)):  # eager is finite: the compiled backward's own node
                    fb = _compiled_backward(ctx, ti)
                if fb is not None:
                    out.append(fb)
                    break
        else:  # no watched call made it: the outside code's backward (a loss module's parameters)
            fb = _outside.backward_finding(log, ctx.step)
            if fb is not None:
                out.append(fb)
    if grads_bad:
        _earlier_backward(ctx, out, earlier, out_rec)
    for (_vec, entry), flags in zip(log.vectors, vbad):
        if isinstance(entry, Grads) and any(flags):
            f = _grad_finding(ctx, entry, flags, earlier=bool(out))
            if f is not None:
                out.append(f)
                break
    ops = [m for m, b in zip(log.meta, sbad) if b and isinstance(m, Op)]
    # every finding is a forward finding of an evaluation pass's call (a validation batch that waited
    # in the log for the step's agreement under torch.distributed): no training step to skip for it
    log.found_in_evaluation = bool(out) and all(
        (w := ctx.where.get(id(f))) is not None and w[0] == "forward" and 0 <= w[1] < len(log.tops)
        and _evaluation(log.tops[w[1]]) for f in out)
    view.occurred[:] = [_occurred(ctx, f) for f in out]
    found = [_users_class(ctx, _with_op(_finish(ctx, f), ops)) for f in out]
    view.born_rows[:] = [ctx.born_rows.get(id(f)) for f in out]
    view.born_tops[:] = [w[1] if (w := ctx.where.get(id(f))) is not None else ctx.born_tops.get(id(f)) for f in out]
    # (a gradient received through the reduction is another rank's finding: `dist.judge` drops it)
    f0 = next((f for f in found if not (view.received and f.phase == "grad")), None)
    if view.bundle and f0 is not None and not ctx.bundled:
        warnings.warn(f"nanhunt wrote no repro bundle to {view.bundle}: the first finding ({f0.phase} of "
                      f"{f0.module or '<model>'}) is not a watched module's forward call that a replay "
                      "reproduced, the one thing a bundle holds", stacklevel=2)
    return found


def _occurred(ctx: _Ctx, f: Finding) -> int:
    """When ``f``'s value was made, on the process's event clock (`_hooks.tick`): the top-level
    call of a forward finding, the loss code's torch call, the step's backward, the optimizer's
    update; 0 where the log does not say (the hunt then takes the time it recorded the finding)."""
    log = ctx.log
    known = ctx.clocks.get(id(f))
    if known:
        return known
    if f.phase == "forward":
        w = ctx.where.get(id(f))
        if w is not None and w[0] == "forward" and 0 <= w[1] < len(log.tops):
            return log.tops[w[1]].clock
        rec = ctx.out_recs.get(id(f))
        if rec is not None and 0 <= rec < len(log.outside):
            return log.outside[rec].clock
    elif f.phase in ("backward", "grad"):
        return log.bwd_clock
    return 0


def _earlier_backward(ctx: _Ctx, out: list[Finding], earlier: int, out_rec: int) -> None:
    """Gradient accumulation: the step's forward finding is in a later micro-batch, and an
    earlier micro-batch's backward, which ran before it, made non-finite gradients of its own (a
    sqrt at 0): that backward's finding goes first, in order of occurrence (the forward's goes
    after it). Without it the later forward's finding took the step, and the backward that came
    first was never named. Read from each earlier top-level call's backward replay; only where
    its output's gradient arrived before the forward finding's call began (or before the outside
    call that made it)."""
    log = ctx.log
    first = next((f for f in out[earlier:] if f.phase == "forward"), None)
    if first is None or any(f.phase == "backward" for f in out):
        return
    if first.module == _outside.OUTSIDE:
        if out_rec < 0:
            return
        before = sum(1 for t in log.tops if t.outside_at <= out_rec)  # top-level calls begun before it

        def preceded(a: tuple[int, int]) -> bool:
            return a[1] <= out_rec
    else:
        where = ctx.where.get(id(first))
        if where is None:
            return
        before = where[1]

        def preceded(a: tuple[int, int]) -> bool:
            return a[0] <= before  # the forward finding's call had not begun
    for j in range(min(before, len(log.tops))):
        top = log.tops[j]
        # a gradient non-finite as it arrived came when the one kept arrived (the latest): an earlier
        # finite one (MAML's inner autograd.grad(create_graph=True)) did not make it
        arrived = [a for k in top.out_keys if (a := _arrival(log.tensors[k])) is not None]
        if not arrived or not preceded(min(arrived)):
            continue
        fb = _backward_from_replay(ctx, j, ctx.replay(j, backward=True))
        if fb is not None:
            out.insert(out.index(first), fb)
            return


def _arrival(info: TensorInfo) -> tuple[int, int] | None:
    return info.last if info.grad is not None and is_bad(info.grad) else info.arrived


def _users_class(ctx: _Ctx, f: Finding) -> Finding:
    """A module the user compiled in place in the model (``net.block = torch.compile(net.block)``)
    is named by its place, and typed by the user's class, not torch's ``OptimizedModule`` wrapper."""
    if f.module_type != "OptimizedModule":
        return f
    m = next((m for m, n in ctx.names.items() if n == f.module), None)
    orig = getattr(m, "_orig_mod", None)
    return dataclasses.replace(f, module_type=type(orig).__name__) if isinstance(orig, nn.Module) else f


def _with_op(f: Finding, ops: list[Op]) -> Finding:
    """mode="ops": the first non-finite op of the finding's phase, known without any replay."""
    first = next((m for m in ops if (m.node is not None) == (f.phase == "backward")), None)
    if first is None or f.phase not in ("forward", "backward") or f.op is not None:
        return f
    return dataclasses.replace(f, op=first.node or first.op)


def _finish(ctx: _Ctx, f: Finding) -> Finding:
    key = id(f)
    where = ctx.where.get(id(f))
    facts = ctx.facts.get(id(f), {})
    judge_at = facts.get("judge_at", where)  # (a child's input an enclosing module's own code made: the child's output)
    seen: dict[str, Any] = {}  # the op trace's replay of the failing call: the verdict's second one
    if where is not None and f.reproducible and ctx.view.replay:
        phase, top_i, ordinal, path = where
        top = ctx.log.tops[top_i]
        batch = top.batch()  # (rows of a reduction are samples only where they are the batch's)
        if phase == "forward":  # (the op an enclosing module's own code made a child's input with: found already)
            got = facts.get("made") or _oplevel.locate_forward(top, ctx.names, ordinal, path, seen=seen)
        else:
            grads = [ctx.log.tensors[k].grad for k in top.out_keys]
            got = _oplevel.locate_backward(top, ctx.names, grads, list(top.module.parameters()), ordinal, path)
        if got is not None and f.cause == "input" and phase == "forward":
            if got.facts.get("mask_fed"):
                got = None  # a -inf fed in that the module does not take as a mask (log(0) data): fed, no op made it
            else:  # the op trace followed the element back to an op with finite inputs: born here
                f = dataclasses.replace(f, cause="created")
        if got is not None:
            # an op in torch's own layers all the way up (an nn.Sequential of them): the user's line
            # is the one that called the model
            f = dataclasses.replace(f, op=got.op, source=got.source or top.src, chain=tuple(got.chain))
            facts = {**got.facts, "saved_bad": True, "fed_bad": facts.get("fed_bad")} if facts.get("saved_bad") else got.facts
            facts = {**facts, "batch": batch}
    if facts.get("born_rows") is not None:
        ctx.born_rows[key] = facts["born_rows"]
    again = seen.get("bad") if judge_at == where else None
    f = _differential.judge(ctx.view, f, judge_at, facts.get("dtype"), again)  # verdict, reference; compile-only: the graph's op and line
    if f.verdict == "transient" and where is not None and (moved := _written_since(ctx, ctx.log.tops[where[1]].module)):
        # no replay reproduced it, and the replays ran on weights the loop wrote in place since (a clamp or
        # a hand-made update between backward and step()): not the values the call had, no device at fault
        f = dataclasses.replace(f, verdict=None, reference={}, hint=_hints.moved_hint(moved))
    ref = f.reference
    if facts.get("cast") and "reached" in facts and ref.get("op") == f.op and ref.get("value") != facts["reached"]:
        # a cast whose input has another shape than the finding: the reference took that input's largest
        # element, the hint the one on the path to the finding's element (the value the user can look up)
        f = dataclasses.replace(f, reference={**ref, "value": facts["reached"]})
    elif facts.get("scalar") == "number" and f.verdict == "precision" and ref.get("op") != f.op:
        # a Python number past the dtype's range (65536 in float16): inf before the op ran, and no traced
        # value of float32 passes it; the op it went into is the one to name, not an unrelated underflow
        f = dataclasses.replace(f, reference={"dtype": "float32", "op": f.op, "value": facts["reached"],
                                              "limit": facts["limit"], "failing_dtype": facts["dtype"],
                                              "failing": math.copysign(math.inf, facts["reached"])})
    hint = f.hint or _start_hint(ctx, f) or _hints.hint(f, facts)
    if not hint and f.phase == "forward" and f.cause == "unknown" and not ctx.view.replay:
        hint = _hints.unreplayed_forward_hint(ctx.view.sharded, f.op)
    if f.phase == "forward" and f.cause == "created" and "lr=" not in hint and "weights are huge" not in hint:
        # (whatever op it was born in: the values were huge; an overflow's "a lower learning rate" names no weight or lr)
        given_big = _given_huge(ctx, where)
        hint += (_hints.given_huge_hint(*given_big) if given_big else
                 _hints.grown_hint(_grown(ctx), ctx.view.steps_applied if ctx.view.optimizers else None))
    evaluation = where is not None and where[0] == "forward" and 0 <= where[1] < len(ctx.log.tops) and _evaluation(
        ctx.log.tops[where[1]])
    f = dataclasses.replace(f, hint=hint, rank=ctx.view.rank, evaluation=evaluation)
    if ctx.view.breakpoint and not ctx.stopped:  # on_find="breakpoint": once, at the first finding
        ctx.stopped = True
        _debug.stop_for(ctx.view, f, where)
    if where is not None and where[0] == "forward" and ctx.view.bundle:
        _save_bundle(ctx, where, f)
    return f


def _save_bundle(ctx: _Ctx, where: tuple[str, int, int, Path], f: Finding) -> None:
    """The first finding's failing call, its inputs, state and RNG: a file to hand to a colleague."""
    ctx.bundled = True
    try:
        _bundle.save_from_top(ctx.view.bundle or "", top=ctx.log.tops[where[1]], names=ctx.names,
                              ordinal=where[2], finding=f)
    except Exception as e:  # never break the user's run over a bundle; said and logged as for a report
        warn_unwritten(f"nanhunt could not write the repro bundle to {ctx.view.bundle}: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- forward
def _forward_finding(ctx: _Ctx, i: int) -> Finding | None:
    log = ctx.log
    entry = log.meta[i]
    assert isinstance(entry, Fwd)
    ci, j = entry.call, entry.out
    c = log.calls[ci]
    path = c.paths[j]
    ref, ver = c.outs[j]
    alive = ref()
    tensor = alive if alive is not None and version(alive) == ver else None
    written = i in log.late  # written in place since the call returned, and its deferred probe taken only after that
    if tensor is not None and not is_bad(tensor):
        return None  # a finite sum that overflowed: not a finding
    r = ctx.replay(c.top, backward=False, focus=lambda r: [_match(r, c.ordinal, c.module)])
    rc = _match(r, c.ordinal, c.module)
    reproducible: bool | None = None
    cause = "unknown"
    fed_in: tuple[str, str] | None = None
    made: dict[str, Any] = {}  # made by an enclosing module's own code, which returns none of it (`_made_in`)
    name, module, call = c.name, c.module, c.call
    received = r.collective if r is not None and rc is not None and not _bad_at_return(rc, path) else None
    if received is not None:
        # finite when it returned on this rank, and the replay (on this rank alone) stopped at a
        # collective after it: that collective wrote it in place (an all_reduce moves no version
        # counter) with another rank's values; that rank's own finding says where they were born
        cause, rc = "input", None
    elif r is not None and (r.error is None or rc is not None):
        again = dict(rc.outputs).get(path) if rc is not None else None
        if again is not None and not is_bad(again) and sum_may_overflow(again):
            return None  # finite values whose sum overflowed: not a finding (the replay's own sum may not)
        if again is not None and written and rc is not None and not _bad_at_return(rc, path):
            # finite when the call returned, written in place after (the caller's own code: y.mul_(1e39)),
            # and probed only then: not this call's finding; the entries after it tell who wrote it
            return None
        calls = log.calls
        probed = {calls[e.call].ordinal for e in log.meta if type(e) is Fwd and calls[e.call].top == c.top}
        at = rc

        def elsewhere(x: ReplayCall) -> bool:
            """An earlier call the log never probed whose non-finite output never comes into this
            one (an intended -inf mask through an nn.Identity): not where this NaN began."""
            return (at is not None and x is not at and x.ordinal not in probed and x.done < at.done
                    and not _within(r, x, at.ordinal) and not _feeds(r, x, at, probed))

        first = _first_bad_forward(r, ctx.view.ignored, elsewhere)
        if (first is not None and rc is not None and first.ordinal != c.ordinal and first.ordinal not in probed
                and first.done < rc.done and (_within(r, first, c.ordinal) or (
                    again is not None and is_bad(again) and _feeds(r, first, rc, probed)))):
            # the replay's first non-finite output is of a call that ended before this one, whose
            # output the log never probed, and that made this one's: a call inside it the log did
            # not see (compiled graph, no hook inside), or an unprobed call (a passthrough module:
            # not probed on the hot path) whose output came into it, directly or through other
            # unprobed calls (a NaN from the parent's own log(y), through a ReLU, into a conv).
            # Not an unprobed call whose non-finite output goes elsewhere (an intended -inf mask
            # through an nn.Identity), nor when this call's value did not come back non-finite
            # (not reproducible). The replay sees deeper
            rc, path = first, first.outputs[first.out_bad.index(True)][0]
            name, module, call = rc.name, rc.module, _call_index(ctx, c.top, rc)
            tensor = None
        reproducible = (first is not None and rc is not None and any(rc.out_bad)
                        and (first.ordinal == rc.ordinal or _within(r, first, rc.ordinal)))
        if reproducible and rc is not None:
            fed_to = rc
            cause, rc, path = _forward_cause(r, rc, path)
            if cause == "made":
                cause, rc, path, made = _made_in(ctx, c.top, r, rc, fed_to, path)
            fed_in = _top_inputs_fed(r, rc, path) if cause == "input" else None
            if cause == "created" and rc is fed_to and any(rc.in_bad):
                rc, path = _minf_maker(ctx, c.top, r, rc, path)
            if rc is not fed_to:  # born in an enclosing module's own code (the compiled root's too)
                name, module = rc.name, rc.module
                call = c.call if rc.ordinal == c.ordinal else _call_index(ctx, c.top, rc)
            tensor = made["fed"][1] if made else dict(rc.outputs).get(path, tensor)
    if cause == "unknown" and any(is_bad(p) for _, p in own_tensors(module)):
        cause = "parameter"
    inside = _collective_in(r, c.ordinal, c.module) if cause == "unknown" else None
    if tensor is None:
        f = _partial(ctx, "forward", name, module, format_path("output", path), call, cause, reproducible)
        if rc is not None:  # for the verdict's replays (differential.judge)
            ctx.where[id(f)] = ("forward", c.top, rc.ordinal, path)
        elif r is None and log.tops[c.top].kwargs is not None and not _replayable(log.tops[c.top]):
            ctx.facts[id(f)] = {"overwritten": True}  # no replay: its inputs were written in place since
        if inside is not None:
            ctx.facts[id(f)] = {"collective_in": inside}
        elif reproducible is False and r is not None and r.drew:
            ctx.facts[id(f)] = {"drew": r.drew}
        return f
    if rc is not None and dict(rc.outputs).get(path) is tensor:  # a sparse or nested output: as the call returned it
        tensor = rc.wrapped.get(path, tensor)
    index, value, counts = element(tensor)
    f = Finding(
        phase="forward", module=name, module_type=type(module).__name__,
        tensor=made["fed"][0] if made else format_path("output", path), step=ctx.step, call=call, index=index,
        value=value, counts=counts, shape=shape_of(tensor), dtype=dtype_name(tensor), cause=cause,
        reproducible=reproducible,
    )
    if rc is not None:
        ctx.where[id(f)] = ("forward", c.top, rc.ordinal, path)
    facts: dict[str, Any] = {"collective": received} if received is not None else (
        {"collective_in": inside} if inside is not None else {})
    if "made" in made:
        facts.update(made=made["made"], judge_at=made["judge_at"])
    if fed_in is not None:
        facts["top_input"] = fed_in
    if reproducible is False and r is not None and r.drew:
        facts["drew"] = r.drew
    if facts:
        ctx.facts[id(f)] = facts
    return f


def _collective_in(r: Replay | None, ordinal: int, module: nn.Module) -> str | None:
    """The collective a replay stopped at inside its ``ordinal``-th call, ``module``'s (which the
    failure then left with no output), if it did."""
    if r is None or r.collective is None or ordinal >= len(r.calls):
        return None
    rc = r.calls[ordinal]
    return r.collective if rc.module is module and rc.done >= 0 and not rc.outputs else None


def _top_inputs_fed(r: Replay, rc: ReplayCall, path: Path) -> tuple[str, str] | None:
    """The top-level call around ``rc`` and its inputs that held the non-finite value ``rc`` was
    fed (NaN or +inf for a NaN, as `_forward_cause` judges): it came in with that call, made before
    it by the data or by the loop's code (the model's name, the inputs' names); else ``None``."""
    top = rc
    while top.parent >= 0:
        top = r.calls[top.parent]
    out = dict(rc.outputs).get(path)
    nan = out is not None and bool(torch.isnan(values(out)).any()) and not bool(torch.isinf(values(out)).any())
    data = _data_minf(r, rc) if nan else set()
    fed = [f or _storage(t) in data for f, (_, t) in zip(top.in_fed, top.inputs)] if nan else top.in_bad
    names = [(format_path(p[1], p[2:]) if len(p) > 1 and p[0] == 1 and isinstance(p[1], str)
              else format_path("input", p[1:])) + _where_bad(top.wrapped_in.get(p, t))  # (a sparse one: at its dense index)
             for (p, t), b in zip(top.inputs, fed) if b]
    return (top.name, "; ".join(names)) if names else None


def _where_bad(t: torch.Tensor) -> str:
    """`` holding nan at [0, 3], only in column 3 of its last dimension``: the first non-finite
    element of a tensor the model was fed and, for a table, the few columns that hold them (a
    feature standardised by a std of 0)."""
    index, value, _ = element(t)
    if index is None or value is None:
        return ""
    got = f" holding {fmt(value)} at [{', '.join(map(str, index))}]"
    if t.dim() >= 2 and not t.is_nested and t.layout == torch.strided and t.shape[-1] > 1:
        with torch.no_grad():
            cols = (~torch.isfinite(t.detach())).reshape(-1, t.shape[-1]).any(0).nonzero().flatten().tolist()
        if 0 < len(cols) <= 3 and len(cols) < t.shape[-1]:
            got += f", only in column{'s' if len(cols) > 1 else ''} {', '.join(map(str, cols))} of its last dimension"
    return got


def _returned(ctx: _Ctx) -> dict[int, torch.Tensor]:
    """Watched outputs that code after the top-level call wrote in place (``out.mul_(1e39)`` in the
    loss code): id -> the replay's tensor for it, as the replayed top-level call left it (the
    outside code's replay starts from it)."""
    out: dict[int, torch.Tensor] = {}
    log = ctx.log
    used = {id(x) for r in log.outside for _, x in tensors((r.args, r.kwargs))}
    for c in log.calls:  # (any depth: the root hands its last child's output on, probed there)
        for (ref, ver), path in zip(c.outs, c.paths):
            t = ref()
            if t is None or id(t) not in used or version(t) == ver:
                continue  # (a replay only for what the outside code took)
            rc = _match(ctx.replay(c.top, backward=False), c.ordinal, c.module)
            v = dict(rc.outputs).get(path) if rc is not None else None
            if isinstance(v, torch.Tensor) and v.shape == t.shape:
                out[id(t)] = v
    return out


def _bad_at_return(rc: ReplayCall, path: Path) -> bool:
    """Was the replayed call's output at ``path`` non-finite when the call returned?"""
    return next((b for (p, _), b in zip(rc.outputs, rc.out_bad) if p == path), True)


def _match(r: Replay | None, ordinal: int, module: nn.Module) -> ReplayCall | None:
    """The replay's ``ordinal``-th call, if it is ``module``'s and returned: a replay that failed
    after it (a collective refused later in the forward: `_locate._NoCollectives`) still ran it
    as the step did. (A call the failure came through was ended too, by the always-called hook,
    with no output.)"""
    if r is None or ordinal >= len(r.calls):
        return None
    rc = r.calls[ordinal]
    return rc if rc.module is module and (r.error is None or (rc.done >= 0 and bool(rc.outputs))) else None


def _feeds(r: Replay, first: ReplayCall, rc: ReplayCall, probed: set[int]) -> bool:
    """Does ``first``'s output reach ``rc`` as one of the inputs that feed a NaN on (NaN or +inf:
    `ReplayCall.in_fed`; an intended -inf mask does not), the very tensor, directly or through
    calls the log never probed (a ReLU then a MaxPool)? Code between the calls (anything but a
    watched call) ends the trail: then it is not known to."""
    made = {id(t): c for c in r.calls if c.done < rc.done for _, t in c.outputs}
    todo = [t for b, (_, t) in zip(rc.in_fed, rc.inputs) if b]
    seen: set[int] = set()
    while todo:
        t = todo.pop()
        p = made.get(id(t))
        if p is None or p.ordinal in seen:
            continue
        if p is first:
            return True
        seen.add(p.ordinal)
        if p.ordinal not in probed:
            todo.extend(x for b, (_, x) in zip(p.in_fed, p.inputs) if b)
    return False


def _within(r: Replay, rc: ReplayCall, ordinal: int) -> bool:
    p = rc.parent
    while p >= 0:
        if p == ordinal:
            return True
        p = r.calls[p].parent
    return False


def _first_bad_forward(r: Replay, ignored: set[nn.Module] | frozenset[nn.Module] = frozenset(),
                       skip: Callable[[ReplayCall], bool] | None = None) -> ReplayCall | None:
    """The first call (in completion order) with a non-finite output that is not an ignored
    module's, nor an ignored module's output handed on unchanged by a parent or through a
    passthrough module (a max-pool of an ignored -inf mask: its non-finite inputs were all
    ignored ones), nor one ``skip`` leaves out."""
    passed: set[int] = set()
    mask_data: set[int] = set()  # the storages of ignored outputs: a view of one (mask[None]) is that mask
    r.read_outputs()
    for o in r.order:
        c = r.calls[o]
        if c.module in ignored:
            passed.update(id(t) for _, t in c.outputs)
            mask_data.update(_storage(t) for _, t in c.outputs)
            continue
        if any(b and id(t) not in passed for b, (_, t) in zip(c.out_bad, c.outputs)):
            if (mask_data and type(c.module) in PASSTHROUGH and any(c.in_bad)
                    and all(_storage(t) in mask_data for b, (_, t) in zip(c.in_bad, c.inputs) if b)):
                passed.update(id(t) for _, t in c.outputs)  # it handed on what it was given
                mask_data.update(_storage(t) for _, t in c.outputs)
                continue
            if skip is not None and skip(c):
                continue
            return c
    return None


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s values live (its views share it), or its id where it has no plain storage."""
    try:
        return t.untyped_storage().data_ptr() if t.layout is torch.strided else id(t)
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without storage)
        return id(t)


def _forward_cause(r: Replay, rc: ReplayCall, path: Path) -> tuple[str, ReplayCall, Path]:
    """Cause at ``rc``; when fed in, climb to the innermost enclosing call that made it.

    A NaN is fed in only by an input holding NaN or +inf: a module fed an intended -inf mask
    that turns it into NaN (softmax of a fully masked row) is where the NaN was born; a row of
    +inf from the data turned into NaN by a matmul (inf - inf) was fed in.
    """
    out = dict(rc.outputs).get(path)
    nan = out is not None and bool(torch.isnan(values(out)).any()) and not bool(torch.isinf(values(out)).any())
    data = _data_minf(r, rc) if nan and any(rc.in_bad) else set()

    def fed(c: ReplayCall) -> bool:
        if not nan:
            return any(c.in_bad)
        return any(c.in_fed) or any(b and _storage(t) in data for b, (_, t) in zip(c.in_bad, c.inputs))

    if rc.params_bad:
        return "parameter", rc, path
    if not fed(rc):
        return "created", rc, path
    p = rc.parent
    while p >= 0:
        pc = r.calls[p]
        if not fed(pc):
            bad_out = [op for op, b in zip(pc.outputs, pc.out_bad) if b]
            if bad_out and _fed_by_params(pc):  # its own code made it of its own weight or buffer (a schedule's
                return "parameter", pc, bad_out[0][0]  # table holding nan): that module, not the child fed it
            if bad_out:  # the enclosing module's own code made it; report its output
                return "created", pc, bad_out[0][0]
            # the enclosing code made it and fed it in, but returns none of it (an empty output: the
            # mean of a 0x0 feature map; tanh(inf) = 1): "made" there, found by `_made_in`
            return "made", pc, path
        p = pc.parent
    return "input", rc, path


def _made_in(ctx: _Ctx, top: int, r: Replay, pc: ReplayCall, fed_to: ReplayCall,
             path: Path) -> tuple[str, ReplayCall, Path, dict[str, Any]]:
    """``pc``'s own code made the non-finite value ``fed_to`` (a call inside it) was fed, and
    returns none of it (`_forward_cause` said "made"): the cause, call and output path to report,
    and facts. Born there when the op trace within ``pc``'s call finds the op that made that input,
    and the op computed it (``s = x.mean((2, 3))`` of a 0x0 feature map): ``pc``, its output as it
    returned, the fed input (``"fed"``: the finding's tensor, named as ``fc1.input[0]``, and the
    tensor), the op (``"made"``) and where the verdict's replays look (``"judge_at"``: the output
    of ``fed_to``, as ``pc``'s holds none of it). Made of ``pc``'s own non-finite weight or buffer
    (a schedule's table holding nan): "parameter", ``pc``. A value the code wrote
    (``x[0, 0] = inf``), or no op found: ``fed_to`` was fed it."""
    out = dict(fed_to.outputs).get(path)
    nan = out is not None and bool(torch.isnan(values(out)).any()) and not bool(torch.isinf(values(out)).any())
    fed = fed_to.in_fed if nan else fed_to.in_bad
    at = next((p for (p, _), b in zip(fed_to.inputs, fed) if b), None)
    if at is None:
        return "input", fed_to, path, {}
    own = pc.outputs[0][0] if pc.outputs else ()
    rel = fed_to.name[len(pc.name) + 1:] if pc.name else fed_to.name
    label = format_path(at[1], at[2:]) if at[:1] == (1,) and isinstance(at[1], str) else format_path("input", at[1:])
    named = (f"{rel}.{label}", dict(fed_to.inputs)[at])
    if _fed_by_params(pc):
        return "parameter", pc, own, {"fed": named}
    got = _oplevel.locate_forward(ctx.log.tops[top], ctx.names, pc.ordinal, (), fed=(fed_to.ordinal, at))
    if got is None or _hints.mask_write(got.op):
        return "input", fed_to, path, {}
    return "created", pc, own, {"fed": named, "made": got, "judge_at": ("forward", top, fed_to.ordinal, path)}


def _fed_by_params(c: ReplayCall) -> bool:
    """Does a weight or buffer of ``c``'s module hold NaN or +inf as the call began (a -inf alone is
    an intended mask's, as for `ReplayCall.in_fed`)?"""
    before = c.before
    held = [before[id(t)] if id(t) in before else t for n, t in own_tensors(c.module) if n in c.params_bad]
    return any(bool(torch.isnan(v).any() or (v == float("inf")).any()) for v in (values(h) for h in held if h is not None))


def _data_minf(r: Replay, rc: ReplayCall) -> set[int]:
    """The storages of the inputs of the top-level call around ``rc`` that hold -inf among finite
    values other than 0: the data's log of 0 (a log-mel of a silent clip), no additive mask (0 and
    -inf), which a call that reads it (or a view of it) is fed, as a NaN in the batch is."""
    top = rc
    while top.parent >= 0:
        top = r.calls[top.parent]
    out: set[int] = set()
    for b, (_, t) in zip(top.in_bad, top.inputs):
        if b and not (t.is_complex() or t.is_nested or t.layout != torch.strided):
            x = t.detach()
            if bool((x == float("-inf")).any()) and not bool(x[torch.isfinite(x)].eq(0).all()):
                out.add(_storage(t))
    return out


def _minf_maker(ctx: _Ctx, top: int, r: Replay, rc: ReplayCall, path: Path) -> tuple[ReplayCall, Path]:
    """``rc`` made NaN of a -inf it was fed, which is where a NaN is born when the -inf is a mask
    (softmax of a fully masked row). When the enclosing module's own code made that -inf this
    step from finite values by arithmetic (log(0) between two children), the value was born
    there: that call and its output, if the op trace's creator is no mask write."""
    p = rc.parent
    while p >= 0:
        pc = r.calls[p]
        if any(pc.in_bad) or pc.params_bad:
            return rc, path  # the -inf came in from outside the call around it
        bad_out = [op for op, b in zip(pc.outputs, pc.out_bad) if b]
        if bad_out:
            got = _oplevel.locate_forward(ctx.log.tops[top], ctx.names, pc.ordinal, bad_out[0][0])
            if got is not None and not _hints.mask_write(got.op):
                return pc, bad_out[0][0]
            return rc, path
        p = pc.parent
    return rc, path


def _call_index(ctx: _Ctx, top: int, rc: ReplayCall) -> int:
    """This module's call index within the step, for a call seen in a replay of ``top``."""
    for c in ctx.log.calls:
        if c.top == top and c.ordinal == rc.ordinal and c.module is rc.module:
            return c.call
    r = ctx._replays.get((top, False)) or ctx._replays.get((top, True))
    calls = r.calls if r else []
    return _nth_call(ctx, top, rc.module, sum(1 for o in calls if o.ordinal < rc.ordinal and o.module is rc.module))


def _nth_call(ctx: _Ctx, top: int, module: nn.Module, within: int) -> int:
    """The step's call index of ``module``'s call number ``within`` inside the top-level call
    ``top`` (micro-batches: the second forward's call of a module is its call 1)."""
    mine = [c for c in ctx.log.calls if c.top == top and c.module is module]
    if within < len(mine):
        return mine[within].call
    r = ctx._replays.get((top, False)) or ctx._replays.get((top, True))
    per_top = sum(1 for o in (r.calls if r else []) if o.module is module)
    tops = ctx.log.tops
    earlier = 0
    evaluation = _evaluation(tops[top])
    for ti in range(top):
        if _evaluation(tops[ti]) != evaluation:
            continue  # an evaluation pass's calls are counted apart (StepLog.number_calls)
        seen = sum(1 for c in ctx.log.calls if c.top == ti and c.module is module)
        if (not seen and (ctx.view.mode == "sentinel" or tops[ti].compiled is not None)
                and tops[ti].module is tops[top].module):
            # sentinel records the root's calls only, a compiled root's ran its parts in the graph:
            # an earlier call of it ran the module as often
            seen = per_top
        earlier += seen
    return earlier + within


def _evaluation(top: Top) -> bool:
    return not top.grad_enabled and not top.training


def _partial(ctx: _Ctx, phase: str, name: str, module: nn.Module, tensor: str, call: int,
             cause: str, reproducible: bool | None) -> Finding:
    return Finding(
        phase=phase, module=name, module_type=type(module).__name__, tensor=tensor, step=ctx.step,
        call=call, index=None, value=None, counts={}, shape=(), dtype="", cause=cause,
        reproducible=reproducible,
    )


# ---------------------------------------------------------------- check
def _checked(log: StepLog, sbad: list[bool]) -> set[int]:
    """Bad `Out` entries whose tensor the user then gave to ``hunt.check``: reported by that check
    (the name the user chose), with the op, line and chain of the outside code."""
    tensors_checked = [m.tensor for m in log.meta if isinstance(m, Chk)]
    if not tensors_checked:
        return set()
    out: set[int] = set()
    for j, (m, b) in enumerate(zip(log.meta, sbad)):
        if b and isinstance(m, Out):
            t = _outside.output_of(log, m)
            if t is not None and any(_outside.same(t, c) for c in tensors_checked):
                out.add(j)
    return out


def _check_finding(ctx: _Ctx, i: int) -> Finding | None:
    entry = ctx.log.meta[i]
    assert isinstance(entry, Chk)
    name, t = entry.name, entry.tensor
    if not is_bad(t):
        return None
    index, value, counts = element(t)
    checked = _checked(ctx.log, ctx.log.bad_flags()[0])
    fwd_bad = any(isinstance(m, (Fwd, Out)) and j not in checked
                  for j, (m, b) in enumerate(zip(ctx.log.meta[:i], ctx.log.bad_flags()[0])) if b)
    got, facts = _outside.check_origin(ctx.log, t)  # made by recorded code outside the model
    f = Finding(
        phase="check", module=name, module_type=type(t).__name__, tensor=name, step=ctx.step,
        call=sum(1 for m in ctx.log.meta[:i] if isinstance(m, Chk) and m.name == name), index=index,
        value=value, counts=counts, shape=shape_of(t), dtype=dtype_name(t),
        cause="input" if fwd_bad else "created",
        op=got.op if got else None, source=got.source if got else None, chain=tuple(got.chain) if got else (),
    )
    ctx.facts[id(f)] = facts
    return f


# ---------------------------------------------------------------- backward
def _backward_culprit(
    events: list[tuple[int, bool]], calls: list[Any], everyone: list[Any] | None = None
) -> tuple[Any, int, Path, str] | None:
    """The call whose backward made the first non-finite gradient from finite ones.

    ``events``: (tensor key, non-finite?) in the order autograd produced the gradients. A call
    *created* it when a gradient w.r.t. one of its inputs is non-finite while every gradient
    w.r.t. its outputs was finite; the earliest such input wins, ties go to the innermost call.
    A tensor's gradient sums all its uses: an input that another call (not one inside this one)
    also takes, and whose gradient that call was handed non-finite first (``mu(h), s(h)`` with a
    nan at ``mu``'s output from the loss), came in through that call, and is no creation of this
    one. ``everyone``: the list the calls' ``parent`` indices point into (``calls`` by default).
    """
    bad_at: dict[int, int] = {}
    seen: set[int] = set()
    for n, (k, b) in enumerate(events):
        seen.add(k)
        if b and k not in bad_at:
            bad_at[k] = n
    table = calls if everyone is None else everyone

    def inside(c2: Any, c: Any) -> bool:  # is c2 a call made within c?
        p = c2.parent
        while 0 <= p < len(table):
            if table[p] is c:
                return True
            p = table[p].parent
        return False

    def fed_through(c: Any, k: int) -> bool:
        return any(c2 is not c and any(kk == k for kk, _ in c2.in_keys) and not inside(c2, c)
                   and any(bad_at.get(ko, len(events)) < bad_at[k] for ko, _ in c2.out_keys) for c2 in calls)

    best: tuple[int, int, Any, int, Path] | None = None
    for c in calls:
        ins = [(bad_at[k], k, p) for k, p in c.in_keys if k in bad_at and not fed_through(c, k)]
        if not ins:
            continue
        if any(k in bad_at for k, _ in c.out_keys):
            continue  # fed a non-finite gradient
        if not any(k in seen for k, _ in c.out_keys):
            continue  # its backward never ran (no gradient reached its outputs)
        n, k, p = min(ins, key=lambda x: x[0])
        cand = (n, -c.depth, c, k, p)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if best is None:
        return None
    return best[2], best[3], best[4], "created"


def _backward_finding(ctx: _Ctx, i: int, sbad: list[bool]) -> Finding | None:
    log = ctx.log
    entry = log.meta[i]
    assert isinstance(entry, Bwd)
    k0 = entry.tensor
    # which top-level call's graph: the one whose calls touched the tensor
    info = log.tensors[k0]
    cis = [ci for ci, _ in info.producers + info.consumers if ci >= 0]
    top_i = log.calls[cis[0]].top if cis else (len(log.tops) - 1)
    if top_i < 0:
        return None
    # chained calls: every call given finite gradients is asked before it (the one that took the
    # tensor whose gradient went bad made it); else that tensor's call alone
    tried = [tj for tj in _blame_order(log, top_i) if tj == top_i or not _fed(log, tj)] if _chained(log) else [top_i]
    for tj in tried:
        f = _backward_from_replay(ctx, tj, ctx.replay(tj, backward=True))
        if f is not None:
            return f
    r = ctx.replay(top_i, backward=True)
    if r is not None and r.error is None and _overflowed_sums(log, sbad, r):
        return None
    # no replay: attribute from the log alone (no element)
    events = [(m.tensor, b) for m, b in zip(log.meta, sbad) if isinstance(m, Bwd)]
    got = _backward_culprit(events, [c for c in log.calls if c.top == top_i], log.calls)
    reproducible = False if r is not None and r.error is None else None
    if got is not None:
        c, _, path, cause = got
        return _partial(ctx, "backward", c.name, c.module, _grad_input_name(path), c.call, cause, reproducible)
    return _fed_backward(ctx, top_i, None, reproducible)


def _chained(log: StepLog) -> bool:
    """Did a top-level call of the step take a tensor a graph made (another call's output: a decoder
    called once per time step, fed the hidden state it returned)? Then its backward hands gradients
    back into the calls before it."""
    return any(t.requires_grad and not t.is_leaf for top in log.tops for _, t in tensors((top.args, top.kwargs or {})))


def _fed(log: StepLog, ti: int) -> bool:
    """Did the top-level call get a non-finite gradient at its outputs?"""
    return any(is_bad(log.tensors[k].grad) for k in log.tops[ti].out_keys)


def _blame_order(log: StepLog, first: int) -> list[int]:
    """The top-level calls in the order their backward replays are asked who made a gradient:
    ``first``, then the others in order; when the calls are chained, those given a non-finite
    gradient at their outputs last (``first`` too): a later call may have made it, and the earlier
    calls' gradients go bad after it."""
    chained = _chained(log)
    return sorted(range(len(log.tops)), key=lambda ti: (chained and _fed(log, ti), ti != first))


def _overflowed_sums(log: StepLog, sbad: list[bool], r: Replay) -> bool:
    """The log's gradient probes are sums: finite gradients whose sum passed float32's range
    (2e38 in each of a few elements) flag them too, and the log keeps no gradient to read again.
    When every flagged probe is an infinity (a NaN gradient sums to NaN), the step's backward
    replay is finite and one of its gradients sums past the range as well, the flag was that sum:
    no finding (it was reported as born in backward, "not reproduced: suspect the hardware")."""
    flagged = [log.sums[j] if j < len(log.sums) else None
               for j, (m, b) in enumerate(zip(log.meta, sbad)) if b and isinstance(m, Bwd)]
    if not flagged or any(s is None or bool(torch.isnan(s)) for s in flagged):
        return False
    grads = [g for _, g in r.grads]
    return (bool(grads) and not any(is_bad(g) for g in grads)
            and any(sum_may_overflow(g) for g in grads))


def _backward_from_replay(ctx: _Ctx, top_i: int, r: Replay | None) -> Finding | None:
    if r is None or r.error is not None or not r.grads:
        return None
    events = [(k, is_bad(g)) for k, g in r.grads]
    got = _backward_culprit(events, r.calls) if any(b for _, b in events) else None
    if got is None:
        top = ctx.log.tops[top_i]
        if not any(is_bad(ctx.log.tensors[k].grad) for k in top.out_keys):
            # no module made it from its inputs' gradients: the root's own code, or a graph whose
            # only leaves are parameters (a where-trap on a bare nn.Parameter)
            fb = _node_finding(ctx, top_i)
            if fb is not None or not any(b for _, b in events):
                return fb
        return _fed_backward(ctx, top_i, r, True)
    rc, k, path, cause = got
    first_bad = next(n for n, (kk, b) in enumerate(events) if kk == k and b)
    early = _weight_grad_first(ctx, top_i, r, rc, events, first_bad)
    if early is not None:
        return early
    owner = _owning_call(ctx, top_i, r, rc, k)
    if owner is not None:
        return owner
    grad = next(g for kk, g in r.grads if kk == k and is_bad(g))
    hooks = _nodes.tensor_hooks(t) if (t := dict(rc.inputs).get(path)) is not None else []
    nf = _node_finding(ctx, top_i) if hooks else None
    hooked = hooks and (nf is None or ctx.facts.get(id(nf), {}).get("tensor_hook"))
    _forget(ctx, nf)
    if hooked:
        # a hook of the user's on that input (``h.register_hook(...)`` in a forward) ran on its gradient
        # after the call's backward made it finite, and no autograd node made it: the hook did
        index, value, counts = element(grad)
        f = Finding(
            phase="backward", module=rc.name, module_type=type(rc.module).__name__,
            tensor=_grad_input_name(path), step=ctx.step, call=_call_index(ctx, top_i, rc), index=index,
            value=value, counts=counts, shape=shape_of(grad), dtype=dtype_name(grad), cause="created",
            source=_nodes.hook_line(hooks[0]), reproducible=True,
        )
        ctx.facts[id(f)] = {"tensor_hook": _nodes.hook_names(hooks)}
        _keep_rows(ctx, f, grad, top_i)
        return f
    if rc.params_bad:
        cause = "parameter"
    elif any(rc.in_bad):  # its forward was given a non-finite value (an overflow before it that its
        cause = "input"   # saturating gates hid from its output): the backward's 0 * inf only shows it
    index, value, counts = element(grad)
    f = Finding(
        phase="backward", module=rc.name, module_type=type(rc.module).__name__,
        tensor=_grad_input_name(path), step=ctx.step,
        call=_call_index(ctx, top_i, rc), index=index, value=value, counts=counts,
        shape=shape_of(grad), dtype=dtype_name(grad), cause=cause, reproducible=True,
    )
    ctx.where[id(f)] = ("backward", top_i, rc.ordinal, path)
    _keep_rows(ctx, f, grad, top_i)
    if cause == "input":
        ctx.facts[id(f)] = {"saved_bad": True, "fed_bad": _fed_bad(ctx.log.tops[top_i])}  # (for the hint: the forward held the value, see nodes._saved_bad)
    return f


def _weight_grad_first(ctx: _Ctx, top_i: int, r: Replay, culprit: ReplayCall, events: list[tuple[int, bool]],
                       before: int) -> Finding | None:
    """A call whose backward made a non-finite gradient of one of its *own weights* from finite
    gradients, earlier than the gradient the module-level analysis blames (event ``before``): an
    fp16 weight gradient (x^T @ g summed over the batch) overflows in the head before a block's
    input gradient does. The events hold only module inputs' and outputs' gradients, so this is
    read from the weights' own ``.grad`` (this step's: accumulation from an earlier micro-batch was
    judged then) and confirmed by the autograd node that made it, which gives its op and line."""
    bad_at: dict[int, int] = {}
    seen_at: dict[int, int] = {}
    for n, (k, b) in enumerate(events):
        seen_at.setdefault(k, n)
        if b:
            bad_at.setdefault(k, n)
    best: tuple[int, int, ReplayCall] | None = None
    for c in r.calls:
        if c is culprit:
            continue  # its own weights' gradients come from the node the culprit's finding names
        if not c.out_keys or any(k in bad_at for k, _ in c.out_keys):
            continue  # no gradient reached it, or a non-finite one did
        t = min((seen_at[k] for k, _ in c.out_keys if k in seen_at), default=None)
        if t is None or t >= before:
            continue
        for p in c.module.parameters(recurse=False):
            g = p.grad
            if isinstance(g, torch.Tensor) and is_bad(g):
                cand = (t, -c.depth, c)
                if best is None or cand[:2] < best[:2]:
                    best = cand
                break
    if best is None:
        return None
    # a weight's .grad sums every use (tied embeddings: the NaN may come in through the other use);
    # the first node in execution order that made a non-finite gradient decides
    c = best[2]
    f = _node_finding(ctx, top_i)
    if f is not None and f.module == c.name:
        return _moved(ctx, f, call=_call_index(ctx, top_i, c))
    return None


def _owning_call(ctx: _Ctx, top_i: int, r: Replay, rc: ReplayCall, k: int) -> Finding | None:
    """The gradient of a tensor is the sum over its uses: when the call's input that turned
    non-finite is also an input of a call around it or of another call, that call may have made it
    (``fc(h) * sqrt(gate + 0 * h)``: the NaN reaches ``h`` through ``0 * h``, not through ``fc``;
    ``a(h) + b(h)`` with the NaN born in ``b``), or used by code outside every call that takes it (the
    caller's own ``sqrt(dist(h))``, a module reading ``h`` kept on it), that code may have made it.
    The autograd node that made it decides: a finding for the call that owns the node, or None
    when the call itself does (or the node cannot be told)."""
    ancestors: list[ReplayCall] = []
    p = rc.parent
    while p >= 0:
        ancestors.append(r.calls[p])
        p = r.calls[p].parent
    # the calls around it, and the others that take the same tensor (siblings: a(h) + b(h))
    sharing = [c for c in r.calls if c is not rc and any(kk == k for kk, _ in c.in_keys)]
    if not sharing and not (ancestors and _used_by_callers_code(r, rc, k)):
        return None
    f = _node_finding(ctx, top_i)
    if f is None:
        return None
    owner = next((a for a in (*ancestors, *sharing) if a.name == f.module and a is not rc), None)
    if owner is not None:
        return _moved(ctx, f, call=_call_index(ctx, top_i, owner))
    if (rc.name == "" or f.module == rc.name or f.module.startswith(rc.name + ".")
            or not any(c.name == f.module for c in r.calls)):
        return None  # made inside the call (or outside the top): the call's own finding stands
    return f  # a call that used the tensor without taking it (a memory kept on the module: ``self.mem = h``)


def _used_by_callers_code(r: Replay, rc: ReplayCall, k: int) -> bool:
    """Is the input of ``rc`` whose gradient turned non-finite (key ``k``) also used outside the
    calls, by the code of a call around it (``h = a(x); b(h) + sqrt(dist(h))`` in the root's
    forward; a block's residual into ``ln_2`` and its own add): then its gradient sums that use too."""
    t = next((t for kk, p in rc.in_keys if kk == k for pp, t in rc.inputs if pp == p), None)
    if t is None or not t.requires_grad:
        return True  # (cannot tell: let the nodes decide)
    roots = [o.grad_fn for _, o in tensors(r.output) if o.requires_grad]
    return _nodes.used_outside(t, [x for _, x in rc.inputs], [o for _, o in rc.outputs], roots)


def _compiled_backward(ctx: _Ctx, top_i: int) -> Finding | None:
    """A gradient only the compiled backward makes (an eager replay of the step's backward is
    finite): the backward graph's node, its forward op's module and line; verdict ``compiler``."""
    top = ctx.log.tops[top_i]
    grads = [ctx.log.tensors[k].grad for k in top.out_keys]
    names = ctx.view.names
    prefix = names.get(top.module, "")
    settings = _inductor.inductor_settings(top.compiled)
    seen: dict[str, Any] = {}
    if settings is not None:  # Inductor's kernels dispatch nothing: its captured backward graph, node by node
        o = _inductor.locate_inductor_backward(top.compiled, settings, top, prefix, grads, ctx.view.scratch, seen)
    else:
        o = _graph.locate_graph_backward(top.compiled, top, prefix, grads, ctx.view.scratch)
    if o is None:
        return None
    name = _graph.watched_name(o, names)
    if name is None:
        name = names.get(top.module, "")
    module = next((m for m, n in names.items() if n == name), top.module)
    verdict, ref = "compiler", {"config": "eager", "op": o.op, "node": o.node, "dtype": o.dtype}
    if "random" in seen:
        # the forward drew its random numbers with Inductor's own generator: the eager replay's finite
        # backward had another mask; the graph's own aten ops made this one from the values it saved
        verdict, ref = "numerics", {**ref, "config": "eager graph on the compiled run's random numbers",
                                    "random": seen["random"]}
    return Finding(
        phase="backward", module=name, module_type=o.module_type or type(module).__name__, tensor="grad_input",
        step=ctx.step, call=0, index=o.index, value=o.value, counts=dict(o.counts), shape=tuple(o.shape),
        dtype=o.dtype, cause="created", op=o.op, source=o.source, chain=tuple(o.chain), reproducible=True,
        verdict=verdict, reference=ref,
    )


def _node_finding(ctx: _Ctx, top_i: int, grads: list[torch.Tensor | None] | None = None) -> Finding | None:
    """The autograd node of the top-level call that made a non-finite gradient from finite ones.
    ``grads``: those its backward starts from (default: those that arrived at its outputs)."""
    top = ctx.log.tops[top_i]
    if not ctx.view.replay or not _replayable(top):
        return None
    if grads is None:
        grads = [ctx.log.tensors[k].grad for k in top.out_keys]
    b = _nodes.creator(top, ctx.names, grads, list(top.module.parameters()))
    if b is None:
        return None
    module = b.module if b.module is not None else top.module
    index, value, counts = element(b.grad)
    dtype = dtype_name(b.grad)
    tensor = f"{b.node}.grad_input[{b.slot}]" if b.node else f"grad_input[{b.slot}]"
    # that replay ran eager; in float32/float64 without autocast it is the reference replay itself
    numerics = dtype in ("float32", "float64") and not any(on for _, on, _ in top.autocast)
    f = Finding(
        phase="backward", module=b.name if b.module is not None else ctx.names.get(top.module, ""),
        # a node's gradient inside the module's own code (not an input of the module: those may
        # not even need a gradient), named by its node
        module_type=type(module).__name__, tensor=tensor,
        step=ctx.step,
        call=_nth_call(ctx, top_i, module, b.call), index=index, value=value, counts=counts, shape=shape_of(b.grad),
        # a forward value it saved was non-finite (an overflow a saturating op hid from every output):
        # fed in by the forward, the 0 * inf of its backward only shows it
        dtype=dtype, cause="input" if b.facts.get("saved_bad") else "created", op=b.op or None, source=b.source or top.src,
        chain=tuple(b.chain), reproducible=True, verdict="numerics" if numerics else None,
        reference={"dtype": dtype, "op": b.op or None, "tensor": tensor, "value": value} if numerics else {},
    )
    if not numerics:  # made in float16/bfloat16 (or under autocast): the same backward in float32
        e = _differential.examine_node(top, f, b.nth, b.slot, grads, b.node)
        if e is not None:
            f = dataclasses.replace(f, verdict=e.verdict, reference=e.reference)
    ctx.facts[id(f)] = {**b.facts, "fed_bad": True} if b.facts.get("saved_bad") and _fed_bad(top) else b.facts
    _keep_rows(ctx, f, b.grad, top_i)
    return f


def _moved(ctx: _Ctx, f: Finding, **changes: Any) -> Finding:
    """``f`` with ``changes``, keeping what the analysis holds under its id (its hint's facts, its rows):
    a node finding handed to the call that owns it is still a where trap."""
    g = dataclasses.replace(f, **changes)
    if id(f) in ctx.facts:
        ctx.facts[id(g)] = ctx.facts.pop(id(f))
    if id(f) in ctx.born_rows:
        ctx.born_rows[id(g)] = ctx.born_rows.pop(id(f))
    if id(f) in ctx.born_tops:
        ctx.born_tops[id(g)] = ctx.born_tops.pop(id(f))
    return g


def _forget(ctx: _Ctx, f: Finding | None) -> None:
    """A finding made and dropped (asked only what it says): what the analysis holds under its id goes,
    before a later finding gets that id."""
    if f is not None:
        ctx.facts.pop(id(f), None)
        ctx.born_rows.pop(id(f), None)
        ctx.born_tops.pop(id(f), None)


def _keep_rows(ctx: _Ctx, f: Finding, grad: torch.Tensor, top_i: int) -> None:
    """The rows of a gradient a replay made (the log does not hold it) that hold non-finite values:
    the samples that made it (`StepView.born_rows`), every one, not only the first element's; and
    the top-level call whose backward made it (`StepView.born_tops`: a micro-batch's, not the last)."""
    ctx.born_tops[id(f)] = top_i
    if grad.dim() and grad.layout is torch.strided:
        ctx.born_rows[id(f)] = (int(grad.shape[0]), (~torch.isfinite(grad)).reshape(grad.shape[0], -1).any(1)
                                .nonzero().flatten().tolist())


def _fed_bad(top: Top) -> bool:
    """Was the top-level call given a non-finite tensor (the data), which a saturating op hid?"""
    return any(is_bad(t) for _, t in tensors((top.args, top.kwargs or {})))


def _fed_backward(ctx: _Ctx, top_i: int, r: Replay | None, reproducible: bool | None) -> Finding | None:
    """The gradient arriving at the model's output was already non-finite: made outside it."""
    fo = _outside.backward_finding(ctx.log, ctx.step)
    if fo is not None:
        return fo
    log = ctx.log
    top = log.tops[top_i]
    arrived = [log.tensors[k].grad for k in top.out_keys]
    if any(g is not None and is_bad(g) for g in arrived) and any(g is not None and not is_bad(g) for g in arrived):
        # an output the model also uses itself (Hugging Face's labels=: (loss, logits), the loss made
        # from the logits inside the forward): the logits' gradient comes from the model's own code.
        # Its backward from the finite gradients alone (the loss's 1) says whether it was born there
        fn = _node_finding(ctx, top_i, [g if g is not None and not is_bad(g) else None for g in arrived])
        if fn is not None:
            return fn
    g = next((log.tensors[k].grad for k in top.out_keys if is_bad(log.tensors[k].grad)), None)
    name = ctx.names.get(top.module, "")
    call = _nth_call(ctx, top_i, top.module, 0)
    if g is None:
        return _partial(ctx, "backward", name, top.module, "grad_output", call, "unknown", reproducible)
    index, value, counts = element(g)
    return Finding(
        phase="backward", module=name, module_type=type(top.module).__name__, tensor="grad_output",
        step=ctx.step, call=call, index=index, value=value, counts=counts, shape=shape_of(g),
        dtype=dtype_name(g), cause="input", reproducible=reproducible,
        hint="The gradient arriving at the model's output was already non-finite: it was made by "
        "the code after the model (the loss). Pass the loss to hunt.check(loss) to see it.",
    )


def _grad_input_name(path: Path) -> str:
    if len(path) >= 2 and path[0] == 0 and isinstance(path[1], int):
        return f"grad_input[{path[1]}]"
    if len(path) >= 2 and path[0] == 1:
        return f"grad_input[{path[1]!r}]"
    return format_path("grad_input", path)


# ---------------------------------------------------------------- sentinel
def _grad_ids(view: StepView) -> frozenset[int]:
    """Ids of the ``.grad`` of the watched model's and optimizers' parameters."""
    params = list(view.root.parameters()) if view.root is not None else []
    params += [p for o in view.optimizers for g in o.param_groups for p in g["params"]]
    return frozenset(id(p.grad) for p in params if p.grad is not None)


def _sentinel_findings(ctx: _Ctx) -> list[Finding]:
    """Sentinel mode saw a bad loss, gradient or parameter: localise by replaying the step."""
    for ti in range(len(ctx.log.tops)):
        r = ctx.replay(ti, backward=False, focus=lambda r: [_first_bad_forward(r, ctx.view.ignored)])
        # (of the calls that returned: a replay that failed after them, at a collective, ran them as the step did)
        first = _first_bad_forward(r, ctx.view.ignored) if r is not None else None
        if r is None or first is None:
            continue
        path = first.outputs[first.out_bad.index(True)][0]
        cause, rc, path = _forward_cause(r, first, path)
        made: dict[str, Any] = {}
        if cause == "made":  # (an enclosing module's own code made it, and returns none of it)
            cause, rc, path, made = _made_in(ctx, ti, r, rc, first, path)
        fed_in = _top_inputs_fed(r, rc, path) if cause == "input" else None
        if cause == "created" and rc is first and any(rc.in_bad):
            # a -inf made by an enclosing module's own code (log of a padding row) turned NaN
            # here: born in that code, as full mode finds it (`_forward_finding`)
            rc, path = _minf_maker(ctx, ti, r, rc, path)
        t = made["fed"][1] if made else dict(rc.outputs)[path]
        index, value, counts = element(t)
        f = Finding(
            phase="forward", module=rc.name, module_type=type(rc.module).__name__,
            tensor=made["fed"][0] if made else format_path("output", path), step=ctx.step,
            call=_call_index(ctx, ti, rc), index=index, value=value, counts=counts, shape=shape_of(t),
            dtype=dtype_name(t), cause=cause, reproducible=True,
        )
        ctx.where[id(f)] = ("forward", ti, rc.ordinal, path)
        if fed_in is not None:  # (made before the model: its inputs, named as full mode names them)
            ctx.facts[id(f)] = {"top_input": fed_in}
        if "made" in made:
            ctx.facts[id(f)] = {"made": made["made"], "judge_at": made["judge_at"]}
        return [f]
    for ti in _blame_order(ctx.log, 0):
        if ctx.log.tops[ti].out_keys:
            fb = _backward_from_replay(ctx, ti, ctx.replay(ti, backward=True))
            if fb is not None:
                return [fb]
    return []


def _compiled_finding(ctx: _Ctx, entry: CompiledSlots, flags: list[bool]) -> Finding:
    """Inside a compiled graph, without a replay: the module and output, nothing finer."""
    name, mtype, path = entry.first(flags) or entry.slots[flags.index(True)]
    root = ctx.view.root
    module = root.get_submodule(name) if root is not None else None
    poisoned = module is not None and any(is_bad(p) for _, p in own_tensors(module))
    if poisoned:
        hint = ""
    elif ctx.view.replay and not ctx.log.tops:  # no call of the model ran eagerly: it was traced into a caller's graph
        hint = _hints.traced_call_hint()
    else:
        hint = ("Found by the compiled graph's own check, with no replay to say more "
                "(replay=False, or the call's inputs were changed in place since): only the module is known.")
    return Finding(
        phase="forward", module=name, module_type=mtype, tensor=format_path("output", path),
        step=ctx.step, call=0, index=None, value=None, counts={}, shape=(), dtype="",
        cause="parameter" if poisoned else "unknown", hint=hint,
    )


# ---------------------------------------------------------------- buffers
def _buffer_finding(ctx: _Ctx, entry: Buffers, flags: list[bool]) -> Finding | None:
    """A buffer of the root that became non-finite during the step while no output did (a
    BatchNorm's running variance overflowing on a huge but finite batch)."""
    root = ctx.view.root
    for name, t, b in zip(entry.names, entry.tensors, flags):
        if not b or not is_bad(t):
            continue
        mname, _, bname = name.rpartition(".")
        largest = _largest_weight_up_to(root, mname)
        try:
            module = root.get_submodule(mname) if root is not None else None
        except AttributeError:
            module = None
        mtype = type(module).__name__ if module is not None else ""
        index, value, counts = element(t)
        # the root call that wrote it: the last one that began with it finite (each kept a copy of
        # the buffers it began with); under gradient accumulation, the module's call in that one
        held = [i for i, top in enumerate(ctx.log.tops) if id(t) in top.saved]
        ti = next((a for a, b in zip(held, held[1:]) if is_bad(ctx.log.tops[b].saved[id(t)])), held[-1] if held else -1)
        return Finding(
            phase="forward", module=mname, module_type=mtype, tensor=bname, step=ctx.step,
            call=_nth_call(ctx, ti, module, 0) if module is not None and ti >= 0 else 0,
            index=index, value=value, counts=counts, shape=shape_of(t), dtype=dtype_name(t), cause="created",
            hint=_hints.buffer_hint(bname, mtype, largest, t.dtype),
        )
    return None


def _grown(ctx: _Ctx) -> tuple[str, float, str, tuple[int, float] | None] | None:
    """The watched model's largest weight when it is huge (past `hints.HUGE_WEIGHT`: grown by the
    updates), with its optimizer and lr as "SGD lr=2" ("" when no watched optimizer holds it), and
    the step and lr of its group's largest lr so far when that was 1 or more and far larger (a
    warm-up that began at 1e38: the schedule has brought the lr down since)."""
    largest = _largest_weight_up_to(ctx.view.root, None, _hints.HUGE_WEIGHT)
    if largest is None or largest[1] <= _hints.HUGE_WEIGHT:
        return None
    p = ctx.view.root.get_parameter(largest[0]) if ctx.view.root is not None else None
    for i, opt in enumerate(ctx.view.optimizers):
        for gi, g in enumerate(opt.param_groups):
            if any(q is p for q in g["params"]) and isinstance(g.get("lr"), (int, float)):
                lr = float(g["lr"])
                peak = ctx.view.peak_lrs.get((i, gi))
                # (an lr of 1 or more: a schedule that decayed 0.1 to 1e-5 has no step to name)
                return (largest[0], largest[1], f"{type(opt).__name__} lr={lr:g}",
                        peak if peak is not None and peak[1] >= 1.0 and peak[1] > 100 * abs(lr) else None)
    return largest[0], largest[1], "", None


def _given_huge(ctx: _Ctx, where: tuple[str, int, int, Any] | None) -> tuple[str, float] | None:
    """The largest floating tensor that ``torch.func.functional_call`` gave the failing call in place
    of the module's own, when it is huge (past `hints.HUGE_WEIGHT`) and none of the model's own is:
    fast weights a meta-learning inner loop (p - lr * g) blew up."""
    if where is None or not ctx.log.tops[where[1]].reparam or _grown(ctx) is not None:
        return None
    best: tuple[str, float] | None = None
    for k, t in given(ctx.log.tops[where[1]])[0].items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not is_bad(t):
            v = float(t.detach().abs().max())
            if v > _hints.HUGE_WEIGHT and (best is None or v > best[1]):
                best = (k, v)
    return best


def _largest_weight_up_to(root: nn.Module | None, mname: str | None,
                          huge: float | None = None) -> tuple[str, float] | None:
    """The largest weight of the modules registered up to ``mname`` (those that feed it, in a
    Sequential; None: all of them): grown huge by the updates, not a huge sample, they may have
    made its input. With ``huge`` (the common case, no weight past it): None as soon as a few joined
    reductions say no weight is (`joined`), without reading each one."""
    if huge is not None and root is not None and mname is None:
        ps = [p for p in root.parameters() if p.is_floating_point() and p.numel()]
        chunks, rest = joined(ps)
        if not rest and chunks:
            with torch.no_grad():
                top = float(torch.stack([flat.abs().max().float() for _, flat in chunks]).max())
            if top <= huge:  # (finite: nothing non-finite either, whose weights the loop below skips)
                return None
    best: tuple[str, float] | None = None
    for name, m in root.named_modules() if root is not None else ():
        for pname, p in m.named_parameters(prefix=name, recurse=False):
            if p.is_floating_point() and p.numel() and not is_bad(p):
                v = float(p.detach().abs().max())
                if best is None or v > best[1]:
                    best = (pname, v)
        if name == mname:
            break
    return best


# ---------------------------------------------------------------- grad / optimizer
def _start_hint(ctx: _Ctx, f: Finding) -> str:
    """For a poisoned module: its weight or buffer that was already non-finite when the watch
    began, or a weight written after its optimizer's last step (a load_state_dict mid-run)."""
    root = ctx.view.root
    if f.cause != "parameter" or root is None or f.phase == "checkpoint":
        return ""
    where = ctx.where.get(id(f))
    if where is not None and ctx.log.tops[where[1]].reparam:
        # the call ran through torch.func.functional_call: the tensors it was given, not the module's
        prefix = f"{f.module}." if f.module else ""
        bad = [k for k, t in given(ctx.log.tops[where[1]])[0].items() if isinstance(t, torch.Tensor) and is_bad(t)]
        bad.sort(key=lambda k: not (k.startswith(prefix) and "." not in k[len(prefix):]))  # the module's own first, else a tied one
        if bad:
            return _hints.given_hint(bad[0])
    if where is not None:  # a child run through functional_call inside the forward (adapted weights)
        r = ctx._replays.get((where[1], False)) or ctx._replays.get((where[1], True))
        rc = r.calls[where[2]] if r is not None and where[2] < len(r.calls) else None
        if rc is not None and rc.given:
            return _hints.given_hint(f"{f.module}.{rc.params_bad[0]}" if f.module else rc.params_bad[0])
    try:
        module = root.get_submodule(f.module)
    except AttributeError:
        return ""
    after = {k: v for d in ctx.view.after_step.values() for k, v in d.items()}
    held = {id(p) for o in ctx.view.optimizers for g in o.param_groups for p in g["params"]}
    for name, t in own_tensors(module):
        if not is_bad(t):
            continue
        what = f"{name!r} of `{f.module or type(root).__name__}`"
        if _at_start(ctx, t):
            return _hints.at_start_hint(what, t)
        if any(x is t for x in ctx.view.known_bad):
            return _hints.carried_hint(what)
        line = _outside.writer(ctx.log, t)
        if line is not None:  # the loop's own code wrote it (p.data[3] = nan: no version counter sees it)
            return _hints.written_hint(what, line)
        if id(t) in after and after[id(t)] != t._version:
            return _hints.written_hint(what)
        if any(id(t) in ctx.view.after_step.get(i, {}) for i in ctx.view.judged):
            # judged finite as its last step() returned, its version unmoved since: its .data was replaced
            return _hints.replaced_hint(what, t.dtype)
        if held and isinstance(t, torch.nn.Parameter) and id(t) not in held:
            return _hints.unheld_hint(what, frozen=not t.requires_grad)
        if not ctx.view.optimizers and isinstance(t, torch.nn.Parameter):
            return _hints.unwatched_hint(what)
    return ""


def _written_since(ctx: _Ctx, module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters written in place since their optimizer's last ``step()``
    (since the watch began, before the first): their values now may not be the ones a call saw."""
    after = {k: v for d in ctx.view.after_step.values() for k, v in d.items()}
    prefix = ctx.names.get(module, "")
    return [f"{prefix}.{n}" if prefix else n for n, p in module.named_parameters()
            if (v := after.get(id(p), ctx.view.start_versions.get(id(p)))) is not None and v != version(p)]


def _at_start(ctx: _Ctx, t: torch.Tensor) -> bool:
    """Was ``t`` already non-finite when the watch began?"""
    return any(x is t for x in ctx.view.bad_at_start)


def _grad_finding(ctx: _Ctx, entry: Grads, flags: list[bool], earlier: bool) -> Finding | None:
    for p, b in zip(entry.params, flags):
        if not b or p.grad is None or not is_bad(p.grad):
            continue
        mname, pname, m = ctx.param_owner(p)
        g = p.grad
        index, value, counts = element(g)
        cause = "input" if earlier else ("parameter" if is_bad(p) else "created")
        hint = ""
        if cause == "created" and (_at_start(ctx, g) or any(x is g for x in ctx.view.stale_grads)):
            # the backward added to a .grad that held NaN/Inf already
            cause, hint = "input", _hints.stale_grad_hint(f"{mname}.{pname}" if mname else pname, _at_start(ctx, g))
        if cause == "created" and not ctx.log.tops and not ctx.log.outside:
            # nothing of the step was seen: "created" would be a guess
            if ctx.log.traced:  # its calls ran in a compiled graph not hooked yet (caught from the next step)
                cause, hint = "unknown", _hints.untraced_forward_hint()
            elif ctx.log.transformed:  # its calls ran inside torch.func transforms (vmap/grad)
                cause, hint = "unknown", _hints.transformed_forward_hint()
            elif ctx.log.foreign:  # its calls ran on another thread than the one that steps the optimizer
                cause, hint = "unknown", _hints.foreign_forward_hint()
            elif ctx.view.mode == "sentinel":
                cause, hint = "unknown", _hints.unseen_forward_hint()
            else:  # no call of the model, no loss code: they ran where no hook runs (a compiled train step)
                cause, hint = "unknown", _hints.unseen_step_hint()
        elif cause == "created" and m is None:
            # a parameter only the optimizer holds (another model's, trained by the same optimizer): its
            # backward ran in no watched call, so no module's gradient was there to judge
            hint = _hints.outside_param_hint(pname)
        elif cause == "created" and not ctx.view.replay and not ctx.view.grad_hooks:
            # no backward replay (replay=False; FSDP2) and no per-module gradient hooks: no module's
            # gradient was judged, so "made in this gradient" would be a guess
            cause, hint = "unknown", _hints.unjudged_backward_hint(ctx.view.sharded)
        hooks = _nodes.tensor_hooks(p) if cause == "created" else []
        backwards = len(ctx.log.seeds)  # (the backward() calls the loop made in the step, where recorded)
        if cause == "created" and not hooks:
            # every gradient the modules' hooks saw was finite: a hook the forward put on an activation
            # that only its own code takes (``h.register_hook(fn)``; ours saw the gradient before it)?
            for top_i in reversed(range(max(len(ctx.log.tops) - 4, 0), len(ctx.log.tops))):  # (a replay each)
                nf = _node_finding(ctx, top_i)
                if nf is not None and ctx.facts.get(id(nf), {}).get("tensor_hook"):
                    return nf
                _forget(ctx, nf)
        f = Finding(
            phase="grad", module=mname, module_type=type(m).__name__ if m is not None else "Parameter",
            tensor=f"{pname}.grad", step=ctx.step, call=0, index=index, value=value, counts=counts,
            shape=shape_of(g), dtype=dtype_name(g), cause=cause, hint=hint,
            # a hook of the user's on it: its line, where the step's one backward leaves nothing else
            source=_nodes.hook_line(hooks[0]) if hooks and backwards <= 1 else None,
        )
        ctx.facts[id(f)] = {"backwards": backwards, "second_order": ctx.log.second_order, **({"grad_hook": _nodes.hook_names(hooks)} if hooks else {})}
        return f
    return None


def _optimizer_now(ctx: _Ctx) -> Finding | None:
    """On a hit: are the parameters or optimizer state non-finite after the last step()?"""
    view = ctx.view
    if not view.steps_applied:
        return None  # no step() yet: whatever is non-finite was not made by the optimizer
    for i, opt in enumerate(view.optimizers):
        if i in view.judged or i in view.mid_step:
            continue  # its update was judged when step() returned (found then, or finite); or its
            # state is mid-update now (a closure called again inside step(): LBFGS)
        # the step its last step() belonged to: the one before, or this one for an optimizer
        # that stepped earlier in a round not ended yet (a GAN's D before G's step())
        last = view.step_of.get(i, max(ctx.step - 1, 0))
        items, tens = optimizer_tensors(opt)
        after = view.after_step.get(i, {})
        # a parameter written since its last step() (by the user: its version moved, or the loop's
        # own code wrote it in place, p.data[3] = nan, which moves none) is not the optimizer's doing
        bad = set(all_bad(tens))  # (one fused read, then exact checks of the hits: a read per tensor cost ~5 ms for 300)
        flags = [j in bad and (bool(sk) or after.get(id(p)) == p._version) and _outside.writer(ctx.log, tens[j]) is None
                 for j, (p, sk) in enumerate(items)]  # (a state the loop's code wrote: the same)
        if any(flags):
            entry = OptimState(i, last, items, tens, view.bad_grads_step == last)
            if view.optimizer_every != 1:  # its state was last read after this step's update (-1: never)
                entry.since = view.probed_at.get(i, -1)
            f = _optimizer_finding(ctx, entry, flags)
            if f is not None:
                ctx.clocks[id(f)] = view.step_clocks.get(i, 0)  # (its last step(): the latest it can have been made)
            return f
        for j in sorted(bad):  # a state the loop's code wrote non-finite since (the parameters: see the forward's finding)
            p, sk = items[j]
            line = _outside.writer(ctx.log, tens[j]) if sk else None
            if line is not None and not any(x is tens[j] for x in view.known_bad):
                return _written_state(ctx, p, sk, tens[j], line)
    return None


def _written_state(ctx: _Ctx, p: torch.Tensor, sk: str, t: torch.Tensor, line: str) -> Finding:
    """Optimizer state ``sk`` of ``p`` written non-finite in place by the loop's code at ``line``
    (``opt.state[p]["exp_avg"][0] = nan``) in this step: fed in, no update made it."""
    mname, pname, m = ctx.param_owner(p)
    index, value, counts = element(t)
    return Finding(
        phase="optimizer", module=mname, module_type=type(m).__name__ if m is not None else "Parameter",
        tensor=f"state[{sk!r}]", step=ctx.step, call=0, index=index, value=value, counts=counts,
        shape=shape_of(t), dtype=dtype_name(t), cause="input", source=line,
        hint=_hints.written_hint(f"the optimizer state {sk!r} of {pname!r}", line),
    )


def _optimizer_finding(ctx: _Ctx, entry: OptimState, flags: list[bool]) -> Finding | None:
    step, fed = entry.step, entry.fed
    if not fed and entry.since is not None:  # read every `optimizer_every` steps: given non-finite gradients at
        fed = entry.since < ctx.view.bad_grads_step <= step  # a step since its last reading (record or warn mode)
    rows = [(p, sk, t) for (p, sk), t, b in zip(entry.items, entry.tensors, flags) if b]
    # what was non-finite before the update (loaded so, or written by the loop's code since
    # backward) goes first: a state that carried its NaN into the parameter, not the parameter
    # the update then wrote, is the finding
    rows.sort(key=lambda r: not (_at_start(ctx, r[2]) or (not fed and entry.before_bad(r[2]))))
    known = ctx.view.known_bad
    for p, sk, t in rows:
        if any(x is t for x in known) or not is_bad(t):
            continue  # (already shown non-finite by an earlier finding: carried through this step, not made by it)
        if not sk and known and any(q is p and k and any(x is u for x in known)
                                    for (q, k), u in zip(entry.items, entry.tensors)):
            continue  # (a parameter its state carried a known NaN into)
        mname, pname, m = ctx.param_owner(p)
        index, value, counts = element(t)
        at_start = _at_start(ctx, t) or _at_start(ctx, p)  # loaded non-finite: no step made it
        if not at_start and not fed and entry.before_bad(t):
            # non-finite already as step() began, its gradient finite: the user's code wrote it (between
            # backward and step(): p.data[3] = nan, which no version counter sees); the update only carried it on
            what = f"the optimizer state {sk!r} of {pname!r}" if sk else f"the parameter {pname!r}"
            return Finding(
                phase="optimizer", module=mname, module_type=type(m).__name__ if m is not None else "Parameter",
                tensor=pname if not sk else f"state[{sk!r}]", step=step, call=0, index=index, value=value,
                counts=counts, shape=shape_of(t), dtype=dtype_name(t), cause="input",
                hint=_hints.written_before_step_hint(f"{what} of `{mname or type(m).__name__}`"),
            )
        opt = ctx.view.optimizers[entry.opt] if entry.opt < len(ctx.view.optimizers) else None
        if opt is not None:  # a wrapper that runs Optimizer.__init__ (a Lookahead): the torch optimizer it steps p with
            opt = _optim.stepped_by(opt, p) or opt
        op, alone = _optim.update_op(opt, p, sk) if opt is not None and not fed and not at_start else (None, False)
        eps = _optim.eps_rounds_to_zero(opt, p) if opt is not None else ""
        setting = _optim.bad_hyperparameter(opt, p) if opt is not None and not at_start else ""
        named = False  # the step is known from the lr noted at it, not only the window of readings
        if not setting and opt is not None and not at_start and not fed:
            # its lr is finite now, but was not at a step() since the last reading (a schedule's 1/0)
            past = _optim.past_bad_lr(opt, p, entry.opt, ctx.view.bad_lrs,
                                      step - 1 if entry.since is None else entry.since, step)
            if past is not None:
                step, named = past[1], True
                setting = f"{past[0]} at step {step}"
        src = ctx.view.step_lines.get(entry.opt)
        chain: tuple[str, ...] = (f"{op} @ {src}" if src else op,) if op else ()
        if op is None and opt is not None and not fed and not at_start and ctx.view.rank is None:
            got = _optim.custom_origin(opt, p, sk, index)  # a hand-written optimizer: its own op and line
            if got is not None:
                op, src, chain = got[0], got[1], tuple(got[2])
        facts = _optim.grad_facts(opt, p) if opt is not None and not fed else None
        if opt is not None and facts is not None and alone:
            facts["settings"] = _optim.settings_text(opt, p)  # (its update overflows from a weight of 1)
        if opt is not None and facts is not None and "lr" in facts:  # (the step's lr, not the schedule's next one)
            noted = _optim.lr_at(opt, p, entry.opt, ctx.view.last_lrs, step)
            facts["lr"] = facts["lr"] if noted is None else noted
        hint = _hints.optimizer_hint(pname, sk, fed, eps, at_start=at_start, setting=setting, grads=facts)
        if not at_start and not named and entry.since is not None and step - entry.since > 1:
            # (a state, read every `optimizer_every` steps, shows only in the window since its last
            # reading; so does a parameter whose non-finite part no forward since used: the rows of
            # an embedding that the next batches did not look up)
            hint += " " + _hints.unread_window_hint(entry.since, step, ctx.view.optimizer_every)
        return Finding(
            phase="optimizer", module=mname,
            module_type=type(m).__name__ if m is not None else "Parameter",
            tensor=pname if not sk else f"state[{sk!r}]", step=step, call=0, index=index,
            value=value, counts=counts, shape=shape_of(t), dtype=dtype_name(t),
            cause="parameter" if at_start else ("input" if fed else "created"), op=op,
            source=src if op else None, chain=chain, hint=hint,
        )
    return None
