"""FlatNCE (Chen et al. 2021, "Simpler, Faster, Stronger: Breaking The log-K Curse On Contrastive
Learners With FlatNCE", arXiv 2107.01152).

For local anchor i with positive column p = offset + i and margins d_ij = t * (s_ij - s_ip) over
the negatives j != p of the gathered batch (positive masked with -inf, not an additive constant):

    v_i       = logsumexp_{j != p} d_ij
    InfoNCE_i = log(1 + e^{v_i})                      (== cross-entropy)
    FlatNCE   = mean_i exp(v_i - v_i.detach())         (value 1, gradient mean_i grad v_i)

grad InfoNCE_i = sigma(v_i) * grad FlatNCE_i: FlatNCE removes the factor sigma(v_i), which vanishes
when the positive already dominates (small batches, large t). The backpropagated loss is
``flat - 1 + InfoNCE.detach()``, so the reported value is the InfoNCE value and the gradient is
FlatNCE's; it is computed by one small autograd Function (``FlatObjective``: value
mean_i log(1 + e^{v_i}), gradient 1/n per anchor on v). Both directions averaged, as in InfoNCE.

``scale_grad``: "same" -- every input (features, logit_scale) gets FlatNCE's gradient;
"split" -- features get FlatNCE's gradient, logit_scale gets InfoNCE's (FlatNCE's gradient
w.r.t. t, mean_i E_w[s_ij - s_ip], does not calibrate a temperature). Implemented with one matmul
and one log_softmax per direction: logits on t.detach(), the scale's gradient routed by
``negative_lse_split`` from the (b, d) side of the matmul's backward. Shapes and call as
every loss (vlp.losses), B >= 2; memory O(b * B); math in fp32 under autocast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlp.losses.common import anchors, check_inputs, fp32_block, softplus_exact
from vlp.losses.diagnostics import diagnostics_from_softmax


class FlatObjective(torch.autograd.Function):
    """Value mean_i log(1 + e^{v_t,i}) (InfoNCE; v_t equals v in value). Gradient: 1/n on every
    v_i (FlatNCE's: d/dv exp(v - v.detach()) = 1) and, when v_t needs it, InfoNCE's
    sigma(v_t,i)/n on v_t. One autograd node instead of six small ones."""

    @staticmethod
    def forward(ctx, v: Tensor, v_t: Tensor) -> Tensor:
        ctx.save_for_backward(v_t)
        return softplus_exact(v_t).mean()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (v_t,) = ctx.saved_tensors
        n = v_t.numel()
        grad_v = (grad / n).expand(n) if ctx.needs_input_grad[0] else None
        grad_v_t = torch.sigmoid(v_t) * (grad / n) if ctx.needs_input_grad[1] else None
        return grad_v, grad_v_t


def flatnce_loss(
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
    """FlatNCE with InfoNCE's value; returns (loss, metrics) incl. "flatnce" (= 1.0 forward).

    ``logit_bias`` cancels in the margins (kept in the graph, gets a zero gradient).
    """
    b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
    with fp32_block(img_local.device):
        # (2b,) anchors of both directions; the mean over 2b averages the two directions.
        # "split": features <- FlatNCE gradient (through v), logit_scale <- InfoNCE's (through v_t)
        a = anchors(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias,
                    b, big_b, offset, scale_grad)
        loss = FlatObjective.apply(a.v, a.v_t)  # value: InfoNCE
        if scale_grad != "same" and a.bias is not None:  # cancels in the margins; kept in the
            loss = loss + 0.0 * a.bias  # graph (zero grad) for DDP
    # FlatNCE's own value, mean_i exp(v_i - v_i.detach()), is 1 by construction
    metrics = diagnostics_from_softmax(a.parts, a.t, extra={"loss": loss, "flatnce": 1.0})
    return loss, metrics
