"""Parallelism applied from outside the model (torchtitan's `parallelize` style): the model code
knows nothing of ranks, so one model serves DDP, FSDP and a single process.

    model = apply_fsdp(model, device_type="cpu", precision="fp32")   # every rank, before the optimizer

`train.parallel: fsdp` shards it with FSDP2 `fully_shard` as docs/training-at-scale.md ("FSDP")
tells: one unit per transformer block of each tower, one per tower, and the root. The same code
runs on CPU (gloo) and GPU (NCCL): Accelerate cannot do FSDP on CPU, so the project shards the
model itself and the tests exercise the path the GPUs run.

0-d parameters (logit_scale, logit_bias) stay plain tensors replicated on every rank
(`ignored_params` of the root) and `sync_replicated_grads` averages their gradients, as DDP
would; clipping norms the two kinds of gradient together. FSDP2's reduce-scatter averages over
ranks as DDP's all-reduce does, so the gradient semantics of vlp/distributed.py hold.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch import nn

from vlp.distributed import all_reduce, get_world_size

def transformer_blocks(clip: nn.Module) -> list[nn.Module]:
    """The residual blocks of both towers (open_clip `ResidualAttentionBlock`s), image tower first:
    `clip.visual.transformer`, then CLIP's own `clip.transformer` or CustomTextCLIP's
    `clip.text.transformer`. HF text towers and timm image towers have no `.resblocks`; each is
    still one unit as a tower."""
    blocks = []
    for tower in (getattr(clip, "visual", None), getattr(clip, "text", None), clip):
        transformer = getattr(tower, "transformer", None)
        blocks += list(getattr(transformer, "resblocks", []) or [])
    return blocks


def towers(clip: nn.Module) -> list[nn.Module]:
    """Modules that hold one tower: the image tower and the text transformer (open_clip's CLIP
    keeps the text embeddings, ln_final and text_projection on itself; they go to the root unit),
    or an HF text tower (CustomTextCLIP's `clip.text`)."""
    return [m for name in ("visual", "text", "transformer") if isinstance(m := getattr(clip, name, None), nn.Module)]


def mixed_precision_policy(precision: str):
    """bf16 compute with fp32 gradient reduction (and fp32 sharded master weights + AdamW state);
    the default (no casts) in fp32. fp16 needs a sharded grad scaler and is refused by config validation."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"train.parallel=fsdp supports precision fp32 or bf16, not {precision}")


def apply_fsdp(model: nn.Module, device_type: str, precision: str = "fp32") -> nn.Module:
    """Shard `model` (a DualEncoder: `.clip` is the open_clip model) in place with FSDP2 over all
    ranks of the default process group; returns it. Call on every rank, after moving the model to
    its device and before building the optimizer (the parameters are replaced by DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # DualEncoder returns logit_scale/bias as 0-d views; nothing writes to them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device_type, (get_world_size(),))
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision_policy(precision)}
    clip = model.clip
    kwargs_root = dict(kwargs, ignored_params=set(scalar_params(model)))
    for block in transformer_blocks(clip):
        fully_shard(block, **kwargs)
    for tower in towers(clip):
        fully_shard(tower, **kwargs)
    fully_shard(model, **kwargs_root)  # root: everything not in a unit above (embeddings, logit_scale, ...)
    return model


def scalar_params(model: nn.Module) -> list[nn.Parameter]:
    """0-d parameters (logit_scale, logit_bias): FSDP2 cannot shard them, so they stay plain
    replicated tensors on every rank and their gradients are averaged by `sync_replicated_grads`."""
    return [p for p in model.parameters() if p.ndim == 0]


@contextlib.contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no reduce-scatter) for the duration: FSDP2's `no_sync`."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def sync_replicated_grads(model: nn.Module) -> None:
    """Average the gradients of the parameters FSDP leaves replicated (`scalar_params`) over
    ranks, as DDP would: one all-reduce of their concatenation (SUM / world: gloo has no AVG).
    Collective: call on every rank after the last backward of a step."""
    params = [p for p in scalar_params(model) if p.grad is not None]
    if not params:
        return
    flat = all_reduce(torch.stack([p.grad.reshape(()) for p in params]), op="mean")
    for p, g in zip(params, flat):
        p.grad.copy_(g)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm over sharded (DTensor) and replicated gradients together;
    returns the norm before clipping. The DTensor part's norm is a partial one per rank until
    `full_tensor()` reduces it, so the two kinds are normed apart and combined."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    groups = [[p for p in params if isinstance(p.grad, DTensor)], [p for p in params if not isinstance(p.grad, DTensor)]]
    norms = []
    for group in groups:
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model", "optimizer"} state dicts keyed by parameter name (FQN), for a DCP save or as the
    target of a DCP load: DTensor shards under FSDP, full tensors for a replicated model (DCP
    then reads the whole of each tensor, whatever the layout it was saved from). Collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def set_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `sharded_state`-shaped dict (filled by a DCP load) into model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def set_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full (unsharded) name-keyed state dicts, present on every rank, into a sharded model
    and its optimizer; each rank keeps its own shard (a replicated `.pt` checkpoint under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def full_model_state(model: nn.Module) -> dict:
    """The full (unsharded) state dict of `model` on CPU, on rank 0 only (other ranks get {}).
    Collective under FSDP: every rank must call it. Keys are the module's own (`clip.` prefix)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def name_keyed_optimizer_state(optim_state: dict, names: list[str]) -> dict:
    """A torch optimizer state dict (parameters numbered 0.. across groups) keyed by parameter
    name instead: the form `set_full_state` takes. `names[i]` is the name of parameter i."""
    return {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]],
    }
