"""The report: one writer, rebuilt from the run folders' rows (`vlp compare --report-only` redoes all).

    write_report(out, result, grid)  runs.csv (every run), then what the grid has:
        no sweep (a plain grid)      results.md (mean ± std per loss × batch), metric_vs_batch.png
        a sweep (a tuned study)      study.md (sweep, final, verdicts; with several batches, regimes
                                     or data sets the map, cost and mechanism), study.json,
                                     final.png, sweep.png, map.png, mechanism.png
        both                         curves.png

Tables come from vlp.study.tables, figures from vlp.study.plots: one stack for both.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Optional

from vlp.checkpoint.storage import RunFolder
from vlp.eval.keys import CHANCE_R1, EVAL_KEYS
from vlp.study import adaptive, plots, tables, transfer, tuning
from vlp.study.rows import DIAG_KEYS, final_table, read_log

CSV_COLUMNS = ("run", "loss", "temperature", "batch_per_device", "global_batch", "seed", "steps",
               "samples_seen", "wall_time_s", "status", "error", *EVAL_KEYS, CHANCE_R1, *DIAG_KEYS)
STUDY_METRICS = ("mean_R@1", "mean_R@10")


def write_report(out: RunFolder, result: dict, grid, facts: Optional[dict] = None) -> str:
    """The report's files from ``result`` (rows: "sweep", "final", "price"; "best": the setting of
    every arm) into the grid's folder (a bucket: written locally, then uploaded); its text.
    facts: {"tried": settings per arm (vlp.study.tuning), "fit_sizes": training pairs per table}."""
    local, rows = out.local_dir(""), [r for k in ("sweep", "final", "price") for r in result.get(k) or []]
    with open(local / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS} for row in rows)
    finals = result["final"]
    text = (study_report(local, result, grid, dict(facts or {})) if grid.sweep
            else results_report(local, finals, grid, len(result["best"]) * len(grid.final_seeds)))
    curves: dict = {}
    for r in finals:
        if r["status"] == "ok":
            curves.setdefault(r["arm"], []).append(read_log(local / r["run"] / "log.jsonl"))
    plots.plot_curves(curves, local / "curves.png")
    out.sync_dir("")
    return text


def results_report(out: Path, rows: list[dict], grid, total_runs: int) -> str:
    """A plain grid's results.md and metric_vs_batch.png; its table."""
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
        text := tables.markdown_table(table, grid.losses), "",
    ] + (["Failed runs: " + "; ".join(failed), ""] if failed else [])
    (out / "results.md").write_text("\n".join(lines))
    plots.plot_metric_vs_batch(table, grid.metric, grid.losses, out / "metric_vs_batch.png", chance)
    return text


def test_rows(final_rows: list[dict]) -> list[dict]:
    """The final rows with their test metrics (and per-run bootstraps) under the metric's name."""
    return [{**r, **{m: r.get(f"test/{m}") for m in STUDY_METRICS},
             **{f"boot/{m}": r.get(f"boot/test/{m}") for m in STUDY_METRICS},
             **{f"hits/{m}": r.get(f"hits/test/{m}") for m in STUDY_METRICS}} for r in final_rows]


def study_report(out: Path, result: dict, grid, facts: dict) -> str:
    """A tuned study's study.md, study.json and figures (final, sweep; the map's map and
    mechanism); its markdown."""
    sweep_rows, final_rows, price_rows, best = result["sweep"], result["final"], result["price"], result["best"]
    facts["tried"] = result["tried"]
    facts["notes"] = tuning.edge_notes(grid, best, facts["tried"])
    facts.setdefault("points", transfer.point_fractions(final_rows))
    facts.setdefault("budget", max((r.get("samples_seen") or 0 for r in final_rows), default=0))
    looks = adaptive.looks_of(grid)
    table = final_table(test_rows(final_rows), STUDY_METRICS, looks=looks)
    choice = transfer.point_choice(final_rows, grid.select_metric)
    at_best = final_table(transfer.rows_at(final_rows, choice, STUDY_METRICS), STUDY_METRICS, looks=looks) \
        if choice else []
    facts["seeds"] = adaptive.seed_reasons(table, grid)
    text = study_markdown(table, at_best, sweep_rows, final_rows, price_rows, best, grid, facts)
    (out / "study.md").write_text(text)
    arm = dataclasses.asdict
    (out / "study.json").write_text(json.dumps({
        "best": [{"arm": arm(a), "setting": [list(kv) for kv in s]} for a, s in best.items()],
        "edges": [{**n, "arm": arm(n["arm"])} for n in facts["notes"]],
        "val_best_point": [{"arm": arm(a), "samples": s} for a, s in choice.items()],
        "seeds": [{**n, "arm": arm(n["arm"])} for n in facts["seeds"]],
        "final": [{k: v for k, v in e.items() if k != "arm"} for e in table],
        "final_at_val_best_point": [{k: v for k, v in e.items() if k != "arm"} for e in at_best],
        "price": [{k: v for k, v in e.items() if k != "arm"} for e in tables.price_table(price_rows)]},
        indent=1, default=str))
    plots.plot_final(table, grid.metric, out / "final.png")
    plots.plot_sweep(sweep_rows, best, facts["notes"], grid.select_metric, SWEEP_KEY, out / "sweep.png")
    if is_map(grid):
        plots.plot_map(table, grid.metric, out / "map.png")
        plots.plot_mechanism(table, grid.metric, out / "mechanism.png")
    return text


def is_map(grid) -> bool:
    """Several batches, regimes or data sets: the report adds the map, its cost and its mechanism."""
    return len(grid.batch_per_device) > 1 or bool(grid.regimes) or bool(grid.datasets)


SWEEP_KEY = "optim.lr"
"""The swept key whose val curve sweep.png draws."""
FINAL_LEGEND = (
    "Cells: mean ± std over seeds [95 % t-interval]; per-run bootstrap: mean over seeds of each run's 95 % "
    "bootstrap interval over test items; Δ: paired by seed against infonce with the same data set, regime, "
    "optimizer and batch (✓ = 95 % CI excludes 0, not corrected for the number of cells); Δ after Holm: the paired "
    "t-test's p-value adjusted by Holm-Bonferroni over the cells of the same (data set, regime) table (every loss, "
    "optimizer and batch compared with infonce, per metric; ✓ = adjusted p ≤ 0.05: resolved once the number of "
    "cells is accounted for); in the map, the simultaneous 95 % CI of that family (Bonferroni, level 1 − 0.05/m); "
    "Δ bootstrap items × seeds: the paired percentile bootstrap of Δ resampling test items and seeds together "
    "(✓ = it excludes 0, not corrected for the number of cells), beside the t-interval, which sees seed "
    "variance only; diagnostics from the last training step.")


def header_lines(grid, facts: dict) -> list[str]:
    """The arms, the sweep and its bounds, the selection rule, the budget and its epochs."""
    regimes = f" × regimes {list(grid.regimes)}" if grid.regimes else ""
    datasets = f" × data sets {list(grid.datasets)}" if grid.datasets else ""
    bounds = (f"; an arm selected at an edge gets the next value ×3 or /3 within grid.sweep_bounds "
              f"{json.dumps(grid.sweep_bounds)}" if grid.sweep_bounds else "")
    lines = [
        "# Tuned loss comparison (sweep on val, seeds on test)", "",
        f"Arms: losses {grid.losses} × optimizers {grid.optimizers} × batch per GPU {grid.batch_per_device}"
        f"{regimes}{datasets}; sweep {json.dumps(grid.sweep)}"
        + "".join(f"; {r}: sweep {json.dumps(v['sweep'])}" for r, v in grid.regimes.items() if v.get("sweep"))
        + f" with seeds {grid.seeds}, selected on the mean val {grid.select_metric} over those {len(grid.seeds)} "
        f"seed(s){bounds}; final seeds {grid.final_seeds}. Every run sees the same budget of samples.", ""]
    if grid.datasets:
        lines += ["Data sets (each with its own fit / val / test split): "
                  + "; ".join(dataset_text(d, sets) for d, sets in grid.datasets.items()) + ".", ""]
    if facts.get("fit_sizes"):
        lines += ["## Budget and epochs", "", transfer.epochs_markdown(
            list(facts["fit_sizes"]), facts["fit_sizes"], facts.get("points") or [], facts.get("budget") or 0), ""]
    return lines


def dataset_text(name: str, sets: dict) -> str:
    """'openclipart: regimes ['lit']', 'mine (your shards: train a/, val b/, test c/)' or 'one (your
    shards s3://b/x/, split by caption hash)'."""
    own = sets.get("shards") or {}
    where = (f" (your shards: train {own['fit']}, val {own['val']}, test {own['test']})" if own else
             f" (your shards {sets['source']}, split by caption hash)" if sets.get("source") else "")
    subsets = ", ".join(f"{k} {sets[k]}" for k in ("batch_per_device", "regimes") if sets.get(k))
    return name + where + (f": {subsets}" if subsets else "")


def sweep_lines(sweep_rows: list[dict], best: dict, grid, notes: list[dict]) -> list[str]:
    edges = tuning.edge_sentences(notes, grid.sweep_bounds)
    return ["## Sweep (val)", "", "Val curve of every arm over the learning rate: sweep.png.", "",
            tables.sweep_markdown(sweep_rows, best, grid.select_metric), "",
            *(edges or ["Every selection is interior to the values its arm tried."]), ""]


def points_lines(table: list[dict], at_best: list[dict], grid) -> list[str]:
    """The verdicts across data sets at the end and at each arm's val-best budget point."""
    metric = grid.metric
    lines = ["## Verdicts across data sets (test)", "",
             "Verdict per cell: + or − where the paired Δ to infonce stays resolved after Holm over its table, "
             "0 where it does not. A verdict transfers when every data set that ran the cell gives the same one.", "",
             "**At the end of the budget**", "", transfer.transfer_markdown(table, metric), "",
             transfer.transfer_counts(table, metric), ""]
    if at_best:
        lines += [f"**At the val-best budget point** (rule: {transfer.VAL_BEST_RULE.format(metric=grid.select_metric)})",
                  "", transfer.transfer_markdown(at_best, metric), "", transfer.transfer_counts(at_best, metric), "",
                  *[f"- at the val-best point: {v}" for v in tables.verdicts(at_best, metric)], ""]
    return lines


def study_markdown(table: list[dict], at_best: list[dict], sweep_rows: list[dict], final_rows: list[dict],
                   price_rows: list[dict], best: dict, grid, facts: dict) -> str:
    """study.md: the arms and budget, the sweep (val), the final table (test) and its verdicts,
    the map per data set, the verdicts across data sets and budget points, cost, mechanism."""
    failed = [f"{r['run']} ({r.get('error', '')})" for r in sweep_rows + final_rows + price_rows if r["status"] != "ok"]
    lines = [*header_lines(grid, facts), *sweep_lines(sweep_rows, best, grid, facts["notes"]),
             "## Final (test)", "", FINAL_LEGEND, "", *looks_lines(grid), tables.final_markdown(table, STUDY_METRICS), "",
             *[f"- {v}" for v in tables.verdicts(table, grid.metric)], "", *seeds_lines(facts["seeds"], grid)]
    if is_map(grid):
        lines += map_lines(table, price_rows, grid)
        lines += points_lines(table, at_best, grid)
        if tables.mechanism_points(table, grid.metric):
            lines += ["## The mechanism, cell by cell (test)", "",
                      f"The argument for {tables.CHALLENGER}: per anchor ∇InfoNCE = σ(v_i) ∇FlatNCE, so where "
                      f"InfoNCE's σ(v) is small its gradient vanishes and {tables.CHALLENGER} should gain. Every cell "
                      "of every data set with both losses, then a least-squares fit of the paired Δ (per seed) on "
                      "log10 of InfoNCE's σ(v) at that seed: the prediction is a negative slope.", "",
                      tables.mechanism_markdown(table, grid.metric), ""]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    return "\n".join(lines)


def looks_lines(grid) -> list[str]:
    """With grid.seeds_until: the stopping rule and the correction every interval carries."""
    rule = grid.seeds_until
    if not rule:
        return []
    looks = adaptive.looks_of(grid)
    return [f"Seeds where the answer is open (grid.seeds_until): after the final seeds, a paired Δ on {grid.metric} "
            f"whose interval contains 0 and is wider than ± {rule.half_width:g} points gets {rule.step} more "
            f"seed(s), up to {rule.max_seeds} (looks at {adaptive.sizes_of(grid)} seeds). Because the number of "
            f"seeds depends on the data, every interval below is at level 1 − 0.05/{looks} "
            f"({100 * (1 - 0.05 / looks):.2f} %) and every p-value is min(1, {looks}·p) (Bonferroni over the "
            f"{looks} planned looks), before Holm over each table's cells.", ""]


def seeds_lines(reasons: list[dict], grid) -> list[str]:
    """Per comparison: its seeds and why (grid.seeds_until)."""
    if not grid.seeds_until or not reasons:
        return []
    lines = ["## Seeds per comparison (test)", "", f"| comparison (Δ vs infonce, {grid.metric}) | seeds | why |",
             "|---|---|---|"]
    lines += [f"| {n['arm'].label} | {n['n']} | {n['reason']} |" for n in reasons]
    return lines + [""]


def map_lines(table: list[dict], price_rows: list[dict], grid) -> list[str]:
    """The map, one section per data set (each of its regimes a table), and its cost."""
    lines = ["## The map (test)", "", "σ(v): InfoNCE-style mean of sigmoid(v_i) at the last step (grad_ratio).", ""]
    for dataset in dict.fromkeys(g[0] for g in tables.groups(table)):
        if dataset:
            lines += [f"### {dataset}", ""]
        lines += [tables.map_markdown(table, grid.metric, [g for g in tables.groups(table) if g[0] == dataset])]
    return lines + [
        "## Cost per cell", "",
        "samples/s: training samples over training seconds (machine- and load-dependent); peak step memory: the "
        "most bytes held by tensors during one training step (vlp.train.memory; on CPU a function of shapes only).",
        "", tables.cost_markdown(table, price_rows, grid.metric)]
