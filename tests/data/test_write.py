"""Shard writer: exact round trip, atomic names, sizes.json, bad rows counted."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from vlp.data.sources import Pair
from vlp.data.shard_list import expand_sources, sizes_from_spec
from vlp.data.write import shard_spec, spec_for, write_shards


def _read_all(paths):
    samples = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    return samples


def test_round_trip_exact(small_pairs, tmp_path):
    summary = write_shards(small_pairs, tmp_path, samples_per_shard=16)
    assert list(summary.sizes.values()) == [16, 16, 16, 2]
    assert summary.num_samples == 50 and summary.skipped == {}
    assert summary.spec == f"{tmp_path}/shard-{{000000..000003}}.tar"
    assert shard_spec(tmp_path) == summary.spec
    assert json.loads((tmp_path / "sizes.json").read_text()) == summary.sizes
    assert sizes_from_spec(summary.spec) == 50
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    samples = _read_all(expand_sources(summary.spec)[0])
    assert list(samples) == [p.key for p in small_pairs]
    for pair in small_pairs:
        got = samples[pair.key]
        assert got["txt"].decode() == pair.caption
        assert json.loads(got["json"]) == pair.meta
        assert got["png"] == pair.image
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(got["png"]))),
                              np.asarray(Image.open(io.BytesIO(pair.image))))


def test_jpeg_resize_and_bad_rows(small_pairs, tmp_path):
    rows = list(small_pairs[:10])
    rows.append(Pair("broken", b"not an image", "a caption"))
    rows.append(Pair("nocaption", small_pairs[0].image, "  "))
    rows.append({"key": "asdict", "image": small_pairs[1].image, "caption": "dict row"})
    summary = write_shards(rows, tmp_path, image_ext="jpg", jpeg_quality=80,
                           resize_longest=32)
    assert summary.num_samples == 11
    assert summary.skipped == {"corrupt_image": 1, "missing_caption": 1}
    samples = _read_all(summary.shards)
    assert "broken" not in samples and "asdict" in samples
    image = Image.open(io.BytesIO(samples["asdict"]["jpg"]))
    assert image.format == "JPEG" and image.size == (32, 32)


def test_rewrite_removes_stale_shards(small_pairs, tmp_path):
    write_shards(small_pairs, tmp_path, samples_per_shard=10)
    summary = write_shards(small_pairs[:15], tmp_path, samples_per_shard=10, overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == list(summary.sizes)
    assert sizes_from_spec(str(tmp_path)) == 15


def test_spec_for_and_bad_key():
    assert spec_for(["/a/x-000003.tar", "/a/x-000004.tar"]) == "/a/x-{000003..000004}.tar"
    assert spec_for(["/a/x.tar", "/b/y.tar"]) == "/a/x.tar::/b/y.tar"
    with pytest.raises(ValueError):
        Pair("has.dot", b"", "c")


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path):
    """A 16-bit greyscale PNG (PIL mode I;16) re-encoded by the writer keeps its tones: scaled to
    8 bits (convert('RGB') alone would clip nearly every pixel to white)."""
    wide = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0..65520
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, format="PNG")
    summary = write_shards([Pair("grey", buf.getvalue(), "a grey ramp")], tmp_path, image_ext="jpg")  # re-encoded
    sample = _read_all(sorted(tmp_path.glob("*.tar")))["grey"]
    ext = next(e for e in sample if e in ("png", "jpg"))
    got = np.asarray(Image.open(io.BytesIO(sample[ext])).convert("L"), dtype=np.float64)
    assert summary.sizes and abs(got.mean() - 127.5) < 2.0 and got.min() <= 2 and got.max() >= 252
