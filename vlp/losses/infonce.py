"""InfoNCE / CLIP loss (Oord et al. 2018, arXiv 1807.03748; Radford et al. 2021, arXiv 2103.00020).

Local-loss form: the b local anchors of this rank against all B gathered candidates, positive of
local row i at global column offset + i, cross-entropy averaged over rows and over both
directions (image->text, text->image). Same value and gradients as open_clip
``ClipLoss(local_loss=True, gather_with_grad=True)``. Shapes and call as every loss
(vlp.losses); memory O(b * B); math in fp32 under autocast.
"""

from __future__ import annotations

from torch import Tensor

from vlp.losses.common import anchors, check_inputs, fp32_block, softplus_exact
from vlp.losses.diagnostics import diagnostics_from_softmax


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
    ``scale_grad`` is accepted for the shared signature: "same" and "split" coincide here.
    """
    b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
    with fp32_block(img_local.device):
        # cross-entropy_i = log(1 + e^{v_i}) with v_i the logsumexp of the margins over the
        # negatives; the softmax over the negatives is shared with the diagnostics
        a = anchors(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias,
                    b, big_b, offset, "same")
        loss = softplus_exact(a.v).mean()  # mean over both directions
    metrics = diagnostics_from_softmax(a.parts, a.t, extra={"loss": loss})
    return loss, metrics
