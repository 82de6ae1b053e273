"""What a run folder holds for a scheduler's job (vlp.executors.batch), and the one reader and writer
of each file, through the run folders' storage (vlp.checkpoint.storage.RunFolder: a local folder,
or a bucket for grid.out_dir s3://... / gs://...):

    job_spec.json   what the job runs: the run's name, config, val / test specs, its work by name
                    ("vlp.study.runs:train_job"), or "warm": true for a (data set, regime)'s
                    feature-cache warm-up (vlp.executors.job reads it)
    job.json        every job submitted for the run: {"name", "submitted", then "id", and once it
                    ended "state", "reason", "ended", and for a job that ended without the run
                    done "failed": true and "why"}; the last one without "state" is in flight. The
                    failed ones are the run's attempts that grid.retries counts, across drivers,
                    since the last submission with "new_config": true (the config was edited)
    compare.json    the run's record (vlp.executors.local.run_one; a job that ended without one gets a
                    failed record from the driver once its retries are spent)
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Optional

from vlp.checkpoint.storage import RunFolder
from vlp.config import ConfigError, stale_key

SPEC_FILE = "job_spec.json"
JOBS_FILE = "job.json"
RECORD_FILE = "compare.json"  # vlp.executors.local.run_one's record: what the report reads
RESULT_FILE = "result.json"  # the Trainer's (a warm-up's: vlp.executors.local.warm_one): the run is done


def write_spec(folder: RunFolder, job) -> None:
    """job_spec.json: what the job runs (vlp.executors.job), from a vlp.executors.Job."""
    work = f"{job.work.__module__}:{job.work.__qualname__}" if job.work else None
    spec = {"run": job.run.name, "config": job.cfg.to_dict(), "specs": job.specs,
            "keep_checkpoints": job.keep_checkpoints, "warm": job.warm, "work": work}
    folder.write_bytes(SPEC_FILE, json.dumps(spec, indent=1).encode())


OLD_WORK = "vlp.study.runs:train_job"  # a job_spec.json written before "work" was: a run's training


def work_named(name: Optional[str]):
    """The function a job_spec.json names as its work ('module:function' in vlp); a spec without
    one is a run's training (OLD_WORK). Any other name is one ConfigError line, not a retried run."""
    name = name or OLD_WORK
    module, _, function = name.partition(":")
    try:
        if module.startswith("vlp.") and function:
            return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError):
        pass
    raise ConfigError(f"job: {SPEC_FILE} names its work {name!r}: not a function of vlp ('vlp.module:function')")


def read_json(folder: RunFolder, name: str) -> Optional[dict]:
    """A run folder's JSON file (local or in a bucket: one GET, never a cached listing), None when
    it is absent or unreadable."""
    try:
        return json.loads(folder.read_bytes(name))
    except (FileNotFoundError, ValueError):
        return None


def spec_changed(folder: RunFolder, job) -> Optional[str]:
    """The first key whose value differs between a job in flight's job_spec.json and the run's
    config now (vlp.config.stale_key), else None: a rerun re-attaches only to what it would submit."""
    saved = read_json(folder, SPEC_FILE)
    if not isinstance(saved, dict) or "config" not in saved:
        return None
    return stale_key(saved["config"], job.cfg.to_dict())


def submissions(folder: RunFolder) -> list[dict]:
    """job.json's submissions, oldest first: {"id", "submitted", and once ended "state", "reason"}."""
    try:
        return json.loads(folder.read_bytes(JOBS_FILE))["jobs"]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"compare: {folder.path(JOBS_FILE)} is not a job list; delete it to submit the run afresh") from None


def write_submissions(folder: RunFolder, scheduler: str, jobs: list[dict]) -> None:
    folder.write_bytes(JOBS_FILE, json.dumps({"scheduler": scheduler, "jobs": jobs}, indent=1).encode())


def failed_attempts(jobs: list[dict]) -> list[dict]:
    """The run's submissions that ended without the run done ("failed", written by the driver that
    saw them end) since its config last changed ("new_config"): what grid.retries counts, whichever
    driver submitted them."""
    since = max((i for i, j in enumerate(jobs) if j.get("new_config")), default=0)
    return [j for j in jobs[since:] if j.get("failed")]


def live_id(jobs: list[dict]) -> Optional[str]:
    """The id of the run's last submission while it has not ended, else None."""
    return jobs[-1].get("id") if jobs and "state" not in jobs[-1] else None


def unrecorded(jobs: list[dict]) -> Optional[dict]:
    """The run's last submission when its id was never recorded (the driver died between asking
    the scheduler and hearing the id), else None."""
    return jobs[-1] if jobs and "id" not in jobs[-1] and "state" not in jobs[-1] else None


def read_record(folder: RunFolder) -> dict:
    """compare.json, {} while the run has not written one."""
    return read_json(folder, RECORD_FILE) or {}


def has_result(folder: RunFolder) -> bool:
    """The run wrote result.json (it is done)."""
    return read_json(folder, RESULT_FILE) is not None


def write_record(folder: RunFolder, record: dict) -> None:
    """compare.json written by the driver: a run that ended without a record of its own."""
    folder.write_bytes(RECORD_FILE, json.dumps(record, indent=2).encode())


def folder_name(folder: RunFolder) -> str:
    """A run folder's own name (its run's), the last part of its path or URL."""
    return folder.url.rsplit("/", 1)[-1]


def job_name(run: str, folder: RunFolder) -> str:
    """The scheduler's name of a run's job: the run's name and a tag of its folder (two grids'
    runs of one name are told apart in the queue and in accounting)."""
    where = folder.url if folder.remote else str(Path(folder.url).resolve())
    return f"vlp-{run}-{hashlib.sha1(where.encode()).hexdigest()[:6]}"
