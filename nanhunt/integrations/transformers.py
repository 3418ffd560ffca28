"""Hugging Face: ``NanHuntCallback(**watch_options)``, a ``TrainerCallback`` that watches training.

    from nanhunt.integrations.transformers import NanHuntCallback

    cb = NanHuntCallback(report="nan.html")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()                 # raises nanhunt.NonFiniteError at the first NaN/Inf
    print(cb.report)

How it maps onto the ``Trainer``:

* ``on_train_begin`` (the optimizer exists by then, wrapped by accelerate):
  ``nanhunt.watch(model, optimizer=<the Trainer's optimizer>, scaler=<accelerate's GradScaler,
  if any>, ...)``. accelerate's ``AcceleratedOptimizer.step()`` calls the wrapped optimizer's
  ``step()`` (directly, or through the scaler): watch() puts the hooks on that inner optimizer, the
  one whose ``step()`` really runs (and ends the step when the wrapper's ``step()`` returns: a
  Lookahead's pull-back is part of it), so the check comes after gradient clipping and before the update, once
  per optimizer step (gradient accumulation included) and ``Finding.step`` is the optimizer step.
* An evaluation during training is checked when it ends (``on_evaluate``).
* Checkpoints: when the Trainer is about to save (``control.should_save`` at the end of a step or
  epoch), a model or optimizer state holding NaN/Inf is refused with `NonFiniteError` (phase
  ``"checkpoint"``) before any file of that checkpoint is written; ``torch.save`` is guarded too.
* ``on_train_end`` closes the watch (a pending finding is raised there).
* The ``Trainer`` has no exception hook, so with ``on_find="raise"`` the watch closes itself
  right before it raises: ``trainer.train()`` lets ``NonFiniteError`` out and leaves no hook
  behind. With ``"warn"``/``"record"``, or if training stops by another exception, call
  :meth:`NanHuntCallback.close`. ``.report`` stays readable after the watch closed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._finding import Finding, NonFiniteError
from .._record import Hunt, Options, watch
from ._common import HuntOwner

_INSTALL = "pip install 'nanhunt[transformers]'"

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        f"nanhunt.integrations.transformers needs Hugging Face transformers; install it with: {_INSTALL}"
    ) from e

_RESERVED = ("model", "optimizer")


def _real_optimizer(opt: Any) -> Any:
    """accelerate's AcceleratedOptimizer (and similar wrappers) -> the torch optimizer that steps."""
    for _ in range(8):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            break
        opt = inner
    return opt


class _RaiseClosing:
    """``on_find`` for raise mode: close the watch, then raise (the Trainer has no exception hook)."""

    raises = True  # the hunt puts back the buffers the failing step wrote, as in raise mode

    def __init__(self) -> None:
        self.hunt: Hunt | None = None
        self.raised = False

    def __call__(self, finding: Finding) -> None:
        hunt = self.hunt
        if hunt is None or self.raised:
            return
        self.raised = True
        # the step's record is already taken; closing as if by an exception: no collective, no raise
        hunt.close(raise_pending=False)
        raise NonFiniteError(finding, hunt.report)


class NanHuntCallback(HuntOwner, TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs ``nanhunt.watch`` over ``trainer.train()``.

    ``watch_options`` are those of :func:`nanhunt.watch` except ``model`` and ``optimizer``, which
    come from the Trainer (``on_find``, ``scaler``, ``ignore``, ``history``, ``report``, ``mode``, …).
    """

    def __init__(self, **watch_options: Any) -> None:
        bad = [k for k in _RESERVED if k in watch_options]
        if bad:
            raise TypeError(
                f"NanHuntCallback takes the model and optimizer from the Trainer; do not pass {', '.join(bad)}"
            )
        Options.check("NanHuntCallback", watch_options)  # a bad option fails now, not inside train()
        self.watch_options = watch_options
        self.hunt: Hunt | None = None

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("NanHuntCallback.on_train_begin got no model from the Trainer")
        self._abandon()  # a second train() with the same callback: a fresh watch
        options = dict(self.watch_options)
        real = _real_optimizer(optimizer) if optimizer is not None else None
        if real is not None and options.get("scaler") is None:
            scaler = getattr(optimizer, "scaler", None)  # accelerate's fp16 GradScaler
            if scaler is not None and hasattr(scaler, "step") and hasattr(scaler, "update"):
                options["scaler"] = scaler
        loader = kwargs.get("train_dataloader")  # (accelerate's prepared one: watch() reads its base loader)
        if "loader" not in options and isinstance(loader, torch.utils.data.DataLoader) \
                and getattr(args, "world_size", 1) == 1:
            options["loader"] = loader  # the dataset indices of a bad row of the data (Finding.samples)
        closing = None
        if options.get("on_find", "raise") == "raise":
            closing = options["on_find"] = _RaiseClosing()
        # (the wrapper as given: watch() finds the optimizer it steps, and ends the step as it returns)
        self.hunt = watch(model, optimizer=optimizer if real is not None else None, **options)
        self.hunt._close_before_raise = True  # skip mode's NonFiniteError (max_skips) too
        if closing is not None:
            closing.hunt = self.hunt
        self._resume_at(getattr(state, "global_step", 0) or 0)  # resume_from_checkpoint: its step on

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        self._guard_save(args, state, control, model, optimizer)

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                     **kwargs: Any) -> None:
        self._guard_save(args, state, control, model, optimizer)

    def _guard_save(self, args: Any, state: Any, control: Any, model: Any, optimizer: Any) -> None:
        """The Trainer is about to write a checkpoint (the model by safetensors, not torch.save):
        refuse it here, before any file of it is written, if the state holds NaN/Inf."""
        hunt = self.hunt
        if hunt is None or hunt.closed or model is None or not getattr(control, "should_save", False):
            return
        obj: dict[str, Any] = {"model": model.state_dict()}
        real = _real_optimizer(optimizer) if optimizer is not None else None
        if real is not None:
            obj["optimizer"] = real.state_dict()
        try:
            hunt.refuse_save(obj, os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}"))
        except NonFiniteError:
            self._abandon()  # the Trainer has no exception hook: leave nothing behind
            raise

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hunt = self.hunt
        if hunt is None or hunt.closed:
            return
        hunt.sync()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def _abandon(self) -> None:
        """Close without raising: a pending finding is recorded only."""
        hunt = self.hunt
        if hunt is None or hunt.closed:
            return
        if isinstance(hunt.on_find, _RaiseClosing):
            hunt.on_find.raised = True
        hunt.close(raise_pending=False)
