"""Tensor helpers every layer shares (a leaf: imports only torch).

- Output trees: walk any output structure (tensors, tuples, lists, dicts — Hugging Face
  ``ModelOutput`` is one —, namedtuples, dataclasses) down to its tensors, with a path a person
  can read (tuples of keys, formatted only when a finding needs them).
- Non-finite tests: :func:`is_checked`, :func:`is_bad`, :func:`element`, :func:`dtype_max`.
- Probes: :func:`probe` (one device-side sum, no host read), :func:`stack_probes`.
- A module's and an optimizer's own tensors: :func:`own_tensors`, :func:`optimizer_tensors`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from operator import attrgetter, methodcaller
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = [
    "add_chunked",
    "all_finite_cpu",
    "joined",
    "Path", "tensors", "format_path", "get_path", "is_checked", "is_bad", "version", "probe",
    "stack_probes", "element", "dtype_name", "dtype_max", "own_tensors", "optimizer_tensors", "local", "values",
    "strided", "same", "shape_of", "SPARSE", "GRAIN", "grain", "poison", "any_bad", "read_nan", "real_view",
    "storage_of", "sum_may_overflow",
]

_F32 = torch.float32
# ATen's at::internal::GRAIN_SIZE: a `cat`, `stack` or reduction of fewer elements runs on the
# calling thread; one of more wakes the intra-op thread pool, which costs more than a probe's work
GRAIN = 32768


def grain() -> int:
    """How many elements one probe's copy or reduction on the CPU may reach before it is cut in
    two (0: never cut; one intra-op thread, nothing to wake)."""
    return GRAIN if torch.get_num_threads() > 1 else 0
SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)

Path = tuple[Any, ...]
_LEAF = (str, bytes, int, float, bool)
_DEEP = 32  # levels walked by recursion (the usual output); deeper ones by `_deep`


def _children(obj: Any, path: Path) -> list[tuple[Any, Path]] | None:
    """The items of a container an output may be made of, with their paths (the order and paths
    of `tensors`); None for a leaf. (Exact types first: `tensors` calls it for every container.)"""
    tp = type(obj)
    if tp is tuple or tp is list:
        return [(v, (*path, i)) for i, v in enumerate(obj)]
    if tp is dict or isinstance(obj, dict):
        return [(v, (*path, k)) for k, v in obj.items()]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return [(getattr(obj, k), (*path, _Attr(k))) for k in obj._fields]
    if isinstance(obj, (tuple, list)):
        return [(v, (*path, i)) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(getattr(obj, f.name, None), (*path, _Attr(f.name))) for f in dataclasses.fields(obj)]
    return None


def tensors(obj: Any, path: Path = (), depth: int = 0) -> Iterator[tuple[Path, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in ``obj``, in a stable order (depth first, items
    in order), however deep it nests. (Collected at once, exact types tried before ``isinstance``:
    a replay over a few hundred modules spent more time here than in their forward.)"""
    tp = type(obj)
    if tp is torch.Tensor or (tp not in _PLAIN and isinstance(obj, torch.Tensor)):
        return iter(((path, obj),))
    out: list[tuple[Path, torch.Tensor]] = []
    _collect(obj, path, depth, out)
    return iter(out)


_LEAVES = frozenset((*_LEAF, type(None)))  # exact types that hold no tensor
_PLAIN = _LEAVES | {tuple, list, dict}  # exact types that are no tensor


def _collect(obj: Any, path: Path, depth: int, out: list[tuple[Path, torch.Tensor]]) -> None:
    """`tensors` of ``obj`` (not a tensor itself) appended to ``out``."""
    if type(obj) in _LEAVES or isinstance(obj, _LEAF):
        return
    if depth >= _DEEP:
        out.extend(_deep(obj, path))
        return
    for v, p in _children(obj, path) or ():
        tv = type(v)
        if tv is torch.Tensor or (tv not in _PLAIN and isinstance(v, torch.Tensor)):
            out.append((p, v))
        elif tv not in _LEAVES:
            _collect(v, p, depth + 1, out)


def _deep(obj: Any, path: Path) -> Iterator[tuple[Path, torch.Tensor]]:
    """`tensors` past `_DEEP` levels: an explicit stack (no recursion limit), and a container that
    holds itself is not entered again."""
    todo: list[tuple[Any, Path, int]] = [(obj, path, 0)]
    within: list[int] = []  # ids of the containers above the item
    while todo:
        x, p, depth = todo.pop()
        if isinstance(x, torch.Tensor):
            yield p, x
            continue
        if x is None or isinstance(x, _LEAF):
            continue
        del within[depth:]
        if id(x) in within:
            continue
        items = _children(x, p)
        if items:
            within.append(id(x))
            todo.extend((v, q, depth + 1) for v, q in reversed(items))


class _Attr(str):
    """A path step that is an attribute (namedtuple field, dataclass field)."""


def format_path(root: str, path: Path) -> str:
    out = root
    for k in path:
        if isinstance(k, _Attr):
            out += f".{k}"
        elif isinstance(k, str):
            out += f"[{k!r}]"
        else:
            out += f"[{k}]"
    return out


def get_path(obj: Any, path: Path) -> Any:
    for k in path:
        obj = getattr(obj, k) if isinstance(k, _Attr) else obj[k]
    return obj


# ------------------------------------------------------------------ non-finite tests
# packed 4-bit floats: no NaN/Inf to hold (e2m1), and no kernel to read them with
NO_SPECIALS = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


def is_checked(t: torch.Tensor) -> bool:
    """Only floating and complex tensors can hold NaN/Inf."""
    return (t.is_floating_point() or t.is_complex()) and t.dtype not in NO_SPECIALS


def is_bad(t: torch.Tensor | None) -> bool:
    """Does ``t`` hold a non-finite value? (Exact; reads the answer back to the host.)"""
    if t is None or not is_checked(t) or t.is_meta:  # (meta: no values)
        return False
    return not bool(torch.isfinite(values(t)).all())


def values(t: torch.Tensor) -> torch.Tensor:
    """The strided tensor that holds ``t``'s values: a sparse or nested tensor's values (flat: an
    element's index is then its place among them), a sharded tensor's local shard, else ``t``.
    A float8 tensor's values come as float32 (exact): most reductions have no float8 kernel."""
    return widen(strided(local(t)))


def widen(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as float32 (exact: most reductions and tests have no float8 kernel)."""
    return t.float() if t.dtype.itemsize == 1 and t.is_floating_point() else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, also for sparse tensors (a sparse buffer: torch.equal has no sparse kernel)."""
    if a.layout is torch.strided and b.layout is torch.strided:
        return torch.equal(a, b)
    if a.layout != b.layout or a.shape != b.shape:
        return False
    return torch.equal(a.to_dense(), b.to_dense())


def strided(t: torch.Tensor) -> torch.Tensor:
    """A sparse or nested tensor's values (flat); any other tensor as it is."""
    if t.is_nested or t.layout is not torch.strided:
        return t._values() if t.layout is torch.sparse_coo else t.values()
    return t


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's own shard (FSDP2 parameters, gradients and optimizer state are DTensors):
    judged where it lives. Reading a DTensor reduction would issue a collective on this rank alone."""
    if type(t).__name__ == "DTensor":
        return t.to_local().detach()  # type: ignore[attr-defined]
    return t


def version(t: torch.Tensor) -> int:
    """``t._version``; -1 for inference tensors (``torch.inference_mode``), which have no counter."""
    return -1 if t.is_inference() else t._version


def probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 tensor on ``t``'s device, outside autograd: non-finite iff ``t`` has a
    non-finite element (or, rarely, its finite values overflow the sum: every hit is re-checked
    exactly before it becomes a finding). Reads nothing back to the host."""
    t = values(t)
    if t.requires_grad:
        t = t.detach()  # cheaper than a no_grad context per call (a gradient, a no_grad output: none needed)
    if t.dtype is _F32:
        return t.sum()
    return probe_sum(t)


_WIDE = (torch.float64, torch.complex128)


def sum_may_overflow(t: torch.Tensor) -> bool:
    """Whether `probe` of ``t``'s finite values may pass its sum's range in some order of summing:
    the hot path's probe and a replay's sum of the same values (another kernel, another order) need
    not agree near the range's end (values of 1e35 in both signs). Reads the host: after a hit only."""
    v = real_view(values(t)).detach()
    if not v.numel():
        return False
    top = torch.finfo(torch.float64 if v.dtype in _WIDE else _F32).max
    return float(v.abs().amax()) * v.numel() > top


def probe_sum(t: torch.Tensor) -> torch.Tensor:
    """`probe` of a tensor that is not float32 (its values, detached): summed in float32, but a
    float64 tensor in float64, then 0 or NaN (``s - s``), so that its values past float32's range
    (1e40, finite in float64) are no alarm."""
    if t.dtype in _WIDE:
        s = real_view(t).sum()
        return (s - s).float()
    return real_view(t).sum(dtype=_F32)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as real numbers: a complex tensor as floats (last dimension: real,
    imaginary), a lazily conjugated one (a module returning ``x.conj()``) resolved first
    (``view_as_real`` refuses it); any other tensor as it is."""
    if not t.is_complex():
        return t
    return torch.view_as_real(t.resolve_conj() if t.is_conj() else t)


def poison(v: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on ``v``'s device: NaN iff ``v`` (probes, a float vector) holds a non-finite
    value, else 0. Each element is multiplied by 0 before the sum, so finite values never overflow
    into a false alarm. Two dispatches where ``~isfinite(v).all()`` is seven (``isfinite`` alone
    is abs, ne, eq, mul and a copy): the step's sync runs cold, after the model's own work."""
    return v.mul(0).sum()


def read_nan(p: torch.Tensor) -> bool:
    """Is the 0-dim ``p`` NaN? (One host read: a `poison`'s answer.)"""
    x = p.item()
    return x != x


def any_bad(v: torch.Tensor) -> bool:
    """Does the vector ``v`` hold a non-finite value? (One host read; see `poison`.)"""
    return read_nan(poison(v))


def stack_probes(ts: list[torch.Tensor]) -> torch.Tensor:
    """Stack 0-dim probes; probes on several devices (model parallel) meet on the first one."""
    try:
        return torch.stack(ts)
    except RuntimeError:
        dev = ts[0].device
        return torch.stack([t.to(dev) for t in ts])


_JOIN = 1 << 16  # elements: a smaller tensor is joined with others of its device and dtype (dispatch-bound)
_CHUNK = 1 << 22  # elements per joined chunk (16 MB of float32): the copy stays small beside any model


def add_chunked(groups: dict[Any, list[list[int]]], sizes: dict[Any, int], key: Any, i: int, n: int, cut: int) -> None:
    """Position ``i`` (of ``n`` elements) into the last chunk of ``groups[key]``; a new chunk when
    that one would reach ``cut`` elements (0: never)."""
    chunks = groups.setdefault(key, [[]])
    if cut and sizes.get(key, 0) + n >= cut:
        chunks.append([])
        sizes[key] = 0
    chunks[-1].append(i)
    sizes[key] = sizes.get(key, 0) + n


_CHECK_ALL = torch._amp_foreach_non_finite_check_and_unscale_
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowADInplaceOrView
_DENSE_TYPES = {torch.Tensor, torch.nn.Parameter}


def all_finite_cpu(ts: Sequence[torch.Tensor]) -> bool | None:
    """After a hit: are all of ``ts`` finite, judged in one dispatch (the kernel GradScaler unscales
    with, at an inverse scale of 1: each value written back as it was read, bit for bit, below
    autograd's in-place layer, no version moved; as the hot path's probes, `_record/probe.py`)?
    None when that cannot say: not all plain float32 CPU tensors, dense and not overlapping."""
    if (not ts or set(map(type, ts)) - _DENSE_TYPES or set(map(_DTYPE, ts)) != {torch.float32}
            or set(map(_LAYOUT, ts)) != {torch.strided} or any(map(_NESTED, ts)) or not all(map(_IS_CPU, ts))
            or not all(map(_CONTIGUOUS, ts)) or any(map(_INFERENCE, ts))):
        return None
    found = torch.zeros(())
    try:
        with torch.no_grad(), _BELOW_AUTOGRAD():
            _CHECK_ALL(list(ts), found, torch.ones(()))
    except RuntimeError:
        return None
    return not bool(found)


_DTYPE = attrgetter("dtype")
_LAYOUT = attrgetter("layout")
_NESTED = attrgetter("is_nested")
_IS_CPU = attrgetter("is_cpu")
_CONTIGUOUS = methodcaller("is_contiguous")
_INFERENCE = methodcaller("is_inference")


def joined(ts: Sequence[torch.Tensor]) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
    """After a hit: the small plain tensors of ``ts`` flattened and joined, a few per copy, for a
    reduction over many in one dispatch (the analysis's reads of every weight and state tensor of a
    small model were most of its cost: ~10 us each, one by one). Returns ``(chunks, rest)``:
    ``chunks`` as (positions in ``ts``, their values in one flat tensor), ``rest`` the positions
    not joined (large, sparse, nested, non-contiguous, sharded, complex or not floating)."""
    groups: dict[tuple[Any, ...], list[list[int]]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    rest: list[int] = []
    for i, t in enumerate(ts):
        n = t.numel()
        if (0 < n < _JOIN and t.layout is torch.strided and not t.is_nested and t.is_floating_point()
                and t.dtype.itemsize > 1 and t.is_contiguous() and not t.is_meta and local(t) is t):
            add_chunked(groups, sizes, (t.device, t.dtype), i, n, _CHUNK)
        else:
            rest.append(i)
    out = []
    with torch.no_grad():
        for cs in groups.values():
            for c in cs:
                out.append((c, torch.cat([ts[i].detach().reshape(-1) for i in c])))
    return out, rest


def element(t: torch.Tensor) -> tuple[tuple[int, ...] | None, float | None, dict[str, int]]:
    """First non-finite element (row-major), its value, and counts over the whole tensor.

    A sharded tensor (DTensor): the element of this rank's shard, at its index in the whole
    tensor; counts over the shard. A sparse tensor: the element at its dense index
    (``t.to_dense()[index]``, where a person looks), the first in row-major order however its values
    are stored (uncoalesced COO, CSR, BSR). A nested tensor: ``(component, *index within it)``
    (``t.unbind()[index[0]][index[1:]]``, also ``torch.nested.to_padded_tensor(t, 0)[index]``), the
    first in component order, row-major within it. Counts: over the stored values."""
    if t.is_nested:
        return _nested_element(t)
    if t.layout in SPARSE:
        return _sparse_element(t)
    offset = _shard_offset(t)
    with torch.no_grad():
        t = values(t).detach()
        if t.is_complex():
            parts = real_view(t)
            bad = ~torch.isfinite(parts)
            mask = bad.any(-1)
            vals = torch.where(bad[..., 0], parts[..., 0], parts[..., 1])
        else:
            mask = ~torch.isfinite(t)
            vals = t
        r = real_view(t)  # complex: both parts count
        counts = {
            "nan": int(torch.isnan(r).sum()),
            "+inf": int((r == math.inf).sum()),
            "-inf": int((r == -math.inf).sum()),
        }
        if t.dim() == 0:
            return ((), float(vals), counts) if bool(mask) else (None, None, counts)
        flat = mask.reshape(-1).nonzero()
        if flat.numel() == 0:
            return None, None, counts
        i = int(flat[0, 0])
        index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape))
        if offset is not None:
            index = tuple(a + b for a, b in zip(index, offset))
        return index, float(vals.reshape(-1)[i]), counts


def _nested_element(t: torch.Tensor) -> tuple[tuple[int, ...] | None, float | None, dict[str, int]]:
    with torch.no_grad():
        _, _, counts = element(values(t))
        try:
            parts = t.detach().unbind()
        except (RuntimeError, NotImplementedError):  # no unbind for this one: its place among the values
            index, value, _ = element(values(t))
            return index, value, counts
        for k, part in enumerate(parts):
            sub, value, _ = element(part)
            if sub is not None:
                return (k, *sub), value, counts
    return None, None, counts


def _sparse_element(t: torch.Tensor) -> tuple[tuple[int, ...] | None, float | None, dict[str, int]]:
    with torch.no_grad():
        try:
            coo = (t if t.layout is torch.sparse_coo else t.to_sparse_coo()).detach()
        except (RuntimeError, NotImplementedError):  # no conversion for this one: its place among the values
            return element(values(t))
        vals, idx = coo._values(), coo._indices()
        _, _, counts = element(vals)
        bad = (~torch.isfinite(vals)).reshape(vals.shape[0], vals.shape[1:].numel())  # a row per stored entry
        hits = bad.nonzero()
        if hits.numel() == 0:
            return None, None, counts
        sizes = coo.shape[:coo.sparse_dim()]
        strides = [sizes[d + 1:].numel() for d in range(len(sizes))]
        rows = hits[:, 0]
        at = (idx[:, rows] * torch.tensor(strides, dtype=idx.dtype, device=idx.device).unsqueeze(1)).sum(0)
        row = int(rows[int((at * bad.shape[1] + hits[:, 1]).argmin())])  # argmin: the first stored copy of a tie
        sub, value, _ = element(vals[row])
        return (*(int(x) for x in idx[:, row].tolist()), *(sub or ())), value, counts


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s shape as a finding reports it: a nested tensor's is its component count and each
    dimension's largest size (the shape of ``torch.nested.to_padded_tensor(t, 0)``, which its
    `element` index is an index of); any other tensor's, ``tuple(t.shape)`` (a sparse one's: dense)."""
    if not t.is_nested:
        return tuple(t.shape)
    try:
        parts = t.unbind()
    except (RuntimeError, NotImplementedError):
        return tuple(values(t).shape)
    if not parts:
        return (0,)
    return (len(parts), *(max(int(p.shape[d]) for p in parts) for d in range(parts[0].dim())))


def _shard_offset(t: torch.Tensor) -> tuple[int, ...] | None:
    if type(t).__name__ != "DTensor":
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
        return tuple(int(x) for x in offset)
    except Exception:  # another torch's layout: the shard's own index
        return None


def dtype_name(t: torch.Tensor) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(t.dtype).removeprefix("torch.")


def dtype_max(dtype: str) -> float | None:
    """The largest finite value of a floating dtype named like ``"float16"``; else None."""
    try:
        return float(torch.finfo(getattr(torch, dtype)).max)
    except (AttributeError, TypeError):
        return None


# ------------------------------------------------------------------ own tensors
def own_tensors(module: nn.Module, recurse: bool = True) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers, by name (not a lazy module's, until its first call gives
    them a shape: they hold no values)."""
    return [(n, t) for n, t in (*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse))
            if not is_lazy(t)]


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[list[tuple[torch.Tensor, str]], list[torch.Tensor]]:
    """Every floating parameter and state tensor of ``opt``: ``(param, state key or "")``, tensor.
    Not a frozen parameter (``requires_grad=False``: no gradient, no update; a mask kept as one)."""
    items: list[tuple[torch.Tensor, str]] = []
    tens: list[torch.Tensor] = []
    for g in opt.param_groups:
        for p in g["params"]:
            if is_lazy(p) or p.is_meta:
                continue  # (no values: a lazy module's before its first call, see own_tensors; a dry run's)
            if is_checked(p) and p.numel() and p.requires_grad:
                tens.append(p)
                items.append((p, ""))
            for sk, sv in opt.state.get(p, {}).items():
                if isinstance(sv, torch.Tensor) and sv.dim() > 0 and is_checked(sv) and not sv.is_sparse:
                    tens.append(sv)
                    items.append((p, sk))
    return items, tens


def storage_of(t: torch.Tensor) -> int:
    """Where ``t``'s elements live (a parameter, its ``.data``, a view of it: the same), 0 for a
    tensor without storage of its own (a subclass's wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0
