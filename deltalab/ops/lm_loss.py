"""The LM head and the next-token cross-entropy in one op, in chunks of tokens.

    linear_cross_entropy(hidden [N, D], weight [V, D], targets [N], *, ignore_index=-100,
                         chunk=None) -> mean over the non-ignored targets of
                         logsumexp(hidden @ weight^T) - (hidden @ weight^T)[target]

is `F.cross_entropy(F.linear(hidden, weight).float(), targets)`, the loss `CausalLM` computed
from its float32 logits (`linear_cross_entropy_reference`), without any `[N, V]` tensor: the
tokens go through in chunks of `chunk` rows, and per chunk

- the logits, by the same matrix product the LM head does (bf16 under bf16 autocast);
- their log-softmax in float32 (one kernel: the bf16 logits read, float32 written; it subtracts
  the row maximum before exponentiating, so no logit overflows and the largest term is
  exp(0) = 1: logsumexp = max + log(sum exp(z - max)) is exact to float32 rounding whatever the
  logits' range), and from it the loss at the target, -log_softmax[target];
- with a gradient wanted, the gradient of the chunk's summed loss w.r.t. its logits,
  softmax - onehot(target) = exp(log_softmax) - onehot, written in the logits' dtype straight
  into the logits' buffer (exp reads float32 and rounds once to bf16, as the unfused backward
  rounds the float32 logit gradient once to bf16 for the LM head's bf16 products). The target
  column is written from float32 separately: exp(log p_t) - 1 in float32, then rounded, since
  p_t rounded to bf16 first and then minus 1 would lose the gradient for p_t near 1
  (spacing 2^-8 there);
- at once the two products of the LM head's backward: d hidden (chunk) = dlogits @ W and
  d W += dlogits^T @ hidden (chunk), the latter accumulated in float32 (at least: float64 for
  float64 inputs), so that the fp32 master weight gets a float32 gradient and the chunks'
  partial sums are not rounded to bf16 one after another.

The backward then only scales the stored d hidden and d W by grad / count (count: the
non-ignored targets), which is why the forward computes them: nothing of the chunk's logits
has to be kept or recomputed. Ignored rows (target == ignore_index) are left out by masking
`[chunk, D]` tensors only: their hidden rows are zeroed before d W's product and their d hidden
rows after the other, never a pass over `[chunk, V]`.

Autocast. Today `lm_head(hidden)` under autocast casts hidden and the fp32 weight to the
autocast dtype (bf16) and multiplies in it; `.float()` then widens the logits; the backward
runs the two products in bf16 on the bf16-rounded logit gradient and the weight's cast returns
its gradient in float32. Inside an autograd.Function autocast would still apply to the ops of
`forward`, but implicitly; here the dtype is decided once, outside (`compute_dtype`: the
autocast dtype when autocast is on for hidden's device, else hidden's dtype, which must then be
weight's), autocast is switched off inside the forward, and the casts are explicit. The
Function takes the uncast (fp32) weight and hidden and returns their gradients in their own
dtypes: d W in float32 from the float32 accumulator (no bf16 copy of it, no cast node), d
hidden rounded through bf16 as the LM head's product gives it. The backward is a scalar
multiplication of stored tensors and needs no autocast state.

Numbers differ from the reference by rounding only: the float32 log-softmax of the same bf16
logits (exact same logits: the same bf16 product), a different summation order of the loss,
and the 1/count scale applied after the bf16 products instead of before (at most a bf16 ulp or
two of the gradients).

An all-ignored batch: the loss is 0/0 = nan, as `F.cross_entropy` gives, and the gradients are
zero, as its backward gives (the scale uses max(count, 1); every row is masked). An all-ignored
chunk costs its products but contributes nothing. Without a gradient wanted (`torch.no_grad`,
or inputs that do not require grad) only the loss is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltalab.ops._checks import require_float, require_rank, require_tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "compute_dtype",
    "default_chunk",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
]

# Logits per chunk (rows x vocab): 2^27 is 4096 rows at a 32K vocab, a 512 MiB float32
# log-softmax and 256 MiB of bf16 logits/gradient, against 2 GiB for the float32 logits of a
# 4 x 4096 batch alone. Large enough that each product is a full-size GEMM.
CHUNK_ELEMENTS = 1 << 27


def default_chunk(vocab: int) -> int:
    """Rows per chunk: CHUNK_ELEMENTS logits, a multiple of 128 rows when that many fit."""
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return rows - rows % 128 if rows >= 128 else rows


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits' product, as `F.linear(hidden, weight)` would run it here: the
    autocast dtype when autocast is on for hidden's device (for inputs autocast casts: not
    float64), else the inputs' common dtype (they must agree, as for F.linear)."""
    device = hidden.device.type
    eligible = torch.float64 not in (hidden.dtype, weight.dtype)
    if eligible and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype outside "
            "autocast"
        )
    return hidden.dtype


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """The definition: the float32 (at least) logits, then `F.cross_entropy` (mean)."""
    logits = F.linear(hidden, weight)
    wide = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(wide), targets, ignore_index=ignore_index)


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk: int,
    dtype: torch.dtype,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed loss, count, d hidden of the summed loss or None, d weight or None)."""
    wide = torch.promote_types(dtype, torch.float32)
    w = weight.to(dtype)
    valid = targets != ignore_index
    count = valid.sum()
    # Ignored rows gather column 0 and are masked out; no host read of the targets.
    safe = torch.where(valid, targets, 0)
    total = torch.zeros((), dtype=wide, device=hidden.device)
    d_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if grad else None
    d_weight = None
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        h = hidden[rows].to(dtype)
        keep = valid[rows]
        target = safe[rows].unsqueeze(1)
        logits = h @ w.t()  # [C, V] in dtype: the LM head's product
        log_p = torch.log_softmax(logits, dim=-1, dtype=wide)  # max-subtracted, float32
        log_p_t = log_p.gather(1, target).squeeze(1)
        total = total - torch.where(keep, log_p_t, 0).sum()
        if not grad:
            continue
        # softmax - onehot in dtype, into the logits' buffer (no longer needed): one pass.
        d_logits = torch.exp(log_p, out=logits)
        del log_p
        on_target = torch.exp(log_p_t) - keep.to(wide)  # p_t - 1 in float32, then rounded
        d_logits.scatter_(1, target, on_target.unsqueeze(1).to(dtype))
        mask = keep.unsqueeze(1).to(dtype)
        d_hidden[rows] = (d_logits @ w) * mask
        part = d_logits.t() @ (h * mask)  # [V, D] in dtype: the LM head's weight product
        if d_weight is None:
            d_weight = part.to(wide)
        else:
            d_weight.add_(part)
    return total, count, d_hidden, d_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            total, count, d_hidden, d_weight = _chunks(
                hidden, weight, targets, ignore_index, chunk, dtype, grad=True
            )
        ctx.save_for_backward(d_hidden, d_weight, count)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad):
        d_hidden, d_weight, count = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # grad / count; count 0 (all ignored) has all-zero stored gradients: zero, not nan.
        scale = grad / count.clamp(min=1).to(grad.dtype)
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = d_hidden.to(hidden_dtype) * scale.to(hidden_dtype)
        if ctx.needs_input_grad[1]:
            dw = (d_weight * scale.to(d_weight.dtype)).to(weight_dtype)
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits `hidden @ weight^T` at `targets`, in chunks of `chunk`
    rows (default: `default_chunk(V)`); module docstring. hidden `[N, D]`, weight `[V, D]`,
    targets `[N]` integer, entries equal to ignore_index left out."""
    hidden = require_float("hidden", hidden)
    weight = require_float("weight", weight)
    targets = require_tensor("targets", targets)
    require_rank("hidden", hidden, (2,), "[N, D]")
    require_rank("weight", weight, (2,), "[V, D]")
    require_rank("targets", targets, (1,), "[N]")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if hidden.shape[1] != weight.shape[1] or targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"shapes do not match: hidden {tuple(hidden.shape)} [N, D], weight "
            f"{tuple(weight.shape)} [V, D], targets {tuple(targets.shape)} [N]"
        )
    if chunk is None:
        chunk = default_chunk(weight.shape[0])
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    dtype = compute_dtype(hidden, weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk, dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        total, count, _, _ = _chunks(
            hidden, weight, targets, ignore_index, chunk, dtype, grad=False
        )
    return total / count
