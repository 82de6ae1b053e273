"""Evaluation during and after training: data.eval_shards as the 'heldout' retrieval set, plus
eval.suite's tasks, run on the main process (vlp.eval.suite)."""

from __future__ import annotations

from pathlib import Path

from vlp.eval import keys


class Evaluator:
    def __init__(self, cfg, folder):
        """`folder`: the run folder (vlp.checkpoint.storage.RunFolder); reports go to eval_stepN/
        in it (from a bucket: written locally, then uploaded). The suite is read now, once: a
        malformed suite file fails before any model is built, not after training."""
        self.folder = folder
        self.suite = self.read_suite(cfg)
        self.has_tasks = bool(self.suite["retrieval"] or self.suite["classification"])  # else evaluation is skipped

    @staticmethod
    def read_suite(cfg) -> dict:
        """data.eval_shards as the 'heldout' retrieval set, plus eval.suite's tasks."""
        suite = {"batch_size": cfg.eval.batch_size, "retrieval": [], "classification": []}
        if cfg.eval.suite:
            from vlp.eval.suite import load_suite

            extra = load_suite(cfg.eval.suite)
            suite.update({k: v for k, v in extra.items() if k not in ("retrieval", "classification")})
            suite["retrieval"] += extra.get("retrieval") or []
            suite["classification"] += extra.get("classification") or []
        if cfg.data.eval_shards:
            suite["retrieval"].insert(0, {"name": keys.HELDOUT, "shards": cfg.data.eval_shards})
        return suite

    def run(self, model, tokenizer, transform, step: int, device) -> dict:
        """Zero-shot retrieval / classification of `model` (its tokenizer and eval transform); a flat
        dict of floats. The 'heldout' set's metrics keep their plain names (image_to_text_R@1, ...);
        other tasks are prefixed with their name (imagenet/top1, ...)."""
        from vlp.eval.suite import run_eval_suite

        name = f"eval_step{step}"
        out_dir = self.folder.local_dir(name) if self.folder.remote else Path(self.folder.root) / name
        results = run_eval_suite(model, tokenizer, transform, self.suite, device,
                                 out_dir=str(out_dir), show_progress=False)
        self.folder.sync_dir(name)
        flat: dict = {}
        for name, res in results.items():
            flat.update({keys.task_key(k, name): v for k, v in res["metrics"].items()})
            if "n_images" in res:
                flat[keys.task_key(keys.NUM_IMAGES, name)] = res["n_images"]
                flat[keys.task_key(keys.CHANCE_R1, name)] = 1.0 / res["n_images"]
        return flat
