"""What passes between the study and an executor, and between the batch executor and a scheduler:
a Job (one run to execute) and a JobState (a scheduler's job as the driver sees it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
CONFIG_ERROR_EXIT = 2  # vlp.executors.job's exit status for a config error: the driver does not retry it


@dataclass(frozen=True)
class Job:
    """One run to execute, picklable: its run (name, arm) and config, the val / test specs it is
    ranked on (None: trained only), the grid's retries and checkpoint policy; ``index``: its
    1-based place among its grid's runs (the progress line); ``work``: what runs it, a module-level
    ``work(job, accelerator)`` (vlp.study.runs.train_job; a scheduler's job finds it by name);
    ``warm``: a (data set, regime)'s feature-cache warm-up instead of a run (no work of its own)."""

    run: Any
    cfg: Any
    specs: Optional[dict] = None
    retries: int = 1
    keep_checkpoints: bool = True
    index: int = 0
    warm: bool = False
    work: Optional[Callable] = None


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
