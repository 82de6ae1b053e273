"""Ctrl-C while training. vlp.train.preempt takes SIGINT as it takes SIGTERM: the run stops at the
next step boundary and saves. This module owns what only Ctrl-C has (docs/reliability.md): the
first SIGINT's line at once; a second SIGINT exits at once, status 130, with one line and no
traceback, even while the main thread waits inside a collective or a long C call: the C-level
handler writes each signal's number to a pipe (`signal.set_wakeup_fd`), and a thread of ours
reads it, so nothing depends on the main thread.

Under a launcher that catches SIGINT (torch's agent; /proc/PPID/status says), SLURM's SIGINT to
every process of a step reaches a rank twice: directly, and again from the agent, which forwards
it. A SIGINT within `ECHO_S` of the first is that copy, not the user's second Ctrl-C. A bare
`accelerate launch` or torchrun answers a second Ctrl-C with SIGTERM to its ranks: SIGTERM after
a Ctrl-C aborts too (with $VLP_PREEMPT_MARKER, "aborted" in it and exit 0).

    watch = CtrlC(main=True, launched=False, marker=None).start()   # main thread, with the SIGINT handler
    ...
    watch.stop()
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

ABORTED = 130  # 128 + SIGINT
ECHO_S = 2.0  # under a launcher: the agent's copy of the first SIGINT arrives within this
FIRST = ("vlp: Ctrl-C: saving a checkpoint at the end of this step, then stopping "
         "(press Ctrl-C again to abort without saving)\n")
SECOND = "vlp: aborted by a second Ctrl-C: nothing saved since the last checkpoint\n"


class CtrlC:
    """Counts SIGINTs from the C-level handler's wakeup pipe; see the module docstring."""

    def __init__(self, main: bool, launched: bool, marker: Optional[str] = None):
        self.main, self.window = main, ECHO_S if launched and parent_catches(signal.SIGINT) else 0.0
        # under a launcher, the marker file is the status (vlp.train.preempt): "aborted", exit 0
        self.marker = marker if launched else None
        self.first: Optional[float] = None
        self._write: Optional[int] = None
        self._previous = -1

    def start(self) -> "CtrlC":
        """Only in the main thread (where signal handlers live); elsewhere it does nothing."""
        if threading.current_thread() is not threading.main_thread():
            return self
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="vlp-ctrl-c", daemon=True).start()
        return self

    def stop(self) -> None:
        """Give the wakeup fd back; the thread ends on the pipe's end."""
        if self._write is None:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self._write)
        self._write = None

    def _watch(self, read: int) -> None:
        try:
            while True:
                data = os.read(read, 256)
                if not data:
                    return
                for signum in data:
                    if signum == signal.SIGINT:
                        self.on_sigint(time.monotonic())
                    elif signum == signal.SIGTERM and self.first is not None:
                        self.abort()  # a bare launcher's answer to a second Ctrl-C (module docstring)
        finally:
            os.close(read)

    def on_sigint(self, now: float) -> None:
        """The first: say so; one after the launcher's copy of the first: exit at once."""
        if self.first is None:
            self.first = now
            self._say(FIRST)
        elif now - self.first >= self.window:
            self.abort()

    def abort(self) -> None:
        """The second Ctrl-C: one line, out at once."""
        self._say(SECOND)
        if self.marker and self.main:
            with open(self.marker, "w") as f:
                f.write("aborted\n")
        os._exit(0 if self.marker else ABORTED)

    def _say(self, line: str) -> None:
        if self.main:
            try:  # a progress bar may have the line: start a fresh one on a terminal
                os.write(2, (("\n" if os.isatty(2) else "") + line).encode())
            except OSError:
                pass


def parent_catches(signum: int) -> bool:
    """Whether this process's parent has a handler for `signum` (Linux: SigCgt in
    /proc/PPID/status); True where that cannot be read."""
    try:
        status = open(f"/proc/{os.getppid()}/status").read()
        caught = next(int(x.split()[1], 16) for x in status.splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    return bool(caught >> (signum - 1) & 1)
