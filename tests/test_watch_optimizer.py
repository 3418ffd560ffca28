"""Optimizer: parameters and state after step(), exploding learning rates, Adam's exp_avg_sq,
GradScaler's skipped steps, and several optimizers."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import linecache
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import nanhunt

from . import zoo
from .zoo import assert_finding, bit_equal, same_state, snapshot


def _data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _classifier() -> zoo.MLP:
    return zoo.mlp(d_out=3)


def _first_bad_after_step(opt: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[str, str, str, Any] | None:
    """(module name, module type, tensor, value) of the first non-finite parameter or state, in
    parameter order (each parameter, then its state)."""
    owner = {id(p): (mn, pn, type(m).__name__) for mn, m in model.named_modules()
             for pn, p in m.named_parameters(recurse=False)}
    for group in opt.param_groups:
        for p in group["params"]:
            mn, pn, mt = owner[id(p)]
            if not torch.isfinite(p).all():
                return mn, mt, pn, p.detach().clone()
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and not torch.isfinite(v).all():
                    return mn, mt, f"state[{k!r}]", v.detach().clone()
    return None


def _regression_data(x_scale: float, n: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g) * x_scale, torch.randn(16, 1, generator=g)) for _ in range(n)]


def _regression() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 1))


@pytest.mark.parametrize("lr", [
    5.0,
    1.0,
])
def test_exploding_learning_rate_overflows_the_parameters(lr: float) -> None:
    """A warm-up gone wrong: lr x10 per step. SGD diverges until an update overflows float32's max
    in the parameters themselves (the activations, |x| < 1, are still finite). With lr=1.0 the
    last finite activations before the overflow are near float32's max. The loss is computed in
    float64: their squared error would overflow float32 first, in the loss, and nanhunt would
    rightly report that earlier value (born outside the model)."""
    data = _regression_data(0.2)

    def growing(step: int) -> float:
        return 10.0 ** step

    ref = _regression()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, growing)
    states, expected, bad_step = [], None, -1
    for k, (x, y) in enumerate(data):
        out = ref(x)
        assert torch.isfinite(out).all(), "test set-up: the optimizer overflows before the forward does"
        F.mse_loss(out.double(), y.double()).backward()
        assert all(torch.isfinite(p.grad).all() for p in ref.parameters()), "test set-up: finite gradients"
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        states.append(snapshot(ref))
        expected = _first_bad_after_step(ref_opt, ref)
        if expected is not None:
            bad_step = k
            break
    assert expected is not None and bad_step >= 3, "test set-up: parameters overflow after a few steps"

    m = _regression()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, growing)
    done, forwards = [], []
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for k, (x, y) in enumerate(data):
            forwards.append(k)
            F.mse_loss(m(x).double(), y.double()).backward()
            opt.step()
            done.append(k)
            opt.zero_grad()
            sched.step()
    mn, mt, tensor, t = expected
    assert_finding(ei.value.finding, phase="optimizer", module=mn, module_type=mt, tensor=tensor, step=bad_step,
                   call=0, cause="created", expected=t)
    # the error comes from the step() that made it (on CPU: no device to wait for), so the model's
    # next forward never runs on the overflowed weights; the weights are those that step produced
    assert forwards[-1] == bad_step and done[-1] == bad_step - 1
    assert same_state(snapshot(m), states[bad_step])


@pytest.mark.parametrize("make, division", [
    (lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9, nesterov=True), ""),
    (lambda ps: torch.optim.Adagrad(ps, lr=1.0), "grad / (sqrt(sum) + eps)"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1.0), "grad / (sqrt(square_avg) + eps)"),
], ids=["sgd-nesterov", "adagrad", "rmsprop"])
def test_an_exploding_learning_rate_names_the_lr_and_only_the_optimizers_own_division(make: Any, division: str) -> None:
    """A warm-up that multiplies lr by 1000 every step, in SGD (nesterov), Adagrad and RMSprop: the
    step whose update overflows is the finding. Its hint named Adam's sqrt(exp_avg_sq) + eps, which
    none of them has, and not the learning rate the step used (1e+15 and up)."""
    data = _regression_data(0.2)
    ref = _regression()
    ref_opt = make(ref.parameters())
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1000.0 ** s)
    bad_step, lr = -1, 0.0
    for k, (x, y) in enumerate(data):
        F.mse_loss(ref(x).double(), y.double()).backward()
        lr = ref_opt.param_groups[0]["lr"]
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        if _first_bad_after_step(ref_opt, ref) is not None:
            bad_step = k
            break
    assert bad_step >= 3, "test set-up: the weights overflow after a few steps"

    m = _regression()
    opt = make(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1000.0 ** s)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for x, y in data:
            F.mse_loss(m(x).double(), y.double()).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", bad_step, "created"), f
    assert f"its lr is {lr:.3g}" in f.hint and "exp_avg_sq" not in f.hint, f.hint
    assert (division in f.hint) if division else "denominator" not in f.hint, f.hint


def test_adam_exp_avg_sq_overflows_on_huge_gradients() -> None:
    data = _data(3)
    scale = [1.0, 1e22, 1.0]  # an unscaled loss at step 1: gradients ~1e21, squared 1e42 > float32 max

    ref = _classifier()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for k, (x, y) in enumerate(data[:2]):
        (F.cross_entropy(ref(x), y) * scale[k]).backward()
        assert all(torch.isfinite(p.grad).all() for p in ref.parameters())
        ref_opt.step()
        ref_opt.zero_grad()
        if k == 0:
            assert _first_bad_after_step(ref_opt, ref) is None
    expected = _first_bad_after_step(ref_opt, ref)
    assert expected is not None and expected[2] == "state['exp_avg_sq']"

    m = _classifier()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for k, (x, y) in enumerate(data):
            (F.cross_entropy(m(x), y) * scale[k]).backward()
            opt.step()
            opt.zero_grad()
    mn, mt, tensor, t = expected
    assert_finding(ei.value.finding, phase="optimizer", module=mn, module_type=mt, tensor=tensor, step=1,
                   call=0, cause="created", expected=t)
    assert ei.value.finding.module_type == "Linear"


def test_optimizer_step_applied_from_non_finite_gradients_is_cause_input() -> None:
    """In record mode the step is applied; the parameters it poisons were fed non-finite gradients."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    x[1, 2:] = x[1, :2]  # sqrt at 0 in backward: nan gradients reach every parameter
    m = zoo.distnet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    phases = [f.phase for f in hunt.findings]
    assert phases[0] == "backward" and "optimizer" in phases, hunt.findings
    f = hunt.findings[phases.index("optimizer")]
    assert (f.step, f.call) == (0, 0)
    assert f.cause == "input", f


# ---------------------------------------------------------------------------- GradScaler
def _amp_run(m: torch.nn.Module, pass_scaler: bool, init_scale: float = 2.0**20
             ) -> tuple[nanhunt.Hunt, torch.amp.GradScaler, list[int]]:
    data = _data(8)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    applied = []
    with nanhunt.watch(m, opt, on_find="record", scaler=scaler if pass_scaler else None) as hunt:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = m(x)
            loss = F.cross_entropy(logits.float(), y)
            scaler.scale(loss).backward()
            before = snapshot(m)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            applied.append(int(not same_state(before, snapshot(m))))
    return hunt, scaler, applied


def test_gradscaler_skipped_steps_are_not_findings() -> None:
    m = _classifier()
    hunt, scaler, applied = _amp_run(m, pass_scaler=True)
    assert applied[0] == 0 and 1 in applied, "test set-up: the scaler skips, then applies steps"
    assert hunt.findings == []
    assert scaler.get_scale() < 2.0**20
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_steps_the_gradscaler_skipped_count_as_in_the_users_loop(mode: str, lookahead: bool) -> None:
    """A huge initial scale: the scaler skips the first iterations (expected, not findings), each
    still a step as the loop counts it; then a batch in raw units overflows a Linear in float16.
    The finding names that iteration, call 0 (before: step 2 or 'step 0, call 6'). Through a
    Lookahead (``scaler.step(lookahead)``) the scaler's skipped steps were not counted: the scaler
    wrapper looked for the Lookahead among the watched optimizers, which hold the SGD it steps."""
    m = _classifier()
    opt: Any = torch.optim.SGD(m.parameters(), lr=1e-2)
    if lookahead:
        opt = _Lookahead(opt, None, k=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    applied: list[int] = []
    bad = 7
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, opt, scaler=scaler, mode=mode) as hunt:
            for i, (x, y) in enumerate(_data(10)):
                if i == bad:
                    x = torch.full_like(x, 7e4)
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = m(x)
                scaler.scale(F.cross_entropy(logits.float(), y)).backward()
                before = snapshot(m)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                applied.append(int(not same_state(before, snapshot(m))))
                assert hunt.step == i + 1
    assert applied[:2] == [0, 0] and 1 in applied, "test set-up: the scaler skips the first steps, then applies"
    f = ei.value.finding
    assert (f.phase, f.step, f.call, f.dtype) == ("forward", bad, 0, "float16"), f


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_clipped_after_unscale_on_a_step_the_gradscaler_skips_are_not_findings(mode: str) -> None:
    """The AMP recipe with clipping: ``scaler.unscale_(opt)``, then ``clip_grad_norm_``. On a step
    whose scaled gradients overflowed (the scaler skips it, as expected) the clipping's norm is inf
    and the clipped gradients inf * 0 = nan: that loop code's values were probed like any, so every
    skipped step was a hit (a replay analysis each), and sentinel's replay of the backward then
    reported the scaled gradient at the model's output, raising on a healthy run. Training is the
    same, bit for bit, as unwatched."""

    def train(watched: bool) -> tuple[list[int], Any, nanhunt.Hunt | None]:
        torch.manual_seed(0)
        m = _classifier()
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
        hunt = nanhunt.watch(m, opt, scaler=scaler, mode=mode) if watched else None
        applied = []
        try:
            for x, y in _data(6):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = m(x)
                scaler.scale(F.cross_entropy(logits.float(), y)).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                before = snapshot(m)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                applied.append(int(not same_state(before, snapshot(m))))
        finally:
            if hunt is not None:
                hunt.close()
        return applied, snapshot(m), hunt

    applied, state, hunt = train(True)
    assert applied[:2] == [0, 0] and 1 in applied, "test set-up: the scaler skips the first steps, then applies"
    assert hunt is not None and hunt.findings == [] and hunt.step == 6
    assert same_state(state, train(False)[1])


def test_without_the_scaler_its_overflowing_gradients_are_findings() -> None:
    hunt, _, applied = _amp_run(_classifier(), pass_scaler=False, init_scale=2.0**24)
    assert applied[0] == 0
    assert hunt.findings, "the fp16 gradient overflow is reported when the scaler is not passed"
    f = hunt.first
    assert f.phase in ("backward", "grad") and f.step == 0 and f.dtype in ("float16", "float32")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_without_the_scaler_a_skipped_step_still_raises_by_the_next_forward(mode: str) -> None:
    # the scaler skips step() (no optimizer step hook runs), then zero_grad(): the inf gradients
    # of iteration 0 raise at the model's next forward at the latest, not when a step() finally runs
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    done = []
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, opt, mode=mode):
            for i, (x, y) in enumerate(_data(8)):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = m(x)
                scaler.scale(F.cross_entropy(logits.float(), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                done.append(i)
    assert done == [0], "raised at iteration 1's forward"
    f = ei.value.finding
    assert f.phase in ("backward", "grad") and f.step == 0 and f.value is not None
    hunt_findings = ei.value.report.findings
    assert len({f.phase for f in hunt_findings}) == len(hunt_findings), "one finding per phase"


def test_gradscaler_with_bfloat16_autocast_trains_without_findings() -> None:
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(m, opt, scaler=scaler) as hunt:
        for x, y in _data(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert hunt.findings == [] and hunt.step == 3
    assert "step" not in vars(scaler), "the scaler is left as it was"


# ---------------------------------------------------------------------------- several optimizers
def test_a_list_of_optimizers_each_watched() -> None:
    """Body on SGD, head on Adam: the head's optimizer state overflows at step 1."""
    data = _data(3)
    m = _classifier()
    body = [p for n, p in m.named_parameters() if n.startswith("0.")]
    head = [p for n, p in m.named_parameters() if n.startswith("3.")]
    opts = [torch.optim.SGD(body, lr=1e-2), torch.optim.Adam(head, lr=1e-3)]
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opts):
        for k, (x, y) in enumerate(data):
            (F.cross_entropy(m(x), y) * (1e22 if k == 1 else 1.0)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.module_type, f.tensor) == ("optimizer", "3", "Linear", "state['exp_avg_sq']")
    assert f.index is not None and f.value == float("inf")


def _two_optimizer_lognet() -> tuple[zoo.LogNet, list[torch.optim.Optimizer], torch.Tensor]:
    """A LogNet with one optimizer per layer (lr 0: the weights stay) and an input row that
    makes its Log take log(0)."""
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.bias.fill_(3.0)
    opts: list[torch.optim.Optimizer] = [torch.optim.SGD(m.lin.parameters(), lr=0.0),
                                         torch.optim.SGD(m.head.parameters(), lr=0.0)]
    return m, opts, -100.0 * m.lin.weight[0].detach().sign()


def test_a_list_of_optimizers_counts_one_training_step_per_round() -> None:
    data = _data(3)
    m, opts, kill = _two_optimizer_lognet()
    with nanhunt.watch(m, opts, on_find="record") as hunt:
        for k in range(3):
            x = kill.expand(2, 4) if k == 2 else torch.full((2, 4), 0.1)
            m(x).sum().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert (hunt.first.module, hunt.first.step) == ("log", 2)
    del data


def test_a_round_of_optimizers_numbers_the_calls_across_their_steps() -> None:
    """Alternating updates (a GAN, manual optimization): forward, ``o1.step()``, forward,
    ``o2.step()``. The round is one step, so the second forward's calls are call 1, also after the
    first optimizer's step() judged the first forward."""
    m, opts, kill = _two_optimizer_lognet()
    with nanhunt.watch(m, opts, on_find="record") as hunt:
        for k in range(3):
            for j, o in enumerate(opts):
                x = kill.expand(2, 4) if (k, j) == (2, 1) else torch.full((2, 4), 0.1)
                o.zero_grad()
                m(x).sum().backward()
                o.step()
    assert (hunt.first.module, hunt.first.step, hunt.first.call) == ("log", 2, 1)


class _SAM(torch.optim.Optimizer):
    """Sharpness-Aware Minimization as it is usually written (davda54/sam): ``first_step()`` moves the
    weights up the gradient by rho / ||g|| (no eps here), ``second_step()`` puts them back and steps
    ``base_optimizer``, which shares its param_groups; the wrapper's own ``step()`` is never called."""

    def __init__(self, params: Any, base: Any, rho: float = 0.05, **kw: Any) -> None:
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]).norm()
        for group in self.param_groups:
            scale = group["rho"] / norm  # @sam-scale
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_sam_watched_through_its_wrapper_counts_the_base_optimizers_steps(mode: str) -> None:
    # watch(model, sam): the batch at step 2 already has zero loss (a margin loss), ||g|| = 0 and
    # first_step's rho / ||g|| is inf (inf * 0 = nan in the weights). The finding said step 0: the
    # wrapper nanhunt hooked never steps, its base optimizer does. Sentinel mode judges the step as the
    # second pass begins (first_step's zero_grad): its replay of the first pass ran on the weights
    # first_step had just written NaN into and named that finite call, cause "parameter"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    sam = _SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, sam, mode=mode):
        for i in range(5):
            x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            if i == 2:
                with torch.no_grad():
                    y = model(x).argmax(1)  # already right, by any margin of 0: no loss, no gradient
            for _ in range(2):
                F.multi_margin_loss(model(x), y, margin=0.0 if i == 2 else 1.0).backward()
                sam.first_step() if _ == 0 else sam.second_step()
    f = ei.value.finding
    assert (f.module, f.step, f.op, f.cause) == ("<outside>", 2, "aten.reciprocal.default", "created"), f
    path, line = (f.source or ":0").rsplit(":", 1)
    assert "@sam-scale" in linecache.getline(path, int(line)), f


class _Lookahead(torch.optim.Optimizer):
    """Lookahead as pytorch_optimizer writes it: it never runs ``Optimizer.__init__`` (so torch never
    patches its ``step`` to run the step hooks) but sets the hook dicts by hand, steps ``optimizer``
    and pulls the weights towards slow copies every ``k`` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, hooks: type | None = dict, k: int = 2, alpha: float = 0.5,
                 pull: str = "lerp") -> None:
        self.optimizer, self.k, self.alpha, self.pull = optimizer, k, alpha, pull
        if hooks is not None:  # (None: no hook dicts at all, as the Lookahead of alphadl/lookahead.pytorch)
            self._optimizer_step_pre_hooks: dict[int, Any] = hooks()
            self._optimizer_step_post_hooks: dict[int, Any] = hooks()
            self._optimizer_load_state_dict_post_hooks: dict[int, Any] = hooks()
        self.defaults = optimizer.defaults
        self.state = collections.defaultdict(dict)
        self.counter = 0
        for p in (p for g in self.param_groups for p in g["params"]):
            self.state[p]["slow_params"] = p.detach().clone()

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(closure)
        self.counter += 1
        if self.counter % self.k == 0:
            for p in (p for g in self.param_groups for p in g["params"]):
                slow = self.state[p]["slow_params"]
                if self.pull == "lerp":
                    p.lerp_(slow, weight=1.0 - self.alpha)
                else:
                    slow.lerp_(p, self.alpha)
                    p.copy_(slow)
                slow.copy_(p)
        return loss


def _lr_blown_at_step_3(model: nn.Module, inner: torch.optim.Optimizer, opt: Any, sched: bool = False,
                        **watch: Any) -> Any:
    """Six steps of ``opt`` (a wrapper of ``inner``) on a CNN under a raise-mode hunt, ``inner``'s lr
    1e38 at step 3 (an LR scheduler built over ``opt`` inside the hunt with ``sched``): the finding."""
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, **watch):
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if sched else None
        for i in range(6):
            inner.param_groups[0]["lr"] = 1e38 if i == 3 else 0.1
            x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            F.cross_entropy(model(x), y).mul(100).backward()
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return ei.value.finding


@pytest.mark.parametrize("hooks", [dict, collections.OrderedDict])
def test_a_lookahead_that_sets_the_step_hooks_by_hand_is_watched_through_the_optimizer_it_steps(hooks: type) -> None:
    # watch(model, lookahead): nanhunt hooked the wrapper, whose hooks never run (its step() is not the
    # one torch patches). With dicts watch() failed ("cannot create weak reference to 'dict' object");
    # with OrderedDicts no step was counted: an update that overflowed at step 3 was "forward, step 0,
    # cause 'parameter': look for a finding in phase 'optimizer'", which never came
    model = zoo.cnn()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _Lookahead(inner, hooks)
    f = _lr_blown_at_step_3(model, inner, opt)
    assert (f.phase, f.step, f.cause, f.op) == ("optimizer", 3, "created", "aten.add_.Tensor"), f
    assert "its lr is 1e+38" in f.hint, f.hint


@pytest.mark.parametrize("settings", [{"mode": "sentinel"}, {"mode": "full", "optimizer_every": 5}])
@pytest.mark.parametrize(("hooks", "pull"), [(collections.OrderedDict, "lerp"), (None, "copy")])
def test_a_lookaheads_pull_back_after_the_step_it_wraps_is_part_of_that_step(
        settings: dict[str, Any], hooks: type | None, pull: str) -> None:
    # watch(model, lookahead): nanhunt hooks the SGD it steps, whose post-step hook noted the weights'
    # versions; Lookahead's own pull-back towards the slow weights (in place, after that step()
    # returned) then moved them. An lr overflow at step 3, read at the next step (sentinel; an
    # unsampled step), was "forward, step 4, cause 'parameter': written after its optimizer's last
    # step (a load_state_dict, an in-place assignment in your code)": no code of the user's wrote it
    model = zoo.cnn()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _Lookahead(inner, hooks, pull=pull)
    f = _lr_blown_at_step_3(model, inner, opt, **settings)
    assert (f.phase, f.step, f.cause, f.op) == ("optimizer", 3, "created", "aten.add_.Tensor"), f
    assert "its lr is 1e+38" in f.hint and "written after" not in f.hint, f.hint
    assert "step" not in vars(opt)  # (the wrapper of its step() is off again)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_lr_scheduler_built_over_a_watched_lookahead_wraps_its_step_as_it_would_unwatched(mode: str) -> None:
    # an LR scheduler takes ``opt.step.__func__`` apart to note that step() was called: built over
    # the wrapper after watch(), it failed ("'_WrapperStep' object has no attribute '__func__'")
    model = zoo.cnn()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _Lookahead(inner, None)
    f = _lr_blown_at_step_3(model, inner, opt, sched=True, mode=mode)
    assert (f.phase, f.step, f.cause) == ("optimizer", 3, "created"), f
    assert opt._opt_called  # (the scheduler's own note that step() ran)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_lookahead_set_up_by_torch_names_the_update_op_of_the_optimizer_it_steps(mode: str) -> None:
    # watched through its own step hooks (they run around the pull-back), its update's op was looked
    # for on a shadow of the Lookahead's own class, which is no torch.optim class: op None, and the
    # hint of a hand-written optimizer ("a denominator like sqrt(exp_avg_sq) + eps at 0") for an SGD
    model = zoo.cnn()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = zoo.Lookahead(inner)
    f = _lr_blown_at_step_3(model, inner, opt, mode=mode)
    assert (f.phase, f.step, f.cause, f.op) == ("optimizer", 3, "created", "aten.add_.Tensor"), f
    assert "its lr is 1e+38" in f.hint and "exp_avg_sq" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_watched_lookahead_trains_bit_identically_and_is_left_as_it_was(mode: str) -> None:
    def train(watch: bool) -> tuple[nn.Module, Any]:
        model = zoo.cnn()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = _Lookahead(inner, None, k=3)
        g = torch.Generator().manual_seed(0)
        with nanhunt.watch(model, opt, mode=mode) if watch else contextlib.nullcontext() as hunt:
            for _ in range(7):
                x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        if watch:
            assert hunt.findings == [] and hunt.step == 7
        return model, opt

    (ref, _), (model, opt) = train(False), train(True)
    assert same_state(snapshot(ref), snapshot(model))
    assert "step" not in vars(opt) and not _step_hooks(opt.optimizer)


def _step_hooks(opt: torch.optim.Optimizer) -> list[Any]:
    return [*opt._optimizer_step_pre_hooks.values(), *opt._optimizer_step_post_hooks.values()]


def test_optimizer_hooks_do_not_change_the_update() -> None:
    data = _data(4)
    ref, m = _classifier(), _classifier()
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in data:
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with nanhunt.watch(m, opt) as hunt:
        for x, y in data:
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert hunt.step == 4 and hunt.findings == []
    assert same_state(snapshot(ref), snapshot(m))
    for p, q in zip(ref.parameters(), m.parameters()):
        for k in ref_opt.state[p]:
            assert bit_equal(ref_opt.state[p][k], opt.state[q][k])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_loaded_non_finite_is_not_called_the_optimizers_doing(mode: str) -> None:
    # a checkpoint with a NaN row in an embedding the batches never read: forward and gradients
    # stay finite, AdamW's weight decay carries the NaN on. No step made it: the finding says the
    # weight came in that way, with no update op blamed.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[7] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, optimizer=opt, on_find="record", mode=mode) as hunt:
        for _ in range(2):
            model(torch.tensor([[1, 2, 3]])).mean().backward()
            opt.step()
            opt.zero_grad()
        model(torch.tensor([[7, 1]])).mean().backward()  # now a batch reads the row
        opt.step()
        opt.zero_grad()
    first = hunt.first
    assert first is not None
    assert (first.phase, first.module, first.tensor, first.index, first.cause) == ("optimizer", "0", "weight", (7, 0), "parameter")
    assert first.op is None and first.chain == ()
    assert "already non-finite when the watch began" in first.hint
    fwd = next(f for f in hunt.findings if f.phase == "forward")
    assert (fwd.module, fwd.cause, fwd.step) == ("0", "parameter", 2)
    assert "'weight' of `0` was already non-finite when the watch began" in fwd.hint
    assert not any(f.cause == "created" for f in hunt.findings)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_left_non_finite_before_the_watch_is_not_born_in_its_first_step(mode: str) -> None:
    # a NaN batch's backward before watch() (or a failed step caught without zero_grad()), then a
    # loop that zeroes after step(): the first step's backward adds to the NaN .grad. The finding
    # was "created", "inf * 0 in a weight gradient, or a gradient written after backward"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[float("nan"), 0.0, 0.0, 0.0]])).sum().backward()
    before = snapshot(model)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, mode=mode):
            for _ in range(2):
                model(torch.randn(5, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("grad", "0", "weight.grad", 0, "input"), f
    assert "'0.weight' already held NaN/Inf when the watch's first step began" in f.hint and "zero_grad()" in f.hint
    assert same_state(before, snapshot(model))  # no update from it


def test_a_gradient_a_caught_error_left_non_finite_is_not_born_again_at_each_later_step() -> None:
    # raise leaves the failing step's gradients for inspection; a loop that catches the error and goes
    # on without zero_grad() adds every later backward to them: each later step was a "created" grad
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    with nanhunt.watch(model, optimizer=opt) as hunt:
        for i in range(3):
            x = torch.randn(5, 4)
            if i == 1:
                x[0, 0] = float("nan")
            try:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            except nanhunt.NonFiniteError as e:
                got.append(e.finding)
    assert [(f.step, f.phase, f.cause) for f in got] == [(1, "forward", "input"), (2, "grad", "input")], got
    assert "still held the NaN/Inf of an earlier finding's step" in got[1].hint and "zero_grad()" in got[1].hint
    assert not any(f.cause == "created" for f in hunt.findings)


def test_a_weight_the_optimizer_overflows_is_still_created_after_a_clean_start() -> None:
    # the same model, finite when the watch begins: an exploding learning rate's overflow is the
    # optimizer's own (the start state does not excuse later damage)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    with nanhunt.watch(model, optimizer=opt, on_find="record") as hunt:
        for _ in range(3):
            (model(torch.tensor([[1, 2, 3]])).mean() * 1e4).backward()
            opt.step()
            opt.zero_grad()
    first = hunt.first
    assert first is not None and first.phase == "optimizer" and first.cause == "created"
    assert first.op is not None and "already non-finite" not in first.hint


def test_a_parameter_outside_the_model_is_named_by_its_place_in_the_optimizer() -> None:
    # a learnable temperature of the loss, stepped by the same optimizer: not one of the model's
    # parameters, so it lives outside the model (not module '' of the model itself)
    torch.manual_seed(0)
    model = zoo.mlp(d_out=3)
    temp = torch.nn.Parameter(torch.tensor(0.0))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [temp]}], lr=0.1)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        (model(torch.randn(4, 4)).softmax(-1).sum() * torch.sqrt(temp)).backward()  # sqrt at 0: inf grad
        opt.step()
        opt.zero_grad()
    grad = next(f for f in hunt.findings if f.phase == "grad")
    assert (grad.module, grad.tensor) == ("<outside>", "param_groups[1][0].grad")


class _Distance(nn.Module):
    """The distance between the two halves of a projection: sqrt at 0 (an infinite gradient) when they are equal."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.sqrt(((h[:, :4] - h[:, 4:]) ** 2).sum(-1, keepdim=True)).expand(-1, 8)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_made_in_a_model_that_is_not_watched_is_told_as_such(mode: str) -> None:
    """One optimizer over two models, only the head watched: a sqrt at 0 in the encoder's backward
    makes its weight's gradient NaN, every gradient of the head finite. The hint said "inf * 0 in a
    weight gradient, or a gradient written after backward" of a parameter that only the optimizer
    holds; it now says that it lies outside the watched model, where nothing was recorded."""
    torch.manual_seed(0)
    enc, head = _Distance(), nn.Linear(8, 3)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(head, opt, mode=mode):
        for step in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if step == 2:
                with torch.no_grad():
                    enc.proj.weight[4:] = enc.proj.weight[:4]
                    enc.proj.bias[4:] = enc.proj.bias[:4]
            F.cross_entropy(head(enc(x)), y).backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.tensor, f.step) == ("grad", "<outside>", "param_groups[0][0].grad", 2), f
    assert "not a parameter of the watched model" in f.hint and "written after backward" not in f.hint, f.hint
    assert all(bool(p.isfinite().all()) for p in enc.parameters())  # (the step was not applied)


def test_a_parameter_outside_the_model_that_an_update_overflowed_is_born_once_and_is_damage() -> None:
    # a loss's learned temperature in a group of its own, its lr raised to 1e38 for one step: the
    # update makes it inf (a finding of step 1). The steps after only carry it on (inf - lr * g),
    # the model's forward stays finite (logits / inf = 0): they used to be reported "created" again
    # at every step, and Report.damage, which listed the model's state only, said nothing was left
    torch.manual_seed(0)
    model = zoo.mlp(d_out=1)
    temp = torch.nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([{"params": model.parameters(), "lr": 0.1}, {"params": [temp], "lr": 1.0}])
    g = torch.Generator().manual_seed(0)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for step in range(4):
            opt.param_groups[1]["lr"] = 1e38 if step == 1 else 1.0
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g).float()
            loss = F.binary_cross_entropy_with_logits(model(x).squeeze(1) / temp, y) * 1e3
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert torch.isinf(temp)
    assert [(f.phase, f.module, f.tensor, f.step, f.cause) for f in hunt.findings] == [
        ("optimizer", "<outside>", "param_groups[1][0]", 1, "created")], [str(f) for f in hunt.findings]
    assert hunt.report.damage["parameters"] == ["param_groups[1][0]"], hunt.report.damage


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_ema_teacher_inside_the_model_written_non_finite_after_step_is_told_as_the_loops_update(mode: str) -> None:
    # DINO/BYOL: student and teacher in one watched module, the teacher (requires_grad=False, in no
    # optimizer) updated by an EMA after step() whose momentum schedule divides by (total - i), 0 at
    # the last step. The hint said "give the optimizer the parameter the model uses": the remedy for a
    # parameter forgotten by the optimizer, not for a teacher that must never be in it
    class DINO(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                t = self.teacher(b)
            return self.student(a), t

    torch.manual_seed(0)
    model = DINO()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    total = 3
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for i in range(6):
            s, t = model(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
            (-(F.softmax(t / 0.04, -1) * F.log_softmax(s / 0.1, -1)).sum(-1).mean()).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                m = 1 - torch.tensor(0.004) * (total - i) / torch.tensor(float(total - i))  # 0/0 at i = total
                for ps, pt in zip(model.student.parameters(), model.teacher.parameters()):
                    pt.mul_(m).add_((1 - m) * ps)
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "teacher.0", total + 1, "parameter"), f
    assert "does not require grad" in f.hint and "EMA" in f.hint and "give the optimizer" not in f.hint, f.hint


def _load_poisoned_state(m: nn.Module) -> None:
    state = {k: v.clone() for k, v in m.state_dict().items()}
    name = next(k for k in state if k.endswith("weight"))
    state[name][0, 0] = float("nan")
    m.load_state_dict(state)  # a poisoned checkpoint loaded mid-run


def _assign_poisoned_parameter(m: nn.Module) -> None:
    layer = next(mod for mod in m.modules() if isinstance(mod, nn.Linear))
    w = layer.weight.detach().clone()
    w[0, 0] = float("nan")
    layer.weight = nn.Parameter(w)  # the optimizer does not even hold it


@pytest.mark.parametrize("poison, said, unsaid", [
    (_load_poisoned_state, ("written after its optimizer's last step", "no optimizer step poisoned it"),
     "an earlier optimizer step poisoned it"),
    (_assign_poisoned_parameter, ("no watched optimizer holds",), "poisoned"),
], ids=["load_state_dict", "new nn.Parameter"])
def test_a_weight_written_mid_run_is_not_blamed_on_the_optimizer(poison: Any, said: tuple[str, ...], unsaid: str) -> None:
    """A weight poisoned between steps by the user's code (a checkpoint loaded, a new
    nn.Parameter assigned): the hint said 'an earlier optimizer step poisoned it'."""
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        F.cross_entropy(m(x), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
        opt.zero_grad()
        poison(m)
        F.cross_entropy(m(x), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.cause) == ("forward", "parameter")
    assert all(s in f.hint for s in said) and unsaid not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_checkpoint_loaded_between_two_calls_of_a_step_is_blamed_on_the_later_call(mode: str) -> None:
    """A GAN's discriminator, watched with its optimizer: its step holds the call the generator's
    loss made of it (after its own step()), then the next iteration's calls. A poisoned checkpoint
    loaded in between: the replay of that earlier call ran on the loaded weights, so full mode's
    first finding was a backward at call 0 (the generator's call, finite) and sentinel's forward
    said call 0; the NaN was born at call 1, the first call on the loaded weights."""
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt = torch.optim.Adam(d.parameters(), lr=1e-3)
    fake = torch.randn(8, 4, requires_grad=True)  # the generator's output
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    with nanhunt.watch(d, opt, on_find="record", mode=mode) as hunt:
        for i in range(3):
            if i == 2:
                _load_poisoned_state(d)
            loss_d = (F.binary_cross_entropy_with_logits(d(torch.randn(8, 4)), ones)
                      + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
            opt.zero_grad()
            loss_d.backward()
            opt.step()
            F.binary_cross_entropy_with_logits(d(fake), ones).backward()  # the generator's loss
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.step, f.call, f.cause) == ("forward", "0", 2, 1, "parameter"), f
    assert "written non-finite in place" in f.hint and "test_watch_optimizer.py" in f.hint, f.hint


@pytest.mark.parametrize("back", [False, True], ids=["half", "half then float"])
def test_a_weight_a_cast_made_inf_is_not_blamed_on_the_optimizer(back: bool) -> None:
    """model.half() mid-run (for a float16 evaluation, or and back: .float()) of a weight past
    float16's largest value: the cast makes it inf, and no version counter sees it (.to() replaces
    .data). The optimizer had judged it finite as its step returned, yet the hint said 'an earlier
    optimizer step poisoned it (look for a finding in phase 'optimizer')', where there is none."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight[0, 0] = 1e5  # a weight grown past 65504 (finite in float32)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        m.half()
        if back:
            m.float()
        m(x.to(m[0].weight.dtype)).float().pow(2).mean().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "0", 1, "parameter"), str(f)
    assert "replaced since: a cast (model.half()" in f.hint and "optimizer step poisoned" not in f.hint.replace(
        "no optimizer step poisoned", ""), f.hint
    assert ("now float16" in f.hint and "65504" in f.hint) != back, f.hint


def _data_write(p: torch.Tensor) -> None:
    p.data[3] = float("nan")  # no version counter sees this  # @data-write


def _no_grad_write(p: torch.Tensor) -> None:
    with torch.no_grad():
        p[3] = float("nan")  # @no-grad-write


def _write_between_backward_and_step(write: Any, opt_class: Any, **watch: Any) -> nanhunt.Finding:
    """Three training steps; at the second, ``write`` poisons the first layer's weight after backward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = opt_class(m.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, **watch):
        for step in range(3):
            m(torch.randn(2, 4)).pow(2).mean().backward()
            if step == 1:
                write(m[0].weight)
            opt.step()
            opt.zero_grad()
    return ei.value.finding


@pytest.mark.parametrize("write", [_data_write, _no_grad_write], ids=["p.data", "no_grad"])
@pytest.mark.parametrize("opt_class", [torch.optim.SGD, torch.optim.AdamW])
def test_a_parameter_written_between_backward_and_step_is_not_the_updates_doing(write: Any, opt_class: Any) -> None:
    """The user's code wrote NaN into a weight after backward, before step(): the finding said the
    update made it (phase optimizer, cause 'created', op aten.add_ of SGD's update)."""
    f = _write_between_backward_and_step(write, opt_class)
    assert (f.phase, f.module, f.tensor, f.step, f.index) == ("optimizer", "0", "weight", 1, (3, 0))
    assert f.cause == "input" and f.op is None and f.source is None and f.chain == ()
    assert "update that overflowed" not in f.hint
    assert "already non-finite when optimizer.step() began" in f.hint and "between backward and step()" in f.hint


@pytest.mark.parametrize("write, marker", [(_data_write, "data-write"), (_no_grad_write, "no-grad-write")],
                         ids=["p.data", "no_grad"])
def test_sentinel_names_the_line_that_wrote_a_parameter_between_backward_and_step(write: Any, marker: str) -> None:
    """Sentinel mode meets the written weight in its replay of the step's forward (a poisoned
    parameter): for p.data[3] = nan, which bumps no version counter, the hint said 'an earlier
    optimizer step poisoned it'. The loop's own write is recorded as code outside the model: its line."""
    f = _write_between_backward_and_step(write, torch.optim.SGD, mode="sentinel")
    assert (f.module, f.cause, f.step) == ("0", "parameter", 1)
    assert "earlier optimizer step poisoned it" not in f.hint and "no optimizer step poisoned it" in f.hint
    here = os.path.abspath(__file__)
    with open(here) as fh:
        at = next(i for i, s in enumerate(fh.read().splitlines(), 1) if s.endswith(f"# @{marker}"))
    assert f"{here}:{at}" in f.hint


@pytest.mark.parametrize("on_find", ["record", "warn"])
def test_an_update_judged_at_its_step_is_not_found_again_at_the_next_hit(on_find: str) -> None:
    """On CPU the update is judged when step() returns; the next step's hit (its forward fed the
    overflowed weights) must not report that same update a second time."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e38)
    x = torch.randn(8, 4) * 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanhunt.watch(m, opt, on_find=on_find) as hunt:
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
            assert [(f.phase, f.step) for f in hunt.findings] == [("optimizer", 0)]
            m(x).sum().backward()
            opt.step()
    found = [(f.phase, f.step) for f in hunt.findings]
    assert found.count(("optimizer", 0)) == 1 and ("forward", 1) in found, found


def test_a_warm_up_schedule_that_divides_by_zero_is_named_in_the_hint() -> None:
    """A LambdaLR warm-up of 0 steps (``(s + 1) / warmup`` with numpy floats: inf, no error) sets
    lr to inf for step 0; the update makes every weight non-finite. The hint names the setting
    (it spoke of an exploding learning rate in general)."""
    np = pytest.importorskip("numpy")

    torch.manual_seed(0)
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup = np.int64(0)

    def factor(s: int) -> float:
        with np.errstate(divide="ignore"):  # numpy warns where Python would raise
            return float(np.float64(s + 1) / warmup) if s <= warmup else 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    assert opt.param_groups[0]["lr"] == float("inf")
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt):
        for x, y in _data():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", 0, "created"), f
    assert "param_groups[0]['lr'] = inf" in f.hint, f.hint


# ---------------------------------------------------------------------------- the numbers behind an update
def _bow() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(50, 16, mode="mean"), nn.Linear(16, 2))


def _eps_0_finding(cls: type) -> tuple[Any, torch.Tensor]:
    """One step of ``cls(eps=0)`` on a bag of words whose tokens 30..49 never appear (their
    embedding rows get a 0 gradient): the finding it raises, and the batch."""
    m = _bow()
    opt = cls(m.parameters(), lr=1e-3, eps=0.0)
    x = torch.randint(0, 30, (8, 5), generator=torch.Generator().manual_seed(0))  # tokens 30..49 never appear
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, opt):
            F.cross_entropy(m(x), torch.zeros(8, dtype=torch.long)).backward()
            opt.step()
    return ei.value.finding, x


def test_adam_with_eps_0_names_eps_where_a_gradient_is_0() -> None:
    """eps=0 (a port of TF code): embedding rows of tokens absent from the batch have 0 gradient,
    so exp_avg / sqrt(exp_avg_sq) is 0/0 at the first step; the hint said 'an update that overflowed'."""
    f, x = _eps_0_finding(torch.optim.Adam)
    assert (f.phase, f.module, f.tensor, f.step) == ("optimizer", "0", "weight", 0), f
    assert f.index[0] not in set(x.flatten().tolist()), "a row the batch never touched: 0 gradient"
    assert "eps is 0" in f.hint and "positive eps" in f.hint, f


@pytest.mark.parametrize("cls, division, default", [
    (torch.optim.RMSprop, "grad / sqrt(square_avg)", "1e-8"), (torch.optim.Adagrad, "grad / sqrt(sum)", "1e-10"),
    (torch.optim.Adamax, "exp_avg / exp_inf", "1e-8"), (torch.optim.Adadelta, "sqrt(acc_delta) / sqrt(square_avg)", "1e-6")])
def test_eps_0_names_the_optimizers_own_state_and_default(cls: type, division: str, default: str) -> None:
    """eps=0 in RMSprop, Adagrad, Adamax or Adadelta: the hint named Adam's state (exp_avg /
    sqrt(exp_avg_sq)) and Adam's default eps (1e-8), which these optimizers do not have."""
    f, _ = _eps_0_finding(cls)
    assert (f.phase, f.module, f.tensor, f.step) == ("optimizer", "0", "weight", 0), f
    assert f"divides 0 by 0 ({division})" in f.hint and f"the default {default})" in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_centered_rmsprop_whose_variance_rounds_negative_is_named(mode: str) -> None:
    # WGAN's RMSprop, centered: the head's bias gets the same gradient at every step (the loss is linear
    # in it), so square_avg - grad_avg**2 tends to 0 and rounding makes it negative; its sqrt is nan
    # after ~130 steps (~1200 with the default alpha=0.99), with every gradient finite and lr 5e-5. The
    # hint blamed an exploding learning rate (its lr is 5e-05) or sqrt(square_avg) at 0
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 64))
    opt = torch.optim.RMSprop(critic.parameters(), lr=5e-5, alpha=0.9, centered=True)
    coef = 1 + torch.arange(64) / 64
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        (-(critic(torch.randn(16, 8, generator=g)) * coef).mean(0).sum()).backward()
        opt.step()
        opt.zero_grad()

    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(critic, opt, mode=mode):
        for _ in range(300):
            step()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.cause) == ("optimizer", "2", "bias", "created"), f
    assert "RMSprop(centered=True)" in f.hint and "negative" in f.hint and "centered=False" in f.hint, f.hint
    assert "learning rate" not in f.hint, f.hint


def test_adam_state_overflow_from_a_huge_gradient_names_the_gradient_not_the_learning_rate() -> None:
    """A loss term weighted 1e21 (a term in the wrong units): finite, but its gradient's square
    passes float32's largest value, so exp_avg_sq becomes inf while the weights stay finite (the
    update is m/inf = 0): the hint blamed the learning rate."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        (m(x) * 1e21).mean().backward()
        opt.step()
    f = hunt.first
    assert f is not None and (f.phase, f.tensor, f.value) == ("optimizer", "state['exp_avg_sq']", float("inf")), f
    assert "square passes float32" in f.hint and "Clip the gradients" in f.hint, f
    assert all(torch.isfinite(p).all() for p in m.parameters())



def _half_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).half()


def _half_first(cls: type, loss_scale: float, **kw: Any) -> Any:
    """The first finding of float16 parameters stepped by ``cls`` on a loss times ``loss_scale``
    (a fixed loss scale with no GradScaler to unscale it)."""
    m = _half_cnn()
    opt = cls(m.parameters(), lr=1e-3, **kw)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=g).half(), torch.randint(0, 3, (8,), generator=g)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        for _ in range(2):
            (F.cross_entropy(m(x).float(), y) * loss_scale).backward()
            opt.step()
            opt.zero_grad()
    return hunt.first


@pytest.mark.parametrize("cls, state, holds", [(torch.optim.RMSprop, "square_avg", "a running mean"),
                                               (torch.optim.Adagrad, "sum", "the running sum")])
def test_float16_state_overflow_names_the_optimizers_own_squared_state(cls: type, state: str, holds: str) -> None:
    """A float16 RMSprop (Adagrad) on a loss scaled by 6e4: gradients of ~7e3 whose squares pass
    65504 make square_avg (sum) inf. The hint said eps=1e-08 rounds to 0 and named Adam's exp_avg_sq."""
    f = _half_first(cls, 6e4)
    assert f is not None and (f.phase, f.tensor, f.step) == ("optimizer", f"state[{state!r}]", 0), f
    assert f"{holds} of squared gradients ({state}) overflows" in f.hint and "Clip the gradients" in f.hint, f.hint
    assert "exp_avg_sq" not in f.hint and "eps" not in f.hint, f.hint


@pytest.mark.parametrize("cls, says", [
    (torch.optim.RMSprop, "where square_avg is 0 the update divides by 0 (grad / sqrt(square_avg))"),
    (torch.optim.Adagrad, "where sum is 0 the update divides by 0 (grad / sqrt(sum))"),
    (torch.optim.Adamax, "where exp_inf is 0 the update divides by 0 (exp_avg / exp_inf)")])
def test_float16_eps_rounding_to_0_names_the_optimizers_own_state(cls: type, says: str) -> None:
    """eps=1e-8 in float16 parameters is 0: where a ReLU's dead unit gave a 0 gradient, RMSprop's
    grad / sqrt(square_avg) is 0/0. The hint named Adam's exp_avg_sq for every optimizer."""
    f = _half_first(cls, 1.0, eps=1e-8)
    assert f is not None and (f.phase, f.tensor, f.step) == ("optimizer", "weight", 0), f
    assert "eps=1e-08 rounds to 0 in float16" in f.hint and says in f.hint and "exp_avg_sq" not in f.hint, f.hint


def test_float16_sgd_momentum_overflow_names_momentum_buffer() -> None:
    """SGD with momentum in float16: gradients of 3e4 make momentum_buffer (0.9 * 5.7e4 + 3e4) inf,
    then the weight; the hint said 'a denominator like sqrt(exp_avg_sq) + eps at 0' (SGD has none)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(m.parameters(), lr=1e-9, momentum=0.9)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        for _ in range(4):
            (m(torch.ones(16, 4).half()).float().sum() * 3e4 / 16).backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.tensor, f.step) == ("optimizer", "weight", 2), f
    assert "'momentum_buffer'" in f.hint and "Clip the gradients" in f.hint and "exp_avg_sq" not in f.hint, f.hint

class _LARS(torch.optim.Optimizer):
    """A hand-written LARS, as in many SimCLR/BYOL repositories: trust = eta * ||w|| / ||g||;
    it keeps a Python list in its state and counts its constructions."""

    made = 0

    def __init__(self, params: Any, lr: float = 0.1, eta: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr, "eta": eta})
        _LARS.made += 1

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = group["eta"] * p.norm() / p.grad.norm()
                    self.state[p].setdefault("trusts", []).append(float(trust))
                    p.sub_(p.grad * trust * group["lr"])


def test_a_hand_written_optimizer_dividing_by_a_zero_gradient_norm_is_named() -> None:
    """A zero-initialised gate gives the gated Linear an all-zero gradient: LARS's trust ratio is
    ||w|| / 0 = inf and the update 0 * inf = nan."""
    torch.manual_seed(0)

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.gate, self.fc = nn.Linear(6, 16), nn.Linear(6, 16), nn.Linear(16, 3)
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.a(x) * torch.relu(self.gate(x)))

    m = Gated()
    opt = _LARS(m.parameters())
    made, hooked = _LARS.made, []
    handle = register_optimizer_step_pre_hook(lambda *a: hooked.append(1))
    try:
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            with nanhunt.watch(m, opt):
                F.cross_entropy(m(torch.randn(8, 6)), torch.zeros(8, dtype=torch.long)).backward()
                opt.step()
    finally:
        handle.remove()
    # the shadow step touched nothing of the user's: its state's lists, its hooks, its constructor
    assert all(len(opt.state[p]["trusts"]) == 1 for p in m.parameters()), "one step's entries"
    assert hooked == [1] and _LARS.made == made
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor) == ("optimizer", "a", "weight"), f
    assert "0 everywhere" in f.hint and "trust ratio" in f.hint, f
    # the op and the line inside the user's own step(), found on a shadow step of the same class
    lines, first = inspect.getsourcelines(_LARS.step)
    trust_line = first + next(i for i, ln in enumerate(lines) if "trust = " in ln)
    assert f.op == "aten.div.Tensor" and f.source == f"{__file__}:{trust_line}", f
    assert f.chain[0] == f"aten.div.Tensor @ {f.source}" and f.chain[-1].startswith("aten.sub_"), f.chain


class _ListLARS(torch.optim.Optimizer):
    """LARS with momentum as many repositories write it: its state kept outside ``self.state``, the
    momentum buffers in a list by position, a step counter tensor and a log of trust ratios."""

    def __init__(self, params: Any, lr: float = 0.1, eta: float = 1e-3, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "eta": eta, "momentum": momentum})
        self.bufs = [torch.zeros_like(p) for g in self.param_groups for p in g["params"]]
        self.t = torch.zeros(())
        self.trusts: list[float] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.t.add_(1)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                trust = group["eta"] * p.norm() / p.grad.norm()
                self.trusts.append(float(trust))
                self.bufs[i].mul_(group["momentum"]).add_(p.grad * trust)
                p.sub_(self.bufs[i], alpha=group["lr"])


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_the_shadow_step_of_a_hand_written_optimizer_never_writes_the_state_it_keeps_outside_self_state(on_find: str) -> None:
    # ReZero (the residual branch scaled by a gate initialised to 0): the branch's weights get an all-zero
    # gradient at step 0 and LARS's trust ratio is ||w|| / 0. The shadow step that looks for the op ran the
    # user's step() on the user's own list of momentum buffers (the shadow's one parameter is at index 0:
    # the buffer of `0.weight`, stepped a second time with the shadow's NaN), its step counter and its log
    class ReZero(nn.Module):
        def __init__(self, f: nn.Module) -> None:
            super().__init__()
            self.f, self.gate = f, nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.gate * self.f(x)

    def run(watch: bool) -> tuple[_ListLARS, list[nanhunt.Finding]]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 16), ReZero(nn.Sequential(nn.Linear(16, 16), nn.GELU())), nn.Linear(16, 3))
        opt = _ListLARS(m.parameters())
        g = torch.Generator().manual_seed(0)
        hunt = nanhunt.watch(m, opt, on_find=on_find) if watch else None
        try:
            F.cross_entropy(m(torch.randn(8, 16, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
        except nanhunt.NonFiniteError:
            pass
        finally:
            findings = hunt.findings if hunt is not None else []
            if hunt is not None:
                hunt.close()
        return opt, findings

    ref, _ = run(False)
    opt, findings = run(True)
    f = findings[0]
    assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("optimizer", "1.f.0", "weight", 0, "created"), f
    assert "0 everywhere" in f.hint and "trust ratio" in f.hint, f.hint
    assert all(bit_equal(a, b) for a, b in zip(opt.bufs, ref.bufs)), "the user's momentum buffers stepped again"
    assert bit_equal(opt.t, ref.t) and len(opt.trusts) == len(ref.trusts), (opt.t, len(opt.trusts))




def test_state_already_non_finite_is_carried_not_made_again_by_each_step() -> None:
    # record mode: the user writes inf into a bias at step 2. The optimizer's steps since are given
    # finite gradients; they did not make the inf ("created ... an update that overflowed" at every
    # step), and step 3's forward was not poisoned by "an earlier optimizer step"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for i in range(4):
            if i == 2:
                with torch.no_grad():
                    model[0].bias[0] = float("inf")
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert [(f.phase, f.step, f.cause) for f in hunt.findings if f.module == "0"] == [
        ("forward", 2, "parameter"), ("forward", 3, "parameter")], hunt.findings
    assert "written after its optimizer's last step" in hunt.findings[0].hint
    later = next(f for f in hunt.findings if f.step == 3 and f.module == "0")
    assert "since an earlier finding" in later.hint and "optimizer step poisoned" not in later.hint, later.hint


def test_an_overflowed_adam_state_is_one_finding_not_one_per_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        for i in range(6):
            (model(torch.randn(2, 4)).sum() * (1e21 if i == 4 else 1.0)).backward()  # grad**2 > float32 max
            opt.step()
            opt.zero_grad()
    assert [(f.phase, f.step, f.tensor, f.cause) for f in hunt.findings] == [
        ("optimizer", 4, "state['exp_avg_sq']", "created")], hunt.findings


def test_state_rolled_back_after_a_finding_is_judged_again() -> None:
    # the user restores the weights in place (load_state_dict) after the optimizer's overflow and goes
    # on; the same overflow later is a new finding (it was taken for the old value carried on)
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = copy.deepcopy(model.state_dict())
    raised = []
    with nanhunt.watch(model, opt) as hunt:
        for i in range(8):
            for g in opt.param_groups:
                g["lr"] = 1e38 if i in (2, 5) else 0.1  # the update overflows at steps 2 and 5
            model(torch.randn(2, 4)).sum().mul(10).backward()
            try:
                opt.step()
            except nanhunt.NonFiniteError as e:
                raised.append(e.finding.step)
                model.load_state_dict(good)
            opt.zero_grad()
    assert raised == [2, 5]
    assert [(f.phase, f.step, f.cause) for f in hunt.findings] == [("optimizer", 2, "created"), ("optimizer", 5, "created")]


@pytest.mark.parametrize("opt_class", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_a_nan_learning_rate_is_found_at_the_update_op_and_the_step_line(opt_class: Any) -> None:
    # a warm-up over 0 steps: LambdaLR's factor 0/0 makes the learning rate NaN at step 0. Adam's
    # finding had no op or line (its shadow step refused lr=nan in the constructor's checks)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = opt_class(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 0) if s else float("nan"))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        model(torch.randn(2, 4)).sum().backward()
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        opt.step()
        sched.step()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", 0, "created"), f
    assert f.op is not None and f.op.startswith("aten.") and f.source is not None, f
    assert f.source.endswith(f":{line}") and "nan" in f.hint, f


def test_a_tensor_learning_rate_made_nan_by_a_schedule_is_found_at_the_update_op() -> None:
    # Adam(lr=torch.tensor(...)) (a tensor lr, as for a captured step) and a warm-up over 0 steps: the
    # shadow step that finds the update op was built with lr=nan and failed the constructor's checks
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float("nan") if s == 0 else 1.0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.step, f.op) == ("optimizer", 0, "aten.addcdiv_.default"), f
    assert "param_groups[0]['lr'] = nan" in f.hint, f.hint


@pytest.mark.parametrize("lr", [1e-3, torch.tensor(1e-3)], ids=["float", "tensor"])
def test_sentinel_names_a_learning_rate_that_was_inf_for_one_step_only(lr: Any) -> None:
    # a schedule that divides by 0 at one step (1 / (s - 3) at s = 3) and is finite again after it: sentinel
    # reads the update every 10 steps, and finds the weights non-finite when the next step's gradients are;
    # the lr is 1e-3 by then, and the hint said "an exploding learning rate (its lr is 0.001)" over steps 0 to 3
    np = pytest.importorskip("numpy")

    torch.manual_seed(0)
    model = zoo.transformer_encoder(dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def factor(s: int) -> float:
        with np.errstate(divide="ignore"):
            return float(np.float64(1.0) / np.float64(s - 3)) if s == 3 else 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode="sentinel"):
        for _ in range(8):
            model(torch.randn(2, 5, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", 3, "created"), f
    assert "param_groups[0]['lr'] = inf at step 3" in f.hint and "steps 0 to 3" not in f.hint, f.hint


@pytest.mark.parametrize("settings", [{"mode": "sentinel"}, {"mode": "full", "optimizer_every": 0},
                                      {"mode": "full", "optimizer_every": 10}, {"mode": "full"}],
                         ids=["sentinel", "optimizer_every=0", "optimizer_every=10", "full"])
def test_an_optimizer_that_stepped_earlier_in_the_round_is_not_blamed_for_the_step_before(settings: dict[str, Any]) -> None:
    # two optimizers (one per layer, as a GAN or a split learning rate): a bad batch at step 2
    # reaches the first optimizer's weights through its gradients, and the hit at the second one's
    # step() finds them non-finite. Their update belongs to step 2, fed non-finite gradients; it
    # was reported as made by the optimizer at step 1 ("created", aten.addcdiv_), the run's first finding
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    o1 = torch.optim.Adam(m[0].parameters(), lr=1e-2)
    o2 = torch.optim.Adam(m[2].parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with nanhunt.watch(m, [o1, o2], on_find="record", **settings) as hunt:
        for step in range(4):
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            if step == 2:
                y = torch.full((4, 1), float("inf"))  # a bad target: the loss code makes the first inf
            ((m(x) - y) ** 2).mean().backward()
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "<outside>", 2, "input"), str(f)
    opt = [x for x in hunt.findings if x.phase == "optimizer"]
    assert all(x.step == 2 and x.cause == "input" and x.op is None for x in opt if x.step <= 2), [str(x) for x in opt]


class _MatrixFactorisation(nn.Module):
    """A recommender's user and item tables (sparse gradients, SparseAdam) and an L2 penalty on the
    item vectors written as sqrt(sum of squares): its gradient at a zero vector is nan."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(10, 4, sparse=True)
        self.item = nn.Embedding(12, 4, sparse=True)
        with torch.no_grad():
            self.item.weight[7].zero_()  # a cold-start item initialised to 0

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        ie = self.item(i)
        return (self.user(u) * ie).sum(-1) - 0.01 * torch.sqrt((ie * ie).sum(-1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_an_unread_update_poisoned_with_nan_gradients_is_told_as_fed(mode: str) -> None:
    # on_find="record" lets step 1 apply the nan gradient of item 7's row. Sentinel mode reads the
    # weights every 10 steps, at close here: its finding said "created", "although the step was given
    # finite gradients: an update that overflowed or divided by 0", though a gradient of that very
    # step window had been recorded non-finite
    torch.manual_seed(0)
    model = _MatrixFactorisation()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    with nanhunt.watch(model, opt, mode=mode, on_find="record") as hunt:
        for step in range(3):
            i = torch.tensor([1, 7, 3, 5] if step == 1 else [1, 2, 3, 4])
            F.mse_loss(model(torch.tensor([1, 2, 3, 4]), i), torch.rand(4)).backward()
            opt.step()
            opt.zero_grad()
    assert not bool(torch.isfinite(model.item.weight[7]).all()), "set-up: the nan gradient was applied"
    grad = next(f for f in hunt.findings if f.phase == "grad")
    assert (grad.module, grad.tensor, grad.step, grad.index) == ("item", "weight.grad", 1, (7, 0)), grad
    upd = next(f for f in hunt.findings if f.phase == "optimizer")
    assert (upd.module, upd.tensor, upd.index, upd.cause) == ("item", "weight", (7, 0), "input"), upd
    assert "non-finite gradients" in upd.hint and "finite gradients:" not in upd.hint, upd.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["at watch()", "load_state_dict", "written before step()"])
def test_an_optimizer_state_non_finite_before_the_update_is_the_finding_not_the_weight_it_poisons(
        how: str, mode: str) -> None:
    # Adam's exp_avg holds a NaN before an update (a resumed checkpoint that was poisoned, loaded
    # before watch() or mid-run; the loop's own write): the update carries it into the weight.
    # The weight was reported, "created" by aten.addcdiv_ (an exploding learning rate, said the
    # hint); the state is what was non-finite first, and no update made it
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    poisoned = copy.deepcopy(opt.state_dict())
    poisoned["state"][0]["exp_avg"][0, 0] = float("nan")
    if how == "at watch()":
        opt.load_state_dict(poisoned)
    with nanhunt.watch(m, opt, mode=mode, on_find="record") as hunt:
        for step in range(4):
            if step == 2 and how == "load_state_dict":
                opt.load_state_dict(poisoned)
            m(x).pow(2).mean().backward()
            if step == 2 and how == "written before step()":
                opt.state[m.weight]["exp_avg"][0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
    f = hunt.first
    expected = ("parameter", 0) if how == "at watch()" else ("input", 2)
    assert f is not None and (f.phase, f.tensor, f.index, (f.cause, f.step)) == (
        "optimizer", "state['exp_avg']", (0, 0), expected), str(f)
    assert f.op is None, str(f)
    assert not [g for g in hunt.findings if g.phase == "optimizer" and g.tensor == "weight"], \
        [str(g) for g in hunt.findings]


def test_a_weight_decay_that_overflows_by_itself_is_named_with_its_op() -> None:
    # AdamW decays first (p *= 1 - lr * wd), then adds the Adam step: a weight_decay of 1e41 (a
    # config value read with the wrong unit) overflows in the decay's mul_; the finding named the
    # last op writing the weight (addcdiv_) and blamed an exploding learning rate
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=1e41)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        m(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.tensor, f.step, f.cause, f.op) == ("optimizer", "weight", 0, "created", "aten.mul_.Tensor"), str(f)
    assert "weight_decay=1e+41" in f.hint and "exploding learning rate" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("cls, state", [
    (torch.optim.Adam, "exp_avg_sq"), (torch.optim.NAdam, "exp_avg_sq"), (torch.optim.RAdam, "exp_avg_sq"),
    (torch.optim.Adagrad, "sum"), (functools.partial(torch.optim.RMSprop, centered=True), "square_avg")],
    ids=["adam", "nadam", "radam", "adagrad", "rmsprop-centered"])
def test_a_coupled_weight_decay_that_overflows_the_squared_state_is_named(cls: Any, state: str, mode: str) -> None:
    # weight decay added to the gradient (g + wd * w, not AdamW's decoupled mul_): a weight_decay of 1e37
    # overflows the state of squared gradients at the first step, with every gradient finite and small.
    # The hint blamed an exploding learning rate (its lr is 0.001) or the denominator at 0: the shadow
    # step judged only the states it had before its own first step, when this one was made
    m = zoo.cnn()
    opt = cls(m.parameters(), lr=1e-3, weight_decay=1e37)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for _ in range(2):
            F.cross_entropy(m(torch.randn(8, 1, 8, 8, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    # (sentinel reads the optimizer's state on a hit: at step 0, or at step 1 with the window, steps 0 to 1)
    assert f.step in ((0,) if mode == "full" else (0, 1)), str(f)
    assert (f.phase, f.tensor, f.cause, f.op) == (
        "optimizer", f"state[{state!r}]", "created", "aten.addcmul_.default"), str(f)
    assert "weight_decay=1e+37" in f.hint and "its state non-finite" in f.hint and "learning rate" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("schedule", ["one-cycle", "cosine-restarts"])
def test_the_lr_named_for_an_overflowing_update_is_the_one_its_step_ran_with(schedule: str, mode: str) -> None:
    # a max_lr of 1e37: the update of step 1 overflows the weight. Sentinel reads the state only on the
    # next step's hit, after scheduler.step() has moved the lr on: the hint named that next lr (6.6e+35,
    # 5e+36), not the one the failing update used
    data = _regression_data(0.2)
    m = _regression()
    opt = torch.optim.SGD(m.parameters(), lr=1e37)
    sched: Any = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e37, total_steps=40, pct_start=0.5)
                  if schedule == "one-cycle" else torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=4))
    lrs: list[float] = []
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for x, y in data:
            F.mse_loss(m(x).double(), y.double()).backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.tensor, f.step, f.cause) == ("optimizer", "weight", 1, "created"), str(f)
    assert f"its lr is {lrs[1]:.3g}" in f.hint, (f.hint, lrs)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_warm_up_that_starts_at_a_huge_lr_names_that_steps_lr_not_the_lr_of_now(mode: str, nesterov: bool) -> None:
    """A warm-up bug: the schedule gives 1e38 times the base lr at step 0 and the base lr after. That
    one update makes the last Linear's weights ~1e36, and step 1's forward overflows in it. The hint
    said "with SGD lr=0.1: grown step after step", the lr of now, which is not the one to fix."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 5))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e38 if s == 0 else 1.0)
    g = torch.Generator().manual_seed(1)
    before = None
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for _ in range(4):
            x, y = torch.randn(8, 3, 8, 8, generator=g) * 10, torch.randint(0, 5, (8,), generator=g)
            before = snapshot(m)
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "5", 1, "created", "aten.addmm.default"), f
    assert "with SGD lr=0.1 now), and step 0's step() ran with lr=1e+37" in f.hint, f.hint
    assert "grown step after step" not in f.hint, f.hint
    assert same_state(snapshot(m), before)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("tell", [False, True])
@pytest.mark.parametrize("change", ["assign", "double", "head"])
def test_an_optimizer_built_again_mid_run_is_watched_in_place_of_the_one_it_replaces(
        mode: str, tell: bool, change: str) -> None:
    """``model.load_state_dict(sd, assign=True)`` mid-run gives the model new Parameter objects
    (``model.double()`` keeps them; a new head replaces some), and the script builds its optimizer
    again. The watched one never steps again: the step count stopped there (an exp overflow at
    step 4 was told as step 2), also after ``hunt.add_optimizer(new)`` (a round waited for the old
    one), and the new one's update was not probed. Now the new optimizer takes the old one's place,
    found at its first step or when given: the steps are the loop's, an update it overflows is an
    optimizer finding."""

    def run(hunt: Any, bad: str | None) -> tuple[nn.Module, list[torch.Tensor]]:
        torch.manual_seed(0)
        m = zoo.expnet()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        if hunt is not None:
            hunt = nanhunt.watch(m, optimizer=opt, mode=mode)
        g = torch.Generator().manual_seed(1)
        outs = []
        try:
            for step in range(6):
                if step == 2:
                    if change == "assign":
                        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
                    elif change == "double":
                        m.double()
                    else:
                        m[2] = nn.Linear(8, 1)  # a new head: the old optimizer holds the old one's and the rest
                    opt = torch.optim.SGD(m.parameters(), lr=(1e308 if change == "double" else 3e38) if bad == "lr" else 0.01)
                    if hunt is not None and tell:
                        hunt.add_optimizer(opt)
                x = torch.randn(8, 4, generator=g)
                if change == "double" and step >= 2:
                    x = x.double()
                if bad == "x" and step == 4:
                    x[3] = 1000.0  # exp overflows
                out = m(x)
                outs.append(out.detach())
                out.mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            if hunt is not None:
                hunt.close()
                assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        return m, outs

    ref, ref_outs = run(None, None)
    m, outs = run(True, None)
    assert all(bit_equal(a, b) for a, b in zip(ref_outs, outs))
    assert all(bit_equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
    with pytest.raises(nanhunt.NonFiniteError) as err:
        run(True, "x")
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "1", 4, "created", "aten.exp.default"), f
    if mode == "full":
        with pytest.raises(nanhunt.NonFiniteError) as err:
            run(True, "lr")
        f = err.value.finding
        assert (f.phase, f.module, f.tensor, f.step, f.cause) == ("optimizer", "2", "weight", 2, "created"), f
        assert ("1e+308" if change == "double" else "3e+38") in f.hint, f.hint
