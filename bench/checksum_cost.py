"""Checksum cost: what the SHA-256 manifest (vlp/checkpoint/integrity.py) adds to a checkpoint save and load.

    OMP_NUM_THREADS=1 python bench/checksum_cost.py           # vlp-micro state + ~500 MB, 3 rounds
    OMP_NUM_THREADS=1 python bench/checksum_cost.py --quick   # vlp-micro + 50 MB, 1 round

Two states: the trainer's .pt checkpoint of vlp-micro (model + AdamW moments + meta) and a plain
dict of random fp32 tensors of about --mb MB (a stand-in for a larger model's state). Each round
alternates:
  save_plain   atomic_write(torch.save) with fsync, as checkpoints were written before manifests
  save_checked checkpoint.save_file: the same, its checksum computed first and sealed inside
  load_plain   torch.load(weights_only)
  load_checked checkpoint.load: integrity.verify (reads and hashes the file) then torch.load
The file is read from the page cache (just written): verification's figure is the hash's CPU
cost; from a cold disk or a network file system the read itself comes on top, once for the
hash and once for torch.load. Wall seconds, median over rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import figure, header, median, pin_threads  # noqa: E402


def micro_state() -> dict:
    import torch

    from vlp.config import LossConfig, ModelConfig
    from vlp.models.model import build_model

    model = build_model(ModelConfig(name="vlp-micro"), LossConfig())[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.clip.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def big_state(mb: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    n = 16  # tensors of mb / 16 MB each
    return {"model": {f"w{i}": torch.randn(mb * (1 << 20) // 4 // n, generator=g) for i in range(n)}}


def measure(name: str, state: dict, folder: Path, rounds: int) -> None:
    import torch

    from vlp.util import atomic_write
    from vlp.checkpoint import files as ckpt
    from vlp.checkpoint import integrity

    plain, checked = folder / f"{name}_plain.pt", folder / f"{name}_checked.pt"
    times: dict[str, list[float]] = {k: [] for k in ("save_plain", "save_checked", "load_plain",
                                                     "load_checked", "verify")}

    def timed(key, fn):
        t = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t)

    for _ in range(rounds):
        timed("save_plain", lambda: atomic_write(plain, lambda f: torch.save(state, f), fsync=True))
        timed("save_checked", lambda: ckpt.save_file(state, checked))
        timed("load_plain", lambda: torch.load(plain, map_location="cpu", weights_only=True))
        timed("load_checked", lambda: ckpt.load(checked))
        timed("verify", lambda: integrity.verify(checked))
    gb = checked.stat().st_size / 1e9
    med = {k: median(v) for k, v in times.items()}
    print(f"# {name}: {gb * 1000:.1f} MB, {rounds} rounds; " +
          ", ".join(f"{k} {v:.3f}s" for k, v in med.items()), flush=True)
    figure(f"checksum_verify_s_per_gb {name}", med["verify"] / gb, "s/GB")
    # overheads as fractions of the plain time (0.25: a quarter longer)
    figure(f"checksum_save_overhead {name}", med["save_checked"] / med["save_plain"] - 1, "",
           f"({med['save_plain']:.3f}s -> {med['save_checked']:.3f}s)")
    figure(f"checksum_load_overhead {name}", med["load_checked"] / med["load_plain"] - 1, "",
           f"({med['load_plain']:.3f}s -> {med['load_checked']:.3f}s)")
    figure(f"checksum_verify_share_of_load {name}", med["verify"] / med["load_checked"], "")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mb", type=int, default=512, help="size of the large state (MB)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.mb = 1, 50
    pin_threads()
    header("checksum cost: SHA-256 manifest on save and load")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="vlp_checksum_") as tmp:
        measure("vlp-micro", micro_state(), Path(tmp), args.rounds)
        measure(f"{args.mb}MB", big_state(args.mb), Path(tmp), args.rounds)


if __name__ == "__main__":
    main()
