"""Augmentation randomness depends only on (seed, epoch, rank, batch index), so a resumed
epoch replays the same crops with any number of workers."""
import torch

from loaders import make_loader


def _random_tf(image):
    # stands in for RandomResizedCrop & co: any draw from torch's global RNG
    return torch.rand(3)


def _tok(captions):
    return torch.zeros(len(captions), 4, dtype=torch.long)


def _collect(spec, workers, start=0):
    loader = make_loader(spec, batch_size=8, transform=_random_tf, tokenize=_tok, seed=3, num_workers=workers,
                         shuffle_buffer=16, start_batch=start)
    return [(b["key"], b["image"]) for b in loader]


def test_augmentation_independent_of_workers_and_resume(tiny_shards):
    spec = tiny_shards["train"]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    serial = _collect(spec, 0)
    assert torch.equal(before, torch.get_rng_state())  # the caller's RNG stream is untouched
    assert not torch.equal(serial[0][1], serial[1][1])
    for workers in (0, 2):
        full = serial if workers == 0 else _collect(spec, workers)
        resumed = _collect(spec, workers, start=5)
        assert len(full) == 20 and len(resumed) == 15
        for (k1, x1), (k2, x2) in zip(full[5:], resumed):
            assert k1 == k2 and torch.equal(x1, x2)
        # batch j gets the same random draws whichever worker process decodes it
        assert all(torch.equal(a[1], b[1]) for a, b in zip(full, serial))
