"""Diagnostics on tiny matrices whose values are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vlp.losses.common import as_fp32, as_scalar, check_inputs, fp32_block, scaled_logits
from vlp.losses.diagnostics import diagnostics_from_logits
from vlp.losses.registry import STATELESS, get_loss

LOSSES = {name: get_loss(name) for name in STATELESS}  # the stateless losses by name

KEYS = {
    "infonce", "log_xi", "grad_ratio", "frac_saturated", "ess_neg", "acc", "mi_nce", "mi_loo",
    "logit_scale",
}


@torch.no_grad()
def contrastive_diagnostics(img_local, txt_local, img_global, txt_global, logit_scale, offset: int = 0) -> dict:
    """The diagnostics of (b, d) local and (B, d) gathered L2-normalised features: their scaled
    logits (t = logit_scale; the positive of local row i is column offset + i), read as the losses do."""
    check_inputs(img_local, txt_local, img_global, txt_global, offset, "same")
    with fp32_block(img_local.device):
        t = as_scalar(logit_scale, img_local.device)
        logits_i2t = scaled_logits(as_fp32(img_local), as_fp32(txt_global), t)
        logits_t2i = scaled_logits(as_fp32(txt_local), as_fp32(img_global), t)
    return diagnostics_from_logits(logits_i2t, logits_t2i, offset, t)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def check(got: dict, expected: dict, abs_tol: float = 1e-6) -> None:
    assert set(got) == KEYS and all(isinstance(v, float) for v in got.values())
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=abs_tol), key


def test_orthonormal_pairs():
    """s = I (2x2), t = 1: every anchor has one negative with d = -1, so v = -1."""
    eye = torch.eye(2)
    got = contrastive_diagnostics(eye, eye, eye, eye, torch.tensor(1.0), offset=0)
    check(got, {
        "infonce": softplus(-1), "log_xi": -1.0, "grad_ratio": sigmoid(-1), "frac_saturated": 0.0,
        "ess_neg": 1.0, "acc": 1.0, "mi_nce": math.log(2) - softplus(-1), "mi_loo": 1.0,
        "logit_scale": 1.0,
    })


def test_identical_features():
    """All s = 1 (B = 3): d = 0, v = log 2, uniform negatives, every positive ties (a miss)."""
    x = F.normalize(torch.ones(3, 4), dim=-1)
    got = contrastive_diagnostics(x, x, x, x, torch.tensor(50.0))
    check(got, {
        "infonce": math.log(3), "log_xi": math.log(2), "grad_ratio": 2 / 3, "frac_saturated": 0.0,
        "ess_neg": 2.0, "acc": 0.0, "mi_nce": 0.0, "mi_loo": 0.0, "logit_scale": 50.0,
    })


def test_one_local_row_with_offset():
    """b = 1, B = 3, offset 1, t = 2; image->text s = [0, 1, 1/sqrt2], text->image s = [0, 1, -1]."""
    r = 1 / math.sqrt(2)
    img_local, txt_local = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    txt_global = torch.tensor([[0.0, 1.0], [1.0, 0.0], [r, r]])
    img_global = torch.tensor([[0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]])
    got = contrastive_diagnostics(img_local, txt_local, img_global, txt_global, torch.tensor(2.0), offset=1)

    d1, d2 = [-2.0, 2 * (r - 1)], [-2.0, -4.0]  # margins t * (s_j - s_pos) over the negatives
    v = [math.log(sum(math.exp(x) for x in d)) for d in (d1, d2)]

    def ess(d):
        w = [math.exp(x) / sum(math.exp(y) for y in d) for x in d]
        return 1 / sum(x * x for x in w)

    infonce = (softplus(v[0]) + softplus(v[1])) / 2
    check(got, {
        "infonce": infonce, "log_xi": sum(v) / 2, "grad_ratio": (sigmoid(v[0]) + sigmoid(v[1])) / 2,
        "frac_saturated": 0.0, "ess_neg": (ess(d1) + ess(d2)) / 2, "acc": 1.0,
        "mi_nce": math.log(3) - infonce, "mi_loo": math.log(2) - sum(v) / 2, "logit_scale": 2.0,
    })


def test_saturated_at_the_clamp():
    """s = I, t = 100: v = -100, sigma(v) ~ 4e-44, the InfoNCE gradient has vanished."""
    eye = torch.eye(2)
    got = contrastive_diagnostics(eye, eye, eye, eye, torch.tensor(100.0))
    check(got, {
        "infonce": 0.0, "log_xi": -100.0, "grad_ratio": 0.0, "frac_saturated": 1.0, "ess_neg": 1.0,
        "acc": 1.0, "mi_nce": math.log(2), "mi_loo": 100.0, "logit_scale": 100.0,
    }, abs_tol=1e-5)


def test_mixed_anchors():
    """img = [e1, e2], txt = [e1, e1], t = 10: v = (0, 0) image->text, (-10, +10) text->image."""
    img, txt = torch.eye(2), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    got = contrastive_diagnostics(img, txt, img, txt, torch.tensor(10.0))
    infonce = (2 * math.log(2) + softplus(-10) + softplus(10)) / 4
    check(got, {
        "infonce": infonce, "log_xi": 0.0, "grad_ratio": 0.5, "frac_saturated": 0.25,
        "ess_neg": 1.0, "acc": 0.25, "mi_nce": math.log(2) - infonce, "mi_loo": 0.0,
    })


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_reports_the_diagnostics(name):
    gen = torch.Generator().manual_seed(0)
    img_g = F.normalize(torch.randn(6, 5, generator=gen), dim=-1)
    txt_g = F.normalize(torch.randn(6, 5, generator=gen), dim=-1)
    img_l, txt_l, t = img_g[2:4], txt_g[2:4], torch.tensor(8.0)
    loss, metrics = LOSSES[name](img_l, txt_l, img_g, txt_g, t, torch.tensor(-1.0), offset=2)
    expected = contrastive_diagnostics(img_l, txt_l, img_g, txt_g, t, offset=2)
    extra = {"infonce": {"loss"}, "flatnce": {"loss", "flatnce"}, "siglip": {"loss", "siglip", "logit_bias"},
             "dcl": {"loss"}}
    assert set(metrics) == KEYS | extra[name]
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6)
    for key in KEYS:
        assert metrics[key] == pytest.approx(expected[key], abs=1e-5), key
