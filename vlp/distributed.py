"""Differentiable all-gather, rank/world helpers and positive-column offsets.

The one place where contrastive features cross devices. No Accelerate here: the trainer owns the
Accelerator; this module only needs ``torch.distributed`` (and works without it being initialised).

Which columns are positives
---------------------------
Every rank holds ``b`` local pairs. ``gather_with_grad`` concatenates the features of all ranks in
rank order, giving ``B = R * b`` global columns. Each rank computes a *local* loss: its ``b`` rows
(anchors) against all ``B`` columns, so memory is O(b * B), never B x B. The positive of local row
``i`` is global column ``o + i`` with ``o = positive_offset(b) = rank * b``::

    R = 3 ranks, b = 2 local rows, B = 6 global columns; logits of rank 1 (o = 2):

                      columns from  rank 0   rank 1   rank 2
                                   +-------+-------+-------+
        rank 1, local row 0        | .  .  | P  .  | .  .  |     P = positive (column o + i)
        rank 1, local row 1        | .  .  | .  P  | .  .  |     . = negative
                                   +-------+-------+-------+
                                    col 0 1  col 2 3  col 4 5

This assumes equal local batch sizes on every rank (the stream guarantees it);
``positive_offset`` asserts it when given the gathered size, and ``gather_with_grad(x,
check_shapes=True)`` checks it with one extra tiny collective.

Gradient scale (docs/design.md, "Gather and gradient scale"): each rank returns the *mean over its
local anchors* (no world-size factor, no sum); all_gather's summing backward and DDP's average
cancel, so every parameter gradient equals the global mean loss's (tests/train/test_distributed.py).
Caveats: the backward pass runs a collective, so every rank must backpropagate through the gather
the same way (same losses, same order); ``all_gather`` is not supported under ``torch.compile``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Rank of this process in the default group; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes in the default group; 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Whether this is rank 0 (the process that writes shared files and prints)."""
    return get_rank() == 0


def barrier() -> None:
    """All ranks meet; a no-op without a process group."""
    if is_distributed():
        dist.barrier()


def all_reduce(x: Tensor, op: str = "sum") -> Tensor:
    """``x`` summed (or averaged: ``op="mean"``, the sum divided by the world size, as gloo has
    no AVG) over ranks, as a new tensor; ``x`` itself without a process group."""
    if not is_distributed():
        return x
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / get_world_size() if op == "mean" else out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank, so all take the same branch; ``obj`` itself
    without a process group."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(objs: list) -> list:
    """Every rank's list ``objs`` (picklable), concatenated in rank order; ``objs`` without a
    process group."""
    if not is_distributed():
        return list(objs)
    parts: list = [None] * get_world_size()
    dist.all_gather_object(parts, objs)
    return [x for part in parts for x in part]


def _check_same_shape(x: Tensor) -> None:
    """ValueError unless every rank passes a tensor of the same shape (one tiny collective)."""
    shape = torch.tensor(list(x.shape), dtype=torch.long, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(get_world_size())]
    dist.all_gather(shapes, shape)
    found = [tuple(s.tolist()) for s in shapes]
    if any(s != found[0] for s in found):
        raise ValueError(
            f"gather_with_grad needs the same shape on every rank (equal local batch sizes); "
            f"got {found} in rank order"
        )


def gather_with_grad(x: Tensor, check_shapes: bool = False) -> Tensor:
    """Concatenate ``x`` (b, ...) over ranks in rank order -> (R*b, ...), with autograd.

    The identity (returns ``x`` itself) when the world size is 1. Gradient semantics: see the
    module docstring. ``check_shapes=True`` first verifies equal shapes on all ranks (costs one
    small collective and a host sync; use it once, e.g. on the first step).
    """
    if get_world_size() == 1:
        return x
    if check_shapes:
        _check_same_shape(x)
    import torch.distributed.nn.functional as dist_nn  # not importable on builds without dist

    with warnings.catch_warnings():
        # torch >= 2.10 marks this autograd all_gather deprecated in favour of a private API
        # (_functional_collectives); it is the documented public differentiable gather.
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*")
        parts = dist_nn.all_gather(x)
    return torch.cat(parts, dim=0)


def positive_offset(batch_per_device: int, global_batch: int | None = None) -> int:
    """Global column of local row 0's positive: ``rank * batch_per_device`` (see the diagram above).

    Assumes equal local batch sizes on every rank; pass the gathered size ``global_batch`` to
    assert ``global_batch == world_size * batch_per_device``.
    """
    world = get_world_size()
    if global_batch is not None and global_batch != world * batch_per_device:
        raise AssertionError(
            f"unequal local batch sizes? global batch {global_batch} != "
            f"world size {world} x local batch {batch_per_device}"
        )
    return get_rank() * batch_per_device


def end_process_group() -> None:
    """Destroy the default process group, if any, before the process exits: a rank that leaves with
    gloo's threads still attached can abort in their destructors (std::terminate, SIGABRT), which
    a launcher reports as a failure."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launched_world(env=None) -> int:
    """The world size a launcher (torchrun, ``accelerate launch``) started this process in: its
    WORLD_SIZE, 1 without a launcher."""
    env = os.environ if env is None else env
    return int(env.get("WORLD_SIZE", "1") or 1) if "TORCHELASTIC_RUN_ID" in env else 1


def cpu_when_launched_without_gpu(env=None, gpu: bool | None = None) -> bool:
    """Under a launcher on a machine without a GPU, set ACCELERATE_USE_CPU=1 (unless given), so
    Accelerate forms one gloo group of CPU processes. Without it Accelerate falls back to
    "no distribution" and every process trained alone on its own (plain ``torchrun`` on CPU).
    Call before the Accelerator is built; True when it set the variable."""
    env = os.environ if env is None else env
    if launched_world(env) <= 1 or "ACCELERATE_USE_CPU" in env:
        return False
    gpu = (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())) if gpu is None else gpu
    if gpu:
        return False
    env["ACCELERATE_USE_CPU"] = "1"
    return True


def check_launched_world(env=None) -> None:
    """ValueError (one line) when the launcher started a world of N processes but this one is not
    in a process group of N (e.g. ACCELERATE_USE_CPU=0 on a machine without a GPU): each would
    train alone on the same folder."""
    launched, joined = launched_world(env), get_world_size()
    if launched != joined:
        raise ValueError(f"the launcher started {launched} processes but this one is in a group of {joined}: "
                         "on a machine without a GPU unset ACCELERATE_USE_CPU or set it to 1 (gloo)")


STOPPING = threading.Event()  # set by vlp.train.preempt when this process got a stop signal
LAUNCHER_GONE = threading.Event()  # set just before this rank stops because its launcher died
STOP_GRACE_S = 300.0  # how long a stopping rank whose launcher died may take to save and exit
_LAUNCHER: list[int] = []  # the pid of this rank's launcher, once exit_with_launcher watches it


def launcher_gone() -> bool:
    """Whether the launcher exit_with_launcher watches has died (this process was reparented)."""
    return bool(_LAUNCHER) and os.getppid() != _LAUNCHER[0]


def exit_with_launcher(poll_s: float = 1.0) -> None:
    """Under a launcher (torchrun / ``accelerate launch``), stop this rank when its launcher dies
    instead of training on as an orphan (docs/reliability.md: a launcher SIGKILLed or dead of
    SIGUSR1). A daemon thread watches the parent pid (unlike PR_SET_PDEATHSIG not tied to the
    parent *thread*); within ``poll_s`` of its death a loop that saves on SIGTERM (vlp.train.preempt's
    handler) is sent SIGTERM and saves like a preempted run; anything else (start-up, the final
    eval), or a rank still stopping ``STOP_GRACE_S`` later, ends with one line, status 1. No-op
    without a launcher. First refuses a process not in its launcher's world (`check_launched_world`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    check_launched_world()
    parent = os.getppid()
    _LAUNCHER[:] = [parent]

    def watch() -> None:
        while parent != 1 and os.getppid() == parent:  # pid 1: the launcher died before we started
            time.sleep(poll_s)
        if not STOPPING.is_set() and callable(signal.getsignal(signal.SIGTERM)):
            LAUNCHER_GONE.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: save at the step boundary
        if STOPPING.wait(poll_s):  # stopping (the launcher's death, or a signal that reached this
            time.sleep(STOP_GRACE_S)  # rank too): its save goes on, within the grace
        print(f"vlp: error: launcher (pid {parent}) is gone; rank {os.environ.get('RANK', '?')} stops",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="vlp-launcher-watch", daemon=True).start()
