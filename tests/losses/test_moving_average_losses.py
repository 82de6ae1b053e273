"""FastCLIP and iSogCLR's sharded per-sample state (vlp/losses/sharded.py, SogCLR's machinery):
2 gloo ranks equal 1 rank and the float64 reference; each rank holds ceil(N / world) rows; a
state saved after some steps resumes bit-identical (also from 2-rank shards on 1 and 3 ranks);
through the Trainer, a run resumed from its checkpoint ends with the same state and weights."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from naive_losses import NaiveFastCLIP, NaiveISogCLR

from vlp.losses.fastclip import FastCLIPLoss
from vlp.losses.isogclr import ISogCLRLoss, TemperatureRule
from vlp.losses.sharded import ids_on, rows_on

F64 = torch.float64
N, STEPS, B = 21, 4, 8  # B: the global batch; 21 samples: unequal shards on 2 and 3 ranks
RULE = dict(tau_init=0.1, tau_lr=0.02, tau_min=0.06, tau_max=0.2, rho=0.5)
NAMES = ["fastclip", "isogclr"]


def build(name, rank=None, world=None):
    if name == "fastclip":
        return FastCLIPLoss(N, gamma=0.3, gamma_min=0.1, schedule="cosine", total_steps=6, rho=2.0,
                            rank=rank, world_size=world)
    return ISogCLRLoss(N, gamma=0.3, gamma_min=0.1, schedule="cosine", total_steps=6,
                       rule=TemperatureRule(**RULE), rank=rank, world_size=world)


def problem(seed, steps=STEPS, big_b=B):
    gen = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(steps, big_b, 5, generator=gen, dtype=F64), dim=-1)
    txt = F.normalize(torch.randn(steps, big_b, 5, generator=gen, dtype=F64), dim=-1)
    ids = torch.stack([torch.randperm(12, generator=gen)[:big_b] for _ in range(steps)])  # reused ids
    return img, txt, ids


def run(loss_fn, rank, world, img, txt, ids, first=0):
    """Steps ``first``.. of the problem on this rank's slice: a no-grad call first (as gradient
    accumulation does), then the call that is backpropagated, then commit."""
    from vlp.distributed import gather_with_grad

    b = img.shape[1] // world
    sl = slice(rank * b, (rank + 1) * b)
    out = []
    for s in range(first, img.shape[0]):
        with torch.no_grad():
            loss_fn(img[s, sl], txt[s, sl], img[s], txt[s], torch.tensor(6.0, dtype=F64), offset=rank * b, ids=ids[s, sl])
        il, tl = img[s, sl].clone().requires_grad_(), txt[s, sl].clone().requires_grad_()
        t = torch.tensor(6.0, dtype=F64, requires_grad=True)
        loss, metrics = loss_fn(il, tl, gather_with_grad(il), gather_with_grad(tl), t, offset=rank * b, ids=ids[s, sl])
        loss.backward()
        loss_fn.commit()
        out.append({"loss": loss.detach(), "grads": (il.grad, tl.grad, t.grad), "metrics": metrics})
    return out


def _worker(rank, world, name, img, txt, ids):
    loss_fn = build(name)
    return {"out": run(loss_fn, rank, world, img, txt, ids), "state": loss_fn.state_dict()}


def reference(name, img, txt, ids):
    """(value, gradients) per step from tests/support/naive_losses.py over the whole batch."""
    ref = NaiveFastCLIP(0.3, 2.0) if name == "fastclip" else NaiveISogCLR(0.3, **{
        "rho": RULE["rho"], "tau_init": RULE["tau_init"], "tau_lr": RULE["tau_lr"], "tau_min": RULE["tau_min"],
        "tau_max": RULE["tau_max"]})
    out = []
    for s in range(img.shape[0]):
        ref.gamma = build(name).__class__.current_gamma.fget(_at_step(name, s))
        im, tx = img[s].clone().requires_grad_(), txt[s].clone().requires_grad_()
        t = torch.tensor(6.0, dtype=F64, requires_grad=True)
        value, surrogate = ref.step(im, tx, t, ids[s]) if name == "fastclip" else ref.step(im, tx, ids[s])
        out.append((value, torch.autograd.grad(surrogate, [im, tx, t], allow_unused=True, materialize_grads=True)))
    return out


def _at_step(name, step):
    loss_fn = build(name, 0, 1)
    loss_fn.step = step
    return loss_fn


@pytest.fixture(scope="module", params=NAMES)
def two_ranks(request):
    from dist_utils import run_distributed

    img, txt, ids = problem(seed=0)
    return request.param, (img, txt, ids), run_distributed(_worker, 2, args=(request.param, img, txt, ids))


@pytest.mark.multiproc
def test_two_ranks_equal_one_rank_and_the_reference(two_ranks):
    """Each rank's feature gradient is twice (all_gather's backward sums the ranks' mean losses)
    the rows of one rank's; t's gradient and the loss average over ranks to one rank's; one rank
    matches the float64 reference to 1e-12; the 2 shards put together are one rank's table."""
    name, (img, txt, ids), ranks = two_ranks
    one = _worker(0, 1, name, img, txt, ids)
    ref = reference(name, img, txt, ids)
    for s in range(STEPS):
        value, ref_grads = ref[s]
        assert one["out"][s]["loss"].item() == pytest.approx(value.item(), abs=1e-12)
        for g, r in zip(one["out"][s]["grads"], ref_grads):
            torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
        mean_loss = (ranks[0]["out"][s]["loss"] + ranks[1]["out"][s]["loss"]) / 2
        torch.testing.assert_close(mean_loss, one["out"][s]["loss"], atol=1e-12, rtol=0)
        t_grad = (ranks[0]["out"][s]["grads"][2] + ranks[1]["out"][s]["grads"][2]) / 2
        torch.testing.assert_close(t_grad, one["out"][s]["grads"][2], atol=1e-12, rtol=0)
        for r in range(2):
            for g, g1 in zip(ranks[r]["out"][s]["grads"][:2], one["out"][s]["grads"][:2]):
                torch.testing.assert_close(g, 2 * g1[r * 4:(r + 1) * 4], atol=1e-12, rtol=0)
    whole = build(name, 0, 1)
    whole.load_state_dict([r["state"] for r in ranks])
    key = whole.STATE_KEY
    torch.testing.assert_close(whole.state_dict()[key], one["state"][key], rtol=1e-6, atol=0)
    assert torch.isfinite(one["state"][key][:, 0]).sum() > 8


@pytest.mark.multiproc
def test_state_is_sharded_by_owner(two_ranks):
    """Rank r holds the samples k % 2 == r only: ceil(N / 2) rows of WIDTH fp32 (O(N / world))."""
    name, _, ranks = two_ranks
    width = 2 if name == "fastclip" else 6
    for r, res in enumerate(ranks):
        state = res["state"]
        assert state[build(name, r, 2).STATE_KEY].shape == (rows_on(r, 2, N), width)
        assert (state["rank"], state["world_size"], state["num_samples"], state["step"]) == (r, 2, N, STEPS)
    assert [rows_on(r, 2, N) for r in range(2)] == [11, 10]


@pytest.mark.multiproc
def test_two_rank_shards_reload_on_one_and_three_ranks(two_ranks):
    name, _, ranks = two_ranks
    saved = [r["state"] for r in ranks]
    whole = build(name, 0, 1)
    whole.load_state_dict(saved)
    full = whole.state_dict()[whole.STATE_KEY]
    for world in (1, 3):
        for rank in range(world):
            part = build(name, rank, world)
            part.load_state_dict(s for s in saved if s["rank"] in part.shards_needed(2))
            assert torch.equal(part.state_dict()[part.STATE_KEY], full[ids_on(rank, world, N)])
            assert part.step == STEPS


@pytest.mark.parametrize("name", NAMES)
def test_saved_state_resumes_bit_identical(name):
    """4 steps straight, or 2 steps, save (torch.save bytes), load into a fresh loss, 2 more:
    the same losses, gradients, metrics and state, bit for bit."""
    img, txt, ids = problem(seed=3)
    straight = build(name, 0, 1)
    a = run(straight, 0, 1, img, txt, ids)
    first = build(name, 0, 1)
    run(first, 0, 1, img[:2], txt[:2], ids[:2])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = build(name, 0, 1)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    b = run(resumed, 0, 1, img, txt, ids, first=2)
    for x, y in zip(a[2:], b):
        assert torch.equal(x["loss"], y["loss"]) and x["metrics"] == y["metrics"]
        assert all(torch.equal(g, h) for g, h in zip(x["grads"], y["grads"]))
    assert torch.equal(straight.state_dict()[straight.STATE_KEY], resumed.state_dict()[resumed.STATE_KEY])
    assert resumed.step == straight.step == STEPS


@pytest.mark.parametrize("name", NAMES)
def test_trainer_resume_restores_state_exactly(tiny_shards, tmp_path, name):
    """Through the Trainer's own checkpoint path (per-rank loss files): a run resumed from its
    step-6 checkpoint ends with the same per-sample state and weights as the uninterrupted one."""
    from vlp_testing import REPO
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    def cfg(out, *extra):
        return load_config(REPO / "configs/demo.yaml", [
            f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={out}",
            "model.name=vlp-micro", "data.batch_per_device=16", "data.shuffle_buffer=64", f"loss.name={name}",
            "loss.gamma=0.5", "loss.gamma_schedule=cosine", "loss.rho=1.0", "loss.tau_lr=0.01", "train.samples=192",
            "train.checkpoint_every=6", "train.keep_last=0", "train.log_every=4", *extra])

    full = Trainer(cfg(tmp_path / "full"))
    full.train()
    resumed = Trainer(cfg(tmp_path / "resumed", f"train.resume={tmp_path / 'full' / 'checkpoints' / 'step_00000006.pt'}"))
    resumed.train()
    a, b = full.loss.state_dict(), resumed.loss.state_dict()
    key = full.loss.STATE_KEY
    assert a["step"] == b["step"] == 12 and torch.isfinite(a[key]).all()  # 12 x 16 > 160: every sample seen
    assert torch.equal(a[key], b[key])
    if name == "isogclr":
        assert len(set(a[key][:, 2:4].flatten().tolist())) > 10  # the temperatures moved
    for (k, p), q in zip(full.unwrapped.state_dict().items(), resumed.unwrapped.state_dict().values()):
        assert torch.equal(p, q), k
