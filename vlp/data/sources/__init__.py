"""Built-in offline sources of (image, caption) pairs: the *packaged* ones (``PACKAGED``:
``openmoji``, ``openclipart``, ``material_icons``; docs/datasets.md) and ``synthetic`` (coloured
shapes with matching captions, any size, for benchmarks and tests).

Every source yields :class:`Pair` objects; ``vlp.data.write.write_shards`` turns any iterable of
them into webdataset shards. Each packaged module has ``load_pairs(split, image_size,
cache_dir)``; a spec names one: ``openclipart``, ``openclipart:128`` (render size) or
``openclipart:fit`` (split); see ``parse_packaged``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from types import ModuleType
from typing import Any

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
PACKAGED = ("openmoji", "openclipart", "material_icons")
DEFAULT_PX = 64
MIN_PX, MAX_PX = 16, 512
PACKAGED_SPLITS = ("train", "eval", "all", "fit", "val", "test")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One image-caption pair, ready to be written to a shard.

    key:     unique, filename-safe sample key (letters, digits, ``_`` and ``-``; no dots,
             because webdataset splits a member name at its first dot).
    image:   encoded image bytes (PNG, JPEG, ... anything PIL reads).
    caption: the text paired with the image.
    meta:    JSON-serialisable extra fields, written as ``{key}.json``.
    """

    key: str
    image: bytes = dataclasses.field(repr=False)
    caption: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_key(self.key)

    @property
    def image_png(self) -> bytes:
        """Alias of ``image`` (the built-in sources encode PNG)."""
        return self.image


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid sample key, else raise ValueError."""
    if not _KEY_RE.match(key):
        raise ValueError(f"sample key {key!r} is not filename-safe ([A-Za-z0-9_-]+)")
    return key


def safe_key(text: str) -> str:
    """Map any string (e.g. a relative file path) to a filename-safe key."""
    key = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_")
    return key or "sample"


def packaged_source(name: str) -> ModuleType:
    """The module of a packaged source (it has ``load_pairs(split, image_size, cache_dir)``);
    imported on use so that listing the names costs nothing."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged source {name!r}: expected one of {', '.join(PACKAGED)}")
    return importlib.import_module(f"{__name__}.{name}")


def parse_packaged(spec: Any) -> tuple[str, int | None, str | None] | None:
    """A packaged-source spec as (name, render size or None, split or None): 'openclipart' ->
    ('openclipart', None, None), 'openclipart:128' -> ('openclipart', 128, None), 'openmoji:eval'
    -> ('openmoji', None, 'eval'). None when ``spec`` names no packaged source; ValueError (one
    line) for a bad suffix or a size outside 16..512."""
    if not isinstance(spec, str):
        return None
    name, sep, rest = spec.partition(":")
    if name not in PACKAGED:
        return None
    if not sep:
        return name, None, None
    if rest in PACKAGED_SPLITS:
        return name, None, rest
    if rest.isdigit() and MIN_PX <= int(rest) <= MAX_PX:
        return name, int(rest), None
    raise ValueError(f"{spec!r}: after '{name}:' give a render size in {MIN_PX}..{MAX_PX} px "
                     f"(e.g. {name}:128) or a split ({', '.join(PACKAGED_SPLITS)})")
