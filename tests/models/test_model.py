"""Model construction: typed output, temperature init, HF text tower from a local directory."""
import math

import pytest
import torch

from vlp.config import LossConfig, ModelConfig
from vlp.losses.siglip import siglip_init
from vlp.models.model import DualEncoderOutput, build_model


def test_forward_is_typed_and_normalised():
    model, tok, _, _ = build_model(ModelConfig(name="vlp-micro"), LossConfig())
    out = model(torch.randn(2, 3, 32, 32), tok(["a cat", "a dog"]))
    assert isinstance(out, DualEncoderOutput)
    assert torch.allclose(out.image_emb.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert out.logit_scale.item() == pytest.approx(1 / 0.07, rel=1e-5) and out.logit_bias is None


def test_siglip_and_fixed_temperature_init():
    model, *_ = build_model(ModelConfig(name="vlp-micro"), LossConfig(name="siglip"))
    init = siglip_init()  # production starts SigLIP from the published init, not a copy of it
    assert model.clip.logit_scale.item() == pytest.approx(init.logit_scale, abs=1e-6)
    assert model.clip.logit_bias.item() == init.logit_bias
    model, *_ = build_model(ModelConfig(name="vlp-micro"), LossConfig(name="siglip", tau=0.07))
    assert model.clip.logit_scale.item() == pytest.approx(math.log(1 / 0.07), abs=1e-6)  # a set tau is 1/tau
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
    assert model.text_pad_id is None  # HF tower: no padding trim
    loaded = model.clip.text.transformer.embeddings.word_embeddings.weight
    assert torch.equal(loaded, bert.embeddings.word_embeddings.weight)
    tokens = tok(["a red heart emoji", "a cat"])
    assert tokens.shape == (2, 16)
    out = model(torch.randn(2, 3, 32, 32), tokens)
    assert out.text_emb.shape == out.image_emb.shape


def test_text_padding_trim_is_exact():
    """trim_text drops all-padding columns and encode_text runs the tower on the shorter sequence:
    same features and parameter gradients as open_clip's full-context encode_text."""
    torch.manual_seed(0)
    model, tok, _, _ = build_model(ModelConfig(name="vlp-tiny"), LossConfig())  # context 32
    text = tok(["a red heart", "grinning face with big eyes and a very long caption here", "cat"])
    trimmed = model.trim_text(text)
    longest = int((text != 0).sum(1).max())
    assert trimmed.shape[1] % 8 == 0 and longest <= trimmed.shape[1] < longest + 8 < text.shape[1]
    assert torch.equal(trimmed, text[:, :trimmed.shape[1]])
    probe = torch.randn(3, 128)

    def features_and_grads(encode):
        model.zero_grad(set_to_none=True)
        feats = encode(text)
        (feats * probe).sum().backward()
        return feats.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    seen = []
    hook = model.clip.transformer.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    ours, ours_grads = features_and_grads(lambda t: model.encode_text(model.trim_text(t)))
    hook.remove()
    ref, ref_grads = features_and_grads(lambda t: model.clip.encode_text(t, normalize=True))
    assert seen == [trimmed.shape[1]]
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert ours_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(ours_grads[name], ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # untrimmed input takes open_clip's own path (no hidden host sync in encode_text)
    torch.testing.assert_close(model.encode_text(text), ref, atol=0, rtol=0)


def test_text_trim_only_where_exact():
    model, tok, _, _ = build_model(ModelConfig(name="vlp-tiny"), LossConfig())
    model.clip.text_pool_type = "last"  # pooling at the last position: padding matters
    from vlp.models.model import DualEncoder

    rebuilt = DualEncoder(model.clip, text_pad_id=0)
    text = tok(["a cat"])
    assert rebuilt.text_pad_id is None and rebuilt.trim_text(text) is text


@pytest.mark.parametrize("eot_at", [7, 8, 15, 16, 23, 24])
def test_text_trim_boundary_when_the_end_token_sits_on_a_multiple_of_8(eot_at):
    """The longest caption's end token at column 8, 16 or 24 (and one before): the kept width is
    the next multiple of 8 above that column, so the end token (where the tower pools) is kept and
    features equal open_clip's full-context encode_text."""
    torch.manual_seed(0)
    model, tok, _, _ = build_model(ModelConfig(name="vlp-tiny"), LossConfig())  # context 32
    sot, eot = tok.sot_token_id, tok.eot_token_id
    text = torch.zeros(2, model.clip.context_length, dtype=torch.long)
    for row, end in enumerate((eot_at, 3)):  # the longest caption and a short one
        text[row, 0], text[row, end] = sot, eot
        text[row, 1:end] = torch.randint(300, 40000, (end - 1,))
    trimmed = model.trim_text(text)
    assert trimmed.shape[1] == (eot_at // 8 + 1) * 8
    with torch.no_grad():
        ours = model.encode_text(trimmed)
        ref = model.clip.encode_text(text, normalize=True)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
