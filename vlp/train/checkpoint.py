"""Atomic checkpoints, keep-last-k, `resume: latest`, and safe loading.

A checkpoint is one `torch.save` file of plain tensors and containers, so it is read back with
`torch.load(weights_only=True)`: nothing from a file is unpickled as an arbitrary object.
It is written to a temporary name in the same folder, fsynced, then renamed: a crash while
writing leaves the previous checkpoint intact and never a half-written file under a final name.
A manifest of SHA-256 checksums is written last (vlp.integrity: `step_N.pt.manifest.json`, or
`manifest.json` inside a DCP directory) and checked before torch.load or DCP read a byte: a
damaged or changed checkpoint is refused by name (resume falls back past it). A `.pt` without
its manifest (from before manifests, or copied alone) loads with one warning that it is
unverified; a DCP directory written with MARK_KEY whose manifest is missing is refused.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from vlp.util import atomic_write, first_line
from vlp import integrity
from vlp.distributed import barrier, gather_object, get_rank, is_distributed

CKPT_RE = re.compile(r"^step_(\d+)(\.pt)?$")  # step_N.pt file (replicated) or step_N/ DCP directory (sharded)
META_FILE = "meta.pt"  # a DCP checkpoint's non-tensor state (step, RNG, config, ...), written by rank 0
MARK_KEY = "integrity"  # in every checkpoint vlp writes with a manifest: its manifest must exist


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message is one line for the user."""


STATE_KEYS = ("model", "optimizer", "scheduler", "step", "epoch", "batch_in_epoch", "world_size", "rng", "config")
CHECKSUMS = "vlp-checksums/1"  # MARK_KEY's value in a .pt that carries its own: {"format", "sha256"}
# atomic_write's temp names (the checkpoint's and, before checksums inside, its manifest's); the last group is the PID
TEMP_PATTERN = r"\.(step_\d+\.pt(?:\.manifest\.json)?)\.tmp-(\d+)"


def atomic_save(obj, path: str | Path) -> None:
    """Write `obj` to `path` through a fsynced temp file and a rename. A dict gets its checksum
    inside, under MARK_KEY (integrity.state_digest of the rest), so it verifies alone, also when
    copied or renamed. A failed write (disk full, quota, I/O error) removes the temp file and
    raises CheckpointError: every earlier checkpoint stays as it was."""
    path = Path(path)
    if isinstance(obj, dict):
        obj = {**obj, MARK_KEY: {"format": CHECKSUMS, integrity.ALGORITHM: integrity.state_digest(obj)}}
    try:  # the same step saved by an earlier release: its sidecar would not fit the new bytes
        integrity.manifest_path(path).unlink(missing_ok=True)
        atomic_write(path, lambda f: torch.save(obj, f), fsync=True)
    except (OSError, RuntimeError) as e:  # torch wraps a failed write in a RuntimeError
        raise write_failed(path, e) from None


def write_failed(path: Path, error: BaseException) -> CheckpointError:
    """The one line for a save that failed: the OS's words, or 'no space left' when the disk
    is full (torch's zip writer and DCP hide the OSError: 'unexpected pos 704 vs 598')."""
    reason = _reason(error)
    try:
        full = shutil.disk_usage(_existing(path)).free < (1 << 20)
    except OSError:
        full = False
    if full and "space" not in reason:  # torch's words name its zip writer, not the disk
        reason = "No space left on device"
    return CheckpointError(f"cannot write checkpoint {path}: {reason}; earlier checkpoints are unchanged")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _reason(error: BaseException) -> str:
    """The OS's words for a failed write (the OSError torch's RuntimeError or DCP's
    CheckpointException hides), one line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        failures = getattr(seen, "failures", None)  # CheckpointException: {rank: (error, traceback)}
        if failures:
            return _reason(next(iter(failures.values()))[0])
        seen = seen.__cause__ or seen.__context__
    return first_line(error)


def load(path: str | Path, manifest: bool = True) -> dict:
    """torch.load(weights_only) of a checkpoint or export file, verified by the checksums inside
    it or its manifest (manifest=False: a DCP directory's meta.pt, covered by the directory's)."""
    state, verified = load_checked(path, manifest)
    if not verified:
        unverified(path, state)
    return state


def load_checked(path: str | Path, manifest: bool = True) -> tuple[object, bool]:
    """(state, whether checksums verified it): a sidecar manifest is checked before torch.load
    reads a byte, the checksums inside after; a mismatch is a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    verified = _verify(path) if manifest else True
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, wrong format, pickled objects
        raise CheckpointError(f"checkpoint {path} cannot be read safely: {first_line(e)}") from None
    return state, _check_inside(state, path) or verified


def _check_inside(state, path: Path) -> bool:
    """True when `state` carries checksums (atomic_save) and they match, False when it has none."""
    mark = state.get(MARK_KEY) if isinstance(state, dict) else None
    if not isinstance(mark, dict):
        return False
    if integrity.state_digest({k: v for k, v in state.items() if k != MARK_KEY}) != mark.get(integrity.ALGORITHM):
        raise CheckpointError(f"checkpoint {path} does not match its {integrity.ALGORITHM} checksum "
                              "(damaged or changed since it was written)")
    return True


def _verify(path: Path) -> bool:
    """integrity.verify as a CheckpointError: True verified, False no manifest."""
    try:
        return integrity.verify(path)
    except integrity.IntegrityError as e:
        raise CheckpointError(f"checkpoint {e}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be checked: {_reason(e)}") from None


_warned: set[str] = set()


def unverified(path: Path, state) -> None:
    """For a checkpoint nothing verified. Written by vlp with checksums (MARK_KEY) whose manifest
    is gone (a DCP directory cut off before its manifest, a .pt of the release before checksums
    inside copied without its sidecar): refused, never loaded silently. A vlp checkpoint from
    before checksums: one warning per file. Someone else's weights file: nothing was promised."""
    if not isinstance(state, dict):
        return
    if state.get(MARK_KEY):
        raise CheckpointError(f"checkpoint {path} has no manifest ({integrity.manifest_path(path).name}) and "
                              "cannot be verified: its save did not finish, or it was copied without it")
    if ("config" not in state and "preprocess_cfg" not in state) or str(path) in _warned:
        return
    _warned.add(str(path))
    if get_rank() == 0:
        print(f"vlp: warning: checkpoint {path} has no checksum manifest (written before vlp kept them): "
              "loaded unverified", file=sys.stderr, flush=True)


def check_state(state, path: str | Path) -> dict:
    """`state` if it is a complete vlp training checkpoint with finite weights, else
    CheckpointError naming what is wrong."""
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a vlp training checkpoint (a {type(state).__name__}, not a dict)")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a vlp training checkpoint: missing {', '.join(missing)}")
    bad = nonfinite_tensors(state["model"])
    if bad:
        raise CheckpointError(f"checkpoint {path} has non-finite weights in {len(bad)} tensors (e.g. {bad[0]})")
    return state


def load_valid(path: str | Path) -> dict:
    """Load a training checkpoint and check it (see check_state). For a sharded (DCP) checkpoint
    directory: its meta dict, checked by `load_sharded_meta` (the tensors load later, per rank)."""
    if Path(path).is_dir():
        return load_sharded_meta(path)
    state, verified = load_checked(path, True)
    check_state(state, path)
    if not verified:  # a warning only once it is known to be usable
        unverified(path, state)
    return state


def nonfinite_tensors(weights) -> list[str]:
    """Names of the tensors of a state dict that hold nan or inf."""
    if not isinstance(weights, dict):
        return ["<not a state dict>"]
    return [k for k, v in weights.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def latest_valid(ckpt_dir: str | Path, load_fn=load_valid):
    """Newest checkpoint of `ckpt_dir` that loads and checks: (path, state, rejected), where
    rejected lists (path, reason) of the newer ones passed over; None when there is no checkpoint.
    Raises CheckpointError when checkpoints exist but none is valid. `load_fn(path)` loads and
    checks one (a DCP checkpoint folder brings its own)."""
    rejected = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_fn(path), rejected
        except (CheckpointError, FileNotFoundError) as e:
            rejected.append((path, str(e)))
    if rejected:
        raise CheckpointError(f"no valid checkpoint in {ckpt_dir}: {rejected[0][1]}"
                              + (f" (and {len(rejected) - 1} more)" if len(rejected) > 1 else ""))
    return None


def set_aside(path: str | Path) -> Path:
    """Rename a bad checkpoint to `<name>.corrupt`: kept for inspection, out of `list_checkpoints`
    (so neither resumed from, pruned, nor overwritten by the step that is written again)."""
    path = Path(path)
    target = path.with_name(path.name + ".corrupt")
    sidecar = integrity.manifest_path(path)
    if path.is_file() and sidecar.exists():  # a DCP directory's manifest moves with it
        os.replace(sidecar, integrity.manifest_path(target))
    os.replace(path, target)
    return target


def remove_stale_temps(ckpt_dir: str | Path) -> list[Path]:
    """Remove temp files of saves killed before their rename (their PID is dead); return them."""
    from vlp.util import remove_stale_temps as remove

    return remove(ckpt_dir, TEMP_PATTERN)


def changed_settings(saved: dict, current: dict) -> list[str]:
    """'section.key: saved -> current' for the config keys that shape the saved state (the
    model's parameters and which of them train): resuming across a change cannot load it.
    Which keys: vlp.train.resume.RESUME_RULES (shapes_state)."""
    from vlp.train.resume import STATE_KEYS

    out = []
    for key in STATE_KEYS:
        section, name = key.split(".")
        old, new = (saved or {}).get(section, {}).get(name), current[section][name]
        if old != new:
            out.append(f"{key}={old!r} in the checkpoint, {new!r} now")
    return out


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Step checkpoints in `ckpt_dir`, oldest first: `step_N.pt` files and `step_N/` DCP dirs
    (not the temp names of saves in progress, nor ones set aside as `.corrupt`)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := CKPT_RE.match(p.name)) and (p.is_dir() if m.group(2) is None else p.is_file())]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def prune(ckpt_dir: str | Path, keep_last: int) -> None:
    for old in list_checkpoints(ckpt_dir)[:-keep_last] if keep_last > 0 else []:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
            integrity.manifest_path(old).unlink(missing_ok=True)
        shutil.rmtree(rank_dir(old), ignore_errors=True)


# ---------------------------------------------------------------- per-rank files
# State that is sharded by rank and grows with the data set (SogCLR's u: O(N / world) per rank)
# is not gathered into one file: each rank writes its own into step_N.ranks/ beside the
# checkpoint, before the checkpoint itself becomes visible.
def rank_dir(path: str | Path) -> Path:
    """step_N.ranks/ beside step_N.pt or step_N/."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".pt") + ".ranks")


def rank_file(folder: str | Path, rank: int, world: int) -> Path:
    return Path(folder) / f"rank{rank:05d}-of-{world:05d}.pt"


def save_rank_files(folder: str | Path, obj, rank: int, world: int) -> None:
    """Collective: every rank writes `obj` into .<folder>.tmp/, then rank 0 renames it to `folder`
    (replacing one of an earlier save of the same step): the folder is complete once visible."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if rank == 0:
        for stale in folder.parent.glob(".step_*.ranks.tmp"):  # this save's, or a killed one's
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    try:
        atomic_save(obj, rank_file(tmp, rank, world))
        error = None
    except CheckpointError as e:
        error = str(e)
    failed = [e for e in gather_object([error]) if e]  # every rank stops, or none
    if rank == 0:
        shutil.rmtree(folder if not failed else tmp, ignore_errors=True)
        if not failed:
            os.replace(tmp, folder)
    if failed:
        raise CheckpointError(failed[0])
    barrier()


def load_rank_files(path: str | Path, ranks: list[int], world: int):
    """The per-rank objects of `ranks` (of a `world`-rank save), read one at a time."""
    for r in ranks:
        yield load(rank_file(rank_dir(path), r, world))


def check_rank_files(path: str | Path, world: int) -> None:
    """CheckpointError unless the checkpoint's per-rank folder holds all `world` files."""
    missing = [r for r in range(world) if not rank_file(rank_dir(path), r, world).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {rank_dir(path).name} lacks the files of "
                              f"rank(s) {missing[:8]} of {world}")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- sharded (DCP) checkpoints
# step_N/ holds one file of tensor shards per rank and DCP's .metadata (torch.distributed.checkpoint),
# plus META_FILE. It is written as .step_N.tmp/ and renamed by rank 0 once every rank has written:
# a directory under a final name is always complete. The checkpoint folder must be shared by all
# ranks (one filesystem), as for any multi-node checkpoint.


def save_sharded(state: dict, meta: dict, path: str | Path) -> None:
    """Write a DCP checkpoint directory atomically. Collective: every rank passes its own shards
    in `state` (parallel.sharded_state); rank 0's `meta` (plain tensors and containers) goes into
    META_FILE. A leftover temp dir of a killed save is removed first; a failed save (disk full,
    quota: DCP raises its CheckpointException, a BaseException, on every rank) removes its temp
    dir and raises CheckpointError, earlier checkpoints untouched."""
    import torch.distributed.checkpoint as dcp  # heavy: only FSDP runs and DCP readers need it
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    main = get_rank() == 0
    if main:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    error = None
    try:
        # returns on every rank once all shards and .metadata are written
        dcp.save(state, checkpoint_id=tmp, no_dist=not is_distributed())
        digests = _gather_digests(tmp)  # each rank hashes the files it wrote
        if main:
            atomic_save(meta, tmp / META_FILE)
            integrity.write_manifest(tmp, digests)  # last: .metadata and meta.pt hashed here
            if path.exists():  # the same step saved again (e.g. the last good state before a stop)
                shutil.rmtree(path)
            os.replace(tmp, path)
    except (OSError, RuntimeError, CheckpointException, CheckpointError) as e:
        error = str(e if isinstance(e, CheckpointError) else write_failed(path, e))
    failed = [e for e in gather_object([error]) if e]  # every rank stops, or none (no rank left waiting)
    if failed:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(failed[0])


def _gather_digests(folder: Path) -> dict[str, dict]:
    """{file name: integrity.entry} of the DCP files of every rank (`__<rank>_*.distcp`): each
    rank hashes its own (O(checkpoint / world) each), rank 0 receives them all."""
    mine = {f.name: integrity.entry(f) for f in sorted(folder.glob(f"__{get_rank()}_*.distcp"))}
    return {name: e for part in gather_object([mine]) for name, e in part.items()}


def load_sharded_meta(path: str | Path) -> dict:
    """The meta dict of a DCP checkpoint directory, after checking the directory is complete and
    (when it has a manifest) every file against its checksum."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    for name in (".metadata", META_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: no {name}")
    verified = _verify(path)  # before meta.pt or .metadata is parsed
    meta = load(path / META_FILE, manifest=False)
    if not verified:
        unverified(path, meta)
    missing = [k for k in STATE_KEYS if k not in ("model", "optimizer") and k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a vlp training checkpoint: missing {', '.join(missing)}")
    _check_shard_files(path)
    return meta


def _check_shard_files(path: Path) -> None:
    """Every shard file DCP's index names exists and is long enough for the bytes it should hold
    (a lost or truncated rank file fails here, before any rank starts loading)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        # DCP's index is a pickle (its format); it comes from our own save, like the shards it names
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


def load_sharded(state: dict, path: str | Path) -> None:
    """Fill `state` (parallel.sharded_state of this run's model and optimizer) in place from a DCP
    directory. DCP reshards: the saved world size and parallelism need not match this run's.
    Collective when a process group exists."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # one process on purpose (e.g. a 2-rank checkpoint on 1 rank)
            warnings.filterwarnings("ignore", message="torch.distributed is ")
            dcp.load(state, checkpoint_id=Path(path), no_dist=not is_distributed())
    except (OSError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {first_line(e)}") from None


def load_sharded_full(path: str | Path) -> dict:
    """A DCP checkpoint directory read whole by one process, shaped like a .pt checkpoint without
    the optimizer: its meta plus the full model weights under open_clip's names (`vlp eval`)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    meta = load_sharded_meta(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is ")
            model = _load_state_dict_from_keys({"model"}, checkpoint_id=Path(path))["model"]
    except (OSError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {first_line(e)}") from None
    return {**meta, "model": {k.removeprefix("clip."): v for k, v in model.items()}}

