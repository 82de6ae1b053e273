"""The report's figures: one plotting stack for the plain grid and the study.

matplotlib is imported inside `figure` (heavy, and only a report draws): Figure without pyplot,
no global figure registry, no GUI backend; savefig renders with Agg.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional, Sequence

from vlp.study.plan import REFERENCE_LOSS
from vlp.study.tables import arm_cells, group_label, groups, mechanism_points

LOSS_COLOURS = {"infonce": "tab:blue", "flatnce": "tab:orange", "sogclr": "tab:green", "siglip": "tab:purple"}
OPTIM_STYLES = {"adamw": "-", "lars": "--", "sgd": ":", "": "-"}
CURVE_KEYS = ("infonce", "grad_ratio", "logit_scale", "log_xi", "frac_saturated")


def figure(**kwargs):
    from matplotlib.figure import Figure  # heavy; only a report draws

    return Figure(layout="constrained", **kwargs)


def label(ax, xlabel: str, ylabel: str, title: str = "", fontsize=None) -> None:
    """An axis's labels, title and light grid (every figure's)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=fontsize)
    ax.grid(alpha=0.3)


def plot_metric_vs_batch(table: list[dict], metric: str = "mean_R@1", losses: Optional[Sequence[str]] = None,
                         path: Optional[Path] = None, chance: Optional[float] = None):
    """Eval metric (percent) vs per-GPU batch on a log2 axis; one errorbar line per loss (std over seeds)."""
    fig = figure(figsize=(6, 4))
    ax = fig.add_subplot()
    losses = list(losses or dict.fromkeys(r["loss"] for r in table))
    batches = sorted({r["batch_per_device"] for r in table})
    for i, loss in enumerate(losses):
        pts = sorted((r["batch_per_device"], r[metric]) for r in table if r["loss"] == loss and r.get(metric))
        dodge = 2 ** (0.04 * (i - (len(losses) - 1) / 2))  # small x shift so error bars do not overlap
        if pts:
            ax.errorbar([b * dodge for b, _ in pts], [100 * s[0] for _, s in pts],
                        yerr=[100 * s[1] for _, s in pts], marker="o", capsize=3, label=loss)
    if chance is not None:
        ax.axhline(100 * chance, color="grey", linestyle=":", linewidth=1, label="chance")
    ax.set_xscale("log", base=2)
    if batches:
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
    label(ax, "batch per GPU (log2 scale)", f"{metric} (%)  [mean ± std over seeds]",
          "held-out retrieval at an equal budget of samples seen")
    ax.legend()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig



def mean_curve(logs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """Mean over seeds of `key` vs samples_seen, at the points every seed logged."""
    points: dict[int, list[float]] = {}
    for log in logs:
        for rec in log:
            if rec.get(key) is not None:
                points.setdefault(rec["samples_seen"], []).append(rec[key])
    xs = sorted(s for s, v in points.items() if len(v) == len(logs))
    return xs, [statistics.fmean(points[s]) for s in xs]



def plot_curves(curves: dict[tuple, list[list[dict]]], path: Path,
                keys: Sequence[str] = CURVE_KEYS):
    """Diagnostics vs samples seen, mean over the seeds of each arm (vlp.study.plan.Arm): colour =
    loss, line style = optimizer, width = batch (thicker = larger)."""
    fig = figure(figsize=(15, 7))
    axes = [fig.add_subplot(2, 3, i + 1) for i in range(len(keys))]
    batches = sorted({arm.batch_per_device for arm in curves})
    for arm, logs in curves.items():
        for ax, key in zip(axes, keys):
            xs, ys = mean_curve(logs, key)
            ax.plot(xs, ys, color=LOSS_COLOURS.get(arm.loss, "k"), linestyle=OPTIM_STYLES.get(arm.optimizer, "-."),
                    linewidth=1.0 + batches.index(arm.batch_per_device), label=arm.label)
    for ax, key in zip(axes, keys):
        label(ax, "samples seen", "", key)
    if curves:
        legend_ax = fig.add_subplot(2, 3, 6)
        legend_ax.axis("off")
        legend_ax.legend(*axes[0].get_legend_handles_labels(), loc="center", title="arm (mean over seeds)")
    fig.savefig(path, dpi=110)
    return fig


def diff_colour(d: dict) -> str:
    """A paired Δ's colour: grey while not resolved, green above 0, red below."""
    return "tab:grey" if not d.get("resolved") else "tab:green" if d["mean"] > 0 else "tab:red"


def plot_final(table: list[dict], metric: str, path: Path):
    """Left: test metric per arm, mean with 95 % CI over seeds (std when one seed). Right: paired
    difference to InfoNCE per arm with its 95 % CI; seeds' own differences as dots."""
    fig = figure(figsize=(11, 4))
    ax, ax_d = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    table = sorted(table, key=lambda e: e["arm"].order())
    labels = [e["arm"].label for e in table]
    for i, e in enumerate(table):
        s = e.get(metric)
        if s is None:
            continue
        err = (s["hi"] - s["mean"]) if s["lo"] is not None else s["std"]
        ax.errorbar([i], [100 * s["mean"]], yerr=[100 * err], marker="o", capsize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    label(ax, "", f"test {metric} (%)", "mean and 95 % CI over seeds", 10)
    diffs = [(e["arm"].label, e.get(f"diff/{metric}")) for e in table if e["loss"] != REFERENCE_LOSS]
    diffs = [(label, d) for label, d in diffs if d is not None]
    for i, (_, d) in enumerate(diffs):
        err = (d["hi"] - d["mean"]) if d["lo"] is not None else 0.0
        ax_d.errorbar([i], [100 * d["mean"]], yerr=[100 * err], marker="s", capsize=4, color=diff_colour(d))
        ax_d.plot([i] * len(d["diffs"]), [100 * v for v in d["diffs"].values()], ".", color="k", alpha=0.5)
    ax_d.axhline(0, color="k", linewidth=0.8)
    ax_d.set_xticks(range(len(diffs)), [name for name, _ in diffs], rotation=30, ha="right")
    label(ax_d, "", f"Δ {metric} vs infonce (points)", "paired by seed, 95 % CI (coloured: resolved); dots: seeds", 10)
    fig.savefig(path, dpi=120)
    return fig


def plot_map(table: list[dict], metric: str, path: Path):
    """One panel per (data set, regime): test metric vs per-GPU batch (log2 axis), a line per
    loss with its 95 % CI over seeds as a band."""
    names = groups(table)
    fig = figure(figsize=(5.5 * max(1, len(names)), 4))
    for i, group in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        cells = arm_cells(table, group)
        for loss in dict.fromkeys(e["loss"] for e in cells):
            points = sorted((e["batch_per_device"], e.get(metric)) for e in cells if e["loss"] == loss and e.get(metric))
            if not points:
                continue
            xs = [b for b, _ in points]
            ys = [100 * s["mean"] for _, s in points]
            lo = [100 * (s["lo"] if s.get("lo") is not None else s["mean"]) for _, s in points]
            hi = [100 * (s["hi"] if s.get("hi") is not None else s["mean"]) for _, s in points]
            colour = LOSS_COLOURS.get(loss, "k")
            ax.plot(xs, ys, marker="o", color=colour, label=loss)
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.15)
        ax.set_xscale("log", base=2)
        batches = sorted({e["batch_per_device"] for e in cells})
        ax.set_xticks(batches, [str(b) for b in batches])
        label(ax, "per-GPU batch (equal sample budget)", f"test {metric} (%)",
              f"{group_label(group)}: mean and 95 % CI over seeds", 10)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return fig


def plot_mechanism(table: list[dict], metric: str, path: Path):
    """FlatNCE − InfoNCE (paired, 95 % CI) against InfoNCE's final σ(v), a point per cell,
    labelled with its batch; marker per (data set, regime). The paper's argument predicts Δ > 0
    as σ(v) → 0."""
    points = mechanism_points(table, metric)
    fig = figure(figsize=(6, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    markers = dict(zip(groups(table), "os^Dv<>pP*Xh"))
    for group in dict.fromkeys(p["arm"].table for p in points):
        mine = [p for p in points if p["arm"].table == group]
        for p in mine:
            d = p["diff"]
            err = 0.0 if d.get("lo") is None else 100 * (d["hi"] - d["mean"])
            ax.errorbar([p["sigma_v"]], [100 * d["mean"]], yerr=[err], marker=markers.get(group, "o"),
                        color=diff_colour(d), capsize=4, linestyle="none")
            ax.annotate(f"b{p['batch_per_device']}", (p["sigma_v"], 100 * d["mean"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.plot([], [], marker=markers.get(group, "o"), color="k", linestyle="none", label=group_label(group))
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xscale("log")
    label(ax, "InfoNCE's final σ(v) = |∇InfoNCE| / |∇FlatNCE| per anchor (log)",
          f"FlatNCE − InfoNCE, test {metric} (points)", "paired Δ with 95 % CI per cell (coloured: resolved)", 10)
    if points:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return fig


def sweep_curves(rows: list[dict], metric: str, key: str) -> dict[tuple, list[tuple[float, float]]]:
    """Per arm, (value of ``key``, mean val ``metric`` over its ok runs) sorted by value: the val
    curve over the swept key (other keys of a setting are folded into the arm's one line)."""
    values: dict[tuple, dict[float, list[float]]] = {}
    for r in rows:
        value = dict(r["setting"]).get(key)
        if r["status"] == "ok" and isinstance(value, (int, float)) and r.get(f"val/{metric}") is not None:
            values.setdefault(r["arm"], {}).setdefault(value, []).append(r[f"val/{metric}"])
    return {arm: sorted((v, statistics.fmean(ms)) for v, ms in by.items()) for arm, by in values.items()}


def plot_sweep(rows: list[dict], best: dict, notes: list[dict], metric: str, key: str = "optim.lr",
               path: Optional[Path] = None):
    """One panel per (data set, regime): every arm's val ``metric`` (mean over the sweep seeds)
    against ``key`` (log axis); the selection as a filled marker, a selection at a declared bound
    as a red square. Colour = loss, width = batch."""
    curves = sweep_curves(rows, metric, key)
    tables = list(dict.fromkeys(arm.table for arm in curves))
    batches = sorted({arm.batch_per_device for arm in curves})
    fig = figure(figsize=(5.5 * max(1, len(tables)), 4.2))
    bounded = {n["arm"] for n in notes if n["kind"] == "bound" and n["key"] == key}
    for i, group in enumerate(tables):
        ax = fig.add_subplot(1, len(tables), i + 1)
        for arm, points in curves.items():
            if arm.table != group:
                continue
            colour = LOSS_COLOURS.get(arm.loss, "k")
            ax.plot(*zip(*points), color=colour, linewidth=0.8 + batches.index(arm.batch_per_device), alpha=0.8,
                    label=arm.with_(dataset="", regime="").label)
            chosen = dict(best.get(arm, ())).get(key)
            for x, y in points:
                if x == chosen:
                    ax.plot([x], [y], marker="s" if arm in bounded else "o", color="tab:red" if arm in bounded else colour,
                            markersize=8)
        ax.set_xscale("log")
        label(ax, f"{key} (log)", f"val {metric} (mean over sweep seeds)",
              f"{group_label(group)}: filled = selected, red square = at a bound", 9)
        ax.legend(fontsize=6, ncol=2)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
