"""SogCLR / FastCLIP's global contrastive loss: FlatNCE with a per-sample moving-average normaliser
(Yuan et al. 2022, "Provable Stochastic Optimization for Global Contrastive Learning: Small Batch
Does Not Harm Performance", arXiv 2202.12387; Wei et al. 2024, FastCLIP, arXiv 2407.01445).

For local anchor i (sample id k_i) in each direction, with margins d_ij = t * (s_ij - s_ip) over
the B - 1 gathered negatives (v_i = logsumexp_j d_ij, as in FlatNCE):

    g_i  = mean_j exp(d_ij) = exp(v_i) / (B - 1)
    u_k  <- (1 - gamma) * u_k + gamma * g_i          (per sample, per direction; kept across steps)
    grad = mean_i grad(g_i) / u_k = mean_i (g_i / u_k) * grad(v_i)

So SogCLR is FlatNCE (grad v_i) with anchor weights w_i = g_i / u_k: with gamma = 1, u_k = g_i and
w_i = 1 exactly, which is FlatNCE's gradient. A small gamma averages the normaliser over the
epochs, the estimate of the *global* (all-data) denominator that makes small batches unbiased.
u is kept as log u (exp(v) overflows fp32 at t = 100); a sample seen for the first time starts at
u = g_i (w_i = 1), instead of SogCLR's u = 0 (w_i = 1/gamma on the first visit).

The reported loss value is InfoNCE's (as FlatNCE); ``scale_grad`` as FlatNCE: "same" (t gets the
SogCLR surrogate's gradient) or "infonce" (t gets InfoNCE's gradient).

State: ``SogCLRLoss.log_u`` is a (num_samples, 2) table (image->text, text->image) indexed by the
stream's stable ``sample_id`` (global position of the sample in the shard list, independent of
world size, workers and epoch). It is replicated: each rank computes u for its local anchors, and
``commit()`` (once per optimizer step, after the step) all-gathers the (ids, log u) of the global
batch so every rank's table stays identical; memory num_samples x 2 x 4 bytes per rank. Saved in
checkpoints via ``state_dict()``; exact resume restores it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from vlp.losses.common import anchors, check_inputs, fp32_block, softplus_exact
from vlp.losses.diagnostics import diagnostics_from_softmax

GAMMA_SCHEDULES = ("constant", "cosine")


def gamma_at(step: int, total: int, gamma: float, gamma_min: float, schedule: str) -> float:
    """gamma at optimizer step ``step`` of ``total``: constant, or FastCLIP's cosine decay from
    ``gamma`` to ``gamma_min`` over the run (then ``gamma_min``)."""
    if schedule == "constant":
        return gamma
    progress = min(1.0, step / max(1, total))
    return gamma_min + (gamma - gamma_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def update_log_u(log_u_old: Tensor, log_g: Tensor, gamma: float) -> Tensor:
    """log((1 - gamma) u + gamma g) in the log domain; an unseen sample (log u = -inf) starts at g."""
    if gamma >= 1.0:
        return log_g.clone()
    mixed = torch.logaddexp(log_u_old + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isfinite(log_u_old), mixed, log_g)


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


def _all_gather(x: Tensor) -> Tensor:
    """Concatenation over ranks in rank order (no autograd); x itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


class SogCLRLoss:
    """The stateful SogCLR loss: the shared loss signature plus ``ids`` (this rank's anchors'
    sample ids), and ``commit()`` after each optimizer step.

        loss_fn = SogCLRLoss(num_samples, gamma=0.9)
        loss, metrics = loss_fn(img_b, txt_b, img_B, txt_B, t, offset=o, ids=ids_b)
        ...backward, optimizer.step()...
        loss_fn.commit()      # a collective under torch.distributed

    Calling it several times before ``commit`` (gradient accumulation recomputes the same
    anchors) reuses the same u: only the last call's update is committed.
    """

    def __init__(self, num_samples: int, gamma: float = 0.9, gamma_min: Optional[float] = None,
                 schedule: str = "constant", total_steps: int = 1):
        if schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"gamma schedule must be one of {GAMMA_SCHEDULES}, got {schedule!r}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.gamma, self.schedule, self.total_steps = gamma, schedule, total_steps
        self.gamma_min = gamma if gamma_min is None else gamma_min
        self.log_u = torch.full((num_samples, 2), float("-inf"))  # -inf: not seen yet
        self.step = 0
        self.pending: Optional[tuple[Tensor, Tensor]] = None

    @property
    def current_gamma(self) -> float:
        return gamma_at(self.step, self.total_steps, self.gamma, self.gamma_min, self.schedule)

    def __call__(self, img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
                 logit_scale: Tensor, logit_bias: Tensor | None = None, *, offset: int = 0,
                 scale_grad: str = "same", ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() != b:
            raise ValueError(f"sogclr needs one sample id per local anchor: {ids.numel()} ids for b={b}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.log_u.shape[0]):
            raise ValueError(f"sample ids must be in [0, {self.log_u.shape[0]}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        device = img_local.device
        gamma = self.current_gamma
        with fp32_block(device):
            v, v_t, parts, t, bias = anchors(img_local, txt_local, img_global, txt_global,
                                             logit_scale, logit_bias, b, big_b, offset, scale_grad)
            with torch.no_grad():
                log_g = v.detach() - math.log(big_b - 1)  # (2b,) log mean_j exp(d_ij)
                log_g = torch.stack(log_g.split(b), dim=1)  # (b, 2): column 0 image->text
                old = self.log_u[ids].to(device=device, dtype=log_g.dtype)
                new = update_log_u(old, log_g, gamma)
                w = torch.exp(log_g - new).T.reshape(-1)  # (2b,) in v's order: g_i / u_i
            loss = _WeightedObjective.apply(v, v_t, w)
            if bias is not None and scale_grad != "same":
                loss = loss + 0.0 * bias  # cancels in the margins; kept in the graph for DDP
        self.pending = (ids.to(device), new.detach().float())  # on the device: NCCL gathers there
        metrics = diagnostics_from_softmax(parts, t, extra={
            "loss": loss, "sogclr_weight": w.mean(), "sogclr_weight_max": w.max(), "sogclr_gamma": gamma})
        return loss, metrics

    def commit(self) -> None:
        """Write the last call's u into the table on every rank (all-gather), advance gamma's step.
        Call once per optimizer step that was taken; a skipped step calls ``discard()``."""
        if self.pending is None:
            raise RuntimeError("SogCLRLoss.commit() without a loss call since the last commit")
        ids, new = self.pending
        self.pending = None
        ids, new = _all_gather(ids), _all_gather(new)
        self.log_u[ids.cpu()] = new.cpu()
        self.step += 1

    def discard(self) -> None:
        """Forget the last call's update (a step skipped for a non-finite loss)."""
        self.pending = None

    def state_dict(self) -> dict:
        return {"log_u": self.log_u.clone(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        log_u = state["log_u"]
        if log_u.shape != self.log_u.shape:
            raise ValueError(f"sogclr state holds {tuple(log_u.shape)[0]} samples, this run's data "
                             f"{self.log_u.shape[0]}: resume needs the same training shards")
        self.log_u = log_u.clone().float()
        self.step = int(state["step"])
