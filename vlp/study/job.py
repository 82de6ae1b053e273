"""One run of a grid inside a scheduler's job (vlp.study.batch): what `vlp compare` would have run
in its own process, from the run folder's job_spec.json.

    python -m vlp.study.job RUN_FOLDER                       # one CPU process (1 node, 0 GPUs)
    python -m accelerate.commands.launch ... -m vlp.study.job RUN_FOLDER   # per node, as launch/slurm.sbatch

It trains (and ranks) the run once (vlp.study.executor.run_job, no retry here: the driver
resubmits a failed job), writing result.json and compare.json as a local run does. Exit status:
0 done, 1 failed (compare.json says why), 2 a config error (not retried), a preemption's own
status (saved; the driver resubmits and the run resumes from its checkpoint).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from vlp.config import ConfigError, from_dict
from vlp.study.jobfiles import SPEC_FILE
from vlp.study.jobstate import CONFIG_ERROR_EXIT


def read_job(folder: Path):
    """The Job of job_spec.json in ``folder`` (vlp.study.batch.write_spec), its config checked."""
    from vlp.experiment import check
    from vlp.study.executor import Job

    try:
        spec = json.loads((folder / SPEC_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"job: cannot read {folder / SPEC_FILE}: {e}") from None
    cfg = check(from_dict(copy.deepcopy(spec["config"])))
    return Job(SimpleNamespace(name=spec["run"]), cfg, spec.get("specs"), retries=0,
               keep_checkpoints=spec.get("keep_checkpoints", True))


def main(argv: list[str]) -> int:
    from accelerate import Accelerator

    from vlp.study.executor import run_job
    from vlp.train.preempt import Preempted

    if len(argv) != 1:
        print("usage: python -m vlp.study.job RUN_FOLDER", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        job = read_job(Path(argv[0]))
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
