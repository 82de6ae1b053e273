"""Evaluation during and after training: data.eval_shards as the 'heldout' retrieval set, plus
eval.suite's tasks, run on the main process (vlp.eval.suite)."""

from __future__ import annotations

from pathlib import Path

from vlp.eval import keys


class Evaluator:
    def __init__(self, cfg, tokenizer, transform, folder):
        """`folder`: the run folder (vlp.checkpoint.storage.RunFolder); reports go to eval_stepN/
        in it (from a bucket: written locally, then uploaded)."""
        self.cfg, self.tokenizer, self.transform, self.folder = cfg, tokenizer, transform, folder
        suite = self.suite()  # a malformed suite file fails now, not after training
        self.has_tasks = bool(suite["retrieval"] or suite["classification"])  # else evaluation is skipped

    def suite(self) -> dict:
        """data.eval_shards as the 'heldout' retrieval set, plus eval.suite's tasks."""
        suite = {"batch_size": self.cfg.eval.batch_size, "retrieval": [], "classification": []}
        if self.cfg.eval.suite:
            from vlp.eval.suite import load_suite

            extra = load_suite(self.cfg.eval.suite)
            suite.update({k: v for k, v in extra.items() if k not in ("retrieval", "classification")})
            suite["retrieval"] += extra.get("retrieval") or []
            suite["classification"] += extra.get("classification") or []
        if self.cfg.data.eval_shards:
            suite["retrieval"].insert(0, {"name": keys.HELDOUT, "shards": self.cfg.data.eval_shards})
        return suite

    def run(self, model, step: int, device) -> dict:
        """Zero-shot retrieval / classification of `model`; a flat dict of floats. The 'heldout'
        set's metrics keep their plain names (image_to_text_R@1, ...); other tasks are prefixed
        with their name (imagenet/top1, ...)."""
        from vlp.eval.suite import run_eval_suite

        name = f"eval_step{step}"
        out_dir = self.folder.local_dir(name) if self.folder.remote else Path(self.folder.root) / name
        results = run_eval_suite(model, self.tokenizer, self.transform, self.suite(), device,
                                 out_dir=str(out_dir), show_progress=False)
        self.folder.sync_dir(name)
        flat: dict = {}
        for name, res in results.items():
            flat.update({keys.task_key(k, name): v for k, v in res["metrics"].items()})
            if "n_images" in res:
                flat[keys.task_key(keys.NUM_IMAGES, name)] = res["n_images"]
                flat[keys.task_key(keys.CHANCE_R1, name)] = 1.0 / res["n_images"]
        return flat
