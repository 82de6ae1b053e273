"""`python -m vlp ...` processes that skip the imports: forked from a server that has done them.

A `vlp train` the tests start spent 6 to 7 of its 7 to 9 CPU seconds importing torch, torchvision
(which imports torch._dynamo), open_clip (which imports transformers and timm) and vlp: about 550
of the full suite's 1,800 CPU seconds on 2 cores (docs/testing.md). `Popen` and `run` here take
subprocess's arguments. A command `[sys.executable, "-m", "vlp", ...]` whose environment agrees
with the server's on what Python and the imported libraries read at start (STARTUP_PREFIXES) goes
to this test process's server, started on first use: it forks, and the child takes the caller's
stdin/stdout/stderr (passed as descriptors), cwd, environment (TMPDIR included), argv and, if
asked, a session of its own, runs vlp's `__main__` as `python -m vlp` does and exits through the
interpreter's shutdown. It is a real process with its own pid: signals, exit statuses, pipes,
locks and files behave as for an exec'd one; only its parent is the server, which reports its
wait status back. Any other command (a launcher, a `-c` script, an old release's tree on
PYTHONPATH) is exec'd as by subprocess. tests/cli/test_forked.py compares the two.

Ranks under `accelerate launch` and the SLURM jobs are exec'd by their launchers as in production,
and tests/test_packaging.py runs the installed `vlp` script: those keep the cold start covered.

    python tests/support/forked.py SOCKET     the server (what Popen starts; not run by hand)
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from vlp_testing import REPO, run_env

MODULES = ("vlp", "forked_probe")  # what the server may run: vlp, and the probe tests/cli/test_forked.py uses
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "CUDA_", "TORCH", "LD_", "MALLOC_",  # read once, at
                    "HF_", "HUGGINGFACE", "TRANSFORMERS", "TIMM", "FSSPEC", "XDG_")  # start or import
_STATUS = struct.Struct("i")
_MAX_REQUEST = 1 << 20
START_LIMIT_S = 300  # the server's imports: ~7 s on an idle box


def _startup_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def forkable(args, env) -> bool:
    """Whether `args` is `python -m MODULE ...` (MODULES) with the server's start-up environment."""
    args = [os.fspath(a) for a in args] if isinstance(args, (list, tuple)) else None
    return (args is not None and args[:2] == [sys.executable, "-m"] and len(args) > 2 and args[2] in MODULES
            and _startup_env(os.environ if env is None else env) == _startup_env(run_env()))


class _Server:
    """This test process's fork server, started on first use and ended at exit."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vlp-forked-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], cwd=REPO, env=run_env(),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # stderr: a crash shows
        atexit.register(self.close)
        ready, deadline = self.path + ".ready", time.monotonic() + START_LIMIT_S
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tests/support/forked.py's server did not start (exit status {self.proc.poll()})")
            select.select([], [], [], 0.05)

    def start(self, request: dict, fds: list[int]) -> tuple[socket.socket, int]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        pid = _STATUS.unpack(conn.recv(_STATUS.size))[0]
        return conn, pid

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # gone already when pytest removed its tree first


_SERVER: list[_Server] = []
_LOCK = threading.Lock()


def _server() -> _Server:
    with _LOCK:
        if not _SERVER or _SERVER[0].proc.poll() is not None:
            _SERVER[:] = [_Server()]
        return _SERVER[0]


class Popen(subprocess.Popen):
    """subprocess.Popen; `python -m vlp ...` forked from the server (see the module's doc)."""

    _conn = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        plain = not (shell or preexec_fn or pass_fds or executable or uid is not None or gid is not None
                     or gids or umask != -1 or process_group != -1)
        if not (plain and forkable(args, env)):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                                          start_new_session, process_group)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        args = [os.fspath(a) for a in args]
        request = {"module": args[2], "argv": args[3:], "cwd": os.fspath(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "new_session": bool(start_new_session)}
        self._conn, self.pid = _server().start(request, fds)
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags):
        if self._conn is None:
            return super()._try_wait(wait_flags)
        if wait_flags & os.WNOHANG and not select.select([self._conn], [], [], 0)[0]:
            return 0, 0
        data = self._conn.recv(_STATUS.size)
        self._conn.close()
        if len(data) != _STATUS.size:  # the server is gone: as waitpid with SIGCLD ignored
            return self.pid, 0
        return self.pid, _STATUS.unpack(data)[0]

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._conn is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, sts = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(sts)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run with Popen from here."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# The server.

def _serve(path: str) -> tuple[dict, list[int]]:
    """Accepts requests until the caller is gone; returns (request, fds) in each forked child."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    parent, live = os.getppid(), {}
    Path(path + ".ready").touch()
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, conn, *live.values()):
                    other.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            conn.sendall(_STATUS.pack(pid))
            live[pid] = conn
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = live.pop(pid)
                try:
                    conn.sendall(_STATUS.pack(status))
                except OSError:  # the caller is gone
                    pass
                conn.close()
    sys.exit(0)


def _child(request: dict, fds: list[int]) -> None:
    """As `python -m MODULE ARGV...` in the caller's cwd, environment and standard streams."""
    import runpy

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() read TMPDIR in the server; here it reads the caller's
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main(path: str) -> None:
    import open_clip  # noqa: F401  (what every `vlp` command imports; the children inherit it)
    import torch  # noqa: F401

    import vlp.cli  # noqa: F401
    import vlp.eval.checkpoints  # noqa: F401
    import vlp.train.loop  # noqa: F401

    gc.freeze()  # a child's collections skip what it inherited: no copy-on-write of the whole heap
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _child(*_serve(path))


if __name__ == "__main__":
    main(sys.argv[1])
