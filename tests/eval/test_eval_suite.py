"""run_eval_suite end to end on the tiny open_clip model: ImageNet-layout folder, class folder,
classification shards, retrieval shards (eval's own reader), reports."""
import json

import numpy as np
import pytest

from vlp.eval import datasets as D
from vlp.eval.suite import run_eval_suite
from vlp.eval.retrieval import embed_retrieval, retrieval_metrics
from vlp.eval.report import markdown_tables
from eval_helpers import random_png, write_class_folders, write_tar


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldata")
    write_class_folders(root / "imagenet_val", ["n01440764", "n01443537", "n01484850"], per_class=3)
    write_class_folders(root / "pets", ["cat", "dog", "guinea_pig"], per_class=2, seed=1)
    rng = np.random.default_rng(2)
    (root / "cls").mkdir()
    (root / "cls" / "classnames.txt").write_text("cat\ndog\nfish\nbird\nfrog\nhorse\n")
    write_tar(root / "cls" / "0.tar", [(f"c{i}", {"png": random_png(rng), "cls": str(i % 6).encode()}) for i in range(8)])
    caps = [b"a red square", b"a blue dot\nsome blue thing", b"green", b"a yellow line\nyellow\nsun", b"night"]
    write_tar(root / "ret-0.tar", [(f"r{i}", {"png": random_png(rng), "txt": c}) for i, c in enumerate(caps[:3])])
    write_tar(root / "ret-1.tar", [(f"r{i}", {"png": random_png(rng), "txt": c}) for i, c in enumerate(caps[3:], 3)])
    return root


def test_suite_end_to_end(tiny_clip, data, tmp_path):
    model, tokenizer, transform = tiny_clip
    suite = {
        "batch_size": 4,
        "chunk_size": 2,
        "retrieval": [{"name": "toy-retrieval", "shards": str(data / "ret-{0..1}.tar")}],
        "classification": [
            {"name": "imagenet", "root": str(data / "imagenet_val"), "templates": "simple"},
            {"name": "pets", "root": str(data / "pets"), "templates": ["a photo of a {c}."]},
            {"name": "toy-shards", "shards": str(data / "cls" / "0.tar"), "templates": "simple", "batch_size": 3},
        ],
    }
    results = run_eval_suite(model, tokenizer, transform, suite, "cpu", str(tmp_path), show_progress=False)

    assert set(results) == {"toy-retrieval", "imagenet", "pets", "toy-shards"}
    ret = results["toy-retrieval"]
    assert (ret["n_images"], ret["n_texts"]) == (5, 8)
    loader = D.make_eval_loader(D.ShardRetrieval(str(data / "ret-{0..1}.tar"), transform, tokenizer), 2,
                                collate_fn=D.collate_retrieval)
    assert ret["metrics"] == retrieval_metrics(*embed_retrieval(model, loader, "cpu", show_progress=False))
    assert ret["clip_benchmark"]["image_retrieval_recall@1"] == ret["metrics"]["text_to_image_R@1"]
    assert ret["metrics"]["image_to_text_R@10"] == 1.0       # only 8 captions

    imnet = results["imagenet"]
    assert imnet["n"] == 9 and imnet["num_classes"] == 1000
    assert set(imnet["metrics"]) == {"top1", "top5", "mean_per_class_recall"}
    assert imnet["clip_benchmark"] == {"acc1": imnet["metrics"]["top1"], "acc5": imnet["metrics"]["top5"],
                                       "mean_per_class_recall": imnet["metrics"]["mean_per_class_recall"]}
    assert results["pets"]["num_classes"] == 3 and results["pets"]["metrics"]["top5"] == 1.0
    assert results["toy-shards"]["n"] == 8 and results["toy-shards"]["num_classes"] == 6

    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    md = (tmp_path / "metrics.md").read_text()
    assert "### retrieval" in md and "### classification" in md and "| imagenet |" in md


@pytest.mark.parametrize("suite, match", [
    ({"retrievals": []}, "unknown key"),
    ({"classification": [{"name": "x", "root": "/nonexistent", "template": "openai"}]}, "unknown key"),
    ({"classification": [{"root": "/nonexistent"}]}, "needs a 'name'"),
    ({"classification": [{"name": "x", "type": "lmdb", "root": "/r"}]}, "type must be"),
])
def test_suite_validation(tiny_clip, suite, match):
    model, tokenizer, transform = tiny_clip
    with pytest.raises(ValueError, match=match):
        run_eval_suite(model, tokenizer, transform, suite, "cpu", None, show_progress=False)


def test_markdown_formats_percentages():
    md = markdown_tables({"c": {"task": "classification", "n": 10,
                                "metrics": {"top1": 0.5, "top5": 0.875, "mean_per_class_recall": 0.25}}})
    assert "| c | 50.00 | 87.50 | 25.00 | 10 |" in md


def test_suite_file_with_a_duplicate_key_is_one_line(tmp_path):
    from vlp.eval.suite import load_suite

    path = tmp_path / "suite.yaml"
    path.write_text("batch_size: 8\nretrieval: []\nbatch_size: 16\n")
    with pytest.raises(ValueError, match=r"suite.yaml: duplicate key 'batch_size' on line 3 \(first on line 1\)"):
        load_suite(str(path))
