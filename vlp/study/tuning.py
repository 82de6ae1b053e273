"""Tuning that finds the optimum: the sweep's edge extension and the notes on edge selections,
as pure functions of the GridSpec, the runs planned so far and the selection.

The study (vlp.study.study) alternates: run the planned runs, select (mean val over the sweep
seeds, vlp.study.plan.select_best), extend, until no arm gets a new value. Each step at most
triples or thirds a value, so a bound [low, high] ends the walk after log3(high / low) steps.
"""

from __future__ import annotations

from vlp.study.plan import Arm, Run, run_of, settings_for, sweep_of

STEP = 3.0
"""The factor between an edge value and the next one beyond it."""
UNBOUNDED_EDGE_MIN = 3
"""A key without a bound is named at an edge only when it was swept over this many values or more
(a one-value key such as a fixed weight decay is not an edge)."""
TOLERANCE = 1e-9


def tried_settings(runs: list[Run]) -> dict[Arm, list[tuple]]:
    """Per arm, the distinct settings of ``runs`` in their order."""
    out: dict[Arm, list[tuple]] = {}
    for run in runs:
        settings = out.setdefault(run.arm, [])
        if run.setting not in settings:
            settings.append(run.setting)
    return out


def key_values(settings: list[tuple], chosen: tuple, key: str) -> list:
    """The values of ``key`` among ``settings`` that equal ``chosen`` on every other key, sorted."""
    others = {k: v for k, v in chosen if k != key}
    return sorted({dict(s)[key] for s in settings if {k: v for k, v in s if k != key} == others and key in dict(s)})


def beyond(value: float, values: list, bound: list[float]) -> tuple[list[float], list[float]]:
    """(the next values beyond the edge(s) ``value`` sits on, those of them outside ``bound``):
    value / STEP below the lowest, value * STEP above the highest (both for a single value),
    each rounded to 6 significant digits."""
    nexts = []
    if value == values[0]:
        nexts.append(float(f"{value / STEP:.6g}"))
    if value == values[-1]:
        nexts.append(float(f"{value * STEP:.6g}"))
    low, high = bound
    outside = [v for v in nexts if v < low * (1 - TOLERANCE) or v > high * (1 + TOLERANCE)]
    return [v for v in nexts if v not in outside], outside


def extension_runs(grid, best: dict[Arm, tuple], tried: dict[Arm, list[tuple]]) -> list[Run]:
    """For every arm whose selected value of a bounded key (grid.sweep_bounds) is the lowest or
    highest it tried: the next value beyond it (inside the bound, not yet tried), the other keys
    as selected, with every sweep seed. Empty when every selection is interior or at a bound."""
    runs = []
    for arm, chosen in best.items():
        settings = tried.get(arm, [chosen])
        for key, bound in grid.sweep_bounds.items():
            if key not in dict(chosen) or not isinstance(dict(chosen)[key], (int, float)):
                continue
            nexts, _ = beyond(dict(chosen)[key], key_values(settings, chosen, key), bound)
            for value in nexts:
                setting = tuple((k, value if k == key else v) for k, v in chosen)
                if setting not in settings:
                    runs += [run_of(grid, arm, setting, seed) for seed in grid.seeds]
    return list(dict.fromkeys(runs))


def edge_notes(grid, best: dict[Arm, tuple], tried: dict[Arm, list[tuple]]) -> list[dict]:
    """Every selection at an edge of the values its arm tried: {arm, label, key, value, kind} with
    kind 'bound' (the next value would cross grid.sweep_bounds), 'edge' (no bound declared for the
    key, swept over >= 3 values: the optimum may lie outside) or 'open' (a bounded key whose next
    value was not run, e.g. --report-only before the extension ran)."""
    notes = []
    for arm, chosen in best.items():
        settings = tried.get(arm) or settings_for(sweep_of(grid, arm.regime), arm.optimizer)
        for key, value in chosen:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            values = key_values(settings, chosen, key)
            bound = grid.sweep_bounds.get(key)
            if bound is None:
                kind = "edge" if len(values) >= UNBOUNDED_EDGE_MIN and value in (values[0], values[-1]) else None
            else:
                nexts, outside = beyond(value, values, bound)
                kind = "open" if nexts else "bound" if outside else None
            if kind:
                notes.append({"arm": arm, "label": arm.label, "key": key, "value": value, "kind": kind})
    return notes


def edge_sentences(notes: list[dict], bounds: dict[str, list]) -> list[str]:
    """The report's lines on edge selections, one per kind that occurs."""
    text = {
        "bound": "Selected at a declared bound (grid.sweep_bounds {}; the next value x3 or /3 would cross it)",
        "edge": "Selected at the edge of its sweep, no bound declared (the optimum may lie outside)",
        "open": "Selected at an edge whose extension has not run yet (run the study again)",
    }
    out = []
    for kind, head in text.items():
        mine = [f"{n['label']}: {n['key']}={n['value']:g}" for n in notes if n["kind"] == kind]
        if mine:
            shown = ", ".join(f"{k}: [{lo:g}, {hi:g}]" for k, (lo, hi) in bounds.items())
            out.append(f"{head.format(shown)}: {'; '.join(mine)}.")
    return out
