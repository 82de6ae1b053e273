"""The epoch layout of the training stream (vlp.data.stream): which samples each rank and worker
reads in an epoch, as a pure function of seed, epoch, rank and worker: shuffled shard order,
contiguous per-rank ranges, per-worker batches, and the pieces an epoch's rest is written as."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from vlp.data.shard_io import Retry
from vlp.data.shard_list import shard_sizes


def seeded_rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class BatchSizes(Sequence):
    """The sizes of a rank's batches: ``count`` batches of ``batch_per_device``, the last one
    ``last`` (a list's interface in O(1) memory: 2.3 B samples are 289 M batches of 8)."""

    def __init__(self, count: int, batch_per_device: int, last: int | None = None):
        self.count, self.batch_per_device = int(count), int(batch_per_device)
        self.last = self.batch_per_device if last is None else int(last)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(self.count))]
        if j < 0:
            j += self.count
        if not 0 <= j < self.count:
            raise IndexError(j)
        return self.last if j == self.count - 1 else self.batch_per_device

    def __iter__(self):
        if self.count:
            yield from itertools.repeat(self.batch_per_device, self.count - 1)
            yield self.last

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, BatchSizes)) else NotImplemented

    def __repr__(self) -> str:
        return f"BatchSizes({self.count}, {self.batch_per_device}, last={self.last})"

    @property
    def total(self) -> int:
        return (self.count - 1) * self.batch_per_device + self.last if self.count else 0

    def of_worker(self, worker: int, workers: int) -> int:
        """Samples in the batches j = worker (mod workers)."""
        mine = len(range(worker, self.count, workers))
        short = self.batch_per_device - self.last if self.count and (self.count - 1) % workers == worker else 0
        return mine * self.batch_per_device - short


def batch_sizes(mode: str, n: int, batch_per_device: int, world: int, drop_last: bool) -> BatchSizes:
    """Batch sizes of one rank for split/resampled (same on every rank)."""
    if drop_last or mode == "resampled":
        count = n // (batch_per_device * world) if drop_last else -(-n // (batch_per_device * world))
        return BatchSizes(count, batch_per_device)
    per_rank = -(-n // world)
    count = -(-per_rank // batch_per_device)
    return BatchSizes(count, batch_per_device, per_rank - (count - 1) * batch_per_device)


def piece_bounds(pieces: list[tuple[int, int, int]]) -> list[int]:
    """Virtual start of each piece, and the total last: [0, len0, len0 + len1, ...] (int64)."""
    lengths = np.fromiter((end - begin for _, begin, end in pieces), dtype=np.int64,
                          count=len(pieces))
    return [0] + np.cumsum(lengths, dtype=np.int64).tolist()


def segments(pieces: list[tuple[int, int, int]], n: int, start: int, stop: int,
              bounds: list[int] | None = None):
    """Shard pieces (shard, begin, end) of virtual positions [start, stop), wrapping at n.

    ``pieces`` lays out the epoch's virtual sequence: ``[(shard, 0, size), ...]`` in shard order
    for a normal epoch, or the samples left of an epoch begun under another layout.
    ``bounds``: piece_bounds(pieces), when the caller has it (one O(shards) pass less per call)."""
    if bounds is None:
        bounds = piece_bounds(pieces)
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
# epoch), Plan.shuffled_pieces), and zero-length headers (SEED, s, s), (EPOCH, e, e),
# (LAYOUT, c, c) say which sequence (c: a checksum of the shard sizes, so a rest is never
# read against other sizes). What a worker has read but not yielded (its shuffle buffer)
# stays explicit, one piece per run of samples. Hence a rank's rest holds 3 headers, at most
# 2 SEQ pieces and shuffle_buffer pieces per worker: bounded, whatever the shard count.
# Only the rest of an epoch that was itself begun from a rest (a second layout change within
# one epoch) is written out explicitly (O(shards) pieces, as before).
SEQ, SEED, EPOCH, LAYOUT = -1, -2, -3, -4
HEADERS = (SEED, EPOCH, LAYOUT)


def seq_parts(lo: int, hi: int, n: int) -> list[tuple[int, int, int]]:
    """SEQ pieces for virtual positions [lo, hi) of a sequence of n, wrapping at n."""
    out, pos = [], lo
    while pos < hi:
        a = pos % n
        take = min(n - a, hi - pos)
        out.append((SEQ, a, a + take))
        pos += take
    return out


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


def index_runs(where: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Samples (shard, index) -> the pieces (shard, begin, end) of their runs of consecutive
    indices, sorted: merge_pieces(sorted((s, i, i + 1) ...)) without a tuple per sample."""
    if not where:
        return []
    codes = np.fromiter((shard << 40 | index for shard, index in where), dtype=np.int64, count=len(where))
    codes.sort()
    breaks = np.flatnonzero(np.diff(codes) != 1) + 1
    begins = codes[np.concatenate(([0], breaks))]
    ends = codes[np.concatenate((breaks - 1, [len(codes) - 1]))] + 1
    mask = (1 << 40) - 1
    return list(zip((begins >> 40).tolist(), (begins & mask).tolist(), (ends & mask).tolist()))


class Plan:
    """Everything a worker needs; picklable; no I/O in __init__ besides sizes.json."""

    retry: Retry = Retry()  # shard read retries (make_loader: data.io_retries, io_backoff_s)

    def __init__(self, sources, weights, mode, batch_per_device, world_size, rank, seed,
                 num_samples, drop_last, shuffle_buffer, num_workers, pieces=None,
                 retry: Retry | None = None, tables=None):
        if retry is not None:
            self.retry = retry
        self.paths = [p for src in sources for p in src]
        self.sizes = shard_sizes(self.paths, num_samples, retry=self.retry, tables=tables)
        self.weights = [w for src, w in zip(sources, weights) for _ in src]
        self.mode, self.batch_per_device, self.world, self.rank = mode, batch_per_device, world_size, rank
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
            count = -(-(hi - lo) // batch_per_device)
            self.sizes_per_batch = BatchSizes(count, batch_per_device, hi - lo - (count - 1) * batch_per_device)
        else:
            self.sizes_per_batch = batch_sizes(mode, self.n, batch_per_device, world_size, drop_last)
        if not self.sizes_per_batch and mode != "sequential":
            raise ValueError(f"{self.n} samples cannot fill one batch of {batch_per_device} on each "
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
        """(pieces, piece_bounds(pieces)) of every shard in the order shuffled with (seed, epoch),
        identically on every rank; the last one is cached."""
        key = ("order", seed, epoch)
        if key not in self._cache:
            order = list(range(len(self.paths)))
            seeded_rng(seed, epoch, "shard-order").shuffle(order)
            sizes = self.sizes
            pieces = [(shard, 0, sizes[shard]) for shard in order]
            for old in [k for k in self._cache if k[0] == "order"]:
                del self._cache[old]
            self._cache[key] = (pieces, piece_bounds(pieces))
        return self._cache[key]

    def expand(self, pieces) -> list[tuple[int, int, int]]:
        """Explicit (shard, begin, end) pieces of a rest of an epoch in either form (see SEQ)."""
        heads: dict[int, int] = {}
        parts = []
        for shard, begin, end in pieces:
            shard, begin, end = int(shard), int(begin), int(end)
            if shard in HEADERS:
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
                out += segments(seq, total, begin, end, bounds)
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
                    segments(seq, bounds[-1], begin, end, bounds)
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
        """(epoch_pieces(epoch), their bounds), cached."""
        if self.pieces is None:
            return self.shuffled_pieces(self.seed, epoch)
        if "given" not in self._cache:
            self._cache["given"] = (self.pieces, piece_bounds(self.pieces))
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
        return segments(seq, self.n, lo, hi, bounds)
