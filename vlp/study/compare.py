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
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from vlp.eval import keys
from vlp.eval.keys import EVAL_KEYS, RECALL_KS
from vlp.config import (PACKAGED_DEFAULTS, Config, ConfigError, LossConfig, apply_overrides, from_dict, load_yaml,
                        set_dotted)
from vlp.storage import RunFolder, is_url, open_run_folder
from vlp.train import runlock
from vlp.study.report import DIAG_KEYS, aggregate, markdown_table, read_log, write_report
from vlp.study.runs import (HARMLESS_KEYS, _flatten, broadcast, embedded_shards, plan_runs, run_config, run_one,  # noqa: F401
                            stale_key, steps_for)

# = configs/compare_small_batch.yaml, shipped in the package (vlp/defaults/ links to configs/)
DEFAULT_CONFIG = PACKAGED_DEFAULTS / "compare_small_batch.yaml"
LOSS_NAMES = typing.get_args(typing.get_type_hints(LossConfig)["name"])
# Grid-controlled keys: a per-loss override of these would silently break the grid.
GRID_KEYS = ("loss.name", "data.batch_per_device", "train.seed", "train.output_dir", "train.resume")


# ---------------------------------------------------------------------------- grid spec
@dataclass
class GridSpec:
    """The `grid:` section of a compare config (popped before the rest becomes a vlp Config)."""

    losses: list[str]
    """Losses to compare (loss.name values)."""
    batch_per_device: list[int]
    """Per-GPU batch sizes to sweep (data.batch_per_device values)."""
    seeds: list[int]
    """Seeds (train.seed): model init and data order; the same order for every loss and batch."""
    out_dir: str = "runs/compare"
    """Results folder: one subfolder per run plus runs.csv, results.md and the plots."""
    loss_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-loss dotted overrides, e.g. {flatnce: {loss.temperature: split}}."""
    warmup_samples: Optional[int] = None
    """If set, optim.warmup_steps = warmup_samples // global batch (equal warmup in samples)."""
    log_every_samples: Optional[int] = None
    """If set, train.log_every = max(1, log_every_samples // global batch) (aligned curves)."""
    keep_checkpoints: bool = True
    """False: delete a run's checkpoints/ once it succeeded (open_clip_model.pt is kept)."""
    keep_models: bool = True
    """Study: False: runs write no final checkpoint and no open_clip_model.pt (train.save_final);
    the study ranks each trained model in memory, and its eval_items.json and log are kept."""
    retries: int = 1
    """Extra attempts for a run that raises, before it is recorded as failed."""
    metric: str = "mean_R@1"
    """Eval metric of metric_vs_batch.png (one of EVAL_KEYS); a study's verdict and final plot."""
    sweep: dict[str, Any] = field(default_factory=dict)
    """Non-empty: a tuned study (vlp/study/study.py). Dotted key -> values, the same for every
    arm, e.g. {optim.lr: [3e-4, 1e-3]}; or optimizer name -> such a map (per-optimizer ranges)."""
    optimizers: list[str] = field(default_factory=list)
    """Study: optim.name values, an axis of the arms (default: the base config's optim.name)."""
    final_seeds: list[int] = field(default_factory=list)
    """Study: seeds of the final runs of each arm's selected setting (default: seeds)."""
    select_metric: str = "mean_R@10"
    """Study: the val metric (mean over grid.seeds) that selects each arm's setting."""
    test_shards: Optional[str] = None
    """Study on your own shards: the test set (data.eval_shards is the val set). OpenMoji: unset."""
    regimes: dict[str, dict] = field(default_factory=dict)
    """Study: named regimes, an axis of the arms: {name: {dotted key: value, ..., sweep: {...}?}}
    (e.g. scratch: {} and lit: {model.name: vlp-lit-lite0, model.lock_image: true, ...}); a
    regime's own `sweep` replaces grid.sweep for it; a regime set to false is left out
    (grid.regimes.scratch=false). Parsed to {name: {"set": {...}, "sweep": ...}}."""
    accum_price: dict[str, Any] = field(default_factory=dict)
    """Study: {batch_per_device: b, accum_steps: k, samples: n}: per regime × loss, a timed run
    of the b·k contrastive batch as k micro-batches of b (b·k must be a grid batch; its gradient
    is that arm's, so its accuracy is that arm's): samples/s and peak memory beside batch b."""
    workers: int = 1
    """Study on one process: run this many runs at once in worker processes (2 on a 2-core CPU
    with OMP_NUM_THREADS=1). Results do not depend on it; samples/s share the cores."""


def _int_list(raw: dict, key: str, minimum: Optional[int]) -> list[int]:
    value = raw.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ConfigError(f"config: grid.{key} must be a non-empty list of integers, got {value!r}")
    if minimum is not None and min(value) < minimum:
        raise ConfigError(f"config: grid.{key} values must be >= {minimum}, got {value}")
    if len(set(value)) != len(value):
        raise ConfigError(f"config: grid.{key} has duplicates: {value}")
    return value


def parse_grid(raw: Any) -> GridSpec:
    """Validate the `grid:` mapping; every problem is one ConfigError line naming the key."""
    if not isinstance(raw, dict):
        raise ConfigError("config: compare needs a 'grid:' section with losses, batch_per_device and seeds")
    known = set(GridSpec.__dataclass_fields__)
    for key in raw:
        if key not in known:
            raise ConfigError(f"config: unknown key 'grid.{key}' (valid: {', '.join(sorted(known))})")
    losses = raw.get("losses")
    if isinstance(losses, str):
        losses = [losses]
    if not isinstance(losses, list) or not losses:
        raise ConfigError(f"config: grid.losses must be a non-empty list, got {losses!r}")
    for name in losses:
        if name not in LOSS_NAMES:
            raise ConfigError(f"config: grid.losses: unknown loss {name!r} (valid: {', '.join(LOSS_NAMES)})")
    if len(set(losses)) != len(losses):
        raise ConfigError(f"config: grid.losses has duplicates: {losses}")
    overrides = raw.get("loss_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"config: grid.loss_overrides must map a loss to overrides, got {overrides!r}")
    flat = {}
    for loss, sets in overrides.items():
        if loss not in losses:
            raise ConfigError(f"config: grid.loss_overrides.{loss}: not one of grid.losses {losses}")
        if not isinstance(sets, dict):
            raise ConfigError(f"config: grid.loss_overrides.{loss} must map dotted keys to values, got {sets!r}")
        flat[loss] = _flatten(sets)
        for key in flat[loss]:
            if key in GRID_KEYS:
                raise ConfigError(f"config: grid.loss_overrides.{loss}.{key}: set by the grid, not per loss")
    spec = GridSpec(
        losses=list(losses),
        batch_per_device=_int_list(raw, "batch_per_device", 1),
        seeds=_int_list(raw, "seeds", 0),
        loss_overrides=flat,
        **{k: raw[k] for k in ("out_dir", "warmup_samples", "log_every_samples", "keep_checkpoints",
                               "retries", "metric", "select_metric", "test_shards", "workers", "keep_models")
           if k in raw},
    )
    _parse_study(raw, spec)
    if not isinstance(spec.out_dir, str) or not spec.out_dir:
        raise ConfigError(f"config: grid.out_dir must be a folder path, got {spec.out_dir!r}")
    if spec.sweep and is_url(spec.out_dir):
        raise ConfigError(f"config: grid.out_dir={spec.out_dir}: a tuned study (grid.sweep) writes to a local "
                          "folder only; a plain grid (no grid.sweep) runs in a bucket")
    if not isinstance(spec.workers, int) or isinstance(spec.workers, bool) or not 1 <= spec.workers <= 64:
        raise ConfigError(f"config: grid.workers must be an integer in 1..64, got {spec.workers!r}")
    for key in ("warmup_samples", "log_every_samples", "retries"):
        value = getattr(spec, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"config: grid.{key} must be an integer >= 0, got {value!r}")
    for key in ("keep_checkpoints", "keep_models"):
        if not isinstance(getattr(spec, key), bool):
            raise ConfigError(f"config: grid.{key} must be true or false, got {getattr(spec, key)!r}")
    if spec.metric not in EVAL_KEYS:
        raise ConfigError(f"config: grid.metric must be one of {list(EVAL_KEYS)}, got {spec.metric!r}")
    return spec


OPTIMIZERS = ("adamw", "lars", "sgd")


def _check_sweep_map(table: Any, where: str) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"config: {where} must map dotted keys to lists of values, got {table!r}")
    for key, values in table.items():
        if key in GRID_KEYS or key == "optim.name" or "." not in str(key):
            raise ConfigError(f"config: {where}.{key}: not a sweepable key (set by the grid, or not dotted)")
        if not isinstance(values, list) or not values or len(values) != len(set(map(repr, values))):
            raise ConfigError(f"config: {where}.{key} must be a non-empty list without duplicates, got {values!r}")


def _parse_study(raw: dict, spec: GridSpec) -> None:
    """The study fields of grid: (sweep, optimizers, final_seeds, select_metric, test_shards)."""
    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, dict):
        raise ConfigError(f"config: grid.sweep must be a mapping, got {sweep!r}")
    per_optim = any(isinstance(v, dict) for v in sweep.values())
    if per_optim:
        for name, table in sweep.items():
            if name not in OPTIMIZERS:
                raise ConfigError(f"config: grid.sweep.{name}: not an optimizer {list(OPTIMIZERS)}")
            _check_sweep_map(table, f"grid.sweep.{name}")
    elif sweep:
        _check_sweep_map(sweep, "grid.sweep")
    spec.sweep = sweep
    optimizers = raw.get("optimizers") or []
    if isinstance(optimizers, str):
        optimizers = [optimizers]
    if not isinstance(optimizers, list) or any(o not in OPTIMIZERS for o in optimizers) \
            or len(set(optimizers)) != len(optimizers):
        raise ConfigError(f"config: grid.optimizers must be distinct names from {list(OPTIMIZERS)}, got {optimizers!r}")
    spec.optimizers = list(optimizers)
    if per_optim and spec.optimizers and set(spec.optimizers) - set(sweep):
        raise ConfigError(f"config: grid.sweep has no settings for optimizer(s) "
                          f"{sorted(set(spec.optimizers) - set(sweep))}")
    spec.final_seeds = _int_list(raw, "final_seeds", 0) if raw.get("final_seeds") is not None else list(spec.seeds)
    if spec.select_metric not in EVAL_KEYS:
        raise ConfigError(f"config: grid.select_metric must be one of {list(EVAL_KEYS)}, got {spec.select_metric!r}")
    if spec.test_shards is not None and (not isinstance(spec.test_shards, str) or not spec.test_shards):
        raise ConfigError(f"config: grid.test_shards must be a shard spec, got {spec.test_shards!r}")
    spec.regimes = _parse_regimes(raw.get("regimes"), bool(sweep))
    spec.accum_price = _parse_price(raw.get("accum_price"), spec, bool(sweep))


def _parse_regimes(raw: Any, study: bool) -> dict[str, dict]:
    """grid.regimes -> {name: {"set": {dotted: value}, "sweep": per-optimizer or flat map or None}}."""
    if not raw:
        return {}
    if not study:
        raise ConfigError("config: grid.regimes needs a tuned study (grid.sweep)")
    if not isinstance(raw, dict):
        raise ConfigError(f"config: grid.regimes must map names to settings, got {raw!r}")
    out = {}
    for name, table in raw.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise ConfigError(f"config: grid.regimes: name {name!r} must be lowercase letters, digits and '-'")
        if table is False:  # grid.regimes.scratch=false: this regime is left out of the study
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"config: grid.regimes.{name} must map dotted keys to values ({{}}: none), or be "
                              f"false to leave it out, got {table!r}")
        table = dict(table)
        sweep = table.pop("sweep", None)
        sets = _flatten(table)
        for key in sets:
            if key in GRID_KEYS or key == "optim.name" or "." not in key:
                raise ConfigError(f"config: grid.regimes.{name}.{key}: set by the grid, or not a dotted key")
        if sweep is not None:
            where = f"grid.regimes.{name}.sweep"
            if not isinstance(sweep, dict) or not sweep:
                raise ConfigError(f"config: {where} must be a non-empty mapping, got {sweep!r}")
            if any(isinstance(v, dict) for v in sweep.values()):
                for optim, values in sweep.items():
                    if optim not in OPTIMIZERS:
                        raise ConfigError(f"config: {where}.{optim}: not an optimizer {list(OPTIMIZERS)}")
                    _check_sweep_map(values, f"{where}.{optim}")
            else:
                _check_sweep_map(sweep, where)
        out[name] = {"set": sets, "sweep": sweep}
    if not out:
        raise ConfigError("config: grid.regimes leaves every regime out")
    return out


def _parse_price(raw: Any, spec: GridSpec, study: bool) -> dict[str, Any]:
    """grid.accum_price -> {batch_per_device, accum_steps, samples, seeds}, checked against the grid."""
    if not raw:
        return {}
    if not study:
        raise ConfigError("config: grid.accum_price needs a tuned study (grid.sweep)")
    known = {"batch_per_device", "accum_steps", "samples", "seeds"}
    if not isinstance(raw, dict) or set(raw) - known or not {"batch_per_device", "accum_steps", "samples"} <= set(raw):
        raise ConfigError(f"config: grid.accum_price must give batch_per_device, accum_steps, samples (and "
                          f"optionally seeds), got {raw!r}")
    for key in ("batch_per_device", "accum_steps", "samples"):
        if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise ConfigError(f"config: grid.accum_price.{key} must be a positive integer, got {raw[key]!r}")
    b, k = raw["batch_per_device"], raw["accum_steps"]
    if k < 2 or b * k not in spec.batch_per_device:
        raise ConfigError(f"config: grid.accum_price: {b} x {k} = {b * k} must be one of grid.batch_per_device "
                          f"{spec.batch_per_device} (accum_steps >= 2): its accuracy is that arm's")
    if raw["samples"] < b * k:
        raise ConfigError(f"config: grid.accum_price.samples={raw['samples']} is less than one step of {b * k}")
    seeds = _int_list({"accum_price.seeds": raw["seeds"]}, "accum_price.seeds", 0) if raw.get("seeds") is not None else [0]
    return {"batch_per_device": b, "accum_steps": k, "samples": raw["samples"], "seeds": seeds}


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
    cfg = from_dict(copy.deepcopy(data)).validate()  # fail on a bad base config before any run
    if grid.sweep and not grid.optimizers:
        grid.optimizers = [cfg.optim.name]
    return data, grid


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunSpec:
    loss: str
    batch_per_device: int
    seed: int
    overrides: tuple[tuple[str, Any], ...] = ()
    """Per-loss dotted overrides, applied after the base config."""

    @property
    def name(self) -> str:
        return f"{self.loss}_b{self.batch_per_device}_s{self.seed}"


def expand_grid(grid: GridSpec) -> list[RunSpec]:
    """All runs, seed-major: after the first seed the table already has every loss × batch cell."""
    return [
        RunSpec(loss, batch, seed, tuple(sorted(grid.loss_overrides.get(loss, {}).items())))
        for seed in grid.seeds for batch in grid.batch_per_device for loss in grid.losses
    ]


def resolve_data(base: dict, acc) -> dict:
    """data.train_shards '' or 'openmoji': the embedded OpenMoji shards (train + held-out eval)."""
    from vlp.data.embedded import SHARD_CACHE

    specs = embedded_shards(base, acc, ("train", "eval"), SHARD_CACHE)
    if specs is not None:
        base["data"]["train_shards"] = specs["train"]
        if not base["data"].get("eval_shards"):
            base["data"]["eval_shards"] = specs["eval"]
    return base


def _train_once(cfg: Config, accelerator) -> dict:
    from vlp.train.loop import Trainer

    try:
        return Trainer(cfg, accelerator=accelerator).train()
    finally:
        accelerator.free_memory()  # drop the prepared model/optimizer before the next run


def run_grid(base: dict, grid: GridSpec, report_only: bool = False, accelerator=None) -> list[dict]:
    """Run every unfinished run of the grid, then write the report; returns the runs.csv rows."""
    if accelerator is None:  # one Accelerator for the whole grid: every run shares its precision
        from accelerate import Accelerator

        precision = from_dict(copy.deepcopy(base)).train.precision
        accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision)
    # one writer per grid folder, as per run folder (a second `vlp compare` is refused in one line)
    lock = None if report_only else runlock.acquire_on_main(
        open_run_folder(grid.out_dir, option="grid.out_dir"), False, accelerator.is_main_process, accelerator.print)
    try:
        return _run_grid(base, grid, report_only, accelerator)
    finally:
        if lock is not None:
            lock.release()


def _run_grid(base: dict, grid: GridSpec, report_only: bool, accelerator) -> list[dict]:
    acc = accelerator
    if grid.sweep:  # a tuned study: sweep on val, seeds on test (vlp/study/study.py)
        from vlp.study.study import run_study

        return run_study(base, grid, acc, report_only)
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
    for i, (run, finished) in enumerate(zip(runs, done)):
        if finished or report_only:
            continue
        acc.print(f"[compare] run {i + 1}/{len(runs)}: {run.name}")
        rec = run_one(run, cfgs[run.name], acc, _train_once, grid.retries, grid.keep_checkpoints)
        acc.print(f"[compare] {run.name}: {rec['status']} in {rec['wall_time_s']:.0f} s")
        if acc.is_main_process:  # partial results are always on disk
            _write_report(out, collect_rows(runs, cfgs, acc.num_processes), grid, len(runs))
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


# ---------------------------------------------------------------------------- rows
def run_row(run: RunSpec, cfg: Config, world: int = 1) -> Optional[dict]:
    """The runs.csv row of a finished or failed run (None while it has not been attempted)."""
    folder = RunFolder(cfg.train.output_dir)  # a local folder or a bucket
    result, record = _read_json(folder, "result.json"), _read_json(folder, "compare.json") or {}
    if result is None and not record:
        return None
    log = read_log(folder.download("log.jsonl")) if folder.exists("log.jsonl") else []
    folder.close()
    last = log[-1] if log else {}
    row = {
        "run": run.name, "loss": run.loss, "temperature": cfg.loss.temperature,
        "batch_per_device": run.batch_per_device,
        "global_batch": (result or {}).get("global_batch", run.batch_per_device * world * cfg.train.accum_steps),
        "seed": run.seed,
        "steps": (result or last).get("step", 0), "samples_seen": (result or last).get("samples_seen", 0),
        "wall_time_s": record.get("wall_time_s", (result or {}).get("train_time_s")),
        "status": "ok" if result is not None else record.get("status", "failed"),
        "error": "" if result is not None else record.get("error", ""),
    }
    for k in RECALL_KS:
        both = [(result or {}).get(keys.eval_key(keys.recall(d, k))) for d in keys.DIRECTIONS]
        row.update({keys.recall(d, k): v for d, v in zip(keys.DIRECTIONS, both)})
        row[keys.mean_recall(k)] = None if None in both else sum(both) / 2
    row[keys.CHANCE_R1] = (result or {}).get(keys.eval_key(keys.CHANCE_R1))
    row.update({k: last.get(k) for k in DIAG_KEYS})
    return row


def _read_json(folder: RunFolder, name: str) -> Optional[dict]:
    try:
        return json.loads(folder.read_text(name))
    except FileNotFoundError:
        return None


def collect_rows(runs: list[RunSpec], cfgs: dict[str, Config], world: int = 1) -> list[dict]:
    return [row for run in runs if (row := run_row(run, cfgs[run.name], world)) is not None]
