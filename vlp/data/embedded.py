"""The embedded (packaged) data sets as shards: the pairs of a packaged source (vlp.data.sources:
'openmoji', the default, 'openclipart', 'material_icons') written once per split under
.cache/shards/ (vlp.data.write). Sources produce pairs; this module is the one place that turns the
packaged ones into shards, and reads the specs that name them ('', 'openmoji', 'openclipart:128')."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vlp.data.sources import DEFAULT_PX, packaged_source, parse_packaged
from vlp.data.write import shard_spec, write_shards

SHARD_CACHE = Path(".cache") / "shards" / "openmoji"  # relative: under the working directory
DEFAULT_SOURCE = "openmoji"


def embedded_source(spec: Any) -> tuple[str, int] | None:
    """The (packaged source, render size) that a data.train_shards value names: '' / None ->
    ('openmoji', 64), 'openclipart' -> ('openclipart', 64), 'material_icons:128' ->
    ('material_icons', 128); None for anything else (a shard spec). ValueError (one line) for a
    bad size or a split suffix, which a shard spec for the study cannot carry."""
    if spec in (None, ""):
        return DEFAULT_SOURCE, DEFAULT_PX
    parsed = parse_packaged(spec)
    if parsed is None:
        return None
    name, size, split = parsed
    if split is not None:
        raise ValueError(f"data.train_shards={spec!r}: name the data set and optionally its render size "
                         f"({name} or {name}:128); the splits are chosen by the run")
    return name, size or DEFAULT_PX


def prepare_shards(root: str | os.PathLike = SHARD_CACHE, splits: tuple[str, ...] = ("train", "eval"),
                   image_size: int = DEFAULT_PX, source: str = DEFAULT_SOURCE) -> dict[str, str]:
    """Render the pairs of ``source`` (cached) at ``image_size`` px and write the shards of
    ``splits`` ('train' and 'eval', or the study's 'fit', 'val' and 'test') under ``root`` once (a
    folder with its sizes.json is reused); return {split: shard spec}. Used by `vlp demo`,
    `vlp compare` on the embedded data, the benchmarks and the tests."""
    load_pairs = packaged_source(source).load_pairs
    specs = {}
    for split in splits:
        out = Path(root) / split
        if not (out / "sizes.json").is_file():
            write_shards(load_pairs(split, image_size=image_size), out, prefix=split, samples_per_shard=500,
                         overwrite=True)
        specs[split] = shard_spec(out, prefix=split)
    return specs
