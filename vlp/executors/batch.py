"""A grid's runs as jobs of a batch scheduler (grid.executor: slurm; Ray or Kubernetes would be
another `Scheduler`): the driver loop that submits, polls and resubmits them. It holds nothing but
the run folders' files (vlp.executors.jobfiles), so a rerun re-attaches to the jobs in flight and
submits no run twice; docs/map.md, "The map on a cluster", tells the whole behaviour.

    with BatchExecutor(grid, scheduler) as ex:   # as any vlp.executors.Executor
        ex.warm(bases)                           # a warm-up job per (data set, regime) with a cache folder
        ex.run(jobs, total=n, on_done=callback)
"""

from __future__ import annotations

import copy
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, Protocol

from vlp.checkpoint.storage import RunFolder
from vlp.config import ConfigError, from_dict
from vlp.experiment import check
from vlp.locations import join
from vlp.executors.jobfiles import (SPEC_FILE, failed_attempts, folder_name, has_result, job_name, live_id, read_record, spec_changed,
                                submissions, unrecorded, write_record, write_spec, write_submissions)
from vlp.executors.jobstate import CONFIG_ERROR_EXIT, PENDING, RUNNING, Job, JobState
from vlp.train.preempt import Preempted

POLL_FAILURES = 5  # failed polls in a row before the driver gives up (its jobs run on)


class Scheduler(Protocol):
    """What a batch scheduler must do for the driver (vlp.executors.slurm.Slurm)."""

    name: str

    def check(self, regimes: list[str]) -> None:
        """Raise ConfigError (one line) when the resources of the jobs of these regimes (of
        grid.regimes; [] for a grid without) cannot run on this cluster."""

    def processes(self, regime: str) -> int:
        """The processes of a job of this regime ('' for a grid without): its run's world size."""

    def submit(self, folder: RunFolder, name: str, regime: str = "") -> str:
        """Submit the job that runs the run in ``folder`` (its job_spec.json; a local folder or a
        bucket's) with the resources of its regime; its id."""

    def poll(self, ids: list[str]) -> dict[str, JobState]:
        """The states of ``ids``, in one call to the scheduler (an id it does not know is absent)."""

    def cancel(self, ids: list[str]) -> None:
        """Cancel ``ids`` (one call)."""

    def output(self, folder: RunFolder, job_id: str) -> Path:
        """The local file where job ``job_id`` of the run in ``folder`` writes its output."""

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
    """One run the driver walks (or a warm-up, ``job.warm``): its job, folder, the (data set,
    regime) table whose warm-up it waits for, its submissions (job.json's, every driver's)."""

    job: Job
    folder: RunFolder
    table: tuple = ("", "")
    jobs: list = field(default_factory=list)


class BatchExecutor:
    """Runs a grid's jobs as scheduler jobs (module doc); used as any vlp.executors.Executor."""

    def __init__(self, grid, scheduler: Scheduler, sleep: Callable[[float], None] = time.sleep):
        self.grid, self.scheduler, self.sleep = grid, scheduler, sleep
        self.checked, self.poll_failures = False, 0
        self.warmups: dict[tuple, Track] = {}  # (data set, regime) -> its feature-cache warm-up (warm)
        self.warmed: set[tuple] = set()  # the tables whose caches are built
        self.warm_failed: dict[tuple, str] = {}  # the tables whose warm-up failed after its retries: why

    def world_of(self, regime: str) -> int:
        """The processes of a run of this regime: its job's (its global batch follows them)."""
        return self.scheduler.processes(regime)

    def __enter__(self) -> "BatchExecutor":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def warm(self, bases: dict) -> None:
        """The feature caches (data.feature_cache, a folder) of each (data set, regime) of ``bases``
        (vlp.study.study.regime_bases) as one job of its own, in <out_dir>/warm_<data set>_<regime>:
        submitted before that table's runs, which are submitted once it is done (``run``). Nothing
        is computed here (the driver may be a login node's process); "memory" caches are each job's."""
        for table, (tree, specs) in bases.items():
            cfg = check(from_dict(copy.deepcopy(tree)))
            if cfg.data.feature_cache in (None, "memory"):
                continue
            name = "_".join(["warm", *(part for part in table if part)])
            cfg.train.output_dir = join(self.grid.out_dir, name)
            job = Job(SimpleNamespace(name=name, arm=SimpleNamespace(regime=table[1])), cfg, specs,
                      self.grid.retries, warm=True)
            self.warmups[table] = Track(job, RunFolder(cfg.train.output_dir), table)

    def run(self, jobs: list[Job], total: Optional[int] = None,
            on_done: Optional[Callable[[Job, dict], None]] = None) -> None:
        """Submit the jobs' runs (re-attaching to those in flight; a table's runs once its warm-up
        is done), poll them all once per round, resubmit the failed ones up to grid.retries;
        ``on_done`` after each run that ended."""
        if not self.checked:  # the cluster can run every regime's resources: before anything is submitted
            self.scheduler.check(list(self.grid.regimes))
            self.checked = True
        tracks = [Track(job, RunFolder(job.cfg.train.output_dir), table_of(job)) for job in jobs]
        waiting = [tb for tb in dict.fromkeys(t.table for t in tracks)  # their caches not built yet
                   if tb in self.warmups and tb not in self.warmed and tb not in self.warm_failed]
        tracks = [self.warmups[tb] for tb in waiting] + tracks
        for t in tracks:
            t.jobs = self._recorded(t.folder, submissions(t.folder))
        watching = self._reattach(tracks)
        queue = [t for t in tracks if not live_id(t.jobs) and not self._built_before(t)]
        ended = 0

        def finish(t: Track, job_id: str) -> None:
            nonlocal ended
            ended += 1
            record = read_record(t.folder)
            print(f"[compare] {ended}/{len(jobs)} {t.job.run.name}: {record.get('status', 'failed')} "
                  f"(job {job_id})", flush=True)
            if on_done is not None:
                on_done(t.job, record)

        for t in [t for t in queue if len(failed_attempts(t.jobs)) > self.grid.retries
                  and not spec_changed(t.folder, t.job)]:  # (an edited config: a fresh count)
            queue.remove(t)  # its attempts spent grid.retries under earlier drivers: failed, not submitted
            self._spent(t)
            if t.job.warm:
                self._warm_ended(t, t.jobs[-1].get("id", "-"))
            else:
                finish(t, t.jobs[-1].get("id", "-"))
        try:
            while queue or watching:
                for t in [t for t in queue if t.table in self.warm_failed and not t.job.warm]:
                    queue.remove(t)  # its warm-up failed after its retries: so does the run, with its reason
                    self._fail_unwarmed(t)
                    finish(t, "-")
                for t in [t for t in queue if self._ready(t)][:self.grid.slurm.max_in_flight - len(watching)]:
                    queue.remove(t)
                    watching[self._submit(t)] = t
                if not watching:
                    continue
                self.sleep(self.grid.slurm.poll_s)
                for job_id, state in self._poll(sorted(watching)).items():
                    if job_id not in watching or state.phase in (PENDING, RUNNING):
                        continue
                    t = watching.pop(job_id)
                    if self._ended(t, state):
                        queue.append(t)
                    elif t.job.warm:
                        self._warm_ended(t, job_id)
                    else:
                        finish(t, job_id)
        except KeyboardInterrupt:
            raise stopped_submitting(len(watching), self.scheduler.name) from None

    def _reattach(self, tracks: list[Track]) -> dict[str, Track]:
        """{id: track} of the tracks whose last job is in flight, each submitted with the config it
        has now (else one line: a rerun re-attaches only to what it would submit)."""
        watching = {live_id(t.jobs): t for t in tracks if live_id(t.jobs)}
        for job_id, t in watching.items():
            why = spec_changed(t.folder, t.job)
            if why:
                raise ConfigError(f"compare: {t.job.run.name}'s job {job_id} was submitted with another config ({why}); "
                                  "cancel it (vlp compare --cancel) or use a new grid.out_dir")
        if watching:
            print(f"[compare] re-attached to {len(watching)} submitted job(s): "
                  f"{', '.join(sorted(watching, key=lambda i: (len(i), i)))}", flush=True)
        return watching

    def _ready(self, t: Track) -> bool:
        """A warm-up, or a run whose table needs none or has its caches built."""
        return t.job.warm or t.table not in self.warmups or t.table in self.warmed

    def _built_before(self, t: Track) -> bool:
        """A warm-up done by an earlier driver with the config it has now (its result.json): not
        submitted again."""
        if not t.job.warm or not has_result(t.folder) or not t.folder.exists(SPEC_FILE) or spec_changed(t.folder, t.job):
            return False
        self.warmed.add(t.table)
        print(f"[compare] {t.job.run.name}: the feature caches were built before (its result.json)", flush=True)
        return True

    def _warm_ended(self, t: Track, job_id: str) -> None:
        """A warm-up's job ended for good: its table's runs may go, or fail with its reason."""
        record = read_record(t.folder)
        if record.get("status") == "ok" and has_result(t.folder):
            self.warmed.add(t.table)
            print(f"[compare] {t.job.run.name}: feature caches built (job {job_id}); its runs go next", flush=True)
            return
        self.warm_failed[t.table] = record.get("error") or "failed"
        print(f"[compare] {t.job.run.name}: failed (job {job_id}); its runs are failed with it", flush=True)

    def _fail_unwarmed(self, t: Track) -> None:
        error = f"its feature-cache warm-up {self.warmups[t.table].job.run.name} failed: {self.warm_failed[t.table]}"
        write_record(t.folder, {"status": "failed", "error": error[:300], "attempts": 0, "scheduler": self.scheduler.name,
                                "wall_time_s": 0.0})

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

    def _recorded(self, folder: RunFolder, jobs: list[dict]) -> list[dict]:
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
            print(f"[compare] {folder_name(folder)}: found its job {found} by name (its id was not recorded)", flush=True)
        write_submissions(folder, self.scheduler.name, jobs)
        return jobs

    def _submit(self, t: Track) -> str:
        # failed attempts under another config than the run's now do not count against its retries
        new_config = bool(failed_attempts(t.jobs)) and spec_changed(t.folder, t.job) is not None
        write_spec(t.folder, t.job)
        name = job_name(t.job.run.name, t.folder)
        # noted before the scheduler hears of it: a driver killed before the id is written finds
        # the job by its name (_recorded); a Ctrl-C waits until the id is written
        t.jobs.append({"name": name, "submitted": time.time(), **({"new_config": True} if new_config else {})})
        write_submissions(t.folder, self.scheduler.name, t.jobs)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            job_id = self.scheduler.submit(t.folder, name, regime_of(t.job))
            t.jobs[-1]["id"] = job_id
            write_submissions(t.folder, self.scheduler.name, t.jobs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print(f"[compare] {t.job.run.name}: submitted as {self.scheduler.name} job {job_id}", flush=True)
        return job_id

    def _ended(self, t: Track, state: JobState) -> bool:
        """Note how the run's job ended (job.json); True when it is to be submitted again."""
        record = read_record(t.folder)  # the run's own word: a job that ended without one failed
        ok = record.get("status") == "ok" and has_result(t.folder)
        t.jobs[-1].update(state=state.state, reason=state.reason, ended=time.time())
        if not ok:  # a failed attempt, counted against grid.retries by this driver and any later one
            why = failure_line(state, record)
            log = self.scheduler.output(t.folder, state.id)
            if log.exists() and not record.get("error"):  # no word from the run itself: where to look
                why += f"; its output: {log}"
            t.jobs[-1].update(failed=True, why=why)
        write_submissions(t.folder, self.scheduler.name, t.jobs)
        if ok:
            return False
        failures = len(failed_attempts(t.jobs))
        if retried(state) and failures <= self.grid.retries:
            print(f"[compare] {t.job.run.name}: job {state.id} {why}; resubmitted "
                  f"(retry {failures} of {self.grid.retries})", flush=True)
            return True
        self._give_up(t, record.get("wall_time_s", 0.0))
        return False

    def _give_up(self, t: Track, wall_time_s: float = 0.0) -> None:
        """The run's failed compare.json: its attempts and why the last failed (from job.json, so a
        later driver writes the same)."""
        failed = failed_attempts(t.jobs)
        n, last = len(failed), failed[-1]
        error = f"{n} attempt{'s' * (n > 1)}, the last job {last.get('id', '-')} {last.get('why', last.get('state'))}"
        write_record(t.folder, {"status": "failed", "error": error[:300], "attempts": n,
                                "scheduler": self.scheduler.name, "wall_time_s": wall_time_s})

    def _spent(self, t: Track) -> None:
        """A run (or warm-up) whose failed attempts in job.json, submitted by earlier drivers, spent
        grid.retries: one line, its failed record (re)written, nothing submitted."""
        n = len(failed_attempts(t.jobs))
        print(f"[compare] {t.job.run.name}: {n} failed attempt{'s' * (n > 1)} in its job.json spent grid.retries="
              f"{self.grid.retries}; not submitted again (raise grid.retries, or delete its job.json, to retry it)",
              flush=True)
        self._give_up(t, read_record(t.folder).get("wall_time_s", 0.0))


def regime_of(job: Job) -> str:
    """The regime of a job's run ('' for a grid without regimes)."""
    return getattr(getattr(job.run, "arm", None), "regime", "")


def table_of(job: Job) -> tuple:
    """The (data set, regime) of a job's run, whose feature-cache warm-up it waits for."""
    return getattr(getattr(job.run, "arm", None), "table", ("", ""))


def stopped_submitting(running: int, scheduler: str) -> Preempted:
    """Ctrl-C in the driver: no more submissions; the jobs submitted run on (one line, exit 130)."""
    return Preempted(0, status=130, line=(
        f"interrupted (Ctrl-C): nothing more is submitted; the {running} {scheduler} job(s) in flight run on. "
        "Run the same command to re-attach, or add --cancel to cancel them"))


# ---------------------------------------------------------------------------- which scheduler
def scheduler_of(grid) -> Scheduler:
    """The Scheduler that grid.executor names (only slurm today)."""
    if grid.executor == "slurm":
        from vlp.executors.slurm import Slurm  # its commands only where a grid asks for them

        return Slurm(grid.slurm)
    raise ConfigError(f"config: grid.executor={grid.executor} has no scheduler: --status and --cancel "
                      "need a batch scheduler (grid.executor: slurm)")
