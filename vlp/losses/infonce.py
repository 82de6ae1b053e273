"""InfoNCE / CLIP loss (Oord et al. 2018, arXiv 1807.03748; Radford et al. 2021, arXiv 2103.00020).

Local-loss form: the b local anchors of this rank against all B gathered candidates, positive of
local row i at global column offset + i, cross-entropy averaged over rows and over both
directions (image->text, text->image). Same value and gradients as open_clip
``ClipLoss(local_loss=True, gather_with_grad=True)``.

Shapes: img_local, txt_local (b, d); img_global, txt_global (B, d), L2-normalised;
logit_scale t = exp(log_scale), 0-d tensor. Memory O(b * B); math in fp32 under autocast.

Usage: ``loss, metrics = infonce_loss(img_b, txt_b, gather_with_grad(img_b),
gather_with_grad(txt_b), logit_scale, offset=positive_offset(b))``
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from vlp.losses.common import (
    as_fp32,
    as_scalar,
    check_inputs,
    fp32_block,
    positive_index,
    scaled_logits,
)
from vlp.losses.diagnostics import diagnostics_from_logits


def infonce_loss(
    img_local: Tensor,
    txt_local: Tensor,
    img_global: Tensor,
    txt_global: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    *,
    offset: int = 0,
    scale_grad: str = "same",
) -> tuple[Tensor, dict[str, float]]:
    """Symmetric InfoNCE; returns (loss, metrics) with metrics as in vlp.losses.diagnostics.

    ``logit_bias`` is added like open_clip does; softmax is shift-invariant, so it changes nothing.
    ``scale_grad`` is accepted for the shared signature: "same" and "infonce" coincide here.
    """
    b, _ = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
    device = img_local.device
    with fp32_block(device):
        t = as_scalar(logit_scale, device)
        bias = as_scalar(logit_bias, device)
        img_b, txt_b = as_fp32(img_local), as_fp32(txt_local)
        img_bb, txt_bb = as_fp32(img_global), as_fp32(txt_global)
        logits_i2t = scaled_logits(img_b, txt_bb, t, bias)  # (b, B)
        logits_t2i = scaled_logits(txt_b, img_bb, t, bias)  # (b, B)
        labels = positive_index(b, offset, device)
        loss = (F.cross_entropy(logits_i2t, labels) + F.cross_entropy(logits_t2i, labels)) / 2
    metrics = diagnostics_from_logits(logits_i2t, logits_t2i, offset, t, extra={"loss": loss})
    return loss, metrics
