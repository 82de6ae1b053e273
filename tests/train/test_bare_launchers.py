"""A bare `accelerate launch` and a bare elastic torchrun (2 CPU ranks over gloo, 2 loader workers
each), stopped as users stop them: SIGTERM, SIGUSR1 and SIGINT to the launcher's process group (a
terminal's Ctrl-C, timeout(1), `kill -- -PGID`, a container's PID 1). One run
folder goes through every stop, each segment resuming from the newest checkpoint, and its final
weights must equal an uninterrupted run's (torch.equal).

What torch's agent does, and so what a user sees (docs/reliability.md): it starts each rank in a
session of its own, so a signal to its group reaches the agent alone.
* SIGTERM / SIGINT: the agent passes it on to the ranks, which save at the step boundary and say
  so in one line; then the agent raises its own SignalException (a traceback of torch's frames
  only, exit 1), whatever its ranks did. vlp cannot change that: no vlp code runs in the agent.
  launch/local.sh and launch/slurm.sbatch exit cleanly (tests/train/test_stop_signals.py).
* SIGUSR1: the agent has no handler and dies; each rank sees its launcher gone within a second,
  saves at the step boundary and exits (vlp.distributed.exit_with_launcher).
* A second Ctrl-C reaches the agent inside its shutdown, and it sends SIGTERM to the ranks: after
  a Ctrl-C, that aborts at once, nothing saved (vlp.train.interrupt; checked on one process here)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import forked
from stops import (STEPS, Segment, child_pids, final_weights, last_step, saved_steps,
                   train_args, vlp_lines)
from vlp.train.interrupt import FIRST, SECOND
from vlp_testing import PYTHON, REPO, free_port, run_env

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
SAMPLES = STEPS * 16  # 60 steps at world 2: room for every stop's steps on a loaded box
AGENT_TRACEBACK = re.compile(r"torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: "
                             r"Process \d+ got signal: (\d+)$")


def _launcher(kind: str) -> list[str]:
    port = str(free_port())
    if kind == "accelerate launch":
        return [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", port]
    return [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=vlp-bare", "--rdzv-conf=last_call_timeout=1",
            "--monitor-interval=0.5"]


def _tracebacks(err: str) -> list[list[str]]:
    """Every traceback in `err`: its lines up to the exception's."""
    blocks, open_block = [], None
    for line in err.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            open_block = [line]
            blocks.append(open_block)
        elif open_block is not None and line.strip() and not line.startswith((" ", "W1", "I1")):
            open_block.append(line)
            open_block = None
        elif open_block is not None:
            open_block.append(line)
    return blocks


def _only_the_agents_traceback(err: str, sig: int | None) -> None:
    """No traceback but torch's agent's SignalException for `sig` (None: none at all), with no
    frame of vlp's."""
    for block in _tracebacks(err):
        found = AGENT_TRACEBACK.match(block[-1])
        assert found and int(found.group(1)) == sig, "\n".join(block)
        assert not any(f"{os.sep}vlp{os.sep}" in x for x in block), "\n".join(block)


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory) -> dict:
    """The weights of the same 2-rank run never stopped."""
    out = tmp_path_factory.mktemp("bare_reference")
    whole = forked.run([*_launcher("accelerate launch"), *train_args(tiny_shards, out, f"train.samples={SAMPLES}")],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return final_weights(out)


def _env() -> dict:
    return run_env() | {"ACCELERATE_USE_CPU": "1"}


STOPS = [(signal.SIGTERM, 1, "preempted at step", "(SIGTERM)"),
         (signal.SIGUSR1, -signal.SIGUSR1, "preempted at step", "(its launcher died)"),
         (signal.SIGINT, 1, "interrupted at step", "(SIGINT)")]  # launcher's status, the line's words


@pytest.mark.multiproc
@pytest.mark.parametrize("kind, stops", [("accelerate launch", STOPS), ("torchrun elastic", STOPS[:2])],
                         ids=["accelerate launch", "torchrun elastic"])
def test_every_stop_of_a_bare_launcher_saves_and_resumes_bit_identical(kind, stops, tiny_shards, tmp_path, reference):
    """accelerate launch: every stop; elastic torchrun (the same agent code once it runs): SIGTERM
    and SIGUSR1, the two ways its agent ends."""
    out = tmp_path / "run"

    def segment() -> Segment:
        cmd = [*_launcher(kind), *train_args(tiny_shards, out, f"train.samples={SAMPLES}", "train.resume=latest")]
        seg = Segment(cmd, _env(), last_step(out))
        seg.wait_for(out)
        seg.ranks = child_pids(seg.proc.pid)
        assert len(seg.ranks) == 2, seg.ranks
        return seg

    for sig, status, words, why in stops:
        seg = segment()
        seg.signal(sig)
        code, err = seg.end()
        lines = vlp_lines(err)
        stop = [x for x in lines if words in x]
        assert code == status and len(stop) == 1 and why in stop[0], (code, lines, err[-4000:])
        assert len(lines) == (2 if sig == signal.SIGINT else 1), lines  # SIGINT: FIRST, then the stop
        _only_the_agents_traceback(err, None if sig == signal.SIGUSR1 else int(sig))
        step = int(stop[0].split(" at step ")[1].split()[0])
        assert step in saved_steps(out), (lines, saved_steps(out))

    seg = Segment([*_launcher(kind), *train_args(tiny_shards, out, f"train.samples={SAMPLES}", "train.resume=latest")],
                  _env(), last_step(out))  # to the end
    code, err = seg.end()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    mine = final_weights(out)
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)


RANK = """
import sys, time
from vlp import distributed
from vlp.train import preempt
distributed.STOP_GRACE_S = float(sys.argv[2])
stop = preempt.Preemption().install()
distributed.exit_with_launcher(poll_s=0.05)
print("ready", flush=True)
while not stop.requested:
    time.sleep(0.01)
print("stopping:", stop.signame, flush=True)
time.sleep(float(sys.argv[1]))  # the save
print("saved", flush=True)
"""
LAUNCHER = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)"
BLOCKED = """
from vlp.train import preempt
import os
preempt.Preemption().install()
print("ready", flush=True)
os.read(os.pipe()[0], 1)  # blocked in a C call: only the watch thread can end it
"""


@pytest.mark.multiproc
def test_sigterm_after_a_ctrl_c_aborts_at_once():
    """A bare launcher answers a second Ctrl-C with SIGTERM to its ranks (torch's agent gets it
    inside its shutdown; seen with torchrun on this box): after a Ctrl-C, SIGTERM aborts at once
    with the second Ctrl-C's line, nothing saved, even from inside a C call."""
    proc = subprocess.Popen([PYTHON, "-c", BLOCKED], cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.stderr.readline().strip() == FIRST.strip()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.splitlines() == [SECOND.strip()], (proc.returncode, err)


@pytest.mark.multiproc
@pytest.mark.parametrize("save_s, grace_s, ends", [(0.5, 60, "saved"), (60, 1, "stops")])
def test_a_rank_whose_launcher_died_saves_within_the_grace(save_s, grace_s, ends):
    """A rank whose launcher is SIGKILLed stops like a preempted one (its save goes on); one whose
    save outlasts STOP_GRACE_S ends with one line."""
    env = run_env() | {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1", "RANK": "0"}
    launcher = subprocess.Popen([PYTHON, "-c", LAUNCHER, PYTHON, "-c", RANK, str(save_s), str(grace_s)], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        assert launcher.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        os.kill(launcher.pid, signal.SIGKILL)
        rest = launcher.communicate(timeout=grace_s + save_s + 30)[0].splitlines()  # the rank holds the pipe
        took = time.monotonic() - t0
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert rest[0] == "stopping: its launcher died", rest
    if ends == "saved":
        assert rest[1:] == ["saved"], rest
    else:
        assert rest[1:] == [f"vlp: error: launcher (pid {launcher.pid}) is gone; rank 0 stops"], rest
        assert grace_s <= took < save_s, took
