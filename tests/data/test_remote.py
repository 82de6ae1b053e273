"""Shards from anywhere: http(s) (a threaded http.server on 127.0.0.1), pipe: and file:// specs
give the same batches as local files, in every mode, with workers, after a resume and after
the server drops connections mid-shard; sizes come from metadata; failures are one line."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from vlp.data.shard_io import Retry, ShardStream, open_shard
from loaders import make_loader
from vlp.data.shard_list import expand_sources, shard_sizes
from dp_helpers import to_tensor, tokenize
import forked
from vlp_testing import PYTHON, REPO, run_env


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves server.root; server.drops[path] = n cuts the first n GETs of path mid-body,
    server.busy[path] = n answers the first n GETs with 503."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        with self.server.lock:
            busy = self.server.busy.get(self.path, 0)
            if busy:
                self.server.busy[self.path] = busy - 1
        if busy:
            self.send_error(503, "busy")
            return
        super().do_GET()

    def copyfile(self, source, outputfile):
        server = self.server
        with server.lock:
            server.gets[self.path] = server.gets.get(self.path, 0) + 1
            drop = server.drops.get(self.path, 0)
            if drop:
                server.drops[self.path] = drop - 1
        if not drop:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(3000))  # Content-Length promised the whole file
        outputfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)


@pytest.fixture(scope="module")
def server(tiny_shards):
    """(base URL, server) serving the directory above tiny_shards' train/ and eval/."""
    root = Path(expand_sources(tiny_shards["train"])[0][0]).parent.parent
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=root))
    srv.daemon_threads = True
    srv.root, srv.lock, srv.drops, srv.busy, srv.gets = root, threading.Lock(), {}, {}, {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    srv.shutdown()
    srv.server_close()


def _http(spec: str, server) -> str:
    base, srv = server
    return spec.replace(str(srv.root), base)


def _batches(spec, **kw):
    kw.setdefault("batch_size", 16)
    return list(make_loader(spec, transform=to_tensor, tokenize=tokenize, **kw))


def _assert_same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x["key"] == y["key"]
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["text"], y["text"])


@pytest.mark.parametrize("kw", [
    dict(mode="split", num_workers=2, seed=1),
    dict(mode="resampled", num_workers=1, seed=2, num_samples=96),
    dict(mode="sequential", num_workers=0, rank=1, world_size=2),
], ids=["split", "resampled", "sequential"])
@pytest.mark.server
def test_http_batches_equal_local(tiny_shards, server, kw):
    _assert_same(_batches(_http(tiny_shards["train"], server), **kw), _batches(tiny_shards["train"], **kw))


@pytest.mark.server
def test_http_weighted_sources_equal_local(tiny_shards, server):
    urls = expand_sources(tiny_shards["train"])[0]
    spec = f"{urls[0]}::{urls[1]}::{urls[2]}"
    kw = dict(mode="resampled", seed=7, num_samples=64, weights="1::3::0")
    _assert_same(_batches(_http(spec, server), **kw), _batches(spec, **kw))


@pytest.mark.server
def test_http_resume_is_exact(tiny_shards, server):
    kw = dict(mode="split", num_workers=2, seed=3, epoch=1, batch_size=8)
    full = _batches(tiny_shards["train"], **kw)
    resumed = _batches(_http(tiny_shards["train"], server), start_batch=7, **kw)
    _assert_same(resumed, full[7:])


@pytest.mark.server
def test_dropped_connections_are_retried_to_the_same_batches(tiny_shards, server):
    spec = _http(tiny_shards["train"], server)
    srv = server[1]
    shards = [url[len(server[0]):] for url in expand_sources(spec)[0]]
    with srv.lock:
        srv.drops.update({path: 2 for path in shards})  # every shard: two cut reads, then whole
    kw = dict(mode="split", num_workers=2, seed=4, io_retries=3, io_backoff_s=0.01)
    loader = make_loader(spec, batch_size=16, transform=to_tensor, tokenize=tokenize, **kw)
    got = list(loader)
    assert all(srv.drops[path] == 0 for path in shards)  # the cuts happened
    assert "bad_shard" not in loader.stats and "bad_member" not in loader.stats
    _assert_same(got, _batches(tiny_shards["train"], **kw))


@pytest.mark.server
def test_busy_server_at_open_is_retried(tiny_shards, server):
    spec = _http(tiny_shards["train"], server)
    srv = server[1]
    with srv.lock:
        srv.busy.update({url[len(server[0]):]: 2 for url in expand_sources(spec)[0]})
        srv.busy["/train/sizes.json"] = 1
    kw = dict(mode="sequential", batch_size=32)
    loader = make_loader(spec, transform=to_tensor, tokenize=tokenize, io_backoff_s=0.01, **kw)
    got = list(loader)
    assert not any(srv.busy.values()) and "bad_shard" not in loader.stats
    _assert_same(got, _batches(tiny_shards["train"], **kw))


@pytest.mark.server
def test_stream_reopens_at_the_same_byte(tiny_shards, server):
    local = expand_sources(tiny_shards["train"])[0][0]
    url = _http(local, server)
    with server[1].lock:
        server[1].drops[url[len(server[0]):]] = 1
    with ShardStream(url, Retry(2, 0.0)) as f:
        data = f.read()
        assert f.reopened == 1
    assert data == Path(local).read_bytes()


@pytest.mark.parametrize("scheme", ["file://", "pipe:cat "])
def test_stream_memory_is_bounded_and_seeks_forward(tmp_path, scheme):
    data = os.urandom(5 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    with ShardStream(f"{scheme}{tmp_path / 'big.bin'}") as f:
        most, got = 0, []
        for _ in range(300):
            got.append(f.read(4096))
            most = max(most, len(f._buf))
        assert b"".join(got) == data[:300 * 4096]
        f.seek(f.tell() - 512)  # tarfile's short step back
        assert f.read(512) == data[300 * 4096 - 512:300 * 4096]
        f.seek(3 << 20)  # skip ahead: seek (file://) or read through (pipe:)
        assert f.read(1000) == data[3 << 20:(3 << 20) + 1000]
        assert f.read() == data[(3 << 20) + 1000:]
    assert most <= ShardStream.CHUNK + ShardStream.KEEP


def test_pipe_and_file_specs(tiny_shards):
    local = tiny_shards["train"]
    kw = dict(mode="split", num_workers=2, seed=5)
    want = _batches(local, **kw)
    _assert_same(_batches(f"pipe:cat {local}", **kw), want)
    _assert_same(_batches(f"file://{local}", **kw), want)
    seq = dict(mode="sequential", batch_size=64)
    _assert_same(_batches(f"pipe:cat {local}", **seq), _batches(local, **seq))


def test_pipe_failure_and_early_close():
    with pytest.raises(OSError, match="exited with status 3"):
        with open_shard("pipe:echo oops >&2; exit 3", Retry(1, 0.0)) as f:
            f.read()
    f = open_shard("pipe:cat /dev/zero | cat")  # endless, two processes: close() ends both
    assert len(f.read(1000)) == 1000
    group = f._raw.proc.pid
    f.close()
    assert f._raw is None
    # SIGKILL is delivered asynchronously: on a loaded box a member may still be listed for a moment
    deadline = time.monotonic() + 20
    while _live_in_group(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_in_group(group) == []


def _live_in_group(pgid: int) -> list[int]:
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


@pytest.mark.server
def test_a_bad_shard_is_counted_and_the_run_goes_on(tiny_shards, server):
    spec = _http(tiny_shards["train"], server)
    urls = expand_sources(spec)[0]
    spec = "::".join(urls[:1] + [urls[1].replace(".tar", "-gone.tar")] + urls[2:])
    loader = make_loader(spec, batch_size=8, transform=to_tensor, tokenize=tokenize,
                         num_samples=160, mode="resampled", io_backoff_s=0.0)
    assert len(list(loader)) == loader.num_batches
    assert loader.stats["bad_shard"] >= 1


@pytest.mark.server
def test_every_shard_failing_is_one_clear_error(server):
    base = server[0]
    with pytest.raises(ValueError, match=r"could not read the first 3 shard\(s\) .*nowhere/2\.tar"):
        make_loader(f"{base}/nowhere/{{0..5}}.tar", batch_size=4, transform=to_tensor,
                    tokenize=tokenize, num_samples=60, io_backoff_s=0.0)
    with pytest.raises(ValueError, match=r"could not read the first 1 shard\(s\) \(after 1 retries"):
        make_loader("pipe:exit 1", batch_size=4, transform=to_tensor, tokenize=tokenize,
                    num_samples=8, io_retries=1, io_backoff_s=0.0)


def test_every_shard_failing_during_the_run_is_one_clear_error(tiny_shards, tmp_path):
    shard = expand_sources(tiny_shards["train"])[0][2]
    once = tmp_path / "read-once"  # the first read (make_loader's probe) works, later ones fail
    spec = f"pipe:if [ -e {once} ]; then exit 1; fi; touch {once}; cat {shard} ; "
    loader = make_loader(spec, batch_size=4, transform=to_tensor, tokenize=tokenize, io_retries=1,
                         io_backoff_s=0.0)
    with pytest.raises(ValueError, match=r"could not read any of the shards .* failed after "
                                         r"data.io_retries=1"):
        list(loader)


@pytest.mark.server
def test_remote_without_sizes_is_a_one_line_error(tiny_shards, server, tmp_path):
    bare = server[1].root / "bare"
    shutil.copytree(Path(expand_sources(tiny_shards["train"])[0][0]).parent, bare,
                    ignore=shutil.ignore_patterns("sizes.json"))
    spec = f"{server[0]}/bare/train-{{000000..000002}}.tar"
    with pytest.raises(ValueError) as err:
        shard_sizes(expand_sources(spec)[0])
    message = str(err.value)
    assert "\n" not in message
    assert all(word in message for word in ("sizes.json", "_stats.json", "data.num_samples"))
    # a total only: shards assumed equal, the layout still exact on every rank
    assert shard_sizes(expand_sources(spec)[0], 160) == [54, 53, 53]
    per_rank = [_batches(spec, num_samples=160, rank=r, world_size=2, batch_size=8) for r in (0, 1)]
    assert [len(b) for b in per_rank] == [10, 10]


@pytest.mark.server
def test_remote_directory_stands_for_its_sizes_json(tiny_shards, server):
    urls = expand_sources(f"{server[0]}/train/")[0]
    assert urls == expand_sources(_http(tiny_shards["train"], server))[0]
    with pytest.raises(FileNotFoundError, match="sizes.json"):
        expand_sources(f"{server[0]}/nowhere/")


@pytest.mark.server
def test_img2dataset_stats_give_sizes(tiny_shards, server):
    src = Path(expand_sources(tiny_shards["train"])[0][0]).parent
    out = server[1].root / "img2dataset"
    out.mkdir()
    sizes = json.loads((src / "sizes.json").read_text())
    for i, (name, count) in enumerate(sizes.items()):
        shutil.copy(src / name, out / f"{i:05d}.tar")
        (out / f"{i:05d}_stats.json").write_text(json.dumps({"count": count + 3, "successes": count}))
    urls = expand_sources(f"{server[0]}/img2dataset/{{00000..00002}}.tar")[0]
    assert shard_sizes(urls) == list(sizes.values())
    assert shard_sizes([f"pipe:cat {out}/00001.tar"]) == [list(sizes.values())[1]]
    kw = dict(mode="split", seed=6, batch_size=16)
    _assert_same(_batches("::".join(urls), **kw), _batches(tiny_shards["train"], **kw))


@pytest.mark.server
def test_eval_classification_shards_over_http(server):
    from vlp.eval.datasets import ShardClassification, shard_classnames
    from dp_helpers import png_bytes, write_tar

    root = server[1].root / "cls" / "test"
    root.mkdir(parents=True)
    (root.parent / "classnames.txt").write_text("zero\none\n")
    write_tar(root / "0.tar", [(f"k{i}", {"png": png_bytes(i), "cls": str(i % 2).encode()}) for i in range(6)])
    spec = f"{server[0]}/cls/test/0.tar"
    assert shard_classnames(spec, None) == ["zero", "one"]
    got = [(tuple(img.shape), label) for img, label in ShardClassification(spec, to_tensor)]
    assert got == [((3, 8, 8), i % 2) for i in range(6)]


# ----------------------------------------------------------------------------- vlp train e2e
TRAIN = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
         "train.log_every=1", "data.shuffle_buffer=64", "data.eval_shards=null", "data.num_workers=1",
         "train.samples=320", "train.checkpoint_every=1", "train.keep_last=2", "data.io_backoff_s=0.05"]


def _train(spec, out, *extra):
    return ["train", "-c", "configs/demo.yaml", f"data.train_shards={spec}", f"train.output_dir={out}",
            *TRAIN, *extra]


def _weights(out):
    return torch.load(Path(out) / "open_clip_model.pt", weights_only=True)["state_dict"]


@pytest.mark.multiproc
@pytest.mark.server
def test_train_over_http_sigkill_and_resume_is_bit_identical(tiny_shards, server, tmp_path):
    spec = _http(tiny_shards["train"], server)
    ref = tmp_path / "ref"
    proc = forked.run([PYTHON, "-m", "vlp", *_train(spec, ref)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run = tmp_path / "killed"
    child = forked.Popen([PYTHON, "-m", "vlp", *_train(spec, run)], cwd=REPO, env=run_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run / "checkpoints" / "step_00000007.pt"  # of 20 steps
    deadline = time.time() + 240
    while not target.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL and not (run / "open_clip_model.pt").exists()

    srv = server[1]
    with srv.lock:  # the resumed run also meets a flaky server
        srv.drops.update({u[len(server[0]):]: 1 for u in expand_sources(spec)[0]})
    proc = forked.run([PYTHON, "-m", "vlp", *_train(spec, run, "train.resume=latest")], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_shard_warnings_and_counts_agree(tiny_shards, tmp_path, capfd, workers):
    """A warning is printed when the batch carrying its count is taken, so the lines printed and
    the bad_shard counts of the batches taken are equal (a worker's read-ahead prints nothing)."""
    shard = expand_sources(tiny_shards["train"])[0][0]
    spec = f"{shard}::pipe:echo broken >&2; exit 1"
    loader = make_loader(spec, batch_size=4, transform=to_tensor, tokenize=tokenize, mode="resampled",
                         num_samples=128, num_workers=workers, io_retries=0, io_backoff_s=0.0, seed=3)
    capfd.readouterr()
    counted = 0
    stream = loader.epochs()
    for _ in range(12):
        counted += next(stream).get("skipped", {}).get("bad_shard", 0)
    lines = [x for x in capfd.readouterr().err.splitlines() if "skipping shard" in x]
    stream.close()
    assert counted >= 1 and len(lines) == counted, (counted, lines)
    assert all("exited with status 1: broken" in x for x in lines)


@pytest.mark.server
def test_a_server_that_dies_mid_run_is_named_as_the_cause(tiny_shards, tmp_path):
    """Every read failing after some batches were read (the server is gone) is one error naming
    the failed reads and the last error, not "no valid samples"."""
    root = tmp_path / "www"
    shutil.copytree(Path(expand_sources(tiny_shards["train"])[0][0]).parent, root)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    spec = f"http://127.0.0.1:{httpd.server_address[1]}/train-{{000000..000002}}.tar"
    loader = make_loader(spec, batch_size=8, transform=to_tensor, tokenize=tokenize, io_retries=1,
                         io_backoff_s=0.0)
    stream = loader.epochs()
    next(stream)  # the first batches come from shards read while the server lived
    httpd.shutdown()
    httpd.server_close()
    with pytest.raises(ValueError, match=r"could not read any of the shards .*every read failed after "
                                         r"data.io_retries=1; the last: .*(onnect|refused)"):
        for _ in range(200):
            next(stream)
    stream.close()
