"""Peak memory of one training step, on any device: what a user compares between a per-GPU
batch of 8 and one of 128, or contrastive accumulation.

    with StepMemory(device, persistent=[model, optimizer]) as mem:
        train_step(...)
    mem.peak_bytes      # the most bytes held by tensors at any moment of the step (None: unknown)

CUDA: ``torch.cuda.max_memory_allocated`` over the step (the caching allocator's own count).
CPU (no allocator statistics): a dispatch mode sees every tensor an operator returns and follows
its storage until it is freed; peak = the tensors alive before the step (``persistent``:
parameters, buffers, gradients, optimizer state) + the most bytes alive at once among the
storages made during it. Views and in-place results share a storage and count once; a result
whose storage cannot be followed (a tensor subclass such as FSDP's DTensor) makes the figure
None rather than low. The figure is
a function of shapes and the graph only (deterministic; the same on every machine), and it is
what ``max_memory_allocated`` counts on a GPU, less allocator rounding and workspaces.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> Optional[int]:
    """Bytes of the distinct storages behind ``tensors`` (None when one has no plain storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:  # a DTensor (FSDP) has no plain storage; FSDP2's unsharded parameters, a freed one
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                return None
    return sum(seen.values())


def held_tensors(*parts) -> list[torch.Tensor]:
    """Parameters, buffers and gradients of modules; the state tensors of optimizers; tensors."""
    out: list[torch.Tensor] = []
    for part in parts:
        if isinstance(part, torch.Tensor):
            out.append(part)
        elif isinstance(part, torch.nn.Module):
            out += list(part.parameters()) + list(part.buffers())
            out += [p.grad for p in part.parameters() if p.grad is not None]
        elif hasattr(part, "state"):  # torch.optim.Optimizer (or an accelerate wrapper of one)
            state = getattr(getattr(part, "optimizer", part), "state", {})
            out += [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages created by operators while active, alive now and at most."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.untracked = 0  # results whose storage cannot be followed (tensor subclasses): no figure
        self._known: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    self._track(t.untyped_storage())
                except (RuntimeError, NotImplementedError, TypeError):  # e.g. a DTensor (FSDP)
                    self.untracked += 1
        return out

    def _track(self, storage) -> None:
        ptr = storage.data_ptr()
        if ptr in self._known or storage.nbytes() == 0:
            return
        self._known.add(ptr)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, ptr, storage.nbytes())

    def _freed(self, ptr: int, nbytes: int) -> None:
        self._known.discard(ptr)
        self.live -= nbytes


class StepMemory:
    """Context manager measuring the peak tensor memory of what runs inside it (module docstring)."""

    def __init__(self, device: torch.device, persistent: Iterable = ()):
        self.device = torch.device(device)
        self.persistent = list(persistent)
        self.peak_bytes: Optional[int] = None
        self._mode: Optional[_LiveStorages] = None

    def __enter__(self) -> "StepMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._base = tensor_bytes(held_tensors(*self.persistent))
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._mode.__exit__(*exc)
            known = self._base is not None and not self._mode.untracked
            self.peak_bytes = self._base + self._mode.peak if known else None
