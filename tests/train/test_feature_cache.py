"""The locked-tower feature cache (vlp/train/feature_cache.py): a cached LiT run equals the
uncached one with train_transform=eval (losses and weights), the refusals are one line, the
cache file is reused and keyed on what makes it, retrieval ranks from cached stems are exact."""
import json

import pytest
import torch

from vlp.config import ConfigError, LossConfig, ModelConfig
from vlp.experiment import load_config
from vlp.models.cached import check_cacheable, tower_split
from vlp.models.model import build_model
from vlp.train import feature_cache as fc
import forked
from lit_fixtures import bert_dir, timm_json  # noqa: F401  (fixtures: a tiny LiT model)
from vlp_testing import REPO

@pytest.fixture(autouse=True)
def fresh_memo():
    fc._MEMO.clear()
    yield
    fc._MEMO.clear()


def _lit(shards, out, timm_json, bert_dir, *extra):
    """A LiT config: both towers locked, the eval transform, 2 epochs of the 160 tiny pairs."""
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", f"model.name={timm_json}",
        f"model.hf_text_dir={bert_dir}", "model.lock_image=true", "model.lock_text=true",
        "data.train_transform=eval", "data.batch_per_device=16", "train.samples=320", "train.log_every=5",
        "optim.lr=1e-2", "optim.warmup_steps=1", "eval.batch_size=48", *extra])


def _run(cfg):
    """(every loss value the trainer computed, final state dict, trainer)."""
    from vlp.train.loop import Trainer

    torch.manual_seed(0)
    t = Trainer(cfg)
    losses, inner = [], t.compute_gradients

    def recording(*args, **kwargs):
        loss, metrics = inner(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss, metrics

    t.compute_gradients = recording  # each step's global loss
    t.train()
    return losses, {k: v.detach().clone() for k, v in t.unwrapped.state_dict().items()}, t


@pytest.mark.parametrize("extra", [
    ("loss.name=infonce",),
    ("loss.name=sogclr", "train.accum_steps=2"),
    ("loss.name=siglip",),
], ids=["infonce", "sogclr-accum2", "siglip"])
def test_cached_run_equals_the_uncached_run(tiny_shards, tmp_path, timm_json, bert_dir, extra):
    plain = _lit(tiny_shards, tmp_path / "plain", timm_json, bert_dir, *extra)
    cached = _lit(tiny_shards, tmp_path / "cached", timm_json, bert_dir, *extra, "data.feature_cache=memory")
    losses_a, weights_a, _ = _run(plain)
    losses_b, weights_b, t = _run(cached)
    assert t.data.features is not None and t.data.epoch >= 1 and t.step == 320 // t.global_batch  # the cache served two epochs
    assert len(losses_a) == len(losses_b) >= 10
    assert losses_b == pytest.approx(losses_a, abs=1e-6)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], atol=1e-6, rtol=0, msg=name)
    head = "clip.visual.head.proj.weight"
    assert not torch.equal(weights_b[head], _run_init(cached)[head])  # the heads did train


def _run_init(cfg):
    torch.manual_seed(0)
    model, *_ = build_model(cfg.model, cfg.loss)
    return model.state_dict()


def test_native_towers_locked_whole_are_cached_whole(tiny_shards, tmp_path):
    """An open_clip ViT and text transformer locked whole: stem = the whole tower, head = identity;
    only the temperature trains, and it trains the same way."""
    base = [f"data.train_shards={tiny_shards['train']}", "model.name=vlp-micro", "model.lock_image=true",
            "model.lock_text=true", "data.train_transform=eval", "data.batch_per_device=16", "train.samples=160",
            "optim.lr=1e-2", "optim.warmup_steps=1"]
    losses_a, weights_a, _ = _run(load_config(None, base + [f"train.output_dir={tmp_path / 'a'}"]))
    losses_b, weights_b, t = _run(load_config(None, base + [f"train.output_dir={tmp_path / 'b'}",
                                                           "data.feature_cache=memory"]))
    assert [s.kind for s in check_cacheable(t.unwrapped)] == ["whole", "whole"]
    assert losses_b == pytest.approx(losses_a, abs=1e-6)
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], atol=1e-6, rtol=0, msg=name)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("extra,needle", [
    (("data.train_transform=augment",), "data.train_transform=eval"),
    (("model.lock_text=false",), "model.lock_text=false"),
    (("model.lock_image_unlocked_groups=1",), "model.lock_image_unlocked_groups=1"),
])
def test_config_refusals_are_one_line(tiny_shards, tmp_path, timm_json, bert_dir, extra, needle):
    with pytest.raises(ConfigError) as e:
        _lit(tiny_shards, tmp_path, timm_json, bert_dir, "data.feature_cache=memory", *extra)
    assert "\n" not in str(e.value) and needle in str(e.value) and "data.feature_cache" in str(e.value)


def test_model_refusals_are_one_line(timm_json, bert_dir):
    model, *_ = build_model(ModelConfig(name=timm_json, hf_text_dir=bert_dir, lock_image=True, lock_text=True),
                            LossConfig())
    check_cacheable(model)
    next(model.clip.visual.trunk.parameters()).requires_grad_(True)  # a trunk that trains
    with pytest.raises(ValueError, match=r"image tower's stem has trainable parameters \(visual\.trunk\.") as e:
        check_cacheable(model)
    assert "\n" not in str(e.value)
    vit, *_ = build_model(ModelConfig(name="vlp-micro", lock_text=True), LossConfig())  # a ViT that trains
    with pytest.raises(ValueError, match="image tower VisionTransformer cannot be cached") as e:
        tower_split(vit, "image")
    assert "\n" not in str(e.value)


def test_a_never_cached_id_raises():
    cache = fc.FeatureCache("k" * 64, torch.zeros(4, 2), torch.zeros(4, 3), torch.tensor([True, False, True, True]))
    assert cache.lookup(torch.tensor([0, 2]))[0].shape == (2, 2)
    for ids in ([1], [7]):
        with pytest.raises(ValueError, match=f"sample id {ids[0]} was never cached"):
            cache.lookup(torch.tensor(ids))


# ----------------------------------------------------------------------------- the file and the key

def test_the_cache_file_is_reused_and_a_damaged_one_rebuilt(tiny_shards, tmp_path, timm_json, bert_dir, capsys):
    from vlp.train.loop import Trainer

    folder = tmp_path / "fc"
    cfg = lambda out: _lit(tiny_shards, tmp_path / out, timm_json, bert_dir, f"data.feature_cache={folder}")  # noqa: E731
    first = Trainer(cfg("a"))
    assert "training: built 160 samples" in capsys.readouterr().out
    files = list(folder.glob("*.pt"))
    assert [f.stem for f in files] == [first.data.features.key]
    fc._MEMO.clear()  # another process: only the file
    second = Trainer(cfg("b"))
    assert f"training: reused {files[0]}" in capsys.readouterr().out
    assert torch.equal(second.data.features.image, first.data.features.image)
    calls = []
    for stem in (second.unwrapped.clip.visual.trunk, second.unwrapped.clip.text.transformer):
        stem.register_forward_hook(lambda *_: calls.append(1))
    second.train()  # two epochs on the file's features: the stems never run
    assert calls == [] and second.step == 20
    third = Trainer(cfg("c"))  # the same process: the memo
    assert "reused from memory" in capsys.readouterr().out and third.data.features.key == first.data.features.key
    fc._MEMO.clear()
    files[0].write_bytes(b"not a torch file")
    fourth = Trainer(cfg("d"))
    out, err = capsys.readouterr()
    assert "is unreadable" in err and "rebuilding it" in err and "training: built 160 samples" in out
    assert torch.equal(fourth.data.features.text, first.data.features.text)


def test_the_key_follows_shards_and_weights(tiny_shards, timm_json, bert_dir):
    from loaders import make_loader

    model, tok, _, tf = build_model(ModelConfig(name=timm_json, hf_text_dir=bert_dir, lock_image=True,
                                                lock_text=True), LossConfig())
    splits = check_cacheable(model)

    def key(spec, batch=48):
        plan = make_loader(spec, batch_size=8, transform=None, tokenize=tok).plan
        return fc.cache_key(model, splits, "train", tf, tok, fc.shards_id(plan.paths, plan.sizes), batch)

    both = key(tiny_shards["train"])
    assert key(tiny_shards["train"]) == both
    assert key(tiny_shards["eval"]) != both and key(tiny_shards["train"], 16) != both
    weight = next(model.clip.visual.trunk.parameters())
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1e-3)
    assert key(tiny_shards["train"]) != both
    with torch.no_grad():
        weight.copy_(kept)
        model.clip.visual.head.proj.weight.add_(1.0)  # the heads are not part of the key
    assert key(tiny_shards["train"]) == both


# ----------------------------------------------------------------------------- retrieval

def test_retrieval_ranks_from_cached_stems_are_exact(tiny_shards, timm_json, bert_dir):
    from vlp.eval.retrieval import retrieval_ranks
    from vlp.eval.suite import embed_retrieval_shards

    torch.manual_seed(3)
    model, tok, _, tf = build_model(ModelConfig(name=timm_json, hf_text_dir=bert_dir, lock_image=True,
                                                lock_text=True), LossConfig())
    img_ref, txt_ref, t2i_ref = embed_retrieval_shards(model, tok, tf, tiny_shards["eval"], "cpu", 16)
    img_feat, txt_feat, t2i = fc.retrieval_features(model, tok, tf, tiny_shards["eval"], "cpu", 16)
    assert torch.equal(t2i, t2i_ref) and img_feat.shape[0] == img_ref.shape[0] == 40
    img_emb, txt_emb = fc.embed_features(model, img_feat, txt_feat)
    torch.testing.assert_close(img_emb, img_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(txt_emb, txt_ref, atol=1e-6, rtol=0)
    for got, ref in zip(retrieval_ranks(img_emb, txt_emb, t2i), retrieval_ranks(img_ref, txt_ref, t2i_ref)):
        assert torch.equal(got, ref)
    again = fc.retrieval_features(model, tok, tf, tiny_shards["eval"], "cpu", 16)
    assert again[0] is img_feat  # memoized per key


@pytest.mark.multiproc
def test_cli_refuses_a_random_transform_in_one_line(tiny_shards):
    import sys

    from vlp_testing import run_env

    proc = forked.run([sys.executable, "-m", "vlp", "train", "model.name=vlp-micro", "model.lock_image=true",
                           "model.lock_text=true", "data.feature_cache=memory", f"data.train_shards={tiny_shards['train']}"],
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlp: error: config: data.feature_cache needs "
                                                   "data.train_transform=eval"), proc.stderr
