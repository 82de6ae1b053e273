"""`vlp compare`: a grid of trainings at an equal sample budget: arms (data set × regime × loss ×
optimizer × per-GPU batch) × seeds, optionally tuned per arm (grid.sweep; vlp.study.study).

    vlp compare -c configs/compare_small_batch.yaml                  # CPU, embedded OpenMoji data
    vlp compare -c configs/compare_small_batch.yaml grid.seeds=[0] train.samples=4096
    accelerate launch -m vlp compare -c configs/compare_gpu_vitb32.yaml   # N GPUs
    vlp compare -c configs/compare_small_batch.yaml --report-only      # rebuild tables and plots

Fairness: every run sees the same budget of samples (steps = samples // global batch, so a
smaller batch takes more steps; the samples actually seen are reported), the same data order
for a given seed (the Trainer seeds the stream with train.seed), and the same held-out eval at
the end. Under `accelerate launch` the per-GPU batch is the swept knob and global batch =
per-GPU × processes × accum is reported. Files: <out_dir>/<run>/ (one Trainer run), runs.csv
and the report (vlp.study.report).

Resumable: a done run is skipped; an unfinished one resumes from its latest checkpoint; a run
that raises is retried (grid.retries), then recorded as failed and the grid goes on. All
processes walk the grid in the same order (the Trainer's collectives need it); only the main
process writes files. Limitation: an exception raised on one rank only (e.g. one GPU's OOM)
usually hangs the others in a collective, as in any DDP job. A plain grid's grid.out_dir may be a
bucket (s3://b/grid, gs://...): its files are written locally and uploaded, and a rerun resumes
from what the bucket holds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

from vlp.config import PACKAGED_DEFAULTS, ConfigError, apply_overrides, from_dict, load_yaml, set_dotted

from vlp.experiment import check
from vlp.checkpoint.storage import open_run_folder
from vlp.config.grid_keys import GridConfig
from vlp.study.grid import parse_grid
from vlp.study.study import regime_bases, run_study
from vlp.study.userdata import check_datasets
from vlp.checkpoint import lock as runlock

# = configs/compare_small_batch.yaml, shipped in the package (vlp/defaults/ links to configs/)
DEFAULT_CONFIG = PACKAGED_DEFAULTS / "compare_small_batch.yaml"


def load_compare_config(path: str | Path, overrides: Sequence[str] = (), quick: bool = False,
                        once: bool = False) -> tuple[dict, GridConfig]:
    """YAML + dotted overrides (grid.* included) → (base vlp config dict, GridConfig), both validated.
    quick: the YAML's top-level `quick:` map of dotted overrides is applied first (a few-minute
    version of the same study); otherwise that section is ignored. once: each key given once in
    `overrides` (vlp.config.parse_overrides: a user's command line)."""
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
    data = apply_overrides(data, list(overrides), once)
    grid = parse_grid(data.pop("grid", None))
    cfg = check(from_dict(copy.deepcopy(data)))  # fail on a bad base config before any run
    if grid.sweep and not grid.optimizers:
        grid.optimizers = [cfg.optim.name]
    check_datasets(grid.datasets)  # your own data sets' local shards exist, before any folder is made
    return data, grid


def run_grid(base: dict, grid: GridConfig, report_only: bool = False, accelerator=None) -> dict:
    """Run every unfinished run of the grid, then write the report (vlp.study.study.run_study);
    returns {"sweep", "final", "best", "price", "tried", "report"}: a plain grid's rows are its final rows."""
    if accelerator is None:  # one Accelerator for the whole grid: every run shares its precision
        from accelerate import Accelerator  # heavy (torch.distributed); only a run needs it

        precision = from_dict(copy.deepcopy(base)).train.precision
        accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision)
    bases = regime_bases(base, grid, accelerator)  # data resolved first: a set that cannot split writes no grid folder
    # one writer per grid folder, as per run folder (a second `vlp compare` is refused in one line)
    lock = None if report_only else runlock.acquire_on_main(
        open_run_folder(grid.out_dir, option="grid.out_dir"), False, accelerator.is_main_process, accelerator.print)
    try:
        return run_study(base, bases, grid, accelerator, report_only)
    finally:
        if lock is not None:
            lock.release()
