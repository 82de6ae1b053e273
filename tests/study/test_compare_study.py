"""The tuned study of `vlp compare`: OpenMoji fit/val/test split, sweep -> val selection -> seeds on
test end to end on a tiny grid, rerun skipping, config refusals, --quick of the shipped config."""
import json

import pytest

import forked
from vlp_testing import REPO
from vlp.study import runs as study_runs
from vlp.study.compare import load_compare_config, run_grid
from vlp.study.grid import parse_grid
from vlp.study.plan import Arm, Run, final_runs, select_best, setting_tag, settings_for, sweep_runs
from vlp.study.rows import item_hits, split_metrics
from vlp.config import ConfigError


def test_openmoji_study_split_is_disjoint_deterministic_and_keeps_eval():
    from vlp.data.sources.openmoji import load_pairs, study_split

    names = {s: [p.meta["name"] for p in load_pairs(s)] for s in ("fit", "val", "test", "train", "eval")}
    fit, val, test = (set(names[s]) for s in ("fit", "val", "test"))
    assert not (fit & val) and not (fit & test) and not (val & test)
    assert fit | val == set(names["train"]) and test == set(names["eval"])
    assert len(val) > 150 and len(test) > 150 and len(fit) > 1400
    assert [study_split(n) for n in names["val"][:20]] == ["val"] * 20
    assert names["val"] == [p.meta["name"] for p in load_pairs("val")]  # deterministic


def test_sweep_expansion_selection_and_reuse_by_hand():
    grid = parse_grid({"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0],
                       "final_seeds": [0, 1], "optimizers": ["adamw", "lars"],
                       "sweep": {"adamw": {"optim.lr": [1e-3, 3e-3]}, "lars": {"optim.lr": [0.5]}}})
    assert settings_for(grid.sweep, "adamw") == [(("optim.lr", 1e-3),), (("optim.lr", 3e-3),)]
    assert settings_for({"optim.lr": [1, 2], "loss.tau": [0.1]}, "sgd") == [
        (("optim.lr", 1), ("loss.tau", 0.1)), (("optim.lr", 2), ("loss.tau", 0.1))]
    runs = sweep_runs(grid)
    assert [r.name for r in runs] == ["infonce_adamw_b8_lr0.001_s0", "infonce_adamw_b8_lr0.003_s0",
                                      "flatnce_adamw_b8_lr0.001_s0", "flatnce_adamw_b8_lr0.003_s0",
                                      "infonce_lars_b8_lr0.5_s0", "flatnce_lars_b8_lr0.5_s0"]
    assert dict(runs[0].overrides)["optim.name"] == "adamw"
    val = {"infonce_adamw_b8_lr0.001_s0": 0.30, "infonce_adamw_b8_lr0.003_s0": 0.20,
           "flatnce_adamw_b8_lr0.001_s0": 0.10, "flatnce_adamw_b8_lr0.003_s0": 0.15,
           "infonce_lars_b8_lr0.5_s0": 0.05, "flatnce_lars_b8_lr0.5_s0": None}
    rows = [{"arm": r.arm, "setting": r.setting, "status": "ok", "val/mean_R@10": val[r.name]} for r in runs]
    best = select_best(rows, "mean_R@10")
    assert best == {Arm("", "", "infonce", "adamw", 8): (("optim.lr", 1e-3),), Arm("", "", "flatnce", "adamw", 8): (("optim.lr", 3e-3),),
                    Arm("", "", "infonce", "lars", 8): (("optim.lr", 0.5),)}  # flatnce/lars had no val value
    finals = [r.name for r in final_runs(grid, best)]
    assert finals[:3] == ["infonce_adamw_b8_lr0.001_s0", "flatnce_adamw_b8_lr0.003_s0", "infonce_lars_b8_lr0.5_s0"]
    assert len(finals) == 6 and finals[3] == "infonce_adamw_b8_lr0.001_s1"
    assert setting_tag(()) == "base"


def test_item_metrics_by_hand():
    items = {"image_to_text": [1, 3, 12, 2], "text_to_image": [2, 1, 1, 20]}
    m = split_metrics(items)
    assert m["image_to_text_R@1"] == 0.25 and m["text_to_image_R@1"] == 0.5 and m["mean_R@1"] == 0.375
    assert m["mean_R@10"] == (0.75 + 0.75) / 2
    assert item_hits(items, 1) == [0.5, 0.5, 0.5, 0.0]  # mean = mean_R@1


@pytest.mark.parametrize("bad, needle", [
    ({"sweep": {"train.seed": [1, 2]}}, "not a sweepable key"),
    ({"sweep": {"optim.lr": []}}, "non-empty list"),
    ({"sweep": {"adam": {"optim.lr": [1]}}}, "not an optimizer"),
    ({"optimizers": ["adam"]}, "grid.optimizers"),
    ({"select_metric": "R@1"}, "grid.select_metric"),
    ({"sweep": {"adamw": {"optim.lr": [1]}}, "optimizers": ["adamw", "lars"]}, "no settings for optimizer"),
])
def test_study_config_refusals(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_grid({"losses": ["infonce"], "batch_per_device": [4], "seeds": [0], **bad})


@pytest.fixture(scope="module")
def study_shards(tmp_path_factory):
    """Tiny fit / val / test shards at 32 px (disjoint names)."""
    from vlp.data.sources.openmoji import load_pairs
    from vlp.data.write import write_shards

    root = tmp_path_factory.mktemp("study_shards")
    return {split: write_shards(load_pairs(split, image_size=32)[:n], root / split, prefix=split,
                                samples_per_shard=64).spec
            for split, n in (("fit", 96), ("val", 24), ("test", 24))}


def test_tiny_study_end_to_end_picks_val_best_then_rerun_skips(study_shards, tmp_path, monkeypatch):
    out = tmp_path / "study"
    base = {"model": {"name": "vlp-micro"},
            "data": {"train_shards": study_shards["fit"], "eval_shards": study_shards["val"], "shuffle_buffer": 32},
            "train": {"samples": 32}, "eval": {"batch_size": 64}}
    grid = parse_grid({"losses": ["infonce", "sogclr"], "batch_per_device": [8], "seeds": [0], "final_seeds": [0, 1],
                       "optimizers": ["adamw"], "sweep": {"optim.lr": [1e-4, 3e-3]}, "out_dir": str(out),
                       "test_shards": study_shards["test"], "metric": "mean_R@10", "keep_checkpoints": False})
    result = run_grid(base, grid)
    assert len(result["sweep"]) == 4 and all(r["status"] == "ok" for r in result["sweep"] + result["final"])
    for arm in (Arm("", "", "infonce", "adamw", 8), Arm("", "", "sogclr", "adamw", 8)):  # the val-best setting was picked
        scores = {r["setting"]: r["val/mean_R@10"] for r in result["sweep"] if r["arm"] == arm}
        assert scores[result["best"][arm]] == max(scores.values())
    finals = result["final"]
    assert sorted(r["seed"] for r in finals) == [0, 0, 1, 1]
    assert {r["setting"] for r in finals if r["loss"] == "infonce"} == {result["best"][Arm("", "", "infonce", "adamw", 8)]}
    items = json.loads((out / finals[0]["run"] / "eval_items.json").read_text())
    assert len(items["test"]["image_to_text"]) == 24 and len(items["val"]["text_to_image"]) == 24
    assert not (out / finals[0]["run"] / "checkpoints").exists()
    row = finals[0]
    lo, hi = row["boot/test/mean_R@10"]
    assert lo <= row["test/mean_R@10"] <= hi
    text = (out / "study.md").read_text()
    assert "## Sweep (val)" in text and "## Final (test)" in text and "Paired by seed" in text
    assert "sogclr/adamw/b8" in text and "infonce/adamw/b8" in text
    for png in ("final.png", "curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(study_runs, "train_and_rank", no_training)
    again = run_grid(base, grid)
    assert again["best"] == result["best"] and again["final"] == finals


def test_shipped_config_quick_and_gpu_are_the_same_study():
    base, grid = load_compare_config(REPO / "configs/compare_small_batch.yaml", quick=True)
    assert grid.sweep and grid.optimizers and len(grid.final_seeds) >= 2
    assert len(sweep_runs(grid)) <= 64 and base["train"]["samples"] <= 4096
    assert set(grid.datasets) == {"openmoji", "material_icons"} and len(grid.seeds) >= 2
    full_base, full = load_compare_config(REPO / "configs/compare_small_batch.yaml")
    gpu_base, gpu = load_compare_config(REPO / "configs/compare_gpu_vitb32.yaml")
    assert set(full.losses) == set(gpu.losses) == {"infonce", "flatnce", "sogclr", "siglip"}
    assert full.optimizers == gpu.optimizers == ["adamw"] and full.batch_per_device == gpu.batch_per_device == [8, 32, 128]
    assert set(full.regimes) == set(gpu.regimes) == {"scratch", "lit"} and full.accum_price.accum_steps == 16
    assert set(full.sweep) == set(gpu.sweep) and full.select_metric == gpu.select_metric
    assert len(full.final_seeds) >= 4 and len(gpu.final_seeds) >= 4
    with pytest.raises(ConfigError, match="quick"):
        load_compare_config(REPO / "configs/demo.yaml", quick=True)
    assert isinstance(Run(Arm(loss="infonce", optimizer="adamw", batch_per_device=8), (), 0).name, str)


@pytest.mark.multiproc
def test_cli_quick_on_openmoji_tiny(tmp_path):
    """`vlp compare --quick` of the shipped config, cut to 2 runs of 16 samples: the OpenMoji
    fit/val/test shards are written, the study runs and reports."""
    from vlp_testing import PYTHON, run_env

    out = tmp_path / "quick"
    proc = forked.run(
        [PYTHON, "-m", "vlp", "compare", "-c", str(REPO / "configs/compare_small_batch.yaml"), "--quick",
         f"grid.out_dir={out}", "train.samples=16", "grid.losses=[infonce,sogclr]", "grid.optimizers=[adamw]",
         "grid.final_seeds=[0]", "grid.sweep={optim.lr: [0.001]}", "grid.warmup_samples=8",
         "grid.batch_per_device=[8]", "grid.regimes={scratch: {}}", "grid.accum_price=null", "grid.workers=1",
         "grid.datasets=null", "grid.seeds=[0]", "grid.sweep_bounds=null"],
        cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (out / "study.md").read_text()
    assert "scratch/infonce/adamw/b8" in text and "scratch/sogclr/adamw/b8" in text
    assert (tmp_path / ".cache" / "shards" / "openmoji_study" / "test" / "sizes.json").is_file()
    items = json.loads((out / "scratch_sogclr_adamw_b8_lr0.001_s0" / "eval_items.json").read_text())
    assert len(items["test"]["image_to_text"]) == 208 and len(items["val"]["image_to_text"]) == 195


def test_edge_selections_are_named():
    from vlp.study.tuning import edge_notes, edge_sentences

    grid = parse_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0],
                       "sweep": {"optim.lr": [1e-4, 1e-3, 1e-2], "loss.tau": [0.07]}})
    grid.optimizers = ["adamw"]
    best = {Arm("", "", "infonce", "adamw", 8): (("optim.lr", 1e-4), ("loss.tau", 0.07)),
            Arm("", "", "flatnce", "adamw", 8): (("optim.lr", 1e-3), ("loss.tau", 0.07))}
    notes = edge_notes(grid, best, {})  # no bound declared: an edge of >= 3 values is named
    assert [(n["label"], n["key"], n["value"], n["kind"]) for n in notes] == [
        ("infonce/adamw/b8", "optim.lr", 1e-4, "edge")]
    assert edge_sentences(notes, {}) == ["Selected at the edge of its sweep, no bound declared (the optimum may lie "
                                         "outside): infonce/adamw/b8: optim.lr=0.0001."]
