"""Run several bench/ scripts, each as its own process, after paying Python's imports once.

    python tests/support/bench_batch.py JOBS.json

JOBS.json: [[script path, [argv...], log path, limit seconds], ...]. This process imports torch,
open_clip and vlp (what every script's main() imports: about 6 CPU seconds each time), then forks
one child per script, in order: the child runs the script as `python SCRIPT ARGV...` would
(runpy, `__name__ == "__main__"`, sys.argv set), its stdout into LOG.out and its stderr into
LOG.err, in a session of its own; a child past its limit is killed with its process group. Writes each
script's CPU seconds (its own and its waited-for children's) to stderr as it ends, and prints one line of JSON at
the end: each script's exit code (a negative signal number as subprocess gives it, "timeout" when
killed at its limit). Used by tests/test_bench_smoke.py.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

import bench._common  # noqa: F401  (imported once here, inherited by every forked script;
import open_clip  # noqa: F401         the repo is on PYTHONPATH: vlp_testing.run_env)
import torch  # noqa: F401
import vlp.train.loop  # noqa: F401


def _child(script: str, argv: list[str], log: str) -> None:
    """In the forked child: run the script as its own program, then its exit handlers (its temporary
    folders go), without the parent's."""
    os.setsid()
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # a script killed at its limit leaves what it printed
    sys.argv = [script, *argv]
    atexit._clear()  # the parent's exit handlers are not the script's; its own run below, as at a real exit
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(script: str, argv: list[str], log: str, limit_s: float) -> int | str:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(script, argv, log)
    deadline = time.monotonic() + limit_s
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:  # its CPU with its waited-for children's (the runs it started), for the log
            print(f"bench_batch: {Path(script).name} {usage.ru_utime + usage.ru_stime:.1f} CPU s", file=sys.stderr)
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.1)


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([_run(*job) for job in jobs]), flush=True)


if __name__ == "__main__":
    main()
