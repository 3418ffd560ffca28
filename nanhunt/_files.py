"""Files written at the moment of failure: atomically (a temp file in the same folder, then rename)."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["atomic_write", "check_writable"]


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
    tmp = _create(os.path.dirname(os.path.abspath(p)), suffix)
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
