"""The local executor: a grid's jobs in this process or in worker processes on this machine.

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
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional

from vlp.checkpoint.storage import RunFolder
from vlp.config import from_dict, global_batch, steps_for
from vlp.executors.jobstate import Job
from vlp.experiment import check
from vlp.train.preempt import SIGNALS, GridStop, Preempted, Preemption, grid_stopped, stop_if_asked

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def run_job(job: Job, accelerator=None) -> dict:
    """One job in this process (its work, or its caches: warm_one); its record. A worker process
    uses one Accelerator of its own for all its runs. A Ctrl-C that came before: no run."""
    stop_if_asked()
    return run_one(job, accelerator or _process_accelerator(), warm_one if job.warm else job.work)


def run_one(job: Job, accelerator, work: Callable) -> dict:
    """``work(job, accelerator)``, retried on exceptions up to job.retries times; writes the run's
    record, compare.json (main process), and returns it."""
    t0 = time.time()
    status, error, attempts = "failed", "", 0
    for attempts in range(1, job.retries + 2):
        try:
            work(job, accelerator)
            status, error = "ok", ""
            break
        except Preempted:  # saved; the grid stops here and a rerun resumes this run (train.resume=latest)
            raise
        except Exception as e:  # noqa: BLE001 - a crashed run must not stop the grid
            error = (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:300]
            if accelerator.is_main_process:
                print(f"[compare] {job.run.name}: attempt {attempts} failed: {error}", flush=True)
    record = {"status": status, "error": error, "attempts": attempts, "wall_time_s": time.time() - t0}
    if accelerator.is_main_process:
        folder = RunFolder(job.cfg.train.output_dir)  # a local folder or a bucket
        with folder.file("compare.json") as path:
            path.write_text(json.dumps(record, indent=2))
        if status == "ok" and not job.keep_checkpoints:
            folder.remove("checkpoints", tree=True)
    accelerator.wait_for_everyone()
    return record


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
    """A worker's initializer: the kernel SIGKILLs this worker when its parent ends (Linux
    PR_SET_PDEATHSIG; SIGKILL, as a run takes SIGTERM for a preemption: docs/map.md), and it ends
    now if the parent already has."""
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


class LocalExecutor:
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

    def __enter__(self) -> "LocalExecutor":
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


# ---------------------------------------------------------------------------- feature caches
def warm_caches(bases: dict, grid, acc) -> None:
    """Build the locked-tower feature caches (data.feature_cache) of every (data set, regime) here,
    before any run; the runs (and worker processes, from the cache folder) only read them."""
    import torch  # heavy: only a process that builds caches needs it

    from vlp.train.feature_cache import build_caches

    for tree, specs in bases.values():
        cfg = check(from_dict(copy.deepcopy(tree)))
        if cfg.data.feature_cache:
            with threads(grid.workers if acc.num_processes == 1 else torch.get_num_threads()):
                build_caches(cfg, specs, acc)


def warm_one(job: Job, accelerator) -> dict:
    """One (data set, regime)'s caches as a job of its own (a batch scheduler's warm-up job; its
    folder is cfg.train.output_dir): then result.json says they are built."""
    from vlp.train.feature_cache import build_caches

    t0, cfg = time.time(), job.cfg
    build_caches(cfg, job.specs, accelerator)
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
