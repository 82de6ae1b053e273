"""One run of a grid or a study: its config, whether it is already done, what running it does
(`train_job`, with retries; an executor in vlp.executors calls it where it decides), and the
embedded data the runs use.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from vlp.config import Config, ConfigError, from_dict, global_batch, set_dotted, steps_for

from vlp.experiment import check
from vlp.locations import is_url
from vlp.checkpoint.storage import RunFolder
from vlp.study.grid import flatten
from vlp.study.plan import SPLITS
from vlp.checkpoint import resume as resume_rules
from vlp.train.preempt import Preempted, stop_if_asked

# Keys that may change between a finished run and a rerun without making the run stale: the
# resume rules table's keys that do not change results (vlp.checkpoint.resume.RESUME_RULES).
HARMLESS_KEYS = tuple(k for k, rule in resume_rules.RESUME_RULES.items() if not rule.results)


def run_config(base: dict, grid, run, world: int = 1) -> Config:
    """The Trainer config of one run: base + per-loss overrides + the grid's coordinates."""
    tree = copy.deepcopy(base)
    sets = {**dict(run.overrides), "loss.name": run.arm.loss, "data.batch_per_device": run.arm.batch_per_device,
            "train.seed": run.seed, "train.output_dir": run_dir(grid.out_dir, run.name),
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


def run_dir(out_dir: str, name: str) -> str:
    """The folder of run `name` in a grid's out_dir (a path, or a URL: s3://b/grid/run)."""
    return f"{str(out_dir).rstrip('/')}/{name}" if is_url(out_dir) else str(Path(out_dir) / name)


def stale_key(saved: dict, current: dict) -> Optional[str]:
    """First dotted key whose value differs between a run's saved config and the current one
    (keys only one side has are ignored: a field added to Config later keeps old runs valid)."""
    a, b = flatten(saved), flatten(current)
    for key in sorted(set(a) & set(b)):
        if key not in HARMLESS_KEYS and a[key] != b[key]:
            return f"{key}: {a.get(key)!r} then, {b.get(key)!r} now"
    return None


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


def run_one(run, cfg: Config, accelerator, train: Callable, retries: int = 1, keep_checkpoints: bool = True) -> dict:
    """Train + eval one run (``train(cfg, accelerator)``), retrying on exceptions; writes
    compare.json (main). Returns its record."""
    t0 = time.time()
    status, error, attempts = "failed", "", 0
    for attempts in range(1, retries + 2):
        try:
            train(cfg, accelerator)
            status, error = "ok", ""
            break
        except Preempted:  # saved; the grid stops here and a rerun resumes this run (train.resume=latest)
            raise
        except Exception as e:  # noqa: BLE001 - a crashed run must not stop the grid
            error = (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:300]
            if accelerator.is_main_process:
                print(f"[compare] {run.name}: attempt {attempts} failed: {error}", flush=True)
    record = {"status": status, "error": error, "attempts": attempts, "wall_time_s": time.time() - t0}
    if accelerator.is_main_process:
        folder = RunFolder(cfg.train.output_dir)  # a local folder or a bucket
        with folder.file("compare.json") as path:
            path.write_text(json.dumps(record, indent=2))
        if status == "ok" and not keep_checkpoints:
            folder.remove("checkpoints", tree=True)
    accelerator.wait_for_everyone()
    return record


def train_job(job, accelerator) -> dict:
    """What an executor runs for a vlp.executors.Job: train its run (and rank its val / test items
    where job.specs), or build its (data set, regime)'s feature caches (job.warm); its record."""
    specs = job.specs
    train = (lambda c, a: train_and_rank(c, a, specs)) if specs is not None else train_only
    if job.warm:
        train = lambda c, a: warm_one(c, a, specs)  # noqa: E731
    return run_one(job.run, job.cfg, accelerator, train, job.retries, job.keep_checkpoints)


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


def warm_caches(bases: dict, grid, acc) -> None:
    """Build the locked-tower feature caches (data.feature_cache) of every (data set, regime) here,
    before any run; the runs (and worker processes, from the cache folder) only read them."""
    import torch  # heavy: only a process that builds caches needs it

    for tree, specs in bases.values():
        cfg = check(from_dict(copy.deepcopy(tree)))
        if cfg.data.feature_cache:
            with threads(grid.workers if acc.num_processes == 1 else torch.get_num_threads()):
                build_caches(cfg, specs, acc)


def warm_one(cfg, accelerator, specs: dict) -> dict:
    """One (data set, regime)'s caches as a job of its own (a batch scheduler's warm-up job; its
    folder is cfg.train.output_dir): then result.json says they are built."""
    t0 = time.time()
    build_caches(cfg, specs, accelerator)
    if accelerator.is_main_process:
        with RunFolder(cfg.train.output_dir).file("result.json") as path:
            path.write_text(json.dumps({"feature_cache": cfg.data.feature_cache, "warm_time_s": time.time() - t0}))
    return {}


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads raised to ``n`` inside (the workers' cores are idle meanwhile)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(before, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_caches(cfg, specs: dict, acc) -> None:
    """One regime's caches: its training shards' stem outputs (every rank) and its val and test
    sets' (main process)."""
    from vlp.models.model import build_model  # heavy (open_clip, the towers), as above
    from vlp.data.train_data import TrainData
    from vlp.train.feature_cache import retrieval_features, training_features

    model, tokenizer, transform, eval_t = build_model(cfg.model, cfg.loss, data_cfg=cfg.data)
    plan = TrainData(cfg, transform, tokenizer, acc.process_index, acc.num_processes).loader.plan
    training_features(cfg, model, transform, tokenizer, plan, acc.device)  # collective: every rank
    if acc.is_main_process:
        folder = None if cfg.data.feature_cache == "memory" else cfg.data.feature_cache
        for split in SPLITS:
            retrieval_features(model, tokenizer, eval_t, specs[split], acc.device, cfg.eval.batch_size, folder)
    acc.wait_for_everyone()


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
