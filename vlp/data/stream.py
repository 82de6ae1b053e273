"""Shards -> batches: split/resample by rank and worker, shuffle, decode, transform, tokenize.

    loader = make_loader("/d/shard-{000000..000009}.tar", batch_size=256, transform=preprocess,
                         tokenize=tokenizer, seed=0, rank=rank, world_size=world, num_workers=4)
    for epoch in range(n):
        loader.set_epoch(epoch)
        for batch in loader:  # {"image": [b,3,H,W], "text": [b,L], "key": [..], "skipped": {..}}
            ...
    for batch in loader.epochs(epoch, start_batch):  # training: all epochs, one set of workers
        ...  # batch["epoch"], batch["index"] say where it is

How an epoch is laid out (all of it is a pure function of seed, epoch, rank, worker):

* ``split``: the shard list is shuffled with (seed, epoch), identically on every rank, and read
  as one virtual sequence of N samples (sizes from sizes.json). Rank r owns the contiguous
  range [r*P, (r+1)*P) with P = num_batches * batch_size, so every rank yields exactly
  ``num_batches`` batches and no sample is used twice, even with uneven shards or fewer shards
  than ranks x workers. Within a rank, batch j belongs to worker j % num_workers; each worker
  reads its own contiguous sub-range through a seeded shuffle buffer. If skipped (bad)
  samples leave a worker short, it re-reads its range (a few duplicates instead of a hang).
* ``resampled``: every worker draws shards with replacement (per-source weights), forever;
  each rank takes exactly ``num_batches`` batches per epoch.
* ``sequential`` (eval): no shuffle; ranks own contiguous near-equal ranges (every sample once
  over all ranks, so per-rank ``num_batches`` may differ by one: run eval on rank 0 or gather
  without per-batch collectives); the last batch may be partial; batches keep file order.

Bad samples are skipped and counted by kind (``SKIP_KINDS``); each batch's ``skipped`` holds
what its worker skipped since its previous batch, and ``Loader.stats`` sums them.
``start_batch=n`` skips the first n batches without decoding them: samples without caption or
image header are dropped before shuffling; an image that fails to decode after the shuffle is
replaced by the stream's next sample, and skipped batches make the same replacements from a
cheap check (``image_decodes``: JPEG entropy decoding at 1/8 scale), so a resumed epoch
yields exactly the batches the uninterrupted one would have. An exact resume needs the same
num_workers, world_size and batch_size. To go on under another layout, ``Loader.rest_of_epoch``
names the pieces of the epoch not consumed yet (each batch carries its worker's), and
``make_loader(pieces=...)`` reads them as the rest of that epoch (vlp/train/resume.py).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import random
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vlp.data.decode import collate_images, image_decoder
from vlp.data.shard_list import expand_sources, shard_sizes
from vlp.data.tars import IMAGE_EXTS, TEXT_EXTS, check_sample, image_decodes, read_shard, warn_bad_shard
from vlp.data.shard_io import Retry

SKIP_KINDS = ("corrupt_image", "missing_caption", "missing_image", "bad_member", "bad_shard")
MODES = ("split", "resampled", "sequential")


# ----------------------------------------------------------------------------- epoch layout
def _rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class BatchSizes(Sequence):
    """The sizes of a rank's batches: ``count`` batches of ``size``, the last one ``last``
    (a list's interface in O(1) memory: 2.3 B samples are 289 M batches of 8)."""

    def __init__(self, count: int, size: int, last: int | None = None):
        self.count, self.size = int(count), int(size)
        self.last = self.size if last is None else int(last)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(self.count))]
        if j < 0:
            j += self.count
        if not 0 <= j < self.count:
            raise IndexError(j)
        return self.last if j == self.count - 1 else self.size

    def __iter__(self):
        if self.count:
            yield from itertools.repeat(self.size, self.count - 1)
            yield self.last

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, BatchSizes)) else NotImplemented

    def __repr__(self) -> str:
        return f"BatchSizes({self.count}, {self.size}, last={self.last})"

    @property
    def total(self) -> int:
        return (self.count - 1) * self.size + self.last if self.count else 0

    def of_worker(self, worker: int, workers: int) -> int:
        """Samples in the batches j = worker (mod workers)."""
        mine = len(range(worker, self.count, workers))
        short = self.size - self.last if self.count and (self.count - 1) % workers == worker else 0
        return mine * self.size - short


def _batch_sizes(mode: str, n: int, batch: int, world: int, drop_last: bool) -> BatchSizes:
    """Batch sizes of one rank for split/resampled (same on every rank)."""
    if drop_last or mode == "resampled":
        count = n // (batch * world) if drop_last else -(-n // (batch * world))
        return BatchSizes(count, batch)
    per_rank = -(-n // world)
    count = -(-per_rank // batch)
    return BatchSizes(count, batch, per_rank - (count - 1) * batch) if count else BatchSizes(0, batch)


def _bounds(pieces: list[tuple[int, int, int]]) -> list[int]:
    """Virtual start of each piece, and the total last: [0, len0, len0 + len1, ...] (int64)."""
    lengths = np.fromiter((end - begin for _, begin, end in pieces), dtype=np.int64,
                          count=len(pieces))
    return [0] + np.cumsum(lengths, dtype=np.int64).tolist()


def _segments(pieces: list[tuple[int, int, int]], n: int, start: int, stop: int,
              bounds: list[int] | None = None):
    """Shard pieces (shard, begin, end) of virtual positions [start, stop), wrapping at n.

    ``pieces`` lays out the epoch's virtual sequence: ``[(shard, 0, size), ...]`` in shard order
    for a normal epoch, or the samples left of an epoch begun under another layout.
    ``bounds``: _bounds(pieces), when the caller has it (one O(shards) pass less per call)."""
    if bounds is None:
        bounds = _bounds(pieces)
    out: list[tuple[int, int, int]] = []
    pos = start
    while pos < stop:  # one chunk per pass over the sequence: [a, b) within [0, n)
        a = pos % n
        b = min(n, a + stop - pos)
        first = bisect.bisect_right(bounds, a) - 1
        last = bisect.bisect_right(bounds, b - 1) - 1
        shard, begin, end = pieces[first]
        if first == last:
            out.append((shard, begin + a - bounds[first], begin + b - bounds[first]))
        else:
            out.append((shard, begin + a - bounds[first], end))
            out += [piece for piece in pieces[first + 1:last] if piece[2] > piece[1]]
            shard, begin, _ = pieces[last]
            out.append((shard, begin, begin + b - bounds[last]))
        pos += b - a
    return out


# The rest of an epoch (Loader.rest_of_epoch) in a compact form: still a list of 3-tuples
# (shard, begin, end), so that ranks' lists concatenate and ``sum(end - begin)`` counts the
# samples left, but with two kinds of special "shard": a SEQ piece (SEQ, a, b) stands for the
# virtual positions [a, b) of the epoch's sequence (the shard order shuffled with (seed,
# epoch), _Plan.shuffled_pieces), and zero-length headers (SEED, s, s), (EPOCH, e, e),
# (LAYOUT, c, c) say which sequence (c: a checksum of the shard sizes, so a rest is never
# read against other sizes). What a worker has read but not yielded (its shuffle buffer)
# stays explicit, one piece per run of samples. Hence a rank's rest holds 3 headers, at most
# 2 SEQ pieces and shuffle_buffer pieces per worker: bounded, whatever the shard count.
# Only the rest of an epoch that was itself begun from a rest (a second layout change within
# one epoch) is written out explicitly (O(shards) pieces, as before).
SEQ, SEED, EPOCH, LAYOUT = -1, -2, -3, -4
_HEADERS = (SEED, EPOCH, LAYOUT)


def _seq_parts(lo: int, hi: int, n: int) -> list[tuple[int, int, int]]:
    """SEQ pieces for virtual positions [lo, hi) of a sequence of n, wrapping at n."""
    out, pos = [], lo
    while pos < hi:
        a = pos % n
        take = min(n - a, hi - pos)
        out.append((SEQ, a, a + take))
        pos += take
    return out


def rest_samples(pieces) -> int:
    """Samples in a rest of an epoch (either form; headers count 0)."""
    return sum(end - begin for shard, begin, end in pieces if shard not in _HEADERS)


def merge_pieces(pieces) -> list[tuple[int, int, int]]:
    """Join adjacent pieces of the same shard: [(s, 0, 5), (s, 5, 9)] -> [(s, 0, 9)]."""
    out: list[tuple[int, int, int]] = []
    for shard, begin, end in pieces:
        if end <= begin:
            continue
        if out and out[-1][0] == shard and out[-1][2] == begin:
            out[-1] = (shard, out[-1][1], end)
        else:
            out.append((shard, begin, end))
    return out


class _Plan:
    """Everything a worker needs; picklable; no I/O in __init__ besides sizes.json."""

    retry: Retry = Retry()  # shard read retries (make_loader: data.io_retries, io_backoff_s)

    def __init__(self, sources, weights, mode, batch_size, world_size, rank, seed,
                 num_samples, drop_last, shuffle_buffer, num_workers, pieces=None,
                 retry: Retry | None = None, tables=None):
        if retry is not None:
            self.retry = retry
        self.paths = [p for src in sources for p in src]
        self.sizes = shard_sizes(self.paths, num_samples, retry=self.retry, tables=tables)
        self.weights = [w for src, w in zip(sources, weights) for _ in src]
        self.mode, self.batch, self.world, self.rank = mode, batch_size, world_size, rank
        self.seed, self.drop_last, self.buffer = seed, drop_last, shuffle_buffer
        self.workers = max(1, num_workers)
        # pieces: this epoch's virtual sequence is given (the samples left of an epoch begun
        # under another layout, see Loader.resume_state) instead of the shuffled shard order
        self._cache: dict = {}  # per process, not pickled (see __getstate__)
        self.pieces = None if pieces is None else merge_pieces(self.expand(pieces))
        total = sum(self.sizes)
        self.n = total if num_samples is None else int(num_samples)
        if self.pieces is not None:
            if mode != "split":
                raise ValueError("pieces (the rest of an epoch) need mode='split'")
            self.n = sum(end - begin for _, begin, end in self.pieces)
        if mode == "split" and self.n > total:
            raise ValueError(f"num_samples={self.n} > {total} samples in the shards; "
                             "use mode='resampled' to draw more than one pass")
        if mode == "sequential":
            lo, hi = self.rank_range()
            count = -(-(hi - lo) // batch_size)
            self.sizes_per_batch = BatchSizes(count, batch_size, hi - lo - (count - 1) * batch_size)
        else:
            self.sizes_per_batch = _batch_sizes(mode, self.n, batch_size, world_size, drop_last)
        if not self.sizes_per_batch and mode != "sequential":
            raise ValueError(f"{self.n} samples cannot fill one batch of {batch_size} on each "
                             f"of {world_size} ranks")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": {}}  # workers rebuild what they need

    def sample_id(self, shard: int, index: int) -> int:
        """A stable id in [0, sum(sizes)): the sample's position in the (unshuffled) shard list.
        The same for any world size, worker count, epoch or mode, so per-sample state (SogCLR's
        normalisers) follows the sample across layouts. A Python int (64-bit in the batch's
        tensor): past 2**31 at LAION scale."""
        base = self._cache.get("id_base")
        if base is None:
            base = self._cache["id_base"] = np.concatenate(
                ([0], np.cumsum(np.asarray(self.sizes, dtype=np.int64), dtype=np.int64)))
        return int(base[shard]) + int(index)

    def layout_sum(self) -> int:
        """A checksum of the shard sizes (the LAYOUT header of a compact rest)."""
        if "crc" not in self._cache:
            sizes = np.asarray(self.sizes, dtype=np.int64)
            self._cache["crc"] = zlib.crc32(np.int64(len(sizes)).tobytes() + sizes.tobytes())
        return self._cache["crc"]

    def shuffled_pieces(self, seed: int, epoch: int) -> tuple[list, list[int]]:
        """(pieces, _bounds(pieces)) of every shard in the order shuffled with (seed, epoch),
        identically on every rank; the last one is cached."""
        key = ("order", seed, epoch)
        if key not in self._cache:
            order = list(range(len(self.paths)))
            _rng(seed, epoch, "shard-order").shuffle(order)
            sizes = self.sizes
            pieces = [(shard, 0, sizes[shard]) for shard in order]
            for old in [k for k in self._cache if k[0] == "order"]:
                del self._cache[old]
            self._cache[key] = (pieces, _bounds(pieces))
        return self._cache[key]

    def expand(self, pieces) -> list[tuple[int, int, int]]:
        """Explicit (shard, begin, end) pieces of a rest of an epoch in either form (see SEQ)."""
        heads: dict[int, int] = {}
        parts = []
        for shard, begin, end in pieces:
            shard, begin, end = int(shard), int(begin), int(end)
            if shard in _HEADERS:
                if heads.setdefault(shard, begin) != begin:
                    raise ValueError("pieces: the rests of different epochs or seeds were joined")
            elif shard == SEQ or 0 <= shard < len(self.paths):
                parts.append((shard, begin, end))
            else:
                raise ValueError(f"pieces: shard {shard} not in the {len(self.paths)} shards")
        if all(shard != SEQ for shard, _, _ in parts):
            return parts
        if SEED not in heads or EPOCH not in heads:
            raise ValueError("pieces: SEQ pieces without the (seed, epoch) headers of their sequence")
        if heads.get(LAYOUT) != self.layout_sum():
            raise ValueError("pieces: this rest of an epoch was laid out over other shard sizes "
                             "(a changed shard list or data.num_samples); resume with the old ones")
        seq, bounds = self.shuffled_pieces(heads[SEED], heads[EPOCH])
        total = bounds[-1]
        out = []
        for shard, begin, end in parts:
            if shard != SEQ:
                out.append((shard, begin, end))
            elif not 0 <= begin <= end <= total:
                raise ValueError(f"pieces: positions [{begin}, {end}) not in the {total} samples")
            else:
                out += _segments(seq, total, begin, end, bounds)
        return out

    def describe_rest(self, parts, epoch: int) -> list[tuple[int, int, int]]:
        """The public form of a rest (Loader.rest_of_epoch) from workers' parts, whose SEQ pieces
        refer to this plan's sequence of ``epoch``: compact with its headers, or explicit when
        the sequence was itself a given rest (then no seed/epoch describes it)."""
        parts = merge_pieces(parts)
        if self.pieces is not None:
            seq, bounds = self.epoch_sequence(epoch)
            out = []
            for shard, begin, end in parts:
                out += [(shard, begin, end)] if shard != SEQ else \
                    _segments(seq, bounds[-1], begin, end, bounds)
            return merge_pieces(out)
        return [(SEED, self.seed, self.seed), (EPOCH, epoch, epoch),
                (LAYOUT, self.layout_sum(), self.layout_sum())] + parts

    def rank_range(self) -> tuple[int, int]:
        """Sequential mode: near-equal contiguous ranges covering every sample once."""
        base, extra = divmod(self.n, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def worker_batches(self, worker: int) -> range:
        return range(worker, len(self.sizes_per_batch), self.workers)

    def epoch_pieces(self, epoch: int) -> list[tuple[int, int, int]]:
        """The epoch's virtual sequence as shard pieces: every shard, in an order shuffled with
        (seed, epoch) identically on every rank (or the given rest of an epoch)."""
        return self.epoch_sequence(epoch)[0]

    def epoch_sequence(self, epoch: int) -> tuple[list, list[int]]:
        """(epoch_pieces(epoch), their _bounds), cached."""
        if self.pieces is None:
            return self.shuffled_pieces(self.seed, epoch)
        if "given" not in self._cache:
            self._cache["given"] = (self.pieces, _bounds(self.pieces))
        return self._cache["given"]

    def worker_span(self, worker: int) -> tuple[int, int]:
        """Split mode: the virtual positions [lo, hi) of the epoch's sequence that worker
        ``worker`` of this rank reads (hi may pass n: then it wraps; drop_last=False)."""
        sizes, workers = self.sizes_per_batch, self.workers
        before = sum(sizes.of_worker(w, workers) for w in range(worker))
        lo = self.rank * sizes.total + before
        return lo, lo + sizes.of_worker(worker, workers)

    def worker_range(self, epoch: int, worker: int) -> list[tuple[int, int, int]]:
        """Split mode: the shard pieces worker ``worker`` of this rank reads in ``epoch``."""
        lo, hi = self.worker_span(worker)
        seq, bounds = self.epoch_sequence(epoch)
        return _segments(seq, self.n, lo, hi, bounds)


# ----------------------------------------------------------------------------- worker side
class _Stream:
    """One (rank, worker)'s batches for one epoch. Collates, tokenizes, counts skips."""

    def __init__(self, plan: _Plan, epoch: int, worker: int, start_batch: int, transform,
                 tokenize, decode_size, image_output: str = "float", pad: bool = False):
        self.plan, self.epoch, self.worker, self.start = plan, epoch, worker, start_batch
        self.transform, self.tokenize, self.decode_size = transform, tokenize, decode_size
        # crop-first JPEG fast path; no transform: images are only checked (image_decodes), never
        # decoded, for batches of cached features (same samples, replacements and skips)
        self.decoder = None if transform is None else image_decoder(transform, decode_size, image_output)
        # pad: yield a placeholder for each skipped batch and up to ceil(num_batches / workers)
        # items, so that every worker yields the same count per epoch and DataLoader's
        # round-robin over workers stays in batch order across chained epochs.
        self.pad = pad
        self.skipped: Counter[str] = Counter()
        # bad-shard lines travel with their counts, printed when the batch is taken (Loader):
        # a warning and the count in the run's totals always agree
        self.warnings: list[str] = []
        self.samples_read = 0
        self.seen_keys: list[str] = []
        self.seen_exts: set[str] = set()
        # what is read and what waits in the shuffle buffer: see ``remaining``
        self.range: list[tuple[int, int, int]] = []
        self.span: tuple[int, int] = (0, 0)  # virtual positions of self.range (worker_span)
        self.starts: list[int] = [0]         # virtual offset of each piece of self.range
        self.read_to: tuple[int, int | None] = (0, None)
        self.pending: list[tuple] = []
        self.passes = 0

    def rng(self, tag: str) -> random.Random:
        p = self.plan
        return _rng(p.seed, self.epoch, p.rank, self.worker, tag)

    def valid(self, pieces) -> Iterator[tuple]:
        """Usable samples ``(key, image bytes, caption, (shard, index))`` of the shard pieces
        (one pass), skips counted; ``read_to`` = (piece, index in shard) read so far."""
        for k, (shard, begin, end) in enumerate(pieces):
            url = self.plan.paths[shard]
            self.read_to = (k, begin)
            for index, key, members in read_shard(url, begin, end, self.skipped, seen_exts=self.seen_exts,
                                                   retry=self.plan.retry, errors=self.warnings):
                self.read_to = (k, index + 1)
                self.samples_read += 1
                if len(self.seen_keys) < 8:
                    self.seen_keys.append(os.path.basename(key))
                sample = check_sample(key, members, url)
                if isinstance(sample, str):
                    self.skipped[sample] += 1
                else:
                    yield sample + ((shard, index),)
            self.read_to = (k + 1, None)

    def remaining(self) -> list[tuple[int, int, int]] | None:
        """Split mode: the pieces of this worker's range not consumed yet (samples waiting in
        the shuffle buffer, then the unread rest), so that a run resumed under another layout
        can finish the epoch without repeating or skipping a sample. [] after a second pass
        (which only re-reads to make up for skipped samples). The unread rest is SEQ pieces
        (positions of the epoch's sequence, see SEQ): the size of this does not grow with the
        shards in the range; the buffer's samples are explicit pieces."""
        if self.plan.mode != "split":
            return None
        if self.passes or not self.range:
            return []
        k, index = self.read_to
        lo, hi = self.span
        if k < len(self.range):
            begin = self.range[k][1]
            at = lo + self.starts[k] + (0 if index is None else index - begin)
        else:
            at = hi
        waiting = sorted((s, i, i + 1) for *_, (s, i) in self.pending)
        return merge_pieces(waiting + _seq_parts(at, hi, self.plan.n))

    def split(self, pieces) -> Iterator[tuple]:
        """Shuffled passes over this worker's range; a pass after the first only happens
        when skipped samples left the worker short of its quota."""
        rng = self.rng("buffer")
        self.range = pieces
        self.starts = _bounds(pieces)
        while True:
            found, read_before, failed_before = 0, self.samples_read, self.failed_reads
            for sample in self.shuffled(self.valid(pieces), rng):
                found += 1
                yield sample
            self.passes += 1
            if not found:
                self.no_valid_samples([self.plan.paths[s] for s, _, _ in pieces],
                                      self.samples_read == read_before and self.failed_reads > failed_before)

    @property
    def failed_reads(self) -> int:
        return self.skipped["bad_shard"] + self.reported_bad

    def no_valid_samples(self, urls: list[str], unreadable: bool = False):
        """The pass found no usable sample: the shards could not be read (a dead server, a
        failing command: say so, with the last error), or their content is unusable."""
        last = self.warnings[-1] if self.warnings else self.last_error
        if (unreadable and last) or (not self.seen_keys and set(self.skipped) == {"bad_shard"}):
            raise ValueError(
                f"could not read any of the shards {sorted(set(urls))[:4]}"
                f"{' ...' if len(set(urls)) > 4 else ''}: every read failed after "
                f"data.io_retries={self.plan.retry.retries}" + (f"; the last: {last}" if last else ""))
        raise ValueError(
            f"no valid samples in {sorted(set(urls))[:4]}: found keys {self.seen_keys}, "
            f"extensions {sorted(self.seen_exts)}; need one of {IMAGE_EXTS} and one of "
            f"{TEXT_EXTS} per key; skipped so far {dict(self.skipped)}")

    def resampled(self) -> Iterator[tuple]:
        rng = self.rng("shards")
        p, picks_without, unread = self.plan, 0, 0
        indices = range(len(p.paths))
        cum_weights = list(itertools.accumulate(p.weights))  # what choices(weights=) computes
        while True:
            shard = rng.choices(indices, cum_weights=cum_weights)[0]
            got, read_before = 0, self.samples_read
            for sample in self.valid([(shard, 0, None)]):
                got += 1
                yield sample
            picks_without = 0 if got else picks_without + 1
            unread = 0 if self.samples_read > read_before else (unread if got == 0 else 0) + 1
            if picks_without > 4 * len(indices) + 8:
                self.no_valid_samples(p.paths, unread >= picks_without)

    def shuffled(self, samples: Iterator[tuple], rng: random.Random) -> Iterator[tuple]:
        buffer = self.pending = []  # the samples read and not yet yielded
        for sample in samples:
            if len(buffer) < self.plan.buffer:
                buffer.append(sample)
                continue
            i = rng.randrange(len(buffer))
            buffer[i], sample = sample, buffer[i]
            yield sample
        rng.shuffle(buffer)
        buffer.reverse()
        while buffer:
            yield buffer.pop()

    def __iter__(self) -> Iterator[dict]:
        p = self.plan
        mine = p.worker_batches(self.worker)
        if not mine:  # more workers than batches
            for _ in range(len(p.worker_batches(0)) if self.pad else 0):
                yield self.placeholder(None)
            return
        if p.mode == "sequential":
            yield from self.sequential(mine)
            return
        if p.mode == "resampled":
            samples = self.shuffled(self.resampled(), self.rng("buffer"))
        else:
            self.span = p.worker_span(self.worker)
            samples = self.split(p.worker_range(self.epoch, self.worker))
        for j in mine:
            chunk = [next(samples) for _ in range(p.sizes_per_batch[j])]
            if j < self.start:  # skipped on resume: no decode, same replacements as decode_all
                self.decode_all(chunk, samples, probe=True)
                self.skipped.clear()  # counts belong to the skipped batch
                if self.pad:
                    yield self.placeholder(j)
                continue
            if self.decoder is None:  # no transform: nothing random to seed (checked, not decoded)
                decoded = self.decode_all(chunk, samples)
                yield self.collate(j, decoded)
                continue
            # Augmentation randomness is a pure function of (seed, epoch, rank, batch index):
            # independent of num_workers and exact after a resume that skipped batches.
            with torch.random.fork_rng(devices=[]):  # the CPU generator only (torch.manual_seed would
                # also queue CUDA seeding, formatting a traceback each batch): the same CPU draws
                torch.default_generator.manual_seed(_rng(p.seed, self.epoch, p.rank, j, "augment").getrandbits(63))
                decoded = self.decode_all(chunk, samples)
            yield self.collate(j, decoded)
        if self.pad:
            for _ in range(len(p.worker_batches(0)) - len(mine)):
                yield self.placeholder(None)

    def placeholder(self, index: int | None) -> dict:
        return {"index": index, "epoch": self.epoch, "empty": True, "warnings": self._take_warnings(),
                "skipped": self._take_skipped(), **self.position()}

    def position(self) -> dict:
        """Where this worker stands, sent with each of its batches (Loader.rest_of_epoch)."""
        return {"worker": self.worker, "remaining": self.remaining()}

    def decode_all(self, chunk: list[tuple], spare: Iterator[tuple] | None,
                   probe: bool = False) -> list:
        """[(key, transformed image, caption)] of the chunk. A sample whose image does not decode
        is counted and, with ``spare``, replaced by the stream's next sample, so batches stay
        full and the stream is the same function of the data with or without a resume
        (``probe``: decide with ``image_decodes`` only, for skipped batches and for a stream
        without a transform, whose images are then None)."""
        probe = probe or self.decoder is None
        out, failed, size = [], 0, len(chunk)
        while chunk:
            key, data, caption, *where = chunk.pop(0)  # where: [(shard, index)] in split/resampled
            try:
                if probe:
                    if not image_decodes(data):
                        raise ValueError("image does not decode")
                    image = None
                else:
                    image = self.decoder.decode(data)
            except Exception:  # PIL raises many types for bad bytes; transform errors do not
                self.skipped["corrupt_image"] += 1  # land here
                failed += 1
                if failed > 4 * size + 16:
                    raise ValueError(
                        f"{failed} images failed to decode while filling one batch of {size} "
                        f"from {self.plan.paths[:4]}...: keys {self.seen_keys}") from None
                if spare is not None:  # keep batches full: take the next sample instead
                    chunk.append(next(spare))
                continue
            out.append((key, image if probe else self.decoder.finish(image), caption, *where))
        return out

    def sequential(self, mine: list[int]) -> Iterator[dict]:
        p = self.plan
        lo, hi = p.rank_range()
        todo = [j for j in mine if j >= self.start]
        if not todo:
            return
        wanted = set(todo)
        first = todo[0] * p.batch + lo
        pieces = _segments([(s, 0, size) for s, size in enumerate(p.sizes)], p.n, first, hi)
        by_batch: dict[int, list] = {}
        position = first
        for shard, begin, end in pieces:
            url, off = p.paths[shard], position - begin - lo  # shard index -> rank position
            for index, key, members in read_shard(
                    url, begin, end, self.skipped, want=lambda i, o=off: (i + o) // p.batch
                    in wanted, retry=p.retry, errors=self.warnings):
                j = (index + off) // p.batch
                while todo and todo[0] < j:  # earlier batches are complete
                    done = todo.pop(0)
                    yield self.collate_or_empty(done, by_batch.pop(done, []))
                sample = check_sample(key, members, url)
                if isinstance(sample, str):
                    self.skipped[sample] += 1
                else:
                    by_batch.setdefault(j, []).append(sample)
            position += end - begin
        for done in todo:
            yield self.collate_or_empty(done, by_batch.pop(done, []))

    def collate_or_empty(self, index: int, chunk: list) -> dict:
        decoded = self.decode_all(chunk, None)
        return self.collate(index, decoded) if decoded else self.placeholder(index)

    reported_bad = 0  # bad_shard counts already sent with earlier batches
    last_error = ""

    def _take_skipped(self) -> dict[str, int]:
        out = dict(self.skipped)
        self.reported_bad += self.skipped["bad_shard"]
        self.skipped.clear()
        return out

    def _take_warnings(self) -> list[str]:
        out, self.warnings = self.warnings, []
        if out:
            self.last_error = out[-1]
        return out

    def collate(self, index: int, decoded: list) -> dict:
        keys = [k for k, *_ in decoded]
        # no transform: an empty (b, 0) image tensor (the batch's features come from elsewhere)
        images = collate_images([s[1] for s in decoded]) if self.decoder is not None else torch.empty(len(decoded), 0)
        text = self.tokenize([s[2] for s in decoded])
        ids = {}
        if all(len(s) == 4 for s in decoded):  # per-sample state (SogCLR) is keyed by this id
            ids["sample_id"] = torch.tensor([self.plan.sample_id(*s[3]) for s in decoded],
                                            dtype=torch.int64)
        return {"image": images, "text": text, "key": keys, "warnings": self._take_warnings(),
                "skipped": self._take_skipped(), "index": index, "epoch": self.epoch, **ids, **self.position()}


class _EpochDataset(torch.utils.data.IterableDataset):
    """One epoch of a worker's batches, or (chain=True) every epoch from ``epoch`` on."""

    def __init__(self, plan, epoch, start_batch, transform, tokenize, decode_size, image_output="float",
                 chain=False):
        super().__init__()
        self.plan, self.epoch, self.start, self.chain = plan, epoch, start_batch, chain
        self.args = (transform, tokenize, decode_size, image_output)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        if not self.chain:
            return iter(_Stream(self.plan, self.epoch, worker, self.start, *self.args))
        return self._chained(worker)

    def _chained(self, worker: int) -> Iterator[dict]:
        epoch, start = self.epoch, self.start
        while True:
            yield from _Stream(self.plan, epoch, worker, start, *self.args, pad=True)
            epoch, start = epoch + 1, 0


def _seed_worker(worker_id: int) -> None:
    """Seed python/numpy RNGs of a worker from torch's (deterministic) worker seed."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


# ----------------------------------------------------------------------------- main side
class Loader:
    """Iterable over one epoch of batches; see the module docstring for the layout."""

    def __init__(self, plan: _Plan, transform, tokenize, epoch: int, start_batch: int,
                 num_workers: int, decode_size: int | None, image_output: str = "float",
                 pin_memory: bool = False):
        self.plan, self.transform, self.tokenize = plan, transform, tokenize
        self.num_workers, self.decode_size = num_workers, decode_size
        self.image_output, self.pin_memory = image_output, pin_memory
        self.epoch, self.start_batch = epoch, 0
        self.set_epoch(epoch, start_batch)
        self.stats: Counter[str] = Counter()
        self.position = start_batch
        self._rest: dict[int, list] = {}  # worker -> pieces not consumed (rest_of_epoch)
        self._rest_epoch: int | None = None

    @property
    def num_batches(self) -> int:
        """Batches this rank yields per epoch (equal on all ranks except sequential)."""
        return len(self.plan.sizes_per_batch)

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch."""
        return self.plan.sizes_per_batch.total

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int, start_batch: int | None = None) -> None:
        """Select the epoch for the next iter(); start_batch (if given) skips that many
        batches of it. A start_batch applies to the next iter() only."""
        if start_batch is not None:
            if not 0 <= start_batch <= self.num_batches:
                raise ValueError(f"start_batch={start_batch} not in [0, {self.num_batches}]")
            self.start_batch = start_batch
        self.epoch = epoch

    def _batches(self, epoch: int, start: int, chain: bool):
        dataset = _EpochDataset(self.plan, epoch, start, self.transform, self.tokenize,
                                self.decode_size, self.image_output, chain=chain)
        if self.num_workers == 0:
            return dataset
        generator = torch.Generator()
        generator.manual_seed(_rng(self.plan.seed, epoch, self.plan.rank).getrandbits(63))
        return torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, generator=generator,
            worker_init_fn=_seed_worker, pin_memory=self.pin_memory)

    def epochs(self, epoch: int = 0, start_batch: int = 0) -> Iterator[dict]:
        """Every batch of every epoch from (epoch, start_batch) on, forever, through one set of
        workers: no restart and no idle prefetch queue at epoch boundaries. Each batch carries
        its "epoch" and "index"; the batches equal those of ``set_epoch(e); iter(loader)``.
        ``start_batch == num_batches`` means the start of the next epoch."""
        if self.plan.mode == "sequential":
            raise ValueError("epochs() is for training streams (split/resampled)")
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch={start_batch} not in [0, {self.num_batches}]")
        epoch, start_batch = epoch + start_batch // self.num_batches, start_batch % self.num_batches
        carry: Counter[str] = Counter()
        expected = (epoch, start_batch)
        for item in self._batches(epoch, start_batch, chain=True):
            self._note_position(item)
            _report(item)
            if item.get("empty"):  # placeholder: keeps the workers' round-robin in order
                carry.update(item["skipped"])
                continue
            where = (item["epoch"], item["index"])
            if where != expected:  # the padding makes this impossible; never train out of order
                raise RuntimeError(f"stream out of order: got {where}, expected {expected}")
            index = item["index"] + 1
            expected = (item["epoch"], index) if index < self.num_batches else (item["epoch"] + 1, 0)
            carry.update(item["skipped"])
            item["skipped"] = dict(carry)
            self.stats.update(carry)
            carry.clear()
            self.epoch, self.position = item["epoch"], index
            yield item

    def _note_position(self, item: dict) -> None:
        worker, rest = item.pop("worker", None), item.pop("remaining", None)
        if worker is None:
            return
        if item["epoch"] != self._rest_epoch:
            self._rest, self._rest_epoch = {}, item["epoch"]
        self._rest[worker] = rest

    def rest_of_epoch(self, epoch: int) -> list[tuple[int, int, int]] | None:
        """Split mode: the shard pieces of ``epoch`` this rank has not consumed, as of the last
        batch ``epochs()`` yielded (None in resampled mode). The ranks' lists, concatenated in
        rank order, are the ``pieces`` with which another layout finishes the epoch without
        repeating or skipping a sample (vlp.train.resume). Compact (see SEQ): 3 headers, <= 2 pieces
        plus the shuffle buffer's runs per worker, whatever the shard count;
        ``rest_samples(pieces)`` counts what is left."""
        if self.plan.mode != "split":
            return None
        known = self._rest if self._rest_epoch == epoch else {}
        out: list[tuple[int, int, int]] = []
        for worker in range(self.plan.workers):
            out += known[worker] if worker in known else _seq_parts(
                *self.plan.worker_span(worker), self.plan.n)
        return self.plan.describe_rest(out, epoch)

    def __iter__(self) -> Iterator[dict]:
        start, self.start_batch = self.start_batch, 0
        batches = self._batches(self.epoch, start, chain=False)
        self.position, yielded = start, 0
        for batch in self._in_order(iter(batches), start):
            yielded += 1
            yield batch
        if not yielded and start < self.num_batches:
            raise ValueError(f"no valid samples in {self.plan.paths[:4]}...: skipped "
                             f"{dict(self.stats)}")

    def _in_order(self, batches: Iterator[dict], expected: int) -> Iterator[dict]:
        """Workers deliver round-robin from worker 0; after a resume the true order starts at
        another worker, so hold back at most num_workers batches and emit by index."""
        pending: dict[int, dict] = {}
        carry: Counter[str] = Counter()
        for batch in batches:
            batch.pop("worker", None), batch.pop("remaining", None)
            batch.pop("epoch", None)
            _report(batch)
            pending[batch.pop("index")] = batch
            while expected in pending:
                out = pending.pop(expected)
                expected += 1
                yield from self._emit(out, carry)
        for index in sorted(pending):
            yield from self._emit(pending.pop(index), carry)
        if carry:
            self.stats.update(carry)

    def _emit(self, batch: dict, carry: Counter) -> Iterator[dict]:
        carry.update(batch["skipped"])
        self.position += 1
        if batch.get("empty"):
            return
        batch["skipped"] = dict(carry)
        self.stats.update(carry)
        carry.clear()
        yield batch


def _report(item: dict) -> None:
    """Print a worker's bad-shard lines as its item (and so its counts) is taken."""
    for line in item.pop("warnings", None) or ():
        warn_bad_shard(line)


def make_loader(
    urls: str,
    *,
    batch_size: int,
    transform: Callable | None,
    tokenize: Callable[[list[str]], torch.Tensor],
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    mode: str = "split",
    shuffle_buffer: int = 1000,
    num_samples: int | None = None,
    drop_last: bool = True,
    start_batch: int = 0,
    weights: str | list[float] | None = None,
    decode_size: int | None = None,
    pieces: list[tuple[int, int, int]] | None = None,
    io_retries: int = 3,
    io_backoff_s: float = 1.0,
    image_output: str = "float",
    pin_memory: bool = False,
) -> Loader:
    """Build the batch stream of one rank over ``urls`` (brace spec, '::' joins sources).

    mode:        'split' | 'resampled' | 'sequential' (module docstring).
    transform:   PIL image -> tensor; None: images are only checked (``image_decodes``, so the
                 same samples are used and replaced as with decoding) and each batch's "image"
                 is an empty (b, 0) tensor: for training on cached features (vlp.train.feature_cache).
    urls:        each element a local path, an fsspec URL or 'pipe:COMMAND'
                 (vlp.data.shard_io); remote shards are streamed, never downloaded whole.
    num_samples: samples per epoch over all ranks (default: total from sizes.json); also what
                 remote shards without sizes.json / *_stats.json are laid out by
                 (shard_list.shard_sizes: equal shares, an assumption).
    drop_last:   split mode only; False pads ranks by wrapping around (a few repeats) and
                 keeps a partial last batch.
    start_batch: skip this many batches of ``epoch`` (resume); see ``Loader.set_epoch``.
    weights:     resampled mode: per-source weights, e.g. '1::2' (each shard of a source is
                 drawn with its source's weight, like open_clip's upsampling factors).
    decode_size: None (default): a transform that starts with a RandomResizedCrop takes the
                 crop-first JPEG decode (vlp/data/decode.py: the same crop boxes, the DCT
                 scale chosen from the box). An int forces the older whole-image DCT downscale
                 keeping both sides >= it, the box then drawn on the downscaled image.
    pieces:      split mode: read these (shard index, begin, end) pieces as the epoch instead
                 of all shards (the rest of an epoch begun under another layout; see
                 ``Loader.rest_of_epoch``: explicit pieces, or its compact form with SEQ
                 pieces and headers, expanded here against the shards' sizes).
    io_retries, io_backoff_s: a failed shard open or read is retried this often, waiting
                 io_backoff_s * 2**k, continuing at the same byte; then it counts 'bad_shard'.
    image_output: what "image" holds: 'float' (the whole transform in the worker), 'uint8',
                 'region' or 'jpeg' (vlp/data/device.py: the rest runs on the device,
                 ``image_decoder(...).device_part()``).
    pin_memory:  the DataLoader's page-locked batches (CUDA: non-blocking copies to the device).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or num_workers < 0:
        raise ValueError(f"bad sizes: batch_size={batch_size} rank={rank} "
                         f"world_size={world_size} num_workers={num_workers}")
    retry, tables = Retry(io_retries, io_backoff_s), {}
    sources = expand_sources(urls, retry=retry, tables=tables)  # each sizes.json read once
    source_weights = _parse_weights(weights, len(sources))
    if weights is not None and mode != "resampled" and len(set(source_weights)) > 1:
        raise ValueError("per-source weights need mode='resampled'")
    plan = _Plan(sources, source_weights, mode, batch_size, world_size, rank, seed,
                 num_samples, drop_last, shuffle_buffer, num_workers, pieces=pieces,
                 retry=retry, tables=tables)
    _probe(plan.paths, plan.retry)
    return Loader(plan, transform, tokenize, epoch, start_batch, num_workers, decode_size, image_output,
                  pin_memory)


def _parse_weights(weights, count: int) -> list[float]:
    if weights is None:
        return [1.0] * count
    values = [float(w) for w in (weights.split("::") if isinstance(weights, str) else weights)]
    if len(values) != count or any(w < 0 for w in values) or not any(values):
        raise ValueError(f"weights {weights!r} must give {count} non-negative values")
    return values


def _probe(paths: list[str], retry: Retry = Retry(), max_samples: int = 32) -> None:
    """Fail fast when the first shards cannot be read at all (a wrong URL, bucket or
    credentials: better one error at start than every worker giving up shard by shard), or
    the first readable shard has no image+caption pair."""
    errors: list[str] = []
    for path in paths[:3]:
        skipped: Counter[str] = Counter()
        keys, exts, usable = [], set(), False
        for i, key, members in read_shard(path, 0, max_samples, skipped, seen_exts=exts,
                                           retry=retry, errors=errors):
            keys.append(os.path.basename(key))
            usable |= any(e in members for e in IMAGE_EXTS) and \
                any(e in members for e in TEXT_EXTS)
        if usable:
            return
        if keys or not skipped:
            raise ValueError(
                f"{path} has no usable samples: keys {keys[:8]}, image/text extensions "
                f"{sorted(exts)}; need one of {IMAGE_EXTS} and one of {TEXT_EXTS} per key")
    if len(errors) == len(paths[:3]):
        raise ValueError(f"could not read the first {len(errors)} shard(s) "
                         f"(after {retry.retries} retries each): {errors[-1]}")
