"""torch.distributed: nanhunt's own agreement between ranks, and gradients judged before and after reduction.

- **Names.** DDP is unwrapped (`unwrap`): findings name ``0.weight``, not ``module.0.weight``, and a
  replay runs the inner module, never DDP's forward (which would broadcast buffers on one rank).
  FSDP2 (`fully_shard`) keeps names; its parameters, gradients and optimizer state are DTensors,
  judged as this rank's shard (`_tensors.local`). A replay of an FSDP2 forward all-gathers
  parameters, and the other ranks would never join it: under FSDP2 nothing is replayed
  (`is_sharded`), the findings come from the step's log (module, output, parameter shard).
- **The agreement** (`Group`) runs on a gloo process group of nanhunt's own, made with
  ``dist_timeout``: it never issues a collective on the user's groups, so it cannot make them
  unpaired. It agrees once per training step (the watched optimizer's ``step()``, which every rank
  runs in lockstep under DDP/FSDP): one all_reduce of three int32 (this rank saw something
  non-finite; its local gradients were non-finite before the reduction; that is unknown here).
  Without a watched optimizer ranks may run different numbers of forwards (uneven inference
  shards): there nothing is agreed, each rank judges its own calls. `close()` agrees nothing.
- **A silent rank.** A rank that died or stopped answering makes the agreement fail (at once, or at
  the group's timeout); the ranks that are still there then name the absent ones through the
  rendezvous store and raise `SilentRankError`, all within ``dist_timeout``: as dead when the
  collective failed at once (a connection broke), as still running elsewhere when it ran to its time
  limit (a hang, or a collective of the user's that this rank skipped: under DDP, one more or one
  fewer ``step()`` on some rank leaves it in DDP's all-reduce while the others agree); what this
  rank found in that step is judged on its own and kept (`Hunt._end_step`). A rank whose hunt
  closed (fewer optimizer steps than the others, or its block left by an error) posts that to the
  store as it closes: it is named as such, at once, not as dead.
- **Before and after reduction** (`Distributed`): a tensor hook on each parameter
  (``register_post_accumulate_grad_hook``, which runs before DDP's reducer sees the gradient, and
  whatever comm hook or manual all_reduce the user has) probes the local gradient; FSDP2's
  reduce-scatter is wrapped to probe its input. At a hit, a rank whose gradients were finite before
  the reduction drops the gradient findings it merely received (`judge`); when no rank's were
  non-finite before it, the reduction itself overflowed: the findings' tensor ends in " (reduced)".
- **Every rank's findings** are gathered on a hit and put in one order (`merge`), so every rank
  raises with the same first finding: the culprit's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from .._finding import Finding
from .._tensors import probe

__all__ = [
    "SilentRankError", "Group", "Distributed", "rank", "world", "unwrap", "is_sharded", "judge", "merge",
    "DEFAULT_TIMEOUT",
]

DEFAULT_TIMEOUT = 300.0
REDUCED = " (reduced)"
_PHASE_ORDER = {"optimizer": 0, "forward": 1, "check": 1, "backward": 2, "grad": 3, "checkpoint": 4}
_made = itertools.count()  # nanhunt groups made in this process: names the store key of a failure


class SilentRankError(RuntimeError):
    """Ranks that died or stopped answering; ``.ranks`` lists them (empty if they could not be told)."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.bad = False  # this rank saw something non-finite in the step it could not agree on


def _dist() -> Any:
    return torch.distributed


def rank() -> int | None:
    d = _dist()
    if d.is_available() and d.is_initialized():
        return int(d.get_rank())
    return None


def world() -> int:
    d = _dist()
    if d.is_available() and d.is_initialized():
        return int(d.get_world_size())
    return 1


def unwrap(model: nn.Module) -> nn.Module:
    """DDP's inner module: names without ``module.``, replays without DDP's forward."""
    d = _dist()
    if d.is_available() and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


def is_sharded(model: nn.Module) -> bool:
    """Does FSDP2 shard any part of ``model``? (Then a replay needs every rank: none is made.)"""
    return any(_fsdp_groups(m) for m in model.modules())


def _fsdp_groups(m: nn.Module) -> list[Any]:
    get = getattr(m, "_get_fsdp_state", None)
    if get is None:
        return []
    try:
        return list(get()._fsdp_param_groups)
    except Exception:
        return []


# ---------------------------------------------------------------------------- the group
class Group:
    """A gloo process group of nanhunt's own, made on first use, every collective bounded by ``timeout``.

    The collective itself gets 90% of the time (at most 10 s less); the rest is for naming the ranks
    that did not come.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = float(timeout)
        me = rank()
        self.rank = me if me is not None else 0
        self._pg: Any = None
        self._name = ""
        self._seq = 0
        self.agreed = 0  # steps agreed (`all_max`): told to the others when this hunt closes
        self.leaving = False  # the hunt closes as its block is left by an exception (told to the others too)
        self.broken = False

    def _grace(self) -> float:
        return min(10.0, max(0.5, 0.1 * self.timeout))

    def _limit(self) -> float:  # the collective's own time limit
        return max(self.timeout - self._grace(), 0.5)

    def _group(self) -> Any:
        if self._pg is None:
            d = _dist()
            self._name = f"g{next(_made)}"
            limit = timedelta(seconds=self._limit())
            self._pg = self._run("connect", lambda: d.new_group(backend="gloo", timeout=limit))
        return self._pg

    def all_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over every rank of a few small ints (one all_reduce)."""
        d = _dist()
        t = torch.tensor(values, dtype=torch.int32)
        pg = self._group()
        self._run("agree", lambda: d.all_reduce(t, op=d.ReduceOp.MAX, group=pg))
        self.agreed += 1
        return [int(x) for x in t.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        d = _dist()
        pg = self._group()
        out: list[Any] = [None] * d.get_world_size()
        self._run("gather", lambda: d.all_gather_object(out, obj, group=pg))
        return out

    def barrier(self) -> None:
        d = _dist()
        pg = self._group()
        self._run("barrier", lambda: d.barrier(group=pg))

    def close(self) -> None:
        pg, self._pg = self._pg, None
        d = _dist()
        if pg is not None and d.is_available() and d.is_initialized():
            if not self.broken:  # (for a rank still agreeing: this one is not dead, its hunt ended, `_silent`)
                try:
                    d.distributed_c10d._get_default_store().set(f"nanhunt/{self._name}/closed/{self.rank}",
                                                                 f"{self.agreed}{'!' if self.leaving else ''}")
                except Exception:  # the store is gone with its host: nobody is left to tell
                    pass
            try:
                d.destroy_process_group(pg)
            except Exception:  # already gone with the default group, or broken: nothing to free
                pass

    def _run(self, what: str, fn: Any) -> Any:
        if self.broken:
            raise SilentRankError("nanhunt's agreement between ranks failed earlier; it is off", ())
        self._seq += 1
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:
            self.broken = True
            waited = time.monotonic() - t0
            silent, closed, note = self._silent(t0)
            me = rank()
            if silent:
                who = ", ".join(str(r) for r in silent)
                # a rank that dies breaks its connections: an agreement fails at once; one that ran to its
                # time limit broke none: the silent ranks still run, somewhere else than here (not so when
                # connecting: that waits in the store for a rank that may have died before it ever came)
                how = ("still running (no connection to it broke) but not in nanhunt's agreement: it hangs, or it "
                       "waits in a collective of your program's that this rank is not in (under DDP: the ranks "
                       "called optimizer.step() different numbers of times; every rank must call it equally often)"
                       if what != "connect" and waited >= 0.9 * self._limit() else "died or stopped answering")
                msg = (f"nanhunt (rank {me}): rank{'s' if len(silent) > 1 else ''} {who} did not answer within "
                       f"dist_timeout={self.timeout:g} s ({what}): {how}{note}. Cause: {e}")
                if closed:
                    msg = f"nanhunt (rank {me}): {_left(closed, silent, self.agreed, what)}. Cause: {e}"
                if what == "connect":  # (the first agreement: a rank that never opened a hunt never joins it)
                    msg += (". If that rank runs without nanhunt (watch() on some ranks only), open the hunt on "
                            "every rank, or pass distributed=False to judge each rank on its own")
            elif what != "connect" and waited >= 0.9 * self._limit():  # (they came, after this rank's wait)
                msg = (f"nanhunt (rank {me}): every rank came to nanhunt's agreement ({what}), but not within the "
                       f"{self._limit():g} s this rank waits for them (dist_timeout={self.timeout:g} s, less the time "
                       "kept for naming a silent rank): a rank that is that much slower at one step (an evaluation, a "
                       f"checkpoint or a data stall on that rank alone) needs a larger dist_timeout{note}. Cause: {e}")
            else:
                msg = f"nanhunt (rank {me}): the agreement between ranks failed ({what}){note}: {e}"
            raise SilentRankError(msg, tuple(silent)) from e

    def _silent(self, t0: float) -> tuple[list[int], dict[int, str], str]:
        """The ranks that did not reach this failed collective: every rank that did posts its rank
        to one store key; whoever has not posted by ``t0 + timeout`` is silent. Of those, the ones
        that closed their hunt (alive: fewer steps, or an error of their own), with the steps they agreed."""
        d = _dist()
        n = world()
        deadline = t0 + self.timeout
        key = f"nanhunt/{self._name}/{self._seq}"
        have: set[int] = set()
        closed: dict[int, str] = {}  # rank -> its steps, "!" when it left by an error
        try:
            store = d.distributed_c10d._get_default_store()
            store.append(key, f"{rank()},")
            while True:
                have = {int(x) for x in store.get(key).decode().split(",") if x}
                for r in set(range(n)) - have - set(closed):
                    ck = f"nanhunt/{self._name}/closed/{r}"
                    if store.check([ck]):
                        closed[r] = store.get(ck).decode()
                if len(have) + len(closed) >= n or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception as e:  # the store is gone too: rank 0 (which usually hosts it) or the launcher
            if not have:
                return [0], {}, f" (the rendezvous store is unreachable: {type(e).__name__})"
        silent = sorted(set(range(n)) - have)
        return silent, {r: closed[r] for r in silent if r in closed}, ""


def _left(closed: dict[int, str], silent: list[int], agreed: int, what: str) -> str:
    """The words for silent ranks of which ``closed`` closed their hunt (alive): rank -> its steps,
    ``!`` when its block was left by an exception."""
    msg = ", ".join(f"rank {r} {'left its hunt by an error' if n.endswith('!') else 'closed its hunt'} after "
                    f"{n.rstrip('!')} optimizer step{'' if n.rstrip('!') == '1' else 's'}" for r, n in closed.items())
    msg += f" while this rank, after {agreed}, went on ({what})"
    if all(n.endswith("!") for n in closed.values()):
        msg += ": see that rank's own error"
    else:
        msg += (": the ranks ran different numbers of optimizer steps (every rank must call step() equally "
                "often; with uneven data, pass distributed=False)")
    gone = [str(r) for r in silent if r not in closed]
    if gone:
        msg += f"; rank{'s' if len(gone) > 1 else ''} {', '.join(gone)} died or stopped answering"
    return msg


# ---------------------------------------------------------------------------- one hunt's view
class Distributed:
    """One hunt's part in the agreement: its group, and its gradients' state before reduction."""

    def __init__(self, model: nn.Module, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.group = Group(timeout)
        self.pre: list[torch.Tensor] = []  # probes of local gradients this step (device-side)
        self.sharded = is_sharded(model)
        self._handles: list[Any] = []
        me = weakref.ref(self)
        for p in model.parameters():
            if p.requires_grad and type(p).__name__ != "DTensor":
                self._handles.append(p.register_post_accumulate_grad_hook(partial_local_grad(me)))
        for m in model.modules():
            for g in _fsdp_groups(m):
                self._handles.append(_CheckedReduceScatter.install(g, me))

    def agree(self, flag: torch.Tensor | None, has_grads: bool) -> tuple[bool, list[int]]:
        """This rank's answer and every rank's, from one all_reduce; the step's one host read."""
        pre, self.pre = self.pre, []
        parts = [flag if flag is not None else torch.zeros((), dtype=torch.bool)]
        parts.append(~torch.isfinite(torch.stack([p.to(parts[0].device) for p in pre])).all()
                     if pre else torch.zeros((), dtype=torch.bool, device=parts[0].device))
        local = [bool(x) for x in torch.stack([p.to(parts[0].device) for p in parts]).tolist()]  # the one sync
        values = [int(local[0]), int(local[1]), int(has_grads and not pre)]
        try:
            agreed = self.group.all_max(values)
        except SilentRankError as e:
            e.bad = local[0]  # (this rank still judges its own step: `Hunt._end_step`)
            raise
        return local[0], [*agreed, int(local[1])]

    def forget(self) -> None:
        self.pre = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.pre = []
        self.group.close()


def partial_local_grad(me: weakref.ref[Distributed]) -> Any:
    def hook(p: torch.Tensor) -> None:
        d = me()
        if d is not None and p.grad is not None:
            d.pre.append(probe(p.grad))
    return hook


class _Restore:
    def __init__(self, group: Any, ours: Any, prev: Any) -> None:
        self.group, self.ours, self.prev = group, ours, prev

    def remove(self) -> None:
        if self.group is not None and getattr(self.group, "_reduce_scatter_comm", None) is self.ours:
            self.group._reduce_scatter_comm = self.prev
        self.group = self.ours = self.prev = None


class _CheckedReduceScatter:
    """FSDP2's reduce-scatter with a probe of its input: the rank's gradients before the reduction."""

    def __init__(self, inner: Any, owner: weakref.ref[Distributed]) -> None:
        self.inner = inner
        self.owner = owner

    @classmethod
    def install(cls, group: Any, owner: weakref.ref[Distributed]) -> _Restore:
        prev = group._reduce_scatter_comm
        ours = cls(prev, owner)
        group._reduce_scatter_comm = ours
        return _Restore(group, ours, prev)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        d = self.owner()
        if d is not None:
            d.pre.append(probe(input_tensor))
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


# ---------------------------------------------------------------------------- findings
def judge(found: list[Finding], agreed: list[int] | None) -> list[Finding]:
    """This rank's findings in the light of every rank's gradients before the reduction.

    ``agreed``: [anyone bad, anyone's local gradients bad, anyone's unknown, this rank's local bad];
    None when nothing was agreed (no optimizer step): only the class names are made plain.
    """
    found = [_plain_type(f) for f in found]
    if agreed is None:
        return found
    _, any_pre, unknown, own_pre = agreed
    if unknown or not any(f.phase == "grad" for f in found):
        return found
    if any_pre:
        if own_pre:
            return found
        return [f for f in found if f.phase != "grad"]  # received through the reduction: not ours
    out = []
    for f in found:
        if f.phase == "grad" and not f.tensor.endswith(REDUCED):
            f = dataclasses.replace(
                f, tensor=f.tensor + REDUCED, cause="created",
                hint=("finite on every rank before the gradient reduction and non-finite after it: the "
                      "sum over ranks overflowed its dtype. Reduce in float32, or divide before summing."),
            )
        out.append(f)
    return out


def _plain_type(f: Finding) -> Finding:
    """FSDP2 makes each sharded module an instance of a new class ``FSDP<Class>``: name the user's."""
    if f.module_type.startswith("FSDP") and len(f.module_type) > 4 and f.module_type != "FSDPModule":
        return dataclasses.replace(f, module_type=f.module_type[4:])
    return f


def merge(everyone: list[list[dict[str, Any]] | None]) -> list[Finding]:
    """Every rank's findings in one order, the same on every rank: by step, phase (parameters and
    state from the last step, then forward, backward, accumulated gradients), then those a replay
    reproduced before the others, then the ranks whose first finding of that step and phase knows
    its cause, then rank. (A value a collective in the forward brought from
    another rank, a tensor-parallel all_reduce, is reproduced only on the rank that made it: a
    replay on one rank alone cannot run the collective. Under FSDP2 a weight non-finite in one
    rank's shard is all-gathered into every rank's forward: only the rank holding it can say
    `"parameter"`.) A finding seen by several ranks (the same reduced gradient under DDP) is kept
    once, from the lowest rank."""
    seen: set[str] = set()
    rows = []
    unknown: dict[tuple[int, int, str], bool] = {}  # (rank, step, phase) -> its first finding there has no cause
    for r, fs in enumerate(everyone):
        for i, d in enumerate(fs or ()):
            key = json.dumps({k: v for k, v in d.items() if k != "rank"} if d.get("tensor", "").endswith(REDUCED)
                             else d, sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            f = Finding.from_dict(d)
            vague = unknown.setdefault((r, f.step, f.phase), f.cause == "unknown")  # (a rank's own order is kept)
            rows.append((f.step, _PHASE_ORDER.get(f.phase, 5), not f.reproducible, vague,
                         f.rank if f.rank is not None else r, r, i, f))
    rows.sort(key=lambda x: x[:7])
    return [x[7] for x in rows]
