"""Checksums end to end (issue 21): every checkpoint and export carries a manifest written last;
damage INSIDE a tensor's bytes (which torch.load and DCP read without complaint) is refused by
name, resume falls back to the newest valid checkpoint, `vlp eval` refuses in one line, and
checkpoints from before manifests still load (with one warning)."""
import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from vlp.train import checkpoint as ckpt
from vlp import integrity
from vlp.cli import main
from vlp_testing import REPO, overrides

TINY = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
        "train.log_every=1", "data.shuffle_buffer=64", "train.samples=64", "data.eval_shards=null"]


def train_args(shards, out, *extra):
    return ["train", "-c", str(REPO / "configs/demo.yaml"), *overrides(
                f"data.train_shards={shards}", f"train.output_dir={out}", *TINY, *extra)]


def run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc, err, *needles):
    assert rc == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("vlp: error:"), err[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- damage helpers
def zip_member_span(path: Path, largest_data: bool = True) -> tuple[int, int]:
    """(offset, length) in the file of the largest tensor storage (archive/data/N) of a .pt zip."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def dcp_span(folder: Path, prefix: str) -> tuple[str, int, int]:
    """(file, offset, length) of the largest saved item whose name starts with `prefix`."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    index, info = max(((i, s) for i, s in storage.items() if i.fqn.startswith(prefix)), key=lambda t: t[1].length)
    return info.relative_path, info.offset, info.length


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int, n: int) -> None:
    with open(path, "rb") as f:
        f.seek(offset)
        old = f.read(n)
    overwrite(path, offset, bytes(b ^ 0xFF for b in old))


# ----------------------------------------------------------------------------- the manifest
def test_manifest_roundtrip_and_every_kind_of_mismatch(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * (9 << 20))  # more than two read chunks
    assert integrity.verify(f) is False  # no manifest yet
    integrity.write_manifest(f)
    data = json.loads(integrity.manifest_path(f).read_text())
    assert data["algorithm"] == "sha256" and data["files"]["a.bin"]["size"] == 9 << 20
    assert integrity.verify(f) is True
    overwrite(f, 5 << 20, b"y")
    with pytest.raises(integrity.IntegrityError, match="a.bin does not match its sha256 checksum"):
        integrity.verify(f)
    with open(f, "ab") as out:
        out.write(b"z")
    with pytest.raises(integrity.IntegrityError, match="holds 9437185 bytes, its manifest says 9437184"):
        integrity.verify(f)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "one").write_bytes(b"1")
    (folder / "two").write_bytes(b"2")
    integrity.write_manifest(folder)
    assert integrity.verify(folder) and sorted(integrity.read_manifest(folder)) == ["one", "two"]
    (folder / "two").unlink()
    with pytest.raises(integrity.IntegrityError, match="two is missing"):
        integrity.verify(folder)
    integrity.manifest_path(folder).write_text("{not json")
    with pytest.raises(integrity.IntegrityError, match="not a readable manifest"):
        integrity.verify(folder)


# ----------------------------------------------------------------------------- .pt checkpoints
@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    """A finished 4-step run, a checkpoint (with manifest) at every step."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    assert main(train_args(tiny_shards["train"], out, "train.checkpoint_every=1", "train.keep_last=0")) == 0
    return out, tiny_shards


@pytest.fixture
def run_copy(trained, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    return out, trained[1]


def test_every_checkpoint_and_the_export_have_a_verifying_manifest(trained):
    out, _ = trained
    ckpts = sorted((out / "checkpoints").glob("step_*.pt"))
    assert len(ckpts) == 4
    for path in ckpts + [out / "open_clip_model.pt"]:
        assert integrity.verify(path), path
    assert ckpt.load(ckpts[-1])[ckpt.MARK_KEY] == integrity.FORMAT


def test_zeroed_tail_of_a_tensor_in_an_intact_zip_falls_back_and_eval_refuses(capsys, run_copy, tmp_path):
    out, shards = run_copy
    newest = out / "checkpoints" / "step_00000004.pt"
    offset, length = zip_member_span(newest)
    cut = int(length * 0.7)
    overwrite(newest, offset + cut, b"\0" * (length - cut))  # the last 30 % of the biggest tensor
    assert isinstance(torch.load(newest, weights_only=True), dict)  # torch itself does not notice
    rc, _, err = run(capsys, "eval", "--checkpoint", newest, "--shards", shards["eval"],
                     "--out", tmp_path / "e", "--device", "cpu")
    one_line(rc, err, "step_00000004.pt does not match its sha256 checksum")
    assert not (tmp_path / "e").exists()
    rc, stdout, err = run(capsys, *train_args(shards["train"], out, "train.resume=latest", "train.samples=96"))
    assert rc == 0, err[-2000:]
    assert "step_00000004.pt does not match its sha256 checksum" in stdout
    assert "falling back to step_00000003.pt" in stdout
    assert (out / "checkpoints" / "step_00000004.pt.corrupt").exists()
    assert (out / "checkpoints" / "step_00000004.pt.corrupt.manifest.json").exists()
    assert json.loads((out / "result.json").read_text())["step"] == 6
    assert integrity.verify(out / "checkpoints" / "step_00000006.pt")


def test_damaged_export_is_refused_by_eval_and_as_pretrained(capsys, run_copy, tmp_path):
    out, shards = run_copy
    export = out / "open_clip_model.pt"
    offset, length = zip_member_span(export)
    flip(export, offset + length // 2, 64)
    rc, _, err = run(capsys, "eval", "--checkpoint", export, "--model", "vlp-micro", "--shards", shards["eval"],
                     "--out", tmp_path / "e", "--device", "cpu")
    one_line(rc, err, "open_clip_model.pt does not match its sha256 checksum")
    rc, _, err = run(capsys, *train_args(shards["train"], tmp_path / "r", f"model.pretrained={export}"))
    one_line(rc, err, "model.pretrained", "does not match its sha256 checksum")


def test_checkpoint_of_this_release_without_manifest_loads_with_one_warning(capsys, run_copy, tmp_path):
    """A checkpoint as the code before manifests wrote it: the same torch.save, no MARK_KEY, no
    sidecar."""
    out, shards = run_copy
    ckpts = out / "checkpoints"
    for path in ckpts.glob("step_*.pt"):
        state = torch.load(path, weights_only=True)
        state.pop(ckpt.MARK_KEY)
        torch.save(state, path)
        integrity.manifest_path(path).unlink()
    rc, stdout, err = run(capsys, *train_args(shards["train"], out, "train.resume=latest", "train.samples=96"))
    assert rc == 0, err[-2000:]
    warnings = [ln for ln in err.splitlines() if "no checksum manifest" in ln]
    assert len(warnings) == 1 and "step_00000004.pt" in warnings[0] and "loaded unverified" in warnings[0]
    assert "resumed from" in stdout and "step_00000004.pt" in stdout


def test_checkpoint_copied_without_its_manifest_loads_unverified(capsys, run_copy):
    """The .pt is renamed whole before its manifest is written: without the manifest (copied
    alone, or a kill in between) its bytes are complete, only unvouched for."""
    out, shards = run_copy
    integrity.manifest_path(out / "checkpoints" / "step_00000004.pt").unlink()
    rc, stdout, err = run(capsys, *train_args(shards["train"], out, "train.resume=latest", "train.samples=96"))
    assert rc == 0, err[-2000:]
    assert "(step_00000004.pt.manifest.json is missing: copied without it?): loaded unverified" in err
    assert "resumed from" in stdout and "step_00000004.pt at step 4" in stdout


# ----------------------------------------------------------------------------- DCP directories
@pytest.fixture(scope="module")
def dcp_pair(tmp_path_factory):
    """Two DCP checkpoints (steps 1 and 2) of vlp-micro with AdamW state, written in one process
    by save_sharded (as each FSDP rank writes its own), and the state they hold."""
    from vlp.train import parallel
    from vlp.config import LossConfig, ModelConfig, load_config
    from vlp.models.model import build_model

    root = tmp_path_factory.mktemp("dcp") / "checkpoints"
    model = build_model(ModelConfig(name="vlp-micro"), LossConfig())[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = load_config(None, ["model.name=vlp-micro"]).to_dict()
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        meta = {"scheduler": {}, "step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1,
                "rng": [ckpt.rng_state()], "config": cfg, "preprocess": dict(model.preprocess)}
        ckpt.save_sharded(parallel.sharded_state(model, opt), meta, root / f"step_{step:08d}")
    return root


@pytest.fixture
def dcp_copy(dcp_pair, tmp_path):
    import shutil

    dst = tmp_path / "checkpoints"
    shutil.copytree(dcp_pair, dst)
    return dst


def test_dcp_manifest_covers_every_file(dcp_pair):
    folder = dcp_pair / "step_00000002"
    names = sorted(integrity.read_manifest(folder))
    assert names == sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert {".metadata", "meta.pt", "__0_0.distcp"} <= set(names)
    assert ckpt.latest_valid(dcp_pair)[0].name == "step_00000002"


@pytest.mark.parametrize("where", ["model_zeroed_4k", "adamw_flipped_64", "meta_flipped_64"])
def test_damaged_dcp_checkpoint_falls_back_to_the_older_one(dcp_copy, where):
    newest = dcp_copy / "step_00000002"
    if where == "meta_flipped_64":
        name, offset, length = "meta.pt", 0, (newest / "meta.pt").stat().st_size
        flip(newest / name, length // 2, 64)
    else:
        name, offset, length = dcp_span(newest, "model." if where.startswith("model") else "optimizer.state.")
        if where == "model_zeroed_4k":
            overwrite(newest / name, offset + length // 2 - 2048, b"\0" * 4096)
        else:
            flip(newest / name, offset + length // 2, 64)
    path, state, rejected = ckpt.latest_valid(dcp_copy)
    assert path.name == "step_00000001" and state["step"] == 1
    assert len(rejected) == 1 and f"{name} does not match its sha256 checksum" in rejected[0][1]
    with pytest.raises(ckpt.CheckpointError, match=f"{name} does not match"):  # vlp eval's reader
        ckpt.load_sharded_full(newest)
    kept = ckpt.set_aside(newest)
    assert kept.name == "step_00000002.corrupt" and (kept / "manifest.json").exists()
    assert [p.name for p in ckpt.list_checkpoints(dcp_copy)] == ["step_00000001"]


def test_dcp_checkpoint_without_manifest(dcp_copy, capsys):
    newest = dcp_copy / "step_00000002"
    (newest / "manifest.json").unlink()
    path, _, rejected = ckpt.latest_valid(dcp_copy)  # written with one (MARK_KEY): not trusted
    assert path.name == "step_00000001" and "has no manifest" in rejected[0][1]
    meta = torch.load(newest / "meta.pt", weights_only=True)
    meta.pop(ckpt.MARK_KEY)
    torch.save(meta, newest / "meta.pt")  # as written before manifests: loads, with a warning
    assert ckpt.latest_valid(dcp_copy)[0].name == "step_00000002"
    assert "no checksum manifest" in capsys.readouterr().err


def _save_two_ranks(rank, world, folder):
    """Two gloo ranks, FSDP2-sharded vlp-micro: save_sharded, each rank hashing its own file."""
    from vlp.train import parallel
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model

    torch.manual_seed(0)
    model = parallel.apply_fsdp(build_model(ModelConfig(name="vlp-micro"), LossConfig())[0], "cpu", "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"scheduler": {}, "step": 1, "epoch": 0, "batch_in_epoch": 1, "world_size": world, "rng": [], "config": {}}
    ckpt.save_sharded(parallel.sharded_state(model, opt), meta, Path(folder) / "step_00000001")
    return 0


def test_two_ranks_each_hash_their_own_dcp_file(tmp_path):
    from _dist_utils import run_distributed

    run_distributed(_save_two_ranks, 2, (str(tmp_path),))
    folder = tmp_path / "step_00000001"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(integrity.read_manifest(folder))
    assert integrity.verify(folder)
    assert ckpt.load_sharded_meta(folder)["world_size"] == 2
