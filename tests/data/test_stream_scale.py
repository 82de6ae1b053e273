"""Stream at scale: injected faults counted exactly, weighted resampling frequencies,
ranks x workers over uneven shards, fast JPEG draft decode."""

from __future__ import annotations

import tarfile
from collections import Counter

import pytest
import torch

from vlp.data.sources import synthetic
from loaders import make_loader
from vlp.data.tars import read_shard
from vlp.data.write import write_shards
from dp_helpers import jpeg_bytes, png_bytes, to_tensor, tokenize, write_sizes, write_tar


def loader(spec, **kwargs):
    return make_loader(spec, transform=kwargs.pop("transform", to_tensor), tokenize=tokenize,
                       **kwargs)


def keys_of(batches):
    return [k for b in batches for k in b["key"]]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """5 shards x 100 JPEG samples; 5 corrupt JPEGs (1%), 5 without caption (1%), and
    shard 3 cut inside sample 60's image (60 good samples survive, 40 are lost)."""
    root = tmp_path_factory.mktemp("faulty")
    corrupt = {(0, 10), (1, 20), (2, 30), (4, 40), (4, 99)}
    no_caption = {(0, 50), (1, 5), (2, 77), (3, 3), (4, 0)}
    expected = []
    for shard in range(5):
        samples = []
        for i in range(100):
            key, image = f"s{shard}_{i:03d}", jpeg_bytes(shard * 100 + i)
            members = {"jpg": image, "txt": f"caption {shard} {i}".encode()}
            if (shard, i) in corrupt:
                members["jpg"] = image[: len(image) // 2] if i % 2 else b"\xff\xd8\xff" + b"x" * 50
            if (shard, i) in no_caption:
                del members["txt"]
            if (shard, i) not in corrupt | no_caption and not (shard == 3 and i >= 60):
                expected.append(key)
            samples.append((key, members))
        write_tar(root / f"f-{shard:06d}.tar", samples)
    path = root / "f-000003.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmember("s3_060.jpg").offset_data + 10
    path.write_bytes(path.read_bytes()[:cut])
    write_sizes(root, {f"f-{s:06d}.tar": 100 for s in range(5)})
    return str(root / "f-{000000..000004}.tar"), expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_injected_faults_are_counted_exactly(faulty, num_workers):
    spec, expected = faulty
    run = loader(spec, batch_size=16, mode="sequential", num_workers=num_workers)
    batches = list(run)
    assert keys_of(batches) == expected
    assert run.stats == {"corrupt_image": 5, "missing_caption": 5, "bad_member": 1}
    total = Counter()
    for batch in batches:
        total.update(batch["skipped"])
    assert total == run.stats


def test_faults_in_split_mode_never_reach_a_batch(faulty):
    spec, expected = faulty
    runs = [loader(spec, batch_size=16, rank=r, world_size=2, num_workers=2) for r in range(2)]
    batches = [list(run) for run in runs]
    assert [len(b) for b in batches] == [15, 15]  # 500 // 32
    assert set(keys_of(batches[0] + batches[1])) <= set(expected)
    for kind in ("corrupt_image", "missing_caption"):
        assert sum(run.stats[kind] for run in runs) >= 1


def test_truncated_tar_at_member_boundary(tmp_path):
    samples = [(f"k{i}", {"png": png_bytes(i), "txt": b"c"}) for i in range(4)]
    path = write_tar(tmp_path / "t.tar", samples)
    with tarfile.open(path) as tar:
        cut = tar.getmember("k2.txt").offset  # header of k2's caption: k2 is incomplete
    path.write_bytes(path.read_bytes()[:cut])
    skipped = Counter()
    got = [key for _, key, _ in read_shard(str(path), 0, None, skipped)]
    assert got == ["k0", "k1"] and skipped == {"bad_member": 1}
    (tmp_path / "empty.tar").write_bytes(b"")
    skipped = Counter()
    assert list(read_shard(str(tmp_path / "empty.tar"), 0, None, skipped)) == []
    assert skipped == {"bad_shard": 1}


@pytest.fixture(scope="module")
def two_tars(tmp_path_factory):
    """open_clip's test layout: 000.tar with 10 samples, 001.tar with 5 (no sizes.json)."""
    root = tmp_path_factory.mktemp("two")
    for idx, count in ((0, 10), (1, 5)):
        write_tar(root / f"test_data_{idx:03d}.tar",
                  [(f"{i}", {"png": png_bytes(i), "txt": f"{idx:03d}_{i}".encode()})
                   for i in range(count)])
    return root


@pytest.mark.parametrize("weights", [None, "1::2"])
def test_resampled_weighted_frequencies(two_tars, weights):
    n = 10_000
    spec = f"{two_tars}/test_data_000.tar::{two_tars}/test_data_001.tar"
    captions = Counter()
    run = make_loader(spec, batch_size=100, mode="resampled", num_samples=n, weights=weights,
                      transform=lambda im: torch.zeros(1), tokenize=lambda caps: caps)
    for batch in run:
        captions.update(batch["text"])
    assert sum(captions.values()) == n and len(captions) == 15
    for caption, count in captions.items():
        if weights is None:
            want = n / 15
        else:
            want = n / 20 if caption.startswith("000") else n / 10
        assert count == pytest.approx(want, rel=0.2), (caption, count)


@pytest.mark.parametrize("per_shard", [9, 60])  # 12 uneven shards, or 2 < ranks x workers
def test_ranks_by_workers_equal_batches_no_duplicates(tmp_path, per_shard):
    spec = write_shards(synthetic.iter_pairs(103, image_size=16), tmp_path,
                        samples_per_shard=per_shard).spec
    runs = [[list(loader(spec, batch_size=5, rank=r, world_size=2, num_workers=2, epoch=e))
             for r in range(2)] for e in range(2)]
    for epoch in runs:
        assert [len(b) for b in epoch] == [10, 10]  # 103 // (5 * 2)
        keys = keys_of(epoch[0]) + keys_of(epoch[1])
        assert len(keys) == len(set(keys)) == 100
    assert keys_of(runs[0][0]) != keys_of(runs[1][0])


def test_split_without_drop_last_covers_everything(tmp_path):
    spec = write_shards(synthetic.iter_pairs(23, image_size=16), tmp_path,
                        samples_per_shard=4).spec
    ranks = [list(loader(spec, batch_size=5, rank=r, world_size=2, drop_last=False))
             for r in range(2)]
    assert [len(b) for b in ranks] == [3, 3]  # 12 samples per rank: 5 + 5 + 2
    assert [len(b["key"]) for b in ranks[0]] == [5, 5, 2]
    assert len(set(keys_of(ranks[0] + ranks[1]))) == 23  # one sample repeats as padding


def test_jpeg_draft_decode(tmp_path):
    pairs = synthetic.load_pairs(4, image_size=256, image_format="JPEG")
    spec = write_shards(pairs, tmp_path).spec
    size = lambda im: torch.tensor(im.size)  # noqa: E731
    full = next(iter(loader(spec, batch_size=4, transform=size)))["image"]
    fast = next(iter(loader(spec, batch_size=4, transform=size, decode_size=64)))["image"]
    assert (full == 256).all() and (fast == 64).all()
    medium = next(iter(loader(spec, batch_size=4, transform=size, decode_size=100)))["image"]
    assert (medium == 128).all()  # DCT scaling keeps both sides >= decode_size
