"""Op-level origin (issue 3): the aten op / autograd node and the user's line that made the value.

Every scenario runs through the public API (``nanhunt.watch`` + a training step) and checks
``finding.op``, ``finding.source`` (computed from marker comments, never hard-coded) and the order
of ``finding.chain``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt._locate import oplevel as _oplevel
from tests import zoo

HERE = os.path.abspath(__file__)
with open(HERE) as _f:
    _LINES = _f.read().splitlines()


def line(marker: str) -> str:
    """``file:LINE`` of the line carrying ``# @marker``."""
    hits = [i + 1 for i, s in enumerate(_LINES) if s.rstrip().endswith(f"# @{marker}")]
    assert len(hits) == 1, marker
    return f"{HERE}:{hits[0]}"


def same_source(got: str | None, want: str) -> bool:
    if got is None:
        return False
    gf, gl = got.rsplit(":", 1)
    wf, wl = want.rsplit(":", 1)
    return gl == wl and os.path.realpath(gf) == os.path.realpath(wf)


def chain_ops(chain: tuple[str, ...]) -> list[str]:
    return [c.split(" @ ")[0] for c in chain]


def train_step(model: nn.Module, x: torch.Tensor, **watch: object) -> nanhunt.Finding:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, **watch):
            loss = model(x).float().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return ei.value.finding


# ---------------------------------------------------------------- forward scenarios
class ExpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 100.0
        return torch.exp(h)  # @exp


def test_exp_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ExpBlock(), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].lin.bias.fill_(1.0)
    f = train_step(model, torch.ones(3, 4))
    assert f.phase == "forward" and f.module == "1" and f.reproducible is True
    assert f.op == "aten.exp.default"
    assert same_source(f.source, line("exp"))
    assert chain_ops(f.chain) == ["aten.exp.default"]
    assert same_source(f.chain[0].split(" @ ")[1], line("exp"))


class LogSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(x * 1000.0, dim=-1)  # @softmax-underflow
        return torch.log(p)  # @log


def test_log_of_underflowed_softmax() -> None:
    model = nn.Sequential(nn.Linear(4, 4), LogSoftmax())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    f = train_step(model, torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    assert f.module == "1" and f.value == -math.inf
    assert f.op == "aten.log.default"
    assert same_source(f.source, line("log"))
    assert chain_ops(f.chain) == ["aten.log.default"]


class MaskedAttention(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = scores.masked_fill(~mask, float("-inf"))  # @masked-fill
        return torch.softmax(s, dim=-1)  # @masked-softmax


class AttnModel(nn.Module):
    def __init__(self, fully_masked_row: bool) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.attn = MaskedAttention()
        self.out = nn.Linear(3, 2)
        self.fully = fully_masked_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2)
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        if self.fully:
            mask[1] = False
        return self.out(self.attn(scores, mask))


def test_fully_masked_softmax() -> None:
    torch.manual_seed(0)
    f = train_step(AttnModel(fully_masked_row=True), torch.randn(3, 4))
    assert f.module == "attn" and math.isnan(f.value) and f.index[0] == 1
    assert f.op == "aten.masked_fill.Scalar"
    assert same_source(f.source, line("masked-fill"))
    ops = chain_ops(f.chain)
    assert ops == ["aten.masked_fill.Scalar", "aten._softmax.default"]
    assert same_source(f.chain[1].split(" @ ")[1], line("masked-softmax"))


class BiasAttention(nn.Module):
    """Attention that takes its key mask as an additive bias (0 or -inf), as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2) + bias
        return torch.softmax(scores, dim=-1) @ q  # @bias-softmax


class BiasModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = BiasAttention()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, bias))


def test_a_mask_passed_in_as_an_additive_bias_blames_the_softmax_of_the_fully_masked_row() -> None:
    # the -inf comes in with the mask (built in the loop): the value is born where the softmax of a
    # fully masked row makes nan of it, not "fed from before the call" with no op at all
    torch.manual_seed(0)
    model = BiasModel()
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1] = False  # the second sequence is all padding
    bias = torch.zeros(2, 1, 3).masked_fill(~keep[:, None, :], float("-inf"))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model):
        model(torch.randn(2, 3, 4), bias).sum().backward()
    f = ei.value.finding
    assert (f.phase, f.module, f.index[0], f.cause) == ("forward", "attn", 1, "created") and math.isnan(f.value)
    assert f.op == "aten._softmax.default" and same_source(f.source, line("bias-softmax"))
    assert chain_ops(f.chain)[:2] == ["aten._softmax.default", "aten.bmm.default"]
    assert "fully masked row" in (f.hint or "")


class LogBetweenChildren(nn.Module):
    """The root's own code makes -inf between two children: by arithmetic (log of 0), or as a
    mask (masked_fill) over a row that a child's softmax then turns into NaN."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 1), how
        self.soft = nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).abs() * (x[:, :1] != 0)
        if self.how == "log":
            h = torch.log(h)  # @root-log
            return self.b(h)
        h = h.masked_fill(x[:, :1] == 0, float("-inf"))
        return self.b(self.soft(h))


@pytest.mark.parametrize("how", ["log", "mask"])
def test_a_minus_inf_the_parent_computes_is_born_there_a_mask_it_writes_is_not(how: str) -> None:
    # a -inf a child turns into NaN is a mask (born where the NaN is made) only when it was written
    # as one; log(0) in the root's own code was blamed on the child Linear ("created" in addmm)
    torch.manual_seed(0)
    x = torch.randn(4, 4) + 5
    x[0, 0] = 0.0
    f = train_step(LogBetweenChildren(how), x)
    assert f.phase == "forward" and f.cause == "created" and math.isnan(f.value), f
    if how == "log":
        assert (f.module, f.op) == ("", "aten.log.default") and same_source(f.source, line("root-log")), f
        assert chain_ops(f.chain) == ["aten.log.default", "aten.addmm.default"]
    else:
        assert (f.module, f.op) == ("soft", "aten._softmax.default"), f  # where the mask became NaN
        assert "fully masked row" in (f.hint or "")


class Constrained(nn.Module):
    """Constrained decoding: disallowed classes get -inf logits (``ignore`` lets the model return them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def test_a_mask_that_reaches_a_sum_is_blamed_where_it_turns_into_inf() -> None:
    # label smoothing sums -log p over every class, masked (-inf) ones included: +inf, born in the
    # loss code where the mask's -inf (fed in from the model) is negated, not "not localised"
    torch.manual_seed(0)
    model = Constrained()
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[:, 4] = False
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, ignore=[""]):
        logits = model(torch.randn(3, 4), allowed)
        F.cross_entropy(logits, torch.tensor([0, 1, 2]), label_smoothing=0.1).backward()  # @smoothing
    f = ei.value.finding
    assert f.module == "<outside>" and f.value == math.inf
    assert f.op == "aten.neg.default" and same_source(f.source, line("smoothing"))
    assert chain_ops(f.chain)[0] == "aten.neg.default" and chain_ops(f.chain)[-1] == "aten.add.Tensor"
    assert "mask" in (f.hint or "") and "finfo" in (f.hint or "")


class InPlaceMask(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        if self.how == "index_put":
            h[torch.tensor([False, True, False])] = float("-inf")  # @inplace-index_put
        else:
            h[1].fill_(float("-inf"))  # @inplace-view
        return torch.softmax(h, dim=-1)  # @inplace-softmax


@pytest.mark.parametrize("how", ["index_put", "view"])
def test_in_place_writes_are_followed(how: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), InPlaceMask(how))
    f = train_step(model, torch.randn(3, 3))
    assert f.module == "1" and f.index == (1, 0)
    assert f.op == ("aten.index_put_.default" if how == "index_put" else "aten.fill_.Scalar")
    assert same_source(f.source, line(f"inplace-{how}"))
    assert chain_ops(f.chain) == [f.op, "aten._softmax.default"]


class PaddedVocabEntropy(nn.Module):
    """A vocabulary padded past its real size, the padding masked with -inf written into a slice
    (a view, not contiguous in memory), then an entropy term p * log p: 0 * -inf = nan there."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = nn.Linear(8, 6), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.lin(x)
        if self.how == "slice":
            t[:, 4:] = float("-inf")  # @pad-slice
        elif self.how == "narrow":
            t.narrow(1, 4, 2).fill_(float("-inf"))  # @pad-narrow
        else:
            t[..., 4:].copy_(torch.full((t.shape[0], 2), float("-inf")))  # @pad-copy
        lp = F.log_softmax(t, -1)  # @pad-log_softmax
        return (lp.exp() * lp).sum(-1)  # @pad-entropy


@pytest.mark.parametrize("how", ["slice", "narrow", "copy"])
def test_a_mask_written_into_a_slice_is_followed_to_its_line(how: str) -> None:
    # the element followed lies in the slice at another index than in the whole tensor: the op
    # trace lost it (op None, chain empty) and the hint blamed 0/0 from finite inputs
    torch.manual_seed(0)
    f = train_step(PaddedVocabEntropy(how), torch.randn(4, 8))
    assert (f.module, f.index, f.cause) == ("", (0,), "created"), f
    ops = chain_ops(f.chain)
    assert same_source(f.source, line(f"pad-{how}")), f
    assert f.op == ops[0] and ops[0] in ("aten.fill_.Tensor", "aten.fill_.Scalar", "aten.full.default"), f
    assert "aten._log_softmax.default" in ops and ops[-2:] == ["aten.mul.Tensor", "aten.sum.dim_IntList"], f.chain
    assert same_source(f.chain[-1].split(" @ ")[1], line("pad-entropy"))
    assert f.hint is not None and "-inf mask written by" in f.hint and "xlogy" in f.hint, f.hint


class MaskThenExp(nn.Module):
    """An intended -inf mask, consumed by a softmax that stays finite; then a real overflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x @ x.transpose(-1, -2)
        causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        y = torch.where(x > 0, x, torch.log(x))  # the untaken branch is NaN
        return p @ torch.exp(y * 1000.0)  # @real-overflow


def test_intended_mask_and_untaken_where_are_not_blamed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), MaskThenExp())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    f = train_step(model, torch.tensor([[1.0, -1.0, 0.5, 2.0], [0.1, 0.2, -0.3, 0.4], [1.0, 1.0, 1.0, 1.0]]))
    assert f.module == "1"
    assert f.op == "aten.exp.default"
    assert same_source(f.source, line("real-overflow"))
    assert not any("masked_fill" in c or "log" in c for c in f.chain)
    assert chain_ops(f.chain)[0] == "aten.exp.default"


class WhereTie(nn.Module):
    """At the reported element both branches are non-finite; only the taken one is to blame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.log(x)  # NaN where x < 0 (untaken there)
        b = torch.exp(-x * 100.0)  # @taken-branch
        return torch.where(x > 0, a, b)  # @where


def test_where_follows_the_taken_branch() -> None:
    model = nn.Sequential(nn.Linear(2, 2), WhereTie())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    f = train_step(model, torch.tensor([[1.0, -1.0]]))
    assert f.module == "1" and f.value == math.inf and f.index == (0, 1)
    assert f.op == "aten.exp.default"
    assert same_source(f.source, line("taken-branch"))
    assert chain_ops(f.chain) == ["aten.exp.default", "aten.where.self"]
    assert same_source(f.chain[1].split(" @ ")[1], line("where"))


def test_intended_mask_alone_is_no_finding() -> None:
    torch.manual_seed(0)
    model = AttnModel(fully_masked_row=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, optimizer=opt) as hunt:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert hunt.findings == []


class Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.half())  # @fp16


def test_fp16_matmul_overflow() -> None:
    model = nn.Sequential(Half())
    model[0].fc.half()
    with torch.no_grad():
        model[0].fc.weight.fill_(1.0)
        model[0].fc.bias.zero_()
    f = train_step(model, torch.full((2, 128), 1000.0))
    assert f.module == "0.fc" and f.dtype == "float16" and f.value == math.inf
    assert f.op == "aten.addmm.default"
    assert same_source(f.source, line("fp16"))
    assert chain_ops(f.chain) == ["aten.addmm.default"]


class HalfMaskedAttention(nn.Module):
    """Eager attention in float16 with a finite key mask (``finfo(float16).min`` at padding), as
    Hugging Face builds it: ``q @ k.T * scale + mask``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.zero_()
            self.q.bias.fill_(1.0)
            self.k.weight.copy_(torch.eye(d))
            self.k.bias.zero_()
        self.half()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask  # @half-scores
        return torch.softmax(scores, dim=-1)


def test_fp16_attention_overflow_behind_a_finfo_min_mask_blames_the_matmul() -> None:
    # key 0 is padding with a finite negative score: score + finfo.min rounds to -inf in the add,
    # harmless (softmax gives it 0); key 2's score overflows float16 in q @ k.T (+inf), and the
    # softmax of its row is nan. The nan is born of the +inf, not of the mask's -inf
    model = HalfMaskedAttention()
    x = torch.zeros(1, 4, 8, dtype=torch.float16)
    x[0, 0] = -100.0  # score -283: finite
    x[0, 2] = 30000.0  # score 240000 in float32: +inf in float16
    mask = torch.zeros(1, 4, 4, dtype=torch.float16)
    mask[..., 0] = torch.finfo(torch.float16).min
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt):
        model(x, mask).float().sum().backward()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause) == ("forward", "", "created") and math.isnan(f.value)
    assert f.op == "aten.bmm.default" and same_source(f.source, line("half-scores"))
    assert chain_ops(f.chain) == ["aten.bmm.default", "aten.mul.Tensor", "aten.add.Tensor", "aten._softmax.default"]
    assert "aten.bmm.default" in (f.hint or "") and "65504" in (f.hint or "")
    assert "-inf" not in (f.hint or "")

@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fp16_attention_scores_past_65504_in_the_matmul_are_told_to_scale_q_before_it(mode: str) -> None:
    # q @ k.T overflows float16 before the scores are scaled after it, and the softmax of the row
    # is nan. The hint was any overflow's "keep this module in float32/bfloat16 or scale before it":
    # the matmul's output goes into a softmax, so it names the attention scores and the usual fixes
    model = HalfMaskedAttention()
    x = torch.zeros(1, 4, 8, dtype=torch.float16)
    x[0, 2] = 30000.0  # score 240000 in float32: +inf in float16
    with nanhunt.watch(model, mode=mode, on_find="record") as hunt:
        model(x, torch.zeros(1, 4, 4, dtype=torch.float16))
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("", "aten.bmm.default", "precision"), f
    assert same_source(f.source, line("half-scores"))
    assert "attention scores" in f.hint and "head_dim ** -0.5 before the matmul" in f.hint, f.hint
    assert "QK-norm" in f.hint and "scale before it" not in f.hint, f.hint


def test_a_finfo_min_mask_added_to_negative_scores_in_float16_is_told_as_the_mask_overflowing() -> None:
    # an HF-style extended mask, (1 - mask) * torch.finfo(float16).min, added to scores that are
    # negative: the sum passes float16's lowest value and is -inf, and the fully masked row (a query
    # of padding) softmaxes to nan. The hint said only "keep this module in float32 or scale before
    # it"; the numbers show the addend that overflowed is the mask
    model = HalfMaskedAttention()
    x = torch.full((1, 4, 8), -10.0, dtype=torch.float16)  # every score -28.3
    mask = torch.zeros(1, 4, 4, dtype=torch.float16)
    mask[0, 0, 3] = mask[0, 1] = torch.finfo(torch.float16).min  # query 1: every key masked
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt):
        model(x, mask).float().sum().backward()
    f = ei.value.finding
    assert (f.phase, f.module, f.index, f.verdict) == ("forward", "", (0, 1, 0), "precision") and math.isnan(f.value), f
    assert f.op == "aten.add.Tensor" and same_source(f.source, line("half-scores")), f
    assert "torch.finfo(float16).min" in f.hint and "masked_fill" in f.hint, f.hint


class _MaskedThenBiased(nn.Module):
    """Scores masked with ``masked_fill(pad, torch.finfo(scores.dtype).min)``, then a position bias
    added (ALiBi): in float16 the masked scores plus a bias below -16 are -inf."""

    def forward(self, scores: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = scores.masked_fill(pad[:, None, :], torch.finfo(scores.dtype).min)
        bias = -20.0 * (1 + (torch.arange(4)[None, :] - torch.arange(4)[:, None]).abs())
        return (scores + bias.to(scores.dtype)).softmax(-1)  # @alibi-add


def test_a_finfo_min_fill_is_no_overflow_in_the_reference_the_add_after_it_is() -> None:
    """The float32 reference fills with float32's lowest value (-3.4e38, past 65504), so the
    reference named the masked_fill as the op that overflowed, its failing value -65504 (finite):
    an op finite in the failing run made no overflow; the add after it, -inf there, is named."""
    model = _MaskedThenBiased()
    scores = torch.zeros(2, 4, 4, dtype=torch.float16)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1] = True  # an empty sequence: every key masked
    with nanhunt.watch(model, on_find="record") as hunt:
        model(scores, pad)
    f = hunt.first
    assert f is not None and (f.module, f.op, f.verdict) == ("", "aten.add.Tensor", "precision"), f
    assert same_source(f.source, line("alibi-add"))
    ref = f.reference
    assert ref["op"] == "aten.add.Tensor" and ref["failing"] == -math.inf and ref["limit"] == 65504.0, ref
    # (the fill was a masked_fill already: the hint's fix is to fill after the bias, not to use one)
    assert "torch.finfo(float16).min" in f.hint and "after every addition" in f.hint, f.hint


class _WideMaskAttention(nn.Module):
    """A half() attention whose extended key mask is made in float32, ``pad * torch.finfo(
    torch.float32).min`` (or ``pad * -1e9``), and cast to the scores' dtype before the add."""

    def __init__(self, fill: float, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.fill = nn.Linear(d, d), nn.Linear(d, d), fill
        self.half()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) * x.shape[-1] ** -0.5
        mask = pad[:, None, :].float() * self.fill
        return (scores + mask.to(scores.dtype)).softmax(-1)  # @wide-mask-cast


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9])
def test_a_float32_mask_cast_to_float16_is_told_as_the_mask_made_in_the_wrong_dtype(fill: float, mode: str) -> None:
    # the cast makes -inf of the mask's value, and a sequence of padding only softmaxes to nan. The
    # op and line were right (the cast), but the hint was a large value's: "keep this module in
    # float32/bfloat16 or scale before it", where the fix is a mask made in the scores' dtype
    torch.manual_seed(0)
    model = _WideMaskAttention(fill)
    pad = torch.zeros(2, 4, dtype=torch.bool)
    with nanhunt.watch(model, mode=mode, on_find="record") as hunt:
        model(torch.randn(2, 4, 8, dtype=torch.float16), pad)
        pad[1] = True  # an empty sequence: every key masked
        model(torch.randn(2, 4, 8, dtype=torch.float16), pad)
    f = hunt.first
    assert f is not None and (f.module, f.step, f.op, f.index) == ("", 1, "aten._to_copy.default", (1, 0, 0)), f
    assert same_source(f.source, line("wide-mask-cast")) and math.isnan(f.value), f
    assert ("torch.finfo(torch.float32).min" if fill < -1e30 else "-1e+09") in f.hint, f.hint
    assert "torch.finfo(scores.dtype).min" in f.hint and "scale before it" not in f.hint, f.hint


class DropExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.drop(x) * 100.0)  # @drop-exp


def test_dropout_replay_is_faithful() -> None:
    model = nn.Sequential(nn.Linear(8, 8), DropExp())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    x = torch.ones(4, 8)
    torch.manual_seed(123)
    want = F.dropout(x, 0.5, training=True)  # the mask the run will draw
    first = tuple(int(i) for i in (want.reshape(-1) != 0).nonzero()[0])
    expected_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first[0]), x.shape))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(123)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt):
            model(x).sum().backward()
            after = torch.get_rng_state()
            opt.step()
    assert torch.equal(torch.get_rng_state(), after)  # the replays restored the user's stream
    f = ei.value.finding
    assert f.reproducible is True and f.module == "1" and f.index == expected_index
    assert f.op == "aten.exp.default"
    assert same_source(f.source, line("drop-exp"))


# ---------------------------------------------------------------- backward scenarios
class SqrtSq(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sq = x * x  # @square
        return torch.sqrt(sq)  # @sqrt


class SqrtModel(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.block = SqrtSq()
        self.head = nn.Linear(3, 1)
        self.keyword = keyword
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(self.block(x=h) if self.keyword else self.block(h))


@pytest.mark.parametrize("keyword", [False, True])
def test_sqrt_at_zero_blames_sqrt_not_consumer(keyword: bool) -> None:
    f = train_step(SqrtModel(keyword), torch.ones(2, 3))
    assert f.phase == "backward" and f.module == "block"
    assert f.tensor == ("grad_input['x']" if keyword else "grad_input[0]")
    assert f.op == "SqrtBackward0"
    assert same_source(f.source, line("sqrt"))
    assert chain_ops(f.chain) == ["SqrtBackward0", "MulBackward0"]
    assert same_source(f.chain[1].split(" @ ")[1], line("square"))


class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return x * 2.0

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        zero = x - x
        return g * 0.0 / zero  # @bad-backward


class BadMod(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Bad.apply(x) + 1.0  # @bad-apply


def test_custom_function_bad_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), BadMod(), nn.Linear(3, 1))
    f = train_step(model, torch.randn(2, 3))
    assert f.phase == "backward" and f.module == "1"
    assert chain_ops(f.chain) == ["aten.div.Tensor", "BadBackward"]
    assert_blames_the_backwards_line(f, "BadBackward", "bad-backward", "bad-apply")


def assert_blames_the_backwards_line(f: nanhunt.Finding, node: str, backward: str, apply: str) -> None:
    """A custom Function's bad backward: ``op`` the aten op of its backward that made the value, at
    its line there (where a user fixes it), the first of the chain; the next, its node at the line
    that applied it; the hint from the numbers (a division by 0)."""
    assert f.op == "aten.div.Tensor" and same_source(f.source, line(backward))
    assert chain_ops(f.chain)[:2] == ["aten.div.Tensor", node]
    assert f.chain[0] == f"{f.op} @ {f.source}"
    assert same_source(f.chain[1].split(" @ ")[1], line(apply))
    assert "division by 0" in (f.hint or "")


class SafeLog(torch.autograd.Function):
    """log(max(x, 1e-6)) whose hand-written backward forgot the clamp: g / x, -inf at x = 0."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return x.clamp_min(1e-6).log()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return g / x  # @safe-log-backward


class SafeLogRoot(nn.Module):
    """The Function applied in the root's own code, between its children."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(SafeLog.apply(self.lin(x)))  # @safe-log-apply


def test_custom_function_bad_backward_in_the_roots_own_code() -> None:
    f = train_step(SafeLogRoot(), torch.randn(2, 3))
    assert (f.phase, f.module, f.cause) == ("backward", "", "created") and math.isinf(f.value)
    assert f.tensor == "SafeLogBackward.grad_input[0]"  # the gradient is still named by its node
    assert_blames_the_backwards_line(f, "SafeLogBackward", "safe-log-backward", "safe-log-apply")


class BadForwardFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)  # @fn-forward

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g


class BadForwardMod(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BadForwardFn.apply(x)


def test_custom_function_forward_is_seen_op_by_op() -> None:
    model = nn.Sequential(nn.Linear(3, 3), BadForwardMod())
    f = train_step(model, torch.ones(2, 3))
    assert f.phase == "forward" and f.module == "1"
    assert f.op == "aten.div.Tensor"
    assert same_source(f.source, line("fn-forward"))


# ---------------------------------------------------------------- no state left behind
def test_locate_never_raises_and_leaves_no_hooks() -> None:
    from torch.nn.modules import module as m

    before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks))
    assert _oplevel.locate_forward(object(), {}, 0, (0,)) is None  # type: ignore[arg-type]
    assert _oplevel.locate_backward(object(), {}, [], [], 0, (0, 0)) is None  # type: ignore[arg-type]
    assert (len(m._global_forward_pre_hooks), len(m._global_forward_hooks)) == before
    assert not torch._C._is_any_autocast_enabled() if hasattr(torch._C, "_is_any_autocast_enabled") else True
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


class _PadNormalize(nn.Module):
    """Token embeddings normalised in float16: a padding token's embedding is all zeros, and
    F.normalize's eps (1e-12) is 0 in float16, so 0 / max(0, eps) = 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.emb(ids), dim=-1)


class _CastDown(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.half() - x.half()).float()  # inf - inf once the cast overflows


def test_hints_name_a_float16_eps_that_rounds_to_0_and_a_cast_that_overflows() -> None:
    torch.manual_seed(0)
    ids = torch.randint(1, 40, (2, 6))
    ids[1, 4:] = 0  # padding
    f = train_step(_PadNormalize().half(), ids)
    assert f.op == "aten.div.Tensor" and f.dtype == "float16", f
    assert "float16" in f.hint and "eps" in f.hint and "1e-12" in f.hint and "guard the denominator" not in f.hint, f.hint
    model = nn.Sequential(nn.Linear(4, 4), _CastDown())
    with torch.no_grad():
        model[0].weight.fill_(3e4)
    f = train_step(model, torch.ones(2, 4))
    assert f.op == "aten._to_copy.default" and f.module == "1", f
    assert f.hint.startswith("Overflow in a cast: 120000 is past float16's largest finite value 65504"), f.hint


class _LogThenSum(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x).sum(self.dim)  # log of a negative value: nan in that row


@pytest.mark.parametrize("dim", [0, -1])
def test_the_rows_sentence_only_for_a_reduction_over_the_rows(dim: int) -> None:
    # sum(-1) keeps one value per row: it was described as "a reduction over 8 rows ... (that sample)"
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4))
        lin.bias.zero_()
    x = torch.rand(8, 4) + 0.5
    x[2, 1] = x[5, 0] = -1.0
    f = train_step(nn.Sequential(lin, _LogThenSum(dim)), x)
    assert f.op == "aten.log.default" and f.module == "1", f
    if dim == 0:
        assert f.hint.endswith("over 8 rows: its input was non-finite at rows 2, 5 (those samples)."), f.hint
    else:
        assert "rows" not in f.hint and "sample" not in f.hint, f.hint


class _Poincare(nn.Module):
    """A hyperbolic distance: acosh(1 + 2|u - v|^2 / ((1 - |u|^2)(1 - |v|^2)))."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        v = torch.zeros_like(u)
        num = 2 * (u - v).pow(2).sum(-1)
        den = (1 - u.pow(2).sum(-1)) * (1 - v.pow(2).sum(-1))
        return torch.acosh(1 + num / den)


def test_acosh_has_a_hint_of_its_own() -> None:
    # a point pushed past the ball's edge (|u| > 1): the argument is below 1, acosh gives nan. The
    # hint was the generic "0/0, a fully masked row, log/sqrt of a negative number"
    u = torch.tensor([[0.3, 0.2], [1.5, 0.0]])
    model = nn.Sequential(nn.Linear(2, 2), _Poincare())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    f = train_step(model, u)
    assert f.op == "aten.acosh.default" and f.hint.startswith("Acosh below 1 gives nan"), f


class _AngularHead(nn.Module):
    """ArcFace's angle, unclamped: acos of the cosine between a normalised embedding and its class centre."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(3, 8, generator=torch.Generator().manual_seed(9)))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return torch.acos(F.normalize(e, dim=-1) @ F.normalize(self.W, dim=-1).t())


def test_acos_of_a_cosine_rounded_past_1_names_the_clamp_short_of_1() -> None:
    # an embedding on its class centre (W's row times 2): its cosine, through two normalisations,
    # is 1.0000001, and acos of it is nan. The hint was "acos outside [-1, 1] gives nan", with no
    # remedy; the usual one, clamp(-1, 1), would trade it for acos's infinite gradient at 1
    head = _AngularHead()
    e = torch.cat([head.W.detach()[:1] * 2, torch.randn(5, 8, generator=torch.Generator().manual_seed(1))])
    cos = F.normalize(e, dim=-1) @ F.normalize(head.W.detach(), dim=-1).t()
    assert float(cos.abs().max()) > 1.0, cos  # (the rounding this scenario is about)
    model = nn.Sequential(nn.Identity(), head)
    f = train_step(model, e)
    assert (f.phase, f.module, f.op, f.cause) == ("forward", "1", "aten.acos.default", "created"), f
    assert "1 - eps" in f.hint and "not to [-1, 1]" in f.hint and "ArcFace" in f.hint, f.hint


@pytest.mark.parametrize("norm", [nn.LayerNorm(4, eps=0.0), nn.GroupNorm(2, 4, eps=0.0)])
def test_a_norm_with_eps_0_over_a_constant_row_has_a_hint_of_its_own(norm: nn.Module) -> None:
    # a zero input row: its variance is 0 and eps=0, so the norm divides 0 by 0. The hint was the
    # generic "0/0, a fully masked row, log/sqrt of a negative number"
    x = torch.tensor([[0.3, -0.2, 0.5, 0.1], [0.0, 0.0, 0.0, 0.0]])
    model = nn.Sequential(nn.Linear(4, 4, bias=False), norm)
    f = train_step(model, x)
    assert f.module == "1" and f.op.startswith("aten.native_") and "eps=0" in f.hint, f


class _TemperedScores(nn.Module):
    """Attention weights at a learned temperature: scores / t, then softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.0))  # driven to 0 (a clamp(min=0) after each step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = x.chunk(2, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2) / self.temperature, dim=-1)  # @temperature


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_temperature_at_0_is_told_as_the_division_not_as_a_masked_row(mode: str) -> None:
    # row 0's scores are all negative, so / 0 makes that row all -inf and the softmax nan. There is
    # no mask anywhere, but the hint read "a softmax over a fully masked row ... leave at least one
    # position unmasked": the masked-row fact outranked the division by 0 that made the row
    x = torch.tensor([[[1.0, 0.0, -1.0, 0.0], [-1.0, 0.0, -2.0, 0.0], [0.5, 0.0, -3.0, 0.0]]])
    f = train_step(_TemperedScores(), x, mode=mode)
    assert (f.module, f.op, f.cause) == ("", "aten.div.Tensor", "created") and math.isnan(f.value), f
    assert same_source(f.source, line("temperature")), f.source
    assert f.hint.startswith("A division by 0") and "temperature" in f.hint and "masked" not in f.hint, f.hint
    assert "clamp_min(eps)" in f.hint and "clamp(min=1)" not in f.hint, f.hint  # (a count's guard, no temperature's)


@pytest.mark.parametrize("norm", [nn.LayerNorm(4), nn.GroupNorm(2, 4)])
def test_a_norm_of_values_whose_variance_overflows_is_told_so_not_as_eps_0(norm: nn.Module) -> None:
    # a transformer's residual stream blown up by a high learning rate (1e22: the squares pass
    # float32's max) into a LayerNorm with its default eps. The hint led with "eps=0 over a constant
    # row" for every norm nan; the numbers say which of the two it is
    x = torch.tensor([[0.3, -0.2, 0.5, 0.1], [2e22, -1e22, 3e22, 0.0]])
    model = nn.Sequential(nn.Linear(4, 4, bias=False), norm)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
    f = train_step(model, x)
    assert f.module == "1" and f.op.startswith("aten.native_") and f.index[0] == 1, f
    assert f.hint.startswith("A normalisation of values as large as 3e+22") and "eps=0" not in f.hint, f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_norm_of_values_whose_statistics_overflow_is_told_so(mode: str) -> None:
    # a CNN's conv output blown up to 1e38 (channels_last, as a vision model trains) into a
    # BatchNorm2d in training mode: its batch statistics overflow and it makes nan. The hint read
    # "typically 0/0 ... a normalisation of a zero vector": the values are what is too large
    model = nn.Sequential(nn.Conv2d(3, 3, 1, bias=False), nn.BatchNorm2d(3)).to(memory_format=torch.channels_last)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3).view(3, 3, 1, 1))
    x = torch.full((2, 3, 4, 4), 1e38)
    x[:, 1] = 0.5
    f = train_step(model, x.contiguous(memory_format=torch.channels_last), mode=mode)
    assert (f.module, f.op, f.cause) == ("1", "aten.native_batch_norm.default", "created"), f
    assert f.hint.startswith("A normalisation of values as large as 1e+38: their mean or variance over the batch"), f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_op_in_torchs_own_layers_all_the_way_up_has_the_line_that_called_the_model(mode: str) -> None:
    # nn.Sequential of torch's layers only: no frame of the user's code between the op and the
    # model's call, and the source was None. The user's line is the one that called the model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Threshold(0.1, float("inf")), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        loss = model(x).pow(2).mean()  # @torch-only-call
        loss.backward()
        opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.module_type, f.op) == ("forward", "1", "Threshold", "aten.threshold.default"), f
    assert same_source(f.source, line("torch-only-call")), f.source


def test_rows_of_a_weight_summed_are_not_called_samples() -> None:
    # an L2 penalty (w ** 2).sum() over a weight that SGD at lr=10 blows up: the reduction's rows
    # are the weight's elements, not samples of a batch (the model takes no batch)
    class Penalty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, -0.5]))

        def forward(self) -> torch.Tensor:
            return (self.w ** 2).sum()

    m = Penalty()
    opt = torch.optim.SGD(m.parameters(), lr=10)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        for _ in range(40):
            m().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert "over 2 rows" in f.hint and "sample" not in f.hint, f.hint


class _PairCosine(nn.Module):
    """Cosine similarity of two mean-pooled token sequences, normalised with eps=0: an all-padding
    sequence pools to the zero vector, whose normalisation is 0 / 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.how = how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a, b = self.emb(ids).mean(2).unbind(1)
        if self.how == "normalize":
            return (F.normalize(a, dim=-1, eps=0) * F.normalize(b, dim=-1, eps=0)).sum(-1)
        return F.cosine_similarity(a, b, dim=-1, eps=0)


@pytest.mark.parametrize("how", ["normalize", "cosine_similarity"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_zero_vector_normalised_with_eps_0_is_told_as_0_over_0(how: str, mode: str) -> None:
    # the hint was the division's generic "dividing by a count that is 0, or by a learned temperature
    # ... clamp(min=1)", with no word of a zero vector or of the eps=0 that lets it through
    torch.manual_seed(0)
    ids = torch.randint(1, 10, (4, 2, 3))
    ids[1] = 0  # a pair of all-padding sequences
    f = train_step(_PairCosine(how), ids, mode=mode)
    assert (f.module, f.op, f.cause, f.index) == ("", "aten.div.Tensor", "created", (1,)) and math.isnan(f.value), f
    assert f.hint.startswith("A division by 0") and "zero vector" in f.hint and "eps" in f.hint, f.hint
    assert "temperature" not in f.hint, f.hint


class _HandNorm(nn.Module):
    """A LayerNorm written by hand: its variance as E[x^2] - E[x]^2, then sqrt or rsqrt of it."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mu * mu
        if self.op == "sqrt":
            return (x - mu) / torch.sqrt(var)
        return (x - mu) * torch.rsqrt(var + 1e-12)


@pytest.mark.parametrize("op", ["sqrt", "rsqrt"])
def test_a_variance_below_0_from_cancellation_is_told_as_such(op: str) -> None:
    # values near 1000 with a spread of 1e-3: E[x^2] - E[x]^2 cancels to -0.0625 in float32. The hint
    # of rsqrt said "rsqrt of 0 gives inf" for a nan of a negative number, sqrt's "sqrt of a negative
    # number gives nan" named no variance, no cancellation, no remedy
    x = 1000.0 + 1e-3 * torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Linear(8, 8), _HandNorm(op))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    m = x.mean(-1, keepdim=True)
    assert bool(((x * x).mean(-1, keepdim=True) - m * m < 0).all()), "set-up"
    f = train_step(model, x)
    assert (f.module, f.op) == ("1", f"aten.{op}.default") and math.isnan(f.value), f
    assert "negative number" in f.hint and "E[x^2] - E[x]^2" in f.hint and "clamp_min(0)" in f.hint, f.hint
    assert "of 0 gives inf" not in f.hint, f.hint


class _HandSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_softmax_written_by_hand_without_its_max_subtracted_is_told_as_such(dtype: torch.dtype) -> None:
    # exp(x) / exp(x).sum(): one exp past the dtype's max is inf, inf / inf = nan. The remedy was to
    # clamp what goes into exp or to keep the module in float32, not the max subtraction softmax does
    x = torch.tensor([[1.0, 2.0, 95.0, 3.0]] if dtype == torch.float32 else [[1.0, 2.0, 12.0, 3.0]], dtype=dtype)
    model = nn.Sequential(nn.Linear(4, 4).to(dtype), _HandSoftmax())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    f = train_step(model, x)
    assert (f.module, f.op) == ("1", "aten.exp.default") and math.isnan(f.value), f
    assert "softmax written by hand" in f.hint and "x.amax(-1, keepdim=True)" in f.hint, f.hint



class _HandSigmoid(nn.Module):
    """A gate exp(x) / (1 + exp(x)) by hand, or a softmax whose denominator has an eps added."""

    def __init__(self, eps: bool) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)
        return e / (e.sum(-1, keepdim=True) + 1e-6) if self.eps else e / (1 + e)


@pytest.mark.parametrize("eps", [False, True])
def test_a_sigmoid_written_by_hand_is_not_told_to_be_a_softmax(eps: bool) -> None:
    # exp(x) / (1 + exp(x)) (also a custom Function's backward of logsigmoid, e / (1 + e)) overflows
    # to inf / inf = nan: the hint told of a softmax by hand and torch.softmax; a softmax whose sum
    # has an eps added (its denominator also made by an add) is still a softmax
    x = torch.tensor([[1.0, 2.0, 95.0, 3.0]])
    model = nn.Sequential(nn.Linear(4, 4), _HandSigmoid(eps))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    f = train_step(model, x)
    assert (f.module, f.op) == ("1", "aten.exp.default") and math.isnan(f.value), f
    if eps:
        assert "softmax written by hand" in f.hint and "sigmoid" not in f.hint, f.hint
    else:
        assert "sigmoid written by hand" in f.hint and "torch.sigmoid(x)" in f.hint and "softmax" not in f.hint, f.hint

class _BiasedVar(nn.Module):
    def __init__(self, correction: int) -> None:
        super().__init__()
        self.correction = correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.var(-1, correction=self.correction, keepdim=True)


@pytest.mark.filterwarnings("ignore:var... degrees of freedom is <= 0:UserWarning")
@pytest.mark.parametrize("correction", [4, 5])
def test_a_var_with_a_correction_not_below_its_count_is_told_as_such(correction: int) -> None:
    # var(correction=c) over n <= c elements divides by max(0, n - c) = 0: inf. The hint was the
    # generic "an overflow past the dtype's max, x/0 or log(0)"
    f = train_step(nn.Sequential(nn.Linear(4, 4), _BiasedVar(correction)), torch.randn(3, 4))
    assert (f.module, f.op) == ("1", "aten.var.correction") and math.isinf(f.value), f
    assert f"correction={correction} over 4 elements" in f.hint and "overflow" not in f.hint, f.hint


class _DenseGCN(nn.Module):
    """A GCN layer over a dense adjacency: D^-1/2 A D^-1/2 @ (x W), the degree normalisation by hand."""

    def __init__(self, adj: torch.Tensor, how: str = "pow") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("adj", adj)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "sqrt":
            dinv = 1 / self.adj.sum(1).sqrt()  # @gcn-sqrt
        elif self.how == "rsqrt":
            dinv = self.adj.sum(1).rsqrt()  # @gcn-rsqrt
        else:
            dinv = self.adj.sum(1).pow(-0.5)  # @gcn-dinv
        return (dinv[:, None] * self.adj * dinv[None, :]) @ self.lin(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_degree_normalisation_of_an_isolated_node_is_told_as_0_to_a_negative_power(mode: str) -> None:
    # node 3 has no edge: its degree is 0, 0 ** -0.5 = inf, and inf * 0 (its row and column of A) is
    # nan. The hint was pow's generic "a power overflows, or a negative base has a fractional exponent":
    # neither happened
    adj = torch.zeros(4, 4)
    adj[0, 1] = adj[1, 0] = adj[1, 2] = adj[2, 1] = 1.0
    f = train_step(_DenseGCN(adj), torch.randn(4, 4), mode=mode)
    assert (f.module, f.op, f.cause) == ("", "aten.pow.Tensor_Scalar", "created") and math.isnan(f.value), f
    assert same_source(f.source, line("gcn-dinv")) and chain_ops(f.chain)[1] == "aten.mul.Tensor", f
    assert f.hint.startswith("A negative power of 0") and "isolated node" in f.hint, f.hint
    assert "overflow" not in f.hint and "negative base" not in f.hint, f.hint


class _EpsFromX0(nn.Module):
    """A diffusion model that predicts x0 and turns it into the noise the loss compares with."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.register_buffer("alpha_bar", torch.linspace(1.0, 0.01, 10))  # alpha_bar[0] == 1: no noise at t = 0

    def forward(self, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        return (xt - ab.sqrt() * self.net(xt)) / (1 - ab).sqrt()  # @eps-from-x0


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_division_by_a_noise_schedules_sqrt_at_0_is_told_so(mode: str) -> None:
    # t sampled from [0, T) instead of [1, T): at t = 0, 1 - alpha_bar is 0 and the division by its sqrt
    # is x/0. The hint was the generic "a count that is 0, a learned temperature ... clamp(min=1)"
    model = _EpsFromX0()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt, mode=mode):
        model(torch.randn(3, 4), torch.tensor([4, 0, 7])).pow(2).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.cause, f.index[0]) == ("", "aten.div.Tensor", "created", 1), f
    assert same_source(f.source, line("eps-from-x0")), f
    assert f.hint.startswith("A division by a square root of 0") and "alpha_bar" in f.hint, f.hint
    assert "clamp(min=1)" not in f.hint, f.hint


class _QSampleOnTheFly(nn.Module):
    """A diffusion model's q_sample reading alpha_bar[t] from a cosine schedule run one step past T: its
    last entry is below 0 (a beta above 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 4))
        self.register_buffer("alpha_bar", torch.tensor([0.98, 0.76, 0.35, 0.02, -0.16]))

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        return self.net(ab.sqrt() * x0 + (1 - ab).sqrt() * torch.randn_like(x0))  # @q-sample


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_sqrt_of_a_noise_schedules_negative_entry_is_told_to_fix_the_schedule(mode: str) -> None:
    # the hint led with "a variance computed as E[x^2] - E[x]^2 ... by cancellation" for a sqrt whose input
    # is a table's entry, -0.16: the schedule is what must be fixed
    model = _QSampleOnTheFly()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt, mode=mode):
        model(torch.randn(3, 4), torch.tensor([1, 4, 2])).pow(2).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.op, f.cause, f.index[0]) == ("", "aten.sqrt.default", "created", 1), f
    assert same_source(f.source, line("q-sample")), f
    assert "alpha_bar[t]" in f.hint and "clamp(0, 0.999)" in f.hint and "E[x^2]" not in f.hint, f.hint


def test_a_division_by_the_sqrt_of_an_isolated_nodes_degree_names_the_degree() -> None:
    # 1 / deg.sqrt() of a node with no edge (aten.reciprocal): the hint was reciprocal's bare "1/0 gives inf."
    adj = torch.zeros(4, 4)
    adj[0, 1] = adj[1, 0] = adj[1, 2] = adj[2, 1] = 1.0
    f = train_step(_DenseGCN(adj, "sqrt"), torch.randn(4, 4))
    assert (f.module, f.op, f.cause) == ("", "aten.reciprocal.default", "created") and math.isnan(f.value), f
    assert same_source(f.source, line("gcn-sqrt")), f
    assert "1 / sqrt(deg) of a node with no edge" in f.hint and "self-loops" in f.hint, f.hint


def test_an_rsqrt_of_an_isolated_nodes_degree_names_the_degree() -> None:
    # deg.rsqrt() of a node with no edge: the hint named only a zero vector or a zero variance
    adj = torch.zeros(4, 4)
    adj[0, 1] = adj[1, 0] = adj[1, 2] = adj[2, 1] = 1.0
    f = train_step(_DenseGCN(adj, "rsqrt"), torch.randn(4, 4))
    assert (f.module, f.op, f.cause) == ("", "aten.rsqrt.default", "created"), f
    assert same_source(f.source, line("gcn-rsqrt")), f
    assert "deg.rsqrt() of a node with no edge" in f.hint and "self-loops" in f.hint, f.hint


class _MeanAggregation(nn.Module):
    """A GraphSAGE-style layer: each node's mean over its in-neighbours, sum and count by index_add_."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("src", torch.tensor([0, 1, 1, 2]))
        self.register_buffer("dst", torch.tensor([1, 0, 2, 1]))  # node 3: no incoming edge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cnt = torch.zeros(x.shape[0]).index_add_(0, self.dst, torch.ones(self.dst.shape[0]))
        agg = torch.zeros_like(x).index_add_(0, self.dst, x[self.src]) / cnt[:, None]  # @mean-agg
        return self.lin(torch.cat([x, agg], -1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_mean_over_a_nodes_in_neighbours_of_a_node_with_none_names_the_count(mode: str) -> None:
    # index_add_(sum) / index_add_(count) at a node no edge goes into is 0/0. The hint led with a zero
    # vector's norm, an IoU and a Dice score, and its remedy was an eps, not clamp(min=1) on the count
    f = train_step(nn.Sequential(nn.Linear(4, 4), _MeanAggregation()), torch.randn(4, 4), mode=mode)
    assert (f.module, f.op, f.cause, f.index[0]) == ("1", "aten.div.Tensor", "created", 3) and math.isnan(f.value), f
    assert same_source(f.source, line("mean-agg")), f
    assert f.hint.startswith("A division by a count of 0 made by a scatter (index_add)"), f.hint
    assert "clamp(min=1)" in f.hint and "IoU" not in f.hint, f.hint


class _PNAScalers(nn.Module):
    """PNA's degree scalers by hand: amplification log(deg + 1) / avg_log, attenuation avg_log / log(deg + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 3)
        self.register_buffer("src", torch.tensor([0, 1, 1, 2]))
        self.register_buffer("dst", torch.tensor([1, 0, 2, 1]))  # node 3: no incoming edge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deg = torch.zeros(x.shape[0]).index_add_(0, self.dst, torch.ones(self.dst.shape[0]))
        agg = torch.zeros_like(x).index_add_(0, self.dst, x[self.src])
        amp = agg * (torch.log(deg + 1) / 1.5)[:, None]
        att = agg * (1.5 / torch.log(deg + 1))[:, None]  # @pna-att
        return self.lin(torch.cat([agg, amp, att], -1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_attenuation_by_the_log_of_an_isolated_nodes_degree_is_told_so(mode: str) -> None:
    # avg_log / log(deg + 1) at a node with no edge is 1.5 / log(1) = inf (then inf * 0 = nan). The hint was
    # the generic "dividing by a count that is 0 ... clamp(min=1) for a count": the denominator is a log
    f = train_step(nn.Sequential(nn.Linear(4, 4), _PNAScalers()), torch.randn(4, 4), mode=mode)
    assert (f.module, f.op, f.cause, f.index[0]) == ("1", "aten.reciprocal.default", "created", 3), f
    assert same_source(f.source, line("pna-att")), f
    assert f.hint.startswith("A division by a log of 1") and "log(deg.clamp(min=1) + 1)" in f.hint, f.hint


class _MaskedGAT(nn.Module):
    """A GAT layer's attention written by hand: a softmax over each node's incoming edges, the max per
    node by scatter_reduce("amax"), masked edges' scores set to -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.att = nn.Linear(8, 1)
        self.register_buffer("src", torch.tensor([0, 1, 1, 2, 3, 3]))
        self.register_buffer("dst", torch.tensor([1, 0, 2, 1, 0, 2]))
        self.register_buffer("keep", torch.tensor([True, True, False, True, True, False]))  # node 2: none kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, src, dst = self.lin(x), self.src, self.dst
        e = F.leaky_relu(self.att(torch.cat([h[src], h[dst]], -1)).squeeze(-1), 0.2)
        e = e.masked_fill(~self.keep, float("-inf"))  # @gat-mask
        m = torch.full((x.shape[0],), float("-inf")).scatter_reduce(0, dst, e, "amax")
        a = torch.exp(e - m[dst])
        alpha = a / torch.zeros(x.shape[0]).index_add_(0, dst, a)[dst]
        return torch.zeros_like(h).index_add_(0, dst, h[src] * alpha[:, None])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_scatter_softmax_over_a_node_whose_edges_are_all_masked_is_told_so(mode: str) -> None:
    # every edge into node 2 is masked: its max is -inf and e - max[dst] = -inf - (-inf) = nan. The hint
    # was the generic one of a -inf mask's arithmetic (p * log p, label smoothing, kl_div's target)
    f = train_step(_MaskedGAT(), torch.randn(4, 4), mode=mode)
    assert (f.module, f.op, f.cause, f.index[0]) == ("", "aten.masked_fill.Scalar", "created", 2), f
    assert same_source(f.source, line("gat-mask")) and chain_ops(f.chain)[1] == "aten.sub.Tensor", f
    assert f.hint.startswith("A softmax over each node's edges") and "every incoming edge is masked" in f.hint, f.hint
    assert "label smoothing" not in f.hint, f.hint


class _Rotary(nn.Module):
    """Rotary position embedding whose positions are made in the model's dtype (float16)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        t = torch.arange(offset, offset + x.shape[1], dtype=x.dtype)  # @rope-positions
        emb = torch.cat([torch.outer(t, self.inv_freq.to(x.dtype))] * 2, -1)
        x1, x2 = x.chunk(2, -1)
        return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class _RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rope, self.head = nn.Embedding(20, 16), _Rotary(16), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, offset: int) -> torch.Tensor:
        return self.head(self.rope(self.emb(ids), offset))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_float16_positions_past_65504_are_told_as_positions_to_make_in_float32(mode: str) -> None:
    """A half() model's rotary positions at a long context: torch.arange(..., dtype=float16) is inf
    from 65520 on, and cos(inf) nan. The finding named the arange and its float32 value, but its
    hint was the generic "NaN from finite inputs: ... a softmax over a fully masked row ...": a
    factory has no tensor input, so its dtype (and its value, recomputed wider) was never read."""
    torch.manual_seed(0)
    model = _RotaryNet().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for offset in (0, 65530):
            model(torch.randint(0, 20, (2, 5)), offset).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.op, f.verdict) == ("forward", "rope", 1, "aten.arange.start", "precision"), str(f)
    assert same_source(f.source, line("rope-positions"))
    assert f.reference["value"] == 65530.0, f.reference
    assert "Overflow: aten.arange.start reached 65530" in f.hint and "torch.arange(n, dtype=torch.float32)" in f.hint, f.hint
    assert "masked" not in f.hint, f.hint


class _InvertibleLinear(nn.Module):
    """A normalising flow's invertible linear layer: z = x W^T and the per-sample log |det W|."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4))
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.log(torch.abs(torch.det(self.weight)))  # @flow-logdet
        if self.how == "expand":
            return x @ self.weight.T, logdet.expand(x.shape[0])
        return x @ self.weight.T, torch.stack([logdet] * x.shape[0])


@pytest.mark.parametrize("how", ["expand", "stack"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_0_dim_value_spread_over_the_batch_is_walked_back_to_its_op(mode: str, how: str) -> None:
    # a flow's log |det W| (0-dim) made per-sample by expand or stack, at a weight with two equal rows
    # (det 0, log 0 = -inf): the walk from a (16,) output into its 0-dim input indexed a row of a
    # 0-dim code and failed, so the finding had no op, no line, no chain and the generic hint
    model = _InvertibleLinear(how)
    with torch.no_grad():
        model.weight[3] = model.weight[2]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt, mode=mode):
        z, logdet = model(torch.randn(16, 4))
        (0.5 * z.pow(2).sum(-1) - logdet).mean().backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.tensor, f.cause, f.value) == ("", "output[1]", "created", -math.inf), f
    assert f.op == "aten.log.default" and same_source(f.source, line("flow-logdet")), f
    assert chain_ops(f.chain)[0] == "aten.log.default", f.chain


class _PowerHead(nn.Module):
    """A head that takes a fractional power of a Linear's output, as a learned gamma curve does."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin, self.head, self.p = nn.Linear(4, 8), nn.Linear(8, 1), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(x) ** self.p)  # @frac-pow


@pytest.mark.parametrize("p", [0.5, 1.5])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_negative_base_to_a_fractional_power_is_told_as_such(mode: str, p: float) -> None:
    # x ** 0.5 or x ** 1.5 of a Linear's output that went below 0: nan. The hint was pow's generic "A power
    # overflows, or a negative base has a fractional exponent." with neither the base nor the remedy
    torch.manual_seed(0)
    model = _PowerHead(p)
    with torch.no_grad():
        model.lin.bias.fill_(-5.0)
    f = train_step(model, torch.randn(8, 4), mode=mode)
    assert (f.module, f.op, f.cause) == ("", "aten.pow.Tensor_Scalar", "created") and math.isnan(f.value), f
    assert same_source(f.source, line("frac-pow")), f
    assert f.hint.startswith("A negative base to a fractional power") and f"to {p:g}, which is nan" in f.hint, f.hint
    assert "clamp_min(0)" in f.hint and "overflows" not in f.hint, f.hint


class _GaussianNLL(nn.Module):
    """Embeddings scored by a Gaussian of the batch's own covariance: 0.5 * log det(cov) + Mahalanobis."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.enc, self.how = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        hc = h - h.mean(0, keepdim=True)
        cov = hc.T @ hc / h.shape[0]
        if self.how == "logdet":
            logdet = torch.logdet(cov)  # @gauss-logdet
        else:
            logdet = torch.log(torch.abs(torch.linalg.det(cov)))  # @gauss-logabsdet
        return 0.5 * logdet + 0.5 * (hc @ torch.linalg.pinv(cov) * hc).sum(-1).mean()


@pytest.mark.parametrize("how", ["logdet", "logabsdet"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_determinant_of_a_singular_covariance_is_told_as_a_singular_matrix(mode: str, how: str) -> None:
    # a batch of one sample repeated: its covariance is 0, log det = -inf. The hint was the generic "Inf from
    # finite inputs: an overflow past the dtype's max ..., x/0 or log(0)" (logdet), or "Log of exactly 0 ...
    # a probability a softmax underflowed to ... F.log_softmax" (log |det|): no word of a singular matrix
    torch.manual_seed(0)
    f = train_step(_GaussianNLL(how), torch.randn(1, 6).expand(16, 6).clone(), mode=mode)
    op = "aten._linalg_slogdet.default" if how == "logdet" else "aten.log.default"
    assert (f.module, f.op, f.cause, f.value) == ("", op, "created", -math.inf), f
    assert same_source(f.source, line(f"gauss-{how}")), f
    assert "singular matrix" in f.hint and "eps * I" in f.hint and f.hint.endswith("s.sum())."), f.hint
    assert "overflow" not in f.hint and "log_softmax" not in f.hint, f.hint


def test_an_all_padding_sequence_in_the_transformer_encoders_fast_path_names_the_sequence_and_torchs_fix() -> None:
    # nn.TransformerEncoder in eval under no_grad (torch's fused fast path), one sequence all padding:
    # the hint said "make the row finite before the softmax (torch.where(row_masked, 0., scores))",
    # scores the user never sees inside the fused kernel, and named no sequence
    m = zoo.transformer_encoder(dropout=0.0).eval()
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[:, 3:] = True
    pad[2] = True  # an empty sequence
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m), torch.no_grad():
        m(torch.randn(4, 5, 16), src_key_padding_mask=pad)
    f = ei.value.finding
    assert (f.phase, f.module, f.index[0], f.cause) == ("forward", "layers.0", 2, "created"), f
    assert f.op is not None and "_transformer_encoder_layer_fwd" in f.op
    assert "sequence 2 of the batch is padding at every position" in f.hint, f.hint
    assert "fast path" in f.hint and "torch.where(row_masked" not in f.hint, f.hint


def test_a_causal_mask_over_left_padding_in_multihead_attention_names_need_weights_false() -> None:
    # a float -inf causal attn_mask and a key padding mask over left padding: the first query of the
    # padded sequence has no key left; nn.MultiheadAttention's need_weights=True path takes a plain softmax
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(16, 2, batch_first=True)
    causal = torch.triu(torch.full((6, 6), float("-inf")), 1)
    pad = torch.zeros(3, 6)
    pad[1, :2] = float("-inf")
    x = torch.randn(3, 6, 16)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(attn):
        attn(x, x, x, attn_mask=causal, key_padding_mask=pad)[0].sum().backward()
    f = ei.value.finding
    assert (f.phase, f.index[:2], f.cause) == ("forward", (1, 0), "created"), f
    assert "inside torch's attention (MultiheadAttention)" in f.hint and "need_weights=False" in f.hint, f.hint
    assert "torch.where(row_masked" not in f.hint, f.hint


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_ctc_loss_with_no_alignment_names_the_row_and_the_frames_its_repeated_labels_need(reduction: str) -> None:
    # an ASR batch whose row 1 has 4 frames for 4 labels, two of them equal neighbours (needs 4 + 1):
    # the hint said only "a target too long for its input", which a user comparing 4 frames to 4
    # labels reads as not the case; it now names the row, its frames and the frames it needs
    torch.manual_seed(0)
    rnn, head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 6)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    ctc = nn.CTCLoss(reduction=reduction)
    targets = torch.tensor([[1, 2, 3, 4], [2, 3, 3, 4], [5, 1, 2, 0]])
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model):
        lp = head(rnn(torch.randn(3, 8, 8))[0]).log_softmax(-1).transpose(0, 1)
        ctc(lp, targets, torch.tensor([8, 4, 8]), torch.tensor([4, 4, 3])).backward()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.value) == ("forward", "<outside>", "created", math.inf), f
    assert f.op is not None and "ctc_loss" in f.op
    assert "row 1: 4 frames for 4 labels, needing 5 with the blanks between repeated labels" in f.hint, f.hint
    assert "zero_infinity=True" in f.hint and "row 0" not in f.hint, f.hint


def test_a_ctc_loss_over_a_class_masked_with_minus_inf_is_told_as_a_blocked_alignment() -> None:
    # a class masked with -inf before log_softmax, used by row 1's target: the CTC loss is inf with
    # frames enough; the hint was the mask's generic "-inf * 0, label smoothing, F.kl_div", no CTC at all
    torch.manual_seed(0)
    m = nn.Linear(8, 6)
    allowed = torch.tensor([True] * 5 + [False])
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m):
        lp = m(torch.randn(10, 3, 8)).masked_fill(~allowed, float("-inf")).log_softmax(-1)
        y = torch.tensor([[1, 2, 3], [1, 5, 2], [4, 4, 1]])
        F.ctc_loss(lp, y, torch.tensor([10, 10, 10]), torch.tensor([3, 3, 3])).backward()
    f = ei.value.finding
    assert (f.module, f.op) == ("<outside>", "aten.masked_fill.Scalar"), f
    assert "CTC loss is inf at row 1 although its 10 frames are enough for its 3 labels" in f.hint, f.hint


def test_an_overflow_from_a_huge_label_or_input_names_the_data_not_the_learning_rate() -> None:
    """A regression target of 1e20 (a sentinel for a missing value) makes the MSE inf; a record of
    3e38 (a sensor's saturation value) makes a Linear's addmm inf. Both hints said "look for
    exploding weights or inputs (a lower learning rate, gradient clipping, ...)", at the first step,
    with moderate weights: the operand that alone is past the square root of the largest value is
    named, with its element, as the data's (also when only a partial sum of the matmul overflowed)."""
    def first(x: torch.Tensor, y: torch.Tensor) -> nanhunt.Finding:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanhunt.watch(model, opt, on_find="skip") as hunt:
            F.mse_loss(model(x).squeeze(-1), y).backward()
            opt.step()
        assert hunt.first is not None
        return hunt.first

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    y[3] = 1e20
    f = first(x, y)
    assert (f.module, f.op) == ("<outside>", "aten.mse_loss.default"), str(f)
    assert "its target holds 1e+20 at [3], while the prediction reaches only" in f.hint, f.hint
    assert "label" in f.hint and "lower learning rate" not in f.hint.split("label")[0], f.hint
    y = torch.randn(64, generator=g)  # (a mean over 64: only the squared difference overflows)
    y[40] = 1e20
    f = first(torch.randn(64, 6, generator=g), y)
    assert "its target holds 1e+20 at [40], while the prediction reaches only" in f.hint, f.hint
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    x[5] = 3e38  # (output[5, 12] overflows in a partial sum only: its float64 value is within range)
    f = first(x, y)
    assert (f.module, f.op) == ("0", "aten.addmm.default"), str(f)
    assert "its input holds 3e+38 at [5, 0], while the weights reach only" in f.hint, f.hint
    x, y = torch.randn(8, 6, generator=g) * 1e20, torch.randn(8, generator=g)  # (a prediction past the square root: not the data's)
    f = first(x, y)
    assert "holds" not in f.hint and "not the training" not in f.hint, f.hint


@pytest.mark.parametrize("autocast", [False, True])
def test_a_weight_cast_past_float16s_range_is_not_said_to_be_created_by_its_transpose(autocast: bool) -> None:
    # an fp32 weight past 65504 is ±inf after model.half() (under autocast: after its cast). The walk
    # followed t(weight) at the untransposed element, a +inf, then took the weight's -inf behind it
    # for an additive mask: "from a non-finite parameter ...; created in aten.t.default", a view
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        m[1].weight.copy_(torch.tensor([[0.1, -1e5, 0.1, 0.1], [1e5, 0.1, 0.1, 0.1],
                                        [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]]))
    if not autocast:
        m.half()
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    with nanhunt.watch(m, on_find="record") as hunt, torch.autocast("cpu", torch.float16, enabled=autocast):
        m(x if autocast else x.half())
    f = hunt.first
    assert f is not None and f.module == "1", f
    if autocast:  # the cast of the finite float32 weight made it: that op, from finite inputs
        assert (f.cause, f.op, f.verdict) == ("created", "aten._to_copy.default", "precision"), f
    else:  # already inf in the model: poisoned weights, not localised to an op
        assert (f.cause, f.op, f.chain) == ("parameter", None, ()), f
        assert "65504 becomes inf when a float32/bfloat16 model or checkpoint is cast" in f.hint, f.hint
