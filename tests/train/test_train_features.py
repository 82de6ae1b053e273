"""Trainer features: LiT locking, non-finite loss handling, eval suite hook, bf16 autocast."""
import json
import math

import pytest
import torch

from vlp_testing import REPO
from vlp.experiment import load_config
from vlp.train.loop import Trainer


def _cfg(shards, out, *extra):
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", "model.name=vlp-micro",
        "data.batch_per_device=16", "train.samples=64", "train.log_every=1", *extra])


def test_lit_locks_exactly_the_image_tower(tiny_shards, tmp_path):
    t = Trainer(_cfg(tiny_shards, tmp_path, "model.lock_image=true"))
    named = dict(t.unwrapped.clip.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    assert frozen == {n for n in named if n.startswith("visual.")}
    before = {n: p.detach().clone() for n, p in named.items()}
    t.train()
    after = dict(t.unwrapped.clip.named_parameters())
    for n in named:
        changed = not torch.equal(before[n], after[n])
        assert changed == (n not in frozen) or n.endswith("logit_scale"), n


def test_lit_unlocked_groups_and_text_lock(tiny_shards, tmp_path):
    t = Trainer(_cfg(tiny_shards, tmp_path, "model.lock_text=true", "model.lock_image=true",
                     "model.lock_image_unlocked_groups=1"))
    trainable = {n for n, p in t.unwrapped.clip.named_parameters() if p.requires_grad}
    # vlp-micro has 1 vision block: the last group is its final norm + projection
    assert trainable and all(n.startswith("visual.") or n == "logit_scale" for n in trainable)
    assert not any(n.startswith(("transformer.", "token_embedding", "text_projection")) for n in trainable)


def test_nonfinite_losses_skip_then_stop_with_valid_checkpoint(tiny_shards, tmp_path):
    t = Trainer(_cfg(tiny_shards, tmp_path, "train.samples=320", "train.checkpoint_every=2", "train.max_nonfinite=3"))
    real = t.loss.fn
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        loss, m = real(*args, **kw)
        if calls["n"] == 3 or calls["n"] >= 7:  # one isolated NaN, then NaN forever
            loss = loss * float("nan")
        return loss, m

    t.loss.fn = flaky
    with pytest.raises(FloatingPointError, match="3 non-finite losses in a row at step 9"):
        t.train()
    assert t.nonfinite_total == 4
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r.get("nonfinite")] == [3, 7, 8, 9]
    from vlp.checkpoint.files import load

    # the stop saved the last good weights (skipped steps leave them as after step 6)
    state = load(tmp_path / "checkpoints" / "step_00000009.pt")
    assert state["train"]["step"] == 9 and all(torch.isfinite(v).all() for v in state["model"].values())
    step8 = load(tmp_path / "checkpoints" / "step_00000008.pt")
    assert all(torch.equal(step8["model"][k], v) for k, v in state["model"].items())


def test_eval_suite_hook_runs_zero_shot_classification(tiny_shards, tmp_path):
    """The hook's top-1 equals the same classification done by hand with the trained model.
    Classes are 8 training pairs (folder = caption), so the trained model tells them apart and
    a wrong label order, model or image set would change the figure."""
    from PIL import Image

    from vlp.data.sources.openmoji import load_pairs

    pairs = [p for p in load_pairs("train", image_size=32)[:160] if "/" not in p.caption and "_" not in p.caption]
    pairs = pairs[::len(pairs) // 8][:8]
    root = tmp_path / "classes"
    for p in pairs:
        (root / p.caption.replace(" ", "_")).mkdir(parents=True)
        (root / p.caption.replace(" ", "_") / "0.png").write_bytes(p.image)
    (tmp_path / "templates.txt").write_text("{}\n")
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"classification:\n  - name: emoji\n    type: folder\n    root: {root}\n"
                     f"    templates: {tmp_path / 'templates.txt'}\n")
    trainer = Trainer(_cfg(tiny_shards, tmp_path / "run", f"data.eval_shards={tiny_shards['eval']}",
                           f"eval.suite={suite}", "train.samples=960", "optim.lr=2e-3", "optim.warmup_steps=2"))
    result = trainer.train()
    names = sorted(p.caption.replace(" ", "_") for p in pairs)  # the folder reader's label order
    model = trainer.unwrapped.eval()
    with torch.no_grad():
        text = model.encode_text(trainer.tokenizer([n.replace("_", " ") for n in names]))
        images = torch.stack([trainer.eval_transform(Image.open(root / n / "0.png").convert("RGB")) for n in names])
        predicted = (model.encode_image(images) @ text.T).argmax(dim=1)
    top1 = (predicted == torch.arange(len(names))).double().mean().item()
    assert top1 >= 2 / 8, predicted  # learned (chance 1/8): two classes told apart, so the label order matters
    assert result["eval/emoji/top1"] == pytest.approx(top1, abs=1e-12)
    assert result["eval/num_images"] == 40
    assert (tmp_path / "run" / "eval_step60" / "metrics.json").is_file()


def test_bf16_autocast_trains_finite(tiny_shards, tmp_path):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the process-wide state was made fp32 by earlier tests
    result = Trainer(_cfg(tiny_shards, tmp_path, "train.precision=bf16", "loss.name=flatnce")).train()
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert result["nonfinite_steps"] == 0
    assert all(math.isfinite(r["infonce"]) for r in log if "infonce" in r)
    AcceleratorState._reset_state(True)


def test_init_from_local_open_clip_checkpoint_with_clip_and_checkpointing(tiny_shards, tmp_path):
    first = Trainer(_cfg(tiny_shards, tmp_path / "a", "train.samples=32"))
    first.train()
    exported = tmp_path / "a" / "open_clip_model.pt"
    second = Trainer(_cfg(tiny_shards, tmp_path / "b", f"model.pretrained={exported}", "optim.grad_clip=0.5",
                          "model.grad_checkpointing=true", "train.samples=32"))
    start = {k: v.clone() for k, v in second.unwrapped.clip.state_dict().items()}
    for k, v in first.unwrapped.clip.state_dict().items():
        assert torch.equal(start[k], v), k
    assert second.unwrapped.clip.visual.transformer.grad_checkpointing
    second.train()
    assert any(not torch.equal(start[k], v) for k, v in second.unwrapped.clip.state_dict().items())


def test_keep_last_k_checkpoints(tiny_shards, tmp_path):
    Trainer(_cfg(tiny_shards, tmp_path, "train.samples=96", "train.checkpoint_every=1", "train.keep_last=2")).train()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000005.pt", "step_00000006.pt"]  # a .pt carries its checksums inside it


def test_compile_trains_like_eager_and_exports_clean_keys(tiny_shards, tmp_path):
    """train.compile=true (inductor on CPU): the compiled step follows the eager one (text
    trimmed to a batch-dependent length, so the graph sees more than one shape), and the
    checkpoint and open_clip export carry the eager parameter names."""
    runs, lengths = {}, set()
    for name, extra in (("eager", ()), ("compiled", ("train.compile=true",))):
        trainer = Trainer(_cfg(tiny_shards, tmp_path / name, "data.batch_per_device=4", "train.samples=48",
                               *extra))
        trim = trainer.unwrapped.trim_text
        trainer.unwrapped.trim_text = lambda t, trim=trim: lengths.add(trim(t).shape[1]) or trim(t)
        trainer.train()
        log = [json.loads(x) for x in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        runs[name] = [r["loss"] for r in log if "loss" in r]
    assert len(runs["compiled"]) == len(runs["eager"]) == 12 and lengths == {8, 16}
    assert runs["compiled"][0] == pytest.approx(runs["eager"][0], rel=1e-5)
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-3)
    import open_clip

    state = torch.load(tmp_path / "compiled" / "open_clip_model.pt", weights_only=True)["state_dict"]
    reference = open_clip.create_model("vlp-micro").state_dict()
    assert state.keys() == reference.keys()
