"""tests/support/forked.py: a `python -m vlp` forked from the server is the process an exec'd one is,
less the imports (the slow tier's single-process CLI runs go through it)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forked
from vlp_testing import REPO, run_env

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

TESTS = REPO / "tests" / "support"  # forked_probe.py


def _probe(run, tmp_path, *extra, **kwargs):
    env = run_env() | {"PROBE": "x y", "TMPDIR": str(tmp_path)}
    proc = run([sys.executable, "-m", "forked_probe", "3", *extra], cwd=TESTS, env=env, input="in\n",
               capture_output=True, text=True, timeout=120, **kwargs)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_a_forked_process_sees_what_an_execd_one_sees(tmp_path):
    code, seen, err = _probe(forked.run, tmp_path, "a b", str(tmp_path))
    ref_code, ref, ref_err = _probe(subprocess.run, tmp_path, "a b", str(tmp_path))
    assert ref["ppid"] == os.getpid() != seen["ppid"]  # the forked one's parent is the server
    del seen["ppid"], ref["ppid"]
    assert (code, seen, err) == (ref_code, ref, ref_err) == (3, {
        "argv": ["3", "a b", str(tmp_path)], "cwd": str(TESTS), "path0": str(TESTS), "tmp": str(tmp_path),
        "probe": "x y", "stdin": "in\n", "main": "__main__", "own_group": False}, "to stderr\n")
    _, alone, _ = _probe(forked.run, tmp_path, start_new_session=True)
    assert alone["own_group"] is True


def test_the_vlp_command_answers_alike_forked_and_execd(tmp_path):
    cmd = [sys.executable, "-m", "vlp", "train", "-c", "configs/demo.yaml", "train.bogus=1",
           f"train.output_dir={tmp_path}"]
    got = [run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
           for run in (forked.run, subprocess.run)]
    assert [(p.returncode, p.stdout, p.stderr) for p in got][0] == [(p.returncode, p.stdout, p.stderr) for p in got][1]
    assert got[0].returncode == 2 and got[0].stderr.startswith("vlp: error: config: unknown key 'train.bogus'")
    assert list(tmp_path.iterdir()) == []


def test_signals_time_outs_and_exit_statuses(tmp_path):
    child = forked.Popen([sys.executable, "-m", "forked_probe", "sleep"], cwd=TESTS, env=run_env(),
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "sleeping\n" and child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    child.stdout.close()
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-m", "forked_probe", "sleep"], cwd=TESTS, env=run_env(), timeout=1,
                   stdout=subprocess.DEVNULL)
    assert time.monotonic() - started < 60  # killed at its time-out, not left running


@pytest.mark.parametrize("cmd, env", [
    (["-c", "import os; print(os.getppid())"], {}),                     # not `-m` of a module it may run
    (["-m", "forked_probe", "0"], {"OMP_NUM_THREADS": "2"}),             # read at start: differs from the server's
    (["-m", "forked_probe", "0"], {"PYTHONPATH": str(TESTS)}),           # another tree on the path
], ids=["script", "threads", "path"])
def test_other_commands_are_execd(cmd, env):
    proc = forked.run([sys.executable, *cmd], cwd=TESTS, env=run_env() | env, capture_output=True, text=True,
                      timeout=120, input="")
    assert proc.returncode == 0, proc.stderr
    ppid = int(proc.stdout) if cmd[0] == "-c" else json.loads(proc.stdout)["ppid"]
    assert ppid == os.getpid()
