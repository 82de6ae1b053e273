"""torchrun elastic on 127.0.0.1 (docs/schedulers.md): two agents ("nodes"), `--nnodes=1:2
--max-restarts=3 --rdzv-backend=c10d`, one CPU process each over gloo, running plain `vlp train`
(no ACCELERATE_USE_CPU: vlp sets it when launched without a GPU). Node 1's agent and rank are
SIGKILLed once a checkpoint at world 2 exists: the survivor's rank says it lost its peers, its
agent re-forms the group at world 1 and the new rank goes on from the latest checkpoint
(train.resume=latest train.resume_mode=continue) to the end, with no human action."""
import pytest
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from vlp.distributed import cpu_when_launched_without_gpu, launched_world
from vlp_testing import REPO, free_port, kill_job, overrides, run_env

TORCHRUN = shutil.which("torchrun", path=str(Path(os.sys.executable).parent)) or "torchrun"
SAMPLES = 480  # 160 pairs per epoch


def _records(out: Path) -> list[dict]:
    log = out / "log.jsonl"
    if not log.exists():
        return []
    return [r for r in map(json.loads, log.read_text().splitlines()) if "infonce" in r]


def _world2_checkpoint(out: Path) -> int | None:
    """The newest checkpoint step written after a step of global batch 16 (world 2), if any."""
    records = _records(out)
    at_world2 = [b["step"] for a, b in zip(records, records[1:]) if b["samples_seen"] - a["samples_seen"] == 16]
    saved = [int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.pt")] if at_world2 else []
    return max((s for s in saved if s >= at_world2[0]), default=None)


def _agent(cmd, host: bool, log: Path) -> subprocess.Popen:
    """One node: torchrun's agent and its rank in a process group of their own. Node 0 hosts the
    c10d store (is_host): the node that hosts it must survive (docs/schedulers.md)."""
    conf = (f"--rdzv-conf=is_host={'true' if host else 'false'},"
            "last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=5")
    env = {k: v for k, v in run_env().items() if k != "ACCELERATE_USE_CPU"}
    return subprocess.Popen([TORCHRUN, conf, *cmd], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.multiproc
def test_a_killed_node_leaves_the_survivor_to_reform_at_world_1_and_finish(tiny_shards, tmp_path):
    out = tmp_path / "run"
    cmd = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=vlp-elastic", "--monitor-interval=0.5",
           "-m", "vlp", "train", "-c", "configs/demo.yaml", *overrides(
               f"data.train_shards={tiny_shards['train']}", f"train.output_dir={out}", "model.name=vlp-micro",
               "data.batch_per_device=8", "optim.warmup_steps=2", "train.log_every=1", "data.shuffle_buffer=32",
               "data.eval_shards=null", "data.num_workers=2", f"train.samples={SAMPLES}", "train.checkpoint_every=4", "train.keep_last=3",
               "train.dist_timeout_s=30", "train.resume=latest", "train.resume_mode=continue")]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_agent(cmd, True, logs[0])]
    time.sleep(1)  # node 0's store first: node 1 connects to it
    nodes.append(_agent(cmd, False, logs[1]))
    try:
        deadline = time.time() + 400
        while _world2_checkpoint(out) is None and time.time() < deadline and all(n.poll() is None for n in nodes):
            time.sleep(0.2)
        before = _world2_checkpoint(out)
        assert before is not None, f"no checkpoint at world 2:\n{logs[0].read_text()[-4000:]}"
        kill_job(nodes[1].pid)  # node 1 lost: its agent, its rank and the rank's loader workers
        nodes[0].wait(timeout=400)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    text = logs[0].read_text()
    assert nodes[0].returncode == 0, text[-5000:]
    # the survivor's rank ends at its next collective with vlp's one line, its agent restarts it
    assert len(re.findall(r"vlp: error: rank \d lost its peers", text)) == 1, text[-5000:]
    resumed = re.findall(r"\[vlp\] resumed from \S+step_(\d+)\.pt at step (\d+), (\d+) samples seen", text)
    assert resumed, text[-5000:]
    step, seen = int(resumed[-1][1]), int(resumed[-1][2])
    assert step >= before, (resumed, before)  # the latest checkpoint, not an older one
    assert "[vlp] layout changed since" in text and "world size: 2 -> 1" in text, text[-5000:]
    assert "global batch=8 (= 8 per device x 1 processes x 1 accum)" in text, text[-5000:]
    records = _records(out)
    deltas = [b["samples_seen"] - a["samples_seen"] for a, b in zip(records, records[1:]) if b["step"] == a["step"] + 1]
    assert 16 in deltas and deltas[-1] == 8, deltas  # world 2, then world 1
    first = [r for r in records if r["step"] == step + 1][-1]  # the log keeps world 2's records of it too
    assert first["samples_seen"] == seen + 8, first
    result = json.loads((out / "result.json").read_text())
    assert result["samples_seen"] == SAMPLES and result["global_batch"] == 8, result
    assert result["step"] == step + (SAMPLES - seen) // 8, result


def test_a_launched_process_on_a_machine_without_a_gpu_joins_a_cpu_group():
    """Plain torchrun on CPU: vlp sets ACCELERATE_USE_CPU=1 (else every process trained alone)."""
    launched = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}
    env = dict(launched)
    assert cpu_when_launched_without_gpu(env, gpu=False) and env["ACCELERATE_USE_CPU"] == "1"
    for given in ({**launched, "ACCELERATE_USE_CPU": "0"}, {"WORLD_SIZE": "2"}, {**launched, "WORLD_SIZE": "1"}):
        env = dict(given)
        assert not cpu_when_launched_without_gpu(env, gpu=False) and env == given
    env = dict(launched)
    assert not cpu_when_launched_without_gpu(env, gpu=True) and env == launched
    assert launched_world(launched) == 2 and launched_world({"WORLD_SIZE": "2"}) == 1
