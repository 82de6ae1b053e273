"""log.jsonl: the trainer's run log, one JSON record per line, each with an explicit "type".

    train      a logged optimizer step: step, samples_seen, epoch, samples_per_s, lr, the loss's
               metrics (vlp.losses.diagnostics) and skipped_* counts
    nonfinite  a step whose loss was not finite on some rank (skipped): step, nonfinite, lr
    eval       an evaluation during training: step and eval/* metrics (vlp.eval.keys)
    result     the end of the run: what result.json holds, without its nested dicts

Readers select records by this field, never by which keys a record happens to have. A resumed
run appends, so a step can appear twice; the last record of a step is the one that counts.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN, NONFINITE, EVAL, RESULT = "train", "nonfinite", "eval", "result"


def read_records(path: str | Path, kind: str) -> list[dict]:
    """The records of type ``kind`` in file order; a line cut short by a kill is skipped."""
    path = Path(path)
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("type") == kind:
                out.append(rec)
    return out


def last_per_step(records: list[dict]) -> list[dict]:
    """One record per step, the last written (a resume replays steps after its checkpoint)."""
    by_step = {rec["step"]: rec for rec in records}
    return [by_step[s] for s in sorted(by_step)]
