"""Zero-shot evaluation: retrieval (vlp.eval.retrieval), classification (vlp.eval.zeroshot), datasets
(vlp.eval.datasets), writers (vlp.eval.report), metric names (vlp.eval.keys) and the suite runner
(vlp.eval.suite.run_eval_suite). Import from the module that defines a name."""
