"""The plan's input: the `grid:` section of a compare config (GridSpec), validated key by key.

    parse_grid(raw)  the grid: mapping -> GridSpec, one ConfigError line per problem

Pure functions of the YAML: nothing here trains, reads run folders or writes files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from vlp.config import ConfigError
from vlp.data.sources import PACKAGED
from vlp.eval.keys import EVAL_KEYS
from vlp.losses.registry import NAMES as LOSS_NAMES
from vlp.study.userdata import USER_KEYS, parse_user_dataset
from vlp.util import is_url

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
    datasets: dict[str, dict] = field(default_factory=dict)
    """Study: the data sets, an axis of the map ({}: the data config as given). A list of packaged
    names, or {name: {batch_per_device: [...], regimes: [...]}} to run a data set on a subset of
    the grid's batches or regimes. A packaged set replaces the name in data.train_shards
    ('openmoji:128' -> 'openclipart:128'); any other name is your own data (vlp.study.userdata):
    {train: spec, val: spec, test: spec} or {shards: spec} split by caption hash. Parsed to {name:
    {"batch_per_device": list or None, "regimes": list or None}}, your own data set's with
    "shards": {fit, val, test} or None and "source": spec or None besides."""
    seeds_until: dict[str, Any] = field(default_factory=dict)
    """Study: seeds where the answer is open, {half_width: points, max_seeds: n, step: k}: after
    the final seeds, every paired Δ (grid.metric) whose interval still contains 0 and is wider
    than ± half_width points gets k more seeds, up to max_seeds; every interval and p-value of the
    study is then corrected for the planned looks (vlp.study.stats.look_level). {}: none."""
    sweep_bounds: dict[str, list] = field(default_factory=dict)
    """Study: {dotted key: [low, high]} (e.g. {optim.lr: [1e-4, 0.1]}): an arm selected at an edge
    of its values of that key gets one more value beyond the edge (x3 or /3) until its selection is
    interior or the next value would cross the bound (the report names it). {}: no extension."""
    budget_points: int = 1
    """Study: rank val and test at this many evenly spaced points of the budget (4: every quarter;
    the steps of every run must divide by it); the report gives the verdict at the end and at each
    arm's val-best point."""


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
        flat[loss] = flatten(sets)
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
    for key in ("final_seeds", "regimes", "accum_price", "datasets", "sweep_bounds", "seeds_until"):
        if raw.get(key) and not sweep:
            raise ConfigError(f"config: grid.{key} needs a tuned study (grid.sweep)")
    spec.regimes = _parse_regimes(raw.get("regimes"))
    spec.accum_price = _parse_price(raw.get("accum_price"), spec)
    spec.datasets = _parse_datasets(raw.get("datasets"), spec)
    spec.seeds_until = _parse_seeds_until(raw.get("seeds_until"), spec)
    spec.sweep_bounds = _parse_bounds(raw.get("sweep_bounds"))
    _check_in_bounds(spec)
    points = raw.get("budget_points", 1)
    if not isinstance(points, int) or isinstance(points, bool) or not 1 <= points <= 64:
        raise ConfigError(f"config: grid.budget_points must be an integer in 1..64, got {points!r}")
    spec.budget_points = points


def _parse_regimes(raw: Any) -> dict[str, dict]:
    """grid.regimes -> {name: {"set": {dotted: value}, "sweep": per-optimizer or flat map or None}}."""
    if not raw:
        return {}
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
        sets = flatten(table)
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


def _parse_price(raw: Any, spec: GridSpec) -> dict[str, Any]:
    """grid.accum_price -> {batch_per_device, accum_steps, samples, seeds}, checked against the grid."""
    if not raw:
        return {}
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


def _parse_datasets(raw: Any, spec: GridSpec) -> dict[str, dict]:
    """grid.datasets (a list of packaged data set names, or {name: {batch_per_device, regimes} and,
    for your own data, train / val / test or shards}) -> {name: {"batch_per_device": subset or
    None, "regimes": subset or None}, and for your own data "shards" and "source"} (vlp.study.userdata)."""
    if not raw:
        return {}
    table = {name: {} for name in raw} if isinstance(raw, list) else raw
    if not isinstance(table, dict) or len(table) != (len(raw) if isinstance(raw, list) else len(table)):
        raise ConfigError(f"config: grid.datasets must be a list of distinct names or a mapping, got {raw!r}")
    out = {}
    for name, sets in table.items():
        sets = sets or {}
        user = {}
        if name not in PACKAGED:
            if not isinstance(sets, dict):
                raise ConfigError(f"config: grid.datasets.{name} must map train / val / test (or shards) to shard "
                                  f"specs, got {sets!r}")
            user = parse_user_dataset(name, sets)
            sets = {k: v for k, v in sets.items() if k not in USER_KEYS}
        if not isinstance(sets, dict) or set(sets) - {"batch_per_device", "regimes"}:
            where = "and regimes only" if name in PACKAGED else "and regimes besides its shards"
            raise ConfigError(f"config: grid.datasets.{name} may set batch_per_device {where}, got {sets!r}")
        batches = _int_list(sets, "batch_per_device", 1) if sets.get("batch_per_device") is not None else None
        if batches and set(batches) - set(spec.batch_per_device):
            raise ConfigError(f"config: grid.datasets.{name}.batch_per_device {batches} must be a subset of "
                              f"grid.batch_per_device {spec.batch_per_device}")
        regimes = sets.get("regimes")
        if regimes is not None and (not isinstance(regimes, list) or not regimes
                                    or set(regimes) - set(spec.regimes)):
            raise ConfigError(f"config: grid.datasets.{name}.regimes must be a non-empty subset of grid.regimes "
                              f"{list(spec.regimes)}, got {regimes!r}")
        out[name] = {"batch_per_device": batches, "regimes": regimes, **user}
    return out


def _parse_seeds_until(raw: Any, spec: GridSpec) -> dict[str, Any]:
    """grid.seeds_until -> {half_width: points > 0, max_seeds: > len(final_seeds), step: >= 1}."""
    if not raw:
        return {}
    if not isinstance(raw, dict) or set(raw) != {"half_width", "max_seeds", "step"}:
        raise ConfigError(f"config: grid.seeds_until must give half_width (points), max_seeds and step, got {raw!r}")
    width, most, step = raw["half_width"], raw["max_seeds"], raw["step"]
    if not isinstance(width, (int, float)) or isinstance(width, bool) or not width > 0:
        raise ConfigError(f"config: grid.seeds_until.half_width must be a number of points > 0, got {width!r}")
    for key, value in (("max_seeds", most), ("step", step)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"config: grid.seeds_until.{key} must be a positive integer, got {value!r}")
    if most <= len(spec.final_seeds):
        raise ConfigError(f"config: grid.seeds_until.max_seeds={most} must exceed the {len(spec.final_seeds)} final "
                          "seed(s) (grid.final_seeds)")
    return {"half_width": float(width), "max_seeds": most, "step": step}


def _parse_bounds(raw: Any) -> dict[str, list]:
    """grid.sweep_bounds -> {dotted key: [low, high]}, 0 < low < high."""
    if not raw:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: grid.sweep_bounds must map a swept key to [low, high], got {raw!r}")
    for key, pair in raw.items():
        ok = (isinstance(pair, list) and len(pair) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair) and 0 < pair[0] < pair[1])
        if not ok or "." not in str(key) or key in GRID_KEYS:
            raise ConfigError(f"config: grid.sweep_bounds.{key} must be [low, high] with 0 < low < high on a dotted "
                              f"swept key, got {pair!r}")
    return {key: [float(lo), float(hi)] for key, (lo, hi) in raw.items()}


def _check_in_bounds(spec: GridSpec) -> None:
    """Every swept value of a bounded key lies inside its grid.sweep_bounds."""
    tables = [spec.sweep] + [r["sweep"] for r in spec.regimes.values() if r.get("sweep")]
    for table in tables:
        maps = table.values() if any(isinstance(v, dict) for v in table.values()) else [table]
        for values in maps:
            for key, (lo, hi) in spec.sweep_bounds.items():
                outside = [v for v in values.get(key, []) if not isinstance(v, (int, float)) or not lo <= v <= hi]
                if outside:
                    raise ConfigError(f"config: grid.sweep_bounds.{key}=[{lo:g}, {hi:g}] excludes swept value(s) {outside}")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{a: {b: 1}, 'c.d': 2} -> {'a.b': 1, 'c.d': 2} (overrides may come nested from the CLI)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
