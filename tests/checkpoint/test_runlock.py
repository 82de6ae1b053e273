"""One writer per run folder (vlp/checkpoint/lock.py, issue 21), with real processes: a live holder is
refused by name, a killed one's lock is reported and taken over, another host's is refused with
advice unless train.break_lock=true, the lock goes at exit (also on an exception), and of two
processes racing for one folder exactly one wins."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from vlp.checkpoint import lock as runlock
from vlp.checkpoint.storage import RunFolder
import forked
from vlp_testing import REPO, run_env

HOLD = """
import sys, time
from vlp.checkpoint import lock as runlock
from vlp.checkpoint.storage import RunFolder
lock = runlock.acquire(RunFolder(sys.argv[1]))
print("locked", flush=True)
{body}
"""


def holder(folder, body="time.sleep(60)"):
    """A process holding `folder`'s lock; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(body=body), str(folder)], cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


@pytest.mark.multiproc
def test_live_holder_refuses_a_second_writer_then_releases(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(runlock.RunLockError) as e:
            runlock.acquire(RunFolder(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and f"pid {proc.pid} on host {socket.gethostname()}" in msg
        assert "in use by another trainer" in msg and "another train.output_dir" in msg
    finally:
        proc.terminate()
        proc.wait()
    # SIGTERM skips atexit: the lock stays, and is stale now
    logs = []
    lock = runlock.acquire(RunFolder(tmp_path), log=logs.append)
    assert len(logs) == 1 and "took over the stale lock" in logs[0] and f"pid {proc.pid}" in logs[0]
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / runlock.LOCK_NAME).exists()


@pytest.mark.multiproc
def test_killed_holder_is_stale(tmp_path):
    proc = holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logs = []
    runlock.acquire(RunFolder(tmp_path), log=logs.append).release()
    assert "stale" in logs[0] and "that process is gone" in logs[0]
    assert not (tmp_path / runlock.LOCK_NAME).exists()


def test_reused_pid_is_not_the_holder(tmp_path):
    """A lock naming a live pid whose process started at another time (the pid was reused)."""
    me = {"pid": os.getppid(), "host": socket.gethostname(), "pid_start": "1", "started": "then"}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(me))
    logs = []
    runlock.acquire(RunFolder(tmp_path), log=logs.append).release()
    assert "stale" in logs[0]


def test_other_host_is_refused_with_advice_unless_broken(tmp_path):
    other = {"pid": 1, "host": "node-17", "started": "2026-12-01T10:00:00+00:00", "token": "x"}
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(runlock.RunLockError, match="locked by pid 1 on host node-17.*train.break_lock=true"):
        runlock.acquire(RunFolder(tmp_path))
    logs = []
    lock = runlock.acquire(RunFolder(tmp_path), break_lock=True, log=logs.append)
    assert "broke the lock" in logs[0] and "node-17" in logs[0]
    lock.release()


@pytest.mark.multiproc
@pytest.mark.parametrize("body", ["raise SystemExit(3)", "raise RuntimeError('boom')", "pass"])
def test_lock_is_released_at_exit_and_on_exceptions(tmp_path, body):
    proc = holder(tmp_path, body)
    proc.wait(timeout=60)
    assert proc.returncode != 0 or body == "pass"
    assert not (tmp_path / runlock.LOCK_NAME).exists()


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    lock = runlock.acquire(RunFolder(tmp_path))
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "node-2", "token": "theirs"}))
    lock.release()
    assert (tmp_path / runlock.LOCK_NAME).exists()


RACE = """
import sys
from vlp.checkpoint import lock as runlock
from vlp.checkpoint.storage import RunFolder
print("ready", flush=True)
sys.stdin.readline()  # go: every racer has its imports behind it
try:
    runlock.acquire(RunFolder(sys.argv[1]), log=lambda m: None)
    print("won", flush=True)
    sys.stdin.read()  # the winner holds the lock until every racer has answered
except runlock.RunLockError:
    print("refused", flush=True)
"""


@pytest.mark.multiproc
def test_of_racing_writers_exactly_one_wins(tmp_path):
    """Three processes acquire the lock at once; the start is a barrier (each has imported and said
    ready), not a wall-clock time, so a slow start on a loaded box cannot make a late racer find the
    lock already released."""
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path)], cwd=REPO, env=run_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    assert outs == ["refused", "refused", "won"]


def test_break_lock_is_a_config_key():
    from vlp.config import ConfigError
    from vlp.experiment import load_config

    assert load_config(None, ["train.break_lock=true"]).train.break_lock is True
    with pytest.raises(ConfigError, match="train.break_lock must be bool"):
        load_config(None, ["train.break_lock=maybe"])


@pytest.mark.multiproc
def test_second_vlp_train_on_a_locked_folder_is_one_line_and_writes_nothing(tmp_path, tiny_shards):
    out = tmp_path / "run"
    proc = holder(out)
    try:
        before = sorted(p.name for p in out.iterdir())
        args = ["-m", "vlp", "train", "-c", str(REPO / "configs/demo.yaml"),
                f"data.train_shards={tiny_shards['train']}",
                f"train.output_dir={out}", "model.name=vlp-micro", "train.samples=32", "data.batch_per_device=16"]
        res = forked.run([sys.executable, *args], cwd=REPO, env=run_env(), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 2, res.stderr[-2000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(errors) == 1 and errors[0].startswith("vlp: error: run folder") and f"pid {proc.pid}" in errors[0]
        assert sorted(p.name for p in out.iterdir()) == before  # no config.yaml, no log
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.multiproc
def test_second_vlp_compare_on_a_locked_grid_folder_is_one_line(tmp_path, tiny_shards):
    out = tmp_path / "grid"
    proc = holder(out)
    try:
        before = sorted(p.name for p in out.iterdir())
        args = ["-m", "vlp", "compare", "-c", str(REPO / "configs/compare_small_batch.yaml"),
                f"data.train_shards={tiny_shards['train']}", f"data.eval_shards={tiny_shards['eval']}",
                f"grid.out_dir={out}", "grid.sweep=null", "grid.final_seeds=null", "grid.regimes=null", "grid.accum_price=null", "grid.datasets=null",
                "grid.sweep_bounds=null", "grid.workers=1", "grid.batch_per_device=[8]",
                "grid.losses=[infonce]", "grid.seeds=[0]", "grid.seeds_until=null",
                "train.samples=32"]
        res = forked.run([sys.executable, *args], cwd=REPO, env=run_env(), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 2, res.stderr[-2000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(errors) == 1 and errors[0].startswith("vlp: error:") and f"pid {proc.pid}" in errors[0], errors
        assert sorted(p.name for p in out.iterdir()) == before  # no run folder, no report
    finally:
        proc.kill()
        proc.wait()
