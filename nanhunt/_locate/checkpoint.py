"""Checkpoints as data: every tensor of a saved object with its key path, and the finding for one
non-finite tensor (imports only the leaves).

Shared by the save guard (`_record/guard.py`), `audit` (`audit.py`) and `damage` (`damage.py`).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import types
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._finding import Finding
from .._tensors import (
    SPARSE,
    all_finite_cpu,
    dtype_name,
    element,
    is_bad,
    is_checked,
    joined,
    local,
    probe,
    real_view,
    shape_of,
    values,
)

__all__ = ["Keys", "Entry", "TensorKey", "walk", "key_path", "first_bad", "all_bad", "finding", "refused_global", "unreadable",
           "judgeable", "safe_load", "SPARSE", "zip_bomb"]

Keys = tuple[Any, ...]
# (key path, tensor, inside the "state" of something shaped like an optimizer's state_dict)
Entry = tuple[Keys, torch.Tensor, bool]

class Attr(str):
    """A key that is an attribute name (an object's field): ``.model`` in a key path."""


class TensorKey(str):
    """A key that is a tensor (a dict keyed by parameters: ``optimizer.state``), by what names it:
    ``[<fc1.weight>]``, never its values (its repr is the whole tensor)."""


def key_path(keys: Keys) -> str:
    """``['model']['fc.weight']``: how a person indexes the saved object (``.model['fc.weight']`` for
    a dataclass's field, ``[<Parameter (16, 6)>]`` for a tensor key); a bare tensor is ``<tensor>``."""
    parts = [f".{k}" if isinstance(k, Attr) else f"[<{k}>]" if isinstance(k, TensorKey)
             else f"[<{type(k).__name__} {tuple(k.shape)}>]" if isinstance(k, torch.Tensor) else f"[{k!r}]"
             for k in keys]
    if len(parts) > 2 * _KEYS_SHOWN:  # a hostile file nests 20,000 levels: the two ends say where
        parts = [*parts[:_KEYS_SHOWN], f"…{len(parts) - 2 * _KEYS_SHOWN} levels…", *parts[-_KEYS_SHOWN:]]
    return "".join(parts) or "<tensor>"


_KEYS_SHOWN = 16


def _fields(o: Any) -> list[tuple[str, Any]] | None:
    """An object's own fields, as pickle saves them (``__dict__``, then ``__slots__``): a dataclass,
    a ``SimpleNamespace``, a trainer's state object. None for classes, functions, Python modules."""
    if isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return None
    out: list[tuple[str, Any]] = []
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        out += [(k, v) for k, v in d.items() if isinstance(k, str)]
    for cls in type(o).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(o, name):
                out.append((name, getattr(o, name)))
    return out or None


def _is_optimizer_state(d: Mapping[Any, Any]) -> bool:
    return isinstance(d.get("state"), Mapping) and isinstance(d.get("param_groups"), (list, tuple))


def walk(obj: Any, limit: int | None = None) -> Iterator[Entry]:
    """Every tensor of ``obj`` (dicts, lists, tuples, an object's fields; a module as its
    parameters and buffers by qualified name, an optimizer as its state, both as their state dicts
    key them, without calling ``state_dict()``: no hook of the user's, no collective of a sharded
    model), in a stable order (depth first, as the object is laid out); each container is visited
    once (no cycles), however deep the nesting (an explicit stack: no recursion limit, no depth
    past which a tensor would go unseen). A container whose items cannot be read (a property or a
    mapping that raises) is passed over, the rest walked. ``limit``: stop after that many items (a
    lazy mapping of a billion keys)."""
    held: dict[int, Any] = {}  # containers visited; kept alive so that no id is reused meanwhile
    # an item's key path as a link to its container's, made a tuple only for a tensor: a tuple per
    # item made a file nesting lists 40,000 deep cost 23 s (80,000: out of memory)
    stack: list[Iterator[tuple[Chain, Any, bool]]] = [iter(((None, obj, False),))]
    made: tuple[Chain, Keys] = (None, ())  # the last container whose key path was made a tuple: its siblings share it
    seen = 0
    while stack:
        try:
            item = next(stack[-1], None)
        except Exception:  # a container whose items cannot be read (a mapping that raises): the rest is walked
            item = None
        if item is None:
            stack.pop()
            continue
        seen += 1
        if limit is not None and seen > limit:
            return
        chain, o, optim = item
        if isinstance(o, torch.Tensor):
            if chain is None:
                yield (), o, optim
                continue
            if chain[0] is not made[0]:
                made = (chain[0], _keys(chain[0]))
            yield (*made[1], chain[1]), o, optim
            continue
        if o is None or isinstance(o, (str, bytes, int, float, bool)):
            continue
        if id(o) in held:
            continue
        try:
            if isinstance(o, nn.Module):
                o = {**dict(o.named_parameters(remove_duplicate=False)),
                     **dict(o.named_buffers(remove_duplicate=False))}
            elif isinstance(o, torch.optim.Optimizer):
                o = {"state": dict(enumerate(o.state.values())), "param_groups": []}
            children = _children(o, chain, optim)
        except Exception:  # an object whose fields cannot be read (a ``__dict__`` property that raises)
            continue
        if children is not None:
            held[id(o)] = o
            stack.append(children)


# a key path as links: None for the object itself, else (its container's chain, its key there)
Chain = Any


def _keys(chain: Chain) -> Keys:
    out = []
    while chain is not None:
        chain, k = chain
        out.append(k)
    return tuple(reversed(out))


def _children(o: Any, chain: Chain, optim: bool) -> Iterator[tuple[Chain, Any, bool]] | None:
    """What :func:`walk` visits inside ``o``, in order (lazily); None when ``o`` holds nothing to walk."""
    if isinstance(o, Mapping):
        state = _is_optimizer_state(o)
        return (((chain, k), v, optim or (state and k == "state")) for k, v in o.items())
    if isinstance(o, (list, tuple)):
        return (((chain, i), v, optim) for i, v in zip(itertools.count(), o))
    fields = _fields(o)
    return iter([((chain, Attr(k)), v, optim) for k, v in fields]) if fields else None


MAX_RATIO, MAX_FREE = 64, 1 << 28  # torch.save stores its records uncompressed: a ratio of about 1


def zip_bomb(path: str) -> str | None:
    """Why ``path`` must not be loaded, when it is a zip archive whose records inflate far past the
    file's own size (a zip bomb: 1 MB that loads as 1 GiB of zeros; torch.load would materialise
    every byte of them); else None (also for what is no zip: the loader says what it is)."""
    try:
        with zipfile.ZipFile(path) as z:
            total = sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    size = os.path.getsize(path)
    if total <= max(MAX_RATIO * size, MAX_FREE):
        return None
    return (f"its records inflate to {total:,} bytes from a {size:,}-byte file (torch.save stores them "
            "uncompressed); nothing was loaded")


def safe_load(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, every sparse tensor's invariants checked
    as it loads: a crafted sparse tensor (indices past its shape, a CSR's row pointers past its
    values) otherwise loads and then reads or writes out of bounds (a crash of the process, not an
    error). The loader's own warnings are silenced: the caller's error says it all."""
    with warnings.catch_warnings(), torch.sparse.check_sparse_tensor_invariants():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def judgeable(t: torch.Tensor) -> bool:
    """Floating, with elements, dense, sparse or nested (a sparse or nested tensor is judged by its
    stored values: a checkpoint's sparse embedding holds its NaN there; a jagged nested tensor's
    layout is neither strided nor sparse)."""
    return (not is_lazy(t) and is_checked(t) and (t.layout is torch.strided or t.layout in SPARSE or t.is_nested)
            and not t.is_meta and t.numel() > 0)


# ------------------------------------------------------------------ views that read an element many times
# A view's elements may outnumber its storage: a stride of 0 (``expand``) or overlapping strides.
# A crafted file of 1 KB holds a 10**9 x 10**9 view of one float: 10**18 elements to sum. Such a
# view is judged by the storage span it reaches, each offset weighted by how many of its elements
# read it: work and memory in the span's length, never in the view's elements.
def _span(t: torch.Tensor) -> torch.Tensor | None:
    """The storage a strided view reaches (flat, from its first element) when the view reads some
    element of it more than once; None for any other tensor (no more elements than its storage)."""
    if t.is_nested or t.layout is not torch.strided or local(t) is not t or t.numel() == 0:
        return None
    length = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.detach().as_strided((length,), (1,)) if t.numel() > length else None


def _reads(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(span, n)``: `_span`, and how many of the view's elements read each of its offsets."""
    span = _span(t)
    if span is None:
        return None
    n = torch.ones(1, dtype=torch.int64, device=t.device)
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        n = _spread(n, size, stride)
    return span, n


def _spread(n: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """How many elements read each offset, one dimension out: ``n`` added to itself shifted by
    ``stride``, ``2 * stride``, ... (a window of ``size`` along each residue class: one cumsum)."""
    if stride == 0:
        return n * size
    length = len(n) + (size - 1) * stride
    out = n.new_zeros(-(-length // stride) * stride)
    out[:len(n)] = n
    sums = out.view(-1, stride).cumsum(0)
    sums[size:] -= sums[:-size].clone()
    return sums.view(-1)[:length]


def _first_read(t: torch.Tensor, bad: torch.Tensor) -> tuple[int, ...]:
    """The first index (row-major) of the view ``t`` whose element is at a ``bad`` offset of its
    span (a mask over the offsets it reads), one dimension at a time: the least index along it from
    which the inner dimensions still reach a bad offset."""
    dims = list(zip(t.shape, t.stride()))
    reach = [torch.ones(1, dtype=torch.bool, device=bad.device)]  # reach[k]: the offsets dimensions k+1... reach
    for size, stride in reversed(dims[1:]):
        reach.append(_spread(reach[-1].long(), size, stride) > 0)
    index: list[int] = []
    for (size, stride), inner in zip(dims, reversed(reach)):
        i = 0
        if stride:  # per bad offset: the nearest offset inner reaches at or below it, by its residue class
            rows = -(-len(bad) // stride)
            at = bad.new_zeros(rows * stride)
            at[:len(inner)] = inner
            row = torch.arange(rows, device=bad.device).unsqueeze(1)
            last = torch.where(at.view(rows, stride), row, -1).cummax(0).values
            hits = bad.nonzero().squeeze(1)
            i = int((hits // stride - last.view(-1)[hits]).min())
        index.append(i)
        bad = bad[i * stride:i * stride + len(inner)] & inner
    return tuple(index)


def _is_bad(t: torch.Tensor) -> bool:
    reads = _reads(t)
    if reads is None:
        return is_bad(t)
    span, n = reads
    return bool((~torch.isfinite(values(span)) & (n > 0)).any())


def _element(t: torch.Tensor) -> tuple[tuple[int, ...] | None, float | None, dict[str, int]]:
    """`element`, for a view that reads an element many times too (counts: over all its elements)."""
    reads = _reads(t)
    if reads is None:
        return element(t)  # a sparse tensor's at its dense index, a nested one's as (component, ...)
    span, n = reads
    with torch.no_grad():
        vals = values(span)
        bad = ~torch.isfinite(vals) & (n > 0)
        r = real_view(vals)  # complex: both parts count
        w = n.view(-1, *([1] * (r.dim() - 1)))
        counts = {"nan": int((torch.isnan(r) * w).sum()), "+inf": int(((r == math.inf) * w).sum()),
                  "-inf": int(((r == -math.inf) * w).sum())}
        if not bool(bad.any()):
            return None, None, counts
        index = _first_read(t, bad)
        return index, element(t[index])[1], counts


def all_bad(ts: list[torch.Tensor]) -> list[int]:
    """Indices of the non-finite tensors: one fused probe and one read, then exact checks of the
    hits. Small plain tensors are judged a few thousand at a time (`joined`: one copy and check per
    chunk), the others one probe each."""
    if all_finite_cpu(ts):  # (a small model's grads or state on the CPU: one dispatch, no walk)
        return []
    idx = [i for i, t in enumerate(ts) if judgeable(t)]
    if not idx:
        return []
    chunks, rest = joined([ts[i] for i in idx])
    with torch.no_grad():
        checks = [~torch.isfinite(flat).all() for _, flat in chunks]  # (exact: no sum to overflow)
        checks += [~torch.isfinite(probe(_probed(ts[idx[j]]))) for j in rest]
        flags = torch.stack(checks).tolist() if checks else []
    out = [idx[j] for (c, flat), f in zip(chunks, flags) if f for j, b in zip(c, _each_bad(flat, [ts[idx[j]] for j in c])) if b]
    out += [idx[j] for j, f in zip(rest, flags[len(chunks):]) if f and _is_bad(ts[idx[j]])]
    return sorted(out)


def _each_bad(flat: torch.Tensor, ts: list[torch.Tensor]) -> list[bool]:
    """Which of ``ts``, joined as ``flat``, hold a non-finite value: their counts, as differences
    of one running count at their ends (one read, however many: a NaN loss's every gradient)."""
    with torch.no_grad():
        ends = torch.tensor([t.numel() for t in ts], device=flat.device).cumsum(0)
        running = torch.cat([flat.new_zeros(1, dtype=torch.long), (~torch.isfinite(flat)).cumsum(0)])
        at = running[ends]
        return (at - torch.cat([at.new_zeros(1), at[:-1]]) > 0).tolist()


def _probed(t: torch.Tensor) -> torch.Tensor:
    """What `probe` sums for ``t``: a view that reads an element many times, its span (all of it:
    an offset it skips may hold a NaN, which the exact check then passes over)."""
    span = _span(t)
    return t if span is None else span


def first_bad(ts: list[torch.Tensor]) -> int | None:
    bad = all_bad(ts)
    return bad[0] if bad else None


def finding(file: str, keys: Keys, t: torch.Tensor, *, step: int, hint: str, rank: int | None = None) -> Finding:
    """A ``"checkpoint"`` finding: ``module`` the file, ``tensor`` the key path."""
    index, value, counts = _element(t)
    return Finding(
        phase="checkpoint", module=file, module_type="checkpoint", tensor=key_path(keys), step=step,
        call=0, index=index, value=value, counts=counts, shape=shape_of(t), dtype=dtype_name(t),
        cause="unknown", rank=rank, hint=hint,
    )


# ------------------------------------------------------------------ why torch.load(weights_only=True) failed
_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torch's advice to load the file unsafely, or to allow-list what it names: never passed on
_ADVICE = ("weights_only", "Re-running", "will likely succeed", "add_safe_globals", "safe_globals", "trusted source",
           "file an issue", "Check the documentation")


def refused_global(e: BaseException) -> str | None:
    """The global (``posix.system``, ``builtins.eval``) a weights-only load refused, if that is why it failed."""
    m = _GLOBAL.search(str(e))
    return m.group(1) if m else None


def _reason(e: BaseException) -> str:
    """torch's own reason in one short line, without its advice to load the file unsafely."""
    if isinstance(e, KeyError):  # the legacy loader's lookup of an unknown pickle id: a bare number
        return ""
    if isinstance(e, EOFError):
        return "it ends too early"
    said = _ANSI.sub("", str(e)).rpartition("WeightsUnpickler error:")[2]
    for line in said.splitlines():
        line = line.strip()
        if line and not any(a in line for a in _ADVICE):
            line = line.split(". ")[0].rstrip(".")  # the first sentence: miniz's page of guesses is cut
            return line if len(line) <= 160 else line[:157] + "..."
    return ""


def unreadable(path: str, e: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed with ``e``, in words, for a file that holds no
    refused global (`refused_global`): from the file's first bytes and torch's reason, never its advice."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as oe:
        return f"it cannot be read ({oe.strerror or oe})"
    if not head:
        return "it is empty"
    why = _reason(e)
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip
        if not zipfile.is_zipfile(path):
            return "it is truncated or corrupted (a zip file as torch.save writes, but cut short or damaged)"
        return "it is a zip file torch cannot read" + (f" ({why})" if why else "")
    if head.startswith(b"\x80"):  # a pickle (torch.save's legacy format)
        return "it is a pickle that a weights-only load cannot read" + (f" ({why})" if why else "")
    if head.lstrip()[:1] in (b"{", b"["):
        return "it looks like a JSON file (a nanhunt report? `nanhunt show " + os.path.basename(path) + "`)"
    return "it is neither a zip file written by torch.save nor a pickle"
