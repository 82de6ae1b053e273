"""The worker side of the training stream (vlp.data.stream): one loader worker reads its pieces
of the epoch (vlp.data.layout) through a seeded shuffle buffer, checks, decodes, transforms and
tokenizes samples, replaces those that fail to decode, and yields batches with their skips."""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from collections.abc import Iterator

import torch

from vlp.data.decode import collate_images, image_decoder
from vlp.data.lifecycle import Board, note_shard
from vlp.data.layout import Plan, index_runs, piece_bounds, seeded_rng, segments, seq_parts
from vlp.data.pool import BufferPool, Leased, Leases, host_buffer
from vlp.data.tars import IMAGE_EXTS, TEXT_EXTS, check_sample, image_decodes, read_shard
from vlp.data.tokens import fast_tokenizer


class WorkerStream:
    """One (rank, worker)'s batches for one epoch. Collates, tokenizes, counts skips."""

    def __init__(self, plan: Plan, epoch: int, worker: int, start_batch: int, transform,
                 tokenize, decode_size, image_output: str = "float", pad: bool = False,
                 pool: BufferPool | None = None):
        self.plan, self.epoch, self.worker, self.start = plan, epoch, worker, start_batch
        self.transform, self.tokenize, self.decode_size = transform, fast_tokenizer(tokenize), decode_size
        # crop-first JPEG fast path; no transform: images are only checked (image_decodes), never
        # decoded, for batches of cached features (same samples, replacements and skips)
        self.decoder = None if transform is None else image_decoder(transform, decode_size, image_output)
        # pad: yield a placeholder for each skipped batch and up to ceil(num_batches / workers)
        # items, so that every worker yields the same count per epoch and DataLoader's
        # round-robin over workers stays in batch order across chained epochs.
        self.pad = pad
        self.pool = pool  # in a DataLoader worker: the batch memory it reuses (vlp.data.pool)
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
        return seeded_rng(p.seed, self.epoch, p.rank, self.worker, tag)

    def valid(self, pieces) -> Iterator[tuple]:
        """Usable samples ``(key, image bytes, caption, (shard, index))`` of the shard pieces
        (one pass), skips counted; ``read_to`` = (piece, index in shard) read so far."""
        for k, (shard, begin, end) in enumerate(pieces):
            url = self.plan.paths[shard]
            self.read_to = (k, begin)
            note_shard(shard)  # named if this worker dies (vlp.data.lifecycle)
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
        return index_runs([sample[-1] for sample in self.pending]) + seq_parts(at, hi, self.plan.n)

    def split(self, pieces) -> Iterator[tuple]:
        """Shuffled passes over this worker's range; a pass after the first only happens
        when skipped samples left the worker short of its quota."""
        rng = self.rng("buffer")
        self.range = pieces
        self.starts = piece_bounds(pieces)
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
                seed = seeded_rng(p.seed, self.epoch, p.rank, j, "augment").getrandbits(63)
                torch.default_generator.manual_seed(seed)
                self.decoder.use_seed(seed)  # the crop boxes: the same draws, replayed (vlp.data.boxes)
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
        first = todo[0] * p.batch_per_device + lo
        pieces = segments([(s, 0, size) for s, size in enumerate(p.sizes)], p.n, first, hi)
        by_batch: dict[int, list] = {}
        position = first
        for shard, begin, end in pieces:
            url, off = p.paths[shard], position - begin - lo  # shard index -> rank position
            note_shard(shard)
            for index, key, members in read_shard(
                    url, begin, end, self.skipped, want=lambda i, o=off: (i + o) // p.batch_per_device
                    in wanted, retry=p.retry, errors=self.warnings):
                j = (index + off) // p.batch_per_device
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
        images = collate_images([s[1] for s in decoded], self.pool.alloc if self.pool else host_buffer) \
            if self.decoder is not None else torch.empty(len(decoded), 0)
        lent = self.pool.lent() if self.pool else []
        images = Leased(images, lent) if lent else images  # the main process unpickles the images
        text = self.tokenize([s[2] for s in decoded])
        ids = {}
        if all(len(s) == 4 for s in decoded):  # per-sample state (SogCLR) is keyed by this id
            ids["sample_id"] = torch.tensor([self.plan.sample_id(*s[3]) for s in decoded],
                                            dtype=torch.int64)
        return {"image": images, "text": text, "key": keys, "warnings": self._take_warnings(),
                "skipped": self._take_skipped(), "index": index, "epoch": self.epoch, **ids, **self.position()}


class EpochDataset(torch.utils.data.IterableDataset):
    """One epoch of a worker's batches, or (chain=True) every epoch from ``epoch`` on."""

    def __init__(self, plan, epoch, start_batch, transform, tokenize, decode_size, image_output="float",
                 chain=False, leases: Leases | None = None, board: Board | None = None):
        super().__init__()
        self.board = board  # each worker's pid and shard, for the line if one dies
        self.plan, self.epoch, self.start, self.chain = plan, epoch, start_batch, chain
        self.args = (transform, tokenize, decode_size, image_output)
        self.leases = leases  # the main process's flags of the workers' batch memory

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        pool = BufferPool(self.leases, worker) if info is not None and self.leases is not None else None
        if info is not None and self.board is not None:
            self.board.enter(worker)
        if not self.chain:
            return iter(WorkerStream(self.plan, self.epoch, worker, self.start, *self.args, pool=pool))
        return self._chained(worker, pool)

    def _chained(self, worker: int, pool: BufferPool | None) -> Iterator[dict]:
        epoch, start = self.epoch, self.start
        while True:
            yield from WorkerStream(self.plan, epoch, worker, start, *self.args, pad=True, pool=pool)
            epoch, start = epoch + 1, 0
