"""One or two sentences on the likely mechanism behind a finding, chosen from the numbers.

`facts` reads what the op trace saw (the creating op's inputs, recomputed in float64; the rows of
a softmax's input; the count a mean divided by) and `hint` picks the sentence from those facts
first, from the op's name only when the numbers say nothing more.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .._finding import Finding
from .._tensors import dtype_max

__all__ = ["hint", "mask_write", "optimizer_hint", "at_start_hint", "carried_hint", "given_hint", "buffer_hint", "written_hint", "unheld_hint", "unwatched_hint", "facts", "DOUBLE_WHERE"]

DOUBLE_WHERE = ("the torch.where trap: the branch that is not taken still gets a zero gradient, and "
                "0 * inf = nan in {op}. Use the double-where fix: make the unsafe input safe first, "
                "torch.where(cond, f(torch.where(cond, x, safe_x)), other)")

# the where trap told by the node that made the nan: why its gradient is not finite in the branch the
# where dropped, and the double where for that op (x the unsafe input, 1. a value safe for it)
_TRAPPED = {
    "SqrtBackward0": ("the gradient of sqrt, 1/(2 sqrt(x)), is infinite at x = 0 (and nan below 0, where sqrt "
                      "itself is nan)", "torch.where(x > 0, torch.sqrt(torch.where(x > 0, x, 1.)), 0.)"),
    "RsqrtBackward0": ("the gradient of rsqrt, -1/(2 x^1.5), is infinite at x = 0 (and nan below 0)",
                       "torch.where(x > 0, torch.rsqrt(torch.where(x > 0, x, 1.)), 0.)"),
    "LogBackward0": ("the gradient of log, 1/x, is infinite at x = 0",
                     "torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.)), 0.)"),
    "Log2Backward0": ("the gradient of log2, 1/(x ln 2), is infinite at x = 0",
                      "torch.where(x > 0, torch.log2(torch.where(x > 0, x, 1.)), 0.)"),
    "Log10Backward0": ("the gradient of log10, 1/(x ln 10), is infinite at x = 0",
                       "torch.where(x > 0, torch.log10(torch.where(x > 0, x, 1.)), 0.)"),
    "Log1pBackward0": ("the gradient of log1p, 1/(1 + x), is infinite at x = -1",
                       "torch.where(x > -1, torch.log1p(torch.where(x > -1, x, 0.)), 0.)"),
    "PowBackward0": ("the gradient of x ** p, p * x ** (p - 1), is infinite at x = 0 for p < 1",
                     "torch.where(x > 0, torch.where(x > 0, x, 1.) ** p, 0.)"),
    "ReciprocalBackward0": ("the gradient of 1/x, -1/x^2, is infinite at x = 0",
                            "torch.where(x != 0, 1 / torch.where(x != 0, x, 1.), 0.)"),
    "DivBackward0": ("the gradient of a / b, -a/b^2 in b, is infinite at b = 0",
                     "torch.where(b != 0, a / torch.where(b != 0, b, 1.), 0.)"),
    "AcosBackward0": ("the gradient of acos, -1/sqrt(1 - x^2), is infinite at x = ±1 (and nan beyond)",
                      "torch.where(x.abs() < 1, torch.acos(torch.where(x.abs() < 1, x, 0.)), 0.)"),
    "AsinBackward0": ("the gradient of asin, 1/sqrt(1 - x^2), is infinite at x = ±1 (and nan beyond)",
                      "torch.where(x.abs() < 1, torch.asin(torch.where(x.abs() < 1, x, 0.)), 0.)"),
    "MulBackward0": ("a product's gradient is the other factor's value, which is infinite in the branch not "
                     "taken (e.g. p * log(p) at p = 0: log(0) = -inf)",
                     "for p * log(p), torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.)), 0.)"),
}


def where_trap_hint(op: str | None) -> str:
    """The where trap's hint, with the mechanism and the double where of node ``op`` where known."""
    known = _TRAPPED.get(op or "")
    if known is None:
        return DOUBLE_WHERE.format(op=op or "this op")[0].upper() + DOUBLE_WHERE.format(op=op or "this op")[1:] + "."
    why, fix = known
    return (f"The torch.where trap: {why}, and where() does not stop it: the branch that is not taken still gets "
            f"a zero gradient, and 0 * inf = nan in {op}. Use the double-where fix, a safe input where the branch "
            f"is not taken, so that neither branch's gradient is infinite: {fix}.")

_SINGULAR = ("a singular matrix (torch.linalg.inv_ex and solve_ex return inf/nan with info > 0 where inv and solve "
             "raise): a Gram or covariance matrix X^T X loses rank with fewer rows than columns or a feature that "
             "is all 0 (a dead ReLU), and a ridge term lam * I stops it only while lam > 0; keep lam positive "
             "(F.softplus(raw) + eps), check info, or use torch.linalg.lstsq / pinv")

_SINGULAR_LOGDET = ("The matrix lost rank: a covariance of fewer samples than dimensions or of features that "
                    "collapsed (a batch of identical rows, a dead unit), or a normalising flow's weight with a zero "
                    "row or two equal rows; slogdet does not help (log |det| is -inf there too). Add a ridge term "
                    "eps * I to a covariance, or parametrise the matrix to stay invertible (a Cholesky factor with a "
                    "softplus diagonal; Glow's W = P L (U + diag(exp(s))), whose log |det| is s.sum())")

_DETS = frozenset({"_linalg_det", "linalg_det", "det"})

# ops that return a matrix's singular values or eigenvalues (svdvals and eigvalsh run these)
_SPECTRA = frozenset({"_linalg_svd", "linalg_svd", "linalg_svdvals", "svd", "_linalg_eigh", "linalg_eigh",
                      "linalg_eigvalsh", "linalg_eigvals", "linalg_eig"})

_OPS = {
    "log": "log of 0 gives -inf and log of a negative number gives nan",
    "sqrt": "sqrt of a negative number gives nan",
    "rsqrt": ("rsqrt of 0 gives inf (a normalisation of a zero vector or a zero variance, a GCN's deg.rsqrt() of "
              "a node with no edge: add self-loops or an eps)"),
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
    "_foreach_norm": "a norm of large values overflows: its sum of squares passes the dtype's largest value "
                     "(gradients near 1e19 in float32: clip_grad_norm_ then scales them to 0)",
    "linalg_vector_norm": "a norm of large values overflows: its sum of squares passes the dtype's largest value",
    "sub": "inf - inf gives nan",
    "add": "inf + -inf gives nan, and a sum can overflow",
    "acos": ("acos outside [-1, 1] gives nan: most often a cosine of normalised vectors (an ArcFace or CosFace head's "
             "F.normalize(x) @ F.normalize(W).T) that comes out a rounding past ±1 (1.0000001); clamp it to "
             "[-1 + eps, 1 - eps] (eps = 1e-7 in float32), not to [-1, 1], whose ±1 still has an infinite gradient"),
    "asin": ("asin outside [-1, 1] gives nan: most often a cosine or sine of normalised vectors that comes out a rounding past ±1; "
             "clamp it to [-1 + eps, 1 - eps] (eps = 1e-7 in float32), not to [-1, 1], whose ±1 still has an "
             "infinite gradient"),
    "atanh": "atanh at ±1 gives ±inf",
    "native_layer_norm": "a normalisation with eps=0 over a constant row: its variance is 0, so (x - mean) / sqrt(0) "
                         "is 0/0 = nan (use a positive eps, the default 1e-5); or values so large (near the dtype's "
                         "max) that their mean or variance overflowed",
    "native_group_norm": "a normalisation with eps=0 over a constant group: its variance is 0, so (x - mean) / sqrt(0) "
                         "is 0/0 = nan (use a positive eps, the default 1e-5); or values so large (near the dtype's "
                         "max) that their mean or variance overflowed",
    "_weight_norm_interface": "a weight_norm layer divides each row of its direction v (parametrizations.weight.original1, "
                              "or weight_v) by that row's norm: a row of v that is all 0 (pruned, zero-initialised, "
                              "decayed to 0) is 0/0 = nan. Prune by zeroing the magnitude g (original0 / weight_g), "
                              "not v's row, or re-initialise that row",
    "acosh": "acosh below 1 gives nan (a hyperbolic distance of points pushed past the ball's edge: clamp its argument to >= 1 + eps)",
    "lgamma": "the log-gamma function lgamma is +inf at 0 and at the negative integers (its poles): a Gamma, Beta or negative-binomial "
              "likelihood's shape parameter (concentration, alpha) that reached 0, from a relu or an underflowed "
              "exp; keep it positive (F.softplus(x) + eps) or clamp it (clamp_min(eps))",
    "digamma": "digamma (lgamma's derivative) is non-finite at 0 and at the negative integers (its poles): a Gamma, "
               "Beta or Dirichlet shape parameter that reached 0 or below; keep it positive (F.softplus(x) + eps)",
    "xlogy": "the x * log(y) of xlogy(x, y) is ±inf where y is 0 and x is not: a Beta log_prob at a value of exactly 0 or 1 "
             "((a - 1) * log(value), (b - 1) * log(1 - value)), a Bernoulli or Binomial at a probability of exactly 0 or 1; "
             "clamp the value into (eps, 1 - eps)",
    "linalg_inv_ex": "the inverse of " + _SINGULAR,
    "_linalg_slogdet": "the log-determinant of a singular matrix is -inf. " + _SINGULAR_LOGDET,
    "_linalg_solve_ex": "a linear solve with " + _SINGULAR,
    "softplus": "softplus computes log1p(exp(beta * x)) / beta below its threshold and x above it: exp overflows once "
                "beta * x passes 88.7 (float32), so a threshold above that lets it overflow; keep the threshold at "
                "the default 20",
}

# (torch's norm backward takes the zero vector's gradient as 0 for ord >= 1: what is left is the dtype's range)
_NORM_BACKWARD = ("the gradient of a norm, x * |x| ** (ord - 2) / norm ** (ord - 1), passed the dtype's range from "
                  "finite values: for an ord other than 2, norm ** (ord - 1) underflows to 0 for tiny values or "
                  "overflows for large ones in float16/bfloat16, and a negative ord divides by 0 at a zero entry (at "
                  "the zero vector itself torch gives the gradient 0 for ord >= 1). Compute the norm in float32 "
                  "(torch.linalg.vector_norm(x.float(), ord, dim)) or take ord=2")


def _pow_backward(p: float) -> str:
    """PowBackward0's hint for its exponent ``p``."""
    grad = f"the gradient of x ** {p:g} ({p:g} * x ** {p - 1:g})"
    if 0 < p < 1:
        dist = (": a distance ((a - b) ** 2).sum(-1) ** 0.5 of two equal points is one, and so is every point's "
                "distance to itself, the diagonal of a pairwise-distance matrix. Take (x + eps) ** 0.5, or "
                "torch.linalg.vector_norm(a - b, dim=-1) (torch.cdist(a, b) for all pairs), whose gradient at 0 is 0"
                if p == 0.5 else
                f" (a norm or root written by hand of a value that reached 0). Take (x + eps) ** {p:g}, or clamp x "
                "to >= eps")
        return f"{grad} is infinite at x = 0{dist}"
    if p < 0:
        return (f"{grad} is infinite at x = 0, where x ** {p:g} is too unless code after it dropped that value "
                "(a where, a mask): keep x away from 0 ((x + eps) ** p, x.clamp_min(eps) ** p)")
    return (f"{grad} passed the dtype's largest finite value: x is too large (exploding activations or weights; a "
            "lower learning rate, gradient clipping, normalising what goes in)")


_BACKWARD = {
    "SqrtBackward0": "the gradient of sqrt at 0 is infinite (d/dx sqrt(x) = 1/(2 sqrt(x))): a distance "
                     "sqrt(((a - b) ** 2).sum(-1)) of two equal points is one, and so is every point's distance to "
                     "itself, the diagonal of a pairwise-distance matrix. Take sqrt(x + eps), or "
                     "torch.linalg.vector_norm(a - b, dim=-1) (torch.cdist(a, b) for all pairs), whose gradient at 0 is 0",
    "RsqrtBackward0": "the gradient of rsqrt at 0 is infinite (-1/(2 x^1.5)): a variance or squared norm that "
                      "reached 0; take rsqrt(x + eps)",
    "PowBackward0": "the gradient of x**p (p * x**(p-1)) is infinite at 0 when p < 1 (take (x + eps) ** p), "
                    "and overflows for a large x when p > 1",
    "LogBackward0": "the gradient of log at 0 is infinite (1/x): its input reached 0 (a probability that "
                    "underflowed, a ReLU output), also where the forward's -inf looked harmless (a softmax "
                    "or exp made it 0). Keep it positive (clamp_min(eps), x + eps) or compute it in log space "
                    "(F.log_softmax, F.logsigmoid)",
    "DivBackward0": "the gradient of a division by (nearly) 0 overflows (-x/d^2 in d, 1/d in x): guard the "
                    "denominator (+ eps or clamp_min(eps); clamp(min=1) for a count)",
    "NormBackward1": _NORM_BACKWARD,
    "LinalgVectorNormBackward0": _NORM_BACKWARD,
    "WhereBackward0": "the untaken branch of torch.where still gets a gradient: inf * 0 = nan there",
    "AcosBackward0": "the gradient of acos at ±1 is infinite (-1/sqrt(1 - x^2)): a clamp to [-1, 1] lets ±1 "
                     "through; clamp to [-1 + eps, 1 - eps] (eps = 1e-7 in float32)",
    "AsinBackward0": "the gradient of asin at ±1 is infinite (1/sqrt(1 - x^2)): a clamp to [-1, 1] lets ±1 "
                     "through; clamp to [-1 + eps, 1 - eps] (eps = 1e-7 in float32)",
    "AcoshBackward0": "the gradient of acosh at 1 is infinite (1/sqrt(x^2 - 1)): clamp its argument to >= 1 + eps",
    "LinalgEighBackward0": "the gradient of eigenvectors divides by the gaps between eigenvalues (1/(l_i - l_j)): "
                           "it is infinite where two are equal (a degenerate spectrum: a batch of identical rows, "
                           "a matrix of rank below its size), and inf * 0 = nan. Let the loss use the eigenvalues "
                           "only (torch.linalg.eigvalsh), perturb the matrix so they differ (a small random jitter on "
                           "the diagonal: + eps * I shifts them all alike), or avoid the eigenvectors (a Newton-Schulz iteration "
                           "for an inverse square root, Cholesky for whitening)",
    "LinalgSvdBackward0": "the gradient of singular vectors divides by the gaps between squared singular values "
                          "(1/(s_i^2 - s_j^2)): it is infinite where two are equal (a rank-deficient matrix has "
                          "several 0s), and inf * 0 = nan. Let the loss use the singular values only "
                          "(torch.linalg.svdvals), or perturb the matrix so they differ (a small random jitter)",
    "XlogyBackward0": "the gradient of xlogy(x, y) in y is x / y: 0/0 = nan where both are 0 (an entropy "
                      "xlogy(p, p) at a probability of exactly 0, a saturated softmax), inf where y alone is. "
                      "Compute it from the logits, (p * F.log_softmax(logits, -1)).sum(-1), or take "
                      "xlogy(p, p.clamp_min(1e-30))",
}

_F32_MAX = float(torch.finfo(torch.float32).max)

# backward nodes of layers whose gradient is a product with the weights (grad_output @ W) or the
# inputs (x^T @ grad_output): an inf they make from finite values in float32 is the values' size
_PRODUCTS = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "MvBackward0", "AddbmmBackward0",
                       "BaddbmmBackward0", "ConvolutionBackward0", "LinearBackward0", "EmbeddingBackward0"})

_RECURRENT = frozenset({"RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell"})  # (a gradient multiplied at every time step)
# a recurrent layer's whole backward in one kernel: an overflow inside it comes out as nan (inf - inf, inf * 0)
_FUSED_RNN = ("MkldnnRnnLayerBackward", "CudnnRnnBackward", "MiopenRnnBackward", "ThnnFused")


def _op_key(op: str) -> str:
    base = op.split(".")[1] if op.startswith("aten.") else op
    return base.rstrip("_")


# ops that write a value the code chose into a tensor: a -inf there is a mask
_MASK_WRITERS = frozenset({"fill", "masked_fill", "index_put", "index_fill", "full", "full_like", "copy",
                           "scatter", "masked_scatter", "where"})

# ops whose values underflow to exactly 0 (and saturate to 1): a one-hot they made is a probability, not a mask
_SATURATING = frozenset({"_softmax", "softmax", "_safe_softmax", "sigmoid", "exp"})
# ops that add values into rows by index: a count or degree made this way is 0 for a row nothing went into
_SCATTERS = frozenset({"index_add", "scatter_add", "scatter_reduce", "index_reduce"})
# ops that read entries of a table by index (a noise schedule's alpha_bar[t], an embedding)
_LOOKUPS = frozenset({"index", "gather", "index_select", "take", "embedding"})

# fused attention ops (nn.MultiheadAttention's fast path, SDPA): a softmax inside, over their mask
_ATTENTION = frozenset({"_native_multi_head_attention", "_masked_softmax", "scaled_dot_product_attention",
                        "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu",
                        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                        "_transformer_encoder_layer_fwd"})

# the FFT kernels torch.stft and torch.fft.* run: a log of what they made is a log spectrogram
_FFTS = ("_fft_r2c", "_fft_c2c")

# ops that fold many rows into fewer values (a scalar loss, a per-sample mean): the rows hint
_REDUCTIONS = frozenset({
    "sum", "mean", "prod", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "logsumexp", "std",
    "var", "std_mean", "var_mean", "nansum", "nanmean", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "cross_entropy_loss", "_ctc_loss", "ctc_loss", "dot",
    "soft_margin_loss", "margin_ranking_loss", "cosine_embedding_loss",
})


def facts(rec: Any, path: list[int]) -> dict[str, Any]:
    """Numbers behind an op trace (`oplevel._Recorder` records, ``path`` from the creator to the
    reported tensor): what the hint is chosen from. Never raises."""
    out: dict[str, Any] = {}
    try:
        first = rec.recs[path[0]]
        out.update(_creator_facts(first, rec.graded))
        if out.get("scalar"):  # (the 0-dim operand an exp made: a logit scale exp'd in float32, applied in float16)
            made = next((rec.recs[i.prod[0]] for i in first.ins if i.shape == () and i.prod is not None), None)
            if made is not None and _op_key(made.op).split(".")[0] == "exp":
                out["exp_scalar"] = True
        x = next((i for i in first.ins if i.pos == 0), None) if out.get("log_mask") else None
        if x is not None and x.prod is not None and _op_key(rec.recs[x.prod[0]].op).split(".")[0] in _SATURATING:
            del out["log_mask"]  # a softmax saturated to one-hot in a no_grad metric: log of a probability at 0
            out["log_zero"] = True
        num = next((i for i in first.ins if i.pos == 0), None) if out.get("zero_over_zero") else None
        made = rec.recs[num.prod[0]] if num is not None and num.prod is not None else None
        if made is not None and _op_key(made.op).startswith("nll_loss"):
            out["count_zero"] = True  # a loss summed over no target (every one ignored), divided by their count
        elif made is not None and _op_key(made.op) == "sum":
            # a masked sum (transformers' LabelSmoother: the ignored positions filled with 0, summed), divided
            # by the count of the unmasked ones (num_items_in_batch, a float under the Trainer): none
            summed = next((i for i in made.ins if i.pos == 0), None)
            if summed is not None and summed.prod is not None and _op_key(rec.recs[summed.prod[0]].op) == "masked_fill":
                out["count_zero"] = True
        pos = 0 if _op_key(first.op) == "reciprocal" else 1  # (1 / x is reciprocal(x))
        if out.get("div_zero"):  # the op that made the denominator, through views (x / s[:, None])
            den_op, _ = _maker(rec, next((i for i in first.ins if i.pos == pos), None))
            if den_op is not None:
                out["den_op"] = den_op
        if out.get("log_zero"):  # the op that made log's 0, through abs and views (log(abs(det(W))))
            log_of, arg = _maker(rec, next((i for i in first.ins if i.pos == 0), None), through=("abs",))
            if log_of is not None:
                out["log_of"] = log_of
            if log_of in ("sub", "rsub") and _made_by(rec, arg, "tanh"):
                out["log_tanh"] = True  # log(1 - tanh(u) ** 2) with tanh(u) rounded to ±1: a squashed policy's correction
            elif log_of in _FFTS or (log_of is not None and log_of not in _SATURATING
                                     and any(_made_by(rec, arg, fft, depth=6) for fft in _FFTS)):
                out["log_spec"] = True  # a log-magnitude or log-mel of an STFT (torch.stft, torch.fft.rfft) at 0: silence
        if "negative" in out:  # the op that made sqrt's negative input: a table's entry (a schedule's alpha_bar[t])
            neg_of, _ = _maker(rec, next((i for i in first.ins if i.pos == 0), None))
            if neg_of is not None:
                out["neg_of"] = neg_of
        if _op_key(first.op).split(".")[0] == "exp":  # the op that made exp's argument: a difference is a ratio's log
            exp_of, arg = _maker(rec, next((i for i in first.ins if i.pos == 0), None))
            if exp_of is not None:
                out["exp_of"] = exp_of.split(".")[0]
                made = rec.recs[arg.prod[0]]  # (a Python number is no recorded input: one input left)
                sim, _ = _maker(rec, next((i for i in made.ins if i.shape), None))
                if (out["exp_of"] in ("div", "mul") and sim in ("mm", "bmm")  # (z1 @ z2.T: no Linear's addmm, a VAE's logvar)
                        and (len(made.ins) == 1 or any(i.shape == () for i in made.ins))):
                    out["exp_scaled"] = True  # exp(sim / T): a similarity at a temperature (InfoNCE by hand)
        for ri in path:
            r = rec.recs[ri]
            name = r.op.split(".")[1] if r.op.startswith("aten.") else r.op
            if name in ("_softmax", "_log_softmax", "softmax", "log_softmax") and r.ins and r.ins[0].code is not None:
                code = r.ins[0].code
                if code.dim() and bool((code == 3).all(-1).any()):
                    out["masked_row"] = True
            elif "ctc_loss" in name and getattr(r, "call", None) is not None and len(r.call[1]) >= 4:
                ctc = _ctc_rows(r.call[1], r.outs[0][1] if r.outs else None)
                if ctc is not None:
                    out["ctc"] = ctc
            elif name == "logsumexp" and r.ins and r.ins[0].code is not None:
                code = r.ins[0].code  # (a row all -inf sums nothing: -inf)
                if code.dim() and bool((code == 3).all(-1).any()):
                    out["masked_row"] = "logsumexp"
            elif (name == "sub" and (mask_write(first.op) or out.get("log_mask") or getattr(rec, "mask_fed", False))
                  and len(r.ins) == 2
                  and r.ins[0].code is not None and r.ins[0].code.dim()
                  and r.ins[1].code is not None and bool((r.ins[0].code == 3).all(-1).any())
                  and bool((r.ins[1].code == 3).any())):  # x - logsumexp(x) or x - x.amax(): -inf - -inf
                out["masked_row"] = "sub"
            elif name == "sub" and mask_write(first.op) and _segment_max_sub(rec, r):
                out["masked_row"] = "segment"
            elif name in _ATTENTION and any(i.code is not None and i.code.dim() and bool((i.code == 3).all(-1).any())
                                            for i in r.ins):  # (its mask: a row all -inf)
                out["masked_row"] = True
                out["masked_fused"] = name
                pad = next((i for i in r.ins if i.pos > 0 and i.code is not None and i.code.dim() == 2
                            and r.ins[0].shape and i.shape[0] == r.ins[0].shape[0]
                            and bool((i.code == 3).all(-1).any())), None)
                if pad is not None:  # a (batch, keys) padding mask: the sequences padded at every position
                    out["masked_seqs"] = pad.code.eq(3).all(-1).nonzero().flatten().tolist()
        if getattr(rec, "mask_fed", False):
            out["mask_fed"] = True
        if _op_key(first.op).split(".")[0] == "exp":
            div = next((r for r in (rec.recs[ri] for ri in path[1:]) if _op_key(r.op).split(".")[0] == "div"
                        and len(r.ins) == 2 and r.ins[1].code is not None and bool(r.ins[1].code.ne(0).any())), None)
            if div is not None:  # exp(x) / exp(x).sum(): a softmax by hand, inf / inf
                den, made = _maker(rec, div.ins[1])
                out["exp_ratio"] = True
                if den == "add" and any(_maker(rec, i)[0] == "exp" for i in rec.recs[made.prod[0]].ins):
                    out["exp_ratio"] = "sigmoid"  # exp(x) / (1 + exp(x)): a sigmoid (or its derivative) by hand
        code0 = first.outs[0][1] if first.outs else None
        if (len(path) > 1 and (mask_write(first.op) or out.get("log_mask")) and code0 is not None
                and bool((code0[code0 != 0] == 3).all())):
            out["mask_written"] = True  # the code wrote a -inf mask (logits[..., pad:] = -inf) that later arithmetic spoiled
        if code0 is not None and code0.dim():  # the creator's rows holding its non-finite values: the samples
            # that made it when they are the batch's (a later BatchNorm or mean mixes every row in)
            out["born_rows"] = (int(code0.shape[0]), code0.reshape(code0.shape[0], -1).ne(0).any(1).nonzero().flatten().tolist())
        for ri in reversed(path[1:]):  # the last reduction on the road: which rows fed it
            last = rec.recs[ri]
            if _op_key(last.op).split(".")[0] not in _REDUCTIONS:
                continue  # a view or a selection keeps (or picks) values: no row was summed away
            oshape = last.outs[0][0] if last.outs else ()
            inp = next((i for i in last.ins if i.code is not None and len(i.shape) > len(oshape) and i.shape), None)
            if inp is not None and oshape and oshape[0] == inp.shape[0]:
                break  # it reduced within each row (sum(-1)): every row kept its own value, none was summed away
            if inp is not None and inp.code is not None:
                flat = inp.code.reshape(inp.shape[0], -1)
                bad = flat.ne(0).any(1)
                worse = (flat.eq(1) | flat.eq(2)).any(1)  # (a row whose only non-finite values are -inf holds a mask:
                if bool(worse.any()):  # a contrastive loss's masked diagonal, beside the one row masked entirely)
                    bad = worse
                rows = bad.nonzero().flatten().tolist()
                if rows:
                    out.update(reduction=last.op, rows=rows[:8], nrows=inp.shape[0], nbad=len(rows))
                break
    except Exception:
        pass
    return out


# losses whose second argument is the target: (prediction, target, ...)
_TARGET_LOSSES = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
                            "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss"})


def _huge_operand(name: str, args: Any, limit: float, out: dict[str, Any]) -> None:
    """An op overflowed from finite operands: is one of them itself huge, past the square root of
    the dtype's largest value, while the others are not (by 1e4 at least)? A loss's target (a label
    of 1e20), an input that is no weight beside weights that are moderate (a saturated sensor's 3e38):
    the data, not the training, made the overflow. Puts ``huge=(what, value, index, the others' largest)``
    into ``out``."""
    ts = [(k, a) for k, a in enumerate(args[:3]) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()]
    if len(ts) < 2:
        return
    mags = [float(a.detach().abs().amax()) for _, a in ts]
    j = max(range(len(ts)), key=mags.__getitem__)
    big, rest = mags[j], max(m for i, m in enumerate(mags) if i != j)
    pos, t = ts[j]
    if not (math.isfinite(big) and big * big > limit and big > 1e4 * rest) or _weight(t):
        return
    if name in _TARGET_LOSSES and pos == 1:
        what = "target"
    elif any(_weight(a) for _, a in ts):
        what = "input"  # (x against the op's weight and bias: a convolution's, a Linear's addmm)
    else:
        return
    at = int(t.detach().abs().argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(at), t.shape)) if t.dim() else ()
    out["huge"] = (what, float(t.detach().reshape(-1)[at]), idx, rest)


def _huge_sentence(fx: dict[str, Any]) -> str:
    """What `_huge_operand` found, and what to do about it."""
    what, big, idx, rest = fx["huge"]
    at = f" at [{', '.join(map(str, idx))}]" if idx else ""
    others = "the prediction reaches" if what == "target" else "the weights reach"
    return (f"its {what} holds {big:.3g}{at}, while {others} only {rest:.3g}: "
            + ("a label out of range (a corrupt record, a sentinel such as 1e20 for a missing value, targets not "
               "normalised), not the training; check, filter or normalise the targets (a lower learning rate or "
               "clipping would not help)" if what == "target" else
               "a value fed in that large (a corrupt record, a sensor's saturation or fill value, inputs not "
               "normalised), not weights that grew; check, filter or normalise the inputs (a lower learning rate "
               "or clipping would not help)"))


_ACCUMULATING = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "convolution", "linear"})


def _weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a Linear's ``weight.t()`` in its addmm)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter)


def _segment_max_sub(rec: Any, r: Any) -> bool:
    """Is ``r`` (a sub) ``e - m[dst]`` with ``m`` a scatter's max per row (a scatter softmax over each
    node's edges, a GAT's) and both -inf at one place: every edge into that node was masked?"""
    if len(r.ins) != 2 or r.ins[0].code is None or r.ins[1].code is None:
        return False
    read, inp = _maker(rec, r.ins[1])
    if read not in _LOOKUPS or inp is None or inp.prod is None:
        return False
    made, _ = _maker(rec, next((i for i in rec.recs[inp.prod[0]].ins if i.pos == 0), None))
    a, b = torch.broadcast_tensors(r.ins[0].code, r.ins[1].code)
    return made in _SCATTERS and bool(((a == 3) & (b == 3)).any())


def _maker(rec: Any, inp: Any, through: tuple[str, ...] = ()) -> tuple[str | None, Any]:
    """The op that made ``inp`` (an input of a record), walked back through views and ``through`` ops
    (their first input) for at most 4 records, and the input that op made; (None, ...) when none."""
    for _ in range(4):
        if inp is None or inp.prod is None:
            break
        made = rec.recs[inp.prod[0]]
        key = _op_key(made.op)
        if not made.moves and key not in through:
            return key, inp
        inp = next((i for i in made.ins if i.pos == 0), None)
    return None, inp


def _made_by(rec: Any, inp: Any, op: str, depth: int = 4) -> bool:
    """Was ``inp`` computed from an output of ``op`` within ``depth`` records before it?"""
    todo = [inp]
    for _ in range(depth):
        todo = [i for t in todo if t.prod is not None for i in rec.recs[t.prod[0]].ins]
        if any(t.prod is not None and _op_key(rec.recs[t.prod[0]].op).split(".")[0] == op for t in todo):
            return True
    return False


def _ctc_rows(args: Any, code: Any) -> dict[str, list[tuple[int, int, int, int]]] | None:
    """The rows of a CTC loss with no alignment: (row, input length, target length, frames needed: the
    labels plus one blank between each pair of equal neighbours), and the rows inf all the same
    (``blocked``: every alignment passes a -inf log-probability, a masked class)."""
    lp, targets, in_lens, tg_lens = args[:4]
    if not isinstance(lp, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return None
    in_l = [int(v) for v in (in_lens.tolist() if isinstance(in_lens, torch.Tensor) else in_lens)]
    tg_l = [int(v) for v in (tg_lens.tolist() if isinstance(tg_lens, torch.Tensor) else tg_lens)]
    if len(in_l) != len(tg_l):
        return None
    short, blocked = [], []
    offset = 0
    for row, (n_in, n_tg) in enumerate(zip(in_l, tg_l)):
        if targets.dim() == 2:
            seq = targets[row, :n_tg]
        else:  # (1-D: the targets of every row, concatenated)
            seq, offset = targets[offset:offset + n_tg], offset + n_tg
        need = n_tg + int((seq[1:] == seq[:-1]).sum()) if n_tg > 1 else n_tg
        if need > n_in:
            short.append((row, n_in, n_tg, need))
        elif code is not None and code.dim() == 1 and row < code.shape[0] and int(code[row]) != 0:
            blocked.append((row, n_in, n_tg, need))
    return {"short": short, "blocked": blocked} if short or blocked else None


# batch norm's kernels: (input, weight, bias, running_mean, running_var, training, momentum, eps)
_BATCH_NORMS = ("native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm")


def _creator_facts(r: Any, graded: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    name = r.op.split(".")[1] if r.op.startswith("aten.") else r.op
    shapes = [i.shape for i in r.ins]
    if name in ("mean", "nanmean") and any(0 in s for s in shapes):
        out["empty_mean"] = True
        if shapes and len(shapes[0]) >= 4 and 0 not in shapes[0][:2]:  # (N, C, H, W) with no H or no W: a global pool
            out["empty_map"] = tuple(shapes[0])
    if name.startswith(("std", "var")) and r.ins and r.outs:
        n_in = math.prod(r.ins[0].shape) if r.ins[0].shape else 1
        n_out = math.prod(r.outs[0][0]) if r.outs[0][0] else 1
        if n_out and n_in // max(n_out, 1) <= 1:
            out["one_element"] = True
        call = getattr(r, "call", None)  # (var(correction=c) divides by max(0, n - c): 0 once c >= n)
        c = call[2].get("correction") if call is not None else None
        if isinstance(c, (int, float)) and n_out and 1 < n_in // n_out <= c:
            out["correction"] = (n_in // n_out, c)
    if "ctc_loss" in name:
        out["ctc"] = True
    call = getattr(r, "call", None)
    if call is None:
        return out
    func, args, kwargs = call
    if "ctc_loss" in name and len(args) >= 4:
        ctc = _ctc_rows(args, r.outs[0][1] if r.outs else None)
        if ctc is not None:
            out["ctc"] = ctc
    # (batch norm: in training mode, over the batch per channel; its running statistics are never summed)
    batch = name in _BATCH_NORMS and len(args) >= 6 and args[5] is True and getattr(args[0], "ndim", 0) >= 2
    if batch or (name in ("native_layer_norm", "native_group_norm") and len(args) >= (2 if name == "native_layer_norm" else 7)
                 and isinstance(args[0], torch.Tensor)):
        x = args[0]  # values whose squares, summed over a row, pass the largest value it is computed in
        n = (x.numel() // max(x.shape[1], 1) if batch else math.prod(args[1]) if name == "native_layer_norm"
             else x.numel() // max(args[3] * args[6], 1))
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        big = float(x.detach().abs().amax()) if x.numel() else 0.0
        if math.isfinite(big) and big * big * max(n, 1) > float(torch.finfo(acc).max):
            out["norm_big"] = big
            if batch:
                out["norm_batch"] = True
            return out
    if name.startswith(("scaled_dot_product", "_scaled_dot_product")) and len(args) >= 2:
        q, k = args[0], args[1]  # scores q @ k^T past the largest value: the softmax inside makes inf - inf
        if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.is_floating_point() and q.dim() >= 2
                and k.dim() == q.dim() and q.shape[-1] == k.shape[-1] and q.numel() // q.shape[-1] * k.shape[-2] <= 1 << 24):
            with torch.no_grad():  # (unscaled: a kernel may scale the product only after it)
                big = float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) if q.numel() else 0.0
            limit = float(torch.finfo(q.dtype).max)
            if math.isfinite(big) and big > limit:
                out.update(scores_big=big, limit=limit, dtype=str(q.dtype).removeprefix("torch."))
                return out
    if name.startswith("nll_loss") and len(args) >= 5 and isinstance(args[1], torch.Tensor):
        kept, w = args[1] != args[4], args[2]
        if not bool(kept.any()):
            out["all_ignored"] = True
        elif isinstance(w, torch.Tensor) and args[3] == 1 and float(w[args[1][kept]].sum()) == 0:
            out["zero_weight"] = True  # every kept target of a class weighted 0: the weighted mean is 0/0
    if name in ("div", "div_") and len(args) >= 2:
        d = args[1]
        if (isinstance(d, torch.Tensor) and d.numel() and bool((d == 0).any())) or (not isinstance(d, torch.Tensor) and d == 0):
            out["div_zero"] = True
            if isinstance(d, torch.Tensor) and d.dtype is torch.float16:
                out["div_float16"] = True  # an eps of 1e-12 is 0 there
            if isinstance(d, torch.nn.Parameter):
                out["den_param"] = True  # a learned scale that reached 0 (a fake-quant's round(x / s) * s)
            code = r.outs[0][1] if r.outs else None
            if isinstance(args[0], torch.Tensor) and code is not None and bool(code.any()):
                n, dd = torch.broadcast_tensors(args[0], d if isinstance(d, torch.Tensor) else torch.tensor(d))
                flat = int(code.reshape(-1).nonzero()[0, 0])  # (the first non-finite element: 0/0 there?)
                if n.numel() == code.numel() and n.reshape(-1)[flat].item() == 0 == dd.reshape(-1)[flat].item():
                    out["zero_over_zero"] = True
                    if isinstance(d, torch.Tensor) and not (d.is_floating_point() or d.is_complex()):
                        out["count_zero"] = True  # an integer denominator: a count (of targets, of positives)
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and r.outs and r.outs[0][1] is not None:
        src, code = args[0], r.outs[0][1]  # a cast down past the new dtype's range (autocast's copy of a weight, .half())
        to = kwargs.get("dtype")
        nz = code.reshape(-1).nonzero()
        if isinstance(to, torch.dtype) and to.is_floating_point and nz.numel() and src.numel() == code.numel():
            v = float(src.reshape(-1)[int(nz[0, 0])])
            limit = float(torch.finfo(to).max)
            if math.isfinite(v) and abs(v) > limit:
                out.update(reached=v, limit=limit, dtype=str(to).removeprefix("torch."), cast=True)
                # (a mask's fill value: the source dtype's lowest, torch.finfo(torch.float32).min, or a
                # tensor of 0s and that one value, (1 - mask) * -1e9, made before the cast to the scores' dtype)
                if v < 0 and src.is_floating_point() and v == -float(torch.finfo(src.dtype).max):
                    out["cast_mask"] = f"torch.finfo({src.dtype}).min"
                elif v < 0 and bool(((src == 0) | (src == v)).all()):
                    out["cast_mask"] = f"{v:g}"
                return out
    code = r.outs[0][1] if r.outs else None
    if code is None:
        return out
    nz = code.reshape(-1).nonzero()
    if not nz.numel():
        return out
    flat = int(nz[0, 0])
    if name in ("exp", "exp_") and args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
        out["exp_scalar"] = True  # exp of one number: a learned temperature or logit scale (CLIP's logit_scale.exp())
        out["exp_param"] = isinstance(args[0], torch.nn.Parameter)  # (else a value: perplexity = exp(loss))
    if r.pointwise and len(args) >= 2:  # a 0-dim operand of a wider dtype is cast to the other's: 65758.9 * x in float16
        wide = [t for t in args[:2] if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
        narrow = [t.dtype for t in args[:2] if isinstance(t, torch.Tensor) and t.dim() and t.is_floating_point()]
        if wide and narrow and torch.finfo(wide[0].dtype).max > torch.finfo(narrow[0]).max:
            v, limit = float(wide[0]), float(torch.finfo(narrow[0]).max)
            if math.isfinite(v) and abs(v) > limit:
                out.update(reached=v, limit=limit, dtype=str(narrow[0]).removeprefix("torch."), cast=True, scalar=True)
                return out
        # a Python number is the tensor's dtype in the op: one past its range is inf (a mu-law's (1 + mu) ** |y|)
        num = next((a for a in args[:2] if type(a) is float and math.isfinite(a)), None)
        if num is not None and narrow and abs(num) > float(torch.finfo(narrow[0]).max):
            out.update(reached=num, limit=float(torch.finfo(narrow[0]).max), dtype=str(narrow[0]).removeprefix("torch."),
                       cast=True, scalar="number")
            return out
    if (name in ("log", "log_") and args and isinstance(args[0], torch.Tensor) and args[0].numel() == code.numel()
            and args[0].reshape(-1)[flat].item() == 0):  # (complex too: log(0j) = -inf)
        x = args[0]  # a constant of 0s and 1s: a mask made additive (logits + mask.log()), not a value that reached 0
        # (a mask keeps some position: all 0s is a rate a dead ReLU made, whose requires_grad a no_grad replay drops)
        mask = not (x.requires_grad or id(x) in graded) and bool(((x == 0) | (x == 1)).all()) and bool((x == 1).any())
        out["log_mask" if mask else "log_zero"] = True
    if (name in ("log", "log_") and args and isinstance(args[0], torch.Tensor) and args[0].numel() == code.numel()
            and not args[0].is_complex() and float(args[0].reshape(-1)[flat]) < 0):
        out["log_negative"] = float(args[0].reshape(-1)[flat])
    if (name in ("reciprocal", "reciprocal_") and args and isinstance(args[0], torch.Tensor)
            and args[0].numel() == code.numel() and args[0].reshape(-1)[flat].item() == 0):
        out["div_zero"] = True
    if (name in ("pow", "pow_") and len(args) >= 2 and isinstance(args[0], torch.Tensor) and not args[0].is_complex()
            and args[0].numel() == code.numel()):
        e = args[1]  # (0 to a negative power: 1/0, a GCN's deg.pow(-0.5) of an isolated node)
        e = float(e.reshape(-1)[flat if e.numel() > 1 else 0]) if isinstance(e, torch.Tensor) and e.numel() in (1, code.numel()) else e
        base = float(args[0].reshape(-1)[flat])
        if isinstance(e, (int, float)) and e < 0 and base == 0:
            out["pow_zero"] = float(e)
        elif isinstance(e, (int, float)) and math.isfinite(e) and e != int(e) and base < 0:
            out["pow_negative"] = (base, float(e))  # (x ** 0.5, x ** 1.5 of a value just below 0: not real)
    if (name in ("sqrt", "sqrt_", "rsqrt", "rsqrt_") and args and isinstance(args[0], torch.Tensor)
            and not args[0].is_complex() and args[0].numel() == code.numel() and float(args[0].reshape(-1)[flat]) < 0):
        out["negative"] = float(args[0].reshape(-1)[flat])  # (rsqrt's nan is no 0's: its hint speaks of 0 only)
    dtype = next((t.dtype for t in _leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    made = kwargs.get("dtype") if dtype is None else None  # a factory (arange, linspace) makes the dtype it is told
    factory = isinstance(made, torch.dtype) and made.is_floating_point
    dtype = made if factory else dtype
    if dtype is None or dtype == torch.float64 or any(isinstance(t, torch.Tensor) and t.is_complex() for t in _leaves(args)):
        return out  # (a complex op: no float64 reference of its parts here)
    with torch.no_grad():
        up = tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, (args, kwargs))
        if factory:
            up[1]["dtype"] = torch.float64
        ref = func(*up[0], **up[1])
    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
    if isinstance(ref, torch.Tensor) and ref.numel() > flat:
        v = float(ref.reshape(-1)[flat])
        limit = float(torch.finfo(dtype).max)
        if (v == math.inf and name in ("exp", "exp_") and args[0].numel() == code.numel()
                and math.isfinite(x := float(args[0].reshape(-1)[flat]))):  # (exp past float64's range too)
            out.update(reached=v, exp_arg=x, limit=limit, dtype=str(dtype).removeprefix("torch."))
        if math.isfinite(v) and abs(v) <= limit and name in _REDUCTIONS and dtype == torch.float32:
            big = max((float(t.detach().abs().amax()) for t in _leaves(args)  # (a term summed on the way overflowed)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()), default=0.0)
            out.update(inner_overflow=(v, big), limit=limit)
            _huge_operand(name, args, limit, out)  # (a loss's target of 1e20, its square past the limit, its mean not)
        elif math.isfinite(v) and abs(v) <= limit and name in _ACCUMULATING:
            # a matmul's or convolution's partial sum passed the largest value: said only when one
            # operand is the data's and huge (else the op's generic line stays)
            _huge_operand(name, args, limit, out)
            if "huge" in out:
                big = max(float(t.detach().abs().amax()) for t in _leaves(args)
                          if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel())
                out.update(inner_overflow=(v, big), limit=limit)
        if math.isfinite(v) and abs(v) > limit:
            out.update(reached=v, limit=limit, dtype=str(dtype).removeprefix("torch."))
            _huge_operand(name, args, limit, out)
            if name in ("add", "add_") and v < 0 and any(  # a torch.finfo(dtype).min mask added to a negative score
                    isinstance(t, torch.Tensor) and t.dtype == dtype and bool((t == -limit).any()) for t in args[:2]):
                out["min_mask"] = True
    return out


def mask_write(op: str) -> bool:
    """Does ``op`` write a value the code chose (a -inf there is a mask), not compute one?"""
    return _op_key(op) in _MASK_WRITERS


def _leaves(x: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(x)


# the remedy for a division by a learned parameter at 0 (forward or backward)
_PARAM_DEN = ("A learned scale or step size (LSQ's s in round(x / s) * s, a fake-quant's learnable scale, a learned "
              "temperature) trained or decayed to 0 or through it: keep it positive by construction, divide by "
              "s.abs() + eps or s.clamp_min(eps), or learn its log (s = log_s.exp()), and keep weight decay off it.")


def from_facts(f: Finding, fx: dict[str, Any]) -> str:
    """The sentence the numbers support, or "" when they support none."""
    op = f.op or "this op"
    if fx.get("grad_hook") and fx.get("backwards", 0) > 1:  # (several backward passes summed: either may have)
        return (f"The gradient became non-finite while {fx['backwards']} backward passes were summed into it (past "
                f"the dtype's max), or in a gradient hook on this parameter, {fx['grad_hook']}: a hook that divides "
                "by the gradient's norm makes 0/0 of a zero gradient.")
    if fx.get("grad_hook"):
        where = f" (at {f.source})" if f.source else ""
        return (f"A gradient hook on this parameter, {fx['grad_hook']}{where}, ran on its gradient: a hook that "
                "divides by the gradient's norm or scale makes 0/0 of a zero gradient (a batch that does not "
                "reach this weight). Check it first.")
    if fx.get("tensor_hook") and fx.get("registered"):
        by = "the loss code" if f.module == "<outside>" else "this module's forward"
        return (f"Made by the gradient hook {fx['tensor_hook']} that {by} registered on a tensor at {f.source} "
                "(register_hook): the gradient that reached that tensor was finite, the one the hook returned "
                "is not. A hook that divides by the gradient's norm or scale makes 0/0 of a zero gradient.")
    if fx.get("tensor_hook"):
        return (f"Made by the gradient hook {fx['tensor_hook']} on this input (a register_hook at {f.source}): "
                "the gradient this module's backward gave it was finite, the one the hook returned is not.")
    if fx.get("backward_hook"):
        return (f"Made by the backward hook {fx['backward_hook']} on this module (at {f.source}): the gradients "
                "it returned are non-finite where the ones it was given were finite.")
    if fx.get("collective_in"):
        return (f"This call ran the collective {fx['collective_in']}, which a replay on this rank alone cannot "
                "run: the value may have come from another rank (see the other ranks' findings) or from this "
                "call's own code after the collective.")
    if fx.get("overwritten"):
        return ("Its call's inputs were written in place after the call began (a reused input buffer: "
                "buf.copy_(batch); or the model's own write into the state it was given a view of: "
                "self.mem.mul_(...) with model(self.mem)), so no replay could see the values it had: pass the "
                "model a fresh tensor (or buf.clone()) to have the op, line and element.")
    if fx.get("den_param") and f.phase == "backward":
        return ("The gradient of a division by a learned parameter that is 0 here: the forward's x/0 = inf was "
                "hidden from every output by what came after it (a fake-quant's clamp(x / s, qn, qp) in "
                "quantization-aware training), and its backward divides the gradient it gets (0 where clamped) "
                "by 0. " + _PARAM_DEN)
    if fx.get("where_trap"):
        return where_trap_hint(f.op)
    if "negative" in fx and fx.get("neg_of") in _LOOKUPS:
        return (f"{_cap(_op_key(op))} of a negative number, {fx['negative']:.3g}, gives nan: its input was read by "
                f"{fx['neg_of']} from a table that holds a negative value there (alpha_bar[t] of a noise schedule "
                "whose alphas_cumprod went below 0: betas above 1, a cosine schedule's betas not clipped to 0.999, "
                "or its t running past T). Fix the table where it is built (betas.clamp(0, 0.999), alpha_bar "
                "within (0, 1]), not the sqrt.")
    if "negative" in fx:
        return (f"{_cap(_op_key(op))} of a negative number, {fx['negative']:.3g}, gives nan. A variance computed as "
                "E[x^2] - E[x]^2 (a LayerNorm or RMSNorm written by hand) comes out slightly below 0 by cancellation "
                "when the values' mean is large against their spread: compute it as ((x - mean) ** 2).mean(-1) "
                "(x.var(-1, unbiased=False), F.layer_norm) or clamp it (var.clamp_min(0) + eps); any other input: "
                "keep it non-negative (clamp_min(0), F.softplus).")
    if "pow_negative" in fx:
        b, e = fx["pow_negative"]
        return (f"A negative base to a fractional power: {op} raised {b:.3g} to {e:g}, which is nan (no real number): "
                "x ** 0.5 or x ** 1.5 of a value that went below 0 (a difference, a variance by cancellation, an "
                "unconstrained output). Clamp the base first, x.clamp_min(0) ** p (clamp_min(eps) when p < 1: the "
                "gradient of x ** p is infinite at 0), make it positive by construction (F.softplus), or keep the "
                "sign, torch.sign(x) * x.abs() ** p.")
    if "pow_zero" in fx:
        return (f"A negative power of 0: {op} raised 0 to {fx['pow_zero']:g}, which is 1/0 = inf (and inf * 0 = nan in the "
                "arithmetic after it): a degree normalisation deg.pow(-0.5) of a graph node with no edge (an isolated "
                "node in a GCN's D^-1/2 A D^-1/2), or a count or norm that is 0. Add self-loops (deg + 1), zero the "
                "infinities as PyG's gcn_norm does (dinv.masked_fill(dinv == float('inf'), 0)), or clamp the base "
                "(clamp_min(eps)).")
    if "reached" in fx:
        if fx["dtype"] in ("float32", "float64") or abs(fx["reached"]) > _F32_MAX:
            # no wider dtype to move to, or float32 overflows too (bfloat16 has its range): the
            # values are the trouble
            remedy = ("the values themselves are too large: look for exploding weights or inputs (a lower "
                      "learning rate, gradient clipping, normalising the inputs)")
            if "huge" in fx:  # (one operand alone past the square root of the largest value: the data's)
                remedy = _huge_sentence(fx)
            if _op_key(op) == "exp" and fx["reached"] > 0:  # (the exponent, not a value, is what to bound)
                arg = fx.get("exp_arg", math.log(fx["reached"]))
                what = ("clamp what goes into exp (a VAE's logvar.clamp(-30, 20)) or use a stable form (F.softplus, "
                        "torch.logsumexp)")
                if fx.get("exp_of") in ("sub", "rsub"):  # (a ratio of probabilities from their logs)
                    what = ("the exp of a difference of log-probabilities is a probability ratio (PPO's "
                            "exp(logp - old_logp), an importance weight), and a policy that moved far from the one "
                            "that collected the data (a large update, a stale old_logp) overflows it; clamp the "
                            "difference before exp ((logp - old_logp).clamp(max=20)), or take smaller updates per batch")
                if fx.get("exp_scaled"):  # (a bounded similarity times 1/T: no weight grew, the loss's form is wrong)
                    remedy = (f"its input, {arg:.4g}, is past {math.log(fx['limit']):.4g}, where exp passes "
                              f"{fx['dtype']}'s largest value: a similarity divided by a small temperature (or times a "
                              "large scale) before exp, as in an InfoNCE or SimCLR loss written by hand, "
                              "exp(sim / T) / exp(sim / T).sum(1): at T = 0.001 a cosine of 1 is 1000. Compute the loss "
                              "from the logits sim / T with F.cross_entropy(sim / T, targets) or torch.logsumexp, which "
                              "subtract each row's max, never exp(sim / T) itself")
                else:
                    remedy = (f"its input, {arg:.4g}, is past {math.log(fx['limit']):.4g}, where exp passes "
                              f"{fx['dtype']}'s largest value: {what}; or " + remedy)
            if f.module_type in ("RNN", "RNNCell") and f.phase == "forward":  # (its hidden state, times weight_hh at every step)
                remedy = ("the hidden state of this recurrent layer is multiplied by its recurrent weights at every "
                          "time step: with recurrent weights whose largest eigenvalue is past 1 (a large init, "
                          "weights grown in training) and an unbounded nonlinearity (nonlinearity='relu') it grows "
                          "exponentially along the sequence; use tanh (or an LSTM/GRU), initialise weight_hh smaller "
                          "(nn.init.orthogonal_), lower the learning rate or clip the gradients")
        elif f.module == "<outside>":  # (the loop's own code: no module to keep in float32)
            remedy = "compute it in float32 (.float() before it, outside autocast) or scale before it"
        elif fx["dtype"] == "bfloat16":
            remedy = "keep this module in float32 or scale before it"
        else:
            remedy = "keep this module in float32/bfloat16 or scale before it"
        if (_op_key(op) == "exp" and 0 < fx["reached"] <= _F32_MAX and fx["dtype"] in ("float16", "bfloat16")
                and not fx.get("exp_scaled") and fx.get("exp_of") not in ("sub", "rsub")):  # (no input to scale: the exponent is what passed the range)
            arg = fx.get("exp_arg", math.log(fx["reached"]))
            wide = (".float() before it, outside autocast" if f.module == "<outside>"
                    else "x.float().exp(), or this module in float32")
            remedy = (f"its input, {arg:.4g}, is past {math.log(fx['limit']):.4g}, where exp passes {fx['dtype']}'s "
                      f"largest value: compute the exp in float32 ({wide}), or clamp what goes into it below "
                      f"{math.log(fx['limit']):.4g} (a VAE's logvar before logvar.exp())")
        if (_op_key(op) in ("bmm", "mm", "matmul", "baddbmm") and fx["dtype"] != "float32" and abs(fx["reached"]) <= _F32_MAX
                and any("softmax" in c.split(" @ ")[0] for c in f.chain[1:5])):  # (q @ k^T, scaled, masked, softmax)
            remedy = (f"these are attention scores, q @ k^T before a softmax: scale q by head_dim ** -0.5 before "
                      "the matmul (not the scores after it: the matmul itself overflowed), normalise q and k "
                      f"(QK-norm), or compute the scores in float32{'' if fx['dtype'] == 'bfloat16' else '/bfloat16'}")
        if _op_key(op) in ("arange", "linspace") and fx["dtype"] != "float32":  # (positions: rotary, sinusoidal)
            remedy = (f"positions (a rotary or sinusoidal embedding's torch.arange(n, dtype=x.dtype)) past "
                      f"{fx['limit']:g} cannot be held in {fx['dtype']}: make them and their angles in float32 "
                      "(torch.arange(n, dtype=torch.float32)) and cast only the cos and sin to the model's dtype")
        if fx.get("exp_scalar") and fx["reached"] > 0:  # (a temperature the optimizer keeps raising: bound it, as CLIP does)
            remedy = (f"the exponent of a learned temperature or logit scale grew past {math.log(fx['limit']):.4g}: clamp "
                      "it as CLIP does, logit_scale.data.clamp_(0, math.log(100)) after each step (or "
                      "logit_scale.exp().clamp(max=100))")
            if f.module == "<outside>" and not fx.get("exp_param"):  # (metric code: a perplexity of a loss)
                remedy = (f"the exp of one number past {math.log(fx['limit']):.4g} in the loop's code, as a perplexity "
                          "exp(loss) of a large loss (an early or diverged step) is: compute the metric from the "
                          "number (math.exp(min(loss.item(), 20))) or clamp the loss first (loss.detach().clamp(max=20).exp()), and log the loss itself")
        if fx.get("exp_ratio") and fx["reached"] > 0:  # (a division after it made inf / inf: no max subtracted)
            remedy = ("a softmax written by hand, exp(x) / exp(x).sum(-1), makes inf / inf = nan of it: use "
                      "torch.softmax(x, -1) (F.log_softmax for its log), which subtracts each row's max first, "
                      "or subtract it yourself, exp(x - x.amax(-1, keepdim=True))")
        if fx.get("exp_ratio") == "sigmoid" and fx["reached"] > 0:  # (1 + exp(x) in the denominator: no sum)
            remedy = ("a sigmoid written by hand, exp(x) / (1 + exp(x)) (or a hand-written backward's "
                      "e / (1 + e) with e = exp(-x)), makes inf / inf = nan of it: use torch.sigmoid(x) "
                      "(F.logsigmoid for its log), or the form that cannot overflow, 1 / (1 + exp(-x))")
        wide = "" if fx["dtype"] in ("float32", "float64") else " (computed wider in the failing run, then rounded)"
        if fx.get("min_mask"):
            return (f"Overflow: {op} added a mask of {fx['dtype']}'s lowest value ({-fx['limit']:g}, "
                    f"torch.finfo({fx['dtype']}).min) to a negative score: {fx['reached']:.6g} is -inf in "
                    f"{fx['dtype']}, and a row masked at every position is then all -inf, its softmax nan. Apply "
                    "the mask last, with masked_fill(mask, torch.finfo(dtype).min) after every addition (not a "
                    "mask added, nor a bias such as ALiBi's added after the fill), or clamp the sum at "
                    "torch.finfo(dtype).min.")
        if fx.get("scalar") == "number":
            return (f"Overflow in a cast: {op} computes in {fx['dtype']}, so the Python number it was given, "
                    f"{fx['reached']:.6g}, is inf there, past {fx['dtype']}'s largest finite value {fx['limit']:g}: a "
                    "constant too large for the dtype, as a mu-law decode's (1 + mu) ** |y| is with mu = 2 ** 16 - 1 "
                    "in float16 (or a mu of far more bits in float32). Use a constant the dtype can hold, or compute "
                    "this op in a wider dtype (y.float() under autocast; float64 past float32's range).")
        if fx.get("scalar"):
            return (f"Overflow in a cast: {op} computes in {fx['dtype']}, so its 0-dim operand {fx['reached']:.6g} "
                    f"(a wider scalar tensor, which does not promote the other's dtype) became inf, past "
                    f"{fx['dtype']}'s largest finite value {fx['limit']:g}; {remedy}.")
        if fx.get("cast_mask"):
            return (f"Overflow in a cast: a mask value, {fx['cast_mask']}, cast by {op} to {fx['dtype']} is -inf, "
                    f"past {fx['dtype']}'s lowest value {-fx['limit']:g}, and a row masked at every position is "
                    "then all -inf, its softmax nan (-inf * 0 and inf - inf are nan too). Make the mask in the dtype "
                    "it is added to, torch.finfo(scores.dtype).min, or fill the scores with "
                    "scores.masked_fill(mask, torch.finfo(scores.dtype).min).")
        if fx.get("cast"):
            return (f"Overflow in a cast: {fx['reached']:.6g} is past {fx['dtype']}'s largest finite value "
                    f"{fx['limit']:g}, so {op} made it inf (and the arithmetic after it, inf - inf or inf * 0, "
                    f"nan); {remedy}.")
        if math.isinf(fx["reached"]):  # (exp past float64's range too: its value is no number to show)
            return (f"Overflow: {op} made inf from finite inputs, past {fx['dtype']}'s largest finite value "
                    f"{fx['limit']:g} (and float64's); {remedy}.")
        return (f"Overflow: {op} reached {fx['reached']:.6g} from finite inputs{wide}, past {fx['dtype']}'s "
                f"largest finite value {fx['limit']:g}; {remedy}.")
    if "inner_overflow" in fx and f.value is not None and math.isinf(f.value):
        v, big = fx["inner_overflow"]
        head = (f"Overflow inside {op}: its result is {v:.3g} in float64, within float32's range, but a term it "
                f"computes on the way (a squared difference, a partial sum) passes float32's largest finite value "
                f"{fx['limit']:g}")
        if "huge" in fx:
            return f"{head}; {_huge_sentence(fx)}."
        return (f"{head}: its inputs reach {big:.3g}. The values themselves are too large (targets or "
                "rewards on a huge scale, a target network copied from a diverging one, exploding weights): "
                "normalise or clip them, lower the learning rate, or compute it in float64.")
    if "norm_big" in fx:
        how = ("their mean or variance over the batch passes the largest value it is computed in, so "
               f"{op} makes nan of them (inf - inf, inf * 0)" if fx.get("norm_batch") else
               f"their variance passes the largest value it is computed in, so {op} normalises inf/inf = nan")
        return (f"A normalisation of values as large as {fx['norm_big']:.3g}: {how} (its eps is not the cause). The values "
                "themselves are too large: look for exploding weights or activations (a lower learning rate, "
                "gradient clipping).")
    if "scores_big" in fx:
        return (f"Attention scores too large: q @ k^T reaches {fx['scores_big']:.3g}, past {fx['dtype']}'s "
                f"largest finite value {fx['limit']:g}, so the softmax inside {op} takes inf - inf = nan (no mask "
                "is the cause). The queries and keys themselves are too large: look for exploding activations or "
                "weights (a lower learning rate, gradient clipping, a LayerNorm before the attention).")
    if isinstance(fx.get("ctc"), dict):  # (a CTC loss on the road: its rows say why it is inf)
        return _ctc_hint(fx)
    if fx.get("masked_row") == "logsumexp":
        return ("A logsumexp over a fully masked row: every position of that row is -inf, so there is nothing to sum "
                "and its logsumexp is -inf (an anchor with no positive in a contrastive loss, a sequence with no valid "
                "position); a loss that takes it is inf. Leave at least one position unmasked, or drop such rows from "
                "the loss (torch.where(has_any, lse, 0.), then a mean over the rows kept).")
    if fx.get("masked_row") == "segment":
        return ("A softmax over each node's edges (a scatter softmax, a GAT's attention: exp(e - max[dst]) with the "
                "max by scatter_reduce 'amax') at a node whose every incoming edge is masked with -inf: that node's "
                "max is -inf, so e - max[dst] is -inf - (-inf) = nan. Drop the masked edges (edge_index[:, keep]) "
                "instead of masking their scores, or mask with torch.finfo(dtype).min instead of -inf.")
    if fx.get("masked_row") == "sub":
        return ("A fully masked row normalised by a subtraction: every position of that row is -inf, so x - "
                "logsumexp(x) (Categorical(logits=...)'s normalisation, a log_softmax by hand) or x - x.amax() is "
                "-inf - (-inf) = nan. Leave at least one position unmasked (a state with no legal action: give it "
                "one, or drop it), or mask with torch.finfo(dtype).min instead of -inf.")
    if fx.get("masked_row") and not fx.get("div_zero") and (fx.get("masked_fused") or f.module_type in _TORCH_ATTENTION):
        return _torch_attention_masked_hint(f, fx)
    if fx.get("masked_row") and not fx.get("div_zero"):  # (a row a division by 0 made all -inf is no mask's)
        return ("A softmax over a fully masked row: every position of that row is -inf, so it normalises 0/0 "
                "= nan; leave at least one position unmasked, or make the row finite before the softmax "
                "(torch.where(row_masked, 0., scores)): a nan zeroed after it is still nan in its backward.")
    if fx.get("mask_written") and f.value is not None and not math.isfinite(f.value):
        return (f"A -inf mask written by {op} reached arithmetic that made {f.value} of it (-inf * 0: p * log p at a "
                "masked position, whose probability is 0; inf - inf; a sum or mean over masked positions, as "
                "label smoothing takes over every class; a target with probability on a masked position, in "
                "F.kl_div or a soft-label cross entropy: mask the target too, to 0). Mask with a "
                "large finite value (torch.finfo(dtype).min) instead of -inf, or keep masked positions out of the "
                "computation (torch.special.xlogy(p, p) for p * log p).")
    if fx.get("mask_fed"):
        return (f"A -inf fed in from before (a mask) reached arithmetic: {op} made {f.value} of it (a sum or "
                "mean over masked positions, label smoothing, -inf * 0, inf - inf). Mask with a large finite "
                "value (torch.finfo(dtype).min) instead of -inf, or keep masked positions out of the computation.")
    if fx.get("zero_weight"):
        return ("A weighted mean over zero weight: every target of the batch not ignored is of a class whose weight "
                "(the loss's weight=) is 0, so the mean divides by a total weight of 0, 0/0 = nan; give every class "
                "a weight > 0, or use reduction='sum' and divide by max(total weight, eps).")
    if fx.get("empty_map"):
        return (f"A mean over zero elements: a feature map of spatial size 0 (shape {fx['empty_map']}) averaged "
                "(a global pool, a squeeze-and-excitation block), 0/0 = nan: the images are too small for the "
                "network's downsampling (its strided convs, pools and crops shrank them to nothing). Feed larger "
                "images (resize or pad them to at least the network's total stride) or use fewer downsampling stages.")
    if fx.get("all_ignored") or fx.get("empty_mean"):
        what = "every target is ignored (ignore_index)" if fx.get("all_ignored") else "the selection is empty"
        return (f"A mean over zero elements: {what}, so the mean is 0/0 = nan; skip such batches, or "
                "divide by max(count, 1).")
    if fx.get("correction"):
        n, c = fx["correction"]
        return (f"std/var with correction={c:g} over {n} elements: it divides by max(0, n - correction) = 0, so it is "
                "x/0 = inf (0/0 = nan for a constant row); use a correction below the count (correction=0 for the "
                "population variance, the default 1 needs two elements).")
    if fx.get("one_element"):
        return ("std/var of one element: with the unbiased correction the count is n - 1 = 0, so it is 0/0 = nan; "
                "use correction=0 or skip batches of one.")
    if fx.get("log_zero") and fx.get("log_of") in _DETS:
        return (f"Log of a determinant of exactly 0: {op} took log |det| of a singular matrix, -inf. " + _SINGULAR_LOGDET + ".")
    if fx.get("log_zero") and fx.get("log_tanh"):
        return (f"Log of exactly 0 at a saturated tanh: {op} took log(1 - tanh(u) ** 2) (a tanh-squashed policy's "
                "log-probability correction, as in SAC), and tanh(u) rounds to ±1 once |u| passes about 9 in "
                "float32, so 1 - tanh(u) ** 2 is 0 and its log -inf. Use the stable form "
                "2 * (math.log(2) - u - F.softplus(-2 * u)) (or TransformedDistribution with TanhTransform), or "
                "add an eps inside the log.")
    if fx.get("log_zero") and fx.get("log_of") == "exp":
        return (f"Log of exactly 0 after an exp that underflowed: {op}'s input is exp(x) of an x so negative (below "
                "about -104 in float32) that it is 0 (a log_std or log-variance head that fell that far, exp'd into a "
                "Normal's scale: Normal(loc, scale).log_prob takes log(scale)). Clamp the exponent before exp "
                "(log_std.clamp(-20, 2), as SAC does), or use it directly where its log is needed (log(exp(x)) = x).")
    if fx.get("log_zero") and fx.get("log_spec"):
        return (f"Log of exactly 0 in a spectrogram: {op}'s input is a magnitude, power or mel energy of an STFT "
                "that is exactly 0 there (a silent clip, digital silence, or zero padding to the batch's length), "
                "and log(0) = -inf. Put a floor inside the log: log(mel + 1e-6) or log(mel.clamp_min(1e-10)) (as "
                "torchaudio's AmplitudeToDB clamps at amin=1e-10).")
    if fx.get("log_zero") and fx.get("log_scalar"):
        return (f"Log of exactly 0 of a single number computed outside the model: {op}'s input, a scalar "
                "coefficient of the loop (mixup's or cutmix's lam = np.random.beta(a, a) is exactly 0 or 1 for a "
                "small a, more often once cast to float32: log(lam) or log(1 - lam) is -inf) or a count that is 0, "
                "is 0. Clip it (lam = min(max(lam, eps), 1 - eps); a count: clamp(min=1)) or leave out the term it "
                "weighs when it is 0.")
    if fx.get("log_zero") and fx.get("log_of") in ("rand", "rand_like", "uniform"):
        return (f"Log of exactly 0 of a uniform random draw: {op}'s input comes from torch.rand, whose [0, 1) "
                "holds 0 (about one draw in 2 ** 24 in float32, one in 256 in bfloat16), and log(0) = -inf: "
                "Gumbel noise -log(-log(u)) (a Gumbel-softmax or Gumbel-max sampler written by hand) or an "
                "exponential draw -log(u) is then infinite. Keep u off 0, "
                "u = torch.rand(...).clamp_min(torch.finfo(u.dtype).tiny), draw it in float32, or use "
                "F.gumbel_softmax.")
    if fx.get("log_zero") and fx.get("log_data"):
        return (f"Log of exactly 0 in a value computed from the data alone, not from the model's outputs: {op}'s "
                "input is 0 there (a box regression target log(w_gt / w_anchor) of a ground-truth box of width or "
                "height 0, a log of a count of 0). Drop such boxes or clamp_min(eps) the value where the targets "
                "are encoded.")
    if fx.get("log_zero"):
        return (f"Log of exactly 0: {op}'s input reached 0 there, and log(0) = -inf (a probability a softmax or "
                "sigmoid underflowed to, a ReLU output, or a distribution's scale from relu or an underflowed "
                "softplus: Normal(loc, scale).log_prob takes log(scale)). Keep it positive (clamp_min(eps); "
                "F.softplus(x) + eps for a scale) or compute it in log space (F.log_softmax, F.logsigmoid; a binary "
                "cross-entropy y * log(p) + (1 - y) * log(1 - p) of a sigmoid's output: drop the sigmoid and take "
                "F.binary_cross_entropy_with_logits of the logits).")
    if "log_negative" in fx:
        return (f"Log of a negative number, {fx['log_negative']:.3g}, gives nan: {op}'s input went below 0 (a box's "
                "width or height, a scale or a ratio predicted without a constraint, a difference that crossed 0). "
                "Make it positive by construction (predict its log, or exp / F.softplus(x) + eps of the raw output) "
                "or clamp it (clamp_min(eps)) before the log.")
    if fx.get("ctc"):
        return _ctc_hint(fx)
    if fx.get("div_zero"):
        if fx.get("div_float16"):
            return ("A division by 0 in float16: x/0 gives inf and 0/0 nan. An eps that guards the denominator "
                    "rounds to 0 in float16 when it is below 3e-08 (F.normalize's 1e-12, a 1e-8): guard it with an "
                    "eps float16 can hold (1e-4), or compute the normalisation in float32.")
        if fx.get("den_param"):
            return ("A division by 0, a learned parameter that reached 0: x/0 gives inf and 0/0 gives nan. "
                    + _PARAM_DEN)
        if fx.get("den_op") in ("std", "var", "std_mean", "var_mean"):
            return ("A division by a standard deviation of 0: (x - x.mean()) / x.std() over values that are all equal "
                    "is 0/0 = nan (an RL batch's advantages or returns that are constant, a constant feature or "
                    "channel); add an eps to the denominator, (x - x.mean()) / (x.std() + 1e-8), or skip the "
                    "normalisation for such a batch.")
        if fx.get("den_op") in ("log", "log1p"):
            return ("A division by a log of 1: the denominator is log(1) = 0 there (log1p(0)), as PNA's attenuation "
                    "scaler avg_log / log(deg + 1) is at a graph node with no edge (deg 0), or a log of a count or "
                    "length that is 1; keep what goes into the log above 1 (log(deg.clamp(min=1) + 1), as PyG's "
                    "PNAConv does) or add an eps to the denominator.")
        if fx.get("den_op") == "sqrt":
            return ("A division by a square root of 0: the denominator is sqrt(0) there (a noise schedule's "
                    "sqrt(1 - alpha_bar) at alpha_bar = 1, its first step t = 0, or 1 / sqrt(alpha) where a "
                    "zero-terminal-SNR schedule's alpha is 0; a GCN's 1 / sqrt(deg) of a node with no edge; a std "
                    "or norm of constant values); keep what goes into the sqrt away from 0 (clamp_min(eps), t from 1, "
                    "betas clipped below 1, self-loops) or add an eps after it.")
        if fx.get("den_op") in _SPECTRA:
            return ("A division by a singular value or eigenvalue of 0: the matrix is rank-deficient (a weight with a "
                    "zero row or two equal rows, a covariance of fewer samples than dimensions), so a condition "
                    "number s_max / s_min or a 1 / s is x/0. Add an eps to the denominator (s_min + eps) or a ridge "
                    "term eps * I to the matrix, or penalise s_max alone (torch.linalg.matrix_norm(W, ord=2)).")
        if fx.get("zero_over_zero") and fx.get("den_op") in _SCATTERS:
            return (f"A division by a count of 0 made by a scatter ({fx['den_op']}): a mean aggregation over a graph "
                    "node with no incoming edge, or a segment or group that received nothing, divides its sum over "
                    "nothing by a count of 0 (0/0 = nan). Divide by count.clamp(min=1), or aggregate with "
                    "scatter_reduce(..., reduce='mean', include_self=False), which leaves such rows as they were.")
        if fx.get("count_zero"):
            return ("A division by a count of 0: a sum over nothing divided by the number of its elements is 0/0 = "
                    "nan (a loss summed over its targets and divided by their count, as transformers' "
                    "num_items_in_batch is, when every label of the batch is ignored (-100); positives counted "
                    "where there are none); skip such batches, or divide by count.clamp(min=1).")
        if fx.get("zero_over_zero") and fx.get("den_op") in ("dot", "vdot"):
            return ("A division by a dot product of 0: 0/0 gives nan here. spectral_norm divides the weight by "
                    "sigma = u . (W v), which is 0 when the weight is all 0 (a zero-initialised layer, as a "
                    "diffusion model's zero_module or a residual branch's last layer, or one pruned or decayed to "
                    "0): leave zero-initialised layers out of spectral_norm or initialise them nonzero; a projection "
                    "(a . b) / (b . b) onto a zero vector: add an eps to the denominator.")
        if fx.get("den_op") in ("dot", "vdot"):  # (x/0: a nonzero weight over a sigma of 0)
            return ("A division by a dot product of 0: x/0 gives inf here. spectral_norm divides the weight by "
                    "sigma = u . (W v), which is 0 for a nonzero weight once its power iteration's u and v are 0: "
                    "F.normalize of W v (and of W^T u) whose norm overflowed float32 (weights past about 1e19) "
                    "gives 0: the weights under spectral_norm are huge, no eps is missing.")
        if not fx.get("zero_over_zero") and fx.get("den_op") in ("linalg_vector_norm", "norm", "frobenius_norm"):
            return ("A division by a norm of 0: the denominator is the norm of an all-zero tensor (a spectral "
                    "convergence loss ||S - S_hat|| / ||S|| of a silent target clip, a relative error "
                    "||x - y|| / ||y|| where y is all 0); add an eps to the norm (/ (||S|| + eps)) or skip such "
                    "targets.")
        if fx.get("zero_over_zero"):
            return ("A division by 0: 0/0 gives nan here, a zero divided by a zero, as a zero vector divided by its "
                    "norm is (F.normalize or F.cosine_similarity with eps=0, x / x.norm(): an all-zero row, an "
                    "all-padding sequence's pooled embedding), an IoU of zero-area boxes (intersection / union = 0/0), "
                    "a Dice score of an empty mask and an empty prediction (2 * intersection / (sum(p) + sum(t)) = 0/0: "
                    "add a smoothing term to both, (2 * inter + 1) / (sum(p) + sum(t) + 1)) or a sum over nothing by a "
                    "count of 0; keep a positive eps (F.normalize's default 1e-12, or clamp_min(eps) on the "
                    "denominator) or skip such rows.")
        return ("A division by 0: x/0 gives inf and 0/0 gives nan (e.g. dividing by a count "
                "that is 0, or by a learned temperature or scale that reached 0); "
                "guard the denominator: clamp(min=1) for a count, + eps or clamp_min(eps) for anything else.")
    return ""


# torch's own attention modules: their scores are out of the user's reach (no where() before the softmax)
_TORCH_ATTENTION = frozenset({"MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
                              "TransformerEncoder", "TransformerDecoder", "Transformer"})


def _torch_attention_masked_hint(f: Finding, fx: dict[str, Any]) -> str:
    """A fully masked row inside nn.MultiheadAttention / nn.Transformer*: the masks the user passed did it."""
    seqs = fx.get("masked_seqs") or []
    which = (f"sequence{'s' if len(seqs) > 1 else ''} {', '.join(map(str, seqs[:8]))}{' …' if len(seqs) > 8 else ''} "
             f"of the batch {'are' if len(seqs) > 1 else 'is'} padding at every position (its key padding mask all "
             "True), so its queries have no key to attend to" if seqs else
             "every key a query may attend to is masked (an empty, all-padding sequence, or a causal attn_mask "
             "over left padding, which leaves a padded position no key)")
    fused = fx.get("masked_fused") in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")
    tail = ("torch's fast path (eval mode, gradients off) gives nan here, where the training path "
            "(scaled_dot_product_attention) gives such rows zeros." if fused else
            "nn.MultiheadAttention with need_weights=False (scaled_dot_product_attention) gives such rows zeros "
            "instead of nan." if f.module_type == "MultiheadAttention" and not fx.get("masked_fused") else
            "a nan zeroed after the attention is still nan in its backward.")
    return (f"A softmax over a fully masked row inside torch's attention ({f.module_type}): {which}; the softmax "
            "normalises 0/0 = nan. Drop empty sequences "
            "from the batch (or pad on the right under a causal mask), or leave one key unmasked in such rows "
            f"(mask[row, 0] = False) and ignore their outputs; {tail}")


def _ctc_hint(fx: dict[str, Any]) -> str:
    """A CTC loss's inf: the rows with no alignment (too few frames), or one whose every alignment is blocked."""
    ctc = fx["ctc"] if isinstance(fx["ctc"], dict) else {}
    short = ctc.get("short") or []
    if short:
        rows = "; ".join(f"row {r}: {n_in} frames for {n_tg} labels"
                         f"{f', needing {need} with the blanks between repeated labels' if need > n_tg else ''}"
                         for r, n_in, n_tg, need in short[:4]) + (" …" if len(short) > 4 else "")
        return (f"CTC loss is inf when a target is too long for its input: no alignment exists ({rows}); a "
                "target needs a frame per label plus one blank between each pair of equal neighbours. Pass "
                "zero_infinity=True to F.ctc_loss / nn.CTCLoss (those samples then give 0 loss and 0 gradient), "
                "drop them, or give the model more frames (less downsampling before the CTC head).")
    if ctc.get("blocked"):
        r = ctc["blocked"][0]
        return (f"CTC loss is inf at row {r[0]} although its {r[1]} frames are enough for its {r[2]} labels: "
                "every alignment passes a log-probability of -inf (a class masked with -inf that its target uses, "
                "or a probability that underflowed to 0 before a log). Mask with a large finite value "
                "(torch.finfo(dtype).min), take F.log_softmax of the logits, or keep masked classes out of the "
                "targets.")
    return ("CTC loss is inf when a target is too long for its input (no alignment exists); pass "
            "zero_infinity=True to F.ctc_loss / nn.CTCLoss, or drop those samples.")


def rows_sentence(fx: dict[str, Any]) -> str:
    """A reduction made the reported tensor: which rows of its input were non-finite."""
    rows = fx.get("rows")
    if not rows:
        return ""
    n = fx.get("nbad", len(rows))
    which = f"row {rows[0]}" if n == 1 else f"rows {', '.join(map(str, rows))}{'…' if n > len(rows) else ''}"
    what = (f" ({'that sample' if n == 1 else 'those samples'})"  # (rows of the batch, not of a weight)
            if fx.get("batch") is not None and fx.get("batch") == fx.get("nrows") else "")
    return (f" The reported value is a reduction ({fx.get('reduction')}) over {fx.get('nrows')} rows: "
            f"its input was non-finite at {which}{what}.")


def hint(f: Finding, fx: dict[str, Any] | None = None) -> str:
    fx = fx or {}
    base = _hint(f, fx)
    return base + rows_sentence(fx) if base or fx.get("rows") else base


def _hint(f: Finding, fx: dict[str, Any]) -> str:
    if (f.phase == "backward" and f.op in ("SoftmaxBackward0", "LogSoftmaxBackward0") and f.value is not None
            and math.isnan(f.value)):
        # (a where trap or a saved non-finite value, told as what it is here: the gradient y * (g - sum(g * y))
        # is finite for a finite g unless the saved y is nan)
        return ("The softmax's forward was already nan here (a fully masked row, every position -inf, or a +inf "
                "score) and code "
                "after it replaced the nan (torch.where, nan_to_num, masked_fill), so the forward looked finite; "
                f"{f.op} multiplies by that saved nan. Make the row finite before the softmax "
                "(torch.where(row_masked, 0., scores)) or leave a position unmasked, instead of fixing its output.")
    if f.phase == "backward" and f.cause == "input" and fx.get("saved_bad") and fx.get("fed_bad"):
        return ("The model was given a non-finite input (the data: a corrupt sample, a bad value in a file, "
                "a transform's 0/0) that a saturating op, tanh, sigmoid, an LSTM's gates, hid from every "
                "output: the backward multiplies its 0 gradient by that inf, which makes the NaN. Check or "
                "filter the data (torch.isfinite on each batch) rather than this backward.")
    if f.phase == "backward" and f.cause == "input" and fx.get("saved_bad"):
        return ("The forward already held a non-finite value here (an overflow, exp or pow past the dtype's "
                "largest value, that a saturating op after it, tanh, sigmoid, an LSTM's gates, hid from "
                "every output): the backward multiplies its 0 gradient by that inf, which makes the NaN. "
                "Find the forward op that overflowed (clamp its input, or use a stable form: softplus, "
                "logsumexp) rather than this backward.")
    if f.cause in ("created", "unknown") or f.phase == "backward":
        got = from_facts(f, fx)
        if got:
            return got
    if f.cause == "parameter":
        return ("A weight or buffer of this module was already non-finite: an earlier optimizer step "
                "poisoned it (look for a finding in phase 'optimizer'; lower the learning rate or clip gradients).")
    if f.reproducible is False and fx.get("drew"):
        return (f"The forward draws from {fx['drew']} stream (a LayerDrop, stochastic depth or a "
                "random layer order decided with random.random() or random.shuffle), which nanhunt does not "
                "record: the replay drew other numbers, ran another path and could not reproduce the value. Draw "
                "such decisions from torch (torch.rand(()) < p, torch.randperm(n)), whose RNG the replay restores, "
                "to have the op, line and element.")
    if f.reproducible is False:
        return ("Replaying the step from the same inputs, weights and RNG state gave finite values: this "
                "suggests nondeterminism, a race or a hardware fault rather than a bug in the model.")
    if f.cause == "input" and f.phase == "forward" and fx.get("collective"):
        return (f"Finite when this call returned on this rank: the collective {fx['collective']} after it wrote "
                "it in place with another rank's values. The value was born on another rank: see that rank's "
                "finding (Finding.rank).")
    if f.cause == "input" and f.phase == "forward":
        if fx.get("top_input"):
            who, args = fx["top_input"]
            who = f"`{who}`" if who else "The model"
            eg = ("a log of 0: a log-mel or log-magnitude spectrogram of a silent clip or of zero padding (take "
                  "log(mel + 1e-6) or log(mel.clamp_min(1e-10)))" if "holding -inf" in args
                  else "a normalisation by a std of 0 or a mask built as 0 * -inf")
            return (f"{who} was given a non-finite input ({args}): it was made before the model, by the data or "
                    "by the loop's own code before the call (which nanhunt records only from the model's return "
                    f"to step()), e.g. {eg}. Check it with torch.isfinite where it is made.")
        if f.module == "<outside>":
            return "Its input was already non-finite: it came from the data or from code nanhunt did not see."
        if f.module:
            return ("Its input was already non-finite: it was made before the model (check the data), by the code "
                    "that called it (the enclosing module's own forward, between its children's calls) or outside any module.")
        return "Its input was already non-finite: it was made before the model (check the data) or outside any module."
    if f.cause == "input" and f.phase == "grad":
        return "The non-finite values earlier in this step flowed into the gradient."
    if f.op:
        if f.phase == "backward" and not f.op.startswith("aten."):
            if (f.op in _PRODUCTS and f.dtype in ("float32", "float64") and f.value is not None
                    and math.isinf(f.value)):
                return (f"The gradient {f.op} makes (a product with this layer's weights or inputs) passed "
                        f"{f.dtype}'s largest finite value {dtype_max(f.dtype):g} from finite values: the weights, "
                        "inputs or the gradient reaching it are huge. Weights that grew step after step point to "
                        "a learning rate (or lr * weight_decay) too large; lower it, or clip the gradients.")
            if (f.module_type in _RECURRENT and f.dtype in ("float32", "float64") and f.value is not None
                    and (math.isinf(f.value) or f.op.startswith(_FUSED_RNN))):
                fused = "" if math.isinf(f.value) else " (inside its fused kernel, where inf - inf or inf * 0 made nan)"
                return (f"The gradient through this recurrent layer passed {f.dtype}'s largest finite value "
                        f"{dtype_max(f.dtype):g} from finite values{fused}: exploding gradients, multiplied again at "
                        "every time step (long sequences, recurrent weights grown large). Clip them "
                        "(torch.nn.utils.clip_grad_norm_ before step()), lower the learning rate or shorten "
                        "the sequences backpropagated through (truncated BPTT).")
            why = _BACKWARD.get(f.op)
            if f.op == "PowBackward0" and isinstance(fx.get("pow_exp"), float) and math.isfinite(fx["pow_exp"]):
                why = _pow_backward(fx["pow_exp"])
            if why:
                return why[0].upper() + why[1:] + "."
        else:  # in backward, an aten op: the one a custom Function's backward made the value in
            why = _OPS.get(_op_key(f.op))
            if why:
                mx = dtype_max(f.dtype)
                extra = (f" ({f.dtype}'s largest finite value is {mx:g})"  # (an inf: a NaN is no overflow's)
                         if mx and "overflow" in why and f.value is not None and math.isinf(f.value) else "")
                return why[0].upper() + why[1:] + extra + "."
    mx = dtype_max(f.dtype) if f.dtype else None
    if f.value is not None and math.isinf(f.value) and f.dtype in ("float16", "bfloat16") and mx:
        return f"Overflow past {f.dtype}'s largest finite value ({mx:g}); compute this in float32 or scale it down."
    if f.phase == "grad":
        if fx.get("second_order"):  # (a gradient penalty: its backward runs through the graph autograd.grad made)
            return ("The gradient became non-finite in a second-order backward, though every module's gradients were "
                    "finite: torch.autograd.grad(create_graph=True) (a gradient penalty) made a graph of the model's "
                    "derivatives, and backward() through it takes second derivatives, infinite where the first is "
                    "finite (x.abs() ** p with 1 < p < 2 at 0) or 0/0 (a norm of a zero vector inside the model, "
                    "x.norm() or torch.linalg.vector_norm of an all-zero row: its first derivative is 0 there, its "
                    "second is not defined): inf * 0 in a weight gradient. "
                    "torch.autograd.detect_anomaly() names that op; make it smooth there (add an eps: "
                    "(x.pow(2).sum(-1) + eps).sqrt() for a norm).")
        if fx.get("backwards") == 1:  # (one backward() in the step: nothing was summed)
            return ("The gradient became non-finite in the step's one backward, though every module's "
                    "gradients were finite: inf * 0 in a weight gradient, a gradient written after backward, or a "
                    "loss term that takes this weight itself (a regulariser: a weight's condition number, "
                    "spectral or orthogonality penalty) computed before the model's call, where nanhunt records "
                    "nothing: compute such terms after the forward, or hunt.check them.")
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


HUGE_WEIGHT = 1e4  # no weight of a sane model is this large: the values were made huge by the model


def outside_param_hint(name: str) -> str:
    """A ``.grad`` made non-finite of a parameter that the watched optimizer holds and the watched
    model does not (``name``: its place in the optimizer, ``param_groups[0][0]``)."""
    return (f"{name!r} is not a parameter of the watched model (only the optimizer holds it): its gradient was "
            "made where nanhunt records nothing, in a module outside the watched model (another model the same "
            "optimizer trains, an encoder called before it) or in code before the model's call. Watch a module "
            "that holds both (or run the script under `nanhunt run`) to have the op and its line.")


def grown_hint(grown: tuple[str, float, str, tuple[int, float] | None] | None, updates: int | None = 1) -> str:
    """The sentence added to a forward finding born from finite values when the model's weights are
    huge: `analyze._grown`'s (name, magnitude, "SGD lr=2", (step, lr) of a far larger lr earlier).
    ``updates``: the watched optimizers' step() calls so far (None: no optimizer watched); none: the
    weights were that large already."""
    if grown is None:
        return ""
    name, big, lr, peak = grown
    if updates == 0:
        return (f" The model's weights are huge ({name!r} reaches {big:.3g}) before any update of the watch: they "
                "were loaded, initialised or trained this large before it, not grown by its steps; check the "
                "checkpoint (trained in another dtype?) or the initialisation.")
    if updates is None:
        return (f" The model's weights are huge ({name!r} reaches {big:.3g}); no optimizer is watched, so whether "
                "training grew them (a learning rate too large: lower it, or clip the gradients) or they were "
                "loaded this large (check the checkpoint) is not known.")
    if peak is not None:
        return (f" The model's weights are huge ({name!r} reaches {big:.3g}, with {lr} now), and step {peak[0]}'s "
                f"step() ran with lr={peak[1]:g}, far above it: an lr that large blows the weights up in a few "
                "updates (a warm-up or schedule that starts at, or jumps to, a huge value: check what it computes "
                "at that step); fix the schedule, or clip the gradients (torch.nn.utils.clip_grad_norm_ before step()).")
    lr = f", with {lr}" if lr else ""
    return (f" The model's weights are huge ({name!r} reaches {big:.3g}{lr}): grown step after step, which "
            "points to a learning rate (or lr * weight_decay) too large; lower it, or clip the gradients "
            "(torch.nn.utils.clip_grad_norm_ before step()).")


# a float16 running variance passes 65504 once the values pass about 256 (a model.half() CNN)
_HALF_NORM = (" In float16 a variance passes 65504 once the values pass about 256: keep the normalisation layers "
              "in float32 (after model.half(), .float() each BatchNorm and cast its input), or train in float32 "
              "under torch.autocast, which runs batch norm in float32.")


def buffer_hint(buffer: str, module_type: str, largest: tuple[str, float] | None = None,
                dtype: torch.dtype | None = None) -> str:
    """A buffer written non-finite by a forward whose outputs stayed finite. ``largest``: the
    model's largest weight and its magnitude; ``dtype``: the buffer's."""
    if (buffer.startswith("running_") or "Norm" in module_type) and largest is not None and largest[1] > HUGE_WEIGHT:
        return (f"The running statistic {buffer!r} overflowed while this step's outputs stayed finite: its "
                "input held huge (but finite) values, whose variance is past the dtype's largest value, and the "
                f"model's weights are huge ({largest[0]!r} reaches {largest[1]:.3g}): the layers before it made "
                "them, not a sample. Weights that grew step after step point to a learning rate (or lr * "
                "weight_decay) too large; lower it, or clip the gradients.")
    if buffer.startswith("running_") or "Norm" in module_type:
        return (f"The running statistic {buffer!r} overflowed while this step's outputs stayed finite: a batch "
                "with huge (but finite) values, whose variance is past the dtype's largest value. Training goes "
                "on, but evaluation (model.eval()) will use it: find the bad sample (watch(loader=...)), clip or "
                "normalise the inputs." + _HALF_NORM * (dtype is torch.float16))
    return (f"The buffer {buffer!r} became non-finite during this step's forward while its outputs stayed "
            "finite: the module wrote it in place; whatever reads it later (evaluation, the next step) gets it.")


def _cap(what: str) -> str:
    return what[:1].upper() + what[1:]


def at_start_hint(what: str, t: torch.Tensor | None = None) -> str:
    """A tensor that was already non-finite when the watch began (before its first step)."""
    said = (f"{_cap(what)} was already non-finite when the watch began: it was loaded or set "
            "that way before nanhunt's first step, so where it was born is not known here (run "
            "`nanhunt audit` on the checkpoint it came from; re-initialise or drop the non-finite rows).")
    if t is not None and t.dtype in (torch.float16, torch.float8_e5m2) and not bool(t.isnan().any()):
        # infinities only, in a narrow dtype: what a cast of a wider model makes of a value past its range
        name = str(t.dtype).replace("torch.", "")
        said += (f" It holds inf and no NaN, in {name}: a weight past {torch.finfo(t.dtype).max:g} becomes "
                 "inf when a float32/bfloat16 model or checkpoint is cast (model.half(), .to(torch.float16)); "
                 "keep the weights in float32 and run under torch.autocast, or use bfloat16.")
    return said


def stale_grad_hint(name: str, at_start: bool) -> str:
    """A parameter's ``.grad`` that was already non-finite when the watch began, or that an earlier
    finding left non-finite, accumulated into."""
    held = ("already held NaN/Inf when the watch's first step began (left by a backward before watch(), or by "
            "a failed step, and never zeroed)" if at_start else
            "still held the NaN/Inf of an earlier finding's step (its NonFiniteError caught, and the gradients "
            "never zeroed)")
    return (f"The .grad of {name!r} {held}: backward adds to it, so every gradient after it is non-finite too. "
            "Call opt.zero_grad() (or model.zero_grad()) before training on.")


def given_hint(name: str) -> str:
    """A non-finite tensor handed to ``torch.func.functional_call`` in place of the module's own."""
    return (f"{name!r}, given to torch.func.functional_call in place of the module's own, is non-finite: "
            "look at the code that built that dict of parameters (a meta-learning inner step, an EMA copy).")


def given_huge_hint(name: str, big: float) -> str:
    """The sentence added to a forward finding born from finite values in a call given huge tensors
    through ``torch.func.functional_call`` while the model's own weights are not."""
    return (f" The weights this call was given through torch.func.functional_call are huge ({name!r} reaches "
            f"{big:.3g}) while the model's own are not: the code that built that dict made them, a meta-learning "
            "inner update (p - inner_lr * g) whose inner learning rate or number of inner steps is too large; lower "
            "the inner learning rate, or clip the inner gradients (the outer optimizer's lr is not the one).")


def carried_hint(what: str) -> str:
    """A tensor an earlier finding already showed non-finite: nothing since made it finite again."""
    return (f"{_cap(what)} has been non-finite since an earlier finding (the hunt's first finding says where "
            "it came from): every step since carries it; restore it from a checkpoint or re-initialise it.")


def moved_hint(names: list[str]) -> str:
    """No replay reproduced a forward value, and parameters of the call were written in place since."""
    shown = ", ".join(repr(n) for n in names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
    return (f"Replays of the call did not reproduce it, but they ran on {shown} as it is now, written in place "
            "since the last optimizer step (a clamp, a constraint or a hand-made update under torch.no_grad() "
            "between backward and step()): the call saw the value before that write, which made the NaN/Inf, and no "
            "device is at fault. Look at what wrote it, or write it after step(), before the next forward.")


def written_hint(what: str, line: str | None = None) -> str:
    """A weight non-finite after its optimizer's last step left it finite: something else wrote it
    (at ``line``, when the code outside the model that wrote it is known)."""
    if line:
        return (f"{_cap(what)} was written non-finite in place at {line}, in your code outside the model "
                "(p.data[...] = ..., an in-place write under torch.no_grad()): no optimizer step poisoned it.")
    return (f"{_cap(what)} was written after its optimizer's last step (a load_state_dict, "
            "an in-place assignment in your code): no optimizer step poisoned it; look at what wrote it.")


def replaced_hint(what: str, dtype: torch.dtype) -> str:
    """A weight finite when its optimizer's last step() returned, non-finite now, its version
    unmoved: its ``.data`` was replaced (``model.half()``, ``.to(dtype)``, ``p.data = ...``)."""
    name = str(dtype).removeprefix("torch.")
    top = dtype_max(name) if dtype.is_floating_point and dtype.itemsize < 4 else None
    cast = f" (now {name}: a value past its largest, {top:g}, becomes inf in the cast)" if top else ""
    return (f"{_cap(what)} was finite after its optimizer's last step and was replaced since: a cast "
            f"(model.half(), model.to(dtype)){cast} or an assignment to .data: no optimizer step poisoned it; "
            "look at what converted or replaced it (keep the weights in float32 and use autocast).")


def written_before_step_hint(what: str) -> str:
    """A parameter non-finite already when its optimizer's step() began: the user's code wrote it."""
    return (f"{_cap(what)} was already non-finite when optimizer.step() began, and no gradient was: code between "
            "backward and step() wrote it (p.data[...] = ..., an in-place write under torch.no_grad(), a "
            "weight clamp or re-initialisation), or an optimizer.load_state_dict() since the last step loaded "
            "it so; the optimizer's update only carried it on. Look at what writes it outside the optimizer.")


def unheld_hint(what: str, frozen: bool = False) -> str:
    """A non-finite parameter that no watched optimizer holds: the user's code set it (``frozen``: it
    does not require grad, so it was never meant for the optimizer: an EMA teacher, a frozen copy)."""
    if frozen:
        return (f"{_cap(what)} does not require grad and no watched optimizer holds it (an EMA or momentum "
                "teacher, a target network, a frozen copy): your code writes it, not an optimizer step. Look at "
                "that update since the module's last call (an EMA after optimizer.step() whose momentum "
                "schedule divides by 0, a copy_ or load from a non-finite source).")
    return (f"{_cap(what)} is a parameter no watched optimizer holds (a new nn.Parameter "
            "assigned to the module, or one the optimizer was never given): no optimizer step wrote it; "
            "look at what set it, and give the optimizer the parameter the model uses.")


def unwatched_hint(what: str) -> str:
    """A non-finite parameter while no optimizer is watched: nothing says who wrote it."""
    return (f"{_cap(what)} was already non-finite. No optimizer is watched, so which step "
            "wrote it is not known here: pass the optimizer (watch(model, optimizer=opt)) to have its "
            "updates judged, or look for an earlier finding whose gradients it applied.")


def unseen_forward_hint() -> str:
    """Sentinel mode judged non-finite gradients of a step in which the watched model was never
    called itself (its parts were, directly)."""
    return ("Sentinel mode sees the model through its own top-level calls, and in this step it had none: its "
            "parts were called directly (a GAN's generator and discriminator held in one container), so "
            "where this gradient's NaN/Inf came from was not seen. Watch each part that the loop calls "
            "(nanhunt.watch(g, opt_g), nanhunt.watch(d, opt_d)) or use mode='full'.")


def unseen_step_hint() -> str:
    """Full mode judged non-finite gradients of a step in which neither a call of the model nor any
    loss code was seen: both ran where no hook runs (a compiled function that calls the model and
    computes the loss)."""
    return ("No call of the model and no loss code was seen in this step, so where this gradient's NaN/Inf "
            "came from was not seen. Either the forward and the loss ran where nanhunt's hooks do not, inside a "
            "torch.compile'd function that calls the model (a compiled training step): compile the model itself "
            "(torch.compile(model) or model.compile()), compute the loss outside that function, or run the "
            "failing step without torch.compile to have it located; or the gradient was written without a "
            "forward (set by hand, loaded).")


def traced_call_hint() -> str:
    """A compiled graph's own check saw a module's output non-finite in a step in which the model
    was never called eagerly: its calls were traced into a compiled function that calls it."""
    return ("Found by the compiled graph's own check; the model ran only inside a torch.compile'd function that "
            "calls it (a compiled training step; Lightning compiles training_step when given torch.compile(module)), "
            "so no call of it can be replayed: only the module is known. Compile the model itself instead "
            "(torch.compile(model) or model.compile(); in a LightningModule, the network it holds: "
            "self.net.compile()), or run the failing step without torch.compile, to have the op, line and element.")


def transformed_forward_hint() -> str:
    """Non-finite gradients of a step whose model calls all ran inside torch.func transforms
    (``vmap(model)``, ``grad``), which the hunt does not record."""
    return ("The model ran only inside a torch.func transform (vmap, grad, jacrev), whose calls nanhunt does not "
            "record, so where this gradient's NaN/Inf came from was not seen; its forward may have made it. "
            "Run the failing batch through the model outside the transform (model(x) on the batch, or on each "
            "sample) under the hunt to have it located.")


def foreign_forward_hint() -> str:
    """Non-finite gradients of a step whose model calls all ran on another thread than the one
    that steps the optimizer (a worker thread's forward): each was judged on its own as it returned."""
    return ("The model ran on another thread than the one that calls optimizer.step(), and a step is recorded "
            "from that thread, so where this gradient's NaN/Inf came from was not seen: each call on the other "
            "thread was judged on its own as it returned (a forward finding of this step, if its output was "
            "non-finite). Call the model on the thread that steps the optimizer to have it located.")


def untraced_forward_hint() -> str:
    """Non-finite gradients of a step whose model calls all ran in a compiled graph the hunt had not
    hooked yet (the model compiled after watch(); sentinel under torch.compile(model)): caught from
    the step after, so where this one's value came from was not seen."""
    return ("The model ran as a compiled graph that the hunt catches from the next step on, so where this "
            "gradient's NaN/Inf came from was not seen; its forward may have made it. A model compiled after "
            "watch(): call watch() after compiling; mode='sentinel' under torch.compile(model): use mode='full' "
            "to see the first step too.")


def unreplayed_forward_hint(sharded: bool, op: str | None) -> str:
    """A forward finding with no replay to localise it: only its module and output are known."""
    if sharded:
        return ("Under FSDP2 nothing is replayed (a replay would all-gather parameters on one rank alone), so only "
                "the module is known, not the element, the op or whether its input was already non-finite (the "
                "data): this module's forward made the value or was given it."
                + ("" if op else " Pass mode='ops' to have every op judged as it runs (slower): the finding then "
                   "names the op that made it."))
    return ("replay=False: only the module is known, not the element, the op or whether its input was already "
            "non-finite: this module's forward made the value or was given it. Leave replay on to have them.")


def unjudged_backward_hint(sharded: bool) -> str:
    """Non-finite gradients of a step whose forward was finite, with no backward replay and no
    per-module gradient hooks: which module's backward made the value was not judged."""
    why = ("under FSDP2 nothing is replayed (a replay would all-gather parameters on one rank alone)" if sharded
           else "replay=False")
    return (f"The forward was finite, and {why}, so no module's gradient was judged: the NaN/Inf was made in "
            "the backward, in some module's gradient (the gradient of sqrt or log at 0, a division by a "
            "tiny value) or in this one. Pass grad_hooks=True to have every module's gradients judged as "
            "the backward makes them: the finding then names the module whose backward made it.")


def unread_window_hint(since: int, step: int, every: int) -> str:
    """The steps an optimizer state read every ``every`` steps may have gone non-finite at."""
    how = (f"only on a hit here (optimizer_every={every})" if every <= 0 else
           f"every {every} steps here (optimizer_every={every})")
    was = "when the watch began" if since < 0 else f"after step {since}"
    return (f"nanhunt reads the optimizer's state {how}: it was finite {was} and is not after step {step}, "
            f"so it was made at one of steps {since + 1} to {step} (the op is the one that writes it at every "
            "step). Pass optimizer_every=1 to name the step.")


def optimizer_hint(param: str, state: str, fed: bool, eps_zero: str = "", at_start: bool = False,
                   setting: str = "", grads: dict[str, Any] | None = None) -> str:
    what = f"the optimizer state {state!r} of {param!r}" if state else f"the parameter {param!r}"
    if at_start:
        return at_start_hint(what)
    if setting:
        return (f"After the optimizer step, {what} is non-finite: the optimizer was set to {setting} (a "
                "learning-rate schedule or warm-up that divided by 0, a setting read from a config as inf). "
                "Check what sets it (scheduler.get_last_lr(), the lambda of a LambdaLR).")
    g = grads or {}
    clip = "Clip the gradients (torch.nn.utils.clip_grad_norm_) or find why they are this large (the loss's scale)."
    if state and g.get("grad_max") is not None and not fed:  # (a state that overflowed: no eps in it)
        if state == g.get("denominator") and "squared" in g["holds"]:
            return (f"After the optimizer step, {what} is non-finite: the gradient of {param!r} reached "
                    f"{g['grad_max']:.3g}, whose square passes {g['dtype']}'s largest value, so {g['holds']} "
                    f"({state}) overflows to inf. {clip}")
        return (f"After the optimizer step, {what} is non-finite: the gradient of {param!r} reached "
                f"{g['grad_max']:.3g} in {g['dtype']}, and {state!r}, which the update builds from the "
                f"gradients, overflowed to inf. {clip}")
    if not state and g.get("bad_state") and not fed:  # (SGD's momentum_buffer overflowed, then the weight)
        return (f"After the optimizer step, {what} is non-finite: the gradient of {param!r} reached "
                f"{g['grad_max']:.3g} in {g['dtype']}, and the optimizer state {g['bad_state']!r}, which the "
                f"update builds from the gradients, overflowed to inf. {clip}")
    if eps_zero and not fed:
        where = (f"where {g['denominator']} is 0 the update divides by 0 ({g['guarded']})" if g.get("denominator")
                 else "where the state it guards is 0 the update divides by 0")
        return (f"After the optimizer step, {what} is non-finite: the optimizer's eps={eps_zero} rounds to 0 in "
                f"float16, so {where}. Keep float32 master weights "
                "(torch.autocast + GradScaler), or use eps >= 1e-4 for float16 parameters.")
    if fed:
        return (f"After the optimizer step, {what} is non-finite: the step was applied with non-finite "
                "gradients (on_find was not 'raise').")
    if g.get("negative_variance") is not None:
        return (f"After the optimizer step, {what} is non-finite: RMSprop(centered=True) divides by "
                "sqrt(square_avg - grad_avg**2), the gradient's variance, which is 0 where the gradient "
                f"has stayed the same from step to step, and rounding made it negative ({g['negative_variance']:.3g}): "
                "its sqrt is nan (eps is added after the sqrt and does not help). Use centered=False.")
    # (eps = 0: the division by the optimizer's own state, and its class's default eps)
    division = f" ({g['guarded']})" if g.get("guarded") else ""
    fix = (f"Use a positive eps (the default {g['eps_default']:g}).".replace("e-0", "e-") if g.get("eps_default")
           else "Use a positive eps.")
    if g.get("eps") == 0 and (g.get("zero_grad") or g.get("zero_some")):
        return (f"After the optimizer step, {what} is non-finite: the optimizer's eps is 0, and where the "
                f"gradient of {param!r} is 0 its update divides 0 by 0{division}. {fix}")
    if g.get("eps") == 0 and "custom" not in g:  # (its gradient is gone by now, or non-finite: read a step later)
        return (f"After the optimizer step, {what} is non-finite: the optimizer's eps is 0, so wherever the "
                f"gradient of {param!r} was 0 (an embedding's padding_idx row, a row no batch looked up, a frozen unit) its update "
                f"divides 0 by 0{division}. {fix}")
    if g.get("zero_grad") and g.get("custom"):
        return (f"After the optimizer step, {what} is non-finite although the step was given finite "
                f"gradients: the gradient of {param!r} is 0 everywhere, so an update that divides by "
                "the gradient's size (a trust ratio ||w|| / ||g||, a normalised step) divides by 0. "
                "Guard that division (where(||g|| > 0, ..., 1)) or add an eps.")
    if g.get("settings"):
        return (f"After the optimizer step, {what} is non-finite although the step was given finite "
                f"gradients: the optimizer's settings alone overflow ({g['settings']}): its update makes "
                f"{'its state' if state else 'a weight of 1'} non-finite from a gradient of 0.5"
                f"{' and a weight of 1' if state else ''}. Check the values given to the optimizer "
                "or set by a schedule.")
    # (the group's learning rate, and the division by its own state that a torch.optim class has, if any)
    lr = f" (its lr is {g['lr']:.3g})" if g.get("lr") is not None else ""
    own = g.get("update_division")
    if own is None:  # (a class not known, or no finite lr)
        den = f"a denominator at 0 in {g['guarded']}" if g.get("guarded") else "a denominator like sqrt(exp_avg_sq) + eps at 0"
        return (f"After the optimizer step, {what} is non-finite although the step was given finite "
                f"gradients: an update that overflowed or divided by 0 (an exploding learning rate{lr}, {den}).")
    if own:
        num, den = own.split(" / ")
        own = f", or the denominator of {num} / ({den} + eps) at 0"
    return (f"After the optimizer step, {what} is non-finite although the step was given finite "
            f"gradients: an update that overflowed or divided by 0: an exploding learning rate{lr}{own}.")
