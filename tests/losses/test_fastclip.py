"""FastCLIP-v3's loss: with gamma = 1 its gradients are the exact gradients of the objective
F = tau mean_i log g_i + tau rho (features and t) and its feature gradient is tau x SogCLR's; over
several steps with a moving average it matches the float64 reference of tests/support/naive_losses.py to
1e-12. (2 ranks, resume, sharding, the trainer: tests/losses/test_moving_average_losses.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from naive_losses import NaiveFastCLIP

from vlp.losses.fastclip import FastCLIPLoss
from vlp.losses.registry import get_spec
from vlp.losses.sogclr import SogCLRLoss

F64 = torch.float64


def features(n, seed, d=6):
    gen = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(n, d, generator=gen, dtype=F64), dim=-1).requires_grad_() for _ in range(2)]


def grads(loss, xs):
    return torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True)


def objective(img, txt, t, rho):
    """F over the whole batch, straight from the definition: g_i = mean_{j != i} exp(t d_ij)."""
    n = img.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    terms = []
    for rows, cols in ((img, txt), (txt, img)):
        sim = rows @ cols.T
        d = sim - sim.diagonal()[:, None]
        g = (torch.exp(t * d) * off).sum(dim=1) / (n - 1)
        terms.append(torch.log(g))
    return torch.cat(terms).mean() / t + rho / t


@pytest.mark.parametrize("rho", [0.0, 6.5])
def test_gamma_one_gives_the_exact_gradient_of_the_objective(rho):
    img, txt = features(8, seed=1)
    t = torch.tensor(11.0, dtype=F64, requires_grad=True)
    loss, metrics = FastCLIPLoss(8, gamma=1.0, rho=rho)(img, txt, img, txt, t, ids=torch.arange(8))
    ref = objective(img, txt, t, rho)
    for g, r in zip(grads(loss, [img, txt, t]), grads(ref, [img, txt, t])):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
    assert metrics["fastclip_objective"] == pytest.approx(ref.item(), abs=1e-12)
    assert metrics["loss"] == metrics["infonce"] == loss.item()  # the reported value: InfoNCE's


def test_feature_gradient_is_tau_times_sogclr():
    """Same u (gamma 0.4, two steps, ids reused): FastCLIP's feature gradient = SogCLR's / t."""
    sog, fast = SogCLRLoss(12, gamma=0.4), FastCLIPLoss(12, gamma=0.4)
    for step, ids in enumerate((torch.arange(6), torch.tensor([3, 4, 5, 6, 7, 8]))):
        img, txt = features(6, seed=10 + step)
        t = torch.tensor(7.0, dtype=F64, requires_grad=True)
        g_sog = grads(sog(img, txt, img, txt, t, ids=ids)[0], [img, txt])
        g_fast = grads(fast(img, txt, img, txt, t, ids=ids)[0], [img, txt])
        for a, b in zip(g_fast, g_sog):
            torch.testing.assert_close(a, b / 7.0, atol=1e-14, rtol=0)
        sog.commit()
        fast.commit()
    assert torch.equal(sog.log_u, fast.log_u)


def test_steps_match_the_float64_reference():
    """Five steps, a third of the ids seen before, gamma 0.3: loss and gradients (features and t)
    to 1e-12, u as the reference stores it."""
    fast, ref = FastCLIPLoss(20, gamma=0.3, rho=5.0), NaiveFastCLIP(gamma=0.3, rho=5.0)
    gen = torch.Generator().manual_seed(7)
    for step in range(5):
        img, txt = features(6, seed=20 + step)
        ids = torch.randperm(10, generator=gen)[:6]
        t = torch.tensor(6.0 + step, dtype=F64, requires_grad=True)
        loss, _ = fast(img, txt, img, txt, t, ids=ids)
        value, surrogate = ref.step(img, txt, t, ids)
        assert loss.item() == pytest.approx(value.item(), abs=1e-12)
        for g, r in zip(grads(loss, [img, txt, t]), grads(surrogate, [img, txt, t])):
            torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
        fast.commit()
    for (k, d), u in ref.log_u.items():
        assert fast.log_u[k, d].item() == u
    assert len(ref.log_u) == int(torch.isfinite(fast.log_u).sum())


def test_registry_entry_and_scale_grad():
    spec = get_spec("fastclip")
    assert spec.stateful and get_spec("fastclip").temperature == "learnable"
    img, txt = features(4, seed=0)
    with pytest.raises(ValueError, match="scale_grad"):
        FastCLIPLoss(4)(img, txt, img, txt, torch.tensor(5.0), scale_grad="split", ids=torch.arange(4))
    assert math.isclose(FastCLIPLoss(4, rho=2.5).rho, 2.5)
