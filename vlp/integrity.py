"""Checksums: what vlp writes for later loading verifies itself, wherever it is copied to.

A checkpoint dict carries its SHA-256 inside (`seal`: over every tensor's dtype, shape and bytes and
every other value, in order). A folder (DCP) holds `manifest.json`, each other file's size and
SHA-256 named relative to it; a file in someone else's format (the open_clip export) the same
manifest beside it, `NAME.manifest.json`, checked under whatever name the file has now. `verify`
reads the files back before torch.load or DCP parse a byte; a mismatch is an `IntegrityError`
naming the file. SHA-256 streams at ~1.2 GB/s per core here (bench/checksum_cost.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

from vlp.util import atomic_write

ALGORITHM = "sha256"
CHUNK_BYTES = 4 << 20
FORMAT = "vlp-manifest/1"
DIR_MANIFEST = "manifest.json"
SIDECAR_SUFFIX = ".manifest.json"
SEAL_KEY = "integrity"  # in every checkpoint dict vlp writes: its checksum, or (older) a manifest's format
SEAL_FORMAT = "vlp-checksums/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message is one line for the user."""


class IntegrityError(CheckpointError):
    """A file whose content is not what its checksums recorded; the message is one line."""


def file_digest(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in CHUNK_BYTES pieces."""
    h = hashlib.new(ALGORITHM)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def entry(path: str | Path) -> dict:
    """{"size": bytes, "sha256": hex} of one file."""
    return {"size": Path(path).stat().st_size, ALGORITHM: file_digest(path)}


def manifest_path(path: str | Path) -> Path:
    """Where the manifest of a checkpoint file or folder lives."""
    path = Path(path)
    return path / DIR_MANIFEST if path.is_dir() else path.with_name(path.name + SIDECAR_SUFFIX)


def manifest_bytes(entries: dict[str, dict]) -> bytes:
    """A manifest's bytes: {name relative to the folder: `entry`}."""
    return (json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": entries}, indent=1,
                       sort_keys=True) + "\n").encode()


def write_manifest(path: str | Path) -> Path:
    """Write the manifest of a file (its sidecar) or a folder (all its files), fsynced."""
    path = Path(path)
    files = sorted(f for f in path.iterdir() if f.is_file() and f.name != DIR_MANIFEST) if path.is_dir() else [path]
    target = manifest_path(path)
    atomic_write(target, manifest_bytes({f.name: entry(f) for f in files}), fsync=True)
    return target


def read_manifest(path: str | Path) -> Optional[dict]:
    """The {name: entry} of a file's or folder's manifest; None when it has none. Also reads the
    bucket manifests of vlp before one format ({"objects": [{name, bytes, sha256}]})."""
    where = manifest_path(path)
    if not where.is_file():
        return None
    try:
        data = json.loads(where.read_text())
        if "objects" in data:
            return {o["name"] or Path(path).name: {"size": o["bytes"], ALGORITHM: o[ALGORITHM]} for o in data["objects"]}
        if data.get("algorithm") != ALGORITHM or not isinstance(data["files"], dict):
            raise ValueError(f"algorithm {data.get('algorithm')!r}")
        return data["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{where} is not a readable manifest ({type(e).__name__})") from None


def verify(path: str | Path, names: Optional[list[str]] = None) -> bool:
    """Check a file or folder against its manifest (only `names`, if given). True: all match;
    False: there is no manifest. IntegrityError naming the first file that is missing, of
    another size or other content."""
    path = Path(path)
    files = read_manifest(path)
    if files is None:
        return False
    if not path.is_dir() and len(files) == 1:
        files = {path.name: next(iter(files.values()))}
    folder = path if path.is_dir() else path.parent
    for name in names if names is not None else sorted(files):
        expected, file = files.get(name), folder / name
        if expected is None:
            raise IntegrityError(f"{file} is not in the manifest {manifest_path(path)}")
        if not file.is_file():
            raise IntegrityError(f"{file} is missing (its manifest lists it)")
        size = file.stat().st_size
        if size != expected.get("size"):
            raise IntegrityError(f"{file} holds {size} bytes, its manifest says {expected.get('size')}")
        if file_digest(file) != expected.get(ALGORITHM):
            raise IntegrityError(f"{file} does not match its {ALGORITHM} checksum "
                                 "(damaged or changed since it was written)")
    return True


def seal(state: dict) -> dict:
    """`state` with its checksum inside, under SEAL_KEY."""
    return {**state, SEAL_KEY: {"format": SEAL_FORMAT, ALGORITHM: state_digest(state)}}


def sealed(state, where) -> bool:
    """True when `state` carries a seal that matches, False when it has none; IntegrityError
    naming `where` when it does not match."""
    mark = state.get(SEAL_KEY) if isinstance(state, dict) else None
    if not isinstance(mark, dict):
        return False
    if state_digest({k: v for k, v in state.items() if k != SEAL_KEY}) != mark.get(ALGORITHM):
        raise IntegrityError(f"checkpoint {where} does not match its {ALGORITHM} checksum "
                             "(damaged or changed since it was written)")
    return True


def state_digest(state) -> str:
    """Hex SHA-256 of a checkpoint's contents as loaded: every tensor's dtype, shape and bytes
    and every other value's repr, in order (the same before torch.save and after torch.load)."""
    h = hashlib.new(ALGORITHM)
    _feed(h, state)
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{flat.dtype}{tuple(obj.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().data)
    elif isinstance(obj, Mapping):
        h.update(f"{{{len(obj)}".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def check_weights_file(path: str | Path, what: str) -> None:
    """For readers of weights files (model.pretrained, tower weights): a file with a manifest
    (a vlp export) must match it; IntegrityError '<what> <file> does not match ...'. A file
    without one (someone else's weights) passes."""
    try:
        verify(path)
    except IntegrityError as e:
        raise IntegrityError(f"{what} {e}") from None
