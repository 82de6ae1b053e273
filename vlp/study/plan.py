"""The plan: which runs a grid is made of (`Arm`, `Run`: an arm trained once with a setting and a
seed), as pure functions of the GridSpec: the sweep's, the final and the price runs, and the
selection between them. An axis lives in `Arm` and in the function here that varies it (arms_of);
edge extension of the sweep (grid.sweep_bounds) is vlp.study.tuning's. Nothing here trains, reads
run folders or writes.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Optional

REFERENCE_LOSS = "infonce"
"""The loss every other loss is compared with, paired by seed, at the same regime, optimizer and batch."""
SPLITS = ("val", "test")
"""A study selects on val and reports on test."""


@dataclass(frozen=True)
class Arm:
    """One cell of the map: what a comparison holds fixed across its seeds and settings. An axis
    the grid does not vary is '' (a plain grid's data set, regime and optimizer: the base config's)."""

    dataset: str = ""
    regime: str = ""
    loss: str = REFERENCE_LOSS
    optimizer: str = ""
    batch_per_device: int = 0

    @property
    def table(self) -> tuple[str, str]:
        """(data set, regime): the table of the report this arm is a row of."""
        return self.dataset, self.regime

    @property
    def label(self) -> str:
        """'dataset/regime/loss/optimizer/b<batch>', the axes the grid does not vary left out."""
        return "/".join(p for p in (self.dataset, self.regime, self.loss, self.optimizer) if p) + \
            f"/b{self.batch_per_device}"

    def with_(self, **axes) -> "Arm":  # the arm with other values on some axes
        return dataclasses.replace(self, **axes)

    def columns(self) -> dict[str, Any]:
        """The arm as a row's columns (runs.csv, study.json): optim for the optimizer."""
        return {"dataset": self.dataset, "regime": self.regime, "loss": self.loss, "optim": self.optimizer,
                "batch_per_device": self.batch_per_device}

    def order(self) -> tuple:
        """Table order: data set, regime, batch, optimizer, the reference loss first."""
        return (self.dataset, self.regime, self.batch_per_device, self.optimizer, self.loss != REFERENCE_LOSS,
                self.loss)


@dataclass(frozen=True)
class Run:
    """One training of the grid (the attributes vlp.study.runs.run_config reads)."""

    arm: Arm
    setting: tuple[tuple[str, Any], ...] = ()
    """The swept (dotted key, value) pairs (a plain grid: none)."""
    seed: int = 0
    loss_overrides: tuple[tuple[str, Any], ...] = ()
    accum: int = 1
    """> 1: a price run (grid.accum_price): contrastive accumulation, timed, not evaluated."""
    samples: Optional[int] = None
    """A price run's train.samples (None: the grid's budget)."""

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        optim = (("optim.name", self.arm.optimizer),) if self.arm.optimizer else ()
        extra = () if self.accum == 1 else (("train.accum_steps", self.accum), ("train.samples", self.samples))
        return (*self.loss_overrides, *optim, *self.setting, *extra)

    @property
    def name(self) -> str:
        """'infonce_b8_s0' (a plain grid) or '[dataset_][regime_]infonce_adamw_b8[xk]_lr0.001_s0'."""
        a = self.arm
        batch = f"b{a.batch_per_device}" + (f"x{self.accum}" if self.accum > 1 else "")
        if not a.optimizer:
            return f"{a.loss}_{batch}_s{self.seed}"
        head = "".join(f"{part}_" for part in a.table if part)
        return f"{head}{a.loss}_{a.optimizer}_{batch}_{setting_tag(self.setting)}_s{self.seed}"


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
    to value lists, or optimizer names to such maps ({}: the one empty setting)."""
    table = sweep.get(optim, {}) if any(isinstance(v, dict) for v in sweep.values()) else sweep
    keys = list(table)
    return [tuple(zip(keys, values)) for values in itertools.product(*(table[k] for k in keys))]


def groups_of(grid) -> list[tuple[str, str]]:
    """(data set, regime) of every table of the grid, in its order (('', ''): one table); a data
    set may be limited to some regimes (grid.datasets.<name>.regimes)."""
    out = []
    for dataset in list(grid.datasets) or [""]:
        only = (grid.datasets.get(dataset) or {}).get("regimes") if dataset else None
        out += [(dataset, regime) for regime in list(grid.regimes) or [""] if only is None or regime in only]
    return out


def cells_of(grid) -> list[tuple[str, str, int]]:
    """(data set, regime, per-GPU batch) of every cell of the map (grid.datasets.<name>.batch_per_device
    may run a data set on fewer batches)."""
    out = []
    for dataset, regime in groups_of(grid):
        only = (grid.datasets.get(dataset) or {}).get("batch_per_device") if dataset else None
        out += [(dataset, regime, b) for b in grid.batch_per_device if only is None or b in only]
    return out


def arms_of(grid, batch: Optional[int] = None) -> list[Arm]:
    """Every arm, in the grid's order (cell, optimizer, loss); ``batch``: the arms of that batch
    in every table (grid.accum_price)."""
    cells = cells_of(grid) if batch is None else [(d, r, batch) for d, r in groups_of(grid)]
    return [Arm(dataset, regime, loss, optim, b) for dataset, regime, b in cells
            for optim in grid.optimizers or [""] for loss in grid.losses]


def sweep_of(grid, regime: str) -> dict:
    """The sweep of a regime: its own `sweep:` if it has one, else grid.sweep."""
    own = (grid.regimes.get(regime) or {}).get("sweep") if regime else None
    return own or grid.sweep


def run_of(grid, arm: Arm, setting: tuple, seed: int, **price) -> Run:
    """The run of ``arm`` with its loss's overrides (grid.loss_overrides)."""
    return Run(arm, setting, seed, tuple(sorted(grid.loss_overrides.get(arm.loss, {}).items())), **price)


def sweep_runs(grid) -> list[Run]:
    """Every arm × setting × sweep seed, seed-major (one full sweep first)."""
    return [run_of(grid, arm, setting, seed) for seed in grid.seeds for arm in arms_of(grid)
            for setting in settings_for(sweep_of(grid, arm.regime), arm.optimizer)]


def final_runs(grid, best: dict[Arm, tuple]) -> list[Run]:
    """The selected setting of every arm with each final seed, seed-major."""
    return [run_of(grid, arm, best[arm], seed) for seed in grid.final_seeds for arm in arms_of(grid) if arm in best]


def price_runs(grid, best: dict[Arm, tuple]) -> list[Run]:
    """grid.accum_price: per regime × optimizer × loss, the contrastive batch b·k as k
    micro-batches of b (train.accum_steps), with the setting selected for the b·k arm (whose
    gradient it is, exactly): timed and its peak memory measured, not evaluated."""
    price = grid.accum_price
    if not price:
        return []
    b, k = price.batch_per_device, price.accum_steps
    return [run_of(grid, arm.with_(batch_per_device=b), best[arm], seed, accum=k, samples=price.samples)
            for seed in price.seeds for arm in arms_of(grid, b * k) if arm in best]


def select_best(rows: list[dict], metric: str) -> dict[Arm, tuple]:
    """Per arm, the setting with the highest mean val ``metric`` over its ok runs, i.e. over the
    sweep seeds (grid.seeds; ties: the setting listed first). rows: with 'arm', 'setting',
    'status', f'val/{metric}'."""
    means: dict[Arm, dict[tuple, list[float]]] = {}
    for row in rows:
        if row["status"] == "ok" and row.get(f"val/{metric}") is not None:
            means.setdefault(row["arm"], {}).setdefault(row["setting"], []).append(row[f"val/{metric}"])
    best = {}
    for arm, by_setting in means.items():
        scored = [(sum(v) / len(v), -i, s) for i, (s, v) in enumerate(by_setting.items())]
        best[arm] = max(scored)[2]
    return best
