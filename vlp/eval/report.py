"""Writers for eval results: metrics.json (our names + CLIP_benchmark names) and a markdown table.

`results` is what `vlp.eval.suite.run_eval_suite` returns: {dataset_name: entry}, where entry is
  {"task": "retrieval", "metrics": {...}, "clip_benchmark": {...}, "n_images": N, "n_texts": M}
  {"task": "classification", "metrics": {...}, "clip_benchmark": {...}, "n": N, "num_classes": C, ...}
"""
from __future__ import annotations

import json
import os
from typing import Any

from vlp.util import atomic_write

RETRIEVAL_COLUMNS = [
    ("image→text R@1", "image_to_text_R@1"), ("R@5", "image_to_text_R@5"), ("R@10", "image_to_text_R@10"),
    ("text→image R@1", "text_to_image_R@1"), ("R@5", "text_to_image_R@5"), ("R@10", "text_to_image_R@10"),
    ("i→t median rank", "image_to_text_median_rank"), ("t→i median rank", "text_to_image_median_rank"),
]
CLASSIFICATION_COLUMNS = [("top-1", "top1"), ("top-5", "top5"), ("mean per-class recall", "mean_per_class_recall")]


def _fmt(key: str, value) -> str:
    if value is None:
        return "–"
    if key.endswith("rank"):
        return f"{value:g}"
    return f"{100.0 * value:.2f}"  # recalls and accuracies as percentages


def markdown_tables(results: dict[str, Any]) -> str:
    """One table per task kind; recalls/accuracies in %, ranks as numbers (said above the tables,
    since metrics.json and the returned dict hold fractions)."""
    out = ["Recalls and accuracies in percent (metrics.json: fractions in [0, 1]); ranks are 1-based.", ""]
    for task, columns, size_key in (("retrieval", RETRIEVAL_COLUMNS, "n_images"),
                                    ("classification", CLASSIFICATION_COLUMNS, "n")):
        rows = {name: e for name, e in results.items() if e.get("task") == task}
        if not rows:
            continue
        heads = ["dataset", *[h for h, _ in columns], "images", "skipped"]
        out += [f"### {task}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for name, entry in rows.items():
            cells = [name, *[_fmt(k, entry["metrics"].get(k)) for _, k in columns], str(entry.get(size_key, "")),
                     _skipped_cell(entry.get("skipped") or {})]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out += [f"- warning: {name}: {w}" for name, e in rows.items() for w in e.get("warnings") or []]
        out += [""] if any(e.get("warnings") for e in rows.values()) else []
    return "\n".join(out)


def _skipped_cell(skipped: dict) -> str:
    """'0', or the total and its kinds: '3 (corrupt_image 2, too_large 1)'."""
    total = sum(skipped.values())
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
    return f"{total} ({kinds})" if total else "0"


def write_reports(results: dict[str, Any], out_dir: str) -> None:
    """Write out_dir/metrics.json and out_dir/metrics.md."""
    atomic_write(os.path.join(out_dir, "metrics.json"),
                 json.dumps(results, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    atomic_write(os.path.join(out_dir, "metrics.md"), markdown_tables(results))
