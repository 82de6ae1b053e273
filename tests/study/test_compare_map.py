"""The small-batch map (`vlp compare` with grid.regimes, several batches and grid.accum_price) on a
tiny grid: both regimes (from scratch; locked towers with the feature cache) run in worker
processes, the report has the map, the cost table with the accumulation rows and both figures,
and a rerun trains nothing."""
import json
import math

import pytest

from test_compare_study import study_shards  # noqa: F401  (fixture: tiny fit / val / test shards)
from lit_fixtures import bert_dir, timm_json  # noqa: F401  (fixtures: a tiny LiT model)
from jobs_here import JobsHere
from vlp.config import ConfigError
from vlp.executors import local
from vlp.study import tables
from vlp.study.rows import final_table
from vlp.study.compare import run_grid
from vlp.study.grid import parse_grid
from vlp.study.plan import Arm, price_runs, sweep_runs


def _grid(out, timm_json, bert_dir, **extra):
    return parse_grid({
        "losses": ["infonce", "flatnce"], "batch_per_device": [4, 8], "seeds": [0], "final_seeds": [0, 1],
        "optimizers": ["adamw"], "sweep": {"optim.lr": [1e-3, 3e-3]}, "out_dir": str(out),
        "metric": "mean_R@10", "keep_checkpoints": False, "workers": 2,
        "regimes": {"scratch": {}, "lit": {
            "model.name": timm_json, "model.hf_text_dir": bert_dir, "model.lock_image": True,
            "model.lock_text": True, "data.train_transform": "eval",
            "data.feature_cache": str(out.parent / "features"), "sweep": {"adamw": {"optim.lr": [1e-2]}}}},
        "accum_price": {"batch_per_device": 4, "accum_steps": 2, "samples": 16}, **extra})


def test_tiny_map_two_regimes_workers_report_and_rerun(study_shards, tmp_path, timm_json, bert_dir, monkeypatch):
    out = tmp_path / "map"
    base = {"model": {"name": "vlp-micro"},
            "data": {"train_shards": study_shards["fit"], "eval_shards": study_shards["val"], "shuffle_buffer": 16},
            "train": {"samples": 32}, "eval": {"batch_size": 24}}
    grid = _grid(out, timm_json, bert_dir, test_shards=study_shards["test"])
    assert len(sweep_runs(grid)) == 2 * 2 * 2 + 2 * 2 * 1  # scratch: 2 lrs; lit: its own 1-lr sweep
    result = run_grid(base, grid)
    rows = result["sweep"] + result["final"] + result["price"]
    assert rows and all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows if r["status"] != "ok"]
    assert {r["regime"] for r in result["final"]} == {"scratch", "lit"}
    assert len(result["final"]) == 2 * 2 * 2 * 2 and len(result["price"]) == 2 * 2
    for r in result["final"] + result["price"]:
        assert r["samples_per_s"] > 0 and r["peak_step_mem_mb"] > 0
    assert {r["accum"] for r in result["price"]} == {2} and all(r["global_batch"] == 8 for r in result["price"])
    assert (tmp_path / "features").is_dir() and list((tmp_path / "features").glob("*.pt"))  # cache built once
    text = (out / "study.md").read_text()
    assert "## The map (test)" in text and "## Cost per cell" in text
    assert "**scratch**" in text and "**lit**" in text and "8 = 4 × 2 accumulated" in text
    assert "scratch, adamw, batch 4: Paired by seed" in text and "lit, adamw, batch 8: Paired by seed" in text
    for png in ("map.png", "mechanism.png", "final.png", "curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "study.json").read_text())
    assert len(summary["price"]) == 4 and {e["regime"] for e in summary["final"]} == {"scratch", "lit"}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(local, "run_job", no_training)
    again = run_grid(base, grid)
    assert again["best"] == result["best"] and again["final"] == result["final"]


def test_on_a_batch_scheduler_the_lit_caches_are_a_job_before_the_runs(study_shards, tmp_path, timm_json, bert_dir,
                                                                      monkeypatch):
    """grid.executor=slurm (SLURM's commands answered here, tests/support/jobs_here.py): lit's feature
    caches are built by a job of their own (warm_lit/, `vlp.executors.job` reading its job_spec.json),
    with the regime's resources (grid.slurm.regimes.lit), before its run's job."""
    from vlp.executors import batch
    from vlp.executors.slurm import Slurm

    here = JobsHere()
    monkeypatch.setattr(batch, "scheduler_of", lambda grid: Slurm(grid.slurm, cwd=tmp_path, run=here))
    monkeypatch.setattr(local, "warm_caches", lambda *a: pytest.fail("the driver built the caches itself"))
    out = tmp_path / "map"
    lit = _grid(out, timm_json, bert_dir).regimes["lit"]["set"]
    grid = parse_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "optimizers": ["adamw"],
                       "sweep": {"optim.lr": [1e-2]}, "out_dir": str(out), "metric": "mean_R@10",
                       "test_shards": study_shards["test"], "regimes": {"lit": lit}, "executor": "slurm",
                       "slurm": {"poll_s": 0.2, "time": 60, "regimes": {"lit": {"time": 5}}}})
    base = {"model": {"name": "vlp-micro"},
            "data": {"train_shards": study_shards["fit"], "eval_shards": study_shards["val"], "shuffle_buffer": 16},
            "train": {"samples": 32}, "eval": {"batch_size": 24}}
    result = run_grid(base, grid)
    assert [r["status"] for r in result["final"]] == ["ok"], result["final"]
    assert here.submitted() == [str(out / "warm_lit"), str(out / "lit_infonce_adamw_b8_lr0.01_s0")]
    assert all("--time=5" in c for c in here.calls if c[0] == "sbatch")
    assert json.loads((out / "warm_lit" / "result.json").read_text())["feature_cache"] == str(tmp_path / "features")
    assert list((tmp_path / "features").glob("*.pt"))


def test_map_tables_and_mechanism_by_hand():
    def cell(regime, loss, batch, mean, sigma, diff=None):
        return {"arm": Arm("", regime, loss, "adamw", batch), "dataset": "", "regime": regime, "loss": loss,
                "optim": "adamw", "batch_per_device": batch, "setting": (),
                "n": 4, "mean_R@10": {"mean": mean, "std": 0.01, "lo": mean - 0.02, "hi": mean + 0.02},
                "grad_ratio": {"mean": sigma}, "logit_scale": {"mean": 14.0},
                "samples_per_s": {"mean": 100.0 * batch}, "peak_step_mem_mb": {"mean": 10.0 + batch},
                "diff/mean_R@10": diff}
    d = {"mean": 0.03, "std": 0.01, "lo": 0.01, "hi": 0.05, "resolved": True, "n": 4}
    table = [cell("lit", "infonce", 8, 0.5, 0.002), cell("lit", "flatnce", 8, 0.53, 0.003, d),
             cell("lit", "infonce", 128, 0.4, 0.9), cell("lit", "flatnce", 128, 0.4, 0.9, {**d, "mean": 0.0,
                                                                                           "lo": -0.01, "resolved": False})]
    text = tables.map_markdown(table, "mean_R@10")
    assert "| 8 | flatnce | adamw | base | 4 | 53.0 ± 1.0 [51.0, 55.0] | +3.0 [+1.0, +5.0] ✓ | — | 0.003 | 14.0 |" in text
    points = tables.mechanism_points(table, "mean_R@10")
    assert [(p["batch_per_device"], p["sigma_v"]) for p in points] == [(8, 0.002), (128, 0.9)]
    price = [{"status": "ok", "arm": Arm("", "lit", "infonce", "adamw", 8), "accum": 16, "samples_per_s": 300.0,
              "peak_step_mem_mb": 11.0}]
    cost = tables.cost_markdown(table, price, "mean_R@10")
    assert "| 128 = 8 × 16 accumulated | infonce | 300 | 11.0 | 40.0 ± 1.0 [38.0, 42.0] (= batch 128) |" in cost


def test_holm_and_the_mechanism_fit_on_every_cell_by_hand():
    """Three seeds, batch 8 and 128. Batch 8: Δ = .05, .06, .05 (t = 16 with 2 df: p = 1 - 16 / sqrt(258));
    batch 128: Δ = 0, +.01, -.01 (p = 1). Holm over the regime's 2 cells: 2p and 1. InfoNCE's σ(v) is
    .001 at batch 8 and .1 at 128: Δ on log10 σ(v) has slope (0 - .16 / 3) / 2 per decade, SSE 2.667e-4."""
    info = {8: (0.50, 0.52, 0.54), 128: (0.40, 0.40, 0.40)}
    flat = {8: (0.55, 0.58, 0.59), 128: (0.40, 0.41, 0.39)}
    sigma = {8: 0.001, 128: 0.1}
    rows = [{"arm": Arm("", "lit", loss, "adamw", b), "status": "ok", "seed": s, "setting": (), "mean_R@10": values[b][s],
             "grad_ratio": sigma[b] if loss == "infonce" else 0.5}
            for loss, values in (("infonce", info), ("flatnce", flat)) for b in (8, 128) for s in range(3)]
    table = final_table(rows, ("mean_R@10",))
    d8 = next(e for e in table if e["arm"] == Arm("", "lit", "flatnce", "adamw", 8))["diff/mean_R@10"]
    d128 = next(e for e in table if e["arm"] == Arm("", "lit", "flatnce", "adamw", 128))["diff/mean_R@10"]
    p8 = 1 - 16 / math.sqrt(258)
    assert d8["p"] == pytest.approx(p8, rel=1e-9) and d8["p_holm"] == pytest.approx(2 * p8, rel=1e-9)
    assert d8["holm"] and d8["m"] == 2 and d128["p_holm"] == pytest.approx(1.0) and not d128["holm"]
    text = tables.map_markdown(table, "mean_R@10")
    # simultaneous (Bonferroni) CI over the 2 cells: t at 1 - 0.025 / 2 with 2 df, closed form (2u - 1) / sqrt(2u(1 - u))
    t = 0.975 / math.sqrt(2 * 0.9875 * 0.0125)
    assert d8["lo_sim"] == pytest.approx(0.16 / 3 - t * math.sqrt(1 / 3) * 0.01 / math.sqrt(3), rel=1e-9)
    assert d128["hi_sim"] == pytest.approx(t * 0.01 / math.sqrt(3), rel=1e-9)  # 3.58 points
    assert "| +5.3 [+3.9, +6.8] ✓ | p=0.0078 [+3.3, +7.4] ✓ | 0.500 |" in text
    assert "| -0.00 [-2.5, +2.5] | p=1 [-3.6, +3.6] | 0.500 |" in text
    fit = tables.mechanism_fit(tables.mechanism_points(table, "mean_R@10"))
    half = 2.7764451051977987 * math.sqrt(2.6666666666666666e-4 / 4 / 6)  # t_{0.975, 4} se; Sxx = 6
    assert fit["n"] == 6 and fit["slope"] == pytest.approx(-0.16 / 6)
    assert (fit["lo"], fit["hi"]) == (pytest.approx(-0.16 / 6 - half), pytest.approx(-0.16 / 6 + half))
    mech = tables.mechanism_markdown(table, "mean_R@10")
    assert "| lit | adamw | 8 | 0.001 | +5.3 [+3.9, +6.8] ✓ | p=0.0078 ✓ |" in mech
    assert "| lit | adamw | 128 | 0.1 | -0.00 [-2.5, +2.5] | p=1 |" in mech  # Δ = -1e-17: float noise
    # r = Sxy / sqrt(Sxx Syy) = -0.16 / sqrt(6 (0.16² / 6 + 2.667e-4)) = -0.970
    assert "| lit | 6 | -2.7 [-3.6, -1.7] | -0.97 | as predicted (slope < 0, 95 % CI) |" in mech


@pytest.mark.parametrize("raw, needle", [
    ({"regimes": {"Bad Name": {}}}, "lowercase"),
    ({"regimes": {"lit": {"loss.name": "flatnce"}}}, "set by the grid"),
    ({"regimes": {"lit": {"sweep": {"adam": {"optim.lr": [1]}}}}}, "not an optimizer"),
    ({"accum_price": {"batch_per_device": 4, "accum_steps": 3, "samples": 64}}, "must be one of grid.batch_per_device"),
    ({"accum_price": {"batch_per_device": 4, "accum_steps": 2}}, "must give batch_per_device"),
    ({"workers": 0}, "grid.workers"),
    ({"regimes": {"lit": None}}, "or be false to leave it out"),
    ({"regimes": {"lit": False}}, "leaves every regime out"),
])
def test_map_config_refusals(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_grid({"losses": ["infonce"], "batch_per_device": [4, 8], "seeds": [0], "sweep": {"optim.lr": [1e-3]},
                    **raw})


def test_a_regime_set_to_false_is_left_out():
    grid = parse_grid({"losses": ["infonce"], "batch_per_device": [4], "seeds": [0], "sweep": {"optim.lr": [1e-3]},
                       "optimizers": ["adamw"], "regimes": {"scratch": False, "lit": {"model.lock_image": True}}})
    assert list(grid.regimes) == ["lit"] and {r.arm.regime for r in sweep_runs(grid)} == {"lit"}


def test_regimes_need_a_study():
    with pytest.raises(ConfigError, match="needs a tuned study"):
        parse_grid({"losses": ["infonce"], "batch_per_device": [4], "seeds": [0], "regimes": {"a": {}}})


def test_price_runs_use_the_big_arms_setting(tmp_path, timm_json, bert_dir):
    grid = _grid(tmp_path / "m", timm_json, bert_dir)
    best = {Arm("", "scratch", "infonce", "adamw", 8): (("optim.lr", 3e-3),),
            Arm("", "lit", "flatnce", "adamw", 8): (("optim.lr", 1e-2),)}
    runs = price_runs(grid, best)
    assert [r.name for r in runs] == ["scratch_infonce_adamw_b4x2_lr0.003_s0", "lit_flatnce_adamw_b4x2_lr0.01_s0"]
    assert dict(runs[0].overrides)["train.accum_steps"] == 2 and dict(runs[0].overrides)["train.samples"] == 16
