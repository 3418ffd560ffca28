"""Files: paths checked when they are given (as the OS will resolve them), written atomically; and
data read back from files (reports, bundles, possibly someone else's) checked field by field.

A path given to ``watch(report=...)`` is checked as the OS resolves it, not as a string
(``missing/../r.json`` names a folder that does not exist), and kept as an absolute real path
(a later ``os.chdir`` does not move it). Text is written as UTF-8 with ``backslashreplace``: a name
that cannot be encoded (a lone surrogate) is written escaped, never raised at the moment of failure.

`check_type` / `need` / `checked_fields` refuse data that is not what nanhunt wrote with an error
naming the field (``findings[0].step must be an int, got str``), never a traceback from deep inside
a renderer or a rebuild.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["atomic_write", "check_writable", "FileFormatError", "check_type", "need", "checked_fields"]


def atomic_write(path: str | os.PathLike[str], suffix: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)``, then move the result onto ``path``; a reader never sees half a file.

    The file gets the permissions ``open()`` would give it (0666 less the umask: 0644 usually; not
    the 0600 of a private temporary file); a file it replaces keeps its own.
    """
    p = os.fspath(path)
    try:
        keep: int | None = stat.S_IMODE(os.stat(p).st_mode)
    except OSError:
        keep = None
    folder = os.path.dirname(p) or os.curdir  # as the OS resolves it: "missing/.." is no folder
    tmp = _create(folder, suffix)
    try:
        write(tmp)
        if keep is not None:
            os.chmod(tmp, keep)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def _create(folder: str, suffix: str) -> str:
    """A new empty file in ``folder`` created with mode 0666, so that the umask applies as for ``open()``."""
    for _ in range(100):
        tmp = os.path.join(folder, f".nanhunt-{secrets.token_hex(6)}{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"could not create a temporary file in {folder!r}")


def check_writable(value: Any, suffixes: tuple[str, ...], what: str) -> str:
    """A path we will write at the moment of failure: checked now, not then; returned absolute."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{what} must be a path, got {type(value).__name__}") from None
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str path, got {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"{what} {path!r}: a path cannot hold a NUL character")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in suffixes:
        raise ValueError(f"{what} must end in {', '.join(suffixes)}; got {path!r}")
    folder = os.path.dirname(path) or os.curdir  # not normalised: the OS walks "missing/.." and fails
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a folder, not a file")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"{what} {path!r} is not writable")
    return os.path.join(os.path.realpath(folder), os.path.basename(path))


# ------------------------------------------------------------------ reading back
class FileFormatError(ValueError):
    """A file that loads but does not hold what nanhunt writes; the message names the field."""


_NONFINITE = ("nan", "inf", "+inf", "-inf")


def _got(v: Any) -> str:
    r = repr(v)
    return f"{'null' if v is None else type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _describe(tp: Any, plural: bool = False) -> str:
    """``tp`` in words: "an int", "a list of ints", "an object of tensors or nulls"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, plural) for a in args)
    if origin in (tuple, list) or tp in (tuple, list):
        head = "lists" if plural else "a list"
        if not args or args[0] is Any:
            return head
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"{head} [{', '.join(_describe(a) for a in args)}]"
        return f"{head} of {_describe(args[0], True)}"
    if origin is dict or tp is dict:
        head = "objects" if plural else "an object"
        return head if not args or args[1] is Any else f"{head} of {_describe(args[1], True)}"
    words = {Any: ("anything", "anything"), type(None): ("null", "nulls"), int: ("an int", "ints"),
             float: ("a number", "numbers"), str: ("a string", "strings"), bool: ("true or false", "true/false values")}
    if tp in words:
        return words[tp][plural]
    name = getattr(tp, "__name__", str(tp)).lower()
    return f"{name}s" if plural else f"a {name}"


def _ok(v: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_ok(v, a) for a in args)
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:  # JSON writes non-finite floats as strings
        return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (isinstance(v, str) and v in _NONFINITE)
    if tp is str:
        return isinstance(v, str)
    if origin in (tuple, list) or tp in (tuple, list):  # JSON has lists only
        if not isinstance(v, (tuple, list)):
            return False
        if not args:
            return True
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return len(v) == len(args) and all(_ok(x, a) for x, a in zip(v, args))
        return all(_ok(x, args[0]) for x in v)
    if origin is dict or tp is dict:
        if not isinstance(v, dict):
            return False
        return not args or all(_ok(k, args[0]) and _ok(x, args[1]) for k, x in v.items())
    return isinstance(v, tp) if isinstance(tp, type) else True


def check_type(v: Any, tp: Any, where: str) -> Any:
    """``v`` if it is a (JSON or plain-pickle) value of type ``tp``, else `FileFormatError` naming ``where``."""
    if not _ok(v, tp):
        raise FileFormatError(f"{where} must be {_describe(tp)}, got {_got(v)}")
    return v


def need(d: Any, key: str, tp: Any, where: str, default: Any = dataclasses.MISSING) -> Any:
    """``d[key]`` checked against ``tp``; missing is an error unless a ``default`` is given."""
    if not isinstance(d, dict):
        raise FileFormatError(f"{where} must be an object, got {_got(d)}")
    if key not in d:
        if default is dataclasses.MISSING:
            raise FileFormatError(f"{where}.{key} is missing")
        return default
    return check_type(d[key], tp, f"{where}.{key}")


def checked_fields(cls: Any, d: Any, where: str, build: Callable[[dict[str, Any]], Any]) -> Any:
    """``build(d)`` for the dataclass ``cls`` (e.g. ``Finding.from_dict``), after checking every field
    of ``d`` against its annotation, and every field of the result again."""
    if not isinstance(d, dict):
        raise FileFormatError(f"{where} must be an object, got {_got(d)}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    for f in fields:
        if f.name in d:
            check_type(d[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FileFormatError(f"{where}.{f.name} is missing")
    try:
        obj = build(d)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise FileFormatError(f"{where}: {type(e).__name__}: {e}") from None
    for f in fields:
        check_type(getattr(obj, f.name), hints[f.name], f"{where}.{f.name}")
    return obj
