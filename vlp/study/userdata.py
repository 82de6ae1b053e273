"""The map on your data: a grid.datasets entry that is not a packaged data set names its own
shards (written by `vlp shards`, or any webdataset shards), local or at a URL (s3://, gs://,
http(s)://, file://), read by vlp.data's shard reader.

    mydata: {train: "d/train-{000000..000009}.tar", val: "d/val-000000.tar", test: "d/test-000000.tar"}
    mydata: {shards: "s3://bucket/all-{000000..000031}.tar"}    # one set, split by caption hash

The second form splits one shard set into fit / val / test by a stable hash of each pair's
caption, the rule of the packaged sets (vlp.data.sources.splits.study_split: ~10 % test, ~10 %
val, the rest fit; a caption lands in one split only), written once as local shards under
.cache/shards/user/. Either form may also set batch_per_device and regimes, as a packaged entry.
Every user set is checked before anything is written (`check_datasets`), the entry's keys when the
grid is read (`parse_user_dataset`), and split once by the main process (`user_specs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

from vlp.config import ConfigError
from vlp.locations import has_backend, is_local, is_url, missing_backend

USER_KEYS = ("train", "val", "test", "shards")
"""The data keys of a user entry: train + val + test (three shard sets), or shards (one, split)."""
SCHEMES = ("s3", "gs", "gcs", "http", "https", "file")
"""URL schemes a user data set may name (local paths need none)."""
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
USER_CACHE = Path(".cache") / "shards" / "user"
"""Where the caption-hash split of a single shard set is written (relative to the working folder)."""
PROBE_SHARDS, PROBE_SAMPLES = 3, 8
"""Checked before any run: the first PROBE_SAMPLES samples of each split's first PROBE_SHARDS shards
are read (the others: a local file exists and is not empty; a URL is read when the runs read it)."""


def _check_spec(name: str, key: str, spec: Any) -> str:
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"config: grid.datasets.{name}.{key} must be a shard spec (a path or URL, braces allowed), "
                          f"got {spec!r}")
    spec = spec.strip()
    for part in spec.split("::"):
        if is_url(part):
            scheme = part.split("://", 1)[0].lower()
            if scheme not in SCHEMES:
                raise ConfigError(f"config: grid.datasets.{name}.{key}={part}: {scheme}:// is not supported "
                                  f"(a local path, or {', '.join(s + '://' for s in SCHEMES)})")
            if not has_backend(part):
                raise ConfigError(f"config: grid.datasets.{name}.{key}={part}: {missing_backend(part)}")
        elif part.startswith("pipe:"):
            raise ConfigError(f"config: grid.datasets.{name}.{key}: a pipe: command is not a data set here; "
                              "give a path or URL")
    return spec


def parse_user_dataset(name: Any, table: dict) -> dict:
    """The data keys of a user entry of grid.datasets: {"shards": {"fit", "val", "test"} (train is
    trained on, as a packaged set's fit) or None, "source": one shard set to split by caption hash
    or None}. One ConfigError line for a bad name, a missing or extra key, or a bad spec."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"config: grid.datasets: {name!r} is not a packaged data set, and as your own data set's "
                          "name it must be lowercase letters, digits, '_' and '-'")
    given = [k for k in USER_KEYS if k in table]
    if given == ["shards"]:
        return {"shards": None, "source": _check_spec(name, "shards", table["shards"])}
    if sorted(given) == sorted(("train", "val", "test")):
        specs = {key: _check_spec(name, key, table[key]) for key in ("train", "val", "test")}
        if len(set(specs.values())) < 3:
            raise ConfigError(f"config: grid.datasets.{name}: train, val and test must be three different shard sets "
                              "(or give one set as 'shards' to split it by caption hash)")
        return {"shards": {"fit": specs["train"], "val": specs["val"], "test": specs["test"]}, "source": None}
    raise ConfigError(f"config: grid.datasets.{name}: not a packaged data set (openmoji, openclipart, material_icons); "
                      "as your own data set, name train, val and test shard specs, or one 'shards' spec to split by "
                      f"caption hash (got {', '.join(given) or 'neither'})")


def _local_parts(spec: str) -> list[str]:
    from vlp.data.shard_list import expand_sources

    local = "::".join(p for p in spec.split("::") if not is_url(p))
    return [path for paths in expand_sources(local) for path in paths] if local else []


def check_local(name: str, specs: dict[str, str]) -> None:
    """Local shards of a user data set exist (URLs are read when the runs read them); one line."""
    for split, spec in specs.items():
        try:
            _local_parts(spec)
        except (FileNotFoundError, ValueError) as e:
            key = "train" if split == "fit" else split
            raise ConfigError(f"config: grid.datasets.{name}.{key}: {e}") from None


def shard_identity(path: str) -> tuple:
    """A shard by what it is, not by how its path is spelled: a local file's (device, inode) (through
    symlinks, './' and relative paths), a URL with its scheme and host lowercased and its path
    normalized. FileNotFoundError / ValueError for a local file that is missing or empty."""
    from urllib.parse import unquote, urlsplit

    if not is_local(path):
        url = urlsplit(path)
        scheme = {"gcs": "gs"}.get(url.scheme.lower(), url.scheme.lower())
        return scheme, url.netloc.lower(), posixpath.normpath(url.path or "/"), url.query
    local = unquote(urlsplit(path).path) if is_url(path) else path
    try:
        stat = os.stat(local)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found") from None
    if not stat.st_size:
        raise ValueError(f"{path}: empty file (0 bytes)")
    return stat.st_dev, stat.st_ino


def probe_shard(path: str) -> Optional[str]:
    """Why the first samples of one shard give no image+caption pair (read by vlp.data's shard
    reader, local or remote), or None when one of them does."""
    from collections import Counter

    from vlp.data.tars import check_sample, describe_unreadable, read_head, read_shard

    skipped, errors, exts, kinds = Counter(), [], set(), Counter()
    for _, key, members in read_shard(path, 0, PROBE_SAMPLES, skipped, seen_exts=exts, errors=errors):
        kind = check_sample(key, members, path)
        if not isinstance(kind, str):
            return None
        kinds[kind] += 1
    if errors:
        head = read_head(path)
        return f"{path}: {describe_unreadable(head)}" if head else errors[0]
    if not kinds:
        return f"{path}: no samples (an empty tar)"
    return (f"{path}: none of its first {sum(kinds.values())} samples is an image+caption pair "
            f"({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))}; member extensions: "
            f"{', '.join(sorted(exts)) or 'none'}): a sample needs an image (.png, .jpg, ...) and a caption "
            "(.txt) under one key")


def check_split(name: str, key: str, spec: str) -> dict[tuple, str]:
    """One split of a user data set: its shards exist and are not empty, and the first samples of
    its first shards give an image+caption pair; {shard_identity: path}. One ConfigError line."""
    from vlp.data.shard_list import expand_sources

    try:
        paths = [path for paths in expand_sources(spec) for path in paths]
        found = {shard_identity(path): path for path in paths}
        why = next(filter(None, map(probe_shard, paths[:PROBE_SHARDS])), None)
    except (OSError, ValueError) as e:
        why = str(e)
    if why:
        raise ConfigError(f"config: grid.datasets.{name}.{key}: {why}")
    return found


def check_datasets(datasets: dict[str, dict]) -> None:
    """Every user data set, before any folder is made (check_split per split); no shard in two of
    train, val and test, compared by shard_identity. One ConfigError line naming the split."""
    for name, entry in datasets.items():
        specs = {"train" if split == "fit" else split: spec for split, spec in (entry.get("shards") or {}).items()} \
            or ({"shards": entry["source"]} if entry.get("source") else {})
        seen: dict[tuple, tuple[str, str]] = {}
        for key, spec in specs.items():
            found = check_split(name, key, spec)
            for identity, path in found.items():
                if identity in seen:
                    other, first = seen[identity]
                    raise ConfigError(f"config: grid.datasets.{name}.{key}: {path} is the same shard as {other}'s "
                                      f"{first}: train, val and test must be three different shard sets")
            seen.update({identity: (key, path) for identity, path in found.items()})


def iter_pairs(spec: str) -> Iterator[tuple[bytes, str]]:
    """(image bytes, caption) of every usable sample of a shard spec, streamed in order (vlp.data's
    reader: local paths and URLs); ValueError naming the first unreadable shard."""
    from collections import Counter

    from vlp.data.shard_list import expand_sources
    from vlp.data.tars import check_sample, read_shard

    skipped, errors = Counter(), []
    for paths in expand_sources(spec):
        for path in paths:
            for _, key, members in read_shard(path, 0, None, skipped, errors=errors):
                sample = check_sample(key, members, path)
                if not isinstance(sample, str):
                    yield sample[1], sample[2]
            if errors:
                raise ValueError(f"cannot read {errors[0]}")


def write_split(name: str, spec: str, root: Path) -> dict[str, str]:
    """Split one shard set by caption hash into fit / val / test shards under ``root`` in one
    streaming pass (once: a folder with its sizes.json is reused); {split: spec}. ValueError when
    a split is empty; a failure leaves no shard behind, nor the folders it made."""
    from collections import Counter

    from vlp.data.encode import encode_pair
    from vlp.data.sources import Pair
    from vlp.data.sources.splits import study_split
    from vlp.data.write import ShardWriter, shard_spec

    splits = ("fit", "val", "test")
    if not all((root / split / "sizes.json").is_file() for split in splits):
        made = [folder for folder in (root, *root.parents) if not folder.exists()]
        writers = {split: ShardWriter(root / split, split, 1000, overwrite=True) for split in splits}
        counts: Counter = Counter()
        try:
            for i, (image, caption) in enumerate(iter_pairs(spec)):
                sample = encode_pair(Pair(f"{i:08d}", image, caption))
                if not isinstance(sample, str):
                    writers[study_split(caption)].write(sample)
                    counts[study_split(caption)] += 1
            empty = [split for split in splits if not counts[split]]
            if empty:
                raise ValueError(f"grid.datasets.{name}.shards: {sum(counts.values())} pairs give no "
                                 f"{' or '.join(empty)} pair by caption hash (~10 % each): give more pairs, or "
                                 "train, val and test shard specs")
        except BaseException:
            for writer in writers.values():
                writer.abort()
            if made:  # the folders it made (the deepest first), each only if empty once the deeper ones are gone
                shutil.rmtree(made[0], ignore_errors=True)
            for folder in made[1:]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
        for writer in writers.values():
            writer.close()
    return {split: shard_spec(root / split, prefix=split) for split in splits}


def user_specs(name: str, entry: dict, acc, cache: Path = USER_CACHE) -> Optional[dict[str, str]]:
    """The {fit, val, test} shard specs of a user data set (None for a packaged one): as named,
    or its one shard set split by caption hash (written once, by the main process)."""
    if entry.get("shards"):
        check_local(name, entry["shards"])
        return dict(entry["shards"])
    if not entry.get("source"):
        return None
    check_local(name, {"shards": entry["source"]})
    # the folder's key: the spec and its local shards' sizes and times (a rewritten set is split again)
    stamp = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in _local_parts(entry["source"])]
    root = Path(cache) / f"{name}-{hashlib.sha1(json.dumps([entry['source'], stamp]).encode()).hexdigest()[:12]}"
    try:
        if acc.is_main_process:
            write_split(name, entry["source"], root)
        acc.wait_for_everyone()
        return write_split(name, entry["source"], root)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config: {e}") from None
