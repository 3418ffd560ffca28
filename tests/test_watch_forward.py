"""Forward: the module where the first NaN/Inf was born, the tensor, the element and the cause."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

from . import zoo
from .zoo import Recorder, assert_finding


def _first(hunt_or_err: object) -> nanhunt.Finding:
    f = hunt_or_err.finding if isinstance(hunt_or_err, nanhunt.NonFiniteError) else hunt_or_err.first
    assert f is not None, "no finding"
    return f


# ---------------------------------------------------------------------------- log(0)
def _lognet_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.rand(3, 4, generator=g) * 0.1 for _ in range(4)]
    xs[2][1] = _killer()  # drives a ReLU unit to exactly 0
    return xs


def _killer() -> torch.Tensor:
    """An input row that sends unit 0 of LogNet's Linear far below 0."""
    return -100.0 * zoo.lognet().lin.weight[0].detach().sign()


def _lognet() -> zoo.LogNet:
    m = zoo.lognet()
    with torch.no_grad():
        m.lin.bias.fill_(3.0)  # ReLU stays positive on small inputs: no log(0) until step 2
    return m


def test_log_of_zero_in_a_training_loop_is_found_at_its_step() -> None:
    ref = _lognet()
    rec = Recorder(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    bad_step = None
    for i, x in enumerate(_lognet_batches()):
        ref(x).sum().backward()
        if bad_step is None and not torch.isfinite(rec.out("log")).all():
            bad_step = i
            expected = rec.out("log")
        ref_opt.step()
        ref_opt.zero_grad()
        rec.new_step()
    assert bad_step == 2, "test set-up: log(0) first at step 2"

    m = _lognet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    seen = []
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt) as hunt:
        for i, x in enumerate(_lognet_batches()):
            seen.append(i)
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert seen == [0, 1, 2], "raise mode stops at the latest when the failing step ends"
    assert_finding(ei.value.finding, phase="forward", module="log", module_type="Log", tensor="output",
                   step=2, call=0, cause="created", expected=expected)
    assert hunt.first == ei.value.finding
    assert isinstance(ei.value, FloatingPointError)


def test_log_of_zero_without_a_replay_says_what_is_not_known_and_how_to_have_it() -> None:
    """replay=False (and FSDP2, where nothing is replayed): the finding is module-level, cause
    "unknown", and its hint was empty: it now says what is not known and how to have it."""
    m = _lognet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, replay=False):
        for x in _lognet_batches():
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.index) == ("forward", "log", 2, "unknown", None), f
    assert "replay=False" in f.hint and "Leave replay on" in f.hint, f.hint


# ---------------------------------------------------------------------------- attention / softmax
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = zoo.MaskedAttention(8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x, pad))


def test_softmax_of_a_fully_masked_row_is_born_in_the_attention_module() -> None:
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[:, -1] = True  # ordinary padding: fine
    pad[1] = True  # a sequence that is all padding: its rows are fully masked
    rec = Recorder(ref)
    ref(x, pad)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x, pad)
    assert_finding(_first(hunt), phase="forward", module="attn", module_type="MaskedAttention", tensor="output",
                   step=0, call=0, cause="created", expected=rec.out("attn"))
    assert math.isnan(_first(hunt).value)


def test_gpt2_fully_masked_row_in_a_4d_attention_mask_is_born_in_the_attention() -> None:
    """A hand-made 4-D additive mask (-inf = masked) where one query row masks every key: the
    eager attention's softmax of an all -inf row is nan. It was born in GPT2Attention (its own
    code), not in the c_proj Linear that was merely fed the nan."""
    m = zoo.gpt2(dropout=0.0)
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    t = ids.shape[1]
    mask = torch.triu(torch.full((t, t), float("-inf")), 1)[None, None].repeat(2, 1, 1, 1)
    mask[1, 0, 3, :] = float("-inf")
    rec = Recorder(ref)
    ref(ids, attention_mask=mask)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(ids, attention_mask=mask)
    f = _first(hunt)
    assert (f.module, f.module_type) == ("transformer.h.0.attn", "GPT2Attention"), f
    assert_finding(f, phase="forward", module="transformer.h.0.attn", module_type="GPT2Attention",
                   tensor="output[0]", step=0, call=0, cause="created", expected=rec.out("transformer.h.0.attn")[0])


def test_gpt2_fp16_attention_scores_overflow() -> None:
    """fp16 GPT-2 whose second block's LayerNorm gain grew large: q.k overflows 65504 inside the
    attention, softmax(inf - inf) = nan. Born in transformer.h.1.attn at the step it happens."""
    m = zoo.gpt2(dropout=0.0).half()
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(m)
    rec = Recorder(ref)
    ref(ids)  # step 0: healthy
    rec.new_step()
    with torch.no_grad():
        ref.transformer.h[1].ln_1.weight.fill_(1000.0)
    ref(ids)
    with nanhunt.watch(m, on_find="record") as hunt:
        with torch.no_grad():
            m(ids)
            m.transformer.h[1].ln_1.weight.fill_(1000.0)
            m(ids)
    assert_finding(_first(hunt), phase="forward", module="transformer.h.1.attn", module_type="GPT2Attention",
                   tensor="output[0]", step=1, call=0, cause="created", expected=rec.out("transformer.h.1.attn")[0])


def test_bert_layernorm_of_huge_finite_embeddings_is_nan() -> None:
    """LayerNorm's variance of finite 1e20 activations overflows float32: nan, born in LayerNorm."""
    m = zoo.bert(dropout=0.0)
    ref = copy.deepcopy(m)
    emb = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0)) * 1e20
    rec = Recorder(ref)
    ref(inputs_embeds=emb)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(inputs_embeds=emb)
    assert_finding(_first(hunt), phase="forward", module="embeddings.LayerNorm", module_type="LayerNorm",
                   tensor="output", step=0, call=0, cause="created", expected=rec.out("embeddings.LayerNorm"))


def test_transformer_encoder_attention_overflow_is_born_in_self_attn() -> None:
    m = zoo.transformer_encoder(dropout=0.0)
    ref = copy.deepcopy(m)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)) * 1e20
    rec = Recorder(ref)
    ref(x)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = _first(hunt)
    assert_finding(f, phase="forward", module="layers.0.self_attn", module_type="MultiheadAttention",
                   tensor="output[0]", step=0, call=0, cause="created", expected=rec.out("layers.0.self_attn")[0])


def test_huge_finite_outputs_are_not_findings() -> None:
    m = nn.Linear(4, 1)
    with torch.no_grad():
        m.weight.fill_(1e38)
        m.bias.zero_()
    x = torch.full((16, 4), 0.5)  # every output is 2e38: finite (their sum is not)
    assert torch.isfinite(m(x)).all()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)  # the output is dropped at once, as a loop that only keeps the loss does
    assert hunt.findings == []


class _Huge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3e38  # finite, but its float32 sum (the probe) is inf


class _Same(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0  # a new tensor with the same huge values: flagged again


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("between", [0, 70])
def test_a_nan_after_huge_finite_outputs_is_still_found(mode: str, between: int) -> None:
    # the first flagged probes are finite outputs whose sums overflowed: no finding, but the NaN that
    # LayerNorm then makes of them (its variance overflows: inf / inf) must still be found, however
    # many such outputs come first
    m = nn.Sequential(_Huge(), *[_Same() for _ in range(between)], nn.LayerNorm(16), nn.Linear(16, 2))
    x = torch.ones(1, 16)
    rec = Recorder(m)
    assert not torch.isfinite(m(x)).all()
    with nanhunt.watch(m, on_find="record", mode=mode) as hunt:
        m(x)
    ln = str(between + 1)
    assert_finding(_first(hunt), phase="forward", module=ln, module_type="LayerNorm", tensor="output", step=0,
                   call=0, cause="created", expected=rec.out(ln))
    assert _first(hunt).op == "aten.native_layer_norm.default"


# ---------------------------------------------------------------------------- fp16 overflow
def test_fp16_linear_overflow() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    with torch.no_grad():
        m[0].weight.mul_(8.0)  # weights that grew during training
    ref = copy.deepcopy(m)
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).clamp(-2, 2) * 3e4).half()
    assert torch.isfinite(x).all()
    rec = Recorder(ref)
    ref(x)
    assert not torch.isfinite(rec.out("0")).all(), "test set-up: the fp16 matmul overflows"
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = _first(hunt)
    assert_finding(f, phase="forward", module="0", module_type="Linear", tensor="output", step=0, call=0,
                   cause="created", expected=rec.out("0"))
    assert math.isinf(f.value)
    assert "float16" in f.hint or "65504" in f.hint


# ---------------------------------------------------------------------------- shared modules
def test_shared_module_reports_the_call_that_overflowed() -> None:
    m = zoo.sharednet(dtype=torch.float16)
    with torch.no_grad():
        m.inp.weight.copy_(torch.eye(4) * 1.0)
        m.inp.bias.zero_()
        m.shared.weight.copy_(torch.eye(4) * 60.0)
        m.shared.bias.zero_()
    ref = copy.deepcopy(m)
    small = torch.full((2, 4), 0.5, dtype=torch.float16)
    big = torch.tensor([[1.0, 2.0, 30.0, 1.0], [1.0, 1.0, 1.0, 25.0]], dtype=torch.float16)
    rec = Recorder(ref)
    ref(small)
    rec.new_step()
    ref(big)
    assert torch.isfinite(rec.out("shared", 0)).all() and not torch.isfinite(rec.out("shared", 1)).all()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(small)  # step 0: calls 0 and 1 of `shared`, finite
        m(big)  # step 1: call 0 finite, call 1 overflows
    assert_finding(_first(hunt), phase="forward", module="shared", module_type="Linear", tensor="output", step=1,
                   call=1, cause="created", expected=rec.out("shared", 1))


class _HealedLoop(nn.Module):
    """A recurrent loop in the root's own code: an inf written between two calls of ``l``, which
    ``l`` is then fed; tanh makes it finite again before the root returns."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = torch.tanh(self.l(x))
            if i == 1:
                x = x.clone()
                x[0, 0] = float("inf")
        return x


def test_a_child_fed_an_inf_its_parent_wrote_is_fed_not_the_creator() -> None:
    torch.manual_seed(0)
    model = _HealedLoop()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt):
        out = model(torch.ones(2, 4))
        assert torch.isfinite(out).all()  # healed before the root returns
        out.sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.call, f.cause, f.op) == ("forward", "l", 2, "input", None)
    assert "enclosing module" in (f.hint or "")


class _CappedSqrt(nn.Module):
    def forward(self, x: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.minimum(x, cap) - 5.0)  # nan where x < 5: made here, the cap is unused


class _NoLimit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = _CappedSqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x, torch.tensor(float("inf"))).nan_to_num()  # "no limit": +inf; the NaN is cleaned


def test_a_child_that_makes_a_nan_from_finite_values_beside_an_unused_inf_input_made_it() -> None:
    model = _NoLimit()
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.arange(8.0).view(2, 4))
    f = _first(hunt)
    assert (f.module, f.cause, f.op) == ("c", "created", "aten.sqrt.default")


def test_a_minus_inf_in_the_data_is_fed_in_with_no_op() -> None:
    # -inf data (log of a zero feature) into a Linear: fed, not a mask that an op turned into nan
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    x[1, 2] = float("-inf")
    with nanhunt.watch(model, on_find="record") as hunt:
        model(x)
    f = _first(hunt)
    assert (f.module, f.cause, f.op, f.chain) == ("0", "input", None, ())


class _Frames(nn.Module):
    """An audio classifier over log-mel frames (batch, time, mels): the conv reads them transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2))
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_mel_of_a_silent_clip_made_in_the_data_pipeline_is_fed_not_a_mask(mode: str) -> None:
    """log(mel) of an all-zero clip, computed before the model: a whole row of -inf in the batch,
    which the conv (reading a view of it) turns into inf - inf = nan. A -inf among finite values
    other than 0 is the data's log of 0, no additive mask: fed in, cause 'input', the model's input
    and its element named, log of 0 in the hint (it was 'created' at the conv's convolution with a
    hint to mask with finfo.min instead of -inf)."""
    torch.manual_seed(0)
    m = _Frames()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    fb = torch.rand(33, 8)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(m, opt, mode=mode):
        for step in range(3):
            wav = torch.randn(4, 400) * 0.1
            if step == 2:
                wav[1] = 0.0  # a silent clip
            spec = torch.stft(wav, 64, 16, window=torch.hann_window(64), return_complex=True)
            feats = torch.log((spec.abs() ** 2).transpose(1, 2) @ fb)  # the data pipeline's log-mel
            F.cross_entropy(m(feats), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "conv", 2, "input", None), f
    assert "input[0] holding -inf at [1, 0, 0]" in f.hint and "log of 0" in f.hint and "mask" not in f.hint, f.hint


# ---------------------------------------------------------------------------- nested outputs
def _plant(h: torch.Tensor) -> torch.Tensor:
    """h with nan planted at [1, 2] and -inf at [2, 0]: built in the module's own code."""
    out = h.clone()
    out[1, 2] = float("nan")
    out[2, 0] = float("-inf")
    return out


def _model_output(h: torch.Tensor) -> object:
    from transformers.modeling_outputs import CausalLMOutput

    return CausalLMOutput(logits=_plant(h))


def _nest(obj: object, levels: int) -> object:
    for _ in range(levels):
        obj = [obj]
    return obj


def _cycle(h: torch.Tensor) -> object:
    out: list[object] = [h, _plant(h)]
    out.append(out)  # a list that holds itself: walked once, not forever
    return out


NESTED = [
    ("tuple", lambda h: (h, _plant(h)), ("output[1]",)),
    ("list", lambda h: [h, [h, _plant(h)]], ("output[1][1]",)),
    ("dict", lambda h: {"hidden": h, "logits": _plant(h)}, ("output['logits']",)),
    ("namedtuple", lambda h: zoo.Pair(h, _plant(h)), ("output.second", "output[1]")),
    ("dataclass", lambda h: zoo.Out(h, _plant(h)), ("output.logits",)),
    ("ModelOutput", _model_output, ("output['logits']",)),
    ("mixed", lambda h: {"a": (h, None, "x", 3), "b": [{"c": h.long()}, {"d": _plant(h)}]}, ("output['b'][1]['d']",)),
    ("deep", lambda h: _nest([h, _plant(h)], 100), ("output" + "[0]" * 100 + "[1]",)),  # however deep it nests
    ("cycle", _cycle, ("output[1]",)),
]


@pytest.mark.parametrize("build,paths", [n[1:] for n in NESTED], ids=[n[0] for n in NESTED])
def test_nested_output_path(build: object, paths: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    m = zoo.Structured(build)
    x = torch.randn(4, 4)
    expected = _plant(m.lin(x).detach())
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = _first(hunt)
    assert f.tensor in paths, f
    assert_finding(f, phase="forward", module="", module_type="Structured", tensor=f.tensor, step=0, call=0,
                   cause="created", expected=expected)
    assert f.index == (1, 2)
    assert f.counts == {"nan": 1, "+inf": 0, "-inf": 1}


class ScalarAndEmpty(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x[:0] * float("inf"), x.sum() / 0.0 * 0.0, x.long(), x.to(torch.bool)


def test_empty_tensors_are_finite_and_zero_dim_tensors_are_found() -> None:
    m = ScalarAndEmpty()
    x = torch.ones(3, 2)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = _first(hunt)
    assert (f.tensor, f.index, f.shape, f.dtype, f.cause) == ("output[1]", (), (), "float32", "created")
    assert math.isnan(f.value) and f.counts == {"nan": 1, "+inf": 0, "-inf": 0}
    assert len(hunt.findings) == 1


class IntOut(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, None, str]:
        return (x * 0).long() - 1, 3, None, "tokens"


def test_integer_and_non_tensor_outputs_are_ignored() -> None:
    m = IntOut()
    with nanhunt.watch(m) as hunt:
        m(torch.ones(3))
    assert hunt.findings == []


@pytest.mark.parametrize("dtype", [
    torch.float16, torch.bfloat16, torch.float32,
    torch.float64,
])
def test_every_float_dtype(dtype: torch.dtype) -> None:
    m = zoo.Log()
    x = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=dtype)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    assert_finding(_first(hunt), phase="forward", module="", module_type="Log", tensor="output", step=0, call=0,
                   cause="created", expected=torch.log(x))


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_float64_values_past_float32s_range_are_no_alarm_and_a_nan_still_is(mode: str, dtype: torch.dtype) -> None:
    """A float64 model whose finite values pass float32's largest (1e40: physics and scientific
    models train in float64 for that range). Their probes were summed in float32: inf, a hit, and
    in raise mode a NonFiniteError ('origin unknown, not reproduced') that stopped a healthy run at
    its first step. A NaN the float64 model makes later is still found, at its step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(3, 4, dtype=dtype) * 1e40
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        for step in range(4):
            if step == 3:
                x = x * float("nan")  # the data goes bad at step 3
            out = model(x)
            loss = (out * out.conj()).real.mean() if dtype.is_complex else out.pow(2).mean()
            if step < 3:
                assert torch.isfinite(loss) and abs(loss.item()) > 3.4e38, "test set-up: finite, past float32"
            try:
                loss.backward()
                opt.step()
            except nanhunt.NonFiniteError:
                assert step == 3
                break
            opt.zero_grad()
    f = hunt.first
    assert f is not None and f.step == 3 and f.cause == "input", f


def test_complex_output_either_part() -> None:
    m = zoo.ComplexNet()
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 2.0, -2.0]])  # row 1 sums to 0: spectrum / 0
    expected = m(x).detach()
    assert not torch.isfinite(expected).all()
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = _first(hunt)
    e = zoo.expected_element(expected)
    assert (f.phase, f.module, f.module_type, f.tensor, f.cause) == ("forward", "", "ComplexNet", "output", "created")
    assert (f.index, f.shape, f.dtype) == (e["index"], e["shape"], "complex64")
    assert f.value is not None and not math.isfinite(f.value)


class _ModReLU(nn.Module):
    """A complex-valued network's activation: relu(|z| + b) * z / |z| (modReLU); and a complex log."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6, dtype=torch.complex64)
        self.b = nn.Parameter(torch.full((6,), -0.01))
        self.how = how

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.fc(z)
        if self.how == "log":
            return torch.log(z)
        mag = z.abs()
        return F.relu(mag + self.b) * (z / mag)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("how", ["modrelu", "log"])
def test_a_complex_zero_over_its_magnitude_and_a_complex_log_of_0_get_their_hints(how: str) -> None:
    """z / |z| of a complex 0 (modReLU's phase) is 0/0 = nan, log(0j) is -inf: the hint's facts read
    elements with float(), which a complex element with an imaginary part (the complex nan) refuses;
    the facts were lost and the division's hint was the op's generic line ("X/0 gives inf and 0/0
    gives nan"). (The log's case held already: kept as its complex guard.)"""
    torch.manual_seed(0)
    m = _ModReLU(how)
    with torch.no_grad():
        m.fc.bias.zero_()
    z = torch.randn(3, 4, dtype=torch.complex64)
    z[1] = 0  # a silent frame's spectrum
    with nanhunt.watch(m, on_find="record") as hunt:
        m(z)
    f = _first(hunt)
    assert (f.module, f.cause, f.dtype) == ("", "created", "complex64"), f
    if how == "modrelu":
        assert f.op == "aten.div.Tensor" and "0/0 gives nan here" in f.hint, f.hint
    else:
        assert f.op == "aten.log.default" and f.value == -math.inf and "Log of exactly 0" in f.hint, f.hint


# ---------------------------------------------------------------------------- causes
def test_nan_in_the_data_is_cause_input_at_the_first_module_that_reads_it() -> None:
    m = zoo.mlp()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    x[2, 1] = float("nan")
    rec = Recorder(ref)
    ref(x)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    assert_finding(_first(hunt), phase="forward", module="0", module_type="Linear", tensor="output", step=0,
                   call=0, cause="input", expected=rec.out("0"))


def test_poisoned_weight_in_gpt2_is_cause_parameter() -> None:
    m = zoo.gpt2(dropout=0.0)
    with torch.no_grad():
        m.transformer.h[1].mlp.c_fc.weight[3, 5] = float("nan")
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(ids)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(ids)
    name = "transformer.h.1.mlp.c_fc"
    assert_finding(_first(hunt), phase="forward", module=name, module_type="Conv1D", tensor="output", step=0,
                   call=0, cause="parameter", expected=rec.out(name))


def test_poisoned_batchnorm_buffer_is_cause_parameter() -> None:
    m = zoo.cnn().eval()
    with torch.no_grad():
        m.bn.running_mean[2] = float("nan")
    ref = copy.deepcopy(m)
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(x)
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    assert_finding(_first(hunt), phase="forward", module="bn", module_type="BatchNorm2d", tensor="output", step=0,
                   call=0, cause="parameter", expected=rec.out("bn"))


class _QSample(nn.Module):
    """A diffusion model's q_sample with its schedule precomputed in __init__, as a buffer: a cosine
    schedule gone below 0 at its last timestep, so that entry of sqrt(alpha_bar) is nan."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 1, 1))
        self.register_buffer("sqrt_ab", torch.tensor([0.99, 0.8, 0.5, 0.1, -0.15]).sqrt())

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        xt = self.sqrt_ab[t][:, None, None, None] * x0 + noise
        return F.mse_loss(self.net(xt), noise)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_the_parent_made_of_its_own_buffer_is_the_parents_not_the_child_it_fed(mode: str) -> None:
    # the root's own code (between its children's calls) read the nan of its schedule buffer and fed it
    # to net.0, whose weights are finite: the finding was net.0, cause "parameter", with the hint "an
    # earlier optimizer step poisoned it"; the weight to look at is the root's buffer
    torch.manual_seed(0)
    model = _QSample()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for t in ([0, 1], [2, 4]):
            x0 = torch.randn(2, 1, 4, 4)
            model(x0, torch.tensor(t), torch.randn_like(x0)).backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "", 1, "parameter"), f
    assert "'sqrt_ab' of `_QSample`" in f.hint and "optimizer step" not in f.hint, f.hint


class _CleanedQSample(_QSample):
    """The same, its loss cleaned of what the nan schedule entry made: it returns a finite loss."""

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        xt = self.sqrt_ab[t][:, None, None, None] * x0 + noise
        return torch.nan_to_num(self.net(xt) - noise).square().mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_the_parent_made_of_its_own_buffer_is_the_parents_though_it_returns_none_of_it(mode: str) -> None:
    # as above, the root's output finite: the finding was net.0, cause "input", "check the data"
    torch.manual_seed(0)
    model = _CleanedQSample()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for t in ([0, 1], [2, 4]):
            x0 = torch.randn(2, 1, 4, 4)
            model(x0, torch.tensor(t), torch.randn_like(x0)).backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.tensor) == ("forward", "", 1, "parameter", "net.0.input[0]"), f
    assert "'sqrt_ab' of `_CleanedQSample`" in f.hint and "optimizer step" not in f.hint, f.hint


class _MaskedThenLog(nn.Module):
    """A causal -inf mask buffer (intended) beside the parent's own log of a dead ReLU's 0, fed to a child."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        att = torch.softmax(h[:, None, :] + self.mask, -1).sum(1)
        return self.b(torch.log(h) + att)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parents_intended_minus_inf_mask_does_not_make_its_own_log_of_0_a_poisoned_buffer(mode: str) -> None:
    # the parent's buffer holds -inf by design (a mask, as the watch began): its own log(0) that fed b is
    # born there from finite values; it was told as cause "parameter" with the mask named
    torch.manual_seed(0)
    model = _MaskedThenLog()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.cause, f.op) == ("forward", "", "created", "aten.log.default"), f
    assert "'mask'" not in f.hint, f.hint


class _MeanSE(nn.Module):
    """A squeeze-and-excitation block: its own code averages the feature map, fed to ``fc1``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3))  # a 0x0 map (images too small for the strides): the mean of nothing is nan
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))[:, :, None, None]


class _CropSEBlock(nn.Module):
    def __init__(self, ci: int, co: int, crop: bool) -> None:
        super().__init__()
        self.conv, self.bn, self.se, self.crop = nn.Conv2d(ci, co, 3, stride=2, padding=1), nn.BatchNorm2d(co), _MeanSE(co), crop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.se(h[:, :, 1:-1, 1:-1] if self.crop else h)  # a valid crop of the border


class _CropSENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2, self.head = _CropSEBlock(3, 16, False), _CropSEBlock(16, 32, True), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b2(self.b1(x)).flatten(2).sum(-1))  # (an empty map sums to 0: a finite loss)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_a_parents_own_code_made_and_fed_a_child_is_the_parents_though_its_output_is_empty(mode: str) -> None:
    # images too small for the strides: `b2.se` got a (N, C, 0, 0) map, its own mean of it is nan, fed to its
    # fc1; its output (and the model's) is empty or finite. The finding was `b2.se.fc1`, cause "input", no op
    torch.manual_seed(0)
    model = _CropSENet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        for size in (16, 16, 4):
            model(torch.randn(4, 3, size, size)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op, f.tensor) == (
        "forward", "b2.se", 2, "created", "aten.mean.dim", "fc1.input[0]"), f
    assert f.source is not None and f.source.endswith(f"test_watch_forward.py:{_MeanSE.forward.__code__.co_firstlineno + 1}"), f
    assert (f.shape, f.verdict) == ((4, 32), "numerics") and f.value is not None and math.isnan(f.value), f
    assert "too small" in f.hint, f.hint


class _LogCleaned(nn.Module):
    """Its own code takes the log of a conv (nan where it is negative), fed to ``c1`` (by keyword or
    not), and cleans what ``c1`` returns: its output is finite."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.c0, self.c1, self.keyword = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.log(self.c0(x))
        return torch.nan_to_num(self.c1(input=y) if self.keyword else self.c1(y), nan=0.0)


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_a_parents_own_code_made_and_fed_a_child_is_the_parents_though_it_cleans_it_after(
        mode: str, keyword: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_LogCleaned(keyword), nn.Flatten(), nn.Linear(4 * 5 * 5, 2))
    x = torch.randn(2, 3, 5, 5)
    expected = copy.deepcopy(model)(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as err, nanhunt.watch(model, opt, mode=mode):
        out = model(x)
        assert torch.equal(out, expected)
        out.square().mean().backward()
        opt.step()
    f = err.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op, f.tensor, f.verdict) == (
        "forward", "0", 0, "created", "aten.log.default", "c1.input" if keyword else "c1.input[0]", "numerics"), f
    assert "Log of a negative number" in f.hint, f.hint


# ---------------------------------------------------------------------------- names
def test_submodule_called_directly_is_named_relative_to_the_watched_model() -> None:
    m = zoo.gpt2(dropout=0.0)
    with torch.no_grad():
        m.transformer.h[1].mlp.c_fc.weight[0, 7] = float("inf")
    h = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    expected = copy.deepcopy(m.transformer.h[1].mlp.c_fc)(h)
    with nanhunt.watch(m, on_find="record") as hunt:
        m.transformer.h[1].mlp(h)
    assert_finding(_first(hunt), phase="forward", module="transformer.h.1.mlp.c_fc", module_type="Conv1D",
                   tensor="output", step=0, call=0, cause="parameter", expected=expected)


def test_modules_outside_the_watched_model_are_not_watched() -> None:
    m = zoo.mlp()
    other = zoo.Log()
    with nanhunt.watch(m) as hunt:
        other(torch.zeros(3))
        m(torch.ones(2, 4))
    assert hunt.findings == []


# ---------------------------------------------------------------------------- hunt.check and steps
def test_check_a_loss_computed_outside_modules() -> None:
    m = zoo.mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt) as hunt:
        for i in range(3):
            out = m(x)
            loss = torch.log(out.abs().sum() * (0.0 if i == 1 else 1.0))  # log(0) in the loss, step 1
            assert hunt.check(loss, "loss") is loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.index, f.shape, f.dtype) == ("check", "loss", 1, (), (), "float32")
    assert f.value == -math.inf and f.counts == {"nan": 0, "+inf": 0, "-inf": 1}
    assert f.cause == "created"


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_step_counts_training_steps(with_optimizer: bool) -> None:
    m = zoo.lognet()
    opt = torch.optim.SGD(m.parameters(), lr=0.0) if with_optimizer else None
    good = torch.full((2, 4), 0.1)
    with torch.no_grad():
        m.lin.bias.fill_(3.0)
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        for i in range(5):
            x = _killer().expand(2, 4) if i == 3 else good
            if opt is None:
                with torch.no_grad():
                    m(x)
            else:
                for _micro in range(2):  # gradient accumulation: two forwards per step
                    m(x).sum().backward()
                opt.step()
                opt.zero_grad()
    f = _first(hunt)
    assert (f.module, f.step, f.call) == ("log", 3, 0)
    assert hunt.findings[-1].step == 3 if opt is None else True


def test_nan_in_the_second_micro_batch_has_call_one() -> None:
    m = _lognet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    ok = torch.full((2, 4), 0.1)
    bad = torch.stack([ok[0], _killer()])
    ref = copy.deepcopy(m)
    rec = Recorder(ref)
    ref(ok)
    ref(bad)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt):
        m(ok).sum().backward()
        m(bad).sum().backward()
        opt.step()
    assert_finding(ei.value.finding, phase="forward", module="log", module_type="Log", tensor="output", step=0,
                   call=1, cause="created", expected=rec.out("log", 1))


@pytest.mark.parametrize("row", [float("inf"), float("nan")])
def test_a_row_of_inf_from_the_data_turned_into_nan_by_a_matmul_was_fed_in(row: float) -> None:
    # inf * w with weights of both signs gives inf - inf = nan in every output of that row: the
    # Linear made the NaN, but from an input that was not finite (unlike a -inf mask's softmax)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.cat([torch.randn(2, 4), torch.full((1, 4), row)])
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = hunt.first
    assert f is not None and (f.module, f.cause) == ("0", "input")
    assert f.counts["nan"] == 4 and "made before the model" in f.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["std", "mask"])
def test_a_nan_the_loop_made_before_the_forward_is_told_as_the_models_named_input(how: str, mode: str) -> None:
    # the loop's code before the model's call is not recorded: the first module fed the NaN (deep
    # inside the model for a mask the attention's own code reads) said "made before the model, by
    # the enclosing module's own forward, or outside any module", never which input of the model it was
    # (sentinel mode, localising by replay, said so still: an RL critic fed an inf reward as input[1])
    torch.manual_seed(0)
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1,
                              enable_nested_tensor=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m, opt, mode=mode):
        for step in range(3):
            x = torch.randn(4, 5, 8)
            causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
            if step == 2 and how == "std":
                x[..., 1] = 3.0  # a constant feature: its std is 0
            x = (x - x.mean((0, 1))) / x.std((0, 1))
            big = float("-inf") if step == 2 and how == "mask" else torch.finfo(torch.float32).min
            mask = causal + (1.0 - torch.ones(5, 5).tril()) * big  # 0 * -inf = nan on the diagonal
            m(x, mask=mask).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("forward", 2, "input"), f
    # which element, and for a table the column (a constant feature standardised by a std of 0):
    # the hint said only "input[0]", leaving the user to search a (4, 5, 8) batch for the NaN
    want = ("input[0] holding nan at [0, 0, 1], only in column 1 of its last dimension" if how == "std"
            else "mask holding nan at [0, 0]")
    assert f"The model was given a non-finite input ({want})" in f.hint, f.hint
    assert "made before the model" in f.hint


def test_a_nan_in_a_validation_loop_raises_at_the_models_next_forward() -> None:
    # an optimizer is watched, but a validation loop never calls step(): the NaN of batch 3 is
    # raised at batch 4's forward at the latest (not at close(), a thousand batches later),
    # numbered as the module's fourth call of the step
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    seen = []
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(m, opt):
            for _ in range(2):
                m(x).sum().backward()
                opt.step()
                opt.zero_grad()
            m.eval()
            with torch.no_grad():
                for j in range(50):
                    b = x.clone()
                    if j == 3:
                        b[0, 0] = float("nan")
                    m(b)
                    seen.append(j)
    assert seen[-1] == 3, "raised at batch 4's forward"
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.call, f.cause) == ("forward", "0", 2, 3, "input")


def test_a_float32_overflow_is_not_told_to_move_to_float32() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        m[1].weight.mul_(1e38)  # an exploded weight
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(m):
        m(torch.randn(4, 8) * 100)
    f = ei.value.finding
    assert (f.module, f.cause, f.op) == ("1", "created", "aten.addmm.default")
    assert "float32's largest finite value" in f.hint and "keep this module in float32" not in f.hint
    assert "exploding weights" in f.hint


class _VAE(nn.Module):
    """An encoder's mean and log-variance, the reparameterisation z = mu + eps * exp(0.5 * logvar)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 4), nn.Linear(32, 4)
        self.dec = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        std = torch.exp(0.5 * logvar)  # @vae-std
        return self.dec(mu + torch.randn_like(std) * std), mu, logvar


@pytest.mark.parametrize("where", ["std", "kl"])
def test_a_vae_whose_logvar_overflowed_exp_is_told_to_clamp_the_exponent(where: str) -> None:
    # logvar near 200 (std = exp(100) = inf, z inf, the decoder nan) or near 100 (std finite, the KL
    # term's logvar.exp() inf): the hint said only "look for exploding weights or inputs", no word
    # of exp's input or of clamping logvar, the usual fix
    torch.manual_seed(0)
    vae = _VAE()
    with torch.no_grad():
        vae.logvar.bias.fill_(200.0 if where == "std" else 100.0)
    opt = torch.optim.Adam(vae.parameters(), 1e-3)
    x = torch.randn(8, 16)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(vae, opt):
        rec, mu, logvar = vae(x)
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        (F.mse_loss(rec, x) + kl).backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.cause, f.op) == ("" if where == "std" else "<outside>", "created", "aten.exp.default"), str(f)
    assert "logvar.clamp" in f.hint and "past 88.72" in f.hint, f.hint


@pytest.mark.parametrize("where", ["std", "kl"])
def test_a_float16_vae_whose_exp_overflowed_is_told_its_exponent_not_to_scale_its_input(where: str) -> None:
    # under float16 autocast exp passes 65504 once its input passes 11.09: the reparameterisation's
    # exp(0.5 * logvar) in the forward (logvar 30) or the KL term's logvar.exp() in the loss code
    # (logvar 14). The hint said "keep this module in float32/bfloat16 or scale before it" (or
    # "compute it in float32 ... or scale before it"): no word of exp's input or of clamping logvar
    torch.manual_seed(0)
    vae = _VAE()
    with torch.no_grad():
        vae.logvar.weight.mul_(0.01)
        vae.logvar.bias.fill_(30.0 if where == "std" else 14.0)
    opt = torch.optim.SGD(vae.parameters(), 1e-3)
    x = torch.randn(8, 16)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(vae, opt):
        with torch.autocast("cpu", dtype=torch.float16):
            rec, mu, logvar = vae(x)
            kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        (F.mse_loss(rec.float(), x) + kl.float()).backward()
        opt.step()
    f = ei.value.finding
    assert (f.module, f.cause, f.op, f.verdict) == ("" if where == "std" else "<outside>", "created", "aten.exp.default",
                                                    "precision"), str(f)
    assert "past 11.09" in f.hint and "logvar" in f.hint and "scale before it" not in f.hint, f.hint


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested", "jagged"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_sparse_or_nested_output_is_judged_by_its_values(layout: str, mode: str) -> None:
    # exp overflows in the module that returns a sparse or nested tensor: found there, never an
    # internal fault that switches the hunt off; its element at an index a user can look up: a
    # sparse tensor's dense coordinates (not its place in values()), a nested tensor's component
    # and the index within it (not its place in the flat values)
    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).exp()
            if layout == "sparse_coo":
                return y.to_sparse()
            if layout == "sparse_csr":
                return y.to_sparse_csr()
            kw = {"layout": torch.jagged} if layout == "jagged" else {}
            return torch.nested.nested_tensor([y[0], y[1:].flatten()], **kw)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = Out()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            o = self.out(x)
            return o.values().sum() if o.is_nested else o.to_dense().sum()

    torch.manual_seed(0)
    m = Model()
    x = torch.randn(3, 4)
    with nanhunt.watch(m, on_find="record", mode=mode) as hunt:
        for step in range(2):
            if step == 1:
                x[1] *= 1e3
            loss = m(x)
            hunt.check(loss, "loss")  # what sentinel mode sees; it then replays the forward
            if loss.requires_grad:  # (a nested tensor made from a list has no autograd history)
                loss.backward()
    f = hunt.first
    assert f is not None
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "out", 1, "created") and f.value == float("inf")
    with torch.no_grad():
        y = m.out.lin(x).exp()  # what the module made at step 1 (no optimizer: the weights are the same)
    if layout.startswith("sparse"):
        want, shape = tuple(int(i) for i in (~torch.isfinite(y)).nonzero()[0]), (3, 4)
        assert y.to_sparse()._values().shape != y.shape  # (its place among the values is another index)
        assert f.index is not None and y[f.index] == f.value
    else:
        parts = [y[0], y[1:].flatten()]
        k = next(k for k, p in enumerate(parts) if not bool(torch.isfinite(p).all()))
        want, shape = (k, int((~torch.isfinite(parts[k])).nonzero()[0, 0])), (2, 8)
        assert f.index is not None and parts[f.index[0]][f.index[1:]] == f.value
    assert (f.index, f.shape) == (want, shape)


class _SparseGCN(nn.Module):
    """A GCN over a sparse COO adjacency the data gives (edge weights from preprocessing)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(torch.sparse.mm(adj, self.l1(x))))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_sparse_input_is_told_at_its_dense_index(mode: str) -> None:
    # an edge weight of a sparse adjacency is nan in the data: fed in, and the hint named the element
    # at its place among the adjacency's values ("input[1] holding nan at [3]"), not at the [row, col]
    # a user looks up in it
    idx = torch.tensor([[0, 1, 1, 2, 2, 3, 4], [1, 0, 2, 1, 3, 4, 3]])
    w = torch.rand(7)
    w[3] = float("nan")  # the edge 2 -> 1
    adj = torch.sparse_coo_tensor(idx, w, (5, 5), check_invariants=True).coalesce()
    model = _SparseGCN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, optimizer=opt, mode=mode):
        F.cross_entropy(model(torch.randn(5, 4), adj), torch.tensor([0, 1, 0, 1, 1])).backward()
        opt.step()
    f = _first(ei.value)
    assert (f.phase, f.cause) == ("forward", "input"), f
    assert "input[1] holding nan at [2, 1]" in f.hint, f.hint


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("layout", ["nested", "jagged"])
def test_an_op_on_a_nested_tensor_is_named_with_its_line(layout: str) -> None:
    # a layer run on a ragged batch (a nested tensor of sequences) takes the sqrt of a negative: the
    # replay's recorder judged each op's tensors with to_dense / .shape, which a nested tensor has
    # not (and a jagged one's built-in sequence lengths live on the meta device): the replay failed,
    # and the finding had no op, no line and the generic hint
    class Ragged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, seqs: list[torch.Tensor]) -> torch.Tensor:
            kw = {"layout": torch.jagged} if layout == "jagged" else {}
            x = torch.nested.nested_tensor(seqs, **kw)
            return (self.lin(x) - 100).sqrt()

    torch.manual_seed(0)
    m = Ragged()
    with nanhunt.watch(m, on_find="record") as hunt:
        m([torch.randn(2, 4), torch.randn(3, 4)])
    f = hunt.first
    assert f is not None and (f.module, f.cause) == ("", "created") and math.isnan(f.value), f
    assert f.op == "aten.sqrt.default" and f.source is not None, f
    assert f.source.endswith(f":{Ragged.forward.__code__.co_firstlineno + 3}"), f.source


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_watch_without_the_optimizer_judges_the_step_before_that_optimizer_writes_the_weights(mode: str) -> None:
    """watch(model) in a training loop, the optimizer not given: the call was judged (and
    replayed) at the model's next call, after the optimizer had written NaN into the weights, so
    a NaN from the data was reported at element (0, 0) with cause 'parameter'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        for step in range(4):
            x = torch.randn(4, 8)
            if step == 2:
                x[2, 3] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()  # record mode: applies the NaN gradients of step 2
            opt.zero_grad()
        assert hunt.step == 3, "steps are still the model's calls"
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.step, f.index, f.cause) == ("forward", "0", 2, (2, 0), "input"), f

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, mode=mode):
            for step in range(4):
                x = torch.randn(4, 8)
                if step == 2:
                    x[2, 3] = float("nan")
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    assert ei.value.finding.step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters()), "raised before the update"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_second_optimizer_not_given_to_watch_has_the_step_judged_before_it_writes(mode: str) -> None:
    """Two optimizers (AdamW for the first layer, SGD for the rest), only SGD given to watch(),
    AdamW stepping first: the step was judged at SGD's step, after AdamW had written NaN into the
    first layer, so a NaN from the data was blamed on poisoned weights; in raise mode AdamW
    applied the NaN gradients."""
    for on_find in ("record", "raise"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        first = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
        rest = torch.optim.SGD(model[2].parameters(), lr=0.1)
        hunt = nanhunt.watch(model, rest, on_find=on_find, mode=mode)
        try:
            for step in range(4):
                x = torch.randn(4, 8)
                if step == 2:
                    x[2, 3] = float("nan")
                model(x).pow(2).mean().backward()
                first.step()
                rest.step()
                first.zero_grad()
                rest.zero_grad()
        except nanhunt.NonFiniteError:
            assert on_find == "raise"
            assert all(torch.isfinite(p).all() for p in model.parameters()), "raised before either update"
        finally:
            hunt.close()
        f = hunt.first
        assert f is not None and (f.phase, f.module, f.step, f.index, f.cause) == ("forward", "0", 2, (2, 0), "input"), f
        assert hunt.step == (2 if on_find == "raise" else 4), "steps are still the watched optimizer's"


def test_poisoned_weights_without_a_watched_optimizer_get_a_hint_that_can_be_followed() -> None:
    """The hint sent the user to 'a finding in phase optimizer', which no hunt without an
    optimizer makes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, on_find="record") as hunt:
        for step in range(4):
            x = torch.randn(4, 8)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()  # applies the NaN gradients: the weights are NaN from step 2 on
            opt.zero_grad()
    later = next(f for f in hunt.findings if f.phase == "forward" and f.cause == "parameter")
    assert "No optimizer is watched" in later.hint and "phase 'optimizer'" not in later.hint, later.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_pass_inside_a_steps_window_does_not_shift_the_micro_batches_call_numbers(mode: str) -> None:
    """Lightning's val_check_interval can run validation between two micro-batches of one step:
    its calls were counted as calls of the training step ('step 2, call 3' for micro-batch 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, mode=mode):
            for step in range(3):
                for micro in range(2):
                    x = torch.randn(4, 8)
                    if (step, micro) == (2, 1):
                        x[1, 1] = float("nan")
                    model(x).pow(2).mean().backward()
                    if micro == 0:  # validation in the middle of the step's window
                        model.eval()
                        with torch.no_grad():
                            for _ in range(2):
                                model(torch.randn(4, 8))
                        model.train()
                opt.step()
                opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.step, f.call, f.cause) == ("forward", 2, 1, "input"), f


class _ToFloat8(nn.Module):
    """Quantises its input to a float8 dtype (an fp8 training recipe's cast): past the dtype's
    range the value becomes inf (e5m2) or NaN (the fnuz dtypes, which have no inf)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e6).to(self.dtype)


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_float8_output_past_its_range_is_found_at_the_cast(dtype: str, mode: str) -> None:
    # most reductions have no float8 kernel (isfinite, isinf, aminmax): the hunt switched itself off
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _ToFloat8(dt))
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, mode=mode):  # history on: the sampled statistics read float8 too
            for _ in range(2):
                model(torch.randn(2, 3)).float().sum()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.dtype, f.cause) == ("forward", "1", 0, dtype, "created"), f
    assert f.op == "aten._to_copy.default" and f.source is not None and f.source.endswith(
        f"test_watch_forward.py:{_ToFloat8.forward.__code__.co_firstlineno + 1}"), f
    assert f.value is not None and not math.isfinite(f.value) and f.index == (0, 0)


class _Float8Cache(nn.Module):
    """A module that keeps a float8 copy of a weight as a buffer (an fp8 inference cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("w8", torch.randn(4, 4).to(torch.float8_e4m3fn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x @ self.w8.float()


@pytest.mark.parametrize("on_find", ["raise", "skip"])
def test_a_float8_buffer_is_judged_with_the_rest(on_find: str, tmp_path: Any) -> None:
    # the step's buffer check, the start-of-watch flags and the save guard read the buffer with
    # kernels float8 lacks: InternalError at the first step
    torch.manual_seed(0)
    model = nn.Sequential(_Float8Cache(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, on_find=on_find) as hunt:
        zoo.train_with_a_nan_batch(model, opt, (2, 4), after_step=lambda: torch.save(model.state_dict(), tmp_path / "ckpt.pt"))
    assert not hunt._faulted and [(f.step, f.cause) for f in hunt.findings][:1] == [(2, "input")], hunt.findings


class _ActNorm(nn.Module):
    """Glow's ActNorm: loc and log-scale set from the first batch (data-dependent init)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, c))
        self.logs = nn.Parameter(torch.zeros(1, c))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.initialized.item() == 0:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0, keepdim=True))
                self.logs.data.copy_(torch.log(1.0 / x.std(0, keepdim=True)))  # @actnorm-init: a constant feature: 1/0
                self.initialized.fill_(1)
        return (x + self.loc) * torch.exp(self.logs)  # 0 * inf there


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_weight_the_first_call_initialises_from_the_data_is_born_there_not_a_poisoned_weight(
        with_optimizer: bool) -> None:
    # the NaN is this call's own (inf * 0 from the scale it just set to 1/0): its parameters were
    # finite when the step began. It was judged on the weights as they are after the call: "parameter"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _ActNorm(4), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight[2].zero_()
        m[0].bias[2] = 1.0  # feature 2 is constant over the batch: its std is 0
    ref = copy.deepcopy(m)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    rec = Recorder(ref)
    ref(x)
    opt = torch.optim.SGD(m.parameters(), lr=0.01) if with_optimizer else None
    with nanhunt.watch(m, opt, on_find="record") as hunt:
        m(x).sum().backward()
        if opt is not None:
            opt.step()
    f = _first(hunt)
    assert_finding(f, phase="forward", module="1", module_type="_ActNorm", tensor="output", step=0,
                   call=0, cause="created", expected=rec.out("1"))
    # the op is the init's 1/std, followed through the .data.copy_ into the scale: the replay starts
    # from the integer buffers the call began with (initialized = 0), and a write through .data
    # (no version bump) is seen as the parameter's latest writer
    with open(__file__) as src:
        init = next(i + 1 for i, t in enumerate(src) if t.rstrip().endswith("@actnorm-init: a constant feature: 1/0"))
    assert f.op == "aten.reciprocal.default" and f.source == f"{__file__}:{init}", (f.op, f.source)
    assert any("aten.copy_" in c for c in f.chain) and f.chain[0].startswith("aten.reciprocal"), f.chain


class _InPlaceNorm(nn.Module):
    """Row normalisation written into its input (no parameters): a zero row gives 0 / 0 = NaN.
    ``detached``: the norm of a detached copy (the form that trains: autograd allows the write)."""

    def __init__(self, detached: bool) -> None:
        super().__init__()
        self.detached = detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.div_((x.detach() if self.detached else x).norm(dim=-1, keepdim=True))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("train", [False, True])
def test_a_module_that_writes_its_input_in_place_is_named(mode: str, train: bool) -> None:
    # the replay read the module's input after the call, when it was the NaN output itself (the
    # same tensor): "fed in", and the finding climbed to the root, whose own code made it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), _InPlaceNorm(detached=train), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if train else None
    x = torch.randn(6, 4)
    x[2] = 0.0  # a zero row: the first Linear (no bias) gives zeros, the norm divides 0 by 0
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        if train:
            model(x).sum().backward()
            assert opt is not None
            opt.step()
        else:
            with torch.no_grad():
                model(x)
                model(x)  # (the next call ends the step)
    f = ei.value.finding
    assert (f.phase, f.module, f.module_type, f.cause, f.op) == ("forward", "1", "_InPlaceNorm", "created", "aten.div_.Tensor")
    assert f.index == (2, 0) and math.isnan(f.value)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weight_norm_of_a_pruned_row_is_told_as_its_zero_direction(mode: str) -> None:
    # magnitude pruning zeroes a row of weight_norm's direction v: the row is v / ||v|| = 0/0. The
    # hint was the generic "typically 0/0, inf - inf or inf * 0 ... a softmax over a fully masked row"
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 6)), nn.ReLU(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    model[0].parametrizations.weight.original1[2].zero_()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause) == ("forward", "0.parametrizations.weight.0", 1, "created"), str(f)
    assert f.op == "aten._weight_norm_interface.default" and f.index == (2, 0), str(f)
    assert "weight_norm" in f.hint and "original0" in f.hint and "fully masked" not in f.hint, f.hint


class _SNDiscriminator(nn.Module):
    """A GAN discriminator under spectral_norm whose last conv is zero-initialised (a residual branch's
    zero init, a diffusion model's zero_module)."""

    def __init__(self, old: bool) -> None:
        super().__init__()
        sn = nn.utils.spectral_norm if old else nn.utils.parametrizations.spectral_norm
        last = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        nn.init.zeros_(last.weight)
        self.c1, self.c2, self.fc = sn(nn.Conv2d(3, 8, 3, padding=1)), sn(last), nn.Linear(8 * 4 * 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.leaky_relu(self.c2(F.leaky_relu(self.c1(x), 0.2)), 0.2).flatten(1))


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_spectral_norm_of_an_all_zero_weight_is_told_as_its_sigma_of_0(mode: str, old: bool) -> None:
    # spectral_norm divides the weight by sigma = u . (W v): 0 for a zero weight, so weight / sigma = 0/0.
    # The hint was the generic 0/0's "a zero vector divided by its norm (F.normalize ...), an IoU of
    # zero-area boxes", no word of spectral_norm or the zero-initialised layer under it
    torch.manual_seed(0)
    model = _SNDiscriminator(old)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        F.softplus(-model(torch.randn(4, 3, 8, 8))).mean().backward()
        opt.step()
    f = ei.value.finding
    module = "c2" if old else "c2.parametrizations.weight.0"
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", module, 0, "created", "aten.div.Tensor"), str(f)
    assert "spectral_norm" in f.hint and "sigma" in f.hint and "zero-initialised" in f.hint, f.hint
    assert "IoU" not in f.hint, f.hint


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_spectral_norm_of_weights_grown_past_1e19_is_told_as_its_power_iteration_overflowing(mode: str, old: bool) -> None:
    # an all-spectral_norm critic whose lr blew the weights up to 3e19: the norm of W v overflows
    # float32, F.normalize makes u and v 0, and weight / sigma is x/0. The hint was the generic "a
    # count that is 0, or a learned temperature ... + eps or clamp_min(eps)", which spectral_norm's
    # user cannot do and which is not the fix
    sn = nn.utils.spectral_norm if old else nn.utils.parametrizations.spectral_norm
    torch.manual_seed(0)
    model = nn.Sequential(sn(nn.Linear(8, 16)), nn.LeakyReLU(0.2), sn(nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e19, betas=(0.0, 0.9))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for _ in range(2):
            F.softplus(-model(torch.randn(16, 8))).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    module = "0" if old else "0.parametrizations.weight.0"
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", module, 1, "created", "aten.div.Tensor"), str(f)
    assert "spectral_norm" in f.hint and "overflowed" in f.hint and "lr=3e+19" in f.hint, f.hint
    assert "count" not in f.hint and "temperature" not in f.hint, f.hint


class _MaskedActor(nn.Module):
    """A policy over legal actions: illegal ones masked to -inf, then a Categorical's log-probability."""

    def __init__(self, how: str = "masked_fill") -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.logits = nn.Linear(16, 5)
        self.how = how

    def forward(self, obs: torch.Tensor, legal: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        logits = self.logits(torch.tanh(self.body(obs)))
        if self.how == "masked_fill":
            logits = logits.masked_fill(~legal, float("-inf"))
        else:  # an additive mask: log(1) = 0, log(0) = -inf
            logits = logits + legal.float().log()
        return torch.distributions.Categorical(logits=logits, validate_args=False).log_prob(act)


@pytest.mark.parametrize("how", ["masked_fill", "log"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_categorical_over_a_row_with_no_legal_action_is_told_as_a_fully_masked_row(mode: str, how: str) -> None:
    # a state with every action illegal: Categorical normalises its logits as logits - logsumexp(logits),
    # -inf - (-inf) = nan. The hint was p * log p's ("-inf * 0 ... label smoothing ... xlogy"), no
    # word of the row being masked at every position; for a mask added as legal.log(), "log of exactly
    # 0 ... keep it positive", as if a value had reached 0
    torch.manual_seed(0)
    model = _MaskedActor(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(2):
            legal = torch.ones(8, 5, dtype=torch.bool)
            if step == 1:
                legal[3] = False
            (-model(torch.randn(8, 6), legal, torch.zeros(8, dtype=torch.long)).mean()).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.index, f.cause) == ("forward", "", 1, (3,), "created"), str(f)
    assert f.op == ("aten.masked_fill.Scalar" if how == "masked_fill" else "aten.log.default"), str(f)
    assert any(c.startswith("aten.sub.Tensor") for c in f.chain), str(f)
    assert "fully masked row" in f.hint and "xlogy" not in f.hint, f.hint


class _GaussianPolicy(nn.Module):
    """A Gaussian policy whose scale is a ReLU's output: 0 for a state that drives it below 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.mu = nn.Linear(16, 2)
        self.sigma = nn.Linear(16, 2)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(obs))
        dist = torch.distributions.Normal(self.mu(h), F.relu(self.sigma(h)), validate_args=False)
        return dist.log_prob(act).sum(-1)  # @normal-log-prob


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_normal_log_prob_whose_scale_reached_0_is_told_as_a_log_of_exactly_0(mode: str) -> None:
    # Normal.log_prob takes log(scale): a scale of exactly 0 (ReLU) is -inf there, then -inf - (-inf)
    # = nan. The hint was "log of 0 gives -inf and log of a negative number gives nan", no word of
    # what reached 0 or how to keep it positive
    torch.manual_seed(0)
    model = _GaussianPolicy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for _ in range(2):
            (-model(torch.randn(8, 6), torch.randn(8, 2)).mean()).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.op) == ("forward", "", "created", "aten.log.default"), str(f)
    want = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith("# @normal-log-prob"))
    assert f.source is not None and f.source.endswith(f"test_watch_forward.py:{want}"), str(f)
    assert "exactly 0" in f.hint and "scale" in f.hint and "softplus" in f.hint, f.hint


class _RidgeHead(nn.Module):
    """A closed-form ridge head (meta-learning): W = (Z^T Z + lam I)^-1 Z^T Y on the support set."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())
        self.lam = nn.Parameter(torch.tensor(0.5))
        self.how = how

    def forward(self, xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        zs, zq = self.enc(xs), self.enc(xq)
        gram = zs.T @ zs + F.relu(self.lam) * torch.eye(4)
        if self.how == "inv_ex":
            return zq @ torch.linalg.inv_ex(gram)[0] @ zs.T @ ys  # @ridge
        return zq @ torch.linalg.solve_ex(gram, zs.T @ ys)[0]  # @ridge


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["inv_ex", "solve_ex"])
def test_an_inverse_of_a_singular_gram_matrix_is_told_as_singular(how: str, mode: str) -> None:
    # 3 support points in 4 dimensions, one feature a dead ReLU's 0 and the ridge term relu'd to 0:
    # the Gram matrix is singular and inv_ex / solve_ex return inf/nan (inv and solve would raise).
    # The op and line were right, the hint the generic "0/0, inf - inf or inf * 0 — e.g. a softmax
    # over a fully masked row"
    torch.manual_seed(0)
    model = _RidgeHead(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    model.lam.fill_(-1.0)
                    model.enc[2].bias[0] = -100.0
            model(torch.randn(3, 8), torch.randn(3, 2), torch.randn(5, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.step) == ("forward", "", "created", 1), str(f)
    assert f.op in ("aten.linalg_inv_ex.default", "aten._linalg_solve_ex.default"), str(f)
    want = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.endswith("# @ridge") and how in text)
    assert f.source is not None and f.source.endswith(f"test_watch_forward.py:{want}"), str(f)
    assert "singular matrix" in f.hint and "lstsq" in f.hint and "masked row" not in f.hint, f.hint


class _SEBlock(nn.Module):
    """A strided conv, BatchNorm, a crop of the border (a 'valid' block) and a squeeze-and-excitation gate."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout)
        self.pool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(cout, cout // 4, 1), nn.Conv2d(cout // 4, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))[:, :, 1:-1, 1:-1]
        return h * torch.sigmoid(self.fc2(F.relu(self.fc1(self.pool(h)))))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_global_pool_of_a_feature_map_of_size_0_names_images_too_small_for_the_strides(mode: str) -> None:
    # 16 x 16 images train; a batch of 8 x 8 ones shrinks to 2 x 2 after the first block and to 0 x 0
    # after the second, whose squeeze-and-excitation pool is then a mean over nothing, 0/0. The hint
    # said "skip such batches, or divide by max(count, 1)", which hides the real fault: the input size
    torch.manual_seed(0)
    model = nn.Sequential(_SEBlock(3, 8), _SEBlock(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 5, (4,))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode=mode):
        for size in (16, 16, 8):
            F.cross_entropy(model(torch.randn(4, 3, size, size)), y).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.cause, f.op) == ("forward", "1.pool", 2, "created", "aten.mean.dim"), f
    assert "spatial size 0 (shape (4, 16, 0, 0))" in f.hint and "too small for the network's downsampling" in f.hint, f.hint
    assert "max(count, 1)" not in f.hint, f.hint
