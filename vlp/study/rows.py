"""Rows: what one finished (or failed) run's folder says, as one dict, and the final table of a
grid (one entry per arm, seeds summarised, paired differences to InfoNCE).

Pure reads of the run folders (local or a bucket): `vlp compare --report-only` rebuilds every row.
"""

from __future__ import annotations

import json
from typing import Optional

from vlp import records
from vlp.config import Config
from vlp.eval import keys
from vlp.eval.keys import RECALL_KS
from vlp.checkpoint.storage import RunFolder
from vlp.study.plan import REFERENCE_LOSS, SPLITS, Arm, Run
from vlp.study.stats import (bootstrap_ci, holm, item_seed_bootstrap, look_level, paired_difference, seed_summary,
                             simultaneous_ci)

DIAG_KEYS = ("infonce", "log_xi", "grad_ratio", "frac_saturated", "ess_neg", "acc", "logit_scale")
"""Diagnostics from the last training step."""
DIAG = ("grad_ratio", "logit_scale", "infonce", "frac_saturated")
"""The final table's diagnostics (grad_ratio: σ(v), the map's mechanism)."""
COST = ("samples_per_s", "peak_step_mem_mb")
POINTS_FILE = "eval_points.json"
ITEMS_FILE = "eval_items.json"
"""A ranked run's val and test ranks at every budget point, and at the end (vlp.study.ranking)."""


def read_log(path) -> list[dict]:
    """The training records ("type": "train", vlp/records.py) of a log.jsonl, one per step
    (the last wins on resume)."""
    return records.last_per_step(records.read_records(path, records.TRAIN))


def run_row(run: Run, cfg: Config, world: int = 1, ranked: bool = False, metric_keys: tuple[str, ...] = (),
            n_boot: int = 1000) -> Optional[dict]:
    """The row of a finished or failed run (None while it has not been attempted). ``ranked``:
    it is ok only with its val / test ranks (eval_items.json), whose metrics, and bootstraps of
    ``metric_keys`` over the test items, it then carries."""
    folder = RunFolder(cfg.train.output_dir)  # a local folder or a bucket
    result, record = _read_json(folder, "result.json"), _read_json(folder, "compare.json") or {}
    items = _read_json(folder, ITEMS_FILE) if ranked else None
    if result is None and not record and items is None:
        return None
    log = read_log(folder.download("log.jsonl")) if folder.exists("log.jsonl") else []
    points = _read_json(folder, POINTS_FILE) if ranked else None
    folder.close()
    last, ok = (log[-1] if log else {}), result is not None and (items is not None or not ranked)
    done = result or {}
    seconds = done.get("train_time_s")
    row = {
        "run": run.name, "arm": run.arm, **run.arm.columns(), "accum": run.accum, "setting": run.setting,
        "temperature": cfg.loss.temperature,
        "global_batch": done.get("global_batch", run.arm.batch_per_device * world * cfg.train.accum_steps),
        "seed": run.seed, "steps": (result or last).get("step", 0),
        "samples_seen": (result or last).get("samples_seen", 0),
        "wall_time_s": record.get("wall_time_s", seconds), "status": "ok" if ok else "failed",
        "error": "" if ok else record.get("error", ""),
        "samples_per_s": done.get("samples_seen", 0) / seconds if seconds else None,
        "peak_step_mem_mb": done.get("peak_step_mem_mb"),
    }
    for k in RECALL_KS:
        both = [done.get(keys.eval_key(keys.recall(d, k))) for d in keys.DIRECTIONS]
        row.update({keys.recall(d, k): v for d, v in zip(keys.DIRECTIONS, both)})
        row[keys.mean_recall(k)] = None if None in both else sum(both) / 2
    row[keys.CHANCE_R1] = done.get(keys.eval_key(keys.CHANCE_R1))
    row.update({k: last.get(k) for k in DIAG_KEYS})
    if ok and ranked:
        row.update(ranked_metrics(items, points or {}, metric_keys, n_boot, run.seed))
    return row


def ranked_metrics(items: dict, points: dict, metric_keys: tuple[str, ...], n_boot: int, seed: int) -> dict:
    """A ranked run's val / test metrics, per-item test hits and their bootstrap intervals, and
    its budget points ({samples seen: {"val/mean_R@10": ..., ...}}, in the order of the budget)."""
    out = {f"{split}/{k}": v for split in SPLITS for k, v in split_metrics(items[split]).items()}
    for key in metric_keys:  # e.g. mean_R@10 -> bootstrap over the test items
        k = int(key.rsplit("@", 1)[1])
        out[f"hits/test/{key}"] = item_hits(items["test"], k)  # per test item: the paired bootstrap's input
        out[f"boot/test/{key}"] = bootstrap_ci(out[f"hits/test/{key}"], n_boot=n_boot, seed=seed)
    out["points"] = {int(samples): {f"{split}/{k}": v for split in SPLITS for k, v in split_metrics(at[split]).items()}
                     for samples, at in sorted(points.items(), key=lambda kv: int(kv[0]))}
    return out


def _read_json(folder: RunFolder, name: str) -> Optional[dict]:
    try:
        return json.loads(folder.read_bytes(name))
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------- study: metrics
def split_metrics(items: dict) -> dict[str, float]:
    """{direction_R@k, mean_R@k} of one split's ranks {image_to_text: [...], text_to_image: [...]}."""
    out = {}
    for k in RECALL_KS:
        both = [sum(r <= k for r in items[d]) / len(items[d]) for d in keys.DIRECTIONS]
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


def final_table(rows: list[dict], metrics: tuple[str, ...], reference: str = REFERENCE_LOSS,
                looks: int = 1) -> list[dict]:
    """One entry per arm: seed summaries of each test metric and diagnostic, mean per-run
    bootstrap interval, and the paired difference to ``reference`` (same data set, regime,
    optimizer and batch) with its Holm-adjusted p over the table's cells (``correct_per_table``)
    and, where the rows carry per-item hits (``hits/<metric>``), the paired bootstrap over test
    items and seeds (``boot_items``). ``looks``: the planned looks of grid.seeds_until (1: none),
    which every interval and p-value is corrected for (vlp.study.stats.look_level)."""
    by_arm: dict[Arm, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_arm.setdefault(row["arm"], []).append(row)
    table = []
    for arm, members in by_arm.items():
        refs = by_arm.get(arm.with_(loss=reference), [])
        entry = {"arm": arm, **arm.columns(), "setting": members[0]["setting"], "n": len(members)}
        for key in metrics + DIAG + COST:
            entry[key] = seed_summary([r.get(key) for r in members])
        entry["grad_ratio_by_seed"] = {r["seed"]: r.get("grad_ratio") for r in members}  # the mechanism's fit
        for key in metrics:
            boot = [r.get(f"boot/{key}") for r in members if r.get(f"boot/{key}")]
            entry[f"boot/{key}"] = (sum(b[0] for b in boot) / len(boot), sum(b[1] for b in boot) / len(boot)) \
                if boot else None
            entry[f"diff/{key}"] = None if arm.loss == reference else paired_difference(
                {r["seed"]: r.get(key) for r in members}, {r["seed"]: r.get(key) for r in refs}, looks)
            if entry[f"diff/{key}"] is not None:
                entry[f"diff/{key}"]["boot_items"] = item_seed_bootstrap(
                    {r["seed"]: r.get(f"hits/{key}") for r in members},
                    {r["seed"]: r.get(f"hits/{key}") for r in refs}, level=look_level(looks))
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
        for group in dict.fromkeys(e["arm"].table for e in table):
            family = {i: e[f"diff/{key}"]["p"] for i, e in enumerate(table)
                      if e["arm"].table == group and e.get(f"diff/{key}") is not None}
            for i, corrected in holm(family).items():
                d = table[i][f"diff/{key}"]
                d.update(corrected)
                d["lo_sim"], d["hi_sim"] = simultaneous_ci(d["mean"], d["std"], d["n"], corrected["m"] * looks)

