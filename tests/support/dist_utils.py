"""Run a function on N CPU processes joined by a gloo process group (for tests).

    results = run_distributed(fn, world_size=2, args=(x,))   # -> [fn(0, 2, x), fn(1, 2, x)]

``fn(rank, world_size, *args)`` runs in a forked child of this process; its return value must be
picklable by ``torch.save`` (tensors, dicts, lists, numbers). An exception on any rank is
re-raised here with the child's traceback; a hang is killed after ``timeout_s``. Rendezvous goes
through a file in a fresh temporary directory, so there is no port to pick or to collide on.
"""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.state import AcceleratorState, GradientState


def _worker(rank: int, fn: Callable, world_size: int, args: tuple, tmp: str) -> None:
    # a forked rank starts as a fresh one would: Accelerate's process-wide state (a singleton an
    # earlier test in this worker may have set up for one process) is built again in this group
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result_rank{rank}.pt"))
        del result
        gc.collect()  # autograd graphs of gathered tensors hold gloo work objects
        dist.barrier()  # no rank tears the group down while its peer still uses it
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout_s: float = 120.0
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return results by rank."""
    with tempfile.TemporaryDirectory(prefix="vlp_dist_") as tmp:
        # fork: each rank starts from this process's imports (torch, open_clip, vlp: ~5 CPU
        # seconds per spawned rank); one BLAS thread here (conftest), so no thread pool is forked
        context = mp.start_processes(
            _worker, args=(fn, world_size, args, tmp), nprocs=world_size, join=False, start_method="fork"
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):  # raises if a rank raised
            if time.monotonic() > deadline:
                for proc in context.processes:
                    if proc.is_alive():
                        proc.kill()
                raise TimeoutError(f"distributed test did not finish in {timeout_s:.0f}s")
        return [
            torch.load(os.path.join(tmp, f"result_rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
