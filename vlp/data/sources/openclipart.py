"""Openclipart: ~2.6k public-domain clip art drawings captioned with their human-written titles,
from Debian's ``openclipart-svg`` (metadata) and ``openclipart-png`` (renders), read offline.

One pair per drawing (its SVG's content hash), its cleaned title the name, the PNG render squared
on white at ``image_size`` px the image, "clip art of <title>" the caption; what is skipped and
counted in index.json, and why, is docs/datasets.md's ("openclipart").

    pairs = load_pairs("fit", image_size=64)   # 'fit' | 'val' | 'test' | 'train' | 'eval' | 'all'
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from . import Pair, safe_key
from .cached import build_once, cache_path, load_split, png_bytes, require, square, write_index

NAME = "openclipart"
PACKAGES = ("openclipart-svg", "openclipart-png")
ROOT = Path("/usr/share/openclipart")
CACHE_FORMAT = 3
COLLECTION_SIZE = 3  # a title on more distinct drawings than this names a collection
TITLE_MAX = 80
DESCRIPTION_MAX = 100
MAX_PIXELS = 16_000_000  # a few renders are ~170 MP; decoding one takes ~0.7 GB
_NS = {"dc": "http://purl.org/dc/elements/1.1/", "cc": "http://web.resource.org/cc/",
       "svg": "http://www.w3.org/2000/svg"}
_BY_PREFIX = re.compile(r"^clip\s*art by [^-]+ - ", re.IGNORECASE)
_JUNK = re.compile(r"@|https?:|www\.|HASH\(|converted from|made with|sodipodi|inkscape", re.IGNORECASE)


def clean(text: str, limit: int) -> str:
    """Whitespace collapsed, underscores read as spaces, at most ``limit`` characters (cut at a word)."""
    text = " ".join(text.replace("_", " ").split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0]
    return text.strip(" .,;:-")


def svg_metadata(data: bytes) -> tuple[str, str]:
    """(title, description) of an SVG: the work's dc:title (else the SVG <title>) and
    dc:description, cleaned; '' where absent. Raises ET.ParseError on malformed XML."""
    root = ET.fromstring(data)
    work = root.find(".//cc:Work", _NS)
    title = work.findtext("dc:title", "", _NS) if work is not None else ""
    description = work.findtext("dc:description", "", _NS) if work is not None else ""
    if not title.strip():
        title = root.findtext("svg:title", "", _NS)
    return clean(_BY_PREFIX.sub("", title.strip()), TITLE_MAX), clean(description, 10 * DESCRIPTION_MAX)


def caption_for(title: str, description: str) -> str:
    """'clip art of <title>', then ': <description>' when it is short, specific and not the title."""
    caption = f"clip art of {title}"
    usable = (description and len(description) <= DESCRIPTION_MAX and not _JUNK.search(description)
              and description.lower() != title.lower() and len(description.split()) >= 2)
    return f"{caption}: {description}" if usable else caption


def usable_title(title: str) -> bool:
    return sum(ch.isalpha() for ch in title) >= 2


def svg_files(root: Path) -> list[Path]:
    """Every SVG (symlinks included) under ``root``/svg, sorted by relative path."""
    svg_root = require(root / "svg", NAME, PACKAGES)
    return sorted((p for p in svg_root.rglob("*.svg") if p.is_file()),
                  key=lambda p: p.relative_to(svg_root).as_posix())


def drawings(root: Path) -> tuple[list[dict], Counter]:
    """One row per distinct drawing (first path by sort order), with its title, description and
    category; and the counts of what was skipped."""
    skipped: Counter = Counter()
    rows, seen = [], set()
    for path in svg_files(root):
        data = path.read_bytes()
        digest = hashlib.sha1(data).hexdigest()
        if digest in seen:
            skipped["duplicate_file"] += 1
            continue
        seen.add(digest)
        try:
            title, description = svg_metadata(data)
        except ET.ParseError:
            skipped["unreadable_svg"] += 1
            continue
        if not usable_title(title):
            skipped["no_title"] += 1
            continue
        rel = path.relative_to(root / "svg")
        rows.append({"sha1": digest, "path": rel.as_posix(), "category": rel.parent.as_posix(),
                     "title": title, "description": description})
    return rows, skipped


def captioned(rows: list[dict], skipped: Counter) -> list[dict]:
    """Rows whose title names one drawing (not a collection), one per caption, with key, name and
    caption added."""
    per_title = Counter(r["title"].lower() for r in rows)
    out, captions = [], set()
    for row in rows:
        if per_title[row["title"].lower()] > COLLECTION_SIZE:
            skipped["collection_title"] += 1
            continue
        if row["title"].lower() in captions:
            skipped["duplicate_title"] += 1
            continue
        captions.add(row["title"].lower())
        caption = caption_for(row["title"], row["description"])
        key = "oca_" + safe_key(Path(row["path"]).stem)[:40] + "_" + row["sha1"][:8]
        out.append({"key": key, "name": row["title"], "caption": caption, **row})
    return out


def _render_into(directory: Path, image_size: int, root: Path) -> None:
    require(root / "png", NAME, PACKAGES)
    rows, skipped = drawings(root)
    (directory / "images").mkdir(parents=True)
    kept = []
    for row in captioned(rows, skipped):
        image = _square_png(root / "png" / Path(row["path"]).with_suffix(".png"), image_size, skipped)
        if image is not None:
            (directory / "images" / f"{row['key']}.png").write_bytes(image)
            kept.append(row)
    write_index(directory, _versions(root), image_size, kept, skipped)


def _square_png(path: Path, image_size: int, skipped: Counter) -> bytes | None:
    """The render squared to ``image_size`` px as PNG bytes; None (counted) if too large, unreadable
    or blank."""
    from PIL import Image  # heavy: imported when rendering only

    try:
        with warnings.catch_warnings():  # the size is checked below, before decoding
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                if image.width * image.height > MAX_PIXELS:
                    skipped["too_large"] += 1
                    return None
                image.load()
                squared = square(image, image_size)
    except Image.DecompressionBombError:  # over twice Pillow's limit: refused before the check above
        skipped["too_large"] += 1
        return None
    except (OSError, ValueError):
        skipped["unreadable_png"] += 1
        return None
    lo, hi = squared.convert("L").getextrema()
    if lo == hi:  # white on transparent, or nothing left at this size
        skipped["blank"] += 1
        return None
    return png_bytes(squared)


def _versions(root: Path) -> str:
    """The cache tag: the format, Pillow, and the installed packages' file listing (name + size)."""
    import PIL  # heavy: imported when rendering only

    listing = sorted(f"{p.relative_to(root)}:{p.stat().st_size}" for p in (root / "svg").rglob("*.svg")
                     if p.is_file())
    return f"{CACHE_FORMAT}|{PIL.__version__}|{hashlib.sha1(chr(10).join(listing).encode()).hexdigest()}"


def ensure_rendered(image_size: int = 64, cache_dir: str | os.PathLike | None = None,
                    root: Path | None = None) -> Path:
    """Render once into the cache (1-3 min on one core); return the folder with index.json.
    ``root``: where the packages put their files (default ``ROOT``)."""
    root = Path(root) if root is not None else ROOT
    require(root / "svg", NAME, PACKAGES)
    target = cache_path(NAME, _versions(root), image_size, cache_dir)
    return build_once(target, lambda tmp: _render_into(tmp, image_size, root))


def load_pairs(split: str = "all", image_size: int = 64, cache_dir: str | os.PathLike | None = None,
               root: Path | None = None) -> list[Pair]:
    """Openclipart pairs of ``split`` sorted by first path; Pair.meta holds name, title,
    description, category, path, sha1 and split. Raises MissingPackage without the packages."""
    return load_split(ensure_rendered(image_size, cache_dir, root), split)
