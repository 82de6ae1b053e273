"""Synthetic pairs: a coloured shape on a plain background, captioned with what it shows.

Cheap to make at any count and size, learnable (colour x shape x position are in the
caption), deterministic from the seed. For benchmarks and tests, not for quality claims.

    pairs = list(iter_pairs(10_000, image_size=224, seed=0, image_format="JPEG"))
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

from . import Pair

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (240, 210, 40), "purple": (140, 60, 180), "orange": (245, 140, 30),
    "black": (20, 20, 20), "pink": (240, 120, 180),
}
SHAPES = ("circle", "square", "triangle", "cross")
PLACES = ("on the left", "on the right", "at the top", "at the bottom", "in the middle")


def _draw(shape: str, color: tuple, place: str, size: int, rng: random.Random):
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    r = size // 5
    cx, cy = {"on the left": (size // 4, size // 2), "on the right": (3 * size // 4, size // 2),
              "at the top": (size // 2, size // 4), "at the bottom": (size // 2, 3 * size // 4),
              "in the middle": (size // 2, size // 2)}[place]
    cx, cy = cx + rng.randint(-r // 3, r // 3), cy + rng.randint(-r // 3, r // 3)
    draw = ImageDraw.Draw(image)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    else:
        w = max(1, r // 3)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=color)
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=color)
    return image


def iter_pairs(count: int, image_size: int = 64, seed: int = 0,
               image_format: str = "PNG", jpeg_quality: int = 90) -> Iterator[Pair]:
    """``count`` pairs with keys 'synth_000000000'...; same seed, same pairs."""
    rng = random.Random(seed)
    for i in range(count):
        color = rng.choice(sorted(COLORS))
        shape, place = rng.choice(SHAPES), rng.choice(PLACES)
        image = _draw(shape, COLORS[color], place, image_size, rng)
        buf = io.BytesIO()
        if image_format.upper() in ("JPEG", "JPG"):
            image.save(buf, format="JPEG", quality=jpeg_quality)
        else:
            image.save(buf, format="PNG")
        yield Pair(key=f"synth_{i:09d}", image=buf.getvalue(),
                   caption=f"a {color} {shape} {place}",
                   meta={"color": color, "shape": shape, "place": place})


def load_pairs(count: int, image_size: int = 64, seed: int = 0, **kwargs) -> list[Pair]:
    return list(iter_pairs(count, image_size, seed, **kwargs))
