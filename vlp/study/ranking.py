"""The run room's ranking: a study run's val and test items ranked at every budget point and at
the end, from the Trainer's evaluation hook (the model as trained so far, in eval mode).

    RankingTrainer(cfg, accelerator, specs).train()
        <run>/eval_points.json  {samples seen: {"val": ranks, "test": ranks}} at every point
        <run>/eval_items.json   the last point's ranks (what the final table reads)

Ranks are the 1-based rank of the correct item for every query, both directions (the eval
suite's reader and ranking, vlp.eval), from which every study metric and bootstrap is computed.
Ranking runs under no_grad and draws no random numbers, so the points do not change training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from vlp.study.plan import SPLITS
from vlp.study.rows import ITEMS_FILE, POINTS_FILE, split_metrics
from vlp.train.loop import Trainer
from vlp.util import atomic_write


class RankingTrainer(Trainer):
    """A Trainer whose evaluation (every train.eval_every steps, and once at the end) ranks the
    study's val and test sets instead of data.eval_shards (the study clears those)."""

    def __init__(self, cfg, accelerator=None, specs: Optional[dict[str, str]] = None):
        super().__init__(cfg, accelerator=accelerator)
        self.specs = specs or {}

    def evaluate(self) -> dict:
        model = self.eval_model()  # collective under FSDP
        flat: dict = {}
        if self.accelerator.is_main_process:
            self.model.eval()
            items = {split: rank_items(model, self.tokenizer, self.eval_transform, self.specs[split], self.cfg,
                                       self.accelerator.device) for split in SPLITS}
            self.model.train()
            self.record(items)
            flat = {f"{split}/mean_R@{k}": split_metrics(items[split])[f"mean_R@{k}"] for split in SPLITS for k in (1, 10)}
        self.accelerator.wait_for_everyone()
        return flat

    def record(self, items: dict) -> None:
        """This point's ranks into eval_points.json (kept over a resume) and, at the last step,
        eval_items.json."""
        folder = Path(self.cfg.train.output_dir)
        points_path = folder / POINTS_FILE
        points = json.loads(points_path.read_text()) if points_path.is_file() else {}
        points[str(self.samples_seen)] = items
        atomic_write(points_path, json.dumps(points))
        if self.step >= self.total_steps:
            atomic_write(folder / ITEMS_FILE, json.dumps(items))


def rank_items(model, tokenizer, transform, spec: str, cfg, device) -> dict[str, list[int]]:
    """1-based rank of the correct item for every query of the val or test set, both directions:
    the eval suite's reader and ranking (vlp.eval.suite, vlp.eval.retrieval), ties included. With a
    data.feature_cache the locked stems' outputs come from the cache (built once, by the same
    reader) and only the heads run."""
    from vlp.eval.retrieval import retrieval_ranks  # heavy (the eval suite's readers)
    from vlp.eval.suite import embed_retrieval_shards
    from vlp.train.feature_cache import embed_features, retrieval_features

    cache, batch_size = cfg.data.feature_cache, cfg.eval.batch_size
    with torch.no_grad():
        if cache:
            img_feat, txt_feat, txt_to_img = retrieval_features(model, tokenizer, transform, spec, device, batch_size,
                                                                cache=None if cache == "memory" else cache)
            img, txt = embed_features(model, img_feat, txt_feat)
        else:
            img, txt, txt_to_img = embed_retrieval_shards(model, tokenizer, transform, spec, device, batch_size)
    i2t, t2i = retrieval_ranks(img, txt, txt_to_img)
    return {"image_to_text": i2t.tolist(), "text_to_image": t2i.tolist()}
