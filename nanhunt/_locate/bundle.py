"""Repro bundles: one failing module call, saved so that it can be re-run in isolation.

A bundle is a file written with ``torch.save`` holding plain containers only (dicts, lists, tuples,
str, numbers, tensors), so that ``torch.load(weights_only=True)`` reads it. It holds:

- the module's class (``module_path`` + ``module_type``) and its structure as a tree of
  ``(class, plain attributes, parameters, buffers, children)`` — no constructor call is recorded;
- its ``state_dict``;
- the call's inputs (``args``, ``kwargs``), the CPU/CUDA RNG state, the autocast and grad mode;
- the finding (``Finding.to_dict()``).

:func:`load` uses ``weights_only=True`` only: a crafted file (a pickle whose ``__reduce__`` would
run code) is refused with :class:`BundleError` and nothing in it runs. :func:`replay` rebuilds a
module only from classes of ``torch.nn`` that are already imported (it never imports a name read
from the file); a user's own class (or an instance of it) must be passed in as ``module=``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from .._files import FileFormatError, atomic_write, check_depth, check_type, checked_fields, fspath, need, not_a_file
from .._finding import Finding
from .._profile import span
from .._tensors import element, format_path, tensors
from .checkpoint import refused_global, safe_load, unreadable, zip_bomb
from .replay import as_it_is, faithful

__all__ = ["save", "save_from_top", "load", "replay", "ReplayResult", "BundleError", "FORMAT"]

FORMAT = "nanhunt.bundle/1"
_UNSUPPORTED = "__nanhunt_unsupported__"
_FN = "__nanhunt_fn__"
_MODULE_KEYS = frozenset(nn.Module().__dict__)
_MAX_NESTING = 200  # a saved module tree (64 levels, 3 containers each) and its inputs; deeper: not a bundle


class BundleError(ValueError):
    """A bundle that cannot be read or replayed (not a bundle, unsafe, or not rebuildable)."""


# ------------------------------------------------------------------ encoding
def _scalar(v: Any) -> tuple[bool, Any]:
    """A plain scalar of an exact builtin type (a str or int subclass would pickle as its class)."""
    if v is None or type(v) in (bool, int, float, str):
        return True, v
    if isinstance(v, bool):
        return True, bool(v)
    for t in (int, float, str):  # IntEnum, TorchVersion, ...
        if isinstance(v, t):
            return True, t(v)
    return False, None


def _plain(v: Any, depth: int = 0) -> tuple[bool, Any]:
    """``(True, copy made of exact builtin types)`` for plain data, else ``(False, None)``."""
    ok, s = _scalar(v)
    if ok:
        return True, s
    if depth > 4:
        return False, None
    if isinstance(v, (tuple, list)):
        items = [_plain(x, depth + 1) for x in v]
        if not all(ok for ok, _ in items):
            return False, None
        vals = [x for _, x in items]
        return True, (tuple(vals) if isinstance(v, tuple) else vals)
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        got = {str(k): _plain(x, depth + 1) for k, x in v.items()}
        if not all(ok for ok, _ in got.values()):
            return False, None
        return True, {k: x for k, (_, x) in got.items()}
    return False, None


def _encode(v: Any, depth: int = 0) -> Any:
    """Inputs as plain containers; tensors detached onto the CPU; anything else marked unsupported."""
    if isinstance(v, torch.Tensor):
        t = v.detach().to("cpu", copy=True)
        return t.requires_grad_(v.requires_grad) if t.is_floating_point() or t.is_complex() else t
    ok, scalar = _scalar(v)
    if ok:
        return scalar
    if isinstance(v, torch.dtype):
        return {_UNSUPPORTED: "dtype", "value": str(v)}
    if depth < 6 and isinstance(v, (tuple, list)) and not hasattr(v, "_fields"):
        seq = [_encode(x, depth + 1) for x in v]
        return tuple(seq) if isinstance(v, tuple) else seq
    if depth < 6 and isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _encode(x, depth + 1) for k, x in v.items()}
    return {_UNSUPPORTED: type(v).__qualname__}


def _unsupported(v: Any) -> list[str]:
    if isinstance(v, dict):
        if _UNSUPPORTED in v:
            return [str(v[_UNSUPPORTED])]
        return [u for x in v.values() for u in _unsupported(x)]
    if isinstance(v, (tuple, list)):
        return [u for x in v for u in _unsupported(x)]
    return []


def _attr(v: Any) -> tuple[bool, Any]:
    ok, plain = _plain(v)
    if ok:
        return True, plain
    name = getattr(v, "__name__", None)
    if callable(v) and isinstance(name, str) and getattr(F, name, None) is v:
        return True, {_FN: name}  # e.g. TransformerEncoderLayer.activation = F.relu
    return False, None


def _tree(m: nn.Module) -> dict[str, Any]:
    cls = type(m)
    attrs: dict[str, Any] = {}
    skipped: list[str] = []
    for k, v in m.__dict__.items():
        if k in _MODULE_KEYS and k != "training" or getattr(type(v), "__nanhunt__", False):
            continue  # (a watching hunt's `forward` wrapper is no attribute of the module's)
        ok, enc = _attr(v)
        if ok:
            attrs[k] = enc
        else:
            skipped.append(k)
    nonpersistent = sorted(m._non_persistent_buffers_set)
    return {
        "module_path": cls.__module__,
        "module_type": cls.__qualname__,
        "attrs": attrs,
        "skipped": skipped,
        "params": {k: None if p is None else p.detach().to("cpu", copy=True) for k, p in m._parameters.items()},
        "requires_grad": {k: bool(p is not None and p.requires_grad) for k, p in m._parameters.items()},
        "buffers": {k: None if b is None else b.detach().to("cpu", copy=True) for k, b in m._buffers.items()},
        "nonpersistent": nonpersistent,
        "children": {k: None if c is None else _tree(c) for k, c in m._modules.items()},
    }


def save(
    path: str | os.PathLike[str],
    *,
    module: nn.Module,
    module_name: str,
    args: Any,
    kwargs: dict[str, Any] | None,
    rng_state: torch.Tensor | None,
    cuda_rng: list[torch.Tensor] | None,
    finding: Finding | dict[str, Any] | None,
    autocast: Any = (),
    grad_enabled: bool = True,
) -> str:
    """Write a repro bundle for one call of ``module`` (atomically); returns the path.

    ``autocast`` is ``[(device, enabled, dtype), ...]`` as the call saw it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"save() needs the failing nn.Module, got {type(module).__name__}")
    try:
        device = str(next(iter(module.parameters())).device)
    except StopIteration:
        device = next((str(t.device) for _, t in tensors(args)), "cpu")
    fd = finding.to_dict() if isinstance(finding, Finding) else (dict(finding) if finding else None)
    bundle = {
        "format": FORMAT,
        "torch": str(torch.__version__),
        "module_name": str(module_name),
        "module_path": type(module).__module__,
        "module_type": type(module).__qualname__,
        "tree": _tree(module),
        "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()},
        "training": module.training,
        "device": device,
        "args": _encode(tuple(args) if isinstance(args, (tuple, list)) else (args,)),
        "kwargs": _encode(dict(kwargs or {})),
        "rng_state": None if rng_state is None else rng_state.detach().to("cpu", copy=True),
        "cuda_rng": None if cuda_rng is None else [t.detach().to("cpu", copy=True) for t in cuda_rng],
        "autocast": [(str(d), bool(e), str(t).removeprefix("torch.")) for d, e, t in autocast],
        "grad_enabled": bool(grad_enabled),
        "finding": _json_plain(fd),
    }
    return atomic_write(path, ".pt", lambda tmp: torch.save(bundle, tmp))


def _json_plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    ok, scalar = _scalar(v)
    if ok:
        return scalar
    if isinstance(v, dict):
        return {str(k): _json_plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_plain(x) for x in v]
    return v


def save_from_top(
    path: str | os.PathLike[str],
    *,
    top: Any,
    names: dict[nn.Module, str],
    ordinal: int,
    finding: Finding | dict[str, Any] | None,
) -> str:
    """Bundle the ``ordinal``-th watched module call inside the top-level call ``top`` (a `_steplog.Top`).

    The top-level call is re-run under ``replay.faithful`` (the user's RNG and buffers are put back
    afterwards) only up to the entry of that call, where its args, kwargs, RNG state, autocast and
    grad mode are taken; ``ordinal`` counts watched-module calls (modules in ``names``) in call order,
    as ``replay.replay_top`` numbers them.
    """

    got: dict[str, Any] = {}
    seen = [0]

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if seen[0] == ordinal:
            cuda = torch.cuda.get_rng_state_all() if top.cuda_rng is not None else None
            # copies: the forward runs on to its end (an exception here would skip the user's code
            # after the call: a context it undoes), and may write these inputs in place meanwhile
            args, kwargs = tree_map(as_it_is, (args, kwargs))
            got.update(module=module, args=args, kwargs=kwargs, rng=torch.get_rng_state(), cuda=cuda,
                       grad=torch.is_grad_enabled(),
                       autocast=[(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")])
        seen[0] += 1

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in names]
    try:
        with faithful(top):
            top.module(*top.args, **(top.kwargs or {}))
    except Exception:
        if not got:
            raise
    finally:
        for h in handles:
            h.remove()
    if not got:
        raise BundleError(f"call #{ordinal} was not reached when the top-level call was re-run")
    m = got["module"]
    return save(path, module=m, module_name=names.get(m, ""), args=got["args"], kwargs=got["kwargs"],
                rng_state=got["rng"], cuda_rng=got["cuda"], finding=finding, autocast=got["autocast"],
                grad_enabled=got["grad"])


# ------------------------------------------------------------------ loading
def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a bundle with ``torch.load(weights_only=True)``; anything else is refused."""
    p = fspath(path, "nanhunt._locate.bundle.load() takes a bundle's path (a .pt file that watch(bundle=...) wrote)")
    why = not_a_file(p)  # a folder, /dev/zero, a FIFO: named, never read
    if why == "does not exist":
        raise BundleError(f"{p}: no such bundle file")
    if why is not None:
        raise BundleError(f"{p} {why}" + (", not a nanhunt bundle file" if why.startswith("is ") else ""))
    bomb = zip_bomb(p)
    if bomb is not None:
        raise BundleError(f"{p} was refused: {bomb}")
    try:
        data = safe_load(p)
    except FileNotFoundError:
        raise BundleError(f"{p}: no such bundle file") from None
    except Exception as e:  # any failure of the safe loader is a refusal (pickle.UnpicklingError mostly)
        raise BundleError(_refusal(p, e)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{p} is not a nanhunt bundle (format {FORMAT!r} expected)")
    check(data, p)
    return data


def _refusal(path: str, e: Exception) -> str:
    """One line saying why the safe loader refused ``path`` (torch's own message runs to a page, and
    advises loading the file unsafely: that advice is never passed on)."""
    if os.path.isdir(path):
        return f"{path} is a folder, not a nanhunt bundle"
    name = refused_global(e)
    if name is not None:
        return (f"{path} was refused: it holds a {name} object, which weights_only=True does not load "
                f"(a nanhunt bundle holds only tensors and plain data); nothing in it was run")
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError:
        head = b""
    if head and not head.startswith(b"PK\x03\x04") and not head.startswith(b"\x80"):  # neither torch.save's zip nor a pickle
        if head.lstrip().startswith(b"{"):
            return f"{path} is not a nanhunt bundle (it looks like a JSON report: `nanhunt show {path}`)"
        return f"{path} is not a nanhunt bundle (not a file written by torch.save)"
    why = unreadable(path, e)
    if head.startswith(b"\x80") and "pickle" in why:  # a pickle the safe loader stopped
        return f"{path} was refused by the safe loader (weights_only=True): {why}; nothing in it was run"
    return f"{path} cannot be read as a nanhunt bundle: {why}"


# ------------------------------------------------------------------ checking what was read
_REQUIRED = ("args",)  # without the inputs there is no call to replay (a module would raise, not reproduce)
_TOP: dict[str, Any] = {  # field -> type, as save() writes them; all but format and _REQUIRED may be absent
    "torch": str, "module_name": str, "module_path": str, "module_type": str, "tree": dict[str, Any],
    "state_dict": dict[str, torch.Tensor], "training": bool, "device": str | None,
    "args": list[Any],  # a tuple in the file: lists and tuples are alike here
    "kwargs": dict[str, Any], "rng_state": torch.Tensor | None,
    "cuda_rng": list[torch.Tensor] | None, "autocast": list[tuple[str, bool, str]] | None,
    "grad_enabled": bool, "finding": dict[str, Any] | None,
}
_TREE: dict[str, Any] = {
    "attrs": dict[str, Any], "skipped": list[str], "params": dict[str, torch.Tensor | None],
    "requires_grad": dict[str, bool], "buffers": dict[str, torch.Tensor | None], "nonpersistent": list[str],
    "children": dict[str, dict[str, Any] | None],
}


def check(data: dict[str, Any], source: str = "bundle") -> None:
    """Every field of a bundle read back, checked: `BundleError` naming the first wrong one."""
    try:
        check_depth(data, "bundle", _MAX_NESTING)
        for key, tp in _TOP.items():
            need(data, key, tp, "bundle", *(() if key in _REQUIRED else (None,)))
        rng = data.get("rng_state")
        if isinstance(rng, torch.Tensor) and (rng.dtype != torch.uint8 or rng.dim() != 1
                                              or rng.numel() != torch.get_rng_state().numel()):
            raise FileFormatError(f"bundle.rng_state must be the CPU generator's state (a 1-d uint8 tensor of "
                                  f"{torch.get_rng_state().numel()}), got {rng.dtype} of shape {tuple(rng.shape)}")
        for i, (_, on, dtype) in enumerate(data.get("autocast") or ()):
            if on and dtype not in ("float16", "bfloat16"):
                raise FileFormatError(f"bundle.autocast[{i}]: autocast runs in float16 or bfloat16, not {str(dtype)[:40]!r}")
        if "tree" in data:
            _check_tree(data["tree"], "bundle.tree", 0)
        _check_views(data)
        if isinstance(data.get("finding"), dict):
            checked_fields(Finding, data["finding"], "bundle.finding", Finding.from_dict)
    except FileFormatError as e:
        raise BundleError(f"{source}: {e}") from None


def _check_tree(tree: Any, where: str, depth: int) -> None:
    if depth > 64:
        raise FileFormatError(f"{where} is nested too deep")
    need(tree, "module_path", str, where)
    need(tree, "module_type", str, where)
    for key, tp in _TREE.items():
        need(tree, key, tp, where, None)
    for key in tree.get("attrs") or ():
        if key in _MODULE_KEYS and key != "training":  # rebuild() would write it over the module's own
            raise FileFormatError(f"{where}.attrs.{key} is nn.Module's own state, never a saved attribute "
                                  f"(parameters, buffers and children are the tree's own fields)")
        if not isinstance(key, str) or (hasattr(nn.Module, key) and key != "training") or key.startswith("__"):
            # (an instance attribute named forward would run in place of the module's own method)
            name = key if isinstance(key, str) and _NAME.match(key) else _short(key)
            raise FileFormatError(f"{where}.attrs.{name} is a method of nn.Module, never a saved attribute")
    for name, child in (tree.get("children") or {}).items():
        if child is not None:
            _check_tree(child, f"{where}.children.{name}", depth + 1)


_VIEW_LIMIT = 8 << 30  # bytes: a saved view that reads its storage many times over, past this, is refused


def _check_views(data: Any) -> None:
    """A tensor of the bundle that is a view reading a small storage over and over (``expand``:
    2**31 x 4 elements of one float in a few KB) is refused past `_VIEW_LIMIT`: the replay would
    allocate all of it. (A tensor that is no such view holds no more than the file's own bytes.)"""
    todo: list[tuple[Any, str]] = [(data, "bundle")]
    while todo:
        x, where = todo.pop()
        if isinstance(x, dict):
            todo.extend((v, f"{where}.{k}" if isinstance(k, str) and _NAME.match(k) else f"{where}[{_short(k)}]")
                         for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            todo.extend((v, f"{where}[{i}]") for i, v in enumerate(x))
        elif isinstance(x, torch.Tensor) and x.layout is torch.strided and not x.is_nested:
            size = x.numel() * x.element_size()
            stored = x.untyped_storage().nbytes()
            if size > _VIEW_LIMIT and size > 1000 * max(stored, 1):
                raise FileFormatError(f"{where} is a view of {x.numel()} elements ({size / 2**30:.0f} GiB) over "
                                      f"{stored} bytes of storage: a replay would allocate all of it")


# ------------------------------------------------------------------ rebuilding
def _nn_class(module_path: Any, name: Any, user: type[nn.Module] | None = None) -> type[nn.Module]:
    """A class of torch.nn that is already imported, or of the module that defines ``user`` (the
    user's own class, named by the user); never imports anything named by the file."""
    if user is not None and isinstance(name, str):
        cls = _user_class(name, user)
        if cls is not None:
            return cls
    if not (isinstance(module_path, str) and isinstance(name, str) and _NAME.match(name)
            and _DOTTED.match(module_path)):
        raise BundleError(f"bundle names an invalid class {_short(module_path)}.{_short(name)}")
    ok_path = module_path == "torch.nn" or module_path.startswith("torch.nn.modules.")
    mod = sys.modules.get(module_path) if ok_path else None
    cls = getattr(mod, name, None) if mod is not None else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        # (the names are the file's, checked to be Python names: the command line shown is the
        # user's own module, never one of the standard library's or torch's, which a crafted file
        # could name to have a reader run it)
        top = module_path.split(".")[0]
        spec = ("your_script.py" if module_path == "__main__" else
                "your_module" if top in sys.stdlib_module_names or top in ("torch", "nanhunt") else module_path)
        raise BundleError(
            f"the failing module is a {module_path}.{name}, not a standard torch.nn layer: "
            f"pass your own class or instance, e.g. nanhunt.replay(bundle, module={name}) "
            f"(command line: nanhunt replay BUNDLE --module {spec}:{name})"
            + ("; the script is imported, so its top-level code runs first: keep its training under "
               "`if __name__ == \"__main__\":`" if module_path == "__main__" else "")
        )
    return cls


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _user_class(name: str, user: type[nn.Module]) -> type[nn.Module] | None:
    """``name`` (a qualified class name) looked up in the module that defines ``user``: the class
    itself or one its module defines or imports. The module path the bundle saved is not compared:
    a script's classes were saved as ``__main__.X``, and the user named this module."""
    if name == user.__qualname__:
        return user
    obj: Any = sys.modules.get(user.__module__)
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__qualname__ == name else None


def _attr_value(v: Any) -> Any:
    if isinstance(v, dict) and _FN in v:
        fn = getattr(F, str(v[_FN]), None)
        if not callable(fn):
            raise BundleError(f"bundle names an unknown torch.nn.functional function {v[_FN]!r}")
        return fn
    return v


def rebuild(tree: dict[str, Any], user: type[nn.Module] | None = None) -> nn.Module:
    """A module from its saved tree, no constructor called: standard torch.nn classes, and with
    ``user`` (the user's own class) the classes of the user's module."""
    cls = _nn_class(tree.get("module_path"), tree.get("module_type"), user)
    if tree.get("skipped"):
        raise BundleError(
            f"{cls.__name__} has attributes that a bundle cannot hold ({', '.join(tree['skipped'])}); "
            f"pass your own instance as module= (command line: --module pointing at a function that builds it)"
        )
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    for k, v in (tree.get("attrs") or {}).items():
        m.__dict__[str(k)] = _attr_value(v)
    grads = tree.get("requires_grad") or {}
    for k, t in (tree.get("params") or {}).items():
        m.register_parameter(k, None if t is None else nn.Parameter(t, requires_grad=bool(grads.get(k, True))))
    nonpersistent = set(tree.get("nonpersistent") or ())
    for k, t in (tree.get("buffers") or {}).items():
        m.register_buffer(k, t, persistent=k not in nonpersistent)
    for k, c in (tree.get("children") or {}).items():
        m.add_module(k, None if c is None else rebuild(c, user))
    return m


# ------------------------------------------------------------------ replay
@dataclasses.dataclass
class ReplayResult:
    """What a replay gave: ``outputs``, ``reproduced`` and, when non-finite, the ``finding``."""

    outputs: Any
    reproduced: bool
    finding: Finding | None
    expected: Finding | None
    module: nn.Module
    error: str | None = None

    def summary(self) -> str:
        exp = self.expected
        where = f"`{exp.module or '<model>'}` ({exp.module_type})" if exp else "the saved module"
        if self.error is not None:
            return f"Replaying {where} failed: {self.error}"
        if self.reproduced and self.finding is not None:
            f = self.finding
            idx = "" if f.index is None else "[" + ", ".join(map(str, f.index)) + "]"
            return (f"Reproduced: {where} gives {f.tensor}{idx} = {f.value} again on the saved inputs "
                    f"({f.counts.get('nan', 0)} nan, {f.counts.get('+inf', 0)} +inf, {f.counts.get('-inf', 0)} -inf).")
        if self.finding is not None:
            return f"Non-finite output, but not the saved one: {self.finding.tensor} (expected {exp.tensor if exp else '?'})."
        return f"Not reproduced: {where} gives finite outputs on the saved inputs."

    def __str__(self) -> str:
        return self.summary()


def _to(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, tuple):
        return tuple(_to(x, device) for x in v)
    if isinstance(v, list):
        return [_to(x, device) for x in v]
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v


def replay(bundle: str | os.PathLike[str] | dict[str, Any], module: nn.Module | type[nn.Module] | None = None,
           *, device: str | torch.device | None = None) -> ReplayResult:
    """Re-run the saved call: rebuild the module (standard torch.nn layers) or use ``module``.

    ``module`` is your own class of the failing module (it is rebuilt from the saved structure,
    with the classes of its Python module for its children; no constructor is called) or your own
    instance of it (the saved ``state_dict`` is loaded into it). The saved RNG state, autocast
    and grad mode are restored around the call and put back after.
    """

    if not isinstance(bundle, (str, bytes, os.PathLike, dict)):
        raise TypeError(f"nanhunt.replay() takes a bundle's path (a .pt file that watch(bundle=...) wrote) or the "
                        f"dict loaded from it, got {type(bundle).__name__}: {_short(bundle)}")
    if device is not None:  # (checked before the bundle is read: `--device bogus`, `--device meta`)
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise BundleError(f"cannot replay on device {device!r}: {e}") from None
        if device.type == "meta":
            raise BundleError("cannot replay on device 'meta': its tensors hold no values to judge")
    data = bundle if isinstance(bundle, dict) else load(bundle)
    if isinstance(bundle, dict):
        if data.get("format") != FORMAT:
            raise BundleError(f"not a nanhunt bundle (format {FORMAT!r} expected)")
        check(data)
    bad = _unsupported(data.get("args")) + _unsupported(data.get("kwargs"))
    if bad:
        raise BundleError(f"the saved call had inputs a bundle cannot hold ({', '.join(bad)}); it cannot be replayed")
    if module is None:
        if not isinstance(data.get("tree"), dict):
            raise BundleError("bundle.tree is missing: the module cannot be rebuilt; pass your own instance as module=")
        try:
            m = rebuild(data["tree"])
        except BundleError:
            raise
        except Exception as e:  # names torch refuses (a dotted parameter name, ...): one clear line
            raise BundleError(f"the saved module cannot be rebuilt: {type(e).__name__}: {e}") from None
    elif isinstance(module, type) and issubclass(module, nn.Module):
        saved = data["tree"].get("module_type") if isinstance(data.get("tree"), dict) else None
        if saved != module.__qualname__:
            raise BundleError(f"the bundle's failing module is a {saved}, not a {module.__qualname__}")
        m = rebuild(data["tree"], module)
    else:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        m = module
        try:
            m.load_state_dict(check_type(data.get("state_dict"), dict[str, torch.Tensor], "bundle.state_dict"))
        except FileFormatError as e:
            raise BundleError(str(e)) from None
        except RuntimeError as e:
            raise BundleError(f"the saved state does not fit your {type(m).__name__}: {e}") from None
    saved = str(data.get("device") or "cpu")
    dev = torch.device(device) if device is not None else torch.device(saved if _available(saved) else "cpu")
    try:
        m.train(bool(data.get("training", False)))
        m.to(dev)
    except Exception as e:  # a saved attribute over the module's own (`train`, `to`): one clear line
        raise BundleError(f"the module cannot be set up for the replay on {dev}: {type(e).__name__}: {e}") from None
    args, kwargs = _to(data.get("args") or (), dev), _to(data.get("kwargs") or {}, dev)
    expected = checked_fields(Finding, data["finding"], "bundle.finding", Finding.from_dict) \
        if isinstance(data.get("finding"), dict) else None
    cpu_rng = torch.get_rng_state()
    try:
        if isinstance(data.get("rng_state"), torch.Tensor):
            torch.set_rng_state(data["rng_state"])
        if data.get("cuda_rng") is not None and dev.type == "cuda":
            torch.cuda.set_rng_state_all(data["cuda_rng"])
        with torch.set_grad_enabled(bool(data.get("grad_enabled", True))), _autocast(data.get("autocast"), dev), \
                span("nanhunt::replay", dev.type == "cuda"):
            out = m(*args, **kwargs)
    except Exception as e:
        return ReplayResult(None, False, None, expected, m, error=f"{type(e).__name__}: {e}")
    finally:
        torch.set_rng_state(cpu_rng)
    found = None
    for path, t in tensors(out):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            index, value, counts = element(t)
            found = Finding(
                phase="forward", module=data.get("module_name", ""), module_type=type(m).__name__,
                tensor=format_path("output", path), step=expected.step if expected else 0,
                call=expected.call if expected else 0, index=index, value=value, counts=counts,
                shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."), cause="created",
                reproducible=True,
            )
            break
    same = found is not None and (expected is None or expected.phase != "forward" or found.tensor == expected.tensor)
    return ReplayResult(out, same, found, expected, m)


def _available(device: str) -> bool:
    try:
        d = torch.device(device)
    except RuntimeError:
        return False
    return d.type == "cpu" or (d.type == "cuda" and torch.cuda.is_available())


class _autocast:
    def __init__(self, spec: Any, dev: torch.device) -> None:
        self.ctx: Any = None
        for item in spec or ():
            d, enabled, dtype = item
            if enabled and d == dev.type and isinstance(getattr(torch, str(dtype), None), torch.dtype):
                self.ctx = torch.autocast(d, dtype=getattr(torch, str(dtype)))

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
