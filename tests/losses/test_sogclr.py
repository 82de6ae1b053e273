"""SogCLR: gamma = 1 is FlatNCE, the moving average on a hand case, 2 ranks = 1 rank, state size,
exact resume through the trainer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vlp.losses.flatnce import flatnce_loss
from vlp.losses.sharded import gamma_at, update_log_u
from vlp.losses.sogclr import SogCLRLoss

F64 = torch.float64


def leaves(b, big_b, seed, d=6, t=14.0):
    gen = torch.Generator().manual_seed(seed)
    out = [F.normalize(torch.randn(n, d, generator=gen, dtype=F64), dim=-1).requires_grad_()
           for n in (b, b, big_b, big_b)]
    return out + [torch.tensor(t, dtype=F64, requires_grad=True)]


def grads(loss, xs):
    return torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("scale_grad", ["same", "other"])
@pytest.mark.parametrize("b,big_b,offset", [(4, 4, 0), (3, 9, 6), (1, 2, 0)])
def test_gamma_one_is_flatnce_exactly(scale_grad, b, big_b, offset):
    """gamma = 1: u_i = g_i, every weight g_i / u_i is 1.0, so value and all gradients equal
    FlatNCE's bit for bit, on a fresh table and on one that has seen the samples before."""
    from vlp.losses.common import SCALE_GRAD_MODES

    mode = "same" if scale_grad == "same" else [m for m in SCALE_GRAD_MODES if m != "same"][0]
    sog = SogCLRLoss(num_samples=20, gamma=1.0)
    ids = torch.tensor([7, 3, 11, 0][:b])
    for step in range(2):
        xs = leaves(b, big_b, seed=step)
        ref, ref_m = flatnce_loss(*xs, offset=offset, scale_grad=mode)
        out, m = sog(*xs, offset=offset, scale_grad=mode, ids=ids)
        assert out.item() == ref.item()
        for g, r in zip(grads(out, xs), grads(ref, xs)):
            assert torch.equal(g, r)
        assert m["sogclr_weight"] == 1.0 and m["infonce"] == ref_m["infonce"]
        sog.commit()


def test_moving_average_on_a_hand_case():
    """u <- (1 - gamma) u + gamma g with g = exp(v) / (B - 1); weight g / u; first visit u = g."""
    assert update_log_u(torch.tensor([math.log(2.0)]), torch.tensor([math.log(4.0)]), 0.5).exp().item() \
        == pytest.approx(3.0, rel=1e-12)
    assert update_log_u(torch.tensor([-math.inf]), torch.tensor([1.5]), 0.1).item() == 1.5
    sog = SogCLRLoss(num_samples=4, gamma=0.5)
    # B = 2, d = 2: one negative per anchor, so g_i = exp(t (s_neg - s_pos)) exactly
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    txt1 = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=F64)
    txt2 = torch.tensor([[0.8, 0.6], [0.0, 1.0]], dtype=F64)
    t = torch.tensor(2.0, dtype=F64)
    ids = torch.tensor([2, 0])

    def g_i2t(txt):  # anchor i (image), negative column 1 - i
        s = img @ txt.T
        return torch.exp(t * torch.stack([s[0, 1] - s[0, 0], s[1, 0] - s[1, 1]]))

    sog(img, img, txt1, txt1, t, ids=ids)  # local = global here (one rank): rows = columns
    sog.commit()
    torch.testing.assert_close(sog.log_u[ids, 0].double().exp(), g_i2t(txt1), rtol=1e-6, atol=0)
    _, m = sog(img, txt2, img, txt2, t, ids=ids)
    u = 0.5 * g_i2t(txt1) + 0.5 * g_i2t(txt2)
    w = g_i2t(txt2) / u
    sog.commit()
    torch.testing.assert_close(sog.log_u[ids, 0].double().exp(), u, rtol=1e-6, atol=0)
    assert torch.isinf(sog.log_u[[1, 3]]).all()  # unseen samples stay unset
    assert sog.state_dict()["log_u"].shape == (4, 2)  # samples x 2 directions
    assert m["sogclr_weight_max"] >= w.max().item() - 1e-9  # (both directions' max)


def test_cosine_gamma_schedule():
    assert gamma_at(0, 100, 0.9, 0.2, "cosine") == pytest.approx(0.9)
    assert gamma_at(50, 100, 0.9, 0.2, "cosine") == pytest.approx(0.55)
    assert gamma_at(100, 100, 0.9, 0.2, "cosine") == pytest.approx(0.2)
    assert gamma_at(300, 100, 0.9, 0.2, "cosine") == pytest.approx(0.2)
    assert gamma_at(50, 100, 0.9, 0.2, "constant") == 0.9


def test_state_round_trip_and_refusals():
    sog = SogCLRLoss(num_samples=6, gamma=0.3)
    xs = leaves(3, 3, seed=1)
    sog(*xs, ids=torch.tensor([5, 1, 2]))
    sog.commit()
    other = SogCLRLoss(num_samples=6, gamma=0.3)
    other.load_state_dict(sog.state_dict())
    assert torch.equal(other.log_u, sog.log_u) and other.step == 1
    with pytest.raises(ValueError, match="same training shards"):
        SogCLRLoss(num_samples=7).load_state_dict(sog.state_dict())
    with pytest.raises(ValueError, match="sample ids"):
        sog(*xs, ids=torch.tensor([5, 1, 6]))


def _two_rank_worker(rank, world, img, txt, ids, steps):
    from vlp.distributed import gather_with_grad

    sog = SogCLRLoss(num_samples=32, gamma=0.4)
    b = img.shape[1] // world
    out = []
    for s in range(steps):
        il = img[s, rank * b:(rank + 1) * b].clone().requires_grad_()
        tl = txt[s, rank * b:(rank + 1) * b].clone().requires_grad_()
        t = torch.tensor(10.0, dtype=F64, requires_grad=True)
        loss, _ = sog(il, tl, gather_with_grad(il), gather_with_grad(tl), t, offset=rank * b,
                      ids=ids[s, rank * b:(rank + 1) * b])
        loss.backward()
        sog.commit()
        out.append((il.grad, tl.grad))
    return {"grads": out, "log_u": sog.log_u, "state": sog.state_dict()}


@pytest.mark.multiproc
def test_two_ranks_equal_one_rank():
    """The table after 3 steps (the 2 ranks' shards put together) equals one rank's; each rank's
    feature gradient is twice (all_gather's backward sums the 2 ranks' mean losses) the rows of
    one rank's gradient of the global mean loss."""
    from dist_utils import run_distributed

    gen = torch.Generator().manual_seed(0)
    steps, big_b = 3, 8
    img = F.normalize(torch.randn(steps, big_b, 5, generator=gen, dtype=F64), dim=-1)
    txt = F.normalize(torch.randn(steps, big_b, 5, generator=gen, dtype=F64), dim=-1)
    ids = torch.stack([torch.randperm(32, generator=gen)[:big_b] for _ in range(steps)])
    ranks = run_distributed(_two_rank_worker, 2, args=(img, txt, ids, steps))
    one = _two_rank_worker(0, 1, img, txt, ids, steps)
    whole = SogCLRLoss(num_samples=32, rank=0, world_size=1)
    whole.load_state_dict([r["state"] for r in ranks])  # each rank holds the samples id % 2 == rank
    torch.testing.assert_close(whole.log_u, one["log_u"], rtol=1e-6, atol=0)
    for s in range(steps):
        for r in range(2):
            for g, g1 in zip(ranks[r]["grads"][s], one["grads"][s]):
                torch.testing.assert_close(g, 2 * g1[r * 4:(r + 1) * 4], rtol=1e-9, atol=1e-12)


def test_trainer_resume_restores_u_exactly(tiny_shards, tmp_path):
    """A sogclr run resumed from its step-10 checkpoint ends with the same table and weights as the
    uninterrupted run (bit-identical on CPU); the table is samples x 2 and was filled."""
    from vlp_testing import REPO
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    def cfg(out, *extra):
        return load_config(REPO / "configs/demo.yaml", [
            f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={out}",
            "model.name=vlp-micro", "data.batch_per_device=16", "data.shuffle_buffer=64", "loss.name=sogclr",
            "loss.gamma=0.5", "loss.gamma_schedule=cosine", "train.samples=320", "train.checkpoint_every=10",
            "train.keep_last=0", "train.log_every=5", *extra])

    full = Trainer(cfg(tmp_path / "full"))
    full.train()
    resumed = Trainer(cfg(tmp_path / "resumed",
                          f"train.resume={tmp_path / 'full' / 'checkpoints' / 'step_00000010.pt'}"))
    resumed.train()
    a, b = full.loss.state_dict(), resumed.loss.state_dict()
    assert a["log_u"].shape == (160, 2) and a["step"] == b["step"] == 20
    assert torch.isfinite(a["log_u"]).all()  # 20 steps x 16 = 2 epochs: every sample seen
    assert torch.equal(a["log_u"], b["log_u"])
    for (name, p), q in zip(full.unwrapped.state_dict().items(), resumed.unwrapped.state_dict().values()):
        assert torch.equal(p, q), name


def test_trainer_gamma_one_trains_like_flatnce(tiny_shards, tmp_path):
    """Through the trainer (stream sample ids, default 'split' temperature for both), sogclr with
    gamma = 1 reaches FlatNCE's weights bit for bit."""
    from vlp_testing import REPO
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    weights = {}
    for loss in ("flatnce", "sogclr"):
        cfg = load_config(REPO / "configs/demo.yaml", [
            f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={tmp_path / loss}",
            "model.name=vlp-micro", "data.batch_per_device=16", "data.shuffle_buffer=64", f"loss.name={loss}",
            "loss.gamma=1.0", "train.samples=160"])
        assert cfg.loss.temperature == "split"
        trainer = Trainer(cfg)
        trainer.train()
        weights[loss] = trainer.unwrapped.state_dict()
    for name, p in weights["flatnce"].items():
        assert torch.equal(p, weights["sogclr"][name]), name
