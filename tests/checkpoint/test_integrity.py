"""Checksums end to end (issues 21, 27): a .pt checkpoint carries its checksum inside, a DCP
directory and an export a manifest written last; damage INSIDE a tensor's bytes (which
torch.load and DCP read without complaint) is refused by name, resume falls back to the newest
valid checkpoint, `vlp eval` refuses in one line. A checkpoint copied or renamed still verifies;
one vlp wrote that cannot be verified is never loaded; checkpoints from before checksums load
with one warning."""
import json
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from vlp.checkpoint import files as ckpt
from vlp.checkpoint import integrity
from vlp.eval.checkpoints import load_sharded_full
from vlp.train.parts import RNG
from vlp.checkpoint.storage import RunFolder
from vlp.checkpoint.checkpointer import Checkpointer, latest_valid, list_checkpoints, set_aside
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
    entries = {f.name: integrity.entry(f) for f in sorted(folder.iterdir())}
    integrity.manifest_path(folder).write_bytes(integrity.manifest_bytes(entries))
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


def test_every_checkpoint_and_the_export_verify(trained):
    out, _ = trained
    ckpts = sorted((out / "checkpoints").glob("step_*.pt"))
    assert len(ckpts) == 4 and not list((out / "checkpoints").glob("*manifest*"))  # checksums inside
    for path in ckpts:
        state, verified = ckpt.load_checked(path)
        assert verified and state[integrity.SEAL_KEY]["format"] == integrity.SEAL_FORMAT
    assert integrity.verify(out / "open_clip_model.pt")


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
    assert json.loads((out / "result.json").read_text())["step"] == 6
    assert ckpt.load_checked(out / "checkpoints" / "step_00000006.pt")[1]


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


def test_checkpoint_from_before_checksums_loads_with_one_warning(capsys, run_copy, tmp_path):
    """A checkpoint as the code before manifests wrote it: the same torch.save, no MARK_KEY, no
    sidecar."""
    out, shards = run_copy
    ckpts = out / "checkpoints"
    for path in ckpts.glob("step_*.pt"):
        state = torch.load(path, weights_only=True)
        state.pop(integrity.SEAL_KEY)
        torch.save(state, path)
    rc, stdout, err = run(capsys, *train_args(shards["train"], out, "train.resume=latest", "train.samples=96"))
    assert rc == 0, err[-2000:]
    warnings = [ln for ln in err.splitlines() if "no checksum manifest" in ln]
    assert len(warnings) == 1 and "step_00000004.pt" in warnings[0] and "loaded unverified" in warnings[0]
    assert "resumed from" in stdout and "step_00000004.pt" in stdout


def adamw_span(path: Path) -> tuple[int, int]:
    """(offset, length) in a .pt zip of the largest AdamW state tensor: storages are numbered in
    the order torch.save meets them, the model's first."""
    state = torch.load(path, weights_only=True)
    model_storages = {t.untyped_storage().data_ptr() for t in state["model"].values()}
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if "/data/" in i.filename
                 and int(i.filename.rsplit("/", 1)[1]) >= len(model_storages)]
    info = max(infos, key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_copied_pt_with_flipped_adamw_bytes_is_never_loaded(capsys, run_copy, tmp_path):
    """The hostile case: a .pt copied alone (no manifest beside it), 64 bytes flipped inside its
    AdamW state. Named explicitly: one error line; found by resume=latest: passed over, saying so."""
    out, shards = run_copy
    copy = tmp_path / "copied" / "checkpoints" / "step_00000004.pt"
    copy.parent.mkdir(parents=True)
    copy.write_bytes((out / "checkpoints" / "step_00000004.pt").read_bytes())
    offset, length = adamw_span(copy)
    flip(copy, offset + length // 2, 64)
    damaged, intact = torch.load(copy, weights_only=True), ckpt.load(out / "checkpoints" / "step_00000004.pt")
    assert all(torch.equal(v, intact["model"][k]) for k, v in damaged["model"].items())  # only the AdamW state
    assert not all(torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
                   for a, b in zip(damaged["optimizer"]["state"].values(), intact["optimizer"]["state"].values()))
    rc, _, err = run(capsys, *train_args(shards["train"], tmp_path / "r", f"train.resume={copy}",
                                         "train.samples=96"))
    one_line(rc, err, "step_00000004.pt does not match its sha256 checksum")
    copy.with_name("step_00000002.pt").write_bytes((out / "checkpoints" / "step_00000002.pt").read_bytes())
    rc, stdout, err = run(capsys, *train_args(shards["train"], copy.parent.parent, "train.resume=latest",
                                              "train.samples=96"))
    assert rc == 0, err[-2000:]
    assert "skipped checkpoint" in stdout and "step_00000004.pt does not match its sha256 checksum" in stdout
    assert "resumed from" in stdout and "step_00000002.pt at step 2" in stdout


def test_damaged_per_rank_file_is_named_not_blamed_on_the_config(capsys, tiny_shards, tmp_path):
    """SogCLR's per-rank file (step_N.ranks/) with bytes flipped in its u table: one line naming
    that file, not 'does not fit this run' (it is not a config change)."""
    out = tmp_path / "run"
    sog = ("loss.name=sogclr", "loss.gamma=0.5", "train.checkpoint_every=2", "train.samples=32")
    assert run(capsys, *train_args(tiny_shards["train"], out, *sog))[0] == 0
    ranks = out / "checkpoints" / "step_00000002.ranks" / "rank00000-of-00001.pt"
    offset, length = zip_member_span(ranks)
    flip(ranks, offset + length // 2, 64)
    rc, _, err = run(capsys, *train_args(tiny_shards["train"], out, *sog, "train.resume=latest", "train.samples=64"))
    line = one_line(rc, err, "rank00000-of-00001.pt does not match its sha256 checksum")
    assert "does not fit" not in line


def test_checkpoint_copied_under_a_new_name_verifies(capsys, run_copy, tmp_path):
    """Checksums inside: a .pt renamed alone verifies. A .pt of the release before (checksums in a
    sidecar) renamed with its sidecar verifies; without it, it cannot be verified: refused."""
    out, shards = run_copy
    renamed = tmp_path / "elsewhere" / "my_model.pt"
    renamed.parent.mkdir()
    renamed.write_bytes((out / "checkpoints" / "step_00000004.pt").read_bytes())
    assert ckpt.load_checked(renamed)[1]
    rc, stdout, err = run(capsys, *train_args(shards["train"], tmp_path / "r1", f"train.resume={renamed}",
                                              "train.samples=96"))
    assert rc == 0 and "unverified" not in err, err[-2000:]
    assert f"resumed from {renamed} at step 4" in stdout
    state = torch.load(renamed, weights_only=True)  # as the release before wrote it
    state[integrity.SEAL_KEY] = integrity.FORMAT
    previous = tmp_path / "prev" / "step_00000004.pt"
    previous.parent.mkdir()
    torch.save(state, previous)
    integrity.write_manifest(previous)
    moved = tmp_path / "elsewhere" / "kept.pt"
    previous.rename(moved)
    integrity.manifest_path(previous).rename(integrity.manifest_path(moved))
    assert ckpt.load_checked(moved)[1] and ckpt.load_valid(moved)["train"]["step"] == 4
    integrity.manifest_path(moved).unlink()
    rc, _, err = run(capsys, *train_args(shards["train"], tmp_path / "r2", f"train.resume={moved}",
                                         "train.samples=96"))
    one_line(rc, err, "kept.pt has no manifest (kept.pt.manifest.json) and cannot be verified")


# ----------------------------------------------------------------------------- DCP directories
class Shards:
    """A model and optimizer as the checkpointer's weights part, saved as DCP shards."""
    sharded = True

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def sharded_state(self):
        from vlp.train import parallel

        return parallel.sharded_state(self.model, self.opt)


def save_sharded(model, opt, meta: dict, folder, step: int) -> str:
    """A DCP checkpoint of `model` and `opt` with `meta` beside the parts (as each FSDP rank writes)."""
    return Checkpointer(RunFolder(folder), Shards(model, opt), facts=meta).save(step)


@pytest.fixture(scope="module")
def dcp_pair(tmp_path_factory):
    """Two DCP checkpoints (steps 1 and 2) of vlp-micro with AdamW state, written in one process
    by save_sharded (as each FSDP rank writes its own), and the state they hold."""
    from vlp.config import LossConfig, ModelConfig
    from vlp.experiment import load_config
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
                "rng": [RNG().state_dict()], "config": cfg, "preprocess": dict(model.preprocess)}
        save_sharded(model, opt, meta, root, step)
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
    assert latest_valid(RunFolder(dcp_pair))[0][1].name == "step_00000002"


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
    (_, path, state), rejected = latest_valid(RunFolder(dcp_copy))
    assert path.name == "step_00000001" and state["train"]["step"] == 1
    assert len(rejected) == 1 and f"{name} does not match its sha256 checksum" in rejected[0][1]
    with pytest.raises(ckpt.CheckpointError, match=f"{name} does not match"):  # vlp eval's reader
        load_sharded_full(newest)
    kept = set_aside(RunFolder(dcp_copy), newest.name)
    assert kept == "step_00000002.corrupt" and (dcp_copy / kept / "manifest.json").exists()
    assert list_checkpoints(RunFolder(dcp_copy)) == ["step_00000001"]


def test_dcp_checkpoint_without_manifest(dcp_copy, capsys):
    newest = dcp_copy / "step_00000002"
    (newest / "manifest.json").unlink()
    (_, path, _), rejected = latest_valid(RunFolder(dcp_copy))  # written with one (sealed): not trusted
    assert path.name == "step_00000001" and "has no manifest" in rejected[0][1]
    meta = torch.load(newest / "meta.pt", weights_only=True)
    meta.pop(integrity.SEAL_KEY)
    torch.save(meta, newest / "meta.pt")  # as written before manifests: loads, with a warning
    assert latest_valid(RunFolder(dcp_copy))[0][1].name == "step_00000002"
    assert "no checksum manifest" in capsys.readouterr().err


def _save_two_ranks(rank, world, folder):
    """Two gloo ranks, FSDP2-sharded vlp-micro: a DCP save, each rank hashing its own file."""
    from vlp.train import parallel
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model

    torch.manual_seed(0)
    model = parallel.apply_fsdp(build_model(ModelConfig(name="vlp-micro"), LossConfig())[0], "cpu", "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"scheduler": {}, "step": 1, "epoch": 0, "batch_in_epoch": 1, "world_size": world, "rng": [], "config": {}}
    save_sharded(model, opt, meta, folder, 1)
    return 0


@pytest.mark.multiproc
def test_two_ranks_each_hash_their_own_dcp_file(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_save_two_ranks, 2, (str(tmp_path),))
    folder = tmp_path / "step_00000001"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(integrity.read_manifest(folder))
    assert integrity.verify(folder)
    assert ckpt.load_valid(folder)["world_size"] == 2


def test_dcp_checkpoint_copied_under_a_new_name_verifies(dcp_pair, tmp_path):
    import shutil

    renamed = tmp_path / "any_name"
    shutil.copytree(dcp_pair / "step_00000002", renamed)  # its manifest names files relative to it
    assert integrity.verify(renamed) and ckpt.load_valid(renamed)["train"]["step"] == 2


def _save_twice_second_disk_full(rank, world, folder):
    """Two gloo ranks: step 1 saves; step 2's shard write on rank 1 hits ENOSPC (DCP turns it
    into a CheckpointException, a BaseException, on every rank). Returns what each rank raised."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs
    from vlp.train import parallel
    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model

    torch.manual_seed(0)
    model = parallel.apply_fsdp(build_model(ModelConfig(name="vlp-micro"), LossConfig())[0], "cpu", "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"scheduler": {}, "step": 1, "epoch": 0, "batch_in_epoch": 1, "world_size": world, "rng": [], "config": {}}
    save_sharded(model, opt, meta, folder, 1)
    real = fs._write_item

    def full(*args, **kwargs):
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    fs._write_item = full
    try:
        save_sharded(model, opt, {**meta, "step": 2}, folder, 2)
    except ckpt.CheckpointError as e:
        return str(e)
    finally:
        fs._write_item = real
    return None


@pytest.mark.multiproc
def test_dcp_save_that_hits_a_full_disk_is_one_error_and_leaves_no_temp(tmp_path):
    from dist_utils import run_distributed

    errors = run_distributed(_save_twice_second_disk_full, 2, (str(tmp_path),))
    assert errors[0] == errors[1] and errors[0] == (
        f"cannot write checkpoint {tmp_path / 'step_00000002'}: No space left on device; "
        "earlier checkpoints are unchanged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no .step_00000002.tmp
    assert ckpt.load_valid(tmp_path / "step_00000001")["train"]["step"] == 1


def test_a_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    """An OSError while checking (EIO, a lost mount) is the same one-line error as damage."""
    import errno

    f = tmp_path / "w.pt"
    f.write_bytes(b"weights")
    integrity.write_manifest(f)

    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(integrity, "file_digest", unreadable)
    with pytest.raises(integrity.IntegrityError, match=rf"^model.pretrained {f} cannot be checked: Input/output error$"):
        integrity.verify(f, "model.pretrained")
