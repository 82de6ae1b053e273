"""Diagnostics of a contrastive batch, logged with every loss (no gradient).

For anchor i (both directions, image->text and text->image, averaged over all 2b local anchors)
with margins d_ij = t * (s_ij - s_i,pos) over the B - 1 negatives j and v_i = logsumexp_j d_ij:

    infonce         mean log(1 + e^{v_i})                  (cross-entropy; = InfoNCE loss value)
    log_xi          mean v_i                               (log of the FlatNCE ratio xi_i = e^{v_i})
    grad_ratio      mean sigma(v_i)                        (|grad InfoNCE_i| / |grad FlatNCE_i|)
    frac_saturated  fraction with sigma(v_i) < 1e-3        (InfoNCE gradient has vanished)
    ess_neg         mean 1 / sum_j w_ij^2, w_i = softmax_j d_ij over negatives (1 .. B-1)
    acc             fraction whose positive beats every negative (ties count as misses)
    mi_nce          log B - infonce                        (InfoNCE bound on mutual information)
    mi_loo          log(B - 1) - log_xi                    (leave-one-out bound)
    logit_scale     t

Usage: ``diagnostics_from_logits(logits_i2t, logits_t2i, offset, t)``. The softmax losses pass
the softmax over the negatives they already computed (``diagnostics_from_softmax``), SigLIP its
logits (``diagnostics_from_logits``), so no matmul or softmax is repeated, and all
values reach the host in one transfer, made only when a value is looked at (a `DeviceScalars`:
the trainer reads them on logging steps only, so other steps make no host sync for them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from vlp.losses.common import (
    NegativeSoftmax,
    as_fp32,
    as_scalar,
    fp32_block,
    negative_softmax,
    positive_index,
    positive_mask,
    softplus_exact,
)

SATURATION_THRESHOLD = 1e-3  # sigma(v) below this: the InfoNCE gradient is effectively gone


class DeviceScalars(Mapping):
    """Named scalars kept as one tensor on the device; read back (one transfer, one host sync)
    the first time a value is looked at, as Python floats. ``host``: plain values beside them."""

    def __init__(self, names: list[str], values: Tensor, host: dict | None = None):
        self.names, self.tensor, self.host = list(names), values, dict(host or {})
        self._read: dict | None = None

    def plus(self, **host) -> "DeviceScalars":
        """The same device values with more host values (no transfer)."""
        return DeviceScalars(self.names, self.tensor, {**self.host, **host})

    def read(self) -> dict:
        if self._read is None:
            self._read = dict(zip(self.names, self.tensor.tolist()))
        return {**self._read, **self.host}

    def __getitem__(self, key):
        return self.host[key] if key in self.host else self.read()[key]

    def __contains__(self, key) -> bool:
        return key in self.host or key in self.names

    def __iter__(self):
        return iter(self.names + [k for k in self.host if k not in self.names])

    def __len__(self) -> int:
        return len(set(self.names) | set(self.host))


@torch.no_grad()
def diagnostics_from_softmax(
    directions: list[NegativeSoftmax],
    logit_scale: Tensor,
    extra: dict[str, Tensor | float] | None = None,
) -> "DeviceScalars":
    """Diagnostics from each direction's softmax over the negatives (what the softmax losses
    computed anyway: nothing (b, B)-sized is recomputed but exp(logp) for ess_neg)."""
    v = torch.cat([d.v for d in directions]).detach()  # (2b,)
    big_b = directions[0].logp.shape[1]
    device = v.device
    w_norm = [torch.linalg.vector_norm(torch.exp(d.logp), dim=1) for d in directions]
    sig = torch.sigmoid(v)
    infonce = softplus_exact(v).mean()  # log(1 + e^v) == cross-entropy
    log_xi = v.mean()
    t = as_scalar(logit_scale, device).detach().to(v.dtype)
    values = {
        "infonce": infonce,
        "log_xi": log_xi,
        "grad_ratio": sig.mean(),
        "frac_saturated": (sig < SATURATION_THRESHOLD).to(v.dtype).mean(),
        "ess_neg": torch.cat(w_norm).square().reciprocal().mean(),  # 1 / sum_j w_ij^2
        "acc": torch.cat([d.hit for d in directions]).to(v.dtype).mean(),
        "mi_nce": math.log(big_b) - infonce,
        "mi_loo": math.log(big_b - 1) - log_xi,
        "logit_scale": t,
    }
    for key, val in (extra or {}).items():
        values[key] = as_scalar(val, device).detach().to(v.dtype)
    return DeviceScalars(list(values), torch.stack(list(values.values())))  # read back when looked at


@torch.no_grad()
def diagnostics_from_logits(
    logits_i2t: Tensor,
    logits_t2i: Tensor,
    offset: int,
    logit_scale: Tensor,
    extra: dict[str, Tensor | float] | None = None,
) -> dict[str, float]:
    """Diagnostics from the two (b, B) logit matrices; ``extra`` scalars are appended to the dict.

    A logit bias in the logits has no effect (every statistic depends on margins only).
    """
    b, big_b = logits_i2t.shape
    device = logits_i2t.device
    pos_idx = positive_index(b, offset, device)
    pos_mask = positive_mask(b, big_b, offset, device)
    with fp32_block(device):
        directions = [negative_softmax(as_fp32(logits.detach()), pos_idx, pos_mask)
                      for logits in (logits_i2t, logits_t2i)]
        return diagnostics_from_softmax(directions, logit_scale, extra)
