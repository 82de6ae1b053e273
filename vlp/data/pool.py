"""Batch memory a loader worker reuses: shared-memory buffers lent to the main process, as a
fresh segment per batch costs the worker a tenth of its work (docs/data-path.md, "Batch memory
reused"):

* ``Leases`` (made by the main process, inherited by its workers): a shared in-use flag per
  (worker, slot).
* ``BufferPool.alloc`` (in a worker): a tensor in a free slot's segment, flagged in use; no free
  slot: a fresh segment, not lent.
* ``Leased``: a worker's batch images with the slots they use. Unpickled in the main process it
  is the images themselves, and each slot's storage there gets a finalizer that clears its flag
  when the last tensor on it is gone (views keep the storage alive), so a worker never writes
  over pixels still in use.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import uuid
import weakref
from typing import Any, Optional

import numpy as np
import torch

SLOTS = 6  # segments per worker: its prefetched batches, the pin queue's and the step's
LOCK_WAIT_S = 1.0


class Leases:
    """In-use flags of every worker's slots, shared by the main process and its workers."""

    live: "weakref.WeakValueDictionary[str, Leases]" = weakref.WeakValueDictionary()  # main process

    def __init__(self, workers: int):
        self.token = uuid.uuid4().hex
        self.flags = multiprocessing.Array("b", workers * SLOTS)  # with a lock: a memory barrier
        Leases.live[self.token] = self


def release(token: str, index: int) -> None:
    """Main process: a lent slot's last tensor is gone (a finalizer of its storage)."""
    leases = Leases.live.get(token)
    if leases is not None:
        with held(leases.flags.get_lock()):
            leases.flags.get_obj()[index] = 0  # raw: the array's own setter waits for the lock forever


@contextlib.contextmanager
def held(lock):
    """The flags' lock, waited for at most LOCK_WAIT_S: a worker killed while holding it (the OOM
    killer) must not hang the main process nor the other workers; past the wait, the one-byte
    write goes on without it (vlp.data.lifecycle reports the dead worker)."""
    got = lock.acquire(timeout=LOCK_WAIT_S)
    try:
        yield got
    finally:
        if got:
            lock.release()


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised tensor in a fresh shared-memory segment (torch's default_collate does the
    same in a worker: the batch goes there anyway, so sending it copies nothing)."""
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(int(np.prod(shape)), device=elem.device)
    return elem.new(storage).view(shape)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A batch tensor where no pool is at hand: shared memory in a DataLoader worker (unless
    empty), ordinary memory in the main process."""
    if torch.utils.data.get_worker_info() is None or not all(shape):
        return torch.empty(shape, dtype=dtype)
    return shared_empty(shape, dtype)


class BufferPool:
    """One worker's slots (see the module docstring); ``alloc`` hands out batch tensors,
    ``lent()`` the (tensor, lease) pairs handed out since its last call."""

    def __init__(self, leases: Leases, worker: int):
        self.leases, self.base = leases, worker * SLOTS
        self.segments: dict[int, torch.Tensor] = {}  # slot -> uint8 segment
        self._lent: list[tuple[torch.Tensor, tuple[str, int]]] = []

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        slot = self._claim(nbytes)
        if slot is None:
            return shared_empty(shape, dtype)
        segment = self.segments.get(slot)
        if segment is None or segment.numel() < nbytes:
            segment = self.segments[slot] = shared_empty((nbytes + nbytes // 4,))  # room to grow
        tensor = segment[:nbytes].view(dtype).view(shape)
        self._lent.append((tensor, (self.leases.token, self.base + slot)))
        return tensor

    def _claim(self, nbytes: int) -> Optional[int]:
        """A free slot, flagged in use: one whose segment holds nbytes, else any free one."""
        flags = self.leases.flags
        with held(flags.get_lock()) as got:
            free = [k for k in range(SLOTS) if not flags[self.base + k]] if got else []
            if not free:
                return None
            fits = [k for k in free if k in self.segments and self.segments[k].numel() >= nbytes]
            slot = (fits or free)[0]
            flags[self.base + slot] = 1
        return slot

    def lent(self) -> list[tuple[torch.Tensor, tuple[str, int]]]:
        out, self._lent = self._lent, []
        return out


class Leased:
    """A worker's batch images (a tensor or a PackedImages) and the lent slots they live in; what
    the main process unpickles is the images, with a finalizer per slot (``release``)."""

    def __init__(self, value: Any, lent: list[tuple[torch.Tensor, tuple[str, int]]]):
        self.value, self.lent = value, lent

    def __reduce__(self):
        return _unpickle_leased, (self.value, self.lent)


def _unpickle_leased(value: Any, lent: list[tuple[torch.Tensor, tuple[str, int]]]) -> Any:
    for tensor, (token, index) in lent:
        weakref.finalize(tensor.untyped_storage(), release, token, index)
    return value
