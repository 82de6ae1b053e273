"""The plan's input: the `grid:` section of a compare config, its keys declared in
vlp/config/keys.py (GridConfig: type, default, rule, doc) and read by vlp.config.read_grid; here
the checks that need the registries (losses, eval metrics, packaged data sets) or join keys, and
the nested keys' shapes.

    parse_grid(raw)  the grid: mapping -> GridConfig, one ConfigError line per problem

Pure functions of the YAML: nothing here trains, reads run folders or writes files.
"""

from __future__ import annotations

import re
from typing import Any

from vlp.config import ConfigError, read_grid
from vlp.config.rules import listed
from vlp.config.keys import OPTIMIZERS, GridConfig
from vlp.data.sources import PACKAGED
from vlp.eval.keys import EVAL_KEYS
from vlp.losses.registry import NAMES as LOSS_NAMES
from vlp.study.userdata import USER_KEYS, parse_user_dataset
from vlp.locations import is_url

SET_BY_GRID = ("loss.name", "data.batch_per_device", "train.seed", "train.output_dir", "train.resume")
"""Run keys the grid sets: a per-loss override of these would silently break the grid."""
STUDY_KEYS = ("final_seeds", "regimes", "accum_price", "datasets", "sweep_bounds", "seeds_until")
"""Keys of a tuned study only (grid.sweep)."""


def parse_grid(raw: Any) -> GridConfig:
    """Validate the `grid:` mapping; every problem is one ConfigError line naming the key."""
    spec = read_grid(raw)
    for name in spec.losses:
        if name not in LOSS_NAMES:
            raise ConfigError(f"config: grid.losses: unknown loss {name!r} (valid: {', '.join(LOSS_NAMES)})")
    for key in ("metric", "select_metric"):
        if getattr(spec, key) not in EVAL_KEYS:
            raise ConfigError(f"config: grid.{key} must be one of {list(EVAL_KEYS)}, got {getattr(spec, key)!r}")
    flat = {}
    for loss, sets in spec.loss_overrides.items():
        if loss not in spec.losses:
            raise ConfigError(f"config: grid.loss_overrides.{loss}: not one of grid.losses {spec.losses}")
        if not isinstance(sets, dict):
            raise ConfigError(f"config: grid.loss_overrides.{loss} must map dotted keys to values, got {sets!r}")
        flat[loss] = flatten(sets)
        for key in flat[loss]:
            if key in SET_BY_GRID:
                raise ConfigError(f"config: grid.loss_overrides.{loss}.{key}: set by the grid, not per loss")
    spec.loss_overrides = flat
    if spec.sweep and is_url(spec.out_dir):
        raise ConfigError(f"config: grid.out_dir={spec.out_dir}: a tuned study (grid.sweep) writes to a local "
                          "folder only; a plain grid (no grid.sweep) runs in a bucket")
    _parse_study(raw, spec)
    return spec


def _ints(value: Any, key: str, minimum: int) -> list[int]:
    """A nested list of integers (one without brackets: a list of one), checked as grid.seeds is."""
    value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    listed(minimum).check(key, value)
    return value


def _check_sweep_map(table: Any, where: str) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"config: {where} must map dotted keys to lists of values, got {table!r}")
    for key, values in table.items():
        if key in SET_BY_GRID or key == "optim.name" or "." not in str(key):
            raise ConfigError(f"config: {where}.{key}: not a sweepable key (set by the grid, or not dotted)")
        if not isinstance(values, list) or not values or len(values) != len(set(map(repr, values))):
            raise ConfigError(f"config: {where}.{key} must be a non-empty list without duplicates, got {values!r}")


def _check_sweep(sweep: dict, where: str) -> bool:
    """A sweep: dotted key -> values, or optimizer -> such a map; True for the latter."""
    per_optim = any(isinstance(v, dict) for v in sweep.values())
    for name, table in sweep.items() if per_optim else [("", sweep)]:
        if per_optim and name not in OPTIMIZERS:
            raise ConfigError(f"config: {where}.{name}: not an optimizer {list(OPTIMIZERS)}")
        _check_sweep_map(table, f"{where}.{name}" if per_optim else where)
    return per_optim


def _parse_study(raw: dict, spec: GridConfig) -> None:
    """The study keys of grid: (sweep, optimizers, regimes, accum_price, datasets, ...), joined."""
    sweep = spec.sweep
    per_optim = _check_sweep(sweep, "grid.sweep")
    if per_optim and spec.optimizers and set(spec.optimizers) - set(sweep):
        raise ConfigError(f"config: grid.sweep has no settings for optimizer(s) "
                          f"{sorted(set(spec.optimizers) - set(sweep))}")
    for key in STUDY_KEYS:
        if raw.get(key) and not sweep:
            raise ConfigError(f"config: grid.{key} needs a tuned study (grid.sweep)")
    spec.final_seeds = spec.final_seeds or list(spec.seeds)
    spec.regimes = _parse_regimes(spec.regimes)
    spec.accum_price = _parse_price(spec.accum_price, spec)
    spec.datasets = _parse_datasets(spec.datasets, spec)
    spec.seeds_until = _parse_seeds_until(spec.seeds_until, spec)
    spec.sweep_bounds = _parse_bounds(spec.sweep_bounds)
    _check_in_bounds(spec)


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
            if key in SET_BY_GRID or key == "optim.name" or "." not in key:
                raise ConfigError(f"config: grid.regimes.{name}.{key}: set by the grid, or not a dotted key")
        if sweep is not None:
            where = f"grid.regimes.{name}.sweep"
            if not isinstance(sweep, dict) or not sweep:
                raise ConfigError(f"config: {where} must be a non-empty mapping, got {sweep!r}")
            _check_sweep(sweep, where)
        out[name] = {"set": sets, "sweep": sweep}
    if not out:
        raise ConfigError("config: grid.regimes leaves every regime out")
    return out


def _parse_price(raw: Any, spec: GridConfig) -> dict[str, Any]:
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
    seeds = _ints(raw["seeds"], "grid.accum_price.seeds", 0) if raw.get("seeds") is not None else [0]
    return {"batch_per_device": b, "accum_steps": k, "samples": raw["samples"], "seeds": seeds}


def _parse_datasets(raw: Any, spec: GridConfig) -> dict[str, dict]:
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
        batches = (_ints(sets["batch_per_device"], f"grid.datasets.{name}.batch_per_device", 1)
                   if sets.get("batch_per_device") is not None else None)
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


def _parse_seeds_until(raw: Any, spec: GridConfig) -> dict[str, Any]:
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
        if not ok or "." not in str(key) or key in SET_BY_GRID:
            raise ConfigError(f"config: grid.sweep_bounds.{key} must be [low, high] with 0 < low < high on a dotted "
                              f"swept key, got {pair!r}")
    return {key: [float(lo), float(hi)] for key, (lo, hi) in raw.items()}


def _check_in_bounds(spec: GridConfig) -> None:
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
