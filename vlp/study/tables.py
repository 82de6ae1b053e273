"""The report's tables: markdown from rows and final tables, one set of cell formatters.

    plain grid   aggregate(rows), markdown_table(table)          results.md
    study        sweep_markdown, final_markdown, verdicts          study.md: sweep (val), final (test)
    the map      map_markdown, cost_markdown, mechanism_points     study.md: the map, cost per cell, mechanism

Pure functions of numbers (vlp.study.plots draws the same tables; vlp.study.report writes files).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from vlp.eval.keys import EVAL_KEYS
from vlp.study.plan import REFERENCE_LOSS, setting_tag
from vlp.study.rows import DIAG_KEYS
from vlp.study.stats import LEVEL, ci_label, linear_fit, seed_summary, signed, verdict

CHALLENGER = "flatnce"
"""The loss whose mechanism (InfoNCE's gradient vanishing as σ(v) → 0) the map tests."""


# ---------------------------------------------------------------------------- cells
def pct(stat: Optional[dict]) -> str:
    """A seed summary in percent: 'mean ± std [lo, hi]' (no interval for one seed); '—' for none."""
    if stat is None:
        return "—"
    ci = "" if stat.get("lo") is None else f" [{100 * stat['lo']:.1f}, {100 * stat['hi']:.1f}]"
    return f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}{ci}"


def diff_cell(d: Optional[dict]) -> str:
    """A paired difference in points: '+m [lo, hi]', ' ✓' when its 95 % CI excludes 0."""
    if d is None:
        return "—"
    ci = "" if d.get("lo") is None else f" [{signed(d['lo'])}, {signed(d['hi'])}]"
    return f"{signed(d['mean'])}{ci}" + (" ✓" if d.get("resolved") else "")


def boot_cell(d: Optional[dict]) -> str:
    """The paired bootstrap over test items and seeds of a difference: '[lo, hi]' in points, ' ✓'
    when it excludes 0; '—' without one (no per-item ranks, or one seed)."""
    if d is None or d.get("boot_items") is None:
        return "—"
    lo, hi = d["boot_items"]
    return f"[{signed(lo)}, {signed(hi)}]" + (" ✓" if lo > 0 or hi < 0 else "")


def mean_cell(stat: Optional[dict], fmt: str = "{:.3g}") -> str:
    return "—" if stat is None else fmt.format(stat["mean"])


def holm_cell(d: Optional[dict], interval: bool = False) -> str:
    """A paired difference after Holm over its table's cells: 'p=<adjusted p>', ' ✓' when it
    stays resolved; with ``interval`` its simultaneous (Bonferroni) CI too; '—' without a test
    (one seed)."""
    if d is None or d.get("p_holm") is None:
        return "—"
    ci = f" [{signed(d['lo_sim'])}, {signed(d['hi_sim'])}]" if interval and d.get("lo_sim") is not None else ""
    return f"p={d['p_holm']:.2g}{ci}" + (" ✓" if d["holm"] else "")


# ---------------------------------------------------------------------------- plain grid
def _mean_std(values: list[float]) -> Optional[tuple[float, float]]:
    """(mean, sample std over seeds) of seed_summary; std 0 for one seed; None for no value."""
    summary = seed_summary(values)
    return None if summary is None else (summary["mean"], summary["std"])


def aggregate(rows: list[dict], keys: Sequence[str] = EVAL_KEYS + DIAG_KEYS + ("wall_time_s",)) -> list[dict]:
    """One table row per arm (a plain grid's: loss × batch): counts, and (mean, std) over the ok seeds per key."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(row["arm"], []).append(row)
    table = []
    for arm, members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        ref = (ok or members)[0]
        entry = {"loss": arm.loss, "batch_per_device": arm.batch_per_device, "global_batch": ref["global_batch"],
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


# ---------------------------------------------------------------------------- study
def sweep_markdown(rows: list[dict], best: dict, metric: str) -> str:
    """Val metric per arm × setting (mean over sweep seeds); the selected setting in bold."""
    cells: dict[tuple, dict[tuple, list[float]]] = {}
    for row in rows:
        value = row.get(f"val/{metric}") if row["status"] == "ok" else None
        cells.setdefault(row["arm"], {}).setdefault(row["setting"], [])
        if value is not None:
            cells[row["arm"]][row["setting"]].append(value)
    lines = [f"| arm (loss/optimizer/batch) | setting | val {metric} (%) | runs |", "|---|---|---|---|"]
    for arm, by_setting in cells.items():
        for setting, values in by_setting.items():
            shown = f"{100 * sum(values) / len(values):.1f}" if values else "failed"
            if best.get(arm) == setting:
                shown = f"**{shown}**"
            lines.append(f"| {arm.label} | {setting_tag(setting)} | {shown} | {len(values)} |")
    return "\n".join(lines)



def diff_label(table: list[dict]) -> str:
    """The level of the table's paired intervals ('95 %'; '97.5 %' with two looks of grid.seeds_until)."""
    levels = [d["level"] for e in table for k, d in e.items() if k.startswith("diff/") and d and "level" in d]
    return ci_label(levels[0] if levels else LEVEL)


def final_markdown(table: list[dict], metrics: tuple[str, ...]) -> str:
    head, label = ["arm (loss/optimizer/batch)", "setting", "seeds"], diff_label(table)
    for m in metrics:
        head += [f"test {m} (%) mean ± std [95 % CI]", f"per-run bootstrap 95 % ({m})", f"Δ vs infonce ({m}) [{label} CI]",
                 f"Δ after Holm ({m})", f"Δ bootstrap items × seeds ({m})"]
    head += ["grad_ratio", "logit_scale", "InfoNCE (last step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(table, key=lambda e: e["arm"].order()):
        cells = [e["arm"].label, setting_tag(e["setting"]), str(e["n"])]
        for m in metrics:
            boot = e.get(f"boot/{m}")
            d = e.get(f"diff/{m}")
            cells += [pct(e.get(m)), "—" if boot is None else f"[{100 * boot[0]:.1f}, {100 * boot[1]:.1f}]",
                      "ref" if e["loss"] == REFERENCE_LOSS else diff_cell(d),
                      "ref" if e["loss"] == REFERENCE_LOSS else holm_cell(d),
                      "ref" if e["loss"] == REFERENCE_LOSS else boot_cell(d)]
        cells += [mean_cell(e.get("grad_ratio")), mean_cell(e.get("logit_scale")), mean_cell(e.get("infonce"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(table: list[dict], metric: str) -> list[str]:
    """One sentence per (data set, regime, optimizer, batch) with a reference arm."""
    out = []
    cells = sorted({e["arm"].with_(loss=REFERENCE_LOSS) for e in table},  # the arms with their reference loss
                   key=lambda a: (a.dataset, a.regime, a.optimizer, a.batch_per_device))
    for cell in cells:
        diffs = {e["loss"]: e.get(f"diff/{metric}") for e in table
                 if e["arm"].with_(loss=REFERENCE_LOSS) == cell and e["loss"] != REFERENCE_LOSS}
        if diffs:
            where = "".join(f"{part}, " for part in cell.table if part)
            out.append(f"{where}{cell.optimizer}, batch {cell.batch_per_device}: "
                       + verdict(diffs, REFERENCE_LOSS, f"test {metric}"))
    return out


# ---------------------------------------------------------------------------- the map
def groups(table: list[dict]) -> list[tuple[str, str]]:
    """The (data set, regime) tables in the order the grid listed them (the table keeps that order)."""
    return list(dict.fromkeys(e["arm"].table for e in table))


def group_label(group: tuple[str, str]) -> str:
    """('openclipart', 'lit') -> 'openclipart · lit'; ('', 'lit') -> 'lit'; ('', '') -> 'all'."""
    return " · ".join(part for part in group if part) or "all"


def arm_cells(table: list[dict], group: tuple[str, str]) -> list[dict]:
    return sorted((e for e in table if e["arm"].table == group), key=lambda e: e["arm"].order())


def map_markdown(table: list[dict], metric: str, only: Optional[list[tuple[str, str]]] = None) -> str:
    """Per (data set, regime), one row per (batch, optimizer, loss): seeds, test metric mean ±
    std [95 % CI], paired Δ to InfoNCE [95 % CI] (✓ = resolved), Δ after Holm over the table's
    cells with its simultaneous (Bonferroni) interval, final σ(v) and logit_scale."""
    out = []
    for group in (only or groups(table)):
        out += [f"**{group_label(group)}**", "",
                f"| per-GPU batch | loss | optimizer | setting | seeds | test {metric} (%) mean ± std [95 % CI] | "
                f"Δ vs {REFERENCE_LOSS} [{diff_label(table)} CI] | Δ after Holm [simultaneous CI] | σ(v) | logit_scale | "
                "Δ bootstrap items × seeds |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in arm_cells(table, group):
            tag = setting_tag(e["setting"])
            d = e.get(f"diff/{metric}")
            diff, corrected = ("ref", "ref") if e["loss"] == REFERENCE_LOSS else (diff_cell(d), holm_cell(d, True))
            out.append(f"| {e['batch_per_device']} | {e['loss']} | {e['optim']} | {tag} | {e['n']} | "
                       f"{pct(e.get(metric))} | {diff} | {corrected} | {mean_cell(e.get('grad_ratio'), '{:.3f}')} | "
                       f"{mean_cell(e.get('logit_scale'), '{:.1f}')} | "
                       f"{'ref' if e['loss'] == REFERENCE_LOSS else boot_cell(d)} |")
        out.append("")
    return "\n".join(out)


def price_table(prices: list[dict]) -> list[dict]:
    """Price runs (ok) grouped by arm: mean samples/s and peak step memory over their seeds."""
    by_arm: dict = {}
    for row in prices:
        if row["status"] == "ok":
            by_arm.setdefault(row["arm"], []).append(row)
    return [{"arm": arm, **arm.columns(),
             "accum": rows[0]["accum"], "samples_per_s": seed_summary([r.get("samples_per_s") for r in rows]),
             "peak_step_mem_mb": seed_summary([r.get("peak_step_mem_mb") for r in rows])}
            for arm, rows in by_arm.items()]


def cost_markdown(table: list[dict], prices: list[dict], metric: str) -> str:
    """Per (data set, regime), samples/s and peak step memory of every cell, and the accumulation
    runs (b × k micro-batches) beside batch b with the accuracy of the b·k cell they equal."""
    priced = price_table(prices)
    out = []
    for group in groups(table):
        out += [f"**{group_label(group)}**", "",
                f"| contrastive batch | loss | samples/s | peak step memory (MiB) | test {metric} (%) |",
                "|---|---|---|---|---|"]
        cells = arm_cells(table, group)
        for e in cells:
            out.append(f"| {e['batch_per_device']} | {e['loss']} | {mean_cell(e.get('samples_per_s'), '{:.0f}')} | "
                       f"{mean_cell(e.get('peak_step_mem_mb'), '{:.1f}')} | {pct(e.get(metric))} |")
        for p in (p for p in priced if p["arm"].table == group):
            big = p["batch_per_device"] * p["accum"]
            same = next((e for e in cells if e["loss"] == p["loss"] and e["optim"] == p["optim"]
                         and e["batch_per_device"] == big), None)
            out.append(f"| {big} = {p['batch_per_device']} × {p['accum']} accumulated | {p['loss']} | "
                       f"{mean_cell(p['samples_per_s'], '{:.0f}')} | {mean_cell(p['peak_step_mem_mb'], '{:.1f}')} | "
                       f"{pct(same.get(metric)) if same else '—'} (= batch {big}) |")
        out.append("")
    return "\n".join(out)


def mechanism_points(table: list[dict], metric: str) -> list[dict]:
    """Per (data set, regime, optimizer, batch) cell with both losses: InfoNCE's final σ(v) and
    the paired FlatNCE − InfoNCE difference."""
    out = []
    for e in table:
        if e["loss"] != CHALLENGER or e.get(f"diff/{metric}") is None:
            continue
        ref = next((r for r in table if r["arm"] == e["arm"].with_(loss=REFERENCE_LOSS)), None)
        if ref is not None and ref.get("grad_ratio") is not None:
            out.append({"arm": e["arm"], "dataset": e["dataset"], "regime": e["regime"], "optim": e["optim"],
                        "batch_per_device": e["batch_per_device"],
                        "sigma_v": ref["grad_ratio"]["mean"], "diff": e[f"diff/{metric}"],
                        "sigma_by_seed": ref.get("grad_ratio_by_seed") or {}})
    return out


def mechanism_fit(points: list[dict]) -> Optional[dict]:
    """Δ_s (FlatNCE − InfoNCE, seed s) against log10 of InfoNCE's σ(v) at seed s, one point per
    cell and seed: stats.linear_fit (slope in Δ per decade of σ(v), its 95 % CI). The mechanism
    predicts a negative slope: FlatNCE gains as InfoNCE's σ(v) → 0."""
    xs, ys = [], []
    for p in points:
        for seed, delta in p["diff"]["diffs"].items():
            sigma = p["sigma_by_seed"].get(seed)
            if sigma is not None and sigma > 0 and delta is not None:
                xs.append(math.log10(sigma))
                ys.append(delta)
    return linear_fit(xs, ys)


def fit_reading(fit: Optional[dict]) -> str:
    """What a fit says about the mechanism's prediction (a negative slope)."""
    if fit is None:
        return "no fit (fewer than 3 points or one σ(v))"
    if fit["hi"] < 0:
        return "as predicted (slope < 0, 95 % CI)"
    if fit["lo"] > 0:
        return "against the prediction (slope > 0, 95 % CI)"
    return "not resolved (95 % CI includes 0)"


def fit_groups(points: list[dict]) -> list[tuple[str, list[dict]]]:
    """The mechanism fits: per (data set, regime) table, per data set over its regimes (with
    several data sets and regimes), and over everything (with more than one table)."""
    tables = list(dict.fromkeys(p["arm"].table for p in points))
    out = [(group_label(g), [p for p in points if p["arm"].table == g]) for g in tables]
    datasets = list(dict.fromkeys(p["dataset"] for p in points))
    if len(datasets) > 1 and len(tables) > len(datasets):
        out += [(f"{d}, every regime", [p for p in points if p["dataset"] == d]) for d in datasets]
    if len(tables) > 1:
        out.append(("every table", points))
    return out


def mechanism_markdown(table: list[dict], metric: str) -> str:
    """Every (data set, regime, optimizer, batch) cell: InfoNCE's σ(v), FlatNCE − InfoNCE [95 %
    CI] and after Holm; then the fit of Δ on log10 σ(v) per table, per data set and over all."""
    order = {g: i for i, g in enumerate(groups(table))}  # the grid's order
    points = sorted(mechanism_points(table, metric),
                    key=lambda p: (order[p["arm"].table], p["optim"], p["batch_per_device"]))
    lines = [f"| data set · regime | optimizer | per-GPU batch | InfoNCE σ(v) | {CHALLENGER} − {REFERENCE_LOSS} "
             "[95 % CI] | Δ after Holm |", "|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {group_label((p['dataset'], p['regime']))} | {p['optim']} | {p['batch_per_device']} | "
                     f"{p['sigma_v']:.3g} | {diff_cell(p['diff'])} | {holm_cell(p['diff'])} |")
    lines += ["", f"| fit over | points (cell × seed) | slope: Δ {metric} (points) per decade of σ(v) [95 % CI] | r | "
              "reading |", "|---|---|---|---|---|"]
    for name, members in fit_groups(points):
        fit = mechanism_fit(members)
        shown = ("—", "—", "—") if fit is None else (
            str(fit["n"]), f"{signed(fit['slope'])} [{signed(fit['lo'])}, {signed(fit['hi'])}]", f"{fit['r']:.2f}")
        lines.append(f"| {name} | {shown[0]} | {shown[1]} | {shown[2]} | {fit_reading(fit)} |")
    return "\n".join(lines)
