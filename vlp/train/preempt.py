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

Exit status 75 (EX_TEMPFAIL, sysexits.h: "try again later"): not 124 (timeout(1)'s), 137/143
(killed by SIGKILL/SIGTERM), 1 (an error) or 2 (a user error). A launcher (accelerate launch /
torchrun) reports a worker's non-zero status as its own failure (exit 1), so for launched runs
the main process also writes the file named by $VLP_PREEMPT_MARKER (when set) with the step:
launch/slurm.sbatch requeues the job when that file exists.
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

    def __init__(self, step: int, checkpoint=None, signame: str = "a signal"):
        self.step, self.checkpoint = step, checkpoint
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
        return Preempted(step, checkpoint, name)
