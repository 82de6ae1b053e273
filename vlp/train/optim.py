"""Optimizers for `optim.name`: adamw | lars | sgd.

    optimizer = build_optimizer(param_groups(model, wd), cfg.optim, device_type)

The groups come from param_groups: group 0 holds biases, norms, gains and
logit_scale/bias (no weight decay), group 1 the weight matrices. LARS (You et al. 2017, as used by
SimCLR and FlatNCE) adapts and decays group 1 only; group 0 gets plain momentum SGD, which is the
SimCLR recipe's exclusion of biases and batch-norm parameters (here also LayerNorm and the
temperature).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def trust_ratio(weight_norm: Tensor, grad_norm: Tensor, weight_decay: float, eta: float) -> Tensor:
    """LARS's layer-wise factor eta * ||w|| / (||g|| + wd * ||w||); 1 when either norm is 0
    (a fresh zero-initialised layer, or no gradient), as in SimCLR's implementation."""
    ratio = eta * weight_norm / (grad_norm + weight_decay * weight_norm)
    return torch.where((weight_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a per-tensor trust ratio (SimCLR's LARS):

        g' = g + wd * w;  r = trust_ratio(||w||, ||g||, wd, eta)   (groups with adapt=True)
        v  = momentum * v + lr * r * g';  w = w - v

    Groups with ``adapt=False`` use r = 1 and no weight decay (biases, norms, logit_scale).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, adapt=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd = group["weight_decay"] if group["adapt"] else 0.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                scale = group["lr"]
                if group["adapt"]:
                    ratio = trust_ratio(torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad),
                                        wd, group["eta"])
                    grad = grad.add(p, alpha=wd) if wd else grad
                    grad = grad * ratio
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p)
                buf.mul_(group["momentum"]).add_(grad, alpha=scale)
                p.sub_(buf)
        return loss


def build_optimizer(groups: list[dict], cfg, device_type: str) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names over `groups` (param_groups: [no-decay, decay])."""
    if cfg.name == "adamw":
        # fused AdamW: one kernel over all parameters (1.3x end-to-end on CPU, BENCHMARKS.md)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 fused=device_type in ("cpu", "cuda"))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "lars":
        marked = [{**g, "adapt": g.get("weight_decay", 0.0) > 0 or i > 0} for i, g in enumerate(groups)]
        return LARS(marked, lr=cfg.lr, momentum=cfg.momentum, eta=cfg.trust_coefficient)
    raise ValueError(f"optim.name must be adamw, lars or sgd, got {cfg.name!r}")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases, norms, gains and logit_scale/bias (open_clip rule)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def optimizer_param_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in the order `param_groups` hands them to AdamW: name i is parameter i of
    a torch optimizer state dict (to load a replicated .pt checkpoint's optimizer under FSDP)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in param_groups(model, 0.0) for p in group["params"]]


def lr_multiplier(step: int, total: int, warmup: int, schedule: str, cooldown: int = 0) -> float:
    """LR factor at `step` (0-based): linear warmup, then cosine to 0 / constant / constant + linear cooldown."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "const-cooldown":
        start = total - cooldown
        return 1.0 if step < start else max(0.0, (total - step) / max(1, cooldown))
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """The LR schedule of `optim` (cfg: OptimConfig); ``position()`` -> (step, total steps) in
    steps of the current global batch, read at each scheduler step. Loaded from a checkpoint it
    keeps its place, and the optimizer and the schedule follow `cfg`, not the checkpoint's values
    (follow_config): the checkpointer loads it after the optimizer and the counters it reads."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, position):
        self.cfg = cfg  # not saved (state_dict): a resume follows this run's
        super().__init__(optimizer, lambda _: lr_multiplier(*position(), cfg.warmup_steps, cfg.schedule,
                                                            cfg.cooldown_steps))

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "cfg"}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        follow_config(self.optimizer, self, self.cfg)


def follow_config(optimizer: torch.optim.Optimizer, scheduler, cfg) -> None:
    """Make a resumed optimizer and LR schedule follow `cfg` (OptimConfig), not the checkpoint's
    values: optimizer.load_state_dict restores every group's lr, weight decay, betas, ... and the
    scheduler's state its base_lrs. Call after both loaded and samples_seen is restored (the LR
    lambda reads it): the next step uses the new peak lr at the schedule's current point. Groups
    follow `param_groups`: group 0 has no weight decay, the others cfg.weight_decay."""
    for i, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = cfg.lr
        if i > 0:
            group["weight_decay"] = cfg.weight_decay
        for name, value in (("betas", (cfg.beta1, cfg.beta2)), ("eps", cfg.eps), ("momentum", cfg.momentum),
                            ("eta", cfg.trust_coefficient)):
            if name in group:
                group[name] = value
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    lambdas = getattr(scheduler, "lr_lambdas", None) or [lambda _: 1.0] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
