"""Pieces shared by the contrastive losses: input checks, the fp32 block, logits, positives.

Conventions (all losses): ``b`` local rows, ``B`` gathered columns, positive of local row ``i`` is
global column ``offset + i`` (see vlp/distributed.py). ``t`` is the exponentiated logit scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

SCALE_GRAD_MODES = ("same", "split")  # vlp.losses.temperature picks one per run


def check_inputs(
    img_local: Tensor,
    txt_local: Tensor,
    img_global: Tensor,
    txt_global: Tensor,
    offset: int,
    scale_grad: str,
    allowed_scale_grad: tuple[str, ...] = SCALE_GRAD_MODES,
) -> tuple[int, int]:
    """Validate shapes/offset/scale_grad and return (b, B)."""
    if img_local.dim() != 2 or img_local.shape != txt_local.shape:
        raise ValueError(
            f"local features must both be (b, d); got {tuple(img_local.shape)} and "
            f"{tuple(txt_local.shape)}"
        )
    if img_global.dim() != 2 or img_global.shape != txt_global.shape:
        raise ValueError(
            f"global features must both be (B, d); got {tuple(img_global.shape)} and "
            f"{tuple(txt_global.shape)}"
        )
    b, d = img_local.shape
    big_b = img_global.shape[0]
    if img_global.shape[1] != d:
        raise ValueError(f"feature dims differ: local d={d}, global d={img_global.shape[1]}")
    if big_b < 2:
        raise ValueError(f"contrastive losses need at least 2 global columns, got B={big_b}")
    if not 0 <= offset <= big_b - b:
        raise ValueError(f"offset {offset} with b={b} local rows does not fit in B={big_b} columns")
    if scale_grad not in allowed_scale_grad:
        raise ValueError(f"scale_grad must be one of {allowed_scale_grad}, got {scale_grad!r}")
    return b, big_b


@contextlib.contextmanager
def fp32_block(device: torch.device) -> Iterator[None]:
    """Disable autocast so the loss math runs in fp32 (inputs are cast with .float())."""
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def as_scalar(x: Tensor | float | None, device: torch.device) -> Tensor | None:
    """A 0-d fp32 tensor (float64 stays float64) from a scalar tensor of shape () or (1,)."""
    if x is None:
        return None
    if not isinstance(x, Tensor):  # a fill, not a host copy: capturable in a CUDA graph
        return torch.full((), float(x), device=device)
    x = x.reshape(())
    return x if x.dtype == torch.float64 else x.float()


def as_fp32(x: Tensor) -> Tensor:
    """fp32 copy of low-precision features; float32/float64 pass through unchanged."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def scaled_logits(
    rows: Tensor, cols: Tensor, logit_scale: Tensor, logit_bias: Tensor | None = None
) -> Tensor:
    """(b, d) x (B, d) -> (b, B) logits t * rows @ cols.T (+ bias); scales the smaller side."""
    logits = (logit_scale * rows) @ cols.T
    return logits if logit_bias is None else logits + logit_bias


def positive_index(b: int, offset: int, device: torch.device) -> Tensor:
    """(b,) global column of each local row's positive: offset + i."""
    return torch.arange(b, device=device) + offset


def positive_mask(b: int, big_b: int, offset: int, device: torch.device) -> Tensor:
    """(b, B) bool, True at (i, offset + i)."""
    mask = torch.zeros(b, big_b, dtype=torch.bool, device=device)
    return mask.scatter_(1, positive_index(b, offset, device)[:, None], True)


class NegativeSoftmax(NamedTuple):
    """One direction's softmax over the negatives of each local row (positive excluded)."""

    v: Tensor  # (b,) logsumexp_{j != p} L_ij - L_ip: the FlatNCE/InfoNCE statistic
    logp: Tensor  # (b, B) log-softmax over the negatives, -inf at the positive
    hit: Tensor  # (b,) bool: the positive beats every negative (ties are misses)


def negative_softmax(logits: Tensor, pos_idx: Tensor, pos_mask: Tensor) -> NegativeSoftmax:
    """The forward math of every softmax-family loss and of the diagnostics: one masked_fill,
    one fused log_softmax and one row max over (b, B); no autograd (see negative_lse_full)."""
    masked = logits.masked_fill(pos_mask, float("-inf"))
    logp = torch.log_softmax(masked, dim=1)  # (b, B), -inf at the positive
    rows = torch.arange(logits.shape[0], device=logits.device)
    top, q = masked.max(dim=1)  # the hardest negative q: lse_i = L_iq - logp_iq for any q, and
    pos = logits[rows, pos_idx]  # this q keeps |logp_iq| <= log(B - 1): no cancellation
    v = (top - pos) - logp[rows, q]
    return NegativeSoftmax(v, logp, top < pos)


def _dv_dlogits(logp: Tensor, pos_idx: Tensor, g: Tensor) -> Tensor:
    """(b, B) gradient of sum_i g_i v_i w.r.t. the logits: g_i w_ij (softmax over the negatives),
    -g_i at the positive."""
    grad = torch.exp(logp).mul_(g[:, None])  # 0 at the positive (logp = -inf there)
    grad[torch.arange(grad.shape[0], device=grad.device), pos_idx] = -g
    return grad


class _NegativeLSE(torch.autograd.Function):
    """v = negative_softmax(logits).v with a hand-written backward; logp and hit ride along
    without gradient, so the diagnostics reuse them instead of recomputing the softmax.

    Backward: dv_i/dL_ij = w_ij (softmax over the negatives) for j != p_i and -1 at p_i. Same
    values and gradients as logsumexp over j != p of (L_ij - L_ip) (tests/losses), ~2x fewer (b, B)
    passes (bench/loss_cost.py).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, pos_idx: Tensor, pos_mask: Tensor):
        out = negative_softmax(logits, pos_idx, pos_mask)
        ctx.save_for_backward(out.logp, pos_idx)
        ctx.mark_non_differentiable(out.logp, out.hit)
        return tuple(out)

    @staticmethod
    def backward(ctx, grad_v: Tensor, _logp, _hit):
        logp, pos_idx = ctx.saved_tensors
        return _dv_dlogits(logp, pos_idx, grad_v), None, None


class _NegativeLSESplit(torch.autograd.Function):
    """(v, v, logp, hit) of logits L = R @ C.T, R = t * rows with t detached by the caller, with
    separate gradient routes: the first output's gradient reaches R and C (the features), the
    second's only t. The matmul is done here so that t's gradient comes from the (b, d) side,
    as a plain matmul's would: with G_i = g_i (w_i - e_p) (w = softmax over the negatives),
    R_i . (G @ C)_i = g_i (sum_j w_ij L_ij - L_ip) = g_i t dv_i/dt. FlatNCE's
    `temperature: split` at the cost of InfoNCE: one matmul and one log_softmax forward, two
    matmuls backward per direction."""

    @staticmethod
    def forward(ctx, rows: Tensor, cols: Tensor, t: Tensor, pos_idx: Tensor, pos_mask: Tensor):
        out = negative_softmax(rows @ cols.T, pos_idx, pos_mask)
        ctx.save_for_backward(out.logp, rows, cols, t, pos_idx)
        ctx.mark_non_differentiable(out.logp, out.hit)
        return out.v, out.v.clone(), out.logp, out.hit

    @staticmethod
    def backward(ctx, g_feat: Tensor, g_t: Tensor, _logp, _hit):
        logp, rows, cols, t, pos_idx = ctx.saved_tensors
        g = torch.zeros_like(logp[:, 0]) if g_feat is None else g_feat
        g_safe = torch.where(g != 0, g, torch.ones_like(g))  # unit weight where g is 0 (for t)
        keep = (g / g_safe)[:, None]  # 1, or 0 where the features get no gradient
        grad = _dv_dlogits(logp, pos_idx, g_safe)  # G with weights g_safe
        g_rows = grad @ cols  # (b, d)
        grad_rows = g_rows * keep if ctx.needs_input_grad[0] else None
        grad_cols = grad.T @ (rows * keep) if ctx.needs_input_grad[1] else None
        grad_t = None
        if g_t is not None and ctx.needs_input_grad[2]:
            dv_dt = torch.linalg.vecdot(rows, g_rows) / (g_safe * t)
            grad_t = (g_t * dv_dt).sum().reshape(t.shape)
        return grad_rows, grad_cols, grad_t, None, None


def negative_lse_split(rows: Tensor, cols: Tensor, t: Tensor, pos_idx: Tensor,
                       pos_mask: Tensor) -> tuple[Tensor, Tensor, NegativeSoftmax]:
    """(v for the features' gradient, v for the gradient of t, the direction's NegativeSoftmax
    for the diagnostics) of logits (t * rows) @ cols.T; ``rows`` come already scaled by a
    detached t."""
    v, v_t, logp, hit = _NegativeLSESplit.apply(rows, cols, t, pos_idx, pos_mask)
    return v, v_t, NegativeSoftmax(v.detach(), logp, hit)


def negative_lse_full(logits: Tensor, pos_idx: Tensor, pos_mask: Tensor) -> NegativeSoftmax:
    """negative_softmax with v differentiable (logp and hit are not)."""
    return NegativeSoftmax(*_NegativeLSE.apply(logits, pos_idx, pos_mask))


class Anchors(NamedTuple):
    """One rank's anchors of both directions (image->text rows first): ``v`` (2b,) the
    logsumexp of each anchor's margins over its negatives, carrying the features' gradient;
    ``v_t`` the same values carrying logit_scale's gradient in scale_grad="split"
    (``v.detach()`` in "same", where ``v`` carries both); ``parts`` each direction's softmax
    over the negatives (for the diagnostics); ``t``, ``bias`` as fp32 scalars."""

    v: Tensor
    v_t: Tensor
    parts: list
    t: Tensor
    bias: Tensor | None


def anchors(img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
            logit_scale, logit_bias, b: int, big_b: int, offset: int, scale_grad: str) -> Anchors:
    """The margins every contrastive loss here starts from; call inside ``fp32_block``.
    Local rows (b, d) against global columns (B, d); the positive of row i is column offset+i."""
    device = img_local.device
    t, bias = as_scalar(logit_scale, device), as_scalar(logit_bias, device)
    img_b, txt_b = as_fp32(img_local), as_fp32(txt_local)
    img_bb, txt_bb = as_fp32(img_global), as_fp32(txt_global)
    pos_idx, pos_mask = positive_index(b, offset, device), positive_mask(b, big_b, offset, device)
    directions = ((img_b, txt_bb), (txt_b, img_bb))  # image->text, text->image
    if scale_grad == "same":
        parts = [negative_lse_full(scaled_logits(rows, cols, t, bias), pos_idx, pos_mask)
                 for rows, cols in directions]  # softmax over the negatives of (b, B) logits
        v = torch.cat([p.v for p in parts])
        return Anchors(v, v.detach(), parts, t, bias)
    t_fixed = t.detach()  # "split": the logits' gradient reaches the features only
    outs = [negative_lse_split(t_fixed * rows, cols, t, pos_idx, pos_mask) for rows, cols in directions]
    return Anchors(torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]),
                   [o[2] for o in outs], t, bias)


def softplus_exact(v: Tensor) -> Tensor:
    """log(1 + e^v) without F.softplus's linear cut-off at v > 20 (an e^-20 error in float64)."""
    return torch.logaddexp(v, torch.zeros_like(v))
