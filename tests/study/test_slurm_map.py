"""`vlp compare` with grid.executor=slurm on a real 2-node SLURM cluster on 127.0.0.1 with accounting
(tests/support/slurm_cluster.py: slurmdbd on a private MariaDB), and one without: each run is one
job (vlp/executors/slurm.py, vlp/executors/batch.py). A tiny plain grid (2 runs of vlp-micro), its out_dir in
moto's S3 bucket, gives the local executor's runs.csv, and a tiny tuned study on a LiT regime (its
feature caches built by a warm-up job first) its study.json; so does a map with one job
scancelled mid-run and the other requeued underneath the driver, and one whose driver is killed
mid-map (SIGHUP, then SIGKILL) and started again (no run submitted twice). A run on two nodes is
one job of two processes. Ctrl-C leaves the jobs; --status and --cancel. A run that always fails
is reported with its reason after grid.retries; bad executor settings are one line each, before
any submission. The `vlp compare` drivers fork from the pre-imported server (tests/support/forked.py:
a real process each; the jobs are exec'd by SLURM). Skipped with the reason where SLURM is not
installed; under CI=true that skip is a failure."""
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import forked
from object_store import start_s3
from slurm_cluster import SlurmCluster, job_runs, missing
from vlp_testing import REPO

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

RUNS = ("infonce_b8_s0", "flatnce_b8_s0")
STEPS = 60  # per run: 480 samples at batch 8, a checkpoint every 10 steps
SAME = ("run", "status", "steps", "samples_seen", "mean_R@1", "mean_R@5", "mean_R@10", "image_to_text_R@1", "text_to_image_R@1",
        "infonce", "logit_scale")


def need(accounting: bool) -> None:
    why = missing(accounting)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    need(accounting=True)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm_acct"), accounting=True).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def cancel_what_a_test_leaves(request):
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        subprocess.run(["scancel", "--user", str(os.getuid())], env=c.env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server in this process (tests/support/object_store.py), bucket `runs`: a grid.out_dir
    that the driver and the jobs on the cluster reach through AWS_ENDPOINT_URL (env_of)."""
    import logging

    quiet = logging.getLogger("werkzeug")  # moto's request log
    was, quiet.disabled = quiet.disabled, True
    store = start_s3()
    store.make_bucket("runs")
    yield store
    store.stop()
    quiet.disabled = was


def write_config(tmp: Path, shards: dict, **grid) -> Path:
    cfg = {"model": {"name": "vlp-micro"},
           "data": {"train_shards": shards["train"], "eval_shards": shards["eval"], "shuffle_buffer": 64},
           "optim": {"lr": 2e-3}, "train": {"samples": STEPS * 8, "checkpoint_every": 10, "keep_last": 1},
           "eval": {"batch_size": 64},
           "grid": {"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0],
                    "out_dir": str(tmp / "grid"), "warmup_samples": 8, "log_every_samples": 8,
                    "executor": "slurm", "slurm": {"poll_s": 0.5, "time": 10}, **grid}}
    path = tmp / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def env_of(c, store=None) -> dict:
    """The driver's environment (sbatch passes it on to the jobs): the cluster's, and the object
    store's endpoint and keys where grid.out_dir is in its bucket."""
    return dict(c.env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                **(store.env if store is not None else {}))


def compare(c, config: Path, *args: str, timeout: float = 400, store=None) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "vlp", "compare", "-c", str(config), *args], cwd=config.parent,
                      env=env_of(c, store), capture_output=True, text=True, timeout=timeout)


def driver(c, config: Path, *args: str, **popen) -> forked.Popen:
    """`vlp compare -c config ARGS` started (a real process, forked from the pre-imported server)."""
    return forked.Popen([sys.executable, "-m", "vlp", "compare", "-c", str(config), *args], cwd=config.parent,
                        env=env_of(c), **popen)


def table(out: Path) -> list[dict]:
    with open(out / "runs.csv") as f:
        return sorted(({k: r[k] for k in SAME} for r in csv.DictReader(f)), key=lambda r: r["run"])


def submitted(out: Path) -> dict[str, list[str]]:
    """Per run folder: the ids of the jobs submitted for it (job.json; a submission whose id is not
    written yet, in the instant of its sbatch, is left out)."""
    return {d.name: [j["id"] for j in json.loads((d / "job.json").read_text())["jobs"] if "id" in j]
            for d in sorted(out.iterdir()) if (d / "job.json").exists()} if out.is_dir() else {}


def sacct_names(c, ids: list[str]) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", "JobName"], env=c.env,
                         capture_output=True, text=True, check=True).stdout
    return sorted(out.split())


@pytest.fixture(scope="module")
def local_table(tiny_shards, tmp_path_factory):
    """The same grid by the local executor: the table every SLURM map must give."""
    tmp = tmp_path_factory.mktemp("local")
    config = write_config(tmp, tiny_shards, executor="local")
    proc = forked.run([sys.executable, "-m", "vlp", "compare", "-c", str(config)], cwd=tmp,
                      env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
                      capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table(tmp / "grid")
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["steps"] == str(STEPS) for r in rows), rows
    return rows


def wait_for(what: str, ready, limit_s: float = 300):
    deadline = time.time() + limit_s
    while time.time() < deadline:
        found = ready()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {limit_s} s")


def logged_step(folder: Path) -> int:
    log = folder / "log.jsonl"
    steps = [json.loads(x).get("step", 0) for x in log.read_text().splitlines()] if log.exists() else []
    return max(steps, default=0)


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def held_past(out: Path, ids: dict[str, str], step: int):
    """Each run's process stopped (SIGSTOP) as soon as its log passes `step`, for the block, then
    continued: what the block does to the jobs lands mid-run however fast the rest of a run would
    go (a 60-step run ends ~4 s after its step 12 on a quiet box; a requeue that came after its
    result.json found it done)."""
    pids = {n: wait_for(f"{n}'s run process", lambda i=i: job_runs(int(i)), 120)[0] for n, i in ids.items()}
    stopped = []
    try:
        deadline = time.time() + 300
        while len(stopped) < len(pids):
            for n, pid in pids.items():
                if pid not in stopped and logged_step(out / n) >= step:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            assert time.time() < deadline, f"not every run past step {step} within 300 s"
            time.sleep(0.02)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_tiny_grid_on_slurm_gives_the_local_table_one_job_per_run(cluster, tiny_shards, tmp_path, local_table, s3):
    """grid.out_dir in a bucket (moto's S3 on loopback): the driver writes each run's job files there,
    each job reads its spec from its run's URL and trains into it; the job script and SLURM's output
    are in a local folder (slurm-logs/<bucket>/<path>/<run> under the working directory)."""
    url = s3.url("runs", f"grid-{tmp_path.name}")
    config = write_config(tmp_path, tiny_shards, out_dir=url)
    proc = compare(cluster, config, store=s3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "grid").exists()
    keys = set(s3.fs().find(url[5:]))
    for name in ("runs.csv", "results.md", *(f"{run}/{f}" for run in RUNS for f in (
            "job_spec.json", "job.json", "result.json", "compare.json", "log.jsonl"))):
        assert f"{url[5:]}/{name}" in keys, (name, sorted(keys))
    out = tmp_path / "grid"  # the bucket's files, fetched: what a user reads
    s3.fs().get(url[5:], str(out), recursive=True)
    assert table(out) == local_table
    ids = submitted(out)
    assert sorted(ids) == ["flatnce_b8_s0", "infonce_b8_s0"] and all(len(v) == 1 for v in ids.values()), ids
    assert len(set(sacct_names(cluster, [i for v in ids.values() for i in v]))) == 2
    assert "accounting is off" not in proc.stdout
    for run, (job,) in ids.items():
        logs = tmp_path / "slurm-logs" / url[5:] / run
        assert (logs / f"slurm-{job}.out").exists(), sorted(p.name for p in logs.parent.rglob("*"))
        assert (logs / "job.sh").read_text().rstrip().endswith(f"-m vlp.executors.job {url}/{run}")
    status = compare(cluster, config, "--status", store=s3)
    assert status.returncode == 0 and "2 done" in status.stdout, status.stdout + status.stderr


@pytest.fixture(scope="module")
def study_config(tmp_path_factory):
    """A tuned study's config (2 losses x 2 rates, seed 0 on val, then seeds 0 and 1 on test: two
    steps, six ranked runs) on tiny fit / val / test shards; its out_dir and its feature cache
    given per run. Its one regime, lit, trains on locked towers' features (vlp-micro's, locked:
    cheaper than a pretrained LiT pair, the same path) cached in a folder (a warm-up first) and has job resources of its own (grid.slurm.regimes: a 9-minute limit)."""
    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    root = tmp_path_factory.mktemp("study_shards")
    shards = {split: write_shards(load_pairs(split, image_size=32)[:n], root / split, prefix=split,
                                  samples_per_shard=64).spec for split, n in (("fit", 96), ("val", 24), ("test", 24))}
    return {"model": {"name": "vlp-micro"},
            "data": {"train_shards": shards["fit"], "eval_shards": shards["val"], "shuffle_buffer": 32},
            "train": {"samples": 32}, "eval": {"batch_size": 64},
            "grid": {"losses": ["infonce", "sogclr"], "batch_per_device": [8], "seeds": [0], "final_seeds": [0, 1],
                     "optimizers": ["adamw"], "sweep": {"optim.lr": [1e-4, 3e-3]}, "test_shards": shards["test"],
                     "metric": "mean_R@10", "keep_checkpoints": False, "regimes": {"lit": {
                         "model.lock_image": True, "model.lock_text": True, "data.train_transform": "eval"}},
                     "slurm": {"poll_s": 0.5, "time": 10, "regimes": {"lit": {"time": 9}}}}}


def study_numbers(out: Path):
    """study.json less what the clock decides (samples/s, memory, times)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not any(w in k for w in ("samples_per_s", "mem_mb", "time"))}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads((out / "study.json").read_text()))


def test_a_tiny_study_on_slurm_gives_the_local_study_json(cluster, study_config, tmp_path):
    """Ranked runs (train_and_rank with the val / test specs from job_spec.json) and a second step
    planned from the first's results (the final seeds): study.json as the local executor writes it.
    The lit regime's feature caches are built by one job of their own (warm_lit/), which ended
    before any of its runs started. Every job has its regime's time limit
    (grid.slurm.regimes.lit.time), not grid.slurm's, the warm-up's too."""
    outs, caches = {}, {}
    for executor in ("local", "slurm"):
        config = tmp_path / f"{executor}.yaml"
        outs[executor], caches[executor] = tmp_path / executor, tmp_path / f"features_{executor}"
        lit = {**study_config["grid"]["regimes"]["lit"], "data.feature_cache": str(caches[executor])}
        tree = {**study_config, "grid": {**study_config["grid"], "executor": executor, "out_dir": str(outs[executor]),
                                         "regimes": {"lit": lit}}}
        config.write_text(yaml.safe_dump(tree))
        proc = compare(cluster, config)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert study_numbers(outs["slurm"]) == study_numbers(outs["local"])
    ids = submitted(outs["slurm"])
    (warm,) = ids.pop("warm_lit")  # one warm-up job, submitted once
    assert len(ids) == 6 and all(len(v) == 1 for v in ids.values()), ids
    limits = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(i for v in ids.values() for i in v), "-o",
                             "Timelimit"], env=cluster.env, capture_output=True, text=True, check=True).stdout.split()
    assert limits == ["00:09:00"] * 6, limits
    rows = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join([warm, *(i for v in ids.values() for i in v)]),
                           "-o", "JobID,JobName,State,Timelimit,Start,End"], env=cluster.env, capture_output=True,
                          text=True, check=True).stdout.splitlines()
    jobs = {r.split("|")[0]: r.split("|")[1:] for r in rows}  # id: name, state, limit, start, end
    assert jobs[warm][0].startswith("vlp-warm_lit-") and jobs[warm][1:3] == ["COMPLETED", "00:09:00"], jobs[warm]
    assert all(jobs[warm][4] <= jobs[i][3] for v in ids.values() for i in v), jobs  # it ended before they started
    built = json.loads((outs["slurm"] / "warm_lit" / "result.json").read_text())
    assert built["feature_cache"] == str(caches["slurm"]) and list(caches["slurm"].glob("*.pt")), built


def test_a_run_on_two_nodes_is_one_job_of_two_processes(cluster, tiny_shards, tmp_path):
    """grid.slurm.nodes=2: srun starts one `accelerate launch` per node (one CPU process each, gloo);
    the driver plans the run for that world (global batch 16: 30 steps)."""
    config = write_config(tmp_path, tiny_shards, losses=["infonce"], slurm={"poll_s": 0.5, "time": 10, "nodes": 2})
    proc = compare(cluster, config)
    out = tmp_path / "grid"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + "".join(
        p.read_text()[-3000:] for p in out.glob("*/slurm-*.out"))
    with open(out / "runs.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["status"], row["global_batch"], row["steps"], row["samples_seen"]) == ("ok", "16", str(STEPS // 2), "480")
    (job,) = submitted(out)["infonce_b8_s0"]
    assert cluster.job(int(job))["NumNodes"] == "2"


def test_one_job_scancelled_and_one_requeued_mid_run_give_the_same_table(cluster, tiny_shards, tmp_path, local_table):
    """Both runs past a checkpoint: infonce's job is scancelled (the driver resubmits it, one line),
    flatnce's is requeued underneath the driver (scontrol requeue: what a preemption or a lost node
    does; the same job id runs again and resumes from its checkpoint, the driver neither resubmits
    nor gives up, --status says requeued 1). The table is the local one."""
    config, out = write_config(tmp_path, tiny_shards), tmp_path / "grid"
    running = driver(cluster, config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("both runs training", lambda: all(logged_step(out / n) >= 1 for n in RUNS))
        ids = {n: submitted(out)[n][0] for n in RUNS}
        with held_past(out, ids, step=12):  # each run stopped once past its first checkpoint
            cancelled, requeued = ids["infonce_b8_s0"], ids["flatnce_b8_s0"]
            subprocess.run(["scancel", cancelled], env=cluster.env, check=True)
            subprocess.run(["scontrol", "requeue", requeued], env=cluster.env, check=True)
            wait_for("SLURM's cancel and requeue reached the jobs", lambda: all(
                "CANCELLED AT" in read(out / n / f"slurm-{ids[n]}.out") for n in RUNS), 120)
        status = wait_for("--status saying requeued 1",
                          lambda: f"| requeued 1 | {requeued} |" in compare(cluster, config, "--status").stdout, 120)
        cluster.release(int(requeued))
        text, _ = running.communicate(timeout=400)
    finally:
        running.kill()
    assert running.returncode == 0, text[-4000:]
    assert f"infonce_b8_s0: job {cancelled} CANCELLED" in text and "resubmitted (retry 1 of 1)" in text, text[-3000:]
    assert text.count("resubmitted") == 1 and status, text[-3000:]
    assert table(out) == local_table
    assert len(submitted(out)["infonce_b8_s0"]) == 2 and submitted(out)["flatnce_b8_s0"] == [requeued]


def test_the_driver_killed_mid_map_reattaches_and_submits_no_run_twice(cluster, tiny_shards, tmp_path, local_table):
    """The driver killed while both jobs are in flight, by SIGHUP (a closed terminal; SIGTERM has
    the same default action), started again and killed by SIGKILL, then started once more: each
    start re-attaches, no run is submitted twice, and the table is the local one. The jobs are
    suspended (scontrol suspend) while the drivers come and go, so that they are still in flight
    whatever the box's speed."""
    config = write_config(tmp_path, tiny_shards)
    out = tmp_path / "grid"
    first = driver(cluster, config, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for("both runs submitted and one training", lambda: len(submitted(out)) == 2 and all(
            submitted(out).values()) and any(logged_step(out / name) >= 1 for name in submitted(out)))
    finally:
        os.killpg(first.pid, signal.SIGHUP)
        assert first.wait(timeout=30) == -signal.SIGHUP
    jobs = submitted(out)
    ids = [i for v in jobs.values() for i in v]
    wait_for("both jobs running", lambda: all(cluster.job(int(i))["JobState"] in ("RUNNING", "COMPLETED") for i in ids))
    for i in ids:
        subprocess.run(["scontrol", "suspend", i], env=cluster.env, capture_output=True)
    for kill in (signal.SIGKILL, None):
        lines: list[str] = []
        again = driver(cluster, config, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       start_new_session=True)
        reader = threading.Thread(target=lambda: lines.extend(again.stdout), daemon=True)
        reader.start()
        try:
            wait_for("the rerun re-attached", lambda: any("re-attached to 2" in x for x in lines), 120)
        finally:
            if kill is None:
                for i in ids:
                    subprocess.run(["scontrol", "resume", i], env=cluster.env, capture_output=True)
            else:
                os.killpg(again.pid, kill)
        assert again.wait(timeout=400) == (-kill if kill else 0), "".join(lines)[-4000:]
        reader.join(10)
        assert submitted(out) == jobs, (jobs, submitted(out))  # no new submission
    assert table(out) == local_table
    assert len(sacct_names(cluster, ids)) == 2


def test_ctrl_c_stops_submitting_leaves_the_jobs_then_status_and_cancel(cluster, tiny_shards, tmp_path):
    """Ctrl-C (SIGINT) to the driver with one run in flight and one waiting (max_in_flight=1): one
    line, exit 130, the job runs on (suspended here, so it is still in flight), nothing else is
    submitted; --status shows it, --cancel cancels it."""
    config = write_config(tmp_path, tiny_shards)
    out = tmp_path / "grid"
    running = driver(cluster, config, "grid.slurm.max_in_flight=1", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, start_new_session=True)
    try:
        wait_for("one run training", lambda: any(logged_step(out / name) >= 1 for name in submitted(out)))
        (job,) = [i for v in submitted(out).values() for i in v]
        subprocess.run(["scontrol", "suspend", job], env=cluster.env, check=True)
        os.kill(running.pid, signal.SIGINT)
        stdout, stderr = running.communicate(timeout=60)
    finally:
        running.kill()
    assert running.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert stderr.strip().splitlines() == [
        "vlp: interrupted (Ctrl-C): nothing more is submitted; the 1 slurm job(s) in flight run on. "
        "Run the same command to re-attach, or add --cancel to cancel them"], stderr
    assert cluster.job(int(job))["JobState"] == "SUSPENDED" and len(submitted(out)) == 1
    status = compare(cluster, config, "--status", timeout=120)
    assert status.returncode == 0 and "| pending | " + job in status.stdout and "1 pending" in status.stdout, status.stdout
    cancel = compare(cluster, config, "--cancel", timeout=120)
    assert cancel.stdout.strip() == f"vlp: cancelled 1 job(s) of {out}", cancel.stdout + cancel.stderr
    wait_for("the job cancelled", lambda: cluster.job(int(job))["JobState"] == "CANCELLED", 60)


def test_a_run_that_always_fails_is_reported_with_its_reason_after_the_retries(cluster, tiny_shards, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    config = write_config(tmp_path, tiny_shards, retries=1,
                          loss_overrides={"flatnce": {"model.pretrained": str(garbage)}})
    proc = compare(cluster, config)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("vlp: error:")]
    assert len(errors) == 1 and "1 run(s) failed" in errors[0] and "flatnce_b8_s0" in errors[0], proc.stderr[-2000:]
    assert "flatnce_b8_s0: job" in proc.stdout and "resubmitted (retry 1 of 1)" in proc.stdout
    out = tmp_path / "grid"
    record = json.loads((out / "flatnce_b8_s0" / "compare.json").read_text())
    assert record["status"] == "failed" and record["error"].startswith("2 attempts, the last job ") and "FAILED: ValueError: model.pretrained" in record["error"], record
    assert len(submitted(out)["flatnce_b8_s0"]) == 2
    rows = {r["run"]: r for r in table(out)}
    assert rows["infonce_b8_s0"]["status"] == "ok" and rows["flatnce_b8_s0"]["status"] == "failed"
    assert f"Failed runs: flatnce_b8_s0 ({record['error']})" in (out / "results.md").read_text()
    status = compare(cluster, config, "--status")
    assert "1 done" in status.stdout and "1 failed" in status.stdout, status.stdout


@pytest.mark.parametrize("setting, words", [
    ("grid.slurm.partition=nope", "no such partition (it has high, main)"),
    ("grid.slurm.time=0", "grid.slurm.time must be > 0"),
    ("grid.slurm.gpus_per_node=1", "partition main has no GPUs"),
    ("grid.slurm.nodes=3", "partition main has 2 node(s)"),
])
def test_bad_executor_settings_are_one_line_before_anything_is_submitted(cluster, tiny_shards, tmp_path, setting, words):
    config = write_config(tmp_path, tiny_shards)
    proc = compare(cluster, config, setting, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlp: error:") and words in lines[0], proc.stderr
    assert not (tmp_path / "grid").exists() or not submitted(tmp_path / "grid")
    queue = subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout
    assert queue.strip() == ""


def test_a_job_is_found_by_its_name(cluster, tmp_path, monkeypatch):
    """Slurm.find: what a rerun asks when the driver died before writing a job's id (sacct here)."""
    from vlp.config.grid_keys import SlurmConfig
    from vlp.executors.slurm import Slurm

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", cluster.env["PATH"])
    since = time.time()
    job = cluster.sbatch(["--job-name=vlp-x-abc123", "--wrap=sleep 1", f"--output={tmp_path}/%j.out"])
    slurm = Slurm(SlurmConfig())
    assert wait_for("sacct's row", lambda: slurm.find("vlp-x-abc123", since), 30) == str(job)
    assert slurm.find("vlp-y-abc123", since) is None


def test_a_cluster_without_accounting_runs_the_map_from_squeue(tiny_shards, tmp_path, local_table, tmp_path_factory):
    need(accounting=False)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm_noacct"), accounting=False).start()
    try:
        config = write_config(tmp_path, tiny_shards)
        proc = compare(c, config)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stdout.count("SLURM accounting is off") == 1, proc.stdout
        assert table(tmp_path / "grid") == local_table
        assert all(len(v) == 1 for v in submitted(tmp_path / "grid").values())
    finally:
        c.stop()
