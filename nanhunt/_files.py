"""Files: paths checked when they are given (as the OS will resolve them), written atomically; and
data read back from files (reports, bundles, possibly someone else's) checked field by field.

A path given to ``watch(report=...)`` is checked as the OS resolves it, not as a string
(``missing/../r.json`` names a folder that does not exist), and kept as an absolute real path
(a later ``os.chdir`` does not move it). A symbolic link is written through: its target is
replaced atomically and the link stays; a device or a pipe (``/dev/null``, ``/dev/stdout``) is
written in place, as ``open()`` would. Text is written as UTF-8 with ``backslashreplace``: a name
that cannot be encoded (a lone surrogate) is written escaped, never raised at the moment of failure;
a file that cannot be written at all is warned and logged (`warn_unwritten`), never raised, also
under ``-W error``.

Files are read only when they are regular files (`not_a_file`): a folder, a device (``/dev/zero``)
or a FIFO is named as what it is and never read; `read_limited` reads at most a bounded number of
bytes (`MAX_REPORT_BYTES` for reports), and `check_depth` refuses data nested deeper than any file
nanhunt writes (no recursion error from a reader further on).

`check_type` / `need` / `checked_fields` refuse data that is not what nanhunt wrote with an error
naming the field (``findings[0].step must be an int, got str``), never a traceback from deep inside
a renderer or a rebuild.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import secrets
import stat
import types
import typing
import warnings
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["atomic_write", "glob_patterns", "check_writable", "FileFormatError", "check_type", "need", "checked_fields", "not_a_file",
           "check_readable", "read_limited", "check_depth", "MAX_REPORT_BYTES", "MAX_DEPTH", "warn_unwritten", "fspath",
           "rank_path"]

MAX_REPORT_BYTES = 256 * 2**20  # a report read back is at most this big (nanhunt's own are well under 1 MiB)
MAX_DEPTH = 64  # containers nested deeper than this in a file read back: not something nanhunt wrote


def rank_path(path: str, rank: int | str | None) -> str:
    """``report.json`` -> ``report.rank1.json`` for ``rank`` 1; unchanged without a rank, and for a
    device or a pipe (``/dev/null``: written in place by every rank, never a file beside it)."""
    if rank is None or rank == "" or (os.path.exists(path) and not os.path.isfile(path)):
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def fspath(path: Any, takes: str) -> str:
    """``os.fspath(path)``; anything that is no path: a TypeError that says what was given and what
    ``takes`` (``"Report.load() takes the path of ..."``), not os.fspath's bare one."""
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"{takes} (a str or os.PathLike), got {type(path).__name__}: {path!r:.80}") from None


def atomic_write(path: str | os.PathLike[str], suffix: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)``, then move the result onto ``path``; a reader never sees half a file.

    ``path`` is written where the OS resolves it: a symbolic link's target is replaced (the link
    stays a link); a device or a FIFO (``/dev/null``, ``/dev/stdout``) is written in place by
    ``write(path)``, never replaced by a file. The file gets the permissions ``open()`` would give
    it (0666 less the umask: 0644 usually; not the 0600 of a private temporary file); a file it
    replaces keeps its own, but never more than a fresh file would get. A file that ``open()``
    could not write (read-only) is refused with `PermissionError`, never replaced.
    """
    p = os.fspath(path)
    try:
        st: os.stat_result | None = os.stat(p)  # follows links: the file the OS would open
    except FileNotFoundError:
        st = None  # no file yet (or a link to one not made yet): created at the link's target
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"{p!r} is a folder, not a file")
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise OSError(f"{p!r} is {_kind(st.st_mode)}: a report or bundle is never written onto one")
        _ready(p, st)
        write(p)  # in place, as open() would: /dev/null stays /dev/null
        return p
    target = os.path.realpath(p) if os.path.islink(p) else p  # a link is written through, never replaced
    if st is not None and not os.access(target, os.W_OK):  # open() refuses a read-only file; a rename would not
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
    folder = os.path.dirname(target) or os.curdir  # as the OS resolves it: "missing/.." is no folder
    try:
        tmp = _create(folder, suffix)
    except OSError as e:  # named by the user's path, not by our temporary file's
        raise OSError(e.errno, f"{e.strerror} (folder {folder!r})", p) from None
    try:
        write(tmp)
        if st is not None:  # the replaced file's own mode, never more than a fresh file's (the umask's)
            os.chmod(tmp, stat.S_IMODE(st.st_mode) & stat.S_IMODE(os.stat(tmp).st_mode))
        try:
            os.replace(tmp, target)
        except OSError as e:  # a name too long, a read-only target ...: the user's path, not ours
            raise OSError(e.errno, e.strerror, p) from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def warn_unwritten(message: str, stacklevel: int = 2) -> None:
    """Say that a file (a report, a repro bundle) was not written: a ``UserWarning`` at the
    caller's ``stacklevel`` and the same words on the ``"nanhunt"`` logger, never an exception.
    A filter of the user's that makes warnings errors (``python -W error``, pytest's
    ``filterwarnings = error``) leaves it at the log: raised from a hook at the moment of a
    finding, it would replace the finding (the `NonFiniteError` of raise mode) with an error about
    a file, or switch the hunt off as an internal fault."""
    logging.getLogger("nanhunt").warning("%s", message)
    try:
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    except Warning:
        pass  # (logged above)


def _ready(path: str, st: os.stat_result) -> None:
    """A FIFO nobody reads would block the writer for good: fail now instead (ENXIO)."""
    if stat.S_ISFIFO(st.st_mode):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            raise OSError(f"{path!r} is a FIFO (named pipe) that nobody reads ({e.strerror})") from None


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
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(os.path.basename(path))) > name_max:
        raise ValueError(f"{what} {path!r}: the file name is longer than its file system allows ({name_max} bytes)")
    if os.path.islink(path):  # written through: the target's folder is the one that must exist
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # a loop of links
            raise ValueError(f"{what} {path!r}: {e.strerror}") from None
        target = os.path.realpath(path)
        if not os.path.isdir(os.path.dirname(target)):
            raise ValueError(f"{what} {path!r} is a link to {target!r}, whose folder does not exist")
        folder = os.path.dirname(target)
    mode = os.stat(path).st_mode if os.path.exists(path) else None
    if mode is not None and not stat.S_ISREG(mode):  # written in place, as open() would (/dev/null)
        if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            raise ValueError(f"{what} {path!r} is {_kind(mode)}, not a file")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{what} {path!r} is not writable")
    elif not os.access(folder, os.W_OK | os.X_OK) or (mode is not None and not os.access(path, os.W_OK)):
        raise PermissionError(f"{what} {path!r} is not writable")
    return os.path.join(os.path.realpath(os.path.dirname(path) or os.curdir), os.path.basename(path))


# ------------------------------------------------------------------ reading files
def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """``None`` when ``path`` is a regular file this process can read (links followed), else why
    not, in words: ``"does not exist"``, ``"is a folder"``, ``"is a character device"``,
    ``"is a FIFO (named pipe)"``, ``"cannot be read: Permission denied"``, ... Nothing is read, and
    only a regular file is opened (a device or a FIFO is judged by its type alone)."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return "points to a file that does not exist (a broken link)" if os.path.islink(p) else "does not exist"
    except OSError as e:  # a loop of links, a name too long, a folder on the way we may not enter
        return f"cannot be read: {e.strerror or e}"
    except ValueError as e:  # a NUL in the name
        return f"cannot be read: {e}"
    if not stat.S_ISREG(st.st_mode):
        return f"is {_kind(st.st_mode)}"
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    return None


def check_readable(path: str, what: str, refused: type[Exception] | None = None) -> None:
    """Nothing when ``path`` is a regular file this process can read (`not_a_file`); else
    `FileNotFoundError` (missing, a broken link), ``refused`` (default `FileFormatError`: a folder, a
    device, a FIFO, named as what it is) or `OSError` (permissions, a loop of links). Nothing is read."""
    why = not_a_file(path)
    if why is None:
        return
    if why == "does not exist":
        raise FileNotFoundError(f"no such {what}: {path!r}")
    if why.startswith("points to"):
        raise FileNotFoundError(f"{path} {why}")
    if why.startswith("is "):
        raise (refused or FileFormatError)(f"{path} {why}, not a {what}")
    raise OSError(f"{path} {why}")


def read_limited(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    A missing file: `FileNotFoundError`; anything but a regular file (a folder, ``/dev/zero``, a
    FIFO) or a file larger than ``limit``: `FileFormatError` naming the file and what it is, before
    a byte is read (the opened file is checked again, so a swap after the check reads nothing)."""
    p = os.fspath(path)
    check_readable(p, what)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileFormatError(f"{p} is {_kind(st.st_mode)}, not a {what}")
        if st.st_size > limit:
            raise FileFormatError(f"{p} is {_size(st.st_size)}: larger than any {what} (at most {_size(limit)})")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:  # it grew while being read
            raise FileFormatError(f"{p} is larger than any {what} (at most {_size(limit)})")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def check_depth(v: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """`FileFormatError` when lists/dicts in ``v`` nest deeper than ``limit`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(v, 0)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, dict):
            items: Any = o.values()
        elif isinstance(o, (list, tuple)):
            items = o
        else:
            continue
        if depth >= limit:
            raise FileFormatError(f"{where} is nested more than {limit} levels deep: not something nanhunt wrote")
        stack.extend((x, depth + 1) for x in items)


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


def glob_patterns(value: Any, of: str) -> tuple[str, ...]:
    """An ``ignore=`` argument: one glob (str) or an iterable of them, as a tuple; anything else is a
    `TypeError` naming ``ignore`` and what was passed (never a bare ``'int' object is not iterable``)."""
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (str, Iterable)):
        raise TypeError(f"ignore must be a glob pattern (str) or an iterable of them; got {value!r}")
    patterns = (value,) if isinstance(value, str) else tuple(value)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"ignore must be glob patterns (str) of {of}; got {p!r}")
    return patterns


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


@functools.cache
def _annotations(cls: Any) -> tuple[tuple[dataclasses.Field[Any], ...], dict[str, Any]]:
    """The dataclass ``cls``'s fields and their types, worked out once (`typing.get_type_hints`
    evaluates every annotation anew: the most of reading a report of thousands of findings)."""
    return dataclasses.fields(cls), typing.get_type_hints(cls)


def checked_fields(cls: Any, d: Any, where: str, build: Callable[[dict[str, Any]], Any]) -> Any:
    """``build(d)`` for the dataclass ``cls`` (e.g. ``Finding.from_dict``), after checking every field
    of ``d`` against its annotation, and every field of the result again."""
    if not isinstance(d, dict):
        raise FileFormatError(f"{where} must be an object, got {_got(d)}")
    fields, hints = _annotations(cls)
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
