"""One raw (image, caption) pair -> the bytes of one shard sample (``EncodedSample``): the image
read (regular files only, bounded), checked and re-encoded if asked, the caption checked, the
meta kept. Used by ``vlp.data.write`` (possibly in worker processes)."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from typing import Any

from vlp.data.sources import check_key

MAX_IMAGE_BYTES = 1 << 28  # 256 MiB: larger "images" are skipped as too_large (never read)
MAX_CAPTION_BYTES = 1 << 20

_PIL_FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif",
                   "TIFF": "tif"}


@dataclasses.dataclass
class EncodedSample:
    key: str
    image_ext: str
    image: bytes
    caption: str
    meta: dict[str, Any]


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(obj, dict) and name in obj:
            return obj[name]
        if not isinstance(obj, dict) and hasattr(obj, name):
            return getattr(obj, name)
    return default


def encode_pair(
    pair: Any,
    image_ext: str | None = None,
    jpeg_quality: int | None = None,
    resize_longest: int | None = None,
) -> EncodedSample | str:
    """Validate and (re-)encode one pair-like (attributes or dict keys ``key``,
    ``image``/``image_png`` bytes or ``image_path``, ``caption`` or ``caption_path``, ``meta``).

    Returns an EncodedSample, or the skip kind as a string. The image bytes pass through
    unchanged when no resize is asked, the format already matches ``image_ext`` (None: keep
    any format) and no ``jpeg_quality`` re-encode is asked for a JPEG.
    """
    from PIL import Image

    key = _field(pair, "key")
    caption = _field(pair, "caption", default=None)
    meta = dict(_field(pair, "meta", default=None) or {})
    if caption is None and _field(pair, "caption_path") is not None:
        data = read_regular(_field(pair, "caption_path"), MAX_CAPTION_BYTES, "missing_caption")
        if isinstance(data, str):
            return data
        try:
            caption = data.decode("utf-8")
        except UnicodeDecodeError:
            return "missing_caption"
    if not isinstance(caption, str) or not caption.strip():
        return "missing_caption"
    raw = _field(pair, "image", "image_png")
    if raw is None:
        raw = read_regular(_field(pair, "image_path"), MAX_IMAGE_BYTES, "missing_image")
        if isinstance(raw, str):
            return raw
    try:
        with Image.open(io.BytesIO(raw)) as image:
            src_ext = _PIL_FORMAT_EXT.get(image.format or "", None)
            image.load()
            want = (image_ext or src_ext or "png").lower().replace("jpeg", "jpg")
            too_big = resize_longest is not None and max(image.size) > resize_longest
            requality = want == "jpg" and jpeg_quality is not None
            if src_ext == want and not too_big and not requality:
                return EncodedSample(check_key(key), want, raw, caption.strip(), meta)
            out = _reencode(image, want, jpeg_quality, resize_longest if too_big else None)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, TypeError):
        return "corrupt_image"
    return EncodedSample(check_key(key), want, out, caption.strip(), meta)


def read_regular(path: Any, limit: int, missing: str) -> bytes | str:
    """The bytes of a regular file (symlinks followed), or the skip kind: ``missing`` (absent,
    unreadable), 'special_file' (FIFO, device, socket, folder: opened non-blocking and never read,
    so a FIFO cannot hang the run nor /dev/zero fill memory) or 'too_large' (over ``limit``)."""
    if not path:
        return missing
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, TypeError, ValueError):
        return missing
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "special_file"
        if info.st_size > limit:
            return "too_large"
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return missing
    finally:
        os.close(fd)
    return "too_large" if len(data) > limit else data


def _reencode(image, ext: str, jpeg_quality: int | None, resize_longest: int | None) -> bytes:
    from PIL import Image, ImageOps

    from .rgb import WIDE_GREY_MODES, to_rgb

    image = ImageOps.exif_transpose(image)
    if image.mode in WIDE_GREY_MODES:  # 16-bit greyscale: scaled to 8 bits, not clipped to white
        image = to_rgb(image)
    if resize_longest is not None:
        scale = resize_longest / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    if ext == "jpg":
        image = image.convert("RGB")
    elif image.mode not in ("RGB", "RGBA", "L", "LA"):
        image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    buf = io.BytesIO()
    if ext == "jpg":
        image.save(buf, format="JPEG", quality=jpeg_quality or 95)
    else:
        image.save(buf, format=ext.upper().replace("TIF", "TIFF"))
    return buf.getvalue()
