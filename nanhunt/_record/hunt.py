"""`Hunt`: the hooks, the step's bookkeeping and its single sync.

Hot path (every watched module call): one device-side sum per floating output tensor, appended
to the step's log (per-module gradient hooks only with ``grad_hooks=True``). Nothing is read back
to the host until the step ends (`optimizer.step()` pre-hook, the model's next root call when no
optimizer is watched, or `close()`), where one `.item()`-like read decides whether anything was
non-finite. Only then is the step handed, as a read-only `StepView`, to `_locate.locate`.

What the hooks see, and what they leave alone:
- **Threads.** A step is recorded from one thread, its owner: the thread that steps a watched
  optimizer (before the first ``step()``, the first thread that calls a watched module); without
  an optimizer, the thread of the current root call (any thread takes the next one). Calls from
  other threads meanwhile never mix into the step: each such top-level call of a watched module
  (an evaluation thread, a server's concurrent requests) is noted on its own (`_foreign_pre`), its
  outputs are read as it returns (one host read per call), and a non-finite one is reported at
  that step, raised in the thread that made the call, without a replay (the model and the RNG are
  the owner's meanwhile); the step's own findings go before it. A thread
  that ended owns nothing: the next thread to call a watched module takes the step over.
  Gradient hooks run in whatever thread autograd uses.
- **The user's forward hooks.** torch runs global hooks before a module's own; for a module with
  forward hooks of its own, nanhunt probes from a forward hook of that module kept after the
  user's (added lazily, removed at close), so it judges the output the program sees.
- **Models that change.** The name map is keyed by id with weak references (it keeps no module
  alive) and is rebuilt after a watched module gains or swaps a child (torch's global module
  registration hook). An optimizer built again over the model's parameters mid-run takes the place
  of the watched ones it replaces (`add_optimizer`, `_unwatched_step`).
- **torch.func.** Calls inside ``vmap``/``grad``/... transforms (functorch-wrapped tensors) are not
  recorded; the gradients they produce are checked as usual at the step's end.
- **Internal faults.** Every hook stage runs under ``try``: see :mod:`.faults`.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from itertools import chain, repeat
from operator import attrgetter, is_
from threading import get_ident
from typing import Any

import torch
from torch import nn

from .._files import rank_path, warn_unwritten
from .._finding import Finding, NonFiniteError
from .._hooks import MODULE_REGISTRATION, OPTIMIZER_STEP, REPLAYING, GlobalHooks, hunt_opened, in_transform, replaying
from .._hooks import tick as _tick
from .._locate import locate
from .._locate.damage import bad_state, damage
from .._locate.outside import OUTSIDE, in_place
from .._profile import span
from .._report import Report
from .._steplog import PASSTHROUGH as _PASSTHROUGH
from .._steplog import (
    TIE_KEY,
    Bwd,
    Call,
    Chk,
    Fwd,
    Grads,
    OptimState,
    Out,
    StepLog,
    StepView,
    TensorInfo,
    Top,
    add_to_group,
)
from .._tensors import (
    NO_SPECIALS,
    Path,
    any_bad,
    dtype_name,
    element,
    format_path,
    grain,
    is_bad,
    is_checked,
    optimizer_tensors,
    probe,
    read_nan,
    shape_of,
    stack_probes,
    storage_of,
    tensors,
    version,
)
from .._words import paragraph
from . import dist as _dist
from .compiled import CompiledChecks, CompiledRoot, forget_compiled
from .copies import hold, release
from .faults import InternalError, log_fault
from .forwards import LAZY_NUMEL as _LAZY_NUMEL
from .forwards import Forward, install, remove
from .guard import SaveGuard
from .history import History, stats, stats_of_rows
from .options import Options
from .outside import _SWITCH, Outside, user_line, user_stacklevel
from .probe import Fused, GradProbe, OptimizerProbe
from .protect import BufferBackup, StepBackup, drop_grads, moves_in_step
from .retain import settle
from .samples import LoaderIndices
from .start import StartState
from .state import BufferState

__all__ = ["Hunt", "NonFiniteWarning"]

_logger = logging.getLogger("nanhunt")

_NO = object()
_NO_PEAK = (-1, float("-inf"))  # (no lr noted yet: see Hunt._peak_lrs)
_F32 = torch.float32
_is_compiling = torch.compiler.is_compiling
_get_ident = threading.get_ident
_tracing_state = torch._C._get_tracing_state  # None unless torch.jit.trace is recording
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_weakref = weakref.ref
_VERSION = attrgetter("_version")
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_CHECKED = frozenset(d for d in vars(torch).values()  # the dtypes that can hold NaN/Inf (`is_checked`)
                     if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex) and d not in NO_SPECIALS)
_ONE_PATH: tuple[Path] = ((),)  # the paths of a call with one tensor output
_FWD0: list[Fwd] = []  # Fwd(i, 0) for each call index i seen so far: shared, never changed
_FWD_CACHED = 1 << 16  # call indices past this get an entry of their own


def _noop_hook(*args: Any) -> None:
    """What a copy of a watched module carries in place of the hunt's hook: nothing to do. At
    the copy's first call it takes itself out of the copy's hook dicts (torch iterates over a
    copy of them), so the copy runs on torch's fast path and holds nothing of nanhunt from then on."""
    module = args[0] if args else None
    if isinstance(module, nn.Module):
        for d in (module._forward_pre_hooks, module._forward_hooks):
            for k in [k for k, v in d.items() if v is _noop_hook]:
                del d[k]
                module._forward_pre_hooks_with_kwargs.pop(k, None)
                module._forward_hooks_with_kwargs.pop(k, None)
                module._forward_hooks_always_called.pop(k, None)
    return None


def _noop_factory() -> Any:
    return _noop_hook


class _OnModule:
    """A hook the hunt puts on one of the user's modules (the root's in sentinel mode, a module
    with forward hooks of its own): it calls the hunt through a weak reference, and a copy of the
    module (``copy.deepcopy`` for an EMA or a teacher, ``torch.save`` of the whole module) gets a
    hook that does nothing, never a copy of the hunt (which holds a lock: the copy failed)."""

    __slots__ = ("_hunt", "_method")
    __nanhunt__ = True  # (left out of a copy or pickle of its module: copies.py)

    def __init__(self, hunt: Hunt, method: str) -> None:
        self._hunt = weakref.ref(hunt)
        self._method = method

    def __call__(self, *args: Any) -> Any:
        h = self._hunt()
        return None if h is None else getattr(h, self._method)(*args)

    def __deepcopy__(self, memo: Any) -> Any:
        return _noop_hook

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _noop_factory, ()


_NO_COPY = ("a nanhunt Hunt cannot be copied or pickled: it is the hooks on one live model and its "
            "optimizers (copy the model, the optimizer or hunt.report instead; an object that holds the "
            "hunt can leave it out of its copy, e.g. in __deepcopy__ or __getstate__)")


def _fwd0(i: int) -> Fwd:
    """The entry of call ``i``'s only output (made once per index, not once per step)."""
    if i >= _FWD_CACHED:
        return Fwd(i, 0)
    while len(_FWD0) <= i:
        _FWD0.append(Fwd(len(_FWD0), 0))
    return _FWD0[i]


# Small float32 outputs (up to `_LAZY_NUMEL` elements, from forwards.py; dispatch-bound: a probe's
# dispatch costs more than its pass over memory) are probed together at the top-level call's return, once their module was seen, for one whole
# call of the root, never to have its output written in place after returning (a ReLU(inplace)
# after a BatchNorm): until then, and for every other output, the probe is taken at once.
_LAZY_CAP = 256  # outputs held at most (<= 16 MiB)
_MAX_ENTRIES = 200_000  # a step that never ends (eval loops): sync anyway past this
_FOLD = 8  # a step's earlier logs kept as calls at most (see _Counted)
_REPORT_EVERY = 10.0  # seconds: `report=` is written at the first finding, then at most this often, and on close
_REPORT_WRITERS: dict[str, weakref.ReferenceType[Hunt]] = {}  # report file (links followed) -> the open hunt writing it


_ABANDONING: set[int] = set()  # optimizers (ids) whose step() a hunt raised out of: see Hunt._others_abandon


class _Counted:
    """The calls of a step's earlier logs (an evaluation call, the cap, the other optimizers of a
    round ended one and the step went on in a new log), counted per (evaluation pass?, module id)
    only when a hit needs the numbers (`StepLog.number_calls`): with an optimizer every step ends
    its log as step() begins and then starts counting anew, and counting its ~100 calls at each
    step cost ~0.5 us a call. Past `_FOLD` logs (a validation loop of thousands of batches between
    two steps, each its own log) they are counted once into ``folded``: the earlier logs' calls
    (and their modules) are not kept, nor copied again at each log, until the step ends."""

    __slots__ = ("parts", "folded")

    def __init__(self, prior: _Counted | None = None, log: StepLog | None = None) -> None:
        self.parts: list[tuple[list[Call], list[bool]]] = list(prior.parts) if prior is not None else []
        self.folded: dict[tuple[bool, int], int] | None = prior.folded if prior is not None else None
        if log is not None:
            self.parts.append((list(log.calls), [not t.grad_enabled and not t.training for t in log.tops]))
            if len(self.parts) > _FOLD:
                self.folded, self.parts = self.counts(), []  # (a new dict: ``prior`` keeps its own counts)

    def counts(self) -> dict[tuple[bool, int], int]:
        out: dict[tuple[bool, int], int] = dict(self.folded) if self.folded else {}
        for calls, evaluation in self.parts:
            for c in calls:
                k = (0 <= c.top < len(evaluation) and evaluation[c.top], id(c.module))
                out[k] = out.get(k, 0) + 1
        return out


class NonFiniteWarning(RuntimeWarning):
    """Emitted for each finding when ``on_find="warn"``."""


class Hunt:
    """A running watch (made by `nanhunt.watch()`). Use as a context manager or call :meth:`close`."""

    def __init__(self, model: nn.Module, optimizer: Any = None, options: Options | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"nanhunt.watch() needs an nn.Module as `model`, got {type(model).__name__}: {model!r:.80}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError(f"nanhunt.watch() cannot watch a TorchScript module ({type(model).__name__}, from "
                            "torch.jit.script or torch.jit.trace): its forward runs in the TorchScript interpreter, "
                            "where no hook sees its submodules and no replay can run. Watch the eager nn.Module "
                            "(script or trace it for export after training)")
        opts = _optimizers(optimizer)
        o = options if options is not None else Options.make()
        self.options = o
        if o.report is not None:
            _report_free(o.report)  # (before any hook)
        self._report_path = o.report
        self._report_at: float | None = None  # when `report=` was last written while running
        self._bundle_path = o.bundle

        self.on_find = o.on_find
        self.mode = o.mode
        self.replay = o.replay
        self.history = o.history
        self.rank = o.rank if o.rank is not None else _dist.rank()
        if self.rank and _dist.world() > 1:
            # each rank its own report and bundle, rank 0's at the path given: ranks that share the path
            # wrote over each other's, the last to close winning (a clean rank's "no NaN/Inf found" over
            # the finding of a rank whose findings were never merged: no optimizer, or a silent rank)
            if self._report_path is not None:
                self._report_path = rank_path(self._report_path, self.rank)
            if self._bundle_path is not None:
                self._bundle_path = rank_path(self._bundle_path, self.rank)
        # all ranks stop at the same step: on by default when torch.distributed runs several ranks
        self.distributed = (_dist.world() > 1) if o.distributed is None else o.distributed
        # torch.compile(model) given itself: sentinel catches its calls from the first step (see _catch_wrapper)
        wrapper = any(type(m).__name__ == "OptimizedModule" for m in (model, _dist.unwrap(model)))
        model = _unwrap(model)  # DDP, torch.compile(model): names and replays of the inner module
        self._dist: _dist.Distributed | None = None
        if self.distributed and _dist.world() > 1:
            self._dist = _dist.Distributed(model, o.dist_timeout)
            if self._dist.sharded:
                self.replay = False  # an FSDP2 replay would all-gather on this rank alone: every rank or none
        self.step = 0
        self.findings: list[Finding] = []
        # called with each batch of findings before they are added (in the order made), however
        # they were made (on_find, a refused checkpoint): `nanhunt run` orders findings across hunts
        self.on_record: list[Callable[[list[Finding]], None]] = []
        self._when: dict[int, tuple[int, Finding]] = {}  # id(finding) -> (`occurred`, the finding)
        self._step_clocks: dict[int, int] = {}  # per optimizer: when its last step() ended (`_hooks.tick`)
        self._step_of: dict[int, int] = {}  # per optimizer: the training step its last step() belonged to
        # per (optimizer, group): the last step() it ran with a non-finite float lr, and that lr (a
        # schedule's 1/0 at one step, finite again when a sampled reading finds the weights it poisoned)
        self._bad_lrs: dict[tuple[int, int], tuple[int, float]] = {}
        # per (optimizer, group): the step of its last step() and the float lr it ran with (the schedule
        # has moved it on by the time a sampled reading finds the weights that step overflowed)
        self._last_lrs: dict[tuple[int, int], tuple[int, float]] = {}
        # per (optimizer, group): the step() that ran with the largest finite float lr so far, and that lr
        # (a warm-up that starts at 1e3: the schedule has brought it down by the time the weights overflow)
        self._peak_lrs: dict[tuple[int, int], tuple[int, float]] = {}
        self.judging_since = 0  # when the step judged last began (`_hooks.tick`; 0: no call in it)
        self._root: nn.Module | None = model
        self._opts: list[torch.optim.Optimizer] = opts
        scaler = o.scaler if o.scaler is not None else _wrapper_scaler(optimizer)
        self._scaler = scaler
        self._ignore = o.ignore
        # "<outside>" matched: values the loss and metric code make are not probed (a perplexity
        # that may overflow); their gradients still are, as every module's
        self._quiet_outside = any(fnmatch.fnmatchcase(OUTSIDE, p) for p in o.ignore)
        self._names: dict[int, tuple[str, Any]] | None = None  # see _build_names
        self._ignored: set[int] = set()  # ids of modules matching `ignore`
        self._cnames: dict[nn.Module, int | None] | None = None  # for compiled graphs: _compiled_names
        self._clate: dict[nn.Module, bool] = {}  # ... the modules with forward hooks of the user's: judged after them
        # ... and the modules whose calls are seen eagerly around their compiled call (torch.compile(m)'s
        # wrapper, m.compile()): no slot, their outputs are judged there (see _around_compiled)
        self._around: dict[nn.Module, bool] = {}
        self._log = StepLog()
        self._stack: list[Call] = []
        self._owner: int | None = None  # the thread whose calls this step records
        self._owner_lock = threading.Lock()
        self._owner_thread = threading.current_thread()  # the Thread of the last owner set (_take_step, _pre_step)
        self._foreign = threading.local()  # .top: the top-level call another thread is making (_foreign_pre)
        self._foreign_ids: set[int] = set()  # ids of findings made in other threads' calls (see _add_findings)
        self._late: dict[int, Any] = {}  # module id -> our forward hook after the user's own
        self._held: list[type] = []  # classes of modules with a hook of ours (copies.py), released at close
        self._defer: set[int] = set()  # module ids whose small outputs are probed at the top-level return
        self._eager: set[int] = set()  # module ids whose outputs were written after their call returned
        self._pending: list[Call] = []  # calls whose outputs _late_post records
        self._user_exc: BaseException | None = None  # raised by the user's on_find: not a fault
        self._in_on_find = 0  # the thread running the user's on_find callback (0: none)
        self._paused = False
        self._closed = False
        self._faulted = False  # switched itself off after an internal fault (see _fault)
        self._steps_applied = 0
        self._applied: dict[int, int] = {}  # per optimizer: its step() calls that ran
        self._probed_at: dict[int, int] = {}  # per optimizer: the step of the last update whose state was probed
        self._loaded: set[int] = set()  # optimizers whose load_state_dict() ran since their last step()
        self._skipped_steps = 0
        self._steps_seen = 0  # step() calls of any optimizer (see _ScalerStep)
        self._history = History(o.history)
        self._grad_hooks = o.grad_hooks
        self._optimizer_every = o.optimizer_every
        # per optimizer: its parameters and their versions after its last step() (a dict on a hit: `_view`)
        self._after_step: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        self._bad_grads_step = -1
        self._round: set[int] = set()
        self._stats_every = o.stats_every
        self._per_module = o.mode != "sentinel"
        self._stats_on = self._per_module and o.history > 0
        self._lean = not (self._ignored or self._grad_hooks)  # see _done
        self._handles: list[Any] = [self._dist] if self._dist is not None else []
        # full mode: the global hooks, and the `Forward` wrappers that see the calls inside a
        # top-level call while those hooks are off (see forwards.py; before the first name map)
        self._global: GlobalHooks | None = None
        self._fwds: dict[int, Forward] = {}  # id(module) -> the wrapper put on it (close() takes them off)
        self._fwd_ok: list[Forward] | None = None  # the name map's wrappers; None: its calls are left to the hooks
        self._kids: list[tuple[dict[str, Any], dict[str, Any], int]] = []  # see _wrap
        self._inner = 0  # the owner thread's ident while a top-level call runs with the hooks off, else 0
        self._arm: Call | None = None  # the top-level call just begun, whose own forward may take the hooks off
        # the lean path (see forwards.py): the calls the wrappers noted, not yet recorded (`_flush`),
        # and that list while the top-level call running with the hooks off may use it, else None
        self._evbuf: list[Any] = []
        self._ev: list[Any] | None = None
        self._cparts: dict[int, CompiledRoot] = {}  # full mode: submodule.compile()'d parts (see _catch_compiled_parts)
        # (these before the first name map: model.compile()'s slots build it, it catches compiled
        # parts, and a rebuilt map regroups the buffers the backup puts back)
        self._backup = BufferBackup() if _restores(o.on_find) else None
        self._compiled: CompiledChecks | None = None
        if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile(): hooks are traced
            self._prepare_compiled(None)
        forget_compiled()  # graphs compiled before watch() would silently skip the hooks
        self._traced = False  # our hooks were traced into a graph the hunt was not ready for: see _after_trace
        self._wrappers: GlobalHooks | None = None  # sentinel: see _catch_wrapper
        self._stepping: torch.optim.Optimizer | None = None  # inside its step pre-hooks (see _release)
        self._in_closure: torch.optim.Optimizer | None = None  # its step(closure)'s check, after the closure
        self._wrapper_steps = 0  # wrapper optimizers' step() calls under way (see _WrapperStep)
        self._held_ends: list[tuple[int, torch.optim.Optimizer]] = []  # their inner steps' ends, held until they return
        # state a finding already showed non-finite (a weight the user wrote inf into, one an update
        # overflowed): carried into later steps, not born there again (see StepView.known_bad)
        self._known_bad: list[weakref.ref[torch.Tensor]] = []
        # the parameters' .grad a finding left non-finite (raise leaves them for inspection): a step
        # that adds to one (the error caught without zero_grad()) did not make its NaN/Inf
        self._stale_grads: list[weakref.ref[torch.Tensor]] = []
        self._odd: tuple[bool, Any, tuple[nn.Module, ...]] | None = None  # see _odd_modes
        self._deferred: list[Any] = []
        self._outside = Outside(self)  # code outside every watched call: on between root calls
        self._dropped = 0  # findings past max_findings: counted, not kept
        self._state = BufferState()  # buffers as they were before each root call
        self._warned_step = -1
        self._step_lines: dict[int, str | None] = {}
        # calls per (evaluation pass?, module id) in this step's earlier logs (checked in parts)
        self._calls_before = _Counted()

        # protect and recover (see protect.py, samples.py, guard.py): ready before any hook can fire
        self.skipped: list[int] = []  # steps dropped by on_find="skip"
        self._max_skips = o.max_skips
        self._skip_run = 0  # consecutive skipped steps
        self._skips_exceeded = False  # the step being handled would have been one skip too many
        self._judged: set[int] = set()  # optimizers whose last update was judged at once (`_judged_now`)
        self._damage: dict[str, list[str]] | None = None
        self._damage_at: torch.optim.Optimizer | None = None  # damage read again after this optimizer's step
        self._bad_samples: set[int] = set()
        self._batches = LoaderIndices(o.loader) if o.loader is not None else None
        self._close_before_raise = False
        self._guard = SaveGuard(self) if o.guard_saves else None
        self._start = StartState()  # what was non-finite when the watch began (read on a hit)

        self._croot: CompiledRoot | None = None
        self._abandon = False  # a finding raised out of step(): the next iteration counts it (see _abandoned)
        self._hit_inputs: list[weakref.ref[torch.Tensor]] = []  # the last hit's top-level inputs (see _resumed)
        self._oprobes: list[OptimizerProbe] = []  # per watched optimizer: its parameters and state
        self._gprobes: dict[int, GradProbe] = {}  # per watched optimizer (-1: all of them, -2: the model's)
        self._pprobes: dict[int, GradProbe] = {}  # per watched optimizer: its parameters as step() begins
        # per watched optimizer: (the step it is for, its parameters, their probe or None: all finite) as step() began
        self._before: dict[int, tuple[int, list[torch.Tensor], torch.Tensor | None]] = {}
        self._later: list[torch.optim.Optimizer] = []  # added while torch ran their step hooks: see add_optimizer
        self._retired: set[int] = set()  # watched optimizers replaced by one that holds the model's parameters: _retire
        # id(optimizer) -> (ref, holds the model's parameters, asked whether it replaces the watched ones)
        self._holds: dict[int, tuple[Any, bool, bool]] = {}
        self._pstores: tuple[StepLog | None, frozenset[int]] = (None, frozenset())  # see _before_write
        self._hand_update = False  # judging a step at a hand-written update's write (see _drop_grads)
        self._kept_scale: _KeepScale | None = None  # a skipped step's GradScaler update() to undo (see _skip)
        # skip: torch's random streams as the step's first top-level call began (its Top's), put
        # back when the step is dropped (`_skip`)
        self._step_rng: tuple[int, torch.Tensor, list[torch.Tensor] | None] | None = None
        self._depth = 0  # `with hunt:` blocks entered and not left
        self._closure_calls: dict[int, int] = {}  # per optimizer: closure calls in its step() under way
        self._step_backups: dict[int, StepBackup] = {}  # per optimizer: its weights when its step(closure) began
        _warn_foreign(model, opts, optimizer)  # (before any hook: a warning turned into an error leaves none)
        try:
            self._install(model, _given(optimizer), scaler, wrapper)
        except BaseException:
            self._report_path = None  # nothing was watched: no report
            self._release()  # nothing stays behind of a watch that failed to start
            raise
        if self._report_path is not None:
            _REPORT_WRITERS[os.path.realpath(self._report_path)] = weakref.ref(self)
        hunt_opened(self)

    def _install(self, model: nn.Module, opts: list[torch.optim.Optimizer], scaler: Any, wrapper: bool) -> None:
        """`__init__`'s hooks, wrappers and patches (taken off again if any of it fails); ``opts``: the
        optimizers as given (a wrapper optimizer too: see `add_optimizer`); ``wrapper``: watch() was
        given torch.compile(model)'s wrapper."""
        o = self.options
        self._handles.append(MODULE_REGISTRATION.add(self._on_register))
        if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile(): see CompiledRoot
            self._catch_compiled_root()
        if self._per_module:
            self._global = GlobalHooks(self._pre, self._post)
            self._handles.append(self._global)
        else:
            self._handles.append(model.register_forward_pre_hook(_OnModule(self, "_root_pre"), with_kwargs=True))
            self._handles.append(model.register_forward_hook(_OnModule(self, "_root_post"), with_kwargs=True,
                                                             always_call=True))
            self._hold(type(model))
            if wrapper:  # its calls are known to come through the wrapper: caught now, not after the first step
                self._catch_wrapper()
        self._opts = []
        for opt in opts:
            self._add_optimizer(opt)
        # an optimizer nobody gave to watch() may still step the model's weights (with none given; or
        # besides the one given: AdamW for the biases and norms next to the watched one for the matrices)
        self._handles.append(OPTIMIZER_STEP.add(self._unwatched_step))
        if scaler is not None:
            self._wrap_scaler(scaler)
        _logger.debug("watching %s (mode %s, %d optimizer(s))", type(model).__name__, o.mode, len(self._opts))
        if self._guard is not None:
            self._guard.install()

    # ------------------------------------------------------------------ public
    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def report(self) -> Report:
        return self._report_now()()

    def _report_now(self) -> Callable[[], Report]:
        """The report as the hunt stands now, made when first called (an error's ``.report``: the
        history's plain data is built only if the user reads it, not as the error is raised)."""
        history, findings, meta = self._history.snapshot(), list(self.findings), self._meta()
        damage, skipped, bad = self._damage, list(self.skipped), sorted(self._bad_samples)

        def make() -> Report:
            hist = history.to_dict()
            return Report(findings, history=hist, warnings=history.warnings(hist), meta=meta,
                          damage=damage, skipped=skipped, bad_samples=bad)
        return make

    @property
    def closed(self) -> bool:
        return self._closed

    def sync(self, *, advance: bool = False) -> None:
        """End the step's record now: its one host read, and `on_find` (raise mode raises).

        For loops the hooks cannot see the end of (integrations); ``advance=True`` also counts a
        step, for loops without a watched optimizer.
        """
        if self._open("hunt.sync()"):
            self._end_step(advance=advance, collective=bool(self._opts))

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch one more optimizer; its ``step()`` calls now count the training step. One built
        again over the model's parameters (after ``load_state_dict(sd, assign=True)`` or
        ``model.double()``, or another class switched to) takes the place of the watched ones it
        replaces (`_replaced_by`): theirs, which nothing steps now, no longer hold the count back."""
        if not self._open("hunt.add_optimizer()"):
            return
        (opt,) = _optimizers(optimizer)
        stale = self._replaced_by(opt)
        self._add_optimizer(optimizer)
        for i in stale:
            self._retire(i, opt)

    def _replaced_by(self, opt: torch.optim.Optimizer) -> list[int]:
        """The watched optimizers ``opt`` replaces: all of them, when it holds the model's
        parameters and, of the model's parameters, each of them holds only ones ``opt`` holds too,
        in groups of its own (built again after ``load_state_dict(sd, assign=True)``: none of them
        the model's any more; after ``model.double()``, a head replaced, or another class switched
        to); else none. (A wrapper that steps a watched optimizer shares its param_groups: never a
        replacement; an optimizer of other parameters of the model, next to them: none either.)"""
        root = self._root
        live = [i for i, o in enumerate(self._opts) if i not in self._retired and o is not opt]
        if not live or root is None or not _first_held(root, opt):
            return []
        groups = opt.param_groups
        mine = {id(p) for g in groups for p in g["params"]}
        model = {id(p) for p in _params_of(root)}
        for i in live:
            o = self._opts[i]
            if o.param_groups is groups or any(g is h for g in o.param_groups for h in groups) or not all(
                    id(p) in mine or id(p) not in model for g in o.param_groups for p in g["params"]):
                return []
        return live

    def _retire(self, i: int, new: torch.optim.Optimizer) -> None:
        """Watched optimizer ``i`` was replaced by one just added (`_replaced_by`): its hooks come
        off, and a round of steps no longer waits for it (`_count_step`)."""
        old = self._opts[i]
        dicts = (old._optimizer_step_pre_hooks, old._optimizer_step_post_hooks,
                 old._optimizer_load_state_dict_post_hooks)
        for h in [h for h in self._handles if getattr(h, "hooks_dict_ref", lambda: None)() in dicts]:
            h.remove()
            self._handles.remove(h)
        self._retired.add(i)
        self._round.discard(i)
        _logger.info("nanhunt: the watched %s is replaced by the %s built over the model's parameters since; "
                     "its steps count from here", type(old).__name__, type(new).__name__)

    def _add_optimizer(self, optimizer: Any) -> None:
        """Watch ``optimizer`` as given: a wrapper (Lookahead) through the torch optimizer it steps."""
        (opt,) = _optimizers(optimizer)
        if any(o is opt for o in self._opts) or any(o is opt for o in self._later):
            return
        if id(opt) in _IN_HOOKS:
            # torch is running this optimizer's step hooks (an on_find that opens a hunt): a hook
            # added now would change the dict it iterates; added at the model's next call instead
            self._later.append(opt)
            return
        i = len(self._opts)
        self._opts.append(opt)
        self._oprobes.append(OptimizerProbe(opt))
        self._handles.append(opt.register_step_pre_hook(partial(self._pre_step, i)))
        self._handles.append(opt.register_step_post_hook(partial(self._post_step, i)))
        self._handles.append(opt.register_load_state_dict_post_hook(partial(self._on_load, i)))
        if opt is not optimizer:  # a wrapper steps it (Lookahead): the wrapper's own writes after its step() are part of the step
            self._handles.append(_WrapperStep.join(optimizer, self))

    def add_scaler(self, scaler: Any) -> bool:
        """Watch ``scaler``'s steps as ``watch(scaler=...)`` does (``nanhunt run`` finds a script's
        GradScaler at its first ``step()``); False if the hunt is closed or has a scaler already."""
        if self._closed or self._scaler is not None:
            return False
        self._scaler = scaler
        self._wrap_scaler(scaler)
        return True

    def _on_load(self, i: int, opt: torch.optim.Optimizer) -> None:
        """Optimizer ``i`` loaded a state dict: its next update is probed before and after (see
        `_params_before`), so that a state loaded non-finite is not taken as made by the update."""
        self._loaded.add(i)

    def check(self, tensor: torch.Tensor, name: str = "check") -> torch.Tensor:
        """Check a tensor computed outside any module (the loss). Returns it unchanged."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hunt.check() needs a torch.Tensor, got {type(tensor).__name__} for {name!r}")
        if not isinstance(name, str):
            raise TypeError(f"hunt.check() name must be a str, got {type(name).__name__}")
        if self._closed and not self._open("hunt.check()"):
            return tensor
        with _NO_TORCH_FUNCTION():  # (the loss-code recorder, on here, need not see these reads: ~3 us each)
            skip = (self._paused or (REPLAYING and get_ident() in REPLAYING) or not is_checked(tensor)
                    or _is_wrapped(tensor) or tensor.is_meta)  # (meta: a shape-only placeholder of a dry run, no values)
        if skip:
            return tensor
        if _get_ident() != self._owner and not self._take_step():
            return tensor  # another thread owns the step
        if self._evbuf and self._inner == _get_ident():  # (a check inside a forward: after the calls before it)
            self._flush()
        try:
            # (nanhunt's own reads: no torch function mode sees them, the loss-code recorder and a
            # user's tensor subclass neither; a C-level guard, where taking the recorder off the
            # mode stack and putting it back cost ~15 us a check)
            with _NO_TORCH_FUNCTION():
                log = self._log
                log.sums.append(probe(tensor))
                log.meta.append(Chk(name, tensor.detach()))
                if self._grad_hooks and tensor.requires_grad and torch.is_grad_enabled():
                    k = self._key(tensor)
                    log.tensors[k].consumers.append((-1, (name,)))
        except Exception as exc:
            self._fault(exc, "check()")
        return tensor

    def close(self, *, raise_pending: bool = True) -> None:
        """Stop watching; idempotent. Nothing of the hunt stays behind (hooks, references).

        In raise mode a finding still pending (made at this last sync) raises `NonFiniteError`,
        unless ``raise_pending=False``: then it is only recorded, and no collective is issued
        (for a run that is already leaving: integrations, exceptions).
        """
        self._close(raise_pending=raise_pending)

    def __enter__(self) -> Hunt:
        if self._open("`with hunt:`"):
            self._depth += 1  # (`with hunt:` inside `with hunt:`: the outer block closes it)
        return self

    def _open(self, what: str) -> bool:
        """Is the hunt open? A hunt closed by ``close()`` says so (RuntimeError); one that switched
        itself off after an internal fault answers False: the run goes on unwatched, silently."""
        if self._closed:
            if self._faulted:
                return False
            raise RuntimeError(f"{what} on a closed nanhunt hunt: close() ended it (its findings and report "
                               "stay readable); start a new one with nanhunt.watch()")
        return True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._depth -= 1
        if self._depth > 0 and not self._closed:
            return  # an inner `with hunt:` ends; the hunt goes on watching the outer block
        before = len(self.findings)
        if isinstance(exc, Exception) and not isinstance(exc, NonFiniteError):
            self._probe_unjudged_outputs()
        self._close(raise_pending=exc_type is None)
        if (isinstance(exc, Exception) and not isinstance(exc, NonFiniteError) and len(self.findings) > before
                and self.on_find in ("raise", "skip", "breakpoint")):
            # the block left by an error of its own (clip_grad_norm_(error_if_nonfinite=True), an
            # assert on the loss) before the step ended: the finding this close made is not raised
            # over it, but the traceback the user reads carries it
            try:
                exc.add_note("nanhunt: " + paragraph(self.findings[0], first=before == 0))
            except Exception:  # (an exception type that refuses attributes)
                pass

    def _probe_unjudged_outputs(self) -> None:
        """Sentinel, the block left by an error of the user's own before the step ended (a
        torch.distributions argument check on a NaN scale, an assert on the outputs): the gradients
        that would judge what the step's training calls returned never came, so their outputs still
        alive are probed now, once, for the step's end at close()."""
        if self._per_module or self._closed:
            return  # (full mode probed every output as it was made)
        try:
            log = self._log
            for c in log.calls:
                if c.depth == 0 and c.out_keys and not c.outs:  # (a training call: only its 0-dim outputs probed)
                    items = [(path, t) for k, path in c.out_keys if (t := log.tensors[k].ref()) is not None]
                    self._probe_root_outputs(log, c, items)
        except Exception as exc:
            self._fault(exc, "close()")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "watching"
        return f"<nanhunt.Hunt {state} step={self.step} findings={len(self.findings)}>"

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_COPY)

    def __copy__(self) -> Any:
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPY)

    # ------------------------------------------------------------------ hooks
    # The name map: id(module) -> (qualified name, weak reference), built lazily on the first call
    # and again after a watched module gains or swaps a child (torch's global module registration
    # hook tells us); it keeps no module alive. The weak reference tells a module apart from a
    # dead one whose id was reused.
    def _build_names(self) -> dict[int, tuple[str, Any]]:
        root = self._root
        names: dict[int, tuple[str, Any]] = {}
        ignored: set[int] = set()
        if root is not None:
            for n, m in root.named_modules(remove_duplicate=False):
                if id(m) not in names:
                    names[id(m)] = (n, weakref.ref(m))
                    if any(fnmatch.fnmatchcase(n, p) for p in self._ignore):
                        ignored.add(id(m))
        self._names = names
        self._ignored = ignored
        if self._backup is not None:  # (a module swapped in since: its buffers go back too)
            self._backup.regroup()
        self._defer.clear()  # ids are of live modules only from here on
        self._eager.clear()
        self._lean = not (self._ignored or self._grad_hooks)  # see _done
        if self._compiled is not None:
            self._compiled_names()
        if self._per_module:
            self._catch_compiled_parts()
            self._wrap(names)
        return names

    def _wrap(self, names: dict[int, tuple[str, Any]]) -> None:
        """Full mode: a `Forward` on every watched module, unless some part of the model runs
        compiled (its hooks are traced into its graph: that path stays as it was)."""
        mods = [m for _, r in names.values() if (m := r()) is not None]
        self._fwd_ok = None
        if (self._compiled is not None or self._cparts or self._root is None or any(
                type(m).__name__ == "OptimizedModule" or isinstance(m, torch.jit.ScriptModule)
                or getattr(m, "_compiled_call_impl", None) is not None for m in mods)):
            for old in self._fwds.values():  # (put on before the model turned out to run compiled)
                remove(old)
            self._fwds.clear()
            return  # (a scripted part: its forward is TorchScript's; the hooks see its call)
        ws = []
        fwds = self._fwds
        for m in mods:
            w = fwds.get(id(m))
            if w is None or w.ref() is not m:
                if w is not None:  # (a module gone, its id now another's)
                    remove(w)
                fwds[id(m)] = w = install(self, m)
            ws.append(w)
        self._fwd_ok = ws
        # the containers' children as the map was built (`_wrapped`; a leaf gains a child only
        # through torch's registration hook)
        self._kids = [(m.__dict__, m._modules, len(m._modules)) for m in mods
                      if m._modules or isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))]
        self._lean_flags()

    def _wrapped(self) -> bool:
        """Is every watched module's ``forward`` still its `Forward` (none replaced since, none
        compiled in place since)? Checked as each top-level call begins (~0.1 us a module). A
        module whose children changed without torch's registration hook (``del seq[1]``,
        ``seq.pop(1)``: a renumbered ``_modules``; ``ModuleList.insert``, ``del mdict[k]``: one
        written in place) drops the name map, as `_on_register` does: rebuilt at the next call,
        with a `Forward` on a module inserted so, this call seen by the hooks."""
        ws = self._fwd_ok
        if ws is None:
            return False
        for w in ws:
            m = w.ref()
            if m is None:
                continue
            d = m.__dict__
            if d.get("forward") is not w or d.get("_compiled_call_impl") is not None:
                return False
        for d, kids, n in self._kids:
            if d.get("_modules") is not kids or len(kids) != n:
                self._names = None
                return False
        return True

    def _enter(self, w: Forward) -> bool:
        """The forward of the top-level call just begun (`_arm`) is starting: take the global hooks
        off, so that the calls inside are seen by their wrappers (`_push`), when everything allows
        it (True: `_leave` puts them back as that forward returns). Only the step's thread: a
        call of the model from another thread meanwhile leaves the arm to it."""
        if _get_ident() != self._owner:
            return False
        c, self._arm = self._arm, None
        hooks = self._global
        try:
            stack = self._stack
            if (hooks is not None and len(stack) == 1 and stack[0] is c and c is not None and c.module is w.ref()
                    and not self._paused and self._names is not None and self._wrapped() and hooks.off()):
                self._inner = _get_ident()
                self._ev = self._evbuf if self._lean else None  # (not with grad_hooks: mode="ops" has them)
                return True
        except Exception as exc:
            self._fault(exc, "the forward pre-hook")
        return False

    def _stale(self, c: Call) -> bool:
        """``c`` is not a call of the step's log: another thread's, pushed as the step was taken
        from it and its log ended (`_detach`: its hook had passed the owner test just before)."""
        calls = self._log.calls
        return c.index >= len(calls) or calls[c.index] is not c

    def _detach(self) -> None:
        """The stepping thread takes the step while another thread's top-level call runs with the
        global hooks off (that thread owned the step: its call began before the first ``step()``):
        the call's recording ends here. Its wrappers stop recording (`_inner`), what its lean calls
        still note goes into a list of their own, the hooks go back on; the step's end drops its
        calls from the stack. (The other thread's `_leave` and `_push` then do nothing.)"""
        self._inner = 0
        self._ev = None
        self._evbuf = []
        if self._global is not None:
            self._global.on()

    def _leave(self) -> None:
        if self._inner != _get_ident():
            return  # the step was taken from this thread meanwhile (`_detach`), or a child registered
            # during the call ended the wrappers' part already (`_on_register`)
        if self._evbuf:
            self._flush()
        self._ev = None
        self._inner = 0
        if self._global is not None:
            self._global.on()  # before torch runs the top-level call's forward hooks: `_post` records it

    def _push(self, m: nn.Module, args: tuple[Any, ...]) -> Call | None:
        """Watched module ``m`` called inside a top-level call that runs with the hooks off: what
        the global pre-hook would do (`_pre`), the common call inlined. The `Call` pushed, which
        its `Forward` pops and ends (`_done_safe`), or None (then `_post` ends it, as the global
        hook would)."""
        if self._owner != _get_ident():
            return None  # the step was taken from this thread meanwhile (`_detach`): not recorded
        if self._evbuf:  # (what the lean path noted comes first)
            self._flush()
        try:
            names = self._names
            stack = self._stack
            if (names is not None and stack and not m._forward_hooks and not self._paused
                    and not REPLAYING and _tracing_state() is None and not in_transform()):
                e = names.get(id(m))
                if e is not None and e[1]() is m:
                    p = stack[-1]
                    calls = self._log.calls
                    i = len(calls)
                    c = Call(m, e[0], -1, p.depth + 1, p.index, p.top, i - stack[0].index, i)
                    calls.append(c)
                    stack.append(c)
                    return c
        except Exception as exc:
            self._fault(exc, "the forward pre-hook")
            return None
        self._pre(m, args)
        return None

    def _flush(self) -> None:
        """Record the calls that `Forward` wrappers only noted on their lean path (the wrapper as
        the call began, then its output and the output's version as it returned), in order, as
        `_push` and `_done` record a call: at the top-level call's return, and before anything
        else touches the stack or the step's entries (a call that is not lean, ``hunt.check``, a
        gradient hook, an exception, the step's end). Only on the thread that noted them."""
        ev = self._evbuf
        if not ev:
            return
        try:
            stack = self._stack
            log = self._log
            calls, sums, meta, seen, defer = log.calls, log.sums, log.meta, log.probed, self._defer
            stats = self._stats_on
            first = stack[0].index if stack else 0
            i, n = 0, len(ev)
            while i < n and stack:
                x = ev[i]
                if type(x) is Forward:  # a call began
                    p = stack[-1]
                    k = len(calls)
                    c = Call(x.ref(), x.name, -1, p.depth + 1, p.index, p.top, k - first, k)  # type: ignore[arg-type]  # (alive: it was called)
                    calls.append(c)
                    stack.append(c)
                    i += 1
                    continue
                if len(stack) < 2:
                    break  # (the step ended inside the top-level call: a sync from another thread)
                # it returned: its output and that output's version then
                c = stack.pop()
                m = c.module
                v = ev[i + 1]
                i += 2
                if stats:  # a sampled step: each call's statistics too (see `_lean_flags`)
                    self._done_tensor(c, m, x, v)
                    continue
                if type(m) in _PASSTHROUGH:
                    continue  # (not probed: see _PASSTHROUGH)
                mid = id(m)
                if (x.dtype is _F32 and v >= 0 and mid in defer and 0 < x.numel() <= _LAZY_NUMEL
                        and not x.is_meta):  # `_done_tensor`'s deferred probe, inlined (its checks cost 0.27 M instructions a step)
                    key = (id(x), v)
                    ref = seen.get(key)
                    if ref is not None and ref() is x:
                        continue  # handed on unchanged from a call already probed (containers, wrappers)
                    seen[key] = ref = _weakref(x)
                    k = c.index
                    log.lazy.append((x, v, len(sums), mid))
                    sums.append(None)
                    meta.append(_FWD0[k] if k < len(_FWD0) else _fwd0(k))
                    c.paths = _ONE_PATH
                    c.outs = ((ref, v),)
                    if len(log.lazy) >= _LAZY_CAP:
                        self._resolve(log)
                else:
                    self._done_tensor(c, m, x, v)
        except Exception as exc:
            self._ev = None
            self._fault(exc, "the forward hook")
        finally:
            ev.clear()

    def _lean_flags(self, changed: Any = None) -> None:
        """Which wrappers take the lean path: those of modules deferred (seen never to write their
        output after returning) and of passthrough modules (whose outputs are not probed), but on
        a sampled step (`_stats_on`) only deferred ones: a passthrough output's statistics are
        read as it returns unless it is known never to be written after that."""
        fwds, names, defer = self._fwds, self._names, self._defer
        if names is None:
            return
        loose = not self._stats_on
        for mid in (changed if changed is not None else list(fwds)):
            w = fwds.get(mid)
            if w is None:
                continue
            e = names.get(mid)
            if e is None:  # (a module no longer in the model: the hooks ignore its calls, as they ignore any other)
                w.lean = False
                continue
            m = w.ref()
            w.name = e[0]
            w.lean = m is not None and e[1]() is m and (mid in defer or (loose and type(m) in _PASSTHROUGH))

    def _set_stats_on(self) -> None:
        """Is the step about to begin a sampled one (`stats_every`)? The lean wrappers follow."""
        on = self._per_module and self.history > 0 and self.step % self._stats_every == 0
        if on is not self._stats_on:
            self._stats_on = on
            if self._fwds:
                self._lean_flags()

    def _done_safe(self, c: Call, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
        try:
            self._done(c, module, args, kwargs, output)
        except Exception as exc:
            self._fault(exc, "the forward hook")

    def _compiled_names(self) -> None:
        """torch.compile traces _post_compiled: it looks slots up in a plain dict keyed by module
        (module -> slot of `CompiledChecks`, None when ignored), filled before any trace. Only
        models that run compiled get one; it holds the modules until close() (dynamo's own caches
        hold them too). Called by `_build_names` whenever the name map is (re)built."""
        if self._compiled is not None and self._names is not None:
            # (not a torch.compile wrapper inside the model: net.block = torch.compile(net.block). Its
            # graph runs the module it wraps, and dynamo, tracing this dict, met that module twice)
            self._cnames = self._compiled.assign(
                {m: (None if i in self._ignored or m in self._around else n) for i, (n, r) in self._names.items()
                 if (m := r()) is not None and type(m).__name__ != "OptimizedModule"})
            if self._per_module:
                # a module with forward hooks of the user's: its output is judged as the program
                # sees it, after them (as `_late_post` does eagerly; the global hook runs before
                # them: a hook that cleans a -inf was judged on the raw output, and raised)
                self._clate = {}
                for m in self._cnames:
                    if any(not isinstance(h, _OnModule) for h in m._forward_hooks.values()):
                        self._late_hook(m)
                        self._clate[m] = True

    def _prepare_compiled(self, device: torch.device | None) -> None:
        """The in-graph checks' buffer (on ``device``, else the model's) and its slots."""
        if device is None:
            first = next(self._root.parameters(), None) if self._root is not None else None
            device = first.device if first is not None else torch.device("cpu")
        self._compiled = CompiledChecks(device)
        self._build_names()  # assigns the slots (_compiled_names)

    def _catch_compiled_root(self) -> None:
        """model.compile(): see the top-level call around the compiled call (CompiledRoot)."""
        if self._croot is None and self._root is not None:
            self._croot = CompiledRoot(self._root, self._compiled_begin, self._compiled_end)
            self._handles.append(self._croot)
            self._around_compiled(self._root)

    def _around_compiled(self, module: nn.Module) -> None:
        """``module``'s calls are seen eagerly around its compiled call (a torch.compile wrapper's
        hooks, `CompiledRoot`), and its outputs judged there: its own hooks, which dynamo compiles
        as frames of their own when the call they hook runs untraced (torch's ``_call_impl``),
        write no slot. A slot made the post-hook a graph of its own, guarded on the output's
        shape: every new batch size compiled it again."""
        if module not in self._around:
            self._around[module] = True
            if self._compiled is not None:
                self._compiled_names()  # (before the call's first trace: no recompile)

    def _catch_compiled_parts(self) -> None:
        """Full mode: a watched submodule compiled in place (``model.block.compile()``) runs its
        own hooks traced inside its graph, so no hook saw its call eagerly and the record went on
        without it: a NaN born in it was blamed on the module after it, with no op. Its call is
        seen around the compiled call, as model.compile()'s root is (`CompiledRoot`)."""
        root, names = self._root, self._names
        if root is None or names is None:
            return
        for _, r in names.values():
            m = r()
            if m is None or m is root or getattr(m, "_compiled_call_impl", None) is None:
                continue
            got = self._cparts.get(id(m))
            if got is not None and got.model is m and m.__dict__.get("_compiled_call_impl") is got.call:
                continue
            self._cparts[id(m)] = part = CompiledRoot(m, self._compiled_begin, self._compiled_end)
            # (its slot stays: inside a compiled root its wrapper is traced, its call not seen eagerly)
            self._handles.append(part)

    def _module_names(self) -> dict[nn.Module, str]:
        """The name map with strong keys, for the analysis (on a hit only)."""
        names = self._names if self._names is not None else (self._build_names() if self._root is not None else {})
        out: dict[nn.Module, str] = {}
        for n, r in names.values():
            m = r()
            if m is not None:
                out[m] = n
        return out

    def _hold(self, cls: type) -> None:
        """A hook of ours is on an instance of ``cls``: copies and pickles leave it out (copies.py)."""
        hold(cls)
        self._held.append(cls)

    def module_hook_handles(self) -> list[Any]:
        """The handles of the hooks this hunt put on the user's own modules (`_OnModule`: the
        root's in sentinel mode, the late hooks after the user's forward hooks)."""
        out = []
        for h in (*self._handles, *self._late.values()):
            d = h.hooks_dict_ref() if hasattr(h, "hooks_dict_ref") else None
            if d is not None and isinstance(d.get(h.id), _OnModule):
                out.append(h)
        return out

    def _on_register(self, parent: nn.Module, name: str, sub: Any) -> None:
        """torch's global module registration hook: a watched module gained or swapped a child."""
        names = self._names
        if names is None and self._backup is not None:
            # no name map (sentinel mode keeps none): whose child it is cannot be told, so the
            # buffers to put back are listed again at the next step (in raise/skip mode only, and
            # only after a module was registered somewhere: one walk of the model)
            self._backup.regroup()
        if names is not None and id(parent) in names:
            self._names = None  # rebuilt at the next call
            if self._inner and self._global is not None:  # the new module has no wrapper yet: the hooks see the rest
                if self._evbuf and self._inner == _get_ident():
                    self._flush()
                self._ev = None
                self._inner = 0
                self._global.on()

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if _is_compiling() or self._paused or (REPLAYING and get_ident() in REPLAYING) or _tracing_state() is not None:
            # inside a compiled graph only _post_compiled runs (tested first: a traced read of
            # _paused would guard the graph on it, and the analysis' compiled replay recompile it);
            # a replay is no hunt's program; torch.jit.trace records every op run (the hunt's probes
            # would be recorded into the trace, whose check then fails), also one made inside a step
            return
        try:
            if _get_ident() != self._owner and (not self._ours(module) or not self._take_step()):
                # a module outside the model never takes the step (a worker thread's own model);
                # another thread owns the step (see "Threads"): a module with this hunt's `Forward`
                # is noted there (these hooks may go off during the call: the owner's `_enter`)
                fw = module.__dict__.get("forward")
                if not (type(fw) is Forward and fw.hunt is self):
                    self._foreign_pre(module, args, None)
                return
            if in_transform():
                if not self._stack and self._ours(module):
                    self._log.transformed = True  # (the analysis says why the step's forward was not seen)
                return  # inside torch.func transforms (vmap/grad): not recorded
            names = self._names
            if names is None:
                names = self._build_names()
            e = names.get(id(module))
            stack = self._stack
            if stack and e is not None and not module._forward_hooks and e[1]() is module:
                # the common case, kept short (it runs for every module call): a watched call
                # inside a watched call, no forward hook of the user's on the module
                p = stack[-1]
                calls = self._log.calls
                i = len(calls)
                c = Call(module, e[0], -1, p.depth + 1, p.index, p.top, i - stack[0].index, i)
                calls.append(c)
                stack.append(c)
                return
            self._pre_other(module, args, e)
        except Exception as exc:
            self._fault(exc, "the forward pre-hook")

    def _pre_other(self, module: nn.Module, args: tuple[Any, ...], e: tuple[str, Any] | None) -> None:
        """`_pre` for a top-level call, a torch.compile wrapper, a module with forward hooks."""
        if self._stack and self._stale(self._stack[0]):
            self._stack.clear()
        if not self._stack and _on_meta(module, args):
            # a model run on the meta device (a dry run for shapes or FLOPs) has no values to judge.
            # Nothing is pushed, so every call inside comes here again and stands aside too.
            self._outside.off()
            return
        wrapper = None
        if e is None or e[1]() is not module:
            orig = getattr(module, "_orig_mod", None)  # torch.compile(model): runs here eagerly
            if not isinstance(orig, nn.Module):
                return
            names = self._names or {}
            e = names.get(id(orig))
            if e is None or e[1]() is not orig:
                return
            wrapper, module = module, orig
            self._around_compiled(module)
            self._compiled_buffer(args)
        if not self._stack and _redirected(module):  # (a watched module's top-level call only: never an unwatched one's)
            return  # Lightning's strategies run training_step as the model's forward: its own call of the model is the top
        if module._forward_hooks:  # the user's own forward hooks: probe after them
            self._late_hook(module)
        stack = self._stack
        log = self._log
        if not stack:
            if _graph_task() != -1:
                # a module called by a backward: activation checkpointing recomputing its block
                # (reentrant: in a nested backward; non-reentrant: unpacking a saved tensor). Its
                # forward was recorded when it ran; a replay runs the block itself (`faithful`).
                return
            got = self._begin_top(module, args, cap=True)
            if got is None:  # on_find closed the hunt
                return
            log, t = got
            t.compiled = wrapper  # the compiled configuration: what a verdict replays
            top, parent, depth, first = len(log.tops) - 1, -1, 0, len(log.calls)
        else:
            p = stack[-1]
            top, parent, depth, first = p.top, p.index, p.depth + 1, stack[0].index
        i = len(log.calls)
        c = Call(module, e[0], -1, depth, parent, top, i - first, i)
        log.calls.append(c)
        stack.append(c)
        if not depth and wrapper is None and self._fwd_ok is not None:
            self._arm = c  # its forward, a `Forward`, may take the hooks off (see _enter)

    def _begin_top(self, module: nn.Module, args: tuple[Any, ...], *, cap: bool) -> tuple[StepLog, Top] | None:
        """A top-level call begins (both modes): it may end the previous step (no optimizer: each
        root call is one), settles what earlier calls keep, captures what a restore and a replay
        need, and records its `Top`. ``cap``: end a step that never ends past `_MAX_ENTRIES`.
        None when ``on_find`` closed the hunt meanwhile."""
        self._outside.off()
        self._outside.keep_writes()  # (a skipped hand-written update's writes were dropped until now)
        if self._later:  # optimizers added while torch ran their step hooks (see add_optimizer)
            later, self._later = self._later, []
            for opt in later:
                self.add_optimizer(opt)
        log = self._log
        if module is self._root and not self._opts:
            if log.root_calls:
                self._end_step(advance=True)
                if self._closed:
                    return None
                log = self._log
            log.root_calls += 1
        elif (cap and len(log) > _MAX_ENTRIES and not self.distributed) or (
                module is self._root and self._iteration_over(log)):
            log.cut = module is self._root  # (a root call about to run: see _Ctx.written_after)
            self._end_iteration(log)
            if self._closed:
                return None
            log = self._log
        taken = None
        if log.tops:
            self._resolve(log)
            settle(log)  # what earlier no_grad calls keep (their inputs, once known finite)
        else:  # the step begins
            if self._backup is not None:
                self._backup.capture(self._root)  # type: ignore[arg-type]  # what a restore goes back to
                taken = self._backup.taken()  # ... also what this call starts from
            if self._guard is not None and self._guard.pending:
                self._guard.first_step(self._root)  # type: ignore[arg-type]
            if self._start.pending and self._root is not None:
                self._start.capture(self._root, self._opts)
        if self._batches is not None:
            self._batches.top_started()
        t = _capture_top(module, args)
        if not log.tops and self.on_find == "skip":
            self._step_rng = (self.step, t.rng, t.cuda_rng)
        t.clock = _tick()
        t.outside_at = len(log.outside)
        t.src = user_line()[0]
        if module is self._root and self._names is not None:  # (a replay after model.eval() runs these in their own mode)
            t.odd_modes = self._odd_modes(module)
        self._state.capture(t, taken)
        log.tops.append(t)
        return log, t

    def _end_iteration(self, log: StepLog) -> None:
        """Judge ``log`` (the step's, its iteration over without a ``step()``) now; a skipped one
        still counts."""
        skips = len(self.skipped)
        self._end_step(advance=False)
        if not self._closed and len(self.skipped) > skips and log.backward:
            # an iteration without step() (a GradScaler not given to watch() skipped it) that
            # on_find="skip" dropped: a skipped step still counts, as the user's loop does
            self.step += 1
            self._calls_before = _Counted()

    def _odd_modes(self, root: nn.Module) -> tuple[nn.Module, ...]:
        """The modules whose train/eval mode is not the root's (a BatchNorm frozen in eval): looked
        up again when the root's mode or the name map changed, else the last answer (one pass over
        every module at each step cost ~1 % on the benchmark MLP)."""
        on, names = root.training, self._names
        got = self._odd
        if got is None or got[0] is not on or got[1] is not names:
            odd = tuple(m for _, r in (names or {}).values() if (m := r()) is not None and m.training is not on)
            self._odd = got = (on, names, odd)
        return got[2]

    def _iteration_over(self, log: StepLog) -> bool:
        """The root is called again and what the log holds can be judged now, as the contract
        promises (at the model's next forward at the latest): an evaluation call (no_grad, the
        model in eval mode, no backward since: a validation loop never reaches step(); a no_grad
        pass inside a training step, FixMatch's pseudo-labels, adds no sync), or an iteration
        whose gradients are gone again (`_grads_dropped`)."""
        root = self._root
        if not log.tops or self.distributed or root is None:
            return False
        if not log.backward:  # the last call's own mode: the loop has usually called model.train() again by now
            last = log.tops[-1]
            return not last.grad_enabled and not last.training
        if log.grads_out and not log.seeds:
            return False  # only torch.autograd.grad ran (a gradient penalty): it fills no .grad
        return self._grads_dropped()

    def _grads_dropped(self) -> bool:
        """A backward ran since the last sync and every watched gradient is gone again: the
        iteration ended without a ``step()`` (a GradScaler that was not given to watch() skipped
        it, then ``zero_grad()``), so the root's next call ends the step's check (gradient
        accumulation keeps its gradients: no extra sync there)."""
        if not self._opts:
            return False
        return all(p.grad is None for p in self._opt_params())

    def _opt_params(self) -> Iterator[torch.Tensor]:
        """Every parameter of every watched optimizer, in order."""
        return (p for o in self._opts for g in o.param_groups for p in g["params"])

    # ------------------------------------------------------------------ other threads' calls
    def _foreign_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
        """A watched call from a thread that does not own the step. The first one on that thread
        (its top-level call: an evaluation thread's, a server's concurrent request) is noted on
        its own, outside the step's log, to be judged as it returns (`_foreign_post`). True when
        it was noted. Modules outside the watched model are none of the hunt's."""
        loc = self._foreign
        if getattr(loc, "top", None) is not None or self._paused or self._closed:
            return False
        e = self._entry(module)
        if e is None:
            return False
        if (in_transform() or _graph_task() != -1 or _tracing_state() is not None
                or _on_meta(module, args)):
            return False
        loc.top = (module, e[0], args, kwargs)
        if torch.is_grad_enabled():
            self._log.foreign = True  # (the analysis says why the step's forward was not seen)
        return True

    def _foreign_post(self, module: nn.Module, kwargs: Any, output: Any) -> None:
        """Another thread's top-level call returned (see `_foreign_pre`): its floating outputs
        are read (one host read for the call) and a non-finite one is reported at the current
        step, raised (``on_find="raise"``) in this thread: the call's module, the first non-finite
        element, ``cause="input"`` when an input was already non-finite. It is not replayed: a
        replay runs on the live model and the process's RNG, which the owner thread is using
        meanwhile (its data draws, its train/eval switches, its own replays). Nothing of the
        owner's step is touched: its log, stack and buffers stay as they are."""
        loc = self._foreign
        got = getattr(loc, "top", None)
        if got is None or got[0] is not module:
            return
        loc.top = None
        if self._paused or self._closed or self._known_bad:
            return  # (weights known non-finite: the owner's finding says so, every output is non-finite now)
        _, name, args, given = got
        with _NO_SUBCLASS():
            items = [(p, t) for p, t in tensors(output) if is_checked(t) and t.numel() and not t.is_meta]
            if not items or not any_bad(stack_probes([probe(t) for _, t in items])):
                return
            path, t = next((p, t) for p, t in items if is_bad(t))
            fed = any(is_checked(x) and x.numel() and not x.is_meta and is_bad(x)
                      for _, x in tensors((args, given if given is not None else kwargs)))
            index, value, counts = element(t)
            f = Finding(
                phase="forward", module=name, module_type=type(module).__name__,
                tensor=format_path("output", path), step=self.step, call=0, index=index, value=value,
                counts=counts, shape=shape_of(t), dtype=dtype_name(t), cause="input" if fed else "unknown",
                source=user_line()[0],
                hint=("made in a call from another thread than the step's (the one that steps the "
                      "optimizer, or the current root call's): judged as it returned, not replayed "
                      "(the model is in use by the step's thread), so the module named is the call's "
                      "own, not where inside it the value was born"),
            )
        self._handle([f], True, evaluation=True, foreign=True)

    def _foreign_call(self, w: Forward, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A `Forward` called from another thread while the owner's top-level call runs with the
        global hooks off: what `_pre` and `_post` would do for it (`_foreign_pre`, `_foreign_post`)."""
        try:
            mine = self._foreign_pre(module, args, kwargs)
        except Exception as exc:
            self._fault(exc, "the forward pre-hook")
            mine = False
        try:
            out = w.run(args, kwargs)
        except BaseException:
            if mine:
                self._foreign.top = None
            raise
        if mine:
            try:
                self._foreign_post(module, kwargs, out)
            except Exception as exc:
                self._fault(exc, "the forward hook")
        return out

    def _entry(self, module: nn.Module) -> tuple[str, Any] | None:
        """``module``'s entry in the name map (qualified name, weak reference), or None."""
        names = self._names if self._names is not None else self._build_names()
        e = names.get(id(module))
        return e if e is not None and e[1]() is module else None

    def _ours(self, module: nn.Module) -> bool:
        """``module`` is one of the watched model's (or a torch.compile wrapper of one)."""
        if self._entry(module) is not None:
            return True
        orig = getattr(module, "_orig_mod", None)
        return isinstance(orig, nn.Module) and self._ours(orig)

    def _take_step(self) -> bool:
        """Threads: the calling thread owns the step if nobody does (rare: once per step), or if
        the thread that owned it has ended (training went on in a new thread: a restarted worker)."""
        if getattr(self._foreign, "top", None) is not None:
            return False  # this thread's own call began as another thread's: its inner calls stay that call's
        if (self._opts and not self._steps_applied and not torch.is_grad_enabled()
                and threading.current_thread() is not threading.main_thread()):
            # an evaluation thread's call before the first step(): the step is the training
            # thread's to take (taken back from a call in flight, its calls could mix into the
            # step's log); its calls are judged on their own meanwhile (`_foreign_pre`)
            return False
        with self._owner_lock:
            owner, thread = self._owner, self._owner_thread
            if owner is None or (thread.ident == owner and not thread.is_alive()):
                self._owner = _get_ident()
                self._owner_thread = threading.current_thread()
                return True
            return False

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO) -> None:
        if _is_compiling():
            self._post_compiled(module, output)
            return
        if self._evbuf and self._inner == _get_ident():  # (what the lean path noted comes first)
            self._flush()
        if output is _NO:  # the always-call path after an exception: (module, args, result)
            # torch runs it while iterating its live dict of global forward hooks: the recorder's
            # own global hooks (`Outside.on`) must not go in now (another hunt's or the user's hook
            # after ours: "OrderedDict mutated during iteration" in place of the user's exception)
            self._outside.held = True
            try:
                self._post(module, args, {}, kwargs)
            finally:
                self._outside.held = False
            return
        try:
            if _get_ident() != self._owner:
                if not (REPLAYING and get_ident() in REPLAYING):
                    self._foreign_post(module, kwargs, output)
                return
            stack = self._stack
            if not stack or self._paused or (REPLAYING and get_ident() in REPLAYING):
                return
            c = stack[-1]
            if c.module is not module:
                module = getattr(module, "_orig_mod", module)  # torch.compile(model)'s wrapper
                if c.module is not module:
                    if not any(x.module is module for x in stack):
                        return
                    while stack[-1].module is not module:  # a child raised and was not unwound
                        stack.pop()
            c = stack.pop()
            if not self._stale(c):
                self._done(c, module, args, kwargs, output)
        except Exception as exc:
            self._fault(exc, "the forward hook")

    def _done(self, c: Call, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
        """A watched call ``c`` returned ``output`` (popped off the stack): probe its outputs."""
        if module._forward_hooks and id(module) in self._late:
            self._pending.append(c)  # recorded by _late_post, after the user's hooks ran
            return  # (which also lets go of the step's thread)
        elif c.depth and self._lean and type(output) is torch.Tensor:
            try:
                v = output._version
            except RuntimeError:  # an inference tensor: no version counter
                v = -1
            self._done_tensor(c, module, output, v)
            return
        else:
            self._record(c, module, args, kwargs, output)
        if not self._stack and not self._opts:
            self._owner = None  # no optimizer: each root call is a step; any thread may take the next

    def _done_tensor(self, c: Call, module: nn.Module, output: torch.Tensor, v: int) -> None:
        """`_done`'s common case, kept short: one plain tensor ``output`` (its version ``v`` when
        the call returned) out of a call inside a watched call (no ignored modules, no per-module
        gradient hooks; on sampled steps its heatmap row too)."""
        log = self._log
        i = c.index
        calls = log.calls
        dt = output.dtype
        if i >= len(calls) or calls[i] is not c or dt not in _CHECKED or output.is_meta:
            return  # the step ended inside this call (a sync from another thread); not floating; no values
        key = (id(output), v)
        mid = id(module)
        stat = self._stats_on  # sampled steps: one heatmap row per call
        if type(module) in _PASSTHROUGH:
            if stat:  # (held for the batched statistics only once seen never to be written after it returns)
                lazy = mid in self._defer
                _add_stats(log, c.name, output, key, lazy=lazy)
                if not lazy and mid not in self._eager and dt is _F32 and key[1] >= 0:
                    log.trial.append((output, key[1], mid))
                    if len(log.trial) >= _LAZY_CAP:
                        self._resolve(log)
            return
        seen = log.probed
        ref = seen.get(key)
        if ref is not None and ref() is output:
            if stat:  # a container handing on its child's output keeps its heatmap row: the same numbers
                _add_stats(log, c.name, output, key, handed_on=True)
            return  # handed on unchanged from a call already probed (containers, wrappers)
        seen[key] = ref = _weakref(output)
        sums = log.sums
        small = dt is _F32 and key[1] >= 0 and 0 < output.numel() <= _LAZY_NUMEL
        if stat:
            _add_stats(log, c.name, output, key, lazy=small and mid in self._defer)
        if small and mid in self._defer:  # probed with the others at the top-level call's return
            log.lazy.append((output, key[1], len(sums), mid))
            sums.append(None)
            if len(log.lazy) >= _LAZY_CAP:
                self._resolve(log)
        else:
            grad = _grad_enabled()
            if grad:  # one switch instead of a detach
                _set_grad_enabled(False)
            try:
                sums.append(output.sum() if dt is _F32 else probe(output))
            except NotImplementedError:  # a nested tensor: no plain sum (probe sums its values)
                sums.append(probe(output))
            finally:
                if grad:
                    _set_grad_enabled(True)
            if small and mid not in self._eager:  # on trial: is it written after it returns?
                log.trial.append((output, key[1], mid))
                if len(log.trial) >= _LAZY_CAP:
                    self._resolve(log)
        log.meta.append(_FWD0[i] if i < len(_FWD0) else _fwd0(i))
        c.paths = _ONE_PATH
        c.outs = ((ref, key[1]),)

    def _resolve(self, log: StepLog) -> None:
        """Probe the step's deferred outputs now (`StepLog.resolve`) and learn from the trials:
        a module whose output was never written after its call returned is deferred from now
        on; one whose output was, never again."""
        changed, kept = log.resolve()
        if log.stats_lazy:
            self._resolve_stats(log)
        if changed:
            self._eager.update(changed)
            self._defer.difference_update(changed)
        if kept:
            self._defer.update(m for m in kept if m not in self._eager)
        if (changed or kept) and self._fwds:
            self._lean_flags([*changed, *kept])

    def _resolve_stats(self, log: StepLog) -> None:
        """Sampled steps: the statistics of the outputs held for them, one reduction per shape
        (four per call cost ~20 us each on the CPU: a sampled step cost a third of a step more on
        the benchmark MLP). Only outputs of modules seen never to write theirs after returning are
        held (`_defer`); one written anyway is read as it is now (as its deferred probe is)."""
        lazy, log.stats_lazy = log.stats_lazy, []
        groups: dict[Any, tuple[list[int], list[torch.Tensor]]] = {}
        rows = log.stats
        cut = grain()
        for t, ver, row in lazy:
            if t._version != ver:
                rows[row] = stats(t)
                continue
            add_to_group(groups, t, row, cut)
        for at, ts in groups.values():
            try:
                got = stats_of_rows(ts)
            except RuntimeError:  # on several devices
                got = [stats(t) for t in ts]
            for row, st in zip(at, got):
                rows[row] = st

    def _late_hook(self, module: nn.Module) -> None:
        """Make sure our per-module forward hook runs after every forward hook the user added."""
        hooks = module._forward_hooks  # an OrderedDict
        h = self._late.get(id(module))
        if h is None:
            h = module.register_forward_hook(_OnModule(self, "_late_post"), with_kwargs=True, always_call=True)
            self._late[id(module)] = h
            self._hold(type(module))
        elif next(reversed(hooks)) != h.id:
            hooks.move_to_end(h.id)  # type: ignore[attr-defined]

    def _late_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO) -> None:
        if _is_compiling():
            self._post_compiled(module, kwargs if output is _NO else output, late=True)
            return
        if self._evbuf and self._inner == _get_ident():  # (a user's hook that called watched modules)
            self._flush()
        try:
            if output is _NO:
                output, kwargs = kwargs, {}
            pending = self._pending
            if pending and pending[-1].module is module:
                c = pending.pop()
                if _get_ident() == self._owner:
                    if not self._paused:
                        self._record(c, module, args, kwargs, output)
                    if not self._stack and not self._opts:
                        self._owner = None  # as `_post`: each root call is a step; any thread may take the next
        except Exception as exc:
            self._fault(exc, "the forward hook")

    def _record(self, c: Call, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
        """Probe the outputs of the watched call ``c`` (the hot path's main cost). A tensor
        subclass's ``__torch_function__`` never sees these reads (they never end a step)."""
        if type(output) is torch.Tensor:
            self._record_body(c, module, args, kwargs, output)
        else:
            with _NO_SUBCLASS():
                self._record_body(c, module, args, kwargs, output)

    def _record_body(self, c: Call, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
        log = self._log
        if c.index >= len(log.calls) or log.calls[c.index] is not c:
            return  # the step ended inside this call (a sync from another thread)
        ci = c.index
        stats_on = self._stats_on
        if c.depth and type(module) in _PASSTHROUGH and not module._forward_hooks:  # (a user's hook may make new values)
            items: Any = ()
            if stats_on and isinstance(output, torch.Tensor) and is_checked(output):
                _add_stats(log, c.name, output, (id(output), version(output)))  # sampled steps: the heatmap stays whole
        else:
            items = (((), output),) if isinstance(output, torch.Tensor) else tensors(output)
        ignored = self._ignored
        skip = id(module) in ignored if ignored else False
        paths: list[Path] = []
        outs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        c.paths, c.outs = paths, outs
        sums, meta, seen = log.sums, log.meta, log.probed
        grad = _grad_enabled()
        if grad:  # one switch for the call instead of a detach per probe
            _set_grad_enabled(False)
        stat = stats_on  # sampled steps: statistics of the call's first floating output
        try:
            for path, t in items:
                if not (t.is_floating_point() or t.is_complex()) or t.is_meta:
                    continue
                key = (id(t), -1 if t.is_inference() else t._version)
                if ignored:
                    if skip:
                        log.ignored[key] = weakref.ref(t)
                        continue
                    if log.is_ignored(t):
                        continue
                ref = seen.get(key)
                if ref is not None and ref() is t:
                    if stat:  # a container handing on its child's output keeps its heatmap row: the same numbers
                        stat = False
                        _add_stats(log, c.name, t, key, handed_on=True)
                    continue  # handed on unchanged from a call already probed (containers, wrappers)
                ref = weakref.ref(t)
                seen[key] = ref
                sums.append(t.sum() if t.dtype is _F32 and type(t) is torch.Tensor and not t.is_nested
                            else probe(t))  # DTensor, nested & co: probe
                meta.append(Fwd(ci, len(paths)))
                if stat:
                    stat = False
                    _add_stats(log, c.name, t, key)
                paths.append(path)
                outs.append((ref, key[1]))
        finally:
            if grad:
                _set_grad_enabled(True)
        depth = c.depth
        if not depth:
            self._resolve(log)  # the call's deferred probes
            top = log.tops[c.top]
            top.kwargs = kwargs
        if not grad:
            if not depth:
                self._outside.on()
            return
        out_keys: list[tuple[int, Path]] = []
        in_keys: list[tuple[int, Path]] = []
        c.out_keys, c.in_keys = out_keys, in_keys
        if self._grad_hooks:  # always-on per-module backward checks (opt-in; replay does it otherwise)
            for path, t in tensors(output):
                if t.requires_grad and is_checked(t):
                    k = self._key(t)
                    log.tensors[k].producers.append((ci, path))
                    out_keys.append((k, path))
            for path, t in tensors((args, kwargs)):
                if t.requires_grad and is_checked(t):
                    k = self._key(t)
                    log.tensors[k].consumers.append((ci, path))
                    in_keys.append((k, path))
        if not depth:  # the gradients arriving at the model's outputs: what a backward replay needs
            if not self._grad_hooks:
                for path, t in tensors(output):
                    if t.requires_grad and is_checked(t):
                        k = self._key(t)
                        log.tensors[k].producers.append((ci, path))
                        out_keys.append((k, path))
            top.out_keys = [k for k, _ in out_keys]
            for k in top.out_keys:
                log.tensors[k].keep_grad = True
            self._outside.on()

    # torch.compile: traced into the graph; see _compiled (no list, no branch: no graph break)
    def _post_compiled(self, module: nn.Module, output: Any, late: bool = False) -> None:
        slots, comp = self._cnames, self._compiled
        if comp is None:
            names = self._names
            if names is None or id(module) in names:  # (not another module's call traced into a graph: a loss
                # module's, dynamo's own wrapper of a custom backend's graph: dropping every graph for it recompiled them)
                self._traced = True  # compiled without slots to write into (compiled after watch()): see _after_trace
            return
        if slots is None:  # (no _paused here: a guard on it would recompile the graph for the analysis'
            return  # compiled replay, whose writes into the slots are put back anyway: graph.guarded)
        slot = slots.get(module)
        if slot is None or (not late and module in self._clate):
            return  # (ignored; or judged after the user's hooks: `_late_post`)
        comp.record(slot, output)

    def _compiled_buffer(self, args: tuple[Any, ...]) -> None:
        if self._compiled is None:
            self._prepare_compiled(next((t.device for _, t in tensors(args)), torch.device("cpu")))

    def _key(self, t: torch.Tensor) -> int:
        """Index of ``t`` in this step's tensors, registering its gradient hook on first sight."""
        log = self._log
        k = (id(t), t._version)
        i = log.keys.get(k)
        if i is not None and log.tensors[i].ref() is t:
            return i
        i = len(log.tensors)
        info = TensorInfo()
        info.ref = weakref.ref(t)
        log.tensors.append(info)
        log.keys[k] = i
        log.handles.append(t.register_hook(partial(self._on_grad, log, i)))
        return i

    def _on_grad(self, log: StepLog, i: int, g: torch.Tensor | None) -> None:
        if self._evbuf and self._inner == _get_ident():  # (a backward inside a forward: after the calls before it)
            self._flush()
        try:
            if (g is None or log is not self._log or self._paused or not is_checked(g) or _is_wrapped(g)
                    or (REPLAYING and get_ident() in REPLAYING)):
                return
            log.sums.append(probe(g))
            log.meta.append(Bwd(i))
            log.backward = True
            log.bwd_clock = _tick()  # (the latest backward: what the gradients the step judges came from)
            info = log.tensors[i]
            if info.keep_grad:
                info.grad = g
                info.last = (len(log.tops), len(log.outside))
                if info.arrived is None:  # (the first backward through it: retain_graph may run more)
                    info.arrived = info.last
        except Exception as exc:
            self._fault(exc, "a gradient hook")

    # ------------------------------------------------------------------ internal faults
    def _fault(self, exc: Exception, stage: str) -> None:
        """An exception inside a hook stage: nanhunt's job (a finding in raise mode, the user's
        own ``on_find``) goes on to the user; anything else is an internal fault: logged once,
        the hunt switches itself off, and only raise mode raises (`InternalError`)."""
        if isinstance(exc, (NonFiniteError, _dist.SilentRankError)) or exc is self._user_exc:
            if self._closed:  # (on_find closed us: its error's traceback holds the user's frames, the model)
                self._user_exc = None
            raise exc
        if self._closed:
            return
        if isinstance(exc, IndexError) and self._owner is not None and self._owner != _get_ident():
            # a hook of a thread that owned the step when it began, recording into the log that
            # the stepping thread ended meanwhile (`step()` took the step: `_detach`): the call
            # is none of the step's any more, and the hunt goes on
            _logger.debug("nanhunt: a call's record was cut short as another thread took the step (%s)", stage)
            return
        msg = log_fault(stage, exc)
        self._switch_off()
        if self.on_find == "raise":
            raise InternalError(msg) from exc

    def _switch_off(self) -> None:
        """Close without a last sync, and without anything that could fail the run again."""
        self._closed = True
        self._faulted = True
        self._paused = True
        try:
            self._release()
        except Exception:  # noqa: BLE001  (already switching off after a fault: nothing more to do)
            for h in self._handles:
                try:
                    h.remove()
                except Exception:  # noqa: BLE001, S110
                    pass
            self._handles.clear()
        finally:
            self._paused = False

    def _join(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        """A call the hunt's own pre-hook did not see (one already under way when this hunt started:
        ``nanhunt run`` discovers roots from inside their first call; model.compile()'s, whose
        hooks are traced): record it as if the pre-hook had seen it."""
        if self._per_module:
            self._pre(module, args)
        else:
            self._root_pre(module, args, kwargs or {})

    # sentinel mode: only the root's calls are recorded, for the replay
    def _root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _is_compiling():  # traced into a compiled graph: nothing to record there (no graph break)
            self._traced = True  # see _catch_wrapper
            return
        if self._paused or (REPLAYING and get_ident() in REPLAYING) or _tracing_state() is not None:
            return  # (torch.jit.trace records every op run: the hunt's own would be recorded into the trace)
        try:
            if _get_ident() != self._owner and (self._stack or not self._take_step()):
                self._foreign_pre(module, args, kwargs)  # another thread owns the step (see "Threads")
                return
            if self._stack:
                return
            if in_transform() or _graph_task() != -1:
                if in_transform():
                    self._log.transformed = True  # (the analysis says why the step's forward was not seen)
                return  # inside torch.func transforms, or recomputed by a backward (checkpointing): not recorded
            if _redirected(module, through=False):
                return  # (as in _pre_other; a wrapper's call stays the top: sentinel hooks nothing inside it)
            if _on_meta(module, args):
                self._outside.off()  # a dry run on the meta device: no values to judge (as in _pre_other)
                return
            got = self._begin_top(module, args, cap=False)
            if got is None:  # on_find closed the hunt
                return
            log, top = got
            top.kwargs = kwargs
            c = Call(module, "", -1, 0, -1, len(log.tops) - 1, 0, len(log.calls))
            log.calls.append(c)
            self._stack.append(c)
        except Exception as exc:
            self._fault(exc, "the forward pre-hook")

    # model.compile(): the top-level call seen around the compiled call (see CompiledRoot)
    def _compiled_begin(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], compiled: Any) -> None:
        self._join(model, args, kwargs)
        stack = self._stack
        if stack and stack[-1].module is model and stack[-1].depth == 0:
            self._log.tops[stack[-1].top].compiled = compiled  # what a verdict replays

    def _compiled_end(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._per_module:
            self._post(model, args, kwargs, output)
        else:
            self._root_post(model, args, kwargs, output)

    # Sentinel under torch.compile(model): the root's own hooks are traced into the graph, so the
    # top-level call is seen from the compiled wrapper's call instead, which runs eagerly. Global
    # hooks for that are added at the first step end after a trace (before: no cost at all; dynamo
    # then traces the graph once more, as global hooks are part of its guards); they act only for
    # a wrapper of the root, and every other eager call pays torch's hook dispatch. (model.compile()
    # is caught by CompiledRoot from the start.)
    def _after_trace(self) -> None:
        """At a step's end after our hooks were traced into a graph the hunt had not prepared for
        (the model compiled after watch(), a compiled function that calls it, sentinel under
        torch.compile(model)): catch model.compile()'s top-level call from now on; full mode makes
        its in-graph slots and has dynamo trace again (once) so the graphs write into them;
        sentinel catches a torch.compile wrapper's calls."""
        self._traced = False
        root = self._root
        if root is None:
            return
        if getattr(root, "_compiled_call_impl", None) is not None:
            self._catch_compiled_root()
        if not self._per_module:
            self._catch_wrapper()
            return
        self._catch_compiled_parts()  # (a part compiled after the name map was built)
        if self._compiled is None:
            self._prepare_compiled(None)
            forget_compiled()

    def _catch_wrapper(self) -> None:
        if self._wrappers is None and self._root is not None:
            self._wrappers = GlobalHooks(self._wrapper_pre, self._wrapper_post)
            self._handles.append(self._wrappers)

    def _wrapper_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if getattr(module, "_orig_mod", None) is self._root and self._root is not None and not _is_compiling():
            self._root_pre(self._root, args, {})
            if self._stack and self._stack[-1].module is self._root:
                self._log.tops[self._stack[-1].top].compiled = module  # what a verdict replays

    def _wrapper_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO) -> None:
        if getattr(module, "_orig_mod", None) is self._root and self._root is not None and not _is_compiling():
            if output is _NO:
                output, kwargs = kwargs, {}
            if self._stack and self._stack[-1].module is self._root:
                self._log.tops[self._stack[-1].top].kwargs = kwargs
            self._root_post(self._root, args, kwargs, output)

    def _root_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO) -> None:
        if _is_compiling():
            return
        try:
            if output is _NO:
                output, kwargs = kwargs, {}
            if (REPLAYING and get_ident() in REPLAYING) or _tracing_state() is not None:
                return
            if self._stack and self._stack[-1].module is module and _get_ident() == self._owner:
                c = self._stack.pop()
                log = self._log
                # no optimizer (inference), or a call without gradients (a validation batch, a
                # pseudo-label pass in training: what it returns never reaches a gradient): the
                # outputs are what there is to judge
                with _NO_SUBCLASS():  # nanhunt's reads: never through the user's tensor subclass
                    if c.index < len(log.calls) and log.calls[c.index] is c:
                        items = list(tensors(output))
                        grad = torch.is_grad_enabled()
                        # with gradients, only a 0-dim output (a loss the model computes itself, as
                        # Hugging Face models do from labels=): its gradient may be finite while it is
                        # not (a mean over zero tokens: 0/0, with zero gradients)
                        self._probe_root_outputs(log, c, items, scalars=bool(self._opts) and grad)
                    else:
                        grad, items = False, []
                    if grad:
                        top = log.tops[c.top]  # for a backward replay: the gradients arriving at the output
                        c.out_keys = out_keys = []
                        for path, t in items:
                            if t.requires_grad and is_checked(t):
                                k = self._key(t)
                                log.tensors[k].keep_grad = True
                                top.out_keys.append(k)
                                out_keys.append((k, path))
                if not self._stack and not self._opts:
                    self._owner = None
                if not self._paused:
                    self._outside.on()
            elif _get_ident() != self._owner:
                self._foreign_post(module, kwargs, output)
        except Exception as exc:
            self._fault(exc, "the forward hook")

    def _probe_root_outputs(self, log: StepLog, c: Call, items: list[tuple[Path, torch.Tensor]],
                            scalars: bool = False) -> None:
        """Sentinel mode with no optimizer (inference), or a root call without gradients (a
        validation batch, a pseudo-label pass): no gradient will judge what it returned, so the
        root's outputs are probed (one probe each), and a hit is localised by replay.
        ``items``: its output tensors (``tensors(output)``); ``scalars``: only the 0-dim ones (a
        training call: the gradients judge the rest)."""
        paths: list[Path] = []
        outs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        c.paths, c.outs = paths, outs
        for path, t in items:
            if is_checked(t) and t.numel() and (not scalars or not t.dim()):
                log.sums.append(probe(t))
                log.meta.append(Fwd(c.index, len(paths)))
                paths.append(path)
                outs.append((weakref.ref(t), version(t)))

    # ------------------------------------------------------------------ steps
    def _pre_step(self, i: int, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if _is_compiling():
            # a step() dynamo traces (torch.compile(opt.step), a compiled train step): traced, the
            # hook's reads of the hunt's state were guards that changed every step (a recompile each
            # step up to the limit, then eager) and its probes graph breaks; disabled, it runs
            # eagerly at one graph break dynamo makes cleanly (so do the post- and unwatched hooks)
            return torch._dynamo.disable(self._pre_step)(i, opt, args, kwargs)
        if self._paused:
            return None
        if self._in_on_find == _get_ident():
            # (judged again, it would call the callback again, without end: RecursionError)
            raise RuntimeError(
                "nanhunt: optimizer.step() was called from inside the on_find callback, while nanhunt was "
                "judging a step; step after the callback returns (on_find='skip' drops a non-finite step)")
        self._outside.off()  # the step's end: nanhunt's probes and the optimizer's update are not outside code
        if self._held_ends:  # a wrapper's step() steps again before it returned: the earlier step ended first
            self._end_held()
        self._step_lines[i] = user_line()[0]  # for an optimizer finding: the line of this step() call
        me = _get_ident()
        if self._inner and self._inner != me:
            self._detach()  # another thread's top-level call is in flight (it began before the first step())
        self._owner = me  # the thread that steps the optimizer owns the steps
        self._owner_thread = threading.current_thread()  # (a thread that ended owns nothing: see _take_step)
        # args are (optimizer, *step_args)
        closure = kwargs.get("closure") if kwargs else (args[1] if len(args) > 1 else None)
        if callable(closure):
            # step(closure) (LBFGS, Lightning): forward and backward run inside step(), so the
            # check runs right after the closure, still before the optimizer applies anything.
            self._closure_calls[i] = 0
            self._step_backups.pop(i, None)  # (a step whose closure raised an error of its own)
            if self._backup is not None and moves_in_step(opt):  # raise/skip: see StepBackup
                self._step_backups[i] = StepBackup(opt)
            wrapped = partial(self._closure, i, opt, closure)
            if kwargs and "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._stepping = opt
        _IN_HOOKS[id(opt)] = _IN_HOOKS.get(id(opt), 0) + 1
        try:
            self._check_step(i, opt)
        except NonFiniteError:
            self._abandoned()
            if id(opt) not in _ABANDONING:
                self._others_abandon(opt, args, kwargs)
            raise
        finally:
            _left_hooks(opt)
            self._stepping = None
            if self._deferred:  # on_find closed the hunt: see _release
                _after_pre_hooks(opt, self._deferred, sys.exc_info()[0] is not None)
                self._deferred = []
        return None

    def _unwatched_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer not watched, that holds the model's parameters, is about to step
        (``watch(model)`` in a training loop; or a second optimizer not given to watch()): the log
        is judged now, before the update writes the weights, as a watched optimizer's would be (a
        replay after it would start from the written weights: a NaN fed by the data blamed on the
        parameters), and in raise mode the update never applies a non-finite gradient. The step is
        still counted by the model's calls (the watched optimizers' steps)."""
        if _is_compiling():
            return torch._dynamo.disable(self._unwatched_step)(opt, args, kwargs)  # type: ignore[no-any-return]
        self._steps_seen += 1
        if self._opts:  # (every step of a watched one comes here first: no generator, ~0.2 us)
            if self._dist is not None:
                return  # (under torch.distributed a step is judged at a watched optimizer's, which every rank runs)
            for o in self._opts:
                if o is opt:
                    return
            for o in self._later:
                if o is opt:
                    return
        if self._paused or self._closed or self._stack or not self._log.tops or (
                REPLAYING and get_ident() in REPLAYING):
            return
        try:
            root = self._root
            holds = self._holds.get(id(opt))
            if holds is None or holds[0]() is not opt:
                mine = {id(p) for p in root.parameters()} if root is not None else set()
                holds = self._holds[id(opt)] = (weakref.ref(opt), any(
                    id(p) in mine for g in opt.param_groups for p in g["params"]), False)
            if not holds[1]:
                return
            if self._opts and not holds[2]:  # its first step: the model's optimizer built again? (see add_optimizer)
                self._holds[id(opt)] = (holds[0], True, True)
                if self._replaced_by(opt):
                    self.add_optimizer(opt)
                    return  # watched from here: torch runs the step hooks just added next, this step's among them
            self._judge_before_update()
        except NonFiniteError:
            raise
        except Exception as exc:
            self._fault(exc, "the optimizer step pre-hook")

    def _judge_before_update(self) -> None:
        calls = self._log.root_calls
        self._end_step(advance=False)
        self._log.root_calls = max(self._log.root_calls, calls)  # the model's next call still ends the step

    def _before_write(self, target: Any) -> bool:
        """No optimizer is watched, and code outside the model is about to write in place into one
        of its parameters after a backward in this step: a hand-written update (``p -= lr * p.grad``,
        ``p.data.add_(...)``, ``torch._foreach_add_(params, grads)``, ``p.data = p.data - lr * p.grad``;
        not ``p.set_(...)``, which torch function modes never see: judged at the next call, after it). The step is judged now, as
        `_unwatched_step` judges it before an unwatched optimizer's update: a replay after the write
        ran on the written weights (a NaN from the data, or made in a later module, was blamed on
        the first module's weights), and in raise mode the write never applies a non-finite
        gradient. Called by the loss-code recorder before the call runs; the parameters' storages
        are gathered once per step, on the first in-place call after a backward. True when the
        step was judged (the recorder leaves the update's write out of the next step's log)."""
        log = self._log
        if self._opts or self._paused or self._closed or self._stack or not log.tops or not log.backward:
            return False
        try:
            if self._pstores[0] is not log:
                root = self._root
                self._pstores = (log, frozenset(
                    storage_of(p) for p in (root.parameters() if root is not None else ())))
            mine = self._pstores[1]
            ts = target if isinstance(target, (list, tuple)) else (target,)
            if any(isinstance(t, torch.Tensor) and storage_of(t) in mine for t in ts):
                self._hand_update = True  # (see _drop_grads)
                try:
                    self._judge_before_update()
                finally:
                    self._hand_update = False
                return True
        except NonFiniteError:
            raise
        except Exception as exc:
            self._fault(exc, "the loss-code recorder (a parameter about to be written)")
        return False

    def _closure(self, i: int, opt: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        loss = closure()
        # past its first call, the optimizer's state is mid-update (LBFGS's line search): a hit
        # now does not read it as what the last step() left (see StepView.mid_step)
        self._closure_calls[i] = self._closure_calls.get(i, 0) + 1
        self._in_closure = opt
        try:
            self._check_step(i, opt)
        except NonFiniteError:  # the step stops here: LBFGS may have moved the weights to a trial point
            backup = self._step_backups.pop(i, None)
            if backup is not None:
                backup.restore()
            self._abandoned()
            raise
        finally:
            self._in_closure = None
        return loss

    def _closure_joined(self, opt: torch.optim.Optimizer, loss: Any) -> Any:
        """``opt``'s ``step(closure)`` began before this hunt watched it (the model's first call ran
        inside that closure: ``nanhunt run``, ``pytest --nanhunt``): its check after the closure, as
        `_closure` makes it, still before the optimizer applies anything."""
        i = next((k for k, o in enumerate(self._opts) if o is opt), None)
        if i is None or self._closed or self._paused:
            return loss
        return self._closure(i, opt, lambda: loss)

    def _abandoned(self) -> None:
        """A finding raised out of ``step()`` before the update. A loop that catches it and goes on
        to its next batch counts the abandoned step, as a skipped one is counted, so the next
        finding's step is the loop's own count (it fell one behind for each resume); a retry of
        the same batch (its tensors given again) is the same step. Decided at the next step's end
        (`_resumed`); until then ``hunt.step`` is the step that raised."""
        self._abandon = True
        self._calls_before = _Counted()
        self._round = set()

    def _others_abandon(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """This hunt raises out of ``opt.step()``'s pre-hooks: torch runs none of the hooks after
        it, nor the post-hooks. Every other open hunt of that optimizer (two hunts of one model: a
        callback's and the user's own, ``nanhunt run`` around a script's watch()) still judges the
        step (those whose pre-hook comes after this one's, as torch would have called it) and
        counts it abandoned as this hunt does, so that its next finding is at the loop's own step,
        not one behind for each step this hunt raised at."""
        _ABANDONING.add(id(opt))
        try:
            after = False
            for hook in list(opt._optimizer_step_pre_hooks.values()):
                func = getattr(hook, "func", None)  # (ours: partial(hunt._pre_step, i))
                owner = getattr(func, "__self__", None)
                if not isinstance(owner, Hunt) or getattr(func, "__name__", "") != "_pre_step":
                    continue
                if owner is self:
                    after = True
                    continue
                if owner._closed:
                    continue
                if after:
                    try:
                        hook(opt, args, kwargs)  # (it judges; one that raises counts itself abandoned)
                    except NonFiniteError:
                        continue
                    except Exception:  # (its own fault, logged by it: this hunt's finding is what is raised)
                        pass
                owner._abandoned()
                if not owner._hit_inputs:  # (a retry of the same batch is the same step for it too)
                    owner._hit_inputs = list(self._hit_inputs)
        finally:
            _ABANDONING.discard(id(opt))

    def _resumed(self, log: StepLog) -> None:
        """The step after one that raised ends (see `_abandoned`): it counts the abandoned one
        unless it was given the abandoned step's own input tensors again."""
        self._abandon = False
        gone = {id(t) for r in self._hit_inputs if (t := r()) is not None}
        self._hit_inputs = []
        if not any(id(t) in gone for top in log.tops for _, t in tensors((top.args, top.kwargs or {}))):
            self.step += 1

    def _check_step(self, i: int, opt: torch.optim.Optimizer) -> None:
        if self._closed:
            return
        try:
            # skip: the round's first step() judges every watched optimizer's gradients, so that a
            # skipped round applies none of them
            opts = self._opts if self.on_find == "skip" and not self._round else [opt]
            params, grads = _with_grads([g["params"] for o in opts for g in o.param_groups])
            if grads:
                self._log.vectors.append((self._grad_probe(i if len(opts) == 1 else -1).probe(params, grads),
                                          Grads(i, params)))
            self._params_before(i, opt)
            self._end_step(advance=False, collective=True)
        except Exception as exc:
            self._fault(exc, "the optimizer step pre-hook")

    def _params_before(self, i: int, opt: torch.optim.Optimizer) -> None:
        """On a step whose update is probed after it (`_post_step_body`): the parameters and state as
        step() begins, probed, so that on a hit a parameter or state already non-finite before the update (written
        by the user's code since backward or the last step: ``p.data[3] = nan``, which no version
        counter sees) is not blamed on the optimizer. Not read here on a GPU (read on a hit only,
        no second sync); on the CPU its summary is read at once (free), and only when it is
        non-finite is each parameter probed, so that the flags are of the values before the update."""
        every = self._optimizer_every
        loaded = i in self._loaded  # (a state dict loaded since the last step(): probed whatever the step)
        if not every or ((self._applied.get(i, 0) + 1) % every and not loaded):
            return
        if not loaded and not any(in_place(getattr(r.func, "__name__", "")) for r in self._log.outside):
            # nothing outside the model wrote in place since the step's forward (the loss code is
            # recorded): the parameters are what the last update left, judged then. The probe cost
            # ~1 M instructions a step on the benchmark MLP (+3 %) for a write that is rare
            return
        # the parameters and the state (a write into exp_avg carries into the parameter)
        params = [p for p in self._oprobes[i].current()[1]
                  if is_checked(p) and p.layout is torch.strided and not p.is_meta]
        if not params:
            return
        gp = self._pprobes.get(i)
        if gp is None:
            gp = self._pprobes[i] = GradProbe()  # (a parameter has its gradient's shape: the same plan)
        got = gp.probe(params, params)
        vec: torch.Tensor | None = got if isinstance(got, torch.Tensor) else (  # (Fused: on the CPU)
            None if not any_bad(got.summary) else torch.stack([probe(p) for p in params]))
        self._before[i] = (self._applied.get(i, 0) + 1, params, vec)

    def _grad_probe(self, key: int) -> GradProbe:
        gp = self._gprobes.get(key)
        if gp is None:
            gp = self._gprobes[key] = GradProbe()
        return gp

    def _post_step(self, i: int, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _is_compiling():
            return torch._dynamo.disable(self._post_step)(i, opt, args, kwargs)  # type: ignore[no-any-return]
        self._closure_calls.pop(i, None)  # its step() is over: its state is what it left
        backup = self._step_backups.pop(i, None)
        if backup is not None and self.skipped and self.skipped[-1] == self.step and not self._closed:
            backup.restore()  # skip: the step was dropped after LBFGS moved the weights (a trial point)
        if self._paused or self._closed:
            return
        self._steps_applied += 1  # (at once: a GradScaler's step() it ran in tells a skipped step by it)
        if self._wrapper_steps:
            # a wrapper optimizer's step() stepped it (Lookahead): what the wrapper writes after
            # this (the pull-back towards its slow weights) is part of the step, so the step's end
            # (the versions that tell the optimizer's writes from the user's, the update's probe)
            # waits until the wrapper's step() returns (`_WrapperStep`)
            if self._held_ends:  # (it stepped twice: the first step ended before the second began)
                self._end_held()
            self._held_ends.append((i, opt))
            return
        _IN_HOOKS[id(opt)] = _IN_HOOKS.get(id(opt), 0) + 1
        try:
            self._post_step_body(i, opt)
        except Exception as exc:
            self._fault(exc, "the optimizer step post-hook")
        finally:
            _left_hooks(opt)

    def _end_held(self) -> None:
        """The step ends `_post_step` held while a wrapper optimizer's step() was under way."""
        held, self._held_ends = self._held_ends, []
        for i, opt in held:
            if self._paused or self._closed:
                return
            try:
                self._post_step_body(i, opt)
            except Exception as exc:
                self._fault(exc, "the optimizer step post-hook")

    def _post_step_body(self, i: int, opt: torch.optim.Optimizer) -> None:
        n = self._applied[i] = self._applied.get(i, 0) + 1  # (each optimizer's own count: of two
        # stepped in turn, counting them together probed only the second's state, every 10th step)
        if self._damage_at is opt and self._root is not None:  # the first finding's step has now ended
            self._damage_at = None
            self._damage = damage(self._root, self._opts)
        step = self.step
        self._count_step(i)
        self._set_stats_on()
        self._lean = not (self._ignored or self._grad_hooks)  # see _done
        # Parameters and state are read every `optimizer_every` steps (1 in full mode, 10 in
        # sentinel, where reading three copies of the model each step would be most of its cost)
        # and on every hit, by the analysis. Versions are free to read: on a hit they tell the
        # optimizer's writes from the user's.
        self._step_clocks[i] = _tick()
        self._step_of[i] = step  # (an optimizer of a round not yet ended: this step, not the one before)
        for gi, g in enumerate(opt.param_groups):
            lr = g.get("lr")
            if lr.__class__ is torch.Tensor and lr.is_cpu and lr.numel() == 1:
                lr = lr.item()  # (a tensor lr a schedule fills in place; on a device it would be a sync)
            if lr.__class__ is float:
                self._last_lrs[(i, gi)] = (step, lr)
                if lr - lr != 0:  # inf or nan (the scheduler steps after this)
                    self._bad_lrs[(i, gi)] = (step, lr)
                elif lr > self._peak_lrs.get((i, gi), _NO_PEAK)[1]:
                    self._peak_lrs[(i, gi)] = (step, lr)
        ps = [p for g in opt.param_groups for p in g["params"]]
        self._after_step[i] = (ps, list(map(_VERSION, ps)))  # (C-level: a dict built here cost ~20 us a step)
        self._judged.discard(i)
        if self._optimizer_every and (n % self._optimizer_every == 0 or i in self._loaded):
            self._loaded.discard(i)
            got = self._probe_update(i, step)
            if got is not None:
                vec, entry = got
                log = self._log
                before = self._before.pop(i, None)
                if before is not None and before[0] == n:  # taken as this step() began
                    entry.before = (before[1], before[2])
                log.vectors.append((vec, entry))
                self._judged.add(i)  # first: the analysis of a hit now must not read this update again
                if not self._judged_now(vec, i):
                    self._judged.discard(i)
                elif log.vectors:  # judged finite (non-finite: that log was ended, its findings made)
                    log.vectors.pop()
        elif self._optimizer_every:
            self._oprobes[i].prepare()

    def _probe_update(self, i: int, step: int) -> tuple[torch.Tensor | Fused, OptimState] | None:
        """The probe of optimizer ``i``'s parameters and state after its update of ``step`` (device
        side), and its log entry; None when it holds no tensors. The entry says since when the
        state went unread (`OptimState.since`): every `optimizer_every` steps, a state made
        non-finite at one of the steps in between is only known to be made in that window."""
        op = self._oprobes[i]
        items, tens = op.current()
        if not tens:
            return None
        fed = self._bad_grads_step == step  # this step was given non-finite gradients (not raise mode)
        entry = OptimState(i, step, items, tens, fed, self._step_clocks.get(i, 0))
        entry.since = self._probed_at.get(i, -1)
        self._probed_at[i] = step
        return op.probe(), entry

    def _probe_last_updates(self) -> bool:
        """Probe each optimizer's last update if it was not (`optimizer_every` > 1, or 0), into the
        log the next sync judges; True when there is one. At close (not with 0: "only on a hit"), so
        that a state that overflowed after the last reading (the weights finite: the run goes on,
        stalled) is not left unreported; at a refused checkpoint, so that the step that made the
        value is found before the refusal."""
        if self._paused:
            return False
        added = False
        for i, step in list(self._step_of.items()):
            if self._probed_at.get(i) != step and i < len(self._oprobes):
                got = self._probe_update(i, step)
                if got is not None:
                    self._log.vectors.append(got)
                    added = True
        return added

    def _judged_now(self, vec: torch.Tensor | Fused, i: int) -> bool:
        """Judge the optimizer's update at once where that costs no device sync (CPU tensors, one
        process); True when judged. Non-finite: the finding is made now (the step's log is ended),
        so it raises from this ``step()``, before the model's next forward. On a GPU (a read there
        would be a second sync per step) and under torch.distributed (the ranks agree at a
        collective) the probe stays in the log and is read at the next step's sync."""
        summary = vec if isinstance(vec, torch.Tensor) else vec.summary
        if self.distributed or not summary.is_cpu:
            return False
        if any_bad(summary):
            self._end_step(advance=False)  # judges it (and whatever else the log holds) now
        elif self._known_bad:
            self._forget_known([i])
        return True

    def _forget_known(self, opts: list[int]) -> None:
        """The parameters and state of optimizers ``opts`` (indices) were judged finite after a
        step: nothing of theirs an earlier finding showed non-finite is still carried (the user
        rolled it back), so a new overflow of it is a new finding. (Only theirs: another
        optimizer's state, not read then, may still carry what was found.)"""
        mine = {id(t) for i in opts if i < len(self._opts) for t in optimizer_tensors(self._opts[i])[1]}
        self._known_bad = [r for r in self._known_bad if (t := r()) is not None and id(t) not in mine]

    def _count_step(self, i: int) -> None:
        """Watched optimizer ``i`` stepped: one training step is a round in which each watched
        optimizer steps once; an optimizer that steps again before the others did starts the next
        round."""
        if i in self._round:
            self._round = set()
        self._round.add(i)
        if len(self._round) == len(self._opts) - len(self._retired):
            self.step += 1
            self._calls_before = _Counted()
            self._round = set()

    def _wrap_scaler(self, scaler: Any) -> None:
        """Join ``scaler``'s one wrapper of ours (`_ScalerStep`), put on it by the first hunt."""
        wrapper = scaler.__dict__.get("step")
        if not isinstance(wrapper, _ScalerStep):
            wrapper = _ScalerStep(scaler)
            scaler.step = wrapper
        wrapper.hunts.append(weakref.ref(self))

    def _scaled_step(self, scaler: Any, orig: Callable[..., Any], optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` of an optimizer this hunt watches, or of any when it watches
        none (see `_ScalerStep`)."""
        before = self._steps_applied if self._opts else self._steps_seen
        stepped = _stepping(optimizer)  # (scaler.step(lookahead): the optimizer watched is the one it steps)
        self._outside.off()
        scale = None  # the scale this iteration's gradients were multiplied by
        if getattr(scaler, "_scale", None) is not None:
            scale = scaler._scale.detach().clone()
            self._history.scales.append((self.step, scale))  # read only for a report
        if not self._closed and self.skipped and self.skipped[-1] == self.step and all(
                p.grad is None for g in optimizer.param_groups for p in g["params"]):
            # on_find="skip" dropped this round's gradients at another optimizer's step: there is
            # nothing to apply, and the scaler would fail on an optimizer without gradients ("No
            # inf checks were recorded for this optimizer"); the round still counts
            i = next((k for k, o in enumerate(self._opts) if o is stepped), None)
            if i is not None:
                self._count_step(i)
            return None
        try:
            out = orig(optimizer, *args, **kwargs)
            if not self._closed and (self._steps_applied if self._opts else self._steps_seen) == before:
                # the scaler skipped the step: its scaled gradients overflowed, as expected. The
                # iteration ends here (its forward is checked) and counts as a step, as the user's
                # loop (and Lightning's and the Trainer's step counters) count it. At a scale
                # of 1 or below the gradients were not magnified: non-finite ones are no overflow
                # of the scale (a NaN made in backward would have the scaler skip every step,
                # its scale falling to 0) and are judged as without a scaler (one read, on a
                # skipped step only: the scaler has just read its own inf checks)
                self._skipped_steps += 1
                if scale is None or float(scale) > 1.0:
                    self._drop_backward()
                calls = self._log.root_calls
                self._end_step(advance=False, collective=True)
                if not self._opts:  # no optimizer watched: the model's next call still ends the step
                    self._log.root_calls = max(self._log.root_calls, calls)
                i = next((k for k, o in enumerate(self._opts) if o is stepped), None)
                if i is not None and not self._closed:
                    self._count_step(i)
        except NonFiniteError:
            _scaler_ready(scaler, optimizer)
            raise
        return out

    def _unwrap_scaler(self) -> None:
        """Leave the scaler's wrapper; the last hunt to leave takes it off."""
        wrapper = self._scaler.__dict__.get("step")
        if isinstance(wrapper, _ScalerStep):
            wrapper.hunts = [r for r in wrapper.hunts if (h := r()) is not None and h is not self]
            if not wrapper.hunts:
                wrapper.remove()

    def _drop_backward(self) -> None:
        """The scaler skipped this step: its non-finite scaled gradients are expected, and so are
        the values the loop's code made after the backward (``clip_grad_norm_`` of the unscaled
        gradients: an inf norm, and inf * 0 = nan in the clipped ones)."""
        log = self._log
        after = log.bwd_clock  # (0: no gradient reached the model's outputs, no code came after one)
        log.keep([i for i, m in enumerate(log.meta) if not isinstance(m, Bwd)
                  and not (after and isinstance(m, Out) and log.outside[m.rec].clock > after)])
        log.vectors = [v for v in log.vectors if not isinstance(v[1], Grads)]
        log.backward = False  # its gradients are the scaler's business: not judged at this step's end either
        log.seeds.clear()  # (nor, with no optimizer watched, the model's gradients its backward() left)
        if self._dist is not None:
            self._dist.forget()  # the local gradients' probes of that step go too

    def _end_step(self, *, advance: bool, raise_ok: bool = True, collective: bool = False) -> None:
        """The step's single sync; analysis and `on_find` only on a hit.

        ``collective``: under torch.distributed, agree with the other ranks (`dist`): only at a
        watched optimizer's step, which every rank runs; elsewhere each rank judges its own.
        """
        self._outside.off()
        if self._evbuf:  # (a step ended inside a top-level call: what its calls noted is part of it)
            if self._inner == _get_ident():
                self._flush()
            self._evbuf.clear()
        self._ev = None
        if self._traced:
            self._log.traced = True
            self._after_trace()
        self._resolve(self._log)
        log, self._log = self._log, StepLog()
        self.judging_since = log.tops[0].clock if log.tops else 0
        self._stack.clear()
        if self._backup is not None:
            self._backup.end_step()
        batches = self._batches.take(log.tops) if self._batches is not None else None
        self._pending.clear()
        # no optimizer: the gradients are checked here; with one, also when its step() never came
        # after a backward (the loop left with an exception, clip_grad_norm_'s error_if_nonfinite)
        unstepped = log.backward and self._opts and not any(isinstance(v, Grads) for _, v in log.vectors)
        # (only after a backward in the step: an inference loop never judges gradients left from before)
        if self._root is not None and ((not self._opts and (log.backward or log.seeds)) or unstepped):
            every = self._root.parameters() if not self._opts else self._opt_params()
            params, grads = _with_grads([every])
            if params:
                log.vectors.append((self._grad_probe(-2 if not self._opts else -3).probe(params, grads),
                                    Grads(-1, params)))
        drained = self._compiled.drain() if self._compiled is not None else None
        if drained is not None:
            log.vectors.append(drained)
        if log.tops and log.tops[0].module is self._root:  # buffers that became non-finite in the step
            written = self._state.probe(log.tops[0], self._ignore)
            if written is not None:
                log.vectors.append(written)
        if self._abandon and (log.tops or log.vectors):
            self._resumed(log)
        step = self.step
        prior = self._calls_before  # this log's calls are numbered after these
        if advance:
            self.step += 1
            self._calls_before = _Counted()
        elif log.calls:  # the step goes on in a new log (an evaluation call, the cap, the other
            # optimizers of a round): its calls keep counting from here; `_count_step` starts anew
            # when the round's last optimizer has stepped
            self._calls_before = _Counted(prior, log)
        if advance or not self._opts or log.backward or any(t.grad_enabled for t in log.tops):
            # (with an optimizer an evaluation pass is no step: each batch of a validation loop at
            # a sampled step was a sample of that step, and 32 of them pushed every training step
            # out of the ring)
            self._history.add(step, list(log.stats_rows), log.stats)
        self._set_stats_on()
        self._lean = not (self._ignored or self._grad_hooks)  # see _done
        found: list[Finding] = []
        evaluation = False
        d = self._dist if collective else None
        silent: _dist.SilentRankError | None = None  # a rank fell silent: this rank's own findings stay, then it raises
        try:
            if d is not None:  # one small all_reduce on nanhunt's own group, folded into the step's sync
                flag = log.bad_flag()
                cuda = flag is not None and flag.is_cuda
                with span("nanhunt::sync", cuda):
                    try:
                        bad, agreed = d.agree(flag, any(isinstance(v, Grads) for _, v in log.vectors))
                    except _dist.SilentRankError as e:
                        if not e.bad:
                            raise
                        silent, bad, agreed, d = e, True, [1, 0, 1, 0], None  # judged as this rank's alone
                if not agreed[0]:
                    return
            else:
                if self._dist is not None:
                    self._dist.forget()
                flag = log.poison()
                cuda = flag is not None and flag.is_cuda
                with span("nanhunt::sync", cuda):
                    bad = flag is not None and read_nan(flag)  # the step's one host read
                if not bad:
                    if self._known_bad and any(isinstance(e, OptimState) for _, e in log.vectors):
                        self._forget_known([e.opt for _, e in log.vectors if isinstance(e, OptimState)])
                    return
            failed: Exception | None = None
            made: dict[int, int] = {}  # the analysis's `occurred` of this rank's findings, by id
            view: StepView | None = None
            if bad:
                self._hit_inputs = [weakref.ref(t) for top in log.tops
                                    for _, t in tensors((top.args, top.kwargs or {}))]
                self._paused = True
                try:
                    with span("nanhunt::replay", cuda), replaying():  # every other hunt's hooks stand aside
                        view = self._view(log, step, prior.counts(),
                                          received=d is not None and bool(agreed[1]) and not (agreed[2] or agreed[3]))
                        found = locate(view)
                    if batches is not None and self._batches is not None:
                        found = self._batches.fill(found, log, batches, view.born_rows, view.born_tops)
                    if len(view.occurred) == len(found):  # when each value was made (see `occurred`)
                        made = {id(f): c for f, c in zip(found, view.occurred) if c}
                except Exception as e:  # the other ranks still wait for this rank's findings
                    if d is None:
                        raise
                    failed = e
                except BaseException:  # Ctrl-C or SystemExit during the analysis: no finding, but the
                    if self._backup is not None:  # buffers the failing step wrote still go back
                        self._backup.restore()
                        self._state.forget()
                    raise
                finally:
                    self._paused = False
            in_evaluation = log.found_in_evaluation  # (the findings are all in evaluation passes' calls)
            if d is not None:
                mine = _dist.judge(found, agreed)
                try:
                    everyone = d.group.gather(([f.to_dict() for f in mine], in_evaluation or not mine))
                except _dist.SilentRankError as e:  # (a rank died in its analysis: what it found is gone with it)
                    silent, everyone = e, [([f.to_dict() for f in mine], in_evaluation or not mine)]
                found = _dist.merge([got[0] if got else None for got in everyone])
                in_evaluation = bool(found) and all(got is None or got[1] for got in everyone)  # the same on every rank
                if failed is not None:
                    raise failed
            elif self._dist is not None:
                found = _dist.judge(found, None)
            # an evaluation pass (no_grad calls only, no gradients, no update): nothing a skip could drop
            evaluation = in_evaluation or (
                bool(log.tops) and not log.backward and not any(t.grad_enabled for t in log.tops)
                and not any(isinstance(e, (Grads, OptimState)) for _, e in log.vectors))
        finally:
            log.release()
        # (a NonFiniteError the user keeps holds this frame in its traceback: never the step or the model)
        del log
        view = None
        if found:
            with span("nanhunt::finding", cuda):
                self._handle(found, raise_ok and silent is None, evaluation, made=made)
        if silent is not None:
            if found:
                silent.add_note(f"nanhunt (rank {self.rank}): this rank's own first finding (in hunt.findings "
                                f"and its report): {found[0].summary()}")
            raise silent

    def _handle(self, found: list[Finding], raise_ok: bool, evaluation: bool = False, foreign: bool = False,
                made: dict[int, int] | None = None) -> None:
        """``foreign``: findings of another thread's call (`_foreign_post`): the owner's step, its
        buffers and its optimizers are left as they are."""
        first = not self.findings and not self._dropped and not foreign  # (the step's own may go before it)
        room = max(self.options.max_findings - len(self.findings), 0)
        self._dropped += max(len(found) - room, 0)
        if foreign:
            self._foreign_ids.update(id(f) for f in found[:room])
        self._add_findings(found[:room], made)
        if any(f.phase in ("backward", "grad") for f in found):
            self._bad_grads_step = self.step
        for f in found:
            self._bad_samples.update(f.samples)
        if self._backup is not None and not foreign:
            self._backup.restore()  # raise and skip: the buffers the failing step wrote go back
            self._state.forget()
        self._skips_exceeded = False
        skipped = self.on_find == "skip" and self._skip(found, evaluation)
        if any(f.cause == "parameter" or f.phase == "optimizer" for f in found):
            self._known_bad = [weakref.ref(t) for t in bad_state(self._root, self._opts)]  # (what is non-finite now)
        if any(f.phase in ("backward", "grad") for f in found) and self._root is not None:
            self._stale_grads = [weakref.ref(p.grad) for p in self._root.parameters() if p.grad is not None and is_bad(p.grad)]
        if self._damage is None and self._root is not None and not foreign:
            self._damage = damage(self._root, self._opts)
            # record/warn: the optimizer goes on to apply the reported step; read again when it has
            going_on = self.on_find not in ("raise", "skip", "breakpoint") and found[0].step == self.step
            self._damage_at = (self._stepping or self._in_closure) if going_on else None
        unwritten = None
        if self._report_path is not None:
            now = time.monotonic()  # not at every finding: a long record-mode run would rewrite it quadratically
            if self._report_at is None or now - self._report_at >= _REPORT_EVERY:
                self._report_at = now
                unwritten = self._write_report()
        warn = self.on_find == "warn" and (foreign or found[0].step != self._warned_step)
        if _logger.isEnabledFor(logging.INFO):  # the summaries, formatted only when a handler wants them
            for i, f in enumerate(found):  # (only the hunt's first finding is called the first)
                if not (warn and i == 0):
                    _logger.info("%s", paragraph(f, first=first and i == 0))
        if callable(self.on_find):
            outer, self._in_on_find = self._in_on_find, _get_ident()
            # the loss-code recorder is off while a step is judged (a root call runs, or step()
            # began): a hunt the callback opened and called its model in turned it on, and it
            # recorded the rest of the judged step (the optimizer's own update of these weights)
            # as that hunt's outside code. Off again after the callback, as without it
            was_off = _SWITCH.on is None
            try:
                for f in found:
                    try:
                        self.on_find(f)
                    except Exception as exc:  # the user's own code: theirs to see, not an internal fault
                        if not isinstance(exc, NonFiniteError):  # (known by its type: not kept, see _fault)
                            self._user_exc = exc
                        raise
            finally:
                self._in_on_find = outer
                if was_off and _SWITCH.on is not None:
                    _SWITCH.off()
        elif warn:
            # at most one warning per step (also on the logger); only the hunt's first finding is
            # called the first (another thread's calls warn each: they leave the step's alone)
            if not foreign:
                self._warned_step = found[0].step
            more = f" ({len(found) - 1} more finding(s) at this step in the report.)" if len(found) > 1 else ""
            message = paragraph(found[0], first=first) + more
            _logger.warning("%s", message)
            try:
                warnings.warn(message, NonFiniteWarning, stacklevel=user_stacklevel())
            except Warning as exc:  # the user's filter made it an error (-W error, pytest's filterwarnings): theirs
                self._user_exc = exc
                raise
        elif self.on_find in ("raise", "skip", "breakpoint") and not skipped and raise_ok:  # breakpoint: stopped in _locate first
            why = None
            if self._skips_exceeded and self.findings and self._max_skips:
                # max_skips: the run stops at a step that is not its first finding's (max_skips=0
                # allows no skip: the first finding stops the run, as in raise mode)
                why = (f"nanhunt: on_find='skip' dropped {self._max_skips} steps in a row "
                       f"({', '.join(map(str, self.skipped[-self._max_skips:]))}; max_skips={self._max_skips}) "
                       f"and step {found[0].step} has a finding again, so the run stops. The first finding:")
            error = NonFiniteError(self.findings[0] if why else found[0], self._report_now(), why, first=first or bool(why))
            if unwritten is not None:
                error.add_note(unwritten)  # (also warned and logged: a -W error run sees it here)
            if self._close_before_raise:  # a loop with no exception hook (HF Trainer): leave nothing behind
                self._close(raise_pending=False)
            raise error

    def _skip(self, found: list[Finding], evaluation: bool = False) -> bool:
        """``on_find="skip"``: drop this step (its gradients; buffers are already back), unless it
        cannot be undone (the optimizer already applied it) or too many steps in a row were dropped.
        An evaluation pass (a validation batch) has nothing to drop: its findings are kept, the
        training step around it is not skipped and no skip is counted."""
        if any(f.phase in ("optimizer", "checkpoint") for f in found):
            return False
        step = found[0].step
        if evaluation:
            _logger.warning("nanhunt: a finding in an evaluation pass at step %d (no training step to skip): %s",
                            step, found[0].summary())
            return True
        if self.skipped and self.skipped[-1] == step:
            # the step was skipped already (at another optimizer's step(): a GAN's D, then G, fed
            # the same bad batch): what was computed since is dropped too
            self._drop_grads()
            self._rewind_rng(step)
            return True
        run = self._skip_run + 1 if self.skipped and self.skipped[-1] == step - 1 else 1
        if run > self._max_skips:
            self._skips_exceeded = True
            return False
        self._skip_run = run
        self.skipped.append(step)
        self._drop_grads()
        self._rewind_rng(step)
        if self._scaler is not None:
            self._kept_scale = _KeepScale.arm(self._scaler) or self._kept_scale
        _logger.warning("nanhunt: skipped step %d (%d in a row): %s", step, run, found[0].summary())
        return True

    def _rewind_rng(self, step: int) -> None:
        """Dropped step ``step``'s draws from torch's random streams (Dropout's masks) are dropped
        too: the CPU and CUDA generators go back to where the step's first top-level call found
        them, so that the next step draws what it would have drawn had the loop never seen the
        batch. (Also after a second optimizer's step() in the same step: what it drew since.)"""
        got = self._step_rng
        if got is None or got[0] != step:
            return  # (no top-level call in that step: nothing of the model's was drawn)
        try:
            torch.set_rng_state(got[1])
            if got[2] is not None:
                torch.cuda.set_rng_state_all(got[2])
        except Exception as exc:  # (never the user's run over it: the streams go on as they are)
            _logger.debug("nanhunt: the random streams of a skipped step were not put back (%s)", exc)

    def _drop_grads(self) -> None:
        if self._hand_update:
            # a hand-written update is writing the parameters (`_before_write`): what it computed
            # from the gradients is in hand already, so dropping them would not drop the step (and
            # the loop's next ``lr * p.grad`` would fail on None). Its writes into the parameters
            # are dropped instead, this one and every one until the model's next call
            self._outside.drop_writes(self._pstores[1])
            return
        if self._root is not None:
            drop_grads(self._root.parameters())
        for opt in self._opts:
            drop_grads(p for g in opt.param_groups for p in g["params"])

    def refuse_save(self, obj: Any, name: str) -> None:
        """Raise `NonFiniteError` (phase ``"checkpoint"``) if saving ``obj`` as ``name`` would write
        the watched model's or optimizers' state with NaN/Inf (for loops that save without
        ``torch.save``, e.g. safetensors). Nothing when ``guard_saves=False``."""
        if self._guard is not None:
            f = self._guard.check(obj, name)
            if f is not None and self._judge_before_refusal():
                f = self._guard.check(obj, name)  # (a skipped step's buffers went back)
            if f is not None:
                raise self._refused(f)

    def _judge_before_refusal(self) -> bool:
        """A checkpoint is about to be refused: what made the value is judged first, as a hit, so
        that it is the first finding (in raise mode, the error) and, in skip mode, its step is
        dropped and its buffers put back before the checkpoint is judged again. Judged: the
        optimizers' updates not read yet (sentinel reads them every 10th step), and an iteration
        that ended without a ``step()`` (a GradScaler not given to watch() skipped it), which the
        model's next call would judge. True when something was judged."""
        if self._stack or self._closed or self._paused:
            return False
        added = self._probe_last_updates()
        log = self._log
        if self._root is not None and self._iteration_over(log):
            self._end_iteration(log)
            return True
        if added:
            self._end_step(advance=False)
            return True
        return False

    def _add_findings(self, found: list[Finding], made: dict[int, int] | None = None) -> None:
        """Keep ``findings`` in order of occurrence: a finding of an earlier step made later (the
        optimizer's, read at the next step's sync, after a checkpoint was refused) goes before
        the later steps' findings; within a step, in the order given."""
        now = _tick()
        for f in found:  # (``made``: the analysis's `occurred` of each, by id)
            self._when[id(f)] = ((made or {}).get(id(f)) or now, f)
        for listener in self.on_record:
            listener(found)
        findings = self.findings
        mine = self._foreign_ids
        for f in found:
            at = len(findings)
            # (the step's own findings go before another thread's of that step: made at the
            # step's end, they may well have come first; the step is what the run trains on)
            while at and (findings[at - 1].step > f.step or (
                    findings[at - 1].step == f.step and id(findings[at - 1]) in mine and id(f) not in mine)):
                at -= 1
            findings.insert(at, f)

    def occurred(self, f: Finding) -> int:
        """When the value of ``f`` (one of `findings`) was made, on the process's event clock
        (`_hooks.tick`, shared by every hunt): the top-level call a forward finding was made in,
        the loss code's torch call, the step's backward, the optimizer's ``step()``; else when
        the hunt recorded it. With several models watched (``nanhunt run`` of a GAN), the
        findings of all hunts go in this order: the discriminator's step may judge its input
        before the generator's step judges the generator's forward that made it. 0 for a finding
        the hunt does not hold."""
        got = self._when.get(id(f))
        return got[0] if got is not None and got[1] is f else 0

    def _refused(self, f: Finding) -> NonFiniteError:
        """The save guard refused a checkpoint: recorded like any finding (within ``max_findings``),
        and the error to raise (what made the value was judged first: `_judge_before_refusal`)."""
        if len(self.findings) < self.options.max_findings:
            self._add_findings([f])
        else:
            self._dropped += 1
        if self._damage is None and self._root is not None:
            self._damage = damage(self._root, self._opts)
        if self._report_path is not None:
            self._write_report()
        return NonFiniteError(f, self._report_now())

    def _write_report(self) -> str | None:
        """Write ``report=``; what went wrong if it could not be written (warned and logged, never
        raised: a full disk, a folder gone, ``-W error``; the finding it was written for goes on)."""
        try:
            self.report.save(self._report_path)  # type: ignore[arg-type]
        except Exception as e:  # never break the user's run over a report (a full disk, a bad name...)
            msg = f"nanhunt could not write the report to {self._report_path}: {type(e).__name__}: {e}"
            warn_unwritten(msg, stacklevel=user_stacklevel())  # (at the user's line, as a NonFiniteWarning)
            return msg
        return None

    def _view(self, log: StepLog, step: int, calls_before: dict[tuple[bool, int], int] | None = None,
              received: bool = False) -> StepView:
        """The read-only view of this step that the analysis gets (on a hit only)."""
        log.number_calls(calls_before)
        names = self._module_names()
        ignored = frozenset(m for m in names if id(m) in self._ignored)
        return StepView(
            log=log, step=step, root=self._root, names=names, ignored=ignored,
            mode=self.mode, replay=self.replay, grad_hooks=self._grad_hooks,
            sharded=self._dist is not None and self._dist.sharded, rank=self.rank, optimizers=tuple(self._opts),
            after_step={i: dict(zip(map(id, ps), vs)) for i, (ps, vs) in self._after_step.copy().items()},
            steps_applied=self._steps_applied,
            bad_grads_step=self._bad_grads_step,
            received=received,
            bundle=self._bundle_path if not self.findings else None,
            breakpoint=not self.findings and (self.on_find == "breakpoint" or getattr(self.on_find, "breakpoint", False)),
            scratch=(self._compiled.buf,) if self._compiled is not None else (),
            step_lines=dict(self._step_lines),
            bad_at_start=self._start.bad(),
            start_versions=self._start.versions,
            known_bad=tuple(t for r in self._known_bad if (t := r()) is not None),
            stale_grads=tuple(t for r in self._stale_grads if (t := r()) is not None),
            judged=frozenset(self._judged),
            mid_step=frozenset(i for i, n in self._closure_calls.items() if n > 1),
            step_clocks=dict(self._step_clocks),
            step_of=dict(self._step_of),
            bad_lrs=dict(self._bad_lrs),
            last_lrs=dict(self._last_lrs),
            peak_lrs=dict(self._peak_lrs),
            probed_at=dict(self._probed_at),
            optimizer_every=self._optimizer_every,
        )

    def _meta(self) -> dict[str, Any]:
        return {
            "steps": self.step,
            "mode": self.mode,
            "skipped_steps": self._skipped_steps,
            "torch": torch.__version__,
            "rank": self.rank,
            "dropped_findings": self._dropped,
        }

    def _close(self, raise_pending: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dist is not None:
            self._dist.group.leaving = not raise_pending  # (the other ranks are told why it stops answering)
        _logger.debug("closing the watch at step %d (%d finding(s) so far)", self.step, len(self.findings))
        try:
            if self._root is not None and not self._owner_busy():  # no collective: the other ranks may close elsewhere, or never
                if self._optimizer_every:
                    self._probe_last_updates()
                self._end_step(advance=False, raise_ok=raise_pending and self.on_find in ("raise", "skip", "breakpoint"))
        except Exception as exc:
            if isinstance(exc, (NonFiniteError, _dist.SilentRankError)) or exc is self._user_exc:
                raise
            msg = log_fault("close()", exc)
            if self.on_find == "raise":
                raise InternalError(msg) from exc
        finally:
            self._release()

    def _owner_busy(self) -> bool:
        """close() on another thread than the step's while that thread is in its step (a server's
        shutdown): the step is not judged here, where its log is still being written and a replay
        would run on the model the training thread is using (a NaN it had made was judged from
        half a log, or raised in the closing thread as "origin unknown")."""
        owner, thread = self._owner, self._owner_thread
        if (owner is None or owner == _get_ident() or thread.ident != owner or not thread.is_alive()
                or not (self._stack or self._log.tops)):
            return False
        _logger.warning("nanhunt: close() was called on another thread than the one training (%s) while it was "
                        "in step %d: that step is not judged", thread.name, self.step)
        return True

    def _release(self) -> None:
        """Remove every hook and drop every reference (the end of `close()`)."""
        self._outside.close()
        self._state.clear()
        self._paused = True  # for good: a hook torch already had in hand for this call does nothing
        busy = self._stepping._optimizer_step_pre_hooks if self._stepping is not None else None
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        if self._backup is not None:
            self._backup.clear()
            self._backup = None
        for h in self._handles:
            if busy is not None and getattr(h, "hooks_dict_ref", lambda: None)() is busy:
                self._deferred.append(h)  # torch is iterating that dict right now (on_find closed us)
                continue
            h.remove()
        self._handles.clear()
        self._inner, self._arm, self._global, self._fwd_ok, self._ev = 0, None, None, None, None
        self._kids = []
        self._evbuf.clear()
        self._calls_before = _Counted()  # (its calls hold their modules)
        self._after_step = {}  # (the parameters)
        for w in self._fwds.values():
            remove(w)
        self._fwds.clear()
        self._cparts.clear()
        for h in self._late.values():
            h.remove()
        self._late.clear()
        for cls in self._held:
            release(cls)
        self._held.clear()
        self._pending.clear()
        self._step_backups.clear()
        self._held_ends.clear()
        self._user_exc = None  # (its traceback holds the user's frames)
        self._log.release()
        self._stack.clear()
        if self._scaler is not None:
            self._unwrap_scaler()
        self._scaler = None
        if self._kept_scale is not None:
            self._kept_scale.remove()
            self._kept_scale = None
        self._root = None
        self._opts = []
        self._later = []
        self._oprobes = []
        self._gprobes = {}
        self._pprobes = {}
        self._before = {}
        self._names = None
        self._cnames = None
        self._clate = {}
        self._around = {}
        self._odd = None  # (holds modules)
        self._ignored = set()
        self._lean = not (self._ignored or self._grad_hooks)  # see _done
        if self._compiled is not None and self._compiled.meta:
            forget_compiled()  # compiled graphs traced our hooks in: drop them with us
        self._compiled = None
        if self._report_path is not None:
            self._write_report()
            key = os.path.realpath(self._report_path)
            if _report_writer(key) is self:
                del _REPORT_WRITERS[key]


def _report_writer(key: str) -> Hunt | None:
    ref = _REPORT_WRITERS.get(key)
    return ref() if ref is not None else None


def _report_free(path: str) -> None:
    """A ValueError when an open hunt writes ``path`` already: the two would replace each other's
    report, the last to write winning (a clean hunt's close wrote "no NaN found" over the other's
    finding). A device (``/dev/null``) is written in place by each, never replaced: shared freely."""
    other = _report_writer(os.path.realpath(path))
    if other is None or other.closed or (os.path.exists(path) and not os.path.isfile(path)):
        return
    watched = type(other._root).__name__ if other._root is not None else "a model"
    raise ValueError(f"report {path!r} is written by another open hunt already (watching {watched}): two hunts "
                     "writing one file would overwrite each other's findings, the last to write winning; give "
                     "each hunt its own report path, or close() the other hunt first")


def _add_stats(log: StepLog, name: str, t: torch.Tensor, key: tuple[int, int], handed_on: bool = False,
               lazy: bool = False) -> None:
    """Sampled steps: one heatmap row of ``name``'s output ``t``. ``handed_on``: ``t`` is known to
    be the very tensor an earlier call returned (`StepLog.probed` said so): its numbers are reused.
    Otherwise ``key`` may be a dead tensor's (ids are reused): the statistics are computed anew.
    ``lazy``: computed with the others at the top-level call's return (a small float32 output of
    a module seen, on trial, never to have its output written after returning: `Hunt._defer`;
    see `Hunt._resolve_stats`)."""
    if t.numel():
        st = log.stats_of.get(key) if handed_on else None
        if st is None:
            if (lazy and t.dtype is _F32 and key[1] >= 0 and type(t) is torch.Tensor and not t.is_nested
                    and t.layout is torch.strided and t.numel() <= _LAZY_NUMEL):
                st = log.stats_of[key] = len(log.stats)  # the row that will hold them
                log.stats.append(None)  # (first: the row exists before anything may resolve it)
                log.stats_lazy.append((t, key[1], st))
            else:
                log.stats.append(got := stats(t))
                log.stats_of[key] = got
        else:
            log.stats.append(st)
        log.stats_rows.append((name, str(t.dtype)[6:], t.numel()))


def _unwrap(model: nn.Module) -> nn.Module:
    """The module a wrapper runs: DDP's ``.module``, ``torch.compile(model)``'s ``_orig_mod`` (its
    calls are still seen: the wrapper's own call runs eagerly, and is what a verdict replays)."""
    while True:
        inner = _dist.unwrap(model)
        orig = getattr(inner, "_orig_mod", None)
        if type(inner).__name__ == "OptimizedModule" and isinstance(orig, nn.Module):
            inner = orig
        if inner is model:
            return model
        model = inner


def _warn_foreign(model: nn.Module, opts: list[torch.optim.Optimizer], given: Any) -> None:
    """Warn of each optimizer given to watch() that holds none of ``model``'s parameters (another
    model's: a GAN's discriminator's): its steps would count and end the steps, while the
    model's weights are stepped by one not watched. A warning, not an error: parameters added
    later (add_param_group) or an optimizer over copies of them (float32 master weights) may be meant."""
    for i, opt in enumerate(opts):
        held = _first_held(model, opt)
        if held is not False:
            continue  # (None: a model whose weights live outside it, torch.func.functional_call)
        which = f"optimizer[{i}]" if isinstance(given, (list, tuple)) else "the optimizer"
        warnings.warn(
            f"nanhunt.watch(): {which} ({type(opt).__name__}, {sum(len(g['params']) for g in opt.param_groups)} "
            f"parameters) holds none of the parameters of the watched model ({type(model).__name__}): is it "
            "another model's (a GAN's discriminator's)? Its step() calls count the training steps, while the "
            "model's weights are stepped by an optimizer nanhunt does not watch. Pass the optimizer that steps "
            "this model (or watch the model it steps); ignore this if you add this model's parameters to it "
            "later (add_param_group) or it steps copies of them (float32 master weights).",
            UserWarning, stacklevel=user_stacklevel())


def _first_held(model: nn.Module, opt: torch.optim.Optimizer) -> bool | None:
    """Does ``opt`` hold one of ``model``'s parameters? (None: the model holds none.) O(1) where
    the model's first parameter is the optimizer's (both walks stop at the first match): the
    modules are not walked, as registration never walks them (a model whose first layers are
    frozen is walked up to its first parameters, then matched against one set of the optimizer's)."""
    groups = [g["params"] for g in opt.param_groups]
    n = 0
    for n, p in enumerate(_params_of(model), 1):
        if any(any(map(is_, ps, repeat(p))) for ps in groups):
            return True
        if n == 8:
            break
    if not n:
        return None
    ids = set(map(id, chain.from_iterable(groups)))
    return any(id(p) in ids for p in _params_of(model))


def _params_of(model: nn.Module) -> Iterator[torch.Tensor]:
    """``model``'s parameters, each module's own before its children's (as ``parameters()``
    orders them), walked lazily: no list of a module's children is made (a Sequential of 10,000)."""
    seen = {id(model)}
    yield from (p for p in model._parameters.values() if p is not None)
    stack: list[Iterator[nn.Module | None]] = [iter(model._modules.values())]
    while stack:
        m = next(stack[-1], _NO)
        if m is _NO:
            stack.pop()
            continue
        if not isinstance(m, nn.Module) or id(m) in seen:
            continue
        seen.add(id(m))
        yield from (p for p in m._parameters.values() if p is not None)
        stack.append(iter(m._modules.values()))


def _given(optimizer: Any) -> list[Any]:
    """watch()'s ``optimizer`` as a list, as given (None: none)."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    out = []
    for o in _given(optimizer):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a list of them; got {type(o).__name__}"
            )
        inner = _stepping(o)
        if not _hooked(inner):
            raise TypeError(
                f"optimizer {type(o).__name__} was never set up by torch.optim.Optimizer.__init__ (its "
                "__init__ does not call super().__init__, and it wraps no optimizer that was): nanhunt "
                "cannot hook its step(); pass the torch optimizer that steps")
        out.append(inner)
    return out


def _hooked(opt: torch.optim.Optimizer) -> bool:
    """Does ``opt.step()`` run the step hooks? Only a class whose ``step`` torch patched (in
    ``Optimizer.__init__``) does: a wrapper that sets the hook dicts by hand and never runs it
    (pytorch_optimizer's ``Lookahead``) has hooks that never run."""
    return hasattr(opt, "_optimizer_step_pre_hooks") and bool(getattr(type(opt).step, "hooked", False))


def _stepping(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A wrapper optimizer (accelerate's ``AcceleratedOptimizer`` and pytorch_optimizer's
    ``Lookahead``, which never run ``Optimizer.__init__`` and step the optimizer they hold; SAM, whose ``first_step()`` and
    ``second_step()`` step its ``base_optimizer`` over the same param_groups and whose own ``step()``
    the loop may never call) -> the torch optimizer that steps."""
    for _ in range(8):
        base = getattr(opt, "base_optimizer", None)
        if isinstance(base, torch.optim.Optimizer) and base is not opt and getattr(opt, "param_groups", None) is base.param_groups:
            opt = base
            continue
        if _hooked(opt):
            break  # set up by torch: its own step hooks run
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            break
        opt = inner
    return opt


class _ScalerStep:
    """The one wrapper of a GradScaler's ``step()``, however many hunts watch the scaler (a GAN's
    generator and discriminator, each with its optimizer, through one scaler): ``step(optimizer)``
    goes through the hunts that watch ``optimizer`` (a hunt that watches none: every step is its
    own); the others' steps pass through untouched. Taken off when the last hunt leaves, the
    scaler as it was (a ``step`` of its own that it had put back)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.own = scaler.__dict__.get("step", _NO)  # an instance attribute it was put over
        self.orig = scaler.step
        self.hunts: list[weakref.ref[Hunt]] = []

    def __call__(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.orig
        stepped = _stepping(optimizer)  # (a wrapper's, scaler.step(lookahead): the optimizer that steps)
        others: list[Hunt] = []  # the hunts that do not watch ``optimizer``
        for r in reversed(self.hunts):
            h = r()
            if h is None or h._closed:
                continue
            h._outside.off()  # (the scaler's own torch calls are no loop code of any hunt's)
            if not h._opts or any(o is stepped for o in h._opts):
                step = partial(h._scaled_step, self.scaler, step)
            else:
                others.append(h)
        out = step(optimizer, *args, **kwargs)
        others = [h for h in others if not h._closed and h._log.backward]
        if others and getattr(self.scaler, "_scale", None) is not None and float(self.scaler._scale) > 1.0:
            # that step's backward was scaled: where it went through another hunt's model (the
            # generator's loss through the discriminator), the gradients it left there are the
            # scaler's business too (checked when that model's optimizer steps through it; else
            # zeroed unused): not judged. That hunt's step goes on. (One read, only then.)
            for h in others:
                h._drop_backward()
        return out

    def remove(self) -> None:
        _take_off(self.scaler, self, self.own)


class _KeepScale:
    """A GradScaler's ``update()`` that leaves its scale and growth tracker as they were, once: put
    on the instance when ``on_find="skip"`` drops a step whose iteration the scaler is in (its
    ``update()`` not called yet), and off as that ``update()`` returns (or at ``close()``). A
    dropped step is one the run never saw: the scaler backing off for its non-finite gradients (a
    NaN input's, never the scale's: a skipped step's finding is made in forward or by the loss, a
    scaled backward's overflow is not one) or counting it towards its growth would leave the scale,
    and in float16 every later gradient, different from a loop that left the batch out, and each bad
    batch would halve the scale for good. No work per step: only at a skip."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.own = scaler.__dict__.get("update", _NO)  # an instance attribute it was put over
        self.orig = scaler.update
        self.scale = scaler._scale.detach().clone()
        self.tracker = scaler._growth_tracker.detach().clone()
        scaler.update = self

    @classmethod
    def arm(cls, scaler: Any) -> _KeepScale | None:
        """Put on ``scaler`` if its iteration is under way (a step of it taken, ``update()`` to come)."""
        if isinstance(scaler.__dict__.get("update"), cls):
            return None  # (armed already: another optimizer's or hunt's step of the same iteration)
        scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
        states = getattr(scaler, "_per_optimizer_states", None)
        ready = getattr(sys.modules.get("torch.amp.grad_scaler"), "OptState", None)
        if not (isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor) and isinstance(states, dict)
                and ready is not None and any(st.get("stage") is not ready.READY for st in states.values())):
            return None
        return cls(scaler)

    def __call__(self, new_scale: Any = None) -> Any:
        self.remove()
        out = self.orig(new_scale)
        if new_scale is None:  # (a scale the loop sets itself is its own)
            with torch.no_grad():
                self.scaler._scale.copy_(self.scale)
                self.scaler._growth_tracker.copy_(self.tracker)
        return out

    def remove(self) -> None:
        d = self.scaler.__dict__
        if d.get("update") is self:
            if self.own is _NO:
                del d["update"]
            else:
                d["update"] = self.own


class _WrapperStep:
    """The one wrapper of a wrapper optimizer's ``step()`` (pytorch_optimizer's ``Lookahead``,
    accelerate's ``AcceleratedOptimizer``: one that `_stepping` went down from), however many hunts
    watch it, on the instance while one does: the writes it makes after the optimizer it holds
    stepped (Lookahead's pull-back of the weights towards its slow copies) are part of the step, so
    each hunt's end of that step (`Hunt._post_step` held it) is made as the wrapper's ``step()``
    returns. Taken off when the last hunt leaves, the wrapper as it was."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.own = wrapper.__dict__.get("step", _NO)  # an instance attribute it was put over
        self.orig = wrapper.step
        self.hunts: list[weakref.ref[Hunt]] = []

    @staticmethod
    def join(wrapper: Any, hunt: Hunt) -> _Leave:
        step = wrapper.__dict__.get("step")
        if not isinstance(step, _WrapperStep):
            step = _WrapperStep(wrapper)
            wrapper.step = step
        step.hunts.append(weakref.ref(hunt))
        return _Leave(step, hunt)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hunts = [h for r in self.hunts if (h := r()) is not None and not h._closed]
        for h in hunts:
            h._wrapper_steps += 1
        try:
            return self.orig(*args, **kwargs)
        finally:
            for h in hunts:
                h._wrapper_steps -= 1
            for h in hunts:
                if not h._wrapper_steps and h._held_ends:
                    h._end_held()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a copy or pickle of the wrapper (accelerate's keeps its whole __dict__) gets a plain
        # step(), never this one (its weak references to the hunts could not be pickled)
        return _own_step, (self.wrapper, None if self.own is _NO else self.own)

    # what a bound method offers, for code that takes ``opt.step`` apart: an LR scheduler built
    # over the wrapper after watch() puts ``step.__func__.__get__(opt)`` around it
    @property
    def __self__(self) -> Any:
        return self.wrapper

    @property
    def __func__(self) -> Any:
        def step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)
        return step

    def leave(self, hunt: Hunt) -> None:
        self.hunts = [r for r in self.hunts if (h := r()) is not None and h is not hunt]
        if not self.hunts:
            _take_off(self.wrapper, self, self.own)


def _take_off(obj: Any, step: Any, own: Any) -> None:
    """``obj``'s ``step`` as it was before nanhunt's ``step`` went over it (the instance attribute
    ``own``, or none: its class's), if nothing was put over nanhunt's since."""
    d = obj.__dict__
    if d.get("step") is step:
        if own is _NO:
            del d["step"]
        else:
            d["step"] = own


def _own_step(wrapper: Any, own: Any) -> Any:
    """A copy's ``step``: the instance attribute `_WrapperStep` was put over, else its class's."""
    return own if own is not None else type(wrapper).step.__get__(wrapper, type(wrapper))


class _Leave:
    """A hunt's handle of a `_WrapperStep` (in its handles: removed at close)."""

    def __init__(self, step: _WrapperStep, hunt: Hunt) -> None:
        self.step, self.hunt = step, weakref.ref(hunt)

    def remove(self) -> None:
        h = self.hunt()
        if h is not None:
            self.step.leave(h)


def _scaler_ready(scaler: Any, optimizer: Any) -> None:
    """A finding left ``scaler.step(optimizer)``: the iteration ends there, before ``update()``. Its
    stage for ``optimizer`` goes back to ready, so that the next iteration's ``step()`` unscales its
    own gradients: left "unscaled" (an error from inside ``optimizer.step()``), the scaler would skip
    that and apply the next gradients still multiplied by the scale; left "stepped" (the scaler had
    skipped the step), its next ``step()`` would fail. The iteration's inf checks stay, for an
    ``update()`` the loop calls after catching the error."""
    states = getattr(scaler, "_per_optimizer_states", None)
    ready = getattr(sys.modules.get("torch.amp.grad_scaler"), "OptState", None)
    if isinstance(states, dict) and ready is not None and id(optimizer) in states:
        states[id(optimizer)]["stage"] = ready.READY


def _wrapper_scaler(optimizer: Any) -> Any:
    """The GradScaler a wrapper optimizer steps through (accelerate's ``AcceleratedOptimizer.scaler``
    under fp16 mixed precision), else None."""
    for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
        scaler = getattr(o, "scaler", None) if _stepping(o) is not o else None
        if scaler is not None and hasattr(scaler, "step") and hasattr(scaler, "update"):
            return scaler
    return None



# id(optimizer) -> how many nanhunt step hooks of it are running (torch iterates its hook dicts)
_IN_HOOKS: dict[int, int] = {}


def _left_hooks(opt: torch.optim.Optimizer) -> None:
    n = _IN_HOOKS.get(id(opt), 0) - 1
    if n > 0:
        _IN_HOOKS[id(opt)] = n
    else:
        _IN_HOOKS.pop(id(opt), None)


def _after_pre_hooks(opt: torch.optim.Optimizer, handles: list[Any], now: bool) -> None:
    """Remove step pre-hooks of ``opt`` that were removed while torch iterated them (a dict changed
    during iteration raises out of ``step()``): at once if the iteration was cut short by an
    exception, else right after the update (``Optimizer._optimizer_step_code``, before post-hooks)."""
    if now or not hasattr(type(opt), "_optimizer_step_code"):
        for h in handles:
            h.remove()
        return
    hooks = list(handles)

    def after_update() -> None:
        opt.__dict__.pop("_optimizer_step_code", None)
        for h in hooks:
            h.remove()
        type(opt)._optimizer_step_code(opt)

    opt._optimizer_step_code = after_update  # type: ignore[method-assign]


def _restores(on_find: Any) -> bool:
    """Does a finding stop or drop the step (raise, skip, or a callable that raises)? Then the
    buffers it wrote are put back."""
    return on_find in ("raise", "skip") or bool(getattr(on_find, "raises", False))


_LIGHTNING = ("lightning.", "pytorch_lightning.", "lightning_fabric.")


def _redirected(module: nn.Module, through: bool = True) -> bool:
    """Lightning's strategies (DDP, FSDP, DeepSpeed; Fabric's wrapped modules) call
    ``training_step`` through the model's ``forward``: for that one call they set the instance's
    ``forward`` to a ``wrapped_forward`` that puts the real one back and runs the step, whose own
    ``self(x)`` is the model's real call. That outer call is no call of the model: a replay of it
    runs the real forward with the step's arguments (a TypeError, the finding without origin)."""
    m: Any = module
    for _ in range(4 if through else 1):  # or the module a wrapper hands the call to (DDP's .module; Fabric's)
        fwd = m.__dict__.get("forward")
        if (fwd is not None and getattr(fwd, "__name__", "") == "wrapped_forward"
                and getattr(fwd, "__module__", "").startswith(_LIGHTNING)):
            return True
        d = m.__dict__.get("_modules") or {}
        m = d.get("module") or d.get("_forward_module") or m.__dict__.get("_original_module")
        if not isinstance(m, nn.Module):
            return False
    return False


def _on_meta(module: nn.Module, args: tuple[Any, ...]) -> bool:
    """A top-level call on the meta device: a positional tensor argument is on meta. (Not judged
    from the parameters: a model offloaded by accelerate keeps them on meta and computes for real;
    a call with keyword arguments only is watched.)"""
    with _NO_SUBCLASS():
        return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


def _with_grads(groups: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters (of each list in ``groups``) that have a gradient with values, and those
    gradients, a sparse one as dense; a meta gradient (a dry run on the meta device) has none.
    (One loop reading each property once: C-level passes, ``map`` with attrgetters, cost 19 %
    more instructions on the benchmark MLP's 98 parameters.)"""
    params, grads = [], []
    for ps in groups:
        for p in ps:
            gr = p.grad
            if gr is not None and not gr.is_meta:
                params.append(p)
                grads.append(gr.to_dense() if gr.is_sparse else gr)
    return params, grads


def _capture_top(module: nn.Module, args: tuple[Any, ...]) -> Top:
    cuda_rng = None
    if torch.cuda.is_initialized():  # (initialized: available; is_available() cost ~8 us a step, cold)
        cuda_rng = torch.cuda.get_rng_state_all()
    autocast = tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
    )
    top = Top(module, args, torch.get_rng_state(), cuda_rng, autocast, torch.is_grad_enabled())
    with _NO_SUBCLASS():  # a tensor subclass's __torch_function__ never sees nanhunt's reads
        top.versions = [version(t) for _, t in tensors(args)]
    top.reparam = _functional_params(module)
    return top


def _functional_params(module: nn.Module) -> dict[str, Any] | None:
    """The tensors ``torch.func.functional_call(module, params, ...)`` put in place of the module's
    own for this call (a replay runs with them too), else None. A few frames up, once per
    top-level call."""
    f: Any = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        code = f.f_code
        if code.co_name == "_functional_call" and code.co_filename.endswith(_STATELESS):
            got, loc = f.f_locals.get("parameters_and_buffers"), f.f_locals
            if not isinstance(got, dict) or loc.get("module") is not module:
                return None
            return {**got, _TIE: bool(loc.get("tie_weights", True))}  # (tied weights follow, as functional_call ties them)
        f = f.f_back
    return None


_STATELESS = os.path.join("nn", "utils", "stateless.py")
_TIE = TIE_KEY
