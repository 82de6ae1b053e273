"""Resume on a changed cluster: which changes a checkpoint allows, and where the data goes on.

The data a step sees is decided by the *layout*: world size, per-device batch, accum_steps,
num_workers, seed, shuffle buffer and mode (vlp.data.stream: rank r owns a contiguous
range of the epoch, worker w the batches j = w mod W of it, each read through a seeded shuffle
buffer). Hence:

* ``train.resume_mode: exact`` (default): the layout must not change. The run then continues
  bit-identically (CPU, deterministic settings) to an uninterrupted one. A changed layout, seed
  or loss would alter results silently, so it is refused with one line naming each change and
  how to allow it.
* ``train.resume_mode: continue``: the layout (and seed, loss) may change, e.g. after a node is
  lost. The run goes on from the same global sample position: every rank saved the pieces of
  the current epoch it had not consumed (``Loader.rest_of_epoch``); concatenated in rank order,
  they are read as the rest of the epoch under the new layout, so no sample of the epoch is
  repeated or skipped (a remainder smaller than one global batch is dropped, as ``drop_last``
  does at every epoch end). Later epochs use the new layout. In resampled mode (sampling with
  replacement) the position in the epoch is carried over in samples. The LR schedule follows
  samples seen, so it is continuous across a change of global batch.
* Never: a changed model, shard list or optimizer (the weights, the optimizer state or the
  saved shard pieces would not fit), nor a value the checkpoint overrides (pretrained weights,
  tau): refused by name.
* Every other key is applied from the resume step on and logged ("optim.lr 0.001 -> 1e-05 from
  step 12"); ``apply_optim_changes`` makes the optimizer and LR schedule follow the new values
  (a loaded optimizer state would otherwise keep the saved lr, weight decay and betas).

Which key is which is ONE table, ``RESUME_RULES``; checkpoint.changed_settings and
vlp compare's harmless keys are views of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vlp.config import Config, ConfigError
from vlp.train.data import DataPosition

# ----------------------------------------------------------------------------- the rules table
APPLY, LAYOUT, REFUSE = "apply", "layout", "refuse"


@dataclass(frozen=True)
class KeyRule:
    """What a resume does with a changed config key.

    kind: APPLY: the new value is used from the resume step on (and logged); LAYOUT: it decides
    the data order, so exact mode refuses it and continue mode applies it; REFUSE: it cannot apply
    to a saved run (the weights, optimizer state or shard pieces would not fit, or the checkpoint's
    value wins), so it is refused by name. shapes_state: the saved tensors depend on it (named when
    a checkpoint does not load). results: a change can alter what the run computes (vlp compare
    treats a finished run as stale on such a change). quiet: not logged when applied."""

    kind: str
    why: str = ""
    shapes_state: bool = False
    results: bool = True
    quiet: bool = False


_WEIGHTS_WIN = KeyRule(REFUSE, "the weights come from the checkpoint")
_SHAPE = KeyRule(REFUSE, "the saved model has other parameters", shapes_state=True)
_SAME = KeyRule(APPLY)  # read afresh from the config every step or at start
_HARMLESS = KeyRule(APPLY, results=False)

RESUME_RULES: dict[str, KeyRule] = {
    # ONE line per config field (tests/test_resume_rules.py checks it covers vlp.config.RULES)
    "model.name": _SHAPE,
    "model.pretrained": _WEIGHTS_WIN,
    "model.image_pretrained": _WEIGHTS_WIN,
    "model.text_pretrained": _WEIGHTS_WIN,
    "model.hf_text_dir": _SHAPE,
    "model.text_pooler": KeyRule(REFUSE, "the text tower was trained with the saved pooling"),
    "model.text_proj": _SHAPE,
    "model.text_context_length": _SHAPE,
    "model.grad_checkpointing": _SAME,
    "model.lock_image": _SHAPE,
    "model.lock_image_unlocked_groups": _SHAPE,
    "model.lock_text": _SHAPE,
    "model.lock_text_unlocked_layers": _SHAPE,
    "data.train_shards": KeyRule(REFUSE, "the saved data position is in the old shard list"),
    "data.eval_shards": _SAME,
    "data.batch_per_device": KeyRule(LAYOUT),
    "data.num_workers": KeyRule(LAYOUT),
    "data.mode": KeyRule(LAYOUT),
    "data.weights": KeyRule(LAYOUT),
    "data.shuffle_buffer": KeyRule(LAYOUT),
    "data.decode_size": _SAME,
    "data.decode": _SAME,  # where images decode: the same crop boxes either way
    "data.num_samples": KeyRule(LAYOUT),
    "data.io_retries": _SAME,
    "data.io_backoff_s": _SAME,
    "data.train_transform": _SAME,  # the stream's transform, read at start
    "data.feature_cache": _SAME,  # read at start; the same batches with or without (to 1e-6)
    "loss.name": KeyRule(LAYOUT, shapes_state=True),
    "loss.temperature": KeyRule(LAYOUT, shapes_state=True),
    "loss.tau": KeyRule(REFUSE, "logit_scale comes from the checkpoint"),
    "loss.max_logit_scale": _SAME,
    "loss.gamma": _SAME,
    "loss.gamma_min": _SAME,
    "loss.gamma_schedule": _SAME,
    "optim.name": KeyRule(REFUSE, "the saved optimizer state is another optimizer's"),
    "optim.momentum": _SAME,  # apply_optim_changes
    "optim.trust_coefficient": _SAME,
    "optim.lr": _SAME,
    "optim.weight_decay": _SAME,
    "optim.beta1": _SAME,
    "optim.beta2": _SAME,
    "optim.eps": _SAME,
    "optim.warmup_steps": _SAME,  # the LR lambda reads the new config
    "optim.schedule": _SAME,
    "optim.cooldown_steps": _SAME,
    "optim.grad_clip": _SAME,
    "train.seed": KeyRule(LAYOUT),
    "train.samples": _SAME,
    "train.accum_steps": KeyRule(LAYOUT),
    "train.precision": _SAME,
    "train.log_every": _HARMLESS,
    "train.eval_every": _SAME,
    "train.checkpoint_every": _HARMLESS,
    "train.keep_last": _HARMLESS,
    "train.save_final": _HARMLESS,
    "train.output_dir": KeyRule(APPLY, results=False, quiet=True),
    "train.resume": KeyRule(APPLY, results=False, quiet=True),
    "train.resume_mode": _SAME,
    "train.dist_timeout_s": _SAME,
    "train.max_nonfinite": _SAME,
    "train.compile": _SAME,
    "train.parallel": _SAME,  # either format resumes under either parallelism
    "train.wandb_project": _SAME,
    "train.break_lock": KeyRule(APPLY, results=False, quiet=True),
    "eval.batch_size": _HARMLESS,
    "eval.suite": _SAME,
}

# derived views for the modules that used to keep their own lists
LAYOUT_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.kind == LAYOUT)
FIXED_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.kind == REFUSE)
STATE_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.shapes_state)
HARMLESS_KEYS = tuple(k for k, r in RESUME_RULES.items() if not r.results)


def _dotted(config: dict, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _has(config: dict, key: str) -> bool:
    section, _, name = key.partition(".")
    return isinstance(config.get(section), dict) and name in config[section]


def _saved_value(saved_cfg: dict, key: str) -> Any:
    old = _dotted(saved_cfg, key)
    if key == "loss.temperature" and old == "infonce":  # the mode's old name
        old = "split"
    return old


def resume_changes(saved_cfg: dict, new_cfg: dict) -> tuple[list[str], list[str]]:
    """(applied, refused): 'key old -> new' for each changed key the resume applies, and
    'key: old -> new (why)' for each it refuses, by RESUME_RULES (LAYOUT keys: refused when
    new_cfg's train.resume_mode is exact). Keys the saved config lacks (added to vlp since) are
    not compared."""
    continue_mode = _dotted(new_cfg, "train.resume_mode") == "continue"
    applied, refused = [], []
    for key, rule in RESUME_RULES.items():
        if not _has(saved_cfg or {}, key):
            continue
        old, new = _saved_value(saved_cfg, key), _dotted(new_cfg, key)
        if old == new:
            continue
        if rule.kind == APPLY or (rule.kind == LAYOUT and continue_mode):
            if not rule.quiet:
                applied.append(f"{key} {old!r} -> {new!r}")
        else:
            why = rule.why or "exact resume keeps the data layout"
            refused.append(f"{key}: {old!r} -> {new!r} ({why})")
    return applied, refused


def applied_lines(saved: dict, cfg: Config) -> list[str]:
    """The log lines of the config changes a resume from `saved` applies: '[vlp] resume:
    optim.lr 0.001 -> 1e-05 from step 12'."""
    applied, _ = resume_changes(saved.get("config") or {}, cfg.to_dict())
    return [f"[vlp] resume: {line} from step {saved.get('step')}" for line in applied]


def apply_optim_changes(optimizer, scheduler, cfg: Config) -> None:
    """Make a resumed optimizer and LR schedule follow `cfg.optim`, not the checkpoint's values
    (optimizer.load_state_dict restores every group's lr, weight decay, betas, ...; the
    scheduler's state its base_lrs). Call after loading both and after the trainer's
    samples_seen is restored (the LR lambda reads it): the step about to run uses the new peak
    lr at the schedule's current point. Groups follow vlp.train.optim.param_groups: group 0 has no
    weight decay, the others cfg.optim.weight_decay."""
    o = cfg.optim
    for i, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = o.lr
        if i > 0:
            group["weight_decay"] = o.weight_decay
        if "betas" in group:
            group["betas"] = (o.beta1, o.beta2)
        if "eps" in group:
            group["eps"] = o.eps
        if "momentum" in group:
            group["momentum"] = o.momentum
        if "eta" in group:
            group["eta"] = o.trust_coefficient
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    lambdas = getattr(scheduler, "lr_lambdas", None) or [lambda _: 1.0] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def apply_changes(saved: dict, cfg: Config, optimizer, scheduler) -> list[str]:
    """The one call after a resume has loaded everything: apply the optimizer's new settings
    (apply_optim_changes) and return the log lines of every applied change (applied_lines)."""
    apply_optim_changes(optimizer, scheduler, cfg)
    return applied_lines(saved, cfg)


def layout_changes(saved: dict, cfg: Config, world_size: Optional[int],
                   keys: tuple[str, ...] = LAYOUT_KEYS) -> list[str]:
    """'key: old -> new' for each of ``keys`` (and the world size, unless None) that differs."""
    current = cfg.to_dict()
    out = []
    if world_size is not None and saved.get("world_size") != world_size:
        out.append(f"world size: {saved.get('world_size')} -> {world_size}")
    for key in keys:
        if key in FIXED_KEYS and not _has(saved.get("config", {}), key):
            continue  # a key older checkpoints do not record
        old, new = _saved_value(saved.get("config", {}), key), _dotted(current, key)
        if old != new:
            why = RESUME_RULES[key].why
            out.append(f"{key}: {old!r} -> {new!r}" + (f" ({why})" if why and key in FIXED_KEYS else ""))
    return out


def check_resume(saved: dict, cfg: Config, world_size: int, path: str) -> bool:
    """Raise ConfigError for a change the resume mode does not allow; True if the layout
    changed (then ``position_after_change`` says where to go on)."""
    fixed = layout_changes(saved, cfg, None, keys=FIXED_KEYS)
    if fixed:
        raise ConfigError(f"resume: {'; '.join(fixed)} since {path}: a checkpoint can only be "
                          "resumed with the same model, shards and optimizer (restore the old values "
                          "or start a new run)")
    changed = layout_changes(saved, cfg, world_size)
    if changed and cfg.train.resume_mode == "exact":
        seen = saved.get("samples_seen", 0)
        raise ConfigError(
            f"resume: {'; '.join(changed)} since {path}; exact resume needs the same data layout: "
            f"set train.resume_mode=continue to go on from sample {seen} under the new layout "
            "(no sample of the epoch repeated or skipped), or restore the old values")
    return bool(changed)


def position_after_change(saved: dict, cfg: Config, world_size: int) -> DataPosition:
    """Where the stream goes on when the layout changed (resume_mode=continue)."""
    epoch, batch = saved["epoch"], saved["batch_in_epoch"]
    if batch >= saved.get("epoch_batches", batch + 1):  # the epoch was complete
        return DataPosition(epoch + 1, 0)
    old_cfg = saved["config"]
    if old_cfg["data"]["mode"] == "resampled":  # with replacement: carry the position in samples
        done = batch * old_cfg["data"]["batch_per_device"] * saved["world_size"]
        return DataPosition(epoch, done // (cfg.data.batch_per_device * world_size))
    rest = saved.get("data_rest")
    if not rest:
        raise ConfigError("resume: this checkpoint does not record the rest of its epoch (written "
                          "before vlp saved it); resume it with the old layout")
    pieces = [tuple(piece) for rank_pieces in rest for piece in rank_pieces]
    left = sum(end - begin for _, begin, end in pieces)
    if left < cfg.data.batch_per_device * world_size:  # less than one batch per rank
        return DataPosition(epoch + 1, 0)
    return DataPosition(epoch, 0, pieces)
