"""Shards in a bucket: s3:// (moto's S3 server) and gs:// (fake-gcs-server) on 127.0.0.1,
sizes.json read from the bucket, give the same batches as the same local files in every mode;
mix with local and HTTP sources; survive dropped connections (a TCP proxy cuts each shard's
first response mid-body); feed `vlp eval --shards` and a `vlp train` that is SIGKILLed and
resumed bit-identically. Bytes always cross a socket to a real server: nothing is mocked."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from loaders import make_loader
from vlp.data.shard_list import expand_sources, shard_sizes
from dp_helpers import to_tensor, tokenize
import forked
from object_store import DropProxy, start_gcs, start_s3
from test_remote import _assert_same, _batches, _http, _train, _weights, server  # noqa: F401 (fixture)
from vlp_testing import PYTHON, REPO, run_env

pytestmark = [pytest.mark.multiproc, pytest.mark.server]  # the tier (docs/testing.md): every test here starts processes and talks to a loopback server

STARTERS = {"s3": start_s3, "gs": start_gcs}


@pytest.fixture(scope="module")
def buckets(tiny_shards):
    """scheme -> (server, {'train': spec, 'eval': spec}): tiny_shards uploaded to
    <scheme>://shards/{train,eval}/ with their sizes.json (servers start on first use)."""
    started = {}

    def get(scheme):
        if scheme not in started:
            store = STARTERS[scheme]()
            store.make_bucket("shards")
            specs = {}
            for split in ("train", "eval"):
                local_dir = Path(expand_sources(tiny_shards[split])[0][0]).parent
                url = store.upload_dir(local_dir, "shards", split)
                specs[split] = tiny_shards[split].replace(str(local_dir), url)
            started[scheme] = store, specs
        return started[scheme]

    yield get
    for store, _ in reversed(list(started.values())):
        store.stop()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
@pytest.mark.parametrize("kw", [
    dict(mode="split", num_workers=2, seed=1),
    dict(mode="resampled", num_workers=1, seed=2, num_samples=96),
    dict(mode="sequential", num_workers=0, rank=1, world_size=2),
], ids=["split", "resampled", "sequential"])
def test_bucket_batches_equal_local(tiny_shards, buckets, scheme, kw):
    _, specs = buckets(scheme)
    assert specs["train"].startswith(f"{scheme}://shards/train/")
    _assert_same(_batches(specs["train"], **kw), _batches(tiny_shards["train"], **kw))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_sizes_come_from_the_bucket_and_a_folder_stands_for_them(tiny_shards, buckets, scheme):
    _, specs = buckets(scheme)
    urls = expand_sources(specs["train"])[0]
    local = expand_sources(tiny_shards["train"])[0]
    assert shard_sizes(urls) == shard_sizes(local) == [64, 64, 32]
    assert expand_sources(f"{scheme}://shards/train/")[0] == urls


def test_mixing_s3_gs_local_and_http_sources(tiny_shards, buckets, server):  # noqa: F811
    s3 = expand_sources(buckets("s3")[1]["train"])[0]
    gs = expand_sources(buckets("gs")[1]["train"])[0]
    local = expand_sources(tiny_shards["train"])[0]
    http = expand_sources(_http(tiny_shards["train"], server))[0]
    kw = dict(mode="resampled", seed=7, num_samples=64, weights="1::3::2::1", num_workers=2)
    mixed = f"{s3[0]}::{gs[1]}::{local[2]}::{http[0]}"
    _assert_same(_batches(mixed, **kw), _batches(f"{local[0]}::{local[1]}::{local[2]}::{local[0]}", **kw))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_dropped_connections_are_retried_to_the_same_batches(tiny_shards, buckets, scheme):
    store, specs = buckets(scheme)
    # gs: cut the media downloads (alt=media), not the JSON metadata calls
    proxy = DropProxy(store.endpoint, pattern=rb"\.tar$|\.tar\?" if scheme == "s3" else rb"\.tar.*alt=media")
    store.use(proxy.endpoint)
    try:
        kw = dict(mode="split", num_workers=2, seed=4, io_retries=3, io_backoff_s=0.01)
        loader = make_loader(specs["train"], batch_size=16, transform=to_tensor, tokenize=tokenize, **kw)
        got = list(loader)
    finally:
        store.use()
        proxy.close()
    assert len(proxy.cuts) == 3 and set(proxy.cuts.values()) == {1}, proxy.cuts  # each shard cut once
    assert "bad_shard" not in loader.stats and "bad_member" not in loader.stats
    _assert_same(got, _batches(tiny_shards["train"], **kw))


# ----------------------------------------------------------------------------- vlp eval / train e2e
@pytest.fixture(scope="module")
def s3_reference_run(buckets, tmp_path_factory):
    """An uninterrupted `vlp train` over s3:// shards (local output folder)."""
    store, specs = buckets("s3")
    ref = tmp_path_factory.mktemp("s3-ref") / "ref"
    proc = forked.run([PYTHON, "-m", "vlp", *_train(specs["train"], ref)], cwd=REPO,
                          env=dict(run_env(), **store.env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref


def test_train_over_s3_sigkill_and_resume_is_bit_identical(buckets, s3_reference_run, tmp_path):
    store, specs = buckets("s3")
    env = dict(run_env(), **store.env)
    run = tmp_path / "killed"
    child = forked.Popen([PYTHON, "-m", "vlp", *_train(specs["train"], run)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run / "checkpoints" / "step_00000007.pt"  # of 20 steps
    deadline = time.time() + 240
    while not target.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL and not (run / "open_clip_model.pt").exists()
    proc = forked.run([PYTHON, "-m", "vlp", *_train(specs["train"], run, "train.resume=latest")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    a, b = _weights(s3_reference_run), _weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch_equal(a[k], b[k]), k


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_vlp_eval_shards_from_a_bucket_equal_local(tiny_shards, buckets, s3_reference_run, tmp_path, scheme, capsys):
    from vlp.cli import main

    _, specs = buckets(scheme)
    model = s3_reference_run / "open_clip_model.pt"
    results = {}
    for where, spec in (("local", tiny_shards["eval"]), (scheme, specs["eval"])):
        rc = main(["eval", "--checkpoint", str(model), "--model", "vlp-micro", "--shards", spec,
                   "--out", str(tmp_path / where), "--device", "cpu", "--batch-size", "16"])
        assert rc == 0, capsys.readouterr().err[-2000:]
        results[where] = json.loads((tmp_path / where / "metrics.json").read_text())
    (local_task, local), = results["local"].items()
    (bucket_task, remote), = results[scheme].items()
    assert remote["metrics"] == local["metrics"] and remote["n_images"] == local["n_images"] == 40
