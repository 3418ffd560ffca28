"""Full mode's per-module ``forward`` wrappers: the calls inside a top-level call, seen without
torch's hook dispatch.

Any global module hook puts every module call of the process on ``Module._call_impl``'s slow
path: two empty global hooks cost ~19 K instructions a call on the benchmark MLP, more than the
record they feed. So while a watched top-level call runs its own forward, full mode takes its two
global hooks off (`GlobalHooks.off`, only while they are the only global module hooks) and sees
the calls beneath it through an instance attribute ``forward`` on each watched module (a
`Forward`), which keeps those calls on the fast path; the hooks go back on as that forward
returns, before torch runs the top-level call's forward hooks. The hooks still see everything
else, as before: the top-level call itself, calls between top-level calls (loss modules), and
every call of a top-level call that cannot be wrapped (a compiled part, another global hook, a
watched module whose ``forward`` is not its `Forward`: replaced since, Lightning's redirection).
Then the wrappers stand aside. The record is the same either way: the common call is pushed by
`Hunt._push` and ended by `Hunt._done` (the code the hooks run), anything else goes through the
hooks' own `Hunt._pre` and `Hunt._post`.

The lean path: a wrapper whose module is known never to write its output after returning (or a
passthrough module, whose output is not probed; `Hunt._lean_flags`) only notes its call in one list
(itself as the call begins, its output and the output's version as it returns: ~1 us), and
`Hunt._flush` records the noted calls in order as `_push`/`_done` record one, at the top-level
call's return or before anything else touches the step's record. An output other than one tensor,
or an exception, is recorded at once (after a flush), as the hooks record it.

What a `Forward` changes for the user while the hunt is open: ``module.forward`` is an instance
attribute (`inspect.signature` sees through it: ``__wrapped__``); close() takes it off again (a
dormant pass-through stays where another wrapper was put on top of it since). A copy or a pickle of
the module (``copy.deepcopy``: an EMA copy; ``copy.copy``; ``pickle``; ``torch.save(model)``) is
what it would be unwatched, with no ``forward`` of nanhunt's in any module's ``__dict__`` (copies.py).
"""

from __future__ import annotations

import copy
import types
import weakref
from threading import get_ident
from typing import Any

import torch
from torch import nn

from .._hooks import REPLAYING, in_transform
from .copies import hold, release

__all__ = ["Forward", "install", "remove", "LAZY_NUMEL"]

_get_ident = get_ident
_Tensor = torch.Tensor
_F32 = torch.float32
# outputs up to this many elements (float32) are probed together at the top-level call's return
# (`Hunt._done_tensor`'s deferred probes): only those wait for `Hunt._flush`
LAZY_NUMEL = 1 << 14
NOTED_CAP = 3 * 128  # list items: at most 128 outputs wait for `Hunt._flush` (<= 8 MiB)
_tracing_state = torch._C._get_tracing_state  # None unless torch.jit.trace is recording
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # False eagerly (one call), True while dynamo traces


class Forward:
    """``module.forward`` while a full-mode hunt is open (see the module docstring)."""

    __slots__ = ("hunt", "ref", "func", "own", "lean", "name", "cls", "__weakref__")
    __nanhunt__ = True  # (bundles and reports leave it out of a module's attributes)

    def __init__(self, hunt: Any, module: nn.Module, own: Any) -> None:
        self.hunt = hunt
        self.ref = weakref.ref(module)  # (no cycle: a module dropped from the model dies as before)
        self.own = own  # the instance's own forward before (accelerate's, a user's), else None
        self.func = type(module).forward  # (only once the module is gone: a live one's class is asked at each call,
        # as torch does: a class patched or an instance's __class__ swapped after watch() runs as it would unwatched)
        self.cls = type(module)  # (its `copyreg` entry is counted by class: see copies.py)
        self.lean = False  # its calls are only noted (`Hunt._lean_flags`), recorded at the next `Hunt._flush`
        self.name = ""  # its qualified name (set with `lean`)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        h = self.hunt
        # (dynamo traces this as the module's forward: nothing it cannot trace before that test)
        if h is None or not (h._inner or h._arm is not None) or _dynamo_compiling():
            if h is not None and h._owner != _get_ident() and not _dynamo_compiling():
                # another thread owns the step, or none does and this one may not take it (an
                # evaluation thread before the first step(): `Hunt._take_step`)
                return self.foreign(h, args, kwargs)
            return self.run(args, kwargs)
        if h._inner == _get_ident():  # a call inside the top-level call: recorded here
            m = self.ref()
            if m is None:
                return self.run(args, kwargs)
            ev = h._ev
            lean = (ev is not None and self.lean and not m._forward_hooks and _tracing_state() is None
                    and not in_transform())
            if lean:  # the lean path: the call is only noted; `Hunt._flush` records it as `_push` would
                ev.append(self)
                c = None
            else:
                c = h._push(m, args)
            try:
                own = self.own
                out = own(*args, **kwargs) if own is not None else type(m).forward(m, *args, **kwargs)
            except Exception:
                h._post(m, args, None)  # (as torch's always-called hook: the stack unwinds)
                raise
            if (lean and type(out) is _Tensor and out.dtype is _F32 and out.numel() <= LAZY_NUMEL
                    and not out.is_inference() and h._ev is ev):
                ev.append(out)  # its output and that output's version at return
                ev.append(out._version)
                if len(ev) >= NOTED_CAP:  # (the list holds its outputs)
                    h._flush()
                return out
            if h._owner != _get_ident():  # (a lean call noted into a list `_detach` set aside)
                return out  # the step was taken from this thread meanwhile (`Hunt._detach`)
            # recorded now, as the global hook records a call: a call that is not lean; a lean one
            # whose output is probed at once, not deferred (a tuple's or a dict's tensors, a large,
            # half-precision or inference output: it may be written in place after it returns), or
            # during which the lean path ended (a child registered, the step ended). The lean calls
            # inside it are recorded first (its children, before it)
            if h._evbuf:
                h._flush()
            stack = h._stack
            if c is not None and stack and stack[-1] is c and not h._paused:
                stack.pop()  # (what the global forward hook would do: `Hunt._post`)
                h._done_safe(c, m, args, kwargs, out)
            else:
                h._post(m, args, kwargs, out)
            return out
        if h._arm is not None and h._enter(self):  # the top-level call's own forward: the hooks come off
            try:
                return self.run(args, kwargs)
            finally:
                h._leave()
        if h._owner != _get_ident():  # another thread's call while the owner's runs with the hooks off
            return self.foreign(h, args, kwargs)
        return self.run(args, kwargs)

    def foreign(self, h: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call from a thread that does not own the step: judged on its own (`Hunt._foreign_call`)."""
        m = self.ref()
        if m is None or (REPLAYING and _get_ident() in REPLAYING):
            return self.run(args, kwargs)
        return h._foreign_call(self, m, args, kwargs)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's forward itself."""
        own = self.own
        if own is not None:
            return own(*args, **kwargs)
        m = self.ref()
        if m is None:
            raise RuntimeError("nanhunt: this forward belongs to a module that no longer exists (a shallow "
                               "copy.copy of a watched module outlived it); use copy.deepcopy")
        return type(m).forward(m, *args, **kwargs)

    # what the module's forward looks like to code that inspects it
    @property
    def __wrapped__(self) -> Any:
        if self.own is not None:
            return self.own
        m = self.ref()
        return types.MethodType(type(m).forward, m) if m is not None else self.func

    @property
    def __self__(self) -> Any:
        return self.ref()

    @property
    def __name__(self) -> str:
        return getattr(self.__wrapped__, "__name__", "forward")

    # copies and pickles of the module get its own forward, never the wrapper
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.own is not None:
            return copy.deepcopy(self.own, memo)
        m = self.ref()
        if m is None:
            return self.func
        c = copy.deepcopy(m, memo)
        return types.MethodType(type(c).forward, c)

    def __copy__(self) -> Any:
        return self.__wrapped__

    def __reduce__(self) -> Any:
        # (nothing of nanhunt's in a pickle: the module's forward looked up again as it loads, or
        # the instance's own forward of before)
        if self.own is not None:
            return (copy.copy, (self.own,))
        m = self.ref()
        return (getattr, (m, "forward")) if m is not None else (getattr, (self.func, "__call__"))

    def __repr__(self) -> str:
        return f"<nanhunt forward of {self.__wrapped__!r}>"


def install(hunt: Any, module: nn.Module) -> Forward:
    """Put the hunt's `Forward` on ``module`` (or return the one already there)."""
    d = module.__dict__
    cur = d.get("forward")
    if isinstance(cur, Forward) and cur.hunt is hunt:
        return cur
    w = Forward(hunt, module, cur)
    d["forward"] = w
    hold(type(module))
    return w


def remove(w: Forward) -> None:
    """Take ``w`` off its module (what was there before goes back); where something was put on
    top of it since, it stays as a dormant pass-through."""
    m = w.ref()
    if w.hunt is not None:
        release(w.cls)  # (the class it was put on with: a swapped __class__ since does not move the count)
    w.hunt = None
    if m is None:
        return
    d = m.__dict__
    if d.get("forward") is w:
        below = w.own
        while isinstance(below, Forward) and below.hunt is None:  # another hunt's, closed before this one
            below = below.own
        if below is None:
            del d["forward"]
        else:
            d["forward"] = below
