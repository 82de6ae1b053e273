"""Image bytes -> transformed tensor, with a train-time JPEG fast path that keeps the augmentation.

``CropFirst`` (a transform that starts with a ``RandomResizedCrop``, open_clip's train
transform) reads the image size from the JPEG header, draws the crop box with the transform's
own ``RandomResizedCrop.get_params`` on that (W, H) (replayed in Python in a stream,
vlp.data.boxes: the same boxes), then decodes at the smallest libjpeg DCT scale 1/s (s in 1, 2,
4, 8) at which the box still covers the output size on both sides, and resamples the box
(mapped to the reduced image) to the output size with the same PIL filter. Only the pixels
inside the box are resampled differently; s = 1 is bit-identical to the plain transform
(``bench/augment_equivalence.py`` measures how close). Everything else (non-JPEG images, other
transforms, an explicit ``decode_size``) takes the plain path: ``decode_rgb`` then the transform.

Every decoded image becomes RGB through ``to_rgb``, which scales 16-bit greyscale (PIL modes
I;16 and I) to 8 bits instead of letting ``convert('RGB')`` clip every value above 255 to white.

What a decoder's ``finish`` returns is set by ``output`` (docs/data-path.md): "float", "uint8",
"region" or "jpeg" (what nvjpeg is not given, PNG or CMYK, comes as a region). A transform that
cannot be split so (no ToTensor + Normalize tail, another filter) takes the nearest output
that it can: ``decoder.output`` says which.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from vlp.data.boxes import BoxDraws, crop_box, probe
from vlp.data.device import FILTERS, JPEG, OUTPUTS, PIXELS, DeviceImages, PackedImages
from vlp.data.pool import host_buffer
from vlp.data.rgb import decode_rgb, to_rgb

DCT_SCALES = (8, 4, 2, 1)  # the reductions libjpeg's DCT scaling offers through PIL's draft()


def dct_scale(box_w: int, box_h: int, out_w: int, out_h: int) -> int:
    """Largest s in DCT_SCALES with box_w / s >= out_w and box_h / s >= out_h (1 if none)."""
    return next(s for s in DCT_SCALES if box_w >= s * out_w and box_h >= s * out_h or s == 1)


class PlainDecoder:
    """Today's path: decode the whole image (optionally DCT-downscaled to >= decode_size on
    both sides, which changes the augmentation), then apply the transform."""

    def __init__(self, transform: Callable, decode_size: int | None = None, output: str = "float"):
        self.transform, self.decode_size = transform, decode_size
        self.split = split_tail(transform) if output != "float" else None
        self.output = "uint8" if self.split else "float"  # the resize stays here (any transform)

    def use_seed(self, seed: int) -> None:
        """Nothing: the transform draws from torch's generator, which the stream seeds."""

    def decode(self, data: bytes):
        """Everything that can fail on bad bytes (the caller replaces such samples)."""
        return decode_rgb(data, self.decode_size)

    def finish(self, decoded):
        if self.split is None:
            return self.transform(decoded)
        return as_uint8(run(self.split[0], decoded))

    def device_part(self) -> Optional[DeviceImages]:
        """The device half of this decoder's output (None: the worker did everything)."""
        return None if self.split is None else DeviceImages(*self.split[1:])


class CropFirst:
    """RandomResizedCrop + the rest of a Compose, with the crop box drawn before decoding."""

    def __init__(self, crop, rest: list[Callable], output: str = "float"):
        from torchvision.transforms.functional import pil_modes_mapping

        self.crop, self.rest = crop, rest
        self.out_h, self.out_w = crop.size
        self.resample = pil_modes_mapping[crop.interpolation]
        self.split = split_tail(rest) if output != "float" else None
        self.output = "float" if self.split is None else output
        if self.output in ("region", "jpeg") and not self._resample_on_device_ok():
            self.output = "uint8"
        # the boxes replay torch's generator (vlp.data.boxes) when nothing after the crop draws
        self.replay = all(_draws_nothing(t) for t in rest)
        self.draws: Optional[BoxDraws] = None

    def use_seed(self, seed: int) -> None:
        """The stream seeded torch's generator with ``seed`` (vlp.data.worker): draw the next
        boxes from its replay, the same boxes without torch ops; or from torch itself where the
        replay is off (a transform step after the crop draws too, or ``probe`` failed)."""
        form = probe(tuple(self.crop.scale), tuple(self.crop.ratio)) if self.replay else None
        self.draws = BoxDraws(seed, form, self.crop.scale, self.crop.ratio) if form else None

    def box(self, width: int, height: int, image) -> tuple[int, int, int, int]:
        """get_params' box for an image of width x height (from the replay, or torch's)."""
        if self.draws is not None:
            return crop_box(self.draws, width, height)
        return self.crop.get_params(image, self.crop.scale, self.crop.ratio)

    def _resample_on_device_ok(self) -> bool:
        """The device resamples with PIL's filter (bicubic/bilinear) and converts nothing: the
        worker steps before ToTensor may only be RGB conversions (the regions are RGB)."""
        return self.crop.interpolation.value in FILTERS and all(_is_rgb_conversion(t) for t in self.split[0])

    def device_part(self) -> Optional[DeviceImages]:
        if self.split is None:
            return None
        size = (self.out_h, self.out_w) if self.output in ("region", "jpeg") else None
        return DeviceImages(*self.split[1:], size=size, kind=self.crop.interpolation.value)

    def decode(self, data: bytes):
        """(reduced RGB image, scale s, crop box (i, j, h, w) in full-size pixels), or a plain
        decoded image for non-JPEG bytes. Raises on bad bytes like ``decode_rgb``; the
        box's RNG draws are then undone, so a failed image consumes no randomness (as on
        the plain path, where the transform never runs for it)."""
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        if image.format != "JPEG":
            return to_rgb(image)
        state = torch.random.get_rng_state() if self.draws is None else self.draws.pos
        try:
            # get_params reads only .size (the header's), so the box equals the plain path's
            i, j, h, w = self.box(*image.size, image)
            # the device decodes it; a JPEG not ending in EOI (cut short) is decoded here, so a
            # corrupt one is replaced in the stream as on the CPU path
            if self.output == "jpeg" and image.mode in NVJPEG_MODES and data.rstrip(b"\0").endswith(b"\xff\xd9"):
                return "jpeg", data, (i, j, h, w)
            s = dct_scale(w, h, self.out_w, self.out_h)
            if s > 1:
                width, height = image.size
                drafted = image.draft("RGB", (width // s, height // s))  # PIL then picks s exactly
                s = 1 if drafted is None else round(width / drafted[1][2])
            image.load()  # the decode (an RGB JPEG is already RGB: no convert copy)
            return image if image.mode == "RGB" else image.convert("RGB"), s, (i, j, h, w)
        except Exception:
            if self.draws is None:
                torch.random.set_rng_state(state)
            else:
                self.draws.pos = state
            raise

    def finish(self, decoded):
        """The transform's output for what ``decode`` returned (``output`` says in which form)."""
        region = self.output in ("region", "jpeg")
        if isinstance(decoded, tuple) and decoded[0] == "jpeg":
            _, data, (i, j, h, w) = decoded
            return JPEG, data, (i, j, h, w), (0.0, 0.0, float(w), float(h))
        if not isinstance(decoded, tuple):  # non-JPEG: the whole transform, as on the plain path
            i, j, h, w = self.box(*decoded.size, decoded)  # as RandomResizedCrop draws it
            if region:  # the resize on the device
                return PIXELS, np.asarray(decoded)[i:i + h, j:j + w], None, (0.0, 0.0, float(w), float(h))
            image = self._resized_crop(decoded, 1, i, j, h, w)  # RandomResizedCrop's own call
        elif region:
            pixels, box = self._region(*decoded)
            return PIXELS, pixels, None, box
        else:
            image, s, (i, j, h, w) = decoded
            image = self._resized_crop(image, s, i, j, h, w)
        if self.split is not None:
            return as_uint8(run(self.split[0], image))
        return run(self.rest, image)

    @staticmethod
    def _region(image, s: int, box: tuple[int, int, int, int]):
        """(the integer region of the reduced image covering the box, as a view of its pixels,
        the box in it)."""
        i, j, h, w = box
        x0, y0, x1, y1 = j / s, i / s, (j + w) / s, (i + h) / s
        left, top = math.floor(x0), math.floor(y0)
        right, bottom = min(math.ceil(x1), image.width), min(math.ceil(y1), image.height)
        return np.asarray(image)[top:bottom, left:right], (x0 - left, y0 - top, x1 - left, y1 - top)

    def _resized_crop(self, image, s: int, i: int, j: int, h: int, w: int):
        from torchvision.transforms import functional as F

        if s == 1:  # the plain transform's own call
            return F.resized_crop(image, i, j, h, w, [self.out_h, self.out_w],
                                  self.crop.interpolation, antialias=self.crop.antialias)
        # Reduced pixel k holds the original pixels [k*s, (k+1)*s): the box's edges map to
        # x / s. Crop the covering integer region first (so the filter clamps at the box's
        # edge as the plain crop-then-resize does), then resample the fractional box.
        x0, y0, x1, y1 = j / s, i / s, (j + w) / s, (i + h) / s
        left, top = math.floor(x0), math.floor(y0)
        right, bottom = min(math.ceil(x1), image.width), min(math.ceil(y1), image.height)
        region = image.crop((left, top, right, bottom))
        return region.resize((self.out_w, self.out_h), self.resample,
                             box=(x0 - left, y0 - top, x1 - left, y1 - top))

    @classmethod
    def of(cls, transform: Callable, output: str = "float") -> CropFirst | None:
        """A CropFirst for a (Compose starting with a) torchvision RandomResizedCrop, else None."""
        from torchvision.transforms import Compose, RandomResizedCrop

        steps = transform.transforms if isinstance(transform, Compose) else [transform]
        if not steps or type(steps[0]) is not RandomResizedCrop:  # subclasses may change forward()
            return None
        return cls(steps[0], list(steps[1:]), output)


def image_decoder(transform: Callable, decode_size: int | None = None,
                  output: str = "float") -> CropFirst | PlainDecoder:
    """The decoder for a stream: the crop-first fast path when the transform allows it and no
    ``decode_size`` asks for the old whole-image downscale, else the plain path. ``output``:
    what ``finish`` returns (module docstring); ``decoder.output`` is what it can give."""
    if output not in OUTPUTS:
        raise ValueError(f"image output must be one of {OUTPUTS}, got {output!r}")
    fast = None if decode_size else CropFirst.of(transform, output)
    return fast or PlainDecoder(transform, decode_size, output)


# ----------------------------------------------------------------------------- worker / device split
NVJPEG_MODES = ("RGB", "L")  # JPEG colour modes given to nvjpeg (CMYK/YCCK decode on the CPU)


def split_tail(transform) -> Optional[tuple[list, tuple, tuple]]:
    """(the steps before ToTensor, mean, std) when a transform (a Compose or its list of steps)
    ends with ToTensor (or open_clip's MaybeToTensor) + Normalize: what a worker runs and what
    the device finishes. None when it does not end so (then the worker runs all of it)."""
    from torchvision.transforms import Compose, Normalize, ToTensor

    steps = transform.transforms if isinstance(transform, Compose) else transform
    if not isinstance(steps, list) or len(steps) < 2:
        return None
    to_tensor, norm = steps[-2], steps[-1]
    if not isinstance(to_tensor, ToTensor) or type(norm) is not Normalize or norm.inplace:
        return None
    return list(steps[:-2]), tuple(norm.mean), tuple(norm.std)


# steps that draw no randomness (torchvision's and open_clip's names)
DETERMINISTIC = ("ToTensor", "PILToTensor", "MaybeToTensor", "Normalize", "ConvertImageDtype")


def _draws_nothing(step) -> bool:
    return type(step).__name__ in DETERMINISTIC or _is_rgb_conversion(step)


def _is_rgb_conversion(step) -> bool:
    """open_clip's MaybeConvertMode('RGB') or _convert_to_rgb: nothing to do on RGB pixels."""
    return (type(step).__name__ == "MaybeConvertMode" and getattr(step, "mode", None) == "RGB") or \
        getattr(step, "__name__", "") == "_convert_to_rgb"


def run(steps: list[Callable], image):
    for t in steps:
        image = t(image)
    return image


def as_uint8(image) -> np.ndarray:
    """A PIL image (RGB after the worker steps) -> uint8 (H, W, 3), what ToTensor would read."""
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"the worker steps of the transform gave {array.dtype} {array.shape}, not RGB uint8")
    return array


def collate_images(images: list, alloc: Callable = host_buffer):
    """A batch of one decoder's ``finish`` outputs: float (b, 3, H, W), uint8 (b, H, W, 3) or
    PackedImages (region/jpeg); written once, into ``alloc(shape, dtype)`` (vlp.data.pool)."""
    if isinstance(images[0], torch.Tensor):
        return torch.stack(images, out=alloc((len(images), *images[0].shape), images[0].dtype))
    if isinstance(images[0], np.ndarray):
        out = alloc((len(images), *images[0].shape))
        np.stack(images, out=out.numpy())
        return out
    return PackedImages.pack(images, alloc)
