"""iSogCLR: the global contrastive objective with one learnable temperature per sample and
direction (Qiu et al. 2023, "Not All Semantics are Created Equal: Contrastive Self-supervised
Learning with Automatic Temperature Individualization", arXiv 2305.11965), optimised with
SogCLR's moving-average estimator (Yuan et al. 2022, arXiv 2202.12387).

Each anchor of either direction has its own temperature tau_i in [tau_min, tau_max], g_i is
estimated by SogCLR's moving average, and each tau_i takes a momentum step on its own clipped
gradient estimate G_i, as in the authors' CLIP code: the objective F, grad_w, G_i, the update of
m_i and tau_i, the first visit's values and the differences from the authors' code are
docs/losses.md's ("iSogCLR"). With gamma = 1 grad_w and G_i are the exact gradients of F
(tests/losses/test_isogclr.py).

State: per (sample, direction) log u, tau and m, sharded by owner rank as SogCLR's u
(vlp/losses/sharded.py). The temperatures are updated in ``commit()`` (after the optimizer step).
The model's logit_scale is not used by this loss (kept in the graph with a zero gradient). The
reported ``loss`` is InfoNCE's value at the per-sample temperatures; the metrics'
"logit_scale" is the anchors' mean 1/tau_i, "isogclr_tau_*" their spread.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from vlp.losses.common import (as_fp32, check_inputs, fp32_block, negative_lse_full, positive_index, positive_mask,
                               softplus_exact)
from vlp.losses.diagnostics import diagnostics_from_softmax
from vlp.losses.sharded import ShardedState, update_log_u
from vlp.losses.registry import CLIP_TAU

DEFAULT_TAU = CLIP_TAU  # CLIP's 0.07: every sample's temperature starts there when loss.tau is unset
MOMENTUM = 0.5  # beta of the temperatures' moving-average gradient (the authors' CLIP code)
GRAD_CLIP = 5.0  # |G_i| clip before the momentum (the authors' and FastCLIP's code)


class TemperatureRule(NamedTuple):
    """The per-sample temperatures' hyperparameters."""

    tau_init: float = DEFAULT_TAU
    tau_lr: float = 1e-4
    tau_min: float = 0.01
    tau_max: float = 1.0
    rho: float = 8.0


def per_sample_anchors(img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
                       tau: Tensor, offset: int) -> list:
    """Each direction's NegativeSoftmax (v differentiable) of logits (rows / tau_i) @ cols.T, tau
    (b, 2) the anchors' temperatures (column 0 image->text), and the direction's logits."""
    b, big_b = img_local.shape[0], img_global.shape[0]
    device = img_local.device
    pos_idx, pos_mask = positive_index(b, offset, device), positive_mask(b, big_b, offset, device)
    out = []
    for k, (rows, cols) in enumerate(((img_local, txt_global), (txt_local, img_global))):
        rows, cols = as_fp32(rows), as_fp32(cols)
        logits = (rows * (1.0 / tau[:, k:k + 1].to(rows.dtype))) @ cols.T
        out.append((negative_lse_full(logits, pos_idx, pos_mask), logits.detach()))
    return out


def temperature_gradient(parts: list, log_u: Tensor, w: Tensor, rho: float, offset: int) -> Tensor:
    """(b, 2) G_i = log u_i + rho - w_i E_{p_i}[L_ij - L_ip] from each direction's softmax over
    the negatives and logits L = d / tau (module docstring); no gradient."""
    cols = []
    for k, (soft, logits) in enumerate(parts):
        rows = torch.arange(logits.shape[0], device=logits.device)
        mean_margin = (torch.exp(soft.logp) * logits).sum(dim=1) - logits[rows, rows + offset]
        cols.append(mean_margin)
    return log_u + rho - w * torch.stack(cols, dim=1)


class ISogCLRLoss(ShardedState):
    """The stateful iSogCLR loss: the shared loss signature plus ``ids`` and ``commit()`` (see
    vlp.losses.sharded.ShardedState). Only scale_grad="same" (logit_scale is not used)."""

    NAME = "isogclr"
    Rule = TemperatureRule  # the registry's factory builds one from the config
    STATE_KEY = "state"  # (rows, 6): log u, tau, m, each (image->text, text->image)
    WIDTH = 6

    def __init__(self, num_samples: int, gamma: float = 0.9, gamma_min: Optional[float] = None,
                 schedule: str = "constant", total_steps: int = 1, *, rule: TemperatureRule = TemperatureRule(),
                 rank: Optional[int] = None, world_size: Optional[int] = None):
        if not 0 < rule.tau_min <= rule.tau_init <= rule.tau_max:
            raise ValueError(f"isogclr needs 0 < tau_min <= tau <= tau_max, got {rule.tau_min}, "
                             f"{rule.tau_init}, {rule.tau_max}")
        super().__init__(num_samples, gamma, gamma_min, schedule, total_steps, rank=rank, world_size=world_size)
        self.rule = rule

    def _start(self, old: Tensor, device) -> tuple[Tensor, Tensor, Tensor]:
        """(log u, tau, m) of the looked-up rows, each (b, 2) on ``device``; first visits get
        log u = -inf, tau_init, m = 0."""
        old = old.to(device)
        seen = torch.isfinite(old[:, :2])
        tau = torch.where(seen, old[:, 2:4], torch.full_like(old[:, 2:4], self.rule.tau_init))
        return old[:, :2], tau, torch.where(seen, old[:, 4:6], torch.zeros_like(old[:, 4:6]))

    def __call__(self, img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
                 logit_scale: Tensor, logit_bias: Tensor | None = None, *, offset: int = 0,
                 scale_grad: str = "same", ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad, ("same",))
        ids = self._check_ids(ids, b)
        device = img_local.device
        looked_up = self._lookup(ids, device)  # collective (world > 1)
        old_log_u, tau, m = self._start(looked_up.old, device)
        with fp32_block(device):
            parts = per_sample_anchors(img_local, txt_local, img_global, txt_global, tau, offset)
            v = torch.cat([p.v for p, _ in parts])  # (2b,) image->text rows first
            with torch.no_grad():
                log_g = torch.stack((v.detach() - math.log(big_b - 1)).split(b), dim=1)  # (b, 2)
                new_log_u = update_log_u(old_log_u.to(log_g.dtype), log_g, self.current_gamma)
                w = torch.exp(log_g - new_log_u)  # (b, 2): g_i / u_i
                grad_tau = temperature_gradient(parts, new_log_u, w, self.rule.rho, offset)
                new_m = (1 - MOMENTUM) * m + MOMENTUM * grad_tau.clamp(-GRAD_CLIP, GRAD_CLIP)
                new_tau = (tau - self.rule.tau_lr * new_m).clamp(self.rule.tau_min, self.rule.tau_max)
            loss = self._objective(v, (tau * w).T.reshape(-1).to(v.dtype), logit_scale, logit_bias)
        self._stage(looked_up, torch.cat([new_log_u.float(), new_tau.float(), new_m.float()], dim=1))
        inv_tau = (1.0 / tau).mean()
        metrics = diagnostics_from_softmax([p for p, _ in parts], inv_tau, extra={
            "loss": loss, "isogclr_weight": w.mean(), "isogclr_gamma": self.current_gamma,
            "isogclr_tau_mean": tau.mean(), "isogclr_tau_min": tau.min(), "isogclr_tau_max": tau.max()})
        return loss, metrics

    @staticmethod
    def _objective(v: Tensor, tau_w: Tensor, logit_scale, logit_bias) -> Tensor:
        """Value: InfoNCE's at the per-sample temperatures; gradient: mean_i tau_i w_i grad v_i.
        logit_scale (and bias) stay in the graph with a zero gradient (DDP)."""
        surrogate = (tau_w * v).mean()
        loss = surrogate - surrogate.detach() + softplus_exact(v.detach()).mean()
        for x in (logit_scale, logit_bias):
            if isinstance(x, Tensor) and x.requires_grad:
                loss = loss + 0.0 * x.reshape(())
        return loss
