"""DCL: its gradient is FlatNCE's exactly (both scale_grad modes), its value is mean_i v_i, and it
matches the float64 per-anchor reference of tests/support/naive_losses.py to 1e-12. (2 ranks == 1 rank and
the naive reference under DDP: tests/train/test_distributed.py; accumulation: tests/train/test_trainer_accum.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from naive_losses import both_directions, naive_loss

from vlp.losses.dcl import dcl_loss
from vlp.losses.flatnce import flatnce_loss
from vlp.losses.infonce import infonce_loss
from vlp.losses.registry import get_loss
from vlp.losses.registry import get_spec

F64 = torch.float64


def leaves(b, big_b, seed, d=6, t=9.0):
    gen = torch.Generator().manual_seed(seed)
    out = [F.normalize(torch.randn(n, d, generator=gen, dtype=F64), dim=-1).requires_grad_()
           for n in (b, b, big_b, big_b)]
    return out + [torch.tensor(t, dtype=F64, requires_grad=True), torch.tensor(-3.0, dtype=F64, requires_grad=True)]


def grads(loss, xs):
    return torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True, retain_graph=True)


@pytest.mark.parametrize("scale_grad", ["same", "split"])
@pytest.mark.parametrize("b,big_b,offset", [(4, 4, 0), (3, 9, 6), (1, 2, 1), (5, 15, 5)])
def test_gradient_is_flatnce_gradient_value_is_mean_v(scale_grad, b, big_b, offset):
    xs = leaves(b, big_b, seed=b + big_b)
    dcl, dm = dcl_loss(*xs, offset=offset, scale_grad=scale_grad)
    flat, _ = flatnce_loss(*xs, offset=offset, scale_grad=scale_grad)
    for g_dcl, g_flat in zip(grads(dcl, xs), grads(flat, xs)):
        torch.testing.assert_close(g_dcl, g_flat, atol=1e-13, rtol=0)
    assert dcl.item() == pytest.approx(dm["log_xi"], abs=1e-13)  # mean_i v_i, the diagnostics' log xi
    assert dm["loss"] == dcl.item() and dm["infonce"] == pytest.approx(flat.item(), abs=1e-13)


@pytest.mark.parametrize("scale_grad", ["same", "split"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_float64_reference(scale_grad, with_bias):
    """The whole batch on one rank (b = B) against per-anchor Python loops: value and every
    gradient (features, t, bias) to 1e-12."""
    img, txt, _, _, t, bias = leaves(7, 7, seed=3)
    bias = bias if with_bias else None
    loss, _ = dcl_loss(img, txt, img, txt, t, bias, scale_grad=scale_grad)
    value, surrogate = naive_loss("dcl", scale_grad, img, txt, t, bias)
    assert loss.item() == pytest.approx(value.item(), abs=1e-12)
    xs = [img, txt, t] + ([bias] if with_bias else [])
    for g, ref in zip(grads(loss, xs), grads(surrogate, xs)):
        torch.testing.assert_close(g, ref, atol=1e-12, rtol=0)


def test_infonce_gradient_is_dcl_gradient_damped_by_sigma():
    """Per anchor: grad InfoNCE_i = sigma(v_i) grad DCL_i (the coupling DCL removes)."""
    img, txt, _, _, t, _ = leaves(5, 5, seed=4)
    v = both_directions(img, txt, t)
    for i in (0, 3, 7):
        g_dcl = grads(v[i], [img, txt])
        g_nce = grads(torch.log1p(torch.exp(v[i])), [img, txt])
        for a, c in zip(g_nce, g_dcl):
            torch.testing.assert_close(a, torch.sigmoid(v[i]) * c, atol=1e-13, rtol=0)
    loss, _ = infonce_loss(img, txt, img, txt, t)
    assert loss.item() == pytest.approx(torch.log1p(torch.exp(v)).mean().item(), abs=1e-12)


def test_registry_entry():
    fn = get_loss("dcl")
    assert fn is dcl_loss and fn.__module__ == "vlp.losses.dcl"
    assert not get_spec("dcl").stateful and get_spec("dcl").temperature == "split"
