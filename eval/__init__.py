"""Zero-shot evaluation: retrieval (eval.retrieval), classification (eval.zeroshot), datasets
(eval.datasets), writers (eval.report) and the suite runner `eval.run_eval_suite`."""


def __getattr__(name):  # lazy, so `import eval.report` does not import torch/open_clip
    if name == "run_eval_suite":
        from eval.suite import run_eval_suite
        return run_eval_suite
    raise AttributeError(name)
