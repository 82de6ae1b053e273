"""The report's view across data sets and across the budget: pure functions of rows and tables.

A verdict is the sign of a paired Δ to InfoNCE that stays resolved after Holm over its table
('+' or '−'), else '0' (not resolved). It transfers when every data set that ran the cell gives
the same verdict.
"""

from __future__ import annotations

import statistics
from typing import Optional

from vlp.study.plan import REFERENCE_LOSS
from vlp.study.stats import signed
from vlp.study.tables import group_label

VAL_BEST_RULE = ("per arm, the budget point with the highest val {metric}, averaged over the arm's final seeds "
                 "(ties: the later point); every seed of the arm is then read at that point on test")


def point_choice(rows: list[dict], metric: str) -> dict:
    """Per arm (ok rows with budget points), the samples-seen point whose val ``metric``, averaged
    over the arm's seeds that have it, is highest; ties go to the later point."""
    by_arm: dict = {}
    for row in rows:
        for samples, metrics in (row.get("points") or {}).items() if row["status"] == "ok" else ():
            if metrics.get(f"val/{metric}") is not None:
                by_arm.setdefault(row["arm"], {}).setdefault(samples, []).append(metrics[f"val/{metric}"])
    return {arm: max(points, key=lambda s: (statistics.fmean(points[s]), s)) for arm, points in by_arm.items()}


def rows_at(rows: list[dict], choice: dict, metrics: tuple[str, ...]) -> list[dict]:
    """The ok rows whose arm has a chosen point, with each test metric read at that point (the
    final table's input: metric keys without a split prefix; no per-run bootstrap)."""
    out = []
    for row in rows:
        samples = choice.get(row["arm"])
        point = (row.get("points") or {}).get(samples) if row["status"] == "ok" else None
        if point is not None:
            out.append({**row, "point": samples, **{m: point.get(f"test/{m}") for m in metrics},
                        **{f"boot/{m}": None for m in metrics}})
    return out


def point_fractions(rows: list[dict]) -> list[int]:
    """The budget points (samples seen) of the runs, ascending."""
    return sorted({s for r in rows for s in (r.get("points") or {})})


def epochs_markdown(groups: list[tuple[str, str]], fit_sizes: dict, points: list[int], budget: int) -> str:
    """Per (data set, regime): its training pairs and the epochs the budget points imply."""
    points = points or [budget]
    head = "| data set · regime | fit pairs | " + " | ".join(f"epochs at {s:,} samples" for s in points) + " |"
    lines = [head, "|---|---|" + "---|" * len(points)]
    for group in groups:
        size = fit_sizes.get(group)
        cells = [f"{s / size:.2f}" if size else "—" for s in points]
        lines.append(f"| {group_label(group)} | {size or '—'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_sign(d: Optional[dict]) -> str:
    """'+' or '−' for a paired Δ resolved after Holm, '0' for one that is not, '·' for none."""
    if d is None or d.get("p_holm") is None:
        return "·"
    return ("+" if d["mean"] > 0 else "−") if d["holm"] else "0"


def transfer_reading(signs: dict[str, str]) -> str:
    """Whether one cell's verdict transfers across the data sets that ran it."""
    present = {name: s for name, s in signs.items() if s != "·"}
    if len(present) < 2:
        return "one data set only"
    kinds = set(present.values())
    if kinds == {"0"}:
        return "transfers: not resolved on any data set"
    if len(kinds) == 1:
        return f"transfers: {kinds.pop()} on every data set"
    if {"+", "−"} <= kinds:
        return "does not transfer: opposite signs"
    resolved = [name for name, s in present.items() if s != "0"]
    return f"does not transfer: resolved on {', '.join(resolved)} only"


def transfer_rows(table: list[dict], metric: str) -> list[dict]:
    """One row per (regime, optimizer, batch, loss) cell other than the reference: per data set
    its paired Δ and verdict sign, and the reading."""
    datasets = list(dict.fromkeys(e["dataset"] for e in table))
    cells = sorted({e["arm"].with_(dataset="") for e in table if e["loss"] != REFERENCE_LOSS},
                   key=lambda a: (a.regime, a.batch_per_device, a.optimizer, a.loss))
    by_arm = {e["arm"]: e for e in table}
    out = []
    for cell in cells:  # the arm with its data set left out
        diffs = {d: (by_arm.get(cell.with_(dataset=d)) or {}).get(f"diff/{metric}") for d in datasets}
        signs = {d: verdict_sign(diff) for d, diff in diffs.items()}
        out.append({**cell.columns(), "diffs": diffs, "signs": signs, "reading": transfer_reading(signs)})
    return out


def transfer_markdown(table: list[dict], metric: str) -> str:
    """The verdicts across data sets: Δ vs InfoNCE per data set (points, Holm ✓ = resolved after
    the correction over its table) and whether the verdict transfers."""
    datasets = list(dict.fromkeys(e["dataset"] for e in table))
    head = ["regime", "optimizer", "per-GPU batch", "loss"] + [f"{d or 'data'}: Δ {metric} (verdict)" for d in datasets]
    lines = ["| " + " | ".join(head + ["transfer"]) + " |", "|" + "---|" * (len(head) + 1)]
    for row in transfer_rows(table, metric):
        cells = [row["regime"] or "—", row["optim"], str(row["batch_per_device"]), row["loss"]]
        for d in datasets:
            diff = row["diffs"][d]
            cells.append("—" if diff is None else f"{signed(diff['mean'])} ({row['signs'][d]})")
        lines.append("| " + " | ".join(cells + [row["reading"]]) + " |")
    return "\n".join(lines)


def transfer_counts(table: list[dict], metric: str) -> str:
    """One sentence: how many cells' verdicts transfer, and which do not."""
    rows = [r for r in transfer_rows(table, metric) if r["reading"] != "one data set only"]
    if not rows:
        return "No cell ran on more than one data set."
    moving = [f"{r['regime'] + '/' if r['regime'] else ''}{r['loss']}/b{r['batch_per_device']}" for r in rows
              if r["reading"].startswith("does not")]
    return (f"{len(rows) - len(moving)} of {len(rows)} cells give the same verdict on every data set"
            + (f"; not: {', '.join(moving)}." if moving else "."))
