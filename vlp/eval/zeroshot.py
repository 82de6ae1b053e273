"""Zero-shot classification: a classifier from class names × prompt templates, and its metrics.

Classifier (CLIP's prompt ensembling): for each class embed every template, L2-normalise, average over
templates, L2-normalise again; columns of a [d, C] matrix. Same numbers as
`open_clip.build_zero_shot_classifier`. Logits = image_emb @ classifier (no ×100: a positive scale
changes no rank).

Tie convention (shared with vlp.eval.retrieval): classes are ordered by descending logit, equal
logits by increasing class index (a stable descending argsort). The target's rank is its
1-based position in that order; top-k hits iff rank <= k; the prediction for mean per-class
recall is the rank-1 class. Without ties this equals `logits.topk(k)`.

Usage:
    clf_dc = build_classifier(model, tokenizer, classnames, load_templates("openai"), "cuda")
    metrics = zeroshot_classify(model, clf_dc, loader, "cuda")   # {"top1", "top5", ...}
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence, Union

import torch
from tqdm import tqdm

from vlp.eval.retrieval import autocast_for, trim_padding

Template = Union[str, Callable[[str], str]]


# ----------------------------------------------------------------------------- templates

def load_templates(spec: Union[str, Sequence[Template]]) -> list[Template]:
    """"openai" (open_clip's 80 OPENAI_IMAGENET_TEMPLATES), "simple" (its 7
    SIMPLE_IMAGENET_TEMPLATES), a path to a text file (one template per line, each containing
    "{}" or "{c}"; blank lines and lines starting with # ignored), or a list used as is."""
    from open_clip import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    if not isinstance(spec, str):
        templates = list(spec)
    elif spec == "openai":
        templates = list(OPENAI_IMAGENET_TEMPLATES)
    elif spec == "simple":
        templates = list(SIMPLE_IMAGENET_TEMPLATES)
    elif os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            templates = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    else:
        raise ValueError(f"templates must be 'openai', 'simple', a file or a list; got {spec!r}")
    if not templates:
        raise ValueError(f"no templates in {spec!r}")
    for t in templates:
        if isinstance(t, str) and "{}" not in t and "{c}" not in t:
            raise ValueError(f"template {t!r} has no '{{}}' or '{{c}}' placeholder")
    return templates


def fill_template(template: Template, classname: str) -> str:
    """A callable is called; a string has "{c}" and "{}" replaced (replace, not format, so other
    braces in a template are kept literally)."""
    if callable(template):
        return template(classname)
    return template.replace("{c}", classname).replace("{}", classname)


# ----------------------------------------------------------------------------- classifier

@torch.no_grad()
def build_classifier(
    model,
    tokenizer,
    classnames: Sequence[str],
    templates: Union[str, Sequence[Template]],
    device: torch.device | str,
    batch_size: int = 10,
    precision: str = "fp32",
    show_progress: bool = False,
) -> torch.Tensor:
    """Zero-shot classifier [d, C] (fp32, on device). templates: a list, or a spec for
    load_templates ("openai", "simple", a file). batch_size = classes per text forward
    (batch_size × len(templates) prompts each)."""
    if isinstance(templates, str):
        templates = load_templates(templates)
    if not classnames or not templates:
        raise ValueError("need at least one class name and one template")
    n_tpl = len(templates)
    columns = []
    starts = range(0, len(classnames), batch_size)
    for start in tqdm(starts, desc="zero-shot classifier", disable=not show_progress):
        names = classnames[start:start + batch_size]
        prompts = [fill_template(t, c) for c in names for t in templates]
        tokens = trim_padding(model, tokenizer(prompts)).to(device)
        with autocast_for(precision, device):
            emb_pd = model.encode_text(tokens, normalize=True).float()        # [c·T, d]
        emb_cd = emb_pd.reshape(len(names), n_tpl, -1).mean(dim=1)             # [c, d]
        columns.append((emb_cd / emb_cd.norm(dim=1, keepdim=True)).T)          # [d, c]
    return torch.cat(columns, dim=1)


# ----------------------------------------------------------------------------- metrics (pure)

def target_ranks(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """1-based rank of the target class per row of logits [N, C] (ties: lower index first)."""
    targets = targets.to(logits.device).long()
    t_logit_n1 = logits.gather(1, targets[:, None])
    cls_idx_c = torch.arange(logits.shape[1], device=logits.device)
    ahead_nc = (logits > t_logit_n1) | ((logits == t_logit_n1) & (cls_idx_c[None] < targets[:, None]))
    return ahead_nc.sum(dim=1) + 1


def predictions(logits: torch.Tensor) -> torch.Tensor:
    """Rank-1 class per row: the max logit, lowest index among equal maxima."""
    return logits.argmax(dim=1)


def accuracy_from_ranks(ranks: torch.Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    return {f"top{k}": float((ranks <= k).double().mean()) for k in ks}


def recall_from_predictions(preds: torch.Tensor, targets: torch.Tensor, num_classes: int) -> float:
    """Mean over classes present in targets of (#correct / #samples) — sklearn's
    balanced_accuracy_score, as used by CLIP_benchmark."""
    preds, targets = preds.cpu().long(), targets.cpu().long()
    count_c = torch.bincount(targets, minlength=num_classes).double()
    correct_c = torch.bincount(targets[preds == targets], minlength=num_classes).double()
    present = count_c > 0
    return float((correct_c[present] / count_c[present]).mean())


# ----------------------------------------------------------------------------- evaluation

def _unpack(batch):
    if isinstance(batch, dict):
        return batch["image"], batch["label"]
    return batch[0], batch[1]


@torch.no_grad()
def zeroshot_classify(
    model,
    classifier: torch.Tensor,
    loader: Iterable,
    device: torch.device | str,
    *,
    ks: Sequence[int] = (1, 5),
    precision: str = "fp32",
    show_progress: bool = True,
) -> dict[str, float]:
    """Top-k accuracy and mean per-class recall of classifier [d, C] over loader batches
    (images [B,3,H,W], labels [B]) as tuples or {"image", "label"} dicts. Streams: keeps only
    one rank and one prediction per image. Returns {"top1", "top5", "mean_per_class_recall", "n"}."""
    device = torch.device(device)
    classifier = classifier.to(device).float()
    ranks, preds, targets = [], [], []
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for batch in tqdm(loader, desc="zero-shot", unit="batch", disable=not show_progress):
            images, labels = _unpack(batch)
            labels = torch.as_tensor(labels).long()
            if not labels.numel():  # every image of the batch was skipped
                continue
            if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classifier.shape[1]):
                raise ValueError(f"label outside [0, {classifier.shape[1]}) — class names do not match the data")
            with autocast_for(precision, device):
                img_bd = model.encode_image(images.to(device, non_blocking=True), normalize=True)
            logits_bc = img_bd.float() @ classifier
            ranks.append(target_ranks(logits_bc, labels).cpu())
            preds.append(predictions(logits_bc).cpu())
            targets.append(labels)
    finally:
        model.train(was_training)
    if not ranks:
        raise ValueError("classification loader yielded no samples")
    ranks_n, preds_n, targets_n = torch.cat(ranks), torch.cat(preds), torch.cat(targets)
    out = accuracy_from_ranks(ranks_n, ks)
    out["mean_per_class_recall"] = recall_from_predictions(preds_n, targets_n, classifier.shape[1])
    out["n"] = int(targets_n.numel())
    return out
