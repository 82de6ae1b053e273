"""The locked-tower feature cache (LiT): the frozen stems' outputs, computed once per sample.

In LiT the stems (vlp.models.cached) give every sample the same output in every epoch; with
`data.feature_cache` set, the trainer computes them once and each step runs only the heads
(docs/design.md, "Locked-tower feature cache"):

    cache = training_features(cfg, model, transform, tokenizer, data.loader.plan, device)
    image_bd, text_bd = cache.lookup(batch["sample_id"])      # a never-cached id raises
    img_feat, txt_feat, txt_to_img = retrieval_features(model, tok, tf, "eval/{0..3}.tar", "cpu", 128)
    img_emb, txt_emb = embed_features(model, img_feat, txt_feat)   # normalized heads

A cached run gives the losses and weights of the uncached run with data.train_transform=eval
(tests/train/test_feature_cache.py): the cache is built from every training shard once, in
order, decoded and transformed as the stream would, the stems run under no_grad in eval mode,
in batches of eval.batch_size, in fp32. A sample whose image does not decode is never cached.

The key (sha256) covers a format version, the stems' parameters and buffers, the image
transform, data.decode_size, the tokenizer, the batch size the stems ran at, and the shards
(paths and sizes; size and mtime of local files): anything else changing gives another key.

Where it lives: a process-level memo (key -> tensors); with a folder, also `<folder>/<key>.pt`,
written atomically and loaded by later runs and other processes (unreadable or mismatched: one
note line, rebuilt). Several processes: with a folder, the main process builds and writes while
the others wait at a barrier (so the build must fit in train.dist_timeout_s) and load the file;
with "memory" every rank builds its own copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from vlp.distributed import barrier, is_main
from vlp.models.cached import TowerSplit, check_cacheable

FORMAT = 1  # bump when what a cache file holds, or how it is computed, changes
_MEMO: dict[str, dict[str, torch.Tensor]] = {}  # key -> tensors, for every run of this process


@dataclass(frozen=True)
class FeatureCache:
    """Stem outputs of every training sample, indexed by the stream's sample id."""

    key: str
    image: torch.Tensor  # (N, d_image_stem) fp32
    text: torch.Tensor  # (N, d_text_stem) fp32
    valid: torch.Tensor  # (N,) bool: the sample was cached

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(image (b, Di), text (b, Dt)) of sample ids (b,); an id never cached is one ValueError
        line (never zeros)."""
        n = len(self.valid)
        bad = (ids < 0) | (ids >= n)
        if not bool(bad.any()):
            bad = ~self.valid[ids]
        if bool(bad.any()):
            raise ValueError(f"feature cache {self.key[:12]}: sample id {int(ids[bad][0])} was never cached "
                             f"(of {n}; its image did not decode when the cache was built, or the shards changed)")
        return self.image[ids], self.text[ids]


# ----------------------------------------------------------------------------- key

def _hash_tensors(h, clip: torch.nn.Module, names: tuple[str, ...]) -> None:
    tensors = {**dict(clip.named_parameters()), **dict(clip.named_buffers())}
    for name in names:
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def tokenizer_id(tokenizer) -> dict:
    """What makes a tokenizer's output: its type, scalar settings (context length, ...), and a
    digest of its vocabulary (HF) or encoder table (open_clip's SimpleTokenizer)."""
    plain = {k: v for k, v in sorted(vars(tokenizer).items()) if isinstance(v, (str, int, float, bool, type(None)))}
    inner = getattr(tokenizer, "tokenizer", None)
    vocab = inner.get_vocab() if hasattr(inner, "get_vocab") else getattr(tokenizer, "encoder", None)
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), default=str).encode()).hexdigest() if vocab else None
    return {"type": type(tokenizer).__name__, "settings": plain, "vocab": digest,
            "context_length": getattr(tokenizer, "context_length", None)}


def shards_id(paths: list[str], sizes: Optional[list[int]] = None) -> list:
    """[path, size in the plan, (file size, mtime_ns) of a local file] per shard."""
    out = []
    for i, path in enumerate(paths):
        stat = os.stat(path) if os.path.isfile(path) else None
        out.append([str(path), None if sizes is None else int(sizes[i]),
                    None if stat is None else [stat.st_size, stat.st_mtime_ns]])
    return out


def cache_key(model, splits: tuple[TowerSplit, TowerSplit], what: str, transform, tokenizer, shards: list,
              batch_size: int, decode_size: Optional[int] = None) -> str:
    """The sha256 (hex) naming one cache: see the module docstring for what it covers."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "what": what, "stems": [s.kind for s in splits],
                         "transform": repr(transform), "preprocess": dict(getattr(model, "preprocess", {})),
                         "decode_size": decode_size, "tokenizer": tokenizer_id(tokenizer), "shards": shards,
                         "batch_size": int(batch_size)}, sort_keys=True, default=str).encode())
    for split in splits:
        _hash_tensors(h, model.clip, split.tensor_names)
    return h.hexdigest()


# ----------------------------------------------------------------------------- computing

@contextlib.contextmanager
def _eval_mode(model):
    """The model in eval mode (BatchNorm statistics, no dropout) and no grad, then as it was."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _stems(model, splits, images: list[torch.Tensor], captions: list[str], tokenizer, device):
    """(image stem (b, Di), text stem (b, Dt)) on the CPU in fp32, for one batch."""
    image_split, text_split = splits
    tokens = model.trim_text(tokenizer(captions))  # exact for a tower that takes it (DualEncoder)
    img = image_split.stem(torch.stack(images).to(device)).float().cpu()
    txt = text_split.stem(tokens.to(device)).float().cpu()
    return img, txt


def build_training_tensors(model, transform, tokenizer, plan, batch_size: int, device,
                           decode_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """{"image", "text", "valid"} over every sample of the plan's shards, read once in order
    (read_shard, check_sample, the stream's decoder and `transform`), rows = plan.sample_id."""
    from vlp.data.decode import image_decoder
    from vlp.data.tars import check_sample, read_shard

    splits = check_cacheable(model)
    n = sum(plan.sizes)
    decoder = image_decoder(transform, decode_size)
    out: dict[str, torch.Tensor] = {"valid": torch.zeros(n, dtype=torch.bool)}
    rows: list[int] = []
    images: list[torch.Tensor] = []
    captions: list[str] = []

    def flush() -> None:
        if not rows:
            return
        img, txt = _stems(model, splits, images, captions, tokenizer, device)
        if "image" not in out:
            out["image"], out["text"] = torch.zeros(n, img.shape[1]), torch.zeros(n, txt.shape[1])
        ids = torch.tensor(rows, dtype=torch.int64)
        out["image"][ids], out["text"][ids], out["valid"][ids] = img, txt, True
        rows.clear(), images.clear(), captions.clear()

    with _eval_mode(model):
        for shard, path in enumerate(plan.paths):
            for index, key, members in read_shard(path, 0, plan.sizes[shard], Counter(), retry=plan.retry):
                sample = check_sample(key, members, path)
                if isinstance(sample, str):
                    continue
                try:
                    image = decoder.decode(sample[1])
                except Exception:  # noqa: BLE001  (as the stream: it replaces this sample, never yields it)
                    continue
                rows.append(plan.sample_id(shard, index))
                images.append(decoder.finish(image))
                captions.append(sample[2])
                if len(rows) == batch_size:
                    flush()
        flush()
    if "image" not in out:
        raise ValueError(f"feature cache: no usable sample in {plan.paths[:3]}")
    return out


# ----------------------------------------------------------------------------- where it lives

def _note(line: str) -> None:
    if is_main():
        print(f"[vlp] feature cache: {line}", flush=True)


def _load(path: Path, key: str, names: tuple[str, ...], rebuild: bool) -> Optional[dict]:
    """The tensors of a cache file, or (rebuild) None with a note when it is unreadable or not
    this key's; without rebuild that is one ValueError line."""
    from vlp.util import first_line

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        why = ("not a feature cache" if not isinstance(state, dict) else
               f"format {state.get('format')}, not {FORMAT}" if state.get("format") != FORMAT else
               "another key" if state.get("key") != key else
               "tensors missing" if not all(isinstance(state.get(k), torch.Tensor) for k in names) else "")
    except Exception as e:  # noqa: BLE001  (zip, unpickling, truncation errors)
        why = first_line(e)[:200]
    if not why:
        return {k: state[k] for k in names}
    if not rebuild:
        raise ValueError(f"feature cache {path} is unreadable ({why})")
    print(f"vlp: note: feature cache {path} is unreadable ({why}): rebuilding it", file=sys.stderr, flush=True)
    return None


def _write(path: Path, key: str, tensors: dict) -> None:
    from vlp.util import atomic_write

    atomic_write(path, lambda f: torch.save({"format": FORMAT, "key": key, **tensors}, f))


def obtain(key: str, folder: Optional[str], build: Callable[[], dict], names: tuple[str, ...],
           collective: bool, what: str) -> dict[str, torch.Tensor]:
    """The tensors of cache `key`: from this process's memo, else `folder`'s file, else built
    (and written to `folder`). collective: every rank calls it; with a folder the main process
    builds and the others load after a barrier."""
    if key in _MEMO:
        _note(f"{what}: reused from memory ({key[:12]})")
        return _MEMO[key]
    path = Path(folder, f"{key}.pt") if folder else None
    tensors = None
    if path is None or is_main() or not collective:
        if path is not None and path.exists():
            tensors = _load(path, key, names, rebuild=True)
            if tensors is not None:
                _note(f"{what}: reused {path}")
        if tensors is None:
            t0 = time.perf_counter()
            tensors = build()
            rows = len(tensors[names[0]])
            _note(f"{what}: built {rows} samples in {time.perf_counter() - t0:.1f} s ({path or 'in memory'})")
            if path is not None:
                _write(path, key, tensors)
    if collective and path is not None:
        barrier()
        if tensors is None:  # another process built it
            tensors = _load(path, key, names, rebuild=False)
    _MEMO[key] = tensors
    return tensors


# ----------------------------------------------------------------------------- entry points
def build_caches(cfg, specs: dict, acc) -> None:
    """A config's caches built ahead of its runs: its training shards' stem outputs (every rank)
    and its eval sets' (``specs``: {split: shard spec}; main process)."""
    from vlp.data.train_data import TrainData  # heavy (the loader), as the model below
    from vlp.models.model import build_model

    model, tokenizer, transform, eval_t = build_model(cfg.model, cfg.loss, data_cfg=cfg.data)
    plan = TrainData(cfg, transform, tokenizer, acc.process_index, acc.num_processes).loader.plan
    training_features(cfg, model, transform, tokenizer, plan, acc.device)  # collective: every rank
    if acc.is_main_process:
        folder = None if cfg.data.feature_cache == "memory" else cfg.data.feature_cache
        for spec in specs.values():
            retrieval_features(model, tokenizer, eval_t, spec, acc.device, cfg.eval.batch_size, folder)
    acc.wait_for_everyone()


def training_features(cfg, model, transform, tokenizer, plan, device) -> FeatureCache:
    """The training cache of `cfg.data.feature_cache` ("memory" or a folder) for the stream's
    `plan` (TrainData.loader.plan); moves `model` to `device` to run the stems there. Every rank
    calls it (see the module docstring)."""
    model.to(device)
    splits = check_cacheable(model)
    d = cfg.data
    key = cache_key(model, splits, "train", transform, tokenizer, shards_id(plan.paths, plan.sizes),
                    cfg.eval.batch_size, d.decode_size)
    folder = None if d.feature_cache == "memory" else d.feature_cache
    tensors = obtain(key, folder, lambda: build_training_tensors(
        model, transform, tokenizer, plan, cfg.eval.batch_size, device, d.decode_size),
        ("image", "text", "valid"), collective=True, what="training")
    return FeatureCache(key, tensors["image"], tensors["text"], tensors["valid"])


class _StemOutputs:
    """Stands in for the model in vlp.eval.suite.embed_retrieval_shards: encode_image / encode_text
    return the stems' outputs (whatever `normalize` says), so the one eval reader decides the
    images, captions, order and keys."""

    training = False

    def __init__(self, model, splits: tuple[TowerSplit, TowerSplit]):
        self.trim_text = model.trim_text  # the same tokens as the real model's eval
        self.splits = splits

    def eval(self) -> "_StemOutputs":
        return self

    def train(self, mode: bool = True) -> "_StemOutputs":
        return self

    def encode_image(self, x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.splits[0].stem(x)

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.splits[1].stem(tokens)


def retrieval_features(model, tokenizer, transform, spec: str, device, batch_size: int,
                       cache: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(img_feat (N, Di), txt_feat (M, Dt), txt_to_img (M,)): the stems' outputs over a retrieval
    shard set as vlp.eval.suite.embed_retrieval_shards reads it; memoized per key in this process,
    and in the folder `cache` when given. Heads on top: `embed_features`."""
    from vlp.eval.datasets import expand_shards
    from vlp.eval.suite import embed_retrieval_shards

    splits = check_cacheable(model)
    key = cache_key(model, splits, "retrieval", transform, tokenizer, shards_id(expand_shards(spec)), batch_size)

    def build() -> dict:
        with _eval_mode(model):
            img, txt, txt_to_img = embed_retrieval_shards(_StemOutputs(model, splits), tokenizer, transform, spec,
                                                          device, batch_size)
        return {"image": img, "text": txt, "txt_to_img": txt_to_img}

    t = obtain(key, cache, build, ("image", "text", "txt_to_img"), collective=False, what="retrieval")
    return t["image"], t["text"], t["txt_to_img"]


def embed_features(model, img_feat: torch.Tensor, txt_feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(img_emb (N, d), txt_emb (M, d)) on the CPU: the model's normalized heads over stem
    outputs (DualEncoder.forward(features=True)), in eval mode."""
    device = next(model.parameters()).device
    with _eval_mode(model):
        out = model(img_feat.to(device), txt_feat.to(device), features=True)
    return out.image_emb.float().cpu(), out.text_emb.float().cpu()
