"""Rows: what one finished (or failed) run's folder says, as one dict, and the final table of a
study (one entry per arm, seeds summarised, paired differences to InfoNCE).

    run_row(run, cfg)             a plain grid's runs.csv row (result.json, compare.json, log.jsonl)
    study_row(run, run_dir, ...)  a study run's row: val / test metrics from eval_items.json, bootstraps
    final_table(rows, metrics)    per arm: seed summaries, per-run bootstrap, paired Δ to InfoNCE

Pure reads of the run folders: `vlp compare --report-only` rebuilds every row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from vlp import records
from vlp.config import Config
from vlp.eval import keys
from vlp.eval.keys import RECALL_KS
from vlp.checkpoint.storage import RunFolder
from vlp.study.plan import REFERENCE_LOSS, SPLITS, RunSpec, StudyRun
from vlp.study.stats import (bootstrap_ci, holm, item_seed_bootstrap, look_level, paired_difference, seed_summary,
                             simultaneous_ci)

KS = (1, 5, 10)
DIAG_KEYS = ("infonce", "log_xi", "grad_ratio", "frac_saturated", "ess_neg", "acc", "logit_scale")
"""A plain grid's diagnostics, from the last training step."""
DIAG = ("grad_ratio", "logit_scale", "infonce", "frac_saturated")
"""A study's diagnostics, from the last training step (grad_ratio: σ(v), the map's mechanism)."""
COST = ("samples_per_s", "peak_step_mem_mb")


def read_log(path: Path) -> list[dict]:
    """The training records ("type": "train", vlp/records.py) of a log.jsonl, one per step
    (the last wins on resume)."""
    return records.last_per_step(records.read_records(path, records.TRAIN))


# ---------------------------------------------------------------------------- plain grid
def run_row(run: RunSpec, cfg: Config, world: int = 1) -> Optional[dict]:
    """The runs.csv row of a finished or failed run (None while it has not been attempted)."""
    folder = RunFolder(cfg.train.output_dir)  # a local folder or a bucket
    result, record = _read_json(folder, "result.json"), _read_json(folder, "compare.json") or {}
    if result is None and not record:
        return None
    log = read_log(folder.download("log.jsonl")) if folder.exists("log.jsonl") else []
    folder.close()
    last = log[-1] if log else {}
    row = {
        "run": run.name, "loss": run.loss, "temperature": cfg.loss.temperature,
        "batch_per_device": run.batch_per_device,
        "global_batch": (result or {}).get("global_batch", run.batch_per_device * world * cfg.train.accum_steps),
        "seed": run.seed,
        "steps": (result or last).get("step", 0), "samples_seen": (result or last).get("samples_seen", 0),
        "wall_time_s": record.get("wall_time_s", (result or {}).get("train_time_s")),
        "status": "ok" if result is not None else record.get("status", "failed"),
        "error": "" if result is not None else record.get("error", ""),
    }
    for k in RECALL_KS:
        both = [(result or {}).get(keys.eval_key(keys.recall(d, k))) for d in keys.DIRECTIONS]
        row.update({keys.recall(d, k): v for d, v in zip(keys.DIRECTIONS, both)})
        row[keys.mean_recall(k)] = None if None in both else sum(both) / 2
    row[keys.CHANCE_R1] = (result or {}).get(keys.eval_key(keys.CHANCE_R1))
    row.update({k: last.get(k) for k in DIAG_KEYS})
    return row


def _read_json(folder: RunFolder, name: str) -> Optional[dict]:
    try:
        return json.loads(folder.read_bytes(name))
    except FileNotFoundError:
        return None


def collect_rows(runs: list[RunSpec], cfgs: dict[str, Config], world: int = 1) -> list[dict]:
    return [row for run in runs if (row := run_row(run, cfgs[run.name], world)) is not None]


# ---------------------------------------------------------------------------- study: metrics
def recall_at(ranks: list[int], k: int) -> float:
    return sum(r <= k for r in ranks) / len(ranks)


def split_metrics(items: dict) -> dict[str, float]:
    """{direction_R@k, mean_R@k} of one split's ranks {image_to_text: [...], text_to_image: [...]}."""
    out = {}
    for k in KS:
        both = [recall_at(items[d], k) for d in keys.DIRECTIONS]
        out.update({keys.recall(d, k): r for d, r in zip(keys.DIRECTIONS, both)})
        out[keys.mean_recall(k)] = sum(both) / 2
    return out


def item_hits(items: dict, k: int) -> list[float]:
    """Per eval item, the mean over both directions of 'hit at k' (one caption per image:
    item j = image j and caption j, so the mean of these is mean_R@k); otherwise the two
    directions' hits side by side."""
    i2t, t2i = items["image_to_text"], items["text_to_image"]
    if len(i2t) == len(t2i):
        return [((a <= k) + (b <= k)) / 2 for a, b in zip(i2t, t2i)]
    return [float(r <= k) for r in i2t + t2i]


# ---------------------------------------------------------------------------- rows
def study_row(run: StudyRun, run_dir: Path, metric_keys: tuple[str, ...], n_boot: int = 1000,
              items: bool = True) -> Optional[dict]:
    """A run's row: status, val and test metrics from eval_items.json (``items``; a price run
    has none), bootstrap intervals of the test metrics, final diagnostics, samples/s and peak
    step memory. None if the run was never attempted."""
    items_path, record_path, result_path = run_dir / "eval_items.json", run_dir / "compare.json", run_dir / "result.json"
    if not items_path.is_file() and not record_path.is_file() and not result_path.is_file():
        return None
    row = {"run": run.name, "arm": run.arm, "dataset": run.dataset, "regime": run.regime, "loss": run.loss,
           "optim": run.optim,
           "batch_per_device": run.batch_per_device, "accum": run.accum, "setting": run.setting, "seed": run.seed,
           "status": "ok" if (items_path.is_file() or not items) and result_path.is_file() else "failed"}
    if row["status"] != "ok":
        row["error"] = json.loads(record_path.read_text()).get("error", "") if record_path.is_file() else ""
        return row
    if items:
        ranks = json.loads(items_path.read_text())
        for split in SPLITS:
            row.update({f"{split}/{k}": v for k, v in split_metrics(ranks[split]).items()})
        for key in metric_keys:  # e.g. mean_R@10 -> bootstrap over the test items
            k = int(key.rsplit("@", 1)[1])
            row[f"hits/test/{key}"] = item_hits(ranks["test"], k)  # per test item: the paired bootstrap's input
            row[f"boot/test/{key}"] = bootstrap_ci(row[f"hits/test/{key}"], n_boot=n_boot, seed=run.seed)
        row["points"] = point_metrics(run_dir / "eval_points.json")
    log = read_log(run_dir / "log.jsonl")
    last = log[-1] if log else {}
    row.update({k: last.get(k) for k in DIAG})
    result = json.loads(result_path.read_text())
    seconds = result.get("train_time_s")
    row.update({"steps": result.get("step"), "samples_seen": result.get("samples_seen"),
                "global_batch": result.get("global_batch"), "wall_time_s": seconds,
                "samples_per_s": result.get("samples_seen", 0) / seconds if seconds else None,
                "peak_step_mem_mb": result.get("peak_step_mem_mb")})
    return row


def point_metrics(path: Path) -> dict[int, dict[str, float]]:
    """A run's budget points (eval_points.json; {} without one): {samples seen: {"val/mean_R@10":
    ..., "test/mean_R@10": ..., ...}} in the order of the budget."""
    if not path.is_file():
        return {}
    points = json.loads(path.read_text())
    return {int(samples): {f"{split}/{k}": v for split in SPLITS for k, v in split_metrics(items[split]).items()}
            for samples, items in sorted(points.items(), key=lambda kv: int(kv[0]))}


def final_table(rows: list[dict], metrics: tuple[str, ...], reference: str = REFERENCE_LOSS,
                looks: int = 1) -> list[dict]:
    """One entry per arm: seed summaries of each test metric and diagnostic, mean per-run
    bootstrap interval, and the paired difference to ``reference`` (same data set, regime,
    optimizer and batch) with its Holm-adjusted p over the table's cells (``correct_per_table``)
    and, where the rows carry per-item hits (``hits/<metric>``), the paired bootstrap over test
    items and seeds (``boot_items``). ``looks``: the planned looks of grid.seeds_until (1: none),
    which every interval and p-value is corrected for (vlp.study.stats.look_level)."""
    by_arm: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_arm.setdefault(row["arm"], []).append(row)
    table = []
    for arm, members in by_arm.items():
        dataset, regime, loss, optim, batch = arm
        entry = {"arm": arm, "dataset": dataset, "regime": regime, "loss": loss, "optim": optim, "batch_per_device": batch,
                 "setting": members[0]["setting"], "n": len(members)}
        for key in metrics + DIAG + COST:
            entry[key] = seed_summary([r.get(key) for r in members])
        entry["grad_ratio_by_seed"] = {r["seed"]: r.get("grad_ratio") for r in members}  # the mechanism's fit
        for key in metrics:
            boot = [r.get(f"boot/{key}") for r in members if r.get(f"boot/{key}")]
            entry[f"boot/{key}"] = (sum(b[0] for b in boot) / len(boot), sum(b[1] for b in boot) / len(boot)) \
                if boot else None
            ref = {r["seed"]: r.get(key) for r in by_arm.get((dataset, regime, reference, optim, batch), [])}
            entry[f"diff/{key}"] = None if loss == reference else paired_difference(
                {r["seed"]: r.get(key) for r in members}, ref, looks)
            if entry[f"diff/{key}"] is not None:
                entry[f"diff/{key}"]["boot_items"] = item_seed_bootstrap(
                    {r["seed"]: r.get(f"hits/{key}") for r in members},
                    {r["seed"]: r.get(f"hits/{key}") for r in by_arm.get((dataset, regime, reference, optim, batch), [])},
                    level=look_level(looks))
        table.append(entry)
    correct_per_table(table, metrics, looks)
    return table


def correct_per_table(table: list[dict], metrics: tuple[str, ...], looks: int = 1) -> None:
    """Holm-Bonferroni per metric over the cells of one (data set, regime) table (every loss,
    optimizer and batch with a paired difference and a p-value): adds p_holm, holm (resolved
    after the correction), m (the family size) and the simultaneous interval over the family
    (lo_sim, hi_sim: Bonferroni, each cell's t-interval at level 1 − 0.05 / (m · looks)) to each of
    those differences, in place (their p is already corrected for the looks)."""
    for key in metrics:
        for group in dict.fromkeys((e["dataset"], e["regime"]) for e in table):
            family = {i: e[f"diff/{key}"]["p"] for i, e in enumerate(table)
                      if (e["dataset"], e["regime"]) == group and e.get(f"diff/{key}") is not None}
            for i, corrected in holm(family).items():
                d = table[i][f"diff/{key}"]
                d.update(corrected)
                d["lo_sim"], d["hi_sim"] = simultaneous_ci(d["mean"], d["std"], d["n"], corrected["m"] * looks)

