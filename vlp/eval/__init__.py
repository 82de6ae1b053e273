"""Evaluation: a checkpoint loaded and evaluated (vlp.eval.checkpoints: `vlp eval`), the evaluation
during and after training (vlp.eval.evaluator), retrieval (vlp.eval.retrieval), classification
(vlp.eval.zeroshot), datasets (vlp.eval.datasets), writers (vlp.eval.report), metric names
(vlp.eval.keys) and the suite runner (vlp.eval.suite.run_eval_suite). Import from the module that
defines a name. The suites themselves (YAML) are in eval/ at the repository's root."""
