"""Where a grid's runs run (docs/design.md, Studies): the study decides what runs next and hands
an executor its Jobs, each with its work (vlp.study.runs.train_job); the executor runs them in this
process or local worker processes (vlp.executors.local), or as a batch scheduler's jobs
(vlp.executors.batch; SLURM: vlp.executors.slurm). The study imports only this module, and
nothing here imports the study; the table is the same either way.

    with executor_of(grid, acc) as ex:
        ex.warm(bases)                           # each (data set, regime)'s feature caches, first
        ex.run(jobs, total=n, on_done=callback)  # callback(job, record) after each run ends
        ex.world_of(regime)                      # the processes of a run of that regime
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from vlp.config import ConfigError
from vlp.executors.jobstate import Job

__all__ = ["Executor", "Job", "executor_of"]


class Executor(Protocol):
    def world_of(self, regime: str) -> int: ...

    def warm(self, bases: dict) -> None: ...

    def run(self, jobs: list[Job], total: Optional[int] = None,
            on_done: Optional[Callable[[Job, dict], None]] = None) -> None: ...

    def __enter__(self) -> "Executor": ...

    def __exit__(self, *exc) -> None: ...


def executor_of(grid, acc) -> Executor:
    """The executor grid.executor names: local, or a batch scheduler's (slurm)."""
    if grid.executor == "local":
        from vlp.executors.local import LocalExecutor

        return LocalExecutor(grid, acc)
    if acc.num_processes > 1:
        raise ConfigError(f"config: grid.executor={grid.executor} submits each run as a job: run `vlp compare` "
                          "itself as one process, not under accelerate launch")
    from vlp.executors.batch import BatchExecutor, scheduler_of

    return BatchExecutor(grid, scheduler_of(grid))
