"""Zero-shot classifier and metrics: hand-computed cases and parity with open_clip."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from vlp.eval.zeroshot import (accuracy_from_ranks, build_classifier, fill_template, load_templates, predictions,
                               recall_from_predictions, target_ranks, zeroshot_classify)


def mean_per_class_recall(logits, targets, num_classes: int) -> float:
    """The metric from logits: the rank-1 predictions' recall per class, averaged."""
    return recall_from_predictions(predictions(logits), targets, num_classes)

CLASSNAMES = ["cat", "dog", "goldfish", "red panda", "toilet paper", "bus", "tree", "car", "ship", "frog"]


# ----------------------------------------------------------------------------- hand-computed

def hand_logits():
    logits = torch.tensor([[0.1, 0.5, 0.4],     # target 2 behind class 1           → rank 2, pred 1
                           [0.9, 0.05, 0.05],   # target 0                          → rank 1, pred 0
                           [0.2, 0.2, 0.6],     # target 1 behind 2, tie with 0 (0 first) → rank 3, pred 2
                           [0.3, 0.3, 0.3],     # all tied, target 2                → rank 3, pred 0
                           [0.0, 0.0, 1.0]])    # target 2                          → rank 1, pred 2
    return logits, torch.tensor([2, 0, 1, 2, 2])


def test_topk_hand_computed():
    logits, targets = hand_logits()
    assert accuracy_from_ranks(target_ranks(logits, targets), (1, 2, 3)) == {"top1": 2 / 5, "top2": 3 / 5, "top3": 1.0}
    assert accuracy_from_ranks(target_ranks(logits, targets), (5,)) == {"top5": 1.0}   # k > C: everything hits


def test_mean_per_class_recall_hand_computed():
    logits, targets = hand_logits()
    # class 0: 1/1, class 1: 0/1, class 2: 1/3 (rows 0, 3, 4 → preds 1, 0, 2); class 3 absent → skipped
    assert mean_per_class_recall(logits, targets, num_classes=4) == pytest.approx((1 + 0 + 1 / 3) / 3)


def test_templates():
    assert len(load_templates("openai")) == 80 and len(load_templates("simple")) == 7
    assert fill_template("a {} of a {c}", "cat") == "a cat of a cat"
    assert fill_template("{x} {}", "cat") == "{x} cat"
    with pytest.raises(ValueError, match="placeholder"):
        load_templates(["no placeholder"])
    with pytest.raises(ValueError):
        load_templates("not-a-template-set")


def test_template_file(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("# comment\na photo of a {c}.\n\nart of the {}.\n")
    tpl = load_templates(str(p))
    assert [fill_template(t, "dog") for t in tpl] == ["a photo of a dog.", "art of the dog."]


# ----------------------------------------------------------------------------- parity with open_clip

@pytest.mark.parametrize("templates", ["openai", "simple", "file"])
def test_classifier_matches_open_clip(tiny_clip, templates, tmp_path):
    import open_clip

    model, tokenizer, _ = tiny_clip
    if templates == "file":
        (tmp_path / "t.txt").write_text("a photo of a {}.\na drawing of the {}.\n")
        ours_tpl = load_templates(str(tmp_path / "t.txt"))
        ref_tpl = ["a photo of a {}.", "a drawing of the {}."]
    else:
        ours_tpl = load_templates(templates)
        ref_tpl = open_clip.OPENAI_IMAGENET_TEMPLATES if templates == "openai" else open_clip.SIMPLE_IMAGENET_TEMPLATES
    ref = open_clip.build_zero_shot_classifier(model, tokenizer, CLASSNAMES, ref_tpl, num_classes_per_batch=4)
    ours = build_classifier(model, tokenizer, CLASSNAMES, ours_tpl, "cpu", batch_size=3)
    if templates != "file":
        assert torch.equal(build_classifier(model, tokenizer, CLASSNAMES, templates, "cpu", batch_size=3), ours)
    assert ours.shape == (64, len(CLASSNAMES))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.norm(dim=0), torch.ones(len(CLASSNAMES)))


def topk_reference(logits, targets, k):
    """open_clip_train.zero_shot.accuracy (its float(ndarray) breaks on numpy 2): top-k by topk."""
    pred = logits.topk(k, 1, True, True)[1].t()
    return float(pred.eq(targets.view(1, -1).expand_as(pred)).float().sum())


def test_zeroshot_classify_matches_open_clip_reference(tiny_clip):
    model, tokenizer, _ = tiny_clip
    g = torch.Generator().manual_seed(0)
    images = torch.randn(40, 3, 32, 32, generator=g)
    targets = torch.randint(0, len(CLASSNAMES), (40,), generator=g)
    loader = DataLoader(TensorDataset(images, targets), batch_size=16)
    clf = build_classifier(model, tokenizer, CLASSNAMES, load_templates("simple"), "cpu")

    ours = zeroshot_classify(model, clf, loader, "cpu", show_progress=False)
    # open_clip_train.zero_shot.run's loop: model(image=...) features, 100 × logits, top-k counts
    ref1 = ref5 = 0.0
    with torch.no_grad():
        for x, y in loader:
            logits = 100.0 * model(image=x)[0] @ clf
            ref1, ref5 = ref1 + topk_reference(logits, y, 1), ref5 + topk_reference(logits, y, 5)
    assert ours["n"] == 40
    assert ours["top1"] == ref1 / 40 and ours["top5"] == ref5 / 40
    assert 0 < ours["top5"] < 1                        # a non-trivial check

    with torch.no_grad():
        logits = model.encode_image(images, normalize=True) @ clf
    assert accuracy_from_ranks(target_ranks(logits, targets), (1, 5)) == {"top1": ref1 / 40, "top5": ref5 / 40}
    assert ours["mean_per_class_recall"] == pytest.approx(mean_per_class_recall(logits, targets, len(CLASSNAMES)))


def test_label_out_of_range_is_an_error(tiny_clip):
    model, tokenizer, _ = tiny_clip
    clf = torch.nn.functional.normalize(torch.randn(64, 3), dim=0)
    loader = [(torch.randn(2, 3, 32, 32), torch.tensor([0, 3]))]
    with pytest.raises(ValueError, match="label outside"):
        zeroshot_classify(model, clf, loader, "cpu", show_progress=False)
