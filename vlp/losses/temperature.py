"""Temperature policy: the one place that decides how logit_scale (and SigLIP's logit_bias)
start, whether they train, which gradient they get and where they are clamped.

    policy = temperature_policy(cfg.loss)      # the one place it is decided
    # vlp.experiment.check: checks it (before torch) and fills in loss.temperature = policy.mode
    # build_model: init_log_scale, init_logit_bias, trainable; the model carries it (model.temperature)
    # the trainer reads model.temperature: scale_grad (every loss call), clamp_() after each step

The model stores log t (t = logit_scale = 1/tau) and returns t = exp(log t). The modes
(`loss.temperature`: learnable, fixed, split), their defaults and the initial values are
docs/design.md's ("Temperature policy") and vlp/config/keys.py's. A set `tau` always means
t = 1/tau; SigLIP keeps its bias init either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from vlp.losses.registry import REGISTRY, get_spec

# torch (and the losses, which need it) are imported inside the functions that use them:
# vlp.experiment checks configs with this module, and config errors must come before torch's import.
MIN_LOG_SCALE = 0.0  # t >= 1 (tau <= 1): open_clip's clamp keeps the temperature at most 1
MODES = ("learnable", "fixed", "split")
# FlatNCE-gradient losses (their t-gradient does not calibrate): the registry's "split" defaults
SPLIT_LOSSES = tuple(name for name, spec in REGISTRY.items() if spec.temperature == "split")


@dataclass(frozen=True)
class TemperaturePolicy:
    """Everything about logit_scale / logit_bias a LossConfig decides."""

    mode: str  # one of MODES
    init_log_scale: float  # log t at initialisation (and the fixed value in mode "fixed")
    init_logit_bias: Optional[float]  # SigLIP's bias at initialisation; None: the model has none
    trainable: bool  # whether log t is a trained parameter
    scale_grad: str  # the losses' `scale_grad`: "same" or "split" (see vlp/losses/flatnce.py)
    max_log_scale: float  # log t is clamped to [MIN_LOG_SCALE, max_log_scale] after each step

    def clamp_(self, log_scale) -> None:
        """Clamp the log-scale parameter in place (after the optimizer step, open_clip's rule)."""
        import torch

        with torch.no_grad():
            log_scale.clamp_(MIN_LOG_SCALE, self.max_log_scale)


def temperature_policy(loss_cfg) -> TemperaturePolicy:
    """Map a LossConfig (validated or not: an unset mode gets its default; vlp.config.from_dict
    reads an old mode name under its new one) to its policy; a LossConfig no policy fits (an
    unknown mode, split for a loss it does not apply to, an initial logit_scale above the clamp)
    is a one-line ValueError naming the keys.

    The one place the policy is decided: vlp.experiment.check calls it to check the
    section and fill in the mode, build_model applies it and hands it on with the model
    (`DualEncoder.temperature`), and the trainer reads it from there."""
    spec = get_spec(loss_cfg.name)  # the loss's default mode and published start
    published_log_scale, init_logit_bias = spec.published_start()
    mode = loss_cfg.temperature or spec.temperature
    if mode not in MODES:
        raise ValueError(f"loss.temperature must be one of {list(MODES)}, got {mode!r}")
    if mode == "split" and loss_cfg.name not in SPLIT_LOSSES:
        raise ValueError(f"loss.temperature=split only applies to loss.name={' or '.join(SPLIT_LOSSES)}")
    init_log_scale = math.log(1.0 / loss_cfg.tau) if loss_cfg.tau is not None else published_log_scale
    scale = math.exp(init_log_scale)
    if scale > loss_cfg.max_logit_scale * (1 + 1e-9):
        raise ValueError(f"loss.tau={loss_cfg.tau!r} gives initial logit_scale {scale:.4g} above "
                         f"loss.max_logit_scale={loss_cfg.max_logit_scale!r}: the clamp would change it silently; "
                         "raise loss.max_logit_scale or set tau")
    return TemperaturePolicy(
        mode=mode,
        init_log_scale=init_log_scale,
        init_logit_bias=init_logit_bias,
        trainable=mode != "fixed",
        scale_grad="split" if mode == "split" else "same",
        max_log_scale=math.log(loss_cfg.max_logit_scale),
    )
