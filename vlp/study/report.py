"""The report's files, rebuilt from the run folders' rows (`vlp compare --report-only` redoes all).

    plain grid  write_report:        runs.csv, results.md, metric_vs_batch.png, curves.png
    study       write_study_report:  study.md, study.json, final.png, curves.png, map.png, mechanism.png

Tables come from vlp.study.tables, figures from vlp.study.plots: one stack for both.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

from vlp.eval.keys import CHANCE_R1, EVAL_KEYS
from vlp.study import plots, tables
from vlp.study.plan import edge_selections
from vlp.study.rows import DIAG_KEYS, final_table, read_log

CSV_COLUMNS = ("run", "loss", "temperature", "batch_per_device", "global_batch", "seed", "steps",
               "samples_seen", "wall_time_s", "status", "error", *EVAL_KEYS, CHANCE_R1, *DIAG_KEYS)
STUDY_METRICS = ("mean_R@1", "mean_R@10")


# ---------------------------------------------------------------------------- plain grid
def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})



def write_report(out: Path, rows: list[dict], grid, total_runs: int) -> None:
    """runs.csv, results.md, metric_vs_batch.png and curves.png from the rows so far (``grid``:
    vlp.study.compare.GridSpec; ``total_runs``: runs in the grid)."""
    write_csv(rows, out / "runs.csv")
    table = tables.aggregate(rows)
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
        tables.markdown_table(table, grid.losses), "",
    ]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    (out / "results.md").write_text("\n".join(lines))
    plots.plot_metric_vs_batch(table, grid.metric, grid.losses, out / "metric_vs_batch.png", chance)
    curves: dict[tuple, list[list[dict]]] = {}
    for r in ok:
        arm = ("", r["loss"], "", r["batch_per_device"])
        curves.setdefault(arm, []).append(read_log(out / r["run"] / "log.jsonl"))
    plots.plot_curves(curves, out / "curves.png")


# ---------------------------------------------------------------------------- study
def write_study_report(out: Path, sweep_rows: list[dict], final_rows: list[dict], best: dict, grid,
                       price_rows: Optional[list[dict]] = None) -> str:
    """study.md, study.json, final.png, curves.png, map.png and mechanism.png; returns the markdown."""
    price_rows = price_rows or []
    test_rows = [{**r, **{m: r.get(f"test/{m}") for m in STUDY_METRICS},
                  **{f"boot/{m}": r.get(f"boot/test/{m}") for m in STUDY_METRICS}} for r in final_rows]
    table = final_table(test_rows, STUDY_METRICS)
    text = study_markdown(table, sweep_rows, final_rows, price_rows, best, grid)
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(json.dumps({
        "best": [{"arm": list(a), "setting": [list(kv) for kv in s]} for a, s in best.items()],
        "final": [{k: v for k, v in e.items() if k != "arm"} for e in table],
        "price": tables.price_table(price_rows)}, indent=1, default=str))
    plots.plot_final(table, grid.metric, out / "final.png")
    if is_map(grid):
        plots.plot_map(table, grid.metric, out / "map.png")
        plots.plot_mechanism(table, grid.metric, out / "mechanism.png")
    curves: dict[tuple, list] = {}
    for r in final_rows:
        if r["status"] == "ok":
            curves.setdefault(r["arm"], []).append(read_log(out / r["run"] / "log.jsonl"))
    plots.plot_curves(curves, out / "curves.png")
    return text


def is_map(grid) -> bool:
    """Several batches or regimes: the report adds the map, its cost and its mechanism."""
    return len(grid.batch_per_device) > 1 or bool(grid.regimes)


def study_markdown(table: list[dict], sweep_rows: list[dict], final_rows: list[dict], price_rows: list[dict],
                   best: dict, grid) -> str:
    """study.md: the arms, the sweep (val), the final table (test) and its verdicts, the map."""
    failed = [f"{r['run']} ({r.get('error', '')})" for r in sweep_rows + final_rows + price_rows if r["status"] != "ok"]
    regimes = f" × regimes {list(grid.regimes)}" if grid.regimes else ""
    lines = [
        "# Tuned loss comparison (sweep on val, seeds on test)", "",
        f"Arms: losses {grid.losses} × optimizers {grid.optimizers} × batch per GPU {grid.batch_per_device}{regimes}; "
        f"sweep {json.dumps(grid.sweep)}"
        + "".join(f"; {r}: sweep {json.dumps(v['sweep'])}" for r, v in grid.regimes.items() if v.get("sweep"))
        + f" with seeds {grid.seeds}, selected on val {grid.select_metric}; "
        f"final seeds {grid.final_seeds}. Every run sees the same budget of samples.", "",
        "## Sweep (val)", "", tables.sweep_markdown(sweep_rows, best, grid.select_metric), "",
        *([f"Selected at the edge of its sweep (the optimum may lie outside): {'; '.join(edges)}.", ""]
          if (edges := edge_selections(best, grid)) else []),
        "## Final (test)", "",
        "Cells: mean ± std over seeds [95 % t-interval]; per-run bootstrap: mean over seeds of each run's 95 % "
        "bootstrap interval over test items; Δ: paired by seed against infonce with the same regime, optimizer "
        "and batch (✓ = 95 % CI excludes 0, not corrected for the number of cells); Δ after Holm: the paired "
        "t-test's p-value adjusted by Holm-Bonferroni over the cells of the same regime's table (every loss, "
        "optimizer and batch compared with infonce, per metric; ✓ = adjusted p ≤ 0.05: resolved once the number "
        "of cells is accounted for); diagnostics from the last training step.", "",
        tables.final_markdown(table, STUDY_METRICS), "",
        *[f"- {v}" for v in tables.verdicts(table, grid.metric)], "",
    ]
    if is_map(grid):
        lines += ["## The map (test)", "", "σ(v): InfoNCE-style mean of sigmoid(v_i) at the last step (grad_ratio).",
                  "", tables.map_markdown(table, grid.metric),
                  "## Cost per cell", "",
                  "samples/s: training samples over training seconds (machine- and load-dependent); peak step "
                  "memory: the most bytes held by tensors during one training step (vlp.train.memory; on CPU a "
                  "function of shapes only).", "",
                  tables.cost_markdown(table, price_rows, grid.metric, grid.accum_price)]
        if tables.mechanism_points(table, grid.metric):
            lines += ["## The mechanism, cell by cell (test)", "",
                      f"The argument for {tables.CHALLENGER}: per anchor ∇InfoNCE = σ(v_i) ∇FlatNCE, so where "
                      f"InfoNCE's σ(v) is small its gradient vanishes and {tables.CHALLENGER} should gain. Every cell "
                      "with both losses, then a least-squares fit of the paired Δ (per seed) on log10 of InfoNCE's "
                      "σ(v) at that seed: the prediction is a negative slope.", "",
                      tables.mechanism_markdown(table, grid.metric), ""]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    return "\n".join(lines)
