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
on 'test' (= the demo's held-out 'eval' names; data_pipelines/sources/openmoji.py).
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eval import keys
from vlp.study.runs import broadcast, embedded_shards, plan_runs, run_config, run_one
from vlp.study.stats import bootstrap_ci, paired_difference, seed_summary, verdict

REFERENCE_LOSS = "infonce"
KS = (1, 5, 10)
SPLITS = ("val", "test")


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class StudyRun:
    """One training of the study (the attributes vlp.study.compare.run_config reads)."""

    loss: str
    optim: str
    batch_per_device: int
    setting: tuple[tuple[str, Any], ...]
    seed: int
    loss_overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def arm(self) -> tuple[str, str, int]:
        return self.loss, self.optim, self.batch_per_device

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        return (*self.loss_overrides, ("optim.name", self.optim), *self.setting)

    @property
    def name(self) -> str:
        return f"{self.loss}_{self.optim}_b{self.batch_per_device}_{setting_tag(self.setting)}_s{self.seed}"


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


def sweep_runs(grid) -> list[StudyRun]:
    """Every arm × setting × sweep seed, seed-major (one full sweep first)."""
    return [StudyRun(loss, optim, batch, setting, seed, tuple(sorted(grid.loss_overrides.get(loss, {}).items())))
            for seed in grid.seeds for batch in grid.batch_per_device for optim in grid.optimizers
            for loss in grid.losses for setting in settings_for(grid.sweep, optim)]


def final_runs(grid, best: dict[tuple, tuple]) -> list[StudyRun]:
    """The selected setting of every arm with each final seed."""
    return [StudyRun(loss, optim, batch, best[(loss, optim, batch)], seed,
                     tuple(sorted(grid.loss_overrides.get(loss, {}).items())))
            for seed in grid.final_seeds for batch in grid.batch_per_device for optim in grid.optimizers
            for loss in grid.losses if (loss, optim, batch) in best]


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
        loss, optim, batch = arm
        entry = {"arm": arm, "loss": loss, "optim": optim, "batch_per_device": batch,
                 "setting": members[0]["setting"], "n": len(members)}
        for key in metrics + DIAG:
            entry[key] = seed_summary([r.get(key) for r in members])
        for key in metrics:
            boot = [r.get(f"boot/{key}") for r in members if r.get(f"boot/{key}")]
            entry[f"boot/{key}"] = (sum(b[0] for b in boot) / len(boot), sum(b[1] for b in boot) / len(boot)) \
                if boot else None
            ref = {r["seed"]: r.get(key) for r in by_arm.get((reference, optim, batch), [])}
            entry[f"diff/{key}"] = None if loss == reference else paired_difference(
                {r["seed"]: r.get(key) for r in members}, ref)
        table.append(entry)
    return table


DIAG = ("grad_ratio", "logit_scale", "infonce", "frac_saturated")


# ---------------------------------------------------------------------------- rows
def study_row(run: StudyRun, run_dir: Path, metric_keys: tuple[str, ...], n_boot: int = 1000) -> Optional[dict]:
    """A run's row: status, val and test metrics from eval_items.json, bootstrap intervals of the
    test metrics, final diagnostics. None if the run was never attempted."""
    from vlp.study.report import read_log

    items_path, record_path = run_dir / "eval_items.json", run_dir / "compare.json"
    if not items_path.is_file() and not record_path.is_file():
        return None
    row = {"run": run.name, "arm": run.arm, "loss": run.loss, "optim": run.optim,
           "batch_per_device": run.batch_per_device, "setting": run.setting, "seed": run.seed,
           "status": "ok" if items_path.is_file() and (run_dir / "result.json").is_file() else "failed"}
    if row["status"] != "ok":
        row["error"] = json.loads(record_path.read_text()).get("error", "") if record_path.is_file() else ""
        return row
    items = json.loads(items_path.read_text())
    for split in SPLITS:
        row.update({f"{split}/{k}": v for k, v in split_metrics(items[split]).items()})
    for key in metric_keys:  # e.g. mean_R@10 -> bootstrap over the test items
        k = int(key.rsplit("@", 1)[1])
        row[f"boot/test/{key}"] = bootstrap_ci(item_hits(items["test"], k), n_boot=n_boot, seed=run.seed)
    log = read_log(run_dir / "log.jsonl")
    last = log[-1] if log else {}
    row.update({k: last.get(k) for k in DIAG})
    result = json.loads((run_dir / "result.json").read_text())
    row.update({"steps": result.get("step"), "samples_seen": result.get("samples_seen"),
                "global_batch": result.get("global_batch"), "wall_time_s": result.get("train_time_s")})
    return row


# ---------------------------------------------------------------------------- eval items
def eval_item_ranks(model, tokenizer, transform, spec: str, device, batch_size: int = 256) -> dict[str, list[int]]:
    """1-based rank of the correct item for every query of a retrieval set, both directions: the
    eval suite's reader and ranking (eval.suite, eval.retrieval), ties included."""
    import torch

    from eval.retrieval import retrieval_ranks
    from eval.suite import embed_retrieval_shards

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
            items = {split: eval_item_ranks(model, trainer.tokenizer, trainer.eval_transform, specs[split],
                                            accelerator.device, cfg.eval.batch_size) for split in SPLITS}
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
    loss, optim, batch = arm
    return f"{loss}/{optim}/b{batch}"


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
        table = settings_for(grid.sweep, arm[1])
        keys = {k: sorted({dict(s)[k] for s in table}) for k, _ in (table[0] if table else ())}
        for key, value in setting:
            values = keys.get(key, [])
            if len(values) >= 3 and value in (values[0], values[-1]):
                notes.append(f"{arm_label(arm)}: {key}={value:g}" if isinstance(value, float)
                             else f"{arm_label(arm)}: {key}={value}")
    return notes


def final_markdown(table: list[dict], metrics: tuple[str, ...]) -> str:
    head = ["arm (loss/optimizer/batch)", "setting", "seeds"]
    for m in metrics:
        head += [f"test {m} (%) mean ± std [95 % CI]", f"per-run bootstrap 95 % ({m})", f"Δ vs infonce ({m}) [95 % CI]"]
    head += ["grad_ratio", "logit_scale", "InfoNCE (last step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(table, key=lambda e: (e["batch_per_device"], e["optim"], e["loss"] != REFERENCE_LOSS, e["loss"])):
        cells = [arm_label(e["arm"]), setting_tag(e["setting"]), str(e["n"])]
        for m in metrics:
            boot = e.get(f"boot/{m}")
            d = e.get(f"diff/{m}")
            cells += [_pct(e.get(m)), "—" if boot is None else f"[{100 * boot[0]:.1f}, {100 * boot[1]:.1f}]",
                      "ref" if e["loss"] == REFERENCE_LOSS else
                      ("—" if d is None else f"{100 * d['mean']:+.1f}" + ("" if d["lo"] is None else
                       f" [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]") + (" ✓" if d["resolved"] else ""))]
        cells += [_num(e.get("grad_ratio")), _num(e.get("logit_scale")), _num(e.get("infonce"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(table: list[dict], metric: str) -> list[str]:
    """One sentence per (optimizer, batch) with a reference arm."""
    out = []
    groups = sorted({(e["optim"], e["batch_per_device"]) for e in table})
    for optim, batch in groups:
        diffs = {e["loss"]: e.get(f"diff/{metric}") for e in table
                 if e["optim"] == optim and e["batch_per_device"] == batch and e["loss"] != REFERENCE_LOSS}
        if diffs:
            out.append(f"{optim}, batch {batch}: " + verdict(diffs, REFERENCE_LOSS, f"test {metric}"))
    return out


def plot_final(table: list[dict], metric: str, path: Optional[Path] = None):
    """Left: test metric per arm, mean with 95 % CI over seeds (std when one seed). Right: paired
    difference to InfoNCE per arm with its 95 % CI; seeds' own differences as dots."""
    from vlp.study.report import figure

    fig = figure(figsize=(11, 4))
    ax, ax_d = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    table = sorted(table, key=lambda e: (e["batch_per_device"], e["optim"], e["loss"] != REFERENCE_LOSS, e["loss"]))
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


LOSS_COLOURS = {"infonce": "tab:blue", "flatnce": "tab:orange", "sogclr": "tab:green", "siglip": "tab:purple"}
OPTIM_STYLES = {"adamw": "-", "lars": "--", "sgd": ":"}
CURVE_KEYS = ("infonce", "grad_ratio", "logit_scale", "log_xi", "frac_saturated")


def plot_study_curves(curves: dict[tuple, list[list[dict]]], path: Optional[Path] = None):
    """Diagnostics vs samples seen, mean over the final seeds of each arm; colour = loss,
    line style = optimizer, width = batch (thicker = larger)."""
    from vlp.study.report import figure, mean_curve

    fig = figure(figsize=(15, 7))
    axes = [fig.add_subplot(2, 3, i + 1) for i in range(len(CURVE_KEYS))]
    batches = sorted({arm[2] for arm in curves})
    for arm, logs in curves.items():
        loss, optim, batch = arm
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


def write_study_report(out: Path, sweep_rows: list[dict], final_rows: list[dict], best: dict, grid) -> str:
    """study.md, final.csv-like JSON, final.png and curves.png; returns the markdown."""
    from vlp.study.report import read_log

    metrics = ("mean_R@1", "mean_R@10")
    test_rows = [{**r, **{m: r.get(f"test/{m}") for m in metrics},
                  **{f"boot/{m}": r.get(f"boot/test/{m}") for m in metrics}} for r in final_rows]
    table = final_table(test_rows, metrics)
    failed = [f"{r['run']} ({r.get('error', '')})" for r in sweep_rows + final_rows if r["status"] != "ok"]
    lines = [
        "# Tuned loss comparison (sweep on val, seeds on test)", "",
        f"Arms: losses {grid.losses} × optimizers {grid.optimizers} × batch per GPU {grid.batch_per_device}; "
        f"sweep {json.dumps(grid.sweep)} with seeds {grid.seeds}, selected on val {grid.select_metric}; "
        f"final seeds {grid.final_seeds}. Every run sees the same budget of samples.", "",
        "## Sweep (val)", "", sweep_markdown(sweep_rows, best, grid.select_metric), "",
        *([f"Selected at the edge of its sweep (the optimum may lie outside): {'; '.join(edges)}.", ""]
          if (edges := edge_selections(best, grid)) else []),
        "## Final (test)", "",
        "Cells: mean ± std over seeds [95 % t-interval]; per-run bootstrap: mean over seeds of each run's 95 % "
        "bootstrap interval over test items; Δ: paired by seed against infonce with the same optimizer and "
        "batch (✓ = 95 % CI excludes 0); diagnostics from the last training step.", "",
        final_markdown(table, metrics), "",
        *[f"- {v}" for v in verdicts(table, grid.metric)], "",
    ]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed), ""]
    text = "\n".join(lines)
    (out / "study.md").write_text(text)
    (out / "study.json").write_text(json.dumps({
        "best": [{"arm": list(a), "setting": [list(kv) for kv in s]} for a, s in best.items()],
        "final": [{k: v for k, v in e.items() if k != "arm"} for e in table]}, indent=1, default=str))
    plot_final(table, grid.metric, out / "final.png")
    curves: dict[tuple, list] = {}
    for r in final_rows:
        if r["status"] == "ok":
            curves.setdefault(r["arm"], []).append(read_log(out / r["run"] / "log.jsonl"))
    plot_study_curves(curves, out / "curves.png")
    return text


# ---------------------------------------------------------------------------- the loop
def resolve_study_data(base: dict, acc, cache: Path) -> tuple[dict, dict[str, str]]:
    """data.train_shards 'openmoji'/'': fit/val/test OpenMoji shards. Otherwise data.train_shards
    is trained on and data.eval_shards (val) and grid.test_shards must be given."""
    specs = embedded_shards(base, acc, ("fit", "val", "test"), cache)
    data = base["data"]
    if specs is not None:
        data["train_shards"], data["eval_shards"] = specs["fit"], specs["val"]
        return base, {"val": specs["val"], "test": specs["test"]}
    return base, {"val": data.get("eval_shards"), "test": None}


def run_study(base: dict, grid, acc, report_only: bool = False) -> dict:
    """Sweep, select, final seeds, report. Every process walks the same runs in the same order."""
    from vlp.config import ConfigError

    base, specs = resolve_study_data(copy.deepcopy(base), acc, Path(".cache") / "shards" / "openmoji_study")
    if grid.test_shards:
        specs["test"] = grid.test_shards
    if not specs["val"] or not specs["test"]:
        raise ConfigError("config: a study (grid.sweep) needs data.eval_shards (val) and grid.test_shards "
                          "(or data.train_shards: openmoji)")
    out = Path(grid.out_dir)
    metric_keys = tuple(k for k in ("mean_R@1", "mean_R@10"))

    def walk(runs: list[StudyRun]) -> list[dict]:
        cfgs = {r.name: run_config(base, grid, r, acc.num_processes) for r in runs}
        done, error = broadcast(plan_runs(runs, cfgs, out, items=True) if acc.is_main_process else None, acc)
        if error:
            raise ConfigError(error)
        todo = [r for r, d in zip(runs, done) if not d]
        acc.print(f"[compare] {len(runs)} runs ({len(runs) - len(todo)} already done) -> {out}")
        for i, run in enumerate(todo):
            if report_only:
                break
            acc.print(f"[compare] run {i + 1}/{len(todo)}: {run.name}")
            rec = run_one(run, cfgs[run.name], acc, lambda cfg, a: train_and_rank(cfg, a, specs),
                          grid.retries, grid.keep_checkpoints)
            acc.print(f"[compare] {run.name}: {rec['status']} in {rec['wall_time_s']:.0f} s")
        return [row for r in runs if (row := study_row(r, out / r.name, metric_keys)) is not None]

    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    sweep = walk(sweep_runs(grid))
    best = broadcast(select_best(sweep, grid.select_metric) if acc.is_main_process else None, acc)
    finals = walk(final_runs(grid, best))
    text = ""
    if acc.is_main_process:
        text = write_study_report(out, sweep, finals, best, grid)
        print(text, flush=True)
    return {"sweep": sweep, "final": finals, "best": best, "report": text}
