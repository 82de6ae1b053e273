"""Cost of the contrastive losses alone: forward+backward time and memory, CPU, features given.

    OMP_NUM_THREADS=1 python bench/loss_cost.py            # B=1024, d=512 (~1-2 min)
    OMP_NUM_THREADS=1 python bench/loss_cost.py --quick    # B=128, d=64 (~10 s)

Time: every variant runs forward + backward on the same (B, d) L2-normalised features with
requires_grad (no encoder), timed by this thread's CPU clock (default; with one OpenMP thread
the forward and the CPU autograd backward both run on it, so other processes on the machine
only disturb it through caches and memory bandwidth; --clock wall for perf_counter), rounds alternate the variants (A B C A B C ...), each round times
`--inner` calls and keeps the fastest (least disturbed by other processes); the figure is the
median over rounds and the ratio is the median of the per-round ratios (measured side by side).
`flatnce_proposed` is the fix proposed for vlp/losses/flatnce.py (see its docstring); it is
checked against vlp's flatnce_loss (value and gradients, float64) before timing. vlp's losses also compute their diagnostics
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
import functools
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    alternate, bench_env, figure, header, median, paired_ratio, pin_threads, run, spread,
)

VARIANTS = ("infonce", "flatnce", "flatnce_t_infonce", "siglip", "openclip_clip", "openclip_siglip",
            "diagnostics_only", "flatnce_proposed", "flatnce_t_infonce_proposed")


def _neg_lse_function():
    import torch

    class NegLSE(torch.autograd.Function):
        """v_i = logsumexp_{j != p_i} L_ij - L_i,p_i for (b, B) logits L, positives p_i.

        One masked_fill and one fused log_softmax forward (the same kernel cross_entropy uses),
        saving only log-probabilities over the negatives; backward: dv_i/dL_ij = w_ij
        (softmax over the negatives) for j != p_i and -1 at p_i.
        """

        @staticmethod
        def forward(ctx, logits, pos_idx, pos_mask):
            masked = logits.masked_fill(pos_mask, float("-inf"))
            logp = torch.log_softmax(masked, dim=1)  # (b, B), -inf at the positive
            rows = torch.arange(logits.shape[0], device=logits.device)
            q = (pos_idx + 1) % logits.shape[1]  # any negative column: lse = L_iq - logp_iq
            v = masked[rows, q] - logp[rows, q] - logits[rows, pos_idx]
            ctx.save_for_backward(logp, pos_idx)
            return v

        @staticmethod
        def backward(ctx, grad_v):
            logp, pos_idx = ctx.saved_tensors
            grad = torch.exp(logp).mul_(grad_v[:, None])  # (b, B) w_ij * g_i, 0 at the positive
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, pos_idx] = -grad_v
            return grad, None, None

    return NegLSE


def flatnce_proposed(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias=None, *,
                     offset=0, scale_grad="same"):
    """The fix proposed in BENCHMARKS.md for vlp/losses/flatnce.py (scale_grad="same"), measured
    here and checked against vlp's flatnce_loss (value and gradients, float64) before timing.

    Same maths; v = NegLSE(logits) replaces negative_lse(logits) = logsumexp((L - L.gather(p))
    .masked_fill(...)), i.e. eager logsumexp (amax, sub, exp, sum, log, add: separate (b, B)
    passes and temporaries) plus gather/sub/masked_fill whose backward adds a zero-filled
    (b, B) scatter, a row sum, a neg and an add of two (b, B) gradients.
    """
    import torch

    from vlp.losses.common import (
        as_fp32, as_scalar, fp32_block, positive_index, positive_mask, scaled_logits, softplus_exact,
    )
    from vlp.losses.diagnostics import diagnostics_from_logits

    assert scale_grad == "same"
    neg_lse = _neg_lse_function()
    b, big_b = img_local.shape[0], img_global.shape[0]
    device = img_local.device
    with fp32_block(device):
        t = as_scalar(logit_scale, device)
        bias = as_scalar(logit_bias, device)
        img_b, txt_b = as_fp32(img_local), as_fp32(txt_local)
        img_bb, txt_bb = as_fp32(img_global), as_fp32(txt_global)
        pos_idx = positive_index(b, offset, device)
        mask = positive_mask(b, big_b, offset, device)
        logits = [scaled_logits(img_b, txt_bb, t, bias), scaled_logits(txt_b, img_bb, t, bias)]
        v = torch.cat([neg_lse.apply(lg, pos_idx, mask) for lg in logits])  # (2b,)
        flat = torch.exp(v - v.detach()).mean()
        loss = flat - 1.0 + softplus_exact(v.detach()).mean()
    metrics = diagnostics_from_logits(logits[0], logits[1], offset, t, extra={"loss": loss, "flatnce": flat})
    return loss, metrics


def _neg_lse_two_function():
    import torch

    class NegLSETwo(torch.autograd.Function):
        """(v, v) for L = t * sim, v_i = logsumexp_{j != p_i} L_ij - L_i,p_i, with separate
        gradient routes: the first output's gradient reaches only `sim`, the second's only `t`
        (dv_i/dt = sum_j w_ij s_ij - s_i,p_i, w = softmax over the negatives): the
        "infonce" temperature mode from one log_softmax instead of two LSEs + a cross-entropy."""

        @staticmethod
        def forward(ctx, sim, t, pos_idx, pos_mask):
            logits = t * sim
            masked = logits.masked_fill(pos_mask, float("-inf"))
            logp = torch.log_softmax(masked, dim=1)
            rows = torch.arange(sim.shape[0], device=sim.device)
            q = (pos_idx + 1) % sim.shape[1]
            v = masked[rows, q] - logp[rows, q] - logits[rows, pos_idx]
            ctx.save_for_backward(logp, sim, t, pos_idx)
            return v, v.clone()

        @staticmethod
        def backward(ctx, g_feat, g_t):
            logp, sim, t, pos_idx = ctx.saved_tensors
            rows = torch.arange(sim.shape[0], device=sim.device)
            w = torch.exp(logp)  # (b, B) softmax over the negatives, 0 at the positive
            grad_sim = grad_t = None
            if g_t is not None:
                dv_dt = (w * sim).sum(1) - sim[rows, pos_idx]
                grad_t = (g_t * dv_dt).sum().reshape(t.shape)
            if g_feat is not None:
                gs = g_feat * t
                grad_sim = w.mul_(gs[:, None])
                grad_sim[rows, pos_idx] = -gs
            return grad_sim, grad_t, None, None

    return NegLSETwo


def flatnce_t_infonce_proposed(img_local, txt_local, img_global, txt_global, logit_scale, logit_bias=None,
                               *, offset=0, scale_grad="infonce"):
    """The same fix for scale_grad="infonce" (FlatNCE's default temperature mode): one NegLSETwo
    per direction replaces negative_lse(t.detach() * sim) + cross_entropy(t * sim.detach())."""
    import torch

    from vlp.losses.common import as_fp32, as_scalar, fp32_block, positive_index, positive_mask, softplus_exact
    from vlp.losses.diagnostics import diagnostics_from_logits

    assert scale_grad == "infonce"
    neg_lse = _neg_lse_two_function()
    b, big_b = img_local.shape[0], img_global.shape[0]
    device = img_local.device
    with fp32_block(device):
        t = as_scalar(logit_scale, device)
        img_b, txt_b = as_fp32(img_local), as_fp32(txt_local)
        img_bb, txt_bb = as_fp32(img_global), as_fp32(txt_global)
        pos_idx = positive_index(b, offset, device)
        mask = positive_mask(b, big_b, offset, device)
        sims = [img_b @ txt_bb.T, txt_b @ img_bb.T]
        outs = [neg_lse.apply(sim, t, pos_idx, mask) for sim in sims]
        v_feat = torch.cat([o[0] for o in outs])
        v_t = torch.cat([o[1] for o in outs])
        flat = torch.exp(v_feat - v_feat.detach()).mean()
        loss = flat - 1.0 + softplus_exact(v_t).mean()  # value InfoNCE; d/dt InfoNCE's; d/dfeatures FlatNCE's
        with torch.no_grad():
            logits = [t * sim for sim in sims]
    metrics = diagnostics_from_logits(logits[0], logits[1], offset, t, extra={"loss": loss, "flatnce": flat})
    return loss, metrics


def check_proposed(big_b: int = 64, d: int = 16) -> float:
    """Max abs difference of value and gradients, proposed vs vlp flatnce (float64, b < B)."""
    import torch

    from vlp.losses import flatnce_loss

    errs = []
    for (b, off), mode in itertools.product(((big_b, 0), (big_b // 4, big_b // 2)), ("same", "infonce")):
        outs = []
        proposed = flatnce_proposed if mode == "same" else flatnce_t_infonce_proposed
        for fn in (functools.partial(flatnce_loss, scale_grad=mode), functools.partial(proposed, scale_grad=mode)):
            g = torch.Generator().manual_seed(1)
            img = torch.nn.functional.normalize(torch.randn(big_b, d, generator=g, dtype=torch.float64), dim=1)
            txt = torch.nn.functional.normalize(torch.randn(big_b, d, generator=g, dtype=torch.float64), dim=1)
            img.requires_grad_(True)
            txt.requires_grad_(True)
            ls = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
            loss, m = fn(img[off:off + b], txt[off:off + b], img, txt, ls.exp(), offset=off)
            loss.backward()
            outs.append((loss.detach(), img.grad, txt.grad, ls.grad, m["infonce"]))
        errs += [float((x - y).abs().max()) if torch.is_tensor(x) else abs(x - y) for x, y in zip(*outs)]
    return max(errs)


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

    from vlp.losses import diagnostics_from_logits, flatnce_loss, infonce_loss, siglip_loss

    params = [img, txt, log_scale, bias]

    def clear():
        for p in params:
            p.grad = None

    def local():
        return img[offset:offset + b], txt[offset:offset + b]

    if variant in ("infonce", "flatnce", "flatnce_t_infonce", "siglip", "flatnce_proposed",
                   "flatnce_t_infonce_proposed"):
        fn = {"infonce": infonce_loss, "flatnce": flatnce_loss, "flatnce_t_infonce": flatnce_loss,
              "siglip": siglip_loss, "flatnce_proposed": flatnce_proposed,
              "flatnce_t_infonce_proposed": flatnce_t_infonce_proposed}[variant]
        kw = {"scale_grad": "infonce" if "t_infonce" in variant else "same", "offset": offset}

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
    err = check_proposed()
    print(f"# flatnce_proposed / flatnce_t_infonce_proposed vs vlp flatnce_loss (scale_grad same / infonce): "
          f"max |diff| of value, grads, infonce = {err:.2e} (float64)")
    if err > 1e-9:
        raise AssertionError(f"flatnce_proposed disagrees with vlp flatnce_loss: {err}")
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
                         ("flatnce_proposed", "infonce"), ("flatnce_proposed", "flatnce"),
                         ("flatnce_t_infonce_proposed", "infonce"),
                         ("flatnce_t_infonce_proposed", "flatnce_t_infonce"),
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
