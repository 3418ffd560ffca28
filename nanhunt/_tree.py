"""Walk any output structure down to its tensors, with a path a person can read.

Handles tensors, tuples, lists, dicts (Hugging Face ``ModelOutput`` is one), namedtuples and
dataclasses. Paths are tuples of keys, formatted only when a finding needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["tensors", "format_path", "get_path"]

_MAX_DEPTH = 32
Path = tuple[Any, ...]


def tensors(obj: Any, path: Path = (), depth: int = 0) -> Iterator[tuple[Path, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in ``obj``, in a stable order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, (*path, k), depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for k in obj._fields:
            yield from tensors(getattr(obj, k), (*path, _Attr(k)), depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from tensors(v, (*path, i), depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name, None), (*path, _Attr(f.name)), depth + 1)


class _Attr(str):
    """A path step that is an attribute (namedtuple field, dataclass field)."""


def format_path(root: str, path: Path) -> str:
    out = root
    for k in path:
        if isinstance(k, _Attr):
            out += f".{k}"
        elif isinstance(k, str):
            out += f"[{k!r}]"
        else:
            out += f"[{k}]"
    return out


def get_path(obj: Any, path: Path) -> Any:
    for k in path:
        obj = getattr(obj, k) if isinstance(k, _Attr) else obj[k]
    return obj
