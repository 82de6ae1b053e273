"""Contrastive gradient accumulation: k=2 micro-batches x b equal k=1 x 2b (the contrastive
batch is per_device x world x accum), and both equal a naive reference."""
import pytest
import torch
from naive_losses import naive_loss

from vlp.experiment import load_config
from vlp.data.train_data import Batch
from vlp.train.loop import Trainer
from vlp.train.optim import lr_multiplier, param_groups


def _trainer(shards: str, loss: str, accum: int, temperature: str = "learnable", batch: int = 4) -> Trainer:
    cfg = load_config(None, [
        "model.name=vlp-micro", f"data.train_shards={shards}", f"data.batch_per_device={batch}",
        f"loss.name={loss}", f"loss.temperature={temperature}", f"train.accum_steps={accum}",
        f"train.samples={max(64, batch * accum)}",
    ])
    t = Trainer(cfg)
    t.model.double()
    return t


def _grads(t: Trainer, batches):
    t.optimizer.zero_grad(set_to_none=True)
    loss, metrics = t.compute_gradients(batches)
    return loss.item(), {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss,temperature", [("infonce", "learnable"), ("flatnce", "learnable"),
                                              ("flatnce", "split"), ("siglip", "learnable"),
                                              ("dcl", "learnable"), ("dcl", "split")])
def test_accum_2_equals_double_batch(tiny_shards, loss, temperature):
    torch.manual_seed(0)
    images = torch.randn(8, 3, 32, 32, dtype=torch.float64)
    text = torch.randint(1, 1000, (8, 16))
    big = _trainer(tiny_shards["train"], loss, 1, temperature)
    acc = _trainer(tiny_shards["train"], loss, 2, temperature)
    acc.unwrapped.load_state_dict(big.unwrapped.state_dict())
    ids = torch.arange(8)
    l1, g1 = _grads(big, [Batch(images, text, ids)])
    l2, g2 = _grads(acc, [Batch(images[:4], text[:4], ids[:4]), Batch(images[4:], text[4:], ids[4:])])
    assert l1 == pytest.approx(l2, abs=1e-10)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-10, rtol=1e-7, msg=name)
    # and against tests/support/naive_losses.py: one forward of all 8 pairs, the loss by per-anchor loops
    model = big.unwrapped
    model.zero_grad(set_to_none=True)
    out = model(images, text)
    value, surrogate = naive_loss(loss, big.temperature.scale_grad, out.image_emb, out.text_emb,
                                  out.logit_scale, out.logit_bias)
    surrogate.backward()
    assert l2 == pytest.approx(value.item(), abs=1e-10)
    naive = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert naive.keys() == g2.keys()
    for name in naive:
        torch.testing.assert_close(g2[name], naive[name], atol=1e-10, rtol=1e-7, msg=name)


@pytest.mark.parametrize("loss", ["infonce", "flatnce", "sogclr", "siglip", "dcl", "fastclip", "isogclr"])
def test_accum_16x8_equals_batch_128(tiny_shards, loss):
    """The study's price of the alternative (grid.accum_price): 16 micro-batches of 8 give the
    gradient of one contrastive batch of 128, for every loss of the map (so that arm's accuracy
    is the batch-128 cell's)."""
    torch.manual_seed(1)
    images = torch.randn(128, 3, 32, 32, dtype=torch.float64)
    text = torch.randint(1, 1000, (128, 16))
    ids = torch.arange(128)
    big = _trainer(tiny_shards["train"], loss, 1, batch=128)
    acc = _trainer(tiny_shards["train"], loss, 16, batch=8)
    acc.unwrapped.load_state_dict(big.unwrapped.state_dict())
    l1, g1 = _grads(big, [Batch(images, text, ids)])
    l2, g2 = _grads(acc, [Batch(images[i:i + 8], text[i:i + 8], ids[i:i + 8]) for i in range(0, 128, 8)])
    assert l1 == pytest.approx(l2, abs=1e-10)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-10, rtol=1e-7, msg=name)


@pytest.mark.parametrize("loss", ["sogclr", "fastclip", "isogclr"])
def test_accum_equals_big_batch_with_a_moving_state(tiny_shards, loss):
    """Stateful losses past their first step: 4 micro-batches of 4 and one batch of 16 give the
    same gradients on a second step whose ids were half seen (u, and iSogCLR's temperatures,
    already moved), and commit the same state."""
    torch.manual_seed(2)
    images = torch.randn(2, 16, 3, 32, 32, dtype=torch.float64)
    text = torch.randint(1, 1000, (2, 16, 16))
    ids = torch.stack([torch.arange(16), torch.arange(8, 24)])
    big = _trainer(tiny_shards["train"], loss, 1, "learnable", batch=16)  # FastCLIP: t's own gradient
    acc = _trainer(tiny_shards["train"], loss, 4, "learnable", batch=4)
    acc.unwrapped.load_state_dict(big.unwrapped.state_dict())
    for step in range(2):
        l1, g1 = _grads(big, [Batch(images[step], text[step], ids[step])])
        l2, g2 = _grads(acc, [Batch(images[step, i:i + 4], text[step, i:i + 4], ids[step, i:i + 4])
                              for i in range(0, 16, 4)])
        big.loss.commit()
        acc.loss.commit()
        assert l1 == pytest.approx(l2, abs=1e-10)
        assert g1.keys() == g2.keys() and len(g1) > 10
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-10, rtol=1e-7, msg=name)
    a, b = big.loss.state_dict(), acc.loss.state_dict()
    key = big.loss.STATE_KEY
    torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0)
    assert torch.isfinite(a[key][:24]).all() and a["step"] == b["step"] == 2


def test_param_groups_no_decay_on_gains_biases_and_scale(tiny_shards):
    t = _trainer(tiny_shards["train"], "infonce", 1)
    groups = param_groups(t.unwrapped, 0.2)
    names = {id(p): n for n, p in t.unwrapped.named_parameters()}
    no_decay = {names[id(p)] for p in groups[0]["params"]}
    decay = {names[id(p)] for p in groups[1]["params"]}
    assert "clip.logit_scale" in no_decay
    assert all(p.ndim >= 2 for p in groups[1]["params"])
    assert not any("bias" in n or ".ln" in n for n in decay)


def test_lr_schedule_shapes():
    assert lr_multiplier(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_multiplier(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(99, 100, 10, "cosine") < 0.01
    assert lr_multiplier(50, 100, 10, "constant") == 1.0
    assert lr_multiplier(95, 100, 10, "const-cooldown", cooldown=10) == pytest.approx(0.5)
