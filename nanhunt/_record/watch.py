"""`watch()`: every option named, validated once (`Options`), and the `Hunt` of its mode."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._finding import Finding
from .hunt import Hunt
from .ops import OpsHunt
from .options import Options

__all__ = ["watch"]


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    on_find: str | Callable[[Finding], Any] = "raise",
    scaler: Any = None,
    ignore: Iterable[str] = (),
    history: int = 32,
    report: str | os.PathLike[str] | None = None,
    mode: str = "full",
    replay: bool = True,
    grad_hooks: bool = False,
    optimizer_every: int | None = None,
    stats_every: int = 10,
    bundle: str | os.PathLike[str] | None = None,
    distributed: bool | None = None,
    rank: int | None = None,
    dist_timeout: float = 300.0,
    max_findings: int = 1000,
    max_skips: int = 3,
    loader: Any = None,
    guard_saves: bool = True,
) -> Hunt:
    """Watch ``model`` (and ``optimizer``) for the first NaN/Inf; returns the running `Hunt`.

    Args:
      model: the ``nn.Module`` to watch (every submodule call, forward and backward).
      optimizer: an optimizer or a list of them: parameters and state are checked after each
        ``step()``, and ``step()`` calls count the training step.
      on_find: ``"raise"`` (`NonFiniteError` at the first finding, before the optimizer applies
        the step), ``"warn"``, ``"record"``, ``"skip"`` (drop the step and train on: the optimizer
        applies nothing, gradients become ``None``, buffers go back to the step's start),
        ``"breakpoint"`` (Python's ``breakpoint()`` inside a replay of the failing op, locals
        ``finding``, ``op``, ``args``, ``out``; then raise), or a callable taking a `Finding`. In
        raise and skip, buffers written during the failing step (BatchNorm running statistics) are
        put back.
      scaler: a ``torch.amp.GradScaler``; the steps it skips are expected overflows, not findings.
      ignore: glob patterns of module names whose outputs may legitimately hold Inf/NaN;
        ``"<outside>"`` covers the values of the code outside every module (a perplexity that
        may overflow), not the gradients it makes.
      history: how many sampled steps of per-module magnitude statistics the report keeps.
      report: a ``.json``/``.html``/``.txt`` path written at the first finding and on close.
      mode: ``"full"`` (every module's outputs, gradients, parameters, optimizer state),
        ``"sentinel"`` (only the root's calls, checked tensors, gradients and sampled
        parameters/state; a hit is localised by replay: the cheapest) or ``"ops"`` (full plus
        every aten op probed from the start: for debugging).
      replay: on a hit, replay the failing call to find the element, cause and op.
      grad_hooks: per-module gradient hooks always on, instead of a backward replay on a hit
        (full mode; with ``mode="sentinel"`` a ValueError).
      optimizer_every: check parameters/state after every N-th ``step()`` (default 1 in full
        mode, 10 in sentinel; 0: only on a hit).
      stats_every: sample the magnitude history every N steps.
      bundle: a ``.pt`` path: save the first failing call there for ``nanhunt replay``.
      distributed: agree on each step's answer across ranks (default: on when several run).
      rank: this process's rank in findings (default: ``torch.distributed``'s).
      dist_timeout: seconds a rank waits for the others in nanhunt's own agreement before it
        raises `SilentRankError` naming the ranks that died or stopped answering.
      max_findings: how many findings the report keeps; later ones are only counted
        (``report.meta["dropped_findings"]``). ``"warn"`` warns at most once per step.
      max_skips: with ``on_find="skip"``, this many consecutive steps are skipped; the next
        consecutive finding raises `NonFiniteError`.
      loader: the ``DataLoader`` the loop iterates: findings name the dataset indices of the
        rows that held NaN/Inf (``Finding.samples``, ``Report.bad_samples``).
      guard_saves: while the hunt is open, ``torch.save`` of the watched model's or optimizer's
        state holding NaN/Inf raises `NonFiniteError` before writing anything.
    """
    options = Options.make(
        on_find=on_find, scaler=scaler, ignore=ignore, history=history, report=report, mode=mode,
        replay=replay, grad_hooks=grad_hooks, optimizer_every=optimizer_every, stats_every=stats_every,
        bundle=bundle, distributed=distributed, rank=rank, dist_timeout=dist_timeout,
        max_findings=max_findings, max_skips=max_skips, loader=loader, guard_saves=guard_saves,
    )
    return (OpsHunt if options.mode == "ops" else Hunt)(model, optimizer, options)
