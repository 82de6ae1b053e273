"""A loader worker that dies on its own (the OOM killer's SIGKILL) is one line, `WorkerDied`, whatever
the main process was doing with its batches (issue 48): waiting on the queue, unpickling a batch
whose storage comes by file descriptor from the dying worker (torch's `rebuild_storage_fd` ->
`resource_sharer`: ConnectionResetError / ConnectionRefusedError), or pinning it. A connection
error while every worker is alive keeps its own message. The kills land at random moments, beside
a CPU hog."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import torch.utils.data._utils.pin_memory as torch_pinning

from dp_helpers import to_tensor, tokenize
from loaders import make_loader
from vlp.data import lifecycle
from vlp.data.lifecycle import Board, WorkerDied
from vlp_testing import cpu_hog

KILLS = 30


def _kill_a_worker_at_random(spec, rng: random.Random) -> WorkerDied:
    """A 2-worker stream of 32-image batches: consume a few batches with random pauses (so batches
    wait in the queue, their storage still in the worker), SIGKILL one worker at a random moment,
    read on until the loader says it died."""
    loader = make_loader(spec, transform=to_tensor, tokenize=tokenize, batch_size=32, num_workers=2, mode="resampled")
    stream = loader.epochs()
    next(stream)
    victim = rng.choice(loader.board.pids())
    kill_after = rng.uniform(0.0, 0.3)
    start = time.monotonic()
    try:
        while True:
            time.sleep(rng.uniform(0.0, 0.05))
            if victim and time.monotonic() - start >= kill_after:
                os.kill(victim, signal.SIGKILL)
                victim = 0
            next(stream)
    except WorkerDied as died:
        return died
    finally:
        stream.close()


def _crossing(died: WorkerDied) -> str:
    """Where the death was met: 'transfer' (the batch's storage coming by fd), 'queue' (torch's
    own liveness check), or the error's type."""
    cause = died.__cause__
    if isinstance(cause, (ConnectionError, EOFError, FileNotFoundError)):
        return "transfer"
    return "queue" if isinstance(cause, RuntimeError) and "DataLoader worker" in str(cause) else type(cause).__name__


@pytest.mark.multiproc
def test_a_worker_killed_at_random_moments_is_always_one_line(tiny_shards, capsys):
    """30 kills at random moments beside a CPU hog: each is WorkerDied naming the worker, its pid,
    SIGKILL and its shard; none escapes as another error. Most land on a batch in transfer."""
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    rng = random.Random(48)
    where: dict[str, int] = {}
    with cpu_hog():
        for _ in range(KILLS):
            died = _kill_a_worker_at_random(tiny_shards["train"], rng)
            line = str(died)
            assert line.startswith("loader worker ") and "was killed by signal SIGKILL" in line, line
            assert "while reading " in line or "before it read a shard" in line, line
            kind = _crossing(died)
            where[kind] = where.get(kind, 0) + 1
    with capsys.disabled():
        print(f"\n{KILLS} worker kills: {where}")
    assert set(where) <= {"transfer", "queue"}, where
    assert where.get("transfer", 0) >= 3, where  # the race this guards is exercised, not only torch's check


@pytest.mark.multiproc
def test_a_worker_killed_while_its_batch_is_pinned_is_one_line(tiny_shards, monkeypatch):
    """With pinning on (torch's pinning thread receives each batch: an accelerator is faked, pinning
    itself is the identity), a batch of a SIGKILLed worker kills the pinning thread inside its
    receive; the main process says one line and the thread prints no traceback."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(torch_pinning, "pin_memory", lambda data, device=None: data)
    thread_errors = []
    monkeypatch.setattr("threading.__excepthook__", thread_errors.append)
    loader = make_loader(tiny_shards["train"], transform=to_tensor, tokenize=tokenize, batch_size=32, num_workers=2,
                         mode="resampled", pin_memory=True)
    stream = loader.epochs()
    next(stream)
    time.sleep(0.5)  # both workers' next batches wait in the pinning thread's queue, their storage by fd
    os.kill(loader.board.pids()[1], signal.SIGKILL)
    with pytest.raises(WorkerDied, match="was killed by signal SIGKILL") as died:
        for _ in range(20):
            time.sleep(0.05)
            next(stream)
    stream.close()
    assert "Pin memory thread exited unexpectedly" in str(died.value.__cause__) or _crossing(died.value) in (
        "transfer", "queue"), repr(died.value.__cause__)
    assert thread_errors == [], thread_errors


class _Flaky(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"x": torch.zeros(4)}
        raise ConnectionResetError(104, "Connection reset by peer (a bucket, not a worker)")


@pytest.mark.multiproc
def test_a_connection_error_with_every_worker_alive_keeps_its_message(monkeypatch):
    """A worker raises a connection error of its own (a bucket's) and stays alive: not a death."""
    monkeypatch.setattr(lifecycle, "DEATH_WAIT_S", 0.5)
    board = Board(1, [])
    loader = torch.utils.data.DataLoader(_Flaky(), batch_size=None, num_workers=1, worker_init_fn=board.enter)
    batches = board.receive(iter(loader))
    next(batches)
    with pytest.raises(ConnectionResetError, match="a bucket, not a worker"):
        next(batches)
    assert len(board.pids()) == 1 and not board.ended
