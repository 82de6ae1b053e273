"""Preemption: SIGTERM / SIGUSR1 ask the run to stop at the next step boundary, save, and exit
with its own status, so the scheduler can requeue it and `train.resume=latest` goes on.

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

What the scheduler sees (`exit_status`, `Preempted.line`):
* a plain process: exit status 75 (EX_TEMPFAIL, sysexits.h: "try again later"), not 124
  (timeout(1)'s), 137/143 (killed by SIGKILL/SIGTERM), 1 (an error) or 2 (a user error);
* a launched run (accelerate launch / torchrun) with $VLP_PREEMPT_MARKER set: the main process
  writes the step to that file and every rank exits 0, so the launcher exits 0 too (it would
  report any other status as its own failure: a ChildFailedError traceback and exit 1). The
  file is the status: launch/slurm.sbatch requeues the job when it exists. Without the
  variable a launched rank exits 75 and the launcher says it failed;
* a rank that lost its peers (vlp.cli) exits 1; the main rank leaves "lost-peers" in the marker
  (`mark_lost_peers`), so the batch script requeues that job too.
Either way only the main process prints the `vlp: preempted ...` line: one per job.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

EXIT_PREEMPTED = 75
MARKER_ENV = "VLP_PREEMPT_MARKER"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a preemption signal after saving; str() is the one line to print."""

    def __init__(self, step: int, checkpoint=None, signame: str = "a signal", is_main: bool = True):
        self.step, self.checkpoint, self.is_main = step, checkpoint, is_main
        saved = f"saved {checkpoint}; " if checkpoint else ""
        super().__init__(f"preempted at step {step} ({signame}); {saved}resume with train.resume=latest")


class Preemption:
    """The flag the signal handlers set, and the per-step agreement on it."""

    def __init__(self, signals: tuple = SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[int] = None  # the first signal's number
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def install(self) -> "Preemption":
        """Install the handlers; returns self. Off the main thread (where Python allows no
        handlers, e.g. a trainer run from a worker thread) it installs none."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def requested(self) -> bool:
        """Whether this process got a signal (no agreement with the other ranks)."""
        return self.received is not None

    @property
    def signame(self) -> str:
        return signal.Signals(self.received).name if self.received else "no signal"

    def local_flag(self) -> float:
        """This rank's part of the agreement: 1.0 once it got a signal. The trainer sums it over
        ranks inside its one per-step collective (vlp.train.loop.Trainer._finite)."""
        return 1.0 if self.requested else 0.0

    agreed: Optional[bool] = None  # a decision `agree` took and `should_stop` has not returned yet

    def agree(self, ranks_signalled: float) -> bool:
        """The decision from the sum of `local_flag` over all ranks (the same on every rank);
        the next `should_stop` returns it without a collective of its own."""
        self.agreed = self._decide(ranks_signalled)
        return self.agreed

    def _decide(self, ranks_signalled: float) -> bool:
        if ranks_signalled > 0 and self.received is None:
            self.received = -1  # another rank's signal
        return bool(ranks_signalled > 0)

    def should_stop(self, device=None) -> bool:
        """True on every rank once any rank got a signal: the sum of the flag over ranks (one
        all-reduce of one number; call it on every rank at the same point of every step).
        `device`: where the collective's tensor lives (the accelerator's device under NCCL)."""
        import torch

        from vlp.distributed import all_reduce, is_distributed

        if self.agreed is not None:  # agreed on in the step's fused collective (Trainer._finite)
            agreed, self.agreed = self.agreed, None
            return agreed
        if not is_distributed():
            return self.requested
        total = all_reduce(torch.tensor([self.local_flag()], device=device))  # how many ranks got one
        return self._decide(total.item())

    def stopped(self, step: int, checkpoint=None, is_main: bool = True) -> Preempted:
        """The Preempted exception to raise after the checkpoint is saved; the main process
        writes $VLP_PREEMPT_MARKER (if set) so a batch script knows to requeue."""
        marker = os.environ.get(MARKER_ENV)
        if marker and is_main:
            Path(marker).write_text(f"{step}\n")
        name = self.signame if self.received and self.received > 0 else "another rank's signal"
        return Preempted(step, checkpoint, name, is_main)


def mark_lost_peers(env=None) -> None:
    """The main rank of a launched run whose collective failed (a node or rank lost) leaves
    "lost-peers" in $VLP_PREEMPT_MARKER, so launch/slurm.sbatch requeues the job, which resumes
    from the latest checkpoint (a lost *first* node takes this script with it: SLURM requeues)."""
    env = os.environ if env is None else env
    marker = env.get(MARKER_ENV)
    if marker and env.get("RANK", "0") == "0":
        Path(marker).write_text("lost-peers\n")


def exit_status(env=None) -> int:
    """The status a preempted rank exits with: 0 under a launcher when $VLP_PREEMPT_MARKER names
    the marker (the file tells), else EXIT_PREEMPTED (see the module docstring)."""
    env = os.environ if env is None else env
    return 0 if env.get(MARKER_ENV) and env.get("TORCHELASTIC_RUN_ID") else EXIT_PREEMPTED
