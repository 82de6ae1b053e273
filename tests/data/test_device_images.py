"""uint8 batches (vlp/data/device.py): the workers ship uint8, the device finishes the transform.

Tolerances: 'uint8' is bit-identical to the worker's float path (the same float ops); 'region'
resamples on the device with PIL's filter in float and PIL's 8-bit rounding: at most 1 uint8
level from PIL's fixed-point resize (1/255/std in normalised units), on < 1 % of the values;
'jpeg' decodes with another decoder (torchvision's libjpeg-turbo here, nvjpeg on CUDA) than PIL:
at most 6 levels, mean < 0.5 level. The crop boxes come from the same RNG draws, so resume stays
exact."""

import io

import numpy as np
import open_clip
import pytest
import torch
from dp_helpers import tokenize, write_sizes, write_tar
from PIL import Image
from test_decode import encode, photo_like
from torchvision.io import decode_jpeg

from vlp.data.decode import PlainDecoder, collate_images, image_decoder, split_tail
from vlp.data.device import JPEG, PIXELS, DeviceImages, JpegDecoder, PackedImages, resample
from loaders import make_loader

SMALL = open_clip.image_transform(64, is_train=True)
STD = torch.tensor(SMALL.transforms[-1].std).view(1, 3, 1, 1)
LEVEL = float(1 / 255 / STD.min()) + 1e-6  # one uint8 level in normalised units


def cpu_batched(blobs, device):
    """The batched decoder's contract, on CPU (torchvision's libjpeg-turbo decode)."""
    return [decode_jpeg(b).to(device) for b in blobs]


def finish_on_device(loader_batch, decoder, jpeg=None):
    device_part = decoder.device_part()
    if jpeg is not None:
        device_part.jpeg = jpeg
    return device_part(loader_batch["image"]) if device_part else loader_batch["image"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """20 pairs: JPEGs of several sizes, a PNG, a CMYK JPEG, a greyscale JPEG, one cut JPEG."""
    out = tmp_path_factory.mktemp("mixed_dev")
    samples = []
    for i in range(20):
        size = ((96, 128), (320, 300), (700, 520))[i % 3]
        data = photo_like(*size, seed=i)
        if i == 4:
            data = encode(Image.open(io.BytesIO(data)), "PNG")
        elif i == 7:
            data = photo_like(*size, seed=i, mode="CMYK")
        elif i == 10:
            data = photo_like(*size, seed=i, mode="L")
        elif i == 13:
            data = data[: len(data) // 2]
        samples.append((f"d{i:03d}", {"jpg": data, "txt": f"caption {i}".encode()}))
    for s in range(2):
        write_tar(out / f"d-{s:06d}.tar", samples[s * 10:(s + 1) * 10])
    write_sizes(out, {f"d-{s:06d}.tar": 10 for s in range(2)})
    return str(out / "d-{000000..000001}.tar")


def loader(spec, output, **kw):
    return make_loader(spec, batch_size=4, transform=SMALL, tokenize=tokenize, seed=3, shuffle_buffer=6,
                       image_output=output, **kw)


def test_uint8_batches_are_bit_identical_to_the_float_path_and_resume(mixed):
    floats = list(loader(mixed, "float"))
    batches = list(loader(mixed, "uint8"))
    decoder = image_decoder(SMALL, None, "uint8")
    assert decoder.output == "uint8" and batches[0]["image"].dtype == torch.uint8
    assert batches[0]["image"].shape == (4, 64, 64, 3)  # a quarter of the float bytes
    assert [b["key"] for b in batches] == [b["key"] for b in floats]
    for a, b in zip(floats, batches):
        assert torch.equal(a["image"], finish_on_device(b, decoder))
    resumed = list(loader(mixed, "uint8", start_batch=2))
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(batches[2:], resumed))


@pytest.mark.parametrize("output", ["region", "jpeg"])
def test_device_resize_within_one_level_of_the_worker_path(mixed, output):
    """Same keys (same replacements of the cut JPEG), same boxes; 'region' against the crop-first
    float path, 'jpeg' (full decode on the 'device') against the plain path's full decode."""
    reference = "float" if output == "region" else "plain"
    if reference == "plain":  # the whole image decoded, then the transform: what nvjpeg sees
        from vlp.data import worker

        mp = pytest.MonkeyPatch()
        mp.setattr(worker, "image_decoder", lambda t, d, o="float": PlainDecoder(t, d))
        floats = list(loader(mixed, "float"))
        mp.undo()
    else:
        floats = list(loader(mixed, "float"))
    jpeg = JpegDecoder(batched=cpu_batched)
    decoder = image_decoder(SMALL, None, output)
    assert decoder.output == output
    batches = list(loader(mixed, output))
    assert [b["key"] for b in batches] == [b["key"] for b in floats]
    diffs = []
    for a, b in zip(floats, batches):
        assert isinstance(b["image"], PackedImages)
        got = finish_on_device(b, decoder, jpeg)
        assert got.shape == a["image"].shape
        diffs.append((got - a["image"]).abs())
    diff = torch.cat(diffs) / LEVEL  # in uint8 levels (at most)
    if output == "region":  # the same decoded pixels: only the resize's rounding differs
        assert float(diff.max()) <= 1 and float((diff > 1e-4).float().mean()) < 0.01, float(diff.max())
    else:  # another JPEG decoder (libjpeg-turbo here, nvjpeg on CUDA) than PIL's: its own rounding
        assert float(diff.max()) <= 6 and float(diff.mean()) < 0.5, (float(diff.max()), float(diff.mean()))
    if output == "jpeg":  # the PNG and the CMYK JPEG came decoded by the worker, the rest as bytes
        kinds = np.concatenate([b["image"].meta[:, 0] for b in batches])
        keys = sum((b["key"] for b in batches), [])
        worker = {k for k, kind in zip(keys, kinds) if kind == PIXELS}
        assert worker == {"d004", "d007"} & set(keys) and jpeg.counts["device"] == len(keys) - len(worker)
    resumed = list(loader(mixed, output, start_batch=3))
    for a, b in zip(batches[3:], resumed):
        assert torch.equal(finish_on_device(a, decoder, jpeg), finish_on_device(b, decoder, jpeg))


def test_batched_decoder_fallback_is_per_sample_and_counted():
    blobs = [torch.frombuffer(bytearray(photo_like(40 + 8 * i, 48, seed=i)), dtype=torch.uint8) for i in range(5)]
    refused = {2, 4}
    calls = []

    def picky(batch, device):  # refuses the whole call if it holds a refused sample (as nvjpeg does)
        calls.append(len(batch))
        if any(int(b.numel()) in {int(blobs[i].numel()) for i in refused} for b in batch):
            raise RuntimeError("nvjpeg: unsupported")
        return cpu_batched(batch, device)

    jpeg = JpegDecoder(batched=picky)
    out = jpeg(blobs, torch.device("cpu"))
    assert calls == [5, 1, 1, 1, 1, 1]  # one batched call, then one per sample
    assert jpeg.counts == {"device": 3, "cpu_fallback": 2}
    for blob, image in zip(blobs, out):
        assert torch.equal(image, decode_jpeg(blob)) or float((image.float() - decode_jpeg(blob).float()).abs().mean()) < 2
    bad = JpegDecoder(batched=picky, cpu=lambda b: (_ for _ in ()).throw(OSError("bad")))
    bad([blobs[2]], "cpu")
    assert bad.counts["undecodable"] == 1


def test_resample_matches_pil_within_one_level():
    rng = np.random.default_rng(0)
    for h, w, box, out in [(300, 280, (3.5, 7.25, 270.5, 290.0), (64, 64)), (90, 120, (10, 5, 90, 85), (112, 100)),
                           (64, 64, (0, 0, 64, 64), (64, 64))]:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ref = np.asarray(Image.fromarray(pixels).resize((out[1], out[0]), Image.BICUBIC, box=box)).astype(int)
        region = torch.zeros(1, 3, h + 7, w + 5)  # padding past the region must not leak in
        region[0, :, :h, :w] = torch.from_numpy(pixels).permute(2, 0, 1).float()
        got = resample(region, torch.tensor([[h, w]]), torch.tensor([box], dtype=torch.float64), out)
        d = np.abs(got[0].permute(1, 2, 0).numpy().astype(int) - ref)
        assert d.max() <= 1 and (d > 0).mean() < 0.01, (d.max(), (d > 0).mean())
    identity = resample(region, torch.tensor([[64, 64]]), torch.tensor([[0.0, 0, 64, 64]], dtype=torch.float64),
                        (64, 64))
    assert torch.equal(identity[0], region[0, :, :64, :64])


def test_pack_keeps_offsets_on_the_host():
    a = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    blob = photo_like(16, 16, seed=0)
    packed = PackedImages.pack([(PIXELS, a, None, (0.0, 0.0, 3.0, 2.0)), (JPEG, blob, (1, 2, 8, 9), (0.0, 0.0, 9.0, 8.0))])
    assert isinstance(packed.meta, np.ndarray) and packed.meta.tolist()[0] == [PIXELS, 0, 18, 2, 3, 0]
    assert packed.jpegs.numel() == len(blob) and packed.pixels.numel() == 18
    assert packed.crops.tolist()[1] == [1, 2, 8, 9] and len(packed) == 2
    moved = packed.to("cpu", non_blocking=True)
    assert torch.equal(moved.pixels, packed.pixels) and moved.meta is packed.meta
    assert isinstance(collate_images([(PIXELS, a, None, (0.0, 0.0, 3.0, 2.0))]), PackedImages)


def test_split_and_outputs_by_transform():
    assert split_tail(SMALL)[1:] == (tuple(SMALL.transforms[-1].mean), tuple(SMALL.transforms[-1].std))
    eval_tf = open_clip.image_transform(64, is_train=False)
    assert image_decoder(eval_tf, None, "region").output == "uint8"  # resize+centre crop stay in the worker
    assert image_decoder(SMALL, 48, "jpeg").output == "uint8"  # decode_size: the plain path
    assert image_decoder(lambda im: im, None, "uint8").output == "float"  # nothing to split
    assert image_decoder(SMALL, None, "float").device_part() is None
    with pytest.raises(ValueError, match="image output"):
        image_decoder(SMALL, None, "png")
    with pytest.raises(ValueError, match="zero"):
        DeviceImages((0.5,) * 3, (0.2, 0.0, 0.2))
    x = torch.rand(2, 3, 8, 8)
    assert DeviceImages((0.5,) * 3, (0.2,) * 3)(x) is x  # float batches pass through
