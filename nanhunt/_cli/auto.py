"""Watch every model a script calls and every optimizer it steps, without editing the script.

`AutoWatch` is what ``nanhunt run`` uses. While it is open:

- **Roots.** A global forward pre-hook notices each module called at the top level (no module is
  running) that is not already inside a watched tree, and starts ``nanhunt.watch(module)`` for it;
  finding names are relative to that root. If a later top-level module *contains* a watched root
  (``model.encoder(x)`` was called before ``model(x)``), the inner hunt is closed (its findings are
  kept) and the outer module is watched instead. Modules added to a tree after its hunt started
  are not watched. A graph that ``torch.compile`` made, called as a module by its backend (the
  ``GraphModule`` of AOTAutograd's ``aot_eager``, dynamo's graph returned by a custom backend), is
  no root: watching it (a new hunt, dynamo's caches reset) had every step recompile.
- **Parts of one model.** A loop that calls a model's parts one by one (``model.enc(x)``, then
  ``model.head(h)``; a LightningModule's ``training_step``) with one optimizer over the whole model:
  the root watched is the smallest module holding the called part and every parameter of an
  optimizer that holds some of the part's parameters (known from torch's module registration
  hook: the model that the part was assigned to). One hunt then sees every part, names its findings
  ``enc.…``/``head.…`` and counts the training step by that optimizer, not by each part's calls. An
  optimizer built after such parts were discovered re-roots them the same way. (Not in sentinel
  mode, which records only the root's own calls.)
- **Optimizers.** ``torch.optim.Optimizer.__init__`` is wrapped for as long as the watch is open
  so that each optimizer is known from its construction: it is attached (``Hunt.add_optimizer``)
  to the hunt whose root owns most of its parameters as soon as that hunt exists, so ``step()``
  counts the training step from the first one. A global optimizer step pre-hook attaches any
  optimizer seen only at its first ``step()`` (one built before the watch opened); its own hooks,
  registered from inside that pre-hook, still run for that first step.
- **The script's own hunts.** A script that calls ``nanhunt.watch`` itself keeps control of what it
  watches: a tree holding (or inside) a root the script watches is left to the script's hunt for the
  rest of the run (an auto hunt already on it is closed, its findings kept), and that hunt's
  findings count in ``nanhunt run``'s report and exit status, each once. Replays (any hunt's) are
  never discovered as calls.
- **Order.** Every finding of every hunt (auto and the script's own) is stamped with when its
  value was made (`Hunt.occurred`, on the event clock all hunts share: the top-level call, the
  loss code's torch call, the backward), not when its hunt judged it: with several models (a
  GAN's generator and discriminator, a teacher and a student) one model's step often judges, as
  its input, a value another made before that one's own step judges it. `findings()` merges the
  hunts' lists by those stamps (each hunt's own order kept). In raise mode the first finding
  recorded first has the other hunts judge what their steps hold (`_settle`): the earliest is
  raised. Hunts whose roots have returned all record the loop's own code (``<outside>``): the
  same event found by several of them is reported once.

- **GradScalers.** ``torch.amp.GradScaler.step`` is wrapped too: at a scaler's first ``step()``
  the hunt that watches that optimizer takes the scaler, as ``watch(scaler=...)`` would, so the
  steps it skips (inf gradients of a scale still too high, as intended) are no findings; so does
  each other hunt at the first ``step()`` of its optimizer through that scaler (a GAN's generator
  and discriminator, one scaler for both).

`close()` closes every hunt, removes the global hooks and restores ``Optimizer.__init__`` and
``GradScaler.step``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.optim import optimizer as _optim_mod

from .._files import warn_unwritten
from .._finding import Finding, NonFiniteError
from .._hooks import on_hunt_opened, own_global_hooks, replaying_here, tick
from .._record import Hunt, NonFiniteWarning, watch
from .._record.hunt import _REPORT_EVERY
from .._record.outside import user_stacklevel
from .._report import Report
from .._words import paragraph

__all__ = ["AutoWatch"]

_logger = logging.getLogger("nanhunt")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# frames between a module call and its caller (torch's module call, fx's, nanhunt's hooks)
_PASSED = tuple(_TORCH_DIR + d + os.sep for d in ("nn", "fx")) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
_COMPILER = tuple(_TORCH_DIR + d + os.sep for d in ("_dynamo", "_functorch", "_inductor"))


class _OnFind:
    """The hunts' ``on_find``: records the order of findings across hunts, then acts like the mode."""

    def __init__(self, owner: AutoWatch, mode: str) -> None:
        self.owner = owner
        self.mode = mode
        self.hunt: Hunt | None = None
        self.breakpoint = mode == "breakpoint"  # the hunt stops in a replay of the op first

    def __call__(self, f: Finding) -> None:
        owner = self.owner
        if owner._settling:
            return  # another hunt's finding is being raised: this one is only recorded (see `_settle`)
        if self.mode not in ("raise", "breakpoint"):
            owner._write_report()
        if self.mode == "warn":
            first = self.hunt is not None and owner._first_to_warn(self.hunt, f)
            if first or f.step != owner.warned_step:
                owner.warned_step = f.step  # at most one warning per step; "First" only once
                owner._warned_first = owner._warned_first or first
                warnings.warn(paragraph(f, first=first), NonFiniteWarning, stacklevel=user_stacklevel())
        elif self.mode in ("raise", "breakpoint") and self.hunt is not None:
            if owner._first_stamped(f):
                owner._settle(self.hunt)
                merged = owner._merged()
                f = merged[0][1] if merged else f  # (another model's value made before this one)
            owner._write_report()
            raise NonFiniteError(f, owner.report())


class AutoWatch:
    """Discover and watch the script's root modules and optimizers; see the module docstring."""

    def __init__(self, on_find: str = "raise", *, report: str | None = None, **options: Any) -> None:
        if on_find not in ("raise", "warn", "record", "breakpoint"):
            raise ValueError(f"on_find must be 'raise', 'warn', 'record' or 'breakpoint'; got {on_find!r}")
        self.on_find = on_find
        self._report_path = report  # (``nanhunt run --report``: written at the first finding, as watch(report=) is)
        self._report_at: float | None = None
        self._pid = os.getpid()  # (a forked process, a DataLoader's worker, never writes it)
        self.options = options
        self.hunts: list[tuple[str, Hunt]] = []  # (root class name, hunt), in order of discovery
        self._stamps: dict[int, tuple[int, Finding]] = {}  # id(finding) -> (when it occurred, the finding): see _stamp
        self._first: Finding | None = None  # the first finding any hunt recorded
        self._settling = False
        self._warned_first = False
        self.warned_step = -1
        self._roots: weakref.WeakKeyDictionary[nn.Module, Hunt] = weakref.WeakKeyDictionary()
        self._owned: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()  # module -> root
        self._pending: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._parents: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()
        self._widen_ok = options.get("mode", "full") != "sentinel"  # sentinel records only the root's own calls
        self._running: list[nn.Module] = []
        self._busy = False
        self._closed = False
        self.script_hunts: list[Hunt] = []  # hunts the script opened itself
        self._aside: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # their trees: left to them
        self._creating = False
        self._unsubscribe = on_hunt_opened(self._on_hunt)
        self._handles = [
            _module_mod.register_module_forward_pre_hook(self._pre),
            _module_mod.register_module_forward_hook(self._post, always_call=True),
            _optim_mod.register_optimizer_step_pre_hook(self._pre_step),
            _module_mod.register_module_module_registration_hook(self._on_register),
        ]
        own_global_hooks(2)  # (torch.compile(module) warns while a global hook of the user's is on)
        self._orig_init: Callable[..., None] | None = torch.optim.Optimizer.__init__
        orig = self._orig_init
        me = weakref.ref(self)

        @functools.wraps(orig)
        def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            orig(opt, *args, **kwargs)
            w = me()
            if w is not None and not w._closed and not replaying_here():  # (an analysis' shadow optimizer)
                w._on_optimizer(opt)

        torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign,assignment]
        self._orig_scaler_step: Callable[..., Any] | None = torch.amp.GradScaler.step
        orig_step = self._orig_scaler_step

        @functools.wraps(orig_step)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            w = me()
            # (a scaler that hunts watch gets here from inside their wrapper, when none of them
            # watches ``optimizer``: another model's hunt may take it now, as the first took it)
            hunt = w._on_scaler(scaler, optimizer) if w is not None else None
            if hunt is not None:  # its first step() through this scaler: watched as its later ones will be
                return hunt._scaled_step(scaler, functools.partial(orig_step, scaler), optimizer, *args, **kwargs)
            return orig_step(scaler, optimizer, *args, **kwargs)

        torch.amp.GradScaler.step = step  # type: ignore[method-assign,assignment]

    # ---------------------------------------------------------------- discovery
    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # traced into a compiled graph: torch.compile(model)'s children are nobody's roots; a
            # model.compile()d root is only ever seen traced: found by an eager call (a graph break
            # dynamo makes cleanly), its hunt then sees it eagerly (CompiledRoot)
            if getattr(module, "_compiled_call_impl", None) is not None:
                torch._dynamo.disable(self._pre_eager)(module, args)
            return
        self._pre_eager(module, args)

    def _pre_eager(self, module: nn.Module, args: Any) -> None:
        if replaying_here():
            return  # a hunt replaying a recorded call: not the script's program
        running = self._running
        running.append(module)
        if len(running) > 1 or self._busy or module in self._owned or module in self._aside:
            return
        if isinstance(module, torch.jit.ScriptModule) or _compiler_graph(module):
            self._aside.add(module)  # (watch() refuses a ScriptModule: TorchScript runs its parts)
            return
        self._discover(module, self._start, module, args)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            if getattr(module, "_compiled_call_impl", None) is not None:
                torch._dynamo.disable(self._post_eager)(module)
            return
        self._post_eager(module)

    def _post_eager(self, module: nn.Module) -> None:
        if replaying_here():
            return
        running = self._running
        if module in running:
            while running and running.pop() is not module:  # a child raised and was not unwound
                pass

    def _start(self, module: nn.Module, args: Any) -> None:
        if any(m in self._aside for m in module.modules()):  # holds a tree the script watches itself
            self._aside.update(module.modules())
            return
        hunt = self._watch(self._widen(module))
        hunt._join(module, args)  # its hooks were registered during this call: let it see the call too

    def _watch(self, root: nn.Module) -> Hunt:
        """Watch ``root``: a hunt on a tree inside it is closed (its findings are kept)."""
        inner = [m for m in root.modules() if m in self._roots]
        for m in inner:  # a bigger tree that holds watched roots: watch it instead
            h = self._roots.pop(m)
            for sub in m.modules():
                self._owned.pop(sub, None)
            h.close()
        cb = _OnFind(self, self.on_find)
        self._creating = True
        try:
            hunt = watch(root, on_find=cb, **self.options)
        finally:
            self._creating = False
        cb.hunt = hunt
        self._stamp(hunt)
        self.hunts.append((type(root).__name__, hunt))
        self._roots[root] = hunt
        for sub in root.modules():
            self._owned[sub] = root
        for opt in list(self._pending):
            self._attach(opt)
        return hunt

    def _on_register(self, parent: nn.Module, name: str, sub: Any) -> None:
        """torch's global module registration hook: remember whose part each module is."""
        if isinstance(sub, nn.Module) and sub is not parent:
            self._parents[sub] = weakref.ref(parent)

    def _cover(self, module: nn.Module, ids: set[int]) -> nn.Module:
        """The smallest of ``module`` and its known ancestors whose tree holds every parameter in
        ``ids`` that its outermost known ancestor holds (a parameter outside the model, a learned
        temperature, does not stop it)."""
        chain = [module]
        while True:
            ref = self._parents.get(chain[-1])
            up = ref() if ref is not None else None
            if up is None or up in chain:
                break
            chain.append(up)
        if len(chain) == 1:
            return module
        want = ids & {id(p) for p in chain[-1].parameters()}
        for m in chain:
            if want <= {id(p) for p in m.parameters()}:
                return m
        return module

    def _widen(self, module: nn.Module, *more: torch.optim.Optimizer) -> nn.Module:
        """The root to watch for a top-level call of ``module``: itself, or the smallest ancestor
        that holds every parameter (within the model) of each known optimizer that holds some of
        its parameters: the model whose parts the loop calls one by one. Never a tree that holds
        one the script watches itself."""
        if not self._widen_ok:
            return module
        root = module
        for opt in [*more, *self._pending, *self._attached]:
            mine = {id(p) for p in root.parameters()}
            ids = _param_ids(opt)
            if mine & ids and not ids <= mine:
                root = self._cover(root, ids)
        if root is not module and any(m in self._aside for m in root.modules()):
            return module
        return root

    def _on_hunt(self, hunt: Hunt) -> None:
        """The script opened a hunt itself: its tree is left to it; an auto hunt overlapping that
        tree is closed (recording a pending finding, never raising into the script)."""
        root = hunt._root
        if self._creating or self._closed or root is None:
            return
        self.script_hunts.append(hunt)
        self._stamp(hunt)
        tree = set(root.modules())
        for m, h in list(self._roots.items()):
            if m in tree or root in set(m.modules()):
                self._roots.pop(m, None)
                for sub in m.modules():
                    self._owned.pop(sub, None)
                    self._aside.add(sub)
                self._close_quietly(h)
        self._aside.update(tree)

    @staticmethod
    def _close_quietly(hunt: Hunt, leaving: bool = False) -> None:
        if isinstance(hunt.on_find, _OnFind):
            hunt.on_find.mode = "record"
        if leaving:  # (the script left by an error before the step ended: as when a `with` block is)
            hunt._probe_unjudged_outputs()
        try:
            hunt.close(raise_pending=not leaving)  # (leaving: the other ranks are told it left by an error)
        except NonFiniteError:
            pass

    # ---------------------------------------------------------------- optimizers
    def _on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._reroot(opt)
        if not self._attach(opt):
            self._pending.add(opt)

    def _reroot(self, opt: torch.optim.Optimizer) -> None:
        """A new optimizer over a model whose parts are already watched as separate roots: watch
        the model that holds them all instead (see `_widen`)."""
        if not self._widen_ok or self._busy or self._running:  # (not from inside a call)
            return
        ids = _param_ids(opt)
        held = [m for m in list(self._roots) if any(id(p) in ids for p in m.parameters())]
        if not held:
            return
        root = self._widen(held[0], opt)
        if root is not held[0] and root not in self._owned:
            self._discover(root, self._watch, root)

    def _discover(self, module: nn.Module, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` to watch ``module``, never breaking the user's run over discovery (a
        finding still raises); no other discovery starts meanwhile."""
        self._busy = True
        try:
            fn(*args)
        except NonFiniteError:
            raise
        except Exception as e:
            warnings.warn(f"nanhunt could not watch {type(module).__name__}: {type(e).__name__}: {e}", stacklevel=3)
        finally:
            self._busy = False

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if opt not in self._attached and not self._busy and not replaying_here():
            self._busy = True
            try:
                if self._attach(opt):
                    return None
            finally:
                self._busy = False
            closure = kwargs.get("closure") if kwargs else (args[1] if len(args) > 1 else None)
            if callable(closure):
                # step(closure) (Lightning, LBFGS) with the model's first call inside the closure: the
                # hunt it opens misses this step's pre-hook, so its check comes after the closure here
                wrapped = functools.partial(self._closure_joined, opt, closure)
                if kwargs and "closure" in kwargs:
                    return args, {**kwargs, "closure": wrapped}
                return (args[0], wrapped, *args[2:]), kwargs
        return None

    def _on_scaler(self, scaler: Any, optimizer: Any) -> Hunt | None:
        """A GradScaler's ``step(optimizer)``: the hunt that watches ``optimizer`` takes the scaler as
        ``watch(scaler=...)`` would, so that the steps it skips (its scale too high: inf gradients,
        as intended) are no findings; every hunt whose optimizers step through it takes it (a GAN's
        generator and discriminator). The hunt if it took it just now, else None."""
        if self._closed or self._busy or replaying_here() or not isinstance(optimizer, torch.optim.Optimizer):
            return None
        self._busy = True
        try:
            self._attach(optimizer)  # (its first step() may be one the scaler skips)
        finally:
            self._busy = False
        hunt = next((h for h in list(self._roots.values()) if any(o is optimizer for o in h._opts)), None)
        return hunt if hunt is not None and hunt.add_scaler(scaler) else None

    def _closure_joined(self, opt: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        loss = closure()
        hunt = next((h for h in list(self._roots.values()) if any(o is opt for o in h._opts)), None)
        return hunt._closure_joined(opt, loss) if hunt is not None else loss

    def _attach(self, opt: torch.optim.Optimizer) -> bool:
        """Attach ``opt`` to the hunt owning most of its parameters; False if none owns any."""
        if opt in self._attached:
            return True
        ids = _param_ids(opt)
        best, most = None, 0
        for root, hunt in list(self._roots.items()):
            n = sum(1 for p in root.parameters() if id(p) in ids)
            if n > most:
                best, most = hunt, n
        if best is None or best.closed:
            return False
        best.add_optimizer(opt)
        self._attached.add(opt)
        self._pending.discard(opt)
        return True

    # ---------------------------------------------------------------- results
    def _stamp(self, hunt: Hunt) -> None:
        """Stamp each finding ``hunt`` records (any way: ``on_find``, a refused checkpoint) with
        when its value was made (`Hunt.occurred`) on the clock every hunt shares: the order of
        occurrence across hunts, whichever hunt judged its step first."""
        stamps = self._stamps

        def stamp(found: list[Finding]) -> None:
            for f in found:
                if id(f) not in stamps:
                    stamps[id(f)] = (hunt.occurred(f) or tick(), f)
                if self._first is None:
                    self._first = f

        hunt.on_record.append(stamp)

    def _first_stamped(self, f: Finding) -> bool:
        """``f`` is the first finding any hunt recorded."""
        return self._first is f

    def _first_to_warn(self, hunt: Hunt, f: Finding) -> bool:
        """Is ``f`` (just recorded by ``hunt``) the first finding, to be warned as such? Not once
        a first was warned; not when a finding made earlier was recorded before it; not while
        another hunt holds a step not judged yet that began before ``f``'s value was made (a GAN's
        generator, whose own step judges what the discriminator was fed): a later finding that
        turns out earlier is then warned as the first."""
        got = self._stamps.get(id(f))
        if self._warned_first or got is None or got[1] is not f:
            return False
        if any(c < got[0] for c, g in self._stamps.values() if g is not f):
            return False
        return not self._pending_before(hunt, got[0])

    def _pending_before(self, hunt: Hunt, when: int) -> bool:
        """Does a hunt other than ``hunt`` hold a step not judged yet that began before ``when``,
        while ``hunt``'s step just judged ran (a model called once long before, whose hunt never
        judges again, does not hold the warning back for good)?"""
        since = hunt.judging_since
        for h in self._all():
            tops = h._log.tops if h is not hunt and not h.closed else None
            if tops and 0 < since <= tops[0].clock < when:
                return True
        return False

    def _settle(self, raising: Hunt) -> None:
        """``raising`` is about to stop the run at the first finding recorded: the other hunts
        judge what their steps hold now (one sync each, their findings only recorded: the auto
        hunts' ``on_find`` stands aside meanwhile, a script hunt's raise is caught), so that a value
        another model made earlier (the generator's, fed to the discriminator that judged its step
        first) is the one raised."""
        self._settling = True
        try:
            for h in self._all():  # (the script's own hunts too: the run stops here; not under
                # torch.distributed, where a sync is an agreement every rank must join)
                if h is raising or h.closed or h.distributed or h._stack or not h._log.tops:
                    continue
                try:
                    h.sync()
                except Exception as exc:  # noqa: BLE001  (a script's hunt raising as it was told, or its
                    # own fault: the earliest finding is raised either way)
                    _logger.debug("nanhunt: another hunt's sync before raising: %r", exc)
        finally:
            self._settling = False

    def _merged(self) -> list[tuple[Hunt, Finding]]:
        """Every hunt's findings, in order of occurrence: each hunt's own order (a late finding of
        an earlier step goes before that hunt's later steps) merged with the others' by when they
        were recorded; an ``<outside>`` event that several hunts recorded, once."""
        rows: list[tuple[int, int, int, Hunt, Finding]] = []
        for i, h in enumerate(self._all()):
            low = None
            keyed = []
            for j in range(len(h.findings) - 1, -1, -1):  # a finding goes no later than any after it in its hunt
                f = h.findings[j]
                got = self._stamps.get(id(f))
                s = got[0] if got is not None and got[1] is f else (h.occurred(f) or tick())
                if got is None or got[1] is not f:
                    self._stamps[id(f)] = (s, f)
                low = s if low is None else min(low, s)
                keyed.append((low, i, j, h, f))
            rows.extend(reversed(keyed))
        rows.sort(key=lambda r: r[:3])
        out: list[tuple[Hunt, Finding]] = []
        kept: dict[tuple[Any, int], int] = {}  # (event, its occurrence in a hunt) -> index in out
        seen: dict[tuple[int, Any], int] = {}  # (hunt, event) -> occurrences so far
        for _, i, _, h, f in rows:
            if f.module == "<outside>":
                event = (f.phase, f.tensor, f.op, f.source, f.chain, f.index, repr(f.value), f.shape, f.dtype)  # (nan != nan)
                n = seen.get((i, event), 0)
                seen[(i, event)] = n + 1
                at = kept.get((event, n))
                if at is not None:  # the same event, recorded by another hunt too
                    if not out[at][0]._opts and h._opts:  # its step counted by an optimizer: that one
                        out[at] = (h, f)
                    continue
                kept[(event, n)] = len(out)
            out.append((h, f))
        return out

    def findings(self) -> list[Finding]:
        """Every finding of every hunt, in order of occurrence (see `_merged`)."""
        return [f for _, f in self._merged()]

    def own_findings(self) -> list[Finding]:
        """The findings of the hunts this watch opened itself, in order of occurrence (``pytest
        --nanhunt``: a test's own hunt, which raises or records as the test chose, is the test's)."""
        return [f for h, f in self._merged() if not any(h is s for s in self.script_hunts)]

    def report(self) -> Report:
        """The report of the hunt that made the first finding, with every hunt's findings."""
        merged = self._merged()
        hunt = merged[0][0] if merged else None
        if hunt is None and self.hunts:
            hunt = self.hunts[0][1]
        base = hunt.report if hunt is not None else Report()
        meta = dict(base.meta)
        names = [n for n, _ in self.hunts]
        meta["roots"] = names
        if hunt is not None:
            meta["root"] = next((n for n, h in self.hunts if h is hunt), None)
        return Report([f for _, f in merged], history=base.history, warnings=base.warnings, meta=meta)

    def _write_report(self) -> None:
        """``report`` at the first finding, then at most every `_REPORT_EVERY` seconds (the command
        writes it once more at the end): a run killed later (a job's time limit, ``os._exit``)
        still leaves it. One that cannot be written is warned once, never raised."""
        now = time.monotonic()
        if self._report_path is None or os.getpid() != self._pid or (
                self._report_at is not None and now - self._report_at < _REPORT_EVERY):
            return
        self._report_at = now
        try:
            self.report().save(self._report_path)
        except Exception as e:  # (a full disk, a folder gone: the command says it again at the end)
            warn_unwritten(f"nanhunt could not write the report to {self._report_path}: {type(e).__name__}: {e}",
                           stacklevel=user_stacklevel())
            self._report_path = None

    def _all(self) -> list[Hunt]:
        return [h for _, h in self.hunts] + self.script_hunts

    def close(self, *, leaving: bool = False) -> None:
        """Close every hunt (a pending finding is recorded, never raised), remove every hook.

        A hunt the script opened and left open gets its last sync here (recorded, never raised).
        ``leaving``: the script was left by an error: under torch.distributed the ranks still
        training name this one as left by an error, not as one that ran fewer optimizer steps."""
        if self._closed:
            return
        self._closed = True
        self._unsubscribe()
        try:
            for h in self._handles:
                h.remove()
            if self._handles:
                own_global_hooks(-2)
            self._handles.clear()
            if self._orig_init is not None:
                torch.optim.Optimizer.__init__ = self._orig_init  # type: ignore[method-assign]
                self._orig_init = None
            if self._orig_scaler_step is not None:
                torch.amp.GradScaler.step = self._orig_scaler_step  # type: ignore[method-assign]
                self._orig_scaler_step = None
            for _, hunt in self.hunts:
                self._close_quietly(hunt, leaving)
            for hunt in self.script_hunts:  # still open when the script ended: its last sync, never raising
                if not hunt.closed:
                    hunt.close(raise_pending=False)
        finally:
            self._roots = weakref.WeakKeyDictionary()
            self._owned = weakref.WeakKeyDictionary()
            self._running.clear()

    def __enter__(self) -> AutoWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _compiler_graph(module: nn.Module) -> bool:
    """``module`` is a graph ``torch.compile`` made, called by its backend's runtime (AOTAutograd's
    ``aot_eager``; dynamo's own call of a custom backend's ``gm``), not by the script: the first
    frame outside torch's module and fx calls (and nanhunt's hooks) is torch's compiler's. A
    ``GraphModule`` of the script's own (``symbolic_trace``) is called from the script's code."""
    if not isinstance(module, torch.fx.GraphModule):
        return False
    f: Any = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PASSED):
        f = f.f_back
    return f is not None and f.f_code.co_filename.startswith(_COMPILER)


def _param_ids(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}
