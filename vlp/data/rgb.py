"""Image bytes -> a PIL RGB image, the one rule every reader uses (training workers, the device
path's CPU fallback, eval sets, shard writing): 16-bit greyscale is scaled to 8 bits, not clipped."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


WIDE_GREY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's 16/32-bit integer greyscale


def to_rgb(image):
    """PIL image -> RGB. Integer greyscale wider than 8 bits is read as 16-bit (0..65535, the
    range PNG and TIFF give; PIL opens a 16-bit PNG as I;16 or, in older versions, I) and
    scaled to 0..255 with rounding, not clipped at 255."""
    if image.mode not in WIDE_GREY_MODES:
        return image.convert("RGB")
    wide = np.asarray(image).astype(np.int64).clip(0, 65535)
    grey = ((wide * 255 + 32767) // 65535).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def decode_rgb(data: bytes, decode_size: int | None = None):
    """PIL RGB image from bytes (`to_rgb`); JPEGs are DCT-downscaled while both sides stay >= size."""
    image = Image.open(io.BytesIO(data))
    if decode_size and image.format == "JPEG":
        image.draft("RGB", (decode_size, decode_size))
    return to_rgb(image)
