"""One checkpoint's bytes (docs/checkpoints.md): step_N.pt (one torch.save, sealed), step_N/ (DCP:
every rank's shards and .metadata, then manifest.json, then META_FILE, the parts, last: its commit)
and step_N.ranks/ (one file per rank). Everything is read with torch.load(weights_only=True) and
checked before a tensor is used: damage is a CheckpointError naming the file, a sealed file that
cannot be verified is refused, one from before checksums warned about; `upgrade` reads old layouts.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

from vlp.checkpoint import integrity
from vlp.distributed import get_rank, is_distributed
from vlp.checkpoint.integrity import SEAL_KEY, CheckpointError
from vlp.config import global_batch
from vlp.util import first_line

CKPT_RE = re.compile(r"^step_(\d+)(\.pt)?$")  # step_N.pt file (replicated) or step_N/ DCP folder (sharded)
META_FILE = "meta.pt"  # a DCP checkpoint's parts (counters, RNG, config, ...): written last, by rank 0
REQUIRED = ("scheduler", "train", "data", "world_size", "rng", "config")  # besides model and optimizer


def ranks_name(name: str) -> str:
    """The per-rank folder beside checkpoint `name`: step_N.pt or step_N -> step_N.ranks."""
    return name.removesuffix(".pt") + ".ranks"


def rank_file(name: str, rank: int, world: int) -> str:
    """Rank `rank`'s file of a `world`-rank save of checkpoint `name`, relative to its folder."""
    return f"{ranks_name(name)}/rank{rank:05d}-of-{world:05d}.pt"


# ---------------------------------------------------------------- writing
def save_file(obj, path: Path) -> None:
    """torch.save `obj` (a dict: sealed) to the local `path`, fsynced; removed on an error."""
    try:
        with open(path, "wb") as f:
            torch.save(integrity.seal(obj) if isinstance(obj, dict) else obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_shards(state: dict, stage: Path) -> dict[str, dict]:
    """This rank's DCP files written into `stage` (a collective); {file name: integrity.entry}."""
    import torch.distributed.checkpoint as dcp  # heavy: only FSDP runs and DCP readers need it

    dcp.save(state, checkpoint_id=stage, no_dist=not is_distributed())
    return {f.name: integrity.entry(f) for f in sorted(stage.iterdir()) if f.is_file()}


def write_failed(shown: str, error: BaseException, local: Path) -> CheckpointError:
    """The one line for a save that failed: the OS's words, or 'no space left' when the local
    disk is full (torch's zip writer and DCP hide the OSError: 'unexpected pos 704 vs 598')."""
    if isinstance(error, CheckpointError):
        return error
    reason = _reason(error)
    try:
        while not local.exists() and local != local.parent:
            local = local.parent
        full = shutil.disk_usage(local).free < (1 << 20)
    except OSError:
        full = False
    if full and "space" not in reason:
        reason = "No space left on device"
    return CheckpointError(f"cannot write checkpoint {shown}: {reason}; earlier checkpoints are unchanged")


def _reason(error: BaseException) -> str:
    """The OS's words that torch's RuntimeError or DCP's CheckpointException hide, one line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        failures = getattr(seen, "failures", None)  # CheckpointException: {rank: (error, traceback)}
        if failures:
            return _reason(next(iter(failures.values()))[0])
        seen = seen.__cause__ or seen.__context__
    return first_line(error)


# ---------------------------------------------------------------- reading
def load_checked(path: str | Path) -> tuple[object, bool]:
    """(state, whether checksums verified it): a sidecar manifest is checked before torch.load
    reads a byte, the seal inside after; a mismatch is an IntegrityError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    verified = integrity.verify(path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, wrong format, pickled objects
        raise CheckpointError(f"checkpoint {path} cannot be read safely: {first_line(e)}") from None
    return state, integrity.sealed(state, path) or verified


def load(path: str | Path):
    """A checkpoint or export file, verified (see load_checked), else refused or warned about."""
    state, verified = load_checked(path)
    if not verified:
        unverified(path, state)
    return state


_warned: set[str] = set()


def unverified(path, state) -> None:
    """For a file nothing verified: refused if vlp sealed it (its manifest is gone), one warning
    per file if vlp wrote it before checksums; someone else's weights file: nothing was promised."""
    if not isinstance(state, dict):
        return
    if state.get(SEAL_KEY):
        raise integrity.IntegrityError(
            f"checkpoint {path} has no manifest ({integrity.manifest_path(path).name}) and cannot be "
            "verified: its save did not finish, or it was copied without it")
    if ("config" not in state and "preprocess_cfg" not in state) or str(path) in _warned:
        return
    _warned.add(str(path))
    if get_rank() == 0:
        print(f"vlp: warning: checkpoint {path} has no checksum manifest (written before vlp kept them): "
              "loaded unverified", file=sys.stderr, flush=True)


def upgrade(state: dict) -> dict:
    """A checkpoint of an earlier release (counters, data position and skip counts at the top
    level) in the parts' layout; a current one as it is."""
    if not isinstance(state, dict) or "train" in state or "step" not in state:
        return state
    s, world = dict(state), state.get("world_size") or 1
    skipped = s.pop("skipped_per_rank", None) or [s.get("skipped", {})] + [{}] * (world - 1)
    rests = s.pop("data_rest", None) or [None] * world
    shared = {k: s.pop(k, None) for k in ("epoch", "batch_in_epoch", "epoch_pieces", "epoch_batches")}
    s.pop("skipped", None)
    s["data"] = [{**shared, "epoch_pieces": shared["epoch_pieces"] if r == 0 else None, "rest": rests[r],
                  "skipped": skipped[r]} for r in range(world)]
    step, batch = s.pop("step"), global_batch(s.get("config") or {}, world)
    s["train"] = {"step": step, "samples_seen": s.pop("samples_seen", step * batch),
                  "nonfinite_total": s.pop("nonfinite_total", 0)}
    if "loss_state" in s:  # a stateful loss's one table, before per-rank files
        s["loss"] = s.pop("loss_state")
    return s


def check_finite(weights, path) -> None:
    """CheckpointError naming `path` when a state dict's tensors hold nan or inf."""
    bad = ["<not a state dict>"] if not isinstance(weights, dict) else [
        k for k, v in weights.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"checkpoint {path} has non-finite weights in {len(bad)} tensors (e.g. {bad[0]})")


def load_valid(path: str | Path) -> dict:
    """A training checkpoint (a .pt, or a DCP folder's meta: its tensors load later, per rank),
    upgraded, complete (its shard and per-rank files too), finite, verified or warned about."""
    path, sharded = Path(path), Path(path).is_dir()
    if sharded:
        for name in (".metadata", META_FILE):
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path} is incomplete: no {name}")
        verified = integrity.verify(path, "checkpoint")  # before META_FILE or .metadata is parsed
        state = load_checked(path / META_FILE)[0]  # the folder's manifest covers it
    else:
        state, verified = load_checked(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a vlp training checkpoint (a {type(state).__name__}, not a dict)")
    state = upgrade(state)
    missing = [k for k in (() if sharded else ("model", "optimizer")) + REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a vlp training checkpoint: missing {', '.join(missing)}")
    _check_shard_files(path) if sharded else check_finite(state["model"], path)
    if not verified:  # a warning only once it is known to be usable
        unverified(path, state)
    world = state.get("rank_files")
    missing = [r for r in range(world or 0) if not (path.parent / rank_file(path.name, r, world)).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {ranks_name(path.name)} lacks the files of "
                              f"rank(s) {missing[:8]} of {world}")
    return state


def _check_shard_files(path: Path) -> None:
    """Every shard file DCP's index names is there and long enough, before any rank loads (the
    manifest checks this too; a folder from before checksums has none)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:  # DCP's index is a pickle (its format); it comes from our own save, like the shards it names
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # truncated or foreign .metadata
        raise CheckpointError(f"checkpoint {path} has an unreadable .metadata: {first_line(e)}") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            have = file.stat().st_size if file.is_file() else "no file"
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} should hold {size} bytes ({have})")


def read_dcp(path, what: str, read: Callable):
    """`read()` of the DCP folder `path`; an error is one line: 'checkpoint PATH WHAT: why'."""
    try:
        with warnings.catch_warnings():  # one process on purpose (e.g. a 2-rank checkpoint on 1 rank)
            warnings.filterwarnings("ignore", message="torch.distributed is ")
            return read()
    except (OSError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} {what}: {first_line(e)}") from None


def load_sharded(state: dict, path: str | Path) -> None:
    """Fill `state` (the strategy's sharded_state) in place from a DCP folder, resharded to this
    run's world size and parallelism. Collective when a process group exists."""
    import torch.distributed.checkpoint as dcp

    read_dcp(path, "cannot be loaded into this model",
             lambda: dcp.load(state, checkpoint_id=Path(path), no_dist=not is_distributed()))

