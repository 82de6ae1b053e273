"""Model construction: typed output, temperature init, HF text tower from a local directory."""
import math

import pytest
import torch

from vlp.config import LossConfig, ModelConfig
from vlp.model import DualEncoderOutput, build_model


def test_forward_is_typed_and_normalised():
    model, tok, _, _ = build_model(ModelConfig(name="vlp-micro"), LossConfig())
    out = model(torch.randn(2, 3, 32, 32), tok(["a cat", "a dog"]))
    assert isinstance(out, DualEncoderOutput)
    assert torch.allclose(out.image_emb.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert out.logit_scale.item() == pytest.approx(1 / 0.07, rel=1e-5) and out.logit_bias is None


def test_siglip_and_fixed_temperature_init():
    model, *_ = build_model(ModelConfig(name="vlp-micro"), LossConfig(name="siglip"))
    assert model.clip.logit_scale.exp().item() == pytest.approx(10.0, rel=1e-5)
    assert model.clip.logit_bias.item() == -10.0
    model, *_ = build_model(ModelConfig(name="vlp-micro"), LossConfig(temperature="fixed", tau=0.05))
    assert not model.clip.logit_scale.requires_grad
    assert model.clip.logit_scale.item() == pytest.approx(math.log(20.0))


def test_hf_text_tower_from_local_directory(tmp_path):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "heart", "emoji", "of", "cat"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    bert = BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64))
    bert.save_pretrained(tmp_path)
    model, tok, _, _ = build_model(ModelConfig(name="vlp-micro", hf_text_dir=str(tmp_path)), LossConfig())
    loaded = model.clip.text.transformer.embeddings.word_embeddings.weight
    assert torch.equal(loaded, bert.embeddings.word_embeddings.weight)
    tokens = tok(["a red heart emoji", "a cat"])
    assert tokens.shape == (2, 16)
    out = model(torch.randn(2, 3, 32, 32), tokens)
    assert out.text_emb.shape == out.image_emb.shape
