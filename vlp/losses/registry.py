"""The loss registry: the one source of the loss names and of what each loss needs.

    spec = get_spec("sogclr")          # LossSpec: factory, state, default temperature, init
    loss = spec.build(cfg.loss, num_samples=n, total_steps=s)
    value, metrics = loss(img_l, txt_l, img_g, txt_g, t, bias, offset=o, scale_grad=g, ids=ids)
    loss.commit()                      # after each optimizer step (a collective for stateful losses)

Every built loss takes the stream's sample ids (``ids=``) and has ``commit()`` / ``discard()``;
a stateless one ignores them. Only a stateful loss has a checkpointed ``state_dict()``. The
config (loss.name's choices), the temperature policy (default mode, published init) and the
trainer read these entries and check no names of their own.

No torch at import: vlp.experiment checks configs with this module before torch is loaded.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

CLIP_TAU = 0.07  # CLIP (Radford et al. 2021): logit_scale starts at 1/0.07; iSogCLR's per-sample start


def resolve(target: str) -> Any:
    """The object a "module:attribute" target names (imported on first use)."""
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class LossSpec:
    name: str
    target: str  # "module:attribute": the loss function, or the stateful loss's class
    stateful: bool = False  # keeps per-sample state: committed after each step, checkpointed
    temperature: str = "learnable"  # the default temperature mode (vlp.losses.temperature)
    init: Optional[str] = None  # "module:function" -> the published (logit_scale, logit_bias) init
    factory: Optional[Callable] = None  # stateful: factory(cls, loss_cfg, num_samples, total_steps)

    def published_start(self) -> tuple[float, Optional[float]]:
        """(log t, logit_bias) the loss's paper starts from: its `init`, else CLIP's t = 1/0.07 and no bias."""
        if self.init is None:
            return math.log(1.0 / CLIP_TAU), None
        init = resolve(self.init)()
        return init.logit_scale, init.logit_bias

    def build(self, loss_cfg, num_samples: int, total_steps: int):
        """This run's loss callable (see the module docstring)."""
        if self.stateful:
            return self.factory(resolve(self.target), loss_cfg, num_samples, total_steps)
        return StatelessLoss(resolve(self.target))


class StatelessLoss:
    """A loss function with the built-loss interface: ``ids`` ignored, nothing to commit."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args, ids=None, **kwargs):
        return self.fn(*args, **kwargs)

    def commit(self) -> None:
        pass

    def discard(self) -> None:
        pass


def _sogclr(cls, loss_cfg, num_samples: int, total_steps: int):
    return cls(num_samples, loss_cfg.gamma, loss_cfg.gamma_min, loss_cfg.gamma_schedule, total_steps)


def _fastclip(cls, loss_cfg, num_samples: int, total_steps: int):
    return cls(num_samples, loss_cfg.gamma, loss_cfg.gamma_min, loss_cfg.gamma_schedule, total_steps,
               rho=loss_cfg.rho)


def _isogclr(cls, loss_cfg, num_samples: int, total_steps: int):
    start = {} if loss_cfg.tau is None else {"tau_init": loss_cfg.tau}  # unset: the loss's default
    rule = cls.Rule(**start, tau_lr=loss_cfg.tau_lr, tau_min=loss_cfg.tau_min, tau_max=loss_cfg.tau_max,
                    rho=loss_cfg.rho)
    return cls(num_samples, loss_cfg.gamma, loss_cfg.gamma_min, loss_cfg.gamma_schedule, total_steps, rule=rule)


REGISTRY: dict[str, LossSpec] = {spec.name: spec for spec in (
    LossSpec("infonce", "vlp.losses.infonce:infonce_loss"),
    LossSpec("flatnce", "vlp.losses.flatnce:flatnce_loss", temperature="split"),
    LossSpec("siglip", "vlp.losses.siglip:siglip_loss", init="vlp.losses.siglip:siglip_init"),
    LossSpec("sogclr", "vlp.losses.sogclr:SogCLRLoss", stateful=True, temperature="split", factory=_sogclr),
    LossSpec("dcl", "vlp.losses.dcl:dcl_loss", temperature="split"),
    LossSpec("fastclip", "vlp.losses.fastclip:FastCLIPLoss", stateful=True, factory=_fastclip),
    # per-sample temperatures in the loss's state; the model's logit_scale is unused: fixed
    LossSpec("isogclr", "vlp.losses.isogclr:ISogCLRLoss", stateful=True, temperature="fixed", factory=_isogclr),
)}
NAMES = tuple(REGISTRY)  # loss.name's choices (vlp.config)
STATELESS = tuple(name for name, spec in REGISTRY.items() if not spec.stateful)


def get_spec(name: str) -> LossSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid: {sorted(REGISTRY)}") from None


def get_loss(name: str) -> Callable:
    """The plain function of a stateless loss (the shared signature, no ``ids``)."""
    if name not in STATELESS:
        raise ValueError(f"unknown loss {name!r}; valid: {sorted(STATELESS)}"
                         + (" (a stateful loss: use get_spec(name).build)" if name in REGISTRY else ""))
    return resolve(REGISTRY[name].target)
