"""Contrastive losses with one call signature, each returning ``(loss, metrics)``.

    loss, metrics = get_loss(name)(img_local, txt_local, img_global, txt_global, logit_scale,
                                   logit_bias=None, offset=o, scale_grad="same")

img_local/txt_local (b, d) this rank's L2-normalised features; img_global/txt_global (B, d) the
gathered ones (vlp.distributed.gather_with_grad); logit_scale t already exponentiated; offset o the
global column of local row 0's positive (vlp.distributed.positive_offset). ``loss`` is the mean over
this rank's anchors (see vlp/distributed.py for why that is the right scale under DDP); ``metrics``
holds "loss" plus the diagnostics of vlp.losses.diagnostics as Python floats.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from vlp.losses.diagnostics import contrastive_diagnostics, diagnostics_from_logits
from vlp.losses.flatnce import flatnce_loss
from vlp.losses.infonce import infonce_loss
from vlp.losses.siglip import siglip_init, siglip_loss



class LossFn(Protocol):
    """The shared signature of every loss in LOSSES."""

    def __call__(
        self,
        img_local: Tensor,
        txt_local: Tensor,
        img_global: Tensor,
        txt_global: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None = None,
        *,
        offset: int = 0,
        scale_grad: str = "same",
    ) -> tuple[Tensor, dict[str, float]]: ...


LOSSES: dict[str, LossFn] = {
    "infonce": infonce_loss,
    "flatnce": flatnce_loss,
    "siglip": siglip_loss,
}


def get_loss(name: str) -> LossFn:
    """The loss function registered under ``name``; ValueError listing the valid names."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid: {sorted(LOSSES)}") from None


__all__ = [
    "LOSSES",
    "LossFn",
    "get_loss",
    "infonce_loss",
    "flatnce_loss",
    "siglip_loss",
    "siglip_init",
    "contrastive_diagnostics",
    "diagnostics_from_logits",
]
