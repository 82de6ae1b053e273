"""A grid's runs as jobs of a batch scheduler (SLURM today; Ray or Kubernetes would be another
`Scheduler`): the driver loop that submits, watches and resubmits them, and what it keeps in the
run folders, from which a rerun re-attaches.

    with BatchExecutor(grid, scheduler) as ex:        # vlp.study.study runs it as any Executor
        ex.run([Job(run, cfg, specs), ...], total=len(all_runs), on_done=callback)

A scheduler does three things (`Scheduler`): submit one run's job, poll the states of all the
given jobs in one call, cancel jobs (and find a job by its name, output: where its log goes).
Everything else is the same for any scheduler: this driver loop; the run folder's files
(vlp.study.jobfiles); `--status` / `--cancel` (vlp.study.status); what a job runs (vlp.study.job).

- a run's folder holds `job_spec.json` (what the job runs: the run's config, its val / test
  specs; vlp.study.job reads it inside the job) and `job.json` (every job submitted for the run:
  its id, and how it ended once it did). The driver holds nothing else: killed and started again,
  it re-attaches to the job of every run whose last submission has not ended, and submits no run
  twice; a run done (result.json) is not walked at all (vlp.study.runs.plan_runs).
- results come from the run folder, as for a local run: the job writes result.json and
  compare.json (vlp.study.runs.run_one); a job that ended without writing a record (killed,
  timed out, out of memory, its node lost) gets a failed compare.json with the scheduler's reason
  once its retries are spent, so the report names the cell's reason.
- a failed job is resubmitted up to grid.retries times (one line each); a config error inside
  the job (exit status 2) is not. The driver polls once per grid.slurm.poll_s for all its jobs,
  keeps at most grid.slurm.max_in_flight submitted, and never waits on a single run.
- Ctrl-C stops submitting: the jobs already submitted run on (one line; the same command
  re-attaches, `vlp compare --cancel` cancels them).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from vlp.config import ConfigError
from vlp.locations import is_url
from vlp.study.executor import Job
from vlp.study.jobfiles import (RECORD_FILE, job_name, live_id, read_record, spec_changed, submissions, unrecorded,
                                write_spec, write_submissions)
from vlp.study.jobstate import CONFIG_ERROR_EXIT, PENDING, RUNNING, JobState
from vlp.train.preempt import Preempted
from vlp.util import atomic_write

POLL_FAILURES = 5  # failed polls in a row before the driver gives up (its jobs run on)


class Scheduler(Protocol):
    """What a batch scheduler must do for the driver (vlp.study.slurm.Slurm)."""

    name: str

    def check(self) -> None:
        """Raise ConfigError (one line) when the grid's resources cannot run on this cluster."""

    def submit(self, folder: Path, name: str) -> str:
        """Submit the job that runs the run in ``folder`` (its job_spec.json); its id."""

    def poll(self, ids: list[str]) -> dict[str, JobState]:
        """The states of ``ids``, in one call to the scheduler (an id it does not know is absent)."""

    def cancel(self, ids: list[str]) -> None:
        """Cancel ``ids`` (one call)."""

    def output(self, folder: Path, job_id: str) -> Path:
        """The file where job ``job_id`` of the run in ``folder`` writes its output."""

    def find(self, name: str, since: float) -> Optional[str]:
        """The id of the job named ``name`` submitted at or after ``since`` (a Unix time), else None."""


def failure_line(state: JobState, record: dict) -> str:
    """Why a job failed, in one phrase: the run's own error where it wrote one (an exception),
    else the scheduler's state and reason (killed, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY ...)."""
    why = f"{state.state}" + (f" ({state.reason})" if state.reason and state.reason not in ("None", state.state) else "")
    if record.get("status") == "failed" and record.get("error"):
        return f"{why}: {record['error']}"
    return why


def retried(state: JobState) -> bool:
    """A failed job is resubmitted unless the run stopped on a config error (exit status 2)."""
    return state.exit_code != CONFIG_ERROR_EXIT


# ---------------------------------------------------------------------------- the driver loop
@dataclass
class Track:
    """One run the driver walks: its job, folder, submissions and failures seen by this driver."""

    job: Job
    folder: Path
    jobs: list = field(default_factory=list)
    failures: int = 0


class BatchExecutor:
    """Runs a grid's jobs as scheduler jobs (module doc); used as vlp.study.executor.Executor is."""

    def __init__(self, grid, scheduler: Scheduler, sleep: Callable[[float], None] = time.sleep):
        if is_url(grid.out_dir):
            raise ConfigError(f"config: grid.executor={scheduler.name} needs grid.out_dir on a file system the "
                              f"jobs share, got {grid.out_dir}")
        self.grid, self.scheduler, self.sleep = grid, scheduler, sleep
        self.checked, self.poll_failures = False, 0
        self.world = grid.slurm.nodes * max(1, grid.slurm.gpus_per_node)  # each run's processes (its global batch)

    def __enter__(self) -> "BatchExecutor":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, jobs: list[Job], total: Optional[int] = None,
            on_done: Optional[Callable[[Job, dict], None]] = None) -> None:
        """Submit the jobs' runs (re-attaching to those in flight), poll them all once per round,
        resubmit the failed ones up to grid.retries; ``on_done`` after each run that ended."""
        if not self.checked:  # the cluster can run these resources: before anything is submitted
            self.scheduler.check()
            self.checked = True
        tracks = [Track(job, Path(job.cfg.train.output_dir)) for job in jobs]
        for t in tracks:
            t.jobs = self._recorded(t.folder, submissions(t.folder))
        watching = {live_id(t.jobs): t for t in tracks if live_id(t.jobs)}
        for job_id, t in watching.items():
            why = spec_changed(t.folder, t.job)
            if why:
                raise ConfigError(f"compare: {t.job.run.name}'s job {job_id} was submitted with another config ({why}); "
                                  "cancel it (vlp compare --cancel) or use a new grid.out_dir")
        if watching:
            print(f"[compare] re-attached to {len(watching)} submitted job(s): "
                  f"{', '.join(sorted(watching, key=lambda i: (len(i), i)))}", flush=True)
        queue = [t for t in tracks if not live_id(t.jobs)]
        ended = 0
        try:
            while queue or watching:
                while queue and len(watching) < self.grid.slurm.max_in_flight:
                    t = queue.pop(0)
                    watching[self._submit(t)] = t
                self.sleep(self.grid.slurm.poll_s)
                for job_id, state in self._poll(sorted(watching)).items():
                    if job_id not in watching or state.phase in (PENDING, RUNNING):
                        continue
                    t = watching.pop(job_id)
                    if self._ended(t, state):
                        queue.append(t)
                        continue
                    ended += 1
                    record = read_record(t.folder)
                    print(f"[compare] {ended}/{len(jobs)} {t.job.run.name}: {record.get('status', 'failed')} "
                          f"(job {job_id})", flush=True)
                    if on_done is not None:
                        on_done(t.job, record)
        except KeyboardInterrupt:
            raise stopped_submitting(len(watching), self.scheduler.name) from None

    def _poll(self, ids: list[str]) -> dict[str, JobState]:
        """One poll of the scheduler; a failed one (the controller busy or restarting) is one line
        and an empty answer, up to POLL_FAILURES in a row, then the error."""
        try:
            states = self.scheduler.poll(ids)
        except ConfigError as e:
            self.poll_failures += 1
            if self.poll_failures >= POLL_FAILURES:
                raise
            print(f"[compare] {e}; polling again in {self.grid.slurm.poll_s:g} s", flush=True)
            return {}
        self.poll_failures = 0
        return states

    def _recorded(self, folder: Path, jobs: list[dict]) -> list[dict]:
        """``jobs`` with an unrecorded last submission resolved: its id, found by its job name in the
        scheduler, or the entry dropped when the scheduler never took it (the run is submitted)."""
        pending = unrecorded(jobs)
        if pending is None:
            return jobs
        found = self.scheduler.find(pending["name"], pending["submitted"])
        if found is None:
            jobs = jobs[:-1]
        else:
            pending["id"] = found
            print(f"[compare] {folder.name}: found its job {found} by name (its id was not recorded)", flush=True)
        write_submissions(folder, self.scheduler.name, jobs)
        return jobs

    def _submit(self, t: Track) -> str:
        t.folder.mkdir(parents=True, exist_ok=True)
        write_spec(t.folder, t.job)
        name = job_name(t.job.run.name, t.folder)
        # noted before the scheduler hears of it: a driver killed before the id is written finds
        # the job by its name (_recorded); a Ctrl-C waits until the id is written
        t.jobs.append({"name": name, "submitted": time.time()})
        write_submissions(t.folder, self.scheduler.name, t.jobs)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            job_id = self.scheduler.submit(t.folder, name)
            t.jobs[-1]["id"] = job_id
            write_submissions(t.folder, self.scheduler.name, t.jobs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print(f"[compare] {t.job.run.name}: submitted as {self.scheduler.name} job {job_id}", flush=True)
        return job_id

    def _ended(self, t: Track, state: JobState) -> bool:
        """Note how the run's job ended (job.json); True when it is to be submitted again."""
        record = read_record(t.folder)  # the run's own word: a job that ended without one failed
        ok = record.get("status") == "ok" and (t.folder / "result.json").exists()
        t.jobs[-1].update(state=state.state, reason=state.reason, ended=time.time())
        write_submissions(t.folder, self.scheduler.name, t.jobs)
        if ok:
            return False
        t.failures += 1
        why = failure_line(state, record)
        log = self.scheduler.output(t.folder, state.id)
        if log.exists() and not record.get("error"):  # no word from the run itself: where to look
            why += f"; its output: {log}"
        if retried(state) and t.failures <= self.grid.retries:
            print(f"[compare] {t.job.run.name}: job {state.id} {why}; resubmitted "
                  f"(retry {t.failures} of {self.grid.retries})", flush=True)
            return True
        error = f"{t.failures} attempt{'s' * (t.failures > 1)}, the last job {state.id} {why}"
        atomic_write(t.folder / RECORD_FILE, json.dumps({
            "status": "failed", "error": error[:300], "attempts": t.failures, "scheduler": self.scheduler.name,
            "wall_time_s": record.get("wall_time_s", 0.0)}, indent=2))
        return False


def stopped_submitting(running: int, scheduler: str) -> Preempted:
    """Ctrl-C in the driver: no more submissions; the jobs submitted run on (one line, exit 130)."""
    return Preempted(0, status=130, line=(
        f"interrupted (Ctrl-C): nothing more is submitted; the {running} {scheduler} job(s) in flight run on. "
        "Run the same command to re-attach, or add --cancel to cancel them"))


# ---------------------------------------------------------------------------- which executor
def scheduler_of(grid) -> Scheduler:
    """The Scheduler that grid.executor names (only slurm today)."""
    if grid.executor == "slurm":
        from vlp.study.slurm import Slurm  # its commands only where a grid asks for them

        return Slurm(grid.slurm)
    raise ConfigError(f"config: grid.executor={grid.executor} has no scheduler: --status and --cancel "
                      "need a batch scheduler (grid.executor: slurm)")


def executor_of(grid, acc):
    """The Executor of grid.executor: local (vlp.study.executor) or a scheduler's (BatchExecutor)."""
    if grid.executor == "local":
        from vlp.study.executor import Executor

        return Executor(grid, acc)
    if acc.num_processes > 1:
        raise ConfigError(f"config: grid.executor={grid.executor} submits each run as a job: run `vlp compare` "
                          "itself as one process, not under accelerate launch")
    return BatchExecutor(grid, scheduler_of(grid))
