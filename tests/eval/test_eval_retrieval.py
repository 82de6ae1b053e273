"""Retrieval metrics: hand-computed cases, chunked == full stable argsort (ties included),
and embed_retrieval's caption/key bookkeeping."""

import pytest
import torch

from vlp.eval.retrieval import (clip_benchmark_names, embed_retrieval, retrieval_metrics,
                            summarize_ranks)


# ----------------------------------------------------------------------------- hand-computed

def hand_case():
    # scores img·txt (rows: images, cols: captions t0..t4); positives marked *
    #        t0   t1   t2   t3   t4
    #  i0:   1*   0    2    1*   0      best positive t0 (tie with t3, lower index) behind t2 → 2
    #  i1:   0    2*   1    1    1      → 1
    #  i2:   1    2    3*   2    1*     → 1
    # text→image: t0: i0=1* ties i2=1 (i0 first) → 1; t1: i1=2* ties i2 → 1; t2: i2=3* → 1;
    #             t3: i0=1* behind i2=2, ties i1 (i0 first) → 2; t4: i2=1* ties i1=1 (i1 first) → 2
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    txt = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    txt_to_img = torch.tensor([0, 1, 2, 0, 2])
    return img, txt, txt_to_img


@pytest.mark.parametrize("chunk_size", [1, 2, 4096])
def test_hand_computed_retrieval(chunk_size):
    m = retrieval_metrics(*hand_case(), ks=(1, 2, 5), chunk_size=chunk_size)
    assert m["image_to_text_R@1"] == pytest.approx(2 / 3)
    assert m["image_to_text_R@2"] == 1.0 and m["image_to_text_R@5"] == 1.0
    assert m["image_to_text_mean_rank"] == pytest.approx(4 / 3)
    assert m["image_to_text_median_rank"] == 1.0
    assert m["text_to_image_R@1"] == pytest.approx(3 / 5)
    assert m["text_to_image_R@2"] == 1.0
    assert m["text_to_image_mean_rank"] == pytest.approx(7 / 5)
    assert m["text_to_image_median_rank"] == 1.0
    assert len(m) == 2 * (3 + 2)


def test_summarize_ranks_hand_computed():
    m = summarize_ranks(torch.tensor([1, 3, 2, 7]), "x")
    assert m == {"x_R@1": 0.25, "x_R@5": 0.75, "x_R@10": 1.0, "x_mean_rank": 3.25, "x_median_rank": 2.5}
    assert summarize_ranks(torch.tensor([4, 1, 9]), "y", ks=(1,))["y_median_rank"] == 4.0


def test_clip_benchmark_names():
    m = retrieval_metrics(*hand_case())
    cb = clip_benchmark_names(m)
    assert cb == {"image_retrieval_recall@1": m["text_to_image_R@1"], "image_retrieval_recall@5": 1.0,
                  "image_retrieval_recall@10": 1.0, "text_retrieval_recall@1": m["image_to_text_R@1"],
                  "text_retrieval_recall@5": 1.0, "text_retrieval_recall@10": 1.0}
    assert clip_benchmark_names({"top1": 0.5, "top5": 0.9, "mean_per_class_recall": 0.4}) == {
        "acc1": 0.5, "acc5": 0.9, "mean_per_class_recall": 0.4}


def test_image_without_caption_is_an_error():
    img, txt, _ = hand_case()
    with pytest.raises(ValueError, match="no caption"):
        retrieval_metrics(img, txt, torch.tensor([0, 0, 0, 1, 1]))


# ----------------------------------------------------------------------------- parity

def naive_ranks(query, cand, positives):
    """Full score matrix + stable descending argsort; rank of the first positive (1-based)."""
    scores = query.float() @ cand.float().T
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranks = []
    for i in range(query.shape[0]):
        pos = torch.tensor([int(o) in positives[i] for o in order[i]])
        ranks.append(int(pos.nonzero()[0]) + 1)
    return torch.tensor(ranks)


def naive_metrics(img, txt, txt_to_img, ks=(1, 5, 10)):
    i2t = naive_ranks(img, txt, [set((txt_to_img == i).nonzero().flatten().tolist()) for i in range(len(img))])
    t2i = naive_ranks(txt, img, [{int(i)} for i in txt_to_img])
    return {**summarize_ranks(i2t, "image_to_text", ks), **summarize_ranks(t2i, "text_to_image", ks)}


def make_features(seed, n_img=12, d=8, quantised=True):
    g = torch.Generator().manual_seed(seed)
    if quantised:  # values in {-1, -.5, 0, .5, 1}: every dot product is exact → many exact ties
        img = torch.randint(-2, 3, (n_img, d), generator=g).float() / 2
    else:
        img = torch.nn.functional.normalize(torch.randn(n_img, d, generator=g), dim=1)
    img[5] = img[2]                                      # duplicated image
    caps_per_img = torch.randint(1, 5, (n_img,), generator=g)  # 1..4 captions per image
    txt_to_img = torch.repeat_interleave(torch.arange(n_img), caps_per_img)
    txt_to_img = txt_to_img[torch.randperm(len(txt_to_img), generator=g)]
    if quantised:
        txt = torch.randint(-2, 3, (len(txt_to_img), d), generator=g).float() / 2
        txt[3] = txt[0]                                  # duplicated captions
        txt[txt_to_img == 7] = img[7]
    else:
        txt = torch.nn.functional.normalize(img[txt_to_img] + 0.7 * torch.randn(len(txt_to_img), d, generator=g), dim=1)
    return img, txt, txt_to_img


@pytest.mark.parametrize("quantised", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_equals_full_argsort(seed, quantised):
    img, txt, txt_to_img = make_features(seed, quantised=quantised)
    ks = (1, 2, 5, 10)
    ref = naive_metrics(img, txt, txt_to_img, ks)
    for chunk in (1, 3, len(img), len(txt)):
        assert retrieval_metrics(img, txt, txt_to_img, ks=ks, chunk_size=chunk) == ref


def test_quantised_case_really_has_ties_at_positives():
    img, txt, txt_to_img = make_features(0)
    s = txt @ img.T
    pos = s[torch.arange(len(txt)), txt_to_img]
    assert int(((s == pos[:, None]).sum(1) > 1).sum()) > 3


def test_ties_follow_candidate_index():
    # All scores equal: the rank is the positive's index (+1) among candidates.
    img = torch.ones(4, 3)
    txt = torch.ones(4, 3)
    m = retrieval_metrics(img, txt, torch.tensor([3, 2, 1, 0]), ks=(1, 2, 3, 4), chunk_size=3)
    assert [m[f"text_to_image_R@{k}"] for k in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert m["text_to_image_mean_rank"] == 2.5 and m["text_to_image_median_rank"] == 2.5


class LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the largest tensor any torch op returns."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.max_numel = max(self.max_numel, out.numel())
        return out


def test_memory_is_chunk_times_candidates():
    img, txt, txt_to_img = make_features(0, n_img=40, d=4)
    with LargestTensor() as spy:
        retrieval_metrics(img, txt, txt_to_img, chunk_size=3)
    assert spy.max_numel <= max(3 * len(txt), 4 * len(txt)) < 40 * len(txt)  # chunk×M or M×d, never N×M


# ----------------------------------------------------------------------------- embedding

class FakeCLIP(torch.nn.Module):
    """encode_image: mean pixel per channel; encode_text: first 3 token ids — both normalised."""

    def encode_image(self, x, normalize=False):
        self.image_calls = getattr(self, "image_calls", 0) + x.shape[0]
        f = x.flatten(2).mean(-1)
        return torch.nn.functional.normalize(f, dim=-1) if normalize else f

    def encode_text(self, t, normalize=False):
        f = t[:, :3].float()
        return torch.nn.functional.normalize(f, dim=-1) if normalize else f


def test_embed_retrieval_groups_captions_by_key():
    imgs = torch.rand(4, 3, 2, 2) + 0.1
    tok = lambda *ids: torch.tensor([ids[0], ids[1], ids[2], 0])
    batches = [
        # one caption per row, key "b" repeated within and across batches
        {"image": imgs[[0, 1, 1]], "text": torch.stack([tok(1, 0, 0), tok(0, 1, 0), tok(0, 2, 1)]), "key": ["a", "b", "b"]},
        # K captions per row as [B, K, L]
        {"image": imgs[[2, 1]], "text": torch.stack([torch.stack([tok(1, 1, 0), tok(1, 2, 0)]),
                                                      torch.stack([tok(3, 1, 1), tok(1, 1, 1)])]), "key": ["c", "b"]},
        # variable captions as a list
        {"image": imgs[[3]], "text": [torch.stack([tok(5, 1, 1), tok(1, 5, 1), tok(1, 1, 5)])], "key": ["d"]},
    ]
    model = FakeCLIP()
    img_emb, txt_emb, txt_to_img = embed_retrieval(model, batches, "cpu", show_progress=False)
    assert model.image_calls == 4                      # "b" embedded once
    assert img_emb.shape == (4, 3) and txt_emb.shape == (10, 3)
    assert txt_to_img.tolist() == [0, 1, 1, 2, 2, 1, 1, 3, 3, 3]
    torch.testing.assert_close(img_emb, torch.nn.functional.normalize(imgs.flatten(2).mean(-1), dim=-1))
    assert torch.allclose(txt_emb.norm(dim=1), torch.ones(10))


def test_embed_retrieval_without_keys_and_precision():
    imgs = torch.rand(3, 3, 2, 2) + 0.1
    batch = {"image": imgs, "text": torch.tensor([[1, 2, 3], [3, 2, 1], [1, 1, 1]])}
    img_emb, txt_emb, txt_to_img = embed_retrieval(FakeCLIP(), [batch], "cpu", precision="amp_bf16",
                                                   show_progress=False)
    assert img_emb.dtype == torch.float32 and txt_to_img.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="precision"):
        embed_retrieval(FakeCLIP(), [batch], "cpu", precision="fp8", show_progress=False)
