"""Global module hooks that come off cleanly (torch <= 2.13 leaves a removed with_kwargs hook's id
behind), and the process-wide rules every nanhunt hook obeys so that hunts compose:

- **Replays are invisible.** While a thread replays a recorded call (after a hit), every nanhunt
  hook on that thread stands aside (`replaying_here()`): no other hunt counts the replay as a root
  call, records it into its step, or hooks its tensors. One dict lookup when nothing replays.
- **Hunts opened** are announced (`hunt_opened`) to whoever subscribed: ``nanhunt run`` leaves a
  model the script watches itself to the script's own hunt.
- **One clock.** `tick` numbers events across every hunt of the process (a top-level call begins,
  a backward starts, a finding is recorded): with several models (a GAN's generator and
  discriminator, a teacher and a student) the hunts' findings are put in order of occurrence by it.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from threading import Lock, get_ident
from typing import Any

import torch
from torch.nn.modules import module as _module_mod
from torch.optim import optimizer as _optim_mod

# True inside torch.func transforms (vmap, grad, jacrev: per-sample gradients), read from the
# dispatch keys. (`torch._C._functorch.maybe_current_level()` makes the thread's functorch state on
# its first call, and from then on the autograd engine copies that state for every node of every
# backward: +0.2 M instructions, 2 %, on each backward of the benchmark MLP, for the life of the thread.)
in_transform: Callable[[], bool] = torch._C._are_functorch_transforms_active

__all__ = ["GlobalHooks", "ReplayHooks", "MODULE_REGISTRATION", "OPTIMIZER_STEP", "REPLAYING", "replaying", "replaying_here", "on_hunt_opened", "hunt_opened",
           "own_global_hooks", "tick", "in_transform"]

tick: Callable[[], int] = itertools.count(1).__next__  # the process's event clock (thread-safe: one C call)


# torch.compile(module) warns on every call while any global module hook exists ("... will cause
# the hooks to fire an extra time for the OptimizedModule"): nanhunt's hooks expect that call and
# stand aside for it, so while they are the only global hooks, that warning is not shown
_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_ours: list[GlobalHooks] = []
_extra = 0  # global module hooks of nanhunt's own besides `GlobalHooks` (`nanhunt run`'s discovery)
_filter: Any = None
_filters: Any = None  # the list it went into (catch_warnings swaps in a copy for its block)


def _global_hook_count() -> int:
    return sum(len(d) for d in (_module_mod._global_forward_hooks, _module_mod._global_forward_pre_hooks,
                                _module_mod._global_backward_hooks, _module_mod._global_backward_pre_hooks))


def own_global_hooks(n: int) -> None:
    """``n`` more (or, negative, fewer) global module hooks are nanhunt's own, outside `GlobalHooks`."""
    global _extra
    _extra += n
    if n > 0:
        _quiet_compile_warning()
    else:
        _restore_compile_warning()


def _quiet_compile_warning() -> None:
    global _filter, _filters
    own = 2 * len(_ours) + _extra
    if _filter is None and _global_hook_count() == own:  # no global hook of the user's
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        _filter, _filters = warnings.filters[0], warnings.filters


def _restore_compile_warning() -> None:
    global _filter, _filters
    if _filter is not None and not _ours and not _extra:
        lists: list[Any] = [_filters, warnings.filters]  # where it went in, and a catch_warnings copy
        for filters in lists:
            if _filter in filters:
                filters.remove(_filter)
        warnings._filters_mutated()  # type: ignore[attr-defined]
        _filter = _filters = None


class GlobalHooks:
    """A forward pre-hook and a forward hook (with kwargs, always called) on every module."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._handles = [
            _module_mod.register_module_forward_pre_hook(pre),
            _module_mod.register_module_forward_hook(post, with_kwargs=True, always_call=True),
        ]
        self._off: tuple[Any, Any] | None = None  # the hooks while `off`
        _ours.append(self)
        _quiet_compile_warning()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
            _module_mod._global_forward_hooks_with_kwargs.pop(h.id, None)
        self._handles.clear()
        self._off = None
        if self in _ours:
            _ours.remove(self)
            _restore_compile_warning()

    def off(self) -> bool:
        """Take both hooks out of torch's dicts for a while (`on` puts them back), only where they
        are the only global forward hooks (so that putting them back keeps every hook's order):
        module calls meanwhile take ``_call_impl``'s fast path. False when not taken off."""
        pre, post = _module_mod._global_forward_pre_hooks, _module_mod._global_forward_hooks
        if len(pre) != 1 or len(post) != 1 or len(self._handles) != 2:
            return False
        a, b = self._handles
        hp, hf = pre.get(a.id), post.get(b.id)
        if hp is None or hf is None:
            return False
        del pre[a.id], post[b.id]
        self._off = (hp, hf)
        return True

    def on(self) -> None:
        """Put the hooks `off` took out back (not after `remove`)."""
        got, self._off = self._off, None
        if got is not None and len(self._handles) == 2:
            _module_mod._global_forward_pre_hooks[self._handles[0].id] = got[0]
            _module_mod._global_forward_hooks[self._handles[1].id] = got[1]


class Shared:
    """One hook in one of torch's process-wide tables that torch iterates live while it calls each
    hook (the module registration hooks as a child is set, the optimizer pre-hooks as ``step()``
    begins), shared by every hunt: a hunt opened or closed meanwhile (from another hunt's
    ``on_find``, or on another thread) made that call raise "OrderedDict mutated during
    iteration". Hunts come and go in a tuple of ours, read as the hook runs; torch's table changes
    only when the first comes and the last goes."""

    def __init__(self, register: Callable[[Callable[..., None]], Any]) -> None:
        self._register = register
        self._fns: tuple[Callable[..., None], ...] = ()
        self._handle: Any = None
        self._lock = Lock()

    def _call(self, *args: Any) -> None:
        for fn in self._fns:  # (a hook never replaces what torch passes on: None)
            fn(*args)

    def add(self, fn: Callable[..., None]) -> SharedHandle:
        with self._lock:
            self._fns = (*self._fns, fn)
            if self._handle is None:
                self._handle = self._register(self._call)
        return SharedHandle(self, fn)

    def discard(self, fn: Callable[..., None]) -> None:
        with self._lock:
            self._fns = tuple(f for f in self._fns if f is not fn)
            if not self._fns and self._handle is not None:
                self._handle.remove()
                self._handle = None


class SharedHandle:
    """What `Shared.add` returns: ``remove()`` as a torch handle's."""

    def __init__(self, shared: Shared, fn: Callable[..., None]) -> None:
        self._shared: Shared | None = shared
        self._fn = fn

    def remove(self) -> None:
        if self._shared is not None:
            self._shared.discard(self._fn)
            self._shared = None


MODULE_REGISTRATION = Shared(_module_mod.register_module_module_registration_hook)
OPTIMIZER_STEP = Shared(_optim_mod.register_optimizer_step_pre_hook)


class ReplayHooks(GlobalHooks):
    """`GlobalHooks` for a replay after a hit: calls made inside torch.func transforms (vmap,
    grad) are not seen, as the hunt's recorder does not see them (their tensors are wrapped and
    die with the transform), so the replay counts the same calls as the record. A module with
    forward hooks of its own is seen after them, as the hunt sees it (a user's hook may replace
    the output: what the program goes on with is what is judged): ``post`` runs from a hook of its
    own put last on that module for the replay, removed with the others. Only the thread that
    replays is seen: the hooks are global, and a thread that runs the model meanwhile (inference in
    the background) is none of the replay's business."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        late: dict[int, Any] = {}  # id(module) -> the handle of its per-module hook for this replay
        self._late = late
        me = get_ident()

        def pre_hook(module: Any, args: Any) -> Any:
            if in_transform() or get_ident() != me:
                return None
            hooks = module._forward_hooks
            if hooks:
                h = late.get(id(module))
                if h is None:
                    late[id(module)] = module.register_forward_hook(late_hook, with_kwargs=True, always_call=True)
                elif next(reversed(hooks)) != h.id:
                    hooks.move_to_end(h.id)
            return pre(module, args)

        def post_hook(module: Any, *args: Any) -> Any:
            if in_transform() or id(module) in late or get_ident() != me:
                return None
            return post(module, *args)

        def late_hook(module: Any, *args: Any) -> Any:
            return None if in_transform() or get_ident() != me else post(module, *args)

        super().__init__(pre_hook, post_hook)

    def remove(self) -> None:
        super().remove()
        for h in self._late.values():
            h.remove()
        self._late.clear()


# thread ident -> depth of the replays under way on that thread. Hot-path check, when nothing
# replays (the usual case): `if REPLAYING and ...` is one global load and an empty-dict test.
REPLAYING: dict[int, int] = {}


def replaying_here() -> bool:
    """Is this thread replaying a recorded call (so nanhunt's hooks must stand aside)?"""
    return bool(REPLAYING) and get_ident() in REPLAYING


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Mark this thread as replaying for the block (nests)."""
    t = get_ident()
    REPLAYING[t] = REPLAYING.get(t, 0) + 1
    try:
        yield
    finally:
        n = REPLAYING[t] - 1
        if n:
            REPLAYING[t] = n
        else:
            del REPLAYING[t]


_opened: list[Callable[[Any], None]] = []


def on_hunt_opened(fn: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``fn(hunt)`` for every hunt opened from now on; returns the function that stops it."""
    _opened.append(fn)

    def stop() -> None:
        if fn in _opened:
            _opened.remove(fn)

    return stop


def hunt_opened(hunt: Any) -> None:
    """Announce a new hunt (its hooks are in place)."""
    for fn in list(_opened):
        fn(hunt)
