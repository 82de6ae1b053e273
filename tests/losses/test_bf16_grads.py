"""bf16 autocast: every loss's gradients against the same loss in fp32, with stated tolerances.

The losses promise fp32 math under autocast (vlp.losses.common.fp32_block, as_fp32). Two checks:
- the gradient reaching bf16 features equals the fp32 loss's gradient up to bf16's own rounding
  of that gradient (8-bit mantissa: relative 2^-8 per rounding; two roundings, one per use of a
  feature as local row and as global column, give the bound 2^-7 of the largest entry);
- a whole step under autocast (bf16 encoder matmuls, fp32 loss) gives encoder and logit_scale
  gradients within 5 % (relative L2) of the fp32 step: the encoder's bf16 matmuls are the only
  difference. A loss computed in bf16 at t = 100 misses the first bound by far.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlp.losses.registry import get_loss

CASES = [("infonce", "same"), ("flatnce", "same"), ("flatnce", "split"), ("siglip", "same")]
FEATURE_TOL = 2.0 ** -7  # of max |grad|: two bf16 roundings of the gradient
STEP_TOL = 0.05  # relative L2 error of a whole bf16-autocast step's gradients


def _scale_bias(name: str, requires_grad: bool = True):
    t = torch.tensor(10.0 if name == "siglip" else 100.0, requires_grad=requires_grad)  # 100: the clamp
    bias = torch.tensor(-10.0, requires_grad=requires_grad) if name == "siglip" else None
    return t, bias


@pytest.mark.parametrize("name,scale_grad", CASES)
def test_feature_gradients_under_bf16_equal_the_fp32_loss(name, scale_grad):
    gen = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(16, 32, generator=gen), dim=-1).bfloat16()
    txt = F.normalize(torch.randn(16, 32, generator=gen), dim=-1).bfloat16()
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):
        i, x = img.to(dtype).requires_grad_(), txt.to(dtype).requires_grad_()
        t, bias = _scale_bias(name)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _ = get_loss(name)(i, x, i, x, t, bias, scale_grad=scale_grad)
        assert loss.dtype == torch.float32
        leaves = [i, x, t] + ([bias] if bias is not None else [])
        grads[dtype] = (loss.detach(), torch.autograd.grad(loss, leaves))
    (loss16, g16), (loss32, g32) = grads[torch.bfloat16], grads[torch.float32]
    assert loss16.item() == loss32.item()  # same values in, same fp32 math
    for a, b in zip(g16[:2], g32[:2]):  # features: bf16 gradients
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).abs().max().item() <= FEATURE_TOL * b.abs().max().item()
    for a, b in zip(g16[2:], g32[2:]):  # logit_scale / bias: fp32 leaves, exact
        assert a.item() == b.item()


@pytest.mark.parametrize("name,scale_grad", CASES)
def test_step_gradients_under_bf16_autocast_are_close_to_fp32(name, scale_grad):
    gen = torch.Generator().manual_seed(1)
    x_img, x_txt = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
    torch.manual_seed(0)
    enc_img, enc_txt = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    grads = {}
    for bf16 in (True, False):
        for p in [*enc_img.parameters(), *enc_txt.parameters()]:
            p.grad = None
        log_t = torch.tensor(4.6052 if name != "siglip" else 2.3026, requires_grad=True)
        _, bias = _scale_bias(name)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            img, txt = F.normalize(enc_img(x_img), dim=-1), F.normalize(enc_txt(x_txt), dim=-1)
            loss, _ = get_loss(name)(img, txt, img, txt, log_t.exp(), bias, scale_grad=scale_grad)
        loss.backward()
        grads[bf16] = [p.grad.clone() for p in [*enc_img.parameters(), *enc_txt.parameters()]] + [log_t.grad]
    for a, b in zip(grads[True], grads[False]):
        assert torch.isfinite(a).all()
        assert (a - b).norm().item() <= STEP_TOL * b.norm().item(), ((a - b).norm() / b.norm()).item()
