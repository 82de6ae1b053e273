"""One run of a grid inside a scheduler's job (vlp.executors.batch), from its folder's job_spec.json:

    python -m vlp.executors.job RUN_FOLDER      # or s3://b/grid/run; per node under accelerate launch

It runs the job once (vlp.executors.local.run_job, no retry: the driver resubmits), writing
result.json and compare.json as a local run does. Exit status: 0 done, 1 failed (compare.json
says why), 2 a config error (not retried), a preemption's own status (the run resumes).
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

from vlp.checkpoint.storage import RunFolder
from vlp.config import ConfigError, from_dict
from vlp.executors.jobfiles import SPEC_FILE, work_named
from vlp.executors.jobstate import CONFIG_ERROR_EXIT, Job


def read_job(folder: str):
    """The Job of job_spec.json in ``folder`` (a path, or a URL: s3://b/grid/run; written by
    vlp.executors.jobfiles.write_spec), its config checked."""
    from vlp.experiment import check

    try:
        run = RunFolder(folder)
        spec = json.loads(run.read_bytes(SPEC_FILE))
    except (OSError, ValueError) as e:
        raise ConfigError(f"job: cannot read {str(folder).rstrip('/')}/{SPEC_FILE}: {e}") from None
    cfg = check(from_dict(copy.deepcopy(spec["config"])))
    return Job(SimpleNamespace(name=spec["run"]), cfg, spec.get("specs"), retries=0,
               keep_checkpoints=spec.get("keep_checkpoints", True), warm=spec.get("warm", False),
               work=work_named(spec.get("work")))


def main(argv: list[str]) -> int:
    from accelerate import Accelerator

    from vlp.executors.local import run_job
    from vlp.train.preempt import Preempted

    if len(argv) != 1:
        print("usage: python -m vlp.executors.job RUN_FOLDER", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        job = read_job(argv[0])
    except ConfigError as e:
        print(f"vlp: error: {e}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    precision = job.cfg.train.precision
    accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision)
    try:
        record = run_job(job, accelerator)
    except Preempted as e:  # saved: the driver resubmits, the run resumes (train.resume=latest)
        if e.is_main:
            print(f"vlp: {e}", file=sys.stderr)
        return e.status
    if record["status"] == "ok":
        return 0
    return CONFIG_ERROR_EXIT if record["error"].startswith("ConfigError") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
