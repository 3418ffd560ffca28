"""Where a value was born inside a ``torch.compile``d graph, from the graph's own metadata.

Runs only after a hit. The compiled call is run once more, as compiled, under a dispatch mode whose
``ignore_compile_internals()`` is true: dynamo then keeps the compiled artifact (a mode without it
makes dynamo fall back to eager, which is not what failed) and the mode sees every aten op that the
artifact dispatches. For backends that run an FX graph in Python (``aot_eager``, ``eager``, custom
backends returning ``gm.forward``), the op's graph node is the innermost frame running a
``GraphModule``: ``gm._lineno_map`` (what dynamo itself uses) maps the frame's line to the node, whose
``stack_trace`` gives the user's line and ``nn_module_stack`` the module (a backend that runs its
graph through ``torch.fx.Interpreter`` names the node in ``run_node``'s frame). Ops are recorded by
:class:`nanhunt._locate.oplevel._Recorder` and walked back from the reported element, so an intended
``-inf`` mask that never reaches it is not blamed. Inductor's fused kernels dispatch nothing (on
CPU they call no intermediate hook either): for an Inductor wrapper ``differential`` uses
:mod:`nanhunt._locate.inductor` instead, which re-compiles with a capturing ``inner_compile`` and runs
the captured aten graph through :func:`_locate_graph` node by node, or bisects compiled prefixes of
it. When no origin is found the finding names the module whose in-graph check failed first
(``differential.judge``).

Cost, paid only after a hit: one more compiled forward with every op recorded (2-core CPU, a
two-Linear model with a softmax: 8-25 ms against 1 ms for the compiled forward itself). Inductor
(same model, 2-core CPU): the capturing re-compile 0.35-0.6 s when the FX graph cache holds the
user's compile (2-7 s cold); a codegen bug's bisection 0.3-1.2 s (4 prefix compiles of an 8-node
graph, ~1 s per cold C++ kernel, ~0.05 s for a prefix of extern kernels only).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._steplog import Top
from .._tensors import Path, tensors
from .oplevel import _chain, _first, _fmt, _Recorder
from .replay import faithful

__all__ = ["GraphOrigin", "guarded", "locate_graph", "locate_graph_backward", "module_id", "node_of_frame",
           "origin_at", "watched_name", "with_element"]


@dataclass
class GraphOrigin:
    op: str  # the aten op the graph node ran, "aten.exp.default"
    node: str  # the FX node's name
    module: str | None  # qualified name relative to the watched model, from nn_module_stack
    module_type: str | None
    source: str | None  # "file.py:LINE" from the node's stack_trace
    chain: list[str] = field(default_factory=list)
    # the element where the value appears at the creator's module's last op on the chain
    index: tuple[int, ...] | None = None
    value: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    # id() of that module, dynamo's nn_module_stack key: names it when the source path cannot
    # (a graph resumed after a graph break reaches the module through a stack slot, ``___stack0``)
    module_id: int | None = None


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _source(stack_trace: Any) -> str | None:
    """The innermost ``File "x.py", line N`` of a node's stack trace outside nanhunt (a function
    compiled in the loss code traces the outside recorder's mode too): the user's line."""
    if not isinstance(stack_trace, str):
        return None
    found = [f for f in _FILE_LINE.findall(stack_trace) if not os.path.abspath(f[0]).startswith(_OWN)]
    return f"{found[-1][0]}:{found[-1][1]}" if found else None


_KEY = re.compile(r"""\._modules\[['"]([^'"]+)['"]\]|\[['"]([^'"]+)['"]\]|\[(\d+)\]|\.([A-Za-z0-9_]+)""")


def module_path(expr: str) -> str:
    """``L['self'].layers[0]._modules['attn']`` -> ``layers.0.attn`` (dynamo's module source names)."""
    s = expr
    m = re.match(r"""^L\[['"][^'"]+['"]\]""", s)  # the compiled function's own argument (self)
    if m:
        s = s[m.end():]
    parts = []
    for a, b, c, d in _KEY.findall(s):
        parts.append(a or b or c or d)
    return ".".join(parts)


def node_of_frame(depth: int = 2) -> Any:
    """The FX node a graph's generated ``forward`` is running, from the innermost such frame."""
    f: Any = sys._getframe(depth)
    while f is not None:
        if f.f_code.co_name == "run_node" and isinstance(f.f_locals.get("self"), torch.fx.Interpreter):
            node = f.f_locals.get("n")  # a backend that interprets its graph node by node
            return node if isinstance(node, torch.fx.Node) else None
        if f.f_code.co_name == "forward":
            gm = f.f_locals.get("self")
            if isinstance(gm, torch.fx.GraphModule):
                lines = getattr(gm, "_lineno_map", None)
                if not lines:
                    return None
                i = lines.get(f.f_lineno - f.f_code.co_firstlineno)
                if i is None:
                    return None
                for n, node in enumerate(gm.graph.nodes):
                    if n == i:
                        return node
                return None
        f = f.f_back
    return None


class GraphMode(TorchDispatchMode):
    """Records the ops a compiled artifact dispatches, each with its graph node (when any)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # keep the compiled artifact: this mode sees it run, not an eager fallback

    def __init__(self, rec: _Recorder | None = None) -> None:
        super().__init__()
        self.rec = rec if rec is not None else _Recorder()
        self.nodes: list[Any] = []  # per record: its FX node or None
        self.dtypes: list[str] = []  # per record: its first floating output's dtype

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        node = node_of_frame()
        src = _source(node.meta.get("stack_trace")) if node is not None else None
        n0 = len(self.rec.recs)
        out = self.rec.record(func, args, kwargs, src)
        if len(self.rec.recs) > n0:
            self.nodes.append(node)
            t = next((x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
            self.dtypes.append(str(t.dtype).removeprefix("torch.") if t is not None else "")
        return out


def _stack(node: Any) -> Any:
    """A node's module stack: its own, or (a backward node) that of the forward op it differentiates."""
    if node is None:
        return None
    return node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")


def module_id(node: Any) -> int | None:
    """The ``id()`` of the module that ran ``node`` (the key of its last ``nn_module_stack`` entry)."""
    stack = _stack(node)
    key = list(stack)[-1] if stack else None
    return int(key) if isinstance(key, str) and key.isdigit() else None


def watched_name(origin: GraphOrigin, names: dict[Any, str]) -> str | None:
    """The origin's module as the watch names it: by its path, else (a graph resumed after a graph
    break reaches it through a stack slot) by its id; None when it is no watched module."""
    if origin.module is not None and origin.module in set(names.values()):
        return origin.module
    return next((n for m, n in names.items() if id(m) == origin.module_id), None)


def _module_of(node: Any, prefix: str) -> tuple[str | None, str | None]:
    stack = _stack(node)
    if not stack:
        return None, None
    expr, cls = list(stack.values())[-1]
    name = module_path(str(expr))
    full = ".".join(p for p in (prefix, name) if p)
    ctype = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return full, ctype.rsplit(".", 1)[-1]


def locate_graph(fn: Any, top: Top, prefix: str, path: Path | None, keep: Any = ()) -> GraphOrigin | None:
    """Run the compiled ``fn`` on ``top``'s inputs and find the graph node that created the first
    non-finite value on the path to output ``path`` (the first created anywhere if that path is
    not traceable). ``prefix``: the compiled module's name in the watched model."""
    return guarded(keep, lambda: _locate_graph(fn, top, prefix, path))


def guarded(keep: Any, run: Callable[[], GraphOrigin | None]) -> GraphOrigin | None:
    """``run()``, the tensors ``keep`` (nanhunt's slots a compiled graph writes into) put back
    after; ``None`` when anything fails: a locator never raises into the user's run."""
    try:
        saved = [t.clone() for t in keep]
        try:
            return run()
        finally:
            with torch.no_grad():
                for t, v in zip(keep, saved):
                    t.copy_(v)
    except Exception:
        return None


def _locate_graph(fn: Any, top: Top, prefix: str, path: Path | None) -> GraphOrigin | None:
    mode = GraphMode()
    rec = mode.rec
    with faithful(top, compiled=True), mode:
        out = fn(*top.args, **(top.kwargs or {}))
    outs = dict(tensors(out))
    t = outs.get(tuple(path)) if path is not None else None
    walked = None
    if t is not None:
        code, prod = rec.lookup(t)
        if code is not None and prod is not None:
            walked = rec.walk(prod, _first(code))
    if not walked:  # the first op that made a non-finite value from finite inputs
        created = rec.first_created()
        walked = [created] if created is not None else None
    if not walked:
        return None
    first = walked[0]
    node = mode.nodes[first]
    module, mtype = _module_of(node, prefix)
    # the element: at the last op on the chain still inside the creator's module (the chain ends
    # there too: the finding reports that module's output, not what later modules made of it)
    last = first
    for ri in walked:
        if _module_of(mode.nodes[ri], prefix)[0] == module and any(c is not None for _, c in rec.recs[ri].outs):
            last = ri
    chain = _chain(rec, walked[: walked.index(last) + 1])
    shape, code = next(((s, c) for s, c in rec.recs[last].outs if c is not None), ((), None))
    origin = GraphOrigin(rec.recs[first].op, node.name if node is not None else "", module, mtype,
                         rec.recs[first].src, chain, shape=tuple(shape), dtype=mode.dtypes[last])
    origin.module_id = module_id(node)
    return with_element(origin, code)


def with_element(origin: GraphOrigin, code: torch.Tensor | None) -> GraphOrigin:
    """``origin`` with the first non-finite element of ``code`` (``oplevel._code``), its value and counts."""
    if code is not None:
        idx = _first(code)
        v = int(code[idx]) if code.numel() else 0
        origin.index = idx
        origin.value = {1: float("nan"), 2: float("inf"), 3: float("-inf")}.get(v)
        origin.counts = {"nan": int((code == 1).sum()), "+inf": int((code == 2).sum()), "-inf": int((code == 3).sum())}
    return origin


def locate_graph_backward(fn: Any, top: Top, prefix: str, grads: list[torch.Tensor | None],
                          keep: Any = ()) -> GraphOrigin | None:
    """The compiled backward's node that made the first non-finite gradient from finite ones:
    ``top`` run through the compiled ``fn`` and differentiated from ``grads`` (those that arrived at
    its outputs) with ``autograd.grad`` (nothing accumulates into ``.grad``), the backward under
    :class:`GraphMode`. A backward node carries its forward op's module (``fwd_nn_module_stack``)
    and ``seq_nr``; the line is that of the forward node with the same ``seq_nr``."""
    return guarded(keep, lambda: _locate_backward(fn, top, prefix, grads))


def _locate_backward(fn: Any, top: Top, prefix: str, grads: list[torch.Tensor | None],
                     forward_nodes: Callable[[], list[Any]] | None = None) -> GraphOrigin | None:
    """(``forward_nodes``: the forward graphs' nodes, when the compiled forward dispatches nothing
    that names them: Inductor.)"""
    fwd = GraphMode()
    mode = GraphMode()
    with faithful(top, compiled=True), torch.enable_grad():
        with fwd:
            out = fn(*top.args, **(top.kwargs or {}))
        outs = [t for _, t in tensors(out) if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wrt: list[torch.Tensor] = [p for p in top.module.parameters() if p.requires_grad]
        wrt += [t for _, t in tensors((top.args, top.kwargs or {})) if t.requires_grad and t.is_leaf]
        if not pairs or not wrt:
            return None
        with mode:
            torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    first = mode.rec.first_created()
    if first is None:
        return None
    node = mode.nodes[first]
    seq = node.meta.get("seq_nr") if node is not None else None
    candidates = list(fwd.nodes) + (forward_nodes() if forward_nodes is not None else [])
    src = next((_source(n.meta.get("stack_trace")) for n in candidates
                if n is not None and seq is not None and n.meta.get("seq_nr") == seq and n.meta.get("stack_trace")), None)
    r = mode.rec.recs[first]
    shape, code = next(((sh, c) for sh, c in r.outs if c is not None), ((), None))
    return origin_at(node, r.op, src, tuple(shape), mode.dtypes[first], code, prefix)


def origin_at(node: Any, op: str, src: str | None, shape: tuple[int, ...], dtype: str,
              code: torch.Tensor | None, prefix: str) -> GraphOrigin:
    """The origin at one graph node that made the value itself (its chain is that op alone)."""
    module, mtype = _module_of(node, prefix)
    origin = GraphOrigin(op, node.name if node is not None else "", module, mtype, src, [_fmt(op, src)],
                         shape=shape, dtype=dtype, module_id=module_id(node))
    return with_element(origin, code)
