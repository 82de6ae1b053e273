"""The map's planning, in process with fake run results: the sweep's edge extension within
grid.sweep_bounds, selection on the mean over sweep seeds, budget points and the val-best point,
the datasets axis, and the verdicts across data sets. Exact expectations, no training."""
import json
import math
from types import SimpleNamespace

import pytest

from vlp.config import ConfigError
from vlp.study import transfer
from vlp.study.grid import parse_grid
from vlp.study.plan import Arm, cells_of, final_runs, price_runs, select_best, sweep_runs
from vlp.study.rows import ranked_metrics
from vlp.study.runs import run_config
from vlp.study.study import tune, with_dataset
from vlp.study.tuning import edge_notes, edge_sentences, extension_runs, tried_settings

ACC = SimpleNamespace(is_main_process=True, num_processes=1)
LR = "optim.lr"


def _grid(**extra):
    raw = {"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0, 1], "optimizers": ["adamw"],
           "sweep": {"optim.lr": [1e-3, 3e-3, 1e-2]}, "sweep_bounds": {"optim.lr": [1e-4, 3e-2]}, **extra}
    return parse_grid(raw)


def _fake_walk(val, log):
    """A StudyWalk stand-in: every planned run 'ran' and has val(arm, lr, seed) as its val mean_R@10."""
    def walk(runs, ranked=True):
        log.append([r.name for r in runs])
        return [{"run": r.name, "arm": r.arm, "setting": r.setting, "seed": r.seed, "status": "ok",
                 "val/mean_R@10": val(r.arm, dict(r.setting)[LR], r.seed)} for r in runs]
    return walk


def _peaked(optimum: dict):
    """Val peaks at each loss's optimum lr (a parabola in log10 lr), the same for every seed."""
    return lambda arm, lr, seed: 0.5 - (math.log10(lr) - math.log10(optimum[arm.loss])) ** 2


def test_extension_walks_out_to_the_optimum_or_the_bound():
    """infonce peaks at 1.2e-4, below the sweep: 1e-3 -> /3 = 3.33333e-4 -> /3 = 1.11111e-4 (best; the
    next, 3.7037e-5, is under the 1e-4 bound). flatnce peaks at 0.02: 1e-2 -> 0.03 (= the bound)."""
    grid, log = _grid(), []
    rows, best, tried = tune(_fake_walk(_peaked({"infonce": 1.2e-4, "flatnce": 0.02}), log), grid, ACC)
    assert log[1] == ["infonce_adamw_b8_lr0.000333333_s0", "infonce_adamw_b8_lr0.000333333_s1",
                      "flatnce_adamw_b8_lr0.03_s0", "flatnce_adamw_b8_lr0.03_s1"]
    assert log[2] == ["infonce_adamw_b8_lr0.000111111_s0", "infonce_adamw_b8_lr0.000111111_s1"]
    assert len(log) == 3 and len(rows) == 2 * 3 * 2 + 4 + 2
    info, flat = Arm("", "", "infonce", "adamw", 8), Arm("", "", "flatnce", "adamw", 8)
    assert best == {info: ((LR, 0.000111111),), flat: ((LR, 0.03),)}
    assert [dict(s)[LR] for s in tried[info]] == [1e-3, 3e-3, 1e-2, 0.000333333, 0.000111111]
    notes = edge_notes(grid, best, tried)
    assert [(n["label"], n["value"], n["kind"]) for n in notes] == [
        ("infonce/adamw/b8", 0.000111111, "bound"), ("flatnce/adamw/b8", 0.03, "bound")]
    assert edge_sentences(notes, grid.sweep_bounds) == [
        "Selected at a declared bound (grid.sweep_bounds optim.lr: [0.0001, 0.03]; the next value x3 or /3 would "
        "cross it): infonce/adamw/b8: optim.lr=0.000111111; flatnce/adamw/b8: optim.lr=0.03."]


def test_an_interior_optimum_stops_after_one_step_and_is_not_flagged():
    """flatnce peaks at 0.012: 1e-2 is the edge, 0.03 is worse, so 1e-2 is interior after one step."""
    grid, log = _grid(), []
    rows, best, tried = tune(_fake_walk(_peaked({"infonce": 3e-3, "flatnce": 0.012}), log), grid, ACC)
    assert log[1] == ["flatnce_adamw_b8_lr0.03_s0", "flatnce_adamw_b8_lr0.03_s1"] and len(log) == 2
    assert dict(best[Arm("", "", "flatnce", "adamw", 8)])[LR] == 1e-2
    assert edge_notes(grid, best, tried) == []


def test_no_bounds_no_extension_and_a_missing_extension_is_named_open():
    grid = _grid(sweep_bounds=None)
    best = {Arm("", "", "infonce", "adamw", 8): ((LR, 1e-3),)}
    tried = tried_settings(sweep_runs(grid))
    assert extension_runs(grid, best, tried) == []
    assert [n["kind"] for n in edge_notes(grid, best, tried)] == ["edge"]
    bounded = _grid()  # --report-only before the extension ran: its next value exists inside the bound
    assert [n["kind"] for n in edge_notes(bounded, best, tried)] == ["open"]
    one = _grid(sweep={"optim.lr": [1e-3]})  # a single value is both edges: both neighbours
    runs = extension_runs(one, best, tried_settings(sweep_runs(one)))
    assert sorted({dict(r.setting)[LR] for r in runs}) == [0.000333333, 0.003] and {r.seed for r in runs} == {0, 1}


def test_selection_is_on_the_mean_over_the_sweep_seeds():
    """Seed 0 alone prefers 3e-3 (0.40 vs 0.30); the mean over seeds 0 and 1 prefers 1e-3 (0.35 vs 0.25)."""
    val = {(1e-3, 0): 0.30, (1e-3, 1): 0.40, (3e-3, 0): 0.40, (3e-3, 1): 0.10, (1e-2, 0): 0.0, (1e-2, 1): 0.0}
    grid = _grid(losses=["infonce"], sweep_bounds=None)
    rows = _fake_walk(lambda arm, lr, seed: val[(lr, seed)], [])(sweep_runs(grid))
    assert select_best([r for r in rows if r["seed"] == 0], "mean_R@10")[Arm("", "", "infonce", "adamw", 8)] == ((LR, 3e-3),)
    assert select_best(rows, "mean_R@10")[Arm("", "", "infonce", "adamw", 8)] == ((LR, 1e-3),)


@pytest.mark.parametrize("raw, needle", [
    ({"sweep_bounds": {"optim.lr": [1e-2, 1e-3]}}, "0 < low < high"),
    ({"sweep_bounds": {"optim.lr": 1e-3}}, "must be \\[low, high\\]"),
    ({"sweep_bounds": {"optim.lr": [1e-3, 5e-3]}}, "excludes swept value\\(s\\) \\[0.01\\]"),
    ({"budget_points": 0}, "grid.budget_points"),
    ({"datasets": ["mnist"]}, "not a packaged data set"),
    ({"datasets": {"openclipart": {"batch_per_device": [16]}}}, "must be a subset of grid.batch_per_device"),
    ({"datasets": {"openclipart": {"regimes": ["lit"]}}}, "subset of grid.regimes"),
    ({"datasets": {"openclipart": {"seeds": [1]}}}, "may set batch_per_device and regimes only"),
])
def test_map_planning_refusals(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        _grid(**raw)


def test_datasets_axis_cells_and_run_names():
    grid = _grid(batch_per_device=[8, 32], regimes={"scratch": {}, "lit": {"model.lock_image": True}},
                 datasets={"openmoji": {}, "material_icons": {"batch_per_device": [8], "regimes": ["lit"]}},
                 accum_price={"batch_per_device": 8, "accum_steps": 4, "samples": 64})
    assert cells_of(grid) == [("openmoji", "scratch", 8), ("openmoji", "scratch", 32), ("openmoji", "lit", 8),
                              ("openmoji", "lit", 32), ("material_icons", "lit", 8)]
    runs = sweep_runs(grid)
    assert len(runs) == 5 * 2 * 3 * 2 and runs[-1].name == "material_icons_lit_flatnce_adamw_b8_lr0.01_s1"
    best = {r.arm: r.setting for r in runs}
    assert len(final_runs(grid, best)) == 5 * 2 * 2
    assert [r.name for r in price_runs(grid, best)] == [  # batch 32 ran on openmoji only
        f"openmoji_{regime}_{loss}_adamw_b8x4_lr0.01_s0" for regime in ("scratch", "lit") for loss in ("infonce", "flatnce")]
    assert parse_grid({"losses": ["infonce"], "batch_per_device": [8], "seeds": [0], "sweep": {"optim.lr": [1e-3]},
                       "datasets": ["openmoji", "openclipart"]}).datasets == {
        "openmoji": {"batch_per_device": None, "regimes": None}, "openclipart": {"batch_per_device": None, "regimes": None}}


def test_a_data_set_replaces_the_name_and_keeps_the_render_size():
    assert with_dataset({"data": {"train_shards": "openmoji:128"}}, "openclipart")["data"]["train_shards"] == "openclipart:128"
    assert with_dataset({"data": {}}, "material_icons")["data"]["train_shards"] == "material_icons"
    assert with_dataset({"data": {"train_shards": "/x/{0..3}.tar"}}, "")["data"]["train_shards"] == "/x/{0..3}.tar"
    with pytest.raises(ConfigError, match="needs data.train_shards to name a packaged data set"):
        with_dataset({"data": {"train_shards": "/x/{0..3}.tar"}}, "openclipart")
    with pytest.raises(ConfigError, match="leave data.eval_shards unset"):
        with_dataset({"data": {"train_shards": "openmoji", "eval_shards": "/v.tar"}}, "openclipart")


def test_budget_points_set_the_eval_interval_of_ranked_runs_only(tmp_path):
    grid = _grid(budget_points=4, out_dir=str(tmp_path), accum_price={"batch_per_device": 4, "accum_steps": 2,
                                                                      "samples": 64}, batch_per_device=[4, 8])
    base = {"model": {"name": "vlp-micro"}, "train": {"samples": 256}}
    run = sweep_runs(grid)[0]
    assert run_config(base, grid, run).train.eval_every == 256 // 4 // 4  # 64 steps, a point every 16
    price = price_runs(grid, {r.arm: r.setting for r in sweep_runs(grid)})[0]
    assert run_config(base, grid, price).train.eval_every == 0
    with pytest.raises(ConfigError, match="grid.budget_points=4 does not divide the 10 steps"):
        run_config({**base, "train": {"samples": 40}}, grid, run)


def test_val_best_point_and_the_rows_read_there(tmp_path):
    ranks = {"val": {"image_to_text": [1, 20], "text_to_image": [2, 30]},
             "test": {"image_to_text": [1, 1], "text_to_image": [11, 1]}}
    (tmp_path / "eval_points.json").write_text(json.dumps({"512": ranks, "128": {**ranks, "val": {
        "image_to_text": [1, 1], "text_to_image": [1, 1]}}}))
    points = ranked_metrics(ranks, json.loads((tmp_path / "eval_points.json").read_text()), (), 0, 0)["points"]
    assert list(points) == [128, 512] and points[512]["val/mean_R@10"] == 0.5 and points[128]["val/mean_R@10"] == 1.0
    assert points[512]["test/mean_R@10"] == 0.75
    arm, other = Arm("om", "lit", "infonce", "adamw", 8), Arm("om", "lit", "flatnce", "adamw", 8)
    rows = [{"arm": arm, "status": "ok", "seed": 0, "points": {1: {"val/m": 0.2, "test/m": 0.5}, 2: {"val/m": 0.3, "test/m": 0.6}}},
            {"arm": arm, "status": "ok", "seed": 1, "points": {1: {"val/m": 0.4, "test/m": 0.7}, 2: {"val/m": 0.2, "test/m": 0.8}}},
            {"arm": other, "status": "ok", "seed": 0, "points": {1: {"val/m": 0.3, "test/m": 0.1}, 2: {"val/m": 0.3, "test/m": 0.2}}},
            {"arm": other, "status": "failed", "seed": 1}]
    choice = transfer.point_choice(rows, "m")
    assert choice == {arm: 1, other: 2}  # arm: mean 0.3 at 1 vs 0.25 at 2; other: a tie goes to the later point
    assert [(r["seed"], r["m"], r["point"]) for r in transfer.rows_at(rows, choice, ("m",))] == [
        (0, 0.5, 1), (1, 0.7, 1), (0, 0.2, 2)]
    assert transfer.point_fractions(rows) == [1, 2]


def test_verdicts_across_data_sets_and_epochs():
    def entry(dataset, loss, batch, mean=None, holm=False):
        d = None if mean is None else {"mean": mean, "p_holm": 0.01 if holm else 0.5, "holm": holm}
        return {"arm": Arm(dataset, "lit", loss, "adamw", batch), "dataset": dataset, "regime": "lit", "optim": "adamw",
                "batch_per_device": batch, "loss": loss, "diff/m": d}
    table = [entry(d, "infonce", b) for d in ("om", "oc", "mi") for b in (8, 32)] + [
        entry("om", "flatnce", 8, 0.02, True), entry("oc", "flatnce", 8, 0.03, True), entry("mi", "flatnce", 8, 0.01, True),
        entry("om", "flatnce", 32, 0.02, True), entry("oc", "flatnce", 32, -0.01, False), entry("mi", "flatnce", 32, -0.04, True),
        entry("om", "siglip", 8, 0.01), entry("oc", "siglip", 8, -0.01)]
    rows = {(r["loss"], r["batch_per_device"]): r for r in transfer.transfer_rows(table, "m")}
    assert rows[("flatnce", 8)]["signs"] == {"om": "+", "oc": "+", "mi": "+"}
    assert rows[("flatnce", 8)]["reading"] == "transfers: + on every data set"
    assert rows[("flatnce", 32)]["reading"] == "does not transfer: opposite signs"
    assert rows[("siglip", 8)]["signs"] == {"om": "0", "oc": "0", "mi": "·"}
    assert rows[("siglip", 8)]["reading"] == "transfers: not resolved on any data set"
    assert transfer.transfer_reading({"om": "+", "oc": "0"}) == "does not transfer: resolved on om only"
    assert transfer.transfer_counts(table, "m") == "2 of 3 cells give the same verdict on every data set; not: lit/flatnce/b32."
    text = transfer.transfer_markdown(table, "m")
    assert "| lit | adamw | 32 | flatnce | +2.0 (+) | -1.0 (0) | -4.0 (−) | does not transfer: opposite signs |" in text
    epochs = transfer.epochs_markdown([("om", "lit"), ("oc", "lit")], {("om", "lit"): 1511, ("oc", "lit"): None},
                                      [2048, 8192], 8192)
    assert "| om · lit | 1511 | 1.36 | 5.42 |" in epochs and "| oc · lit | — | — | — |" in epochs
