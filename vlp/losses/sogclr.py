"""SogCLR / FastCLIP's global contrastive loss: FlatNCE with a per-sample moving-average normaliser
(Yuan et al. 2022, "Provable Stochastic Optimization for Global Contrastive Learning: Small Batch
Does Not Harm Performance", arXiv 2202.12387; Wei et al. 2024, FastCLIP, arXiv 2407.01445).

FlatNCE's gradient with anchor weights w_i = g_i / u_k, u_k the per-sample, per-direction moving
average of g_i (docs/losses.md, "SogCLR": the update, the state, the hyperparameters). u is kept
as log u (exp(v) overflows fp32 at t = 100); a sample seen for the first time starts at u = g_i
(w_i = 1), instead of SogCLR's u = 0 (w_i = 1/gamma on the first visit). The reported loss value
is InfoNCE's; ``scale_grad`` as FlatNCE.

State: sharded by owner rank (vlp/losses/sharded.py). ``load_state_dict`` also takes the
replicated ``{"log_u": (N, 2), "step"}`` of earlier releases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from vlp.losses.common import SCALE_GRAD_MODES, anchors, check_inputs, fp32_block, softplus_exact
from vlp.losses.diagnostics import diagnostics_from_softmax
from vlp.losses.sharded import ShardedState, ids_on, update_log_u


class _WeightedObjective(torch.autograd.Function):
    """Value mean_i log(1 + e^{v_t,i}) (InfoNCE). Gradient w_i / n on v_i (SogCLR's) and, when v_t
    needs it, InfoNCE's sigma(v_t,i) / n on v_t."""

    @staticmethod
    def forward(ctx, v: Tensor, v_t: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(v_t, w)
        return softplus_exact(v_t).mean()

    @staticmethod
    def backward(ctx, grad: Tensor):
        v_t, w = ctx.saved_tensors
        n = v_t.numel()
        grad_v = w * (grad / n) if ctx.needs_input_grad[0] else None
        grad_v_t = torch.sigmoid(v_t) * (grad / n) if ctx.needs_input_grad[1] else None
        return grad_v, grad_v_t, None


def moving_average_weights(v: Tensor, old_log_u: Tensor, b: int, big_b: int, gamma: float):
    """(new log u (b, 2), anchor weights w = g / u (2b,) in v's order) from the anchors' margins
    v (2b,; image->text rows first) and their old log u (b, 2); no gradient."""
    with torch.no_grad():
        log_g = v.detach() - math.log(big_b - 1)  # (2b,) log mean_j exp(d_ij)
        log_g = torch.stack(log_g.split(b), dim=1)  # (b, 2): column 0 image->text
        new = update_log_u(old_log_u.to(device=log_g.device, dtype=log_g.dtype), log_g, gamma)
        return new, torch.exp(log_g - new).T.reshape(-1)


class SogCLRLoss(ShardedState):
    """The stateful SogCLR loss: the shared loss signature plus ``ids`` (this rank's anchors'
    sample ids, int64), and ``commit()`` after each optimizer step.

        loss_fn = SogCLRLoss(num_samples, gamma=0.9, rank=rank, world_size=world)
        loss, metrics = loss_fn(img_b, txt_b, img_B, txt_B, t, offset=o, ids=ids_b)  # collective
        ...backward, optimizer.step()...
        loss_fn.commit()      # a collective under torch.distributed

    See vlp.losses.sharded.ShardedState for the state's rules (repeated calls, collectives).
    """

    SCALE_GRAD = SCALE_GRAD_MODES  # the scale_grad modes this loss accepts

    @property
    def log_u(self) -> Tensor:
        """(rows, 2) fp32 copy of this rank's shard, row k = sample rank + world * k (with one
        rank: the whole table, row = sample id); -inf where a sample was not seen yet."""
        return self.table.dense()

    def __call__(self, img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
                 logit_scale: Tensor, logit_bias: Tensor | None = None, *, offset: int = 0,
                 scale_grad: str = "same", ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad,
                                self.SCALE_GRAD)
        ids = self._check_ids(ids, b)
        device = img_local.device
        looked_up = self._lookup(ids, device)  # collective (world > 1)
        gamma = self.current_gamma
        with fp32_block(device):
            a = anchors(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias, b, big_b,
                        offset, scale_grad)
            new, w = moving_average_weights(a.v, looked_up.old, b, big_b, gamma)
            loss, extra = self.objective(a, w, new)
            if a.bias is not None and scale_grad != "same":
                loss = loss + 0.0 * a.bias  # cancels in the margins; kept in the graph for DDP
        self._stage(looked_up, new)
        metrics = diagnostics_from_softmax(a.parts, a.t, extra={
            "loss": loss, f"{self.NAME}_weight": w.mean(), f"{self.NAME}_weight_max": w.max(),
            f"{self.NAME}_gamma": gamma, **extra})
        return loss, metrics

    def objective(self, a, w: Tensor, new_log_u: Tensor) -> tuple[Tensor, dict]:
        """(loss, extra metrics) from the anchors ``a``, their weights w = g / u and new log u."""
        return _WeightedObjective.apply(a.v, a.v_t, w), {}

    def _load_replicated(self, state: Mapping) -> None:
        """This release's replicated table {"log_u": (num_samples, 2), "step"}."""
        log_u = state["log_u"]
        self._check_samples(log_u.shape[0])
        if log_u.shape != (self.num_samples, 2):
            raise ValueError(f"sogclr state of shape {tuple(log_u.shape)}, expected ({self.num_samples}, 2)")
        mine = ids_on(self.rank, self.world, self.num_samples)
        self.table.write(torch.arange(mine.numel()), log_u[mine])
