"""Zero-shot evaluation: retrieval (vlp.eval.retrieval), classification (vlp.eval.zeroshot), datasets
(vlp.eval.datasets), writers (vlp.eval.report) and the suite runner `vlp.eval.run_eval_suite`."""


def __getattr__(name):  # lazy, so `import vlp.eval.report` does not import torch/open_clip
    if name == "run_eval_suite":
        from vlp.eval.suite import run_eval_suite
        return run_eval_suite
    raise AttributeError(name)
