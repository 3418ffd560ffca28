"""Checks inside `torch.compile` graphs: a branch-free write into a device buffer.

Inside a compiled graph the module hooks are traced. A data-dependent branch or a Python list
append there would break the graph, so each watched module gets a slot of a device buffer, assigned
before tracing, and the traced hook only adds its outputs' probe sums into it. The step's sync
reads the buffer with everything else.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._steplog import CompiledSlots
from .._tensors import is_checked, probe, tensors

__all__ = ["CompiledChecks", "CompiledRoot", "forget_compiled"]


class CompiledChecks:
    """One slot per watched module, assigned before any graph is traced (:meth:`assign`): the traced
    hook only reads the slot map, so the graph's guards hold from its first call (a slot added while
    tracing made dynamo retrace every compiled frame once more on its second call). A module's
    outputs add into its one slot; the finding names the module (the replay names the output)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buf = torch.zeros(1, device=self.device)
        self.meta: list[tuple[str, str, Any]] = []  # per slot: module name, class name, output path ()

    def assign(self, names: dict[Any, str | None]) -> dict[Any, int | None]:
        """Slots for the watched modules (module -> name, None when ignored), in ``names``' order
        (``named_modules``: parents before children); returns module -> slot (None: unchecked)."""
        slots: dict[Any, int | None] = {}
        meta: list[tuple[str, str, Any]] = []
        for m, name in names.items():
            if name is None:
                slots[m] = None
            else:
                slots[m] = len(meta)
                meta.append((name, type(m).__name__, ()))
        self.meta = meta
        self.buf = torch.zeros(max(len(meta), 1), device=self.device)
        return slots

    def record(self, slot: int, output: Any) -> None:
        buf = self.buf
        for _, t in tensors(output):
            if is_checked(t) and t.device == buf.device:
                with torch.no_grad():
                    buf[slot].add_(_flag(t))

    def drain(self) -> tuple[torch.Tensor, CompiledSlots] | None:
        """This step's slots (for the sync), and a zeroed buffer for the next step. No host read."""
        if not self.meta:
            return None
        values = self.buf[: len(self.meta)].clone()
        self.buf.zero_()
        return values, CompiledSlots(list(self.meta))


def _flag(t: torch.Tensor) -> torch.Tensor:
    """inf when ``t`` holds a NaN/Inf, else 1 (the reciprocal of "all finite?"): exact, where a sum
    also overflows for finite values (3e38s), which no eager replay then reproduces; fused into the
    graph's kernels like a sum, and no non-finite constant in the graph. (Not ``(t * 0).sum()``:
    Inductor folds a product with 0 to 0, and the check saw nothing.)"""
    if t.layout != torch.strided or t.is_complex():
        return probe(t)
    if t.dtype.itemsize == 1:
        t = t.float()  # float8: no isfinite kernel
    return torch.isfinite(t).all().to(torch.float32).reciprocal()


class CompiledRoot:
    """``model.compile()``: the model's own hooks run inside its compiled ``_call_impl`` (traced),
    so no hook sees the top-level call eagerly. This wraps the instance's ``_compiled_call_impl``
    so that ``begin(model, args, kwargs, compiled)`` and ``end(model, args, kwargs, output)`` run
    around it, eagerly. ``remove()`` takes the wrapper out of the chain (two hunts on one model
    close in any order) and leaves a ``_compiled_call_impl`` the user set meanwhile alone."""

    def __init__(self, model: Any, begin: Any, end: Any) -> None:
        self.model = model
        self.orig = model._compiled_call_impl  # what this wrapper calls (another hunt's wrapper, or the user's)
        compiled = _users(self.orig)
        me = self

        def call(*args: Any, **kwargs: Any) -> Any:
            begin(model, args, kwargs, compiled)
            try:
                out = me.orig(*args, **kwargs)
            except BaseException:
                end(model, args, kwargs, None)
                raise
            end(model, args, kwargs, out)
            return out

        call.__nanhunt_root__ = self  # type: ignore[attr-defined]
        self.call = call
        model._compiled_call_impl = call

    def remove(self) -> None:
        model = self.model
        if model is None:
            return
        cur = model.__dict__.get("_compiled_call_impl")
        if cur is self.call:
            model._compiled_call_impl = self.orig
        else:  # another hunt wrapped ours: the wrapper that calls ours calls what ours called
            while cur is not None:
                outer = getattr(cur, "__nanhunt_root__", None)
                if outer is None:
                    break
                if outer.orig is self.call:
                    outer.orig = self.orig
                    break
                cur = outer.orig
        self.model = self.orig = None


def _users(fn: Any) -> Any:
    """The user's compiled call under any nanhunt wrappers (what a verdict replays)."""
    while getattr(fn, "__nanhunt_root__", None) is not None:
        fn = fn.__nanhunt_root__.orig
    return fn


def forget_compiled() -> None:
    """Make torch.compile retrace: graphs compiled without (or with) our hooks must not run on."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    from torch._dynamo.utils import counters

    if counters["stats"]["unique_graphs"]:
        dynamo.reset()
