"""FastCLIP-v3's loss: the global contrastive objective with a global learnable temperature
(RGCL-g), optimised with SogCLR's moving-average estimator (Wei et al. 2024, "FastCLIP: A Suite
of Optimization Techniques to Accelerate CLIP Training with Limited Resources", arXiv
2407.01445; the estimator of Yuan et al. 2022, arXiv 2202.12387; the robust temperature
objective of Qiu et al. 2023, arXiv 2305.11965).

F(w, tau) = tau * mean_i log g_i + tau * rho with tau = 1/t, minimised in the encoders and in
tau, g_i estimated by SogCLR's moving average (same state, sharding and gamma schedule): the
objective, its stochastic gradients and the hyperparameters are docs/losses.md's ("FastCLIP-v3").
They are the gradients of the surrogate S = (1/t.detach()) mean_i w_i v_i + (mean_i log u_i +
rho) / t with w_i = g_i / u_i and u_i detached: FastCLIP's own loss function; with gamma = 1 they
are the exact gradients of F (tests/losses/test_fastclip.py).

The temperature is the model's logit_scale (log t, clamped to [1, max_logit_scale], trained by
the run's optimizer): `loss.temperature` learnable (the default) or fixed. The reported ``loss``
is InfoNCE's value; "fastclip_objective" is the estimate tau * (mean_i log u_i + rho) of F.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from vlp.losses.common import softplus_exact
from vlp.losses.sogclr import SogCLRLoss

DEFAULT_RHO = 8.0  # FastCLIP's default rho (its FastCLIPLoss)


class FastCLIPLoss(SogCLRLoss):
    """SogCLR's stateful loss with FastCLIP-v3's objective; the same state (log u, sharded),
    ``commit`` and checkpoints. Only scale_grad="same": t gets this objective's gradient."""

    NAME = "fastclip"
    SCALE_GRAD = ("same",)

    def __init__(self, num_samples: int, gamma: float = 0.9, gamma_min: Optional[float] = None,
                 schedule: str = "constant", total_steps: int = 1, *, rho: float = DEFAULT_RHO,
                 rank: Optional[int] = None, world_size: Optional[int] = None):
        super().__init__(num_samples, gamma, gamma_min, schedule, total_steps, rank=rank, world_size=world_size)
        self.rho = float(rho)

    def objective(self, a, w: Tensor, new_log_u: Tensor) -> tuple[Tensor, dict]:
        """Value: InfoNCE's; gradient: the surrogate S's (module docstring)."""
        t = a.t
        tail = new_log_u.mean() + self.rho  # mean over this rank's 2b anchors; DDP averages ranks
        surrogate = (w * a.v).mean() / t.detach() + tail / t
        value = softplus_exact(a.v.detach()).mean()
        loss = surrogate - surrogate.detach() + value  # surrogate - surrogate.detach() == 0 exactly
        return loss, {"fastclip_objective": tail / t.detach()}
