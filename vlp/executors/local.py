"""The run room's executor: one `Executor` runs the jobs of every grid (a plain grid and each
step of a tuned study), in this process or in worker processes, and the training functions a
job calls (train only, or train and rank the val / test items).

    with Executor(grid, accelerator) as ex:
        ex.run([Job(run, cfg, specs), ...], total=len(all_runs), on_done=callback)

In this process (grid.workers == 1, or several processes under `accelerate launch`): every rank
walks the jobs in the same order (the Trainer's collectives need it). With grid.workers > 1 on
one process: that many spawned worker processes, kept for the whole grid; each job is an
independent run, so the results do not depend on the number of workers, only the timing.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from vlp.checkpoint.storage import RunFolder
from vlp.config import from_dict, global_batch, steps_for

from vlp.experiment import check
from vlp.study.plan import SPLITS
from vlp.study.runs import run_one
from vlp.train.preempt import EXIT_PREEMPTED, HUNG_UP, SIGNALS, Preempted, Preemption

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_GRID_STOP: list = []  # this process's Ctrl-C watch while it runs a grid's jobs (see GridStop)


@dataclass(frozen=True)
class Job:
    """One run to execute: its config, the val / test specs it is ranked on (None: trained only,
    a plain grid's run or a price run), and the grid's retry and checkpoint policy; ``index``:
    its 1-based place among the runs of its grid (for the progress line); ``warm``: not a run but
    a (data set, regime)'s feature-cache warm-up, a job of its own under a batch scheduler
    (vlp.study.batch; `warm_one`). Picklable."""

    run: Any
    cfg: Any
    specs: Optional[dict] = None
    retries: int = 1
    keep_checkpoints: bool = True
    index: int = 0
    warm: bool = False


def run_job(job: Job, accelerator=None) -> dict:
    """Train (and rank) one run in this process; its compare.json record. A worker process uses
    one Accelerator of its own for all its runs. A Ctrl-C that came before: no run, KeyboardInterrupt."""
    stop_if_asked()
    accelerator = accelerator or _process_accelerator()
    specs = job.specs
    train = (lambda c, a: train_and_rank(c, a, specs)) if specs is not None else train_only
    if job.warm:
        train = lambda c, a: warm_one(c, a, specs)  # noqa: E731
    return run_one(job.run, job.cfg, accelerator, train, job.retries, job.keep_checkpoints)


class GridStop:
    """A stop signal (Ctrl-C, SIGTERM, SIGUSR1) around the runs of a grid, in the process that runs
    them (`vlp compare` itself, or each worker process for its whole life). Inside a run's training
    loop the Trainer takes it (vlp.train.preempt: save at the step boundary, raise Preempted).
    Elsewhere it would be lost or land anywhere: in a run's start-up or final evaluation the
    Trainer's flag is never read again (the run finished and the grid went on to its next runs),
    between runs a KeyboardInterrupt raised inside a weakref callback is printed and ignored, and
    SIGTERM / SIGUSR1 killed the process. So the signals only set a flag here (a Preemption: the
    first Ctrl-C's line in the main process, a second one exits at once), and `stop_if_asked`
    raises at the points where stopping loses nothing: before a run starts, once its Trainer is
    built, and after a run. A run that took a Ctrl-C and still finished (it came during its final
    evaluation) leaves its own SIGINT handler in place (Preemption.uninstall keeps counting): that
    counts as asked too."""

    def __enter__(self) -> Preemption:
        stop = Preemption().install()
        _GRID_STOP.append(stop)
        return stop

    def __exit__(self, *exc) -> None:
        stop = _GRID_STOP.pop()
        if stop.holds(signal.SIGINT):
            stop.uninstall()
        # else a run stopped for a Ctrl-C: its watch goes on counting (a second one exits at once)


def stop_if_asked() -> None:
    """Raise `grid_stopped` when a stop signal reached this process since its grid began (GridStop)."""
    if not _GRID_STOP or threading.current_thread() is not threading.main_thread():
        return
    stop = _GRID_STOP[-1]
    if stop.requested or not stop.holds(signal.SIGINT):
        raise grid_stopped(stop)


def grid_stopped(stop: Preemption) -> BaseException:
    """What a grid stopped between runs raises: KeyboardInterrupt for a Ctrl-C (vlp.cli: one line,
    exit 130), else Preempted with one line saying that the finished runs are kept (exit 75)."""
    if stop.received in (None, signal.SIGINT):  # None: a run's own handler took the Ctrl-C
        return KeyboardInterrupt()
    status, stopped = (HUNG_UP, "hung up") if stop.received == signal.SIGHUP else (EXIT_PREEMPTED, "preempted")
    return Preempted(0, signame=stop.signame, status=status, line=(
        f"{stopped} ({stop.signame}) between runs; the finished runs are kept: run the same command again to go on"))


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the spawned workers' shared memory) with SIGUSR1
    and SIGHUP ignored, as it ignores SIGINT and SIGTERM itself: a SIGUSR1 to the group killed it,
    and its replacement printed a KeyError traceback for every segment it had not seen."""
    from multiprocessing import resource_tracker

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGHUP)}  # kept across exec
    try:
        resource_tracker.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_ACCELERATOR: list = []  # a worker process's Accelerator, made by its first run


def _process_accelerator():
    if not _ACCELERATOR:
        from accelerate import Accelerator  # heavy (torch.distributed); only a worker process needs one

        _ACCELERATOR.append(Accelerator())
    return _ACCELERATOR[0]


def die_with_parent(parent: int) -> None:
    """A worker's initializer: ask the kernel to SIGKILL this worker when its parent ends
    (Linux PR_SET_PDEATHSIG), and end now if the parent already has.

    SIGKILL, not SIGTERM: inside a run the Trainer handles SIGTERM as a preemption (vlp.train.
    preempt: save at the next step, raise Preempted), which run_one counts as a failed attempt
    and retries, so a SIGTERMed worker went on training for a whole run after `vlp compare` was
    killed. A killed run loses at most its last checkpoint interval: the next `vlp compare`
    resumes it (train.resume=latest) and removes stale temp files. Ctrl-C reaches the whole
    process group as before."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


def start_worker(parent: int) -> None:
    """A worker process's initializer: it dies with its parent (die_with_parent), and a stop signal
    to the group is noted for its whole life (GridStop; `_pool` started it with the stop signals
    blocked, so one that came during its start-up is delivered now, to the note)."""
    die_with_parent(parent)
    if "fork" in multiprocessing.get_all_start_methods():
        # a spawned process inherits "spawn" as its default: its runs' loader workers would each
        # import torch again (seconds) and take a stop signal to the group during that, before
        # they ignore it (vlp.data.lifecycle), as a KeyboardInterrupt traceback or their death
        multiprocessing.set_start_method("fork", force=True)
    GridStop().__enter__()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(SIGNALS))


class Executor:
    """Runs jobs in this process or, with grid.workers > 1 on one process, in a pool of spawned
    worker processes kept until the `with` block ends."""

    def __init__(self, grid, acc):
        self.grid, self.acc, self.pool = grid, acc, None

    def world_of(self, regime: str) -> int:
        """The processes of a run (of any regime): this process's group."""
        return self.acc.num_processes

    def warm(self, bases: dict) -> None:
        """The feature caches of every (data set, regime), built here before any run (warm_caches)."""
        warm_caches(bases, self.grid, self.acc)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, jobs: list[Job], total: Optional[int] = None,
            on_done: Optional[Callable[[Job, dict], None]] = None) -> None:
        """Run ``jobs`` (``total``: the runs of their grid, for the progress line); ``on_done``
        is called after each job (on every rank in this process; on the main one with workers)."""
        total = total or len(jobs)
        if self.grid.workers <= 1 or self.acc.num_processes > 1:
            self._run_here(jobs, total, on_done)
            return
        # most steps first, so that no long run is left going alone at the end
        longest_first = sorted(jobs, key=lambda j: -steps_for(j.cfg.train.samples, global_batch(j.cfg)))
        # SIGTERM / SIGUSR1 / Ctrl-C to the group reach the workers' runs, which save and raise
        # Preempted, raised again here; this process only waits for them (a second Ctrl-C: 130)
        with Preemption() as stop:
            futures = {self._submit(job): job for job in longest_first}
            for i, future in enumerate(as_completed(futures)):
                try:
                    rec, job = future.result(), futures[future]
                except BrokenProcessPool:  # a worker aborted (a second Ctrl-C) or was killed
                    if stop.requested:
                        raise grid_stopped(stop) from None
                    raise
                print(f"[compare] {i + 1}/{len(jobs)} {job.run.name}: {rec['status']} in {rec['wall_time_s']:.0f} s",
                      flush=True)
                if on_done is not None:
                    on_done(job, rec)
                if stop.requested:  # the workers' runs finished anyway: no next one
                    raise grid_stopped(stop)

    def _run_here(self, jobs: list[Job], total: int, on_done) -> None:
        """The jobs in this process, in order (every rank); a Ctrl-C between or around runs stops
        the grid (GridStop; one process only: under `accelerate launch` the ranks would not agree)."""
        with GridStop() if self.acc.num_processes == 1 else contextlib.nullcontext():
            for job in jobs:
                self.acc.print(f"[compare] run {job.index}/{total}: {job.run.name}")
                rec = run_job(job, self.acc)
                self.acc.print(f"[compare] {job.run.name}: {rec['status']} in {rec['wall_time_s']:.0f} s")
                if on_done is not None:
                    on_done(job, rec)
                stop_if_asked()

    def _submit(self, job: Job):
        """pool.submit, with the stop signals blocked in this thread meanwhile: a worker process it
        starts inherits the block (start_worker lifts it once its note is in place), so a Ctrl-C
        or SIGTERM during a worker's start-up (its imports take seconds) is noted, not a
        KeyboardInterrupt traceback from its bootstrap or a killed worker; here it is delivered
        once unblocked."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGNALS))
        try:
            return self._pool().submit(run_job, job)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            start_resource_tracker()
            self.pool = ProcessPoolExecutor(self.grid.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=start_worker, initargs=(os.getpid(),))
        return self.pool


# ---------------------------------------------------------------------------- what a job runs
def train_only(cfg, accelerator) -> dict:
    from vlp.train.loop import Trainer  # heavy (open_clip, the models); imported when a run starts

    try:
        trainer = Trainer(cfg, accelerator=accelerator)
        stop_if_asked()  # a Ctrl-C while it was built: no run (GridStop)
        return trainer.train()
    finally:
        accelerator.free_memory()  # drop the prepared model/optimizer before the next run


def train_and_rank(cfg, accelerator, specs: dict[str, str]) -> dict:
    """Train one run and rank its val and test items at every budget point (train.eval_every)
    and at the end: eval_points.json and eval_items.json (vlp.study.ranking)."""
    from vlp.study.ranking import RankingTrainer  # heavy (the Trainer, open_clip): a run needs it

    try:
        trainer = RankingTrainer(cfg, accelerator=accelerator, specs=specs)
        stop_if_asked()  # a Ctrl-C while it was built: no run (GridStop)
        return trainer.train()
    finally:
        accelerator.free_memory()


# ---------------------------------------------------------------------------- feature caches
def warm_caches(bases: dict, grid, acc) -> None:
    """Build the locked-tower feature caches (data.feature_cache) of every regime once, before
    any run: the training shards' and the val / test sets' stem outputs. Runs (and worker
    processes, from the cache folder) then only read them."""
    for tree, specs in bases.values():
        cfg = check(from_dict(copy.deepcopy(tree)))
        if cfg.data.feature_cache:
            with threads(grid.workers if acc.num_processes == 1 else torch.get_num_threads()):
                _warm(cfg, specs, acc)


def warm_one(cfg, accelerator, specs: dict) -> dict:
    """One (data set, regime)'s caches as a job of its own (a batch scheduler's warm-up job,
    vlp.study.batch; its folder is cfg.train.output_dir): then result.json says they are built."""
    t0 = time.time()
    _warm(cfg, specs, accelerator)
    if accelerator.is_main_process:
        with RunFolder(cfg.train.output_dir).file("result.json") as path:
            path.write_text(json.dumps({"feature_cache": cfg.data.feature_cache, "warm_time_s": time.time() - t0}))
    return {}


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
