"""Global module hooks that come off cleanly (torch <= 2.13 leaves a removed with_kwargs hook's id behind)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.modules import module as _module_mod

__all__ = ["GlobalHooks"]


class GlobalHooks:
    """A forward pre-hook and a forward hook (with kwargs, always called) on every module."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._handles = [
            _module_mod.register_module_forward_pre_hook(pre),
            _module_mod.register_module_forward_hook(post, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
            _module_mod._global_forward_hooks_with_kwargs.pop(h.id, None)
        self._handles.clear()
