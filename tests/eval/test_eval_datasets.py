"""ImageNet synset table, class folders and eval shards."""
import re

import numpy as np
import pytest
import torch

from eval_helpers import random_png, write_class_folders, write_tar
from vlp.eval import datasets as D


def test_synsets_are_the_1000_sorted_ilsvrc_wnids():
    import open_clip

    wnids = D.read_imagenet_synsets()
    assert len(wnids) == 1000 == len(set(wnids)) == len(open_clip.IMAGENET_CLASSNAMES)
    assert wnids == sorted(wnids)
    assert all(re.fullmatch(r"n\d{8}", w) for w in wnids)
    # spot checks of the index ↔ open_clip class-name correspondence
    names = dict(zip(wnids, open_clip.IMAGENET_CLASSNAMES))
    assert names["n01440764"] == "tench" and names["n01443537"] == "goldfish"
    assert names["n02123045"] == "tabby cat" and names["n02509815"] == "red panda"
    assert names["n04592741"] == "airplane wing" and names["n15075141"] == "toilet paper"


def test_imagenet_folder_uses_global_indices(tmp_path):
    folders = ["n01443537", "n02509815", "n15075141"]
    write_class_folders(tmp_path, folders, per_class=2)
    (tmp_path / "n01443537" / "notes.txt").write_text("ignored")
    ds, classnames = D.imagenet_folder(tmp_path, transform=lambda im: torch.tensor(im.size))
    assert len(classnames) == 1000 and len(ds) == 6
    assert sorted({label for _, label in ds.samples}) == [1, 387, 999]
    img, label = ds[0]
    assert label == 1 and img.tolist() == [40, 36]


def test_imagenet_folder_rejects_unknown_folders(tmp_path):
    write_class_folders(tmp_path, ["n01443537", "cats"], per_class=1)
    with pytest.raises(ValueError, match="not ImageNet-1k wnids"):
        D.imagenet_folder(tmp_path)


def test_class_folder_names(tmp_path):
    write_class_folders(tmp_path, ["red_panda", "ant"], per_class=1)
    ds, names = D.class_folder(tmp_path)
    assert names == ["ant", "red panda"] and [l for _, l in ds.samples] == [0, 1]
    (tmp_path.parent / "names.txt").write_text("formica\nailurus\n")
    assert D.class_folder(tmp_path, classnames=str(tmp_path.parent / "names.txt"))[1] == ["formica", "ailurus"]
    with pytest.raises(ValueError, match="1 class names for 2 folders"):
        D.class_folder(tmp_path, classnames=["x"])


def test_shard_classification_and_retrieval(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "test").mkdir()
    (tmp_path / "classnames.txt").write_text("cat\ndog\n")
    write_tar(tmp_path / "test" / "0.tar", [("s0", {"png": random_png(rng), "cls": b"1", "txt": b"a dog\nmy dog\n"}),
                                            ("s1", {"png": random_png(rng), "cls": b"0\n", "txt": b"a cat"})])
    write_tar(tmp_path / "test" / "1.tar", [("dir/s2", {"png": random_png(rng), "cls": b"0", "txt": b"cat"})])
    spec = str(tmp_path / "test" / "{0..1}.tar")
    assert D.expand_shards(spec) == D.expand_shards(str(tmp_path / "test")) == D.expand_shards(str(tmp_path / "test/*.tar"))
    assert D.shard_classnames(spec, None) == ["cat", "dog"]

    size = lambda im: torch.tensor(im.size)
    cls = list(D.make_eval_loader(D.ShardClassification(spec, size), batch_size=2, num_workers=2))
    labels = sorted(torch.cat([y for _, y, _ in cls]).tolist())
    assert labels == [0, 0, 1]

    tokenize = lambda caps: torch.tensor([[len(c), 0] for c in caps])
    batches = list(D.make_eval_loader(D.ShardRetrieval(spec, size, tokenize), batch_size=2,
                                      collate_fn=D.collate_retrieval))
    assert [b["key"] for b in batches] == [["s0", "s1"], ["dir/s2"]]
    assert batches[0]["text"][0].tolist() == [[5, 0], [6, 0]] and batches[0]["image"].shape == (2, 2)


def test_shard_errors(tmp_path):
    rng = np.random.default_rng(0)
    write_tar(tmp_path / "a.tar", [("s0", {"png": random_png(rng)})])
    with pytest.raises(ValueError, match="no 'cls' label"):
        list(D.ShardClassification(str(tmp_path / "a.tar"), None))
    with pytest.raises(ValueError, match="no caption"):
        list(D.ShardRetrieval(str(tmp_path / "a.tar"), None, lambda c: c))
    with pytest.raises(FileNotFoundError):
        D.expand_shards(str(tmp_path / "missing-{0..1}.tar"))
