"""Dual encoder built from an open_clip config; tokenizer and transforms to match.

The model knows nothing about ranks or losses: `forward(image, text)` returns one typed
`DualEncoderOutput` with L2-normalised embeddings and the exponentiated logit scale.

    model, tok, train_tf, eval_tf = build_model(cfg.model, cfg.loss)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import open_clip
import torch
from torch import nn

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(MODEL_CONFIG_DIR)


@dataclass
class DualEncoderOutput:
    image_emb: torch.Tensor  # (b, d), unit norm
    text_emb: torch.Tensor  # (b, d), unit norm
    logit_scale: torch.Tensor  # scalar, exp(log scale)
    logit_bias: Optional[torch.Tensor]  # scalar (SigLIP) or None


class DualEncoder(nn.Module):
    """Thin wrapper over an open_clip CLIP: typed output, open_clip state dict inside `.clip`."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def encode_image(self, image: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.clip.encode_image(image, normalize=normalize)

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.clip.encode_text(text, normalize=normalize)

    @property
    def log_logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> DualEncoderOutput:
        bias = getattr(self.clip, "logit_bias", None)
        return DualEncoderOutput(
            image_emb=self.encode_image(image),
            text_emb=self.encode_text(text),
            logit_scale=self.clip.logit_scale.exp().reshape(()),
            logit_bias=None if bias is None else bias.reshape(()),
        )


def resolve_model_name(name: str) -> str:
    """A built-in / packaged open_clip name, or a JSON file path registered on the fly."""
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {name}")
        open_clip.add_model_config(path)
        return path.stem
    if name not in open_clip.list_models():
        raise ValueError(f"unknown model '{name}': not an open_clip model or a .json config path")
    return name


def model_config_dict(name: str) -> dict:
    return open_clip.get_model_config(resolve_model_name(name))


def with_hf_text_tower(name: str, hf_dir: str) -> str:
    """Register `name` with its text tower replaced by the local HF model in `hf_dir`."""
    import hashlib
    import tempfile

    cfg = json.loads(json.dumps(model_config_dict(name)))
    context = cfg["text_cfg"].get("context_length", 77)
    cfg["text_cfg"] = {"hf_model_name": str(Path(hf_dir).resolve()), "hf_tokenizer_name": str(Path(hf_dir).resolve()),
                       "hf_proj_type": "linear", "hf_pooler_type": "cls_pooler", "context_length": context}
    tag = hashlib.sha1(f"{name}|{Path(hf_dir).resolve()}".encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / "vlp_model_configs" / f"{Path(name).stem}-hf-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    open_clip.add_model_config(path)
    return path.stem


def build_model(model_cfg, loss_cfg, device: str | torch.device = "cpu"):
    """Return (DualEncoder, tokenizer, train_transform, eval_transform).

    Temperature: logit_scale starts at log(1/tau); for SigLIP at log(10) with bias -10
    (SigLIP paper / open_clip) unless tau is overridden from its default.
    """
    name = resolve_model_name(model_cfg.name)
    if model_cfg.hf_text_dir:
        name = with_hf_text_tower(name, model_cfg.hf_text_dir)
    siglip = loss_cfg.name == "siglip"
    tau = loss_cfg.tau
    if siglip and math.isclose(tau, 0.07):
        tau = 0.1
    kwargs = dict(init_logit_scale=math.log(1.0 / tau))
    if siglip:
        kwargs["init_logit_bias"] = -10.0
    if model_cfg.pretrained and not Path(model_cfg.pretrained).is_file():
        raise FileNotFoundError(f"model.pretrained: no such file: {model_cfg.pretrained}")
    clip, train_tf, eval_tf = open_clip.create_model_and_transforms(
        name, pretrained=model_cfg.pretrained, device=device, **kwargs
    )
    if model_cfg.grad_checkpointing:
        clip.set_grad_checkpointing(True)
    if model_cfg.lock_image:  # LiT (Zhai et al. 2022)
        clip.lock_image_tower(unlocked_groups=model_cfg.lock_image_unlocked_groups)
    if model_cfg.lock_text:
        clip.lock_text_tower(unlocked_layers=model_cfg.lock_text_unlocked_layers)
    if loss_cfg.temperature == "fixed":
        with torch.no_grad():
            clip.logit_scale.fill_(math.log(1.0 / tau))
        clip.logit_scale.requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(name)
    return DualEncoder(clip), tokenizer, train_tf, eval_tf


def export_open_clip(model: DualEncoder, path: str | Path) -> None:
    """Write the open_clip state dict so `open_clip.create_model(name, pretrained=path)` loads it."""
    state = {k: v.detach().cpu() for k, v in model.clip.state_dict().items()}
    torch.save({"state_dict": state}, path)


def save_model_config(name: str, path: str | Path) -> None:
    Path(path).write_text(json.dumps(model_config_dict(name), indent=2))
