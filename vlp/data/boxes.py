"""RandomResizedCrop's boxes without torch ops: torch's CPU generator replayed in Python
(docs/data-path.md, "Crop boxes without torch ops"). torch's mt19937 seeded as
``torch.manual_seed`` seeds it is Python's Mersenne Twister with that state, and ``crop_box``
repeats get_params' arithmetic on its draws:

  uniform_(lo, hi) on float32   u = (x & 0xFFFFFF) / 2**24,  u * (hi - lo) + lo  in float32,
                                with one rounding (a fused multiply-add) or two, as torch's
                                build computes it
  randint(0, n)                 x % n
  exp of a float32              torch's own exp, on one element (the only torch op left)

So the boxes and the draws consumed are get_params' bit for bit. ``probe`` checks the replay
against torch once per process and turns it off when neither float32 form reproduces torch.
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

_PACK32 = struct.Struct("f")


def f32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even), as a Python float."""
    return _PACK32.unpack(_PACK32.pack(x))[0]


def mt19937_state(seed: int) -> tuple:
    """Python ``random.Random`` state equal to torch's CPU generator after ``manual_seed(seed)``
    (torch keeps the seed's low 32 bits; the state is regenerated before the first draw)."""
    s = seed & 0xFFFFFFFF
    words = [s]
    for j in range(1, 624):
        s = (1812433253 * (s ^ (s >> 30)) + j) & 0xFFFFFFFF
        words.append(s)
    return 3, tuple(words) + (624,), None


def _fused(u: float, d: float, lo: float) -> float:
    """float32 fma(u, d, lo): u * d is exact in a double (24-bit operands); the sum rounds to a
    double and then to float32, which is the single rounding unless the double lands exactly
    halfway between two float32s: then the exact sum decides the side."""
    p = u * d
    r = p + lo
    exact = Fraction(p) + Fraction(lo)
    if exact != Fraction(r):
        r = math.nextafter(r, math.inf if exact > r else -math.inf)
    return f32(r)


def uniforms(raw: np.ndarray, lo: float, hi: float, form: str) -> np.ndarray:
    """float32 ``uniform_(lo, hi)`` of each raw 32-bit draw (torch's formula, ``form``)."""
    lo, d = f32(lo), f32(f32(hi) - f32(lo))
    u = (raw & 0xFFFFFF).astype(np.float64) * 2.0 ** -24
    if form == "plain":  # float32 u * d, then + lo (each rounding innocuous through a double)
        return ((u * d).astype(np.float32).astype(np.float64) + lo).astype(np.float32)
    r = u * d + lo  # u * d exact in a double; the sum rounds once here, once to float32 below
    out = r.astype(np.float32)
    m, _ = np.frexp(r)
    for k in np.flatnonzero((r != 0) & ((m * 2.0 ** 25) % 2 == 1)):  # halfway: the exact sum
        out[k] = _fused(float(u[k]), d, lo)
    return out


FORMS = ("fma", "plain")


class BoxDraws:
    """torch's CPU generator after ``manual_seed(seed)``, as get_params reads it: the raw
    draws in blocks, and per position the uniform over ``scale``, and the exp of the uniform
    over log(``ratio``) (torch's exp, on a block at once: the same float32 as on one element).
    ``pos`` is the next draw; setting it back undoes draws."""

    BLOCK = 256  # a batch of 32 images takes ~130 draws

    def __init__(self, seed: int, form: str, scale, ratio):
        self.rng = random.Random()
        self.rng.setstate(mt19937_state(seed))
        self.form, self.scale, self.ratio = form, tuple(scale), tuple(ratio)
        self.log_ratio = log_ratio(self.ratio)
        self.raw: list[int] = []
        self.area: list[float] = []
        self.aspect: list[float] = []
        self.pos = 0

    def _more(self) -> None:
        raw = np.frombuffer(self.rng.getrandbits(32 * self.BLOCK).to_bytes(4 * self.BLOCK, "little"),
                            dtype=np.uint32)
        log_u = torch.from_numpy(uniforms(raw, *self.log_ratio, self.form))
        self.raw += raw.tolist()
        self.area += uniforms(raw, *self.scale, self.form).tolist()
        self.aspect += torch.exp(log_u).tolist()

    def take(self) -> int:
        while self.pos >= len(self.raw):
            self._more()
        self.pos += 1
        return self.pos - 1

    def randint(self, n: int) -> int:
        """torch.randint(0, n, (1,)).item() for n < 2**32."""
        return self.raw[self.take()] % n


@lru_cache(maxsize=None)
def log_ratio(ratio: tuple[float, float]) -> tuple[float, float]:
    return tuple(torch.log(torch.tensor(ratio)).tolist())


def crop_box(draws: BoxDraws, width: int, height: int) -> tuple[int, int, int, int]:
    """RandomResizedCrop.get_params(image of width x height, draws.scale, draws.ratio)."""
    area = height * width
    for _ in range(10):
        target_area = area * draws.area[draws.take()]
        aspect_ratio = draws.aspect[draws.take()]
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = draws.randint(height - h + 1)
            j = draws.randint(width - w + 1)
            return i, j, h, w
    ratio = draws.ratio
    in_ratio = float(width) / float(height)  # get_params' fallback: a central crop
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


_PROBE_SIZES = [(512, 512), (640, 480), (333, 1000), (1920, 1080), (97, 31), (4000, 300)]


@lru_cache(maxsize=None)
def probe(scale: tuple[float, float], ratio: tuple[float, float]) -> Optional[str]:
    """The float32 form ('fma' or 'plain') whose replay gives torch's uniforms, get_params'
    boxes and torch's generator where get_params leaves it, for these scale and ratio; None
    when neither does (then the decoder calls get_params)."""
    from torchvision.transforms import RandomResizedCrop

    # get_params reads only an image's size: 0-stride tensors of these sizes
    images = [torch.empty(1, 1, 1).expand(1, h, w) for w, h in _PROBE_SIZES] * 20
    ranges = [tuple(scale), log_ratio(tuple(ratio))]
    for form in FORMS:
        same = True
        for seed in (0, 1, 2**40 + 12345):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                want = [torch.empty(1).uniform_(*ranges[k % 2]).item() for k in range(400)]
                want += [RandomResizedCrop.get_params(im, list(scale), list(ratio)) for im in images]
                want.append(torch.randint(0, 1000, (1,)).item())
                want += [torch.exp(torch.tensor([v])).item() for v in want[1:400:2]]  # one element
            rng = random.Random()
            rng.setstate(mt19937_state(seed))
            raw = np.array([rng.getrandbits(32) for _ in range(400)], dtype=np.uint32)
            got = [float(uniforms(raw[k:k + 1], *ranges[k % 2], form)[0]) for k in range(400)]
            draws = BoxDraws(seed, form, scale, ratio)
            draws.pos = 400
            got += [crop_box(draws, im.shape[2], im.shape[1]) for im in images] + [draws.randint(1000)]
            got += torch.exp(torch.tensor(got[1:400:2])).tolist()  # a block at once, as BoxDraws
            same = same and got == want
        if same:
            return form
    return None
