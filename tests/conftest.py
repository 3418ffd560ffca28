"""Shared fixtures: every test must leave no global hook behind."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.modules import module as _module_mod
from torch.optim import optimizer as _optimizer_mod

torch.set_num_threads(2)

pytest_plugins = ["pytester"]  # the pytest plugin's tests run pytest on generated test files

_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def global_hooks() -> dict[str, Any]:
    """Every process-wide hook table torch keeps, as {table: keys}.

    ``_global_forward_hooks_with_kwargs`` is left out here: torch's own handle does not clean it
    (test_watch_api checks that nanhunt does)."""
    out = {n: list(getattr(_module_mod, n, {}).keys()) for n in _GLOBAL_HOOK_DICTS}
    out["optim_pre"] = list(_optimizer_mod._global_optimizer_pre_hooks.keys())
    out["optim_post"] = list(_optimizer_mod._global_optimizer_post_hooks.keys())
    return out


@pytest.fixture(autouse=True)
def _no_global_hooks_left() -> Iterator[None]:
    """Whatever a test does, the global hook tables are as they were afterwards."""
    before = global_hooks()
    modes = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    yield
    gc.collect()
    from nanhunt._record.outside import _SWITCH

    # a pass-through outside-code mode torch pushed back after its own handler (a fault inside it, or
    # close() from a backward hook): its hook takes it off at the next module call, as this does
    _SWITCH.sweep()
    assert global_hooks() == before, "a global hook survived the test"
    left = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    assert left == modes, f"a torch function/dispatch mode survived the test: {modes} -> {left}"
