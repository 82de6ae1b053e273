"""`vlp compare`: grid expansion, equal budget, run loop (resume, retry, failure), table, plots."""
import csv
import json
from pathlib import Path

import pytest
import yaml

from vlp_testing import REPO
from vlp.eval.keys import EVAL_KEYS
from vlp.study import plots
from vlp.study import runs as study_runs
from vlp.study.compare import load_compare_config, run_grid
from vlp.study.grid import parse_grid
from vlp.config import steps_for
from vlp.study.plan import Arm, sweep_runs
from vlp.study.plots import mean_curve, plot_curves, plot_metric_vs_batch
from vlp.study.rows import DIAG_KEYS, read_log
from vlp.study.runs import run_config, stale_key
from vlp.study.tables import aggregate, markdown_table
from vlp.config import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _base(shards, samples=32):
    return {"model": {"name": "vlp-micro"},
            "data": {"train_shards": shards["train"], "eval_shards": shards["eval"], "shuffle_buffer": 64},
            "optim": {"lr": 2e-3}, "train": {"samples": samples}, "eval": {"batch_size": 64}}


def _grid(out, **kw):
    raw = {"losses": ["infonce", "flatnce"], "batch_per_device": [4, 8], "seeds": [0, 1],
           "out_dir": str(out), "warmup_samples": 8, "log_every_samples": 8, **kw}
    return parse_grid(raw)


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _check_png(path):
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as im:
        im.load()
        assert im.size[0] > 100 and im.size[1] > 100


def test_tiny_grid_end_to_end_then_rerun_skips_everything(tiny_shards, tmp_path, monkeypatch):
    grid = _grid(tmp_path / "cmp")
    rows = run_grid(_base(tiny_shards), grid)["final"]
    out = tmp_path / "cmp"
    csv_rows = _csv(out / "runs.csv")
    assert len(rows) == len(csv_rows) == 8
    assert sorted((r["loss"], int(r["batch_per_device"]), int(r["seed"])) for r in csv_rows) == sorted(
        (loss, b, s) for loss in ("infonce", "flatnce") for b in (4, 8) for s in (0, 1))
    for r in csv_rows:
        b = int(r["batch_per_device"])
        assert r["status"] == "ok" and r["error"] == ""
        assert int(r["global_batch"]) == b and int(r["steps"]) == 32 // b and int(r["samples_seen"]) == 32
        for key in EVAL_KEYS + DIAG_KEYS + ("wall_time_s",):
            assert r[key] != "", key
        assert 0.0 <= float(r["mean_R@1"]) <= 1.0
    # the curves are read from the Trainer's log: log_every = 8 samples // batch
    log = read_log(out / "infonce_b4_s0" / "log.jsonl")
    assert [rec["samples_seen"] for rec in log] == [8, 16, 24, 32]
    md = (out / "results.md").read_text()
    assert md.count("| infonce |") == 2 and md.count("| flatnce |") == 2 and "**" in md
    # grid.keep_checkpoints unset: a finished run keeps its checkpoints (to resume or evaluate)
    assert all(list((out / r["run"] / "checkpoints").glob("step_*")) for r in csv_rows)
    for name in ("metric_vs_batch.png", "curves.png"):
        _check_png(out / name)

    # rerun: every run has result.json, so nothing trains and the report is rebuilt identically
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(study_runs, "train_only", no_training)
    (out / "runs.csv").unlink()
    rows_again = run_grid(_base(tiny_shards), grid)["final"]
    assert rows_again == rows
    assert _csv(out / "runs.csv") == csv_rows


def _fake_train(calls, fail=lambda cfg: False):
    """A stand-in for one Trainer run: writes what the Trainer writes, instantly."""
    def train_once(cfg, accelerator):
        calls.append(Path(cfg.train.output_dir).name)
        out = Path(cfg.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        gb = cfg.data.batch_per_device
        steps = cfg.train.samples // gb
        with open(out / "log.jsonl", "a") as f:
            for step in range(1, steps + 1):
                f.write(json.dumps({"type": "train", "step": step, "samples_seen": step * gb, "infonce": 1.0 / step,
                                    "log_xi": 0.5, "grad_ratio": 0.9, "frac_saturated": 0.0, "ess_neg": 2.0,
                                    "acc": 0.5, "logit_scale": 14.0}) + "\n")
                if fail(cfg) and step == 1:
                    raise RuntimeError("CUDA out of memory (fake)\nsecond line")
        r1 = 0.1 * cfg.train.seed + (0.2 if cfg.loss.name == "flatnce" else 0.0)
        (out / "result.json").write_text(json.dumps({
            "step": steps, "samples_seen": steps * gb, "global_batch": gb, "train_time_s": 0.1,
            **{f"eval/{k}": r1 for k in EVAL_KEYS if not k.startswith("mean")}, "eval/chance_R@1": 0.025}))
        return {}
    return train_once


def test_crashed_run_is_retried_once_then_recorded_and_grid_continues(tiny_shards, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(study_runs, "train_only", _fake_train(
        calls, fail=lambda cfg: cfg.loss.name == "flatnce" and cfg.data.batch_per_device == 8))
    grid = _grid(tmp_path / "cmp")  # grid.retries unset: one retry
    rows = run_grid(_base(tiny_shards), grid)["final"]
    assert len(calls) == 8 + 2  # two failing runs, each tried twice
    assert calls.count("flatnce_b8_s0") == calls.count("flatnce_b8_s1") == 2
    failed = [r for r in rows if r["status"] != "ok"]
    assert {r["run"] for r in failed} == {"flatnce_b8_s0", "flatnce_b8_s1"}
    assert all(r["error"] == "RuntimeError: CUDA out of memory (fake)" for r in failed)
    assert all(r["steps"] == 1 and r["samples_seen"] == 8 for r in failed)  # from the log
    md = (tmp_path / "cmp" / "results.md").read_text()
    assert "| 8 | 8 | flatnce | 1 | 8 | 0/2 | — |" in md and "Failed runs: flatnce_b8_s0" in md
    # rerun: finished runs skipped, failed ones attempted again
    calls.clear()
    run_grid(_base(tiny_shards), grid)
    assert sorted(calls) == ["flatnce_b8_s0"] * 2 + ["flatnce_b8_s1"] * 2


def test_rerun_with_a_changed_budget_refuses_to_mix_results(tiny_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(study_runs, "train_only", _fake_train([]))
    grid = _grid(tmp_path / "cmp", losses=["infonce"], seeds=[0])
    run_grid(_base(tiny_shards), grid)
    with pytest.raises(ConfigError, match=r"infonce_b4_s0 was run with another config \(train.samples: 32"):
        run_grid(_base(tiny_shards, samples=64), grid)


def test_equal_budget_arithmetic(tiny_shards, tmp_path):
    assert steps_for(12288, 8) == 1536 and steps_for(12288, 128) == 96
    assert steps_for(12288, 32 * 4) == 96 and steps_for(12288, 32 * 4 * 2) == 48
    assert steps_for(1000, 128) == 7  # samples actually seen: 896, reported as such
    grid = _grid(tmp_path, warmup_samples=64, log_every_samples=16, batch_per_device=[2, 8])
    base = _base(tiny_shards, samples=128)
    runs = sweep_runs(grid)
    assert [r.name for r in runs[:4]] == ["infonce_b2_s0", "flatnce_b2_s0", "infonce_b8_s0", "flatnce_b8_s0"]
    for world in (1, 2):
        for run in runs:
            cfg = run_config(base, grid, run, world)
            gb = run.arm.batch_per_device * world
            assert (cfg.loss.name, cfg.data.batch_per_device, cfg.train.seed) == (
                run.arm.loss, run.arm.batch_per_device, run.seed)
            assert cfg.train.samples == 128 and cfg.optim.warmup_steps == 64 // gb
            assert cfg.train.log_every == max(1, 16 // gb)
            assert cfg.train.output_dir == str(tmp_path / run.name) and cfg.train.resume == "latest"
    with pytest.raises(ConfigError, match="gives 0 steps for infonce_b8_s0"):
        run_config(_base(tiny_shards, samples=4), grid, runs[2])


def test_loss_overrides_and_grid_validation(tmp_path):
    grid = parse_grid({"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0],
                       "loss_overrides": {"flatnce": {"loss": {"temperature": "split"}, "optim.lr": 1e-4}}})
    runs = {r.arm.loss: r for r in sweep_runs(grid)}
    base = {"train": {"samples": 64}}
    assert run_config(base, grid, runs["flatnce"]).loss.temperature == "split"
    assert run_config(base, grid, runs["flatnce"]).optim.lr == 1e-4
    assert run_config(base, grid, runs["infonce"]).loss.temperature == "learnable"
    good = {"losses": ["infonce"], "batch_per_device": [8], "seeds": [0]}
    bad = [
        (None, "needs a 'grid:' section"),
        ({**good, "batchsize": [8]}, "unknown key 'grid.batchsize'"),
        ({**good, "losses": ["nce"]}, "grid.losses: unknown loss 'nce'"),
        ({**good, "batch_per_device": []}, "grid.batch_per_device must be a non-empty list"),
        ({**good, "batch_per_device": [8, 0]}, "grid.batch_per_device values must be >= 1"),
        ({**good, "seeds": [0, 0]}, "grid.seeds has duplicates"),
        ({**good, "loss_overrides": {"siglip": {"optim.lr": 1.0}}}, "not one of grid.losses"),
        ({**good, "loss_overrides": {"infonce": {"train.seed": 3}}}, "set by the grid"),
        ({**good, "metric": "R@1"}, "grid.metric must be one of"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            parse_grid(raw)
    typo = parse_grid({**good, "loss_overrides": {"infonce": {"optim.lrr": 1.0}}})
    with pytest.raises(ConfigError, match="unknown key 'optim.lrr'"):
        run_config(base, typo, sweep_runs(typo)[0])


@pytest.mark.parametrize("name,runs,model", [("compare_small_batch.yaml", 240, "vlp-micro"),
                                             ("compare_gpu_vitb32.yaml", 144, "ViT-B-32"),
                                             ("compare_b8_lars.yaml", 24, "vlp-micro")])
def test_shipped_configs_load(name, runs, model):
    """The shipped configs are tuned studies (vlp/study/study.py): the map (4 losses x 3 batches x
    from scratch / LiT, AdamW) on CPU and GPU, and the batch-8 AdamW / LARS study."""
    from vlp.study.plan import sweep_runs

    base, grid = load_compare_config(REPO / "configs" / name)
    assert len(sweep_runs(grid)) == runs
    assert len(grid.final_seeds) >= (3 if name == "compare_b8_lars.yaml" else 4)
    for run in sweep_runs(grid):
        if run.arm.regime == "lit":  # its towers are built from PyPI packages; the config is what is checked here
            continue
        cfg = run_config(base, grid, run)
        assert cfg.model.name == model and cfg.optim.name == run.arm.optimizer
    base, grid = load_compare_config(REPO / "configs" / name, ["grid.seeds=[5]", "train.samples=4096"])
    assert grid.seeds == [5] and base["train"]["samples"] == 4096


def test_cli_hook_parses():
    from vlp.cli import build_parser, cmd_compare

    args = build_parser().parse_args(["compare", "-c", "x.yaml", "--report-only", "grid.seeds=[0]"])
    assert args.func is cmd_compare and args.report_only and args.overrides == ["grid.seeds=[0]"]
    assert build_parser().parse_args(["compare"]).config is None  # cmd_compare: the packaged default


# ---------------------------------------------------------------------------- pure functions
def _row(loss, batch, seed, r1, status="ok", infonce=2.0):
    return {"run": f"{loss}_b{batch}_s{seed}", "arm": Arm(loss=loss, batch_per_device=batch), "loss": loss,
            "batch_per_device": batch, "global_batch": 2 * batch,
            "seed": seed, "steps": 64 // batch, "samples_seen": 64, "status": status, "wall_time_s": 10.0,
            **{k: (r1 if status == "ok" else None) for k in EVAL_KEYS},
            **{k: (infonce if status == "ok" else None) for k in DIAG_KEYS}}


def test_aggregate_mean_std_and_bold_best_per_batch():
    rows = [_row("infonce", 8, 0, 0.10), _row("infonce", 8, 1, 0.20),
            _row("flatnce", 8, 0, 0.30), _row("flatnce", 8, 1, 0.50), _row("flatnce", 8, 2, 0.9, "failed"),
            _row("infonce", 32, 0, 0.40), _row("infonce", 32, 1, 0.40),
            _row("flatnce", 32, 0, 0.40), _row("flatnce", 32, 1, 0.40)]
    table = {(r["loss"], r["batch_per_device"]): r for r in aggregate(rows)}
    f8 = table[("flatnce", 8)]
    assert (f8["n_ok"], f8["n_runs"], f8["global_batch"], f8["steps"]) == (2, 3, 16, 8)
    assert f8["mean_R@1"][0] == pytest.approx(0.4) and f8["mean_R@1"][1] == pytest.approx(0.1414213, rel=1e-5)
    assert table[("infonce", 32)]["mean_R@1"] == pytest.approx((0.4, 0.0))
    md = markdown_table(list(table.values()), losses=["infonce", "flatnce"]).splitlines()
    assert [line.split(" | ")[2] for line in md[2:]] == ["infonce", "flatnce", "infonce", "flatnce"]
    i8, f8_line, i32, f32 = md[2:]
    assert "| 15.0 ± 7.1 |" in i8 and "| **40.0 ± 14.1** |" in f8_line and "| 2/3 |" in f8_line
    assert i32.count("**40.0 ± 0.0**") == 8 and f32.count("**40.0 ± 0.0**") == 8  # ties: both bold
    assert "**2" not in f8_line  # diagnostics (InfoNCE, logit scale) are never bolded
    only_failed = aggregate([_row("siglip", 8, 0, 0.0, "failed")])
    assert only_failed[0]["mean_R@1"] is None and "| — |" in markdown_table(only_failed)


def test_plots_have_one_series_per_loss_and_per_loss_batch(tmp_path):
    rows = [_row(loss, b, s, 0.1 * s + b / 100) for loss in ("infonce", "flatnce", "siglip")
            for b in (8, 32) for s in (0, 1, 2)]
    fig = plot_metric_vs_batch(aggregate(rows), "mean_R@1", path=tmp_path / "m.png", chance=0.01)
    ax = fig.axes[0]
    assert len(ax.containers) == 3  # one errorbar series per loss
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["chance", "flatnce", "infonce", "siglip"]
    assert ax.get_xscale() == "log"
    _check_png(tmp_path / "m.png")

    def log(seed, gb):
        return [{"step": k, "samples_seen": k * gb, **{key: seed + k for key in plots.CURVE_KEYS}}
                for k in range(1, 5)]

    curves = {Arm(loss=loss, batch_per_device=b): [log(s, b) for s in (0, 1, 2)] for loss in ("infonce", "flatnce") for b in (8, 32)}
    fig = plot_curves(curves, path=tmp_path / "c.png")
    panels = [ax for ax in fig.axes if ax.get_title() in plots.CURVE_KEYS]
    assert len(panels) == len(plots.CURVE_KEYS)
    assert all(len(ax.get_lines()) == 4 for ax in panels)  # loss x batch
    _check_png(tmp_path / "c.png")
    assert sorted(t.get_text() for t in fig.axes[-1].get_legend().get_texts()) == [
        "flatnce/b32", "flatnce/b8", "infonce/b32", "infonce/b8"]
    xs, ys = mean_curve(curves[Arm(loss="infonce", batch_per_device=8)], "infonce")
    assert xs == [8, 16, 24, 32] and ys == [2.0, 3.0, 4.0, 5.0]  # mean over seeds 0, 1, 2


def test_read_log_keeps_training_records_last_one_per_step(tmp_path):
    """Records are selected by their "type" (vlp/records.py), whatever keys they carry."""
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"type": "train", "step": 1, "samples_seen": 8, "infonce": 3.0},
        {"type": "train", "step": 2, "samples_seen": 16, "infonce": 2.0},
        {"type": "train", "step": 2, "samples_seen": 16, "infonce": 2.5},  # replayed after a resume
        {"type": "nonfinite", "step": 3, "samples_seen": 24, "nonfinite": 1.0, "infonce": 9.0},
        {"type": "eval", "step": 2, "eval/image_to_text_R@1": 0.1, "infonce": 9.0},
        {"type": "result", "step": 2, "samples_seen": 16, "train_time_s": 1.0},
    ]) + '\n{"type": "train", "step": 3, "samp')
    assert [(r["step"], r["infonce"]) for r in read_log(path)] == [(1, 3.0), (2, 2.5)]


def test_stale_check_ignores_harmless_and_newly_added_keys():
    saved = {"train": {"samples": 32, "log_every": 1, "output_dir": "a"}, "model": {"name": "vlp-micro"}}
    now = {"train": {"samples": 32, "log_every": 4, "output_dir": "b"},
           "model": {"name": "vlp-micro", "lock_image": False}}  # a Config field added after the run
    assert stale_key(saved, now) is None
    assert stale_key(saved, {**now, "model": {"name": "ViT-B-32"}}) == (
        "model.name: 'vlp-micro' then, 'ViT-B-32' now")


@pytest.mark.multiproc
def test_a_worker_dies_with_its_parent_even_when_it_ignores_sigterm(tmp_path):
    """The Executor's worker initializer (PR_SET_PDEATHSIG = SIGKILL): a worker that ignores
    SIGTERM (as a Trainer run handles it: a preemption, then a retry) still ends when the
    process that made it is SIGKILLed."""
    import signal
    import subprocess
    import time

    from vlp_testing import PYTHON, run_env

    parent = subprocess.Popen([PYTHON, "-c", (
        "import multiprocessing, os, signal, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from vlp.executors.local import die_with_parent\n"
        "pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'),\n"
        "                           initializer=die_with_parent, initargs=(os.getpid(),))\n"
        "pool.submit(signal.signal, signal.SIGTERM, signal.SIG_IGN).result()\n"
        "print(pool.submit(os.getpid).result(), flush=True)\n"
        "pool.submit(time.sleep, 600)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, env=run_env(), cwd=tmp_path)
    try:
        worker = int(parent.stdout.readline())
        assert worker != parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=60)
        deadline = time.time() + 60

        def alive(pid):
            try:
                state = open(f"/proc/{pid}/status").read().split("State:")[1].split()[0]
            except (FileNotFoundError, IndexError):
                return False
            return state != "Z"  # a zombie has ended; its new parent reaps it when it can

        while alive(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(worker), "the worker outlived its parent"
    finally:
        parent.kill()
