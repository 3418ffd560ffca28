"""Op-level origin of a finding, by a second faithful replay under a ``TorchDispatchMode``.

Runs only after a hit, on the one top-level call that failed, so host reads are allowed here.

Forward: the call is replayed inside :func:`nanhunt._replay.faithful` with a dispatch mode that,
while the reported module call is running, records every aten op: which tensor each floating input
came from (the op that last wrote it), and where each output is non-finite (a small code per
element: nan, +inf, -inf). From the reported element of the reported output we walk back, op by op,
through inputs that are non-finite *at the element that matters* (exactly for pointwise ops, the
selected branch of ``where`` / ``masked_fill``; the same row otherwise), until an op whose relevant
inputs were all finite: that op created the value. Non-finite values that never reach the reported
element (a ``-inf`` mask consumed by a softmax that stays finite, the untaken branch of
``torch.where``) are never on that path, so they are never blamed.

Backward: the forward is replayed with grad enabled; each autograd node is mapped to the forward
line whose op created it; the backward is run through ``torch.autograd.grad`` (nothing touches
``.grad``) with a hook on every node of the graph recording whether the gradients it received were
finite and the gradients it produced were not. The creator is the node that produced a non-finite
gradient from finite ones (``SqrtBackward0``, not the consumer that turned its ``inf`` into ``nan``).
Inside a custom ``autograd.Function`` backward, the aten op that made the value is found the same
way as in forward and put first in the chain.

Nothing is left behind: modes, module hooks and node hooks are removed in ``finally``, the RNG and
buffers are restored by ``faithful``, and any failure returns ``None``.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._hooks import ReplayHooks
from .._steplog import Top
from .._tensors import Path, get_path, is_bad, tensors, version, widen
from . import hints as _hints
from .replay import faithful

__all__ = ["OpOrigin", "locate_forward", "locate_backward", "python_backward"]


@dataclass
class OpOrigin:
    op: str  # "aten.exp.default" in forward, "SqrtBackward0" in backward
    source: str | None  # "path/to/file.py:LINE" of the user's code
    chain: list[str] = field(default_factory=list)  # "op @ file.py:LINE", oldest first
    facts: dict[str, Any] = field(default_factory=dict)  # the numbers a hint is chosen from (hints.facts)


# the nodes whose backward hands a masked-out element a zero gradient: a NaN made from that zero
# (0 * inf in the masked branch's own backward) is the `where` trap (hints.DOUBLE_WHERE)
_SELECT = ("WhereBackward", "MaskedFillBackward", "IndexPutBackward", "MaskedScatterBackward")
_TRAP_DEPTH = 4  # (nodes between the where and the unsafe op: ``torch.where(c, y * torch.log(x) - x, 0)``)


def where_trap(fn: Any, ran: list[Any], zeroed: tuple[int, int] | None, dropped: dict[Any, torch.Tensor]) -> bool:
    """Is the non-finite gradient autograd node ``fn`` made the torch.where trap? A where or
    masked_fill (a node of ``ran``, those that executed), directly on its output or a few nodes
    above it, dropped the element ``fn`` made the value at: ``zeroed`` (`zero_fed`) is where ``fn``
    was given a 0 gradient and made a non-finite one (0 * inf), ``dropped`` each where's `dropped`
    mask; a 0 that came from elsewhere (a saturated softmax's) is no trap, nor an element the where
    kept (``torch.sqrt(d).masked_fill(pad, 0)`` at a d of 0 that is not padding: the sqrt's own
    infinite gradient). As in ``torch.where(p > 0, p * torch.log(p), 0)`` or ``(2 * x.log()).masked_fill(...)``."""
    if zeroed is None:
        return False
    level, seen = [fn], {fn}
    for depth in range(_TRAP_DEPTH):
        level = [f for f in ran if f not in seen and any(n is x for n, _ in f.next_functions for x in level)]
        for f in level:
            if not f.name().startswith(_SELECT):
                continue
            m = dropped.get(f)
            if m is None or m.numel() != zeroed[1]:
                if depth == 0:
                    return True  # (a broadcast where on fn's output: no mask element for element; the 0 is its)
                continue
            if bool(m.reshape(-1)[zeroed[0]]):
                return True
        if not level:
            return False
        seen.update(level)
    return False


def pow_exponent(fn: Any) -> dict[str, Any]:
    """Hint facts of autograd node ``fn``, after a hit: a ``PowBackward0``'s scalar exponent (its
    hint tells x ** 0.5 at 0 from x ** 3 past the dtype's range), kept by the node after its backward."""
    if fn.name() != "PowBackward0":
        return {}
    try:
        p = getattr(fn, "_saved_exponent", None)
    except Exception:  # (an attribute that cannot be read)
        return {}
    return {"pow_exp": float(p)} if isinstance(p, (int, float)) and not isinstance(p, bool) else {}


def zero_fed(grad_inputs: Any, grad_outputs: Any) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Device-side: whether a node produced a non-finite gradient where the one it received was 0
    (the untaken branch of a where), the first such element's flat index and the numel; same-shaped
    pairs only, ``None`` when there is none."""
    for gi in grad_inputs:
        for go in grad_outputs:
            if (isinstance(gi, torch.Tensor) and isinstance(go, torch.Tensor) and _floating(gi) and _floating(go)
                    and gi.layout == torch.strided and go.layout == torch.strided and gi.shape == go.shape and gi.numel()):
                hit = (~torch.isfinite(gi) & (go == 0)).reshape(-1)
                return hit.any(), hit.int().argmax(), gi.numel()
    return None


def dropped(grad_inputs: Any, grad_outputs: Any) -> torch.Tensor | None:
    """Device-side, element by element: where a where/masked_fill node handed on a 0 gradient for a
    nonzero one it received (the elements it masked out)."""
    go = grad_outputs[0] if grad_outputs else None
    if not (isinstance(go, torch.Tensor) and _floating(go) and go.layout == torch.strided):
        return None
    out = None
    for gi in grad_inputs:
        if isinstance(gi, torch.Tensor) and _floating(gi) and gi.layout == torch.strided and gi.shape == go.shape:
            m = (go != 0) & (gi == 0)
            out = m if out is None else out | m
    return out


def param_den(fn: Any) -> torch.Tensor | None:
    """Device-side: for a division's node whose denominator is a learned parameter (a leaf that
    requires grad: a fake-quant's scale s in clamp(x / s, qn, qp)), whether that denominator holds a
    0, read while the node's saved values are alive; ``None`` for any other node."""
    if fn.name() != "DivBackward0":
        return None
    try:
        d = fn._saved_other
    except Exception:  # (a saved value already freed)
        return None
    if isinstance(d, torch.Tensor) and d.is_leaf and d.requires_grad and _floating(d) and d.numel():
        return (d.detach() == 0).any()
    return None


def zeroed_at(z: tuple[torch.Tensor, torch.Tensor, int] | None) -> tuple[int, int] | None:
    """`zero_fed`'s answer read on the host: (flat index, numel), or None."""
    return (int(z[1]), z[2]) if z is not None and bool(z[0]) else None


# ---------------------------------------------------------------- source lines
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NANHUNT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_DEMO = os.path.join(_NANHUNT_DIR, "_cli", "demo.py")
_OUTSIDE = os.path.join(_NANHUNT_DIR, "_record", "outside.py")
_FORWARDS = os.path.join(_NANHUNT_DIR, "_record", "forwards.py")  # full mode's `forward` wrappers
_USER, _SKIP, _STOP = 0, 1, 2
_kinds: dict[str, int] = {}


def _kind(filename: str) -> int:
    k = _kinds.get(filename)
    if k is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_NANHUNT_DIR):
            # the demo's model is "user" code; a pass-through outside-code mode is nobody's frame
            k = _USER if path == _DEMO else (_SKIP if path in (_OUTSIDE, _FORWARDS) else _STOP)
        elif path.startswith(_TORCH_DIR) or filename.startswith("<frozen") or (
            path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path[len(_STDLIB_DIR):]
        ):
            k = _SKIP
        else:
            k = _USER
        _kinds[filename] = k
    return k


_FUNCTION_PY = torch.autograd.function.__file__
_TF = "__torch_function__"


def _user_frames(depth: int = 2) -> tuple[str | None, str | None]:
    """The first frame outside torch and nanhunt (``file:line``), and, when that frame is a custom
    ``autograd.Function`` forward, the line that called ``.apply``. ``None`` past a nanhunt frame:
    the op was run by nanhunt itself (a built-in backward formula run from the replay)."""
    f: Any = sys._getframe(depth)
    inner = None
    while f is not None:
        k = _kind(f.f_code.co_filename)
        if k == _USER and f.f_code.co_name == _TF and inner is not None and inner.co_name == _TF:
            k = _SKIP  # a tensor subclass's __torch_function__ handing the op on (super()): its caller's line
        if k == _USER:
            src = f"{f.f_code.co_filename}:{f.f_lineno}"
            g = f.f_back
            if g is not None and g.f_code.co_filename == _FUNCTION_PY:
                while g is not None:
                    kg = _kind(g.f_code.co_filename)
                    if kg == _USER:
                        return src, f"{g.f_code.co_filename}:{g.f_lineno}"
                    if kg == _STOP:
                        break
                    g = g.f_back
            return src, None
        if k == _STOP:
            return None, None
        inner, f = f.f_code, f.f_back
    return None, None


def _fmt(op: str, src: str | None) -> str:
    return f"{op} @ {src}" if src else op


# ---------------------------------------------------------------- per-element codes
def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


# ops whose arguments the hints read also when an input was already non-finite
_KEEP_CALL = frozenset({torch.ops.aten._ctc_loss.Tensor, torch.ops.aten._ctc_loss.default})


def _code(t: torch.Tensor) -> torch.Tensor | None:
    """``None`` when finite, else a uint8 tensor: 0 finite, 1 nan, 2 +inf, 3 -inf."""
    if t.is_meta:  # no values (a jagged nested tensor's sequence lengths, held as sizes)
        return None
    if t.is_nested:  # (its values, flat: as the ops on it see them)
        t = t.values()
    elif t.layout != torch.strided:
        t = t.to_dense()
    t = widen(t)
    if t.is_complex():
        bad = ~torch.isfinite(t)
        return bad.to(torch.uint8) if bool(bad.any()) else None
    if bool(torch.isfinite(t).all()):
        return None
    return (torch.isnan(t).to(torch.uint8) + (t == float("inf")).to(torch.uint8) * 2
            + (t == float("-inf")).to(torch.uint8) * 3)



def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``t``'s `_code`: a nested tensor's flat values' (a strided one has no sizes)."""
    return tuple((t.values() if t.is_nested else t).shape)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr()) or None
    except Exception:
        return None


_Geo = tuple[int, tuple[int, ...]]  # a strided tensor's place in its storage: (offset, strides)


def _geo(t: torch.Tensor) -> _Geo | None:
    try:
        return int(t.storage_offset()), tuple(t.stride())
    except Exception:  # sparse, nested: no strides
        return None


class _In:
    __slots__ = ("pos", "shape", "code", "prod", "geo", "param")

    def __init__(self, pos: int, shape: tuple[int, ...], code: torch.Tensor | None, prod: tuple[int, int] | None,
                 geo: _Geo | None = None, param: bool = False):
        self.pos = pos  # position among the op's tensor arguments
        self.shape = shape
        self.code = code  # None: finite
        self.prod = prod  # (record, output slot) that last wrote it, None: made before the call
        self.geo = geo
        self.param = param  # an nn.Parameter: a learned weight, never an intended mask


class _Rec:
    __slots__ = ("op", "src", "pointwise", "ins", "outs", "geos", "select", "origin", "node", "moves", "call")

    def __init__(self, op: str, src: str | None, pointwise: bool):
        self.moves = False  # a view or a copy: never creates a value, left out of the chain
        self.op = op
        self.src = src
        self.pointwise = pointwise
        self.ins: list[_In] = []
        self.outs: list[tuple[tuple[int, ...], torch.Tensor | None]] = []  # (shape, code)
        self.geos: list[_Geo | None] = []  # per output: where it lies in its storage
        self.select: tuple[str, Any] | None = None  # ("where", cond) / ("masked_fill", mask)
        self.origin = 0  # earliest creating record on a non-finite path into it (a tie-break)
        self.node: int = -1  # backward: the autograd node running it
        self.call: tuple[Any, Any, Any] | None = None  # (func, args, kwargs) of a creator: for hints.facts


_PLAIN = (torch.Tensor, nn.Parameter)  # (what an op hands on as it made it)
_NO_CHAIN = frozenset({"aten.clone.default", "aten.contiguous.default", "aten.detach.default",
                       "aten.alias.default", "aten._unsafe_view.default", "aten.lift_fresh.default"})


class _Recorder:
    """Records ops (when ``on``): producers of tensors and where their outputs are non-finite."""

    def __init__(self) -> None:
        self.recs: list[_Rec] = []
        self.by_id: dict[int, tuple[Any, int, torch.Tensor | None, tuple[int, int] | None]] = {}
        self.by_storage: dict[int, tuple[int, int]] = {}
        # each output by its place in its storage: a tensor subclass's __torch_function__ hands on
        # another object than the op made (as_subclass: the same values, another id)
        self.by_place: dict[tuple[int, _Geo | None, tuple[int, ...]], tuple[int, int]] = {}
        self.mask_fed = False  # the last `walk` ended where a -inf fed in from before the call turned into something else
        self.graded: set[int] = set()  # ids of a no_grad replay's tensors whose originals required grad (no constants)

    def lookup(self, t: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        """Code of ``t`` now, and the (record, slot) that last wrote it."""
        e = self.by_id.get(id(t))
        ver = version(t)
        if e is not None and e[0]() is t:
            prod = e[3]
            st = _storage(t)
            w = self.by_storage.get(st) if st is not None else None
            newer = w is not None and (prod is None or w[0] > prod[0])
            if e[1] == ver and ver >= 0 and not newer:
                return e[2], e[3]
            if newer:  # written since through another tensor of its storage (w.data.copy_: no version bump)
                prod = w
            code = _code(t)
            self.by_id[id(t)] = (weakref.ref(t), ver, code, prod)
            return code, prod
        st = _storage(t)
        prod = self.by_storage.get(st) if st is not None else None
        if st is not None and type(t) not in _PLAIN:
            made = self.by_place.get((st, _geo(t), _shape(t)))
            prod = made if prod is None or (made is not None and made[0] > prod[0]) else prod
        code = _code(t)
        try:
            self.by_id[id(t)] = (weakref.ref(t), ver, code, prod)
        except TypeError:
            pass
        return code, prod

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], src: str | None) -> Any:
        op = str(func)
        try:
            pointwise = torch.Tag.pointwise in func.tags
        except Exception:
            pointwise = False
        rec = _Rec(op, src, pointwise)
        rec.moves = op in _NO_CHAIN or bool(getattr(func, "is_view", False))
        leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        origin = len(self.recs)
        any_bad = False
        for pos, t in enumerate(leaves):
            if not _floating(t):
                continue
            code, prod = self.lookup(t)
            if code is not None and prod is None and t.dim() == 0 and not t.requires_grad \
                    and not isinstance(t, nn.Parameter):
                code = None  # a literal (``h[m] = -inf``): this op is where it enters
            rec.ins.append(_In(pos, _shape(t), code, prod, _geo(t) if prod is not None else None,
                               code is not None and isinstance(t, nn.Parameter)))
            if code is not None:
                any_bad = True
        name = getattr(func, "__name__", "")
        if name.startswith("where") and leaves and leaves[0].dtype == torch.bool:
            rec.select = ("where", leaves[0])
        elif name.startswith("masked_fill") and len(leaves) >= 2 and leaves[1].dtype == torch.bool:
            rec.select = ("masked_fill", leaves[1])

        out = func(*args, **kwargs)

        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        seen = {id(x) for x in outs}
        try:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = args[i] if i < len(args) else kwargs.get(a.name)
                    for x in tree_leaves(v):
                        if isinstance(x, torch.Tensor) and id(x) not in seen:
                            outs.append(x)
                            seen.add(id(x))
        except Exception:
            pass
        ri = len(self.recs)
        if any_bad:
            origins = [self.recs[i.prod[0]].origin for i in rec.ins if i.code is not None and i.prod is not None]
            origin = min(origins) if origins else -1
        rec.origin = origin
        inplace = name.endswith("_") or "out" in kwargs
        for slot, t in enumerate(outs):
            code = _code(t) if _floating(t) else None
            if code is not None and t.dim() == 0 and op == "aten.lift_fresh.default":
                code = None  # a literal: blamed where it is used
            rec.outs.append((_shape(t), code))
            rec.geos.append(_geo(t))
            st = _storage(t)
            if st is not None:
                self.by_place[(st, rec.geos[-1], rec.outs[-1][0])] = (ri, slot)
            try:
                self.by_id[id(t)] = (weakref.ref(t), version(t), code, (ri, slot))
            except TypeError:
                continue
            if inplace or any(id(t) == id(x) for x in leaves):
                st = _storage(t)
                if st is not None:
                    self.by_storage[st] = (ri, slot)
        if not any_bad and any(code is not None for _, code in rec.outs):
            rec.call = (func, args, kwargs)  # finite in, non-finite out: a candidate creator
        elif func in _KEEP_CALL and any(code is not None for _, code in rec.outs):
            rec.call = (func, args, kwargs)  # (a CTC loss fed a -inf: its lengths and targets tell the hint why)
        self.recs.append(rec)
        return out

    def first_created(self) -> int | None:
        """The first record that made a non-finite output from finite inputs (no element to follow)."""
        return next((ri for ri, r in enumerate(self.recs)
                     if any(c is not None for _, c in r.outs) and not any(i.code is not None for i in r.ins)), None)

    # ---------------------------------------------------------------- the walk back
    def walk(self, start: tuple[int, int], idx: tuple[int, ...] | None) -> list[int] | None:
        """Records from the creator to ``start`` (oldest first), following the reported element."""
        self.mask_fed = False
        path: list[int] = []
        kinds: list[int] = []  # the followed element's code in each record's output (3: -inf)
        ri, slot = start
        seen: set[tuple[int, int]] = set()
        into: tuple[tuple[int, ...], _Geo | None] | None = None  # the followed input's shape and place
        while True:
            if (ri, slot) in seen or ri >= len(self.recs):
                return None
            seen.add((ri, slot))
            rec = self.recs[ri]
            shape, code = rec.outs[slot]
            if code is None:
                return None  # that output is finite: not on a non-finite path
            if into is not None and idx is not None and (into[0] != shape or into[1] != rec.geos[slot]):
                # the op wrote a view of the tensor followed (t[:, 4:] = -inf): the same element there
                idx = _view_index(idx, into[1], shape, rec.geos[slot])
            if (idx is None or len(idx) != code.dim() or any(not 0 <= i < n for i, n in zip(idx, code.shape))
                    or int(code[idx]) == 0):
                idx = _first(code)
            path.append(ri)
            kinds.append(int(code[idx]))
            cands = self._candidates(rec, shape, idx, kinds[-1])
            if not cands:
                path.reverse()
                return path  # every input that matters was finite: created here
            key, inp, in_idx = min(cands, key=lambda c: c[0])
            if inp.prod is None:
                if inp.code is not None and int(inp.code[in_idx]) == 3 and not inp.param:
                    # a -inf fed in from before the call: an additive mask (attention's key mask, as
                    # Hugging Face passes it). It is no creation; the op that made something else of
                    # it (softmax of a fully masked row: nan) is where the value was born. A -inf
                    # weight is no mask: poisoned weights (a float16 cast past 65504), not localised
                    k = len(kinds) - 1
                    while k >= 0 and kinds[k] == 3:
                        k -= 1
                    if k >= 0:
                        self.mask_fed = True
                        got = path[:k + 1]
                        got.reverse()
                        return got
                return None  # fed from before the call: not localised here
            ri, slot = inp.prod
            idx = in_idx
            into = (inp.shape, inp.geo)

    def _candidates(self, rec: _Rec, shape: tuple[int, ...], idx: tuple[int, ...],
                    out_code: int) -> list[tuple[Any, _In, Any]]:
        """The inputs non-finite where output element ``idx`` (of code ``out_code``) is made, each with
        its element to follow."""
        sel_pos: int | None = None
        if rec.select is not None:
            kind, cond = rec.select
            ci = _bmap(idx, shape, tuple(cond.shape))
            if ci is not None:
                c = bool(cond[ci])
                if kind == "where":
                    sel_pos = 1 if c else 2
                else:
                    sel_pos = 2 if c else 0  # masked_fill: the (tensor) value where the mask holds
        out = []
        for inp in rec.ins:
            if inp.code is None:
                continue
            if sel_pos is not None and inp.pos != sel_pos:
                continue
            if inp.pos == 0 and rec.op in _OVERWRITES:
                continue  # what the destination held before is gone: only the source is copied in
            if rec.pointwise or sel_pos is not None:
                in_idx = _bmap(idx, shape, inp.shape)
                if in_idx is None:
                    in_idx = _first(inp.code)
                elif int(inp.code[in_idx]) == 0:
                    continue  # finite where it matters
            else:
                in_idx = _in_row(inp.code, inp.shape, shape, idx, out_code)
            v = int(inp.code[in_idx])
            origin = self.recs[inp.prod[0]].origin if inp.prod is not None else sys.maxsize
            # a -inf is most often an intended mask: follow anything else first
            out.append(((v == 3, inp.prod is None, origin), inp, in_idx))
        return out


# ops whose first argument is overwritten whole by the others (a weight set through .data.copy_)
_OVERWRITES = frozenset({"aten.copy_.default", "aten.copy.default", "aten._copy_from.default"})


def _in_row(code: torch.Tensor, in_shape: tuple[int, ...], shape: tuple[int, ...], idx: tuple[int, ...],
            kind: int) -> tuple[int, ...]:
    """The element of a (not pointwise) op's input to follow from output element ``idx`` of code
    ``kind``: the same element, else one in the same row, else the input's first non-finite one. A
    nan or +inf out of a row (softmax, a sum) comes of a nan or +inf in it, or of a row all -inf (a
    fully masked row): a -inf of a row that also holds those (a large negative score plus a float16
    mask's finfo.min, harmless) is passed over for them."""
    same = in_shape == shape and int(code[idx]) != 0
    row = code[idx[:-1]] if len(shape) >= 1 and len(in_shape) >= 1 and in_shape[:-1] == shape[:-1] else None
    if row is None or not bool(row.any()):
        return idx if same else _first(code)
    if kind != 3 and not (same and int(code[idx]) != 3):
        hot = ((row == 1) | (row == 2)).nonzero()
        if hot.numel():
            return (*idx[:-1], int(hot[0, 0]))
    return idx if same else (*idx[:-1], int(row.nonzero()[0, 0]))


def _view_index(idx: tuple[int, ...], geo: _Geo | None, shape: tuple[int, ...],
                view: _Geo | None) -> tuple[int, ...] | None:
    """Element ``idx`` of a tensor at ``geo``, as an index of the tensor of ``shape`` at ``view``
    in the same storage; None when it is not in it."""
    if geo is None or view is None or len(idx) != len(geo[1]):
        return None
    rest = geo[0] + sum(i * s for i, s in zip(idx, geo[1])) - view[0]
    out = [0] * len(shape)
    for d in sorted(range(len(shape)), key=lambda d: -view[1][d]):
        s = view[1][d]
        if s > 0:
            out[d] = min(rest // s, shape[d] - 1)
            rest -= out[d] * s
    return tuple(out) if rest == 0 and all(0 <= i < n for i, n in zip(out, shape)) else None


def _first(code: torch.Tensor) -> tuple[int, ...]:
    if code.dim() == 0:
        return ()
    nz = code.reshape(-1).nonzero()
    i = int(nz[0, 0]) if nz.numel() else 0
    return tuple(int(x) for x in torch.unravel_index(torch.tensor(i), code.shape))


def _bmap(idx: tuple[int, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The element of a broadcast input that feeds output element ``idx``."""
    if len(in_shape) > len(out_shape) or len(idx) != len(out_shape):
        return None
    off = len(out_shape) - len(in_shape)
    res = []
    for d, s in enumerate(in_shape):
        o = out_shape[off + d]
        if s == o:
            res.append(idx[off + d])
        elif s == 1:
            res.append(0)
        else:
            return None
    return tuple(res)


# ---------------------------------------------------------------- the dispatch mode
class _Mode(TorchDispatchMode):
    """Forward: records ops while ``on``. Also maps autograd nodes to the line of the op that
    made them (``track_nodes``), and in backward, records ops run by a node with a user frame."""

    def __init__(self, rec: _Recorder, track_nodes: bool = False) -> None:
        super().__init__()
        self.rec = rec
        self.on = False
        self.track_nodes = track_nodes
        self.pending: list[tuple[Any, str | None, str | None, bool]] = []
        self.node_src: dict[Any, tuple[str | None, bool]] = {}
        self.node: list[int] = []  # backward: the running node (stack)
        self.backward = False
        self.quiet = 0

    def flush(self) -> None:
        """Outputs of earlier ops now carry their grad_fn: map each new node to its line."""
        for ref, src, apply_src, inside in self.pending:
            t = ref()
            if t is None:
                continue
            fn = t.grad_fn
            if fn is None or fn in self.node_src:
                continue
            if apply_src is not None and isinstance(fn, torch.autograd.function.BackwardCFunction):
                src = apply_src
            self.node_src[fn] = (src, inside)
        self.pending.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        if self.backward:
            if not self.node:
                return func(*args, **kwargs)
            src, _ = _user_frames()
            if src is None:
                return func(*args, **kwargs)
            n0 = len(self.rec.recs)
            out = self.rec.record(func, args, kwargs, src)
            if len(self.rec.recs) > n0:
                self.rec.recs[-1].node = self.node[-1]
            return out
        if not (self.on or self.track_nodes):
            return func(*args, **kwargs)
        if self.track_nodes and self.pending:
            self.flush()
        src, apply_src = _user_frames()
        if self.on and not self.track_nodes:
            return self.rec.record(func, args, kwargs, src)
        out = func(*args, **kwargs)
        if self.track_nodes:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.pending.append((weakref.ref(t), src, apply_src, self.on))
                    if func.__name__.endswith("_") and t._is_view() and t._base is not None:
                        self.pending.append((weakref.ref(t._base), src, apply_src, self.on))
        return out


class _Calls:
    """Global module hooks, during the replay only: switch ``mode.on`` inside the target call."""

    def __init__(self, names: dict[nn.Module, str], ordinal: int, mode: _Mode, path: Path | None = None):
        self.names = names
        self.ordinal = ordinal
        self.mode = mode
        self.count = 0
        self.stack: list[tuple[nn.Module, bool]] = []
        self.output: Any = None
        self.done = False
        self.in_path = path  # backward: the input whose gradient is reported
        self.looked: dict[Path, tuple[torch.Tensor | None, tuple[int, int] | None]] = {}
        self.edge: Any = None
        self.handles: list[Any] = []
        # forward: the dispatch mode is on only inside the target call, and the replay stops
        # right after it (the rest of the forward cannot matter)
        self.scoped = False
        self.entered = False
        # forward: a call inside the target (its ordinal, an input's path) whose input the target's
        # own code made; that input's code and producer as the call began
        self.fed: tuple[int, Path] | None = None
        self.fed_in: tuple[torch.Tensor | None, tuple[int, int] | None] | None = None
        self.fed_at = -1  # (an input given by keyword: looked up as that call returns, at this depth)

    def __enter__(self) -> _Calls:
        self.handles.append(ReplayHooks(self.pre, self.post))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module not in self.names:
            return
        target = self.count == self.ordinal and not self.done
        if self.fed is not None and self.count == self.fed[0] and self.mode.on:
            if self.fed[1][:1] == (0,):
                self._fed((args, {}))
            else:
                self.fed_at = len(self.stack)
        self.count += 1
        self.stack.append((module, target))
        if target:
            if self.in_path is not None and self.in_path[:1] == (0,):
                self._edge((args, {}))
            self.mode.on = True
            if self.scoped:
                self.mode.__enter__()
                self.entered = True

    def post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = None) -> None:
        if not self.stack or self.stack[-1][0] is not module:
            return
        _, target = self.stack.pop()
        if self.fed_at == len(self.stack):
            self.fed_at = -1
            self._fed((args, kwargs if isinstance(kwargs, dict) else {}))
        if target:
            self.mode.on = False
            self.done = True
            self.output = output
            if self.scoped:  # (forward: each output's code and producer now, as the caller may write it in place after)
                self.looked = {tuple(p): self.mode.rec.lookup(t) for p, t in tensors(output) if _floating(t)}
            if self.in_path is not None and self.in_path[:1] != (0,):
                self._edge((args, kwargs if isinstance(kwargs, dict) else {}))
            if self.scoped:  # the mode is off from here; the forward runs on to its end (see differential._Scope)
                self.leave()

    def leave(self) -> None:
        if self.entered:
            self.entered = False
            self.mode.__exit__(None, None, None)

    def _fed(self, inputs: tuple[Any, Any]) -> None:
        assert self.fed is not None
        try:
            t = get_path(inputs, self.fed[1])
        except Exception:
            return
        if isinstance(t, torch.Tensor) and _floating(t):
            self.mode.quiet += 1  # (its reads are not the user's ops)
            try:
                self.fed_in = self.mode.rec.lookup(t)
            finally:
                self.mode.quiet -= 1

    def _edge(self, inputs: Any) -> None:
        if self.in_path is None:
            return
        try:
            t = get_path(inputs, self.in_path)
        except Exception:
            return
        if isinstance(t, torch.Tensor) and t.requires_grad:
            self.edge = (t, torch.autograd.graph.get_gradient_edge(t))


def _call(top: Top) -> Any:
    return top.module(*top.args, **(top.kwargs or {}))


# ---------------------------------------------------------------- forward
def locate_forward(top: Top, names: dict[nn.Module, str], ordinal: int, path: Path,
                   fed: tuple[int, Path] | None = None, seen: dict[str, Any] | None = None) -> OpOrigin | None:
    """The op that created the first non-finite value on the path to the reported element of
    output ``path`` of the ``ordinal``-th watched call within ``top``; with ``fed`` (a call inside
    that one, by ordinal, and the path of one of its inputs in ``(args, kwargs)``), on the path to
    that input as the call began (one given by keyword: as it returned): what the ``ordinal``-th
    call's own code made and fed it. ``seen["bad"]``: whether this replay's value at ``path`` came
    out non-finite (None: it did not get there), one more replay of the failing call for the
    verdict's agreement (`differential.examine`'s ``again``)."""
    try:
        return _locate_forward(top, names, ordinal, path, fed, seen)
    except Exception:
        return None


def _locate_forward(top: Top, names: dict[nn.Module, str], ordinal: int, path: Path,
                    fed: tuple[int, Path] | None = None, seen: dict[str, Any] | None = None) -> OpOrigin | None:
    rec = _Recorder()
    mode = _Mode(rec)
    calls = _Calls(names, ordinal, mode)
    calls.scoped = True
    calls.fed = fed
    try:
        with faithful(top), calls:
            _call(top)
    except Exception:
        if not calls.done:
            raise
    finally:
        calls.leave()
    if not calls.done:
        return None
    if seen is not None:
        out = dict(tensors(calls.output)).get(tuple(path))
        seen["bad"] = is_bad(out) if isinstance(out, torch.Tensor) and _floating(out) else None
    if fed is not None:
        if calls.fed_in is None:
            return None
        code, prod = calls.fed_in
    else:
        t = dict(tensors(calls.output)).get(tuple(path))
        if t is None or not _floating(t):
            return None
        code, prod = calls.looked.get(tuple(path)) or rec.lookup(t)
    if code is None or prod is None:
        return None
    got = rec.walk(prod, _first(code))
    calls.output = None
    if not got:
        return None
    chain = _chain(rec, got)
    first = rec.recs[got[0]]
    return OpOrigin(first.op, first.src, chain, _hints.facts(rec, got))


def _chain(rec: _Recorder, path: list[int]) -> list[str]:
    out = []
    for n, ri in enumerate(path):
        r = rec.recs[ri]
        if n and r.moves:
            continue
        out.append(_fmt(r.op, r.src))
    return out


# ---------------------------------------------------------------- backward
def locate_backward(
    top: Top, names: dict[nn.Module, str], grads: list[torch.Tensor | None], params: list[Any],
    ordinal: int, path: Path,
) -> OpOrigin | None:
    """The autograd node that created the first non-finite gradient reported at input ``path`` of
    the ``ordinal``-th watched call, and the forward line that created that node."""
    try:
        return _locate_backward(top, names, grads, params, ordinal, path)
    except Exception:
        return None


class _Node:
    __slots__ = ("fn", "name", "done", "in_bad", "out_bad", "inner", "flags", "keep", "mark", "zero", "drop", "den")

    def __init__(self, fn: Any):
        self.fn = fn
        self.name = fn.name()
        self.done = -1  # execution order
        self.in_bad: list[bool] = []  # gradients received (w.r.t. the forward outputs)
        self.out_bad: list[bool] = []  # gradients produced (aligned with next_functions)
        self.inner: OpOrigin | None = None  # the op inside a Python backward that made the value
        self.flags: tuple[list[Any], list[Any]] = ([], [])  # device-side "all finite?" checks
        self.keep: Any = None  # the gradients a Python backward produced (its ops were recorded)
        self.mark = 0  # records before it ran
        self.zero: tuple[torch.Tensor, torch.Tensor, int] | None = None  # a 0 received where it made a non-finite one (`zero_fed`)
        self.drop: torch.Tensor | None = None  # a where's masked-out elements (`dropped`)
        self.den: torch.Tensor | None = None  # a division by a learned parameter at 0 (`param_den`)


def _finite(g: Any) -> torch.Tensor | None:
    """A device-side "all finite?" (no sync), ``None`` for no gradient or a non-float one."""
    if not (isinstance(g, torch.Tensor) and _floating(g)):
        return None
    if g.layout != torch.strided:
        g = g.to_dense()
    return torch.isfinite(widen(g)).all()


def _is_bad(g: Any) -> bool:
    f = _finite(g)
    return f is not None and not bool(f)


def _settle(nodes: list[_Node]) -> None:
    """One host read for every node's checks."""
    flat = [f for n in nodes for side in n.flags for f in side if f is not None]
    values = iter(torch.stack([f.cpu() for f in flat]).tolist() if flat else [])
    for n in nodes:
        ins, outs = n.flags
        n.in_bad = [f is not None and not next(values) for f in ins]
        n.out_bad = [f is not None and not next(values) for f in outs]


def _locate_backward(
    top: Top, names: dict[nn.Module, str], grads: list[torch.Tensor | None], params: list[Any],
    ordinal: int, path: Path,
) -> OpOrigin | None:
    rec = _Recorder()
    mode = _Mode(rec, track_nodes=True)
    calls = _Calls(names, ordinal, mode, path=tuple(path))
    handles: list[Any] = []
    try:
        with faithful(top) as cut, torch.enable_grad(), mode:
            with calls:
                out = _call(top)
            mode.flush()
            if calls.edge is None:
                return None
            x, edge = calls.edge
            outs = [t for _, t in tensors(out) if t.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            if not pairs:
                return None
            # the graph: every node reachable from the outputs, and who consumes each (node, slot)
            nodes: list[_Node] = []
            index: dict[Any, int] = {}
            consumers: dict[tuple[int, int], list[tuple[int, int]]] = {}

            def visit(fn: Any) -> int:
                i = index.get(fn)
                if i is None:
                    i = index[fn] = len(nodes)
                    nodes.append(_Node(fn))
                    todo.append(fn)
                return i

            todo: list[Any] = []
            for o, _ in pairs:
                if o.grad_fn is not None:
                    visit(o.grad_fn)
            while todo:
                fn = todo.pop()
                i = index[fn]
                for j, (nxt, nr) in enumerate(fn.next_functions):
                    if nxt is not None:
                        consumers.setdefault((visit(nxt), nr), []).append((i, j))
            ran: list[int] = []
            target = index.get(edge.node)
            if target is None:
                return None
            for i, n in enumerate(nodes):
                if n.name == "AccumulateGrad":
                    continue
                handles.append(n.fn.register_prehook(_pre_hook(mode, nodes, i)))
                handles.append(n.fn.register_hook(_post_hook(mode, rec, nodes, i, ran)))
            leaves = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
            leaves += [t for _, t in tensors(top.args) if t.requires_grad and t.is_leaf] + cut
            leaves.append(x)
            mode.backward = True
            torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
            mode.backward = False
            _settle(nodes)
            for i, n in enumerate(nodes):
                if n.keep is not None and any(n.out_bad) and not any(n.in_bad):
                    n.inner = _inner(rec, i, n.keep)
                n.keep = None
    finally:
        for h in handles:
            h.remove()
        mode.backward = False
        mode.node.clear()
    return _blame(nodes, consumers, mode.node_src, (target, edge.output_nr))


def _pre_hook(mode: _Mode, nodes: list[_Node], i: int) -> Any:
    def hook(grad_outputs: Any) -> None:
        nodes[i].mark = len(mode.rec.recs)
        mode.node.append(i)

    return hook


def _post_hook(mode: _Mode, rec: _Recorder, nodes: list[_Node], i: int, ran: list[int]) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        if mode.node and mode.node[-1] == i:
            mode.node.pop()
        n = nodes[i]
        n.done = len(ran)
        ran.append(i)
        mode.quiet += 1  # our own checks are not the user's ops
        try:
            n.flags = ([_finite(g) for g in grad_outputs], [_finite(g) for g in grad_inputs])
            n.zero = zero_fed(grad_inputs, grad_outputs)
            if n.name.startswith(_SELECT):
                n.drop = dropped(grad_inputs, grad_outputs)
            n.den = param_den(n.fn)
            if len(rec.recs) > n.mark:
                n.keep = tuple(grad_inputs)
        finally:
            mode.quiet -= 1

    return hook


def _inner(rec: _Recorder, i: int, grad_inputs: Any) -> OpOrigin | None:
    """Inside a Python backward (node ``i``): the aten op that made the value, its line in that
    backward, and the ops from it to the result."""
    for g in grad_inputs:
        if not _is_bad(g):
            continue
        code, prod = rec.lookup(g)
        if code is None or prod is None or rec.recs[prod[0]].node != i:
            continue
        got = rec.walk(prod, _first(code))
        if got:
            first = rec.recs[got[0]]
            return OpOrigin(first.op, first.src, _chain(rec, got), _hints.facts(rec, got))
    return None


def python_backward(fn: Any, grad_outputs: Any, grad_inputs: Any, slot: int) -> OpOrigin | None:
    """A custom ``autograd.Function``'s backward node ``fn`` that made ``grad_inputs[slot]``
    non-finite from the finite ``grad_outputs``: its backward run once more on them under the op
    recorder (from the node's post hook, while its saved tensors are alive), for the aten op and the
    line of that backward that made the value. ``None`` for a built-in node, or on any failure."""
    if not isinstance(fn, torch.autograd.function.BackwardCFunction):
        return None
    try:
        rec = _Recorder()
        mode = _Mode(rec)
        mode.backward = True
        mode.node.append(0)
        with warnings.catch_warnings(), mode:
            warnings.simplefilter("ignore")  # its first run warned already
            out = fn.apply(*grad_outputs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        want = grad_inputs[slot]
        if len(outs) != len(grad_inputs):  # non-tensor arguments of its forward got a None too
            outs = [o for o in outs if isinstance(o, torch.Tensor) and _is_bad(o)
                    and isinstance(want, torch.Tensor) and o.shape == want.shape]
            slot = 0
        return _inner(rec, 0, [outs[slot]]) if slot < len(outs) else None
    except Exception:
        return None


def _blame(nodes: list[_Node], consumers: dict[tuple[int, int], list[tuple[int, int]]], node_src: dict[Any, tuple[str | None, bool]],
           start: tuple[int, int]) -> OpOrigin | None:
    """From the consumer that produced the reported gradient, back through nodes whose incoming
    gradients were non-finite, to the node that made one from finite gradients (the earliest, when
    several paths lead there)."""
    best: dict[int, tuple[int, list[int]] | None] = {}

    def deps(j: int) -> list[int]:
        n = nodes[j]
        out = []
        for s, bad in enumerate(n.in_bad):
            if bad:
                for m, slot in consumers.get((j, s), []):
                    ob = nodes[m].out_bad
                    if slot < len(ob) and ob[slot]:
                        out.append(m)
        return out

    def solve(i: int) -> tuple[int, list[int]] | None:
        stack = [(i, False)]
        while stack:  # iterative post-order: graphs can be deeper than Python's recursion limit
            j, expanded = stack.pop()
            if j in best:
                continue
            ds = deps(j)
            if not expanded:
                stack.append((j, True))
                stack.extend((m, False) for m in ds if m not in best)
                continue
            n = nodes[j]
            if not any(n.out_bad):
                best[j] = None
            elif not any(n.in_bad):
                best[j] = (n.done, [j])
            else:
                cands = [b for b in (best.get(m) for m in ds) if b is not None]
                if cands:
                    b = min(cands, key=lambda c: c[0])
                    best[j] = (b[0], [*b[1], j])
                else:
                    best[j] = None  # fed from outside the graph, or a sum that overflowed
        return best.get(i)

    target, nr = start
    cands = []
    for m, slot in consumers.get((target, nr), []):
        n = nodes[m]
        if slot < len(n.out_bad) and n.out_bad[slot]:
            got = solve(m)
            if got is not None:
                inside = node_src.get(n.fn, (None, False))[1]
                cands.append(((not inside, got[0]), got))
    if not cands:
        return None
    _, (_, chain_nodes) = min(cands, key=lambda c: c[0])
    creator = nodes[chain_nodes[0]]
    src = node_src.get(creator.fn, (None, False))[0]
    inner = creator.inner
    chain = list(inner.chain) if inner is not None else []
    for j in chain_nodes:
        n = nodes[j]
        chain.append(_fmt(n.name, node_src.get(n.fn, (None, False))[0]))
    ran = [n.fn for n in nodes if n.done >= 0]
    drops = {n.fn: n.drop for n in nodes if n.drop is not None}
    facts = {"where_trap": where_trap(creator.fn, ran, zeroed_at(creator.zero), drops), **pow_exponent(creator.fn)}
    if creator.den is not None and not facts["where_trap"] and bool(creator.den):
        facts["den_param"] = True  # (a learned scale at 0: the forward's x/0 clamped away)
    if inner is not None:  # a custom Function's backward: the op of it that made the value, at its line
        return OpOrigin(inner.op, inner.source, chain, {**inner.facts, **facts})
    return OpOrigin(creator.name, src, chain, facts)
