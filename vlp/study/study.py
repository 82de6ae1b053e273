"""The tuned study of `vlp compare` (a grid with `grid.sweep`): every arm tuned with the same
budget, selected on val, reported on test with seeds and paired statistics.

    arm      = (regime, loss, optimizer, per-GPU batch)
    sweep    = the same settings grid for every arm (per optimizer: an AdamW lr range is not a
               LARS one; per regime if it has its own), run with grid.seeds: val metric per setting
    select   = per arm, the setting with the best mean val metric over those seeds
    final    = the selected setting per arm with grid.final_seeds (a sweep run with the same
               setting and seed is reused, not rerun): test metrics
    price    = grid.accum_price: the batch b·k as k accumulated micro-batches of b, timed
    report   = study.md (sweep, final, verdicts, the map, cost), study.json and the figures

The three rooms: vlp.study.plan says which runs (pure), vlp.study.runs / vlp.study.executor run
them, vlp.study.rows / tables / plots / report report them. This module walks the steps.

Runs: <out_dir>/<regime>_<loss>_<optim>_b<batch>_<setting>_s<seed>/ (Trainer files + eval_items.json,
the 1-based rank of every val and test query in both directions, from which all study metrics
and bootstraps are computed). Reruns skip runs with result.json and eval_items.json.
Data: data.train_shards 'openmoji' trains on the OpenMoji 'fit' names, selects on 'val' and reports
on 'test' (= the demo's held-out 'eval' names; vlp/data/sources/openmoji.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

from vlp.config import ConfigError, set_dotted
from vlp.study.executor import Executor, Job, warm_caches
from vlp.study.plan import StudyRun, final_runs, price_runs, regimes_of, select_best, sweep_runs
from vlp.study.report import STUDY_METRICS, write_study_report
from vlp.study.rows import study_row
from vlp.study.runs import broadcast, embedded_shards, plan_runs, run_config

STUDY_SHARDS = Path(".cache") / "shards" / "openmoji_study"


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
    out = {}
    for regime in regimes_of(grid):
        tree = copy.deepcopy(base)
        for key, value in ((grid.regimes.get(regime) or {}).get("set") or {}).items():
            set_dotted(tree, key, value)
        tree, specs = resolve_study_data(tree, acc, STUDY_SHARDS)
        if grid.test_shards:
            specs["test"] = grid.test_shards
        if not specs["val"] or not specs["test"]:
            raise ConfigError("config: a study (grid.sweep) needs data.eval_shards (val) and grid.test_shards "
                              "(or data.train_shards: openmoji)")
        out[regime] = (tree, specs)
    return out


class StudyWalk:
    """One step of the study (sweep, final or price runs): plan which are done, run the rest
    with the study's Executor, read every run's row."""

    def __init__(self, grid, acc, bases: dict, executor: Executor, report_only: bool):
        self.grid, self.acc, self.bases, self.executor, self.report_only = grid, acc, bases, executor, report_only
        self.out = Path(grid.out_dir)

    def __call__(self, runs: list[StudyRun], ranked: bool = True) -> list[dict]:
        grid, acc, out = self.grid, self.acc, self.out
        cfgs = {r.name: run_config(self.bases[r.regime][0], grid, r, acc.num_processes) for r in runs}
        done, error = broadcast(plan_runs(runs, cfgs, out, items=ranked) if acc.is_main_process else None, acc)
        if error:
            raise ConfigError(error)
        todo = [(i, r) for i, (r, d) in enumerate(zip(runs, done), 1) if not d]
        acc.print(f"[compare] {len(runs)} runs ({len(runs) - len(todo)} already done) -> {out}")
        if todo and not self.report_only:
            self.executor.run([Job(r, cfgs[r.name], self.bases[r.regime][1] if ranked else None, grid.retries,
                                   grid.keep_checkpoints, i) for i, r in todo], total=len(runs))
        return [row for r in runs if (row := study_row(r, out / r.name, STUDY_METRICS, items=ranked)) is not None]


def run_study(base: dict, grid, acc, report_only: bool = False) -> dict:
    """Sweep, select, final seeds, price runs, report. Every process walks the same runs in the
    same order; with grid.workers > 1 (one process) runs go to that many worker processes."""
    bases = regime_bases(base, grid, acc)
    out = Path(grid.out_dir)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    if not report_only:
        warm_caches(bases, grid, acc)
    with Executor(grid, acc) as executor:
        walk = StudyWalk(grid, acc, bases, executor, report_only)
        sweep = walk(sweep_runs(grid))
        best = broadcast(select_best(sweep, grid.select_metric) if acc.is_main_process else None, acc)
        finals = walk(final_runs(grid, best))
        prices = walk(price_runs(grid, best), ranked=False)
    text = ""
    if acc.is_main_process:
        text = write_study_report(out, sweep, finals, best, grid, prices)
        print(text, flush=True)
    return {"sweep": sweep, "final": finals, "best": best, "price": prices, "report": text}
