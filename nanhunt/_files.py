"""Files written at the moment of failure: atomically (a temp file in the same folder, then rename)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["atomic_write", "check_writable"]


def atomic_write(path: str | os.PathLike[str], suffix: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)``, then move the result onto ``path``; a reader never sees half a file."""
    p = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".nanhunt-", suffix=suffix, dir=os.path.dirname(os.path.abspath(p)))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def check_writable(value: Any, suffixes: tuple[str, ...], what: str) -> str:
    """A path we will write at the moment of failure: checked now, not then."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{what} must be a path, got {type(value).__name__}") from None
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in suffixes:
        raise ValueError(f"{what} must end in {', '.join(suffixes)}; got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {path!r}: folder {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"{what} {path!r} is not writable")
    return path
