"""Hostile or unlucky inputs (issue 15): each is one `vlp: error: ...` line with exit 2 (or a
counted skip), never a traceback, and nothing already on disk is lost.

Calls `vlp.cli.main` in-process (capsys sees stdout/stderr); every case checks the exit status,
the error line, and the files on disk before and after.
"""
import gzip
import io
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlp.cli import main
import forked
from vlp_testing import REPO, overrides, write_tar

TINY = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
        "train.log_every=1", "data.shuffle_buffer=64", "train.samples=64", "data.eval_shards=null"]


def run(capsys, *args):
    """(exit status, stdout, stderr) of `vlp ARGS` in this process."""
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


PROGRESS = re.compile(r"\[\d+:\d+(<|,|\])")  # a tqdm bar: "shards: 3img [00:00, 85img/s]"


def one_error(rc, err, *needles):
    """Exit 2, exactly one `vlp: error:` line holding every needle, no traceback, and nothing
    else on stderr but progress bars."""
    assert rc == 2, err[-2000:]
    lines = [ln for ln in re.split(r"[\r\n]", err) if ln.strip() and not PROGRESS.search(ln)]
    errors = [ln for ln in lines if ln.startswith("vlp: error:")]
    assert len(errors) == 1 and lines == errors, err[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def snapshot(folder: Path) -> dict:
    """{relative path: bytes} of every file under folder (links not followed)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def png(color, size=(24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def train(shards, out, *extra):
    return ["train", "-c", REPO / "configs/demo.yaml",
            *overrides(f"data.train_shards={shards}", f"train.output_dir={out}", *TINY, *extra)]


# ----------------------------------------------------------------------------- vlp shards
@pytest.fixture
def image_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"img{i}.png").write_bytes(png((60 * i, 0, 0)))
        (src / f"img{i}.txt").write_text(f"a red box number {i}")
    return src


def test_shards_all_rows_invalid_keeps_existing_shards(capsys, tmp_path, image_folder):
    out = tmp_path / "out"
    assert run(capsys, "shards", image_folder, out, "--samples-per-shard", 2)[0] == 0
    before = snapshot(out)
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(3):
        (bad / f"x{i}.png").write_bytes(b"not an image")
        (bad / f"x{i}.txt").write_text("caption")
    rc, _, err = run(capsys, "shards", bad, out, "--overwrite")
    one_error(rc, err, "no valid samples", "corrupt_image=3", "unchanged")
    assert snapshot(out) == before and not list(out.glob(".*"))


def test_shards_refuse_existing_without_overwrite(capsys, tmp_path, image_folder):
    out = tmp_path / "out"
    run(capsys, "shards", image_folder, out, "--samples-per-shard", 2)
    before = snapshot(out)
    rc, _, err = run(capsys, "shards", image_folder, out, "--samples-per-shard", 3)
    one_error(rc, err, "already holds 2 shard(s)", "--overwrite")
    assert snapshot(out) == before
    rc, stdout, _ = run(capsys, "shards", image_folder, out, "--samples-per-shard", 3, "--overwrite")
    assert rc == 0 and sorted(json.loads((out / "sizes.json").read_text()).values()) == [1, 3]
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]


def test_shards_skip_fifos_devices_and_folders_without_blocking(capsys, tmp_path, image_folder):
    os.mkfifo(image_folder / "pipe.png")
    (image_folder / "pipe.txt").write_text("a caption for a fifo")
    os.symlink("/dev/zero", image_folder / "zero.jpg")
    (image_folder / "zero.txt").write_text("endless zeros")
    (image_folder / "folder.png").mkdir()
    os.mkfifo(image_folder / "img0.txt.fifo")  # not an image: ignored
    os.remove(image_folder / "img1.txt")
    os.mkfifo(image_folder / "img1.txt")  # a FIFO caption sidecar
    out = tmp_path / "out"
    rc, stdout, err = run(capsys, "shards", image_folder, out)
    assert rc == 0, err
    assert "wrote 3 samples" in stdout and "special_file=3" in stdout, stdout  # pipe, zero, img1.txt
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_shards_prefix_with_slash_and_bad_options(capsys, tmp_path, image_folder):
    out = tmp_path / "out"
    for args, needle in [(["--prefix", "a/b"], "--prefix 'a/b' must be a plain name"),
                         (["--prefix", "../x"], "must be a plain name"),
                         (["--resize-longest", "0"], "--resize-longest must be >= 1"),
                         (["--jpeg-quality", "500"], "--jpeg-quality must be in [1, 100]")]:
        rc, _, err = run(capsys, "shards", image_folder, out, *args)
        one_error(rc, err, needle)
    assert not out.exists()


@pytest.mark.multiproc
def test_shards_remove_stale_temp_files_of_dead_writers(capsys, tmp_path, image_folder):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = out / f".shard-000000.tar.tmp-{dead.pid}"
    stale.write_bytes(b"x" * 100)
    live = out / f".other-000000.tar.tmp-{os.getpid()}"  # a live writer (this process): kept
    live.write_bytes(b"y")
    rc, stdout, _ = run(capsys, "shards", image_folder, out)
    assert rc == 0 and "removed 1 temp file(s)" in stdout
    assert not stale.exists() and live.exists()


def test_shards_disk_full_leaves_folder_unchanged(capsys, tmp_path, image_folder, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(out)
    import tarfile

    real_open = tarfile.open

    def to_dev_full(name=None, mode="r", *a, **kw):
        if mode == "w":  # the kernel's own ENOSPC: write the shard to /dev/full
            return real_open(fileobj=open("/dev/full", "wb"), mode="w", **kw)
        return real_open(name, mode, *a, **kw)

    monkeypatch.setattr(tarfile, "open", to_dev_full)
    rc, _, err = run(capsys, "shards", image_folder, out)
    one_error(rc, err, "No space left on device", "unchanged")
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("text, needle", [
    ("- optim\n- lr\n", "top level of"),
    ("optim:\n  lr: .inf\n", "optim.lr must be finite and > 0, got inf"),
    ("loss:\n  max_logit_scale: .nan\n", "loss.max_logit_scale must be finite and >= 1, got nan"),
    ("optim:\n  grad_clip: -1\n", "optim.grad_clip must be finite and > 0"),
    ("train:\n  max_nonfinite: 0\n", "train.max_nonfinite must be > 0, got 0"),
    ("data:\n  shuffle_buffer: -1\n", "data.shuffle_buffer must be > 0, got -1"),
    ("loss:\n  tau: .inf\n", "loss.tau must be finite"),
    ("\xff\xfe bad bytes", "not UTF-8"),
])
def test_bad_config_file_is_one_line_before_any_work(capsys, tmp_path, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(text.encode("latin-1"))
    rc, _, err = run(capsys, "train", "-c", cfg, "data.train_shards=x.tar", f"train.output_dir={tmp_path / 'run'}")
    one_error(rc, err, needle)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- unreadable shards
@pytest.mark.parametrize("content, reason", [
    (b"", "empty file (0 bytes)"),
    (gzip.compress(b"x" * 2000, mtime=0), "gzip-compressed"),
    (b"<html>not found</html>" * 40, "not a tar archive"),
])
def test_unreadable_shard_is_named_with_its_reason(capsys, tmp_path, tiny_shards, content, reason):
    bad = tmp_path / "shards" / "bad.tar"
    bad.parent.mkdir()
    bad.write_bytes(content)
    rc, _, err = run(capsys, *train(bad, tmp_path / "run"))
    one_error(rc, err, str(bad), reason)
    good_then_bad = f"{tiny_shards['train']}::{bad}"  # mixed, no sizes.json beside bad.tar
    rc, _, err = run(capsys, *train(good_then_bad, tmp_path / "run2"))
    one_error(rc, err, str(bad), reason)


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    """A finished 4-step run with a checkpoint at every step (kept), and its shard spec."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main([str(a) for a in train(tiny_shards["train"], out, "train.checkpoint_every=1", "train.keep_last=0")]) == 0
    return out, tiny_shards["train"]


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    return out, trained[1]


def test_zero_byte_and_keyless_checkpoints_are_one_line(capsys, run_copy, tmp_path):
    out, shards = run_copy
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    rc, _, err = run(capsys, *train(shards, tmp_path / "r1", f"train.resume={empty}"))
    one_error(rc, err, str(empty), "is empty (0 bytes)")
    keyless = tmp_path / "keyless.pt"
    state = torch.load(out / "checkpoints" / "step_00000002.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if k not in ("world_size", "rng", "integrity")}, keyless)
    rc, _, err = run(capsys, *train(shards, tmp_path / "r2", f"train.resume={keyless}"))
    one_error(rc, err, "missing world_size, rng")
    foreign = tmp_path / "list.pt"
    torch.save([1, 2, 3], foreign)
    rc, _, err = run(capsys, *train(shards, tmp_path / "r3", f"train.resume={foreign}"))
    one_error(rc, err, "not a vlp training checkpoint")


@pytest.mark.parametrize("change, needle", [
    ("model.lock_image=true", "model.lock_image: False -> True (the saved model has other parameters)"),
    ("model.name=vlp-tiny", "model.name"),
])
def test_changed_model_on_resume_is_one_line(capsys, run_copy, change, needle):
    out, shards = run_copy
    before = snapshot(out / "checkpoints")
    rc, _, err = run(capsys, *train(shards, out, "train.resume=latest", "train.samples=96", change))
    one_error(rc, err, needle)
    assert snapshot(out / "checkpoints") == before


@pytest.mark.multiproc
def test_resume_falls_back_past_corrupt_checkpoints_and_cleans_temps(capsys, run_copy):
    out, shards = run_copy
    ckpts = out / "checkpoints"
    newest = ckpts / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:5000])  # truncated
    (ckpts / "step_00000003.pt").write_bytes(b"")  # zero bytes
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = ckpts / f".step_00000005.pt.tmp-{dead.pid}"
    stale.write_bytes(b"z" * 1000)
    rc, stdout, err = run(capsys, *train(shards, out, "train.resume=latest", "train.samples=96"))
    assert rc == 0, err[-2000:]
    assert f"removed {stale.name}" in stdout and not stale.exists()
    assert "step_00000004.pt cannot be read safely" in stdout and "step_00000003.pt is empty" in stdout
    assert "falling back to step_00000002.pt" in stdout and "resumed from" in stdout
    assert (ckpts / "step_00000004.pt.corrupt").stat().st_size == 5000  # kept for inspection
    assert (ckpts / "step_00000003.pt.corrupt").exists()
    assert json.loads((out / "result.json").read_text())["step"] == 6


def test_resume_with_only_corrupt_checkpoints_is_one_line(capsys, run_copy):
    out, shards = run_copy
    for p in (out / "checkpoints").glob("step_*.pt"):
        p.write_bytes(b"\x00" * 10)
    before = snapshot(out / "checkpoints")
    rc, _, err = run(capsys, *train(shards, out, "train.resume=latest", "train.samples=96"))
    one_error(rc, err, "no valid checkpoint in", "(and 3 more)")
    assert snapshot(out / "checkpoints") == before


def test_disk_full_while_saving_is_one_line_and_keeps_earlier(capsys, run_copy):
    out, shards = run_copy
    ckpts = out / "checkpoints"
    before = snapshot(ckpts)
    # the next save (step 6) writes its temp file into /dev/full: the kernel's ENOSPC
    tmp = ckpts / f".step_00000006.pt.tmp-{os.getpid()}"
    os.symlink("/dev/full", tmp)
    rc, _, err = run(capsys, *train(shards, out, "train.resume=latest", "train.samples=96"))
    one_error(rc, err, "cannot write checkpoint", "No space left on device", "earlier checkpoints are unchanged")
    assert snapshot(ckpts) == before and not os.path.lexists(tmp)


def test_disk_full_while_logging_is_one_line(capsys, tiny_shards, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink("/dev/full", out / "log.jsonl")  # every log write hits the kernel's ENOSPC
    rc, _, err = run(capsys, *train(tiny_shards["train"], out))
    one_error(rc, err, "cannot write", "No space left on device")


def _nan_after(trainer, step):
    real = trainer.loss.fn

    def loss_fn(*args, **kw):
        loss, metrics = real(*args, **kw)
        return (loss * float("nan"), metrics) if trainer.step >= step else (loss, metrics)

    trainer.loss.fn = loss_fn


def test_nonfinite_stop_saves_last_good_state_without_checkpoint_every(tiny_shards, tmp_path):
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    t = Trainer(load_config(REPO / "configs/demo.yaml", [f"data.train_shards={tiny_shards['train']}",
                                                         f"train.output_dir={tmp_path}", *TINY, "train.max_nonfinite=2"]))
    _nan_after(t, 1)
    with pytest.raises(FloatingPointError) as e:
        t.train()
    saved = tmp_path / "checkpoints" / "step_00000003.pt"
    assert f"saved the last good weights to {saved}" in str(e.value)
    state = torch.load(saved, weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_nonfinite_weights_are_never_saved(tiny_shards, tmp_path):
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    t = Trainer(load_config(REPO / "configs/demo.yaml", [f"data.train_shards={tiny_shards['train']}",
                                                         f"train.output_dir={tmp_path}", *TINY,
                                                         "train.checkpoint_every=1", "train.keep_last=0"]))
    real_step = t.optimizer.step

    def poisoned_step(*a, **kw):  # the second update leaves nan weights behind
        real_step(*a, **kw)
        if t.step == 1:
            with torch.no_grad():
                next(t.model.parameters()).fill_(float("nan"))

    t.optimizer.step = poisoned_step
    with pytest.raises(FloatingPointError) as e:
        t.train()
    first = tmp_path / "checkpoints" / "step_00000001.pt"
    assert "not finite" in str(e.value) and str(first) in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [first.name]  # checksums inside


# ----------------------------------------------------------------------------- model files
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An open_clip export of an untrained vlp-micro model."""
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model, export_open_clip

    path = tmp_path_factory.mktemp("export") / "micro.pt"
    export_open_clip(build_model(ModelConfig(name="vlp-micro"), LossConfig())[0], path)
    return path


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/vlp_pwned_by_pickle",))


@pytest.mark.parametrize("kind, needle", [
    ("pickle", "cannot be loaded into this model"),
    ("text", "cannot be loaded into this model"),
    ("other_model", "cannot be loaded into this model"),
    ("empty_dict", "cannot be loaded into this model"),
])
def test_foreign_pretrained_file_is_one_line(capsys, tmp_path, tiny_shards, exported, kind, needle):
    path = tmp_path / f"{kind}.pt"
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"state_dict": _Evil()}))
    elif kind == "text":
        path.write_text("hello, not weights\n")
    elif kind == "other_model":
        path = exported
    else:
        torch.save({}, path)
    model = "vlp-tiny" if kind == "other_model" else "vlp-micro"
    rc, _, err = run(capsys, *train(tiny_shards["train"], tmp_path / "run", f"model.pretrained={path}",
                                    f"model.name={model}"))
    one_error(rc, err, "model.pretrained", needle)
    assert not Path("/tmp/vlp_pwned_by_pickle").exists()


def test_pretrained_export_loads(tiny_shards, tmp_path, exported):
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model

    model = build_model(ModelConfig(name="vlp-micro", pretrained=str(exported)), LossConfig())[0]
    saved = torch.load(exported, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in model.clip.state_dict().items())


def test_eval_model_not_matching_checkpoint_is_one_line(capsys, trained, tmp_path, tiny_shards, exported):
    out, _ = trained
    rc, _, err = run(capsys, "eval", "--checkpoint", out / "checkpoints" / "step_00000004.pt", "--model", "vlp-tiny",
                     "--shards", tiny_shards["eval"], "--out", tmp_path / "e1", "--device", "cpu")
    one_error(rc, err, "does not fit model 'vlp-tiny'", "drop --model", "missing keys (e.g. visual.")
    rc, _, err = run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-tiny",
                     "--shards", tiny_shards["eval"], "--out", tmp_path / "e2", "--device", "cpu")
    one_error(rc, err, "does not fit model 'vlp-tiny'")
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()


# ----------------------------------------------------------------------------- eval class folders
def _class_root(tmp_path, classes=("cat", "dog")):
    root = tmp_path / "classes"
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(3):
            (root / name / f"{i}.png").write_bytes(png((80 * c, 40 * i, 0)))
    return root


def _eval_folder(capsys, exported, tmp_path, root):
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"classification:\n  - name: pets\n    type: folder\n    root: {root}\n    templates: simple\n")
    return run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-micro", "--suite", suite,
               "--out", tmp_path / "eval", "--device", "cpu")


def test_eval_skips_and_counts_bad_images_links_and_loops(capsys, tmp_path, exported, monkeypatch):
    root = _class_root(tmp_path)
    (root / "cat" / "broken.png").write_bytes(png((1, 2, 3))[:40])  # truncated
    (root / "cat" / "text.jpg").write_bytes(b"not an image at all")
    (root / "dog" / "bomb.png").write_bytes(png((9, 9, 9), size=(64, 64)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 > 2x this: a decompression bomb
    os.symlink(root, root / "cat" / "loop")  # up the tree: would re-walk every class
    os.symlink(root / "dog", root / "cat" / "other_class")  # another class: wrong labels
    os.symlink(root / "cat" / "0.png", root / "cat" / "again.png")  # the same file twice
    os.mkfifo(root / "dog" / "pipe.png")
    rc, stdout, err = _eval_folder(capsys, exported, tmp_path, root)
    assert rc == 0, err[-2000:]
    res = json.loads((tmp_path / "eval" / "metrics.json").read_text())["pets"]
    assert res["n"] == 6
    assert res["skipped"] == {"corrupt_image": 2, "too_large": 1, "repeated_folder": 2, "duplicate_file": 1,
                              "special_file": 1}
    assert "7 (corrupt_image 2" in stdout and "7 (corrupt_image 2" in (tmp_path / "eval" / "metrics.md").read_text()


def test_eval_one_class_warns_metric_is_meaningless(capsys, tmp_path, exported):
    rc, stdout, err = _eval_folder(capsys, exported, tmp_path, _class_root(tmp_path, classes=("cat",)))
    assert rc == 0
    assert "vlp: warning: pets: only 1 class" in err and "Traceback" not in err
    res = json.loads((tmp_path / "eval" / "metrics.json").read_text())["pets"]
    assert res["metrics"]["top1"] == 1.0 and res["warnings"][0].startswith("only 1 class")
    assert "warning: pets: only 1 class" in stdout


def test_eval_one_caption_retrieval_warns(capsys, tmp_path, exported):
    shard = write_tar(tmp_path / "one-000000.tar", [("k0", {"png": png((1, 1, 1)), "txt": b"one caption"})])
    rc, stdout, err = run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-micro", "--shards", shard,
                          "--out", tmp_path / "eval", "--device", "cpu", "--batch-size", 4)
    assert rc == 0, err
    assert "only 1 image" in err and "only 1 caption" in err


def test_global_skip_counts_sum_over_ranks(monkeypatch):
    """result.json / log skip counts: every rank's summed (the gather is accelerate's gather_object)."""
    import vlp.train.loop as trainer_module
    from vlp.experiment import load_config
    from vlp.data.train_data import relayout

    ranks = [{"corrupt_image": 2}, {"corrupt_image": 10, "missing_caption": 1}]
    monkeypatch.setattr(trainer_module, "gather_object", lambda objs: ranks)

    class Stub:
        world, skipped = 2, ranks[0]

    assert trainer_module.Trainer.global_skipped(Stub()) == {"corrupt_image": 12, "missing_caption": 1}
    saved = {"config": {"data": {"mode": "split", "batch_per_device": 8}},
             "data": [{"epoch": 0, "batch_in_epoch": 4, "epoch_batches": 4, "skipped": r} for r in ranks]}
    relaid = [d["skipped"] for d in relayout(saved, load_config(None, ["data.batch_per_device=8"]), 1)]
    assert relaid == [{"corrupt_image": 12, "missing_caption": 1}]  # world size changed: all on rank 0
    assert [d["skipped"] for d in relayout(saved, load_config(None, ["data.batch_per_device=4"]), 2)] == ranks
    assert [d["skipped"] for d in relayout(saved, load_config(None, []), 3)][1:] == [{}, {}]


@pytest.mark.multiproc
def test_end_to_end_exit_status_and_stderr_of_a_real_process(tmp_path):
    """The same contract seen from outside: a real `python -m vlp` process on a source of a FIFO
    and a non-image ends (no hang) with exit 2 and one stderr line, and leaves no temp file."""
    from vlp_testing import PYTHON, run_env

    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe.jpg")
    (src / "pipe.txt").write_text("caption")
    (src / "junk.png").write_bytes(b"junk")
    (src / "junk.txt").write_text("caption")
    proc = forked.run([PYTHON, "-m", "vlp", "shards", str(src), str(tmp_path / "out")], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=120)
    one_error(proc.returncode, proc.stderr, "no valid samples", "corrupt_image=1", "special_file=1")
    assert sorted(os.listdir(tmp_path / "out")) == []


def _train_in_ranks(rank, world, args):
    """One rank of a 2-rank run (forked gloo ranks, Accelerate on the existing process group as
    under `accelerate launch`) of the `vlp train` arguments `args`."""
    from vlp.experiment import load_config
    from vlp.train.loop import Trainer

    os.environ.update(ACCELERATE_USE_CPU="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    Trainer(load_config(args[2], [str(a) for a in args[3:]])).train()


@pytest.mark.multiproc
def test_two_ranks_skip_counts_are_summed_in_result_and_log(tmp_path):
    """2 ranks (gloo): both meet corrupt images; result.json and the log hold the sum of both
    ranks' counts, not rank 0's alone."""
    from dist_utils import run_distributed
    from vlp.data.sources.openmoji import load_pairs

    pairs = load_pairs("train", image_size=32)[:80]
    samples = [(p.key, {"png": b"garbage" if i % 5 == 2 else p.image, "txt": p.caption.encode()})
               for i, p in enumerate(pairs)]
    for s in range(2):
        write_tar(tmp_path / f"mix-{s}.tar", samples[40 * s:40 * (s + 1)])
    out = tmp_path / "run"
    run_distributed(_train_in_ranks, 2, (train(tmp_path / "mix-{0..1}.tar", out, "data.batch_per_device=8",
                                               "train.samples=64"),), timeout_s=300)
    per_rank = torch.load(out / "checkpoints" / "step_00000004.pt", weights_only=True)["data"]
    per_rank = [d["skipped"] for d in per_rank]
    assert len(per_rank) == 2 and all(r.get("corrupt_image", 0) > 0 for r in per_rank), per_rank
    total = sum(r["corrupt_image"] for r in per_rank)
    assert json.loads((out / "result.json").read_text())["skipped"] == {"corrupt_image": total}
    last = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()][-2]
    assert last["skipped_corrupt_image"] == total


@pytest.mark.parametrize("text, needle", [
    ("- name: x\n", "eval suite must be a mapping, got list"),
    ("retrieval:\n  - name: r\n", "retrieval 'r' needs 'shards'"),
    ("classification: pets\n", "classification must be a list of entries"),
    ("retrieval: [unclosed\n", "is not valid YAML"),
])
def test_malformed_eval_suite_is_one_line_before_any_work(capsys, tmp_path, tiny_shards, exported, text, needle):
    suite = tmp_path / "suite.yaml"
    suite.write_text(text)
    rc, _, err = run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-micro", "--suite", suite,
                     "--out", tmp_path / "eval", "--device", "cpu")
    one_error(rc, err, needle)
    rc, _, err = run(capsys, *train(tiny_shards["train"], tmp_path / "run", f"eval.suite={suite}"))
    one_error(rc, err, needle)
    assert not (tmp_path / "eval").exists() and not (tmp_path / "run").exists()


def test_eval_refuses_nonfinite_weights(capsys, tmp_path, tiny_shards, exported):
    state = torch.load(exported, weights_only=True)
    state["state_dict"]["logit_scale"] = torch.tensor(float("nan"))
    torch.save(state, tmp_path / "nan.pt")
    rc, _, err = run(capsys, "eval", "--checkpoint", tmp_path / "nan.pt", "--model", "vlp-micro",
                     "--shards", tiny_shards["eval"], "--out", tmp_path / "eval", "--device", "cpu")
    one_error(rc, err, "non-finite weights in 1 tensors (e.g. logit_scale)")
    assert not (tmp_path / "eval").exists()


def test_csv_rows_pointing_at_special_files_are_counted(capsys, tmp_path, image_folder):
    os.mkfifo(tmp_path / "fifo.png")
    rows = ["filepath\ttitle", f"{image_folder / 'img0.png'}\tgood one", "/dev/zero\tzeros", "/dev/null\tnull",
            f"{tmp_path / 'fifo.png'}\tfifo", f"{image_folder}\ta folder", "missing.png\tgone"]
    (tmp_path / "pairs.tsv").write_text("\n".join(rows) + "\n")
    rc, stdout, err = run(capsys, "shards", tmp_path / "pairs.tsv", tmp_path / "out")
    assert rc == 0, err
    assert "wrote 1 samples" in stdout and "missing_image=1, special_file=4" in stdout, stdout


# ----------------------------------------------------------------------------- issue 21: the last tracebacks
@pytest.mark.parametrize("text, needle", [
    ("optim:\n  lr: 1.0e-3\n  warmup_steps: 2\n  lr: 1.0e-5\n", "duplicate key 'lr' on line 4 (first on line 2)"),
    ("optim: {lr: 1}\ntrain: {seed: 1}\noptim: {lr: 2}\n", "duplicate key 'optim' on line 3 (first on line 1)"),
    ("model:\n  name: " + "m" * 10_000_000 + "\n", "model.name must be a non-empty string of at most 4096"),
])
def test_duplicate_yaml_keys_and_huge_values_are_one_short_line(capsys, tmp_path, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    rc, _, err = run(capsys, "train", "-c", cfg, "data.train_shards=x.tar", f"train.output_dir={tmp_path / 'run'}")
    line = one_error(rc, err, needle)
    assert len(line) < 400
    assert not (tmp_path / "run").exists()


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    from vlp.experiment import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("base: &b {lr: 1.0e-3, warmup_steps: 3}\noptim:\n  <<: *b\n  lr: 2.0e-3\n")
    with pytest.raises(Exception, match="unknown key 'base'"):  # merge keys work; 'base' is just not a section
        load_config(cfg)


def test_every_error_line_is_capped():
    from vlp.util import MAX_LINE, cap, first_line

    long = "unknown model " + "x" * 10_000_000 + " (see vlp/model_configs)"
    short = cap(long)
    assert len(short) <= MAX_LINE and short.startswith("unknown model xxx") and short.endswith("(see vlp/model_configs)")
    assert f"({len(long)} chars)" in short
    assert len(first_line(ValueError(long))) <= MAX_LINE
    assert cap("fits") == "fits"


@pytest.mark.parametrize("key", ["train.output_dir", "eval.suite", "train.resume", "model.pretrained"])
def test_over_long_path_component_is_one_line(capsys, tmp_path, key):
    value = tmp_path / ("d" * 300) / "x.yaml"
    rc, _, err = run(capsys, *train("x.tar", tmp_path / "run", f"{key}={value}"))
    one_error(rc, err, f"{key} has a path component of 300 bytes", "allows 255")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--classes", "--imagenet"])
def test_over_long_eval_folder_is_one_line(capsys, tmp_path, exported, flag):
    rc, _, err = run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-micro", flag, tmp_path / ("d" * 300),
                     "--out", tmp_path / "eval", "--device", "cpu")
    one_error(rc, err, flag, "File name too long")


def test_class_level_symlink_cycle_is_one_line(capsys, tmp_path, exported):
    root = _class_root(tmp_path)
    os.symlink("loop_b", root / "loop_a")  # two class folders pointing at each other
    os.symlink("loop_a", root / "loop_b")
    for flag in ("--classes", "--imagenet"):
        rc, _, err = run(capsys, "eval", "--checkpoint", exported, "--model", "vlp-micro", flag, root,
                         "--out", tmp_path / "eval", "--device", "cpu")
        one_error(rc, err, "class folder", "loop_", "Too many levels of symbolic links")
        assert not (tmp_path / "eval").exists()


def _png16_rgb(rgb16) -> bytes:
    """A 16-bit-per-channel RGB PNG (PIL cannot write one), from a (H, W, 3) uint16 array."""
    import struct
    import zlib

    import numpy as np

    h, w, _ = rgb16.shape
    raw = b"".join(b"\0" + rgb16[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    assert rgb16.dtype == np.uint16
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_16_bit_pngs_are_scaled_to_8_bits_not_clipped(tmp_path):
    import numpy as np
    from torchvision import transforms as T

    from vlp.data.decode import CropFirst, PlainDecoder
    from vlp.data.rgb import decode_rgb, to_rgb
    from vlp.eval.datasets import open_rgb

    ramp = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")
    grey16 = buf.getvalue()
    assert Image.open(io.BytesIO(grey16)).mode in ("I;16", "I")
    assert np.asarray(Image.open(io.BytesIO(grey16)).convert("RGB")).mean() > 250  # what PIL alone gives: white
    expected = np.round(ramp.astype(np.float64) / 257).astype(np.uint8)
    for image in (decode_rgb(grey16), open_rgb(grey16), PlainDecoder(lambda x: x).decode(grey16),
                  CropFirst(T.RandomResizedCrop(16), []).decode(grey16)):
        pixels = np.asarray(image)
        assert image.mode == "RGB" and np.abs(pixels[..., 0].astype(int) - expected).max() <= 1
        assert (pixels[..., 0] == pixels[..., 2]).all()
    as_i = np.asarray(to_rgb(Image.fromarray(ramp.astype(np.int32), mode="I")))[..., 0]  # mode I: same scale
    assert np.abs(as_i.astype(int) - expected).max() <= 1
    rgb16 = np.stack([ramp, 65535 - ramp, np.full_like(ramp, 32896)], axis=-1)
    im = Image.open(io.BytesIO(_png16_rgb(rgb16)))
    assert im.mode == "RGB"  # PIL keeps the high byte of 16-bit RGB: no clipping to handle
    pixels = np.asarray(decode_rgb(_png16_rgb(rgb16)))
    assert np.abs(pixels.astype(int) - (rgb16 >> 8)).max() == 0


def test_duplicate_key_in_a_compare_config_is_one_line(capsys, tmp_path):
    cfg = tmp_path / "grid.yaml"
    cfg.write_text("grid:\n  losses: [infonce]\n  seeds: [0]\n  losses: [flatnce]\n")
    rc, _, err = run(capsys, "compare", "-c", cfg, "--report-only")
    one_error(rc, err, "duplicate key 'losses' on line 4 (first on line 2)")
