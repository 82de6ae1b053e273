"""The crop-first JPEG decode (default train path) draws the same crop boxes as the plain
transform and resamples them to nearly the same pixels (bench/augment_equivalence.py has the
full measurement)."""

import io
import math

import numpy as np
import open_clip
import pytest
import torch
from dp_helpers import tokenize, write_sizes, write_tar
from PIL import Image, ImageDraw
from torchvision.transforms import Compose, RandomResizedCrop

from vlp.data import worker
from vlp.data.decode import CropFirst, PlainDecoder, dct_scale, image_decoder
from loaders import make_loader

TRAIN = open_clip.image_transform(224, is_train=True)


def encode(image, fmt="JPEG", **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}), **options)
    return buf.getvalue()


def photo_like(width: int, height: int, seed: int, mode: str = "RGB", **options) -> bytes:
    """Smooth random colour field + noise (photo-like entropy), JPEG q90."""
    rng = np.random.default_rng(seed)
    low = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8))
    smooth = np.asarray(low.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    noisy = np.clip(smooth + rng.standard_normal(smooth.shape, dtype=np.float32) * 8, 0, 255)
    return encode(Image.fromarray(noisy.astype(np.uint8)).convert(mode), **options)


def shapes(size: int, seed: int) -> bytes:
    """Hard edges on white (glyph-like: the hard case for a DCT-domain downscale)."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = (int(v) for v in rng.integers(0, size // 2, 2))
        x1, y1 = (int(v) for v in rng.integers(40, size // 2, 2) + (x0, y0))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.ellipse((x0, y0, x1, y1), fill=fill, outline="black", width=int(rng.integers(2, 9)))
    return encode(image)


def plain_and_fast(data: bytes, seed: int, transform=TRAIN):
    """(plain output, RNG state after, fast output, RNG state after, fast's decoded tuple)."""
    plain, fast = PlainDecoder(transform), CropFirst.of(transform)
    torch.manual_seed(seed)
    a = plain.finish(plain.decode(data))
    state_a = torch.get_rng_state()
    torch.manual_seed(seed)
    decoded = fast.decode(data)
    b = fast.finish(decoded)
    return a, state_a, b, torch.get_rng_state(), decoded


def test_dct_scale_is_the_largest_that_keeps_the_box_at_or_above_the_output():
    assert dct_scale(460, 470, 224, 224) == 2
    assert dct_scale(447, 1000, 224, 224) == 1
    assert dct_scale(1792, 1800, 224, 224) == 8
    assert dct_scale(1791, 1800, 224, 224) == 4
    assert dct_scale(100, 100, 224, 224) == 1
    assert dct_scale(300, 700, 64, 160) == 4  # non-square output: each side against its own


SIZES = [((256, 256), "RGB", {}), ((512, 512), "RGB", {}), ((800, 600), "RGB", {}),
         ((600, 1100), "RGB", {}), ((1000, 1000), "L", {}), ((700, 500), "CMYK", {}),
         ((900, 700), "RGB", {"progressive": True}), ((640, 640), "RGB", {"subsampling": 0})]


@pytest.mark.parametrize("size,mode,options", SIZES)
def test_same_crop_boxes_and_rng_as_the_plain_transform(size, mode, options):
    """(a) exact: the box is get_params on the fully decoded image under the same seed, and the
    whole transform leaves the torch RNG in the same state."""
    data = photo_like(*size, seed=size[0], mode=mode, **options)
    crop = TRAIN.transforms[0]
    for seed in range(5):
        torch.manual_seed(seed)
        full = Image.open(io.BytesIO(data)).convert("RGB")
        expected = crop.get_params(full, crop.scale, crop.ratio)
        _, state_a, out, state_b, decoded = plain_and_fast(data, seed)
        assert decoded[2] == expected
        assert torch.equal(state_a, state_b)
        assert out.shape == (3, 224, 224)
        s = decoded[1]
        assert decoded[0].size == (math.ceil(size[0] / s), math.ceil(size[1] / s))
        assert expected[2] >= s * 224 and expected[3] >= s * 224  # the box stays >= 224 px


def test_scales_used_by_source_size():
    scales = {size: plain_and_fast(photo_like(*size, seed=1), 0)[4][1]
              for size in [(300, 300), (512, 512), (1100, 1100), (2100, 2100)]}
    assert scales == {(300, 300): 1, (512, 512): 2, (1100, 1100): 4, (2100, 2100): 8}


@pytest.mark.parametrize("size", [(256, 256), (384, 288)])
def test_scale_one_is_bit_identical(size):
    data = photo_like(*size, seed=3)
    for seed in range(3):
        a, _, b, _, decoded = plain_and_fast(data, seed)
        assert decoded[1] == 1 and torch.equal(a, b)


def to_unit(x):
    norm = TRAIN.transforms[-1]
    return x * torch.tensor(norm.std).view(3, 1, 1) + torch.tensor(norm.mean).view(3, 1, 1)


@pytest.mark.parametrize("kind", ["photo_like", "shapes"])
def test_fast_pixels_close_to_the_plain_path(kind):
    """(b) loose bound: measured (bench/augment_equivalence.py) mean |d| 0.0015..0.005 and PSNR
    >= 35 dB; here mean |d| < 0.01 and PSNR > 30 dB in [0, 1] units."""
    for k, size in enumerate([512, 900]):
        data = photo_like(size, size, seed=k) if kind == "photo_like" else shapes(size, seed=k)
        a, _, b, _, decoded = plain_and_fast(data, seed=k)
        assert decoded[1] > 1
        diff = to_unit(a) - to_unit(b)
        psnr = 10 * math.log10(1 / float((diff ** 2).mean()))
        assert float(diff.abs().mean()) < 0.01 and psnr > 30, (size, float(diff.abs().mean()), psnr)


def test_failed_decode_consumes_no_randomness():
    data = photo_like(512, 512, seed=0)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(OSError):
        CropFirst.of(TRAIN).decode(data[: len(data) // 2])
    assert torch.equal(before, torch.get_rng_state())


def test_plain_path_for_non_jpeg_eval_subclasses_and_decode_size():
    png = encode(Image.open(io.BytesIO(photo_like(512, 400, seed=2))), "PNG")
    a, state_a, b, state_b, _ = plain_and_fast(png, seed=4)
    assert torch.equal(a, b) and torch.equal(state_a, state_b)
    assert isinstance(image_decoder(TRAIN), CropFirst)
    assert isinstance(image_decoder(RandomResizedCrop(32)), CropFirst)  # a bare crop
    assert isinstance(image_decoder(TRAIN, decode_size=224), PlainDecoder)  # the old downscale
    assert isinstance(image_decoder(open_clip.image_transform(224, is_train=False)), PlainDecoder)

    class MyCrop(RandomResizedCrop):
        pass

    assert isinstance(image_decoder(Compose([MyCrop(32)])), PlainDecoder)


@pytest.fixture(scope="module")
def mixed_jpegs(tmp_path_factory):
    """24 JPEG pairs: small sources (DCT scale 1 at output 64), large ones (scale 4), every 5th
    cut in half (only its decode fails)."""
    out = tmp_path_factory.mktemp("mixed")
    samples = []
    for i in range(24):
        data = photo_like(*((96, 128) if i % 2 else (320, 300)), seed=i)
        samples.append((f"m{i:03d}", {"jpg": data[: len(data) // 2] if i % 5 == 2 else data,
                                      "txt": f"caption {i}".encode()}))
    for s in range(2):
        write_tar(out / f"m-{s:06d}.tar", samples[s * 12:(s + 1) * 12])
    write_sizes(out, {f"m-{s:06d}.tar": 12 for s in range(2)})
    return str(out / "m-{000000..000001}.tar")


def test_stream_default_path_equals_plain_and_resumes_exactly(mixed_jpegs, monkeypatch):
    """Through make_loader: the same samples replaced, the same keys, scale-1 images bit-equal
    to the plain path (so a failed decode drew no randomness), scaled ones close; a resume that
    skips batches (probe path) yields the same batches."""
    small = open_clip.image_transform(64, is_train=True)
    kwargs = dict(batch_size=4, transform=small, tokenize=tokenize, seed=1, shuffle_buffer=8)
    fast_loader = make_loader(mixed_jpegs, **kwargs)
    fast = list(fast_loader)
    assert len(fast) == 6 and fast_loader.stats["corrupt_image"] > 0
    for start in (2, 5):
        resumed = list(make_loader(mixed_jpegs, start_batch=start, **kwargs))
        assert [b["key"] for b in resumed] == [b["key"] for b in fast[start:]]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(fast[start:], resumed))
    monkeypatch.setattr(worker, "image_decoder", lambda t, d, o="float": PlainDecoder(t, d))
    plain = list(make_loader(mixed_jpegs, **kwargs))
    assert [b["key"] for b in plain] == [b["key"] for b in fast]
    for a, b in zip(plain, fast):
        for key, x, y in zip(a["key"], a["image"], b["image"]):
            if int(key[1:]) % 2:  # 96x128 source: DCT scale 1
                assert torch.equal(x, y)
            else:
                assert 0 < float((x - y).abs().mean()) < 0.05  # normalized units (~0.0135 in [0, 1])
