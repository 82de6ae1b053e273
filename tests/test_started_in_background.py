"""The suite started as a script's background job (`pytest &`: the shell ignores SIGINT in it, and
every process started below inherits that) still tests Ctrl-C: tests/conftest.py gives the pytest
processes Python's handler back, so the processes a test starts can take a SIGINT. Without it, a
run of the suite started so failed the Ctrl-C tests (a rank never saw the signal, and
launch/local.sh cannot trap a signal ignored on entry)."""
import signal
import subprocess

import pytest

from vlp_testing import PYTHON, REPO, run_env

CTRL_C = "tests/train/test_stop_signals.py::test_under_a_launcher_that_forwards_sigint_its_copy_is_not_a_second_ctrl_c"


@pytest.mark.multiproc
def test_a_suite_started_with_sigint_ignored_still_tests_ctrl_c():
    """One xdist worker, as the README's command runs them: the test asserts that its worker's
    parent (the pytest controller) catches SIGINT, then Ctrl-Cs a process the worker started."""
    done = subprocess.run([PYTHON, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", CTRL_C],
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                          stdin=subprocess.DEVNULL, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
