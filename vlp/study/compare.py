"""`vlp compare`: a grid of trainings (loss × per-GPU batch × seed) at an equal sample budget.

    vlp compare -c configs/compare_small_batch.yaml                  # CPU, embedded OpenMoji data
    vlp compare -c configs/compare_small_batch.yaml grid.seeds=[0] train.samples=4096
    accelerate launch -m vlp compare -c configs/compare_gpu_vitb32.yaml   # N GPUs
    vlp compare -c configs/compare_small_batch.yaml --report-only      # rebuild table and plots

Fairness: every run sees the same budget of samples (steps = samples // global batch, so a
smaller batch takes more steps; the samples actually seen are reported), the same data order
for a given seed (the Trainer seeds the stream with train.seed), and the same held-out
retrieval eval (data.eval_shards) at the end. Under `accelerate launch` the per-GPU batch is
the swept knob and global batch = per-GPU × processes × accum is reported.

    <out_dir>/<loss>_b<batch>_s<seed>/  one Trainer run: log.jsonl, result.json, config.yaml
    <out_dir>/runs.csv                  one row per run (config, status, eval, final diagnostics)
    <out_dir>/results.md                mean ± std over seeds per loss × batch, best per batch bold
    <out_dir>/metric_vs_batch.png       eval metric vs per-GPU batch (log2), one line per loss
    <out_dir>/curves.png                diagnostics vs samples seen, one line per loss × batch

Resumable: a run with result.json is skipped; an unfinished one resumes from its latest
checkpoint; a run that raises is retried once (from its latest checkpoint), then recorded as
failed and the grid goes on. All processes walk the grid in the same order (the Trainer's
collectives need it); only the main process writes files. Limitation: an exception raised on
one rank only (e.g. one GPU's OOM) usually hangs the others in a collective, as in any DDP job.

grid.out_dir may be a bucket (s3://b/grid, gs://...): every run's folder is a bucket run folder
(vlp.train), runs.csv / results.md / plots are written locally and uploaded, and a rerun resumes
the grid from what the bucket holds. A tuned study (grid.sweep) needs a local folder.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import yaml

from vlp.config import PACKAGED_DEFAULTS, ConfigError, apply_overrides, from_dict, load_yaml, set_dotted

from vlp.experiment import check
from vlp.checkpoint.storage import RunFolder, open_run_folder
from vlp.study.executor import Executor, Job
from vlp.study.grid import GridSpec, parse_grid
from vlp.study.plan import expand_grid
from vlp.study.report import write_report
from vlp.study.rows import collect_rows
from vlp.study.runs import broadcast, embedded_shards, plan_runs, run_config
from vlp.study.study import run_study
from vlp.study.tables import aggregate, markdown_table
from vlp.study.userdata import check_datasets
from vlp.checkpoint import lock as runlock

# = configs/compare_small_batch.yaml, shipped in the package (vlp/defaults/ links to configs/)
DEFAULT_CONFIG = PACKAGED_DEFAULTS / "compare_small_batch.yaml"


def load_compare_config(path: str | Path, overrides: Sequence[str] = (), quick: bool = False) -> tuple[dict, GridSpec]:
    """YAML + dotted overrides (grid.* included) → (base vlp config dict, GridSpec), both validated.
    quick: the YAML's top-level `quick:` map of dotted overrides is applied first (a few-minute
    version of the same study); otherwise that section is ignored."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: no such file: {path}")
    data = load_yaml(path.read_text(), str(path)) or {}  # a duplicate key is refused, not overwritten
    quick_sets = data.pop("quick", None)
    if quick:
        if not isinstance(quick_sets, dict) or not quick_sets:
            raise ConfigError(f"config: --quick needs a top-level 'quick:' map of dotted overrides in {path}")
        for key, value in quick_sets.items():
            set_dotted(data, key, value)
    data = apply_overrides(data, list(overrides))
    grid = parse_grid(data.pop("grid", None))
    cfg = check(from_dict(copy.deepcopy(data)))  # fail on a bad base config before any run
    if grid.sweep and not grid.optimizers:
        grid.optimizers = [cfg.optim.name]
    check_datasets(grid.datasets)  # your own data sets' local shards exist, before any folder is made
    return data, grid


def resolve_data(base: dict, acc) -> dict:
    """data.train_shards '' or 'openmoji': the embedded OpenMoji shards (train + held-out eval)."""
    from vlp.data.embedded import SHARD_CACHE  # heavy (the renderer); only the embedded data needs it

    specs = embedded_shards(base, acc, ("train", "eval"), SHARD_CACHE)
    if specs is not None:
        base["data"]["train_shards"] = specs["train"]
        if not base["data"].get("eval_shards"):
            base["data"]["eval_shards"] = specs["eval"]
    return base


def run_grid(base: dict, grid: GridSpec, report_only: bool = False, accelerator=None):
    """Run every unfinished run of the grid (a tuned study with grid.sweep: vlp.study.study),
    then write the report; returns the runs.csv rows (a study: its result dict)."""
    if accelerator is None:  # one Accelerator for the whole grid: every run shares its precision
        from accelerate import Accelerator  # heavy (torch.distributed); only a run needs it

        precision = from_dict(copy.deepcopy(base)).train.precision
        accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision)
    # one writer per grid folder, as per run folder (a second `vlp compare` is refused in one line)
    lock = None if report_only else runlock.acquire_on_main(
        open_run_folder(grid.out_dir, option="grid.out_dir"), False, accelerator.is_main_process, accelerator.print)
    try:
        if grid.sweep:  # a tuned study: sweep on val, seeds on test
            return run_study(base, grid, accelerator, report_only)
        return run_plain_grid(base, grid, report_only, accelerator)
    finally:
        if lock is not None:
            lock.release()


def run_plain_grid(base: dict, grid: GridSpec, report_only: bool, acc) -> list[dict]:
    """loss × batch × seed, each run trained once and evaluated by the Trainer (data.eval_shards);
    the report is rewritten after every run (partial results are always on disk)."""
    base = resolve_data(copy.deepcopy(base), acc)
    runs = expand_grid(grid)
    cfgs = {r.name: run_config(base, grid, r, acc.num_processes) for r in runs}
    out = open_run_folder(grid.out_dir, option="grid.out_dir")  # a local folder or a bucket, checked
    done, error = broadcast(plan_runs(runs, cfgs, out) if acc.is_main_process else None, acc)
    if error:  # raised on every rank, so none waits in a collective
        raise ConfigError(error)
    if acc.is_main_process:
        with out.file("compare_config.yaml") as path:
            path.write_text(yaml.safe_dump({**base, "grid": {**grid.__dict__}}, sort_keys=False))
        print(f"[compare] {len(runs)} runs ({sum(done)} already done) -> {out.path()}", flush=True)

    def partial_report(job: Job, record: dict) -> None:
        if acc.is_main_process:
            _write_report(out, collect_rows(runs, cfgs, acc.num_processes), grid, len(runs))

    if not report_only:
        jobs = [Job(r, cfgs[r.name], None, grid.retries, grid.keep_checkpoints, i)
                for i, (r, finished) in enumerate(zip(runs, done), 1) if not finished]
        with Executor(grid, acc) as executor:
            executor.run(jobs, total=len(runs), on_done=partial_report)
    rows = collect_rows(runs, cfgs, acc.num_processes)
    if acc.is_main_process:
        _write_report(out, rows, grid, len(runs))
        print(markdown_table(aggregate(rows), grid.losses), flush=True)
    out.close()
    return rows


def _write_report(out: RunFolder, rows: list[dict], grid: GridSpec, n_runs: int) -> None:
    """runs.csv, results.md and the plots into the grid's folder (a bucket: written locally, then uploaded)."""
    write_report(out.local_dir(""), rows, grid, n_runs)
    out.sync_dir("")
