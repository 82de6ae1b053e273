"""The suite leaves nothing behind in the machine's temp dir (issue 48): a few representative tests
(an in-process loader with a worker, a process SIGKILLed on purpose, a 2-rank `accelerate launch`
whose elastic agent writes its log folders) run in a pytest of their own with a TMPDIR of their
own, which must be empty when it ends but for pytest's own (empty) root folder.

That pytest is started as `nohup pytest ... &` in a script starts it (the shell ignores SIGINT in
its background jobs, nohup ignores SIGHUP, and every process started below inherits both), on one
xdist worker as the README's command runs them: a Ctrl-C test among the representatives checks
that tests/conftest.py gave the pytest processes Python's handler back, and the last one that the
processes a test starts take SIGINT and SIGHUP. Without it, a suite started so failed its Ctrl-C
tests (a rank never saw the signal; launch/local.sh cannot trap a signal ignored on entry) and its
SIGHUP tests (a `vlp` started with SIGHUP ignored keeps ignoring it, as under nohup it should)."""
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from vlp_testing import PYTHON, REPO, run_env

REPRESENTATIVE = [
    "tests/data/test_stream.py::test_start_batch_resumes_exactly",
    "tests/checkpoint/test_runlock.py::test_killed_holder_is_stale",
    "tests/cli/test_cluster.py::test_a_preempted_launch_says_it_once_and_exits_0_with_the_marker",
    "tests/train/test_stop_signals.py::test_under_a_launcher_that_forwards_sigint_its_copy_is_not_a_second_ctrl_c",
    "tests/test_leftovers.py::test_the_processes_a_test_starts_take_sigint_and_sighup",
]


def _as_nohup_in_the_background() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_the_processes_a_test_starts_take_sigint_and_sighup():
    """Whatever way this pytest was started (the test above starts one under nohup, in the background)."""
    child = subprocess.run([PYTHON, "-c", "import os; print(open('/proc/self/status').read())"],
                           capture_output=True, text=True, check=True).stdout
    mask = int(next(x for x in child.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
    assert not mask & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGHUP - 1)), hex(mask)


def _left(folder: Path) -> list[str]:
    """What is in `folder`, but pytest's root (pytest-of-USER) with its 'pytest-current' link."""
    found = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        found += [str(rel / name) for name in files + dirs if not (
            rel == Path(".") and name.startswith("pytest-of-") or rel.name.startswith("pytest-of-") and
            name == "pytest-current" and os.path.islink(Path(root) / name))]
    return sorted(found)


@pytest.mark.multiproc
def test_representative_tests_leave_their_temp_dir_empty_and_take_ctrl_c_when_started_in_the_background():
    """The watched folder is a short path of the machine's temp dir: nested in pytest's tree, the
    inner tests' AF_UNIX socket paths (multiprocessing's) pass the 108 bytes a socket path may have."""
    watched = Path(tempfile.mkdtemp(prefix="vlp-left-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        env = run_env() | {"TMPDIR": str(watched), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([PYTHON, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", *REPRESENTATIVE],
                              preexec_fn=_as_nohup_in_the_background, stdin=subprocess.DEVNULL, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and " passed in " in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        assert _left(watched) == [], _left(watched)
    finally:
        shutil.rmtree(watched, ignore_errors=True)
