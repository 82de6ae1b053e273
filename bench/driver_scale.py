"""The map's driver at cluster scale (issue 50, DESIGN §6): `vlp compare` with grid.executor=slurm
holding 1,000 runs in flight, by simulation (the loopback cluster holds a few jobs, not 1,000).

    OMP_NUM_THREADS=1 python bench/driver_scale.py                  # 1,000 runs, 1,000 in flight
    OMP_NUM_THREADS=1 python bench/driver_scale.py --runs 200 --quick

What is real: the driver loop (vlp.executors.batch.BatchExecutor: submissions, one poll per round,
job.json / job_spec.json / compare.json in each run folder, re-attach), the SLURM scheduler class
(vlp.executors.slurm.Slurm: the sbatch line and job script it writes, the sacct call it makes and the
parse of its answer) and real run configs (each Job carries a vlp Config, as the study's do). What
is simulated: the SLURM commands themselves (`SimulatedSlurm` answers sbatch / sacct / sinfo as the
controller would, each job pending for a few rounds, running for a few more, then writing its run
folder's result.json and compare.json as `vlp.executors.job` does) and the wait between polls (0 s).

Figures: the driver's CPU seconds and peak RSS for the whole map, CPU per poll round with every
run in flight, the SLURM calls it made by kind, the bytes of the largest sacct command line
(one call for all the jobs), and the files it wrote per run. The same driver then restarts on
the half-finished map (re-attach), as after a SIGKILL: its start-up CPU and the calls it made.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import figure, header, scratch  # noqa: E402


class SimulatedSlurm:
    """What slurmctld / slurmdbd would answer to the driver's commands (a `run` for vlp.executors.slurm.Slurm)."""

    def __init__(self, pending_rounds: int, running_rounds: int):
        self.pending_rounds, self.running_rounds = pending_rounds, running_rounds
        self.jobs: dict[str, dict] = {}  # id -> {"folder", "name", "polls", "state"}
        self.calls: Counter = Counter()
        self.longest_argv = 0
        self.stop_after_polls = None  # a driver "killed" after this many polls (KeyboardInterrupt)

    def __call__(self, cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        self.calls["sbatch --test-only" if "--test-only" in cmd else cmd[0]] += 1
        self.longest_argv = max(self.longest_argv, sum(len(x) + 1 for x in cmd))
        out = getattr(self, "_" + cmd[0])(cmd)
        return subprocess.CompletedProcess(cmd, 0, out, "")

    def _sinfo(self, cmd) -> str:
        return "debug*|2|(null)\n"

    def _sbatch(self, cmd) -> str:
        if "--test-only" in cmd:
            return ""
        job_id = str(1000 + len(self.jobs))
        folder = Path(cmd[-1]).parent  # the job script, last (vlp.executors.slurm.sbatch_args), in the run folder
        name = next(a.split("=", 1)[1] for a in cmd if a.startswith("--job-name="))
        self.jobs[job_id] = {"folder": folder, "name": name, "polls": 0, "state": "PENDING"}
        return f"{job_id}\n"

    def _sacct(self, cmd) -> str:
        if "-j" not in cmd:  # find by name
            return ""
        if self.stop_after_polls is not None:
            self.stop_after_polls -= 1
            if self.stop_after_polls < 0:
                raise KeyboardInterrupt
        rows = []
        for job_id in cmd[cmd.index("-j") + 1].split(","):
            job = self.jobs[job_id]
            job["polls"] += 1
            if job["state"] == "PENDING" and job["polls"] > self.pending_rounds:
                job["state"] = "RUNNING"
            elif job["state"] == "RUNNING" and job["polls"] > self.pending_rounds + self.running_rounds:
                job["state"] = "COMPLETED"
                folder = job["folder"]
                (folder / "result.json").write_text(json.dumps({"mean_R@1": 1.0}))
                (folder / "compare.json").write_text(json.dumps({"status": "ok", "error": "", "wall_time_s": 1.0}))
            rows.append(f"{job_id}|{job['state']}|0:0|None")
        return "\n".join(rows) + "\n"


def jobs(out: Path, runs: int) -> list:
    """`runs` Jobs as the study makes them: a run name and a full vlp Config whose output_dir is its folder."""
    from types import SimpleNamespace

    from vlp.config import from_dict
    from vlp.executors import Job
    from vlp.util import load_yaml

    base = load_yaml((Path(__file__).resolve().parent.parent / "configs" / "demo.yaml").read_text())
    made = []
    for i in range(runs):
        cfg = from_dict({**base, "train": {**base.get("train", {}), "output_dir": str(out / f"run{i:05d}"), "seed": i}})
        made.append(Job(SimpleNamespace(name=f"run{i:05d}"), cfg, index=i + 1))
    return made


def drive(grid, all_jobs: list, sim: SimulatedSlurm) -> tuple[float, int]:
    """One driver over `all_jobs`: (CPU seconds, runs it saw end)."""
    from vlp.executors.batch import BatchExecutor
    from vlp.executors.slurm import Slurm

    done = []
    cpu0 = time.process_time()
    try:
        BatchExecutor(grid, Slurm(grid.slurm, run=sim, say=lambda line: None), sleep=lambda s: None).run(
            all_jobs, on_done=lambda job, record: done.append(job.run.name))
    except Exception as e:  # noqa: BLE001  (the "killed" driver: stopped_submitting)
        if "nothing more is submitted" not in str(e):
            raise
    return time.process_time() - cpu0, len(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--pending-rounds", type=int, default=3)
    parser.add_argument("--running-rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="100 runs")
    args = parser.parse_args()
    runs = 100 if args.quick else args.runs
    header(f"driver_scale: {runs} runs in flight at once, simulated SLURM")
    import contextlib
    import io

    from vlp.config import read_grid

    out = Path(scratch("vlp-driver-scale-"))
    grid = read_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "out_dir": str(out),
                      "executor": "slurm", "slurm": {"max_in_flight": runs, "poll_s": 1}})
    made = jobs(out, runs)
    from vlp.executors import batch, slurm  # noqa: F401  (the driver's code, loaded before the baseline)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    # the first driver, killed mid-map (as by SIGKILL: nothing more is written), then a second one
    first = SimulatedSlurm(args.pending_rounds, args.running_rounds)
    first.stop_after_polls = args.pending_rounds + 1  # every job submitted and running
    with contextlib.redirect_stdout(io.StringIO()):
        cpu_first, _ = drive(grid, made, first)
    second = SimulatedSlurm(args.pending_rounds, args.running_rounds)
    second.jobs = first.jobs  # the same cluster
    with contextlib.redirect_stdout(io.StringIO()) as said:
        cpu_second, ended = drive(grid, made, second)
    assert ended == runs, (ended, said.getvalue()[-2000:])
    rounds = second.calls["sacct"]
    files = sum(1 for _ in out.rglob("*")) / runs

    figure("driver_runs_in_flight", runs, "runs")
    figure("driver_cpu_s submit_and_watch", cpu_first, "s", f"{runs} sbatch + {first.calls['sacct']} polls")
    figure("driver_cpu_s reattach_to_the_end", cpu_second, "s", f"{rounds} polls, {second.calls['sbatch']} sbatch")
    figure("driver_cpu_ms_per_poll_round", 1000 * cpu_second / max(rounds, 1), "ms", f"{runs} jobs per sacct call")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    figure("driver_peak_rss_mb", peak / 1024, "MB", f"{rss0 / 1024:.0f} MB with vlp imported and the runs' configs made")
    figure("driver_rss_growth_mb", (peak - rss0) / 1024, "MB", "submitting and watching every run")
    figure("driver_slurm_calls sbatch", first.calls["sbatch"] + second.calls["sbatch"], "calls",
           f"for {runs} runs (the restarted driver: {second.calls['sbatch']}); and one sbatch --test-only per driver")
    figure("driver_slurm_calls per_poll_round", 1, "calls", "one sacct for every job in flight")
    figure("driver_sacct_argv_bytes", max(first.longest_argv, second.longest_argv), "bytes")
    figure("driver_files_per_run", files, "files")


if __name__ == "__main__":
    main()
