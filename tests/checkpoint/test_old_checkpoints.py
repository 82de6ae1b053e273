"""Checkpoints written by the release before the restructuring (commit 965021a: flat vlp/, no
checksums) still load: a replicated .pt and a 2-rank FSDP DCP directory, each made by that
release's own code (taken from git) and resumed, evaluated and exported by today's."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import io
from pathlib import Path

import pytest
import torch

from vlp_testing import REPO, accelerate_cmd, run_env, run_launch

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

OLD_RELEASE = "965021a"  # the last commit with vlp/trainer.py
# That release's 2-process runs end, now and then, with a rank aborting in gloo's destructors after
# its last step (fixed since: docs/reliability.md, "Preemption saves"); its run is made once more.
OLD_TEARDOWN_ABORT = "terminate called without an active exception"
COMMON = ["model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=0", "data.shuffle_buffer=32",
          "optim.warmup_steps=2", "train.log_every=2", "train.checkpoint_every=4", "train.keep_last=0"]


@pytest.fixture(scope="module")
def old_code(tmp_path_factory) -> Path:
    """The old release's packages, unpacked from this clone's history."""
    root = tmp_path_factory.mktemp("old_release")
    got = subprocess.run(["git", "-C", str(REPO), "archive", OLD_RELEASE, "vlp", "data_pipelines", "eval",
                          "configs", "launch"], capture_output=True, timeout=120)
    assert got.returncode == 0, (f"this test needs the clone's history (commit {OLD_RELEASE}); "
                                 f"git said: {got.stderr.decode()[-300:]}")
    tarfile.open(fileobj=io.BytesIO(got.stdout)).extractall(root)
    assert (root / "vlp" / "trainer.py").is_file()
    return root


def _old_train(old: Path, shards, out: Path, *extra, procs: int = 1):
    args = ["-m", "vlp", "train", "-c", str(old / "configs/demo.yaml"), f"data.train_shards={shards['train']}",
            f"data.eval_shards={shards['eval']}", f"train.output_dir={out}", *COMMON, *extra]
    env = run_env() | {"PYTHONPATH": str(old), "ACCELERATE_USE_CPU": "1"}
    if procs == 1:
        proc = subprocess.run([str(Path(__import__("sys").executable)), *args], cwd=old, env=env,
                              capture_output=True, text=True, timeout=600)
    else:
        for attempt in range(2):
            if attempt:
                shutil.rmtree(out)
            proc = run_launch(accelerate_cmd(*args, config=old / "launch/cpu_2proc.yaml"), cwd=old, env=env,
                              timeout=600)
            if OLD_TEARDOWN_ABORT not in proc.stderr:
                break
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the old code really ran: no manifests, the old module layout
    assert not list(out.glob("checkpoints/*manifest*")), sorted(p.name for p in (out / "checkpoints").iterdir())


def _new(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(__import__("sys").executable)), "-m", "vlp", *args], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)


def test_old_pt_checkpoint_resumes_and_evaluates(old_code, tiny_shards, tmp_path):
    old = tmp_path / "old"
    _old_train(old_code, tiny_shards, old, "train.samples=64")
    ckpt = old / "checkpoints" / "step_00000004.pt"
    saved = torch.load(ckpt, weights_only=True)
    run = tmp_path / "new"
    got = _new("train", "-c", "configs/demo.yaml", f"data.train_shards={tiny_shards['train']}",
               f"data.eval_shards={tiny_shards['eval']}", f"train.output_dir={run}", *COMMON,
               "train.samples=96", f"train.resume={ckpt}")
    assert got.returncode == 0, got.stderr[-3000:]
    assert f"resumed from {ckpt} at step 4, 32 samples seen" in got.stdout
    assert "unverified" in got.stderr  # no manifest: loaded with a warning, not refused
    result = __import__("json").loads((run / "result.json").read_text())
    assert result["step"] == 12 and result["samples_seen"] == 96
    ev = _new("eval", "--checkpoint", str(ckpt), "--shards", tiny_shards["eval"], "--out", str(tmp_path / "ev"))
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert set(saved["model"]) and saved["step"] == 4


def test_old_dcp_checkpoint_resumes_in_one_and_two_processes(old_code, tiny_shards, tmp_path):
    from vlp.experiment import load_config
    from vlp.eval.checkpoints import load_sharded_full
    from vlp.train.loop import Trainer

    old = tmp_path / "old"
    _old_train(old_code, tiny_shards, old, "train.samples=64", "train.parallel=fsdp", procs=2)
    src = old / "checkpoints" / "step_00000004"
    assert (src / "meta.pt").is_file() and not (src / "manifest.json").exists()
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={tiny_shards['train']}", f"data.eval_shards={tiny_shards['eval']}",
        f"train.output_dir={tmp_path / 'one'}", *COMMON, "train.samples=96", f"train.resume={src}",
        "train.resume_mode=continue"])
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    assert trainer.step == 4 and trainer.samples_seen == 64
    saved = load_sharded_full(src)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in trainer.unwrapped.clip.state_dict().items())
    # and vlp eval reads the old DCP directory whole
    ev = _new("eval", "--checkpoint", str(src), "--shards", tiny_shards["eval"], "--out", str(tmp_path / "ev"))
    assert ev.returncode == 0, ev.stderr[-3000:]
