"""A shared zoo of small real models and the failure mechanisms users hit.

Every builder seeds its own RNG, so two calls give bit-identical models. Nothing is downloaded:
the transformers models are built from tiny configs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- plain models


class MLP(nn.Sequential):
    """Linear -> Tanh -> Dropout -> Linear: a regression head."""

    def __init__(self, d_in: int = 4, d_hidden: int = 8, d_out: int = 1, p: float = 0.0) -> None:
        super().__init__(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Dropout(p), nn.Linear(d_hidden, d_out))


def mlp(seed: int = 0, **kw: Any) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


class Log(nn.Module):
    """log of its input: -inf at 0 (the classic log(0))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogNet(nn.Module):
    """Linear -> ReLU -> Log -> Linear. ReLU zeros make Log emit -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.act = nn.ReLU()
        self.log = Log()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.act(self.lin(x))))


def lognet(seed: int = 0) -> LogNet:
    torch.manual_seed(seed)
    return LogNet()


class PairDistance(nn.Module):
    """Euclidean distance between two halves of its input: sqrt(sum((a - b)**2)).

    Finite in forward; when a == b the gradient of sqrt at 0 is inf, and inf * 0 = nan.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.sqrt(((a - b) ** 2).sum(-1, keepdim=True))


class DistNet(nn.Module):
    """A siamese distance: the same projection of both halves of the input, then their distance.

    Inputs whose two halves are equal give a == b exactly, at any weights: sqrt at 0.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 3)
        self.dist = PairDistance()
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.proj(x[:, :2]), self.proj(x[:, 2:])], dim=-1)
        return self.head(self.dist(h))


def distnet(seed: int = 0) -> DistNet:
    torch.manual_seed(seed)
    return DistNet()


class SafeSqrt(nn.Module):
    """The torch.where gradient trap: where(x > 0, sqrt(x), 0) is finite, its gradient is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class WhereNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.safe = SafeSqrt()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.safe(self.lin(x)))


def wherenet(seed: int = 0) -> WhereNet:
    torch.manual_seed(seed)
    return WhereNet()


class _BadBackward(torch.autograd.Function):
    """Identity forward; a backward that returns inf wherever the input is negative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.where(x < 0, torch.full_like(g, float("inf")), g)


class BadGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BadBackward.apply(x)


class BadGradNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bad = BadGrad()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bad(self.lin(x)))


def badgradnet(seed: int = 0) -> BadGradNet:
    torch.manual_seed(seed)
    return BadGradNet()


class SharedNet(nn.Module):
    """The same Linear applied twice per forward (weight tying / recurrence)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.shared = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.shared(self.inp(x))))


def sharednet(seed: int = 0, dtype: torch.dtype = torch.float32) -> SharedNet:
    torch.manual_seed(seed)
    return SharedNet().to(dtype)


class MaskedAttention(nn.Module):
    """Single-head attention that masks padded keys with -inf before softmax.

    A query row whose keys are all padding is a fully masked row: softmax of all -inf is nan.
    """

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_padding: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(key_padding[:, None, :], float("-inf"))
        return self.out(F.softmax(scores, dim=-1) @ self.v(x))


class CausalMask(nn.Module):
    """Makes a causal additive mask: -inf above the diagonal (legitimately non-finite)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return torch.triu(torch.full((t, t), float("-inf"), dtype=x.dtype), diagonal=1)


class CausalAttention(nn.Module):
    """Self-attention with a causal -inf mask made by a submodule; every row keeps a key."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mask = CausalMask()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + self.mask(x)
        return self.proj(F.softmax(scores, dim=-1) @ v)


class MaskPassThrough(nn.Module):
    """A parent returning its child's legitimate -inf mask unchanged, next to real work."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mask = CausalMask()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.mask(x)


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear, with dropout: buffers and RNG both matter."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(self.act(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(h.flatten(1)))


def cnn(seed: int = 0) -> CNN:
    torch.manual_seed(seed)
    return CNN()


class AuxCNN(CNN):
    """A CNN that also returns a diagnostic log-activation (-inf where ReLU is 0), unused by the loss."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        h = F.max_pool2d(self.act(self.bn(self.conv(x))), 2).flatten(1)
        return {"logits": self.fc(self.drop(h)), "log_act": torch.log(h.detach())}


def auxcnn(seed: int = 0) -> AuxCNN:
    torch.manual_seed(seed)
    return AuxCNN()


class BNCNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear, no dropout: a run is a function of its batches."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(self.act(self.bn(self.conv(x))), 2).flatten(1))


def bncnn(seed: int = 0) -> BNCNN:
    torch.manual_seed(seed)
    return BNCNN()


class BNMLP(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: a classifier over 6 features."""

    def __init__(self, d_in: int = 6, d_hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.bn(self.fc1(x))))


def bnmlp(seed: int = 0) -> BNMLP:
    torch.manual_seed(seed)
    return BNMLP()


def transformer_encoder(seed: int = 0, d: int = 16, dropout: float = 0.1) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class ComplexNet(nn.Module):
    """A spectral layer: rfft -> complex gain -> the complex spectrum is returned."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x) * self.gain / x.sum(-1, keepdim=True)


class Exp(nn.Module):
    """exp of its input: overflows to +inf past ~88.7 in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def expnet(seed: int = 0) -> nn.Sequential:
    """Linear -> Exp -> Linear: a batch with a huge row overflows in Exp (born there, from finite inputs)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 1))


# ---------------------------------------------------------------------------- nested outputs

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    logits: torch.Tensor


class Structured(nn.Module):
    """Returns ``build(h)`` where ``h`` is a Linear's output: any structure around tensors."""

    def __init__(self, build: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.build = build

    def forward(self, x: torch.Tensor) -> Any:
        return self.build(self.lin(x))


# ---------------------------------------------------------------------------- transformers


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def gpt2(seed: int = 0, attn: str = "eager", dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation=attn,
    )
    return GPT2LMHeadModel(cfg)


def bert(seed: int = 0, dropout: float = 0.1) -> nn.Module:
    from transformers import BertConfig, BertModel

    _quiet_transformers()
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        attn_implementation="eager",
    )
    return BertModel(cfg)


# ---------------------------------------------------------------------------- compile-only failures


class SharpAttention(nn.Module):
    """Attention weights from sharp scores (logits near 100): finite in eager, whose softmax
    subtracts the row's max before exp."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) * 30.0
        return torch.softmax(scores, dim=-1)  # SHARP_SOFTMAX_LINE


class SharpScores(nn.Module):
    """SharpAttention -> Linear head."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = SharpAttention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def sharp_scores(seed: int = 0) -> tuple[SharpScores, torch.Tensor]:
    """The model and an input whose scores pass 88 (exp overflows in float32 past ~88.7)."""
    torch.manual_seed(seed)
    return SharpScores(), torch.randn(4, 8) * 3


SHARP_SOFTMAX_LINE = next(
    n for n, line in enumerate(inspect.getsource(SharpAttention.forward).splitlines(),
                               SharpAttention.forward.__code__.co_firstlineno)
    if line.endswith("# SHARP_SOFTMAX_LINE")
)


def compiled(model: nn.Module, how: str, backend: Any = "aot_eager") -> Any:
    """``torch.compile(model, backend=...)`` (the wrapper) when ``how == "torch.compile"``, else
    ``model.compile(backend=...)`` in place; the callable that runs it."""
    if how == "torch.compile":
        return torch.compile(model, backend=backend)
    model.compile(backend=backend)
    return model


def naive_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """A wrong ``aten._softmax`` decomposition: ``exp(x) / sum(exp(x))`` without subtracting the
    max, so sharp scores give inf / inf = NaN where eager is finite."""
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


def naive_softmax_backend(run: str = "python") -> Any:
    """A legitimate ``torch.compile`` backend (AOT autograd; graphs run as generated Python, or
    node by node by ``torch.fx.Interpreter`` with ``run="interpreter"``) with :func:`naive_softmax`."""
    from torch._dynamo.backends.common import aot_autograd

    def run_as_python(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return gm.forward

    def interpret(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return lambda *args: torch.fx.Interpreter(gm).run(*args)

    compiler = interpret if run == "interpreter" else run_as_python
    return aot_autograd(fw_compiler=compiler, decompositions={torch.ops.aten._softmax.default: naive_softmax})


def naive_softmax_inductor() -> Any:
    """Inductor itself (``compile_fx``, its own decompositions and C++ codegen) with
    :func:`naive_softmax` in place of its softmax decomposition."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    return functools.partial(
        compile_fx, decompositions={**select_decomp_table(), torch.ops.aten._softmax.default: naive_softmax})


class ReluLog(nn.Module):
    """``log(relu(h) + 1e-3)``: finite in eager for any ``h``. Under Inductor's testing-only relu
    bug (``cpp.inject_relu_bug_TESTING_ONLY="accuracy"``: ``relu(h)`` becomes ``h + 1``) the log
    gets negative arguments: a NaN only the generated C++ makes."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = torch.log(torch.relu(h) + 1e-3)  # RELU_LOG_LINE
        return self.head(y)


def relu_log(seed: int = 0) -> tuple[ReluLog, torch.Tensor]:
    torch.manual_seed(seed)
    return ReluLog(), torch.randn(4, 8) * 3


RELU_LOG_LINE = next(
    n for n, line in enumerate(inspect.getsource(ReluLog.forward).splitlines(), ReluLog.forward.__code__.co_firstlineno)
    if line.endswith("# RELU_LOG_LINE")
)


class SatTanh(nn.Module):
    """``tanh`` of large pre-activations: saturated (exactly +-1 in float32) and finite, and so is
    its gradient (``1 - y*y`` = 0)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.lin.weight.mul_(30.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))  # SAT_TANH_LINE
        return self.head(y)


def sat_tanh(seed: int = 0) -> tuple[SatTanh, torch.Tensor]:
    torch.manual_seed(seed)
    return SatTanh(), torch.randn(8, 4)


SAT_TANH_LINE = next(
    n for n, line in enumerate(inspect.getsource(SatTanh.forward).splitlines(), SatTanh.forward.__code__.co_firstlineno)
    if line.endswith("# SAT_TANH_LINE")
)


def wrong_tanh_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A wrong ``aten.tanh_backward`` decomposition: ``g * s / s * s`` with ``s = 1 - y*y`` is
    ``g * s`` except where ``tanh`` saturated (``s`` = 0): 0 / 0 = NaN."""
    s = 1 - y * y
    return g * s / s * s


def wrong_tanh_backward_backend() -> Any:
    """A legitimate AOT-autograd backend (graphs run as generated Python) whose backward graph uses
    :func:`wrong_tanh_backward`: a NaN only the compiled backward makes."""
    from torch._dynamo.backends.common import aot_autograd

    def run_as_python(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return gm.forward

    return aot_autograd(fw_compiler=run_as_python, bw_compiler=run_as_python,
                        decompositions={torch.ops.aten.tanh_backward.default: wrong_tanh_backward})


def wrong_tanh_backward_inductor() -> Any:
    """Inductor itself with :func:`wrong_tanh_backward` in its decomposition table."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    return functools.partial(
        compile_fx, decompositions={**select_decomp_table(), torch.ops.aten.tanh_backward.default: wrong_tanh_backward})


# ---------------------------------------------------------------------------- reference runs
#
# Expected values are computed from an *unwatched* copy of the model run on the same data: the
# test never hard-codes an index or a count.

_INT_VIEW = {
    torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
    torch.float64: torch.int64, torch.complex64: torch.int64, torch.complex128: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits: equal bits means bit-identical, NaN payloads included."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
        return t.contiguous().view(_INT_VIEW[t.dtype] if t.dtype in _INT_VIEW else torch.int32)
    if t.dtype in _INT_VIEW:
        return t.contiguous().view(_INT_VIEW[t.dtype])
    return t


def bit_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def expected_element(t: torch.Tensor) -> dict[str, Any]:
    """What a Finding must say about tensor ``t``: first non-finite element in row-major order."""
    t = t.detach()
    bad = ~torch.isfinite(t)
    assert bool(bad.any()), "test set-up: the expected tensor is finite"
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = []
    rest = flat
    for size in reversed(t.shape):
        index.append(rest % size)
        rest //= size
    val = t.reshape(-1)[flat]
    if t.is_complex():
        val = val.real if not bool(torch.isfinite(val.real)) else val.imag
    parts = torch.view_as_real(t) if t.is_complex() else t
    return {
        "index": tuple(reversed(index)),
        "value": float(val),
        "counts": {
            "nan": int(torch.isnan(parts).sum()),
            "+inf": int((parts == float("inf")).sum()),
            "-inf": int((parts == float("-inf")).sum()),
        },
        "shape": tuple(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def same_value(a: float | None, b: float) -> bool:
    return a is not None and ((math.isnan(a) and math.isnan(b)) or a == b)


def assert_finding(f: Any, *, phase: str, module: str, module_type: str, tensor: str, step: int, call: int,
                   cause: str, expected: torch.Tensor) -> None:
    """Every field the contract fixes, against the tensor the reference run produced."""
    e = expected_element(expected)
    got = {
        "phase": f.phase, "module": f.module, "module_type": f.module_type, "tensor": f.tensor,
        "step": f.step, "call": f.call, "cause": f.cause, "index": f.index, "counts": f.counts,
        "shape": f.shape, "dtype": f.dtype,
    }
    want = {
        "phase": phase, "module": module, "module_type": module_type, "tensor": tensor, "step": step,
        "call": call, "cause": cause, "index": e["index"], "counts": e["counts"], "shape": e["shape"],
        "dtype": e["dtype"],
    }
    assert got == want, f"\n got: {got}\nwant: {want}\n{f}"
    assert same_value(f.value, e["value"]), (f.value, e["value"])


class Recorder:
    """Records, on an unwatched model, every named module's outputs and the gradients w.r.t. its
    tensor inputs, per call. ``out(name, call)`` / ``grad_in(name, call, i)`` read them back;
    ``new_step()`` restarts the call counts (the contract counts calls within a step)."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[tuple[int, str, int], Any] = {}
        self.grads: dict[tuple[int, str, int, int], torch.Tensor] = {}
        self.step = 0
        self._counts: dict[str, int] = {}
        self._handles: list[Any] = []
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            call = self._counts.get(name, 0)
            self._counts[name] = call + 1
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    key = (self.step, name, call, i)

                    def keep(g: torch.Tensor, key: tuple[int, str, int, int] = key) -> None:
                        self.grads[key] = g.detach().clone()

                    self._handles.append(a.register_hook(keep))

        return pre

    def _post(self, name: str) -> Any:
        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            call = self._counts[name] - 1
            self.outputs[(self.step, name, call)] = _detach_tree(output)

        return post

    def new_step(self) -> None:
        self.step += 1
        self._counts.clear()

    def out(self, name: str, call: int = 0, step: int | None = None) -> Any:
        return self.outputs[(self.step if step is None else step, name, call)]

    def grad_in(self, name: str, call: int = 0, i: int = 0, step: int | None = None) -> torch.Tensor:
        return self.grads[(self.step if step is None else step, name, call, i)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _detach_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detach_tree(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_detach_tree(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach_tree(v) for v in obj)
    return obj


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, cloned."""
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


def train_with_a_nan_batch(model: nn.Module, opt: torch.optim.Optimizer, shape: tuple[int, ...], *, steps: int = 3,
                           bad: int = 2, after_step: Callable[[], Any] | None = None) -> None:
    """The user's loop with a NaN in batch ``bad`` (a corrupt record): a ``NonFiniteError`` from the
    hunt is caught and training goes on; ``after_step`` runs after each step (a checkpoint)."""
    import nanhunt

    for i in range(steps):
        x = torch.randn(*shape)
        if i == bad:
            x.view(-1)[0] = float("nan")
        try:
            model(x).sum().backward()
            opt.step()
        except nanhunt.NonFiniteError:
            pass
        opt.zero_grad()
        if after_step is not None:
            after_step()


class Lookahead(torch.optim.Optimizer):
    """Lookahead as timm writes it: it runs ``Optimizer.__init__`` (torch runs its own step hooks,
    around the pull-back) over the param_groups of the optimizer it steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer, self.k, self.alpha, self.counter = optimizer, k, alpha, 0
        self.param_groups = optimizer.param_groups
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(closure)
        self.counter += 1
        if self.counter % self.k == 0:
            for p, slow in zip((p for g in self.param_groups for p in g["params"]), self.slow):
                p.lerp_(slow, weight=1.0 - self.alpha)
                slow.copy_(p)
        return loss


def gan_round(D: nn.Module, fake: torch.Tensor, od: torch.optim.Optimizer, og: torch.optim.Optimizer) -> None:
    """One round of a GAN's loop: the discriminator's step on the generator's output (detached),
    then the generator's step through the discriminator."""
    D(fake.detach()).mean().backward()
    od.step()
    od.zero_grad()
    D(fake).mean().backward()
    og.step()
    og.zero_grad()
