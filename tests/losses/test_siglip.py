"""SigLIP: parity with open_clip SigLipLoss (value and gradients) and a slow loop with offsets."""

from __future__ import annotations

import math
from pathlib import Path

import open_clip.loss as oc_loss
import pytest
import torch
import torch.nn.functional as F

from vlp.losses.siglip import siglip_init, siglip_loss

F64 = torch.float64


def unit(n: int, d: int, gen: torch.Generator, dtype=F64) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=gen, dtype=dtype), dim=-1).requires_grad_()


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F64, requires_grad=True)


def slow_siglip(img_l, txt_g, t, bias, offset):
    """-(1/b) sum_ij log sigmoid(z_ij (t s_ij + bias)), element by element."""
    b, big_b = img_l.shape[0], txt_g.shape[0]
    total = 0.0
    for i in range(b):
        for j in range(big_b):
            z = 1.0 if j == offset + i else -1.0
            logit = t * torch.dot(img_l[i], txt_g[j]) + bias
            total = total - torch.log(1.0 / (1.0 + torch.exp(-z * logit)))
    return total / b


@pytest.mark.parametrize("b,d", [(2, 3), (5, 8), (16, 32)])
@pytest.mark.parametrize("t_value,bias_value", [(10.0, -10.0), (1.0, 0.0), (100.0, -3.0)])
def test_matches_open_clip(b, d, t_value, bias_value):
    gen = torch.Generator().manual_seed(b + d)
    img, txt = unit(b, d, gen), unit(b, d, gen)
    t, bias = scalar(t_value), scalar(bias_value)
    leaves = [img, txt, t, bias]
    ours, metrics = siglip_loss(img, txt, img, txt, t, bias)
    ref = oc_loss.SigLipLoss()(img, txt, t, bias)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=0)
    assert metrics["siglip"] == metrics["loss"] == pytest.approx(ref.item(), abs=1e-9)
    assert metrics["logit_bias"] == bias_value and metrics["logit_scale"] == t_value


@pytest.mark.parametrize("b,big_b,offset", [(1, 2, 1), (3, 3, 0), (2, 6, 4)])
def test_matches_slow_loop_with_offset(b, big_b, offset):
    gen = torch.Generator().manual_seed(big_b)
    img_l, txt_l, img_g, txt_g = unit(b, 4, gen), unit(b, 4, gen), unit(big_b, 4, gen), unit(big_b, 4, gen)
    t, bias = scalar(7.0), scalar(-2.0)
    ours, _ = siglip_loss(img_l, txt_l, img_g, txt_g, t, bias, offset=offset)
    ref = slow_siglip(img_l, txt_g, t, bias, offset)
    used = [img_l, txt_g, t, bias]  # txt_l / img_g only feed the no-grad diagnostics
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, used), torch.autograd.grad(ref, used)):
        torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=0)


def test_no_bias_means_zero_bias():
    gen = torch.Generator().manual_seed(0)
    img, txt = unit(4, 5, gen), unit(4, 5, gen)
    t = scalar(10.0)
    no_bias, metrics = siglip_loss(img, txt, img, txt, t)
    zero_bias, _ = siglip_loss(img, txt, img, txt, t, torch.tensor(0.0, dtype=F64))
    torch.testing.assert_close(no_bias, zero_bias, atol=0, rtol=0)
    assert metrics["logit_bias"] == 0.0


def test_init_matches_open_clip_and_starts_every_pair_negative():
    """The bias is the one open_clip ships with its SigLIP models (an independent source), and
    with t = exp(logit_scale) every logit t * s + bias, |s| <= 1, starts at or below 0: each pair,
    even an identical one, is first predicted a negative, as the b^2 - b negatives outnumber the
    b positives (the point of the SigLIP init)."""
    import json

    import open_clip

    init = siglip_init()
    shipped = json.loads((Path(open_clip.__file__).parent / "model_configs" / "ViT-B-16-SigLIP.json").read_text())
    assert init.logit_bias == shipped["init_logit_bias"]
    largest_logit = math.exp(init.logit_scale) * 1.0 + init.logit_bias  # s = 1: identical features
    assert largest_logit <= 1e-9


def test_rejects_scale_grad_split():
    gen = torch.Generator().manual_seed(0)
    img, txt = unit(2, 3, gen), unit(2, 3, gen)
    with pytest.raises(ValueError, match="scale_grad"):
        siglip_loss(img, txt, img, txt, scalar(10.0), scalar(-10.0), scale_grad="split")


def test_fp32_inside_bf16_autocast():
    gen = torch.Generator().manual_seed(1)
    enc = torch.nn.Linear(8, 8)
    x_img, x_txt = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    t, bias = torch.tensor(10.0), torch.tensor(-10.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img, txt = F.normalize(enc(x_img), dim=-1), F.normalize(enc(x_txt), dim=-1)
        loss, _ = siglip_loss(img, txt, img, txt, t, bias)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    img32, txt32 = img.detach().float(), txt.detach().float()
    assert loss.item() == siglip_loss(img32, txt32, img32, txt32, t, bias)[0].item()
