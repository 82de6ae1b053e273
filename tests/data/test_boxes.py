"""vlp.data.boxes: RandomResizedCrop's boxes from a Python replay of torch's generator, bit for bit."""

import random

import numpy as np
import pytest
import torch
from test_decode import TRAIN, photo_like
from torchvision.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

from vlp.data.boxes import BoxDraws, crop_box, f32, mt19937_state, probe, uniforms
from vlp.data.decode import CropFirst


def image_of(size):
    """What get_params reads of an image: its size (a 0-stride tensor of that size)."""
    width, height = size
    return torch.empty(1, 1, 1).expand(1, height, width)


@pytest.mark.parametrize("scale", [(0.08, 1.0), (0.9, 1.0), (0.5, 0.5)])
def test_boxes_and_generator_equal_torch(scale):
    ratio = (3 / 4, 4 / 3)
    form = probe(scale, ratio)
    assert form in ("fma", "plain")
    rng = random.Random(1)
    for _ in range(8):
        seed = rng.getrandbits(63)
        sizes = [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(30)] + [(4000, 90), (90, 4000)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            want = [RandomResizedCrop.get_params(image_of(size), scale, ratio) for size in sizes]
            after = torch.randint(0, 10**6, (1,)).item()
        draws = BoxDraws(seed, form, scale, ratio)
        assert [crop_box(draws, *size) for size in sizes] == want
        assert draws.randint(10**6) == after  # the generator is where get_params left it


def test_uniforms_are_torchs_float32_draws():
    state = mt19937_state(7)
    rng = random.Random()
    rng.setstate(state)
    raw = np.array([rng.getrandbits(32) for _ in range(3000)], dtype=np.uint32)
    lo, hi = torch.log(torch.tensor((3 / 4, 4 / 3))).tolist()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        want = [torch.empty(1).uniform_(lo, hi).item() for _ in range(3000)]
    assert uniforms(raw, lo, hi, probe((0.08, 1.0), (3 / 4, 4 / 3))).tolist() == want
    assert f32(0.1) == torch.tensor(0.1).item()


def test_crop_first_replays_only_when_nothing_else_draws():
    fast = CropFirst.of(TRAIN)
    fast.use_seed(5)
    assert fast.draws is not None
    flipping = CropFirst.of(Compose([RandomResizedCrop(64), RandomHorizontalFlip(), *TRAIN.transforms[1:]]))
    flipping.use_seed(5)
    assert flipping.draws is None  # the flip draws from torch too: boxes from get_params


def test_replayed_stream_equals_torchs_and_a_failed_decode_draws_nothing():
    data = [photo_like(512, 384, seed=k) for k in range(6)]
    data.insert(2, data[0][: len(data[0]) // 2])  # cut short: fails to decode
    seed = 2**62 + 3
    replayed = CropFirst.of(TRAIN)
    replayed.use_seed(seed)
    plain = CropFirst.of(TRAIN)  # draws with get_params from torch's generator
    torch.manual_seed(seed)
    for blob in data:
        try:
            a = replayed.decode(blob)
        except OSError:
            with pytest.raises(OSError):
                plain.decode(blob)
            continue
        b = plain.decode(blob)
        assert a[1:] == b[1:] and torch.equal(replayed.finish(a), plain.finish(b))
