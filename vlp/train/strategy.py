"""One object per parallelism, so the loop never asks which one it runs under.

    strategy = make_strategy(cfg, accelerator)
    model, optimizer = strategy.prepare(model, make_optimizer)   # make_optimizer(model) -> torch optimizer
    with strategy.no_sync(model): ...                            # a non-last accumulation micro-step
    strategy.backward(loss); strategy.finish_grads(model, clip)  # then optimizer.step()
    Checkpointer(folder, strategy, ...)                          # the prepared model and optimizer: its weights part
    full = strategy.full_model(model, build)                     # main process: a plain model

`Replicated` (train.parallel=ddp): Accelerate's DDP replicas; a checkpoint is one step_N.pt of
full tensors written by the main process. `Sharded` (train.parallel=fsdp): FSDP2 applied by
vlp.train.parallel; a checkpoint is a DCP folder each rank writes its shards into. Both load
both formats (DCP reshards to any layout). The strategy that prepared the model and optimizer
is the checkpointer's weights part (vlp.checkpoint.checkpointer): state_dict / load_state_dict (full
tensors, a .pt) and sharded_state / load_sharded (each rank's DCP shards).
"""

from __future__ import annotations

from typing import Callable

import torch

from vlp.config import ConfigError
from vlp.distributed import is_main
from vlp.train import parallel
from vlp.train.optim import optimizer_param_names
from vlp.train.static_step import on_capture_stream


class Replicated:
    """DDP through Accelerate: every rank holds the whole model and optimizer state."""

    sharded = False

    def __init__(self, accelerator, cfg):
        self.acc, self.cfg = accelerator, cfg

    def prepare(self, model, make_optimizer: Callable):
        """(model, optimizer) ready to train, kept for the checkpoint; the torch optimizer stays in
        `torch_optimizer` (DCP state dicts need the optimizer itself, not Accelerate's wrapper)."""
        self.torch_optimizer = make_optimizer(model)
        if self.cfg.train.compile:
            model = torch.compile(model)
        with on_capture_stream(self.acc.device, self.cfg.train.cuda_graphs):  # DDP built where it is captured
            self.model, self.optimizer = self.acc.prepare(model, self.torch_optimizer)
        return self.model, self.optimizer

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

    # the checkpointer's weights part: the prepared model and optimizer
    def state_dict(self) -> dict:
        """Full tensors ({"model", "optimizer"} of a .pt: the main process's)."""
        return {"model": self.unwrap(self.model).clip.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Model and optimizer state from full tensors."""
        self.unwrap(self.model).clip.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def sharded_state(self) -> dict:
        """The target of a DCP save or load (a collective under FSDP)."""
        return parallel.sharded_state(self.unwrap(self.model), self.torch_optimizer)

    def load_sharded(self, state: dict) -> None:
        parallel.set_sharded_state(self.unwrap(self.model), self.torch_optimizer, state)

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
        self.model, self.optimizer = model, self.torch_optimizer  # already parallel: Accelerate would add DDP
        return self.model, self.optimizer

    def no_sync(self, model):
        return parallel.no_grad_sync(model)

    def finish_grads(self, model, max_norm: float) -> None:
        """The 0-d parameters FSDP leaves replicated get DDP's average; then one norm over
        sharded and replicated gradients."""
        parallel.sync_replicated_grads(model)
        if max_norm:
            parallel.clip_grad_norm_(model.parameters(), max_norm)

    def load_state_dict(self, state: dict) -> None:
        """A replicated .pt that every rank reads whole, keeping its own shards. A collective."""
        weights = {f"clip.{k}": v for k, v in state["model"].items()}
        optim = parallel.name_keyed_optimizer_state(state["optimizer"], optimizer_param_names(self.model))
        parallel.set_full_state(self.model, self.torch_optimizer, weights, optim)

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


def make_strategy(cfg, accelerator) -> Replicated:
    """The strategy train.parallel names."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("the accelerate launch config sets distributed_type: FSDP, which vlp does not use: "
                          "launch with a plain multi-GPU config (launch/fsdp.yaml) and set train.parallel=fsdp")
    return (Sharded if cfg.train.parallel == "fsdp" else Replicated)(accelerator, cfg)
