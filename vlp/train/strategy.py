"""One object per parallelism, so the loop never asks which one it runs under.

    strategy = make_strategy(cfg, accelerator)
    model, optimizer = strategy.prepare(model, make_optimizer)   # make_optimizer(model) -> torch optimizer
    with strategy.no_sync(model): ...                            # a non-last accumulation micro-step
    strategy.backward(loss); strategy.finish_grads(model, clip)  # then optimizer.step()
    path = strategy.write_checkpoint(ckpt_dir, step, model, optimizer, meta)
    strategy.load_checkpoint(state, path, model, optimizer)      # either format into either mode
    full = strategy.full_model(model, build)                     # main process: a plain model

`Replicated` (train.parallel=ddp): Accelerate's DDP replicas; a checkpoint is one step_N.pt of
full tensors written by the main process. `Sharded` (train.parallel=fsdp): FSDP2 applied by
vlp.train.parallel; a checkpoint is a DCP directory each rank writes its shards into. Both load
both formats (DCP reshards to any layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from vlp.config import ConfigError
from vlp.distributed import is_main
from vlp.train import checkpoint as ckpt
from vlp.train import parallel
from vlp.train.optim import optimizer_param_names


class Replicated:
    """DDP through Accelerate: every rank holds the whole model and optimizer state."""

    sharded = False

    def __init__(self, accelerator, cfg):
        self.acc, self.cfg = accelerator, cfg

    def prepare(self, model, make_optimizer: Callable):
        """(model, optimizer) ready to train; the torch optimizer stays in `torch_optimizer`
        (DCP state dicts need the optimizer itself, not Accelerate's wrapper)."""
        self.torch_optimizer = make_optimizer(model)
        if self.cfg.train.compile:
            model = torch.compile(model)
        return self.acc.prepare(model, self.torch_optimizer)

    def unwrap(self, model):
        return self.acc.unwrap_model(model)

    def no_sync(self, model):
        return self.acc.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def finish_grads(self, model, max_norm: float) -> None:
        """After the last backward of a step: DDP has averaged the gradients; clip them."""
        if max_norm:
            self.acc.clip_grad_norm_(model.parameters(), max_norm)

    def write_checkpoint(self, ckpt_dir: Path, step: int, model, optimizer, meta: dict) -> Optional[Path]:
        """step_N.pt of full tensors plus `meta`, written by the main process (None elsewhere)."""
        if not is_main():
            return None
        path = ckpt_dir / f"step_{step:08d}.pt"
        state = {"model": self.unwrap(model).clip.state_dict(), "optimizer": optimizer.state_dict(), **meta}
        ckpt.atomic_save(state, path)
        return path

    def load_checkpoint(self, state: dict, path, model, optimizer) -> None:
        """Model and optimizer state from a .pt (`state` holds the tensors) or a DCP directory
        (`state` is its meta; the tensors are read from `path`, resharded to this layout)."""
        if "model" not in state:
            load_dcp(path, self.unwrap(model), self.torch_optimizer)
        else:
            self.unwrap(model).clip.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

    def full_model(self, model, build: Callable):
        """The model to evaluate or export on the main process: the replica itself."""
        return self.unwrap(model)


class Sharded(Replicated):
    """FSDP2 over all ranks (vlp.train.parallel): each rank holds 1/world of the weights,
    gradients and AdamW state. vlp shards the model itself because Accelerate cannot on CPU;
    Accelerate keeps the launch and the process group."""

    sharded = True

    def prepare(self, model, make_optimizer: Callable):
        world = self.acc.num_processes
        if world < 2:
            raise ConfigError("config: train.parallel=fsdp needs >= 2 processes (accelerate launch); "
                              "one process trains with train.parallel=ddp")
        device = self.acc.device
        # before the optimizer: FSDP2 replaces the parameters by DTensor shards
        model = parallel.apply_fsdp(model.to(device), device.type, self.cfg.train.precision)
        self.torch_optimizer = make_optimizer(model)
        if self.cfg.train.compile:
            model = torch.compile(model)
        return model, self.torch_optimizer  # already parallel: Accelerate would add DDP

    def no_sync(self, model):
        return parallel.no_grad_sync(model)

    def finish_grads(self, model, max_norm: float) -> None:
        """The 0-d parameters FSDP leaves replicated get DDP's average; then one norm over
        sharded and replicated gradients."""
        parallel.sync_replicated_grads(model)
        if max_norm:
            parallel.clip_grad_norm_(model.parameters(), max_norm)

    def write_checkpoint(self, ckpt_dir: Path, step: int, model, optimizer, meta: dict) -> Path:
        """A DCP directory: every rank writes its own shards, rank 0 the meta and the rename."""
        path = ckpt_dir / f"step_{step:08d}"
        ckpt.save_sharded(parallel.sharded_state(model, self.torch_optimizer), meta, path)
        return path

    def load_checkpoint(self, state: dict, path, model, optimizer) -> None:
        """A DCP directory resharded to this layout, or a replicated .pt that every rank reads
        whole, keeping its own shards. A collective."""
        if "model" not in state:
            load_dcp(path, self.unwrap(model), self.torch_optimizer)
            return
        weights = {f"clip.{k}": v for k, v in state["model"].items()}
        optim = parallel.name_keyed_optimizer_state(state["optimizer"], optimizer_param_names(model))
        parallel.set_full_state(model, self.torch_optimizer, weights, optim)

    def full_model(self, model, build: Callable):
        """A full copy gathered from the shards on the main process (a collective; None on the
        other ranks). `build()` makes a fresh model to load it into."""
        full = parallel.full_model_state(model)
        if not is_main():
            return None
        with torch.random.fork_rng(devices=[]):  # its init draws random weights: keep the training RNG
            fresh = build()
        fresh.load_state_dict(full)
        return fresh.to(self.acc.device).eval()


def load_dcp(path, model, torch_optimizer) -> None:
    """Fill model and optimizer from a DCP directory (any saved layout)."""
    target = parallel.sharded_state(model, torch_optimizer)
    ckpt.load_sharded(target, path)
    parallel.set_sharded_state(model, torch_optimizer, target)


def make_strategy(cfg, accelerator) -> Replicated:
    """The strategy train.parallel names."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("the accelerate launch config sets distributed_type: FSDP, which vlp does not use: "
                          "launch with a plain multi-GPU config (launch/fsdp.yaml) and set train.parallel=fsdp")
    return (Sharded if cfg.train.parallel == "fsdp" else Replicated)(accelerator, cfg)
