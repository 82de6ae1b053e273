"""The plan: which runs a grid or a study is made of, as pure functions of the GridSpec.

    plain grid   expand_grid(grid): loss × per-GPU batch × seed (RunSpec)
    tuned study  arm = (regime, loss, optimizer, per-GPU batch)
                 sweep_runs(grid):        every arm × its regime's settings × sweep seed
                 select_best(rows, m):    per arm, the setting with the best mean val metric
                 final_runs(grid, best):  the selected setting of every arm × final seed
                 price_runs(grid, best):  the accumulated batch b·k as k micro-batches of b (timed)
                 edge_selections(best):   arms selected at an edge of a swept range

Nothing here trains, reads run folders or writes files (vlp.study.runs and vlp.study.executor
run the plan; vlp.study.report reports it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from vlp.study.grid import GridSpec

REFERENCE_LOSS = "infonce"
"""The loss every other loss is compared with, paired by seed, at the same regime, optimizer and batch."""
SPLITS = ("val", "test")
"""A study selects on val and reports on test."""


def steps_for(samples: int, batch_per_device: int, world: int = 1, accum: int = 1) -> int:
    """Optimizer steps for a sample budget: samples // global batch (the Trainer's rule)."""
    return samples // (batch_per_device * world * accum)


# ---------------------------------------------------------------------------- plain grid
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


# ---------------------------------------------------------------------------- tuned study
@dataclass(frozen=True)
class StudyRun:
    """One training of the study (the attributes vlp.study.runs.run_config reads)."""

    loss: str
    optim: str
    batch_per_device: int
    setting: tuple[tuple[str, Any], ...]
    seed: int
    loss_overrides: tuple[tuple[str, Any], ...] = ()
    regime: str = ""
    """grid.regimes name ('' without regimes): its settings are in the run's base config."""
    accum: int = 1
    """> 1: a price run (grid.accum_price): contrastive accumulation, timed, not evaluated."""
    samples: Optional[int] = None
    """A price run's train.samples (None: the study's budget)."""

    @property
    def arm(self) -> tuple[str, str, str, int]:
        return self.regime, self.loss, self.optim, self.batch_per_device

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        extra = () if self.accum == 1 else (("train.accum_steps", self.accum), ("train.samples", self.samples))
        return (*self.loss_overrides, ("optim.name", self.optim), *self.setting, *extra)

    @property
    def name(self) -> str:
        batch = f"b{self.batch_per_device}" + (f"x{self.accum}" if self.accum > 1 else "")
        head = f"{self.regime}_" if self.regime else ""
        return f"{head}{self.loss}_{self.optim}_{batch}_{setting_tag(self.setting)}_s{self.seed}"


def setting_tag(setting: tuple[tuple[str, Any], ...]) -> str:
    """(('optim.lr', 0.001), ('loss.tau', 0.07)) -> 'lr0.001-tau0.07' (folder-name safe)."""
    if not setting:
        return "base"
    parts = []
    for key, value in setting:
        text = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{key.split('.')[-1]}{text}".replace("/", "_"))
    return "-".join(parts)


def settings_for(sweep: dict, optim: str) -> list[tuple[tuple[str, Any], ...]]:
    """The cartesian product of the sweep's values for one optimizer: ``sweep`` maps dotted keys
    to value lists, or optimizer names to such maps."""
    table = sweep.get(optim, {}) if any(isinstance(v, dict) for v in sweep.values()) else sweep
    keys = list(table)
    return [tuple(zip(keys, values)) for values in itertools.product(*(table[k] for k in keys))]


def regimes_of(grid) -> list[str]:
    """The regime names ([''] without grid.regimes)."""
    return list(grid.regimes) or [""]


def sweep_of(grid, regime: str) -> dict:
    """The sweep of a regime: its own `sweep:` if it has one, else grid.sweep."""
    own = (grid.regimes.get(regime) or {}).get("sweep") if regime else None
    return own or grid.sweep


def _overrides(grid, loss: str) -> tuple:
    return tuple(sorted(grid.loss_overrides.get(loss, {}).items()))


def sweep_runs(grid) -> list[StudyRun]:
    """Every arm × setting × sweep seed, seed-major (one full sweep first)."""
    return [StudyRun(loss, optim, batch, setting, seed, _overrides(grid, loss), regime)
            for seed in grid.seeds for regime in regimes_of(grid) for batch in grid.batch_per_device
            for optim in grid.optimizers for loss in grid.losses
            for setting in settings_for(sweep_of(grid, regime), optim)]


def final_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """The selected setting of every arm with each final seed."""
    return [StudyRun(loss, optim, batch, best[(regime, loss, optim, batch)], seed, _overrides(grid, loss), regime)
            for seed in grid.final_seeds for regime in regimes_of(grid) for batch in grid.batch_per_device
            for optim in grid.optimizers for loss in grid.losses if (regime, loss, optim, batch) in best]


def price_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """grid.accum_price: per regime × optimizer × loss, the contrastive batch b·k as k
    micro-batches of b (train.accum_steps), with the setting selected for the b·k arm (whose
    gradient it is, exactly): timed and its peak memory measured, not evaluated."""
    price = grid.accum_price
    if not price:
        return []
    b, k = price["batch_per_device"], price["accum_steps"]
    return [StudyRun(loss, optim, b, best[(regime, loss, optim, b * k)], seed, _overrides(grid, loss), regime,
                     accum=k, samples=price["samples"])
            for seed in price.get("seeds", [0]) for regime in regimes_of(grid) for optim in grid.optimizers
            for loss in grid.losses if (regime, loss, optim, b * k) in best]


def select_best(rows: list[dict], metric: str) -> dict[tuple, tuple]:
    """Per arm, the setting with the highest mean val ``metric`` over its ok runs (ties: the
    setting listed first). rows: study rows with 'arm', 'setting', 'status', f'val/{metric}'."""
    means: dict[tuple, dict[tuple, list[float]]] = {}
    for row in rows:
        if row["status"] == "ok" and row.get(f"val/{metric}") is not None:
            means.setdefault(row["arm"], {}).setdefault(row["setting"], []).append(row[f"val/{metric}"])
    best = {}
    for arm, by_setting in means.items():
        scored = [(sum(v) / len(v), -i, s) for i, (s, v) in enumerate(by_setting.items())]
        best[arm] = max(scored)[2]
    return best



def arm_label(arm: tuple) -> str:
    """(regime, loss, optimizer, batch) -> 'regime/loss/optimizer/b<batch>', empty parts left out
    (a plain grid's arm is ('', loss, '', batch): 'loss/b<batch>')."""
    regime, loss, optim, batch = arm
    return "/".join(part for part in (regime, loss, optim) if part) + f"/b{batch}"


def edge_selections(best: dict, grid) -> list[str]:
    """Arms whose selected setting is the first or last value of a swept key with >= 3 values:
    the optimum may lie outside the sweep (widen it)."""
    notes = []
    for arm, setting in best.items():
        table = settings_for(sweep_of(grid, arm[0]), arm[2])
        keys = {k: sorted({dict(s)[k] for s in table}) for k, _ in (table[0] if table else ())}
        for key, value in setting:
            values = keys.get(key, [])
            if len(values) >= 3 and value in (values[0], values[-1]):
                notes.append(f"{arm_label(arm)}: {key}={value:g}" if isinstance(value, float)
                             else f"{arm_label(arm)}: {key}={value}")
    return notes

