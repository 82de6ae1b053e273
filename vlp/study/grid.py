"""The plan's input: the `grid:` section of a compare config, its keys declared in
vlp/config/grid_keys.py (GridConfig: type, default, rule, doc) and read by vlp.config.read_grid; here
the checks that need the registries (losses, eval metrics, packaged data sets) or join keys, and
the shapes of grid.regimes and grid.datasets (`parse_grid`: one ConfigError line per problem).

Pure functions of the YAML: nothing here trains, reads run folders or writes files.
"""

from __future__ import annotations

import re
from typing import Any

from vlp.config import ConfigError, flatten, read_grid
from vlp.config.rules import listed
from vlp.config.grid_keys import GridConfig
from vlp.config.keys import OPTIMIZERS
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
    per_optim = _check_sweep(spec.sweep, "grid.sweep")  # then the study keys, joined
    if per_optim and spec.optimizers and set(spec.optimizers) - set(spec.sweep):
        raise ConfigError(f"config: grid.sweep has no settings for optimizer(s) "
                          f"{sorted(set(spec.optimizers) - set(spec.sweep))}")
    for key in STUDY_KEYS:
        if raw.get(key) and not spec.sweep:
            raise ConfigError(f"config: grid.{key} needs a tuned study (grid.sweep)")
    spec.final_seeds = spec.final_seeds or list(spec.seeds)
    spec.regimes = _parse_regimes(spec.regimes)
    named = list(raw.get("regimes") or {})  # a regime left out (false) may keep its resources
    for name in set(spec.slurm.regimes) - set(named):
        raise ConfigError(f"config: grid.slurm.regimes.{name}: no such regime in grid.regimes "
                          f"({'it has ' + ', '.join(named) if named else 'the grid has none'})")
    spec.datasets = _parse_datasets(spec.datasets, spec)
    _check_groups(spec)
    return spec


def settable(key) -> bool:
    """A dotted run key that a sweep or a regime may set: not one the grid sets, not the optimizer."""
    return key not in SET_BY_GRID and key != "optim.name" and "." in str(key)


def _check_sweep(sweep: dict, where: str) -> bool:
    """A sweep: dotted key -> values, or optimizer -> such a map; True for the latter."""
    per_optim = any(isinstance(v, dict) for v in sweep.values())
    for name, table in sweep.items() if per_optim else [("", sweep)]:
        if per_optim and name not in OPTIMIZERS:
            raise ConfigError(f"config: {where}.{name}: not an optimizer {list(OPTIMIZERS)}")
        at = f"{where}.{name}" if per_optim else where
        if not isinstance(table, dict):
            raise ConfigError(f"config: {at} must map dotted keys to lists of values, got {table!r}")
        for key, values in table.items():
            if not settable(key):
                raise ConfigError(f"config: {at}.{key}: not a sweepable key (set by the grid, or not dotted)")
            if not isinstance(values, list) or not values or len(values) != len(set(map(repr, values))):
                raise ConfigError(f"config: {at}.{key} must be a non-empty list without duplicates, got {values!r}")
    return per_optim


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
            if not settable(key):
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
        batches = sets.get("batch_per_device")
        batches = [batches] if isinstance(batches, int) and not isinstance(batches, bool) else batches
        if batches is not None:  # checked as grid.batch_per_device is (one without brackets: a list of one)
            listed(1).check(f"grid.datasets.{name}.batch_per_device", batches)
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


def _check_groups(spec: GridConfig) -> None:
    """grid.accum_price, grid.seeds_until and grid.sweep_bounds (their own keys read by read_grid)
    against the other keys: b·k a grid batch, max_seeds above the final seeds, swept values in bounds."""
    price, rule = spec.accum_price, spec.seeds_until
    big = price.batch_per_device * price.accum_steps if price else 0
    if price and big not in spec.batch_per_device:
        raise ConfigError(f"config: grid.accum_price: {price.batch_per_device} x {price.accum_steps} = {big} must be "
                          f"one of grid.batch_per_device {spec.batch_per_device}: its accuracy is that arm's")
    if price and price.samples < big:
        raise ConfigError(f"config: grid.accum_price.samples={price.samples} is less than one step of {big}")
    if rule and rule.max_seeds <= len(spec.final_seeds):
        raise ConfigError(f"config: grid.seeds_until.max_seeds={rule.max_seeds} must exceed the "
                          f"{len(spec.final_seeds)} final seed(s) (grid.final_seeds)")
    for key in set(spec.sweep_bounds) & set(SET_BY_GRID):
        raise ConfigError(f"config: grid.sweep_bounds.{key}: set by the grid, not a swept key")
    spec.sweep_bounds = {key: [float(lo), float(hi)] for key, (lo, hi) in spec.sweep_bounds.items()}
    tables = [spec.sweep] + [r["sweep"] for r in spec.regimes.values() if r.get("sweep")]
    for table in tables:
        maps = table.values() if any(isinstance(v, dict) for v in table.values()) else [table]
        for values in maps:
            for key, (lo, hi) in spec.sweep_bounds.items():
                outside = [v for v in values.get(key, []) if not isinstance(v, (int, float)) or not lo <= v <= hi]
                if outside:
                    raise ConfigError(f"config: grid.sweep_bounds.{key}=[{lo:g}, {hi:g}] excludes swept value(s) {outside}")
