"""Image↔text retrieval: embed a paired eval set, then Recall@k and ranks.

Directions are named plainly:
  * image→text: each image is a query, all M captions are candidates; the correct items are the
    image's own captions (an image may have several).
  * text→image: each caption is a query, all N images are candidates; one correct item.

Rank convention (exact, ties included). Candidates are ordered like a *stable descending
argsort* of the query's scores: higher score first, equal scores in increasing candidate index.
The rank of a query is the 1-based position of its best correct item in that order, i.e. for the
first correct item p* in that order

    rank = #{j : s_j > s_p*} + #{j < p* : s_j == s_p*} + 1.

A query hits at k iff rank <= k (some correct item is in its top k). The chunked computation
below is therefore identical to `torch.sort(scores, descending=True, stable=True)` on the full
score matrix, while only ever holding one (chunk × candidates) block: memory O(chunk_size · M).
Scores are computed in float32 from the given embeddings; ties are ties of those float32 values.

Usage:
    img_emb, txt_emb, txt_to_img = embed_retrieval(model, loader, "cuda", precision="amp")
    metrics = retrieval_metrics(img_emb.cuda(), txt_emb.cuda(), txt_to_img.cuda())
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch
from tqdm import tqdm

from vlp.eval import keys

# ----------------------------------------------------------------------------- metrics (pure)

def ranks_of_best_positive(
    query_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    pos_query: torch.Tensor,
    pos_cand: torch.Tensor,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """1-based rank of each query's best positive under the stable-descending convention.

    query_emb [Q, d], cand_emb [C, d]; the correct (query, candidate) pairs are
    (pos_query[i], pos_cand[i]) (LongTensors on query_emb.device), sorted by pos_query. A query without any pair gets rank C + 1.
    Returns LongTensor[Q] on query_emb.device. Peak memory O(chunk_size · C + #pairs).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = query_emb.device
    cand_f = cand_emb.float()
    num_q, num_c = query_emb.shape[0], cand_emb.shape[0]
    cand_idx_c = torch.arange(num_c, device=device)
    ranks = torch.empty(num_q, dtype=torch.long, device=device)
    for start in range(0, num_q, chunk_size):
        stop = min(start + chunk_size, num_q)
        q = stop - start
        scores_qc = query_emb[start:stop].float() @ cand_f.T                          # [q, C]
        lo, hi = torch.searchsorted(pos_query, torch.tensor([start, stop], device=device)).tolist()
        row_p, col_p = pos_query[lo:hi] - start, pos_cand[lo:hi]                     # this chunk's pairs
        val_p = scores_qc[row_p, col_p]        # the very values of the score matrix (exact ties)
        # Best positive = highest score, lowest candidate index among equal scores, i.e. the
        # first positive of the stable descending order.
        best_val_q = torch.full((q,), float("-inf"), device=device).scatter_reduce(0, row_p, val_p, "amax")
        is_best_p = val_p == best_val_q[row_p]
        best_idx_q = torch.full((q,), num_c, device=device).scatter_reduce(
            0, row_p[is_best_p], col_p[is_best_p], "amin")
        best_q1, best_idx_q1 = best_val_q[:, None], best_idx_q[:, None]
        ranks[start:stop] = ((scores_qc > best_q1).sum(1)
                             + ((scores_qc == best_q1) & (cand_idx_c[None] < best_idx_q1)).sum(1) + 1)
    return ranks


def _check_inputs(img_emb, txt_emb, txt_to_img):
    if img_emb.ndim != 2 or txt_emb.ndim != 2 or img_emb.shape[1] != txt_emb.shape[1]:
        raise ValueError(f"need img_emb [N,d], txt_emb [M,d]; got {tuple(img_emb.shape)}, {tuple(txt_emb.shape)}")
    if txt_to_img.shape != (txt_emb.shape[0],):
        raise ValueError(f"txt_to_img must be [M]={txt_emb.shape[0]}, got {tuple(txt_to_img.shape)}")
    n = img_emb.shape[0]
    if txt_to_img.numel() and (int(txt_to_img.min()) < 0 or int(txt_to_img.max()) >= n):
        raise ValueError(f"txt_to_img values must lie in [0, {n})")
    missing = torch.ones(n, dtype=torch.bool, device=txt_to_img.device)
    missing[txt_to_img] = False
    if bool(missing.any()):
        raise ValueError(f"{int(missing.sum())} image(s) have no caption, e.g. image {int(missing.nonzero()[0])}")


def summarize_ranks(ranks: torch.Tensor, prefix: str, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """R@k (fraction of queries with rank <= k), mean rank, median rank (average of the two
    middle ranks when the count is even, like numpy.median) for one direction."""
    ranks_f = ranks.double().cpu()
    out = {keys.recall(prefix, k): float((ranks_f <= k).double().mean()) for k in ks}
    out[keys.mean_rank(prefix)] = float(ranks_f.mean())
    srt = ranks_f.sort().values
    n = srt.numel()
    out[keys.median_rank(prefix)] = float(srt[(n - 1) // 2] + srt[n // 2]) / 2.0
    return out


def retrieval_metrics(
    img_emb: torch.Tensor,
    txt_emb: torch.Tensor,
    txt_to_img: torch.Tensor,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 4096,
) -> dict[str, float]:
    """Recall@k, mean and median rank in both directions.

    img_emb [N, d], txt_emb [M, d] (L2-normalised, so scores are cosine similarities);
    txt_to_img LongTensor[M]: the image index of each caption (every image needs >= 1 caption).
    Keys: "image_to_text_R@{k}", "text_to_image_R@{k}", "{direction}_mean_rank",
    "{direction}_median_rank". Ranks are 1-based, ties as described in the module docstring.
    Runs on img_emb.device; never builds the full N×M matrix.
    """
    i2t_ranks, t2i_ranks = retrieval_ranks(img_emb, txt_emb, txt_to_img, chunk_size)
    return {**summarize_ranks(i2t_ranks, keys.IMAGE_TO_TEXT, ks), **summarize_ranks(t2i_ranks, keys.TEXT_TO_IMAGE, ks)}


def retrieval_ranks(img_emb: torch.Tensor, txt_emb: torch.Tensor, txt_to_img: torch.Tensor,
                    chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """1-based rank of the best positive of every image (image→text) and every caption
    (text→image), ties as in the module docstring; on img_emb.device."""
    txt_to_img = txt_to_img.to(device=img_emb.device, dtype=torch.long)
    txt_emb = txt_emb.to(img_emb.device)
    _check_inputs(img_emb, txt_emb, txt_to_img)
    # image→text pairs sorted by image (stable: captions keep their order); text→image: caption m
    # has the single positive txt_to_img[m].
    caption_idx_m = torch.arange(txt_emb.shape[0], device=img_emb.device)
    order_m = torch.sort(txt_to_img, stable=True).indices
    i2t = ranks_of_best_positive(img_emb, txt_emb, txt_to_img[order_m], caption_idx_m[order_m], chunk_size)
    t2i = ranks_of_best_positive(txt_emb, img_emb, caption_idx_m, txt_to_img, chunk_size)
    return i2t, t2i


def clip_benchmark_names(metrics: dict[str, float]) -> dict[str, float]:
    """Rename to CLIP_benchmark's keys: image_retrieval_recall@k is text→image (a caption
    retrieves images), text_retrieval_recall@k is image→text. Metrics without a CLIP_benchmark
    counterpart (ranks) are dropped. Classification keys (top1, top5, mean_per_class_recall) map
    to acc1, acc5, mean_per_class_recall."""
    out = {}
    for key, value in metrics.items():
        if key.startswith("text_to_image_R@"):
            out["image_retrieval_recall@" + key.rsplit("@", 1)[1]] = value
        elif key.startswith("image_to_text_R@"):
            out["text_retrieval_recall@" + key.rsplit("@", 1)[1]] = value
        elif key.startswith("top") and key[3:].isdigit():
            out["acc" + key[3:]] = value
        elif key == "mean_per_class_recall":
            out[key] = value
    return out


# ----------------------------------------------------------------------------- embedding

def trim_padding(model, tokens: torch.Tensor) -> torch.Tensor:
    """Drop all-padding token columns on the host where the model says it is exact (vlp's
    DualEncoder.trim_text); tokens of any other model pass unchanged."""
    trim = getattr(model, "trim_text", None)
    return trim(tokens) if trim is not None else tokens


def autocast_for(precision: str, device: torch.device | str):
    """Context manager for eval forward passes. precision: "fp32" (no autocast), "amp"
    (fp16 on CUDA, bf16 elsewhere), "amp_bf16", "amp_fp16"."""
    device_type = torch.device(device).type
    if precision == "fp32":
        return contextlib.nullcontext()
    dtypes = {"amp": torch.float16 if device_type == "cuda" else torch.bfloat16,
              "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}
    if precision not in dtypes:
        raise ValueError(f"precision must be one of fp32, {', '.join(dtypes)}; got {precision!r}")
    return torch.autocast(device_type=device_type, dtype=dtypes[precision])


def _captions_of(text, batch_size: int) -> list[torch.Tensor]:
    """Per-sample caption token tensors [K_i, L] from a batch's "text" field, which may be
    LongTensor[B, L] (one caption each), LongTensor[B, K, L] (K each) or a list of [K_i, L]/[L]."""
    if isinstance(text, torch.Tensor):
        if text.ndim == 2:
            return [t[None] for t in text]
        if text.ndim == 3:
            return list(text)
        raise ValueError(f"batch['text'] tensor must be [B,L] or [B,K,L], got {tuple(text.shape)}")
    caps = [t if t.ndim == 2 else t[None] for t in text]
    if len(caps) != batch_size:
        raise ValueError(f"batch['text'] has {len(caps)} entries for {batch_size} images")
    return caps


@torch.no_grad()
def embed_retrieval(
    model,
    loader: Iterable[dict],
    device: torch.device | str,
    *,
    precision: str = "fp32",
    show_progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embed a paired eval set. Returns (img_emb [N,d], txt_emb [M,d], txt_to_img [M]) on CPU, fp32.

    loader yields dicts {"image": [B,3,H,W], "text": tokens, "key": list[str] (optional)}.
    Images are identified by key: a key seen before (in any batch) is not re-embedded, its
    captions are attached to the first image with that key. Without "key" every row is its own
    image. "text" may carry one or several captions per row (see _captions_of).
    Calls model.encode_image / encode_text(..., normalize=True) (open_clip API).
    """
    device = torch.device(device)
    key_to_img: dict[str, int] = {}
    img_chunks, txt_chunks, txt_to_img = [], [], []
    rows_seen = 0
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for batch in tqdm(loader, desc="embed retrieval", unit="batch", disable=not show_progress):
            images = batch["image"]
            b = images.shape[0]
            keys = list(batch["key"]) if batch.get("key") is not None else [f"#row{rows_seen + i}" for i in range(b)]
            rows_seen += b
            captions = _captions_of(batch["text"], b)
            new_rows, owner = [], []
            for key in keys:
                if key not in key_to_img:
                    key_to_img[key] = len(key_to_img)
                    new_rows.append(len(owner))
                owner.append(key_to_img[key])
            with autocast_for(precision, device):
                if new_rows:
                    x = images[new_rows].to(device, non_blocking=True)
                    img_chunks.append(model.encode_image(x, normalize=True).float().cpu())
                tokens = trim_padding(model, torch.cat(captions)).to(device, non_blocking=True)
                txt_chunks.append(model.encode_text(tokens, normalize=True).float().cpu())
            for img_idx, caps in zip(owner, captions):
                txt_to_img.extend([img_idx] * caps.shape[0])
    finally:
        model.train(was_training)
    if not img_chunks:
        raise ValueError("retrieval loader yielded no samples")
    return torch.cat(img_chunks), torch.cat(txt_chunks), torch.tensor(txt_to_img, dtype=torch.long)
