"""A scheduler's job as the batch executor sees it (vlp.study.batch): its state and the phase the
driver acts on. Shared by the driver and every scheduler (vlp.study.slurm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
CONFIG_ERROR_EXIT = 2  # vlp.study.job's exit status for a config error: the driver does not retry it


@dataclass(frozen=True)
class JobState:
    """One job as the scheduler sees it: its own word for the state (RUNNING, TIMEOUT, ...), the
    phase the driver acts on (PENDING, RUNNING, DONE, FAILED), the scheduler's reason or exit
    code, and how often it was requeued underneath the driver."""

    id: str
    state: str
    phase: str
    reason: str = ""
    exit_code: Optional[int] = None
    requeues: int = 0
