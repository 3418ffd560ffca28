"""``on_find="breakpoint"``: Python's ``breakpoint()`` inside a replay of the failing op.

After a hit, the failing call is replayed once more (inside ``faithful``, as compiled when it ran
compiled) with a dispatch mode that runs each op and, at the op that made the reported value (the
finding's op, producing a non-finite output from finite inputs), calls :func:`_stop` with locals
``finding`` (the :class:`~nanhunt.Finding`), ``op`` (the aten op: ``op(*args)`` runs it again),
``args`` and ``out``. ``breakpoint()`` honours ``PYTHONBREAKPOINT`` (``0`` turns it off). When no
replay can reach the op (backward, gradients, optimizer findings), it stops once with ``op=None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._finding import Finding
from .._steplog import StepView, Top
from .._tensors import Path
from .differential import _run_backward, _Scope
from .graph import node_of_frame
from .replay import faithful

__all__ = ["stop_at", "stop_for"]


def _stop(finding: Finding, op: Any, args: Any, out: Any) -> None:
    """The failing op, replayed: ``finding``, ``op``, ``args``, ``out`` are in scope."""
    breakpoint()  # noqa: T100 - on_find="breakpoint": the user asked for this


def _floats(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _creates(args: Any, kwargs: Any, out: Any) -> bool:
    """A non-finite output from finite inputs (0-dim literals such as a ``-inf`` fill aside)."""
    if not any(not bool(torch.isfinite(t).all()) for t in _floats(out)):
        return False
    return all(bool(torch.isfinite(t).all()) for t in _floats((args, kwargs)) if t.dim() or t.requires_grad)


class _StopMode(TorchDispatchMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled call runs its compiled artifact under this mode

    def __init__(self, finding: Finding, node: str | None = None) -> None:
        super().__init__()
        self.finding = finding
        self.want = finding.op if finding.op and finding.op.startswith("aten.") else None
        self.node = node
        self.stopped = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stopped or (self.want is not None and str(func) != self.want):
            return out
        if self.node is not None:
            n = node_of_frame()
            if n is None or n.name != self.node:
                return out
        if _creates(args, kwargs, out):
            self.stopped = True
            _stop(self.finding, func, args, out)
        return out


def stop_at(finding: Finding, top: Top | None = None, names: dict[nn.Module, str] | None = None,
            ordinal: int = 0, path: Path = (), *, compiled: Any = None, node: str | None = None,
            keep: Sequence[torch.Tensor] = (), grads: list[torch.Tensor | None] | None = None) -> bool:
    """Replay ``top`` and stop at the op that made ``finding``; ``True`` when that op was reached.
    ``grads``: a backward finding, replayed from the gradients that arrived at the outputs (the
    stop is at the first backward op that makes a non-finite value from finite ones). Without a
    replay to run (or when it does not reach the op), stop once with ``op=None``."""
    stopped = False
    if top is not None and names is not None and grads is not None:
        mode = _StopMode(finding)
        _run_backward(top, names, ordinal, path, grads, mode=mode)
        stopped = mode.stopped
    elif top is not None and names is not None:
        saved = [t.clone() for t in keep]
        mode = _StopMode(finding, node if compiled is not None else None)
        try:
            with faithful(top):
                if compiled is not None:
                    with mode:
                        compiled(*top.args, **(top.kwargs or {}))
                else:
                    with _Scope(names, ordinal, mode):
                        top.module(*top.args, **(top.kwargs or {}))
        except Exception:
            pass
        finally:
            with torch.no_grad():
                for t, v in zip(keep, saved):
                    t.copy_(v)
        stopped = mode.stopped
    if not stopped:
        _stop(finding, None, (), None)
    return stopped


def stop_for(view: StepView, f: Finding, where: tuple[str, int, int, Path] | None) -> bool:
    """The breakpoint for finding ``f`` of this step (``where`` as the analysis keeps it)."""
    if where is None or not view.replay:
        return stop_at(f)
    phase, top_i, ordinal, path = where
    top = view.log.tops[top_i]
    if phase == "backward":
        grads = [view.log.tensors[k].grad for k in top.out_keys]
        return stop_at(f, top, view.names, ordinal, path, grads=grads)
    if f.verdict == "compiler" and top.compiled is not None:
        return stop_at(f, top, view.names, ordinal, path, compiled=top.compiled,
                       node=f.reference.get("node"), keep=view.scratch)
    return stop_at(f, top, view.names, ordinal, path, keep=view.scratch)
