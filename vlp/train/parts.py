"""The loop's own checkpoint parts (docs/checkpoints.md): its counters (SHARED) and each rank's
random state (PER_RANK); the Trainer registers them with the checkpointer like every other part."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
from accelerate.utils import set_seed


@dataclass
class Counters:
    """The loop's counters, a checkpoint part: optimizer steps taken, samples seen (global,
    counted: true across layout changes), steps skipped for a non-finite loss."""

    step: int = 0
    samples_seen: int = 0
    nonfinite_total: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


class RNG:
    """This process's random state (torch, Python, CUDA) as a per-rank part: loaded from its
    rank's saved entry; None (a resume under another layout) seeds `seed + rank` afresh."""

    def __init__(self, seed: int = 0, rank: int = 0):
        self.seed, self.rank = seed, rank

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, states: list) -> None:
        state = states[self.rank]
        if state is None:  # accelerate's set_seed: torch, numpy, Python and CUDA at once
            return set_seed(self.seed + self.rank)
        torch.set_rng_state(state["torch"])
        random.setstate(_tuplify(state["python"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
