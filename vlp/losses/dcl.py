"""DCL, the decoupled contrastive loss (Yeh et al. 2022, "Decoupled Contrastive Learning",
arXiv 2110.06848): InfoNCE with the positive taken out of the denominator.

DCL_i = logsumexp_{j != p} d_ij = v_i, so DCL's gradient is FlatNCE's exactly: DCL is FlatNCE's
gradient as a plain loss, with a value that moves (docs/losses.md, "DCL"). Cross-modal negatives
only (CLIP's two directions), as FlatNCE here.

``scale_grad`` as FlatNCE: "same", t gets DCL's own gradient mean_i E_w[s_ij - s_ip], which does
not calibrate a temperature; "split" (the default mode, vlp.losses.temperature), t gets
InfoNCE's. The reported ``loss`` is DCL's value; "infonce" is in the metrics as for every loss.
"""

from __future__ import annotations

from torch import Tensor

from vlp.losses.common import anchors, check_inputs, fp32_block
from vlp.losses.diagnostics import diagnostics_from_softmax
from vlp.losses.flatnce import FlatObjective


class _DecoupledObjective(FlatObjective):
    """Value mean_i v_i (DCL); the gradient is FlatObjective's: 1/n on every v_i and, when v_t
    needs it ("split"), InfoNCE's sigma(v_t,i)/n on v_t (v_t equals v in value)."""

    @staticmethod
    def forward(ctx, v: Tensor, v_t: Tensor) -> Tensor:
        ctx.save_for_backward(v_t)
        return v.mean()


def dcl_loss(
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
    """Symmetric DCL; returns (loss, metrics). ``logit_bias`` cancels in the margins (kept in the
    graph with a zero gradient)."""
    b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
    with fp32_block(img_local.device):
        a = anchors(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias,
                    b, big_b, offset, scale_grad)
        if scale_grad == "same":
            loss = a.v.mean()  # v carries the features' and t's gradient
        else:
            loss = _DecoupledObjective.apply(a.v, a.v_t)
            if a.bias is not None:
                loss = loss + 0.0 * a.bias  # cancels in the margins; kept in the graph for DDP
    metrics = diagnostics_from_softmax(a.parts, a.t, extra={"loss": loss})
    return loss, metrics
