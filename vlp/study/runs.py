"""One run of a grid or a study: its config, whether it is already done, what running it does
(`train_job`, a Job's work: an executor in vlp.executors calls it where it decides, with the
grid's retries), and the embedded data the runs use.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import yaml

from vlp.config import Config, ConfigError, from_dict, global_batch, set_dotted, stale_key, steps_for
from vlp.experiment import check
from vlp.locations import join
from vlp.checkpoint.storage import RunFolder
from vlp.train.preempt import stop_if_asked


def run_config(base: dict, grid, run, world: int = 1) -> Config:
    """The Trainer config of one run: base + per-loss overrides + the grid's coordinates."""
    tree = copy.deepcopy(base)
    sets = {**dict(run.overrides), "loss.name": run.arm.loss, "data.batch_per_device": run.arm.batch_per_device,
            "train.seed": run.seed, "train.output_dir": join(grid.out_dir, run.name),
            "train.resume": "latest"}  # an unfinished run continues from its last checkpoint
    for key, value in sets.items():
        set_dotted(tree, key, value)
    cfg = from_dict(tree)
    batch = global_batch(cfg, world)
    if cfg.train.samples < batch:
        raise ConfigError(f"config: train.samples={cfg.train.samples} gives 0 steps for {run.name} "
                          f"(global batch {batch}); raise the budget or drop the batch size")
    if grid.warmup_samples is not None:
        cfg.optim.warmup_steps = steps_for(grid.warmup_samples, batch)
    if grid.log_every_samples is not None:
        cfg.train.log_every = max(1, steps_for(grid.log_every_samples, batch))
    if not grid.keep_models:  # a study ranking the model in memory keeps no weights
        cfg.train.save_final = False
    steps, points = steps_for(cfg.train.samples, batch), grid.budget_points
    if points > 1 and run.accum == 1:  # a ranked study run: val and test at every point, the last at the end
        if steps % points:
            raise ConfigError(f"config: grid.budget_points={points} does not divide the {steps} steps of {run.name}; "
                              "choose train.samples so that every batch's steps divide by it")
        cfg.train.eval_every = steps // points
    return check(cfg)


def plan_runs(runs: list, cfgs: dict[str, Config], out: RunFolder, items: bool = False) -> tuple[list[bool], str]:
    """(done flag per run, error) of the runs in `out` (a local folder or a bucket); a run folder
    written under another config is an error, so results of two configs are never mixed in one
    table. items: done also needs eval_items.json (a study run's per-query ranks)."""
    done = []
    for run in runs:
        try:
            saved = out.read_bytes(f"{run.name}/config.yaml").decode()
        except FileNotFoundError:
            saved = None
        if saved is not None:
            why = stale_key(yaml.safe_load(saved) or {}, cfgs[run.name].to_dict())
            if why:
                return [], (f"compare: {out.path(run.name)} was run with another config ({why}); "
                            "use a new grid.out_dir or delete that folder")
        done.append(out.exists(f"{run.name}/result.json") and (not items or out.exists(f"{run.name}/eval_items.json")))
    return done, ""


def train_job(job, accelerator) -> dict:
    """A run's work (vlp.executors.Job.work): train it, and rank its val / test items where
    job.specs names them; the Trainer's result."""
    if job.specs is None:
        return train_only(job.cfg, accelerator)
    return train_and_rank(job.cfg, accelerator, job.specs)


def train_only(cfg, accelerator) -> dict:
    from vlp.train.loop import Trainer  # heavy (open_clip, the models); imported when a run starts

    return trained(lambda: Trainer(cfg, accelerator=accelerator), accelerator)


def train_and_rank(cfg, accelerator, specs: dict[str, str]) -> dict:
    """Train one run and rank its val and test items at every budget point (train.eval_every)
    and at the end: eval_points.json and eval_items.json (vlp.study.ranking)."""
    from vlp.study.ranking import RankingTrainer  # heavy (the Trainer, open_clip): a run needs it

    return trained(lambda: RankingTrainer(cfg, accelerator=accelerator, specs=specs), accelerator)


def trained(build: Callable, accelerator) -> dict:
    """``build()``'s trainer trained; no run when a stop came while it was built (GridStop)."""
    try:
        trainer = build()
        stop_if_asked()
        return trainer.train()
    finally:
        accelerator.free_memory()  # drop the prepared model/optimizer before the next run


def embedded_shards(base: dict, acc, splits: tuple[str, ...], root: Path) -> Optional[dict[str, str]]:
    """data.train_shards '' / 'openmoji', 'openclipart', 'material_icons' (optionally ':<px>'): that
    packaged data set's shards of ``splits`` rendered at 64 (or <px>) px under ``root`` (a sibling
    '<root>_<name>' folder for the other sets, a '<px>px' subfolder for other sizes), written once
    by the main process, as {split: spec}; None for other data (vlp.data.embedded)."""
    from vlp.data.embedded import DEFAULT_PX, embedded_source, prepare_shards  # heavy (PIL, renderers)

    try:
        found = embedded_source(base.setdefault("data", {}).get("train_shards"))
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    if found is None:
        return None
    name, size = found
    root = Path(root) if name == "openmoji" else Path(root).with_name(f"{Path(root).name}_{name}")
    root = root if size == DEFAULT_PX else root / f"{size}px"
    if acc.is_main_process:  # renders and writes once; the others then only read the specs
        prepare_shards(root, splits, size, source=name)
    acc.wait_for_everyone()
    return prepare_shards(root, splits, size, source=name)
