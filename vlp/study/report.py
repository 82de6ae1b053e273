"""`vlp compare` reports: runs.csv, results.md (mean ± std over seeds, best per batch in bold),
metric_vs_batch.png and curves.png, from the rows of the grid's run folders (vlp/study/compare.py).
Pure functions of the rows and logs: `vlp compare --report-only` rebuilds everything.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Optional, Sequence

from vlp.eval.keys import CHANCE_R1, EVAL_KEYS
from vlp import records

# EVAL_KEYS: both directions' R@k and mean_R@k; R@10 is the steadier number on a small eval set
LOSS_COLOURS = {"infonce": "tab:blue", "flatnce": "tab:orange", "sogclr": "tab:green", "siglip": "tab:purple"}
DIAG_KEYS = ("infonce", "log_xi", "grad_ratio", "frac_saturated", "ess_neg", "acc", "logit_scale")
CSV_COLUMNS = ("run", "loss", "temperature", "batch_per_device", "global_batch", "seed", "steps",
               "samples_seen", "wall_time_s", "status", "error", *EVAL_KEYS, CHANCE_R1, *DIAG_KEYS)
CURVE_KEYS = ("infonce", "log_xi", "grad_ratio", "frac_saturated", "logit_scale")


def read_log(path: Path) -> list[dict]:
    """The training records ("type": "train", vlp/records.py) of a log.jsonl, one per step
    (the last wins on resume)."""
    return records.last_per_step(records.read_records(path, records.TRAIN))


# ---------------------------------------------------------------------------- rows
def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})


# ---------------------------------------------------------------------------- aggregation
def _mean_std(values: list[float]) -> Optional[tuple[float, float]]:
    """(mean, sample std over seeds); std 0 for one seed; None for no value."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(rows: list[dict], keys: Sequence[str] = EVAL_KEYS + DIAG_KEYS + ("wall_time_s",)) -> list[dict]:
    """One table row per (loss, batch_per_device): counts, and (mean, std) over the ok seeds per key."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["loss"], row["batch_per_device"]), []).append(row)
    table = []
    for (loss, batch), members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        ref = (ok or members)[0]
        entry = {"loss": loss, "batch_per_device": batch, "global_batch": ref["global_batch"],
                 "steps": ref["steps"], "samples_seen": ref["samples_seen"],
                 "n_ok": len(ok), "n_runs": len(members)}
        entry.update({k: _mean_std([r.get(k) for r in ok]) for k in keys})
        table.append(entry)
    return table


TABLE_COLUMNS = (  # (key, header, scale, higher is better → bold the best per batch size)
    ("mean_R@1", "mean R@1", 100, True), ("mean_R@10", "mean R@10", 100, True),
    ("image_to_text_R@1", "I→T R@1", 100, True), ("image_to_text_R@5", "I→T R@5", 100, True),
    ("image_to_text_R@10", "I→T R@10", 100, True),
    ("text_to_image_R@1", "T→I R@1", 100, True), ("text_to_image_R@5", "T→I R@5", 100, True),
    ("text_to_image_R@10", "T→I R@10", 100, True),
    ("infonce", "InfoNCE (last step)", 1, False), ("logit_scale", "logit scale", 1, False),
    ("wall_time_s", "wall s", 1, False),
)


def markdown_table(table: list[dict], losses: Optional[Sequence[str]] = None, columns=TABLE_COLUMNS) -> str:
    """Rows sorted by batch then loss; 'mean ± std' cells; the best mean per batch size in bold
    (compared as displayed, so ties are all bold). Eval metrics in percent."""
    order = {name: i for i, name in enumerate(losses or [])}
    table = sorted(table, key=lambda r: (r["batch_per_device"], order.get(r["loss"], len(order)), r["loss"]))

    def shown(stat, scale):
        return None if stat is None else round(stat[0] * scale, 1)

    best = {}
    for key, _, scale, bold in columns:
        for r in table:
            value = shown(r.get(key), scale)
            if bold and value is not None:
                b = (key, r["batch_per_device"])
                best[b] = max(best.get(b, value), value)
    head = ["batch/GPU", "global batch", "loss", "steps", "samples seen", "seeds ok"] + [c[1] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = [str(r["batch_per_device"]), str(r["global_batch"]), r["loss"], str(r["steps"]),
                 str(r["samples_seen"]), f"{r['n_ok']}/{r['n_runs']}"]
        for key, _, scale, bold in columns:
            stat = r.get(key)
            if stat is None:
                cells.append("—")
                continue
            mean, std = stat[0] * scale, stat[1] * scale
            text = f"{mean:.1f} ± {std:.1f}" if scale != 1 else f"{mean:.3g} ± {std:.2g}"
            if bold and shown(stat, scale) == best.get((key, r["batch_per_device"])):
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots
def figure(**kwargs):
    # Figure without pyplot: no global figure registry, no GUI backend; savefig renders with Agg.
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kwargs)


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
    ax.set_xlabel("batch per GPU (log2 scale)")
    ax.set_ylabel(f"{metric} (%)  [mean ± std over seeds]")
    ax.set_title("held-out retrieval at an equal budget of samples seen")
    ax.grid(alpha=0.3)
    ax.legend()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


_STYLE = {"infonce": ("Blues", "-"), "flatnce": ("Oranges", "--"), "siglip": ("Greens", ":"),
          "sogclr": ("Purples", "-.")}


def mean_curve(logs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """Mean over seeds of `key` vs samples_seen, at the points every seed logged."""
    points: dict[int, list[float]] = {}
    for log in logs:
        for rec in log:
            if rec.get(key) is not None:
                points.setdefault(rec["samples_seen"], []).append(rec[key])
    xs = sorted(s for s, v in points.items() if len(v) == len(logs))
    return xs, [statistics.fmean(points[s]) for s in xs]


def plot_curves(curves: dict[tuple[str, int], list[list[dict]]], keys: Sequence[str] = CURVE_KEYS,
                path: Optional[Path] = None):
    """One panel per diagnostic vs samples seen; one line per (loss, batch), mean over seeds.

    curves maps (loss, batch_per_device) to the per-seed lists of log.jsonl training records.
    Colour family and dash = loss, shade = batch size (darker = larger).
    """
    ncols = 3
    nrows = math.ceil((len(keys) + 1) / ncols)
    fig = figure(figsize=(5 * ncols, 3.6 * nrows))
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(len(keys))]
    batches = sorted({b for _, b in curves})
    import matplotlib

    for (loss, batch), logs in curves.items():
        shade = 0.45 + 0.5 * (batches.index(batch) / max(1, len(batches) - 1))
        cmap, linestyle = _STYLE.get(loss, ("Purples", "-."))
        for ax, key in zip(axes, keys):
            xs, ys = mean_curve(logs, key)
            ax.plot(xs, ys, color=matplotlib.colormaps[cmap](shade), linestyle=linestyle, linewidth=1.3,
                    label=f"{loss} b={batch}")
    for ax, key in zip(axes, keys):
        ax.set_title(key)
        ax.set_xlabel("samples seen")
        ax.grid(alpha=0.3)
    if curves:
        handles, labels = axes[0].get_legend_handles_labels()
        legend_ax = fig.add_subplot(nrows, ncols, len(keys) + 1)
        legend_ax.axis("off")
        legend_ax.legend(handles, labels, loc="center", title="loss, batch per GPU (mean over seeds)")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def write_report(out: Path, rows: list[dict], grid, total_runs: int) -> None:
    """runs.csv, results.md, metric_vs_batch.png and curves.png from the rows so far (``grid``:
    vlp.study.compare.GridSpec; ``total_runs``: runs in the grid)."""
    write_csv(rows, out / "runs.csv")
    table = aggregate(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    chance = next((r[CHANCE_R1] for r in ok if r.get(CHANCE_R1)), None)
    failed = [f"{r['run']} ({r['error']})" for r in rows if r["status"] != "ok"]
    lines = [
        "# Loss comparison at an equal budget of samples seen", "",
        f"Losses {', '.join(grid.losses)} × batch per GPU {grid.batch_per_device} × seeds {grid.seeds}; "
        f"{len(ok)} of {total_runs} runs done. Cells: mean ± std over seeds; eval metrics in "
        "percent (held-out retrieval after the last step); best per batch size in **bold**; "
        "InfoNCE and logit scale from the last training step."
        + (f" Chance R@1 = {100 * chance:.2f} %." if chance else ""), "",
        markdown_table(table, grid.losses), "",
    ]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    (out / "results.md").write_text("\n".join(lines))
    plot_metric_vs_batch(table, grid.metric, grid.losses, out / "metric_vs_batch.png", chance)
    curves: dict[tuple[str, int], list[list[dict]]] = {}
    for r in ok:
        curves.setdefault((r["loss"], r["batch_per_device"]), []).append(read_log(out / r["run"] / "log.jsonl"))
    plot_curves(curves, path=out / "curves.png")
