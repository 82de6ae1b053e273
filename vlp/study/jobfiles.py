"""What a run folder holds for a scheduler's job (vlp.study.batch), and the one reader and writer
of each file:

    job_spec.json   what the job runs: the run's name, config, val / test specs (vlp.study.job reads it)
    job.json        every job submitted for the run: {"name", "submitted", then "id", and once it
                    ended "state", "reason", "ended"}; the last one without "state" is in flight
    compare.json    the run's record (vlp.study.runs.run_one; a job that ended without one gets a
                    failed record from the driver once its retries are spent)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from vlp.config import ConfigError
from vlp.study.runs import stale_key
from vlp.util import atomic_write

SPEC_FILE = "job_spec.json"
JOBS_FILE = "job.json"
RECORD_FILE = "compare.json"  # vlp.study.runs.run_one's record: what the report reads


def write_spec(folder: Path, job) -> None:
    """job_spec.json: what the job runs (vlp.study.job), from a vlp.study.executor.Job."""
    spec = {"run": job.run.name, "config": job.cfg.to_dict(), "specs": job.specs,
            "keep_checkpoints": job.keep_checkpoints}
    atomic_write(folder / SPEC_FILE, json.dumps(spec, indent=1))


def spec_changed(folder: Path, job) -> Optional[str]:
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


def job_name(run: str, folder: Path) -> str:
    """The scheduler's name of a run's job: the run's name and a tag of its folder (two grids'
    runs of one name are told apart in the queue and in accounting)."""
    return f"vlp-{run}-{hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:6]}"
