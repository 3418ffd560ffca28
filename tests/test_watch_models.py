"""Real models: training is bit-identical with and without the watch (dropout, BatchNorm, replays
after a hit included), and intended -inf masks are not findings."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

from . import zoo
from .zoo import bit_equal, same_state, snapshot


def _train(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
           watch: dict[str, Any] | None, opt_cls: type = torch.optim.AdamW, seed: int = 123
           ) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]], dict[str, torch.Tensor], torch.Tensor, Any]:
    """Train a few steps; return losses, grads per step, final state, RNG state after, the hunt."""
    opt = opt_cls(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    losses, grads = [], []
    hunt = nanhunt.watch(model, opt, **watch) if watch is not None else None
    try:
        for b in batches:
            loss = loss_fn(model, b)
            if hunt is not None:
                hunt.check(loss, "loss")
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    finally:
        if hunt is not None:
            hunt.close()
    return losses, grads, snapshot(model), torch.get_rng_state(), hunt


def _assert_identical(make: Callable[[], nn.Module], batches: list[Any],
                      loss_fn: Callable[[nn.Module, Any], torch.Tensor], watch: dict[str, Any]) -> Any:
    a = _train(make(), batches, loss_fn, None)
    b = _train(make(), batches, loss_fn, watch)
    assert all(bit_equal(x, y) for x, y in zip(a[0], b[0])), "losses differ"
    assert all(bit_equal(g, h) for ga, gb in zip(a[1], b[1]) for g, h in zip(ga, gb)), "gradients differ"
    assert same_state(a[2], b[2]), "weights or buffers differ"
    assert torch.equal(a[3], b[3]), "the RNG stream was disturbed"
    return b[4]


def _ids(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 100, (2, 8), generator=g) for _ in range(n)]


def test_gpt2_training_is_bit_identical() -> None:
    hunt = _assert_identical(lambda: zoo.gpt2(attn="eager"), _ids(), lambda m, ids: m(ids, labels=ids).loss,
                             {"on_find": "raise"})
    assert hunt.findings == [] and hunt.step == 3


def test_gpt2_sdpa_with_causal_masking_has_no_findings() -> None:
    hunt = _assert_identical(lambda: zoo.gpt2(attn="sdpa"), _ids(2), lambda m, ids: m(ids, labels=ids).loss,
                             {"on_find": "raise"})
    assert hunt.findings == []


def test_bert_with_padding_mask_is_bit_identical() -> None:
    def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0
        return m(ids, attention_mask=mask).last_hidden_state.pow(2).mean()

    hunt = _assert_identical(zoo.bert, _ids(), loss, {"on_find": "raise"})
    assert hunt.findings == []


def test_transformer_encoder_with_causal_inf_mask_is_bit_identical() -> None:
    """The -inf causal mask goes *in*; softmax keeps every row finite: nothing to report."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 6, 16, generator=g) for _ in range(3)]
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    assert torch.isinf(causal).any()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x, mask=causal, is_causal=True).pow(2).mean()

    hunt = _assert_identical(zoo.transformer_encoder, xs, loss, {"on_find": "raise"})
    assert hunt.findings == []


def _images(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def test_cnn_with_batchnorm_and_inplace_relu_is_bit_identical() -> None:
    hunt = _assert_identical(zoo.cnn, _images(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), {"on_find": "raise"})
    assert hunt.findings == []


def test_bit_identical_after_record_mode_hits_and_replays() -> None:
    """Every step has a forward hit (the unused log-activation output), so every step is replayed:
    dropout's RNG stream, BatchNorm's running statistics and .grad must come out untouched."""
    hunt = _assert_identical(zoo.auxcnn, _images(4), lambda m, b: F.cross_entropy(m(b[0])["logits"], b[1]),
                             {"on_find": "record"})
    assert [f.step for f in hunt.findings if f.phase == "forward"] == [0, 1, 2, 3]
    f = hunt.first
    assert (f.module, f.tensor, f.cause, f.value) == ("", "output['log_act']", "created", float("-inf"))


def test_bit_identical_after_a_record_mode_backward_hit() -> None:
    """A backward hit (sqrt at 0) is replayed with autograd: nothing may accumulate into .grad."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g) for _ in range(3)]
    xs[1][0, 2:] = xs[1][0, :2]

    def make() -> nn.Module:
        m = zoo.distnet()
        return nn.Sequential(m, nn.Dropout(0.3))

    hunt = _assert_identical(make, xs, lambda m, x: m(x).sum(), {"on_find": "record"})
    assert hunt.first.phase == "backward" and hunt.first.module == "0.dist" and hunt.first.step == 1


def test_watch_on_a_model_in_eval_and_no_grad() -> None:
    m = zoo.gpt2()
    m.eval()
    ids = _ids(1)[0]
    with torch.no_grad():
        ref = m(ids).logits
        with nanhunt.watch(m) as hunt:
            for _ in range(3):
                out = m(ids).logits
    assert bit_equal(ref, out) and hunt.findings == []


class _MaskedMeanPool(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (x * m).sum(1) / m.sum(1)  # 0/0 for a sequence of length 0


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pool, self.head = nn.Linear(4, 8), _MaskedMeanPool(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.embed(x), mask))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_born_in_a_validation_pass_says_it_was_in_evaluation(mode: str) -> None:
    """Training batches all have tokens; a validation batch holds a sequence of length 0 (masked
    mean pooling: 0/0). The finding is the pooling's forward in the validation call, and says it ran
    in evaluation; a training step's finding does not."""
    torch.manual_seed(0)
    m = _Classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, mask = torch.randn(4, 5, 4), torch.ones(4, 5, dtype=torch.bool)
    with nanhunt.watch(m, opt, on_find="record", mode=mode) as hunt:
        for _ in range(2):
            F.cross_entropy(m(x, mask), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
            opt.zero_grad()
        m.eval()
        with torch.no_grad():
            val_mask = mask.clone()
            val_mask[2] = False
            m(x, val_mask)
        m.train()
    f = hunt.first
    assert (f.phase, f.module, f.step, f.index[0], f.cause) == ("forward", "pool", 2, 2, "created"), f
    assert f.evaluation and "in evaluation" in str(f)
    assert nanhunt.Finding.from_dict(f.to_dict()) == f
    with nanhunt.watch(m, opt, on_find="record", mode=mode) as hunt:
        F.cross_entropy(m(x, val_mask), torch.tensor([0, 1, 2, 0])).backward()
    f = hunt.first
    assert (f.phase, f.module) == ("forward", "pool") and not f.evaluation and "evaluation" not in str(f)


# ---------------------------------------------------------------------------- intended -inf
class MaskedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = zoo.CausalAttention(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def test_a_mask_module_outputs_inf_and_is_reported_unless_ignored() -> None:
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    m = MaskedModel()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x).sum().backward()
    f = hunt.first
    assert (f.phase, f.module, f.module_type, f.value, f.cause) == ("forward", "attn.mask", "CausalMask",
                                                                    float("-inf"), "created")
    for pattern in ("attn.mask", "*mask", "*.mask"):
        with nanhunt.watch(m, on_find="raise", ignore=[pattern]) as hunt:
            m(x).sum().backward()
        assert hunt.findings == [], pattern


def test_a_parent_returning_an_ignored_output_unchanged_is_not_a_finding() -> None:
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("block", zoo.MaskPassThrough(8))
    x = torch.randn(2, 5, 8)
    with nanhunt.watch(m, ignore=["*mask"]) as hunt:
        for _ in range(2):
            h, mask = m(x)
            (h.sum() + (h[:, :, :5] + mask[None]).softmax(-1).sum()).backward()
    assert hunt.findings == []


def test_ignore_does_not_hide_real_failures_elsewhere() -> None:
    torch.manual_seed(0)
    m = MaskedModel()
    with torch.no_grad():
        m.head.weight[0, 3] = float("nan")
    ref = copy.deepcopy(m)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    with nanhunt.watch(m, ignore=["*mask"], on_find="record") as hunt:
        m(x)
    zoo.assert_finding(hunt.first, phase="forward", module="head", module_type="Linear", tensor="output", step=0,
                       call=0, cause="parameter", expected=ref.head(ref.attn(x)).detach())


@pytest.mark.parametrize("pattern", [3, [None]])
def test_ignore_must_be_patterns(pattern: Any) -> None:
    with pytest.raises(TypeError):
        nanhunt.watch(zoo.mlp(), ignore=pattern)


@pytest.mark.parametrize("mode", ["full", "sentinel", "ops"])
def test_lazy_modules_watched_before_their_first_call(mode: str, tmp_path: Any) -> None:
    """A model of lazy modules (LazyLinear, LazyBatchNorm1d), watched with its optimizer before the
    first batch gives them their shapes: the first forward failed with nanhunt's InternalError
    (numel of an uninitialised parameter), the hunt switched itself off, and `nanhunt run` said
    "clean". Now the log(0) born in that very first call is found, the run's values are those of
    the unwatched run, and checkpoints are judged (before and after the first call)."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.LazyLinear(6), nn.LazyBatchNorm1d(), nn.ReLU(), zoo.Log(), nn.LazyLinear(1))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def run(m: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        outs = []
        for _ in range(2):
            out = m(torch.randn(8, 5))
            outs.append(out.detach().clone())
            out.nan_to_num().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return outs

    plain = run(*build())
    m, opt = build()
    with nanhunt.watch(m, opt, on_find="record", mode=mode) as hunt:
        torch.save(m.state_dict(), tmp_path / "before.pt")  # uninitialised: nothing to judge, written
        watched = run(m, opt)
        with pytest.raises(nanhunt.NonFiniteError):
            torch.save(m.state_dict(), tmp_path / "after.pt")  # the NaN gradients reached the weights
    assert all(bit_equal(a, b) for a, b in zip(plain, watched))
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.cause) == ("forward", "3", 0, "created")
    if mode != "sentinel":
        assert f.op == "aten.log.default"


class _MaskThenWork(nn.Module):
    """A mask module (ignored) whose output is freed right after use, then real work: the next
    outputs may take the mask's freed object id (with version 0 too)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mask = zoo.CausalMask()
        self.lin = nn.Linear(d, d)
        self.log = zoo.Log()
        self.shift = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = (x @ x.transpose(-1, -2) + self.mask(x)[None]).softmax(-1)  # (the mask object dies here)
        return self.log(self.lin(s @ x) - self.shift)


def test_an_ignored_outputs_reused_id_does_not_hide_a_later_modules_nan() -> None:
    """An ignored module's outputs were remembered by (id, version) alone: once the mask tensor
    was freed, a later module's output could take its id and was skipped as ignored, and its NaN
    was never found (silently, every step after the first)."""
    torch.manual_seed(0)
    m = _MaskThenWork()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(2, 5, 8)
    missed = []
    for trial in range(20):  # ids are reused by chance: many steps make it near certain
        with nanhunt.watch(m, opt, on_find="record", ignore=["*mask"]) as hunt:
            for step in range(3):
                m.shift = 100.0 if step == 2 else -100.0
                m(x).nan_to_num().sum().backward()
                opt.step()
                opt.zero_grad()
        f = hunt.first
        if f is None or (f.phase, f.module, f.step, f.cause) != ("forward", "log", 2, "created"):
            missed.append((trial, f))
    assert not missed, missed[:3]


class _Conj(nn.Module):
    """A spectral block's FFT, conjugated: a lazy conj view (torch's view_as_real refuses it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x).conj()


class _Real(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.fft.ifft(z).real


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_returning_a_conjugate_view_is_watched_and_replayed(mode: str) -> None:
    """A spectral block whose module returns ``fft(x).conj()``: full mode's sampled statistics
    and the replay read it (once resolved) instead of failing; the NaN born later is found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Conj(), _Real(), nn.Linear(8, 4), zoo.Log())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    with nanhunt.watch(model, optimizer=opt, mode=mode, on_find="record") as hunt:
        for _ in range(3):
            out = model(x)
            out.nan_to_num().pow(2).mean().backward()
            hunt.check(out.sum(), "out")
            opt.step()
            opt.zero_grad()
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.cause, f.op) == ("forward", "4", "created", "aten.log.default"), str(f)
    assert f.reproducible


@pytest.mark.parametrize("change", ["del", "pop", "insert"])
def test_a_container_changed_under_an_open_hunt_is_named_as_it_is_now(change: str) -> None:
    """``del model[1]`` / ``model.pop(1)`` renumber a Sequential's children and ``insert`` shifts
    them, all without torch's module registration hook: the full-mode hunt kept its old name map,
    so an exp overflow after ``del model[1]`` was reported in ``"3"`` (the Linear there now), and
    one in a block inserted mid-run was blamed on the root (the new block had no `Forward`: not
    seen). Now the overflow is named where ``named_modules()`` puts it, and the run is unchanged."""

    def build() -> tuple[nn.Sequential, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 8), zoo.Exp(), nn.Linear(8, 1))
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    def run(m: nn.Sequential, opt: torch.optim.Optimizer, steps: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        outs = []
        for s in range(steps):
            if s == 2:
                if change == "del":
                    del m[1]
                elif change == "pop":
                    m.pop(1)
                else:
                    torch.manual_seed(3)
                    m.insert(1, nn.Sequential(nn.Linear(8, 8), zoo.Exp()))
                    opt.add_param_group({"params": list(m[1].parameters())})
            x = torch.randn(3, 4, generator=g)
            if s == 3:
                x[0] = 3000.0  # exp overflows in the Exp right after the change
            out = m(x)
            outs.append(out.detach())
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        return outs

    ref = run(*build(), steps=3)
    m, opt = build()
    with nanhunt.watch(m, optimizer=opt) as hunt:
        assert all(bit_equal(a, b) for a, b in zip(ref, run(m, opt, steps=3)))
    assert hunt.findings == []
    m, opt = build()
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, optimizer=opt):
        run(m, opt, steps=4)
    f = err.value.finding
    where = "1.1" if change == "insert" else "2"
    assert dict(m.named_modules())[where].__class__ is zoo.Exp
    assert (f.phase, f.module, f.module_type, f.step, f.cause, f.op) == (
        "forward", where, "Exp", 3, "created", "aten.exp.default"), f
    assert all("forward" not in mod.__dict__ for mod in m.modules())
