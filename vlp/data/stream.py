"""Shards -> batches: split/resample by rank and worker, shuffle, decode, transform, tokenize.

    data = DataConfig(train_shards="/d/shard-{000000..000009}.tar", batch_per_device=256, num_workers=4)
    loader = make_loader(data, transform=preprocess, tokenize=tokenizer, seed=0, rank=rank, world_size=world)
    for epoch in range(n):
        loader.set_epoch(epoch)
        for batch in loader:  # {"image": [b,3,H,W], "text": [b,L], "key": [..], "skipped": {..}}
            ...
    for batch in loader.epochs(epoch, start_batch):  # training: all epochs, one set of workers
        ...  # batch["epoch"], batch["index"] say where it is

How an epoch is laid out is a pure function of seed, epoch, rank and worker (docs/design.md,
"Stream": split and resampled mode, validity, resume). ``sequential`` (eval): no shuffle; ranks
own contiguous near-equal ranges (every sample once over all ranks, so per-rank ``num_batches``
may differ by one: run eval on rank 0 or gather without per-batch collectives); the last batch
may be partial; batches keep file order.

Bad samples are skipped and counted by kind (corrupt_image, missing_caption, missing_image,
bad_member, bad_shard); each batch's ``skipped`` holds what its worker skipped since its previous
batch, and ``Loader.stats`` sums them.
``start_batch=n`` skips the first n batches without decoding them, making the same replacements
as decoding would, so a resumed epoch yields exactly the uninterrupted one's batches (same
num_workers, world_size and batch_per_device). To go on under another layout,
``Loader.rest_of_epoch`` names the pieces of the epoch not consumed yet, and
``make_loader(pieces=...)`` reads them as the rest of that epoch (vlp/checkpoint/resume.py).

Rooms: the epoch layout is vlp.data.layout, a worker's reading vlp.data.worker, and this module
is the main side (Loader, make_loader).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from vlp.config.keys import DataConfig
from vlp.data.layout import Plan, seeded_rng, seq_parts
from vlp.data.pool import Leases
from vlp.data.shard_io import Retry
from vlp.data.shard_list import expand_sources
from vlp.data.tars import IMAGE_EXTS, TEXT_EXTS, read_shard, warn_bad_shard
from vlp.data.lifecycle import Board, start_worker
from vlp.data.worker import EpochDataset

MODES = ("split", "resampled", "sequential")


class Loader:
    """Iterable over one epoch of batches; see the module docstring for the layout."""

    def __init__(self, plan: Plan, transform, tokenize, epoch: int, start_batch: int,
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
        self.board: Board | None = None  # the workers' pids and shards (vlp.data.lifecycle)

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
        """The batches' iterator (the workers start now)."""
        leases = Leases(self.num_workers) if self.num_workers else None  # workers reuse batch memory
        self.board = Board(self.num_workers, self.plan.paths) if self.num_workers else None
        dataset = EpochDataset(self.plan, epoch, start, self.transform, self.tokenize, self.decode_size,
                               self.image_output, chain=chain, leases=leases, board=self.board)
        if self.num_workers == 0:
            return dataset
        generator = torch.Generator()
        generator.manual_seed(seeded_rng(self.plan.seed, epoch, self.plan.rank).getrandbits(63))
        started = iter(torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, generator=generator,
            worker_init_fn=start_worker, pin_memory=self.pin_memory, collate_fn=as_is))
        self.board.watch(getattr(started, "_workers", ()))  # a worker's death is raised at the next batch, not mid-step
        return self.board.receive(started)  # ... as WorkerDied, one line, whatever the batch was doing

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
        repeating or skipping a sample (vlp.checkpoint.resume). Compact (see SEQ): 3 headers, <= 2 pieces
        plus the shuffle buffer's runs per worker, whatever the shard count (what is left: the
        pieces' lengths, headers not counted)."""
        if self.plan.mode != "split":
            return None
        known = self._rest if self._rest_epoch == epoch else {}
        out: list[tuple[int, int, int]] = []
        for worker in range(self.plan.workers):
            out += known[worker] if worker in known else seq_parts(
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


def as_is(item: dict) -> dict:
    """A worker's item as it is: its tensors are made in the worker (the DataLoader's default,
    default_convert, walks every list in it looking for numpy arrays: ~5 ms per batch)."""
    return item


def _report(item: dict) -> None:
    """Print a worker's bad-shard lines as its item (and so its counts) is taken."""
    for line in item.pop("warnings", None) or ():
        warn_bad_shard(line)


def make_loader(data: DataConfig, *, transform: Callable | None, tokenize: Callable[[list[str]], torch.Tensor],
                seed: int = 0, rank: int = 0, world_size: int = 1, epoch: int = 0, start_batch: int = 0,
                pieces: list[tuple[int, int, int]] | None = None, drop_last: bool = True,
                image_output: str = "float", pin_memory: bool = False) -> Loader:
    """Build the batch stream of one rank over ``data.train_shards`` as the data section says
    (batch_per_device, num_workers, mode, shuffle_buffer, num_samples, weights, decode_size,
    io_retries, io_backoff_s: vlp/config/keys.py). The rest is this run's and this rank's:

    transform:   PIL image -> tensor; None: images are only checked (``image_decodes``, so the
                 same samples are used and replaced as with decoding) and each batch's "image"
                 is an empty (b, 0) tensor: for training on cached features (vlp.train.feature_cache).
    drop_last:   split mode only; False pads ranks by wrapping around (a few repeats) and
                 keeps a partial last batch.
    start_batch: skip this many batches of ``epoch`` (resume); see ``Loader.set_epoch``.
    pieces:      split mode: read these (shard index, begin, end) pieces as the epoch instead
                 of all shards (the rest of an epoch begun under another layout; see
                 ``Loader.rest_of_epoch``: explicit pieces, or its compact form with SEQ
                 pieces and headers, expanded here against the shards' sizes).
    image_output: what "image" holds: 'float' (the whole transform in the worker), 'uint8',
                 'region' or 'jpeg' (vlp/data/device.py: the rest runs on the device,
                 ``image_decoder(...).device_part()``).
    pin_memory:  the DataLoader's page-locked batches (CUDA: non-blocking copies to the device).
    """
    urls, batch_per_device, num_workers, mode, weights = (data.train_shards, data.batch_per_device,
                                                           data.num_workers, data.mode, data.weights)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if batch_per_device < 1 or world_size < 1 or not 0 <= rank < world_size or num_workers < 0:
        raise ValueError(f"bad sizes: batch_per_device={batch_per_device} rank={rank} "
                         f"world_size={world_size} num_workers={num_workers}")
    retry, tables = Retry(data.io_retries, data.io_backoff_s), {}
    sources = expand_sources(urls, retry=retry, tables=tables)  # each sizes.json read once
    source_weights = _parse_weights(weights, len(sources))
    if weights is not None and mode != "resampled" and len(set(source_weights)) > 1:
        raise ValueError("per-source weights need mode='resampled'")
    plan = Plan(sources, source_weights, mode, batch_per_device, world_size, rank, seed,
                 data.num_samples, drop_last, data.shuffle_buffer, num_workers, pieces=pieces,
                 retry=retry, tables=tables)
    _probe(plan.paths, plan.retry)
    return Loader(plan, transform, tokenize, epoch, start_batch, num_workers, data.decode_size, image_output,
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
