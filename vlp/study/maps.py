"""The study as a map: loss × per-GPU batch × regime, from the final table of vlp.study.study.

    map_markdown(table, metric)          one row per cell: test metric with CI, paired Δ to InfoNCE, σ(v), scale
    cost_markdown(table, prices, ...)    samples/s and peak step memory per cell, accumulation beside batch b
    plot_map(table, metric, path)        metric vs per-GPU batch, a line per loss, 95 % CI band, a panel per regime
    plot_mechanism(table, metric, path)  FlatNCE − InfoNCE Δ against InfoNCE's σ(v), one point per cell

σ(v) is the mean over anchors of sigmoid(v_i) at the last step (the `grad_ratio` diagnostic):
per anchor, ∇InfoNCE = σ(v_i) ∇FlatNCE, so InfoNCE's σ(v) → 0 is where FlatNCE's argument
(InfoNCE's gradient vanishes at small batch) applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from vlp.study.stats import seed_summary, signed

REFERENCE_LOSS = "infonce"
CHALLENGER = "flatnce"


def _pct(s: Optional[dict]) -> str:
    if s is None:
        return "—"
    ci = "" if s.get("lo") is None else f" [{100 * s['lo']:.1f}, {100 * s['hi']:.1f}]"
    return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f}{ci}"


def _diff(d: Optional[dict]) -> str:
    if d is None:
        return "—"
    ci = "" if d.get("lo") is None else f" [{signed(d['lo'])}, {signed(d['hi'])}]"
    return f"{signed(d['mean'])}{ci}" + (" ✓" if d.get("resolved") else "")


def _mean(s: Optional[dict], fmt: str = "{:.3g}") -> str:
    return "—" if s is None else fmt.format(s["mean"])


def regimes(table: list[dict]) -> list[str]:
    """Regime names in the order the grid listed them (the table keeps that order)."""
    seen: list[str] = []
    for e in table:
        if e["regime"] not in seen:
            seen.append(e["regime"])
    return seen


def _cells(table: list[dict], regime: str) -> list[dict]:
    return sorted((e for e in table if e["regime"] == regime),
                  key=lambda e: (e["batch_per_device"], e["optim"], e["loss"] != REFERENCE_LOSS, e["loss"]))


def map_markdown(table: list[dict], metric: str, settings: Optional[callable] = None) -> str:
    """Per regime, one row per (batch, optimizer, loss): seeds, test metric mean ± std [95 %
    CI], paired Δ to InfoNCE [95 % CI] (✓ = resolved), final σ(v) and logit_scale."""
    out = []
    for regime in regimes(table):
        out += [f"**{regime or 'all'}**", "",
                f"| per-GPU batch | loss | optimizer | setting | seeds | test {metric} (%) mean ± std [95 % CI] | "
                f"Δ vs {REFERENCE_LOSS} [95 % CI] | σ(v) | logit_scale |", "|---|---|---|---|---|---|---|---|---|"]
        for e in _cells(table, regime):
            tag = settings(e["setting"]) if settings else str(e["setting"])
            diff = "ref" if e["loss"] == REFERENCE_LOSS else _diff(e.get(f"diff/{metric}"))
            out.append(f"| {e['batch_per_device']} | {e['loss']} | {e['optim']} | {tag} | {e['n']} | "
                       f"{_pct(e.get(metric))} | {diff} | {_mean(e.get('grad_ratio'), '{:.3f}')} | "
                       f"{_mean(e.get('logit_scale'), '{:.1f}')} |")
        out.append("")
    return "\n".join(out)


def price_table(prices: list[dict]) -> list[dict]:
    """Price runs (ok) grouped by arm: mean samples/s and peak step memory over their seeds."""
    by_arm: dict[tuple, list[dict]] = {}
    for row in prices:
        if row["status"] == "ok":
            by_arm.setdefault(row["arm"], []).append(row)
    return [{"regime": arm[0], "loss": arm[1], "optim": arm[2], "batch_per_device": arm[3],
             "accum": rows[0]["accum"], "samples_per_s": seed_summary([r.get("samples_per_s") for r in rows]),
             "peak_step_mem_mb": seed_summary([r.get("peak_step_mem_mb") for r in rows])}
            for arm, rows in by_arm.items()]


def cost_markdown(table: list[dict], prices: list[dict], metric: str, price: dict) -> str:
    """Per regime, samples/s and peak step memory of every cell, and the accumulation runs
    (b × k micro-batches) beside batch b with the accuracy of the b·k cell they equal."""
    priced = price_table(prices)
    out = []
    for regime in regimes(table):
        out += [f"**{regime or 'all'}**", "",
                f"| contrastive batch | loss | samples/s | peak step memory (MiB) | test {metric} (%) |",
                "|---|---|---|---|---|"]
        cells = _cells(table, regime)
        for e in cells:
            out.append(f"| {e['batch_per_device']} | {e['loss']} | {_mean(e.get('samples_per_s'), '{:.0f}')} | "
                       f"{_mean(e.get('peak_step_mem_mb'), '{:.1f}')} | {_pct(e.get(metric))} |")
        for p in (p for p in priced if p["regime"] == regime):
            big = p["batch_per_device"] * p["accum"]
            same = next((e for e in cells if e["loss"] == p["loss"] and e["optim"] == p["optim"]
                         and e["batch_per_device"] == big), None)
            out.append(f"| {big} = {p['batch_per_device']} × {p['accum']} accumulated | {p['loss']} | "
                       f"{_mean(p['samples_per_s'], '{:.0f}')} | {_mean(p['peak_step_mem_mb'], '{:.1f}')} | "
                       f"{_pct(same.get(metric)) if same else '—'} (= batch {big}) |")
        out.append("")
    return "\n".join(out)


def plot_map(table: list[dict], metric: str, path: Optional[Path] = None):
    """One panel per regime: test metric vs per-GPU batch (log2 axis), a line per loss with its
    95 % CI over seeds as a band."""
    from vlp.study.report import LOSS_COLOURS, figure

    names = regimes(table)
    fig = figure(figsize=(5.5 * max(1, len(names)), 4))
    for i, regime in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        cells = _cells(table, regime)
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
        ax.set_xlabel("per-GPU batch (equal sample budget)")
        ax.set_ylabel(f"test {metric} (%)")
        ax.set_title(f"{regime or 'study'}: mean and 95 % CI over seeds", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def mechanism_points(table: list[dict], metric: str) -> list[dict]:
    """Per (regime, optimizer, batch) cell with both losses: InfoNCE's final σ(v) and the paired
    FlatNCE − InfoNCE difference."""
    out = []
    for e in table:
        if e["loss"] != CHALLENGER or e.get(f"diff/{metric}") is None:
            continue
        ref = next((r for r in table if r["loss"] == REFERENCE_LOSS and r["regime"] == e["regime"]
                    and r["optim"] == e["optim"] and r["batch_per_device"] == e["batch_per_device"]), None)
        if ref is not None and ref.get("grad_ratio") is not None:
            out.append({"regime": e["regime"], "optim": e["optim"], "batch_per_device": e["batch_per_device"],
                        "sigma_v": ref["grad_ratio"]["mean"], "diff": e[f"diff/{metric}"]})
    return out


def plot_mechanism(table: list[dict], metric: str, path: Optional[Path] = None):
    """FlatNCE − InfoNCE (paired, 95 % CI) against InfoNCE's final σ(v), a point per cell,
    labelled with its batch; marker per regime. The paper's argument predicts Δ > 0 as σ(v) → 0."""
    from vlp.study.report import figure

    points = mechanism_points(table, metric)
    fig = figure(figsize=(6, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    markers = dict(zip(regimes(table), "os^Dv<>"))
    for regime in dict.fromkeys(p["regime"] for p in points):
        mine = [p for p in points if p["regime"] == regime]
        for p in mine:
            d = p["diff"]
            err = 0.0 if d.get("lo") is None else 100 * (d["hi"] - d["mean"])
            colour = "tab:grey" if not d.get("resolved") else ("tab:green" if d["mean"] > 0 else "tab:red")
            ax.errorbar([p["sigma_v"]], [100 * d["mean"]], yerr=[err], marker=markers.get(regime, "o"),
                        color=colour, capsize=4, linestyle="none")
            ax.annotate(f"b{p['batch_per_device']}", (p["sigma_v"], 100 * d["mean"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.plot([], [], marker=markers.get(regime, "o"), color="k", linestyle="none", label=regime or "study")
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("InfoNCE's final σ(v) = |∇InfoNCE| / |∇FlatNCE| per anchor (log)")
    ax.set_ylabel(f"FlatNCE − InfoNCE, test {metric} (points)")
    ax.set_title("paired Δ with 95 % CI per cell (coloured: resolved)", fontsize=10)
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=8)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
