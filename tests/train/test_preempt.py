"""Preemption flag logic (vlp/train/preempt.py, issue 21): a signal sets the flag, every rank agrees on
it at the next step, the stop is a Preempted line with exit 75 and (when asked) a requeue marker."""
import os
import signal
import subprocess
import sys
import time

import pytest

from vlp.train import preempt
from vlp_testing import REPO, run_env


def test_signal_sets_the_flag_and_uninstall_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with preempt.Preemption() as stop:
        assert not stop.requested and not stop.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one's name
        time.sleep(0.05)
        assert stop.requested and stop.should_stop() and stop.signame == "SIGUSR1"
        e = stop.stopped(12, "runs/x/checkpoints/step_00000012.pt")
    assert signal.getsignal(signal.SIGUSR1) is before
    assert str(e) == ("preempted at step 12 (SIGUSR1); saved runs/x/checkpoints/step_00000012.pt; "
                      "resume with train.resume=latest")
    assert preempt.EXIT_PREEMPTED == 75


def test_marker_is_written_by_the_main_process_only(tmp_path, monkeypatch):
    marker = tmp_path / "preempted"
    monkeypatch.setenv(preempt.MARKER_ENV, str(marker))
    stop = preempt.Preemption()
    stop.stopped(3, is_main=False)
    assert not marker.exists()
    stop.stopped(3)
    assert marker.read_text() == "3\n"


def _ranks(rank, world):
    """Rank 1 alone gets SIGUSR1 before step 2; both must stop after step 2."""
    stop = preempt.Preemption().install()
    stopped_at = None
    for step in range(1, 6):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
        if stop.should_stop():
            stopped_at = step
            break
    stop.uninstall()
    return {"step": stopped_at, "why": str(stop.stopped(stopped_at, is_main=rank == 0))}


@pytest.mark.multiproc
def test_all_ranks_stop_after_the_same_step_when_one_is_signalled():
    from dist_utils import run_distributed

    out = run_distributed(_ranks, 2)
    assert [r["step"] for r in out] == [2, 2]
    assert "(another rank's signal)" in out[0]["why"] and "(SIGUSR1)" in out[1]["why"]


LOOP = """
import sys, time
from vlp.train import preempt
stop = preempt.Preemption().install()
print("ready", flush=True)
step = 0
while True:
    time.sleep(0.01)  # a training step
    step += 1
    if stop.should_stop():
        print(stop.stopped(step, "ckpt.pt"), file=sys.stderr)
        sys.exit(preempt.EXIT_PREEMPTED)
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_process_signalled_mid_run_exits_75_with_one_line(tmp_path, sig):
    env = dict(run_env(), VLP_PREEMPT_MARKER=str(tmp_path / "marker"))
    proc = subprocess.Popen([sys.executable, "-c", LOOP], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preempted at step ") and signal.Signals(sig).name in lines[0]
    assert (tmp_path / "marker").exists()


def test_exit_status_is_0_under_a_launcher_with_a_marker_else_75():
    launched = {"TORCHELASTIC_RUN_ID": "x"}
    assert preempt.exit_status(launched | {preempt.MARKER_ENV: "/m"}) == 0
    assert preempt.exit_status(launched) == preempt.EXIT_PREEMPTED
    assert preempt.exit_status({preempt.MARKER_ENV: "/m"}) == preempt.EXIT_PREEMPTED  # plain process


def test_only_the_main_rank_marks_lost_peers(tmp_path):
    marker = tmp_path / "m"
    preempt.mark_lost_peers({preempt.MARKER_ENV: str(marker), "RANK": "1"})
    assert not marker.exists()
    preempt.mark_lost_peers({preempt.MARKER_ENV: str(marker), "RANK": "0"})
    assert marker.read_text() == "lost-peers\n"
    assert not preempt.Preemption().stopped(3, is_main=False).is_main


def test_a_rank_stopped_by_a_peer_names_its_launchers_death_when_it_shares_it(monkeypatch):
    """Ranks see their launcher die up to a poll apart: one stopped by a peer's flag (received -1)
    names the launcher's death when its own launcher is gone too, else "another rank's signal"."""
    from vlp import distributed

    stop = preempt.Preemption()
    stop.received = -1
    monkeypatch.setattr(distributed, "_LAUNCHER", [os.getppid()])  # alive
    assert "(another rank's signal)" in str(stop.stopped(3))
    monkeypatch.setattr(distributed, "_LAUNCHER", [os.getppid() + 1])  # not this process's parent: gone
    assert "(its launcher died)" in str(stop.stopped(3))
