"""Eval input formats: CLIP_benchmark's webdataset layout (classification and retrieval), class
folders from `vlp eval --classes`, and eval's one retrieval reader (issue 14 item 6, issue 16
item 1)."""
import json

import numpy as np
import pytest

from vlp.eval import datasets as D
from vlp.eval.retrieval import embed_retrieval, retrieval_metrics
from vlp.eval.suite import run_eval_suite, wds_entry
from vlp.eval.zeroshot import build_classifier, zeroshot_classify
from eval_helpers import random_png, write_class_folders, write_tar


@pytest.fixture(scope="module")
def wds(tmp_path_factory):
    """Two CLIP_benchmark-style wds folders: wds_toyclass (cls members, classnames.txt,
    zeroshot_classification_templates.txt, test/ with 2 shards) and wds_toyret (txt members with
    several captions per image, one escaped newline)."""
    root = tmp_path_factory.mktemp("wds")
    rng = np.random.default_rng(0)
    cls = root / "wds_toyclass"
    (cls / "test").mkdir(parents=True)
    (cls / "classnames.txt").write_text("apple\nbanana\ncherry\n")
    (cls / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\nart of the {c}.\n")
    samples = [(f"s{i:04d}", {"webp" if i % 2 else "png": random_png(rng), "cls": str(i % 3).encode()})
               for i in range(7)]
    write_tar(cls / "test" / "0.tar", samples[:4])
    write_tar(cls / "test" / "1.tar", samples[4:])
    ret = root / "wds_toyret"
    (ret / "test").mkdir(parents=True)
    caps = [b"a red square\nsomething red", b"a blue dot", b"two lines\\nin one caption\nand a second one"]
    write_tar(ret / "test" / "0.tar", [(f"r{i}", {"jpg": random_png(rng), "txt": c}) for i, c in enumerate(caps)])
    return root


def test_wds_entry_picks_the_task(wds):
    assert wds_entry(str(wds / "wds_toyclass")) == (
        "classification", {"name": "toyclass", "wds": str(wds / "wds_toyclass"), "split": "test"})
    assert wds_entry(str(wds / "wds_toyret"))[0] == "retrieval"
    with pytest.raises(FileNotFoundError, match="no train/ folder"):
        wds_entry(str(wds / "wds_toyret"), split="train")


def test_wds_classification_uses_the_sets_names_and_templates(tiny_clip, wds):
    model, tokenizer, transform = tiny_clip
    root = wds / "wds_toyclass"
    res = run_eval_suite(model, tokenizer, transform, {"classification": [{"name": "toy", "wds": str(root)}]},
                         "cpu", None, show_progress=False)["toy"]
    assert (res["n"], res["num_classes"]) == (7, 3)
    assert res["templates"] == str(root / "zeroshot_classification_templates.txt")
    # the same numbers by hand: classifier from those names and templates, labels from "cls"
    clf = build_classifier(model, tokenizer, ["apple", "banana", "cherry"], ["a photo of a {c}.", "art of the {c}."],
                           "cpu")
    loader = D.make_eval_loader(D.ShardClassification(str(root / "test"), transform), 64)
    ref = zeroshot_classify(model, clf, loader, "cpu", show_progress=False)
    assert ref.pop("n") == 7 and res["metrics"] == ref


def test_wds_retrieval_reads_every_caption_line(tiny_clip, wds):
    model, tokenizer, transform = tiny_clip
    res = run_eval_suite(model, tokenizer, transform, {"retrieval": [{"name": "r", "wds": str(wds / "wds_toyret")}]},
                         "cpu", None, show_progress=False)["r"]
    assert (res["n_images"], res["n_texts"]) == (3, 5)
    seen = []
    counting_tok = lambda caps: seen.extend(caps) or tokenizer(caps)  # noqa: E731
    list(D.ShardRetrieval(str(wds / "wds_toyret" / "test"), transform, counting_tok))
    assert seen == ["a red square", "something red", "a blue dot", "two lines\nin one caption", "and a second one"]


def test_the_one_reader_takes_the_training_caption_members(tiny_clip, tmp_path):
    """Shards written for training (caption member 'caption' or 'txt', one per sample) read the
    same as the trainer's eval sees them; an undecodable image is counted, not fatal."""
    model, tokenizer, transform = tiny_clip
    rng = np.random.default_rng(1)
    write_tar(tmp_path / "0.tar", [("a", {"png": random_png(rng), "caption": b"first"}),
                                   ("b", {"png": b"not an image", "txt": b"second"}),
                                   ("c", {"jpg": random_png(rng), "txt": b"third"})])
    res = run_eval_suite(model, tokenizer, transform, {"retrieval": [{"name": "r", "shards": str(tmp_path / "0.tar")}]},
                         "cpu", None, show_progress=False)["r"]
    assert (res["n_images"], res["n_texts"], res["skipped"]) == (2, 2, {"corrupt_image": 1})
    loader = D.make_eval_loader(D.ShardRetrieval(str(tmp_path / "0.tar"), transform, tokenizer), 2,
                                collate_fn=D.collate_retrieval)
    assert res["metrics"] == retrieval_metrics(*embed_retrieval(model, loader, "cpu", show_progress=False))


def test_trainer_and_vlp_eval_use_eval_s_reader(monkeypatch, tiny_clip, tmp_path):
    """Neither the trainer nor `vlp eval` hands eval another loader: run_eval_suite takes none."""
    import inspect

    from vlp.eval import suite

    assert "make_loader" not in inspect.signature(suite.run_eval_suite).parameters
    calls = []
    real = D.ShardRetrieval
    monkeypatch.setattr(D, "ShardRetrieval", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    rng = np.random.default_rng(2)
    write_tar(tmp_path / "0.tar", [("a", {"png": random_png(rng), "txt": b"x"}), ("b", {"png": random_png(rng), "txt": b"y"})])
    model, tokenizer, transform = tiny_clip
    run_eval_suite(model, tokenizer, transform, {"retrieval": [{"name": "r", "shards": str(tmp_path / "0.tar")}]},
                   "cpu", None, show_progress=False)
    assert calls == [str(tmp_path / "0.tar")]


def test_class_folder_entry_from_the_cli_builder(tmp_path):
    from vlp.eval.checkpoints import build_suite

    write_class_folders(tmp_path / "pets", ["cat", "dog"], per_class=1)
    spec = build_suite(None, None, None, "simple", 8, "fp32", classes=[str(tmp_path / "pets")],
                       wds=[])
    assert spec["classification"] == [{"name": "pets", "type": "folder", "root": str(tmp_path / "pets"),
                                       "templates": "simple"}]
    with pytest.raises(FileNotFoundError, match="--classes: no such folder"):
        build_suite(None, None, None, "simple", 8, "fp32", classes=[str(tmp_path / "nope")])


def test_reports_state_units(tiny_clip, tmp_path):
    model, tokenizer, transform = tiny_clip
    write_class_folders(tmp_path / "set", ["a", "b"], per_class=1)
    results = run_eval_suite(model, tokenizer, transform,
                             {"classification": [{"name": "s", "root": str(tmp_path / "set"), "templates": "simple"}]},
                             "cpu", str(tmp_path / "out"), show_progress=False)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["s"]["units"].startswith("fractions in [0, 1]")
    md = (tmp_path / "out" / "metrics.md").read_text()
    assert "in percent" in md and f"| s | {100 * results['s']['metrics']['top1']:.2f} |" in md
