"""`nanhunt.audit()`: the non-finite tensors of a checkpoint, without ever running code from it.

A file is read with ``torch.load(weights_only=True)`` (``.safetensors`` with safetensors): a
pickle that names any callable outside torch's allow-list is refused before anything runs.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .._files import check_readable, glob_patterns
from .checkpoint import Keys, all_bad, finding, key_path, refused_global, safe_load, unreadable, walk, zip_bomb

__all__ = ["audit", "AuditRefused"]

_SKIP = ("callbacks", "loops")  # a Lightning checkpoint's callback and loop state (kth_value = inf, ...)

_HINT = ("This checkpoint holds non-finite values: a run resumed from it carries them on (or turns "
         "NaN a few steps later). Resume from an earlier checkpoint; watch the run with nanhunt to see "
         "where they were born.")


class AuditRefused(ValueError):
    """The file would run code when loaded, or is not a checkpoint (unreadable, truncated, a folder or
    a device: never read): nothing in it was executed. A missing file raises `FileNotFoundError`."""


def audit(path_or_object: Any, ignore: Iterable[str] | str = ()) -> list[Any]:
    """Every non-finite floating tensor of a checkpoint, as ``"checkpoint"`` findings.

    ``path_or_object``: a path (``torch.save`` file or ``.safetensors``) or an object already loaded.
    Not judged: a Lightning checkpoint's ``callbacks`` and ``loops`` state, and key paths (as in
    ``['state_dict']['mask']``) or last keys (``mask``) matching an ``ignore`` glob.
    """
    patterns = tuple(map(_key_glob, glob_patterns(ignore, "key paths or keys")))
    if path_or_object is None or isinstance(path_or_object, (bool, int, float, complex)):
        raise TypeError("audit() takes a checkpoint's path or the object loaded from it (a dict, a list, a "
                        f"tensor), got {type(path_or_object).__name__}: {path_or_object!r}")
    if isinstance(path_or_object, (io.IOBase, Iterator)) or callable(getattr(path_or_object, "read", None)):
        # (walked as an object, an open file or a generator holds no tensor: a poisoned checkpoint read "clean")
        raise TypeError("audit() takes a checkpoint's path or the object loaded from it (a dict, a list, a "
                        f"tensor), got {type(path_or_object).__name__}, whose tensors it cannot see: pass the file's "
                        "path, or what torch.load(f, weights_only=True) returns (a list of a generator's items)")
    if isinstance(path_or_object, (str, bytes, os.PathLike)):
        name = os.fsdecode(path_or_object)
        obj = _load(name)
    else:
        name, obj = "<object>", path_or_object
    step = -1
    if isinstance(obj, Mapping):
        gs = obj.get("global_step", obj.get("step"))
        if isinstance(gs, int) and not isinstance(gs, bool):
            step = gs
    items: list[tuple[Keys, Any]] = []
    seen: set[Any] = set()  # a tensor held under several keys (tied weights; a file that refers to one 200,000 times): once
    for keys, t, _ in walk(obj):
        if isinstance(obj, Mapping) and keys and keys[0] in _SKIP:
            continue
        k = _same_values(t)
        if k in seen or (patterns and _ignored(keys, patterns)):
            continue
        seen.add(k)
        items.append((keys, t))
    return [finding(name, items[i][0], items[i][1], step=step, hint=_HINT) for i in all_bad([t for _, t in items])]


_CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def _same_values(t: Any) -> Any:
    """What tells a tensor's values apart: its place in its storage (torch.load gives each key of
    tied weights a tensor object of its own over one storage), else the object."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested: the object
        return id(t)


def _key_glob(p: str) -> str:
    """``p``, or, when it is written as a key path (``['state_dict']['mask']``, also with wildcards:
    ``['state_dict']['*.bias']``), with its brackets literal: fnmatch reads ``[...]`` as a set of
    characters, which matches no key path (and any last key that starts with one of them)."""
    return re.sub(r"[][]", r"[\g<0>]", p) if re.search(r"\[['\"]|['\"]\]", p) else p


def _ignored(keys: Keys, patterns: tuple[str, ...]) -> bool:
    path, last = key_path(keys), str(keys[-1]) if keys else ""
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def _load(path: str) -> Any:
    if os.path.isdir(path):  # a Hugging Face or Lightning checkpoint folder: say which files to audit
        inside = sorted(n for n in os.listdir(path) if n.endswith(_CHECKPOINT_SUFFIXES))[:6]
        raise AuditRefused(f"{path} is a folder, not a checkpoint file; audit the files in it"
                           + (f" ({', '.join(inside)})" if inside else ""))
    check_readable(path, "checkpoint file", AuditRefused)  # /dev/zero, a FIFO: named, never read
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise AuditRefused(f"{path}: reading .safetensors needs safetensors: pip install safetensors") from None
        try:
            return load_file(path, device="cpu")
        except Exception as e:  # SafetensorError (a bad or lying header), OSError, ...
            said = " ".join(str(e).split()) or type(e).__name__
            raise AuditRefused(f"{path}: not a .safetensors file safetensors can read: {said}") from None
    bomb = zip_bomb(path)
    if bomb is not None:
        raise AuditRefused(f"{path}: refused: {bomb}")
    try:
        return safe_load(path)
    except Exception as e:  # any failure of the safe loader: refused or unreadable, nothing in it was run
        name = refused_global(e)
        if name is not None:
            raise AuditRefused(
                f"{path}: refused: loading it would run code or build objects that a weights-only load does not "
                f"allow ({name}), so nothing in it was executed"
            ) from None
        raise AuditRefused(f"{path}: not a checkpoint torch can read: {unreadable(path, e)}") from None
