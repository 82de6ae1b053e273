"""Built-in offline sources of (image, caption) pairs.

Every source yields :class:`Pair` objects; ``vlp.data.write.write_shards`` turns any
iterable of them into webdataset shards.

- ``openmoji``: ~1.9k real emoji renders with their Unicode names (the default demo data).
- ``synthetic``: coloured shapes with matching captions, any size, for benchmarks and tests.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")


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
