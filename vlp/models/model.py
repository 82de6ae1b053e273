"""Dual encoder built from an open_clip config; tokenizer and transforms to match.

The model knows nothing about ranks or losses: `forward(image, text)` returns one typed
`DualEncoderOutput` with L2-normalised embeddings and the exponentiated logit scale.

    model, tok, train_tf, eval_tf = build_model(cfg.model, cfg.loss, data_cfg=cfg.data)

The build decides, once each, the temperature policy (vlp.losses.temperature: logit_scale's
init and trainability here; the model carries it as `model.temperature` for the trainer's
gradient routing and clamp) and the transform training uses (data.train_transform).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import open_clip
import torch
import torch.nn.functional as F
from open_clip.transformer import text_global_pool
from torch import nn

from vlp.models import cached, packaged, towers
from vlp.losses.temperature import TemperaturePolicy, temperature_policy

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(MODEL_CONFIG_DIR)


@dataclass
class DualEncoderOutput:
    image_emb: torch.Tensor  # (b, d), unit norm
    text_emb: torch.Tensor  # (b, d), unit norm
    logit_scale: torch.Tensor  # scalar, exp(log scale)
    logit_bias: Optional[torch.Tensor]  # scalar (SigLIP) or None


class DualEncoder(nn.Module):
    """Thin wrapper over an open_clip CLIP: typed output, open_clip state dict inside `.clip`.
    `trim_text` (on the host) drops the text columns that are padding in every row and
    `encode_text` runs on the shorter sequence: the same features and gradients (docs/design.md,
    "Text padding"; tests/models/test_model.py)."""

    TRIM_MULTIPLE = 8  # keep lengths on a few shapes (compile, tensor cores)

    def __init__(self, clip: nn.Module, text_pad_id: Optional[int] = None, frozen: Sequence[str] = (),
                 preprocess: Optional[dict] = None, temperature: Optional[TemperaturePolicy] = None):
        super().__init__()
        self.clip = clip
        # the policy logit_scale was built with (build_model): the trainer's gradient routing and clamp
        self.temperature = temperature
        self.text_pad_id = text_pad_id if _trimmable_text_tower(clip) else None
        self.frozen = list(frozen)  # submodules of `clip` locked by model.lock_* (vlp.models.towers)
        self.preprocess = dict(preprocess or {})  # image preprocessing of the tower, saved in checkpoints
        self._feature_heads: Optional[tuple] = None  # forward(features=True): see feature_heads

    def train(self, mode: bool = True) -> "DualEncoder":
        """Locked submodules stay in eval mode while the rest trains: their BatchNorm statistics
        (buffers, which requires_grad does not cover) and dropout stay fixed, so a locked tower
        is bit-identical after training."""
        super().train(mode)
        for name in self.frozen:
            self.clip.get_submodule(name).eval()
        return self

    def encode_image(self, image: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.clip.encode_image(image, normalize=normalize)

    def trim_text(self, text: torch.Tensor) -> torch.Tensor:
        """``text`` without the trailing all-padding columns (a multiple of 8 kept), or as it is
        when the tower cannot take it. Costs a host sync on an accelerator: trim on the CPU."""
        if self.text_pad_id is None or text.dim() != 2 or text.shape[1] <= self.TRIM_MULTIPLE:
            return text
        used = (text != self.text_pad_id).any(dim=0).nonzero()
        length = int(used[-1]) + 1 if len(used) else 1
        length = -(-length // self.TRIM_MULTIPLE) * self.TRIM_MULTIPLE
        return text[:, :length] if length < text.shape[1] else text

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        clip = self.clip
        length = text.shape[1]
        if length == clip.context_length or self.text_pad_id is None:
            return clip.encode_text(text, normalize=normalize)
        # open_clip CLIP.encode_text on the first `length` positions
        cast_dtype = clip.transformer.get_cast_dtype()
        x = clip.token_embedding(text).to(cast_dtype) + clip.positional_embedding[:length].to(cast_dtype)
        x = clip.transformer(x, attn_mask=clip.attn_mask[:length, :length])
        x = clip.ln_final(x)
        x = text_global_pool(x, text, clip.text_pool_type, eos_token_id=getattr(clip, "text_eos_id", None))
        if clip.text_projection is not None:
            x = clip.text_projection(x) if isinstance(clip.text_projection, nn.Linear) else x @ clip.text_projection
        return F.normalize(x, dim=-1) if normalize else x

    @property
    def log_logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def feature_heads(self) -> tuple:
        """(image head, text head) of the stem/head split (vlp.models.cached), found once: the
        split walks every parameter name, too slow for each step of a small head."""
        if self._feature_heads is None:
            self._feature_heads = (cached.tower_split(self, "image").head, cached.tower_split(self, "text").head)
        return self._feature_heads

    def forward(self, image: torch.Tensor, text: torch.Tensor, features: bool = False) -> DualEncoderOutput:
        """features=False: images (b, 3, H, W) and tokens (b, L). features=True: the towers'
        stem outputs (b, d_image_stem), (b, d_text_stem) (vlp.models.cached, cached by
        vlp.train.feature_cache); only the heads run. A forward keyword, so DDP passes it on."""
        bias = getattr(self.clip, "logit_bias", None)
        if features:
            image_head, text_head = self.feature_heads()
            image_emb, text_emb = F.normalize(image_head(image), dim=-1), F.normalize(text_head(text), dim=-1)
        else:
            image_emb, text_emb = self.encode_image(image), self.encode_text(text)
        return DualEncoderOutput(
            image_emb=image_emb,
            text_emb=text_emb,
            logit_scale=self.clip.logit_scale.exp().reshape(()),
            logit_bias=None if bias is None else bias.reshape(()),
        )


def _trimmable_text_tower(clip: nn.Module) -> bool:
    """open_clip's built-in causal text tower pooling at the EOT / EOS token or the first one."""
    return (isinstance(clip, open_clip.CLIP) and getattr(clip, "attn_mask", None) is not None
            and getattr(clip, "text_pool_type", None) in ("argmax", "eos", "first"))


def resolve_model_name(name: str) -> str:
    """A built-in / packaged open_clip name, `hf-hub:org/repo` (its open_clip_config.json, from
    the Hugging Face cache), or a JSON file path registered on the fly."""
    if name.startswith(towers.HF_HUB):  # its open_clip_config.json's model, registered under the hub name
        hub_model = hub_config(name)["model_cfg"]
        return towers.register_config(name, hub_model, name)
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {name}")
        open_clip.add_model_config(path)
        return path.stem
    if name not in open_clip.list_models():
        raise ValueError(f"unknown model '{name}': not an open_clip model, hf-hub:org/name or a .json config path")
    return name


def hub_config(name: str) -> dict:
    """open_clip_config.json of `hf-hub:org/repo` ({"model_cfg", "preprocess_cfg"}), read through
    the Hugging Face cache (offline once cached)."""
    from open_clip.pretrained import download_pretrained_from_hf

    try:
        path = download_pretrained_from_hf(name[len(towers.HF_HUB):].strip("/"), filename="open_clip_config.json")
        cfg = json.loads(Path(path).read_text())
    except Exception as e:  # noqa: BLE001  (hub / cache / JSON errors)
        raise FileNotFoundError(f"model {name}: no open_clip_config.json in the Hugging Face cache or hub "
                                f"({type(e).__name__}; offline runs need it cached)") from None
    if not isinstance(cfg, dict) or "model_cfg" not in cfg:
        raise ValueError(f"model {name}: its open_clip_config.json has no model_cfg")
    return cfg


def model_config_dict(name: str) -> dict:
    return open_clip.get_model_config(resolve_model_name(name))


def architecture(model_cfg) -> str:
    """The open_clip name to create: model.name resolved; with model.hf_text_dir, registered (in memory)
    with its text tower replaced by that HF model, pooled and projected as model_cfg says (towers.hf_text_cfg)."""
    name = resolve_model_name(model_cfg.name)
    if not model_cfg.hf_text_dir:
        return name
    cfg = json.loads(json.dumps(open_clip.get_model_config(name)))
    text_cfg = towers.hf_text_cfg(model_cfg.hf_text_dir, cfg["text_cfg"].get("context_length", 77),
                                  model_cfg.text_pooler, model_cfg.text_proj, model_cfg.text_context_length)
    cfg["text_cfg"] = text_cfg
    return towers.register_config(name, cfg, f"{name}|{json.dumps(text_cfg, sort_keys=True)}")


def build_model(model_cfg, loss_cfg, device: str | torch.device = "cpu", init_weights: bool = True,
                data_cfg=None):
    """Return (DualEncoder, tokenizer, train_transform, eval_transform).

    Weights: model.pretrained, then model.image_pretrained / text_pretrained (vlp.models.towers), then
    the locks. init_weights=False builds the architecture only (a checkpoint's weights follow:
    the pretrained files need not exist any more). hf_text_dir is read either way (its config
    and tokenizer are part of the architecture).

    Temperature (initial logit_scale / logit_bias, trainability): vlp.losses.temperature's policy
    for `loss_cfg`, computed here once and carried by the model (`model.temperature`).

    train_transform: the one training uses (vlp.models.towers.chosen_train_transform): with a
    `data_cfg` whose train_transform is eval, the eval transform; else open_clip's augmenting one.
    """
    model_cfg = packaged.resolve_model_cfg(model_cfg)  # pypi:<name> sources -> their local files
    name = architecture(model_cfg)
    policy = temperature_policy(loss_cfg)
    kwargs = dict(init_logit_scale=policy.init_log_scale)
    if policy.init_logit_bias is not None:
        kwargs["init_logit_bias"] = policy.init_logit_bias
    if model_cfg.text_context_length and not model_cfg.hf_text_dir:
        kwargs["force_context_length"] = model_cfg.text_context_length
    if not init_weights:
        model_cfg = dataclasses.replace(model_cfg, pretrained=None, image_pretrained=None, text_pretrained=None)
    clip, image_from_timm = _create(name, model_cfg, device, kwargs, init_weights)
    overlay, image_from_timm = _load_weights(clip, model_cfg, init_weights, image_from_timm)
    if model_cfg.grad_checkpointing:
        clip.set_grad_checkpointing(True)
    frozen = towers.lock_towers(clip, model_cfg)
    preprocess = towers.tower_preprocess(clip, image_from_timm, overlay)
    train_tf, eval_tf = towers.transforms(preprocess)
    if data_cfg is not None:
        train_tf = towers.chosen_train_transform(data_cfg, train_tf, eval_tf)
    if not policy.trainable:  # also over a pretrained checkpoint's value
        with torch.no_grad():
            clip.logit_scale.fill_(policy.init_log_scale)
        clip.logit_scale.requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(name)
    pad_id = 0 if isinstance(tokenizer, open_clip.tokenizer.SimpleTokenizer) else None  # pads with 0
    if model_cfg.hf_text_dir:
        towers.check_hf_projection(clip, model_cfg.text_proj)
    model = DualEncoder(clip, text_pad_id=pad_id, frozen=frozen, preprocess=preprocess, temperature=policy)
    return model, tokenizer, train_tf, eval_tf


def _load_weights(clip: nn.Module, model_cfg, init_weights: bool, image_from_timm: bool) -> tuple[dict, bool]:
    """Load model.pretrained (a hf-hub: model's own weights by default), then the towers' weights.
    Return (the preprocessing they bring, whether the image tower now holds timm weights)."""
    pretrained = model_cfg.pretrained
    overlay = {}
    if model_cfg.name.startswith(towers.HF_HUB):  # the repository's preprocessing, and its weights by default
        overlay = hub_config(model_cfg.name).get("preprocess_cfg") or {}
        pretrained = pretrained or (model_cfg.name if init_weights else None)
    if pretrained:
        load_pretrained(clip, pretrained, model_cfg.name)
        overlay.update(towers.tag_preprocess(pretrained, model_cfg.name))
    for tower, source in (("image", model_cfg.image_pretrained), ("text", model_cfg.text_pretrained)):
        if source:
            from_open_clip = towers.load_tower(clip, tower, source, model_cfg.name, f"model.{tower}_pretrained")
            if tower == "image":  # a timm trunk file brings timm's preprocessing, open_clip weights the model's
                image_from_timm = not from_open_clip
                overlay.update(towers.tag_preprocess(source, model_cfg.name))
    return overlay, image_from_timm


def _create(name: str, model_cfg, device, kwargs: dict, init_weights: bool = True) -> tuple[nn.Module, bool]:
    """(open_clip model, whether its image tower holds timm weights). A model JSON asking for
    timm's pretrained trunk (`timm_model_pretrained: true`) gets it through timm, from the Hugging
    Face cache, unless model.image_pretrained gives the weights; when timm cannot load them the
    build stops with one line instead of leaving the tower random."""
    vision = open_clip.get_model_config(name).get("vision_cfg", {})
    want_timm = bool(init_weights and vision.get("timm_model_name") and vision.get("timm_model_pretrained")
                     and not model_cfg.image_pretrained and not model_cfg.pretrained)
    try:
        with _without_random_init_notice():
            clip = open_clip.create_model(name, device=device, pretrained_image=want_timm, **kwargs)
    except Exception as e:  # noqa: BLE001
        if not want_timm:
            raise
        raise ValueError(f"model {model_cfg.name} sets timm_model_pretrained: true, but timm could not load "
                         f"{vision['timm_model_name']}'s weights ({type(e).__name__}: offline and not in the Hugging "
                         "Face cache?): set model.image_pretrained to a local weights file") from None
    return clip, want_timm


@contextlib.contextmanager
def _without_random_init_notice():
    """Quiet the notices of model creation that vlp's own loading makes wrong: open_clip's 'No
    pretrained weights loaded ... initialized randomly' and '... initialized partially' (vlp loads
    model.pretrained / image_pretrained / text_pretrained after creation, and a checkpoint's
    weights after that), and transformers' load report of a HF text tower (the BERT pooler's
    weights are 'unexpected' whenever another pooler is used). stderr stays for user errors."""
    def drop(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "No pretrained weights loaded" not in message and "initialized partially" not in message

    root = logging.getLogger()
    root.addFilter(drop)
    hf_logging = None
    try:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is only needed for HF text towers
        pass
    try:
        yield
    finally:
        root.removeFilter(drop)
        if hf_logging is not None:
            hf_logging.set_verbosity(verbosity)


def load_pretrained(clip: nn.Module, source: str, model_name: str = "") -> None:
    """Initialise the whole model from an open_clip checkpoint: a local file, a pretrained tag of
    `model_name` or hf-hub:org/repo (vlp.models.towers.resolve_weights; open_clip.load_checkpoint:
    weights_only unpickling, key conversions, strict). Anything that is not one, or not for this
    model (a pickle with code, another architecture, a text file), is one ValueError line."""
    from vlp.util import first_line

    path = towers.resolve_weights(source, model_name) if model_name else source
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.pretrained: no such file: {path}")
    from vlp.checkpoint.integrity import verify

    verify(path, "model.pretrained")  # a vlp export's checksums, before unpickling
    try:
        open_clip.load_checkpoint(clip, path)
    except Exception as e:  # UnpicklingError, RuntimeError (size mismatch), KeyError, StopIteration, ...
        why = state_dict_mismatch(e) if isinstance(e, RuntimeError) else first_line(e)[:200]
        raise ValueError(f"model.pretrained {path} cannot be loaded into this model: {why} (weights of one "
                         "tower go in model.image_pretrained / model.text_pretrained)") from None


def state_dict_mismatch(error: BaseException) -> str:
    """One line from load_state_dict's many-line error: how many keys are missing, unexpected
    or of another shape, with one example each."""
    from vlp.util import first_line

    text = str(error)
    parts = []
    for label, pattern in (("missing", r"Missing key\(s\) in state_dict: (.*)"),
                           ("unexpected", r"Unexpected key\(s\) in state_dict: (.*)")):
        found = re.search(pattern, text)
        names = re.findall(r'"([^"]+)"', found.group(1)) if found else []
        if names:
            parts.append(f"{len(names)} {label} keys (e.g. {names[0]})")
    sizes = re.findall(r"size mismatch for ([^:]+): (.*)", text)
    if sizes:
        parts.append(f"{len(sizes)} shape mismatches (e.g. {sizes[0][0]}: {sizes[0][1][:160]})")
    return "; ".join(parts) or first_line(error)[:200]


def export_open_clip(model: DualEncoder, path: str | Path) -> None:
    """Write the open_clip state dict so `open_clip.create_model(name, pretrained=path)` loads it;
    "preprocess_cfg" (open_clip's hub-config name) keeps the tower's image preprocessing for
    `vlp eval`."""
    from vlp.checkpoint.integrity import manifest_path, write_manifest

    state = {k: v.detach().cpu() for k, v in model.clip.state_dict().items()}
    manifest_path(path).unlink(missing_ok=True)  # an older export's: never beside the new bytes
    torch.save({"state_dict": state, "preprocess_cfg": dict(model.preprocess)}, path)
    write_manifest(path)  # last: readers (vlp eval, model.pretrained) check the bytes against it
