"""vlp.data.pool: workers reuse their batch memory only once the main process is done with it."""

import numpy as np
import open_clip
import pytest
import torch
from multiprocessing.reduction import ForkingPickler
from dp_helpers import tokenize, write_sizes, write_tar
from test_decode import photo_like

from vlp.data.pool import SLOTS, BufferPool, Leased, Leases
from vlp.data import pool, stream
from loaders import make_loader


def _worker(leases, items, replies):
    """A stand-in loader worker: lends two buffers, then reports whether slot 0 is reused."""
    buffers = BufferPool(leases, worker=1)
    a = buffers.alloc((4, 5), torch.float32).fill_(3)
    b = buffers.alloc((7,)).fill_(1)
    items.put(Leased({"image": a, "other": b}, buffers.lent()))
    replies.get()  # the main process let go of both
    c = buffers.alloc((20,), torch.float32)  # fits in slot 0's segment
    items.put((c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr(), buffers.lent()[0][1][1]))


@pytest.mark.multiproc
def test_a_slot_is_free_again_when_its_last_tensor_is_gone():
    ctx = torch.multiprocessing.get_context("fork")
    leases = Leases(workers=2)
    items, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_worker, args=(leases, items, replies))
    child.start()
    try:
        got = items.get(timeout=60)  # unpickled here: the images themselves
        assert set(got) == {"image", "other"} and torch.equal(got["image"], torch.full((4, 5), 3.0))
        assert list(leases.flags[SLOTS:SLOTS + 3]) == [1, 1, 0]
        view = got["image"][1:]
        del got
        assert list(leases.flags[SLOTS:SLOTS + 2]) == [1, 0]  # 'other' is gone; a view keeps 'image'
        del view
        assert list(leases.flags[SLOTS:SLOTS + 2]) == [0, 0]
        replies.put("done")
        assert items.get(timeout=60) == (True, SLOTS)
    finally:
        child.join(timeout=60)


def test_no_free_slot_gives_a_fresh_unlent_segment():
    leases = Leases(workers=1)
    buffers = BufferPool(leases, worker=0)
    held = [buffers.alloc((10,)) for _ in range(SLOTS)]
    extra = buffers.alloc((10,))
    assert len(buffers.lent()) == SLOTS and extra.is_shared() and all(leases.flags)
    assert buffers.alloc((0,)).numel() == 0


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pool")
    samples = [(f"p{i:03d}", {"jpg": photo_like(96 + 8 * (i % 5), 80 + 8 * (i % 3), seed=i), "txt": f"c {i}".encode()})
               for i in range(48)]
    for s in range(2):
        write_tar(out / f"p-{s:06d}.tar", samples[s * 24:(s + 1) * 24])
    write_sizes(out, {f"p-{s:06d}.tar": 24 for s in range(2)})
    return str(out / "p-{000000..000001}.tar")


def images_of(batch):
    image = batch["image"]
    return image.pixels.clone() if hasattr(image, "pixels") else image.clone()


def run(spec, output, pooled: bool, monkeypatch, count: int = 36):
    """(the first `count` batches' images through 2 workers, the kept batches' images at the end,
    the shared segments the workers made)."""
    if not pooled:
        monkeypatch.setattr(stream, "Leases", lambda workers: None)
    made = torch.multiprocessing.get_context("fork").Value("i", 0)
    fresh = pool.shared_empty

    def counted(*args):
        with made.get_lock():
            made.value += 1
        return fresh(*args)

    monkeypatch.setattr(pool, "shared_empty", counted)  # the forked workers inherit it
    loader = make_loader(spec, batch_size=4, transform=open_clip.image_transform(48, is_train=True),
                         tokenize=tokenize, seed=2, shuffle_buffer=8, image_output=output, num_workers=2)
    kept, got = [], []
    for k, batch in zip(range(count), loader.epochs(0)):  # 3 epochs: slots reused many times
        got.append(images_of(batch))
        if k % 7 == 0:
            kept.append(batch)  # held while later batches are written
    monkeypatch.undo()
    return got, [images_of(batch) for batch in kept], made.value


@pytest.mark.multiproc
@pytest.mark.parametrize("output", ["region", "uint8", "float"])
def test_batches_through_reused_memory_equal_fresh_segments(jpegs, output, monkeypatch):
    """Every batch equals the one sent through a fresh segment, also batches kept alive while
    many later batches were written (their slots are not reused)."""
    pooled, kept, made_pooled = run(jpegs, output, True, monkeypatch)
    fresh, _, made_fresh = run(jpegs, output, False, monkeypatch)
    assert len(pooled) == len(fresh) == 36
    assert made_fresh >= 36 and made_pooled <= 2 * SLOTS + len(kept)  # reused, not made per batch
    assert all(torch.equal(a, b) for a, b in zip(pooled, fresh))
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh[::7]))
