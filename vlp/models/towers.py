"""Pretrained towers: where each tower's weights come from, how a tower is locked, and the
image preprocessing that belongs to it.

    src = resolve_weights("laion2b_s34b_b79k", "ViT-B-32")     # a file, from the HF cache
    load_tower(clip, "image", "/w/effnet_timm.pt", model_name)  # strict, one-line errors
    frozen = lock_towers(clip, model_cfg)                       # modules kept in eval mode
    pp = tower_preprocess(clip, image_from_timm=True)           # mean/std/resize of the tower

Weights sources: as model.pretrained, model.image_pretrained and model.text_pretrained declare
them (vlp/config/keys.py; a vlp step_*.pt is read as an open_clip checkpoint). Key matching is
strict for the tower being loaded (docs/design.md, "Pretrained towers").
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Optional

import open_clip
import torch
from open_clip.hf_model import register_pooler
from torch import nn

HF_HUB = "hf-hub:"


# ----------------------------------------------------------------------------- HF text poolers

@register_pooler
class LastTokenPooler(nn.Module):
    """The hidden state of each row's last non-padding token (EOS / [SEP] for right-padded
    batches): the pooling of causal (GPT-like) text models, which open_clip does not ship."""

    cls_token_position = -1  # HFTextEncoder reads it to choose the output tokens

    def forward(self, x, attention_mask: torch.Tensor) -> torch.Tensor:
        last = attention_mask.sum(dim=1).clamp(min=1) - 1
        return x.last_hidden_state[torch.arange(len(last), device=last.device), last]


# user name -> open_clip pooler. "cls": the CLS token's hidden state; "cls_pooler": BERT's
# pooler output (dense + tanh over CLS, trained only by BERT's next-sentence task); "mean": mean
# over non-padding tokens (sentence-transformers); "last": the last non-padding token.
HF_POOLERS = {"cls": "cls_last_hidden_state_pooler", "cls_pooler": "cls_pooler",
              "mean": "mean_pooler", "last": "last_token_pooler"}
HF_PROJECTIONS = {"linear": "linear", "mlp": "mlp", "none": None}


def sentence_transformers_pooler(hf_dir: str | Path) -> Optional[str]:
    """The pooling a sentence-transformers folder was trained with (1_Pooling/config.json), as a
    HF_POOLERS name; None when the folder does not say."""
    path = Path(hf_dir, "1_Pooling", "config.json")
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    for key, name in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                      ("pooling_mode_lasttoken", "last")):
        if cfg.get(key):
            return name
    return None


def hf_text_cfg(hf_dir: str, base_context: int, pooler: Optional[str] = None, proj: str = "linear",
                context_length: Optional[int] = None) -> dict:
    """open_clip text_cfg for the local HF model in `hf_dir` (weights and tokenizer from that
    folder). pooler None: the folder's sentence-transformers pooling, else "cls_pooler" (BERT's).
    Context: `context_length`, else the base model's; at most the HF model's positions."""
    folder = str(Path(hf_dir).resolve())
    pooler = pooler or sentence_transformers_pooler(hf_dir) or "cls_pooler"
    context = context_length or base_context
    hf_cfg = json.loads(Path(hf_dir, "config.json").read_text())
    positions = hf_cfg.get("max_position_embeddings")
    if positions and context > positions:
        raise ValueError(f"model.text_context_length {context} is more than the {positions} positions of {hf_dir}")
    return {"hf_model_name": folder, "hf_tokenizer_name": folder, "hf_proj_type": HF_PROJECTIONS[proj],
            "hf_pooler_type": HF_POOLERS[pooler], "context_length": context}


def register_config(base: str, cfg: dict, tag: str) -> str:
    """Register `cfg` with open_clip in memory under a name derived from `base` and `tag`, and
    return the name. In memory, so building a model writes no file anywhere (open_clip only
    offers add_model_config(path); its registry dict is the one place it looks names up)."""
    stem = Path(base).stem.replace(":", "-").replace("/", "-")  # no schema or path: a plain open_clip name
    name = f"{stem}-{hashlib.sha1(tag.encode()).hexdigest()[:10]}"
    open_clip.factory._MODEL_CONFIGS[name] = json.loads(json.dumps(cfg))
    return name


def check_hf_projection(clip: nn.Module, proj: str) -> None:
    """text_proj=none keeps the HF width as the embedding: it must equal embed_dim."""
    text = getattr(clip, "text", None)
    if proj == "none" and text is not None and not hasattr(text, "proj"):
        raise ValueError("model.text_proj=none needs the HF model's hidden size to equal the model's embed_dim")


# ----------------------------------------------------------------------------- weights

def resolve_weights(source: str, model_name: str) -> str:
    """A local file for `source` (see the module docstring). Not found / not cached / unknown
    tag: FileNotFoundError, one line."""
    from open_clip.pretrained import download_pretrained, download_pretrained_from_hf, get_pretrained_cfg

    if source.startswith(HF_HUB):
        repo = source[len(HF_HUB):].strip("/")
        try:
            return download_pretrained_from_hf(repo)
        except Exception as e:  # noqa: BLE001  (hub/cache errors are many and long)
            raise FileNotFoundError(f"{source}: no open_clip weights in the Hugging Face cache or hub "
                                    f"({type(e).__name__}; offline runs need it cached)") from None
    if Path(source).is_file():
        return source
    cfg = get_pretrained_cfg(model_name.removeprefix(HF_HUB), source)
    if cfg:
        try:
            return download_pretrained(cfg)
        except Exception as e:  # noqa: BLE001
            raise FileNotFoundError(f"pretrained tag {source!r} of {model_name}: weights not in the Hugging Face "
                                    f"cache and not downloadable ({type(e).__name__})") from None
    tags = open_clip.list_pretrained_tags_by_model(model_name)
    raise FileNotFoundError(f"{source!r} is not a file, an hf-hub:org/name, or a pretrained tag of {model_name}"
                            f"{' (tags: ' + ', '.join(tags) + ')' if tags else ' (it has no tags)'}")


def tag_preprocess(source: Optional[str], model_name: str) -> dict:
    """The preprocessing open_clip records for a pretrained tag (mean, std, ...), else {}."""
    from open_clip.pretrained import get_pretrained_cfg

    if not source or source.startswith(HF_HUB) or Path(source).is_file():
        return {}
    cfg = get_pretrained_cfg(model_name.removeprefix(HF_HUB), source) or {}
    return {k: cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if k in cfg}


def read_state_dict(path: str, what: str) -> dict:
    """name -> tensor from an open_clip / timm / torchvision / safetensors file or a vlp step_*.pt
    (its "model"); anything else is one ValueError line naming `what`."""
    from vlp.util import first_line
    from vlp.checkpoint.integrity import verify

    verify(path, what)  # a vlp export's or checkpoint's checksums, before parsing
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (unpickling, zip, safetensors header errors)
        raise ValueError(f"{what} {path} is not a weights file: {first_line(e)[:200]}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and "config" in state:
        state = state["model"]  # a vlp training checkpoint
    elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{what} {path} is not a state dict (a mapping of names to tensors)")
    return {k.removeprefix("module."): v for k, v in state.items()}


def in_tower(key: str, tower: str) -> bool:
    """open_clip keys: the image tower is `visual.*`; the text tower everything else but the
    logit scale and bias (token_embedding, transformer, ln_final, text_projection or text.*)."""
    if tower == "image":
        return key.startswith("visual.")
    return not key.startswith("visual.") and key not in ("logit_scale", "logit_bias")


def key_mismatch(given: dict, expected: dict) -> str:
    """'' when `given` has exactly the keys and shapes of `expected`, else one line."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(k for k in set(given) & set(expected) if tuple(given[k].shape) != tuple(expected[k].shape))
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if keys:
            parts.append(f"{len(keys)} {label} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
    return "; ".join(parts)


def tower_state(clip: nn.Module, tower: str, state: dict) -> dict:
    """`state` as keys of `clip`'s tower: an open_clip checkpoint keeps its tower's keys; any other
    file is the tower's own module (a timm/torchvision trunk without its classifier, or a HF
    model's weights) and gets the tower's prefix."""
    own = clip.state_dict()
    if any(k in own for k in state):  # an open_clip checkpoint
        return {k: v for k, v in state.items() if in_tower(k, tower)}
    if tower == "image" and hasattr(clip.visual, "trunk"):
        trunk = clip.visual.trunk
        classifier = (getattr(trunk, "pretrained_cfg", {}) or {}).get("classifier") or "fc"
        names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
        trunk_keys = set(trunk.state_dict())
        return {f"visual.trunk.{k}": v for k, v in state.items()
                if k in trunk_keys or not any(k.startswith(n + ".") for n in names)}
    if tower == "image":  # the state dict of an open_clip image tower module
        return {f"visual.{k}": v for k, v in state.items()}
    if hasattr(getattr(clip, "text", None), "transformer"):  # a HF model's own weights
        return {f"text.transformer.{k}": v for k, v in state.items()}
    return state


def load_tower(clip: nn.Module, tower: str, source: str, model_name: str, what: str) -> bool:
    """Load one tower (`tower`: "image" or "text") from `source`; strict over that tower's keys (a missing
    or extra key, or another shape, is one ValueError line). The other tower is untouched.
    Returns whether the source was an open_clip checkpoint (else the tower module's own weights)."""
    path = resolve_weights(source, model_name)
    state = read_state_dict(path, what)
    from_open_clip = any(k in clip.state_dict() for k in state)
    given = tower_state(clip, tower, state)
    expected = {k: v for k, v in clip.state_dict().items() if in_tower(k, tower)}
    if tower == "image" and hasattr(clip.visual, "trunk"):  # a trunk file: the projection head stays as built
        if not any(k.startswith("visual.head.") for k in given):
            expected = {k: v for k, v in expected.items() if not k.startswith("visual.head.")}
    if tower == "text" and hasattr(getattr(clip, "text", None), "transformer"):
        if not any(k.startswith("text.proj.") for k in given):
            expected = {k: v for k, v in expected.items() if not k.startswith("text.proj.")}
    why = key_mismatch(given, expected)
    if why:
        raise ValueError(f"{what} {source} does not fit the {tower} tower of {model_name}: {why}")
    clip.load_state_dict(given, strict=False)
    return from_open_clip


# ----------------------------------------------------------------------------- locking

def lock_towers(clip: nn.Module, model_cfg) -> list[str]:
    """Freeze what model.lock_* asks (open_clip's tower `lock` methods, which only set
    requires_grad: never their BatchNorm replacement, which drops timm's fused activations) and
    return the names of the frozen modules, which DualEncoder keeps in eval mode so their
    BatchNorm statistics and dropout stay fixed too."""
    if model_cfg.lock_image:  # LiT (Zhai et al. 2022)
        clip.visual.lock(unlocked_groups=model_cfg.lock_image_unlocked_groups, freeze_bn_stats=False)
    if model_cfg.lock_text:
        text = getattr(clip, "text", None)
        if hasattr(text, "transformer") and hasattr(text, "pooler") and model_cfg.lock_text_unlocked_layers:
            lock_hf_layers(text.transformer, model_cfg.lock_text_unlocked_layers)
        else:
            clip.lock_text_tower(unlocked_layers=model_cfg.lock_text_unlocked_layers)
    return frozen_modules(clip) if (model_cfg.lock_image or model_cfg.lock_text) else []


def lock_hf_layers(transformer: nn.Module, unlocked_layers: int) -> None:
    """Freeze a HF model but its last `unlocked_layers` blocks and what follows them (final norm,
    BERT's pooler): open_clip's HFTextEncoder.lock rule, for any architecture. (open_clip finds
    the blocks by a per-architecture table whose BERT entry lacks them; here they are the
    longest ModuleList, e.g. encoder.layer or block.)"""
    lists = [(name, m) for name, m in transformer.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError("model.lock_text_unlocked_layers: the HF text model has no list of layers")
    name, layers = max(lists, key=lambda item: len(item[1]))
    if unlocked_layers > len(layers):
        raise ValueError(f"model.lock_text_unlocked_layers={unlocked_layers}: the HF text model has {len(layers)} layers")
    params = list(transformer.named_parameters())
    in_layers = [i for i, (n, _) in enumerate(params) if n.startswith(f"{name}.")]
    keep = tuple(f"{name}.{i}." for i in range(len(layers) - unlocked_layers, len(layers)))
    for i, (n, p) in enumerate(params):
        p.requires_grad_(n.startswith(keep) or i > in_layers[-1])


def frozen_modules(root: nn.Module) -> list[str]:
    """Names of the largest submodules whose parameters are all frozen (at least one)."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        params = list(module.parameters())
        if prefix and params and not any(p.requires_grad for p in params):
            found.append(prefix)
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", root)
    return found


# ----------------------------------------------------------------------------- preprocessing

def tower_preprocess(clip: nn.Module, image_from_timm: bool, overlay: Optional[dict] = None) -> dict:
    """The image preprocessing of the tower as built: open_clip's (CLIP mean/std, or what a hub
    config or pretrained tag set, `overlay`), or for a timm trunk with timm weights its
    pretrained_cfg (mean, std, interpolation, crop_pct). Plain values, saved in checkpoints."""
    pp = dict(getattr(clip.visual, "preprocess_cfg", {}) or {})
    pp.update(overlay or {})
    pp["crop_pct"] = 1.0
    trunk_cfg = getattr(getattr(clip.visual, "trunk", None), "pretrained_cfg", None)
    if image_from_timm and trunk_cfg:
        pp.update(mean=trunk_cfg["mean"], std=trunk_cfg["std"], interpolation=trunk_cfg.get("interpolation", "bicubic"),
                  crop_pct=float(trunk_cfg.get("crop_pct") or 1.0), resize_mode="shortest")
    size = clip.visual.image_size
    pp["size"] = int(size[0]) if isinstance(size, (tuple, list)) and size[0] == size[-1] else size
    pp["mean"], pp["std"] = [float(x) for x in pp["mean"]], [float(x) for x in pp["std"]]
    return {k: pp[k] for k in ("size", "mean", "std", "interpolation", "resize_mode", "crop_pct") if k in pp}


def transforms(pp: dict):
    """(train, eval) image transforms for preprocessing `pp`. Train: open_clip's (random resized
    crop to size). Eval: resize the short side to size / crop_pct, centre crop (timm's eval for
    crop_pct < 1, open_clip's for 1)."""
    from open_clip.transform import PreprocessCfg, image_transform_v2
    from torchvision import transforms as T

    cfg = PreprocessCfg(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in pp.items() if k != "crop_pct"})
    train = image_transform_v2(cfg, is_train=True)
    crop_pct = float(pp.get("crop_pct", 1.0))
    if math.isclose(crop_pct, 1.0) or not isinstance(cfg.size, int):
        return train, image_transform_v2(cfg, is_train=False)
    mode = {"bicubic": T.InterpolationMode.BICUBIC, "bilinear": T.InterpolationMode.BILINEAR}.get(
        cfg.interpolation, T.InterpolationMode.BICUBIC)
    return train, T.Compose([T.Lambda(_rgb), T.Resize(int(math.floor(cfg.size / crop_pct)), interpolation=mode),
                             T.CenterCrop(cfg.size), T.ToTensor(), T.Normalize(cfg.mean, cfg.std)])


def chosen_train_transform(data_cfg, train, eval_):
    """The transform training uses: open_clip's random-crop train transform, or with
    data.train_transform=eval the deterministic eval transform (what a feature cache needs)."""
    return eval_ if data_cfg.train_transform == "eval" else train


def _rgb(image):
    return image.convert("RGB")


# ----------------------------------------------------------------------------- weight formats

def convert_by_order(source: dict, target: dict, what: str = "weights") -> dict:
    """`source`'s tensors under `target`'s names, matched by position: for a checkpoint of the
    same architecture saved by another implementation (EfficientNet-Lite0 of the
    efficientnet_pytorch layout -> timm's tf_efficientnet_lite0). Refused (one ValueError line)
    unless both have the same number of tensors and every pair has the same shape and the same
    kind (the last name part: weight, bias, running_mean, ...); classifier tensors included."""
    if len(source) != len(target):
        raise ValueError(f"{what}: {len(source)} tensors, the model has {len(target)}")
    out = {}
    for (src_key, value), (dst_key, ref) in zip(source.items(), target.items()):
        if tuple(value.shape) != tuple(ref.shape) or src_key.rsplit(".", 1)[-1] != dst_key.rsplit(".", 1)[-1]:
            raise ValueError(f"{what}: {src_key} {tuple(value.shape)} does not match {dst_key} {tuple(ref.shape)}")
        out[dst_key] = value
    return out
