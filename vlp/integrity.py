"""Content checksums of checkpoints and exports: a manifest written last, checked before loading.

A manifest is a small JSON file naming every file of a checkpoint with its size and SHA-256:

    step_N.pt  +  step_N.pt.manifest.json     (a replicated checkpoint, an open_clip export)
    step_N/    +  step_N/manifest.json        (a DCP directory: every rank file, .metadata, meta.pt)

It is written after everything it covers, so its presence says the checkpoint is complete; this
also holds where the run folder cannot rename atomically (an object store: each object appears
whole when its PUT ends, and the manifest is the last one). `verify` reads every covered file
back and compares; a mismatch is an `IntegrityError` naming the file, raised before torch.load
or DCP ever parse the bytes. Checkpoints written before manifests existed have none: `verify`
returns False and the caller warns that they are unverified. A sidecar manifest covers one file
whatever its name, so a checkpoint renamed or copied with its manifest still verifies.

A training `.pt` carries its checksum inside instead (`state_digest`: SHA-256 over every tensor's
bytes and every other value, in order), so it verifies alone, copied or renamed.

SHA-256 streams at ~1.2 GB/s per core here (SHA extensions; blake2b ~0.76 GB/s, md5 ~0.68),
in 4 MiB reads (1-8 MiB give the same speed): bench/checksum_cost.py measures its share of a
save and a load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

ALGORITHM = "sha256"
CHUNK_BYTES = 4 << 20
FORMAT = "vlp-manifest/1"
DIR_MANIFEST = "manifest.json"
SIDECAR_SUFFIX = ".manifest.json"


class IntegrityError(ValueError):
    """A file whose content is not what its manifest recorded; the message is one line."""


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
    """Where the manifest of a checkpoint file or directory lives."""
    path = Path(path)
    return path / DIR_MANIFEST if path.is_dir() else path.with_name(path.name + SIDECAR_SUFFIX)


def write_manifest(path: str | Path, entries: Optional[dict[str, dict]] = None, *,
                   manifest_at: Optional[Path] = None) -> Path:
    """Write the manifest of `path` (a file, or a directory: all its files) atomically and fsynced.
    `entries` (name relative to the directory -> `entry`) supplies digests computed elsewhere
    (e.g. by the rank that wrote a file); files of the directory not in it are hashed here.
    `manifest_at`: write it there instead of `manifest_path(path)` (a file's temp name)."""
    from vlp.util import atomic_write

    path = Path(path)
    entries = dict(entries or {})
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name != DIR_MANIFEST and f.name not in entries:
                entries[f.name] = entry(f)
    elif not entries:
        entries = {path.name: entry(path)}
    target = manifest_at or manifest_path(path)
    body = json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "files": entries}, indent=1, sort_keys=True)
    atomic_write(target, body + "\n", fsync=True)
    return target


def read_manifest(path: str | Path) -> Optional[dict]:
    """The manifest's {name: entry} of a checkpoint file or directory; None when it has none."""
    where = manifest_path(path)
    if not where.is_file():
        return None
    try:
        data = json.loads(where.read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {data.get('algorithm')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{where} is not a readable manifest ({type(e).__name__})") from None
    return files


def verify(path: str | Path, names: Optional[list[str]] = None) -> bool:
    """Check the files of a checkpoint file or directory against its manifest (only `names`, if
    given). True: all match; False: there is no manifest (written before vlp kept them).
    IntegrityError naming the first file that is missing, of another size or other content.
    A file's sidecar lists that one file: it is checked under the name it has now."""
    path = Path(path)
    files = read_manifest(path)
    if files is None:
        return False
    if not path.is_dir() and len(files) == 1:
        files = {path.name: next(iter(files.values()))}
    folder = path if path.is_dir() else path.parent
    for name in names if names is not None else sorted(files):
        expected = files.get(name)
        if expected is None:
            raise IntegrityError(f"{folder / name} is not in the manifest {manifest_path(path)}")
        file = folder / name
        if not file.is_file():
            raise IntegrityError(f"{file} is missing (its manifest lists it)")
        size = file.stat().st_size
        if size != expected.get("size"):
            raise IntegrityError(f"{file} holds {size} bytes, its manifest says {expected.get('size')}")
        if file_digest(file) != expected.get(ALGORITHM):
            raise IntegrityError(f"{file} does not match its {ALGORITHM} checksum "
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
    (a vlp export or checkpoint) must match it; IntegrityError '<what> <file> does not match ...'.
    A file without one (someone else's weights) passes."""
    try:
        verify(path)
    except IntegrityError as e:
        raise IntegrityError(f"{what} {e}") from None
