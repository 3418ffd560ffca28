"""After a hit: the autograd node that made the first non-finite gradient of a whole call.

The module-level backward analysis blames a module when the gradient of one of its *inputs* is
non-finite while the gradients of its outputs were finite. Two places have no such input: the
root's own code (the gradient of a child's output is made by ops the root runs itself) and graphs
whose only leaves are parameters (a ``torch.where`` over a bare ``nn.Parameter``). Here the failing
top-level call is replayed faithfully with grad, every autograd node of its graph gets a hook, and
the backward runs through ``torch.autograd.grad`` (no ``.grad`` is touched): the creator is the
first node, in execution order, that produced a non-finite gradient from finite ones. Each node is
given to the innermost watched call whose outputs reach it (children finish first), and the line
of the op that created it (`oplevel`'s node tracking).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from threading import get_ident
from typing import Any, NamedTuple

import torch
from torch import nn

from .._hooks import ReplayHooks
from .._steplog import Top
from .._tensors import is_bad, tensors
from .oplevel import (
    _SELECT,
    _USER,
    OpOrigin,
    _fmt,
    _kind,
    _Mode,
    _Recorder,
    dropped,
    param_den,
    pow_exponent,
    python_backward,
    where_trap,
    zero_fed,
    zeroed_at,
)
from .replay import faithful

__all__ = ["Blame", "Born", "creator", "blame_nodes", "checked_hook", "graph_nodes", "hook_line", "hook_names", "tensor_hooks",
           "used_outside"]



@dataclass
class Born:
    """The node that made a non-finite gradient from finite ones, and what hints need."""

    op: str  # the node's name, e.g. "SqrtBackward0"
    source: str | None  # the forward line that created the node
    grad: torch.Tensor  # the non-finite gradient it produced
    slot: int  # for which of its inputs
    chain: list[str] = field(default_factory=list)
    module: nn.Module | None = None  # the innermost watched module that created it (None: outside)
    name: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    nth: int = 0  # how many nodes of the same name ran before it in that backward
    call: int = 0  # which call of ``module`` in the top-level call made it (0: its first)
    node: str = ""  # the node's name (op differs for a custom Function's node: the op in its backward)


class Blame(NamedTuple):
    """What `blame_nodes` found: the creator node, its bad slot and gradient, the nodes the bad
    gradient then went through (oldest first), hint facts, how many nodes of the creator's name ran
    before it (to find the same node in another run of the same graph), and, for a custom
    ``autograd.Function``'s node, the op of its backward that made the value (`python_backward`)."""

    fn: Any
    slot: int
    grad: torch.Tensor
    chain: list[Any]
    facts: dict[str, Any]
    nth: int
    inner: OpOrigin | None = None


def named(b: Blame, node_src: Any, src: str | None) -> tuple[str, str | None, list[str], dict[str, Any]]:
    """Op, line, chain and hint facts of ``b``: the creator node at ``src`` (the forward line that
    created it), each node of the chain at ``node_src(node)``; a custom Function's creator by the op
    of its backward that made the value, at that backward's line, first in the chain."""
    chain = [_fmt(n.name(), node_src(n)) for n in b.chain]
    if b.inner is None:
        return b.fn.name(), src, chain, b.facts
    return b.inner.op, b.inner.source, [*b.inner.chain, *chain], {**b.inner.facts, **b.facts}


def graph_nodes(roots: list[Any]) -> list[Any]:
    """Every autograd node reachable from the nodes ``roots``."""
    nodes: list[Any] = []
    seen: set[Any] = set()
    todo = list(roots)
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nodes.append(fn)
        todo.extend(n for n, _ in fn.next_functions)
    return nodes


def used_outside(t: torch.Tensor, inputs: list[torch.Tensor], outputs: list[torch.Tensor], roots: list[Any]) -> bool:
    """Does a node outside a call's own graph (the nodes its ``outputs`` reach before its
    ``inputs``' nodes) take the gradient of its input ``t``: ``h`` used by the caller's own code
    too (``b(h) + sqrt(...h...)``, a residual)? ``t``'s gradient is then the sum over those uses.
    ``roots``: the nodes of the whole graph's outputs."""
    node, nr = t.grad_fn, t.output_nr

    def takes(n: Any, i: int) -> bool:
        return n is node and i == nr if node is not None else getattr(n, "variable", None) is t

    stop = {x.grad_fn for x in inputs}
    own: set[Any] = set()
    todo = [o.grad_fn for o in outputs]
    while todo:
        fn = todo.pop()
        if fn is None or fn in own or fn in stop:
            continue
        own.add(fn)
        todo.extend(n for n, _ in fn.next_functions)
    return any(takes(n, i) for fn in graph_nodes(roots) if fn not in own for n, i in fn.next_functions if n is not None)


def blame_nodes(nodes: list[Any], run: Any) -> Blame | None:
    """Hook ``nodes``, call ``run()`` (a backward), return the creator: the first node, in
    execution order, that produced a non-finite gradient from finite ones."""
    order: list[tuple[Any, list[bool], list[bool], tuple[Any, ...]]] = []
    handles = []
    inner: list[OpOrigin | None] = []  # the first creator's, when it is a custom Function's node
    saved_bad: list[bool] = []  # ... and whether a forward value it saved was non-finite already
    den: list[Any] = []  # ... and whether it divided by a learned parameter at 0 (`param_den`)
    zero: list[tuple[int, int] | None] = []  # ... and where it was given a 0 gradient and made the value (`zero_fed`)
    drops: dict[Any, torch.Tensor] = {}  # each where's masked-out elements (`dropped`)

    def hook(fn: Any) -> Any:
        def post(gi: Any, go: Any) -> None:
            if fn.name().startswith(_SELECT):
                d = dropped(gi, go)
                if d is not None:
                    drops[fn] = d
            ob = [isinstance(g, torch.Tensor) and is_bad(g) for g in gi]
            ib = [isinstance(g, torch.Tensor) and is_bad(g) for g in go]
            order.append((fn, ib, ob, tuple(gi) if any(ob) else ()))
            if any(ob) and not any(ib) and not inner:  # the creator, as blamed below: its saved tensors are alive now
                inner.append(python_backward(fn, go, gi, ob.index(True)))
                saved_bad.append(_saved_bad(fn))
                den.append(param_den(fn))
                zero.append(zeroed_at(zero_fed(gi, go)))
        return post

    try:
        for fn in nodes:
            if fn.name() != "torch::autograd::AccumulateGrad":
                handles.append(fn.register_hook(hook(fn)))
        run()
    finally:
        for h in handles:
            h.remove()
    bad_out = {fn: ob for fn, _ib, ob, _gi in order}
    for i, (fn, ib, ob, gi) in enumerate(order):
        if not any(ob) or any(ib):
            continue
        slot = ob.index(True)
        chain = [fn]
        nxt = fn.next_functions[slot][0] if slot < len(fn.next_functions) else None
        while nxt is not None and nxt not in chain and any(bad_out.get(nxt, ())):
            chain.append(nxt)
            s = bad_out[nxt].index(True)
            nxt = nxt.next_functions[s][0] if s < len(nxt.next_functions) else None
        trap = where_trap(fn, list(bad_out), zero[0] if zero else None, drops)
        # (a where-trap's saved value is non-finite too, where the where masked it: its own hint)
        facts = {"where_trap": trap, "saved_bad": bool(saved_bad and saved_bad[0]) and not trap}
        if den and den[0] is not None and not trap and bool(den[0]):
            facts["den_param"] = True
        facts.update(pow_exponent(fn))
        nth = sum(1 for o in order[:i] if o[0].name() == fn.name())
        return Blame(fn, slot, gi[slot], chain, facts, nth, inner[0] if inner else None)
    return None


def _saved_bad(fn: Any) -> bool:
    """Does node ``fn`` hold a non-finite forward value it saved (``exp``'s +inf result, which a
    tanh after it hid from every output: its backward's 0 * inf is the NaN)?"""
    try:
        for a in dir(fn):
            if a.startswith("_saved_"):
                v = getattr(fn, a, None)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and is_bad(v):
                    return True
    except Exception:  # (a saved value already freed, an attribute that cannot be read)
        return False
    return False


def creator(top: Top, names: dict[nn.Module, str], grads: list[torch.Tensor | None],
            params: list[Any]) -> Born | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's code warned once already
            return _creator(top, names, grads, params)
    except Exception:
        return None


def _creator(top: Top, names: dict[nn.Module, str], grads: list[torch.Tensor | None],
             params: list[Any]) -> Born | None:
    # (module, inputs, output, which of its calls) in completion order; a call's number is in the
    # order the calls began, as the step's log numbers them (a recursive module's parent call ends
    # after its children)
    done: list[tuple[nn.Module, Any, Any, int]] = []
    stack: list[nn.Module] = []
    nths: list[int] = []  # which call of its module each call on the stack is
    begun: dict[nn.Module, int] = {}

    def pre(module: nn.Module, args: Any) -> None:
        if module in names:
            stack.append(module)
            nths.append(begun.get(module, 0))
            begun[module] = nths[-1] + 1

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None) -> None:
        if stack and stack[-1] is module:
            stack.pop()
            done.append((module, (args, kwargs if isinstance(kwargs, dict) else {}), output, nths.pop()))

    rec = _Recorder()
    mode = _Mode(rec, track_nodes=True)
    hooks = ReplayHooks(pre, post)
    made: list[tuple[Any, str, nn.Module, int, torch.Tensor]] = []  # (`_checked_hooks`)
    try:
        with faithful(top) as cut, torch.enable_grad(), mode, _checked_hooks(made, stack, top.module, nths):
            out = top.module(*top.args, **(top.kwargs or {}))
            mode.flush()
    finally:
        hooks.remove()
    outs = [t for _, t in tensors(out) if t.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    if not pairs:
        return None
    nodes = graph_nodes([o.grad_fn for o, _ in pairs])
    leaves = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
    leaves += [t for _, t in tensors(top.args) if t.requires_grad and t.is_leaf] + cut
    if not leaves:
        return None

    def run() -> None:
        torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)

    got = blame_nodes(nodes, run)
    if got is None and made:  # no node made it: a gradient hook the forward registered did
        user, line, by, nth, grad = made[0]
        return Born("", line, grad, 0, [], by, names.get(by, ""), {"tensor_hook": hook_names([user]), "registered": True},
                    0, nth)
    if got is None:
        return None
    owner, call = _owner(got.fn, done)
    op, src, chain, facts = named(got, lambda n: mode.node_src.get(n, (None, False))[0],
                                  mode.node_src.get(got.fn, (None, False))[0])
    hooked = _hook_owner(got.fn, done) if got.fn.name() == _HOOK_NODE else None
    if hooked is not None:  # the user's backward hook of a module made it: that module, at the hook's line
        owner, call, users = hooked
        src = hook_line(users[0])
        facts = {**facts, "backward_hook": hook_names(users)}
    return Born(op, src, got.grad, got.slot, chain, owner, names.get(owner, "") if owner is not None else "",
                facts, got.nth, call, got.fn.name())


def checked_hook(user: Any, made: list[Any], *where: Any) -> Any:
    """``user``, a gradient hook of the user's, as a replay runs it: the first hook that turns a finite
    gradient non-finite goes into ``made`` as (``user``, ``*where``, the gradient it returned)."""
    def hook(g: torch.Tensor) -> Any:
        out = user(g)
        got = g if out is None else out
        if not made and isinstance(got, torch.Tensor) and is_bad(got) and not is_bad(g):
            made.append((user, *where, got))
        return out
    return hook


@contextlib.contextmanager
def _checked_hooks(made: list[tuple[Any, str, nn.Module, int, torch.Tensor]], stack: list[nn.Module],
                   root: nn.Module, nths: list[int]) -> Iterator[None]:
    """While a replayed forward runs on this thread: each gradient hook that the user's code in it
    registers (``h.register_hook(fn)`` on an activation) runs checked, and the first that turns a
    finite gradient non-finite goes into ``made``: (fn, the line that registered it, the module whose
    forward did, which of its calls)."""
    me = get_ident()

    def register_hook(t: torch.Tensor, fn: Any) -> Any:
        caller = sys._getframe(1)
        if get_ident() != me or not callable(fn) or _kind(caller.f_code.co_filename) != _USER:
            return orig(t, fn)  # (another thread's; torch's own: a module's full backward hook)
        owner = stack[-1] if stack else root
        where = (f"{caller.f_code.co_filename}:{caller.f_lineno}", owner, nths[-1] if stack else 0)
        return orig(t, checked_hook(fn, made, *where))

    orig = torch.Tensor.register_hook
    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = orig  # type: ignore[method-assign]


_HOOK_NODE = "BackwardHookFunctionBackward"  # the node a module's full backward (pre-)hooks run in


def _hook_owner(fn: Any, done: list[tuple[nn.Module, Any, Any, int]]) -> tuple[nn.Module, int, list[Any]] | None:
    """The module whose full backward hooks run in node ``fn``: the one whose inputs it wraps
    (``register_full_backward_hook``: the hook returns the gradients of the inputs) or whose
    outputs it wraps (``register_full_backward_pre_hook``: the gradients of the outputs); that
    module, which of its calls, and its hooks of that kind (which of several made it, no node says)."""
    for module, inputs, output, call in done:
        full = list(module._backward_hooks.values()) if getattr(module, "_is_full_backward_hook", None) else []
        pre = list(module._backward_pre_hooks.values())
        if not full and not pre:
            continue
        if full and fn in {t.grad_fn for _, t in tensors(inputs) if isinstance(t, torch.Tensor)}:
            return module, call, full
        outs = {t.grad_fn for _, t in tensors(output) if isinstance(t, torch.Tensor)}
        if pre and any(n in outs for n, _ in fn.next_functions if n is not None):
            return module, call, pre
    return None


def hook_names(hooks: list[Any]) -> str:
    """The hooks' names for a hint: ``norm_grad``, or ``a, b`` (which of several made a value, no node says)."""
    names = [getattr(h, "__qualname__", None) or type(h).__name__ for h in (getattr(h, "func", h) for h in hooks)]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def hook_line(hook: Any) -> str | None:
    """``file:line`` where a hook function is defined."""
    f = getattr(hook, "func", hook)  # (a functools.partial)
    call = vars(type(f)).get("__call__")  # (a callable object: its class's method)
    code = getattr(f, "__code__", None) or getattr(call, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def _owner(target: Any, done: list[tuple[nn.Module, Any, Any, int]]) -> tuple[nn.Module | None, int]:
    """The innermost watched call whose outputs reach ``target`` before its inputs' nodes: its
    module, and which of that module's calls it was (0: the first)."""
    for module, inputs, output, call in done:  # children complete before their parents
        stop = {t.grad_fn for _, t in tensors(inputs) if isinstance(t, torch.Tensor)}
        stop |= {t.grad_fn for _, t in tensors(inputs) if isinstance(t, torch.Tensor)}
        todo = [t.grad_fn for _, t in tensors(output) if isinstance(t, torch.Tensor)]
        seen: set[Any] = set()
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen or fn in stop:
                continue
            if fn is target:
                return module, call
            seen.add(fn)
            todo.extend(n for n, _ in fn.next_functions)
    return None, 0


def tensor_hooks(p: torch.Tensor) -> list[Any]:
    """The user's hooks on a tensor's gradient (``register_hook``, ``register_post_accumulate_grad_hook``),
    nanhunt's and torch's own (DDP's, FSDP's) left out."""
    hooks = [*(getattr(p, "_backward_hooks", None) or {}).values(),
             *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]
    return [h for h in hooks
            if not str(getattr(getattr(h, "func", h), "__module__", None) or "").startswith(("nanhunt.", "torch."))]
