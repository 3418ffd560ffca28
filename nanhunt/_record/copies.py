"""Copies and pickles of watched modules are what they are unwatched.

While a hunt is open its `Forward` wrappers sit in modules' ``__dict__`` and its hooks
(`hunt._OnModule`: the root's in sentinel mode, the late hooks after a user's forward hooks) in
their hook dicts. ``copy.deepcopy`` (an EMA copy, a teacher), ``copy.copy``, ``pickle`` and
``torch.save(model)`` would carry them into the copy or file, for good: an instance ``forward``
that a class patched later never reaches, a no-op hook, other bytes. So while a module's class has
anything of a hunt's on one of its instances, ``copyreg.dispatch_table`` holds an entry for that
class (`_reduce`): the class's own reduction (or the entry there before, which it calls), with
every object of nanhunt's (``__nanhunt__`` on its type) left out of the state: a wrapper gives
way to the instance's own ``forward`` of before, a hook goes with its entries in the hook dicts'
companions (``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called``). The entries are
counted by class (`hold`, `release`) and taken out with the last; a user's entry made since stays.
A class with a ``__deepcopy__`` of its own is copied its way (the wrapper copies as the module's
own ``forward``, bound to the copy; a hook as a no-op).
"""

from __future__ import annotations

import copyreg
import threading
from typing import Any

__all__ = ["hold", "release"]

_lock = threading.Lock()
_classes: dict[type, list[Any]] = {}  # class -> [holds, the dispatch_table entry there before us (or None)]
# a module's hook dicts by name, with the companions keyed by the same hook ids
_HOOKS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
}


def hold(cls: type) -> None:
    """Something of a hunt's is on an instance of ``cls`` (a wrapper, a hook)."""
    with _lock:
        got = _classes.get(cls)
        if got is None:
            _classes[cls] = [1, copyreg.dispatch_table.get(cls)]
            copyreg.dispatch_table[cls] = _reduce
        else:
            got[0] += 1


def release(cls: type) -> None:
    """It came off again (the last: the class's entry goes, the one before comes back)."""
    with _lock:
        got = _classes.get(cls)
        if got is None:
            return
        got[0] -= 1
        if got[0] > 0:
            return
        del _classes[cls]
        if copyreg.dispatch_table.get(cls) is _reduce:  # (else replaced since: the new one stays)
            if got[1] is not None:
                copyreg.dispatch_table[cls] = got[1]
            else:
                del copyreg.dispatch_table[cls]


def _reduce(obj: Any) -> Any:
    got = _classes.get(type(obj))
    before = got[1] if got is not None else None
    rv = before(obj) if before is not None else obj.__reduce_ex__(2)
    if not isinstance(rv, tuple) or len(rv) < 3:
        return rv
    state = rv[2]
    if isinstance(state, dict):
        state = _without_ours(state)
    elif isinstance(state, tuple) and state and isinstance(state[0], dict):  # (__dict__, __slots__ values)
        state = (_without_ours(state[0]), *state[1:])
    return (rv[0], rv[1], state, *rv[3:])


def _ours(v: Any) -> bool:
    return getattr(type(v), "__nanhunt__", False) is True


def _without_ours(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a module's ``__dict__``: never changed) without nanhunt's wrapper and hooks."""
    out: dict[str, Any] | None = None
    w = state.get("forward")
    if _ours(w):
        out = dict(state)
        own = getattr(w, "own", None)
        while _ours(own):  # another hunt's wrapper, beneath
            own = getattr(own, "own", None)
        if own is None:
            del out["forward"]
        else:
            out["forward"] = own
    for name, companions in _HOOKS.items():
        hooks = state.get(name)
        if not isinstance(hooks, dict):
            continue
        ids = [k for k, v in hooks.items() if _ours(v)]
        if not ids:
            continue
        if out is None:
            out = dict(state)
        out[name] = d = hooks.copy()  # (an OrderedDict stays one)
        for k in ids:
            del d[k]
        for c in companions:
            comp = state.get(c)
            if isinstance(comp, dict) and any(k in comp for k in ids):
                out[c] = comp = comp.copy()
                for k in ids:
                    comp.pop(k, None)
    return state if out is None else out
