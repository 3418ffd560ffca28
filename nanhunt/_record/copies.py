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

``torch.jit.script`` of a watched module (an export in the middle of a run) compiles every module's
``forward`` and forward hooks, and would try to compile the wrappers and hooks: so while anything
is held, ``torch.jit._recursive.create_script_module`` (where ``torch.jit.script`` and the export
path of ``torch.jit.trace`` build their ScriptModule; looked up at call time) is replaced by
`_create_script_module`, which takes nanhunt's wrappers and hooks off the modules being scripted
while the original runs and puts them back as they were, order included: the ScriptModule is the
one an unwatched model gives, and the hunt goes on. The original comes back with the last release
(unless someone replaced it after us: then ours stays in their chain as a pass-through).
"""

from __future__ import annotations

import copyreg
import threading
from collections.abc import Callable
from typing import Any

import torch.jit._recursive as _recursive

__all__ = ["hold", "release"]

_lock = threading.Lock()
_classes: dict[type, list[Any]] = {}  # class -> [holds, the dispatch_table entry there before us (or None)]
# a module's hook dicts by name, with the companions keyed by the same hook ids
_HOOKS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
}
_CREATE: Callable[..., Any] = _recursive.create_script_module  # torch's own, as it was at import
_create_original: Callable[..., Any] | None = None  # what was there when we replaced it


def hold(cls: type) -> None:
    """Something of a hunt's is on an instance of ``cls`` (a wrapper, a hook)."""
    with _lock:
        got = _classes.get(cls)
        if got is None:
            if not _classes:
                _install()
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
        if not _classes:
            _uninstall()


def _install() -> None:
    global _create_original
    if _recursive.create_script_module is not _create_script_module:
        _create_original = _recursive.create_script_module
        _recursive.create_script_module = _create_script_module


def _uninstall() -> None:
    global _create_original
    if _recursive.create_script_module is _create_script_module:
        _recursive.create_script_module = _create_original if _create_original is not None else _CREATE
        _create_original = None


def _create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.jit._recursive.create_script_module`` with nanhunt's wrappers and hooks off the
    modules it scripts while it runs (see the module docstring)."""
    original = _create_original if _create_original is not None else _CREATE
    if not _classes:  # (a pass-through in someone's chain)
        return original(nn_module, *args, **kwargs)
    aside: list[tuple[dict[str, Any], str, Any]] = []  # (dict, key, what it held): put back in reverse
    try:
        for m in nn_module.modules():
            d = m.__dict__
            if _ours(d.get("forward")):
                own = _own(d["forward"])
                aside.append((d, "forward", d["forward"]))
                if own is None:
                    del d["forward"]
                else:
                    d["forward"] = own
            for name in _HOOKS:
                hooks = d.get(name)
                if isinstance(hooks, dict) and any(_ours(v) for v in hooks.values()):
                    aside.append((d, name, hooks.copy()))  # (its order, to put back)
                    for k in [k for k, v in hooks.items() if _ours(v)]:
                        del hooks[k]
        return original(nn_module, *args, **kwargs)
    finally:
        for d, key, held in reversed(aside):
            if key == "forward":
                d["forward"] = held
            else:
                hooks = d[key]
                hooks.clear()
                hooks.update(held)


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


def _own(w: Any) -> Any:
    """The instance's own ``forward`` beneath nanhunt's wrapper ``w`` (and other hunts'), or None."""
    own = getattr(w, "own", None)
    while _ours(own):  # another hunt's wrapper, beneath
        own = getattr(own, "own", None)
    return own


def _without_ours(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a module's ``__dict__``: never changed) without nanhunt's wrapper and hooks."""
    out: dict[str, Any] | None = None
    w = state.get("forward")
    if _ours(w):
        out = dict(state)
        own = _own(w)
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
