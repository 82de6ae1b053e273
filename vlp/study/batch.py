"""A grid's runs as jobs of a batch scheduler (SLURM today; Ray or Kubernetes would be another
`Scheduler`): the driver loop that submits, watches and resubmits them, and what it keeps in the
run folders, from which a rerun re-attaches.

    with BatchExecutor(grid, scheduler) as ex:        # vlp.study.study runs it as any Executor
        ex.run([Job(run, cfg, specs), ...], total=len(all_runs), on_done=callback)

A scheduler does three things (`Scheduler`): submit one run's job, poll the states of all the
given jobs in one call, cancel jobs. Everything else is here and is the same for any scheduler:

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

import hashlib
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from vlp.config import ConfigError
from vlp.locations import is_url
from vlp.study.executor import Job
from vlp.study.jobstate import PENDING, RUNNING, JobState
from vlp.study.runs import stale_key
from vlp.train.preempt import Preempted
from vlp.util import atomic_write

SPEC_FILE = "job_spec.json"
JOBS_FILE = "job.json"
RECORD_FILE = "compare.json"  # vlp.study.runs.run_one's record: what the report reads

CONFIG_ERROR_EXIT = 2  # vlp.study.job's status for a config error: not retried
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


# ---------------------------------------------------------------------------- the run folder
def write_spec(folder: Path, job: Job) -> None:
    """job_spec.json: what the job runs (vlp.study.job)."""
    spec = {"run": job.run.name, "config": job.cfg.to_dict(), "specs": job.specs,
            "keep_checkpoints": job.keep_checkpoints}
    atomic_write(folder / SPEC_FILE, json.dumps(spec, indent=1))


def spec_changed(folder: Path, job: Job) -> Optional[str]:
    """The first key whose value differs between a job in flight's job_spec.json and the run's
    config now (vlp.study.runs.stale_key), else None: a rerun re-attaches only to what it would submit."""
    try:
        saved = json.loads((folder / SPEC_FILE).read_text())["config"]
    except (OSError, ValueError, KeyError):
        return None
    return stale_key(saved, job.cfg.to_dict())


def submissions(folder: Path) -> list[dict]:
    """job.json's submissions, oldest first: {"id", "submitted", and once ended "state", "reason"}."""
    try:
        return json.loads((folder / JOBS_FILE).read_text())["jobs"]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"compare: {folder / JOBS_FILE} is not a job list; delete it to submit the run afresh") from None


def write_submissions(folder: Path, scheduler: str, jobs: list[dict]) -> None:
    atomic_write(folder / JOBS_FILE, json.dumps({"scheduler": scheduler, "jobs": jobs}, indent=1))


def live_id(jobs: list[dict]) -> Optional[str]:
    """The id of the run's last submission while it has not ended, else None."""
    return jobs[-1].get("id") if jobs and "state" not in jobs[-1] else None


def unrecorded(jobs: list[dict]) -> Optional[dict]:
    """The run's last submission when its id was never recorded (the driver died between asking
    the scheduler and hearing the id), else None."""
    return jobs[-1] if jobs and "id" not in jobs[-1] and "state" not in jobs[-1] else None


def read_record(folder: Path) -> dict:
    try:
        return json.loads((folder / RECORD_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


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


def job_name(run: str, folder: Path) -> str:
    """The scheduler's name of a run's job: the run's name and a tag of its folder (two grids'
    runs of one name are told apart in the queue and in accounting)."""
    return f"vlp-{run}-{hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:6]}"


def stopped_submitting(running: int, scheduler: str) -> Preempted:
    """Ctrl-C in the driver: no more submissions; the jobs submitted run on (one line, exit 130)."""
    return Preempted(0, status=130, line=(
        f"interrupted (Ctrl-C): nothing more is submitted; the {running} {scheduler} job(s) in flight run on. "
        "Run the same command to re-attach, or add --cancel to cancel them"))


# ---------------------------------------------------------------------------- --status / --cancel
def run_folders(out_dir) -> list[Path]:
    """The grid's run folders that were ever submitted (job.json) or are done (result.json)."""
    root = Path(out_dir)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and ((d / JOBS_FILE).exists() or (d / "result.json").exists()))


def status_rows(folders: list[Path], states: dict[str, JobState]) -> list[tuple[str, str, str, str]]:
    """(run, state, job id, detail) per run folder: done, pending, running, requeued N, failed (reason),
    never submitted here ('-'). Pure: the folders' files and the scheduler's states."""
    rows = []
    for folder in folders:
        jobs = submissions(folder)
        last = jobs[-1] if jobs else {}
        job_id = last.get("id", "-")
        if (folder / "result.json").exists():
            rows.append((folder.name, "done", job_id, ""))
            continue
        if not jobs:
            rows.append((folder.name, "-", "-", "not submitted"))
            continue
        tries = f"attempt {len(jobs)}"
        live = states.get(job_id) if "state" not in last else None
        if live is not None and live.phase in (PENDING, RUNNING):
            word = f"requeued {live.requeues}" if live.requeues else live.phase
            rows.append((folder.name, word, job_id, f"{live.state} {live.reason}".strip() + f"; {tries}"))
        elif live is not None:
            rows.append((folder.name, "ended", job_id, f"{live.state} {live.reason}".strip() + "; not yet seen by a driver"))
        elif "state" in last:
            record = read_record(folder)
            why = record.get("error") or f"{last['state']} {last.get('reason', '')}".strip()
            rows.append((folder.name, "failed", job_id, f"{why}; {tries}"))
        else:
            rows.append((folder.name, "unknown", job_id, "not known to the scheduler any more"))
    return rows


def status_table(rows: list[tuple[str, str, str, str]]) -> str:
    """The runs by state, as a markdown table, with a count per state."""
    counts: dict[str, int] = {}
    for _, word, _, _ in rows:
        key = word.split()[0]
        counts[key] = counts.get(key, 0) + 1
    lines = ["| run | state | job | detail |", "|---|---|---|---|"]
    lines += [f"| {run} | {word} | {job} | {detail} |" for run, word, job, detail in rows]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no run submitted yet"
    return "\n".join(lines + ["", summary])


def study_status(grid, scheduler: Scheduler) -> str:
    """`vlp compare --status`: the table of the grid's runs; one poll, nothing submitted."""
    folders = run_folders(grid.out_dir)
    live = [i for i in (live_id(submissions(f)) for f in folders) if i]
    return status_table(status_rows(folders, scheduler.poll(live) if live else {}))


def cancel_study(grid, scheduler: Scheduler) -> int:
    """`vlp compare --cancel`: cancel every job of the grid not yet ended; notes it in each job.json.
    Returns how many."""
    cancelled = []
    for folder in run_folders(grid.out_dir):
        jobs = submissions(folder)
        if live_id(jobs):
            cancelled.append(jobs[-1]["id"])
            jobs[-1].update(state="CANCELLED", reason="vlp compare --cancel", ended=time.time())
            write_submissions(folder, scheduler.name, jobs)
    if cancelled:
        scheduler.cancel(cancelled)
    return len(cancelled)


def exit_on_failures(rows: list[dict]) -> Optional[str]:
    """The one line for a grid that ended with failed cells (their runs and reasons are in the
    report), else None."""
    failed = [r for r in rows if r.get("status") != "ok"]
    if not failed:
        return None
    names = ", ".join(r["run"] for r in failed[:3]) + (" ..." if len(failed) > 3 else "")
    return f"{len(failed)} run(s) failed after grid.retries ({names}); the report shows each cell's reason"



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
