"""Training runs whose folder is a bucket (`train.output_dir=s3://...`, `gs://...`), against
moto's S3 server and fake-gcs-server on 127.0.0.1 (tests/support/object_store.py): the files a local
run folder gets, keep-last-k in the bucket, exact resume after SIGKILL (one process and a
2-process FSDP launch), an upload killed halfway never resumed from, `vlp eval` and
`vlp compare` on the bucket, the lock object, and one-line refusals at start and for every
path-valued option that cannot take a URL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

import forked
from jobs_here import JobsHere
from object_store import start_gcs, start_s3
from vlp_testing import PYTHON, REPO, accelerate_cmd, free_port, overrides, run_env, run_launch

pytestmark = pytest.mark.server  # the tier (docs/testing.md): every test here talks to a loopback server

TINY = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
        "train.log_every=1", "data.shuffle_buffer=64"]
DEMO = str(REPO / "configs/demo.yaml")


@pytest.fixture(scope="module")
def s3():
    import logging

    quiet = logging.getLogger("werkzeug")  # moto's request log: not the one line a test checks
    was = quiet.disabled
    quiet.disabled = True
    store = start_s3()
    store.make_bucket("runs")
    yield store
    store.stop()
    quiet.disabled = was


def _prefix(store, what: str) -> str:
    return store.url("runs", f"{what}-{uuid.uuid4().hex[:8]}")


def _keys(store, url: str) -> list[str]:
    root = url.split("://", 1)[1]
    return sorted(k[len(root) + 1:] for k in store.fs().find(root))


def _bucket_weights(store, url: str) -> dict:
    import io

    data = store.fs().cat_file(url.split("://", 1)[1] + "/open_clip_model.pt")
    return torch.load(io.BytesIO(data), weights_only=True)["state_dict"]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _cfg(shards, out, *extra):
    from vlp.experiment import load_config

    return load_config(DEMO, [f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}",
                              f"train.output_dir={out}", *TINY, *extra])


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from vlp.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(rc: int, err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "127.0.0.1 - - " not in line]  # not moto's log
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("vlp: error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _train_args(shards, out, *extra):
    return ["train", "-c", DEMO, *overrides(f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}",
                                            f"train.output_dir={out}", *TINY, "train.samples=192",
                                            "train.checkpoint_every=1", "train.keep_last=2", *extra)]


def _vlp(store, cwd, *argv, wait=True, tmpdir=None):
    env = run_env() | store.env | ({"TMPDIR": str(tmpdir)} if tmpdir else {})
    cmd = [PYTHON, "-m", "vlp", *map(str, argv)]
    if not wait:
        return forked.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return forked.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _kill_when(store, child, key: str, timeout_s: float = 240) -> None:
    """SIGKILL the whole process group of `child` once object `key` exists in the bucket."""
    fs, deadline = store.fs(), time.time() + timeout_s
    while child.poll() is None and time.time() < deadline:
        if fs.exists(key):
            break
        fs.invalidate_cache()
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


# ----------------------------------------------------------------------------- one process
@pytest.mark.multiproc
def test_s3_run_gets_the_run_folder_and_resumes_after_sigkill_bit_identical(s3, tiny_shards, tmp_path):
    """`vlp train` into s3://: config, log, checkpoints (keep_last=2 in the bucket), export, eval
    report, result; SIGKILL mid-run and `resume=latest` gives the uninterrupted local run's
    weights bit for bit; nothing is written to a local folder named 's3:'. The killed run's local
    stage folder ($TMPDIR/vlp-run-PID-*) is removed by the next start."""
    ref = _vlp(s3, tmp_path, *_train_args(tiny_shards, tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    url = _prefix(s3, "kill")
    kill_at = random.Random(os.getpid()).randint(3, 9)  # of 12 steps
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    child = _vlp(s3, tmp_path, *_train_args(tiny_shards, url), wait=False, tmpdir=tmp)
    _kill_when(s3, child, f"{url[5:]}/checkpoints/step_{kill_at:08d}.pt")
    assert "open_clip_model.pt" not in _keys(s3, url)
    assert [p.name.split("-")[2] for p in tmp.glob("vlp-run-*")] == [str(child.pid)]  # left by the kill
    proc = _vlp(s3, tmp_path, *_train_args(tiny_shards, url, "train.resume=latest"), tmpdir=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp.glob("vlp-run-*"))  # the dead run's stage at start, this run's own at exit
    assert f"resumed from {url}/checkpoints/step_" in proc.stdout
    _same(_bucket_weights(s3, url), torch.load(tmp_path / "ref/open_clip_model.pt", weights_only=True)["state_dict"])
    keys = _keys(s3, url)
    assert [k for k in keys if k.startswith("checkpoints/")] == [
        "checkpoints/step_00000011.pt", "checkpoints/step_00000012.pt"]  # checksums inside
    for name in ("config.yaml", "log.jsonl", "open_clip_model.pt", "result.json", "eval_step12/metrics.json"):
        assert name in keys, keys
    assert "vlp.lock" not in keys  # released at exit
    assert json.loads(s3.fs().cat_file(f"{url[5:]}/result.json"))["step"] == 12
    log = [json.loads(line) for line in s3.fs().cat_file(f"{url[5:]}/log.jsonl").decode().splitlines()]
    assert {r["step"] for r in log if r["type"] == "train"} == set(range(1, 13))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "tmp"]  # no local 's3:' folder


def test_an_upload_killed_halfway_is_never_resumed_from(s3, tiny_shards, tmp_path, capsys):
    """A checkpoint folder without its META_FILE (an upload killed halfway) is not a checkpoint:
    removed at the next start; a checkpoint whose bytes no longer match its checksum is set aside
    and resume falls back to the one before."""
    import io
    import struct
    import zipfile

    from vlp.train.loop import Trainer

    url = _prefix(s3, "half")
    root = url[5:]
    Trainer(_cfg(tiny_shards, url, "train.samples=64", "train.checkpoint_every=1", "train.keep_last=3",
                 "data.eval_shards=null")).train()
    fs = s3.fs()
    good = fs.cat_file(f"{root}/checkpoints/step_00000003.pt")
    fs.pipe_file(f"{root}/checkpoints/step_00000006/__0_0.distcp", good[:1000])  # no META_FILE: killed halfway
    blob = bytearray(fs.cat_file(f"{root}/checkpoints/step_00000004.pt"))
    with zipfile.ZipFile(io.BytesIO(bytes(blob))) as z:  # 64 bytes flipped inside its largest tensor
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    mid = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    blob[mid:mid + 64] = bytes(b ^ 0xFF for b in blob[mid:mid + 64])
    fs.pipe_file(f"{root}/checkpoints/step_00000004.pt", bytes(blob))
    capsys.readouterr()
    Trainer(_cfg(tiny_shards, url, "train.samples=96", "train.checkpoint_every=1", "train.keep_last=3",
                 "data.eval_shards=null", "train.resume=latest")).train()
    out = capsys.readouterr().out
    assert f"removed step_00000006 in {url}/checkpoints: left by a checkpoint save that was killed" in out
    assert f"{url}/checkpoints/step_00000004.pt does not match its sha256 checksum" in out
    assert "kept as step_00000004.pt.corrupt" in out
    assert f"resumed from {url}/checkpoints/step_00000003.pt at step 3" in out
    keys = _keys(s3, url)
    assert "checkpoints/step_00000004.pt.corrupt" in keys
    assert [k for k in keys if k.startswith("checkpoints/step_") and k.endswith(".pt")] == [
        f"checkpoints/step_{s:08d}.pt" for s in (4, 5, 6)]  # step 4 saved again


def test_vlp_eval_reads_checkpoints_and_writes_reports_in_the_bucket(s3, tiny_shards, tmp_path, capsys, monkeypatch):
    import tempfile

    from vlp.train.loop import Trainer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # downloads go here, and go
    (tmp_path / "tmp").mkdir()

    url = _prefix(s3, "eval")
    Trainer(_cfg(tiny_shards, url, "train.samples=32", "data.eval_shards=null")).train()
    capsys.readouterr()
    common = ["--shards", tiny_shards["eval"], "--device", "cpu", "--batch-size", "64"]
    rc, out, err = _cli(capsys, "eval", "--checkpoint", f"{url}/open_clip_model.pt", "--model", "vlp-micro",
                        "--out", f"{url}/eval_export", *common)
    assert rc == 0, err[-2000:]
    rc, out2, err = _cli(capsys, "eval", "--checkpoint", f"{url}/checkpoints/step_00000002.pt", *common)
    assert rc == 0, err[-2000:]
    assert out == out2  # the export and the last checkpoint: the same weights
    keys = _keys(s3, url)
    assert {"eval_export/metrics.json", "checkpoints/eval/metrics.json"} <= set(keys), keys
    rc, _, err = _cli(capsys, "eval", "--checkpoint", f"{url}/checkpoints/step_00000001.pt", *common)
    _one_error(rc, err, "step_00000001.pt")  # not committed (keep_last pruned it)
    assert not list((tmp_path / "tmp").glob("vlp-run-*"))  # every download removed once loaded


@pytest.mark.multiproc
def test_gs_run_folder_trains_prunes_and_resumes(tiny_shards, tmp_path, capsys):
    from vlp.train.loop import Trainer

    store = start_gcs()
    try:
        store.make_bucket("runs")
        url = _prefix(store, "gs")
        Trainer(_cfg(tiny_shards, url, "train.samples=48", "train.checkpoint_every=1", "train.keep_last=2",
                     "data.eval_shards=null")).train()
        Trainer(_cfg(tiny_shards, url, "train.samples=64", "train.checkpoint_every=1", "train.keep_last=2",
                     "data.eval_shards=null", "train.resume=latest")).train()
        assert f"resumed from {url}/checkpoints/step_00000003.pt at step 3" in capsys.readouterr().out
        keys = _keys(store, url)
        assert [k for k in keys if k.startswith("checkpoints/")] == [f"checkpoints/step_{s:08d}.pt" for s in (3, 4)]
        assert {"config.yaml", "log.jsonl", "open_clip_model.pt", "result.json"} <= set(keys)
    finally:
        store.stop()


# ----------------------------------------------------------------------------- FSDP, 2 processes
def _launch(store, shards, out, *extra, wait=True):
    from vlp_testing import FSDP_COMMON as COMMON

    cmd = accelerate_cmd("-m", "vlp", "train", "-c", "configs/demo.yaml",
                         *overrides(f"data.train_shards={shards['train']}", f"train.output_dir={out}", *COMMON,
                                    "train.parallel=fsdp", "loss.name=sogclr", "train.samples=96", *extra))
    env = run_env() | store.env | {"ACCELERATE_USE_CPU": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    return run_launch(cmd, cwd=REPO, env=env, timeout=300)


@pytest.mark.multiproc
def test_fsdp_in_a_bucket_resumes_after_sigkill_bit_identical(s3, tiny_shards, capsys):
    """2 processes, FSDP: DCP folders and SogCLR's per-rank files (step_N.ranks/) uploaded by
    each rank, committed by rank 0 (META_FILE last); SIGKILL of the job after step 3 of 6 and resume=latest give the
    uninterrupted run's weights bit for bit; `vlp eval` reads a DCP directory in the bucket."""
    ref = _prefix(s3, "fsdp-ref")
    proc = _launch(s3, shards=tiny_shards, out=ref)
    assert proc.returncode == 0, proc.stderr[-4000:]
    url = _prefix(s3, "fsdp-kill")
    child = _launch(s3, tiny_shards, url, "train.checkpoint_every=1", wait=False)
    _kill_when(s3, child, f"{url[5:]}/checkpoints/step_00000003/meta.pt")
    proc = _launch(s3, tiny_shards, url, "train.checkpoint_every=1", "train.resume=latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {url}/checkpoints/step_" in proc.stdout
    _same(_bucket_weights(s3, url), _bucket_weights(s3, ref))
    keys = _keys(s3, ref)
    assert {"checkpoints/step_00000006/__0_0.distcp", "checkpoints/step_00000006/__1_0.distcp",
            "checkpoints/step_00000006/.metadata", "checkpoints/step_00000006/meta.pt",
            "checkpoints/step_00000006/manifest.json",
            "checkpoints/step_00000006.ranks/rank00000-of-00002.pt",
            "checkpoints/step_00000006.ranks/rank00001-of-00002.pt"} <= set(keys), keys
    rc, _, err = _cli(capsys, "eval", "--checkpoint", f"{ref}/checkpoints/step_00000006", "--shards",
                      tiny_shards["eval"], "--device", "cpu", "--out", f"{ref}/eval_dcp")
    assert rc == 0, err[-2000:]
    assert "eval_dcp/metrics.json" in _keys(s3, ref)


# ----------------------------------------------------------------------------- compare
def _bucket_grid(s3, tiny_shards, tmp_path, what: str, more: str = "") -> tuple[str, Path, list[str]]:
    """(its URL, config file, overrides) of a one-run grid whose out_dir is in the bucket; ``more``: grid lines."""
    url = _prefix(s3, what)
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(Path(DEMO).read_text() + f"\ngrid:\n  losses: [infonce]\n  batch_per_device: [16]\n  seeds: [0]\n"
                   f"  out_dir: {url}\n{more}")
    sets = [f"data.train_shards={tiny_shards['train']}", f"data.eval_shards={tiny_shards['eval']}",
            "model.name=vlp-micro", "train.samples=32", "data.shuffle_buffer=64", "optim.warmup_steps=1"]
    return url, cfg, sets


def test_compare_grid_in_a_bucket_resumes(s3, tiny_shards, tmp_path, capsys, monkeypatch):
    from vlp.study.compare import load_compare_config, run_grid

    monkeypatch.chdir(tmp_path)
    url, cfg, sets = _bucket_grid(s3, tiny_shards, tmp_path, "grid")
    run_grid(*load_compare_config(cfg, sets))
    run_grid(*load_compare_config(cfg, [*sets, "grid.seeds=[0,1]"]))
    out = capsys.readouterr().out
    assert "[compare] 2 runs (1 already done)" in out and "run 2/2: infonce_b16_s1" in out
    assert "run 1/2" not in out
    keys = _keys(s3, url)
    assert {"runs.csv", "results.md", "compare_config.yaml", "infonce_b16_s0/result.json",
            "infonce_b16_s1/compare.json"} <= set(keys), keys
    rows = s3.fs().cat_file(f"{url[5:]}/runs.csv").decode().splitlines()
    assert len(rows) == 3 and all(",ok," in r for r in rows[1:]), rows
    assert list(tmp_path.iterdir()) == [cfg]


def test_compare_grid_on_slurm_in_a_bucket(s3, tiny_shards, tmp_path, monkeypatch):
    """grid.executor=slurm, grid.out_dir in the bucket (SLURM's commands answered here,
    tests/support/jobs_here.py): the driver writes each run's job_spec.json and job.json to the
    bucket, the job reads its spec from the run's URL and writes its run there; the job script and
    SLURM's output go to a local folder, slurm-logs/<bucket>/<path>/<run> under the working directory."""
    from vlp.executors import batch, status
    from vlp.study.compare import load_compare_config, run_grid
    from vlp.executors.slurm import Slurm

    monkeypatch.chdir(tmp_path)
    here = JobsHere()
    monkeypatch.setattr(batch, "scheduler_of", lambda grid: Slurm(grid.slurm, cwd=tmp_path, run=here))
    url, cfg, sets = _bucket_grid(s3, tiny_shards, tmp_path, "slurm", "  executor: slurm\n  slurm: {poll_s: 0.2}\n")
    base, grid = load_compare_config(cfg, sets)
    run_grid(base, grid)
    keys = set(_keys(s3, url))
    assert {"runs.csv", "infonce_b16_s0/job_spec.json", "infonce_b16_s0/job.json", "infonce_b16_s0/result.json",
            "infonce_b16_s0/compare.json"} <= keys, keys
    rows = s3.fs().cat_file(f"{url[5:]}/runs.csv").decode().splitlines()
    assert len(rows) == 2 and ",ok," in rows[1], rows
    assert here.submitted() == [f"{url}/infonce_b16_s0"]
    logs = tmp_path / "slurm-logs" / url[5:] / "infonce_b16_s0"
    assert f"-m vlp.executors.job {url}/infonce_b16_s0" in (logs / "job.sh").read_text()
    (sbatch,) = [c for c in here.calls if c[0] == "sbatch" and "--test-only" not in c]
    assert f"--output={logs}/slurm-%j.out" in sbatch and sbatch[-1] == str(logs / "job.sh")
    jobs = json.loads(s3.fs().cat_file(f"{url[5:]}/infonce_b16_s0/job.json"))["jobs"]
    assert [j["state"] for j in jobs] == ["COMPLETED"]
    assert status.study_status(grid, Slurm(grid.slurm, run=here)).endswith("1 done")


# ----------------------------------------------------------------------------- refusals, lock
@pytest.mark.multiproc
def test_bucket_start_failures_are_one_line_before_anything_is_written(s3, tiny_shards, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["train", "-c", DEMO, f"data.train_shards={tiny_shards['train']}", *TINY]
    rc, _, err = _cli(capsys, *base, "train.output_dir=s3://no-such-bucket/run")
    _one_error(rc, err, "train.output_dir=s3://no-such-bucket/run", "does not exist")
    s3.use(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("VLP_STORAGE_TIMEOUT_S", "3")
    try:
        t = time.monotonic()
        rc, _, err = _cli(capsys, *base, "train.output_dir=s3://runs/unreachable")
        _one_error(rc, err, "train.output_dir=s3://runs/unreachable")
        assert time.monotonic() - t < 10
    finally:
        s3.use()
    script = ("import sys; sys.modules['s3fs'] = None\nfrom vlp.cli import main\n"
              f"sys.exit(main({base + ['train.output_dir=s3://runs/noextra']!r}))")
    proc = subprocess.run([PYTHON, "-c", script], cwd=tmp_path, env=run_env() | s3.env, capture_output=True,
                          text=True, timeout=120)
    _one_error(proc.returncode, proc.stderr, "train.output_dir=s3://runs/noextra", "pip install 'vlp[s3]'")
    assert list(tmp_path.iterdir()) == []
    assert "unreachable" not in str(_keys(s3, "s3://runs"))


@pytest.mark.multiproc
def test_the_bucket_lock_refuses_a_live_writer_and_takes_over_a_dead_one(s3, tiny_shards, tmp_path, capsys):
    import socket

    from vlp.checkpoint.storage import RunFolder
    from vlp.checkpoint import lock as runlock

    url = _prefix(s3, "lock")
    folder = RunFolder(url)
    lock = runlock.acquire(folder)
    assert not folder.create("vlp.lock", b"{}")  # exactly one creator: a second writer (our own pid aside)
    lock.release()
    assert not folder.exists("vlp.lock")
    alive = {"pid": os.getppid(), "host": socket.gethostname(), "started": "then", "token": "x"}
    folder.write_bytes("vlp.lock", json.dumps(alive).encode())
    rc, _, err = _cli(capsys, "train", "-c", DEMO, f"data.train_shards={tiny_shards['train']}", *TINY,
                      f"train.output_dir={url}", "train.samples=16")
    _one_error(rc, err, f"run folder {url} is in use by another trainer", f"pid {os.getppid()}")
    assert "config.yaml" not in _keys(s3, url)
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder.write_bytes("vlp.lock", json.dumps({**alive, "pid": int(dead.stdout)}).encode())
    said = []
    lock = runlock.acquire(folder, log=said.append)
    assert "took over the stale lock" in said[0] and json.loads(folder.read_bytes("vlp.lock"))["pid"] == os.getpid()
    lock.release()
    folder.close()


@pytest.mark.parametrize("argv,option", [
    (["train.resume=s3://runs/x/checkpoints/step_00000002.pt"], "train.resume"),
    (["model.pretrained=s3://runs/x/open_clip_model.pt"], "model.pretrained"),
    (["model.image_pretrained=gs://runs/x/tower.pt"], "model.image_pretrained"),
    (["model.text_pretrained=s3://runs/x/tower.pt"], "model.text_pretrained"),
    (["model.hf_text_dir=s3://runs/x/hf"], "model.hf_text_dir"),
    ("shards", "vlp shards OUT"),
    ("demo", "vlp demo --out"),
    ("study", "grid.out_dir"),
])
def test_path_options_refuse_a_url_in_one_line(s3, tiny_shards, tmp_path, capsys, monkeypatch, argv, option):
    """Every path-valued option either works on a URL (train.output_dir, grid.out_dir, vlp eval
    --checkpoint/--out: tests above) or refuses it naming the option; never a local 's3:' folder."""
    monkeypatch.chdir(tmp_path)
    if argv == "shards":
        rc, _, err = _cli(capsys, "shards", "openmoji", "s3://runs/shards")
    elif argv == "demo":
        rc, _, err = _cli(capsys, "demo", "--out", "s3://runs/demo")
    elif argv == "study":
        cfg = tmp_path / "study.yaml"
        cfg.write_text(Path(DEMO).read_text() + "\ngrid:\n  losses: [infonce]\n  batch_per_device: [16]\n"
                       "  seeds: [0]\n  out_dir: s3://runs/study\n  sweep: {optim.lr: [1.0e-3]}\n")
        rc, _, err = _cli(capsys, "compare", "-c", cfg)
    else:
        rc, _, err = _cli(capsys, "train", "-c", DEMO, f"data.train_shards={tiny_shards['train']}", *TINY,
                          f"train.output_dir={tmp_path / 'run'}", *argv)
    _one_error(rc, err, option)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(("s3:", "gs:"))]
    assert not (tmp_path / "run").exists()
