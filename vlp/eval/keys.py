"""Metric names, built in one place and looked up, never parsed back out of strings.

Retrieval (vlp.eval.retrieval):  recall(direction, k) = "image_to_text_R@1", ...; mean_recall(k) =
"mean_R@1" (the mean of both directions); chance R@1 = 1 / number of images.
Results of a training run (vlp.train.loop): eval_key(metric, task) = "eval/image_to_text_R@1" for
the held-out set (HELDOUT, data.eval_shards) and "eval/<task>/<metric>" for an eval.suite task.
"""

from __future__ import annotations

from typing import Optional

IMAGE_TO_TEXT, TEXT_TO_IMAGE = "image_to_text", "text_to_image"
DIRECTIONS = (IMAGE_TO_TEXT, TEXT_TO_IMAGE)
RECALL_KS = (1, 5, 10)
CHANCE_R1 = "chance_R@1"
NUM_IMAGES = "num_images"
HELDOUT = "heldout"  # the trainer's retrieval set from data.eval_shards: its metrics carry no task
EVAL_PREFIX = "eval/"


def recall(direction: str, k: int) -> str:
    """R@k of one direction: the fraction of queries whose best positive ranks <= k."""
    return f"{direction}_R@{k}"


def mean_recall(k: int) -> str:
    """The mean of both directions' R@k."""
    return f"mean_R@{k}"


def median_rank(direction: str) -> str:
    return f"{direction}_median_rank"


def mean_rank(direction: str) -> str:
    return f"{direction}_mean_rank"


# every retrieval number a comparison reports: both directions' R@k, then the means
EVAL_KEYS = tuple(recall(d, k) for d in DIRECTIONS for k in RECALL_KS) + tuple(mean_recall(k) for k in RECALL_KS)


def task_key(metric: str, task: Optional[str] = None) -> str:
    """A metric's name in a run's flat results: plain for the held-out set, "<task>/<metric>" else."""
    return metric if task in (None, HELDOUT) else f"{task}/{metric}"


def eval_key(metric: str, task: Optional[str] = None) -> str:
    """The key of a metric in result.json and in log.jsonl's eval records."""
    return EVAL_PREFIX + task_key(metric, task)
