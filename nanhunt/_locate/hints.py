"""One or two sentences on the likely mechanism behind a finding."""

from __future__ import annotations

import math

from .._finding import Finding
from .._tensors import dtype_max

__all__ = ["hint", "optimizer_hint"]

_OPS = {
    "log": "log of 0 gives -inf and log of a negative number gives nan",
    "sqrt": "sqrt of a negative number gives nan",
    "rsqrt": "rsqrt of 0 gives inf (a normalisation of a zero vector or a zero variance)",
    "div": "x/0 gives inf and 0/0 gives nan",
    "reciprocal": "1/0 gives inf",
    "exp": "exp overflows past the dtype's largest value",
    "pow": "a power overflows, or a negative base has a fractional exponent",
    "softmax": "a softmax over a row that is entirely -inf (a fully masked row) gives nan",
    "log_softmax": "log_softmax of a fully masked row gives nan; of an underflowed probability, -inf",
    "masked_fill": "the mask fills -inf; harmless unless a whole row is masked or it reaches an output",
    "mm": "a matmul overflows past the dtype's largest value",
    "addmm": "a matmul overflows past the dtype's largest value",
    "bmm": "a batched matmul overflows past the dtype's largest value",
    "matmul": "a matmul overflows past the dtype's largest value",
    "mul": "inf * 0 gives nan, and a product can overflow",
    "sub": "inf - inf gives nan",
    "add": "inf + -inf gives nan, and a sum can overflow",
    "acos": "acos outside [-1, 1] gives nan",
    "asin": "asin outside [-1, 1] gives nan",
    "atanh": "atanh at ±1 gives ±inf",
}

_BACKWARD = {
    "SqrtBackward0": "the gradient of sqrt at 0 is infinite (d/dx sqrt(x) = 1/(2 sqrt(x)))",
    "RsqrtBackward0": "the gradient of rsqrt at 0 is infinite",
    "PowBackward0": "the gradient of x**p with p < 1 is infinite at 0",
    "LogBackward0": "the gradient of log at 0 is infinite",
    "DivBackward0": "the gradient of a division by (nearly) 0 overflows",
    "NormBackward1": "the gradient of a norm at the zero vector is 0/0",
    "LinalgVectorNormBackward0": "the gradient of a norm at the zero vector is 0/0",
    "WhereBackward0": "the untaken branch of torch.where still gets a gradient: inf * 0 = nan there",
    "AcosBackward0": "the gradient of acos at ±1 is infinite",
    "AsinBackward0": "the gradient of asin at ±1 is infinite",
}



def _op_key(op: str) -> str:
    base = op.split(".")[1] if op.startswith("aten.") else op
    return base.rstrip("_")


def hint(f: Finding) -> str:
    if f.cause == "parameter":
        return ("A weight or buffer of this module was already non-finite: an earlier optimizer step "
                "poisoned it (look for a finding in phase 'optimizer'; lower the learning rate or clip gradients).")
    if f.reproducible is False:
        return ("Replaying the step from the same inputs, weights and RNG state gave finite values: this "
                "suggests nondeterminism, a race or a hardware fault rather than a bug in the model.")
    if f.cause == "input" and f.phase == "forward":
        return "Its input was already non-finite: it was made before the model (check the data) or outside any module."
    if f.cause == "input" and f.phase == "grad":
        return "The non-finite values earlier in this step flowed into the gradient."
    if f.op:
        if f.phase == "backward":
            why = _BACKWARD.get(f.op)
            if why:
                return why[0].upper() + why[1:] + "."
        else:
            why = _OPS.get(_op_key(f.op))
            if why:
                mx = dtype_max(f.dtype)
                extra = f" ({f.dtype}'s largest finite value is {mx:g})" if mx and "overflow" in why else ""
                return why[0].upper() + why[1:] + extra + "."
    mx = dtype_max(f.dtype) if f.dtype else None
    if f.value is not None and math.isinf(f.value) and f.dtype in ("float16", "bfloat16") and mx:
        return f"Overflow past {f.dtype}'s largest finite value ({mx:g}); compute this in float32 or scale it down."
    if f.phase == "grad":
        return ("The gradient became non-finite while being accumulated (several backward passes summed "
                "past the dtype's max) or from inf * 0 in a weight gradient.")
    if f.value is not None and math.isnan(f.value):
        return ("NaN from finite inputs: typically 0/0, inf - inf or inf * 0 — e.g. a softmax over a fully "
                "masked row, a normalisation of a zero vector, or log/sqrt of a negative number.")
    if f.value is not None and math.isinf(f.value):
        big = dtype_max(f.dtype)
        why = f" ({f.dtype}'s largest finite value is {big:g})" if big else ""
        return f"Inf from finite inputs: an overflow past the dtype's max{why}, x/0 or log(0)."
    return ""


def optimizer_hint(param: str, state: str, fed: bool) -> str:
    what = f"the optimizer state {state!r} of {param!r}" if state else f"the parameter {param!r}"
    if fed:
        return (f"After the optimizer step, {what} is non-finite: the step was applied with non-finite "
                "gradients (on_find was not 'raise').")
    return (f"After the optimizer step, {what} is non-finite although the step was given finite "
            "gradients: an update that overflowed (an exploding learning rate, or a denominator like "
            "sqrt(exp_avg_sq) + eps at 0).")
