"""The cluster paths on one box (CPU, gloo, `accelerate launch`): two "nodes" on 127.0.0.1 equal
one 2-process launch; a 2-process checkpoint goes on as 1 process (train.resume_mode=continue);
a dead node ends the other within the stated timeout; ranks never outlive their launcher."""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from vlp.cli import peer_failure
import forked
from vlp_testing import LAUNCH, PYTHON, REPO, free_port, kill_job, overrides, run_env, run_launch

COMMON = ["model.name=vlp-micro", "data.batch_per_device=8", "data.num_workers=2", "optim.lr=1e-3", "optim.warmup_steps=2",
          "train.log_every=1", "data.shuffle_buffer=32", "data.eval_shards=null"]


def _train_args(shards, out, *extra):
    return ["-m", "vlp", "train", "-c", "configs/demo.yaml", *overrides(
                f"data.train_shards={shards['train']}", f"train.output_dir={out}", *COMMON, *extra)]


def _launch(args, machines=1, rank=0, port=None, wait=True, env=None):
    """`accelerate launch` of 2 CPU processes in total, on 1 machine or as one of 2 machines."""
    cmd = [*LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", str(machines),
           "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(port or free_port()), "--rdzv_backend", "static", *args]
    env = run_env() | {"ACCELERATE_USE_CPU": "1"} | (env or {})
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return run_launch(cmd, cwd=REPO, env=env, timeout=400)


def _weights(out):
    return torch.load(Path(out) / "open_clip_model.pt", weights_only=True)["state_dict"]


def _wait_for_steps(out: Path, steps: int, procs, limit_s: float = 240):
    deadline = time.time() + limit_s
    log = out / "log.jsonl"
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if log.exists() and sum('"infonce"' in x for x in log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps in {out} ({[p.poll() for p in procs]})")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def single(tiny_shards, tmp_path_factory):
    """One 2-process launch: 16 steps of global batch 16 over 160 pairs (10 batches per epoch)."""
    out = tmp_path_factory.mktemp("single")
    proc = _launch(_train_args(tiny_shards, out, "train.samples=256", "train.checkpoint_every=4",
                               "train.keep_last=4"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.multiproc
def test_two_machines_on_loopback_equal_one_two_process_launch(tiny_shards, single, tmp_path):
    port = free_port()
    args = _train_args(tiny_shards, tmp_path, "train.samples=256")
    nodes = [_launch(args, machines=2, rank=r, port=port, wait=False) for r in (0, 1)]
    outs = [node.communicate(timeout=400) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    a, b = _weights(single), _weights(tmp_path)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"2 machines vs 1 machine, 2 processes: max |weight diff| = {worst:.1e}")
    assert worst <= 1e-6
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (single / "log.jsonl").read_text().splitlines()]
    assert [r["infonce"] for r in log if "infonce" in r] == pytest.approx(
        [r["infonce"] for r in ref if "infonce" in r], abs=1e-6)


@pytest.mark.multiproc
def test_two_process_checkpoint_goes_on_as_one_process(tiny_shards, single, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(single / "checkpoints" / "step_00000012.pt", tmp_path / "checkpoints")  # epoch 1, batch 2
    args = _train_args(tiny_shards, tmp_path, "data.batch_per_device=16", "train.samples=256",
                       "train.resume=latest")
    env = run_env()
    refused = forked.run([PYTHON, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    lines = [x for x in refused.stderr.splitlines() if x.startswith("vlp: error")]
    assert len(lines) == 1 and "Traceback" not in refused.stderr
    assert "world size: 2 -> 1" in lines[0] and "data.batch_per_device: 8 -> 16" in lines[0]
    proc = forked.run([PYTHON, *args, "train.resume_mode=continue"], cwd=REPO, env=env,
                      capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "192 samples seen (epoch 1, batch 0 of its rest under the new layout)" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["samples_seen"] == 256 and result["step"] == 12 + 4


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_dead_or_frozen_node_ends_the_other_within_the_timeout(tiny_shards, tmp_path, fault):
    """killed: node 1's launcher and rank get SIGKILL (the connection breaks at once);
    frozen: node 1's rank gets SIGSTOP (only the collective timeout can end node 0)."""
    timeout_s = 20
    port = free_port()
    args = _train_args(tiny_shards, tmp_path, "train.samples=100000", f"train.dist_timeout_s={timeout_s}")
    nodes = [_launch(args, machines=2, rank=r, port=port, wait=False) for r in (0, 1)]
    frozen = []
    try:
        _wait_for_steps(tmp_path, 2, nodes)
        if fault == "killed":  # the launcher, its rank and its workers
            kill_job(nodes[1].pid)
        else:
            frozen = _children(nodes[1].pid)
            os.kill(frozen[0], signal.SIGSTOP)
        start = time.time()
        _, err = nodes[0].communicate(timeout=timeout_s + 90)
        took = time.time() - start
    finally:
        for pid in frozen:  # a stopped rank cannot watch its launcher: end it here
            os.kill(pid, signal.SIGKILL)
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    print(f"node 0 exited {took:.1f} s after node 1 was {fault} (timeout {timeout_s} s)")
    # frozen: the timeout, then the rank's exit and its launcher's report (6-27 s on 2 loaded cores)
    assert nodes[0].returncode != 0 and took < timeout_s + 60, err[-4000:]
    assert "vlp: error: rank 0 lost its peers" in err and "[rank0]: Traceback" not in err, err[-6000:]


@pytest.mark.parametrize("words", [
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation",
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:25502: Connection reset by peer",
    "Application timeout caused pair closure",  # a frozen peer, seen inside DDP's all-reduce (backward)
    "Socket closed",
])
def test_each_way_gloo_says_a_peer_is_gone_reads_as_lost_peers(words):
    assert peer_failure(RuntimeError(words))
    assert not peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) and not peer_failure(
        ValueError("Socket closed"))


@pytest.mark.multiproc
def test_ranks_whose_launcher_is_killed_save_and_exit(tiny_shards, tmp_path):
    """The launcher alone SIGKILLed (the OOM killer): its ranks see it gone within a second, save
    after the same step, say it in one line and exit; they do not train on as orphans."""
    launcher = _launch(_train_args(tiny_shards, tmp_path, "train.samples=100000"), wait=False)
    try:
        _wait_for_steps(tmp_path, 2, [launcher])
        ranks = _children(launcher.pid)
        assert len(ranks) == 2
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher only, not its process group
        _, err = launcher.communicate(timeout=120)  # its stderr: open until the ranks end
        deadline = time.time() + 15
        while time.time() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "ranks outlived their launcher"
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [x for x in err.splitlines() if "vlp: " in x]
    assert len(lines) == 1 and "(its launcher died)" in lines[0] and "Traceback" not in err, err[-3000:]
    step = int(lines[0].split(" at step ")[1].split()[0])
    assert (tmp_path / "checkpoints" / f"step_{step:08d}.pt").exists(), lines


@pytest.mark.multiproc
def test_a_preempted_launch_says_it_once_and_exits_0_with_the_marker(tiny_shards, tmp_path):
    """SIGUSR1 to one rank of `accelerate launch` (2 processes): both save after the same step, one
    `vlp: preempted` line for the job, no launcher traceback, exit 0, the marker holds the step."""
    out, marker = tmp_path / "run", tmp_path / "preempted"
    launcher = _launch(_train_args(tiny_shards, out, "train.samples=100000"), wait=False,
                       env={"VLP_PREEMPT_MARKER": str(marker)})
    try:
        _wait_for_steps(out, 3, [launcher])
        os.kill(_children(launcher.pid)[-1], signal.SIGUSR1)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    lines = [x for x in err.splitlines() if "vlp: " in x]
    assert launcher.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and "preempted at step " in lines[0], err[-3000:]
    step = int(marker.read_text())
    assert (out / "checkpoints" / f"step_{step:08d}.pt").exists()
