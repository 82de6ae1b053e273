"""A loader worker's life: what signals it takes, when it ends, and what the main process says
when one dies on its own.

    loader = DataLoader(..., worker_init_fn=start_worker)      # the training and eval loaders
    board = Board(num_workers)                                  # main process, before the workers
    note_shard(url)                                             # a worker, as it opens a shard
    board.failure(error)                                        # main: "loader worker 1 (pid N) ..."

Signals. SLURM (preemption, scancel, `--signal=USR1@N`), timeout(1), `kill -- -PGID` and Ctrl-C
signal every process of the run, loader workers included. The main process handles SIGTERM,
SIGUSR1 and SIGINT: it stops at the next step boundary and saves (vlp.train.preempt), and the
save still needs the workers (their batch memory, torch's liveness checks). So a worker ignores
all three: the run's own shutdown ends it (torch tells it to stop, or it sees its parent gone),
and it never outlives the main process: the kernel SIGKILLs it when the process that made it ends
(Linux PR_SET_PDEATHSIG), beside torch's own check of the parent every 5 s, and the main process
SIGKILLs the ones still running as it exits (`end_workers`: multiprocessing's SIGTERM at exit is
ignored, and its join would wait forever). Every loader that uses `start_worker` calls
`end_workers_at_exit` as it starts them.

A worker that dies on its own (SIGKILL from the OOM killer, a segfault in a decoder) is reported
by torch as a RuntimeError naming its pid; `Board.failure` turns that into one line naming the
worker, its pid, how it ended and the shard it was reading (each worker writes its pid and the
shard it opens to a shared board).
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
import weakref
from typing import Optional

IGNORED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
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
        self.ended: dict[int, str] = {}  # main process: pid -> how that worker ended (SIGCHLD)

    def watch(self) -> None:
        """Main process, once the workers run: SIGCHLD notes how a worker ended (the exit is
        peeked at, not reaped: torch reaps it) instead of torch's handler, which raised the
        error wherever the main thread was, in the middle of a step or of a checkpoint's write.
        torch then raises it where the main process waits for that worker's next batch (within
        5 s, its liveness check): at a step boundary, with the model's state whole."""
        _WATCHED.add(self)
        end_workers_at_exit()
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
            if info is not None and info.si_pid:
                self.ended[pid] = _ended(info)

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
                return self._describe(found, e)
        return None

    def _describe(self, found: re.Match, error: BaseException) -> str:
        pids = [int(p) for p in found.group(1).replace(",", " ").split()]
        how = _HOW.search(str(error))
        told = ("was killed by signal " + how.group(1) if how and how.group(1) else
                f"exited with status {how.group(2)}" if how else "exited unexpectedly")
        lines = []
        for pid in pids:
            ended = self.ended.get(pid, told)
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


def _on_child(signum, frame) -> None:
    for board in list(_WATCHED):
        board.peek()


def _ended(info) -> str:
    """How a child ended, from os.waitid's answer."""
    if info.si_code == os.CLD_EXITED:
        return f"exited with status {info.si_status}"
    name = signal.Signals(info.si_status).name if info.si_status in signal.valid_signals() else str(info.si_status)
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
