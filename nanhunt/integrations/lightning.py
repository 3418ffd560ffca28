"""Lightning: ``NanHunt(**watch_options)``, a ``Callback`` that watches the fit.

    from nanhunt.integrations.lightning import NanHunt

    hunt = NanHunt(report="nan.html")
    trainer = Trainer(callbacks=[hunt])
    trainer.fit(model)              # raises nanhunt.NonFiniteError at the first NaN/Inf
    print(hunt.report)

How it maps onto Lightning:

* ``on_fit_start`` (after the strategy set up the optimizers): ``nanhunt.watch(pl_module,
  optimizer=<the torch optimizers>, scaler=<the precision plugin's GradScaler, if any>, ...)``.
* Automatic optimization runs forward and backward *inside* ``optimizer.step(closure)``. nanhunt's
  step pre-hook wraps that closure, so the step's check runs right after the closure (forward,
  backward, ``on_before_optimizer_step``) and before the optimizer applies anything: a NaN born in
  the forward of step ``k`` is reported with ``step == k == trainer.global_step`` and the weights are
  never updated from it. Under ``16-mixed`` the scaler calls ``step()`` without a closure, after
  the closure ran: the plain pre-step check is then already at the right place.
* ``on_before_backward``: the training loss is checked as ``"loss"`` (catches a NaN made in
  ``training_step`` outside any module), still before this step's check.
* Validation (also the sanity check) is checked when it ends; ``trainer.validate/test/predict``
  on their own are watched too (without an optimizer; one check per batch).
* Checkpoints: while the watch is open, a checkpoint whose model or optimizer state holds NaN/Inf
  is refused (`NonFiniteError`, phase ``"checkpoint"``) before anything is written; other tensors
  (``ModelCheckpoint``'s ``kth_value = inf``) are not judged. ``guard_saves=False`` turns it off.
* ``on_fit_end`` closes the watch (a pending finding is raised there); ``on_exception`` and
  ``teardown`` close it without raising again. The ``NonFiniteError`` raised inside the loop is
  re-raised unchanged by ``trainer.fit()``. ``.report`` stays readable after the watch closed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._record import Hunt, Options, watch
from .._record.guard import saving_to
from ._common import HuntOwner

_INSTALL = "pip install 'nanhunt[lightning]'"


def _callback_bases() -> tuple[type, ...]:
    """``lightning.pytorch.Callback`` and/or ``pytorch_lightning.Callback``, whichever are installed.

    When both are, the callback derives from both so either package's ``Trainer`` accepts it."""
    bases: list[type] = []
    errors: list[str] = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            mod = __import__(name, fromlist=["Callback"])
            bases.append(mod.Callback)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    if not bases:
        raise ImportError(
            "nanhunt.integrations.lightning needs Lightning (lightning.pytorch or pytorch_lightning); "
            f"install it with: {_INSTALL}  ({'; '.join(errors)})"
        )
    return tuple(bases)


_BASES = _callback_bases()
_RESERVED = ("model", "optimizer")


def _torch_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers the loop steps: unwrap LightningOptimizer (and the like). A wrapper that
    is itself a torch Optimizer (a Lookahead over the configured SGD, accelerate's) is kept:
    watch() watches the optimizer it steps, and takes the step's end when the wrapper's returns
    (the Lookahead's pull-back is part of the step)."""
    out: list[torch.optim.Optimizer] = []
    for o in optimizers or ():
        seen = 0
        while not isinstance(o, torch.optim.Optimizer) or type(o).__name__ == "LightningOptimizer":
            inner = getattr(o, "_optimizer", None) or getattr(o, "optimizer", None)
            if inner is None or seen > 8:
                break
            o, seen = inner, seen + 1
        if isinstance(o, torch.optim.Optimizer):
            if not any(o is p for p in out):
                out.append(o)
        else:
            warnings.warn(
                f"nanhunt: {type(o).__name__} is not a torch.optim.Optimizer; its steps are not watched "
                "(parameters and gradients are checked at the model's forward only)",
                RuntimeWarning,
                stacklevel=3,
            )
    return out


def _scaler_of(trainer: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "step") and hasattr(scaler, "update"):
        is_enabled = getattr(scaler, "is_enabled", None)
        if is_enabled is None or is_enabled():
            return scaler
    return None


class NanHunt(HuntOwner, *_BASES):  # type: ignore[misc]
    """A Lightning ``Callback`` that runs ``nanhunt.watch`` over the fit. See the module docstring.

    ``watch_options`` are those of :func:`nanhunt.watch` except ``model`` and ``optimizer``, which
    come from the trainer (``on_find``, ``scaler``, ``ignore``, ``history``, ``report``, ``mode``, …).
    ``check_loss=False`` turns off the check of the training loss.
    """

    def __init__(self, *, check_loss: bool = True, **watch_options: Any) -> None:
        super().__init__()
        bad = [k for k in _RESERVED if k in watch_options]
        if bad:
            raise TypeError(f"NanHunt takes the model and optimizers from the Trainer; do not pass {', '.join(bad)}")
        Options.check("NanHunt", watch_options)  # a bad option fails now, not inside fit()
        self.watch_options = watch_options
        self.check_loss = check_loss
        self.hunt: Hunt | None = None
        self._eval_only = False

    # ------------------------------------------------------------------ fit
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module, _torch_optimizers(getattr(trainer, "optimizers", None)))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        hunt = self.hunt
        if hunt is None or hunt.closed or not self.check_loss or not isinstance(loss, torch.Tensor):
            return
        hunt.check(loss, "loss")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # optimizers configured late (e.g. by a strategy after on_fit_start) are watched too
        hunt = self.hunt
        if hunt is not None and not hunt.closed:
            opts = _torch_optimizers(getattr(trainer, "optimizers", None))
            for opt in opts:
                hunt.add_optimizer(opt)
            # fit(ckpt_path=...): the loops' state is restored after on_fit_start; the hunt numbers
            # its steps as global_step does (which counts every optimizer's step: one round here)
            self._resume_at((getattr(trainer, "global_step", 0) or 0) // max(len(opts), 1))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.hunt is not None and not self.hunt.closed and not self._eval_only:
            self.hunt.sync()  # validation inside fit (and the sanity check): report it before training on
        elif self._eval_only:
            self._stop()

    # ------------------------------------------------------------------ validate / test / predict alone
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_eval(trainer, pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_eval(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_eval(trainer, pl_module)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._eval_batch_end()

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._eval_batch_end()

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._eval_batch_end()

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        if self._eval_only:
            self._stop()

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        if self._eval_only:
            self._stop()

    # ------------------------------------------------------------------ ends
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._abandon(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._abandon(None)

    def state_dict(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ internals
    def _start(self, trainer: Any, pl_module: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        self._abandon(None)  # a callback reused for a second fit: a fresh watch
        options = dict(self.watch_options)
        if optimizers and options.get("scaler") is None:
            scaler = _scaler_of(trainer)
            if scaler is not None:
                options["scaler"] = scaler
        if "loader" not in options and (getattr(trainer, "world_size", 1) or 1) == 1:
            # the DataLoader given to fit(): its batches' dataset indices name a bad row (Finding.samples),
            # as watch(loader=...) does; on one process Lightning iterates it as given (a loader from the
            # module's train_dataloader() is made later, and one per rank is rebuilt with its own sampler)
            source = getattr(getattr(getattr(trainer, "fit_loop", None), "_data_source", None), "instance", None)
            if isinstance(source, torch.utils.data.DataLoader):
                options["loader"] = source
        self.hunt = watch(pl_module, optimizer=optimizers or None, **options)
        if options.get("guard_saves", True):
            self._name_saves(trainer)

    def _name_saves(self, trainer: Any) -> None:
        """Lightning writes a checkpoint with ``torch.save`` into a buffer, then the bytes to the file:
        tell nanhunt's save guard that file's name (the refusal names it). Undone in teardown."""
        original = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            with saving_to(filepath):
                return original(filepath, *args, **kwargs)

        save_checkpoint.__nanhunt__ = True  # type: ignore[attr-defined]
        trainer.save_checkpoint = save_checkpoint
        self._named = trainer

    def _unname_saves(self) -> None:
        trainer, self._named = getattr(self, "_named", None), None
        if trainer is not None and getattr(trainer.__dict__.get("save_checkpoint"), "__nanhunt__", False):
            del trainer.save_checkpoint

    def _start_eval(self, trainer: Any, pl_module: Any) -> None:
        if self.hunt is not None and not self.hunt.closed:
            return  # inside fit: the fit's watch sees validation too
        if getattr(trainer, "training", False) or _fitting(trainer):
            return
        self._start(trainer, pl_module, [])
        self._eval_only = True

    def _eval_batch_end(self) -> None:
        if self._eval_only and self.hunt is not None and not self.hunt.closed:
            self.hunt.sync(advance=True)  # no optimizer: one check per batch, `step` = batch index

    def _stop(self) -> None:
        self._eval_only = False
        self.close()

    def _abandon(self, exception: BaseException | None) -> None:
        """Close without raising: the run is already leaving (by ``exception``, if any)."""
        self._eval_only = False
        self._unname_saves()
        hunt = self.hunt
        if hunt is None or hunt.closed:
            return
        hunt.close(raise_pending=False)  # records a pending finding, never raises it


def _fitting(trainer: Any) -> bool:
    state = getattr(trainer, "state", None)
    fn = getattr(state, "fn", None)
    return str(getattr(fn, "value", fn)) == "fit"
