"""The device half of the image path: what loader workers ship (uint8) -> the model's float input.

What a worker ships is the stream's ``image_output`` (vlp.data.decode.image_decoder): 'float',
'uint8', 'region' or 'jpeg'; docs/data-path.md tells what each leaves to the device, how exact
it is and the counted GPU decode fallbacks (``DeviceImages.counts``).

Only ``data`` of a PackedImages (and boxes, sizes) travels to the device; the offsets stay on
the host, so unpacking needs no device sync. JPEG bytes stay on the host too: nvjpeg reads
them from host memory.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch
from PIL import Image

from vlp.data.pool import host_buffer
from vlp.data.rgb import to_rgb

PIXELS, JPEG = 0, 1  # PackedImages.meta[:, 0]: a region of uint8 pixels (h, w, 3), or JPEG bytes
OUTPUTS = ("float", "uint8", "region", "jpeg")
FILTERS = ("bicubic", "bilinear")  # PIL's, as torchvision names them


@dataclass
class PackedImages:
    """Variable-size samples of one batch in two flat buffers (workers -> device).

    pixels: uint8 (N,) the PIXELS samples' (h, w, 3) regions back to back (goes to the device)
    jpegs:  uint8 (M,) the JPEG samples' bytes back to back (stays on the host for nvjpeg)
    meta:   int64 numpy (b, 6) per sample: kind, offset, length, height, width, 0 (host only);
            for a JPEG sample height/width are 0 until decoded
    crops:  int64 numpy (b, 4) JPEG samples: top, left, height, width of the integer region
            cut from the decoded image (PIXELS samples: the whole region)
    boxes:  float64 (b, 4) x0, y0, x1, y1 of the crop box in the region's pixels
    """

    pixels: torch.Tensor
    jpegs: torch.Tensor
    meta: np.ndarray
    crops: np.ndarray
    boxes: torch.Tensor

    def __len__(self) -> int:
        return len(self.meta)

    @classmethod
    def pack(cls, samples: list[tuple], alloc: Callable = host_buffer) -> "PackedImages":
        """From a worker's samples: (PIXELS, uint8 (h, w, 3) array (a view is fine), None, box)
        or (JPEG, bytes, (top, left, height, width), box). Each sample is copied once, into
        the batch's buffers from ``alloc(shape)`` (vlp.data.pool: shared memory in a worker)."""
        meta = np.zeros((len(samples), 6), dtype=np.int64)
        crops = np.zeros((len(samples), 4), dtype=np.int64)
        sizes = {PIXELS: 0, JPEG: 0}
        for i, (kind, payload, crop, _) in enumerate(samples):
            h, w = (0, 0) if kind == JPEG else payload.shape[:2]
            length = len(payload) if kind == JPEG else h * w * 3
            meta[i] = (kind, sizes[kind], length, h, w, 0)
            crops[i] = crop if kind == JPEG else (0, 0, h, w)
            sizes[kind] += length
        buf = {kind: alloc((size,)) for kind, size in sizes.items()}
        views = {kind: b.numpy() for kind, b in buf.items()}
        for (kind, offset, length, h, w, _), (_, payload, _, _) in zip(meta.tolist(), samples):
            dst = views[kind][offset:offset + length]
            if kind == JPEG:
                dst[:] = np.frombuffer(payload, dtype=np.uint8)
            else:
                dst.reshape(h, w, 3)[:] = payload
        boxes = torch.tensor([s[3] for s in samples], dtype=torch.float64).reshape(-1, 4)
        return cls(buf[PIXELS], buf[JPEG], meta, crops, boxes)

    def pin_memory(self) -> "PackedImages":
        return replace(self, pixels=self.pixels.pin_memory(), boxes=self.boxes.pin_memory())

    def to(self, device, non_blocking: bool = False) -> "PackedImages":
        return replace(self, pixels=self.pixels.to(device, non_blocking=non_blocking),
                       boxes=self.boxes.to(device, non_blocking=non_blocking))


# ----------------------------------------------------------------------------- PIL's resampling
def _bicubic(x: torch.Tensor) -> torch.Tensor:
    """PIL's bicubic kernel (a = -0.5, support 2)."""
    a, x = -0.5, x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _bilinear(x: torch.Tensor) -> torch.Tensor:
    return (1 - x.abs()).clamp(min=0)


KERNELS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}


def resample_weights(lo: torch.Tensor, hi: torch.Tensor, in_sizes: torch.Tensor, out_size: int,
                     in_max: int, kind: str = "bicubic") -> torch.Tensor:
    """(b, out_size, in_max) float32 weights of PIL's ``resize(box=...)`` along one axis: output
    pixel k of sample n reads input pixel j with weight f((j + 0.5 - c) / fs), c = lo + (k + 0.5)
    * scale, fs = max(scale, 1) (an antialiasing filter when downscaling), zero past the
    sample's size, each row normalised (PIL's precompute_coeffs, in float64)."""
    kernel, _ = KERNELS[kind]
    lo, hi = lo.double(), hi.double()
    scale = (hi - lo) / out_size                                                  # (b,)
    fscale = scale.clamp(min=1.0)
    k = torch.arange(out_size, device=lo.device, dtype=torch.float64)
    centers = lo[:, None] + (k[None] + 0.5) * scale[:, None]                      # (b, out)
    j = torch.arange(in_max, device=lo.device, dtype=torch.float64)
    w = kernel((j[None, None] + 0.5 - centers[..., None]) / fscale[:, None, None])  # (b, out, in)
    w = w * (j[None, None] < in_sizes[:, None, None])
    return (w / w.sum(-1, keepdim=True).clamp(min=1e-12)).float()


def _round8(x: torch.Tensor) -> torch.Tensor:
    """PIL's 8-bit output: round half up, clip to 0..255 (after each pass)."""
    return torch.floor(x + 0.5).clamp_(0, 255)


def resample(regions: torch.Tensor, sizes: torch.Tensor, boxes: torch.Tensor, out_hw: tuple[int, int],
             kind: str = "bicubic") -> torch.Tensor:
    """Each sample's box of its region, resized to out_hw as PIL does it for 8-bit images
    (horizontal pass, round, vertical pass, round): float32 (b, 3, H, W) holding 0..255.

    regions: float32 (b, 3, Hm, Wm), sample n valid in [:sizes[n, 0], :sizes[n, 1]], zero past;
    boxes: (b, 4) x0, y0, x1, y1. Two batched matmuls (dense weights; the device's job)."""
    out_h, out_w = out_hw
    _, _, hm, wm = regions.shape
    wx = resample_weights(boxes[:, 0], boxes[:, 2], sizes[:, 1], out_w, wm, kind)   # (b, W, Wm)
    wy = resample_weights(boxes[:, 1], boxes[:, 3], sizes[:, 0], out_h, hm, kind)   # (b, H, Hm)
    rows = _round8(regions @ wx.transpose(1, 2)[:, None])                          # (b, 3, Hm, W)
    return _round8(wy[:, None] @ rows)                                             # (b, 3, H, W)


# ----------------------------------------------------------------------------- decoders
def nvjpeg_batch(blobs: list[torch.Tensor], device) -> list[torch.Tensor]:
    """One batched nvjpeg decode: host uint8 byte tensors -> (3, H, W) uint8 on ``device``."""
    from torchvision.io import ImageReadMode, decode_jpeg  # torchvision.io: heavy, only for decode=gpu

    return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)


def pil_decode(blob: torch.Tensor) -> torch.Tensor:
    """The CPU decoder (vlp.data.rgb.to_rgb, as the worker's): (3, H, W) uint8, host."""
    image = to_rgb(Image.open(io.BytesIO(blob.numpy().tobytes())))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


class JpegDecoder:
    """A batch of JPEGs decoded on the device in one call; per sample, what that call cannot
    read is decoded on the CPU (counted: ``counts['cpu_fallback']``). ``batched`` is injectable
    (tests run the routing on CPU with a decoder that refuses some samples)."""

    def __init__(self, batched: Callable = nvjpeg_batch, cpu: Callable = pil_decode):
        self.batched, self.cpu = batched, cpu
        self.counts: Counter[str] = Counter()

    def __call__(self, blobs: list[torch.Tensor], device) -> list[torch.Tensor]:
        if not blobs:
            return []
        try:
            out = list(self.batched(blobs, device))
            self.counts["device"] += len(out)
            return out
        except Exception:  # noqa: BLE001  (one unreadable sample fails the whole batched call)
            return [self.one(blob, device) for blob in blobs]

    def one(self, blob: torch.Tensor, device) -> torch.Tensor:
        try:
            image = self.batched([blob], device)[0]
            self.counts["device"] += 1
            return image
        except Exception:  # noqa: BLE001
            self.counts["cpu_fallback"] += 1
            try:
                return self.cpu(blob).to(device)
            except Exception:  # noqa: BLE001  (no worker decoded it: a black image, counted)
                self.counts["undecodable"] += 1
                return torch.zeros(3, 1, 1, dtype=torch.uint8, device=device)


# ----------------------------------------------------------------------------- the device transform
class DeviceImages:
    """The rest of the image transform, run on the batch's device: uint8 -> float, normalise,
    and for packed batches decode/crop/resample first. Float input passes unchanged."""

    def __init__(self, mean, std, size: Optional[tuple[int, int]] = None, kind: str = "bicubic",
                 jpeg: Optional[JpegDecoder] = None):
        std_t = torch.as_tensor(std, dtype=torch.float32)
        if (std_t == 0).any():  # checked once here, not per batch on the device
            raise ValueError(f"std {std} has a zero")
        self.mean, self.std = torch.as_tensor(mean, dtype=torch.float32), std_t
        self.size, self.kind = size, kind
        self.jpeg = jpeg or JpegDecoder()
        self.counts: Counter[str] = Counter()  # samples by route: region, jpeg, worker_decoded
        self._on: dict = {}

    def _stats(self, device):
        if device not in self._on:
            self._on[device] = (self.mean.to(device).view(1, -1, 1, 1), self.std.to(device).view(1, -1, 1, 1))
        return self._on[device]

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """(b, 3, H, W) values 0..255 (uint8 or float) -> ToTensor + Normalize's float ops."""
        mean, std = self._stats(pixels.device)
        return pixels.contiguous().float().div(255).sub_(mean).div_(std)

    def __call__(self, images):
        if isinstance(images, PackedImages):
            regions, sizes = self.regions(images)
            boxes = images.boxes.to(regions.device, non_blocking=True)  # moved with the batch already
            return self.normalize(resample(regions, sizes, boxes, self.size, self.kind))
        if images.dtype == torch.uint8:  # (b, H, W, 3) from the worker
            return self.normalize(images.permute(0, 3, 1, 2))
        return images

    def regions(self, packed: PackedImages) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (b, 3, Hm, Wm) zero-padded regions on the device, and their (h, w) sizes."""
        device = packed.pixels.device if packed.pixels.numel() else packed.boxes.device
        jpeg_rows = [i for i, m in enumerate(packed.meta) if m[0] == JPEG]
        blobs = [packed.jpegs[m[1]:m[1] + m[2]] for m in packed.meta[jpeg_rows]]
        decoded = dict(zip(jpeg_rows, self.jpeg(blobs, device)))
        self.counts["jpeg"] += len(jpeg_rows)
        self.counts["region"] += len(packed) - len(jpeg_rows)
        parts = []
        for i, (kind, offset, length, h, w, _) in enumerate(packed.meta.tolist()):
            if kind == JPEG:
                top, left, ch, cw = packed.crops[i].tolist()
                image = decoded[i]
                ch, cw = min(ch, image.shape[1] - top), min(cw, image.shape[2] - left)
                parts.append(image[:, top:top + ch, left:left + cw])
            else:
                parts.append(packed.pixels[offset:offset + length].view(h, w, 3).permute(2, 0, 1))
        hm, wm = max(p.shape[1] for p in parts), max(p.shape[2] for p in parts)
        regions = torch.zeros(len(parts), 3, hm, wm, dtype=torch.float32, device=device)
        for i, part in enumerate(parts):
            regions[i, :, :part.shape[1], :part.shape[2]] = part
        sizes = np.array([[p.shape[1], p.shape[2]] for p in parts], dtype=np.int64).reshape(-1, 2)
        return regions, host_to_device(sizes, device)


def host_to_device(array: np.ndarray, device) -> torch.Tensor:
    """A small host array on ``device`` without a device sync: through pinned memory with a
    non-blocking copy on CUDA (a pageable copy waits for the stream), as is on CPU."""
    tensor = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
