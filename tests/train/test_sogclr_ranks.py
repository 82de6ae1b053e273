"""SogCLR's u in a real run: each rank saves its own shard (step_N.ranks/), pruned with its
checkpoint; a 2-rank checkpoint resumes exactly on 2 ranks and, in resume_mode=continue, on 1 and
3 ranks with every sample's u kept; FastCLIP's and iSogCLR's state the same way. The ranks are
forked gloo processes running the Trainer as `accelerate launch` would (the launcher itself is
tested by test_two_process, test_cluster and the SLURM tests): ~20 CPU seconds of start-up less
per run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from test_two_process import COMMON as TWO_PROCESS
from vlp_testing import REPO
from vlp.experiment import load_config
from vlp.losses.sogclr import SogCLRLoss
from vlp.train.loop import Trainer

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

SOG = ("loss.name=sogclr", "loss.gamma=0.5", "loss.gamma_schedule=cosine", "train.checkpoint_every=4")


def _two_process_args(shards, out, *extra) -> list[str]:
    """The overrides of test_two_process's `_launch` (its shards, eval shards and COMMON)."""
    return [f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}", f"train.output_dir={out}",
            *TWO_PROCESS, *extra]


def _whole(folder, world: int, n: int = 160) -> SogCLRLoss:
    """The full table put together from a checkpoint's per-rank files."""
    whole = SogCLRLoss(n, rank=0, world_size=1)
    whole.load_state_dict(torch.load(folder / f"rank{r:05d}-of-{world:05d}.pt", weights_only=True)["loss"]
                          for r in range(world))
    return whole


def test_two_rank_u_per_rank_files_exact_resume_and_changed_worlds(tiny_shards, tmp_path):
    said = run_distributed(_full_then_resumed, 2, (tiny_shards, str(tmp_path), (*SOG, "train.keep_last=3")),
                           timeout_s=400)
    assert "resumed from" in said[0] and "step_00000008.pt" in said[0], said[0][-4000:]
    full, part = tmp_path / "full", tmp_path / "part"
    ck = full / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert "step_00000004.ranks" not in names and "step_00000008.ranks" in names, names  # pruned together
    meta = torch.load(ck / "step_00000008.pt", weights_only=True)
    assert meta["rank_files"] == 2 and "loss_state" not in meta  # no O(N) table in the shared file
    assert torch.isfinite(_whole(ck / "step_00000016.ranks", 2).log_u).all()

    # exact: the 2-rank run resumed from step 8 ends with the same u and weights
    for r in range(2):
        name = f"step_00000016.ranks/rank{r:05d}-of-00002.pt"
        a, b = (torch.load(d / "checkpoints" / name, weights_only=True)["loss"] for d in (full, part))
        assert torch.equal(a["log_u"], b["log_u"]) and a["step"] == b["step"] == 16
    wa, wb = (torch.load(d / "open_clip_model.pt", weights_only=True)["state_dict"] for d in (full, part))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # 2 -> 1 process, continue: every u of step 8 is there
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={tmp_path / 'one'}",
        "model.name=vlp-micro", "data.batch_per_device=16", "data.shuffle_buffer=32", *SOG[:3],
        "train.samples=320", f"train.resume={ck / 'step_00000008.pt'}", "train.resume_mode=continue"])
    one = Trainer(cfg)
    one.maybe_resume()
    assert torch.equal(one.loss.log_u, _whole(ck / "step_00000008.ranks", 2).log_u) and one.loss.step == 8

    # 2 -> 3 processes, continue: resumes, then writes 3 files holding every sample
    three = tmp_path / "three"
    shutil.copytree(full, three)
    (three / "open_clip_model.pt").unlink()
    args = (f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={three}",
            "model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=0", "data.shuffle_buffer=32",
            *SOG[:3], "train.samples=400", "train.checkpoint_every=2", "train.resume=latest",
            "train.resume_mode=continue", "train.keep_last=0")
    said = run_distributed(_train, 3, (args,), timeout_s=400)
    assert "resumed from" in said[0], said[0][-4000:]
    last = sorted(p for p in (three / "checkpoints").iterdir() if p.name.endswith(".ranks"))[-1]
    assert sorted(x.name for x in last.iterdir() if x.suffix == ".pt") == [f"rank{r:05d}-of-00003.pt" for r in range(3)]
    assert torch.isfinite(_whole(last, 3).log_u).all()


def _whole_of(loss_fn, folder, world: int):
    """The full table of ``loss_fn``'s kind put together from a checkpoint's per-rank files."""
    loss_fn.load_state_dict(torch.load(folder / f"rank{r:05d}-of-{world:05d}.pt", weights_only=True)["loss"]
                            for r in range(world))
    return loss_fn.state_dict()[loss_fn.STATE_KEY]


def _cut_after(folder, step: int) -> None:
    """Delete a run's checkpoints after step `step` (a run stopped there)."""
    for p in (folder / "checkpoints").iterdir():
        if int(p.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _train(rank, world, args) -> str:
    """One forked gloo rank of a run (Accelerate on the existing process group, as under
    `accelerate launch`, which test_two_process and the SLURM tests go through) of demo.yaml with
    the overrides `args`; what it printed."""
    import contextlib
    import io

    from accelerate.state import AcceleratorState

    os.environ.update(ACCELERATE_USE_CPU="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state()  # an earlier run in this rank set it up for its own config
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        Trainer(load_config(REPO / "configs/demo.yaml", list(args))).train()
    return said.getvalue()


def _full_then_resumed(rank, world, shards, root, extra):
    """In forked gloo ranks (`_train`): the full run, then a copy cut after step 8 resumed with
    resume=latest. This rank's output of the resumed run."""
    import torch.distributed as dist

    full, part = Path(root) / "full", Path(root) / "part"
    _train(rank, world, _two_process_args(shards, full, *extra))
    dist.barrier()
    if rank == 0:
        shutil.copytree(full, part)
        _cut_after(part, 8)
    dist.barrier()
    return _train(rank, world, _two_process_args(shards, part, *extra, "train.resume=latest"))


@pytest.mark.parametrize("name", ["fastclip", "isogclr"])
def test_two_rank_state_of_the_new_losses_resumes_exactly(tiny_shards, tmp_path, name):
    """FastCLIP's u and iSogCLR's u, temperatures and momenta in a 2-rank run: one file per rank,
    resumed from step 8 on 2 ranks bit-identical (state and weights), and on 1 process
    (resume_mode=continue) with every sample's row kept."""
    from vlp.losses.fastclip import FastCLIPLoss
    from vlp.losses.isogclr import ISogCLRLoss

    kind = FastCLIPLoss if name == "fastclip" else ISogCLRLoss
    extra = (f"loss.name={name}", "loss.gamma=0.5", "loss.rho=1.0", "loss.tau_lr=0.01", "train.checkpoint_every=4")
    said = run_distributed(_full_then_resumed, 2, (tiny_shards, str(tmp_path), (*extra, "train.keep_last=3")),
                           timeout_s=400)
    assert "resumed from" in said[0] and "step_00000008.pt" in said[0], said[0][-4000:]
    full, part = tmp_path / "full", tmp_path / "part"
    ck = full / "checkpoints"
    last = sorted(p.name for p in ck.iterdir() if p.name.endswith(".ranks"))[-1]
    for r in range(2):
        a, b = (torch.load(d / "checkpoints" / last / f"rank{r:05d}-of-00002.pt", weights_only=True)["loss"]
                for d in (full, part))
        key = kind.STATE_KEY
        assert a[key].shape[0] == 80 and torch.equal(a[key], b[key]) and a["step"] == b["step"]
    wa, wb = (torch.load(d / "open_clip_model.pt", weights_only=True)["state_dict"] for d in (full, part))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    cfg = load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={tiny_shards['train']}", "data.eval_shards=", f"train.output_dir={tmp_path / 'one'}",
        "model.name=vlp-micro", "data.batch_per_device=16", "data.shuffle_buffer=32", *extra[:-1],
        "train.samples=320", f"train.resume={ck / 'step_00000008.pt'}", "train.resume_mode=continue"])
    one = Trainer(cfg)
    one.maybe_resume()
    whole = _whole_of(kind(160, rank=0, world_size=1), ck / "step_00000008.ranks", 2)
    assert torch.equal(one.loss.state_dict()[kind.STATE_KEY], whole) and one.loss.step == 8
    assert torch.isfinite(whole[:, 0]).sum() > 100
