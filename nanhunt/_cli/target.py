"""``nanhunt replay BUNDLE --module SPEC``: the user's own module class, imported by the user's word.

``SPEC`` is ``package.module:Name`` (imported as ``python -m`` would, the current folder first on
``sys.path``) or ``path/to/file.py:Name`` (the file is imported as a module: its
``if __name__ == "__main__":`` block does not run). ``Name`` may be dotted (``models:GPT.Block``).
It names an ``nn.Module`` subclass (the bundle's saved structure is rebuilt with it and the
classes of its module), a function that returns the module (called without arguments), or a
module instance. Nothing named inside the bundle is ever imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

__all__ = ["TargetError", "load_target", "module_of"]


class TargetError(ValueError):
    """A ``--module`` value that does not name something importable."""


def load_target(spec: str) -> Any:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TargetError(f"--module must be MODULE:NAME or FILE.py:NAME; got {spec!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise TargetError(f"--module {spec!r}: no such file {where!r}")
        try:
            mod = _import_file(where)
        except TargetError:
            raise
        except Exception as e:
            raise TargetError(f"--module {spec!r}: importing {where!r} failed: {type(e).__name__}: {e}") from None
    else:
        here = os.getcwd()
        if here not in sys.path:
            sys.path.insert(0, here)
        try:
            mod = importlib.import_module(where)
        except Exception as e:  # its own top-level code may raise anything
            raise TargetError(f"--module {spec!r}: cannot import {where!r}: {type(e).__name__}: {e}") from None
    obj: Any = mod
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"--module {spec!r}: {where!r} has no {name!r}") from None
    return obj


def module_of(obj: Any, spec: str) -> Any:
    """What ``nanhunt.replay(module=...)`` takes: an ``nn.Module`` class or instance (a function is
    called, without arguments, for the instance)."""
    from torch import nn

    if isinstance(obj, nn.Module) or (isinstance(obj, type) and issubclass(obj, nn.Module)):
        return obj
    if isinstance(obj, type) or not callable(obj):
        raise TargetError(f"--module {spec!r} is a {type(obj).__name__}, not an nn.Module class or a function")
    try:
        made = obj()
    except Exception as e:
        raise TargetError(f"--module {spec!r}: calling it failed: {type(e).__name__}: {e}") from None
    if not isinstance(made, nn.Module):
        raise TargetError(f"--module {spec!r} returned a {type(made).__name__}, not an nn.Module")
    return made


def _import_file(path: str) -> Any:
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its sibling modules import as they do for `python file.py`
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem not in sys.modules else f"_nanhunt_user_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its classes find their module (dataclasses, pickling, nanhunt.replay)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod
