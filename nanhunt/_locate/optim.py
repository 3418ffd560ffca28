"""After an optimizer finding: the op that writes the reported tensor in that optimizer's update.

The step itself is gone (the parameters and state were overwritten), so the op is found on a
*shadow*: a fresh optimizer of the same `torch.optim` class and hyperparameters, over a one-element
copy of the parameter (same dtype and device), stepped twice under a dispatch mode that notes
which aten op last wrote the parameter and each state tensor.

A hand-written optimizer (`custom_origin`): its own code is the user's, so its op *and line* are
worth finding. A shadow of its class over a copy of the one parameter (its non-finite values set
to 0: what it held before the step is gone), with the parameter's gradient and a deep copy of
its state, is stepped once under the op-level recorder (without step hooks; the RNG put back; not
under torch.distributed, where a step may call collectives); the op that made a non-finite value
from finite ones on the path to the reported element is the answer. Its step runs user code once
more, as every replay does; nothing it touches is the user's (fresh tensors, a fresh instance, the
instance's plain containers rebuilt): a write into any other tensor (state kept outside
``self.state``: moments in a list by position, a dict by name, a step counter tensor) stops the
shadow before it is made, and the op is then not found.
"""

from __future__ import annotations

import collections
import copy
import inspect
import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["stepped_by", "update_op", "settings_text", "custom_origin", "eps_rounds_to_zero", "bad_hyperparameter", "past_bad_lr", "lr_at",
           "grad_facts"]


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The parameter group that holds ``p`` (StopIteration when none does)."""
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def _noted(opt: torch.optim.Optimizer, p: torch.Tensor, i: int,
           noted: dict[tuple[int, int], tuple[int, float]]) -> tuple[int, tuple[int, float]] | None:
    """``p``'s group index in optimizer ``i`` and what the hunt noted for that group (``noted``, keyed
    by (optimizer, group)), else None."""
    gi = next((gi for gi, g in enumerate(opt.param_groups) if any(q is p for q in g["params"])), None)
    got = noted.get((i, gi)) if gi is not None else None
    return (gi, got) if gi is not None and got is not None else None


class _Foreign(Exception):
    """The shadow step was about to write a tensor it was not given and did not make."""


class _OwnWrites(TorchDispatchMode):
    """Lets the shadow step write only the tensors it owns (storages in ``own``: its parameter,
    gradient and state, and whatever it makes); a write into any other (the user's) raises
    `_Foreign` before it happens."""

    def __init__(self, own: set[int]) -> None:
        super().__init__()
        self.own = own

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.own
                       for x in tree_leaves(v)):
                    raise _Foreign(str(func))
        out = func(*args, **kwargs)
        self.own.update(x.untyped_storage().data_ptr() for x in tree_leaves(out) if isinstance(x, torch.Tensor))
        return out


def _unshared(v: Any) -> Any:
    """``v`` with its plain containers (list, tuple, set, dict) rebuilt all the way down, anything
    else as it is: what the shadow step appends or sets there is its own."""
    if type(v) in (list, tuple, set):
        return type(v)(_unshared(x) for x in v)
    if isinstance(v, dict):
        c = copy.copy(v)
        c.update((k, _unshared(x)) for k, x in v.items())
        return c
    return v


class _Writes(TorchDispatchMode):
    """Notes the aten op that last wrote each target, and the first that made one non-finite; and,
    by storage, the first op that made any other tensor it writes non-finite (``fresh``: a state the
    step creates, Adam's ``exp_avg_sq``, before it is known)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr(): k for k, t in targets.items()}
        self.last: dict[str, str] = {}
        self.made: dict[str, str] = {}
        self.fresh: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for x in tree_leaves(v):
                    if isinstance(x, torch.Tensor):
                        ptr = x.untyped_storage().data_ptr()
                        written.append((self.ptrs.get(ptr), ptr, x, bool(torch.isfinite(x).all())))
        out = func(*args, **kwargs)
        for k, ptr, x, finite in written:
            if k is not None:
                self.last[k] = str(func)
            if finite and not bool(torch.isfinite(x).all()):
                if k is not None:
                    self.made.setdefault(k, str(func))
                self.fresh.setdefault(ptr, str(func))
        return out


def update_op(opt: torch.optim.Optimizer, p: torch.Tensor, key: str) -> tuple[str | None, bool]:
    """The aten op that writes ``p`` (``key=""``) or ``state[key]`` in ``opt``'s update, and whether
    the settings alone make it non-finite: the shadow's update does so from a weight of 1 and a
    gradient of 0.5 (a weight decay of 1e41 in AdamW's ``mul_``); the op is then the one that
    did, else the last that writes it."""
    got = _shadow_writes(opt, p)
    if got is None:
        return None, False
    made = got.made.get(key)
    return made or got.last.get(key), made is not None


def settings_text(opt: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """``p``'s group's numeric settings, the large ones (|x| >= 1e4) alone when there are any."""
    try:
        group = _group_of(opt, p)
    except StopIteration:
        return ""
    nums = {k: v for k, v in group.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    large = {k: v for k, v in nums.items() if abs(v) >= 1e4}
    return ", ".join(f"{k}={v:g}" for k, v in (large or nums).items())


def stepped_by(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.optim.Optimizer | None:
    """The ``torch.optim`` optimizer that a wrapper optimizer (a Lookahead that runs
    ``Optimizer.__init__`` and steps ``.optimizer``; ``base_optimizer``) steps ``p`` with, else None."""
    for _ in range(8):
        if type(opt).__module__.split(".")[:2] == ["torch", "optim"]:
            return opt
        inner = next((o for o in (getattr(opt, k, None) for k in ("optimizer", "base_optimizer"))
                      if isinstance(o, torch.optim.Optimizer) and o is not opt
                      and any(q is p for g in o.param_groups for q in g["params"])), None)
        if inner is None:
            return None
        opt = inner
    return None


def _shadow_writes(opt: torch.optim.Optimizer, p: torch.Tensor) -> _Writes | None:
    try:
        if type(opt).__module__.split(".")[:2] != ["torch", "optim"]:
            return None
        group = _group_of(opt, p)
        accepted = inspect.signature(type(opt).__init__).parameters
        # a NaN/inf setting (lr = nan from a warm-up over 0 steps) fails the constructor's checks; the
        # op that writes the tensor does not depend on its value
        hp: dict[str, Any] = {k: _finite(v) for k, v in group.items() if k in accepted and k != "params"}
        with torch.no_grad():
            q = torch.nn.Parameter(torch.ones(1, dtype=p.dtype, device=p.device))
        q.grad = torch.full_like(q, 0.5)
        shadow = type(opt)([q], **hp)
        first = _Writes({"": q})
        with first:
            shadow.step()  # creates the state
        targets = {"": q, **{k: v for k, v in shadow.state[q].items() if isinstance(v, torch.Tensor) and v.dim()}}
        w = _Writes(targets)
        w.made.update(first.made)
        for k, v in targets.items():  # (a state the first step created and overflowed: a weight decay of 1e37 squared)
            if k and (made := first.fresh.get(v.untyped_storage().data_ptr())) is not None:
                w.made.setdefault(k, made)
        with w:
            shadow.step()
        return w
    except Exception:
        return None


def _finite(v: Any) -> Any:
    """A setting for the shadow: a non-finite float or one-element tensor (a tensor lr) as 1e-3."""
    if isinstance(v, float) and not math.isfinite(v):
        return 1e-3
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point() and not bool(torch.isfinite(v)):
        return torch.full_like(v, 1e-3)
    return v


def custom_origin(opt: torch.optim.Optimizer, p: torch.Tensor, key: str,
                  index: tuple[int, ...] | None) -> tuple[str, str | None, list[str]] | None:
    """``(op, source, chain)`` of the reported element of ``p`` (``key=""``) or ``state[key]`` in a
    hand-written optimizer's update, from a shadow step (see the module docstring), else None."""
    from .oplevel import _chain, _Mode, _Recorder  # the forward op trace's recorder

    try:
        if type(opt).__module__.split(".")[:2] == ["torch", "optim"]:
            return None
        group = _group_of(opt, p)
        g = p.grad
        if g is None or g.is_sparse or not bool(torch.isfinite(g).all()):
            return None
        with torch.no_grad():
            q = torch.nn.Parameter(torch.nan_to_num(p.detach().clone(), nan=0.0, posinf=0.0, neginf=0.0),
                                   requires_grad=p.requires_grad)
            q.grad = g.detach().clone()
            state = copy.deepcopy(dict(opt.state.get(p, {})))  # nothing of it shared: lists, counters
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    state[k] = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        # the shadow: the optimizer's own attributes, its own hook dicts (empty), one group of q
        # (its __init__ is not run again: it may log or count)
        shadow = object.__new__(type(opt))
        shadow.__dict__.update((k, _unshared(v)) for k, v in opt.__dict__.items())
        shadow.__dict__.update(
            param_groups=[{**group, "params": [q]}], state=collections.defaultdict(dict),
            _optimizer_step_pre_hooks=collections.OrderedDict(), _optimizer_step_post_hooks=collections.OrderedDict(),
            _optimizer_state_dict_pre_hooks=collections.OrderedDict(),
            _optimizer_state_dict_post_hooks=collections.OrderedDict(),
            _optimizer_load_state_dict_pre_hooks=collections.OrderedDict(),
            _optimizer_load_state_dict_post_hooks=collections.OrderedDict())
        if state:
            shadow.state[q] = state
        step = getattr(type(opt).step, "__wrapped__", None)  # the step itself, without the global step hooks
        rec = _Recorder()
        mode = _Mode(rec)
        mode.on = True
        own = {t.untyped_storage().data_ptr() for t in tree_leaves((q, q.grad, state)) if isinstance(t, torch.Tensor)}
        rng = torch.get_rng_state()
        try:
            with _OwnWrites(own), mode:
                if step is not None:
                    step(shadow)
                else:
                    shadow.step()
        finally:
            torch.set_rng_state(rng)
        target = q if not key else shadow.state.get(q, {}).get(key)
        if not isinstance(target, torch.Tensor):
            return None
        code, prod = rec.lookup(target)
        if code is None or prod is None:
            return None  # finite on the shadow: not reproduced
        path = rec.walk(prod, index)
        if not path:
            return None
        first = rec.recs[path[0]]
        return first.op, first.src, _chain(rec, path)
    except Exception:
        return None


def eps_rounds_to_zero(opt: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """``repr(eps)`` when the group's ``eps`` is 0 in ``p``'s dtype (Adam's 1e-8 in float16), else ""."""
    try:
        group = _group_of(opt, p)
        eps = group.get("eps")
        if isinstance(eps, float) and eps > 0 and p.is_floating_point() and p.dtype != torch.float32:
            if float(torch.tensor(eps, dtype=p.dtype)) == 0.0:
                return repr(eps)
    except Exception:
        pass
    return ""


def bad_hyperparameter(opt: torch.optim.Optimizer, p: torch.Tensor) -> str:
    """``param_groups[g]['lr'] = inf`` for the first non-finite number among the settings of
    ``p``'s parameter group (a warm-up schedule that divided by 0), else ""."""
    for gi, group in enumerate(opt.param_groups):
        if not any(q is p for q in group["params"]):
            continue
        for key, v in group.items():
            vals = v if isinstance(v, (tuple, list)) and key != "params" else (v,)
            for x in vals:
                if isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point():
                    x = float(x)
                if isinstance(x, float) and not math.isfinite(x):
                    return f"param_groups[{gi}][{key!r}] = {x}"
        return ""
    return ""


def past_bad_lr(opt: torch.optim.Optimizer, p: torch.Tensor, i: int, seen: dict[tuple[int, int], tuple[int, float]],
                since: int, step: int) -> tuple[str, int] | None:
    """``("param_groups[g]['lr'] = inf", s)`` when ``p``'s group of optimizer ``i`` ran its step() of
    step ``s`` (``since < s <= step``) with a non-finite lr (``seen``: as the hunt noted it then), else
    None: a schedule's lr finite again by the reading that found the weights it poisoned."""
    got = _noted(opt, p, i, seen)
    if got is None or not since < got[1][0] <= step:
        return None
    gi, (s, lr) = got
    return f"param_groups[{gi}]['lr'] = {lr}", s


def lr_at(opt: torch.optim.Optimizer, p: torch.Tensor, i: int, noted: dict[tuple[int, int], tuple[int, float]],
          step: int) -> float | None:
    """The lr that ``p``'s group of optimizer ``i`` ran its step() of ``step`` with, as the hunt noted
    it then (``noted``: each group's last), else None: a schedule has moved the group's lr on since."""
    got = _noted(opt, p, i, noted)
    return got[1][1] if got is not None and got[1][0] == step else None


# the division that eps guards in each torch.optim update, named by the optimizer's own state; that
# state (0 where every gradient so far was 0) and what it holds
_DIVISIONS: tuple[tuple[type, str, str, str], ...] = (
    (torch.optim.Adam, "exp_avg / sqrt(exp_avg_sq)", "exp_avg_sq", "a running mean of squared gradients"),
    (torch.optim.AdamW, "exp_avg / sqrt(exp_avg_sq)", "exp_avg_sq", "a running mean of squared gradients"),
    (torch.optim.NAdam, "exp_avg / sqrt(exp_avg_sq)", "exp_avg_sq", "a running mean of squared gradients"),
    (torch.optim.RAdam, "exp_avg / sqrt(exp_avg_sq)", "exp_avg_sq", "a running mean of squared gradients"),
    (torch.optim.Adamax, "exp_avg / exp_inf", "exp_inf", "a running maximum of the gradient's size"),
    (torch.optim.RMSprop, "grad / sqrt(square_avg)", "square_avg", "a running mean of squared gradients"),
    (torch.optim.Adagrad, "grad / sqrt(sum)", "sum", "the running sum of squared gradients"),
    (torch.optim.Adadelta, "sqrt(acc_delta) / sqrt(square_avg)", "square_avg", "a running mean of squared gradients"),
)


def _eps_default(opt: torch.optim.Optimizer) -> float | None:
    """``opt``'s class's default eps (None when it has none)."""
    try:
        default = inspect.signature(type(opt).__init__).parameters["eps"].default
    except (KeyError, TypeError, ValueError):
        default = None
    return default if isinstance(default, float) and default > 0 else None


def grad_facts(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """What the numbers say of ``p``'s update, for the hint (after a hit: host reads allowed):
    ``eps`` (the group's, when it is exactly 0, with ``eps_default``, the class's default), ``lr``
    (the group's, when finite) and, with it, for a torch.optim class whose update is known,
    ``update_division`` (``guarded``, "" for SGD's: none), ``zero_grad`` (the gradient is 0 everywhere) or
    ``zero_some`` (somewhere), ``grad_max`` (its largest magnitude, when its square passes the
    dtype's largest value, with ``bad_state``, the first of ``p``'s optimizer states that is
    non-finite, or None); for a torch.optim class with a denominator, always ``denominator`` (the
    state eps guards: Adam's ``exp_avg_sq``, RMSprop's ``square_avg``), ``holds`` (what it holds, in
    words) and ``guarded`` (the division); for centered RMSprop whose ``square_avg - grad_avg**2`` is
    negative somewhere, ``negative_variance`` (its least value). Only those and ``eps`` when the gradient is gone
    (``zero_grad()`` ran) or non-finite (read a step later, in sentinel mode, after the poisoned
    weights made the next gradient NaN)."""
    out: dict[str, Any] = {}
    for c, division, state, holds in _DIVISIONS:
        if isinstance(opt, c):
            out.update(denominator=state, holds=holds, guarded=division)
            break
    try:
        group = _group_of(opt, p)
        eps = group.get("eps")
        if isinstance(eps, (int, float)) and eps == 0:
            out["eps"] = 0.0
            out["eps_default"] = _eps_default(opt)
        state = opt.state.get(p, {})
        sa, ga = state.get("square_avg"), state.get("grad_avg")
        if group.get("centered") and isinstance(sa, torch.Tensor) and isinstance(ga, torch.Tensor):
            # centered RMSprop's sqrt(square_avg - grad_avg^2), as its update computes it: a variance of
            # 0 (a gradient constant over the steps) that rounding made negative, whose sqrt is nan
            var = torch.addcmul(sa, ga, ga, value=-1)
            if bool((var < 0).any()):
                out["negative_variance"] = float(var.min())
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = float(lr)
        if isinstance(lr, (int, float)) and math.isfinite(lr):
            out["lr"] = float(lr)
            if isinstance(opt, torch.optim.SGD) or "guarded" in out:  # (SGD's update divides by nothing)
                out["update_division"] = out.get("guarded", "")
        g = p.grad
        if g is None or g.is_sparse or not g.is_floating_point() or not g.numel():
            return out
        g = g.detach()
        if not bool(torch.isfinite(g).all()):
            return out
        out["custom"] = type(opt).__module__.split(".")[:2] != ["torch", "optim"]
        zeros = int((g == 0).sum())
        if zeros == g.numel():
            out["zero_grad"] = True
        elif zeros:
            out["zero_some"] = True
        gmax = float(g.abs().max())
        if gmax * gmax > torch.finfo(g.dtype).max:
            out["grad_max"] = gmax
            out["dtype"] = str(g.dtype).replace("torch.", "")
            out["bad_state"] = next((k for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)
                                     and v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    except Exception:
        return {}
    return out
