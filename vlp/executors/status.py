"""`vlp compare --status` and `--cancel` for a grid run by a scheduler (grid.executor: slurm), and
the one line of a grid that ended with failed cells: read from the run folders' job.json
(vlp.executors.jobfiles) and one call to the scheduler; nothing is submitted."""

from __future__ import annotations

import time
from typing import Optional

from vlp.checkpoint.storage import RunFolder
from vlp.executors.jobfiles import (JOBS_FILE, RESULT_FILE, folder_name, has_result, live_id, read_record, submissions,
                                write_submissions)
from vlp.executors.jobstate import PENDING, RUNNING, JobState


def run_folders(out_dir) -> list[RunFolder]:
    """The grid's run folders (local or in a bucket) that were ever submitted (job.json) or are
    done (result.json), by name."""
    root = RunFolder(out_dir)
    return [root.sub(name) for name in root.listdir() if any(root.exists(f"{name}/{f}") for f in (JOBS_FILE, RESULT_FILE))]


def status_rows(folders: list[RunFolder], states: dict[str, JobState]) -> list[tuple[str, str, str, str]]:
    """(run, state, job id, detail) per run folder: done, pending, running, requeued N, failed (reason),
    never submitted here ('-'). Pure: the folders' files and the scheduler's states."""
    rows = []
    for folder in folders:
        name, jobs = folder_name(folder), submissions(folder)
        last = jobs[-1] if jobs else {}
        job_id = last.get("id", "-")
        if has_result(folder):
            rows.append((name, "done", job_id, ""))
            continue
        if not jobs:
            rows.append((name, "-", "-", "not submitted"))
            continue
        tries = f"attempt {len(jobs)}"
        live = states.get(job_id) if "state" not in last else None
        if live is not None and live.phase in (PENDING, RUNNING):
            word = f"requeued {live.requeues}" if live.requeues else live.phase
            rows.append((name, word, job_id, f"{live.state} {live.reason}".strip() + f"; {tries}"))
        elif live is not None:
            rows.append((name, "ended", job_id, f"{live.state} {live.reason}".strip() + "; not yet seen by a driver"))
        elif "state" in last:
            record = read_record(folder)
            why = record.get("error") or f"{last['state']} {last.get('reason', '')}".strip()
            rows.append((name, "failed", job_id, f"{why}; {tries}"))
        else:
            rows.append((name, "unknown", job_id, "not known to the scheduler any more"))
    return rows


def status_table(rows: list[tuple[str, str, str, str]]) -> str:
    """The runs by state, as a markdown table, with a count per state."""
    counts: dict[str, int] = {}
    for _, word, _, _ in rows:
        key = word.split()[0]
        counts[key] = counts.get(key, 0) + 1
    lines = ["| run | state | job | detail |", "|---|---|---|---|"]
    lines += [f"| {run} | {word} | {job} | {detail} |" for run, word, job, detail in rows]
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no run submitted yet"
    return "\n".join(lines + ["", summary])


def study_status(grid, scheduler) -> str:
    """`vlp compare --status`: the table of the grid's runs; one poll, nothing submitted."""
    folders = run_folders(grid.out_dir)
    live = [i for i in (live_id(submissions(f)) for f in folders) if i]
    return status_table(status_rows(folders, scheduler.poll(live) if live else {}))


def cancel_study(grid, scheduler) -> int:
    """`vlp compare --cancel`: cancel every job of the grid not yet ended; notes it in each job.json.
    Returns how many."""
    cancelled = []
    for folder in run_folders(grid.out_dir):
        jobs = submissions(folder)
        if live_id(jobs):
            cancelled.append(jobs[-1]["id"])
            jobs[-1].update(state="CANCELLED", reason="vlp compare --cancel", ended=time.time())
            write_submissions(folder, scheduler.name, jobs)
    if cancelled:
        scheduler.cancel(cancelled)
    return len(cancelled)


def exit_on_failures(rows: list[dict]) -> Optional[str]:
    """The one line for a grid that ended with failed cells (their runs and reasons are in the
    report), else None."""
    failed = [r for r in rows if r.get("status") != "ok"]
    if not failed:
        return None
    names = ", ".join(r["run"] for r in failed[:3]) + (" ..." if len(failed) > 3 else "")
    return f"{len(failed)} run(s) failed after grid.retries ({names}); the report shows each cell's reason"
