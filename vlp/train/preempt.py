"""Preemption: SIGTERM / SIGUSR1 (and SIGHUP, SIGINT) ask the run to stop at the next step boundary, save, and exit
with its own status, so the scheduler can requeue it and `train.resume=latest` goes on. SIGINT
(Ctrl-C) stops and saves the same way; a second one aborts at once (vlp.train.interrupt).

    stop = Preemption().install()          # main thread, before the loop
    while step < total:
        train_step(...)
        if stop.should_stop(device):        # every rank, once per step: one all-reduce of 1 number
                                            # (the trainer fuses it: local_flag / agree)
            save_checkpoint()
            raise Preempted(step, path)     # cli: prints stop.message, exits EXIT_PREEMPTED

A signal handler only sets a flag (no I/O, no collective inside a handler). Ranks may get the
signal at different steps (or only some of them get it); `should_stop` takes the max of the
flag over all ranks, so every rank stops after the same step and the checkpoint is collective.

Exit statuses and lines per signal and launcher are docs/reliability.md's tables ("How a run
stops"): a plain process exits 75 (EX_TEMPFAIL: "try again later"), 130 on SIGINT, 129 on SIGHUP.
A launched run with $VLP_PREEMPT_MARKER set writes its status to that file ("N", "interrupted N",
"hangup N", "aborted", "lost-peers") and every rank exits 0, as the launcher would report any
other status as its own failure; launch/slurm.sbatch requeues only on "N" and "lost-peers".
Only the main process prints the `vlp: ...` line: one per job. A run started under nohup keeps
ignoring SIGHUP (`nohup`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from vlp.train.interrupt import ABORTED, CtrlC

EXIT_PREEMPTED = 75
MARKER_ENV = "VLP_PREEMPT_MARKER"
HUNG_UP = 129  # 128 + SIGHUP, as a shell reports it
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
STOPPED = {"SIGINT": "interrupted", "SIGHUP": "hung up"}  # the user's stops; the rest: "preempted"
_GRID_STOP: list = []  # this process's stop watch while it runs a grid's runs (GridStop)


def nohup() -> bool:
    """The run was started under nohup (SIGHUP ignored on entry): a closed terminal must not stop
    it, so SIGHUP stays ignored. Not in a launcher's rank, which inherits its launcher's ignore
    (launch/local.sh); under `nohup launch/local.sh` the script cannot pass on the SIGHUP it ignores,
    and torch's ranks, each in a session of its own, never see the terminal's."""
    return signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and not os.environ.get("TORCHELASTIC_RUN_ID")


class Preempted(Exception):
    """The run stopped on a preemption signal (or Ctrl-C) after saving; str() is the one line to
    print, `status` the exit status."""

    def __init__(self, step: int, checkpoint=None, signame: str = "a signal", is_main: bool = True,
                 status: Optional[int] = None, line: Optional[str] = None):
        self.step, self.checkpoint, self.is_main = step, checkpoint, is_main
        self.status = exit_status() if status is None else status
        saved = f"saved {checkpoint}; " if checkpoint else ""
        stopped = STOPPED.get(signame, "preempted")
        super().__init__(line or f"{stopped} at step {step} ({signame}); {saved}resume with train.resume=latest")

    def __reduce__(self):  # a run in a worker process (vlp compare): its caller gets the same line
        return (_rebuilt, (str(self), self.step, self.checkpoint, self.is_main, self.status))


def _rebuilt(line, step, checkpoint, is_main, status) -> "Preempted":
    return Preempted(step, checkpoint, is_main=is_main, status=status, line=line)


class Preemption:
    """The flag the signal handlers set, and the per-step agreement on it."""

    def __init__(self, signals: tuple = SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[int] = None  # the first signal's number
        self._previous: dict = {}
        self.ctrl_c: Optional[CtrlC] = None  # the second Ctrl-C's watch (vlp.train.interrupt)
        self.launcher_gone = False  # the stop is vlp.distributed.exit_with_launcher's

    def _handle(self, signum, frame) -> None:
        launched = sys.modules.get("vlp.distributed")  # no import in a handler: loaded where it matters
        if self.received is None:
            self.received = signum
            if signum == signal.SIGHUP:
                _off_the_terminal()
            self.launcher_gone = launched is not None and launched.LAUNCHER_GONE.is_set()
        if launched is not None:
            launched.STOPPING.set()  # a launcher that died of the same signal does not end this rank's save

    def install(self) -> "Preemption":
        """Install the handlers; returns self. Off the main thread (where Python allows no
        handlers, e.g. a trainer run from a worker thread) it installs none."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            if sig == signal.SIGHUP and nohup():
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        if signal.SIGINT in self.signals:
            self.ctrl_c = CtrlC(_main_rank(), bool(os.environ.get("TORCHELASTIC_RUN_ID")),
                                os.environ.get(MARKER_ENV)).start()
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install`. After a Ctrl-C the run is on its
        way out: SIGINT stays counted (a second one still exits at once, with its line) instead of
        raising KeyboardInterrupt into the exit's clean-up, which would hide the stop's line."""
        stopping = self.received == signal.SIGINT and self.ctrl_c is not None and self.ctrl_c.first is not None
        if self.ctrl_c is not None and not stopping:
            self.ctrl_c.stop()
            self.ctrl_c = None
        for sig, previous in self._previous.items():
            signal.signal(sig, _counted if stopping and sig == signal.SIGINT else
                          previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def holds(self, signum: int) -> bool:
        """Whether this Preemption's handler is still the one for `signum` (a later one, e.g. a
        run's own, may have taken its place)."""
        return signal.getsignal(signum) == self._handle

    @property
    def requested(self) -> bool:
        """Whether this process got a signal (no agreement with the other ranks)."""
        return self.received is not None

    @property
    def signame(self) -> str:
        if self.launcher_gone:
            return "its launcher died"
        return signal.Signals(self.received).name if self.received else "no signal"

    def local_flag(self) -> float:
        """This rank's part of the agreement: 1.0 once it got a signal. The trainer sums it over
        ranks inside its one per-step collective (vlp.train.loop.Trainer._finite)."""
        return 1.0 if self.requested else 0.0

    agreed: Optional[bool] = None  # a decision `agree` took and `should_stop` has not returned yet

    def agree(self, ranks_signalled: float) -> bool:
        """The decision from the sum of `local_flag` over all ranks (the same on every rank);
        the next `should_stop` returns it without a collective of its own."""
        if ranks_signalled > 0 and self.received is None:
            self.received = -1  # another rank's signal
        self.agreed = bool(ranks_signalled > 0)
        return self.agreed

    def should_stop(self, device=None) -> bool:
        """True on every rank once any rank got a signal: the sum of the flag over ranks (one
        all-reduce of one number; call it on every rank at the same point of every step).
        `device`: where the collective's tensor lives (the accelerator's device under NCCL)."""
        import torch

        from vlp.distributed import all_reduce, is_distributed

        if self.agreed is None:  # else agreed on in the step's fused collective (Trainer._finite)
            if not is_distributed():
                return self.requested
            self.agree(all_reduce(torch.tensor([self.local_flag()], device=device)).item())  # ranks that got one
        agreed, self.agreed = self.agreed, None
        return agreed

    def stopped(self, step: int, checkpoint=None, is_main: bool = True) -> Preempted:
        """The Preempted exception to raise after the checkpoint is saved; the main process
        writes $VLP_PREEMPT_MARKER (if set) so a batch script knows to requeue."""
        marker = os.environ.get(MARKER_ENV)
        if self.received == signal.SIGINT:  # the user's stop: the marker says so, no requeue
            if marker and is_main:
                Path(marker).write_text(f"interrupted {step}\n")
            return Preempted(step, checkpoint, "SIGINT", is_main, exit_status(unlaunched=ABORTED))
        if self.received == signal.SIGHUP:  # the terminal closed: saved, no requeue
            if marker and is_main:
                Path(marker).write_text(f"hangup {step}\n")
            return Preempted(step, checkpoint, "SIGHUP", is_main, exit_status(unlaunched=HUNG_UP))
        if marker and is_main:
            Path(marker).write_text(f"{step}\n")
        launched = sys.modules.get("vlp.distributed")
        if self.received == -1 and launched is not None and launched.launcher_gone():
            self.launcher_gone = True  # a peer saw the launcher die first: it is this rank's launcher too
        own = self.launcher_gone or (self.received is not None and self.received > 0)
        name = self.signame if own else "another rank's signal"
        return Preempted(step, checkpoint, name, is_main)


def _off_the_terminal() -> None:
    """After SIGHUP: stdout / stderr on the closed terminal go to /dev/null, so the save's output
    (progress, the stop's line) cannot fail with EIO midway. A file or pipe keeps them."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _counted(signum, frame) -> None:
    """SIGINT's handler once the run stops for a Ctrl-C: the watch (vlp.train.interrupt) counts it."""


def _main_rank() -> bool:
    """The process that speaks for the run: rank 0, and not a worker process of `vlp compare`
    (whose main process says it once for all its runs)."""
    import multiprocessing

    return os.environ.get("RANK", "0") == "0" and multiprocessing.parent_process() is None


def mark_lost_peers(env=None) -> None:
    """The main rank of a launched run whose collective failed (a node or rank lost) leaves
    "lost-peers" in $VLP_PREEMPT_MARKER, so launch/slurm.sbatch requeues the job, which resumes
    from the latest checkpoint (a lost *first* node takes this script with it: SLURM requeues)."""
    env = os.environ if env is None else env
    marker = env.get(MARKER_ENV)
    if marker and env.get("RANK", "0") == "0":
        Path(marker).write_text("lost-peers\n")


def exit_status(env=None, unlaunched: int = EXIT_PREEMPTED) -> int:
    """The status a stopped rank exits with: 0 under a launcher when $VLP_PREEMPT_MARKER names
    the marker (the file tells), else `unlaunched`: EXIT_PREEMPTED, or 130 after a Ctrl-C (see
    the module docstring)."""
    env = os.environ if env is None else env
    return 0 if env.get(MARKER_ENV) and env.get("TORCHELASTIC_RUN_ID") else unlaunched


class GridStop:
    """A stop signal (Ctrl-C, SIGTERM, SIGUSR1) around a grid's runs, in the process that runs them
    (`vlp compare`, or each local worker for its life). Inside a run's loop the Trainer takes it;
    elsewhere (a run's start-up or final evaluation, between runs) it would be lost or kill the
    process, so the signals only set a flag here and `stop_if_asked` raises where stopping loses
    nothing: before a run, once its Trainer is built, after a run."""

    def __enter__(self) -> Preemption:
        stop = Preemption().install()
        _GRID_STOP.append(stop)
        return stop

    def __exit__(self, *exc) -> None:
        stop = _GRID_STOP.pop()
        if stop.holds(signal.SIGINT):
            stop.uninstall()
        # else a run stopped for a Ctrl-C: its watch goes on counting (a second one exits at once)


def stop_if_asked() -> None:
    """Raise `grid_stopped` when a stop signal reached this process since its grid began (GridStop;
    a run's own SIGINT handler left in place counts as asked)."""
    if not _GRID_STOP or threading.current_thread() is not threading.main_thread():
        return
    stop = _GRID_STOP[-1]
    if stop.requested or not stop.holds(signal.SIGINT):
        raise grid_stopped(stop)


def grid_stopped(stop: Preemption) -> BaseException:
    """What a grid stopped between runs raises: KeyboardInterrupt for a Ctrl-C (exit 130), else
    Preempted with one line saying that the finished runs are kept (exit 75)."""
    if stop.received in (None, signal.SIGINT):  # None: a run's own handler took the Ctrl-C
        return KeyboardInterrupt()
    status, stopped = (HUNG_UP, "hung up") if stop.received == signal.SIGHUP else (EXIT_PREEMPTED, "preempted")
    return Preempted(0, signame=stop.signame, status=status, line=(
        f"{stopped} ({stop.signame}) between runs; the finished runs are kept: run the same command again to go on"))
