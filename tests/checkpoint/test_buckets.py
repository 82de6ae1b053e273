"""Run folders (vlp/checkpoint/storage.py) against real servers on 127.0.0.1: moto's S3 and fake-gcs-server
(tests/support/object_store.py), and the same calls on a local folder.

A checkpoint folder is listed only once its META_FILE is written last (vlp/checkpoint/checkpointer.py):
an uploader killed halfway leaves objects that are never listed and are cleaned at the next
start; prune and set_aside work the same on a bucket; a downloaded checkpoint verifies itself;
every start-up failure (no bucket, refused credentials, no endpoint, missing extra) is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
import uuid

import pytest

from object_store import start_gcs, start_s3
from vlp.checkpoint.integrity import IntegrityError, entry, manifest_bytes
from vlp.checkpoint.storage import RunFolder, StorageError, check_writable
from vlp.checkpoint.files import META_FILE, CheckpointError, load_valid
from vlp.checkpoint.checkpointer import clean, fetch, list_checkpoints, prune, set_aside
from vlp_testing import PYTHON, REPO, free_port, run_env

STARTERS = {"s3": start_s3, "gs": start_gcs}


@pytest.fixture(scope="module")
def servers():
    """scheme -> a started server with a 'runs' bucket (started on first use, stopped at the end;
    one that cannot start raises: the test errors, it is not skipped)."""
    started = {}

    def get(scheme):
        if scheme not in started:
            started[scheme] = STARTERS[scheme]()
            started[scheme].make_bucket("runs")
        return started[scheme]

    yield get
    for server in reversed(list(started.values())):
        server.stop()


@pytest.fixture(params=["s3", "gs"])
def store(request, servers):
    return servers(request.param)


@pytest.fixture
def folder(store):
    run = RunFolder(store.url("runs", f"r-{uuid.uuid4().hex[:8]}"))
    yield run
    run.close()


@pytest.fixture(params=["s3", "gs", "local"])
def any_folder(request, servers, tmp_path):
    """The same RunFolder calls on a bucket (s3 and gs) and on a local folder."""
    if request.param == "local":
        run = RunFolder(tmp_path / "run")
    else:
        run = RunFolder(servers(request.param).url("runs", f"r-{uuid.uuid4().hex[:8]}"))
    yield run
    run.close()


def _stage_file(folder, name, data):
    stage = folder.stage(name)
    stage.write_bytes(data)
    return stage


def _publish_file(folder, step, data):
    name = f"checkpoints/step_{step:08d}.pt"
    folder.publish(_stage_file(folder, name, data), name)
    return name


def _listed(folder) -> list[str]:
    return [f"checkpoints/{n}" for n in list_checkpoints(folder.sub("checkpoints"))]


def _stage_dir(folder, name, files: dict):
    stage = folder.stage(name)
    for rel, blob in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(blob)
    return stage


# ----------------------------------------------------------------------------- whole objects
@pytest.mark.multiproc
@pytest.mark.server
def test_whole_objects(any_folder):
    f = any_folder
    assert not f.exists("config.yaml") and f.listdir() == []
    f.write_bytes("config.yaml", b"a: 1\n")
    f.write_bytes("eval_step5/report.json", b"{}")
    f.write_bytes("eval_step5/deep/x.bin", b"\0\1")
    assert f.read_bytes("config.yaml").decode() == "a: 1\n" and f.exists("eval_step5/deep/x.bin")
    assert f.listdir() == ["config.yaml", "eval_step5"]
    assert f.listdir("eval_step5") == ["deep", "report.json"]
    f.write_bytes("config.yaml", b"a: 2\n")  # replaced whole
    assert f.read_bytes("config.yaml").decode() == "a: 2\n"
    f.remove("eval_step5", tree=True)
    assert f.listdir() == ["config.yaml"] and not f.exists("eval_step5/report.json")
    with pytest.raises(FileNotFoundError, match="nothing.txt does not exist"):
        f.read_bytes("nothing.txt")


@pytest.mark.multiproc
@pytest.mark.server
def test_local_dir_for_tools_that_write_files(any_folder):
    f = any_folder
    tb = f.local_dir("tb")
    (tb / "events.1").write_bytes(b"e1")
    (tb / "sub").mkdir()
    (tb / "sub" / "events.2").write_bytes(b"e2")
    f.sync_dir("tb")
    assert f.read_bytes("tb/events.1") == b"e1" and f.read_bytes("tb/sub/events.2") == b"e2"
    assert f.listdir("tb") == ["events.1", "sub"]


@pytest.mark.multiproc
@pytest.mark.server
def test_download_and_of_for_one_file(any_folder):
    f = any_folder
    f.write_bytes("open_clip_model.pt", b"weights")
    folder, name = RunFolder.of(f.path("open_clip_model.pt"))
    assert name == "open_clip_model.pt" and folder.url == f.url
    assert folder.download(name).read_bytes() == b"weights"
    ckpt = _publish_file(f, 3, b"state")
    f.wait()
    folder, name = RunFolder.of(f.path(ckpt))
    assert (folder.url, name) == (f.path("checkpoints"), ckpt.split("/")[-1])
    assert fetch(folder, name).read_bytes() == b"state"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        folder.download("nothing.pt")
    folder.close()


def test_local_folder_is_plain_files(tmp_path):
    f = RunFolder(tmp_path / "run")
    f.write_bytes("result.json", b"{}")
    assert (tmp_path / "run" / "result.json").read_text() == "{}" and not f.remote
    assert RunFolder(f"file://{tmp_path}/run").read_bytes("result.json").decode() == "{}"


@pytest.mark.multiproc
@pytest.mark.server
def test_log_writer_appends_and_survives_a_resume(any_folder):
    f = any_folder
    from vlp.train.logger import LogWriter

    log = LogWriter(f, "log.jsonl", upload_every_s=3600)
    log.write('{"step": 1}')
    log.write('{"step": 2}\n')
    if f.remote:  # not yet uploaded: an object cannot be appended to, it is put whole
        assert not f.exists("log.jsonl")
        log.flush()
    assert f.read_bytes("log.jsonl").decode() == '{"step": 1}\n{"step": 2}\n'
    log.write('{"step": 3}')
    log.close()
    resumed = LogWriter(f, "log.jsonl", upload_every_s=0)  # every line uploaded
    resumed.write('{"step": 4}')
    assert f.read_bytes("log.jsonl").decode().splitlines() == [f'{{"step": {i}}}' for i in (1, 2, 3, 4)]
    resumed.close()


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.multiproc
@pytest.mark.server
def test_publish_uploads_in_the_background_and_a_folder_is_listed_by_its_last_file(any_folder):
    f = any_folder
    data = os.urandom(3 << 20)
    name = _publish_file(f, 7, data)
    f.wait()
    assert _listed(f) == [name]
    assert f.download(name).read_bytes() == data
    # a DCP-like folder: several objects, listed once META_FILE (written last) is there
    files = {".metadata": b"m" * 100, "__0_0.distcp": os.urandom(1 << 20), "sub/x.bin": b"x"}
    stage = _stage_dir(f, "checkpoints/step_00000009", files)
    f.put(stage, "checkpoints/step_00000009")
    assert _listed(f) == [name] and not stage.exists()  # the staged copy is gone once uploaded
    f.put(_stage_file(f, f"checkpoints/step_00000009/{META_FILE}", b"meta"), f"checkpoints/step_00000009/{META_FILE}")
    assert _listed(f) == [name, "checkpoints/step_00000009"]
    got = fetch(f, "checkpoints/step_00000009")
    assert {rel: (got / rel).read_bytes() for rel in files} == files and (got / META_FILE).read_bytes() == b"meta"


@pytest.mark.multiproc
@pytest.mark.server
def test_publish_returns_before_the_upload_ends(folder):
    data = os.urandom(32 << 20)
    t = time.perf_counter()
    name = _publish_file(folder, 1, data)
    returned = time.perf_counter() - t
    listed = _listed(folder)
    in_flight = folder._thread is not None and folder._thread.is_alive()  # still uploading after the listing: it was listed mid-upload
    folder.wait()
    uploaded = time.perf_counter() - t
    assert returned < uploaded / 2, (returned, uploaded)
    if in_flight:
        assert listed == []  # an object appears whole or not at all
    assert _listed(folder) == [name]


@pytest.mark.multiproc
@pytest.mark.server
def test_a_failed_upload_is_one_line_at_the_next_wait(store):
    f = RunFolder(store.url("no-such-bucket-here", "run"))
    f.publish(_stage_file(f, "checkpoints/step_00000001.pt", b"abc"), "checkpoints/step_00000001.pt")
    with pytest.raises(StorageError) as err:
        f.wait()
    assert "\n" not in str(err.value) and store.url("no-such-bucket-here", "run") in str(err.value)
    f.close()


KILLED_UPLOADER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from vlp.checkpoint.storage import RunFolder
    f = RunFolder(sys.argv[1])
    ckpt = f.stage("checkpoints/step_00000005")
    ckpt.mkdir()
    for i in range(40):
        (ckpt / f"__{i:02d}.distcp").write_bytes(os.urandom(1 << 20))
    print("uploading", flush=True)
    f.put(ckpt, "checkpoints/step_00000005")
    f.write_bytes("checkpoints/step_00000005/meta.pt", b"last")
    print("done", flush=True)
""")


@pytest.mark.multiproc
@pytest.mark.server
def test_an_upload_killed_halfway_is_never_listed(folder, store):
    old = _publish_file(folder, 3, b"committed")
    folder.wait()
    child = subprocess.Popen([PYTHON, "-c", KILLED_UPLOADER, folder.url], cwd=REPO,
                             env=dict(run_env(), **store.env), stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while len(folder.listdir("checkpoints/step_00000005")) < 3 and time.time() < deadline:
            assert child.poll() is None, "the uploader ended before it was killed"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    uploaded = folder.listdir("checkpoints/step_00000005")
    assert 3 <= len(uploaded) < 40 and META_FILE not in uploaded, uploaded  # stopped halfway
    assert _listed(folder) == [old]
    with pytest.raises(CheckpointError, match="is incomplete"):
        load_valid(fetch(folder, "checkpoints/step_00000005"))
    assert clean(folder.sub("checkpoints")) == ["step_00000005"]
    assert folder.listdir("checkpoints") == ["step_00000003.pt"]
    assert folder.download(old).read_bytes() == b"committed"


@pytest.mark.multiproc
@pytest.mark.server
def test_a_checkpoint_written_by_two_ranks_is_listed_once_rank_0_writes_its_last_file(folder, tmp_path):
    """DCP under FSDP: each rank puts its own shard files, rank 0 the manifest and META_FILE last."""
    name = "checkpoints/step_00000008"
    parts = {0: {".metadata": b"index", "__0_0.distcp": b"r0" * 1000}, 1: {"__1_0.distcp": b"r1" * 1000}}
    ranks = {r: RunFolder(folder.url) for r in parts}  # one RunFolder per process
    digests = {}
    for r, files in parts.items():
        stage = _stage_dir(ranks[r], name, files)
        digests.update({rel: entry(stage / rel) for rel in files})
        ranks[r].put(stage, name)
        assert _listed(folder) == []  # not listed before META_FILE
    meta = tmp_path / META_FILE
    meta.write_bytes(b"meta")
    folder.write_bytes(f"{name}/manifest.json", manifest_bytes({**digests, META_FILE: entry(meta)}))
    folder.put(meta, f"{name}/{META_FILE}")
    assert _listed(folder) == [name]
    got = fetch(folder, name)
    assert {p.name: p.read_bytes() for p in got.iterdir() if p.name not in ("manifest.json", META_FILE)} == {
        **parts[0], **parts[1]}
    for r in ranks.values():
        r.close()


@pytest.mark.multiproc
@pytest.mark.server
def test_a_downloaded_checkpoint_checks_every_file_against_its_manifest(folder, tmp_path):
    name = "checkpoints/step_00000002"
    files = {".metadata": b"m", "__0_0.distcp": b"A" * 1000, META_FILE: b"x"}
    for rel, blob in files.items():
        (tmp_path / rel).write_bytes(blob)
    folder.write_bytes(f"{name}/manifest.json", manifest_bytes({rel: entry(tmp_path / rel) for rel in files}))
    for rel, blob in files.items():
        folder.write_bytes(f"{name}/{rel}", blob)
    folder.write_bytes(f"{name}/__0_0.distcp", b"B" * 1000)  # same size, other bytes
    with pytest.raises(IntegrityError, match="__0_0.distcp does not match its sha256 checksum"):
        load_valid(fetch(folder, name))
    folder.remove(f"{name}/__0_0.distcp")
    with pytest.raises(IntegrityError, match="__0_0.distcp is missing"):
        load_valid(fetch(folder, name))


@pytest.mark.multiproc
@pytest.mark.server
def test_prune_and_set_aside(any_folder):
    f = any_folder
    names = [_publish_file(f, step, f"s{step}".encode()) for step in (1, 2, 3, 10)]
    f.wait()
    ckpts = f.sub("checkpoints")
    assert _listed(f) == names  # by step, not by text (10 after 3)
    assert prune(ckpts, 2) == ["step_00000001.pt", "step_00000002.pt"]
    assert _listed(f) == names[2:]
    assert not f.exists(names[0]) and not f.exists(names[1])
    kept = set_aside(ckpts, "step_00000010.pt")
    assert _listed(f) == [names[2]] and ckpts.exists(kept) and kept == "step_00000010.pt.corrupt"
    assert prune(ckpts, 0) == []  # keep_last=0: keep all


@pytest.mark.multiproc
@pytest.mark.server
def test_publish_prunes_after_the_commit(any_folder):
    f = any_folder
    names = []
    for step in (1, 2, 3, 4):
        name = f"checkpoints/step_{step:08d}.pt"
        f.publish(_stage_file(f, name, b"x"), name, then=lambda: prune(f.sub("checkpoints"), 2))
        names.append(name)
    f.wait()
    assert _listed(f) == names[2:] and not f.exists(names[0])


@pytest.mark.multiproc
@pytest.mark.server
def test_publishing_the_same_name_again_replaces_it(any_folder):
    f = any_folder
    name = _publish_file(f, 4, b"first")
    name = _publish_file(f, 4, b"second")  # waits for the first upload
    f.wait()
    assert _listed(f) == [name] and f.download(name).read_bytes() == b"second"


def test_local_temp_names_of_dead_writers_are_removed(tmp_path):
    f = RunFolder(tmp_path / "run")
    stage = _stage_file(f, "checkpoints/step_00000001.pt", b"half")  # this process's: alive
    dead = tmp_path / "run" / "checkpoints" / ".step_00000002.pt.tmp-999999999"
    dead.write_bytes(b"x")
    ranks = tmp_path / "run" / "checkpoints" / "step_00000007.ranks"  # per-rank files of no checkpoint
    ranks.mkdir()
    assert clean(f.sub("checkpoints")) == [dead.name, ranks.name] and stage.exists()
    f.put(stage, "checkpoints/step_00000001.pt")
    assert not stage.exists() and _listed(f) == ["checkpoints/step_00000001.pt"]


# ----------------------------------------------------------------------------- start-up check
def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.multiproc
@pytest.mark.server
def test_check_writable_passes_and_leaves_nothing(store):
    url = store.url("runs", "fresh-run")
    check_writable(url)
    assert RunFolder(url).listdir() == []


@pytest.mark.multiproc
@pytest.mark.server
def test_check_writable_names_a_missing_bucket(store):
    url = store.url("no-such-bucket-9", "runs/x")
    with pytest.raises(StorageError) as err:
        check_writable(url, timeout_s=20)
    message = _one_line(err)
    assert url in message and "bucket 'no-such-bucket-9' does not exist" in message


@pytest.mark.multiproc
@pytest.mark.server
def test_check_writable_is_bounded_for_an_unreachable_endpoint(store):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store.use(dead)
    try:
        t = time.monotonic()
        with pytest.raises(StorageError) as err:
            check_writable(store.url("runs", "x"), timeout_s=4)
        assert time.monotonic() - t < 6
    finally:
        store.use()
    message = _one_line(err)
    assert store.url("runs", "x") in message
    assert "within 4 s" in message or "connect" in message.lower(), message


@pytest.mark.multiproc
def test_check_writable_refused_credentials_s3():
    """moto checks signatures only with auth on (INITIAL_NO_AUTH_ACTION_COUNT=0): a moto server
    in its own process, where every access key is unknown."""
    port = free_port()
    env = dict(run_env(), INITIAL_NO_AUTH_ACTION_COUNT="0")
    server = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    script = textwrap.dedent(f"""
        import sys, time, urllib.request
        from vlp.checkpoint.storage import StorageError, check_writable
        for _ in range(200):
            try:
                urllib.request.urlopen("http://127.0.0.1:{port}/moto-api/", timeout=1); break
            except Exception:
                time.sleep(0.1)
        try:
            check_writable("s3://some-bucket/runs/x", timeout_s=20)
        except StorageError as e:
            print(e)
    """)
    from object_store import _COMMON_ENV

    try:
        out = subprocess.run([PYTHON, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=dict(run_env(), **_COMMON_ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}"))
    finally:
        server.terminate()
        server.wait(10)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout + out.stderr[-2000:]
    assert lines[0].startswith("train.output_dir=s3://some-bucket/runs/x: cannot write there: access denied"), lines


@pytest.mark.multiproc
@pytest.mark.parametrize("scheme,extra", [("s3", "vlp[s3]"), ("gs", "vlp[gcs]")])
def test_check_writable_names_the_missing_extra(scheme, extra):
    module = {"s3": "s3fs", "gs": "gcsfs"}[scheme]
    script = (f"import sys; sys.modules[{module!r}] = None\n"
              "from vlp.checkpoint.storage import StorageError, check_writable, RunFolder\n"
              f"try:\n    check_writable('{scheme}://b/run')\nexcept StorageError as e:\n    print(e)\n"
              f"try:\n    RunFolder('{scheme}://b/run')\nexcept StorageError as e:\n    print(e)\n")
    out = subprocess.run([PYTHON, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=60)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout + out.stderr[-2000:]
    for line in lines:
        assert f"{scheme}://b/run" in line and f"pip install '{extra}'" in line, line
