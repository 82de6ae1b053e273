"""Start-up at internet scale (issue 20), exactly and fast: each directory's sizes.json is read
once (local opens and loopback HTTP requests counted), its fetch honours data.io_retries and a
dead server is one connection error naming the URL, ids and offsets are 64-bit past 2**31
(shard 231,349 of 231,350 x 10,000), and the compact rest of an epoch reads back as the same
batches as its explicit form while its size does not grow with the shard count."""

from __future__ import annotations

import functools
import http.server
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from vlp.data import shard_list
from vlp.data.layout import HEADERS, SEQ, BatchSizes, piece_bounds, segments
from loaders import make_loader
from vlp.data.shard_list import SizesFetchError, brace_expand, expand_sources, shard_sizes
from dp_helpers import png_bytes, to_tensor, tokenize, write_tar
from vlp_testing import free_port


def rest_samples(pieces) -> int:
    """Samples in a rest of an epoch (either form; headers count 0)."""
    return sum(end - begin for shard, begin, end in pieces if shard not in HEADERS)


def loader(spec, **kw):
    return make_loader(spec, transform=to_tensor, tokenize=tokenize, **kw)


def keys_of(batches):
    return [k for b in batches for k in b["key"]]


def _layout(root: Path, count: int, declared: int | None = None, real: Path | None = None,
            existing=None) -> Path:
    """``count`` shard names in root/sizes.json (``declared`` samples each, default the real
    shard's 12), symlinked to one real shard (only ``existing`` indices, default all)."""
    root.mkdir(parents=True, exist_ok=True)
    if real is None:
        real = root.parent / f"{root.name}-real.tar"
        write_tar(real, [(f"{root.name}_{i:02d}", {"png": png_bytes(i), "txt": f"c {i}".encode()})
                         for i in range(12)])
    names = [f"s-{i:06d}.tar" for i in range(count)]
    for i in (range(count) if existing is None else existing):
        os.symlink(real, root / names[i])
    (root / "sizes.json").write_text(json.dumps({n: declared or 12 for n in names}))
    return root


# ----------------------------------------------------------------------------- HTTP server
class _Counting(http.server.SimpleHTTPRequestHandler):
    """Counts every GET by path; server.fail[path] = n answers the first n with 503."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        srv = self.server
        with srv.lock:
            srv.requests[self.path] += 1
            fail = srv.fail.get(self.path, 0)
            if fail:
                srv.fail[self.path] = fail - 1
        if fail:
            self.send_error(503, "busy")
            return
        super().do_GET()


@pytest.fixture
def http_root(tmp_path):
    """(base URL, server) serving tmp_path/www on 127.0.0.1."""
    root = tmp_path / "www"
    root.mkdir()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Counting, directory=root))
    srv.daemon_threads = True
    srv.root, srv.lock, srv.requests, srv.fail = root, threading.Lock(), Counter(), {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.shutdown()
    srv.server_close()


# ----------------------------------------------------------------------------- sizes.json once
def test_local_sizes_json_opened_once_per_directory(tmp_path, monkeypatch):
    for d in ("a", "b"):
        _layout(tmp_path / d, 300)
    opened = Counter()
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened[os.path.basename(str(path))] += 1
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(shard_list, "open", counting_open, raising=False)
    spec = f"{tmp_path}/a/s-{{000000..000299}}.tar::{tmp_path}/b::{tmp_path}/b/s-{{000000..000009}}.tar"
    run = loader(spec, batch_size=8, shuffle_buffer=4)
    assert len(run.plan.paths) == 610 and sum(run.plan.sizes) == 610 * 12
    assert opened["sizes.json"] == 2  # a/ and b/ once each (b/ named twice), not once per shard


@pytest.mark.server
@pytest.mark.parametrize("form", ["braces", "directory"])
def test_remote_sizes_json_fetched_once_per_directory(tmp_path, http_root, form):
    base, srv = http_root
    for d in ("a", "b"):
        _layout(srv.root / d, 200)
    if form == "braces":
        spec = f"{base}/a/s-{{000000..000199}}.tar::{base}/b/s-{{000000..000199}}.tar"
    else:
        spec = f"{base}/a/::{base}/b/"
    run = loader(spec, batch_size=8, shuffle_buffer=4, num_workers=0)
    assert len(run.plan.paths) == 400 and sum(run.plan.sizes) == 400 * 12
    assert srv.requests["/a/sizes.json"] == srv.requests["/b/sizes.json"] == 1
    assert not any(p.endswith("_stats.json") for p in srv.requests)
    shard_gets = sum(n for p, n in srv.requests.items() if p.endswith(".tar"))
    assert shard_gets == 1  # the start-up probe reads the first shard only
    batch = next(iter(run))
    assert batch["image"].shape[0] == 8


# ----------------------------------------------------------------------------- retries, dead server
@pytest.mark.server
def test_sizes_json_fetch_honours_io_retries(tmp_path, http_root):
    base, srv = http_root
    _layout(srv.root / "a", 20)
    spec = f"{base}/a/s-{{000000..000019}}.tar"
    srv.fail["/a/sizes.json"] = 2  # two 503s, then served
    run = loader(spec, batch_size=8, io_retries=2, io_backoff_s=0.0)
    assert srv.requests["/a/sizes.json"] == 3 and sum(run.plan.sizes) == 240
    srv.requests.clear()
    srv.fail["/a/sizes.json"] = 10
    with pytest.raises(SizesFetchError, match=r"/a/sizes\.json.*data\.io_retries=1") as err:
        loader(spec, batch_size=8, io_retries=1, io_backoff_s=0.0)
    assert srv.requests["/a/sizes.json"] == 2  # 1 + io_retries, not the default 3 retries
    assert isinstance(err.value, ValueError) and isinstance(err.value, ConnectionError)


def test_dead_server_is_a_connection_error_naming_the_url():
    port = free_port()  # a port nobody listens on
    url = f"http://127.0.0.1:{port}/data"
    for spec in (f"{url}/s-{{0..3}}.tar", f"{url}/"):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port}/data/sizes\.json") as err:
            loader(spec, batch_size=8, io_retries=0, io_backoff_s=5.0)
        assert time.monotonic() - start < 5  # io_retries=0: no backoff wait at all
        assert "not found" not in str(err.value) and "unknown" not in str(err.value)


# ----------------------------------------------------------------------------- 64-bit at 2.3 B
N_LAION5B, PER = 231_350, 10_000


@pytest.fixture(scope="module")
def laion5b(tmp_path_factory):
    """231,350 shards x 10,000 samples in sizes.json; only the first 3 (the start-up probe) and
    the last exist. The directory form needs no stat per shard."""
    root = tmp_path_factory.mktemp("laion5b") / "d"
    return _layout(root, N_LAION5B, declared=PER, existing=[0, 1, 2, N_LAION5B - 1])


def test_ids_and_offsets_are_64_bit_past_2_31(laion5b):
    last = N_LAION5B - 1
    run = loader(str(laion5b), batch_size=8, shuffle_buffer=4, pieces=[(last, 0, 12)])
    plan = run.plan
    assert sum(plan.sizes) == N_LAION5B * PER > 2**31
    assert plan.sample_id(last, PER - 1) == N_LAION5B * PER - 1
    batch = next(iter(run))
    assert batch["sample_id"].dtype == torch.int64
    ids = sorted(batch["sample_id"].tolist())
    assert ids[0] >= last * PER > 2**31 and ids[-1] < last * PER + 12
    # the normal epoch's plan: the rank's rest spans all 2.3 B positions; its end expands to
    # the last shard of the shuffled order, at offsets past 2**31
    full = loader(str(laion5b), batch_size=8, world_size=4, rank=3, num_workers=2)
    rest = full.rest_of_epoch(0)
    seq = [p for p in rest if p[0] == SEQ]
    assert seq[-1][2] == N_LAION5B * PER and rest_samples(rest) == N_LAION5B * PER // 4
    tail = full.plan.expand(rest)
    order = full.plan.epoch_pieces(0)
    assert tail[-1] == order[-1] and sum(e - b for _, b, e in tail) == N_LAION5B * PER // 4
    assert full.num_batches == N_LAION5B * PER // 32 and isinstance(full.plan.sizes_per_batch, BatchSizes)


def test_int32_sizes_do_not_overflow():
    """np.cumsum of int32 is int32 (Windows' default int): sizes arrive as int32 here."""
    big = np.int32(2**31 - 1)
    found = piece_bounds([(0, np.int32(0), big), (1, np.int32(0), big), (2, np.int32(0), big)])
    assert found == [0, 2**31 - 1, 2**32 - 2, 3 * (2**31 - 1)]
    assert BatchSizes(2**31, 8).total == 2**34


def test_brace_fast_path_equals_braceexpand():
    import braceexpand

    for spec in ("a-{000000..231349}.tar", "x{0..12}y", "x{7..12}", "{00..3}", "{0..003}",
                 "a/{9..10}.tar", "a{3..1}", "a{1..3}b{1..2}", "{0..0}", "x{1..5..2}"):
        assert brace_expand(spec) == list(braceexpand.braceexpand(spec)), spec


# ----------------------------------------------------------------------------- compact rest
@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """7 real shards of 5..17 samples (distinct images)."""
    root = tmp_path_factory.mktemp("uneven")
    sizes = {}
    for s, count in enumerate((5, 17, 9, 12, 6, 14, 8)):
        name = f"u-{s:06d}.tar"
        write_tar(root / name, [(f"u{s}_{i:02d}", {"png": png_bytes(100 * s + i),
                                                     "txt": f"c {s} {i}".encode()})
                                for i in range(count)])
        sizes[name] = count
    (root / "sizes.json").write_text(json.dumps(sizes))
    return str(root / "u-{000000..000006}.tar")


def _same(a, b):
    assert keys_of(a) == keys_of(b) and len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["sample_id"], y["sample_id"])


@pytest.mark.parametrize("stop_after", [0, 2, 4])
def test_compact_rest_reads_as_its_explicit_form(uneven, stop_after):
    rests, consumed = [], []
    for r in range(2):
        run = loader(uneven, batch_size=4, rank=r, world_size=2, num_workers=2, shuffle_buffer=6,
                     seed=3)
        batches = run.epochs(0, 0)
        consumed += keys_of([next(batches) for _ in range(stop_after)])
        rests.append(run.rest_of_epoch(0))
        batches.close()
    joined = [p for rest in rests for p in rest]  # what vlp.checkpoint.resume concatenates
    assert any(p[0] == SEQ for p in joined)
    explicit = loader(uneven, batch_size=4).plan.expand(joined)
    assert all(shard >= 0 for shard, _, _ in explicit)
    assert rest_samples(joined) == sum(e - b for _, b, e in explicit)
    kw = dict(batch_size=5, num_workers=3, seed=7)
    compact_batches = list(loader(uneven, pieces=joined, **kw))
    _same(compact_batches, list(loader(uneven, pieces=explicit, **kw)))
    continued = keys_of(compact_batches)
    assert not set(consumed) & set(continued) and len(set(continued)) == len(continued)
    assert rest_samples(joined) == 2 * loader(uneven, batch_size=4, world_size=2).num_samples \
        - len(consumed)
    # a second change within the epoch: the rest of a rest is explicit (and still exact)
    again = loader(uneven, pieces=joined, **kw)
    stream_ = again.epochs(0, 0)
    next(stream_)
    second = again.rest_of_epoch(0)
    stream_.close()
    assert all(shard >= 0 for shard, _, _ in second)
    assert rest_samples(second) == rest_samples(joined) // 5 * 5 - 5  # drop_last: 1 rank x batch 5


def test_compact_rest_size_does_not_grow_with_shards(tmp_path):
    sizes = {}
    for count in (10, 2000):
        root = _layout(tmp_path / f"n{count}", count)
        run = loader(str(root), batch_size=4, num_workers=2, shuffle_buffer=8)
        batches = run.epochs(0, 0)
        for _ in range(3):
            next(batches)
        rest = run.rest_of_epoch(0)
        batches.close()
        assert rest_samples(rest) == run.num_samples - 12
        sizes[count] = len(rest)
        assert len(rest) <= 3 + 2 * (2 + 8)  # headers + per worker: SEQ ranges + buffer runs
    assert sizes[2000] <= sizes[10] + 2


def test_rest_against_other_sizes_is_refused(uneven, tmp_path):
    rest = loader(uneven, batch_size=4).rest_of_epoch(0)
    other = _layout(tmp_path / "other", 7)
    with pytest.raises(ValueError, match="other shard sizes"):
        loader(str(other), batch_size=4, pieces=rest)


def test_sizes_table_shared_by_expand_and_sizes(tmp_path):
    root = _layout(tmp_path / "d", 50, declared=99)
    assert shard_list.sizes_from_spec(str(root)) == 50 * 99
    tables: dict = {}
    paths = [p for src in expand_sources(str(root), tables=tables) for p in src]
    (root / "sizes.json").unlink()  # shard_sizes uses the table expand_sources read (else: 12)
    assert len(paths) == 50 and shard_sizes(paths, tables=tables) == [99] * 50


def _segments_loop(pieces, n, start, stop):
    """The per-piece loop layout.segments replaced (its reference)."""
    bounds = [0]
    for _, begin, end in pieces:
        bounds.append(bounds[-1] + end - begin)
    out, pos = [], start
    while pos < stop:
        p = pos % n
        k = __import__("bisect").bisect_right(bounds, p) - 1
        take = min(bounds[k + 1] - p, n - p, stop - pos)
        shard, begin, _ = pieces[k]
        out.append((shard, begin + p - bounds[k], begin + p - bounds[k] + take))
        pos += take
    return out


def test_segments_equal_the_per_piece_loop():
    import random

    rng = random.Random(0)
    for _ in range(400):
        pieces = []
        for shard in range(rng.randint(1, 12)):
            begin = rng.randint(0, 5)
            pieces.append((shard, begin, begin + rng.choice([0, 1, 2, 7, 30])))
        total = sum(e - b for _, b, e in pieces)
        if not total:
            continue
        n = rng.randint(1, total)
        start = rng.randint(0, 3 * n)
        stop = start + rng.randint(0, 3 * n)
        assert segments(pieces, n, start, stop) == _segments_loop(pieces, n, start, stop)
