"""2 CPU processes through `accelerate launch` (gloo) with 2 dataloader workers per rank:
train, checkpoint, SIGKILL, resume, evaluate; and the weights match a 1-process run that
sees the same global batches (2 ranks x b == 1 rank x 2b: vlp/distributed.py's gradient-scale
argument, end to end)."""
import json
import os
import subprocess
import time
from dataclasses import replace

import pytest
import torch

from vlp_testing import REPO, accelerate_cmd, kill_job, run_env, run_launch
from vlp.experiment import load_config
from vlp.data.stream import make_loader
from vlp.train.loop import Trainer

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

COMMON = ["model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=2", "optim.lr=1e-3",
          "optim.warmup_steps=2", "train.log_every=1", "data.shuffle_buffer=32", "train.samples=256"]


def _launch(shards, out, *extra, wait=True):
    cmd = accelerate_cmd("-m", "vlp", "train", "-c", "configs/demo.yaml",
                         f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}",
                         f"train.output_dir={out}", *COMMON, *extra)
    env = run_env() | {"ACCELERATE_USE_CPU": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    return run_launch(cmd, cwd=REPO, env=env, timeout=400)


class _TwoRankStream:
    """The global batch of a 2-rank run, built in one process: rank 0's rows then rank 1's."""

    def __init__(self, loaders):
        self.loaders = loaders
        self.num_batches = loaders[0].num_batches
        self.plan = loaders[0].plan

    def rest_of_epoch(self, epoch):  # checkpoints of this reference are never resumed elsewhere
        return None

    def epochs(self, epoch, start_batch):
        for parts in zip(*(loader.epochs(epoch, start_batch) for loader in self.loaders)):
            yield {"image": torch.cat([p["image"] for p in parts]), "text": torch.cat([p["text"] for p in parts]),
                   "key": sum((p["key"] for p in parts), []), "skipped": {},
                   "sample_id": torch.cat([p["sample_id"] for p in parts]),
                   "epoch": parts[0]["epoch"], "index": parts[0]["index"]}


def _one_process_reference(cfg) -> Trainer:
    """A 1-process Trainer whose batches of 16 are the two ranks' batches of 8, side by side."""
    t = Trainer(cfg)
    d = replace(cfg.data, batch_per_device=cfg.data.batch_per_device // 2)
    t.data.loader = t.data.current = _TwoRankStream([
        make_loader(d, transform=t.data.transform, tokenize=t.data.tokenize, seed=cfg.train.seed, rank=r, world_size=2)
        for r in range(2)])
    return t


@pytest.mark.parametrize("loss", ["flatnce"])
def test_two_processes_train_resume_and_match_one_process(tiny_shards, tmp_path, loss):
    # uninterrupted 2-process run
    full = tmp_path / "full"
    proc = _launch(tiny_shards, full, f"loss.name={loss}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "global batch=16 (= 8 per device x 2 processes x 1 accum)" in proc.stdout + proc.stderr
    result = json.loads((full / "result.json").read_text())
    assert result["step"] == 16 and result["global_batch"] == 16
    assert result["eval/num_images"] == 40

    # SIGKILL the whole 2-process job after a checkpoint, then resume it
    run = tmp_path / "killed"
    child = _launch(tiny_shards, run, f"loss.name={loss}", "train.checkpoint_every=1", wait=False)
    target = run / "checkpoints" / "step_00000006.pt"
    deadline = time.time() + 300
    while not target.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    kill_job(child.pid)
    child.wait()
    proc = _launch(tiny_shards, run, f"loss.name={loss}", "train.checkpoint_every=1", "train.resume=latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout

    # 1 process, batch 16 made of the two ranks' batches
    ref_dir = tmp_path / "ref"
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={tiny_shards['train']}", f"train.output_dir={ref_dir}", *COMMON,
        "data.batch_per_device=16", f"loss.name={loss}"])
    _one_process_reference(cfg).train()

    ref = torch.load(ref_dir / "open_clip_model.pt", weights_only=True)["state_dict"]
    for name in ("full", "killed"):
        got = torch.load(tmp_path / name / "open_clip_model.pt", weights_only=True)["state_dict"]
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        print(f"2-process vs 1-process ({name}): max |weight diff| = {worst:.2e}")
        assert worst < 1e-4, (name, worst)
    log_full = [json.loads(x) for x in (full / "log.jsonl").read_text().splitlines()]
    log_ref = [json.loads(x) for x in (ref_dir / "log.jsonl").read_text().splitlines()]
    for a, b in zip([r for r in log_full if "infonce" in r], [r for r in log_ref if "infonce" in r]):
        assert a["infonce"] == pytest.approx(b["infonce"], abs=1e-4)
