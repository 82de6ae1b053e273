"""Resume on a changed cluster: which changes a checkpoint allows, and where the data goes on.

The data a step sees is decided by the *layout*: world size, per-device batch, accum_steps,
num_workers, seed, shuffle buffer and mode (data_pipelines.stream: rank r owns a contiguous
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
* Never: a changed model or shard list (the weights or the saved shard pieces would not fit).
"""

from __future__ import annotations

from typing import Any, Optional

from vlp.config import Config, ConfigError
from vlp.train.data import DataPosition

# config keys that decide the data order (plus the world size), and the ones that never change
LAYOUT_KEYS = ("data.batch_per_device", "train.accum_steps", "data.num_workers", "train.seed",
               "data.shuffle_buffer", "data.mode", "data.weights", "data.num_samples", "loss.name",
               "loss.temperature")
FIXED_KEYS = ("model.name", "model.hf_text_dir", "data.train_shards")


def _dotted(config: dict, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def layout_changes(saved: dict, cfg: Config, world_size: Optional[int],
                   keys: tuple[str, ...] = LAYOUT_KEYS) -> list[str]:
    """'key: old -> new' for each of ``keys`` (and the world size, unless None) that differs."""
    current = cfg.to_dict()
    out = []
    if world_size is not None and saved.get("world_size") != world_size:
        out.append(f"world size: {saved.get('world_size')} -> {world_size}")
    for key in keys:
        old, new = _dotted(saved.get("config", {}), key), _dotted(current, key)
        if key == "loss.temperature" and old == "infonce":  # the mode's old name
            old = "split"
        if old != new:
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


def check_resume(saved: dict, cfg: Config, world_size: int, path: str) -> bool:
    """Raise ConfigError for a change the resume mode does not allow; True if the layout
    changed (then ``position_after_change`` says where to go on)."""
    fixed = layout_changes(saved, cfg, None, keys=FIXED_KEYS)
    if fixed:
        raise ConfigError(f"resume: {'; '.join(fixed)} since {path}: a checkpoint can only be "
                          "resumed with the same model and shards (start a new run instead)")
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
