"""Slow, obviously-correct contrastive losses over one whole batch: per-anchor Python loops in
float64, no gather, no offsets, no vlp code. The independent reference of the 2-rank and the
accumulation tests (which otherwise compare vlp's code with itself).

    value, surrogate = naive_loss("flatnce", "split", img, txt, t, bias)

``value`` is the loss the trainer reports; ``surrogate`` has the loss's gradient (FlatNCE's
value is InfoNCE's while its gradient is not, so the two differ there).
"""

from __future__ import annotations

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
    assert name == "flatnce"
    if scale_grad == "same":  # d/dv exp(v - v.detach()) = 1: FlatNCE's gradient is mean_i grad v_i
        return infonce, v.mean() + zero
    # split: the features get FlatNCE's gradient (t held), t gets InfoNCE's (features held)
    v_feat = both_directions(img, txt, t.detach())
    v_t = both_directions(img.detach(), txt.detach(), t)
    return infonce, v_feat.mean() + torch.log1p(torch.exp(v_t)).mean() + zero
