"""torchrun elastic on 127.0.0.1 (docs/slurm.md "torchrun elastic"): two agents, `--nnodes=1:2
--max-restarts=3 --rdzv-backend=c10d`, one CPU process each over gloo. One node's agent and rank are
SIGKILLed: the survivor's rank says it lost its peers, its agent re-forms the group at world 1 and
the new rank goes on from the latest checkpoint (train.resume=latest train.resume_mode=continue),
with no human action."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from vlp_testing import REPO, run_env

TORCHRUN = shutil.which("torchrun", path=str(Path(os.sys.executable).parent)) or "torchrun"


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seen(out: Path) -> list[int]:
    log = out / "log.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(x)["samples_seen"] for x in lines if '"infonce"' in x and x.endswith("}")]


def _running_at_world_2(out: Path) -> bool:
    """Three steps of 16 samples in a row (2 ranks x 8) and a checkpoint to go on from."""
    seen = _seen(out)
    return (len(seen) >= 4 and all(b - a == 16 for a, b in zip(seen[-4:], seen[-3:]))
            and any((out / "checkpoints").glob("step_*.pt")))


def test_a_killed_node_leaves_the_survivor_to_reform_at_world_1_and_finish(tiny_shards, tmp_path):
    out = tmp_path / "run"
    cmd = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_port()}", "--rdzv-id=vlp-elastic", "--monitor-interval=0.5",
           "--rdzv-conf=last_call_timeout=30,keep_alive_interval=1,keep_alive_max_attempt=3",
           "-m", "vlp", "train", "-c", "configs/demo.yaml", f"data.train_shards={tiny_shards['train']}",
           f"train.output_dir={out}", "model.name=vlp-micro", "data.batch_per_device=8", "optim.warmup_steps=2",
           "train.log_every=1", "data.shuffle_buffer=32", "data.eval_shards=null", "train.samples=960",
           "train.checkpoint_every=5", "train.keep_last=2", "train.dist_timeout_s=30",
           "train.resume=latest", "train.resume_mode=continue"]
    env = run_env()
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)]
    time.sleep(2)  # node 0 hosts the c10d rendezvous store (the survivor must be the host)
    nodes.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True))
    try:
        deadline = time.time() + 300  # (under load node 1's agent may join after a first round alone)
        while not _running_at_world_2(out) and time.time() < deadline and nodes[0].poll() is None:
            time.sleep(0.2)
        assert _running_at_world_2(out), f"never ran at world 2: {_seen(out)}"
        os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1's agent and its rank
        stdout, stderr = nodes[0].communicate(timeout=400)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert nodes[0].returncode == 0, stderr[-5000:]
    assert "lost its peers" in stderr, stderr[-5000:]
    worlds = re.findall(r"global batch=\d+ \(= 8 per device x (\d) processes", stdout)
    assert worlds and worlds[-1] == "1", stdout[-3000:]  # the first round's rank 0 may have been node 1's
    seen = _seen(out)
    steps = [b - a for a, b in zip(seen, seen[1:])]  # 8 per step at world 1, 16 at world 2
    assert 16 in steps and steps[-1] == 8, steps  # (node 1's agent may join after a first round alone)
    resumed = re.findall(r"\[vlp\] resumed from \S+ at step (\d+)", stdout)
    assert resumed and int(resumed[-1]) >= 5, stdout[-3000:]  # the last round went on from a checkpoint
    result = json.loads((out / "result.json").read_text())
    assert result["samples_seen"] == 960 and result["global_batch"] == 8
