"""Resume rules: which config changes a checkpoint allows (ONE table, RESUME_RULES, read from
each key's declaration in vlp/config/keys.py). A changed *layout* (world size, batch, seed, ...)
is refused under train.resume_mode=exact, so the run continues bit-identically; `continue` goes
on from the same global sample (the relayout the data part registers). A changed model, shard list or
optimizer is always refused; other keys are applied and logged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from vlp.config import KEYS, Config, ConfigError, current_value, get_dotted
from vlp.config.rules import APPLY, LAYOUT, REFUSE, KeyRule

RESUME_RULES: dict[str, KeyRule] = {name: k.resume for name, k in KEYS.items()}  # APPLY, LAYOUT or REFUSE
LAYOUT_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.kind == LAYOUT)
FIXED_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.kind == REFUSE)
STATE_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.shapes_state)
APPLIED_KEYS = tuple(k for k, r in RESUME_RULES.items() if r.kind == APPLY and not r.quiet)  # logged when changed
_UNRECORDED = object()  # a key the saved config lacks


def _dotted(config: Optional[dict], key: str, missing: Any = None) -> Any:
    """config[a][b] for key 'a.b' under its current name (a renamed value read as today's);
    ``missing`` when absent."""
    return current_value(key, get_dotted(config or {}, key, missing))


def _changes(saved_cfg: Optional[dict], new_cfg: dict, keys, skip_unrecorded=()) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for each of ``keys`` whose value changed; a key of ``skip_unrecorded``
    that the saved config lacks (added to vlp since) is skipped, any other compared as None."""
    out = []
    for key in keys:
        old = _dotted(saved_cfg, key, _UNRECORDED if key in skip_unrecorded else None)
        if old is not _UNRECORDED and old != (new := _dotted(new_cfg, key)):
            out.append((key, old, new))
    return out


def applied_lines(saved: dict, cfg: Config) -> list[str]:
    """'[vlp] resume: optim.lr 0.001 -> 1e-05 from step 12' for each changed key a resume applies (a
    layout change has its own line); keys the saved config lacks (added to vlp since) are skipped."""
    return [f"[vlp] resume: {key} {old!r} -> {new!r} from step {saved['train']['step']}"
            for key, old, new in _changes(saved.get("config"), cfg.to_dict(), APPLIED_KEYS, APPLIED_KEYS)]


def layout_changes(saved: dict, cfg: Config, world_size: Optional[int],
                   keys: tuple[str, ...] = LAYOUT_KEYS) -> list[str]:
    """'key: old -> new' for each of ``keys`` (and the world size, unless None) that differs."""
    out = [f"world size: {saved.get('world_size')} -> {world_size}"] \
        if world_size is not None and saved.get("world_size") != world_size else []
    for key, old, new in _changes(saved.get("config"), cfg.to_dict(), keys, FIXED_KEYS):
        why = RESUME_RULES[key].why if key in FIXED_KEYS else None
        out.append(f"{key}: {old!r} -> {new!r}" + (f" ({why})" if why else ""))
    return out


def check_resume(saved: dict, cfg: Config, world_size: int, path: str) -> bool:
    """ConfigError for a change the resume mode does not allow; True if the layout changed."""
    fixed = layout_changes(saved, cfg, None, keys=FIXED_KEYS)
    if fixed:
        raise ConfigError(f"resume: {'; '.join(fixed)} since {path}: a checkpoint can only be "
                          "resumed with the same model, shards and optimizer (restore the old values "
                          "or start a new run)")
    changed = layout_changes(saved, cfg, world_size)
    if changed and cfg.train.resume_mode == "exact":
        seen = saved.get("train", {}).get("samples_seen", 0)
        raise ConfigError(
            f"resume: {'; '.join(changed)} since {path}; exact resume needs the same data layout: "
            f"set train.resume_mode=continue to go on from sample {seen} under the new layout "
            "(no sample of the epoch repeated or skipped), or restore the old values")
    return bool(changed)


def changed_settings(saved: dict, current: dict) -> list[str]:
    """'key=old in the checkpoint, new now' for each changed key that shapes the saved state."""
    return [f"{key}={old!r} in the checkpoint, {new!r} now"
            for key, old, new in _changes(saved, current, STATE_KEYS)]


def fit(saved: dict, cfg: Config, world_size: int, where: str, relayouts: dict[str, Optional[Callable]]) -> dict:
    """The saved state as this run loads it (`check_resume`). After a layout change each per-rank
    part's entries come from the relayout its owner registered (the data position:
    vlp.data.train_data.relayout), or are None (a fresh start: the RNG seeds seed + rank)."""
    if not check_resume(saved, cfg, world_size, where):
        return saved
    return {**saved, **{key: relayout(saved, cfg, world_size) if relayout else [None] * world_size
                        for key, relayout in relayouts.items()}}

