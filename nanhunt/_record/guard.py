"""The checkpoint guard: while a hunt is open, ``torch.save`` (and safetensors' writers,
transformers' ``save_pretrained``, accelerate's ``save_state``) refuse non-finite model state.

``torch.save`` is replaced once, while at least one hunt with ``guard_saves=True`` is open, by a
function that asks each open hunt's :class:`SaveGuard` to judge the object first, and calls the
original only when none objects; the original is put back when the last such hunt closes (unless
someone replaced ``torch.save`` after us: then ours stays in their chain as a pass-through).

What is judged (everything else in the object is not: a callback's ``inf`` sentinel, user
metadata, a copy of a tensor under a name of its own):

* a tensor sharing its storage with a watched parameter, buffer or optimizer state tensor (what
  ``model.state_dict()`` and ``optimizer.state_dict()`` return);
* a copy of a state dict (``copy.deepcopy``, ``{k: v.cpu()}``): a tensor under a key that is a
  watched parameter's or buffer's qualified name, or ends in ``"." + name``, with the same shape;
* every tensor in the ``state`` of something shaped like an optimizer ``state_dict()`` (a copy of
  one), when the hunt watches an optimizer.

Buffers and frozen parameters that were already non-finite when the watch began (an intended
``-inf`` mask) are never judged; a buffer the model's own code put in place since (a mask built lazily for the longest
sequence seen: a new tensor, not an in-place write) is judged only once the hunt has found
something, as the step's buffer check does not judge a replaced buffer either (`state.py`). A hit raises `NonFiniteError` (phase ``"checkpoint"``) before the original runs: no byte
is written and a file already at that path is untouched. What the guard cannot walk (a property
or a mapping that raises, more than a million items) it leaves unjudged: it never makes a save
fail that would succeed unwatched, except for non-finite watched state. A module in the object is
walked as its parameters and buffers, never through ``state_dict()`` (a sharded model's gathers).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import is_lazy

from .._locate.checkpoint import SPARSE, Keys, TensorKey, all_bad, finding, judgeable, walk
from .._tensors import is_checked, stack_probes, strided, widen

if TYPE_CHECKING:
    from .hunt import Hunt

__all__ = ["SaveGuard", "saving_to"]

_guards: list[SaveGuard] = []
_WALKED = 1_000_000  # items of one saved object looked at, at most (a lazy mapping of a billion keys)
_logger = logging.getLogger("nanhunt")
_original: Callable[..., Any] | None = None
_name_hint: contextvars.ContextVar[str | None] = contextvars.ContextVar("nanhunt_save_name", default=None)

_OPTIMIZER_STATE = "optimizer state"
_HINT_PART = ("nanhunt refused to write this file: it holds part of the watched model's or optimizer's "
              "state, and another part of that state (the tensor named) is non-finite. Checkpoints "
              "written as several files (safetensors shards, one file per model) are refused from "
              "their first file, so none is left half new, half old (a file already at that path is "
              "unchanged). The hunt's first finding says where the values were born.")
_HINT = ("nanhunt refused to write this checkpoint: the watched model's or optimizer's state holds "
         "non-finite values (a file already at that path is unchanged). The hunt's first finding says "
         "where they were born; resume from the last good checkpoint.")


def _guarded_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
    for g in list(_guards):
        g.judge(obj, f)
    original = _original if _original is not None else _SERIALIZATION_SAVE
    with _hooks_aside([h for g in list(_guards) if (hunt := g._hunt()) is not None for h in hunt.module_hook_handles()]):
        return original(obj, f, *args, **kwargs)


@contextlib.contextmanager
def _hooks_aside(handles: list[Any]) -> Iterator[None]:
    """While a module is pickled (``torch.save(model)``), the hooks a hunt put on the user's own
    modules (sentinel's root hooks, the late hooks behind the user's forward hooks) are out of
    its hook dicts: the file is the one an unwatched save writes, and loading it needs no nanhunt.
    Each dict is put back as it was, order included."""
    saved: dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]] = {}
    try:
        for h in handles:
            for ref in (h.hooks_dict_ref, *getattr(h, "extra_dict_ref", ())):
                d = ref()
                if d is None or h.id not in d:
                    continue
                if id(d) not in saved:
                    saved[id(d)] = (d, list(d.items()))
                del d[h.id]
        yield
    finally:
        for d, items in saved.values():
            d.clear()
            d.update(items)


_SERIALIZATION_SAVE: Callable[..., Any] = torch.serialization.save  # torch's own, as it was at import
_serialization_original: Callable[..., Any] | None = None


functools.update_wrapper(_guarded_save, torch.serialization.save)


@contextlib.contextmanager
def saving_to(path: Any) -> Iterator[None]:
    """Name the file for a save that goes through a buffer (Lightning writes ``torch.save`` into a
    ``BytesIO``, then the bytes to ``path``)."""
    token = _name_hint.set(os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path))
    try:
        yield
    finally:
        _name_hint.reset(token)


def file_name(f: Any) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    hint = _name_hint.get()
    if hint is not None:
        return hint
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else f"<{type(f).__name__}>"


def _storage(t: torch.Tensor) -> tuple[Any, int] | None:
    """Where ``t``'s values live (a sparse tensor has no storage of its own: that of its values,
    which its state dict entry and its detached copies share)."""
    try:
        ptr = (strided(t) if t.layout in SPARSE else t).untyped_storage().data_ptr()
    except Exception:  # a tensor subclass without a storage (or one that raises); a lazy module's uninitialised tensor
        return None
    return (t.device, ptr) if ptr else None


# Writers other than torch.save. safetensors (Hugging Face's and accelerate's checkpoints,
# ``save_file(model.state_dict(), ...)``): its writers turn the dict of tensors into pointers in one
# module-level helper, looked up at call time (the writers themselves are often imported by name,
# ``from safetensors.torch import save_file``, before watch()); that helper is guarded, so every
# writer is. A checkpoint of several files is judged whole before its first file: transformers'
# ``save_pretrained`` (config, then weight shards) and accelerate's ``save_state`` (one file per
# model and optimizer) as they begin, each safetensors file against all of the watched state it
# is part of (`SaveGuard.check`, ``whole``). Each is put on while a guard is open and taken off with
# the last one (one put on top of ours since stays, ours a pass-through).
_ST_HELPERS = ("_flatten_as_ptr", "_flatten")  # (safetensors >= 0.6, before)
_patched: list[tuple[Any, str, Callable[..., Any]]] = []  # (owner, attribute, original)
# inside a writer that judged its whole checkpoint as it began: each file is judged by itself only
_whole_judged: contextvars.ContextVar[bool] = contextvars.ContextVar("nanhunt_whole_judged", default=False)
_st_looked = False


def _safetensors() -> Any:
    """``safetensors.torch`` when installed (imported here, once: ~2 ms), else None."""
    global _st_looked
    mod = sys.modules.get("safetensors.torch")
    if mod is None and not _st_looked:
        _st_looked = True
        if importlib.util.find_spec("safetensors") is not None:
            try:
                mod = importlib.import_module("safetensors.torch")
            except Exception:  # noqa: BLE001  (a broken install: its saves cannot run either)
                mod = None
    return mod


def _path(x: Any, default: str) -> str:
    return os.fspath(x) if isinstance(x, (str, os.PathLike)) else default


def _st_pick(caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str]:
    name = caller.f_locals.get("filename") if caller.f_code.co_name in ("save_file", "save_model") else None
    return args[0] if args else kwargs.get("tensors"), _path(name, "<safetensors bytes>")


def _hf_pick(caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str]:
    state = kwargs.get("state_dict")  # (a state dict given to write instead of the model's own)
    where = args[1] if len(args) > 1 else kwargs.get("save_directory")
    return (state if state is not None else args[0]), _path(where, "<save_pretrained>")


def _accelerate_pick(caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str]:
    acc = args[0]
    where = args[1] if len(args) > 1 else kwargs.get("output_dir")
    return ([*getattr(acc, "_models", ()), *getattr(acc, "_optimizers", ())],
            _path(where, "<accelerate save_state>"))


def _guarded(original: Callable[..., Any], pick: Callable[..., tuple[Any, str]], outer: bool) -> Callable[..., Any]:
    """``original`` judged first; ``outer``: it writes a whole checkpoint (judged whole as it
    begins), so the files it writes are judged each by itself only."""

    @functools.wraps(original)
    def writer(*args: Any, **kwargs: Any) -> Any:
        if not _guards:
            return original(*args, **kwargs)
        obj, target = pick(sys._getframe(1), args, kwargs)
        whole = not _whole_judged.get()
        for g in list(_guards):
            g.judge(obj, target, whole=whole)
        if not outer:
            return original(*args, **kwargs)
        token = _whole_judged.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _whole_judged.reset(token)

    writer.__nanhunt__ = True  # type: ignore[attr-defined]
    return writer


def _writers() -> list[tuple[Any, str, Callable[..., tuple[Any, str]], bool]]:
    """The writers there are to guard: (owner, attribute, what it writes and where, whether it
    writes a whole checkpoint of several files)."""
    out: list[tuple[Any, str, Callable[..., tuple[Any, str]], bool]] = []
    st = _safetensors()
    if st is not None:
        out += [(st, name, _st_pick, False) for name in _ST_HELPERS if callable(getattr(st, name, None))]
    hf = sys.modules.get("transformers.modeling_utils")  # (not imported here: only when the script did)
    if hf is not None and isinstance(getattr(hf, "PreTrainedModel", None), type):
        out.append((hf.PreTrainedModel, "save_pretrained", _hf_pick, True))
    acc = sys.modules.get("accelerate.accelerator")
    if acc is not None and isinstance(getattr(acc, "Accelerator", None), type):
        out.append((acc.Accelerator, "save_state", _accelerate_pick, True))
    return out


def _guard_writers() -> None:
    if _patched:
        return
    for owner, name, pick, outer in _writers():
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if callable(fn) and not getattr(fn, "__nanhunt__", False):
            _patched.append((owner, name, fn))
            setattr(owner, name, _guarded(fn, pick, outer))


def _unguard_writers() -> None:
    for owner, name, fn in _patched:
        cur = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if getattr(cur, "__wrapped__", None) is fn:
            setattr(owner, name, fn)
    _patched.clear()


def _kind(root: torch.nn.Module, name: str, b: torch.Tensor) -> tuple[Any, ...]:
    """A buffer's shape, dtype, device and the id of the module holding it (see `SaveGuard._converted`)."""
    try:
        owner: Any = root.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        owner = None
    return tuple(b.shape), b.dtype, b.device, id(owner)


class SaveGuard:
    """One hunt's judge of the objects handed to ``torch.save`` (and to safetensors' writers)."""

    def __init__(self, hunt: Hunt) -> None:
        self._hunt = weakref.ref(hunt)
        # buffers non-finite when the watch began (intended masks) are never judged. They are
        # probed on the device at the first step (watch() never walks the model) and read at the
        # first save, with what that save judges.
        self.pending = True
        self._buffers: list[tuple[str, torch.Tensor]] | None = None
        self._flags: torch.Tensor | None = None
        self._exempt_names: set[str] | None = None
        self._exempt: set[tuple[Any, int]] = set()
        self._known: set[tuple[Any, int]] | None = None  # the buffers' storages when the watch began
        self._shapes: dict[str, tuple[Any, ...]] = {}  # ... by name: shape, dtype, device, owner (see _converted)

    def first_step(self, root: torch.nn.Module) -> None:
        """The first step begins: probe the buffers as they were at watch() (no read)."""
        self.pending = False
        # buffers, and frozen parameters (a -inf mask kept as nn.Parameter(requires_grad=False)): constants
        self._buffers = [(n, b) for n, b in root.named_buffers() if judgeable(b)]
        self._buffers += [(n, p) for n, p in root.named_parameters() if not p.requires_grad and judgeable(p)]
        self._known = {k for _, b in self._buffers if (k := _storage(b)) is not None}
        self._shapes = {n: _kind(root, n, b) for n, b in root.named_buffers() if judgeable(b)}
        if self._buffers:
            with torch.no_grad():
                # exact (not a sum, which a huge finite buffer could overflow); once per hunt
                self._flags = ~stack_probes([torch.isfinite(widen(strided(b) if b.layout in SPARSE else b)).all()
                                             for _, b in self._buffers])

    def _exemptions(self, hunt: Hunt) -> None:
        if self._exempt_names is not None:
            return
        if self.pending and hunt._root is not None:
            self.first_step(hunt._root)
        bufs, flags = self._buffers or [], self._flags
        bad = [i for i, f in enumerate(flags.tolist()) if f] if flags is not None else []
        self._exempt_names = {bufs[i][0] for i in bad}
        self._exempt = {k for i in bad if (k := _storage(bufs[i][1])) is not None}
        self._buffers, self._flags = None, None

    def install(self) -> None:
        """Guard ``torch.save`` and ``torch.serialization.save`` (the names looked up at call time;
        a name imported before watch(), ``from torch import save``, is the unguarded function:
        `Hunt.refuse_save` serves such loops)."""
        global _original, _serialization_original
        if not _guards and torch.save is not _guarded_save:
            _original = torch.save
            torch.save = _guarded_save  # type: ignore[assignment]
        if not _guards and torch.serialization.save is not _guarded_save:
            _serialization_original = torch.serialization.save
            torch.serialization.save = _guarded_save  # type: ignore[assignment]
        if not _guards:
            _guard_writers()
        _guards.append(self)

    def remove(self) -> None:
        global _original, _serialization_original
        if self in _guards:
            _guards.remove(self)
        if not _guards and torch.save is _guarded_save:
            torch.save = _original if _original is not None else _SERIALIZATION_SAVE  # type: ignore[assignment]
            _original = None
        if not _guards and torch.serialization.save is _guarded_save:
            torch.serialization.save = (_serialization_original if _serialization_original is not None  # type: ignore[assignment]
                                        else _SERIALIZATION_SAVE)
            _serialization_original = None
        if not _guards:
            _unguard_writers()

    # ------------------------------------------------------------------ judging
    def _state(self, hunt: Hunt) -> list[tuple[str, torch.Tensor]]:
        """What this guard judges of the watched state, by name: the model's parameters and
        buffers (not those exempt), then the optimizers' state tensors ("optimizer state")."""
        self._exemptions(hunt)
        exempt_names = self._exempt_names or set()
        out: list[tuple[str, torch.Tensor]] = []
        root = hunt._root
        if root is not None:
            # a buffer put in place since the watch began, while the hunt has found nothing; not
            # one that is the same state in new storage (`_converted`)
            found = any(f.phase != "checkpoint" for f in hunt.findings)
            known = self._known if self._known is not None and not found else None
            for n, t in [*root.named_parameters(), *((n, b) for n, b in root.named_buffers()
                                                       if known is None or _storage(b) in known
                                                       or self._converted(root, n, b))]:
                if n not in exempt_names and is_checked(t) and not is_lazy(t):
                    out.append((n, t))
        for opt in hunt._opts:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and is_checked(v):
                        out.append((_OPTIMIZER_STATE, v))
        return out

    def _converted(self, root: torch.nn.Module, name: str, b: torch.Tensor) -> bool:
        """A buffer in storage the model did not have at the first step is the same state as the
        one of its name then, not one the model's code put in place (a lazily built mask, judged
        only once the hunt has a finding), when it has that one's shape and either another dtype
        or device (model.double(), .to(device)) or another module holds it (a BatchNorm swapped
        for a fresh one)."""
        was = self._shapes.get(name)
        if was is None:
            return False
        now = _kind(root, name, b)
        return was[0] == now[0] and (was[1:3] != now[1:3] or was[3] != now[3])

    def _watched(self, hunt: Hunt) -> tuple[dict[tuple[Any, int], str], dict[str, tuple[int, ...]]]:
        storages: dict[tuple[Any, int], str] = {}
        names: dict[str, tuple[int, ...]] = {}
        for n, t in self._state(hunt):
            if n is not _OPTIMIZER_STATE:
                names[n] = tuple(t.shape)
            k = _storage(t)
            if k is not None and k not in self._exempt:
                storages.setdefault(k, n)
        return storages, names

    def judged(self, obj: Any) -> list[tuple[Keys, torch.Tensor]]:
        """The tensors of ``obj`` that are the watched model's or optimizers' state."""
        return self._judged(obj)[0]

    def _judged(self, obj: Any) -> tuple[list[tuple[Keys, torch.Tensor]], bool]:
        """`judged`, and whether one of them is the watched state itself (shares its storage), not
        a copy of it under its name (an EMA model of the same architecture)."""
        hunt = self._hunt()
        if hunt is None:
            return [], False
        storages, names = self._watched(hunt)
        optimizers = bool(hunt._opts)
        out: list[tuple[Keys, torch.Tensor]] = []
        itself = False
        for keys, t, in_optim in walk(obj, limit=_WALKED):
            if not is_checked(t) or t.is_nested:  # (a nested tensor has no shape to match a name by)
                continue
            k = _storage(t)
            if k is not None and k in self._exempt:
                continue
            mine = k is not None and k in storages
            if mine or (in_optim and optimizers) or _named(keys, t, names):
                out.append((keys, t))
                itself = itself or mine
        return out, itself

    def check(self, obj: Any, file: str, whole: bool = False) -> Any:
        """The finding for the first non-finite judged tensor of ``obj``, or None. ``whole``: a
        file of a checkpoint written in several (safetensors shards, one file per model): when
        ``obj`` holds any of the watched state itself, all of it is judged, so that the first file
        is refused already and none of the checkpoint is left half new, half old."""
        hunt = self._hunt()
        if hunt is None or hunt._paused or hunt.closed:
            return None
        items, itself = self._judged(obj)
        bad = all_bad([t for _, t in items])
        if bad:
            keys, t = items[bad[0]]
            if any(isinstance(k, torch.Tensor) for k in keys):  # (``optimizer.state``: keyed by the parameters)
                storages = self._watched(hunt)[0]
                keys = tuple(_key_named(k, storages) for k in keys)
            return finding(file, keys, t, step=hunt.step, hint=_HINT, rank=hunt.rank)
        if not whole or not itself:  # (a clean copy of another model, an EMA's, is not part of this checkpoint)
            return None
        state = [(n, t) for n, t in self._state(hunt) if _storage(t) not in self._exempt]
        bad = all_bad([t for _, t in state])
        if not bad:
            return None
        n, t = state[bad[0]]
        return finding(file, (n,), t, step=hunt.step, hint=_HINT_PART, rank=hunt.rank)

    def judge(self, obj: Any, f: Any, whole: bool = False) -> None:
        """Raise `NonFiniteError` if ``obj`` holds non-finite watched state (``torch.save``'s guard;
        ``whole``: see `check`)."""
        hunt = self._hunt()
        if hunt is None or hunt._paused or hunt.closed:
            return
        try:
            got = self.check(obj, file_name(f), whole)
        except Exception as exc:  # an object it cannot walk (a property or a mapping that raises, a
            # tensor subclass that refuses a read): the save goes on as it would unwatched, unjudged
            _logger.debug("nanhunt: torch.save's object was not judged (%s: %s)", type(exc).__name__, exc)
            return
        if got is not None and hunt._judge_before_refusal():
            try:  # (a skipped step's buffers went back: the object may be clean now)
                got = self.check(obj, file_name(f), whole)
            except Exception:
                pass
        if got is not None:
            raise hunt._refused(got)


def _key_named(k: Any, storages: dict[tuple[Any, int], str]) -> Any:
    """A key that is one of the watched parameters, by its name."""
    if not isinstance(k, torch.Tensor):
        return k
    n = storages.get(_storage(k))  # type: ignore[arg-type]
    return TensorKey(n) if n is not None and n is not _OPTIMIZER_STATE else k


def _named(keys: Keys, t: torch.Tensor, names: dict[str, tuple[int, ...]]) -> bool:
    """A copy of a watched tensor under its own name (``model.state_dict()`` deep-copied or moved)."""
    if not keys or not isinstance(keys[-1], str) or not names:
        return False
    k = keys[-1]
    shape = tuple(t.shape)
    while True:
        got = names.get(k)
        if got is not None and got == shape:
            return True
        dot = k.find(".")
        if dot < 0:
            return False
        k = k[dot + 1:]
