"""shards_from_source: every source type, bad rows counted, parallel == serial."""

from __future__ import annotations

import csv
import io
import json
import tarfile

import pytest
from PIL import Image

from vlp.data.write import iter_source, shards_from_source
from dp_helpers import jpeg_bytes, png_bytes


def _captions(summary) -> dict[str, str]:
    out = {}
    for path in summary.shards:
        with tarfile.open(path) as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                if ext == "txt":
                    out[key] = tar.extractfile(info).read().decode()
    return out


@pytest.fixture
def folder(tmp_path):
    """6 images at two depths with sidecar captions, one without, one corrupt."""
    root = tmp_path / "imgs"
    (root / "a" / "b").mkdir(parents=True)
    for i in range(6):
        sub = root / "a" if i % 2 else root / "a" / "b"
        (sub / f"img{i}.jpg").write_bytes(jpeg_bytes(i * 30, size=64))
        (sub / f"img{i}.txt").write_text(f"caption number {i}\n")
    (root / "nocap.png").write_bytes(png_bytes(1))
    (root / "bad.jpg").write_bytes(b"\xff\xd8 not really")
    (root / "bad.txt").write_text("a broken image")
    return root


def test_folder_with_sidecars(folder, tmp_path):
    summary = shards_from_source(str(folder), tmp_path / "out", samples_per_shard=4,
                                 progress=False)
    assert summary.num_samples == 6 and list(summary.sizes.values()) == [4, 2]
    assert summary.skipped == {"missing_caption": 1, "corrupt_image": 1}
    captions = _captions(summary)
    assert captions["a_b_img0"] == "caption number 0" and captions["a_img1"] == "caption number 1"
    assert "skipped: corrupt_image=1, missing_caption=1" in str(summary)


def test_parallel_workers_write_identical_shards(folder, tmp_path):
    serial = shards_from_source(str(folder), tmp_path / "s", samples_per_shard=4,
                                resize_longest=32, jpeg_quality=70, progress=False)
    parallel = shards_from_source(str(folder), tmp_path / "p", samples_per_shard=4,
                                  resize_longest=32, jpeg_quality=70, workers=2, progress=False)
    assert serial.skipped == parallel.skipped
    for a, b in zip(serial.shards, parallel.shards):
        assert open(a, "rb").read() == open(b, "rb").read()
    with tarfile.open(serial.shards[0]) as tar:
        name = next(n for n in tar.getnames() if n.endswith(".jpg"))
        assert Image.open(io.BytesIO(tar.extractfile(name).read())).size == (32, 32)


def test_csv_open_clip_layout_tab_separated(tmp_path):
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(5):
        (tmp_path / "img" / f"{i}.png").write_bytes(png_bytes(i))
        rows.append({"filepath": f"img/{i}.png", "title": f"title {i}"})
    rows.append({"filepath": "img/missing.png", "title": "gone"})
    rows.append({"filepath": "img/0.png", "title": ""})
    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["filepath", "title"], delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    summary = shards_from_source(str(tmp_path / "train.csv"), tmp_path / "out", progress=False)
    assert summary.num_samples == 5
    assert summary.skipped == {"missing_image": 1, "missing_caption": 1}
    assert sorted(_captions(summary).values()) == [f"title {i}" for i in range(5)]


def test_comma_csv_with_named_columns(tmp_path):
    (tmp_path / "x.png").write_bytes(png_bytes(3))
    (tmp_path / "pairs.csv").write_text("path,text,other\nx.png,\"hello, world\",1\n")
    summary = shards_from_source(str(tmp_path / "pairs.csv"), tmp_path / "out", progress=False)
    assert list(_captions(summary).values()) == ["hello, world"]
    with pytest.raises(ValueError, match="no caption column"):
        list(iter_source(str(tmp_path / "pairs.csv"), caption_column="title"))


def test_parquet_bytes_struct_and_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.png").write_bytes(png_bytes(9))
    table = pa.table({
        "image": [{"bytes": png_bytes(1), "path": None}, {"bytes": None, "path": "p.png"},
                  {"bytes": b"garbage", "path": None}],
        "caption": ["one", "two", "three"],
    })
    pq.write_table(table, tmp_path / "data.parquet")
    pq.write_table(pa.table({"jpg": [jpeg_bytes(5)], "text": ["raw bytes"]}),
                   tmp_path / "more.parquet")
    one = shards_from_source(str(tmp_path / "data.parquet"), tmp_path / "o1", progress=False)
    assert sorted(_captions(one).values()) == ["one", "two"]
    assert one.skipped == {"corrupt_image": 1}
    (tmp_path / "p.png").unlink()
    both = shards_from_source(str(tmp_path), tmp_path / "o2", progress=False)
    assert sorted(_captions(both).values()) == ["one", "raw bytes"]
    assert both.skipped == {"corrupt_image": 1, "missing_image": 1}


def test_hf_save_to_disk_and_imagefolder(tmp_path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    data = {"image": [{"bytes": png_bytes(i), "path": None} for i in range(4)],
            "text": [f"hf caption {i}" for i in range(4)]}
    ds = datasets.Dataset.from_dict(data, features=features)
    datasets.DatasetDict({"train": ds.select(range(3)), "validation": ds.select([3])}
                         ).save_to_disk(str(tmp_path / "hf"))
    train = shards_from_source(str(tmp_path / "hf"), tmp_path / "o1", split="train",
                               progress=False)
    assert sorted(_captions(train).values()) == [f"hf caption {i}" for i in range(3)]
    held_out = shards_from_source(str(tmp_path / "hf"), tmp_path / "o2", split="eval",
                                  progress=False)
    assert list(_captions(held_out).values()) == ["hf caption 3"]

    folder = tmp_path / "imagefolder" / "train"
    folder.mkdir(parents=True)
    with open(folder / "metadata.jsonl", "w") as f:
        for i in range(3):
            (folder / f"{i}.png").write_bytes(png_bytes(i))
            f.write(json.dumps({"file_name": f"{i}.png", "caption": f"folder {i}"}) + "\n")
    summary = shards_from_source(str(tmp_path / "imagefolder"), tmp_path / "o3",
                                 progress=False)
    assert sorted(_captions(summary).values()) == [f"folder {i}" for i in range(3)]


def test_builtin_sources_and_errors(tmp_path):
    summary = shards_from_source("synthetic:7:32", tmp_path / "syn", progress=False)
    assert summary.num_samples == 7
    with pytest.raises(FileNotFoundError):
        shards_from_source(str(tmp_path / "nope"), tmp_path / "x", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        shards_from_source(str(tmp_path / "empty"), tmp_path / "x", progress=False)
