"""SigLIP sigmoid loss (Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training",
arXiv 2303.15343).

    loss = -(1/b) * sum_{i local, j global} log sigma(z_ij * (t * s_ij + bias)),
    z_ij = +1 at the positive column offset + i, -1 elsewhere.

Global-column form: local image rows against all B gathered text columns (one (b, B) matrix).
open_clip's ``SigLipLoss`` exchanges text features between neighbouring ranks instead, but sums
exactly these terms with the same 1/b normalisation, so the value on every rank and the gradients
equal open_clip's. The pair set {(i, j)} over all ranks is the whole B x B matrix, which is
symmetric in image/text, so a text->image direction would add the same terms again: one direction
is computed (the diagnostics still average both, the text->image logits under no_grad).

Shapes and call as every loss (vlp.losses); logit_bias None means no bias. Init:
``siglip_init()``. Memory O(b * B); math in fp32 under autocast.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vlp.losses.common import (
    as_fp32,
    as_scalar,
    check_inputs,
    fp32_block,
    positive_mask,
    scaled_logits,
)
from vlp.losses.diagnostics import diagnostics_from_logits


class SigLipInit(NamedTuple):
    """Initial values of the SigLIP paper (open_clip ``init_logit_scale``, ``init_logit_bias``)."""

    logit_scale: float  # log of t: the model stores log_scale and returns t = exp(log_scale)
    logit_bias: float


def siglip_init() -> SigLipInit:
    """(log(10), -10): t = 10 and bias = -10 at initialisation."""
    return SigLipInit(logit_scale=math.log(10.0), logit_bias=-10.0)


def siglip_loss(
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
    """Sigmoid loss; returns (loss, metrics): the diagnostics plus "siglip" and "logit_bias".

    ``scale_grad`` must be "same" (the "split" routing is FlatNCE-specific).
    """
    b, big_b = check_inputs(
        img_local, txt_local, img_global, txt_global, offset, scale_grad, ("same",)
    )
    device = img_local.device
    with fp32_block(device):
        t = as_scalar(logit_scale, device)
        bias = as_scalar(logit_bias, device)
        logits = scaled_logits(as_fp32(img_local), as_fp32(txt_global), t, bias)  # (b, B)
        pos_mask = positive_mask(b, big_b, offset, device)
        signs = torch.where(pos_mask, 1.0, -1.0).to(logits.dtype)  # z_ij
        loss = -F.logsigmoid(signs * logits).sum() / b
        with torch.no_grad():  # text->image only for the diagnostics
            logits_t2i = scaled_logits(as_fp32(txt_local), as_fp32(img_global), t)
    extra = {"loss": loss, "siglip": loss, "logit_bias": 0.0 if bias is None else bias}
    return loss, diagnostics_from_logits(logits, logits_t2i, offset, t, extra=extra)
