"""Protect the run after a finding: buffers put back as they were when the step began, and a
skipped step's gradients dropped so that ``optimizer.step()`` applies nothing.

Buffers (BatchNorm running statistics and counters) are written by the failing forward itself;
the weights were never updated (the check runs before ``step()``), but poisoned running statistics
would make every later ``eval()`` prediction NaN. :class:`BufferBackup` keeps one copy of the
model's buffers, refreshed at the first top-level call of every step by one ``_foreach_copy_``
(no allocation, no sync). Every buffer is copied: version counters cannot say which ones a step
writes, since BatchNorm's kernels update the running statistics without bumping them (checked on
torch 2.13). A model without buffers costs nothing.

A step whose gradients are all ``None`` is a no-op for every ``torch.optim`` optimizer except
LBFGS: parameters and state (Adam's per-parameter ``step`` included) stay bit-identical to a loop
that never saw the batch.

LBFGS moves the weights inside one ``step(closure)``, between calls of the closure (each
line-search trial point, each fixed step): a finding at a later call leaves them at the trial
point, moved from the gradient of the step's first call. :class:`StepBackup` keeps the weights and
the optimizer's state as they were when that ``step()`` began (one copy of the weights and of the
state's tensors, taken for LBFGS only, in raise/skip mode) and puts them back when a finding stops
or drops the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._tensors import same, strided

__all__ = ["BufferBackup", "StepBackup", "buffer_slots", "drop_grads", "moves_in_step"]


class BufferBackup:
    """The model's buffers as they were when the current step began."""

    def __init__(self) -> None:
        self._slots: list[tuple[dict[str, torch.Tensor | None], str, str]] | None = None  # at the first step
        self._src: list[torch.Tensor | None] = []  # the buffers the copies were taken of
        self._copy: list[torch.Tensor] = []
        self._captured = False  # a copy was taken at this step's start
        self._armed = False  # ... for the step that just ended: restore() may put it back
        self._before: list[tuple[dict[str, torch.Tensor | None], str, str]] | None = None  # see regroup

    def capture(self, root: nn.Module) -> None:
        """At the step's first top-level call: copy every buffer (one fused copy). The buffers are
        found at the first step and after the model's modules changed (`regroup`); watch() itself
        never walks the model."""
        if self._slots is None:
            self._slots = buffer_slots(root)
            self._before = None
        if not self._slots:
            return
        now = [d.get(k) for d, k, _ in self._slots]
        src, copies = self._src, self._copy
        # never inference tensors, whichever mode the step's first call runs in (a validation pass
        # under torch.inference_mode begins a step too): later steps copy into them in place
        with torch.inference_mode(False), torch.no_grad():
            # (a buffer resized in place since, as a per-channel fake-quant's scale and observer's
            # min_val are at their first call: fresh copies of the new shape)
            if len(src) == len(now) and all(a is b and (a is None or a.shape == c.shape)
                                            for a, b, c in zip(now, src, copies)):
                torch._foreach_copy_(copies, now)  # type: ignore[arg-type]
            else:  # first step, or a buffer was replaced or resized: fresh copies
                if any(t is not None and is_lazy(t) for t in now):
                    return  # a lazy module's first call gives its buffers their values: nothing to put back yet
                self._src = now
                self._copy = [t.detach().clone() if t is not None else torch.empty(0) for t in now]
        self._captured = True

    def regroup(self) -> None:
        """The watched model's modules changed (a BatchNorm swapped in, a block added): its buffers
        are found anew when the next step begins (a restore before then puts back those the
        current step's copies were taken of)."""
        if self._slots is not None:
            self._before, self._slots = self._slots, None  # (the copies taken so far are of these)

    def taken(self) -> dict[int, torch.Tensor]:
        """The copies taken at this step's start, by id of the buffer (empty before the first)."""
        if not self._captured:
            return {}
        return {id(s): c for s, c in zip(self._src, self._copy) if s is not None}

    def end_step(self) -> None:
        """The step ended (its sync): :meth:`restore` now refers to it; the next step captures anew."""
        self._armed, self._captured = self._captured, False

    def restore(self) -> list[str]:
        """Put back every buffer the step that just ended wrote; their qualified names. After a hit
        only (it reads values back to compare)."""
        slots = self._before if self._before is not None else self._slots
        if not self._armed or not slots:
            return []
        self._armed = False
        names: list[str] = []
        with torch.no_grad():
            for (d, k, name), src, c in zip(slots, self._src, self._copy):
                if src is None:
                    continue
                t = d.get(k)
                if t is src and same(t, c) and not (t.is_floating_point() and strided(t).isnan().any()):
                    continue
                if t is not src:  # replaced by assignment during the step: the original goes back
                    d[k] = src
                # through .data: no version bump. A graph the loop still backprops through may have
                # saved the buffer (a GAN's generator BatchNorm, whose output the generator's loss
                # uses after the discriminator's skipped step): its backward must not fail as
                # "modified by an inplace operation" (in training mode BatchNorm's backward reads
                # the batch statistics it saved, not the running ones)
                if src.shape == c.shape:
                    src.data.copy_(c)
                else:  # resized in place during the step (a fake-quant's first call): its shape goes back too
                    src.data = c.clone()
                names.append(name)
        return names

    def clear(self) -> None:
        self._slots = self._before = None
        self._src = []
        self._copy = []
        self._captured = self._armed = False


def moves_in_step(opt: torch.optim.Optimizer) -> bool:
    """Does ``opt`` write the weights between calls of its closure within one ``step()``?"""
    return isinstance(opt, torch.optim.LBFGS)


class StepBackup:
    """An optimizer's weights and state as they were when its ``step(closure)`` began.

    The state's tensors are copied (LBFGS writes ``prev_flat_grad`` in place); its lists are copied
    as lists (LBFGS appends to its history; the tensors in it are never written in place)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._opt = opt
        self._params = [p for g in opt.param_groups for p in g["params"]]
        with torch.no_grad():
            self._values = [p.detach().clone() for p in self._params]
            self._state = {p: {k: _copied(v) for k, v in st.items()} for p, st in opt.state.items()}

    def restore(self) -> None:
        """Put the weights and the state back, once (the optimizer's state dicts stay the same objects)."""
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self._params], self._values)
        state = self._opt.state
        for p in [p for p in state if p not in self._state]:
            del state[p]
        for p, st in self._state.items():
            now = state[p]
            now.clear()
            now.update(st)


def _copied(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return list(v) if isinstance(v, list) else v


def buffer_slots(root: nn.Module) -> list[tuple[dict[str, torch.Tensor | None], str, str]]:
    """Every buffer of ``root`` once: (its module's buffer dict, key, qualified name)."""
    out: list[tuple[dict[str, torch.Tensor | None], str, str]] = []
    seen: set[int] = set()
    for mname, m in root.named_modules():
        for bname, b in m._buffers.items():
            if b is None or id(b) in seen or b.is_meta:  # (a meta placeholder: no values to put back)
                continue
            seen.add(id(b))
            out.append((m._buffers, bname, f"{mname}.{bname}" if mname else bname))
    return out


def drop_grads(params: Iterable[torch.Tensor]) -> None:
    """Every gradient to ``None``: the next ``step()`` applies nothing."""
    for p in params:
        p.grad = None
