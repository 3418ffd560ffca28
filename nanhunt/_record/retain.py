"""What a step keeps of its top-level calls, and for how long (bounded, documented memory).

A top-level call keeps its inputs, kwargs and RNG state (`Top`) so that, on a hit, the analysis can
replay it. A call made with gradients enabled may still be needed by a backward replay, so it is
kept until the step ends (its autograd graph holds more than its inputs anyway). A call made
without gradients (`no_grad` / `inference_mode`: a validation loop between two optimizer steps)
can only be needed if its own forward went non-finite: when the next top-level call begins,
`settle` folds the probes recorded since that call began (its outputs, and `hunt.check()`s made
before the next call) into one device-side flag; once that flag is known to be finite the call's
inputs, kwargs, RNG state and checked tensors are dropped, and so are the torch calls recorded
outside every watched call since it began (`_record.outside`: loss and metric code) whose outputs
need no gradient. A non-finite one is kept for the replay.

The flag is read without a host sync: a CPU value is already there; on an accelerator it is
copied to pinned host memory without blocking and read when its event has completed (polled at
later top-level calls, so at most the calls still in flight on the device are kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._steplog import Chk, StepLog, Top

__all__ = ["settle"]

_GONE = torch.empty(0, dtype=torch.uint8)  # what a released call holds instead of its RNG state / checked tensor


def settle(log: StepLog) -> None:
    """A top-level call begins (its `Top` not appended yet): settle what the previous ones keep."""
    end, oend = len(log.sums), len(log.outside)
    t = log.tops[-1] if log.tops else None
    if t is not None and not t.grad_enabled and t.rng is not _GONE:
        start, ostart = log.span, log.out_span
        if start == end:
            _release(log, t, start, end, ostart, oend)
        else:
            log.pending.append((t, start, end, ostart, oend, _when_ready(log.probes(start, end))))
    log.span, log.out_span = end, oend
    if log.pending:
        keep = []
        for item in log.pending:
            top, a, b, oa, ob, read = item
            finite = read()
            if finite is None:
                keep.append(item)
            elif finite:
                _release(log, top, a, b, oa, ob)
        log.pending = keep


def _release(log: StepLog, t: Top, start: int, end: int, ostart: int, oend: int) -> None:
    t.args = ()
    t.kwargs = None  # not replayable any more (it will never need to be)
    t.rng = _GONE
    t.cuda_rng = None
    meta = log.meta
    for i in range(start, end):
        m = meta[i]
        if isinstance(m, Chk):
            m.tensor = _GONE
    for r in log.outside[ostart:oend]:  # known finite; needed by no backward: nothing to replay
        if r.func is not None and not any(isinstance(x, torch.Tensor) and x.requires_grad for x in _leaves(r.out)):
            r.func, r.args, r.kwargs, r.out, r.rng = None, (), {}, None, None


def _leaves(out: object) -> list[object]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _when_ready(probes: torch.Tensor | None) -> Callable[[], bool | None]:
    """A reader of "are all these probes finite?": the answer once it is on the host, ``None``
    before (and forever when it cannot be had without waiting: the call is then kept)."""
    try:
        if probes is None:
            return lambda: True
        flag = torch.isfinite(probes).all()
        if flag.device.type == "cpu":
            value = bool(flag.untyped_storage()[0])  # computed already: reading host memory is no sync
            return lambda: value
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        done = torch.Event(flag.device)
        done.record()
    except Exception:  # no events or pinned memory, a transformed tensor (torch.func): keep the call
        return lambda: None
    return lambda: bool(host.untyped_storage()[0]) if done.query() else None
