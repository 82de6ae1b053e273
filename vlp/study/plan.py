"""The plan: which runs a grid or a study is made of, as pure functions of the GridSpec.

    plain grid   expand_grid(grid): loss × per-GPU batch × seed (RunSpec)
    tuned study  arm = (regime, loss, optimizer, per-GPU batch)
                 sweep_runs(grid):        every arm × its regime's settings × sweep seed
                 select_best(rows, m):    per arm, the setting with the best mean val metric
                 final_runs(grid, best):  the selected setting of every arm × final seed
                 price_runs(grid, best):  the accumulated batch b·k as k micro-batches of b (timed)
    the axes     cells_of(grid):          (data set, regime, batch) of every cell (grid.datasets may
                                          run a data set on fewer batches or regimes)
Edge extension of the sweep (grid.sweep_bounds) is vlp.study.tuning's.

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
    dataset: str = ""
    """grid.datasets name ('' without datasets): it replaces the data set in the run's base config."""

    @property
    def arm(self) -> tuple[str, str, str, str, int]:
        return self.dataset, self.regime, self.loss, self.optim, self.batch_per_device

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        extra = () if self.accum == 1 else (("train.accum_steps", self.accum), ("train.samples", self.samples))
        return (*self.loss_overrides, ("optim.name", self.optim), *self.setting, *extra)

    @property
    def name(self) -> str:
        batch = f"b{self.batch_per_device}" + (f"x{self.accum}" if self.accum > 1 else "")
        head = "".join(f"{part}_" for part in (self.dataset, self.regime) if part)
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


def datasets_of(grid) -> list[str]:
    """The data set names ([''] without grid.datasets: the data config as given)."""
    return list(getattr(grid, "datasets", None) or {}) or [""]


def groups_of(grid) -> list[tuple[str, str]]:
    """(data set, regime) of every table of the study, in the grid's order; a data set may be
    limited to some regimes (grid.datasets.<name>.regimes)."""
    out = []
    for dataset in datasets_of(grid):
        only = (grid.datasets.get(dataset) or {}).get("regimes") if dataset else None
        out += [(dataset, regime) for regime in regimes_of(grid) if only is None or regime in only]
    return out


def batches_of(grid, dataset: str) -> list[int]:
    """The per-GPU batches of a data set (grid.datasets.<name>.batch_per_device, else the grid's)."""
    only = (grid.datasets.get(dataset) or {}).get("batch_per_device") if dataset else None
    return [b for b in grid.batch_per_device if only is None or b in only]


def cells_of(grid) -> list[tuple[str, str, int]]:
    """(data set, regime, per-GPU batch) of every cell of the map."""
    return [(dataset, regime, batch) for dataset, regime in groups_of(grid) for batch in batches_of(grid, dataset)]


def sweep_of(grid, regime: str) -> dict:
    """The sweep of a regime: its own `sweep:` if it has one, else grid.sweep."""
    own = (grid.regimes.get(regime) or {}).get("sweep") if regime else None
    return own or grid.sweep


def loss_overrides(grid, loss: str) -> tuple:
    return tuple(sorted(grid.loss_overrides.get(loss, {}).items()))


def sweep_runs(grid) -> list[StudyRun]:
    """Every arm × setting × sweep seed, seed-major (one full sweep first)."""
    return [StudyRun(loss, optim, batch, setting, seed, loss_overrides(grid, loss), regime, dataset=dataset)
            for seed in grid.seeds for dataset, regime, batch in cells_of(grid)
            for optim in grid.optimizers for loss in grid.losses
            for setting in settings_for(sweep_of(grid, regime), optim)]


def final_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """The selected setting of every arm with each final seed."""
    return [StudyRun(loss, optim, batch, best[(dataset, regime, loss, optim, batch)], seed, loss_overrides(grid, loss),
                     regime, dataset=dataset)
            for seed in grid.final_seeds for dataset, regime, batch in cells_of(grid)
            for optim in grid.optimizers for loss in grid.losses if (dataset, regime, loss, optim, batch) in best]


def price_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """grid.accum_price: per regime × optimizer × loss, the contrastive batch b·k as k
    micro-batches of b (train.accum_steps), with the setting selected for the b·k arm (whose
    gradient it is, exactly): timed and its peak memory measured, not evaluated."""
    price = grid.accum_price
    if not price:
        return []
    b, k = price["batch_per_device"], price["accum_steps"]
    return [StudyRun(loss, optim, b, best[(dataset, regime, loss, optim, b * k)], seed, loss_overrides(grid, loss),
                     regime, accum=k, samples=price["samples"], dataset=dataset)
            for seed in price.get("seeds", [0]) for dataset, regime in groups_of(grid) for optim in grid.optimizers
            for loss in grid.losses if (dataset, regime, loss, optim, b * k) in best]


def select_best(rows: list[dict], metric: str) -> dict[tuple, tuple]:
    """Per arm, the setting with the highest mean val ``metric`` over its ok runs, i.e. over the
    sweep seeds (grid.seeds; ties: the setting listed first). rows: study rows with 'arm', 'setting', 'status', f'val/{metric}'."""
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
    """(data set, regime, loss, optimizer, batch) -> 'dataset/regime/loss/optimizer/b<batch>',
    empty parts left out (a plain grid's arm is ('', loss, '', batch): 'loss/b<batch>')."""
    return "/".join(part for part in arm[:-1] if part) + f"/b{arm[-1]}"
