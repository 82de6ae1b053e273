"""Every config key, declared once: type (the annotation), default, validation rule and resume
rule (`key(default, rule, resume)`, vlp.config.rules) and what it means (the docstring below it).

    cfg.data.batch_per_device          # the sections of vlp.config.Config

The `grid:` keys of `vlp compare` are declared the same way in vlp.config.grid_keys.

vlp.config derives its validation table `RULES` from these fields and vlp.checkpoint.resume its
`RESUME_RULES`; docs/configuration.md lists them (scripts/config_keys.py writes the list).
A new key is one field here: a field declared without `key(...)` stops vlp at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from vlp.config.rules import (ANY, APPLIED, CHECKPOINT, COUNT, FILE, FOLDER, HARMLESS, HF_FOLDER,
                              LAYOUT_KEY, LAYOUT_STATE, NAME, POSITIVE_INT, QUIET, REFUSE, SAMPLING_WEIGHTS,
                              SEED, SHAPES_MODEL, TEXT, WEIGHTS, WEIGHTS_WIN, KeyRule, key, number)

OPTIMIZERS = ("adamw", "lars", "sgd")
"""optim.name's values (OptimConfig.name) and grid.optimizers'."""


@dataclass
class ModelConfig:
    """`model:` the dual encoder: architecture, initial weights, locked towers."""

    name: str = key("vlp-tiny", NAME, SHAPES_MODEL)
    """open_clip model name (built-in or vlp/models/model_configs/*.json) or a path to a model JSON."""
    pretrained: Optional[str] = key(None, WEIGHTS, WEIGHTS_WIN)
    """Whole-model weights: a local open_clip checkpoint file, an open_clip pretrained tag of
    `name` (e.g. laion2b_s34b_b79k) or hf-hub:org/repo; tags and hub names are read from the
    Hugging Face cache (offline once cached). A `name` of hf-hub:org/repo loads its own weights."""
    image_pretrained: Optional[str] = key(None, WEIGHTS, WEIGHTS_WIN)
    """Weights for the image tower only (after `pretrained`): a timm/torchvision state dict of a
    timm trunk (classifier keys dropped), an open_clip checkpoint (its visual.* keys), a tag or
    hf-hub:org/repo. Strict: any missing/unexpected key is an error. A timm trunk file also brings
    timm's preprocessing (mean, std, resize) for that model."""
    text_pretrained: Optional[str] = key(None, WEIGHTS, WEIGHTS_WIN)
    """Weights for the text tower only: an open_clip checkpoint (all but visual.* and the logit
    scale/bias), a tag or hf-hub:org/repo. A Hugging Face text tower comes from hf_text_dir."""
    hf_text_dir: Optional[str] = key(None, HF_FOLDER, SHAPES_MODEL)
    """Local Hugging Face model directory (config, weights, tokenizer) used as the text tower,
    initialised from its weights; replaces the text_cfg of `name`."""
    text_pooler: Optional[Literal["cls", "cls_pooler", "mean", "last"]] = key(
        None, ANY, KeyRule(REFUSE, "the text tower was trained with the saved pooling"))
    """hf_text_dir: how token states become one vector. cls: the CLS token's last hidden state;
    cls_pooler: BERT's pooler output (dense + tanh over CLS); mean: mean over non-padding tokens
    (sentence-transformers); last: the last non-padding token (EOS). Unset: the folder's
    sentence-transformers pooling (1_Pooling/config.json), else cls_pooler."""
    text_proj: Literal["linear", "mlp", "none"] = key("linear", ANY, SHAPES_MODEL)
    """hf_text_dir: projection from the HF width to the embedding (none: widths must be equal)."""
    text_context_length: Optional[int] = key(None, number(1, 4096, integer=True), SHAPES_MODEL)
    """Tokens per caption (the tokenizer pads/truncates to it). Unset: the model config's. For an
    HF tower at most its max_position_embeddings; for open_clip's text tower it resizes the
    positional embedding."""
    grad_checkpointing: bool = key(False, ANY, APPLIED)
    """Recompute activations in backward to save memory."""
    lock_image: bool = key(False, ANY, SHAPES_MODEL)
    """LiT: freeze the image tower."""
    lock_image_unlocked_groups: int = key(0, COUNT, SHAPES_MODEL)
    """With lock_image: leave the last n layer groups of the image tower trainable."""
    lock_text: bool = key(False, ANY, SHAPES_MODEL)
    """Freeze the text tower."""
    lock_text_unlocked_layers: int = key(0, COUNT, SHAPES_MODEL)
    """With lock_text: leave the last n text layers trainable."""


@dataclass
class DataConfig:
    """`data:` the training and held-out shards and how they are read."""

    train_shards: str = key("", ANY,  # empty: not given (`vlp train` asks for it)
                            KeyRule(REFUSE, "the saved data position is in the old shard list"))
    """Webdataset spec: brace expansion, several sources joined by '::'."""
    eval_shards: Optional[str] = key(None, TEXT, APPLIED)
    """Held-out shards for retrieval eval (sequential, every sample once)."""
    batch_per_device: int = key(64, POSITIVE_INT, LAYOUT_KEY)
    """Per-device (per-GPU) micro-batch size: the knob the loss comparison sweeps."""
    num_workers: int = key(0, COUNT, LAYOUT_KEY)
    """Dataloader worker processes per rank."""
    mode: Literal["split", "resampled"] = key("split", ANY, LAYOUT_KEY)
    """'split': shuffled epochs without replacement; 'resampled': infinite, with replacement."""
    weights: Optional[str] = key(None, SAMPLING_WEIGHTS, LAYOUT_KEY)
    """Per-source sampling weights for '::'-joined sources in resampled mode, e.g. '1::2'."""
    shuffle_buffer: int = key(1000, POSITIVE_INT, LAYOUT_KEY)
    """Sample shuffle buffer size."""
    decode_size: Optional[int] = key(None, POSITIVE_INT, APPLIED)
    """Unset (default): the train transform's RandomResizedCrop box is drawn from the JPEG header
    and the JPEG decoded at the smallest DCT scale keeping the box >= the output size (same
    boxes as a full decode; vlp/data/decode.py). Set: the older whole-image DCT downscale
    keeping both sides >= this, the box drawn on the downscaled image (can upsample the crop;
    as fast as the default for open_clip's scale=(0.9, 1), see BENCHMARKS.md)."""
    num_samples: Optional[int] = key(None, POSITIVE_INT, LAYOUT_KEY)
    """Samples per epoch (all ranks). Needed for remote shards (URL or pipe:) that have no
    sizes.json or img2dataset *_stats.json beside them: their sizes are then assumed equal
    (vlp.data.shard_list.shard_sizes). Unset: the total of the shards' sizes."""
    decode: Literal["auto", "cpu", "gpu"] = key("auto", ANY, APPLIED)
    """Where training images are decoded. cpu: in the loader workers (uint8 to the device, which
    normalises and, on CUDA, resizes); gpu: batched nvjpeg on the device, the workers only parse
    headers and draw crop boxes; refused without CUDA (docs/data-path.md). auto: gpu when the
    run trains on CUDA (1.41x cpu's samples/s on an H200, BENCHMARKS.md), else cpu."""
    io_retries: int = key(3, COUNT, APPLIED)
    """Retries of a failed shard open or read (remote shards); a retry continues at the same
    byte, so batches do not change. A shard still failing counts as 'bad_shard'."""
    io_backoff_s: float = key(1.0, number(0), APPLIED)
    """Wait before the first retry; doubles for each further one."""
    train_transform: Literal["augment", "eval"] = key("augment", ANY, APPLIED)
    """Image transform of the training stream. augment: open_clip's train transform
    (RandomResizedCrop: a new crop every epoch); eval: the model's eval transform (resize, centre
    crop: deterministic), needed by feature_cache."""
    feature_cache: Optional[str] = key(None, FOLDER, APPLIED)  # resumed: the same batches with or without (1e-6)
    """LiT: compute the locked towers' outputs once per training sample and reuse them every
    epoch (vlp/train/feature_cache.py). Unset: off; "memory": built at start-up, held in memory
    (per process); a folder: <folder>/<key>.pt, reused by later runs whose towers, transform,
    tokenizer and shards are the same. Needs train_transform=eval and both towers locked whole."""


@dataclass
class LossConfig:
    """`loss:` the contrastive loss and its temperature."""

    name: str = key("infonce", ANY, LAYOUT_STATE)
    """Contrastive loss over the gathered global batch: a name of vlp/losses/registry.py (checked
    against the registry by vlp/experiment.py, the layer that builds the loss)."""
    temperature: Optional[Literal["learnable", "fixed", "split"]] = key(None, ANY, LAYOUT_STATE)
    """learnable: logit_scale trained by the loss; fixed: 1/tau, never trained;
    split: (FlatNCE, DCL, SogCLR) encoders get the loss's gradient, logit_scale InfoNCE's.
    Unset: 'split' for FlatNCE, DCL and SogCLR (best of the three on the small-batch grid, and it
    keeps logit_scale off the clamp; see docs/losses.md), 'fixed' for iSogCLR (per-sample
    temperatures in its state), 'learnable' otherwise.
    The old name 'infonce' for 'split' is still read (configs and checkpoints of older runs).
    vlp/losses/temperature.py turns this section into the model's init and the trainer's rules."""
    tau: Optional[float] = key(None, number(0, 1, lo_open=True),
                               KeyRule(REFUSE, "logit_scale comes from the checkpoint"))
    """Initial temperature (learnable/split) or the fixed one (fixed), in (0, 1] with
    1/tau <= max_logit_scale. Unset: the loss's published init (CLIP 0.07; SigLIP's
    siglip_init(), logit_scale 10 and bias -10). isogclr: every sample's start."""
    max_logit_scale: float = key(100.0, number(1), APPLIED)
    """logit_scale = 1/tau is clamped to [1, max_logit_scale] after each optimizer step."""
    gamma: float = key(0.9, number(0, 1, lo_open=True), APPLIED)
    """SogCLR: moving-average rate of the per-sample normaliser u <- (1 - gamma) u + gamma g, in
    (0, 1]; 1 gives FlatNCE's gradient (vlp/losses/sogclr.py). With gamma_schedule=cosine, the start."""
    gamma_min: float = key(0.2, number(0, 1, lo_open=True), APPLIED)
    """SogCLR, gamma_schedule=cosine: the value gamma decays to at the end of the run (FastCLIP)."""
    gamma_schedule: Literal["constant", "cosine"] = key("constant", ANY, APPLIED)
    """SogCLR: constant gamma, or FastCLIP's cosine decay from gamma to gamma_min over the run."""
    rho: float = key(8.0, number(), APPLIED)
    """fastclip, isogclr: rho of the temperature objective tau * (log g + rho); larger, smaller tau."""
    tau_lr: float = key(1e-4, number(0), APPLIED)
    """isogclr: step size of the per-sample temperatures (momentum SGD, vlp/losses/isogclr.py)."""
    tau_min: float = key(0.01, number(0, 1, lo_open=True), APPLIED)
    """isogclr: lower bound of the per-sample temperatures."""
    tau_max: float = key(1.0, number(0, 1, lo_open=True), APPLIED)
    """isogclr: upper bound of the per-sample temperatures (loss.tau, their start, lies between)."""


@dataclass
class OptimConfig:
    """`optim:` the optimizer and the learning-rate schedule."""

    name: Literal["adamw", "lars", "sgd"] = key(  # = OPTIMIZERS
        "adamw", ANY, KeyRule(REFUSE, "the saved optimizer state is another optimizer's"))
    """adamw (fused); lars: SGD with momentum and LARS's layer-wise trust ratio (SimCLR/FlatNCE
    recipe; biases, norms and logit_scale neither adapted nor decayed; vlp/train/optim.py); sgd: SGD
    with momentum. beta1/beta2/eps apply to adamw only."""
    momentum: float = key(0.9, number(0, 1, hi_open=True), APPLIED)  # resumed: vlp.train.optim.follow_config
    """lars/sgd: momentum."""
    trust_coefficient: float = key(0.001, number(0, lo_open=True), APPLIED)
    """lars: eta in the trust ratio eta * ||w|| / (||grad|| + weight_decay * ||w||)."""
    lr: float = key(5e-4, number(0, lo_open=True), APPLIED)
    """Peak learning rate."""
    weight_decay: float = key(0.2, number(0), APPLIED)
    """AdamW weight decay (never on biases, norms, embeddings' gains or logit_scale/bias)."""
    beta1: float = key(0.9, number(0, 1, hi_open=True), APPLIED)
    """AdamW: decay rate of the gradient's moving average."""
    beta2: float = key(0.98, number(0, 1, hi_open=True), APPLIED)
    """AdamW: decay rate of the squared gradient's moving average."""
    eps: float = key(1e-6, number(0, lo_open=True), APPLIED)
    """AdamW: added to the denominator."""
    warmup_steps: int = key(50, COUNT, APPLIED)  # resumed: the LR lambda reads the new config
    """Linear warmup steps."""
    schedule: Literal["cosine", "constant", "const-cooldown"] = key("cosine", ANY, APPLIED)
    """LR schedule after warmup."""
    cooldown_steps: int = key(0, COUNT, APPLIED)
    """Steps of linear cooldown at the end (const-cooldown)."""
    grad_clip: Optional[float] = key(None, number(0, lo_open=True), APPLIED)
    """Clip the global gradient norm to this value."""


@dataclass
class TrainConfig:
    """`train:` the run: budget, precision, parallelism, logging, checkpoints, resume."""

    seed: int = key(0, SEED, LAYOUT_KEY)
    """Seeds model init and the data order."""
    samples: int = key(100_000, POSITIVE_INT, APPLIED)
    """Budget of samples seen (global): steps = samples // global batch."""
    accum_steps: int = key(1, POSITIVE_INT, LAYOUT_KEY)
    """Micro-batches per optimizer step; the contrastive batch grows k-fold (GradCache)."""
    precision: Literal["fp32", "bf16", "fp16"] = key("fp32", ANY, APPLIED)
    """Autocast precision (losses are always computed in fp32)."""
    log_every: int = key(10, POSITIVE_INT, HARMLESS)
    """Steps between console / JSONL log lines."""
    eval_every: int = key(0, COUNT, APPLIED)
    """Steps between evals (0: only at the end)."""
    checkpoint_every: int = key(0, COUNT, HARMLESS)
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = key(2, COUNT, HARMLESS)
    """Number of step checkpoints to keep (0: keep all)."""
    save_final: bool = key(True, ANY, HARMLESS)
    """Write the final checkpoint and open_clip_model.pt at the end (false: neither, e.g. a study
    run whose trained model is ranked in memory; an interrupted run then restarts)."""
    output_dir: str = key("runs/default", FOLDER, QUIET)
    """Where logs, checkpoints and eval results go."""
    resume: Optional[str] = key(None, CHECKPOINT, QUIET)
    """'latest' (newest checkpoint in output_dir) or a checkpoint path."""
    resume_mode: Literal["exact", "continue"] = key("exact", ANY, APPLIED)
    """exact: the data layout (world size, batch_per_device, accum_steps, num_workers, seed,
    shuffle_buffer, mode, loss) must equal the checkpoint's, and the run continues bit-identically;
    a change is refused by name. continue: it may change (e.g. after losing a node); the run goes on
    from the same global sample, finishing the epoch under the new layout (vlp/checkpoint/resume.py)."""
    dist_timeout_s: float = key(900.0, number(1), APPLIED)
    """Seconds a collective may wait for another rank before this rank fails with an error
    (a dead rank or node never leaves the others waiting forever). Rank 0's eval and checkpoint
    writes happen while the others wait, so keep it above their duration."""
    max_nonfinite: int = key(5, POSITIVE_INT, APPLIED)
    """Stop after this many consecutive non-finite losses (each one skips its step), saving
    the last good state; >= 1."""
    compile: bool = key(False, ANY, APPLIED)
    """torch.compile the dual encoder (the gather and the loss stay eager)."""
    cuda_graphs: bool = key(False, ANY, APPLIED)
    """Replay each train step as a CUDA graph (vlp/train/static_step.py): no host sync a step,
    non-finite steps skipped on the device and counted at log steps. CUDA only; train.parallel=ddp,
    precision fp32 or bf16, optim.name=adamw (docs/performance.md)."""
    parallel: Literal["ddp", "fsdp"] = key("ddp", ANY, APPLIED)  # either format resumes under either
    """ddp: replicas kept in sync by Accelerate's DDP. fsdp: FSDP2 shards parameters, gradients
    and AdamW state over all ranks (vlp/train/parallel.py; same code on CPU and GPU; needs >= 2
    processes; precision fp32 or bf16). Checkpoints become DCP directories (step_N/)."""
    wandb_project: Optional[str] = key(None, TEXT, APPLIED)
    """Also log to Weights & Biases under this project (needs `pip install wandb`)."""
    break_lock: bool = key(False, ANY, QUIET)
    """Take over output_dir's lock (vlp.lock) even when its holder cannot be shown to be gone
    (another host's run): only once that run is known to have ended (vlp/checkpoint/lock.py)."""


@dataclass
class EvalConfig:
    """`eval:` evaluation during training."""

    batch_size: int = key(256, POSITIVE_INT, HARMLESS)
    """Batch size for embedding eval data."""
    suite: Optional[str] = key(None, FILE, APPLIED)
    """Eval suite YAML (configs/eval_*.yaml: zero-shot classification, more retrieval sets)
    run with the held-out retrieval at every eval."""
