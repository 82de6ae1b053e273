"""Streaming loader: shapes, determinism, equal batches per rank, resume, skipped samples."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from loaders import make_loader
from vlp.data.write import write_shards
from vlp_testing import noise_jpeg
from dp_helpers import png_bytes, to_tensor, tokenize, write_sizes, write_tar


@pytest.fixture(scope="module")
def uneven(small_pairs, tmp_path_factory):
    """50 samples in shards of 7 (7,7,7,7,7,7,7,1): uneven shards."""
    out = tmp_path_factory.mktemp("uneven")
    return write_shards(small_pairs, out, samples_per_shard=7).spec


def loader(spec, **kwargs):
    kwargs.setdefault("batch_size", 4)
    return make_loader(spec, transform=to_tensor, tokenize=tokenize, **kwargs)


def keys_of(batches):
    return [k for b in batches for k in b["key"]]


def test_sample_ids_are_stable_across_layouts(uneven):
    """sample_id (SogCLR's state index) is the position in the shard list: the same id for the
    same key under any world size, worker count, epoch or mode; unique within a split epoch."""
    def ids(**kw):
        world = kw.pop("world_size", 1)
        out = {}
        for rank in range(world):
            ld = loader(uneven, rank=rank, world_size=world, **kw)
            for epoch in range(2):
                ld.set_epoch(epoch)
                for b in ld:
                    assert b["sample_id"].shape == (len(b["key"]),)
                    for k, i in zip(b["key"], b["sample_id"].tolist()):
                        assert out.setdefault(k, i) == i
        return out

    one = ids()
    assert sorted(one.values()) == list(range(50))  # two epochs of 48 out of 50 see every sample
    epoch_ids = [i for b in loader(uneven) for i in b["sample_id"].tolist()]
    assert len(set(epoch_ids)) == len(epoch_ids)
    for kw in ({"world_size": 2}, {"num_workers": 2}, {"mode": "resampled"}):
        other = ids(**kw)
        assert all(one.get(k, i) == i for k, i in other.items())


def test_batch_shapes(uneven):
    batches = list(loader(uneven))
    assert len(batches) == 12  # 50 // 4
    batch = batches[0]
    assert set(batch) == {"image", "text", "key", "skipped", "sample_id"}
    assert batch["image"].shape == (4, 3, 64, 64) and batch["image"].dtype == torch.float32
    assert batch["text"].shape == (4, 8) and batch["text"].dtype == torch.long
    assert len(batch["key"]) == 4 and batch["skipped"] == {}


def test_deterministic_order(uneven):
    a = keys_of(loader(uneven, seed=3))
    assert a == keys_of(loader(uneven, seed=3))
    assert a != keys_of(loader(uneven, seed=4))
    other_epoch = loader(uneven, seed=3)
    other_epoch.set_epoch(1)
    assert keys_of(other_epoch) != a
    assert len(set(a)) == len(a) == 48


@pytest.mark.parametrize("mode", ["split", "resampled"])
def test_equal_batches_across_ranks(uneven, mode):
    per_rank = [list(loader(uneven, rank=r, world_size=2, mode=mode)) for r in range(2)]
    counts = [len(b) for b in per_rank]
    assert counts == [6, 6]  # 50 // (4 * 2)
    if mode == "split":
        keys = keys_of(per_rank[0]) + keys_of(per_rank[1])
        assert len(keys) == len(set(keys)) == 48


def test_sequential_keeps_every_sample_once_in_order(uneven, small_pairs):
    everything = [p.key for p in small_pairs]
    single = list(loader(uneven, mode="sequential", batch_size=8))
    assert keys_of(single) == everything
    assert [len(b["key"]) for b in single] == [8] * 6 + [2]
    ranks = [keys_of(loader(uneven, mode="sequential", batch_size=8, rank=r, world_size=2))
             for r in range(2)]
    assert ranks[0] + ranks[1] == everything


@pytest.mark.parametrize("num_workers", [0, 2])
def test_start_batch_resumes_exactly(uneven, num_workers):
    full = list(loader(uneven, seed=1, epoch=2, num_workers=num_workers))
    resumed = list(loader(uneven, seed=1, epoch=2, num_workers=num_workers, start_batch=5))
    assert len(resumed) == len(full) - 5
    for a, b in zip(full[5:], resumed):
        assert a["key"] == b["key"]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["text"], b["text"])


@pytest.mark.parametrize("num_workers,mode", [(0, "split"), (2, "split"), (3, "split"), (2, "resampled")])
def test_chained_epochs_equal_one_loader_per_epoch(uneven, num_workers, mode):
    """Loader.epochs (one set of workers for the whole run) yields exactly the batches of
    per-epoch iteration, in order, also when workers own unequal batch counts (7 batches
    of 7 over 2 or 3 workers) and when it starts mid-epoch or at an epoch's end."""
    make = lambda: loader(uneven, seed=5, batch_size=7, num_workers=num_workers, mode=mode)  # noqa: E731
    reference = []
    for epoch in range(3):
        one = make()
        one.set_epoch(epoch)
        reference += [(epoch, j, b) for j, b in enumerate(one)]
    assert len(reference) == 21

    def take(epoch, start, count):
        stream = make().epochs(epoch, start)
        out = [next(stream) for _ in range(count)]
        stream.close()
        return out

    for (epoch, start), offset in [((0, 0), 0), ((0, 5), 5), ((1, 2), 9), ((0, 7), 7)]:
        got = take(epoch, start, 21 - offset)
        for (e, j, ref), batch in zip(reference[offset:], got):
            assert (batch["epoch"], batch["index"]) == (e, j)
            assert batch["key"] == ref["key"] and torch.equal(batch["image"], ref["image"])
            assert torch.equal(batch["text"], ref["text"])


def test_chained_epochs_with_more_workers_than_batches(uneven):
    make = lambda: loader(uneven, seed=5, batch_size=20, num_workers=3)  # noqa: E731  (2 batches)
    stream = make().epochs()
    got = [(b["epoch"], b["index"], b["key"]) for b in (next(stream) for _ in range(6))]
    stream.close()
    expected = []
    for epoch in range(3):
        one = make()
        one.set_epoch(epoch)
        expected += [(epoch, j, b["key"]) for j, b in enumerate(one)]
    assert got == expected


def test_workers_match_across_runs_and_cover_rank(uneven):
    a = list(loader(uneven, num_workers=2, rank=1, world_size=2))
    b = list(loader(uneven, num_workers=2, rank=1, world_size=2))
    assert len(a) == 6 and keys_of(a) == keys_of(b)
    assert len(set(keys_of(a))) == 24


def test_corrupt_image_skipped_and_counted(tmp_path):
    samples = [(f"s{i:03d}", {"png": png_bytes(i), "txt": f"caption {i}".encode()})
               for i in range(20)]
    samples[7] = ("s007", {"png": b"\x89PNG garbage", "txt": b"broken"})
    write_tar(tmp_path / "a-000000.tar", samples)
    write_sizes(tmp_path, {"a-000000.tar": 20})
    run = loader(str(tmp_path / "a-000000.tar"), batch_size=4, mode="sequential")
    batches = list(run)
    keys = keys_of(batches)
    assert "s007" not in keys and len(keys) == 19
    assert sum(Counter(b["skipped"])["corrupt_image"] for b in batches) == 1
    assert run.stats == {"corrupt_image": 1}
    split = loader(str(tmp_path / "a-000000.tar"), batch_size=4)
    got = list(split)
    assert len(got) == 5 and split.stats["corrupt_image"] >= 1
    assert "s007" not in keys_of(got)


@pytest.fixture(scope="module")
def truncated_jpegs(tmp_path_factory):
    """40 JPEG pairs in 4 shards, every 5th image cut in half (header intact: only decoding
    finds it)."""
    out = tmp_path_factory.mktemp("truncated")
    samples = []
    for i in range(40):
        data = noise_jpeg(i)
        samples.append((f"j{i:03d}", {"jpg": data[: len(data) // 2] if i % 5 == 2 else data,
                                      "txt": f"caption {i}".encode()}))
    for s in range(4):
        write_tar(out / f"t-{s:06d}.tar", samples[s * 10:(s + 1) * 10])
    write_sizes(out, {f"t-{s:06d}.tar": 10 for s in range(4)})
    return str(out / "t-{000000..000003}.tar")


@pytest.mark.parametrize("mode", ["split", "resampled"])
def test_resume_is_exact_with_undecodable_images(truncated_jpegs, mode):
    """Truncated JPEGs are replaced by the stream's next sample when decoding fails; a resume
    that skips batches without decoding them makes the same replacements."""
    kwargs = dict(seed=2, epoch=1, batch_size=4, mode=mode, shuffle_buffer=8)
    full_loader = loader(truncated_jpegs, **kwargs)
    full = list(full_loader)
    assert len(full) == 10 and full_loader.stats["corrupt_image"] > 0
    assert all(int(k[1:]) % 5 != 2 for k in keys_of(full))
    for start in (1, 4, 7):
        resumed = list(loader(truncated_jpegs, start_batch=start, **kwargs))
        assert [b["key"] for b in resumed] == [b["key"] for b in full[start:]]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(full[start:], resumed))


def test_only_undecodable_images_is_an_error_not_a_hang(tmp_path):
    data = noise_jpeg(1)
    cut = data[: len(data) // 2]
    write_tar(tmp_path / "cut.tar", [(f"k{i}", {"jpg": cut, "txt": b"c"}) for i in range(6)])
    with pytest.raises(ValueError, match="failed to decode"):
        list(loader(str(tmp_path / "cut.tar"), batch_size=2))


def test_zero_valid_samples_names_what_it_found(tmp_path):
    write_tar(tmp_path / "x.tar", [("k1", {"jpeg2": b"a", "label": b"b"})])
    with pytest.raises(ValueError, match=r"k1.*jpeg2|jpeg2.*k1"):
        loader(str(tmp_path / "x.tar"), batch_size=1)


def test_missing_shard_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere-3.tar"):
        loader(str(tmp_path / "nothere-{1..3}.tar"))


def test_too_few_samples_is_a_clear_error(uneven):
    with pytest.raises(ValueError, match="cannot fill one batch"):
        loader(uneven, batch_size=40, world_size=2)


@pytest.mark.parametrize("mode", ["split", "sequential"])
def test_all_corrupt_is_an_error_not_a_hang(tmp_path, mode):
    write_tar(tmp_path / "bad.tar", [(f"k{i}", {"png": b"\x89PNG nope", "txt": b"c"})
                                     for i in range(3)])
    with pytest.raises(ValueError, match="no valid samples"):
        list(loader(str(tmp_path / "bad.tar"), batch_size=1, mode=mode))


@pytest.mark.parametrize("stop_after", [0, 3, 5])
def test_rest_of_epoch_continues_under_another_layout(uneven, stop_after):
    """2 ranks x 2 workers x batch 4 consume `stop_after` batches each; the rest of the epoch,
    read by 1 rank x 3 workers x batch 5, repeats no sample and leaves out fewer than one
    batch of what was left."""
    old = [loader(uneven, rank=r, world_size=2, num_workers=2, shuffle_buffer=6, seed=3)
           for r in range(2)]
    everything = {k for r in range(2) for k in keys_of(
        [b for b in loader(uneven, rank=r, world_size=2, shuffle_buffer=6, seed=3)])}
    consumed, rest = [], []
    for run in old:
        stream = run.epochs(0, 0)
        consumed += keys_of([next(stream) for _ in range(stop_after)])
        rest += run.rest_of_epoch(0)
        stream.close()
    new = loader(uneven, batch_size=5, num_workers=3, seed=7, pieces=rest)
    continued = keys_of(list(new))
    left = sum(end - begin for _, begin, end in rest)
    assert len(consumed) == 8 * stop_after and left == len(everything) - len(consumed)
    assert not set(consumed) & set(continued) and len(set(continued)) == len(continued)
    assert set(consumed) | set(continued) <= everything
    assert len(continued) == left // 5 * 5


@pytest.mark.parametrize("mode", ["split", "resampled"])
def test_a_stream_without_transform_keeps_every_batch(truncated_jpegs, mode):
    """transform=None (cached features): images are only checked, never decoded; every batch has
    the ids, keys, captions and skip counts of the decoding stream, and an empty (b, 0) image."""
    kwargs = dict(seed=2, batch_size=4, mode=mode, shuffle_buffer=8)
    decoding, checking = loader(truncated_jpegs, **kwargs), make_loader(
        truncated_jpegs, transform=None, tokenize=tokenize, **kwargs)
    items = [(a, b) for (a, b), _ in zip(zip(decoding.epochs(0), checking.epochs(0)), range(25))]
    assert sum(a["skipped"].get("corrupt_image", 0) for a, _ in items) > 0
    for a, b in items:
        assert b["image"].shape == (len(a["key"]), 0)
        assert torch.equal(a["sample_id"], b["sample_id"]) and a["key"] == b["key"]
        assert torch.equal(a["text"], b["text"]) and a["skipped"] == b["skipped"]
        assert (a["epoch"], a["index"]) == (b["epoch"], b["index"])
    seq = list(make_loader(truncated_jpegs, transform=None, tokenize=tokenize, batch_size=4, mode="sequential"))
    assert keys_of(seq) == keys_of(loader(truncated_jpegs, batch_size=4, mode="sequential"))
