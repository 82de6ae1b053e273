"""Slow, obviously-correct contrastive losses over one whole batch: per-anchor Python loops in
float64, no gather, no offsets, no vlp code. The independent reference of the 2-rank and the
accumulation tests (which otherwise compare vlp's code with itself).

    value, surrogate = naive_loss("flatnce", "split", img, txt, t, bias)
    ref = NaiveFastCLIP(gamma=0.5, rho=8.0); value, surrogate = ref.step(img, txt, t, ids)  # stateful
    ref = NaiveISogCLR(gamma=0.5, rho=8.0, tau_init=0.07, tau_lr=1e-3, tau_min=0.01, tau_max=1.0)

``value`` is the loss the trainer reports; ``surrogate`` has the loss's gradient (FlatNCE's
value is InfoNCE's while its gradient is not, so the two differ there). The stateful references
keep their per-sample state in dicts of Python floats, rounded to float32 as vlp stores it.
"""

from __future__ import annotations

import math

import torch


def negative_margins(rows: torch.Tensor, cols: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(n,) v_i = log sum_{j != i} exp(t * (r_i . c_j - r_i . c_i)): the positive of row i is column i."""
    n = rows.shape[0]
    out = []
    for i in range(n):
        pos = t * torch.dot(rows[i], cols[i])
        negs = torch.stack([t * torch.dot(rows[i], cols[j]) - pos for j in range(n) if j != i])
        out.append(torch.logsumexp(negs, dim=0))
    return torch.stack(out)


def both_directions(img, txt, t) -> torch.Tensor:
    """(2n,) the margins of image->text and text->image anchors."""
    return torch.cat([negative_margins(img, txt, t), negative_margins(txt, img, t)])


def naive_loss(name: str, scale_grad: str, img, txt, t, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(reported value, surrogate with the loss's gradient) over the whole batch (n pairs)."""
    zero = 0.0 * bias if bias is not None else 0.0  # bias: in the graph, no gradient (shift-invariant)
    if name == "siglip":
        n = img.shape[0]
        terms = [torch.nn.functional.logsigmoid((1.0 if i == j else -1.0) * (t * torch.dot(img[i], txt[j]) + bias))
                 for i in range(n) for j in range(n)]
        value = -torch.stack(terms).sum() / n  # every pair once, normalised by the n anchors
        return value, value
    v = both_directions(img, txt, t)
    infonce = torch.log1p(torch.exp(v)).mean()  # = cross-entropy with the positive
    if name == "infonce":
        return infonce, infonce + zero
    if name == "dcl":  # -log(e^{pos} / sum_{j != i} e^{neg_j}) = v_i; "split": t gets InfoNCE's gradient
        if scale_grad == "same":
            return v.mean(), v.mean() + zero
        v_feat = both_directions(img, txt, t.detach())
        v_t = both_directions(img.detach(), txt.detach(), t)
        return v.mean(), v_feat.mean() + torch.log1p(torch.exp(v_t)).mean() + zero
    assert name == "flatnce"
    if scale_grad == "same":  # d/dv exp(v - v.detach()) = 1: FlatNCE's gradient is mean_i grad v_i
        return infonce, v.mean() + zero
    # split: the features get FlatNCE's gradient (t held), t gets InfoNCE's (features held)
    v_feat = both_directions(img, txt, t.detach())
    v_t = both_directions(img.detach(), txt.detach(), t)
    return infonce, v_feat.mean() + torch.log1p(torch.exp(v_t)).mean() + zero


def fp32(x: float) -> float:
    """x rounded to float32, as vlp's per-sample tables store it."""
    return float(torch.tensor(x, dtype=torch.float32))


def moving_average(u_old, log_g: float, gamma: float) -> float:
    """log((1 - gamma) u + gamma g); a first visit (u_old None) starts at g."""
    if u_old is None:
        return log_g
    return math.log((1 - gamma) * math.exp(u_old) + gamma * math.exp(log_g))


class NaiveFastCLIP:
    """FastCLIP-v3 over the whole batch: F = tau mean_i log g_i + tau rho with u_i for g_i."""

    def __init__(self, gamma: float, rho: float):
        self.gamma, self.rho, self.log_u = gamma, rho, {}

    def step(self, img, txt, t, ids) -> tuple[torch.Tensor, torch.Tensor]:
        n = img.shape[0]
        v = both_directions(img, txt, t)  # (2n,) image->text anchors first
        keys = [(int(k), 0) for k in ids] + [(int(k), 1) for k in ids]
        new = [moving_average(self.log_u.get(key), float(vi) - math.log(n - 1), self.gamma)
               for key, vi in zip(keys, v.detach())]
        w = torch.tensor([math.exp(float(vi) - math.log(n - 1) - u) for vi, u in zip(v.detach(), new)],
                         dtype=v.dtype)
        surrogate = (w * v).mean() / t.detach() + (sum(new) / len(new) + self.rho) / t
        for key, u in zip(keys, new):
            self.log_u[key] = fp32(u)
        return torch.log1p(torch.exp(v)).mean(), surrogate


def per_sample_margins(rows, cols, taus):
    """(n,) v_i = log sum_{j != i} exp((r_i . c_j - r_i . c_i) / tau_i) and (n,) E_i = sum_j p_ij x_ij,
    p_i the softmax of x_ij = (r_i . c_j - r_i . c_i) / tau_i over j != i."""
    vs, es = [], []
    for i in range(rows.shape[0]):
        x = torch.stack([(torch.dot(rows[i], cols[j]) - torch.dot(rows[i], cols[i])) / taus[i]
                         for j in range(rows.shape[0]) if j != i])
        vs.append(torch.logsumexp(x, dim=0))
        es.append((torch.softmax(x.detach(), dim=0) * x.detach()).sum())
    return torch.stack(vs), torch.stack(es)


class NaiveISogCLR:
    """iSogCLR over the whole batch: per (sample, direction) u, tau and momentum m in dicts."""

    def __init__(self, gamma, rho, tau_init, tau_lr, tau_min, tau_max, beta=0.5, clip=5.0):
        self.gamma, self.rho, self.tau_init, self.tau_lr = gamma, rho, tau_init, tau_lr
        self.tau_min, self.tau_max, self.beta, self.clip = tau_min, tau_max, beta, clip
        self.log_u, self.tau, self.m = {}, {}, {}

    def step(self, img, txt, ids) -> tuple[torch.Tensor, torch.Tensor]:
        n = img.shape[0]
        keys = [[(int(k), d) for k in ids] for d in (0, 1)]
        taus = [[self.tau.get(key, fp32(self.tau_init)) for key in ks] for ks in keys]
        (v0, e0), (v1, e1) = per_sample_margins(img, txt, taus[0]), per_sample_margins(txt, img, taus[1])
        v, e = torch.cat([v0, v1]), torch.cat([e0, e1])
        keys, taus = keys[0] + keys[1], taus[0] + taus[1]
        terms, updates = [], []
        for key, vi, ei, tau in zip(keys, v, e, taus):
            log_g = float(vi.detach()) - math.log(n - 1)
            u = moving_average(self.log_u.get(key), log_g, self.gamma)
            w = math.exp(log_g - u)
            terms.append(tau * w * vi)
            grad = min(max(u + self.rho - w * float(ei), -self.clip), self.clip)
            m = (1 - self.beta) * self.m.get(key, 0.0) + self.beta * grad
            updates.append((key, u, min(max(tau - self.tau_lr * m, self.tau_min), self.tau_max), m))
        for key, u, tau, m in updates:
            self.log_u[key], self.tau[key], self.m[key] = fp32(u), fp32(tau), fp32(m)
        return torch.log1p(torch.exp(v)).mean(), torch.stack(terms).mean()
