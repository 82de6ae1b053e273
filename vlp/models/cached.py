"""Each tower of a dual encoder as a frozen *stem* and a trainable *head*: tower(x) == head(stem(x)).

The towers split so, and what runs on the stems' outputs, are docs/design.md's ("Locked-tower
feature cache"); the HF text stem's attention mask is tokens != pad id, as HFTextEncoder.forward.

    split = tower_split(model, "image")          # TowerSplit(stem, head, kind, tensor_names)
    check_cacheable(model)                        # one ValueError line unless both stems are frozen
    emb = F.normalize(split.head(split.stem(x)), dim=-1)   # == model.encode_image(x)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from vlp.models.towers import in_tower


@dataclass(frozen=True)
class TowerSplit:
    """One tower as stem (frozen, cacheable) and head (trained); `tensor_names`: the keys of
    `model.clip.state_dict()` (and named_parameters) the stem depends on."""

    stem: Callable[[torch.Tensor], torch.Tensor]  # input (images / tokens) -> (b, d_stem)
    head: Callable[[torch.Tensor], torch.Tensor]  # (b, d_stem) -> (b, embed_dim), unnormalized
    kind: str  # "whole", "timm", "hf": what the key records and the messages name
    tensor_names: tuple[str, ...]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _names(clip: nn.Module, keep: Callable[[str], bool]) -> tuple[str, ...]:
    """Parameter and buffer names of `clip` that `keep` accepts (persistent or not)."""
    names = {n for n, _ in clip.named_parameters()} | {n for n, _ in clip.named_buffers()}
    return tuple(sorted(n for n in names if keep(n)))


def _all_frozen(clip: nn.Module, tower: str) -> bool:
    params = [p for n, p in clip.named_parameters() if in_tower(n, tower)]
    return bool(params) and not any(p.requires_grad for p in params)


def tower_split(model, tower: str) -> TowerSplit:
    """The stem/head split of `model`'s `tower` ("image" or "text"); a tower that has none
    (not locked whole, and not a timm / HF tower) is one ValueError line naming its type."""
    clip = model.clip
    if tower == "image":
        visual = clip.visual
        if _all_frozen(clip, "image"):
            return TowerSplit(lambda x: model.encode_image(x, normalize=False), _identity, "whole",
                              _names(clip, lambda n: in_tower(n, "image")))
        if hasattr(visual, "trunk") and hasattr(visual, "head"):  # open_clip TimmModel
            return TowerSplit(visual.trunk, visual.head, "timm", _names(clip, lambda n: n.startswith("visual.trunk.")))
        raise ValueError(f"model: the image tower {type(visual).__name__} cannot be cached: it trains and has no "
                         "frozen stem (supported: a timm tower, or any tower locked whole)")
    text = getattr(clip, "text", None)
    if _all_frozen(clip, "text"):
        return TowerSplit(lambda t: model.encode_text(t, normalize=False), _identity, "whole",
                          _names(clip, lambda n: in_tower(n, "text")))
    if hasattr(text, "transformer") and hasattr(text, "pooler"):  # open_clip HFTextEncoder
        proj = getattr(text, "proj", None)
        return TowerSplit(lambda t: hf_stem(text, t), proj if proj is not None else _identity, "hf",
                          _names(clip, lambda n: n.startswith(("text.transformer.", "text.pooler."))))
    name = type(text).__name__ if text is not None else f"{type(clip).__name__} text transformer"
    raise ValueError(f"model: the text tower {name} cannot be cached: it trains and has no frozen stem "
                     "(supported: a Hugging Face tower, or any tower locked whole)")


def hf_stem(text: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """open_clip HFTextEncoder.forward up to the projection: the pooled hidden states (b, width)."""
    attn_mask = (tokens != text.config.pad_token_id).long()
    return text.pooler(text.transformer(input_ids=tokens, attention_mask=attn_mask), attn_mask)


def check_cacheable(model) -> tuple[TowerSplit, TowerSplit]:
    """(image split, text split) when both stems are frozen, else one ValueError line naming the
    trainable tensor: a stem that trains would make every cached feature stale after one step."""
    splits = tower_split(model, "image"), tower_split(model, "text")
    params = dict(model.clip.named_parameters())
    for tower, split in zip(("image", "text"), splits):
        training = [n for n in split.tensor_names if n in params and params[n].requires_grad]
        if training:
            raise ValueError(f"model: the {tower} tower's stem has trainable parameters ({training[0]}"
                             f"{f' and {len(training) - 1} more' if len(training) > 1 else ''}): "
                             "its outputs cannot be cached; lock it")
    return splits
