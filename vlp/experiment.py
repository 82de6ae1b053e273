"""An experiment's config, checked against what vlp can build: the commands' loader.

    cfg = load_config("configs/demo.yaml", ["loss.name=flatnce", "data.batch_per_device=32"])

vlp.config declares the keys and checks each against its own rule, importing nothing above the
ground floor. What needs the registries (a loss name, the temperature policy of the loss section,
a `pypi:` tower) is checked here, by the layer that builds losses and models, before any work:
every command and every run of a study goes through `check`. Each problem is a ConfigError of
one line naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from vlp.config import Config, ConfigError, read_config
from vlp.config.rules import check_type, is_packaged
from vlp.losses import temperature
from vlp.losses.registry import CLIP_TAU, NAMES as LOSS_NAMES
from vlp.models import packaged


def check(cfg: Config) -> Config:
    """`cfg` with every key checked (Config.check_keys), the loss name, the temperature policy
    and the packaged towers checked against the registries, and an unset loss.temperature filled
    in with the mode it means. Returns `cfg` (changed in place)."""
    cfg.check_keys()
    check_type("loss.name", cfg.loss.name, Literal[LOSS_NAMES])
    try:
        policy = temperature.temperature_policy(cfg.loss)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    cfg.loss.temperature = policy.mode
    start = cfg.loss.tau if cfg.loss.tau is not None else CLIP_TAU
    if cfg.loss.name == "isogclr" and not cfg.loss.tau_min <= start <= cfg.loss.tau_max:
        raise ConfigError(f"config: loss.name=isogclr needs loss.tau_min <= tau ({start:g}) <= loss.tau_max, "
                          f"got [{cfg.loss.tau_min:g}, {cfg.loss.tau_max:g}]")
    for key, value in cfg.entries():
        why = packaged.problem(value) if key.rule.packaged and is_packaged(value) else None
        if why:
            raise ConfigError(f"config: {key.name}: {why}")
    return cfg


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                once: bool = False) -> Config:
    """YAML file (optional) + dotted overrides → a checked Config (vlp.config.read_config, then
    `check`); once: each key given once, the rule of a user's command line (parse_overrides)."""
    return check(read_config(path, overrides, once))
