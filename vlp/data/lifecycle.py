"""A loader worker's life: what signals it takes, when it ends, and what the main process says
when one dies on its own.

    loader = DataLoader(..., worker_init_fn=start_worker)      # the training and eval loaders
    board = Board(num_workers)                                  # main process, before the workers
    note_shard(url)                                             # a worker, as it opens a shard
    board.failure(error)                                        # main: "loader worker 1 (pid N) ..."

Signals and deaths as docs/reliability.md ("How a run stops") tells them. A worker ignores
SIGTERM, SIGUSR1 and SIGINT: the main process takes them, stops at the next step boundary and
saves (vlp.train.preempt), and the save still needs the workers. It never outlives the main
process: the kernel SIGKILLs it when that process ends (PR_SET_PDEATHSIG), and the main process
SIGKILLs the ones still running as it exits (`end_workers`: multiprocessing's SIGTERM at exit is
ignored, and its join would wait forever). Every loader that uses `start_worker` calls
`end_workers_at_exit` as it starts them.

A worker that dies on its own surfaces in the main process wherever a batch was crossing from
it: torch's RuntimeError naming its pid, a ConnectionResetError / ConnectionRefusedError /
EOFError from `rebuild_storage_fd`, or "Pin memory thread exited unexpectedly". `Board.receive`
wraps that crossing: any error there is `WorkerDied`, one line naming the worker, its pid, how it
ended and the shard it was reading (from the shared board), when a worker of the loader has died
(waited for up to DEATH_WAIT_S: a dead worker's sockets close just before the kernel shows it
dead); with every worker alive the error is raised as it is.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import weakref
from typing import Iterator, Optional

IGNORED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # vlp.train.preempt.SIGNALS
DEATH_WAIT_S = 5.0  # Board.death: how long a worker's end may trail the error its death caused
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PIDS = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")
_HOW = re.compile(r"killed by signal: ([^.]+)\.|exit code (-?\d+)")


def start_worker(worker_id: int) -> None:
    """A loader worker's init (worker_init_fn): ignore the run's stop signals, die with the main
    process, seed python/numpy from torch's worker seed."""
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()
    seed_worker(worker_id)
    if sys.excepthook is not _worker_error:
        _WORKER_HOOK[:] = [sys.excepthook]
        sys.excepthook = _worker_error


_WORKER_HOOK: list = []  # in a worker: sys.excepthook before _worker_error


def _worker_error(kind, value, tb) -> None:
    """A worker's sys.excepthook (multiprocessing's resource sharer reports its thread's errors
    there): the main process that ended while a batch's storage was on its way to it (a second
    Ctrl-C, a SIGKILL) is not this worker's error to print; the main process says how it ended."""
    frames, inner = [], tb
    while inner is not None:
        frames.append(inner.tb_frame.f_code.co_filename)
        inner = inner.tb_next
    if issubclass(kind, (ConnectionError, EOFError)) and any(f.endswith("resource_sharer.py") for f in frames):
        return
    (_WORKER_HOOK[0] if _WORKER_HOOK else sys.__excepthook__)(kind, value, tb)


def seed_worker(worker_id: int) -> None:
    """Seed python/numpy RNGs of a worker from torch's (deterministic) worker seed."""
    import random

    import numpy as np
    import torch

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the one that made it ends (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return


class WorkerDied(RuntimeError):
    """A loader worker died on its own; str() is the one line (vlp.cli exits 1 with it)."""


class Board:
    """Per worker: its pid and the index of the shard it reads (-1: none yet), in shared memory
    made by the main process before the workers start (they inherit it)."""

    def __init__(self, workers: int, paths: list[str]):
        self.paths = list(paths)
        self.cells = multiprocessing.Array("q", [-1] * (2 * max(workers, 1)), lock=False)
        self.ended: dict[int, str] = {}  # main process: pid -> how that worker died (SIGCHLD)
        self.processes: dict = {}  # main process: pid -> torch's worker process (watch)
        self.receiving = False  # main process: waiting in `receive` for the next batch

    def watch(self, processes=()) -> None:
        """Main process, once the workers run (`processes`: torch's, for how one ended when torch
        reaped it first): SIGCHLD notes how a worker ended (the exit is peeked at, not reaped:
        torch reaps it) instead of torch's handler, which raised the error wherever the main
        thread was, in the middle of a step or of a checkpoint's write. Here it is raised only
        while the main process waits for a batch (`receive`): at a step boundary, with the
        model's state whole, and at once, not at torch's next liveness check (5 s)."""
        self.processes = {p.pid: p for p in processes}
        _WATCHED.add(self)
        end_workers_at_exit()
        if threading.excepthook is not _thread_error:
            _HOOK[:] = [threading.excepthook]
            threading.excepthook = _thread_error
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, _on_child)

    def peek(self) -> None:
        for i in range(0, len(self.cells), 2):
            pid = self.cells[i]
            if pid <= 0 or pid in self.ended:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already, or not our child
                continue
            if info is not None and info.si_pid and (info.si_code != os.CLD_EXITED or info.si_status != 0):
                self.ended[pid] = _ended(info.si_code == os.CLD_EXITED, info.si_status)

    def receive(self, batches: Iterator) -> Iterator:
        """The loader's batches as they cross from the workers; an error on the way (waiting on the
        queue, unpickling a batch whose storage comes by file descriptor, pinning) is WorkerDied
        when a worker of this board died, else raised as it is."""
        while True:
            try:
                self.receiving = True  # a worker's death raises _Died here (SIGCHLD: _on_child)
                if self.ended:  # it died while the main process was busy: its batches cannot come
                    raise _Died()
                batch = next(batches)
                self.receiving = False
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001  (KeyboardInterrupt passes)
                self.receiving = False
                line = self.death(e)
                if line is None:
                    raise
                _shut_down(batches)
                raise WorkerDied(line) from e
            finally:
                self.receiving = False
            yield batch

    def death(self, error: BaseException) -> Optional[str]:
        """The line for a worker's death behind `error`: torch's words name its pid, or a worker of
        this board has ended (waited for up to DEATH_WAIT_S: its sockets close before the kernel
        shows it dead). None when every worker is alive."""
        line = self.failure(error)
        deadline = time.monotonic() + DEATH_WAIT_S
        while line is None:
            self.peek()
            dead = [pid for pid in self.pids() if pid in self.ended]
            if dead:
                return self._describe(dead, "exited unexpectedly")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        return line

    def _reaped(self, pid: int) -> Optional[str]:
        """How worker `pid` ended, from torch's process object (when torch reaped it first)."""
        code = getattr(self.processes.get(pid), "exitcode", None)
        return None if code is None else _ended(code >= 0, abs(code))

    def pids(self) -> list[int]:
        return [pid for pid in self.cells[::2] if pid > 0]

    def enter(self, worker: int) -> None:
        """In worker `worker`: this process is it; `note_shard` writes here from now on."""
        self.cells[2 * worker] = os.getpid()
        _MINE[:] = [(self, worker)]

    def failure(self, error: BaseException) -> Optional[str]:
        """The line for torch's "DataLoader worker (pid N) ..." error (or its cause), naming the
        worker and the shard it was reading; None for any other error."""
        for e in _chain(error):
            found = _PIDS.search(str(e))
            if found:
                how = _HOW.search(str(e))
                told = ("was killed by signal " + how.group(1) if how and how.group(1) else
                        f"exited with status {how.group(2)}" if how else "exited unexpectedly")
                return self._describe([int(p) for p in found.group(1).replace(",", " ").split()], told)
        return None

    def _describe(self, pids: list[int], told: str) -> str:
        lines = []
        for pid in pids:
            ended = self.ended.get(pid) or self._reaped(pid) or told
            cells = [i for i in range(0, len(self.cells), 2) if self.cells[i] == pid]
            if not cells:
                lines.append(f"loader worker (pid {pid}) {ended}")
                continue
            shard = self.cells[cells[0] + 1]
            reading = f"while reading {self.paths[shard]}" if 0 <= shard < len(self.paths) else "before it read a shard"
            lines.append(f"loader worker {cells[0] // 2} (pid {pid}) {ended} {reading}")
        return "; ".join(lines)


def end_workers_at_exit() -> None:
    """Main process, as it starts loader workers (`start_worker`): at its exit, `end_workers`.
    Registered once, after multiprocessing's own exit hook, so it runs before that one."""
    if not _AT_EXIT:
        atexit.register(end_workers)
        _AT_EXIT.append(True)


def end_workers() -> None:
    """SIGKILL this process's daemonic children still running (its loader workers). They ignore
    SIGTERM, which is how multiprocessing ends daemonic children at exit before joining them, so
    a loader that torch did not shut down (an error ended the run mid-epoch) would keep the exit
    waiting forever. Only unjoined children of this process are signalled (no pid reused by another)."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


_AT_EXIT: list = []  # end_workers is registered once
_MINE: list = []  # in a worker: [(its Board, its index)]
_WATCHED: "weakref.WeakSet[Board]" = weakref.WeakSet()  # main process: the boards of live loaders


_HOOK: list = []  # the threading.excepthook before _thread_error


def _thread_error(args) -> None:
    """threading.excepthook: torch's pinning thread dies of the error that a dead worker's batch
    raised in it; the main process then says it in one line (Board.receive), so the thread's
    traceback is not printed. Any other thread's error goes to the hook before."""
    tb = args.exc_traceback
    pinning = False
    while tb is not None:
        pinning = pinning or tb.tb_frame.f_code.co_name == "_pin_memory_loop"
        tb = tb.tb_next
    if pinning and any(board.death(args.exc_value) for board in list(_WATCHED)):
        return
    (_HOOK[0] if _HOOK else threading.__excepthook__)(args)


def _shut_down(batches) -> None:
    """A loader whose worker died, shut down now (its other workers, queues, pinning thread), not
    whenever its iterator is collected: a process that goes on (vlp compare's next run) must not
    have the dead loader's queue threads writing to pipes whose descriptors are reused."""
    shut = getattr(batches, "_shutdown_workers", None)  # torch's DataLoader iterator
    if shut is not None:
        shut()


class _Died(Exception):
    """Raised by SIGCHLD's handler into a `receive` waiting for a batch: a worker died."""


_WAITS = ("selectors.py", "threading.py")  # where a blocked `receive` waits: the result queue's poll, the pin queue's


def _on_child(signum, frame) -> None:
    """SIGCHLD: note how a watched worker ended; when the main process is blocked waiting for a
    batch (`receive`, in a poll or a lock's wait: not running a finalizer or any other code), end
    the wait now with _Died rather than at torch's next liveness check (5 s). Inside `receive` but
    not yet waiting: SIGCHLD again to the main thread shortly, which lands in that wait."""
    for board in list(_WATCHED):
        board.peek()
        if not (board.receiving and board.ended):
            continue
        if frame is not None and frame.f_code.co_filename.endswith(_WAITS):
            board.receiving = False
            raise _Died()
        if not _AGAIN:
            _AGAIN.append(threading.Timer(0.01, _signal_main_again))
            _AGAIN[0].start()


_AGAIN: list = []  # the pending Timer of _on_child's repeat


def _signal_main_again() -> None:
    _AGAIN.clear()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGCHLD)


def _ended(exited: bool, status: int) -> str:
    """How a child ended: its exit status, or the signal that killed it."""
    if exited:
        return f"exited with status {status}"
    name = signal.Signals(status).name if status in signal.valid_signals() else str(status)
    hint = {"SIGKILL": " (the OOM killer, or a kill -9)", "SIGSEGV": " (a crash in native code, e.g. an image decoder)",
            "SIGBUS": " (out of shared memory? /dev/shm)"}.get(name, "")
    return f"was killed by signal {name}{hint}"


def note_shard(shard: int) -> None:
    """In a worker: it now reads shard `shard` (an index of the loader's paths)."""
    if _MINE:
        board, worker = _MINE[0]
        board.cells[2 * worker + 1] = shard


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
