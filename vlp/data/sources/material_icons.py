"""Material Icons: ~2.1k Google Material Design icons captioned with their designers' names for them
(docs/datasets.md, "material_icons": the font, the caption templates, the aliases, why this set).
Offline; nothing is downloaded. One pair per distinct drawing (hash of the rendered pixels), the
first name in sort order kept, the others counted as 'alias' in index.json; blank glyphs as 'blank'.

    pairs = load_pairs("fit", image_size=64)   # 'fit' | 'val' | 'test' | 'train' | 'eval' | 'all'
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from pathlib import Path

from . import Pair
from .cached import build_once, cache_path, load_split, png_bytes, require, write_index
from .splits import stable_hash

NAME = "material_icons"
PACKAGES = ("fonts-material-design-icons-iconfont",)
FONT = Path("/usr/share/fonts/truetype/material-design-icons-iconfont/MaterialIcons-Regular.ttf")
CODEPOINTS = Path("/usr/share/fonts-material-design-icons-iconfont/scss/_variables.scss")
CACHE_FORMAT = 1
TEMPLATES = ("an icon of {name}", "a {name} icon", "a pictogram of {name}", "a symbol for {name}")
_ENTRY = re.compile(r'^\s*"([a-z0-9_]+)":\s*([0-9a-fA-F]{4,6}),?\s*$', re.MULTILINE)


def read_codepoints(path: Path) -> list[tuple[str, int]]:
    """(name, code point) of every icon in the SCSS map, sorted by name."""
    entries = _ENTRY.findall(require(path, NAME, PACKAGES).read_text(encoding="utf-8"))
    if not entries:
        raise ValueError(f"{NAME}: no icon names found in {path}")
    return sorted((name, int(code, 16)) for name, code in entries)


def words(name: str) -> str:
    """'battery_charging_full' -> 'battery charging full'."""
    return " ".join(name.split("_"))


def caption_for(name: str) -> str:
    return TEMPLATES[stable_hash(name) % len(TEMPLATES)].format(name=words(name))


def draw(font, codepoint: int, size: int):
    """The glyph in black, centred on a white ``size`` px square."""
    from PIL import Image, ImageDraw  # heavy: imported when rendering only

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((size / 2, size / 2), chr(codepoint), font=font, fill="black", anchor="mm")
    return image


def _render_into(directory: Path, image_size: int, font_path: Path, codepoints: Path) -> None:
    from PIL import ImageFont  # heavy: imported when rendering only

    # the glyphs fill their 1 em box; 0.8 of the side leaves a white margin
    font = ImageFont.truetype(str(require(font_path, NAME, PACKAGES)), max(8, round(image_size * 0.8)))
    (directory / "images").mkdir(parents=True)
    skipped: Counter = Counter()
    rows, seen = [], set()
    for name, codepoint in read_codepoints(codepoints):
        image = draw(font, codepoint, image_size)
        if image.convert("L").getextrema()[0] == 255:
            skipped["blank"] += 1
            continue
        digest = hashlib.sha1(image.tobytes()).hexdigest()
        if digest in seen:
            skipped["alias"] += 1
            continue
        seen.add(digest)
        key = f"mi_{name}"
        (directory / "images" / f"{key}.png").write_bytes(png_bytes(image))
        rows.append({"key": key, "name": words(name), "caption": caption_for(name), "icon": name,
                     "codepoint": f"U+{codepoint:04X}"})
    write_index(directory, _versions(font_path, codepoints), image_size, rows, skipped)


def _versions(font_path: Path, codepoints: Path) -> str:
    import PIL  # heavy: imported when rendering only

    digest = hashlib.sha1(require(font_path, NAME, PACKAGES).read_bytes()
                          + require(codepoints, NAME, PACKAGES).read_bytes()).hexdigest()
    return f"{CACHE_FORMAT}|{PIL.__version__}|{digest}"


def ensure_rendered(image_size: int = 64, cache_dir: str | os.PathLike | None = None,
                    font_path: Path | None = None, codepoints: Path | None = None) -> Path:
    """Render once into the cache (~10 s); return the folder with index.json. ``font_path`` and
    ``codepoints``: the package's files (default ``FONT``, ``CODEPOINTS``)."""
    font_path = Path(font_path) if font_path is not None else FONT
    codepoints = Path(codepoints) if codepoints is not None else CODEPOINTS
    target = cache_path(NAME, _versions(font_path, codepoints), image_size, cache_dir)
    return build_once(target, lambda tmp: _render_into(tmp, image_size, font_path, codepoints))


def load_pairs(split: str = "all", image_size: int = 64, cache_dir: str | os.PathLike | None = None,
               font_path: Path | None = None, codepoints: Path | None = None) -> list[Pair]:
    """Material Icons pairs of ``split`` sorted by icon name; Pair.meta holds name, icon, codepoint
    and split. Raises MissingPackage without the package."""
    return load_split(ensure_rendered(image_size, cache_dir, font_path, codepoints), split)
