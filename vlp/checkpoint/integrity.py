"""Checksums: what vlp writes for later loading verifies itself, wherever it is copied to.

A checkpoint dict carries its SHA-256 inside (`seal`). A folder (DCP) holds `manifest.json`, each
other file's size and SHA-256; a file in someone else's format (the open_clip export) the same
beside it, `NAME.manifest.json`, checked under whatever name the file has now. `verify` reads the
files back before torch.load or DCP parse a byte (SHA-256: ~1.2 GB/s per core, bench/checksum_cost.py).
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
    h = hashlib.new(ALGORITHM)
    with open(path, "rb", buffering=0) as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(block)
    return h.hexdigest()


def entry(path: str | Path) -> dict:
    return {"size": Path(path).stat().st_size, ALGORITHM: file_digest(path)}


def manifest_path(path: str | Path) -> Path:
    path = Path(path)
    return path / DIR_MANIFEST if path.is_dir() else path.with_name(path.name + SIDECAR_SUFFIX)


def manifest_bytes(entries: dict[str, dict]) -> bytes:
    """A manifest's bytes: {name relative to the folder: `entry`}."""
    return (json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": entries}, indent=1,
                       sort_keys=True) + "\n").encode()


def write_manifest(path: str | Path) -> Path:
    """Write a file's sidecar manifest, NAME.manifest.json, fsynced."""
    path, target = Path(path), manifest_path(path)
    atomic_write(target, manifest_bytes({path.name: entry(path)}), fsync=True)
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


def verify(path: str | Path, what: str = "") -> bool:
    """Check a file or folder against its manifest: True when all match, False when it has none;
    IntegrityError '[WHAT ]FILE ...' naming the first file missing, of another size or content,
    or that cannot be read. A file without a manifest (someone else's weights) passes."""
    path = Path(path)
    try:
        files = read_manifest(path)
        if files is None:
            return False
        if not path.is_dir() and len(files) == 1:
            files = {path.name: next(iter(files.values()))}
        for name, expected in sorted(files.items()):
            file = (path if path.is_dir() else path.parent) / name
            if not file.is_file():
                raise IntegrityError(f"{file} is missing (its manifest lists it)")
            if (size := file.stat().st_size) != expected.get("size"):
                raise IntegrityError(f"{file} holds {size} bytes, its manifest says {expected.get('size')}")
            if file_digest(file) != expected.get(ALGORITHM):
                raise IntegrityError(f"{file} does not match its {ALGORITHM} checksum "
                                     "(damaged or changed since it was written)")
    except (OSError, IntegrityError) as e:
        why = f"{e.filename or path} cannot be checked: {e.strerror or e}" if isinstance(e, OSError) else str(e)
        raise IntegrityError(f"{what} {why}".lstrip()) from None
    return True


def seal(state: dict) -> dict:
    """`state` with its checksum inside, under SEAL_KEY."""
    return {**state, SEAL_KEY: {"format": SEAL_FORMAT, ALGORITHM: state_digest(state)}}


def sealed(state, where) -> bool:
    """Whether `state` carries a seal; IntegrityError naming `where` when it does not match."""
    mark = state.get(SEAL_KEY) if isinstance(state, dict) else None
    if not isinstance(mark, dict):
        return False
    if state_digest({k: v for k, v in state.items() if k != SEAL_KEY}) != mark.get(ALGORITHM):
        raise IntegrityError(f"checkpoint {where} does not match its {ALGORITHM} checksum "
                             "(damaged or changed since it was written)")
    return True


def state_digest(state) -> str:
    """Hex SHA-256 of every tensor's dtype, shape and bytes and every other value's repr, in
    order: the same before torch.save and after torch.load."""
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

