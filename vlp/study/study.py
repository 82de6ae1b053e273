"""The driver of `vlp compare`: it decides which runs run next, and an executor (vlp.executors)
runs them where grid.executor says. A plain grid is a study with no sweep and no seeds rule: every
arm's one setting with each seed, evaluated by the Trainer. A tuned study (grid.sweep): sweep,
extend at the edges (vlp.study.tuning) and select on val, final seeds, more seeds where a verdict is
open (vlp.study.adaptive), price runs, report on test (docs/map.md tells each step).

vlp.study.plan says which runs (pure), vlp.study.runs what a run does, vlp.study.rows / report
report them; this module walks the steps. Reruns skip done runs (result.json, and eval_items.json
where ranked).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import yaml

from vlp.checkpoint.storage import open_run_folder
from vlp.config import ConfigError, set_dotted
from vlp.data.shard_list import sizes_from_spec
from vlp.distributed import broadcast_object
from vlp.data.sources import parse_packaged
from vlp.study.adaptive import more_seed_runs, open_arms, seeds_of_look, sizes_of
from vlp.executors import Executor, Job, executor_of
from vlp.study.plan import Run, arms_of, final_runs, groups_of, price_runs, select_best, sweep_runs
from vlp.study.report import STUDY_METRICS, test_rows, write_report
from vlp.study.rows import final_table, run_row
from vlp.study.runs import embedded_shards, plan_runs, run_config, train_job
from vlp.study.tuning import extension_runs, tried_settings
from vlp.study.userdata import user_specs

DEFAULT_SOURCE = "openmoji"

STUDY_SHARDS = Path(".cache") / "shards" / "openmoji_study"


def with_dataset(tree: dict, dataset: str, user: Optional[dict] = None) -> dict:
    """The base config of one data set of grid.datasets: data.train_shards names it, at the size
    the regime renders ('openmoji:128' -> 'openclipart:128'). Its val and test are that set's.
    ``user``: your own data set's {fit, val, test} shard specs (vlp.study.userdata): fit is trained
    on and val becomes data.eval_shards (the regime's packaged name and render size are dropped)."""
    if not dataset:
        return tree
    data = tree.setdefault("data", {})
    if data.get("eval_shards"):
        raise ConfigError("config: grid.datasets ranks each data set's own val and test: leave data.eval_shards unset")
    if user is not None:
        data["train_shards"], data["eval_shards"] = user["fit"], user["val"]
        return tree
    spec = data.get("train_shards") or DEFAULT_SOURCE
    try:
        parsed = parse_packaged(spec)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    if parsed is None:
        raise ConfigError(f"config: grid.datasets needs data.train_shards to name a packaged data set, got {spec!r}")
    data["train_shards"] = f"{dataset}:{parsed[1]}" if parsed[1] else dataset
    return tree


def regime_bases(base: dict, grid, acc) -> dict[tuple[str, str], tuple[dict, Optional[dict[str, str]]]]:
    """Per (data set, regime): (its base config = base + the regime's settings, the data set
    named, data resolved; its val and test shard specs, None for a plain grid's Trainer eval).
    data.train_shards '' or 'openmoji' (':<px>'): the embedded OpenMoji shards, a plain grid's
    train and held-out eval, a study's fit, val and test; data.eval_shards, when given, is the
    eval (val) set. A study clears data.eval_shards: it ranks val and test itself (eval_items.json)."""
    if not grid.sweep:
        from vlp.data.embedded import SHARD_CACHE  # heavy (the renderer); only the embedded data needs it

        tree = copy.deepcopy(base)
        specs = embedded_shards(tree, acc, ("train", "eval"), SHARD_CACHE)
        if specs is not None:
            tree["data"]["train_shards"] = specs["train"]
            tree["data"]["eval_shards"] = tree["data"].get("eval_shards") or specs["eval"]
        return {("", ""): (tree, None)}
    if grid.datasets and grid.test_shards:
        raise ConfigError("config: grid.datasets ranks each data set's own val and test: leave grid.test_shards unset")
    out, users = {}, {}
    for dataset, regime in groups_of(grid):
        tree = copy.deepcopy(base)
        for key, value in ((grid.regimes.get(regime) or {}).get("set") or {}).items():
            set_dotted(tree, key, value)
        if dataset and dataset not in users:
            users[dataset] = user_specs(dataset, grid.datasets[dataset], acc)
        user = users.get(dataset)
        tree = with_dataset(tree, dataset, user)
        found = embedded_shards(tree, acc, ("fit", "val", "test"), STUDY_SHARDS) or {}
        data = tree["data"]
        val, data["eval_shards"] = data.get("eval_shards") or found.get("val"), None
        if found:
            data["train_shards"] = found["fit"]
        specs = {"val": val, "test": grid.test_shards or (user or {}).get("test") or found.get("test")}
        if not specs["val"] or not specs["test"]:
            raise ConfigError("config: a study (grid.sweep) needs data.eval_shards (val) and grid.test_shards "
                              "(or data.train_shards: openmoji)")
        out[(dataset, regime)] = (tree, specs)
    return out


def fit_sizes(bases: dict) -> dict[tuple[str, str], Optional[int]]:
    """Per (data set, regime): the pairs of its training set (None where its shards carry no
    sizes.json), for the epochs the budget implies."""
    out = {}
    for group, (tree, _) in bases.items():
        try:
            out[group] = sizes_from_spec(tree["data"]["train_shards"])
        except (OSError, ValueError):
            out[group] = None
    return out


class StudyWalk:
    """One step of the grid (its runs, a sweep's, the final or price runs): plan which are done,
    run the rest with the grid's Executor, read every run's row. ``on_done``: called after each
    run (a plain grid rewrites its report)."""

    def __init__(self, grid, acc, bases: dict, executor: Executor, report_only: bool, on_done=None):
        self.grid, self.acc, self.bases, self.executor, self.report_only = grid, acc, bases, executor, report_only
        self.out, self.on_done = open_run_folder(grid.out_dir, option="grid.out_dir"), on_done
        self.cfgs: dict = {}  # every walked run's config, by name
        self.world = executor.world_of  # a run's processes by its regime (a job's: its own resources)

    def __call__(self, runs: list[Run], ranked: bool = True) -> list[dict]:
        if not runs:
            return []
        grid, acc, out = self.grid, self.acc, self.out
        ranked = ranked and bool(grid.sweep)  # a plain grid's runs are evaluated by the Trainer
        cfgs = {r.name: run_config(self.bases[r.arm.table][0], grid, r, self.world(r.arm.regime)) for r in runs}
        self.cfgs.update(cfgs)
        done, error = broadcast_object(plan_runs(runs, cfgs, out, items=ranked) if acc.is_main_process else None)
        if error:  # raised on every rank, so none waits in a collective
            raise ConfigError(error)
        todo = [(i, r) for i, (r, d) in enumerate(zip(runs, done), 1) if not d]
        acc.print(f"[compare] {len(runs)} runs ({len(runs) - len(todo)} already done) -> {out.path()}")
        if todo and not self.report_only:
            self.executor.run([Job(r, cfgs[r.name], self.bases[r.arm.table][1] if ranked else None, grid.retries,
                                   grid.keep_checkpoints, i, work=train_job) for i, r in todo],
                              total=len(runs), on_done=self.on_done)
        return self.rows(runs, ranked)

    def rows(self, runs: list[Run], ranked: bool) -> list[dict]:
        return [row for r in runs if (row := run_row(r, self.cfgs[r.name], self.world(r.arm.regime), ranked,
                                                     STUDY_METRICS)) is not None]


def tune(walk: StudyWalk, grid, acc) -> tuple[list[dict], dict, dict]:
    """The sweep, then its edge extension (grid.sweep_bounds; vlp.study.tuning) until every
    selection is interior or at a bound: (sweep rows, the selection, the settings tried per arm).
    Each round adds settings not tried before, inside the bounds, so the walk ends."""
    planned = sweep_runs(grid)
    rows = walk(planned)
    while True:
        best = broadcast_object(select_best(rows, grid.select_metric) if acc.is_main_process else None)
        new = extension_runs(grid, best, tried_settings(planned))
        if not new:
            ok = {row["run"] for row in rows if row["status"] == "ok"}
            return rows, best, tried_settings([r for r in planned if r.name in ok])
        planned += new
        rows += walk(new)


def add_seeds(walk: StudyWalk, grid, acc, best: dict, finals: list[dict]) -> list[dict]:
    """grid.seeds_until: at each planned look after the first, the comparisons still open on test
    grid.metric (vlp.study.adaptive.open_arms) get the look's new seeds (with their references);
    settled ones get none. Returns the final rows with the new seeds' rows."""
    sizes, finals = sizes_of(grid), list(finals)
    for look in range(1, len(sizes)):
        table = final_table(test_rows(finals), (grid.metric,), looks=len(sizes)) if acc.is_main_process else None
        arms = broadcast_object(open_arms(table, grid, sizes[look - 1]) if acc.is_main_process else None)
        runs = more_seed_runs(grid, best, arms, seeds_of_look(grid, look))
        new = walk(runs) if runs else []
        if not new:  # nothing open (or --report-only before these seeds ran)
            break
        finals += new
    return finals


def run_study(base: dict, bases: dict, grid, acc, report_only: bool = False) -> dict:
    """Sweep (extended at its edges) and select, final seeds, more seeds where open, price runs,
    report; a plain grid: its runs, the report rewritten after each. Every process walks the same
    runs in the same order; with grid.workers > 1 (one process) runs go to worker processes.
    `bases`: regime_bases(base, grid, acc)."""
    plain = {arm: () for arm in arms_of(grid)} if not grid.sweep else None
    with executor_of(grid, acc) as executor:  # local, or a scheduler's jobs (vlp.executors.batch)
        if grid.sweep and not report_only:  # here, or a job per (data set, regime) before its runs
            executor.warm(bases)
        walk = StudyWalk(grid, acc, bases, executor, report_only)
        if plain is not None:  # the report after every run: partial results are always on disk
            runs = final_runs(grid, plain)
            walk.on_done = lambda job, record: acc.is_main_process and write_report(
                walk.out, {"final": walk.rows(runs, False), "best": plain}, grid)
        sweep, best, tried = tune(walk, grid, acc) if plain is None else ([], plain, {})
        finals = add_seeds(walk, grid, acc, best, walk(final_runs(grid, best)))
        prices = walk(price_runs(grid, best), ranked=False)
    result = {"sweep": sweep, "final": finals, "best": best, "price": prices, "tried": tried, "report": ""}
    if acc.is_main_process:
        with walk.out.file("compare_config.yaml") as path:
            path.write_text(yaml.safe_dump({**base, "grid": dataclasses.asdict(grid)}, sort_keys=False))
        result["report"] = write_report(walk.out, result, grid, {"fit_sizes": fit_sizes(bases) if grid.sweep else {}})
        print(result["report"], flush=True)
    walk.out.close()
    return result
