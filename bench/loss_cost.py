"""Cost of the contrastive losses alone: forward+backward time and memory, CPU, features given.

    OMP_NUM_THREADS=1 python bench/loss_cost.py            # B=1024, d=512 (~1-2 min)
    OMP_NUM_THREADS=1 python bench/loss_cost.py --quick    # B=128, d=64 (~10 s)

Time: every variant runs forward + backward on the same (B, d) L2-normalised features with
requires_grad (no encoder), timed by this thread's CPU clock (default; with one OpenMP thread
the forward and the CPU autograd backward both run on it, so other processes on the machine
only disturb it through caches and memory bandwidth; --clock wall for perf_counter), rounds alternate the variants (A B C A B C ...), each round times
`--inner` calls and keeps the fastest (least disturbed by other processes); the figure is the
median over rounds and the ratio is the median of the per-round ratios (measured side by side).
vlp's losses also compute their diagnostics
(no grad, one host transfer) on every call, as the trainer does; open_clip's ClipLoss /
SigLipLoss (no diagnostics) are timed as the reference, and the diagnostics alone too.

Memory, two ways, for b local rows of B = 1024 gathered columns (world 8 simulated: b = 128,
offset = 3 * 128) against the full matrix (b = B):
  * saved: bytes of the distinct tensors autograd saves for backward
    (torch.autograd.graph.saved_tensors_hooks; exact, excludes the input features);
  * peak: peak RSS (VmHWM, reset through /proc/self/clear_refs) minus RSS before the call, in
    a fresh subprocess per variant (local then full shape), after one warm-up call per shape (includes transient forward
    intermediates, the diagnostics, the backward and the input gradients); the child runs
    with MALLOC_MMAP_THRESHOLD_=65536 so every block >= 64 KiB is mmapped and returned to the
    OS on free, so RSS tracks live tensor memory (page granularity).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    alternate, bench_env, figure, header, median, paired_ratio, pin_threads, run, spread,
)

VARIANTS = ("infonce", "flatnce", "flatnce_t_infonce", "siglip", "openclip_clip", "openclip_siglip",
            "diagnostics_only")


def make_inputs(big_b: int, d: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(big_b, d, generator=g), dim=1)
    # correlated pairs so the loss is in a realistic regime (positives ahead of most negatives)
    txt = torch.nn.functional.normalize(img + 0.8 * torch.randn(big_b, d, generator=g), dim=1)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    log_scale = torch.tensor(2.659, requires_grad=True)  # log(1/0.07)
    bias = torch.tensor(-10.0, requires_grad=True)
    return img, txt, log_scale, bias


def make_step(variant: str, img, txt, log_scale, bias, b: int, offset: int):
    """A callable doing one forward+backward of `variant` with b local rows at `offset`."""
    import torch

    from vlp.losses.diagnostics import diagnostics_from_logits
    from vlp.losses.flatnce import flatnce_loss
    from vlp.losses.infonce import infonce_loss
    from vlp.losses.siglip import siglip_loss

    params = [img, txt, log_scale, bias]

    def clear():
        for p in params:
            p.grad = None

    def local():
        return img[offset:offset + b], txt[offset:offset + b]

    if variant in ("infonce", "flatnce", "flatnce_t_infonce", "siglip"):
        fn = {"infonce": infonce_loss, "flatnce": flatnce_loss, "flatnce_t_infonce": flatnce_loss,
              "siglip": siglip_loss}[variant]
        kw = {"scale_grad": "split" if "t_infonce" in variant else "same", "offset": offset}

        def step():
            clear()
            il, tl = local()
            t = log_scale.exp()
            loss, _ = fn(il, tl, img, txt, t, bias if variant == "siglip" else None, **kw)
            loss.backward()
        return step

    if variant in ("openclip_clip", "openclip_siglip"):
        import open_clip.loss as ocl

        if variant == "openclip_clip":
            ref = ocl.ClipLoss()

            def loss_of(il, tl, t):  # local-loss form with the gathered columns (as ClipLoss does)
                logits_i = t * il @ txt.T
                logits_t = t * tl @ img.T
                labels = torch.arange(b) + offset
                f = torch.nn.functional.cross_entropy
                return (f(logits_i, labels) + f(logits_t, labels)) / 2
            if b == img.shape[0]:
                def loss_of(il, tl, t):  # noqa: F811  (world 1: exactly open_clip's module)
                    return ref(il, tl, t)
        else:
            ref = ocl.SigLipLoss()

            def loss_of(il, tl, t):
                logits = t * il @ txt.T + bias
                labels = -torch.ones_like(logits)
                labels[torch.arange(b), torch.arange(b) + offset] = 1.0
                return -torch.nn.functional.logsigmoid(labels * logits).sum() / b
            if b == img.shape[0]:
                def loss_of(il, tl, t):  # noqa: F811
                    return ref(il, tl, t, bias)

        def step():
            clear()
            il, tl = local()
            loss_of(il, tl, log_scale.exp()).backward()
        return step

    if variant == "diagnostics_only":
        with torch.no_grad():
            t = log_scale.exp()
            li, lt = t * img[offset:offset + b] @ txt.T, t * txt[offset:offset + b] @ img.T

        def step():
            diagnostics_from_logits(li, lt, offset, t)
        return step
    raise ValueError(variant)


def saved_bytes(variant: str, big_b: int, d: int, b: int, offset: int) -> int:
    """Bytes of distinct storages autograd saves in forward (inputs excluded)."""
    import torch

    img, txt, log_scale, bias = make_inputs(big_b, d)
    inputs = {img.untyped_storage().data_ptr(), txt.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    step = make_step(variant, img, txt, log_scale, bias, b, offset)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_peak(variant: str, big_b: int, d: int, shapes: list) -> None:
    """(subprocess) print the peak-RSS delta of one forward+backward per (b, offset) as JSON."""
    import gc

    pin_threads()
    deltas = []
    for b, offset in shapes:
        img, txt, log_scale, bias = make_inputs(big_b, d)
        step = make_step(variant, img, txt, log_scale, bias, b, offset)
        step()  # warm-up: lazy library init and first-call buffers are not the loss's memory
        img.grad = txt.grad = log_scale.grad = bias.grad = None
        if not _reset_peak_rss():
            deltas.append(float("nan"))
            continue
        before = _status_kib("VmRSS")
        step()
        deltas.append((_status_kib("VmHWM") - before) * 1024)
        del img, txt, log_scale, bias, step
        gc.collect()
    print(json.dumps({"deltas": deltas}))


def peak_deltas(variant: str, big_b: int, d: int, shapes: list) -> list:
    """Peak-RSS deltas for each (b, offset), measured one after the other in one fresh process."""
    _, out = run([sys.executable, __file__, "--_child", json.dumps([variant, big_b, d, shapes])],
                 env=bench_env(MALLOC_MMAP_THRESHOLD_="65536"))
    return json.loads(out.strip().splitlines()[-1])["deltas"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B=128, d=64, 2 rounds, peak memory of flatnce only")
    ap.add_argument("--batch", type=int, default=1024, help="global batch B")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--world", type=int, default=8, help="simulated ranks for the local-loss rows")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--inner", type=int, default=5, help="calls per round (the min is kept)")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: CPU time of this thread (all work runs on it with 1 OMP thread; "
                         "insensitive to being descheduled by other processes); wall: perf_counter")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        child_peak(*json.loads(args._child))
        return
    if args.quick:
        args.batch, args.dim, args.rounds, args.inner = 128, 64, 2, 1
    pin_threads()
    header(f"loss cost: forward+backward of the loss alone, B={args.batch}, d={args.dim}, CPU")
    big_b, d = args.batch, args.dim
    b_local, offset_local = big_b // args.world, 3 * (big_b // args.world) % big_b

    results = {}
    for label, b, off in (("full b=B", big_b, 0), (f"local b=B/{args.world}", b_local, offset_local)):
        img, txt, log_scale, bias = make_inputs(big_b, d)
        steps = {v: make_step(v, img, txt, log_scale, bias, b, off) for v in VARIANTS}
        for s in steps.values():  # warm-up (allocator, first-call dispatch)
            s()

        clock = time.thread_time if args.clock == "thread" else time.perf_counter

        def timer(s):
            def f():  # min over `inner` calls: the least disturbed by other processes
                best = float("inf")
                for _ in range(args.inner):
                    t0 = clock()
                    s()
                    best = min(best, clock() - t0)
                return best * 1e3
            return f

        ms = alternate({v: timer(s) for v, s in steps.items()}, args.rounds)
        results[label] = ms
        print(f"\n## {label} (b={b} rows x B={big_b} columns), ms ({args.clock} clock) per forward+backward: "
              f"min of {args.inner} calls per round, median [min..max] over {args.rounds} rounds")
        for v in VARIANTS:
            print(f"  {v:20s} {spread(ms[v])}")
        tag = "" if b == big_b else "_local"
        for num, den in (("flatnce", "infonce"), ("flatnce_t_infonce", "infonce"),
                         ("siglip", "infonce"), ("infonce", "openclip_clip"),
                         ("siglip", "openclip_siglip")):
            r = paired_ratio(ms[num], ms[den])
            figure(f"loss_time_ratio{tag} {num}/{den}", median(r), "x",
                   f"[{min(r):.3f}..{max(r):.3f}]")
        figure(f"loss_time{tag} infonce", median(ms["infonce"]), "ms")
        figure(f"loss_time{tag} diagnostics_share_of_infonce",
               median(paired_ratio(ms["diagnostics_only"], ms["infonce"])), "x")

    print(f"\n## memory: b={b_local} local rows (world {args.world}) vs b=B={big_b}; MiB")
    print(f"  {'variant':20s} {'saved b':>9s} {'saved B':>9s} {'ratio':>6s} | "
          f"{'peak b':>8s} {'peak B':>8s} {'ratio':>6s}")
    for v in ("flatnce",) if args.quick else ("infonce", "flatnce", "flatnce_t_infonce", "siglip"):
        sb = saved_bytes(v, big_b, d, b_local, offset_local) / 2**20
        sB = saved_bytes(v, big_b, d, big_b, 0) / 2**20
        pb, pB = (x / 2**20 for x in peak_deltas(v, big_b, d, [(b_local, offset_local), (big_b, 0)]))
        print(f"  {v:20s} {sb:9.2f} {sB:9.2f} {sb / sB:6.3f} | {pb:8.2f} {pB:8.2f} {pb / max(pB, 1e-9):6.3f}")
        figure(f"loss_mem_saved {v} local/full", sb / sB, "x", f"{sb:.2f} vs {sB:.2f} MiB")
        figure(f"loss_mem_peak {v} local/full", pb / max(pB, 1e-9), "x", f"{pb:.2f} vs {pB:.2f} MiB")
    bb = 4 * b_local * big_b / 2**20
    print(f"  (one fp32 b x B matrix: {bb:.2f} MiB local, {4 * big_b * big_b / 2**20:.2f} MiB full)")


if __name__ == "__main__":
    main()
