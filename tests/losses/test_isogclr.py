"""iSogCLR: with gamma = 1 its feature gradient and each sample's temperature gradient G_i are the
exact gradients of F = mean_i tau_i log g_i(tau_i) + tau_i rho; over several steps (temperatures
moving, clipped and clamped) it matches the float64 reference of tests/support/naive_losses.py to 1e-12.
(2 ranks, resume, sharding, the trainer: tests/losses/test_moving_average_losses.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from naive_losses import NaiveISogCLR

from vlp.losses.isogclr import MOMENTUM, ISogCLRLoss, TemperatureRule
from vlp.losses.registry import get_spec

F64 = torch.float64


def features(n, seed, d=6):
    gen = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(n, d, generator=gen, dtype=F64), dim=-1).requires_grad_() for _ in range(2)]


def grads(loss, xs):
    return torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True, retain_graph=True)


def objective(img, txt, tau, rho):
    """F over the whole batch from the definition; tau (n, 2) per sample and direction."""
    n = img.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    terms = []
    for k, (rows, cols) in enumerate(((img, txt), (txt, img))):
        sim = rows @ cols.T
        d = sim - sim.diagonal()[:, None]
        g = (torch.exp(d / tau[:, k:k + 1]) * off).sum(dim=1) / (n - 1)
        terms.append(tau[:, k] * torch.log(g) + tau[:, k] * rho)
    return torch.cat(terms).mean()


def test_gamma_one_gives_the_exact_gradients_of_the_objective():
    """One step from fresh state: features' gradient = dF/dw; the committed momentum
    m_i = beta G_i with G_i = 2n dF/dtau_i (F is a mean over 2n anchors), the new tau_i =
    tau_i - lr m_i; the model's logit_scale gets exactly 0."""
    n, rho = 8, 1.5
    img, txt = features(n, seed=2)
    rule = TemperatureRule(tau_init=0.125, tau_lr=0.01, tau_min=0.01, tau_max=1.0, rho=rho)
    iso = ISogCLRLoss(n, gamma=1.0, rule=rule)
    t = torch.tensor(3.0, dtype=F64, requires_grad=True)
    loss, metrics = iso(img, txt, img, txt, t, ids=torch.arange(n))
    tau = torch.full((n, 2), 0.125, dtype=F64, requires_grad=True)
    ref = objective(img, txt, tau, rho)
    for g, r in zip(grads(loss, [img, txt]), grads(ref, [img, txt])):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
    assert grads(loss, [t])[0].item() == 0.0
    iso.commit()
    g_tau = grads(ref, [tau])[0] * 2 * n
    assert g_tau.abs().max() < 5  # no clip in this case
    state = iso.state_dict()["state"]
    torch.testing.assert_close(state[:, 4:6].double(), MOMENTUM * g_tau, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state[:, 2:4].double(), 0.125 - 0.01 * MOMENTUM * g_tau, rtol=1e-6, atol=1e-7)
    assert metrics["isogclr_tau_mean"] == 0.125 and metrics["logit_scale"] == 8.0


def test_steps_match_the_float64_reference():
    """Six steps, ids reused, gamma 0.4: temperatures move (some clipped at |G| = 5, some at the
    tau bounds); loss and feature gradients to 1e-12 every step, the state as the reference keeps it."""
    rule = TemperatureRule(tau_init=0.1, tau_lr=0.02, tau_min=0.06, tau_max=0.2, rho=0.5)
    iso = ISogCLRLoss(20, gamma=0.4, rule=rule)
    ref = NaiveISogCLR(gamma=0.4, rho=0.5, tau_init=0.1, tau_lr=0.02, tau_min=0.06, tau_max=0.2)
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        img, txt = features(6, seed=30 + step)
        ids = torch.randperm(9, generator=gen)[:6]
        t = torch.tensor(5.0, dtype=F64, requires_grad=True)
        loss, _ = iso(img, txt, img, txt, t, ids=ids)
        value, surrogate = ref.step(img, txt, ids)
        assert loss.item() == pytest.approx(value.item(), abs=1e-12)
        for g, r in zip(grads(loss, [img, txt]), grads(surrogate, [img, txt])):
            torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
        iso.commit()
    state = iso.state_dict()["state"]
    for (k, d), u in ref.log_u.items():
        assert state[k, d].item() == u
        assert state[k, 2 + d].item() == ref.tau[k, d] and state[k, 4 + d].item() == ref.m[k, d]
    taus = torch.tensor(list(ref.tau.values()))
    assert len(set(taus.tolist())) > 4 and (taus == torch.tensor(0.06).float()).any()  # moved, some at a bound
    assert (torch.tensor(list(ref.m.values())).abs() > 2.4).any()  # some clipped gradients


def test_fresh_rows_and_refusals():
    iso = ISogCLRLoss(5, rule=TemperatureRule(tau_init=0.2))
    assert iso.state_dict()["state"].shape == (5, 6)
    with pytest.raises(ValueError, match="tau_min <= tau <= tau_max"):
        ISogCLRLoss(5, rule=TemperatureRule(tau_init=0.005))
    img, txt = features(4, seed=0)
    with pytest.raises(ValueError, match="scale_grad"):
        iso(img, txt, img, txt, torch.tensor(5.0), scale_grad="split", ids=torch.arange(4))
    spec = get_spec("isogclr")
    assert spec.stateful and get_spec("isogclr").temperature == "fixed"


def test_config_refuses_a_start_outside_the_bounds():
    from vlp.config import ConfigError
    from vlp.experiment import load_config

    with pytest.raises(ConfigError, match=r"loss.tau_min <= tau \(0.07\) <= loss.tau_max"):
        load_config(None, ["loss.name=isogclr", "loss.tau_min=0.1"])
    with pytest.raises(ConfigError, match="loss.tau_max"):
        load_config(None, ["loss.name=isogclr", "loss.tau=0.5", "loss.tau_max=0.3"])
    cfg = load_config(None, ["loss.name=isogclr", "loss.tau=0.05", "loss.tau_lr=0.001"])
    assert cfg.loss.temperature == "fixed" and (cfg.loss.tau_min, cfg.loss.tau_max, cfg.loss.rho) == (0.01, 1.0, 8.0)
