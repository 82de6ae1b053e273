"""Contrastive losses with one call signature, each returning ``(loss, metrics)``.

    loss, metrics = get_loss(name)(img_local, txt_local, img_global, txt_global, logit_scale,
                                   logit_bias=None, offset=o, scale_grad="same")

img_local/txt_local (b, d) this rank's L2-normalised features; img_global/txt_global (B, d) the
gathered ones (vlp.distributed.gather_with_grad); logit_scale t already exponentiated; offset o the
global column of local row 0's positive (vlp.distributed.positive_offset). ``loss`` is the mean over
this rank's anchors (see vlp/distributed.py for why that is the right scale under DDP); ``metrics``
holds "loss" plus the diagnostics of vlp.losses.diagnostics as Python floats.

The names, and what each loss needs, are vlp.losses.registry's (the one source); the
functions are imported on first use, so `import vlp.losses.registry` (vlp.config) loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from vlp.losses.registry import NAMES, REGISTRY, STATELESS, LossSpec, build_loss, get_loss, get_spec

if TYPE_CHECKING:
    from torch import Tensor


class LossFn(Protocol):
    """The shared signature of every stateless loss in LOSSES."""

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


_LAZY = {
    "infonce_loss": "vlp.losses.infonce",
    "flatnce_loss": "vlp.losses.flatnce",
    "dcl_loss": "vlp.losses.dcl",
    "siglip_loss": "vlp.losses.siglip",
    "siglip_init": "vlp.losses.siglip",
    "contrastive_diagnostics": "vlp.losses.diagnostics",
    "diagnostics_from_logits": "vlp.losses.diagnostics",
}


def __getattr__(name: str) -> Any:
    """The loss functions (and ``LOSSES``, name -> function of the stateless losses), on first use."""
    if name == "LOSSES":
        return {n: get_loss(n) for n in STATELESS}
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOSSES", "NAMES", "REGISTRY", "LossFn", "LossSpec", "build_loss", "get_loss", "get_spec",
    *_LAZY,
]
