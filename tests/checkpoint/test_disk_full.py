"""A disk that fills up during a checkpoint save, for real (issue 27): a 30 MB tmpfs as
train.output_dir holds one vlp-micro checkpoint (~20 MB with AdamW state) but not two. The save
of step 8 fails with one `vlp:` line and a non-zero exit, removes its temp files (the disk is
free again), and step 4 stays intact and resumes in place. Plain (.pt, 1 process) and FSDP (DCP,
2 CPU processes). Mounting a tmpfs needs root (the test containers run as root)."""
import shutil
import subprocess
import sys

import pytest

import forked
from vlp_testing import REPO, accelerate_cmd, run_env, run_launch

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

COMMON = ["model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=0", "data.shuffle_buffer=32",
          "optim.warmup_steps=2", "train.log_every=2", "data.eval_shards=null", "train.keep_last=3"]


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.fail(f"this test mounts a 30 MB tmpfs and needs root: {got.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _train(shards, out, procs, *extra):
    args = ["-m", "vlp", "train", "-c", "configs/demo.yaml", f"data.train_shards={shards['train']}",
            f"train.output_dir={out}", *COMMON, *extra]
    env = run_env() | {"ACCELERATE_USE_CPU": "1"}
    if procs == 1:
        return forked.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    return run_launch(accelerate_cmd(*args, "train.parallel=fsdp"), cwd=REPO, env=env, timeout=400)


@pytest.mark.parametrize("procs", [1, 2], ids=["plain", "fsdp"])
def test_disk_full_during_save_keeps_the_previous_checkpoint_resumable(tiny_shards, small_disk, procs):
    from vlp.checkpoint import files as ckpt

    out = small_disk / "run"
    proc = _train(tiny_shards, out, procs, "train.samples=192", "train.checkpoint_every=4")
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vlp:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    name = "step_00000008" + (".pt" if procs == 1 else "")
    assert lines[0].startswith(f"vlp: error: cannot write checkpoint {out / 'checkpoints' / name}: "), lines[0]
    assert lines[0].endswith(": No space left on device; earlier checkpoints are unchanged"), lines[0]
    assert not [ln for ln in proc.stderr.splitlines() if "Traceback" in ln and (procs == 1 or "[rank" in ln)]
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == ["step_00000004" + (".pt" if procs == 1 else "")], left  # no temp files of step 8
    assert shutil.disk_usage(small_disk).free > 5 << 20  # the failed save gave its space back
    assert ckpt.load_valid(out / "checkpoints" / left[0])["train"]["step"] == 4
    again = _train(tiny_shards, out, procs, "train.samples=96", "train.checkpoint_every=0",
                   "train.save_final=false", "train.resume=latest")
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resumed from {out / 'checkpoints' / left[0]} at step 4" in again.stdout
