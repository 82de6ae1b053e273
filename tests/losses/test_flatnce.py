"""FlatNCE: per-anchor gradient identity with InfoNCE, reported value, edge cases, scale_grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlp.losses.flatnce import flatnce_loss
from vlp.losses.infonce import infonce_loss
from vlp.losses.common import negative_lse_full, positive_index, positive_mask

F64 = torch.float64


def unit(n: int, d: int, gen: torch.Generator, dtype=F64) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=gen, dtype=dtype), dim=-1).requires_grad_()


def make_case(b, big_b, offset, t_value, seed, d=6):
    gen = torch.Generator().manual_seed(seed)
    leaves = [unit(b, d, gen), unit(b, d, gen), unit(big_b, d, gen), unit(big_b, d, gen)]
    leaves.append(torch.tensor(t_value, dtype=F64, requires_grad=True))
    return leaves


def anchor_logits(img_l, txt_l, img_g, txt_g, t):
    """The 2b anchors as rows: image->text rows then text->image rows, written out plainly."""
    return [t * img_l @ txt_g.T, t * txt_l @ img_g.T]


def grad(y, xs):
    """dy/dx for every x (zeros where x is unused), keeping the graph for the next anchor."""
    return torch.autograd.grad(y, xs, retain_graph=True, allow_unused=True, materialize_grads=True)


CASES = [(1, 2, 0), (2, 2, 0), (4, 4, 0), (3, 9, 6), (5, 10, 5)]


@pytest.mark.parametrize("b,big_b,offset", CASES)
@pytest.mark.parametrize("t_value", [1.0, 14.285714, 100.0])
def test_per_anchor_infonce_grad_is_sigmoid_v_times_flatnce_grad(b, big_b, offset, t_value):
    """For every anchor a: grad InfoNCE_a == sigma(v_a) * grad FlatNCE_a (float64, 1e-10)."""
    leaves = make_case(b, big_b, offset, t_value, seed=b + big_b)
    labels = positive_index(b, offset, torch.device("cpu"))
    mask = positive_mask(b, big_b, offset, torch.device("cpu"))
    for logits in anchor_logits(*leaves):
        ce = F.cross_entropy(logits, labels, reduction="none")  # (b,) independent of v
        v = negative_lse_full(logits, labels, mask).v  # (b,) the library's v
        torch.testing.assert_close(ce, torch.logaddexp(v, torch.zeros_like(v)), atol=1e-12, rtol=0)
        for i in range(b):
            g_info = grad(ce[i], leaves)
            g_flat = grad(torch.exp(v[i] - v[i].detach()), leaves)
            for gi, gf in zip(g_info, g_flat):
                torch.testing.assert_close(gi, torch.sigmoid(v[i]).detach() * gf, atol=1e-10, rtol=0)


@pytest.mark.parametrize("b,big_b,offset", CASES)
@pytest.mark.parametrize("t_value", [1.0, 30.0])
def test_loss_gradient_is_reweighted_infonce(b, big_b, offset, t_value):
    """grad flatnce_loss == mean_a grad CE_a / sigma(v_a), with sigma(v_a) = 1 - exp(-CE_a).

    The right side uses only per-row cross-entropy, so it checks the library end to end.
    """
    leaves = make_case(b, big_b, offset, t_value, seed=7 * b + big_b)
    loss, metrics = flatnce_loss(*leaves, offset=offset)
    got = torch.autograd.grad(loss, leaves)

    labels = torch.arange(b) + offset
    ce = torch.cat([F.cross_entropy(lg, labels, reduction="none") for lg in anchor_logits(*leaves)])
    expected = [torch.zeros_like(x) for x in leaves]
    for a in range(2 * b):
        grads = grad(ce[a], leaves)
        weight = 1.0 / (1.0 - torch.exp(-ce[a].detach())) / (2 * b)
        expected = [e + weight * g for e, g in zip(expected, grads)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-9)
    assert metrics["flatnce"] == 1.0


@pytest.mark.parametrize("scale_grad", ["same", "split"])
@pytest.mark.parametrize("b,big_b,offset", CASES)
def test_value_equals_infonce(scale_grad, b, big_b, offset):
    leaves = make_case(b, big_b, offset, 20.0, seed=3)
    flat, metrics = flatnce_loss(*leaves, offset=offset, scale_grad=scale_grad)
    info, _ = infonce_loss(*leaves, offset=offset)
    torch.testing.assert_close(flat, info, atol=1e-12, rtol=0)
    assert metrics["loss"] == pytest.approx(info.item(), abs=1e-12)
    assert metrics["flatnce"] == 1.0


@pytest.mark.parametrize("b,big_b,offset", CASES)
def test_scale_grad_infonce_splits_gradients(b, big_b, offset):
    """scale_grad="split": d/dt is InfoNCE's, d/dfeatures is FlatNCE's ("same" mode)."""
    leaves = make_case(b, big_b, offset, 12.0, seed=11)
    split, _ = flatnce_loss(*leaves, offset=offset, scale_grad="split")
    same, _ = flatnce_loss(*leaves, offset=offset, scale_grad="same")
    info, _ = infonce_loss(*leaves, offset=offset)
    g_split = torch.autograd.grad(split, leaves)
    g_same = torch.autograd.grad(same, leaves)
    g_info = torch.autograd.grad(info, leaves)
    for g, e in zip(g_split[:4], g_same[:4]):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_split[4], g_info[4], atol=1e-12, rtol=0)
    assert (g_same[4] - g_info[4]).abs() > 1e-6  # the two choices really differ here


def test_scale_grad_infonce_with_frozen_features():
    """Only the temperature trains (both towers locked): d/dt is still InfoNCE's."""
    leaves = make_case(3, 9, 6, 12.0, seed=5)
    frozen = [x.detach() for x in leaves[:4]] + [leaves[4]]
    split, _ = flatnce_loss(*frozen, offset=6, scale_grad="split")
    info, _ = infonce_loss(*frozen, offset=6)
    (g_split,) = torch.autograd.grad(split, [leaves[4]])
    (g_info,) = torch.autograd.grad(info, [leaves[4]])
    torch.testing.assert_close(g_split, g_info, atol=1e-12, rtol=0)


def _assert_finite(loss, leaves):
    assert torch.isfinite(loss)
    for g in torch.autograd.grad(loss, leaves):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("scale_grad", ["same", "split"])
def test_finite_edge_cases(scale_grad):
    t100 = torch.tensor(100.0, requires_grad=True)
    # B = 2
    leaves = make_case(2, 2, 0, 100.0, seed=5)
    loss, _ = flatnce_loss(*leaves, scale_grad=scale_grad)
    _assert_finite(loss, leaves)
    # identical features everywhere: all margins 0, v = log(B - 1)
    x = F.normalize(torch.ones(4, 3), dim=-1).requires_grad_()
    loss, metrics = flatnce_loss(x, x, x, x, t100, scale_grad=scale_grad)
    _assert_finite(loss, [x, t100])
    assert metrics["log_xi"] == pytest.approx(torch.log(torch.tensor(3.0)).item(), abs=1e-6)
    # saturated: t = 100 and perfectly separated pairs; InfoNCE's gradient vanishes, FlatNCE's not
    eye = torch.eye(4, requires_grad=True)
    loss, metrics = flatnce_loss(eye, eye, eye, eye, t100, scale_grad=scale_grad)
    _assert_finite(loss, [eye, t100])
    assert metrics["frac_saturated"] == 1.0
    (g_flat,) = torch.autograd.grad(flatnce_loss(eye, eye, eye, eye, t100)[0], [eye])
    (g_info,) = torch.autograd.grad(infonce_loss(eye, eye, eye, eye, t100)[0], [eye])
    assert g_flat.abs().max() > 1.0 and g_info.abs().max() < 1e-30


@pytest.mark.parametrize("scale_grad", ["same", "split"])
def test_finite_under_bf16_autocast(scale_grad):
    gen = torch.Generator().manual_seed(0)
    enc = torch.nn.Linear(8, 8)
    log_scale = torch.tensor(4.6052, requires_grad=True)  # t ~ 100, the clamp
    x_img, x_txt = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img, txt = F.normalize(enc(x_img), dim=-1), F.normalize(enc(x_txt), dim=-1)
        loss, metrics = flatnce_loss(img, txt, img, txt, log_scale.exp(), scale_grad=scale_grad)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(log_scale.grad)
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters())
    assert metrics["flatnce"] == 1.0
