"""The tuned study of `vlp compare` (a grid with `grid.sweep`): every arm tuned with the same
budget, selected on val, reported on test with seeds and paired statistics.

    arm      = (loss, optimizer, per-GPU batch)
    sweep    = the same settings grid for every arm (per optimizer: an AdamW lr range is not a
               LARS one), run with grid.seeds (usually one seed): val metric per setting
    select   = per arm, the setting with the best mean val metric over those seeds
    final    = the selected setting per arm with grid.final_seeds (a sweep run with the same
               setting and seed is reused, not rerun): test metrics
    report   = sweep table (val), final table (test: mean ± std, 95 % CI over seeds, per-run
               bootstrap CI over eval items, paired difference to InfoNCE under the same optimizer
               and batch), a verdict sentence, plots with error bars and the diagnostics' curves

Runs: <out_dir>/<loss>_<optim>_b<batch>_<setting>_s<seed>/ (Trainer files + eval_items.json, the
1-based rank of every val and test query in both directions, from which all study metrics and
bootstraps are computed). Reruns skip runs with result.json and eval_items.json.
Data: data.train_shards 'openmoji' trains on the OpenMoji 'fit' names, selects on 'val' and reports
on 'test' (= the demo's held-out 'eval' names; vlp/data/sources/openmoji.py).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vlp.eval import keys
from vlp.study.runs import broadcast, embedded_shards, plan_runs, run_config, run_one
from vlp.study.stats import bootstrap_ci, paired_difference, seed_summary, signed, verdict

REFERENCE_LOSS = "infonce"
KS = (1, 5, 10)
SPLITS = ("val", "test")


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class StudyRun:
    """One training of the study (the attributes vlp.study.runs.run_config reads)."""

    loss: str
    optim: str
    batch_per_device: int
    setting: tuple[tuple[str, Any], ...]
    seed: int
    loss_overrides: tuple[tuple[str, Any], ...] = ()
    regime: str = ""
    """grid.regimes name ('' without regimes): its settings are in the run's base config."""
    accum: int = 1
    """> 1: a price run (grid.accum_price): contrastive accumulation, timed, not evaluated."""
    samples: Optional[int] = None
    """A price run's train.samples (None: the study's budget)."""

    @property
    def arm(self) -> tuple[str, str, str, int]:
        return self.regime, self.loss, self.optim, self.batch_per_device

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        extra = () if self.accum == 1 else (("train.accum_steps", self.accum), ("train.samples", self.samples))
        return (*self.loss_overrides, ("optim.name", self.optim), *self.setting, *extra)

    @property
    def name(self) -> str:
        batch = f"b{self.batch_per_device}" + (f"x{self.accum}" if self.accum > 1 else "")
        head = f"{self.regime}_" if self.regime else ""
        return f"{head}{self.loss}_{self.optim}_{batch}_{setting_tag(self.setting)}_s{self.seed}"


def setting_tag(setting: tuple[tuple[str, Any], ...]) -> str:
    """(('optim.lr', 0.001), ('loss.tau', 0.07)) -> 'lr0.001-tau0.07' (folder-name safe)."""
    if not setting:
        return "base"
    parts = []
    for key, value in setting:
        text = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{key.split('.')[-1]}{text}".replace("/", "_"))
    return "-".join(parts)


def settings_for(sweep: dict, optim: str) -> list[tuple[tuple[str, Any], ...]]:
    """The cartesian product of the sweep's values for one optimizer: ``sweep`` maps dotted keys
    to value lists, or optimizer names to such maps."""
    table = sweep.get(optim, {}) if any(isinstance(v, dict) for v in sweep.values()) else sweep
    keys = list(table)
    return [tuple(zip(keys, values)) for values in itertools.product(*(table[k] for k in keys))]


def regimes_of(grid) -> list[str]:
    """The regime names ([''] without grid.regimes)."""
    return list(grid.regimes) or [""]


def sweep_of(grid, regime: str) -> dict:
    """The sweep of a regime: its own `sweep:` if it has one, else grid.sweep."""
    own = (grid.regimes.get(regime) or {}).get("sweep") if regime else None
    return own or grid.sweep


def _overrides(grid, loss: str) -> tuple:
    return tuple(sorted(grid.loss_overrides.get(loss, {}).items()))


def sweep_runs(grid) -> list[StudyRun]:
    """Every arm × setting × sweep seed, seed-major (one full sweep first)."""
    return [StudyRun(loss, optim, batch, setting, seed, _overrides(grid, loss), regime)
            for seed in grid.seeds for regime in regimes_of(grid) for batch in grid.batch_per_device
            for optim in grid.optimizers for loss in grid.losses
            for setting in settings_for(sweep_of(grid, regime), optim)]


def final_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """The selected setting of every arm with each final seed."""
    return [StudyRun(loss, optim, batch, best[(regime, loss, optim, batch)], seed, _overrides(grid, loss), regime)
            for seed in grid.final_seeds for regime in regimes_of(grid) for batch in grid.batch_per_device
            for optim in grid.optimizers for loss in grid.losses if (regime, loss, optim, batch) in best]


def price_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """grid.accum_price: per regime × optimizer × loss, the contrastive batch b·k as k
    micro-batches of b (train.accum_steps), with the setting selected for the b·k arm (whose
    gradient it is, exactly): timed and its peak memory measured, not evaluated."""
    price = grid.accum_price
    if not price:
        return []
    b, k = price["batch_per_device"], price["accum_steps"]
    return [StudyRun(loss, optim, b, best[(regime, loss, optim, b * k)], seed, _overrides(grid, loss), regime,
                     accum=k, samples=price["samples"])
            for seed in price.get("seeds", [0]) for regime in regimes_of(grid) for optim in grid.optimizers
            for loss in grid.losses if (regime, loss, optim, b * k) in best]


# ---------------------------------------------------------------------------- metrics
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


def select_best(rows: list[dict], metric: str) -> dict[tuple, tuple]:
    """Per arm, the setting with the highest mean val ``metric`` over its ok runs (ties: the
    setting listed first). rows: study rows with 'arm', 'setting', 'status', f'val/{metric}'."""
    means: dict[tuple, dict[tuple, list[float]]] = {}
    for row in rows:
        if row["status"] == "ok" and row.get(f"val/{metric}") is not None:
            means.setdefault(row["arm"], {}).setdefault(row["setting"], []).append(row[f"val/{metric}"])
    best = {}
    for arm, by_setting in means.items():
        scored = [(sum(v) / len(v), -i, s) for i, (s, v) in enumerate(by_setting.items())]
        best[arm] = max(scored)[2]
    return best


def final_table(rows: list[dict], metrics: tuple[str, ...], reference: str = REFERENCE_LOSS) -> list[dict]:
    """One entry per arm: seed summaries of each test metric and diagnostic, mean per-run
    bootstrap interval, and the paired difference to ``reference`` (same optimizer and batch)."""
    by_arm: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_arm.setdefault(row["arm"], []).append(row)
    table = []
    for arm, members in by_arm.items():
        regime, loss, optim, batch = arm
        entry = {"arm": arm, "regime": regime, "loss": loss, "optim": optim, "batch_per_device": batch,
                 "setting": members[0]["setting"], "n": len(members)}
        for key in metrics + DIAG + COST:
            entry[key] = seed_summary([r.get(key) for r in members])
        for key in metrics:
            boot = [r.get(f"boot/{key}") for r in members if r.get(f"boot/{key}")]
            entry[f"boot/{key}"] = (sum(b[0] for b in boot) / len(boot), sum(b[1] for b in boot) / len(boot)) \
                if boot else None
            ref = {r["seed"]: r.get(key) for r in by_arm.get((regime, reference, optim, batch), [])}
            entry[f"diff/{key}"] = None if loss == reference else paired_difference(
                {r["seed"]: r.get(key) for r in members}, ref)
        table.append(entry)
    return table


DIAG = ("grad_ratio", "logit_scale", "infonce", "frac_saturated")
COST = ("samples_per_s", "peak_step_mem_mb")


# ---------------------------------------------------------------------------- rows
def study_row(run: StudyRun, run_dir: Path, metric_keys: tuple[str, ...], n_boot: int = 1000,
              items: bool = True) -> Optional[dict]:
    """A run's row: status, val and test metrics from eval_items.json (``items``; a price run
    has none), bootstrap intervals of the test metrics, final diagnostics, samples/s and peak
    step memory. None if the run was never attempted."""
    from vlp.study.report import read_log

    items_path, record_path, result_path = run_dir / "eval_items.json", run_dir / "compare.json", run_dir / "result.json"
    if not items_path.is_file() and not record_path.is_file() and not result_path.is_file():
        return None
    row = {"run": run.name, "arm": run.arm, "regime": run.regime, "loss": run.loss, "optim": run.optim,
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
            row[f"boot/test/{key}"] = bootstrap_ci(item_hits(ranks["test"], k), n_boot=n_boot, seed=run.seed)
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


# ---------------------------------------------------------------------------- eval items
def cached_item_ranks(model, tokenizer, transform, spec: str, device, batch_size: int, cache: str) -> dict[str, list[int]]:
    """eval_item_ranks for a model with locked stems (data.feature_cache): the stems' outputs over
    the set come from the cache (built once, by the same eval reader), only the heads run."""
    from vlp.eval.retrieval import retrieval_ranks
    from vlp.train.feature_cache import embed_features, retrieval_features

    img_feat, txt_feat, txt_to_img = retrieval_features(model, tokenizer, transform, spec, device, batch_size,
                                                        cache=None if cache == "memory" else cache)
    with torch.no_grad():
        img, txt = embed_features(model, img_feat, txt_feat)
    i2t, t2i = retrieval_ranks(img, txt, txt_to_img)
    return {"image_to_text": i2t.tolist(), "text_to_image": t2i.tolist()}


def eval_item_ranks(model, tokenizer, transform, spec: str, device, batch_size: int = 256,
                    cache: Optional[str] = None) -> dict[str, list[int]]:
    """1-based rank of the correct item for every query of a retrieval set, both directions: the
    eval suite's reader and ranking (vlp.eval.suite, vlp.eval.retrieval), ties included."""
    from vlp.eval.retrieval import retrieval_ranks
    from vlp.eval.suite import embed_retrieval_shards

    with torch.no_grad():
        img, txt, txt_to_img = embed_retrieval_shards(model, tokenizer, transform, spec, device, batch_size)
    i2t, t2i = retrieval_ranks(img, txt, txt_to_img)
    return {"image_to_text": i2t.tolist(), "text_to_image": t2i.tolist()}


def train_and_rank(cfg, accelerator, specs: dict[str, str]) -> dict:
    """Train one run, then write eval_items.json (main process) with the val and test ranks."""
    from vlp.train.loop import Trainer

    try:
        trainer = Trainer(cfg, accelerator=accelerator)
        result = trainer.train()
        model = trainer.eval_model()  # collective under FSDP
        if accelerator.is_main_process:
            rank = cached_item_ranks if cfg.data.feature_cache else eval_item_ranks
            items = {split: rank(model, trainer.tokenizer, trainer.eval_transform, specs[split], accelerator.device,
                                 cfg.eval.batch_size, cfg.data.feature_cache) for split in SPLITS}
            path = Path(cfg.train.output_dir) / "eval_items.json"
            path.with_suffix(".tmp").write_text(json.dumps(items))
            path.with_suffix(".tmp").replace(path)
        accelerator.wait_for_everyone()
        return result
    finally:
        accelerator.free_memory()


# ---------------------------------------------------------------------------- report
def _pct(stat: Optional[dict], ci: bool = True) -> str:
    if stat is None:
        return "—"
    text = f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}"
    if ci and stat.get("lo") is not None:
        text += f" [{100 * stat['lo']:.1f}, {100 * stat['hi']:.1f}]"
    return text


def _num(stat: Optional[dict]) -> str:
    return "—" if stat is None else f"{stat['mean']:.3g}"


def arm_label(arm: tuple) -> str:
    regime, loss, optim, batch = arm
    return f"{regime + '/' if regime else ''}{loss}/{optim}/b{batch}"


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
            lines.append(f"| {arm_label(arm)} | {setting_tag(setting)} | {shown} | {len(values)} |")
    return "\n".join(lines)


def edge_selections(best: dict, grid) -> list[str]:
    """Arms whose selected setting is the first or last value of a swept key with >= 3 values:
    the optimum may lie outside the sweep (widen it)."""
    notes = []
    for arm, setting in best.items():
        table = settings_for(sweep_of(grid, arm[0]), arm[2])
        keys = {k: sorted({dict(s)[k] for s in table}) for k, _ in (table[0] if table else ())}
        for key, value in setting:
            values = keys.get(key, [])
            if len(values) >= 3 and value in (values[0], values[-1]):
                notes.append(f"{arm_label(arm)}: {key}={value:g}" if isinstance(value, float)
                             else f"{arm_label(arm)}: {key}={value}")
    return notes


def arm_order(e: dict) -> tuple:
    """Table order: regime (as listed), batch, optimizer, the reference loss first."""
    return (e["regime"], e["batch_per_device"], e["optim"], e["loss"] != REFERENCE_LOSS, e["loss"])


def final_markdown(table: list[dict], metrics: tuple[str, ...]) -> str:
    head = ["arm (loss/optimizer/batch)", "setting", "seeds"]
    for m in metrics:
        head += [f"test {m} (%) mean ± std [95 % CI]", f"per-run bootstrap 95 % ({m})", f"Δ vs infonce ({m}) [95 % CI]"]
    head += ["grad_ratio", "logit_scale", "InfoNCE (last step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(table, key=arm_order):
        cells = [arm_label(e["arm"]), setting_tag(e["setting"]), str(e["n"])]
        for m in metrics:
            boot = e.get(f"boot/{m}")
            d = e.get(f"diff/{m}")
            cells += [_pct(e.get(m)), "—" if boot is None else f"[{100 * boot[0]:.1f}, {100 * boot[1]:.1f}]",
                      "ref" if e["loss"] == REFERENCE_LOSS else
                      ("—" if d is None else signed(d["mean"]) + ("" if d["lo"] is None else
                       f" [{signed(d['lo'])}, {signed(d['hi'])}]") + (" ✓" if d["resolved"] else ""))]
        cells += [_num(e.get("grad_ratio")), _num(e.get("logit_scale")), _num(e.get("infonce"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(table: list[dict], metric: str) -> list[str]:
    """One sentence per (optimizer, batch) with a reference arm."""
    out = []
    groups = sorted({(e["regime"], e["optim"], e["batch_per_device"]) for e in table})
    for regime, optim, batch in groups:
        diffs = {e["loss"]: e.get(f"diff/{metric}") for e in table if e["regime"] == regime
                 and e["optim"] == optim and e["batch_per_device"] == batch and e["loss"] != REFERENCE_LOSS}
        if diffs:
            where = f"{regime}, " if regime else ""
            out.append(f"{where}{optim}, batch {batch}: " + verdict(diffs, REFERENCE_LOSS, f"test {metric}"))
    return out


def plot_final(table: list[dict], metric: str, path: Optional[Path] = None):
    """Left: test metric per arm, mean with 95 % CI over seeds (std when one seed). Right: paired
    difference to InfoNCE per arm with its 95 % CI; seeds' own differences as dots."""
    from vlp.study.report import figure

    fig = figure(figsize=(11, 4))
    ax, ax_d = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    table = sorted(table, key=arm_order)
    labels = [arm_label(e["arm"]) for e in table]
    for i, e in enumerate(table):
        s = e.get(metric)
        if s is None:
            continue
        err = (s["hi"] - s["mean"]) if s["lo"] is not None else s["std"]
        ax.errorbar([i], [100 * s["mean"]], yerr=[100 * err], marker="o", capsize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(f"test {metric} (%)")
    ax.set_title("mean and 95 % CI over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    diffs = [(arm_label(e["arm"]), e.get(f"diff/{metric}")) for e in table if e["loss"] != REFERENCE_LOSS]
    diffs = [(label, d) for label, d in diffs if d is not None]
    for i, (_, d) in enumerate(diffs):
        err = (d["hi"] - d["mean"]) if d["lo"] is not None else 0.0
        ax_d.errorbar([i], [100 * d["mean"]], yerr=[100 * err], marker="s", capsize=4,
                      color="tab:grey" if not d["resolved"] else "tab:green" if d["mean"] > 0 else "tab:red")
        ax_d.plot([i] * len(d["diffs"]), [100 * v for v in d["diffs"].values()], ".", color="k", alpha=0.5)
    ax_d.axhline(0, color="k", linewidth=0.8)
    ax_d.set_xticks(range(len(diffs)), [label for label, _ in diffs], rotation=30, ha="right")
    ax_d.set_ylabel(f"Δ {metric} vs infonce (points)")
    ax_d.set_title("paired by seed, 95 % CI (coloured: resolved); dots: seeds", fontsize=10)
    ax_d.grid(alpha=0.3)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


OPTIM_STYLES = {"adamw": "-", "lars": "--", "sgd": ":"}
CURVE_KEYS = ("infonce", "grad_ratio", "logit_scale", "log_xi", "frac_saturated")


def plot_study_curves(curves: dict[tuple, list[list[dict]]], path: Optional[Path] = None):
    """Diagnostics vs samples seen, mean over the final seeds of each arm; colour = loss,
    line style = optimizer, width = batch (thicker = larger)."""
    from vlp.study.report import LOSS_COLOURS, figure, mean_curve

    fig = figure(figsize=(15, 7))
    axes = [fig.add_subplot(2, 3, i + 1) for i in range(len(CURVE_KEYS))]
    batches = sorted({arm[3] for arm in curves})
    for arm, logs in curves.items():
        _, loss, optim, batch = arm
        for ax, key in zip(axes, CURVE_KEYS):
            xs, ys = mean_curve(logs, key)
            ax.plot(xs, ys, color=LOSS_COLOURS.get(loss, "k"), linestyle=OPTIM_STYLES.get(optim, "-."),
                    linewidth=1.0 + batches.index(batch), label=arm_label(arm))
    for ax, key in zip(axes, CURVE_KEYS):
        ax.set_title(key)
        ax.set_xlabel("samples seen")
        ax.grid(alpha=0.3)
    if curves:
        legend_ax = fig.add_subplot(2, 3, 6)
        legend_ax.axis("off")
        legend_ax.legend(*axes[0].get_legend_handles_labels(), loc="center",
                         title="loss/optimizer/batch (mean over final seeds)")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def write_study_report(out: Path, sweep_rows: list[dict], final_rows: list[dict], best: dict, grid,
                       price_rows: Optional[list[dict]] = None) -> str:
    """study.md, study.json, final.png, curves.png, map.png and mechanism.png; returns the markdown."""
    from vlp.study import maps
    from vlp.study.report import read_log

    metrics = ("mean_R@1", "mean_R@10")
    price_rows = price_rows or []
    test_rows = [{**r, **{m: r.get(f"test/{m}") for m in metrics},
                  **{f"boot/{m}": r.get(f"boot/test/{m}") for m in metrics}} for r in final_rows]
    table = final_table(test_rows, metrics)
    failed = [f"{r['run']} ({r.get('error', '')})" for r in sweep_rows + final_rows + price_rows if r["status"] != "ok"]
    regimes = f" × regimes {list(grid.regimes)}" if grid.regimes else ""
    lines = [
        "# Tuned loss comparison (sweep on val, seeds on test)", "",
        f"Arms: losses {grid.losses} × optimizers {grid.optimizers} × batch per GPU {grid.batch_per_device}{regimes}; "
        f"sweep {json.dumps(grid.sweep)}"
        + "".join(f"; {r}: sweep {json.dumps(v['sweep'])}" for r, v in grid.regimes.items() if v.get("sweep"))
        + f" with seeds {grid.seeds}, selected on val {grid.select_metric}; "
        f"final seeds {grid.final_seeds}. Every run sees the same budget of samples.", "",
        "## Sweep (val)", "", sweep_markdown(sweep_rows, best, grid.select_metric), "",
        *([f"Selected at the edge of its sweep (the optimum may lie outside): {'; '.join(edges)}.", ""]
          if (edges := edge_selections(best, grid)) else []),
        "## Final (test)", "",
        "Cells: mean ± std over seeds [95 % t-interval]; per-run bootstrap: mean over seeds of each run's 95 % "
        "bootstrap interval over test items; Δ: paired by seed against infonce with the same regime, optimizer "
        "and batch (✓ = 95 % CI excludes 0); diagnostics from the last training step.", "",
        final_markdown(table, metrics), "",
        *[f"- {v}" for v in verdicts(table, grid.metric)], "",
    ]
    if len(grid.batch_per_device) > 1 or grid.regimes:
        lines += ["## The map (test)", "", "σ(v): InfoNCE-style mean of sigmoid(v_i) at the last step (grad_ratio).",
                  "", maps.map_markdown(table, grid.metric, setting_tag),
                  "## Cost per cell", "",
                  "samples/s: training samples over training seconds (machine- and load-dependent); peak step "
                  "memory: the most bytes held by tensors during one training step (vlp.train.memory; on CPU a "
                  "function of shapes only).", "",
                  maps.cost_markdown(table, price_rows, grid.metric, grid.accum_price)]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    text = "\n".join(lines)
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(json.dumps({
        "best": [{"arm": list(a), "setting": [list(kv) for kv in s]} for a, s in best.items()],
        "final": [{k: v for k, v in e.items() if k != "arm"} for e in table],
        "price": maps.price_table(price_rows)}, indent=1, default=str))
    plot_final(table, grid.metric, out / "final.png")
    if len(grid.batch_per_device) > 1 or grid.regimes:
        maps.plot_map(table, grid.metric, out / "map.png")
        maps.plot_mechanism(table, grid.metric, out / "mechanism.png")
    curves: dict[tuple, list] = {}
    for r in final_rows:
        if r["status"] == "ok":
            curves.setdefault(r["arm"], []).append(read_log(out / r["run"] / "log.jsonl"))
    plot_study_curves(curves, out / "curves.png")
    return text


# ---------------------------------------------------------------------------- the loop
def resolve_study_data(base: dict, acc, cache: Path) -> tuple[dict, dict[str, str]]:
    """data.train_shards 'openmoji'/'openmoji:<px>'/'': fit/val/test OpenMoji shards (val: data.eval_shards
    when given; test: grid.test_shards when given, see regime_bases). Otherwise
    data.train_shards is trained on and data.eval_shards (val) and grid.test_shards must be given.
    data.eval_shards is then cleared: the study ranks val and test itself (eval_items.json)."""
    specs = embedded_shards(base, acc, ("fit", "val", "test"), cache)
    data = base["data"]
    if specs is not None:  # a data.eval_shards given with the embedded data is the val set
        val = data.get("eval_shards") or specs["val"]
        data["train_shards"], data["eval_shards"] = specs["fit"], None
        return base, {"val": val, "test": specs["test"]}
    val, data["eval_shards"] = data.get("eval_shards"), None
    return base, {"val": val, "test": None}


def regime_bases(base: dict, grid, acc) -> dict[str, tuple[dict, dict[str, str]]]:
    """Per regime: (its base config = base + the regime's settings, data resolved; its val and
    test shard specs)."""
    from vlp.config import ConfigError, set_dotted

    out = {}
    for regime in regimes_of(grid):
        tree = copy.deepcopy(base)
        for key, value in ((grid.regimes.get(regime) or {}).get("set") or {}).items():
            set_dotted(tree, key, value)
        tree, specs = resolve_study_data(tree, acc, Path(".cache") / "shards" / "openmoji_study")
        if grid.test_shards:
            specs["test"] = grid.test_shards
        if not specs["val"] or not specs["test"]:
            raise ConfigError("config: a study (grid.sweep) needs data.eval_shards (val) and grid.test_shards "
                              "(or data.train_shards: openmoji)")
        out[regime] = (tree, specs)
    return out


def run_study(base: dict, grid, acc, report_only: bool = False) -> dict:
    """Sweep, select, final seeds, price runs, report. Every process walks the same runs in the
    same order; with grid.workers > 1 (one process) runs go to that many worker processes."""
    from vlp.config import ConfigError

    bases = regime_bases(base, grid, acc)
    out = Path(grid.out_dir)
    metric_keys = ("mean_R@1", "mean_R@10")

    def walk(runs: list[StudyRun], ranked: bool = True) -> list[dict]:
        cfgs = {r.name: run_config(bases[r.regime][0], grid, r, acc.num_processes) for r in runs}
        done, error = broadcast(plan_runs(runs, cfgs, out, items=ranked) if acc.is_main_process else None, acc)
        if error:
            raise ConfigError(error)
        todo = [r for r, d in zip(runs, done) if not d]
        acc.print(f"[compare] {len(runs)} runs ({len(runs) - len(todo)} already done) -> {out}")
        if todo and not report_only:
            executor.run([Job(r, cfgs[r.name], bases[r.regime][1] if ranked else None, grid.retries,
                              grid.keep_checkpoints) for r in todo])
        return [row for r in runs if (row := study_row(r, out / r.name, metric_keys, items=ranked)) is not None]

    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    if not report_only:
        warm_caches(bases, grid, acc)
    with Executor(grid, acc) as executor:
        sweep = walk(sweep_runs(grid))
        best = broadcast(select_best(sweep, grid.select_metric) if acc.is_main_process else None, acc)
        finals = walk(final_runs(grid, best))
        prices = walk(price_runs(grid, best), ranked=False)
    text = ""
    if acc.is_main_process:
        text = write_study_report(out, sweep, finals, best, grid, prices)
        print(text, flush=True)
    return {"sweep": sweep, "final": finals, "best": best, "price": prices, "report": text}


def warm_caches(bases: dict, grid, acc) -> None:
    """Build the locked-tower feature caches (data.feature_cache) of every regime once, before
    any run: the training shards' and the val / test sets' stem outputs. Runs (and worker
    processes, from the cache folder) then only read them."""
    from vlp.config import from_dict

    for regime, (tree, specs) in bases.items():
        cfg = from_dict(copy.deepcopy(tree)).validate()
        if cfg.data.feature_cache:
            with threads(grid.workers if acc.num_processes == 1 else torch.get_num_threads()):
                _warm(cfg, specs, acc)


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads set to ``n`` inside (the cores the study's workers will use are
    idle while the caches are built), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _warm(cfg, specs: dict, acc) -> None:
    """One regime's caches: its training shards' stem outputs (every rank) and its val and test
    sets' (main process)."""
    from vlp.models.model import build_model
    from vlp.models.towers import chosen_train_transform
    from vlp.train.data import TrainData
    from vlp.train.feature_cache import retrieval_features, training_features

    model, tokenizer, train_t, eval_t = build_model(cfg.model, cfg.loss)
    transform = chosen_train_transform(cfg.data, train_t, eval_t)
    plan = TrainData(cfg, transform, tokenizer, acc.process_index, acc.num_processes).loader.plan
    training_features(cfg, model, transform, tokenizer, plan, acc.device)  # collective: every rank
    if acc.is_main_process:
        folder = None if cfg.data.feature_cache == "memory" else cfg.data.feature_cache
        for split in SPLITS:
            retrieval_features(model, tokenizer, eval_t, specs[split], acc.device, cfg.eval.batch_size, folder)
    acc.wait_for_everyone()


@dataclass(frozen=True)
class Job:
    """One run to execute: its config, the val / test specs it is ranked on (None: a price run,
    trained only), and the grid's retry and checkpoint policy. Picklable (worker processes)."""

    run: StudyRun
    cfg: Any
    specs: Optional[dict]
    retries: int = 1
    keep_checkpoints: bool = True


def run_job(job: Job, accelerator=None) -> dict:
    """Train (and rank) one run in this process; its compare.json record. A worker process uses
    one Accelerator of its own for all its runs."""
    accelerator = accelerator or _process_accelerator()
    specs = job.specs
    train = (lambda c, a: train_and_rank(c, a, specs)) if specs is not None else _train_only
    return run_one(job.run, job.cfg, accelerator, train, job.retries, job.keep_checkpoints)


_ACCELERATOR: list = []  # a worker process's Accelerator, made by its first run


def _process_accelerator():
    if not _ACCELERATOR:
        from accelerate import Accelerator

        _ACCELERATOR.append(Accelerator())
    return _ACCELERATOR[0]


def _die_with_parent() -> None:
    """Ask the kernel to end a worker when the process that made it ends (Linux PR_SET_PDEATHSIG).
    It does in a plain pool; after a SIGKILL of `vlp compare` the workers were seen to stay (not
    understood yet): end them by hand then. Ctrl-C reaches the whole process group."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass


class Executor:
    """Runs a study's jobs: in this process (every rank, in order), or with grid.workers > 1 on
    one process, in that many spawned worker processes kept for the whole study (independent
    runs: the results are the same; only their timing shares the cores)."""

    def __init__(self, grid, acc):
        self.grid, self.acc, self.pool = grid, acc, None

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, jobs: list[Job]) -> None:
        acc = self.acc
        if self.grid.workers <= 1 or acc.num_processes > 1:
            for i, job in enumerate(jobs):
                acc.print(f"[compare] run {i + 1}/{len(jobs)}: {job.run.name}")
                rec = run_job(job, acc)
                acc.print(f"[compare] {job.run.name}: {rec['status']} in {rec['wall_time_s']:.0f} s")
            return
        from concurrent.futures import as_completed

        # most steps first, so that no long run is left going alone at the end
        longest_first = sorted(jobs, key=lambda j: -j.cfg.train.samples // (j.run.batch_per_device * j.run.accum))
        futures = {self._pool().submit(run_job, job): job.run.name for job in longest_first}
        for i, future in enumerate(as_completed(futures)):
            rec = future.result()
            print(f"[compare] {i + 1}/{len(jobs)} {futures[future]}: {rec['status']} in {rec['wall_time_s']:.0f} s",
                  flush=True)

    def _pool(self):
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(self.grid.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_die_with_parent)
        return self.pool


def _train_only(cfg, accelerator) -> dict:
    from vlp.train.loop import Trainer

    try:
        return Trainer(cfg, accelerator=accelerator).train()
    finally:
        accelerator.free_memory()
