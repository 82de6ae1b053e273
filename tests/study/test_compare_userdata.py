"""The map on your data: grid.datasets entries that name your own shards (train / val / test, or
one set split by caption hash), built from CSVs of images written here with PIL by `vlp shards`.
In process: the entries' refusals, bad shards refused by `vlp compare` in one line before anything
is written, the caption-hash split and the data each (data set, regime) trains, selects and reports on. End to end (slow tier): configs/compare_your_data.yaml with
--quick, cut to a tiny grid, on two such sets: a table, a verdict row and seeds per set."""
import json
import os
import re
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image, ImageDraw

import forked
from vlp.cli import main
from vlp.config import ConfigError
from vlp.data.shard_list import expand_sources
from vlp.data.sources.splits import study_split
from vlp.data.write import shards_from_source
from vlp.study.grid import parse_grid
from vlp.study.study import regime_bases
from vlp.study.userdata import check_datasets, iter_pairs, user_specs
from vlp_testing import PYTHON, REPO, run_env

ACC = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
COLORS = ("red", "green", "blue", "orange", "purple", "black")
SHAPES = ("circle", "square", "bar")


def write_csv(folder: Path, name: str, start: int, count: int) -> Path:
    """``count`` 32-px PNGs of coloured shapes and a tab-separated CSV (open_clip's filepath / title)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["filepath\ttitle"]
    for i in range(start, start + count):
        color, shape = COLORS[i % len(COLORS)], SHAPES[(i // len(COLORS)) % len(SHAPES)]
        image = Image.new("RGB", (32, 32), "white")
        draw = ImageDraw.Draw(image)
        box = (4 + i % 5, 4 + i % 7, 24 + i % 5, 26 - i % 3)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box if shape != "bar" else (4, 12, 28, 18 + i % 5),
                                                               fill=color)
        image.save(folder / f"img{i}.png")
        lines.append(f"img{i}.png\ta {color} {shape} number {i}")
    path = folder / f"{name}.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _grid(datasets, **extra):
    return parse_grid({"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0], "optimizers": ["adamw"],
                       "sweep": {"optim.lr": [1e-3]}, "datasets": datasets, **extra})


@pytest.mark.parametrize("entry, needle", [
    ({"train": "a", "val": "b"}, "name train, val and test shard specs, or one 'shards' spec"),
    ({"shards": "a", "train": "b", "val": "c", "test": "d"}, "got train, val, test, shards"),
    ({"train": "a", "val": "a", "test": "b"}, "three different shard sets"),
    ({"shards": ""}, "must be a shard spec"),
    ({"shards": "ftp://host/x.tar"}, "ftp:// is not supported"),
    ({"shards": "pipe:cat x.tar"}, "a pipe: command is not a data set here"),
    ({"shards": "a", "seeds": [1]}, "may set batch_per_device and regimes besides its shards"),
    ("shards/a", "must map train / val / test \\(or shards\\) to shard specs"),
])
def test_user_entry_refusals(entry, needle):
    with pytest.raises(ConfigError, match=needle):
        _grid({"mine": entry})


def test_user_entry_name_refusal():
    with pytest.raises(ConfigError, match="lowercase letters, digits"):
        _grid({"My Data": {"shards": "a"}})


def test_user_entries_parse_with_subsets_and_urls():
    grid = _grid({"openmoji": {}, "mine": {"train": "s3://b/t-{000..009}.tar", "val": "https://h/v.tar",
                                           "test": "d/test", "batch_per_device": [8]}, "one": {"shards": "gs://b/x/"}})
    assert grid.datasets["mine"] == {"batch_per_device": [8], "regimes": None, "source": None,
                                     "shards": {"fit": "s3://b/t-{000..009}.tar", "val": "https://h/v.tar",
                                                "test": "d/test"}}
    assert grid.datasets["one"]["source"] == "gs://b/x/" and grid.datasets["openmoji"] == {
        "batch_per_device": None, "regimes": None}


def test_missing_local_shards_are_one_line(tmp_path):
    grid = _grid({"mine": {"train": str(tmp_path / "nope"), "val": str(tmp_path / "v"), "test": str(tmp_path / "t")}})
    with pytest.raises(ConfigError, match=r"^config: grid.datasets.mine.train: 1 shard\(s\) not found: "):
        user_specs("mine", grid.datasets["mine"], ACC, tmp_path / "cache")


def test_one_shard_set_is_split_by_caption_hash_once(tmp_path):
    csv = write_csv(tmp_path / "b", "set_b", 0, 60)
    shards_from_source(str(csv), tmp_path / "shards_b", samples_per_shard=25, progress=False)
    grid = _grid({"set_b": {"shards": str(tmp_path / "shards_b")}})
    specs = user_specs("set_b", grid.datasets["set_b"], ACC, tmp_path / "cache")
    captions = {split: [caption for _, caption in iter_pairs(spec)] for split, spec in specs.items()}
    assert sorted(sum(captions.values(), [])) == sorted(f"a {c} {s} number {i}" for i, (c, s) in enumerate(
        (COLORS[i % 6], SHAPES[(i // 6) % 3]) for i in range(60)))  # every pair once
    for split, names in captions.items():
        assert names and all(study_split(c) == split for c in names)
    folder = Path(expand_sources(specs["fit"])[0][0]).parent
    stamp = (folder / "sizes.json").stat().st_mtime_ns
    assert user_specs("set_b", grid.datasets["set_b"], ACC, tmp_path / "cache") == specs  # reused, not rewritten
    assert (folder / "sizes.json").stat().st_mtime_ns == stamp


def test_each_user_set_trains_selects_and_reports_on_its_own_shards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for split, start in (("train", 0), ("val", 100), ("test", 200)):
        shards_from_source(str(write_csv(tmp_path / "a", split, start, 12)), tmp_path / "a" / f"s_{split}",
                           progress=False)
    grid = _grid({"set_a": {"train": "a/s_train", "val": "a/s_val", "test": "a/s_test"}},
                 regimes={"lit": {"data.train_shards": "openmoji:128", "model.lock_image": True}})
    bases = regime_bases({"model": {"name": "vlp-micro"}, "data": {}}, grid, ACC)
    tree, specs = bases[("set_a", "lit")]
    assert tree["data"]["train_shards"] == "a/s_train" and tree["data"]["eval_shards"] is None
    assert specs == {"val": "a/s_val", "test": "a/s_test"} and tree["model"]["lock_image"] is True


@pytest.mark.multiproc
def test_cli_map_on_two_user_data_sets_from_csvs(tmp_path):
    """`vlp shards` turns three CSVs into set A's train / val / test and one CSV into set B (split by
    caption hash); configs/compare_your_data.yaml --quick, cut to 2 losses × batch 8 × from scratch ×
    32 samples, gives each set its table, verdict row, seeds per comparison and verdict column."""
    env = run_env()
    sources = [(write_csv(tmp_path / "csv_a", split, start, n), tmp_path / "shards" / "set_a" / split)
               for split, start, n in (("train", 0, 40), ("val", 100, 12), ("test", 200, 12))]
    sources.append((write_csv(tmp_path / "csv_b", "set_b", 300, 90), tmp_path / "shards" / "set_b"))
    for csv, out in sources:
        proc = forked.run([PYTHON, "-m", "vlp", "shards", str(csv), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "map"
    proc = forked.run(
        [PYTHON, "-m", "vlp", "compare", "-c", str(REPO / "configs/compare_your_data.yaml"), "--quick",
         f"grid.out_dir={out}", "train.samples=32", "grid.warmup_samples=8", "grid.batch_per_device=[8]",
         "grid.sweep={optim.lr: [0.001]}", "grid.sweep_bounds={optim.lr: [0.001, 0.002]}", "grid.budget_points=2",
         "grid.regimes={scratch: {}}", "grid.workers=1", "eval.batch_size=64"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "study.md").read_text()
    for name in ("set_a", "set_b"):
        assert f"### {name}" in text and f"**{name} · scratch**" in text  # its table in the map
        assert f"- {name}, scratch, adamw, batch 8: Paired by seed, test mean_R@10 minus infonce's" in text
        assert f"| {name} · scratch |" in text  # its budget and epochs row
        assert f"| {name}/scratch/flatnce/adamw/b8 |" in text  # its seeds per comparison
    assert "| set_a: Δ mean_R@10 (verdict) | set_b: Δ mean_R@10 (verdict) | transfer |" in text
    assert "set_b (your shards shards/set_b, split by caption hash)" in text
    assert "| set_a · scratch | 40 |" in text  # set A trains on its own 40 train pairs
    summary = json.loads((out / "study.json").read_text())
    seeds = {(s["arm"]["dataset"],): s["n"] for s in summary["seeds"]}
    assert set(seeds) == {("set_a",), ("set_b",)} and set(seeds.values()) <= {2, 3}
    assert {e["dataset"] for e in summary["final"]} == {"set_a", "set_b"}
    run = out / "set_b_scratch_infonce_adamw_b8_lr0.001_s0"
    items = json.loads((run / "eval_items.json").read_text())
    assert 0 < len(items["test"]["image_to_text"]) < 90  # set B's caption-hash test split


def test_the_shipped_your_data_config_names_two_user_sets(tmp_path, monkeypatch):
    """Its shards are refused in one line until they exist (before any folder is made), then it loads."""
    from vlp.study.compare import load_compare_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^config: grid.datasets.set_a.train: 1 shard\\(s\\) not found: shards/set_a/train$"):
        load_compare_config(REPO / "configs/compare_your_data.yaml")
    assert list(tmp_path.iterdir()) == []
    csv = write_csv(tmp_path / "csv", "all", 0, 4)
    for folder in ("set_a/train", "set_a/val", "set_a/test", "set_b"):
        shards_from_source(str(csv), tmp_path / "shards" / folder, progress=False)
    for quick in (False, True):
        base, grid = load_compare_config(REPO / "configs/compare_your_data.yaml", quick=quick)
        assert grid.datasets["set_a"]["shards"] == {"fit": "shards/set_a/train", "val": "shards/set_a/val",
                                                    "test": "shards/set_a/test"}
        assert grid.datasets["set_b"]["source"] == "shards/set_b" and grid.seeds_until.max_seeds > len(grid.final_seeds)
        assert list(grid.regimes) == ["lit"] and grid.sweep_bounds


@pytest.fixture
def http_root(tmp_path):
    """A folder served over HTTP on loopback (python's http.server, in a thread)."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    root = tmp_path / "www"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.server
def test_one_shard_set_at_an_http_url_is_read_and_split(tmp_path, http_root):
    root, base = http_root
    csv = write_csv(tmp_path / "b", "set_b", 0, 60)
    shards_from_source(str(csv), root / "b", samples_per_shard=30, progress=False)
    grid = _grid({"web": {"shards": f"{base}/b/shard-{{000000..000001}}.tar"}})
    specs = user_specs("web", grid.datasets["web"], ACC, tmp_path / "cache")
    local = user_specs("local", {"source": str(root / "b")}, ACC, tmp_path / "cache")
    for split in ("fit", "val", "test"):  # the same pairs in the same splits as the local copy's
        assert list(iter_pairs(specs[split])) == list(iter_pairs(local[split])) and not specs[split].startswith("http")
    missing = _grid({"gone": {"shards": f"{base}/nothing-000000.tar"}})
    with pytest.raises(ConfigError, match=r"^config: cannot read .*nothing-000000.tar"):
        user_specs("gone", missing.datasets["gone"], ACC, tmp_path / "cache")


def test_a_split_with_an_empty_split_is_one_line_and_leaves_no_shard(tmp_path):
    csv = write_csv(tmp_path / "c", "tiny", 3, 3)  # captions 3-5: all "fit" by their hash
    shards_from_source(str(csv), tmp_path / "tiny", progress=False)
    grid = _grid({"tiny": {"shards": str(tmp_path / "tiny")}})
    with pytest.raises(ConfigError, match=r"^config: grid.datasets.tiny.shards: 3 pairs give no val or test pair by caption "
                                          r"hash \(~10 % each\): give more pairs, or train, val and test shard specs$"):
        user_specs("tiny", grid.datasets["tiny"], ACC, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # no shard, and not the folders it made


def test_vlp_compare_on_a_set_too_small_to_split_writes_nothing(tmp_path, monkeypatch, capsys):
    """The same through `vlp compare`: one line, status 2, no grid.out_dir and no .cache (the data
    is resolved before the grid folder's lock is taken)."""
    csv = write_csv(tmp_path / "c", "tiny", 3, 3)
    shards_from_source(str(csv), tmp_path / "tiny", progress=False)
    monkeypatch.chdir(tmp_path)
    status = main(["compare", "-c", str(REPO / "configs/compare_your_data.yaml"), "grid.out_dir=out",
                   f"grid.datasets={json.dumps({'tiny': {'shards': 'tiny'}})}"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("vlp: error: config: grid.datasets.tiny.shards: 3 pairs give no val or test pair"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "tiny"]  # no out_dir, no .cache


@pytest.mark.server
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_user_data_sets_in_a_bucket_are_read_and_split(scheme, tmp_path):
    """Three shard sets and one set to split, in moto's S3 or fake-gcs-server on loopback: the
    three are taken as named (URLs ending in '/' stand for their sizes.json's shards) and the one
    is split exactly as its local copy."""
    from object_store import start_gcs, start_s3

    store = {"s3": start_s3, "gs": start_gcs}[scheme]()
    try:
        store.make_bucket("data")
        shards_from_source(str(write_csv(tmp_path / "b", "set_b", 0, 60)), tmp_path / "b_shards", progress=False)
        url = store.upload_dir(tmp_path / "b_shards", "data", "set_b") + "/"
        grid = _grid({"remote": {"shards": url}, "three": {"train": url, "val": f"{url}shard-000000.tar",
                                                           "test": f"{scheme}://data/set_b/"
                                                                   "shard-{000000..000000}.tar"}})
        specs = user_specs("remote", grid.datasets["remote"], ACC, tmp_path / "cache")
        local = user_specs("local", {"source": str(tmp_path / "b_shards")}, ACC, tmp_path / "cache")
        for split in ("fit", "val", "test"):
            assert list(iter_pairs(specs[split])) == list(iter_pairs(local[split]))
        three = user_specs("three", grid.datasets["three"], ACC, tmp_path / "cache")
        assert three["fit"] == url and len(list(iter_pairs(three["test"]))) == 60
    finally:
        store.stop()


def keep_members(source: str, target: Path, exts: tuple[str, ...]) -> None:
    """A copy of a shard with only the members whose extension is in ``exts``."""
    with tarfile.open(source) as tar, tarfile.open(target, "w") as out:
        for info in tar.getmembers():
            if info.name.rsplit(".", 1)[-1] in exts:
                out.addfile(info, tar.extractfile(info))


def bad_files(root: Path, tiny_shards: dict) -> None:
    """Under ``root``: good train / val / test shards (OpenMoji pairs at 32 px) and bad ones."""
    train = expand_sources(tiny_shards["train"])[0]
    (root / "d").mkdir()
    for name, source in (("train", train[0]), ("val", train[1]), ("test", expand_sources(tiny_shards["eval"])[0][0])):
        (root / "d" / f"{name}.tar").write_bytes(Path(source).read_bytes())
    (root / "d" / "zero.tar").write_bytes(b"")
    tarfile.open(root / "d" / "none.tar", "w").close()  # a valid tar without members
    (root / "d" / "text.tar").write_text("a caption, not a tar\n" * 40)
    keep_members(train[2], root / "d" / "images.tar", ("png",))
    keep_members(train[2], root / "d" / "captions.tar", ("txt",))
    os.symlink("train.tar", root / "d" / "link.tar")
    os.symlink("gone.tar", root / "d" / "dangling.tar")


@pytest.mark.parametrize("entry, key, needle", [
    ({"train": "d/zero.tar"}, "train", "d/zero.tar: empty file \\(0 bytes\\)"),
    ({"train": "d/none.tar"}, "train", "d/none.tar: no samples \\(an empty tar\\)"),
    ({"val": "d/zero.tar"}, "val", "empty file"),
    ({"val": "d/none.tar"}, "val", "no samples"),
    ({"test": "d/none.tar"}, "test", "no samples"),
    ({"train": "d/images.tar"}, "train", "image\\+caption pair \\(missing_caption: 8; member extensions: png\\)"),
    ({"test": "d/images.tar"}, "test", "missing_caption"),
    ({"val": "d/captions.tar"}, "val", "missing_image: 8; member extensions: txt"),
    ({"val": "d/text.tar"}, "val", "not a tar archive"),
    ({"test": "d/dangling.tar"}, "test", "d/dangling.tar: not found"),
    ({"val": "d/./train.tar"}, "val", "d/./train.tar is the same shard as train's d/train.tar"),
    ({"val": "d/link.tar"}, "val", "same shard as train's"),
    ({"val": "ABS/d/train.tar"}, "val", "same shard as train's d/train.tar"),
    ({"test": "d/../d/train.tar"}, "test", "same shard as train's"),
    ({"test": "d/{val,link}.tar"}, "test", "d/val.tar is the same shard as val's d/val.tar"),
    ({"shards": "d/none.tar"}, "shards", "no samples"),
    ({"shards": "d/images.tar::d/captions.tar"}, "shards", "missing_caption"),
], ids=["train-0-bytes", "train-empty-tar", "val-0-bytes", "val-empty-tar", "test-empty-tar", "train-no-captions",
        "test-no-captions", "val-no-images", "val-not-a-tar", "test-broken-link", "val-train-dot-spelled",
        "val-train-symlinked", "val-train-absolute", "test-train-dotdot", "test-holds-val", "shards-empty-tar",
        "shards-no-captions"])
def test_a_bad_user_data_set_is_one_line_before_anything_is_written(entry, key, needle, tmp_path, monkeypatch,
                                                                     capsys, tiny_shards):
    """`vlp compare` on a user set with an empty, unreadable or captionless shard, or one shard in two
    splits however spelled: one line naming the set and its split, status 2, nothing written."""
    bad_files(tmp_path, tiny_shards)
    monkeypatch.chdir(tmp_path)
    sets = entry if "shards" in entry else {"train": "d/train.tar", "val": "d/val.tar", "test": "d/test.tar", **entry}
    sets = {k: v.replace("ABS", str(tmp_path)) for k, v in sets.items()}
    status = main(["compare", "-c", str(REPO / "configs/compare_your_data.yaml"), "grid.out_dir=out",
                   f"grid.datasets={json.dumps({'mine': sets})}"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"vlp: error: config: grid.datasets.mine.{key}: "), err
    assert re.search(needle, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no out_dir, no .cache


def test_good_user_shards_pass_the_check(tmp_path, monkeypatch, tiny_shards):
    bad_files(tmp_path, tiny_shards)
    monkeypatch.chdir(tmp_path)
    check_datasets(_grid({"mine": {"train": "d/train.tar", "val": "d/val.tar", "test": "d/test.tar"},
                          "one": {"shards": "d/{train,val,test}.tar"}}).datasets)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.server
@pytest.mark.parametrize("entry, key, needle", [
    ({"val": "URL/d/none.tar"}, "val", "URL/d/none.tar: no samples \\(an empty tar\\)"),
    ({"test": "URL/d/./x/../train.tar"}, "test", "URL/d/./x/../train.tar is the same shard as train's URL/d/train.tar"),
], ids=["val-empty-tar", "test-train-respelled"])
def test_a_bad_user_data_set_at_a_url_is_one_line(entry, key, needle, tmp_path, http_root, tiny_shards):
    """The same check on shards served over HTTP, read by vlp.data's shard reader; URLs compared normalized."""
    root, base = http_root
    bad_files(root, tiny_shards)
    sets = {"train": "URL/d/train.tar", "val": "URL/d/val.tar", "test": "URL/d/test.tar", **entry}
    grid = _grid({"mine": {k: v.replace("URL", base) for k, v in sets.items()}})
    with pytest.raises(ConfigError, match=f"^config: grid.datasets.mine.{key}: {needle.replace('URL', base)}"):
        check_datasets(grid.datasets)
