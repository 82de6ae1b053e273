"""Is the crop-first JPEG decode (the default train path) the same augmentation as the plain one?

    OMP_NUM_THREADS=1 python bench/augment_equivalence.py            # ~400 images, ~1 min
    OMP_NUM_THREADS=1 python bench/augment_equivalence.py --quick    # ~60 images, seconds

Transform: open_clip.image_transform(224, is_train=True) (RandomResizedCrop(224, scale=(0.9, 1),
bicubic) + ToTensor + Normalize). Images, all JPEG quality 90 (4:2:0 chroma, PIL's default):
OpenMoji glyphs rendered at 512 px (flat colours and hard edges: the hard case for a DCT-domain
downscale), and smooth colour gradients + Gaussian noise (photo-like entropy) at 256 px (DCT
scale 1: must be exact), 384x288, 512, 800x600, 1024x768 and 2560x1920 px (scales 1 to 8).

Per image and trial, the same torch seed is set before each path:
  plain  decode the whole JPEG, then the transform  (vlp.data.decode.PlainDecoder)
  fast   box from the header size, decode at DCT scale 1/s, resample the box (CropFirst)
  other  the plain path under a different seed (another crop of the same image): the size of
         the augmentation's own variation, the yardstick for the fast-vs-plain difference
  draft  the old data.decode_size=224 path (whole image DCT-downscaled, box drawn on it)

(a) boxes: CropFirst's box == RandomResizedCrop.get_params on the fully decoded image under
    the same seed, and the torch RNG state after the whole transform is equal (exact counts).
(b) pixels, in [0, 1] units (Normalize undone): per-image mean |fast - plain|, max |.|, PSNR.
(c) distributions: per image and channel, the output's mean, std and mean gradient magnitude
    (sharpness). Paired: mean relative difference fast vs plain. Unpaired: two-sample KS of
    fast (seed A) against plain (seed B) per-image channel means / stds / sharpness, next to
    plain (seed A) against plain (seed B), which is what two equal distributions give here.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import figure, header, pin_threads, synthetic_jpeg_pairs  # noqa: E402

NOISE_SIZES = [(256, 256, 40), (384, 288, 40), (512, 512, 80), (800, 600, 40), (1024, 768, 30),
               (2560, 1920, 10)]  # (width, height, count)


def jpeg(image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def openmoji_jpegs(count: int, size: int = 512):
    """``count`` OpenMoji glyphs spread over the candidate list, rendered at ``size`` px."""
    from vlp.data.sources import openmoji

    renderer = openmoji.Renderer(size)
    candidates = openmoji.candidate_emojis()
    step = max(1, len(candidates) // (2 * count))
    out = []
    for chars, _ in candidates[::step]:
        image = renderer.render(chars)
        if image is not None:
            out.append(jpeg(image))
        if len(out) == count:
            break
    return out


def noise_jpegs(width: int, height: int, count: int, seed: int):
    from PIL import Image

    side = max(width, height)
    out = []
    for pair in synthetic_jpeg_pairs(count, size=side, seed=seed):
        with Image.open(io.BytesIO(pair["image"])) as image:
            out.append(jpeg(image.convert("RGB").crop((0, 0, width, height))))
    return out


def photo_jpegs(count: int, seed: int = 0):
    """The one real photo on hand (matplotlib's grace_hopper.jpg, 512x600, camera JPEG) as is,
    then random crops of it (280..512 px) re-encoded, some scaled to 1.5x or 2x (smooth)
    ([] when matplotlib's sample data are missing)."""
    import random

    from PIL import Image

    try:
        from matplotlib import cbook

        path = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
        original = Path(path).read_bytes()
    except Exception:  # optional: matplotlib or its sample data may be absent
        return []
    rng = random.Random(seed)
    photo = Image.open(io.BytesIO(original)).convert("RGB")
    out = [original]
    while len(out) < count:
        w, h = rng.randint(280, 512), rng.randint(280, 512)
        x, y = rng.randint(0, 512 - w), rng.randint(0, 600 - h)
        crop = photo.crop((x, y, x + w, y + h))
        zoom = rng.choice((1, 1, 1.5, 2))
        if zoom > 1:
            crop = crop.resize((round(w * zoom), round(h * zoom)), Image.Resampling.BICUBIC)
        out.append(jpeg(crop))
    return out


def groups(quick: bool) -> dict[str, list[bytes]]:
    scale = 0.15 if quick else 1.0
    out = {"openmoji 512": openmoji_jpegs(max(8, int(120 * scale)))}
    photos = photo_jpegs(max(6, int(60 * scale)))
    if photos:
        out["photo crops"] = photos
    for k, (w, h, n) in enumerate(NOISE_SIZES):
        out[f"noise {w}x{h}"] = noise_jpegs(w, h, max(2, int(n * scale)), seed=100 + k)
    return out


def ks(a, b) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D and its asymptotic p-value."""
    import numpy as np

    a, b = np.sort(np.asarray(a)), np.sort(np.asarray(b))
    grid = np.concatenate([a, b])
    d = float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a)
                            - np.searchsorted(b, grid, "right") / len(b))))
    ne = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    if lam < 0.2:  # the series below converges too slowly there; Q_KS(0.2) = 1 - 1e-20
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


class Paths:
    """The four ways to turn bytes into a [0, 1] crop (Normalize undone)."""

    def __init__(self, transform):
        import torch

        from vlp.data.decode import CropFirst, PlainDecoder

        self.transform = transform
        self.plain, self.fast = PlainDecoder(transform), CropFirst.of(transform)
        self.draft = PlainDecoder(transform, decode_size=224)
        norm = transform.transforms[-1]
        self.mean = torch.tensor(norm.mean).view(3, 1, 1)
        self.std = torch.tensor(norm.std).view(3, 1, 1)

    def run(self, decoder, data: bytes, seed: int):
        """(output in [0, 1], RNG state after, decoded object)."""
        import torch

        torch.manual_seed(seed)
        decoded = decoder.decode(data)
        out = decoder.finish(decoded) * self.std + self.mean
        return out, torch.get_rng_state(), decoded

    def box_matches(self, data: bytes, seed: int) -> bool:
        """CropFirst's box equals get_params on the fully decoded image (same seed)."""
        import torch
        from PIL import Image

        crop = self.fast.crop
        torch.manual_seed(seed)
        full = Image.open(io.BytesIO(data)).convert("RGB")
        expected = crop.get_params(full, crop.scale, crop.ratio)
        torch.manual_seed(seed)
        return self.fast.decode(data)[2] == expected


def image_stats(x):
    """Per-channel mean, std and mean gradient magnitude of a [3, H, W] image."""
    gx = (x[:, :, 1:] - x[:, :, :-1]).abs().mean((1, 2))
    gy = (x[:, 1:, :] - x[:, :-1, :]).abs().mean((1, 2))
    return x.mean((1, 2)), x.std((1, 2)), (gx + gy) / 2


def measure(paths: Paths, images: list[bytes], trials: int, seed0: int) -> dict:
    import torch

    rows = {k: [] for k in ("scale", "box_ok", "rng_ok", "mad", "max", "psnr", "mad_other",
                            "mad_draft", "dmean", "rstd", "rsharp", "rsharp_draft", "rsharp_other")}
    stats = {k: [] for k in ("fast", "plain", "other")}
    for n, data in enumerate(images):
        for t in range(trials):
            seed, other_seed = seed0 + 1000 * n + t, seed0 + 1000 * n + t + 500
            plain, rng_plain, _ = paths.run(paths.plain, data, seed)
            fast, rng_fast, decoded = paths.run(paths.fast, data, seed)
            other, _, _ = paths.run(paths.plain, data, other_seed)
            draft, _, _ = paths.run(paths.draft, data, seed)
            rows["scale"].append(decoded[1])
            rows["box_ok"].append(paths.box_matches(data, seed))
            rows["rng_ok"].append(torch.equal(rng_plain, rng_fast))
            diff = (fast - plain).abs()
            mse = float((diff ** 2).mean())
            rows["mad"].append(float(diff.mean()))
            rows["max"].append(float(diff.max()))
            rows["psnr"].append(10 * math.log10(1 / mse) if mse > 0 else float("inf"))
            rows["mad_other"].append(float((other - plain).abs().mean()))
            rows["mad_draft"].append(float((draft - plain).abs().mean()))
            sf, sp, so, sd = (image_stats(x) for x in (fast, plain, other, draft))
            rows["dmean"] += (sf[0] - sp[0]).tolist()
            rows["rstd"] += (sf[1] / sp[1] - 1).tolist()
            rows["rsharp"] += (sf[2] / sp[2] - 1).tolist()
            rows["rsharp_draft"] += (sd[2] / sp[2] - 1).tolist()
            rows["rsharp_other"] += (so[2] / sp[2] - 1).abs().tolist()
            stats["fast"].append(sf)
            stats["plain"].append(sp)
            stats["other"].append(so)
    return {"rows": rows, "stats": stats}


def main(argv=None) -> None:
    import numpy as np
    import open_clip

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=2, help="crops per image")
    args = ap.parse_args(argv)
    pin_threads()
    header("augmentation equivalence: crop-first DCT-scaled JPEG decode vs full decode")
    paths = Paths(open_clip.image_transform(224, is_train=True))
    print(f"# transform: {paths.transform.transforms[0]}")
    data = groups(args.quick)
    print(f"\n{'group':18s} {'n':>4s} {'scales':>14s} {'box=':>5s} {'rng=':>5s} "
          f"{'mean|d|':>8s} {'p95':>7s} {'max|d|':>7s} {'PSNR med':>8s} {'min':>6s} "
          f"{'other':>7s} {'draft':>7s} {'dmean':>8s} {'dstd%':>6s} {'dsharp%':>7s} {'draft%':>7s} "
          f"{'|other%|':>8s} {'KSp sharp':>9s} {'ref':>5s}")
    all_rows, all_stats = {}, {"fast": [], "plain": [], "other": []}
    for g, (name, images) in enumerate(data.items()):
        res = measure(paths, images, args.trials, seed0=10_000 * g)
        r = res["rows"]
        for k, v in r.items():
            all_rows.setdefault(k, []).extend(v)
        for k in all_stats:
            all_stats[k] += res["stats"][k]
        scales = {s: r["scale"].count(s) for s in sorted(set(r["scale"]))}
        mad = np.array(r["mad"])
        # one value per crop (channels averaged: they are not independent samples)
        crop_sharp = {k: np.stack([x[2].numpy() for x in res["stats"][k]]).mean(1) for k in res["stats"]}
        _, p_sharp = ks(crop_sharp["fast"], crop_sharp["other"])
        _, p_ref = ks(crop_sharp["plain"], crop_sharp["other"])
        print(f"{name:18s} {len(mad):4d} {' '.join(f'{s}:{c}' for s, c in scales.items()):>14s} "
              f"{sum(r['box_ok'])/len(mad):5.0%} {sum(r['rng_ok'])/len(mad):5.0%} "
              f"{np.median(mad):8.5f} {np.percentile(mad, 95):7.5f} {max(r['max']):7.4f} "
              f"{np.median(r['psnr']):8.1f} {min(r['psnr']):6.1f} "
              f"{np.median(r['mad_other']):7.4f} {np.median(r['mad_draft']):7.4f} "
              f"{np.mean(r['dmean']):+8.5f} {100 * np.mean(r['rstd']):+6.2f} "
              f"{100 * np.mean(r['rsharp']):+7.2f} {100 * np.mean(r['rsharp_draft']):+7.2f} "
              f"{100 * np.mean(r['rsharp_other']):8.2f} {p_sharp:9.3f} {p_ref:5.3f}", flush=True)
    print("\ncolumns: scales = DCT scale s: count; box= / rng= share of identical crop boxes / equal "
          "RNG state after the transform; mean|d| = per-image mean |fast - plain| in [0,1] units "
          "(median, p95); max|d| = largest single-pixel difference; PSNR (dB) median and min; "
          "other = median mean|d| between two plain crops (different seeds) of the same image; "
          "draft = median mean|d| of the old decode_size=224 path vs plain (its boxes differ); "
          "dmean = mean per-channel mean difference; dstd%, dsharp% = mean relative change of "
          "per-channel std and gradient magnitude, fast (draft%: decode_size=224) vs plain; "
          "|other%| = mean |relative change| of gradient magnitude between two plain crops; "
          "KSp sharp = KS p-value of per-crop gradient magnitudes (channel mean), fast (seed A) vs "
          "plain (seed B); ref = the same for plain (seed A) vs plain (seed B)")

    r = all_rows
    n = len(r["mad"])
    boxes_equal = sum(r["box_ok"]) == n and sum(r["rng_ok"]) == n
    print(f"\n## overall ({n} crops of {sum(len(v) for v in data.values())} images)")
    figure("augment_box_identical", sum(r["box_ok"]) / n, "share", "exact: same seed -> same box")
    figure("augment_rng_identical", sum(r["rng_ok"]) / n, "share")
    figure("augment_mean_abs_diff", float(np.median(r["mad"])), "[0,1]",
           f"median; p95 {np.percentile(r['mad'], 95):.5f}; max {max(r['mad']):.5f}")
    figure("augment_mean_abs_diff_other_crop", float(np.median(r["mad_other"])), "[0,1]",
           "two plain crops of one image (the augmentation's own spread)")
    figure("augment_max_abs_diff", max(r["max"]), "[0,1]")
    figure("augment_psnr_median", float(np.median(r["psnr"])), "dB", f"min {min(r['psnr']):.1f} dB")
    figure("augment_sharpness_change", 100 * float(np.mean(r["rsharp"])), "%",
           f"decode_size=224 path: {100 * float(np.mean(r['rsharp_draft'])):+.2f} %; two plain crops "
           f"differ by {100 * float(np.mean(r['rsharp_other'])):.2f} % (mean |.|)")
    for label, idx in (("mean", 0), ("std", 1), ("sharpness", 2)):
        fast = np.stack([s[idx].numpy() for s in all_stats["fast"]])
        plain = np.stack([s[idx].numpy() for s in all_stats["plain"]])
        other = np.stack([s[idx].numpy() for s in all_stats["other"]])
        for c, ch in enumerate("RGB"):
            d, p = ks(fast[:, c], other[:, c])
            d0, p0 = ks(plain[:, c], other[:, c])
            print(f"  KS per-image {label} {ch}: fast(seed A) vs plain(seed B) D={d:.4f} p={p:.3f}   "
                  f"plain(seed A) vs plain(seed B) D={d0:.4f} p={p0:.3f}")
        d, p = ks(fast.mean(1), other.mean(1))  # one value per crop: channels are not independent
        d0, p0 = ks(plain.mean(1), other.mean(1))
        figure(f"augment_ks_p_channel_{label}", p, "",
               f"D={d:.4f}, fast vs plain, other crops, channel mean; plain vs plain D={d0:.4f} p={p0:.3f}")
    print(f"\nboxes identical for every crop: {boxes_equal}")


if __name__ == "__main__":
    main()
