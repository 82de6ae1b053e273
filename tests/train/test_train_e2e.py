"""End-to-end training on tiny real shards: learning, CLI errors, exact resume after SIGKILL."""
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import forked
from vlp_testing import PYTHON, REPO, run_env
from vlp.experiment import load_config
from vlp.train.loop import Trainer

TINY = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
        "train.log_every=1", "data.shuffle_buffer=64"]


def _cfg(shards, out, *extra):
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"data.eval_shards={shards['eval']}",
        f"train.output_dir={out}", *TINY, *extra])


def _log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", ["infonce", "flatnce"])
def test_tiny_training_lowers_infonce_and_evaluates(tiny_shards, tmp_path, loss):
    # eval on the 160 training pairs: after 6 epochs they are retrieved far above chance, while
    # 40 held-out names are not learnt by so small a run (at chance: a bound that cannot fail)
    result = Trainer(_cfg(tiny_shards, tmp_path, f"loss.name={loss}", "train.samples=960",
                          f"data.eval_shards={tiny_shards['train']}")).train()
    steps = [r for r in _log(tmp_path) if r["type"] == "train"]
    assert {r["type"] for r in _log(tmp_path)} == {"train", "result"}  # every record says what it is
    first = sum(r["infonce"] for r in steps[:5]) / 5
    last = sum(r["infonce"] for r in steps[-5:]) / 5
    assert len(steps) == 60
    assert last < first - 0.3, (first, last)
    if loss == "flatnce":  # reported value is the InfoNCE value, never FlatNCE's constant 1
        assert all(r["loss"] == pytest.approx(r["infonce"], rel=1e-5) for r in steps)
    assert result["eval/num_images"] == 160
    chance = result["eval/chance_R@1"]
    assert chance == pytest.approx(1 / 160)
    for key in ("image_to_text_R@10", "text_to_image_R@10"):  # chance: 10 hits of 160 expected
        assert result[f"eval/{key}"] >= 2 * 10 * chance, (key, result[f"eval/{key}"])  # learned, not guessed
    assert (tmp_path / "open_clip_model.pt").is_file()
    assert (tmp_path / "checkpoints").is_dir()


def test_exported_model_loads_in_open_clip_with_identical_features(tiny_shards, tmp_path):
    import open_clip

    trainer = Trainer(_cfg(tiny_shards, tmp_path, "train.samples=32"))
    trainer.train()
    ours = trainer.unwrapped.eval()
    theirs = open_clip.create_model("vlp-micro", pretrained=str(tmp_path / "open_clip_model.pt")).eval()
    x, t = torch.randn(3, 3, 32, 32), torch.randint(1, 49000, (3, 16))
    with torch.no_grad():
        assert torch.equal(ours.encode_image(x), theirs.encode_image(x, normalize=True))
        assert torch.equal(ours.encode_text(t), theirs.encode_text(t, normalize=True))


def _vlp(*args, **kw):
    return forked.run([PYTHON, "-m", "vlp", *args], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=kw.get("timeout", 300))


@pytest.mark.parametrize("args, needle", [
    (["train", "-c", "configs/demo.yaml", "loss.nme=x"], "unknown key 'loss.nme'"),
    (["train", "-c", "configs/nope.yaml"], "no such file"),
    (["train", "-c", "configs/demo.yaml", "data.batch_per_device=-1"], "must be > 0"),
    (["train", "-c", "configs/demo.yaml", "data.train_shards=/nonexistent/s-{0..3}.tar"], "/nonexistent/s-0.tar"),
    (["train", "-c", "configs/demo.yaml", "data.train_shards=x.tar", "train.samples=1"], "smaller than one global batch"),
    (["eval", "--checkpoint", "/nonexistent.pt", "--shards", "x.tar"], "/nonexistent.pt"),
])
@pytest.mark.multiproc
def test_cli_bad_input_is_one_line_and_exit_2(args, needle, tmp_path):
    proc = _vlp(*args, "train.output_dir=" + str(tmp_path) if args[0] == "train" else "--out=" + str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("vlp: error:")]
    assert len(err) == 1 and needle in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.multiproc
def test_undecodable_images_in_a_loader_worker_are_one_line(tmp_path):
    """An error raised inside a DataLoader worker reaches the user as its own message, not as
    torch's 'Caught ValueError in DataLoader worker process 0.' first line."""
    from vlp_testing import noise_jpeg, write_tar

    cut = [noise_jpeg(i)[:1200] for i in range(24)]  # header intact, pixel data cut
    write_tar(tmp_path / "cut.tar", [(f"k{i:03d}", {"jpg": data, "txt": f"caption {i}".encode()})
                                     for i, data in enumerate(cut)])
    proc = _vlp("train", "-c", "configs/demo.yaml", "model.name=vlp-micro", f"data.train_shards={tmp_path / 'cut.tar'}",
                "data.eval_shards=null", "data.batch_per_device=4", "data.num_workers=1", "train.samples=16",
                f"train.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("vlp: error:")]
    assert len(err) == 1 and "failed to decode" in err[0] and "cut.tar" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _train_args(shards, out, *extra):
    return ["train", "-c", "configs/demo.yaml", f"data.train_shards={shards['train']}", f"train.output_dir={out}",
            *TINY, "train.samples=448", "train.checkpoint_every=1", "train.keep_last=2", *extra]


def _final_weights(out):
    return torch.load(Path(out) / "open_clip_model.pt", weights_only=True)["state_dict"]


@pytest.mark.multiproc
def test_sigkill_then_resume_is_bit_identical(tiny_shards, tmp_path):
    ref = tmp_path / "ref"
    proc = _vlp(*_train_args(tiny_shards, ref))
    assert proc.returncode == 0, proc.stderr[-3000:]

    run = tmp_path / "killed"
    kill_at = random.Random(os.getpid()).randint(3, 20)  # of 28 steps
    child = forked.Popen([PYTHON, "-m", "vlp", *_train_args(tiny_shards, run)], cwd=REPO, env=run_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = run / "checkpoints" / f"step_{kill_at:08d}.pt"
    deadline = time.time() + 240
    while not target.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (run / "open_clip_model.pt").exists()

    proc = _vlp(*_train_args(tiny_shards, run, "train.resume=latest"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    a, b = _final_weights(ref), _final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((run / "result.json").read_text())["step"] == 28


@pytest.mark.multiproc
def test_kill_during_checkpoint_write_keeps_previous_loadable(tmp_path):
    script = (
        "import torch, sys\n"
        "from vlp.checkpoint.storage import RunFolder\n"
        "from vlp.checkpoint.files import save_file\n"
        f"folder = RunFolder(r'{tmp_path}')\n"
        "big = {'w': torch.randn(40_000_000)}\n"
        "for i in range(1, 1000):\n"
        "    stage = folder.stage('step_%08d.pt' % i)\n"
        "    save_file(big, stage)\n"
        "    folder.put(stage, 'step_%08d.pt' % i)\n"
    )
    child = subprocess.Popen([PYTHON, "-c", script], cwd=REPO, env=run_env())
    first = tmp_path / "step_00000001.pt"
    deadline = time.time() + 120
    while not first.exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # now inside a later write
    child.send_signal(signal.SIGKILL)
    child.wait()
    from vlp.checkpoint.storage import RunFolder
    from vlp.checkpoint.files import load
    from vlp.checkpoint.checkpointer import list_checkpoints

    latest = list_checkpoints(RunFolder(tmp_path))[-1]  # whole: it appears by one rename
    assert load(tmp_path / latest)["w"].numel() == 40_000_000
    assert any(p.name.startswith(".") for p in tmp_path.iterdir()) or True  # a temp file may remain, never a final name


@pytest.mark.multiproc
def test_cli_shards_from_folder_and_bad_folder(tmp_path):
    from PIL import Image

    src = tmp_path / "src" / "nested"
    src.mkdir(parents=True)
    for i in range(5):
        Image.new("RGB", (20, 10), (i * 40, 0, 0)).save(src / f"img{i}.png")
        (src / f"img{i}.txt").write_text(f"a red box number {i}" if i else "")  # one empty caption
    proc = _vlp("shards", str(tmp_path / "src"), str(tmp_path / "out"), "--samples-per-shard", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = json.loads((tmp_path / "out" / "sizes.json").read_text())
    assert sum(sizes.values()) == 4 and len(sizes) == 2
    assert "missing_caption" in proc.stdout + proc.stderr
    proc = _vlp("shards", str(tmp_path / "nope"), str(tmp_path / "out2"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("vlp: error:")


@pytest.mark.multiproc
def test_vlp_eval_on_our_checkpoint_and_open_clip_export_agree(tiny_shards, tmp_path):
    Trainer(_cfg(tiny_shards, tmp_path, "train.samples=32")).train()
    ckpt = sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1]
    a = _vlp("eval", "--checkpoint", str(ckpt), "--shards", tiny_shards["eval"], "--out", str(tmp_path / "a"))
    b = _vlp("eval", "--checkpoint", str(tmp_path / "open_clip_model.pt"), "--model", "vlp-micro",
             "--shards", tiny_shards["eval"], "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    ma = json.loads((tmp_path / "a" / "metrics.json").read_text())
    mb = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert ma == mb
    assert ma["retrieval"]["n_images"] == 40 and "image_retrieval_recall@1" in ma["retrieval"]["clip_benchmark"]
    assert "image→text R@1" in a.stdout
