"""``watch(loader=DataLoader)``: the dataset indices of every batch the loop receives, and of the
rows of a finding's batch that hold non-finite values.

No device work and no sync: the loader's index sampler (``batch_sampler``, or ``sampler`` when
``batch_size=None``) is wrapped so that every index list it hands out is queued, and the loader's
iterator (made in ``loader._get_iterator``) gets a subclass whose ``__next__`` takes the queue's
front as the indices of the batch it is returning. Worker processes fetch ahead, but deliver in
order (``in_order=True``, the default), so the queue's order is the delivery order. Everything is
put back at ``close()``. A batch the loader did not deliver (``itertools.cycle(loader)``'s replays
of its first pass, a cached list) has no samples once a step worked on the last delivered one,
unless the call is given that batch's own tensors. A persistent workers' iterator from an earlier
epoch is subclassed at ``watch()`` (its next pass draws from the wrapped sampler). accelerate's
prepared loader (``DataLoaderShard``) iterates a DataLoader of its own (``base_dataloader``), one
batch ahead of what it yields (to know the last one): that loader is the one recorded, each batch
taken as received when the next one is fetched, or the pass ends. Not covered: any other iterator
made before ``watch()``, ``in_order=False``, iterable datasets (no indices).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._finding import Finding
from .._steplog import Chk, StepLog
from .._tensors import format_path, is_checked, real_view, tensors, version
from .outside import user_stacklevel

__all__ = ["LoaderIndices"]

Batch = tuple[int, ...]


class _Recording:
    """The loader's index sampler, queueing what it hands out."""

    def __init__(self, inner: Any, owner: LoaderIndices, single: bool) -> None:
        self._nanhunt_inner = inner
        self._nanhunt_owner = owner
        self._nanhunt_single = single

    def __iter__(self) -> Iterator[Any]:
        if self._nanhunt_owner._loader is None:  # closed: kept by a loader made from the watched one
            yield from self._nanhunt_inner  # (accelerate's prepare), which nanhunt cannot reach to put back
            return
        queue = self._nanhunt_owner.queue
        queue.clear()  # a new pass: whatever an abandoned iterator fetched ahead is gone
        self._nanhunt_owner.held = None
        single = self._nanhunt_single
        for b in self._nanhunt_inner:
            queue.append(_batch([b] if single else b))
            yield b

    def __len__(self) -> int:
        return len(self._nanhunt_inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nanhunt_inner, name)


def _batch(b: Any) -> Batch | None:
    try:
        out = tuple(int(i) for i in b)
    except (TypeError, ValueError):  # an iterable dataset's None, or keys that are not indices
        return None
    return out


_SUBCLASSES: dict[type, type] = {}


def _recording_iterator(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        def __next__(self: Any) -> Any:
            ref = getattr(self, "_nanhunt_indices", None)
            try:
                out = cls.__next__(self)  # type: ignore[attr-defined]
            except StopIteration:
                owner = ref() if ref is not None else None
                if owner is not None and owner.held is not None:  # accelerate yields the batch it held
                    owner.delivered(None, ended=True)
                raise
            owner = ref() if ref is not None else None
            if owner is not None:
                owner.delivered(out)
            return out

        sub = type(cls.__name__, (cls,), {"__next__": __next__, "__qualname__": cls.__qualname__,
                                          "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


class LoaderIndices:
    """Which dataset indices the loop's batches hold; see the module docstring."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader must be a torch.utils.data.DataLoader; got {type(loader).__name__}")
        base = loader.__dict__.get("base_dataloader")  # accelerate's prepared loader: see the module docstring
        self._ahead = isinstance(base, DataLoader)
        if isinstance(base, DataLoader):
            loader = base
        self.held: tuple[Batch | None, Any] | None = None  # (accelerate) fetched, not yet yielded to the loop
        self.queue: collections.deque[Batch | None] = collections.deque()
        self.last: Batch | None = None  # the batch the loop received last
        self._last_tensors: list[weakref.ref[torch.Tensor]] = []  # its tensors, as the loader returned them
        self._last_used = False  # a step that ended worked on it
        self._told = False  # warned that the loop's batches do not come through the loader's iterator
        self._tops: list[tuple[Batch | None, bool]] = []  # per top-level call of the step: the batch current then, and whether a step already worked on it
        self._loader: DataLoader[Any] | None = loader
        self._attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        self._inner = getattr(loader, self._attr)
        self._iters: weakref.WeakSet[Any] = weakref.WeakSet()
        object.__setattr__(loader, self._attr, _Recording(self._inner, self, single=self._attr == "sampler"))
        original = loader._get_iterator
        me = weakref.ref(self)

        def _get_iterator() -> Any:
            it = original()
            owner = me()
            if owner is not None:
                owner._record(it)
            return it

        loader._get_iterator = _get_iterator  # type: ignore[method-assign]
        it = loader.__dict__.get("_iterator")  # persistent workers' iterator of an earlier pass: the next
        if it is not None and it.__dict__.get("_index_sampler") is self._inner:  # pass resets it, made anew never
            it._index_sampler = loader._index_sampler  # (its pass draws from what it kept at its making)
            self._record(it)

    def _record(self, it: Any) -> None:
        it.__class__ = _recording_iterator(type(it))
        it._nanhunt_indices = weakref.ref(self)
        self._iters.add(it)

    def delivered(self, batch: Any = None, ended: bool = False) -> None:
        b = None if ended else self.queue.popleft() if self.queue else None
        if self._ahead:  # the loop receives the batch fetched before this one
            held, self.held = self.held, None if ended else (b, batch)
            if held is None:
                return
            b, batch = held
        self.last = b
        self._last_tensors = [weakref.ref(t) for _, t in tensors(batch)]
        self._last_used = False

    def top_started(self) -> None:
        """A top-level call of the watched model began: it works on the last batch received."""
        self._tops.append((self.last, self._last_used))

    def take(self, calls: Sequence[Any] = ()) -> list[Batch | None]:
        """The step ended: the batch of each of its top-level calls (``calls``: the step's `Top`s).
        A batch a step that ended already worked on is this call's only when the call was given
        that batch's own tensors (the same batch trained on again, by position or keyword):
        batches the loader did not deliver (``itertools.cycle(loader)`` replays its first pass, a
        cached list, synthetic ones) were named by the rows of the last batch it did deliver."""
        tops, self._tops = self._tops, []
        if self.last is None and not self._told and any(b is not None for b in self.queue):
            self._told = True  # its sampler handed out batches that no iterator of its delivered
            warnings.warn(
                "nanhunt.watch(loader=...): the loop's batches do not come from that DataLoader's own "
                "iterator, though its sampler is drawn from (accelerate's prepare() makes a loader of its own "
                "from it): Finding.samples stays empty. Give watch() the loader the loop iterates (the "
                "prepared one).", UserWarning, stacklevel=user_stacklevel())
        mine = {id(t) for r in self._last_tensors if (t := r()) is not None}
        out: list[Batch | None] = []
        for i, (batch, used) in enumerate(tops):
            if batch is not None and used and batch is self.last:
                top = calls[i] if i < len(calls) else None
                given = tensors((top.args, top.kwargs or {})) if top is not None else ()
                if not any(id(t) in mine for _, t in given):
                    batch = None  # unknown: no samples, rather than another batch's rows
            out.append(batch)
        last = self.last
        if last is not None and any(b is last for b, _ in tops):
            self._last_used = True
        return out

    def close(self) -> None:
        loader, self._loader = self._loader, None
        if loader is None:
            return
        if isinstance(loader.__dict__.get(self._attr), _Recording):
            object.__setattr__(loader, self._attr, self._inner)
        if "_get_iterator" in loader.__dict__:
            del loader._get_iterator
        for it in list(self._iters):
            sampler = it.__dict__.get("_index_sampler")
            if isinstance(sampler, _Recording) and sampler._nanhunt_owner is self:
                it._index_sampler = self._inner  # (a persistent iterator lives on: made while watched, it kept ours)
            base = type(it).__mro__[1]
            if _SUBCLASSES.get(base) is type(it):
                it.__class__ = base
            it.__dict__.pop("_nanhunt_indices", None)
        self._iters = weakref.WeakSet()
        self.queue.clear()
        self._tops.clear()
        self.held = None
        self._inner = None

    # ------------------------------------------------------------------ after a hit
    def fill(self, found: Sequence[Finding], log: StepLog, tops: list[Batch | None],
             born: Sequence[tuple[int, list[int]] | None] = (),
             born_tops: Sequence[int | None] = ()) -> list[Finding]:
        """``Finding.samples`` for the findings of one step (host reads allowed: after a hit);
        ``born``: per finding, the rows of the op that created its value (`StepView.born_rows`);
        ``born_tops``: per finding, the top-level call that made it (`StepView.born_tops`)."""
        born = born if len(born) == len(found) else [None] * len(found)
        born_tops = born_tops if len(born_tops) == len(found) else [None] * len(found)
        last = self.last
        delivered = [t for r in self._last_tensors if (t := r()) is not None]  # (the last batch's own tensors,
        return [_with_samples(f, log, tops, b, t, last, delivered)  # its targets too, not only what the model got)
                for f, b, t in zip(found, born, born_tops)]


def _with_samples(f: Finding, log: StepLog, tops: list[Batch | None],
                  born: tuple[int, list[int]] | None = None, top: int | None = None,
                  last: Batch | None = None, delivered: Sequence[torch.Tensor] = ()) -> Finding:
    """``last``, ``delivered``: the batch the loop received last and its tensors as the loader
    returned them (a loss fed a NaN target: the rows of the batch that hold it are the samples)."""
    if f.phase not in ("forward", "backward", "check") or not tops:
        return f
    # the micro-batch the analysis placed it in (a backward's, a sentinel forward's), else by the log
    ti = top if top is not None and 0 <= top < len(tops) else _top_of(f, log, len(tops))
    batch = tops[ti]
    if not batch:
        return f
    n = len(batch)
    inputs = [t for _, t in tensors(log.tops[ti].args)] if ti < len(log.tops) else []
    if f.cause == "parameter":  # poisoned weights made it, not a sample: only rows whose own input held one
        rows = _bad_rows(inputs, n)
        return dataclasses.replace(f, samples=tuple(batch[r] for r in rows if r < n)) if rows else f
    if n == 1:  # a batch of one sample (or batch_size=None): whatever it made is its
        return dataclasses.replace(f, samples=batch)
    if not f.shape or f.shape[0] != n:  # (a loss's scalar): fed a value of the batch's own (its targets)
        rows = _bad_rows(list(delivered), n) if f.cause == "input" and batch is last else []
        return dataclasses.replace(f, samples=tuple(batch[r] for r in rows if r < n)) if rows else f
    rows = _bad_rows(inputs, n)
    if not rows and born is not None and born[0] == n:  # the rows whose values its op made non-finite:
        rows = born[1]  # the reported tensor may be past a BatchNorm or a mean that mixed every row in
    if not rows:
        t = _tensor_of(f, log)
        rows = _bad_rows([t] if t is not None else [], n)
    if not rows and f.index:
        rows = [f.index[0]]
    return dataclasses.replace(f, samples=tuple(batch[r] for r in rows if r < n))


def _top_of(f: Finding, log: StepLog, n_tops: int) -> int:
    if f.phase == "forward":
        for c in log.calls:
            if c.name == f.module and c.call == f.call and c.top < n_tops:
                return c.top
    return n_tops - 1


def _tensor_of(f: Finding, log: StepLog) -> torch.Tensor | None:
    """The finding's own tensor when the log still holds it (a checked tensor, a live output)."""
    if f.phase == "check":
        chk = [m.tensor for m in log.meta if isinstance(m, Chk) and m.name == f.module]
        return chk[f.call] if f.call < len(chk) else None
    if f.phase == "forward":
        for c in log.calls:
            if c.name == f.module and c.call == f.call:
                for path, (ref, ver) in zip(c.paths, c.outs):
                    if format_path("output", path) == f.tensor:
                        t = ref()
                        return t if t is not None and version(t) == ver else None
    return None


def _bad_rows(ts: list[torch.Tensor], n: int) -> list[int]:
    """Rows (leading index) holding a non-finite value, over the tensors whose leading dimension is ``n``."""
    bad: torch.Tensor | None = None
    with torch.no_grad():
        for t in ts:
            if not is_checked(t) or t.dim() == 0 or t.shape[0] != n or t.is_meta:
                continue
            r = t.detach()
            r = real_view(r)
            rb = (~torch.isfinite(r)).reshape(n, -1).any(1).cpu()
            bad = rb if bad is None else (bad | rb)
    return [] if bad is None else bad.nonzero().flatten().tolist()
