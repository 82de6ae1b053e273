"""`run_eval_suite`: the one entry point `vlp eval` (and the trainer's eval hook) calls.

Every result carries "skipped" ({kind: count} of samples left out: undecodable images,
decompression bombs, special or repeated files) and "warnings" (a metric that cannot mean
anything: one class, top-k with k >= classes, one image or caption); warnings also go to stderr.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch

from vlp.eval import datasets as D
from vlp.eval.report import write_reports
from vlp.eval.retrieval import clip_benchmark_names, embed_retrieval, retrieval_metrics
from vlp.eval.zeroshot import build_classifier, load_templates, zeroshot_classify

SUITE_KEYS = {"retrieval", "classification", "batch_size", "num_workers", "precision", "chunk_size"}
RETRIEVAL_KEYS = {"name", "shards", "wds", "split", "batch_size"}
CLASSIFICATION_KEYS = {"name", "type", "root", "shards", "wds", "split", "classnames", "templates", "batch_size"}
UNITS = "fractions in [0, 1] (recalls, accuracies); ranks are 1-based positions"


def _check_keys(d: dict, allowed: set, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def check_suite(suite: dict) -> dict:
    """The suite's structure (keys, entry lists, names, a retrieval entry's shards), checked
    before any work: a ValueError line, not a crash after hours of training."""
    _check_keys(suite, SUITE_KEYS, "eval suite")
    names: set = set()
    for kind, allowed in (("retrieval", RETRIEVAL_KEYS), ("classification", CLASSIFICATION_KEYS)):
        entries = suite.get(kind) or []
        if not isinstance(entries, list):
            raise ValueError(f"eval suite: {kind} must be a list of entries, got {type(entries).__name__}")
        for entry in entries:
            _check_keys(entry, allowed, f"{kind} entry")
            if "name" not in entry:
                raise ValueError(f"{kind} entry needs a 'name'")
            if entry["name"] in names:
                raise ValueError(f"duplicate eval name {entry['name']!r}")
            names.add(entry["name"])
            if kind == "retrieval" and not (entry.get("shards") or entry.get("wds")):
                raise ValueError(f"retrieval {entry['name']!r} needs 'shards' or 'wds'")
            if entry.get("shards") and entry.get("wds"):
                raise ValueError(f"{kind} {entry['name']!r}: give 'shards' or 'wds', not both")
    return suite


def shards_of(entry: dict) -> str:
    """An entry's shards: "shards", or for `wds: ROOT` (a CLIP_benchmark webdataset folder:
    ROOT/classnames.txt, ROOT/zeroshot_classification_templates.txt, ROOT/<split>/*.tar) the
    split's folder (default split: test)."""
    if entry.get("wds"):
        return os.path.join(entry["wds"], entry.get("split", "test"))
    return entry["shards"]


def wds_entry(root: str, split: str = "test", name: Optional[str] = None) -> tuple[str, dict]:
    """(task, suite entry) for a CLIP_benchmark webdataset folder: classification when it has
    classnames.txt, else retrieval."""
    if not os.path.isdir(os.path.join(root, split)):
        raise FileNotFoundError(f"{root}: no {split}/ folder of shards (CLIP_benchmark wds layout)")
    entry = {"name": name or os.path.basename(os.path.normpath(root)).removeprefix("wds_"), "wds": root, "split": split}
    return ("classification" if os.path.isfile(os.path.join(root, "classnames.txt")) else "retrieval"), entry


def load_suite(path: str) -> dict:
    """A suite YAML file, checked (check_suite)."""
    import yaml

    from vlp.util import DuplicateKey, load_yaml
    from vlp.util import first_line

    if not os.path.isfile(path):
        raise FileNotFoundError(f"eval suite not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            suite = load_yaml(f.read()) or {}
    except DuplicateKey as e:
        raise ValueError(f"eval suite {path}: {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"eval suite {path} is not valid YAML: {first_line(e)}") from None
    return check_suite(suite)


def counting(loader: Iterable, skipped: Counter, stop: Optional[Callable[[], None]] = None) -> Iterator:
    """The loader's batches, adding each batch's skip counts to `skipped` (dict batches: their
    "skipped"; tuple batches: a dict third element) and dropping batches left empty by skips;
    `stop()` before each (it raises to end the eval: `vlp eval`'s Ctrl-C, vlp.eval.checkpoints)."""
    for batch in loader:
        if stop is not None:
            stop()
        counts = batch.get("skipped") if isinstance(batch, dict) else (batch[2] if len(batch) > 2 else None)
        skipped.update(counts or {})
        images = batch["image"] if isinstance(batch, dict) else batch[0]
        if len(images):
            yield batch


def meaningless(task: str, result: dict, ks=(1, 5)) -> list[str]:
    """Why some of a result's metrics say nothing about the model (empty: they all do)."""
    if task == "classification":
        c = result["num_classes"]
        if c < 2:
            return [f"only {c} class: every image is classified correctly by construction, top-k is meaningless"]
        return [f"top{k} is 100% by construction with {c} classes" for k in ks if k >= c]
    out = []
    if result["n_images"] < 2:
        out.append(f"only {result['n_images']} image: text-to-image recall is meaningless")
    if result["n_texts"] < 2:
        out.append(f"only {result['n_texts']} caption: image-to-text recall is meaningless")
    return out


def _classification_dataset(entry: dict, transform):
    """(dataset, classnames) for one classification entry."""
    kind = entry.get("type") or ("shards" if "shards" in entry or "wds" in entry else
                                 "imagenet" if entry["name"].lower().startswith("imagenet") else "folder")
    if kind == "shards":
        shards = shards_of(entry)
        return D.ShardClassification(shards, transform), D.shard_classnames(shards, entry.get("classnames"))
    if "root" not in entry:
        raise ValueError(f"classification {entry['name']!r} (type {kind}) needs 'root'")
    if kind == "imagenet":
        if entry.get("classnames") is not None:
            raise ValueError("type 'imagenet' uses open_clip's IMAGENET_CLASSNAMES; use type 'folder' for custom names")
        return D.imagenet_folder(entry["root"], transform)
    if kind == "folder":
        return D.class_folder(entry["root"], transform, entry.get("classnames"))
    raise ValueError(f"classification type must be imagenet, folder or shards; got {kind!r}")


def _shard_templates(entry: dict) -> Optional[str]:
    """zeroshot_classification_templates.txt of a shard set (beside its shards or one level up,
    like classnames.txt), when it has one."""
    if entry.get("type", "shards") != "shards" or not (entry.get("shards") or entry.get("wds")):
        return None
    return D.shard_side_file(shards_of(entry), "zeroshot_classification_templates.txt")


def embed_retrieval_shards(model, tokenizer, transform, shards: str, device, batch_size: int = 64,
                           num_workers: int = 0, skipped: Optional[Counter] = None, precision: str = "fp32",
                           show_progress: bool = False, stop: Optional[Callable[[], None]] = None):
    """(img_emb, txt_emb, txt_to_img) of a retrieval shard set, read by the one eval reader
    (vlp.eval.datasets.ShardRetrieval); skipped images are counted into `skipped`."""
    loader = D.make_eval_loader(D.ShardRetrieval(shards, transform, tokenizer), batch_size, num_workers,
                                collate_fn=D.collate_retrieval)
    return embed_retrieval(model, counting(loader, Counter() if skipped is None else skipped, stop), device,
                           precision=precision, show_progress=show_progress)


def run_eval_suite(
    model,
    tokenizer: Callable,
    transform: Callable,
    suite: dict,
    device: torch.device | str,
    out_dir: Optional[str],
    *,
    show_progress: bool = True,
    stop: Optional[Callable[[], None]] = None,
) -> dict[str, Any]:
    """Run every task of `suite`, write out_dir/metrics.json and metrics.md, return the results.

    suite (unknown keys are errors):
      batch_size: 64, num_workers: 0, precision: "fp32" | "amp" | "amp_bf16" | "amp_fp16",
      chunk_size: 4096 (retrieval query chunk),
      retrieval: [{"name": "coco", "shards": "coco/{0..4}.tar", "batch_size": 64?},
                  {"name": "flickr30k", "wds": "/data/wds_flickr30k", "split": "test"?}, ...]
      classification: [
        {"name": "imagenet", "root": "/data/imagenet/val", "templates": "openai"},
        {"name": "pets", "type": "folder", "root": "/data/pets", "classnames": "names.txt"?},
        {"name": "cifar10", "shards": "/data/cifar10/test/{0..3}.tar", "classnames": "..."?},
        {"name": "cars", "wds": "/data/wds_cars"}, ...]
    `wds`: a CLIP_benchmark webdataset folder (shards_of); its classnames.txt and
    zeroshot_classification_templates.txt are used unless the entry names others.
    Classification `type` defaults to "shards" if `shards` is given, else "imagenet" when the name
    starts with "imagenet", else "folder". `templates`: "openai" (default; for shards the set's
    zeroshot_classification_templates.txt when it has one), "simple", a file, or a list. Shard
    class names default to classnames.txt beside/above the shards.
    Metrics are fractions in [0, 1] (metrics.json, the returned dict); metrics.md shows percent.
    Retrieval shards are read by eval's one reader (vlp.eval.datasets.ShardRetrieval).

    Returns {name: {"task", "metrics", "clip_benchmark", sizes...}}; out_dir=None writes nothing.
    `stop()` is called before every task and batch; what it raises ends the suite, nothing written.
    """
    check_suite(suite)
    opts = _Options(int(suite.get("batch_size", 64)), int(suite.get("num_workers", 0)),
                    suite.get("precision", "fp32"), int(suite.get("chunk_size", 4096)), show_progress, stop or _go_on)
    device = torch.device(device)
    results: dict[str, Any] = {}
    for entry in suite.get("retrieval") or []:
        opts.stop()
        _check_keys(entry, RETRIEVAL_KEYS, "retrieval entry")
        results[_entry_name(entry, "retrieval", results)] = _retrieval_task(
            model, tokenizer, transform, entry, device, opts)
    for entry in suite.get("classification") or []:
        opts.stop()
        _check_keys(entry, CLASSIFICATION_KEYS, "classification entry")
        results[_entry_name(entry, "classification", results)] = _classification_task(
            model, tokenizer, transform, entry, device, opts)
    for name, result in results.items():
        result["warnings"] = meaningless(result["task"], result)
        for text in result["warnings"]:
            print(f"vlp: warning: {name}: {text}", file=sys.stderr)

    if out_dir is not None:
        write_reports(results, out_dir)
    return results


class _Options(NamedTuple):
    """A suite's shared settings: batch size, loader workers, precision, retrieval chunk."""

    batch_size: int
    num_workers: int
    precision: str
    chunk_size: int
    show_progress: bool
    stop: Optional[Callable[[], None]] = None


def _go_on() -> None:
    """The stop check of a suite nobody stops."""


def _entry_name(entry: dict, where: str, results: dict) -> str:
    if "name" not in entry:
        raise ValueError(f"{where} entry needs a 'name'")
    if entry["name"] in results:
        raise ValueError(f"duplicate eval name {entry['name']!r}")
    return entry["name"]


def _retrieval_task(model, tokenizer, transform, entry: dict, device: torch.device, opts: _Options) -> dict:
    skipped: Counter[str] = Counter()
    img_emb, txt_emb, txt_to_img = embed_retrieval_shards(
        model, tokenizer, transform, shards_of(entry), device, int(entry.get("batch_size", opts.batch_size)),
        opts.num_workers, skipped, opts.precision, opts.show_progress, opts.stop)
    metrics = retrieval_metrics(img_emb.to(device), txt_emb.to(device), txt_to_img.to(device),
                                chunk_size=opts.chunk_size)
    return {"task": "retrieval", "metrics": metrics, "clip_benchmark": clip_benchmark_names(metrics),
            "n_images": int(img_emb.shape[0]), "n_texts": int(txt_emb.shape[0]),
            "skipped": dict(sorted(skipped.items())), "units": UNITS}


def _classification_task(model, tokenizer, transform, entry: dict, device: torch.device, opts: _Options) -> dict:
    dataset, classnames = _classification_dataset(entry, transform)
    templates_spec = entry.get("templates") or _shard_templates(entry) or "openai"
    classifier = build_classifier(model, tokenizer, classnames, load_templates(templates_spec), device,
                                  precision=opts.precision, show_progress=opts.show_progress)
    loader = D.make_eval_loader(dataset, int(entry.get("batch_size", opts.batch_size)), opts.num_workers)
    skipped = Counter(getattr(dataset, "skipped", {}))  # left out when the folders were read
    metrics = zeroshot_classify(model, classifier, counting(loader, skipped, opts.stop), device, precision=opts.precision,
                                show_progress=opts.show_progress)
    n = metrics.pop("n")
    return {"task": "classification", "metrics": metrics, "clip_benchmark": clip_benchmark_names(metrics),
            "n": n, "num_classes": len(classnames),
            "templates": templates_spec if isinstance(templates_spec, str) else "custom",
            "skipped": dict(sorted(skipped.items())), "units": UNITS}
