"""`vlp eval`: load a checkpoint (ours or an open_clip file), run an eval suite, write reports."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from vlp import checkpoint as ckpt
from vlp.config import ConfigError, LossConfig, ModelConfig, from_dict


def load_model_from_checkpoint(path: str, model_name: Optional[str] = None, device: str = "cpu"):
    """(model, tokenizer, eval_transform) from a vlp `step_*.pt` file or `step_*/` DCP directory
    (train.parallel=fsdp), or an open_clip state-dict file."""
    from vlp.model import build_model, state_dict_mismatch

    state = ckpt.load_sharded_full(path) if Path(path).is_dir() else ckpt.load(path)  # DCP dir or file
    if not isinstance(state, dict):
        raise ckpt.CheckpointError(f"{path} is not a checkpoint: it holds a {type(state).__name__}, not a dict of weights")
    if "model" in state and "config" in state:  # a vlp training checkpoint
        model_cfg = from_dict(state["config"]["model"], ModelConfig, "model.")
        loss_cfg = from_dict(state["config"]["loss"], LossConfig, "loss.")
        weights = state["model"]
    else:  # open_clip checkpoint: {"state_dict": ...} or a bare state dict
        if model_name is None:
            raise ConfigError("vlp eval: --model is required for an open_clip checkpoint (no vlp config inside)")
        model_cfg, loss_cfg = ModelConfig(), LossConfig()
        weights = state.get("state_dict", state)
        if not isinstance(weights, dict) or not all(isinstance(k, str) for k in weights):
            raise ckpt.CheckpointError(f"{path} is not a model state dict (no name -> tensor mapping)")
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    bad = ckpt.nonfinite_tensors(weights)
    if bad:  # metrics of nan weights would be silently meaningless
        raise ckpt.CheckpointError(f"checkpoint {path} has non-finite weights in {len(bad)} tensors (e.g. {bad[0]})")
    if model_name is not None:
        model_cfg.name = model_name
    model_cfg.pretrained = None
    if "logit_bias" in weights:
        loss_cfg.name = "siglip"
    model, tokenizer, _, eval_tf = build_model(model_cfg, loss_cfg, device=device)
    try:
        model.clip.load_state_dict(weights)
    except (RuntimeError, TypeError, AttributeError) as e:
        hint = " (drop --model to use the checkpoint's own)" if model_name and "config" in state else ""
        raise ckpt.CheckpointError(f"checkpoint {path} does not fit model '{model_cfg.name}'{hint}: "
                                   f"{state_dict_mismatch(e)}") from None
    model.eval()
    return model, tokenizer, eval_tf


def build_suite(suite: Optional[str], shards: Optional[str], imagenet: Optional[str], templates: str,
                batch_size: int, precision: str) -> dict:
    from eval.suite import check_suite, load_suite

    spec = load_suite(suite) if suite else {}
    spec.setdefault("batch_size", batch_size)
    spec.setdefault("precision", {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}[precision])
    if shards:
        spec.setdefault("retrieval", []).append({"name": "retrieval", "shards": shards})
    if imagenet:
        if not Path(imagenet).is_dir():
            raise FileNotFoundError(f"ImageNet val folder not found: {imagenet}")
        spec.setdefault("classification", []).append({"name": "imagenet", "root": imagenet, "templates": templates})
    if not spec.get("retrieval") and not spec.get("classification"):
        raise ConfigError("vlp eval: nothing to evaluate: give --shards, --imagenet or --suite")
    return check_suite(spec)


def evaluate_checkpoint(checkpoint: str, model_name: Optional[str] = None, suite: Optional[str] = None,
                        shards: Optional[str] = None, imagenet: Optional[str] = None, templates: str = "openai",
                        out_dir: Optional[str] = None, batch_size: int = 256, precision: str = "fp32",
                        device: Optional[str] = None) -> dict:
    from data_pipelines.stream import make_loader
    from eval.suite import run_eval_suite

    spec = build_suite(suite, shards, imagenet, templates, batch_size, precision)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, eval_tf = load_model_from_checkpoint(checkpoint, model_name, device)
    out_dir = out_dir or str(Path(checkpoint).resolve().parent / "eval")
    return run_eval_suite(model, tokenizer, eval_tf, spec, device, out_dir, make_loader=make_loader)
