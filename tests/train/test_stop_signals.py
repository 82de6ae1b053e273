"""Runs stopped as users stop them (issue 41), with loader workers (data.num_workers=2, as every
shipped GPU config has them): a signal to the run's whole process group (timeout(1),
`kill -- -PGID`, SLURM, a terminal's Ctrl-C), a second Ctrl-C, a loader worker killed on its
own, the main process SIGKILLed. One run folder goes through every stop in turn, each segment
resuming from the newest checkpoint (train.resume=latest), and its final weights must equal an
uninterrupted run's (torch.equal). The launched twin (2 ranks over gloo, launch/local.sh)
takes the same signals. No segment may print a traceback."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

import forked
from stops import (STEPS, Segment, check_end, child_pids, ctrl_c_twice, final_weights, is_alive, last_step, saved_steps,
                   train_args)
from vlp.data.lifecycle import Board
from vlp.train.interrupt import ECHO_S, FIRST, SECOND
from vlp_testing import PYTHON, REPO, free_port, run_env

STOPS = [(signal.SIGTERM, 75, "preempted at step"), (signal.SIGUSR1, 75, "preempted at step"),
         (signal.SIGINT, 130, "interrupted at step"), (signal.SIGHUP, 129, "hung up at step")]  # each signal to the group: exit status, line


def _each_stop_saves(segment, out) -> Iterator[tuple[int, list[str], str]]:
    """For each of STOPS: a new segment of the run, the signal to its group once it trains, its
    exit checked (status, one line, no traceback) and the step it names saved; yields
    (signal, its lines, its stderr) for the caller's own checks."""
    for sig, status, words in STOPS:
        seg = segment()
        seg.wait_for(out)
        seg.signal(sig)
        code, err = seg.end()
        lines = check_end(code, err, status, words)
        step = int(lines[-1].split(" at step ")[1].split()[0])
        assert step in saved_steps(out), (lines, saved_steps(out))
        yield sig, lines, err


@pytest.mark.multiproc
def test_every_stop_of_a_plain_run_with_workers_then_resume_bit_identical(tiny_shards, tmp_path):
    """`vlp train` with 2 loader workers: SIGTERM, SIGUSR1 and SIGINT to the process group each save
    at the step boundary with one line (exit 75, 75, 130), SIGHUP too (129) but not under nohup; a
    loader worker SIGKILLed is one line
    naming it, its shard and the step (exit 1, nothing saved); two Ctrl-C exit 130 at once; the
    main process SIGKILLed takes its workers with it. Resumed after each, the run ends with the
    weights of a run never stopped."""
    env = run_env()
    ref, out = tmp_path / "ref", tmp_path / "run"
    whole = forked.run([PYTHON, *train_args(tiny_shards, ref, f"train.samples={STEPS * 8}")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=400)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cmd = [PYTHON, *train_args(tiny_shards, out, f"train.samples={STEPS * 8}", "train.resume=latest")]

    def segment() -> Segment:
        return Segment(cmd, env, last_step(out))

    for sig, lines, _ in _each_stop_saves(segment, out):
        assert f"({signal.Signals(sig).name})" in lines[-1], lines
        if sig == signal.SIGINT:
            assert len(lines) == 2 and "press Ctrl-C again to abort without saving" in lines[0], lines

    seg = Segment(["nohup", *cmd], env, last_step(out))  # under nohup a SIGHUP is no stop; SIGTERM still is
    seg.wait_for(out)
    seg.signal(signal.SIGHUP)
    seg.after = last_step(out)
    seg.wait_for(out)
    seg.signal(signal.SIGTERM)
    code, err = seg.end()
    assert not any("hung up" in line for line in check_end(code, err, 75, "preempted at step")), err

    seg = segment()  # a loader worker dies on its own (the OOM killer's SIGKILL)
    seg.wait_for(out)
    saved = saved_steps(out)
    workers = child_pids(seg.proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    code, err = seg.end()
    lines = check_end(code, err, 1, "was killed by signal SIGKILL")
    assert len(lines) == 1 and f"(pid {workers[1]})" in lines[0] and "while reading " in lines[0], lines
    assert "train-00000" in lines[0] and ", at step " in lines[0] and "not saved" in lines[0], lines
    assert saved_steps(out)[:len(saved)] == saved  # every checkpoint before is still there

    seg = segment()  # two Ctrl-C: out at once, nothing saved
    seg.wait_for(out)
    saved = saved_steps(out)
    ctrl_c_twice(seg, [seg.proc.pid], [seg.proc.pid])
    code, err = seg.end()
    check_end(code, err, 130, "aborted by a second Ctrl-C")
    assert saved_steps(out) == saved, (saved, saved_steps(out))

    seg = segment()  # SIGKILL to the main process alone: its workers go with it
    seg.wait_for(out)
    workers = child_pids(seg.proc.pid)
    os.kill(seg.proc.pid, signal.SIGKILL)
    seg.end()
    deadline = time.time() + 10
    while any(map(is_alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    assert workers and not any(map(is_alive, workers)), "loader workers outlived their main process"

    seg = segment()  # to the end
    code, err = seg.end()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    mine, theirs = final_weights(out), final_weights(ref)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.multiproc
def test_every_stop_of_a_launched_run_through_launch_local(tiny_shards, tmp_path):
    """launch/local.sh (accelerate launch, 2 CPU ranks over gloo, 2 loader workers each): SIGTERM,
    SIGUSR1 and SIGINT to the process group each save after the same step on both ranks with one
    line for the job (exit 75, 75, 130); two Ctrl-C exit 130 at once; each next segment resumes
    from the newest checkpoint."""
    out = tmp_path / "run"
    env = run_env() | {"ACCELERATE_USE_CPU": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    script = str(REPO / "launch" / "local.sh")

    def segment() -> Segment:
        cmd = [script, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
               *train_args(tiny_shards, out, f"train.samples={STEPS * 8}", "train.resume=latest")]
        return Segment(cmd, env, last_step(out))

    for _, _, err in _each_stop_saves(segment, out):
        assert "ChildFailedError" not in err and "SignalException" not in err, err[-3000:]

    seg = segment()
    seg.wait_for(out)
    saved = saved_steps(out)
    launcher = child_pids(seg.proc.pid)
    ranks = [r for pid in launcher for r in child_pids(pid)]
    assert len(ranks) == 2, (launcher, ranks)
    ctrl_c_twice(seg, ranks, ranks)
    code, err = seg.end()
    check_end(code, err, 130, "aborted by a second Ctrl-C")
    assert saved_steps(out) == saved, (saved, saved_steps(out))


BLOCKED = """
import os, sys
from vlp.train import preempt
stop = preempt.Preemption().install()
print("ready", flush=True)
r, w = os.pipe()
os.read(r, 1)  # blocked in a C call for good: only the second Ctrl-C's thread can end it
"""


@pytest.mark.multiproc
def test_a_second_ctrl_c_ends_a_process_blocked_in_a_c_call(tmp_path):
    """The first SIGINT says it will save; the second exits 130 at once with one line, although the
    main thread never returns to Python (vlp/train/interrupt.py reads the signal from a pipe)."""
    proc = subprocess.Popen([PYTHON, "-c", BLOCKED], cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None  # the first one only asks for a save
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines() == [FIRST.strip(), SECOND.strip()], err


@pytest.mark.multiproc
def test_under_a_launcher_that_forwards_sigint_its_copy_is_not_a_second_ctrl_c(tmp_path):
    """A rank whose parent catches SIGINT (torch's agent; here the test process) takes a SIGINT
    within ECHO_S of the first as the agent's copy of it; a later one aborts (exit 0 with
    "aborted" in the marker: the launcher must not report it as its own failure)."""
    from vlp.train.interrupt import parent_catches

    assert parent_catches(signal.SIGINT)  # pytest: Python's KeyboardInterrupt handler
    marker = tmp_path / "marker"
    env = run_env() | {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "VLP_PREEMPT_MARKER": str(marker)}
    proc = subprocess.Popen([PYTHON, "-c", BLOCKED], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # the agent's copy
        time.sleep(0.5)
        assert proc.poll() is None
        time.sleep(max(0.0, ECHO_S + 0.3 - (time.monotonic() - t0)))
        proc.send_signal(signal.SIGINT)  # the user's second Ctrl-C
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and marker.read_text() == "aborted\n", (proc.returncode, err)
    assert err.splitlines() == [FIRST.strip(), SECOND.strip()], err


def test_a_dead_worker_is_named_with_its_shard_from_torchs_words():
    """Board.failure reads the pid out of torch's two reports (the SIGCHLD one and the liveness
    check's) and names the worker and the shard it had opened; other errors are not its own."""
    board = Board(2, ["/d/a.tar", "/d/b.tar", "/d/c.tar"])
    board.cells[0:4] = [101, 2, 102, -1]  # worker 0: pid 101 reading c.tar; worker 1: pid 102, none yet
    killed = RuntimeError("DataLoader worker (pid 101) is killed by signal: Killed. ")
    assert board.failure(killed) == "loader worker 0 (pid 101) was killed by signal Killed while reading /d/c.tar"
    try:
        raise RuntimeError("DataLoader worker (pid(s) 102) exited unexpectedly") from None
    except RuntimeError as e:
        gone = e
    board.ended[102] = "was killed by signal SIGSEGV (a crash in native code, e.g. an image decoder)"
    assert board.failure(gone) == ("loader worker 1 (pid 102) was killed by signal SIGSEGV (a crash in native "
                                   "code, e.g. an image decoder) before it read a shard")
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = killed
    assert board.failure(wrapped).startswith("loader worker 0 (pid 101)")
    assert board.failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
