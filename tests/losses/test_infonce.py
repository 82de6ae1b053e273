"""InfoNCE: parity with open_clip ClipLoss(local_loss=True, gather_with_grad=True) and a slow loop."""

from __future__ import annotations

import open_clip.loss as oc_loss
import pytest
import torch
import torch.nn.functional as F

from vlp.losses.infonce import infonce_loss

F64 = torch.float64


def unit(n: int, d: int, gen: torch.Generator, dtype=F64) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=gen, dtype=dtype), dim=-1).requires_grad_()


def slow_infonce(img_l, txt_l, img_g, txt_g, t, offset):
    """Cross-entropy written out element by element, both directions averaged."""
    b, big_b = img_l.shape[0], img_g.shape[0]
    total = 0.0
    for rows, cols in ((img_l, txt_g), (txt_l, img_g)):
        for i in range(b):
            scores = [t * torch.dot(rows[i], cols[j]) for j in range(big_b)]
            denom = sum(torch.exp(s) for s in scores)
            total = total - torch.log(torch.exp(scores[offset + i]) / denom)
    return total / (2 * b)


SHAPES = [(2, 3), (5, 8), (16, 32)]
SCALES = [1.0, 14.285714, 100.0]


@pytest.mark.parametrize("b,d", SHAPES)
@pytest.mark.parametrize("t_value", SCALES)
def test_matches_open_clip_single_process(b, d, t_value):
    gen = torch.Generator().manual_seed(b * 100 + d)
    img, txt = unit(b, d, gen), unit(b, d, gen)
    t = torch.tensor(t_value, dtype=F64, requires_grad=True)

    ours, metrics = infonce_loss(img, txt, img, txt, t)
    ref = oc_loss.ClipLoss(local_loss=True, gather_with_grad=True)(img, txt, t)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    for g_ours, g_ref in zip(
        torch.autograd.grad(ours, [img, txt, t]), torch.autograd.grad(ref, [img, txt, t])
    ):
        torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=0)
    assert metrics["loss"] == pytest.approx(ref.item(), abs=1e-9)
    assert metrics["infonce"] == pytest.approx(ref.item(), abs=1e-6)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_matches_open_clip_local_loss_with_offset(rank, monkeypatch):
    """Emulate rank `rank` of 3 in one process: open_clip's gather returns our global tensors."""
    world, b, d = 3, 4, 6
    gen = torch.Generator().manual_seed(rank)
    img_l, txt_l = unit(b, d, gen), unit(b, d, gen)
    img_g, txt_g = unit(world * b, d, gen), unit(world * b, d, gen)  # separate leaves
    t = torch.tensor(7.5, dtype=F64, requires_grad=True)
    monkeypatch.setattr(oc_loss, "gather_features", lambda *a, **k: (img_g, txt_g))

    ours, _ = infonce_loss(img_l, txt_l, img_g, txt_g, t, offset=rank * b)
    clip = oc_loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    ref = clip(img_l, txt_l, t)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    leaves = [img_l, txt_l, img_g, txt_g, t]
    for g_ours, g_ref in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("b,big_b,offset", [(1, 2, 1), (3, 3, 0), (2, 6, 4), (3, 9, 3)])
@pytest.mark.parametrize("t_value", [0.5, 20.0, 100.0])
def test_matches_slow_loop(b, big_b, offset, t_value):
    gen = torch.Generator().manual_seed(big_b + offset)
    img_l, txt_l, img_g, txt_g = unit(b, 5, gen), unit(b, 5, gen), unit(big_b, 5, gen), unit(big_b, 5, gen)
    t = torch.tensor(t_value, dtype=F64, requires_grad=True)
    leaves = [img_l, txt_l, img_g, txt_g, t]
    ours, _ = infonce_loss(img_l, txt_l, img_g, txt_g, t, offset=offset)
    ref = slow_infonce(img_l, txt_l, img_g, txt_g, t, offset)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=0)


def test_bias_changes_nothing_but_stays_in_graph():
    gen = torch.Generator().manual_seed(0)
    img, txt = unit(4, 8, gen), unit(4, 8, gen)
    t = torch.tensor(10.0, dtype=F64)
    bias = torch.tensor(-3.0, dtype=F64, requires_grad=True)
    with_bias, _ = infonce_loss(img, txt, img, txt, t, bias)
    without, _ = infonce_loss(img, txt, img, txt, t)
    torch.testing.assert_close(with_bias, without, atol=1e-12, rtol=0)
    (g_bias,) = torch.autograd.grad(with_bias, [bias])
    assert abs(g_bias.item()) < 1e-12


def test_fp32_inside_bf16_autocast():
    """Features from a bf16 autocast region: the loss is fp32 and equals the fp32 math exactly."""
    gen = torch.Generator().manual_seed(1)
    enc = torch.nn.Linear(8, 8)
    x_img, x_txt = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    t = torch.tensor(50.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img, txt = F.normalize(enc(x_img), dim=-1), F.normalize(enc(x_txt), dim=-1)
        assert img.dtype == torch.bfloat16
        loss, metrics = infonce_loss(img, txt, img, txt, t)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    img32, txt32 = img.detach().float(), txt.detach().float()
    ref, _ = infonce_loss(img32, txt32, img32, txt32, t)
    assert loss.item() == ref.item()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters())


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(2)
    img, txt = unit(3, 4, gen), unit(3, 4, gen)
    t = torch.tensor(1.0, dtype=F64)
    with pytest.raises(ValueError, match="offset"):
        infonce_loss(img, txt, img, txt, t, offset=1)
    with pytest.raises(ValueError, match="at least 2"):
        infonce_loss(img[:1], txt[:1], img[:1], txt[:1], t)
    with pytest.raises(ValueError, match="local features"):
        infonce_loss(img, txt[:2], img, txt, t)
    with pytest.raises(ValueError, match="scale_grad"):
        infonce_loss(img, txt, img, txt, t, scale_grad="bogus")

