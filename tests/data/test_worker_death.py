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
import threading
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


def _warm(spec) -> None:
    """Decode a batch in this process first: each loader's workers fork warm (no lazy imports)."""
    stream = make_loader(spec, transform=to_tensor, tokenize=tokenize, batch_size=32, mode="resampled",
                         shuffle_buffer=32).epochs()
    next(stream)
    stream.close()


def _kill_a_worker_at_random(spec, rng: random.Random) -> tuple[str, str]:
    """A 2-worker stream of 32-image batches, read with random pauses (batches wait in the queue,
    their storage still in the worker) or none (the main process waits inside the loader): one
    worker SIGKILLed by a thread at a random moment; read on until the loader says it died."""
    loader = make_loader(spec, transform=to_tensor, tokenize=tokenize, batch_size=32, num_workers=2, mode="resampled",
                         shuffle_buffer=32)
    stream = loader.epochs()
    next(stream)
    victim, pause = rng.choice(loader.board.pids()), rng.choice([0.0, 0.02])
    killer = threading.Timer(rng.uniform(0.0, 0.2), os.kill, (victim, signal.SIGKILL))
    killer.start()
    try:
        for _ in range(10_000):
            time.sleep(rng.uniform(0.0, pause))
            next(stream)
    except WorkerDied as died:
        return str(died), _crossing(died)
    finally:
        killer.join()
        stream.close()
    raise AssertionError("the loader went on after a worker was killed")


def _crossing(died: WorkerDied) -> str:
    """Where the main process met the death: 'transfer' (a batch's storage coming by fd from the
    dead worker), 'waiting' (SIGCHLD while it waited for a batch), 'next batch' (it died while the
    main process was busy), 'queue' (torch's own liveness check)."""
    cause = died.__cause__
    if isinstance(cause, (ConnectionError, EOFError, FileNotFoundError)):
        return "transfer"
    if isinstance(cause, lifecycle._Died):
        return "waiting" if cause.__traceback__.tb_next else "next batch"
    return "queue" if isinstance(cause, RuntimeError) and "DataLoader worker" in str(cause) else repr(cause)


@pytest.mark.multiproc
def test_a_worker_killed_at_random_moments_is_always_one_line(tiny_shards, capsys):
    """30 kills at random moments beside a CPU hog: each is WorkerDied naming the worker, its pid,
    SIGKILL and its shard; none escapes as another error. Most land on a batch in transfer."""
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    rng = random.Random(48)
    where: dict[str, int] = {}
    _warm(tiny_shards["train"])
    with cpu_hog():
        for _ in range(KILLS):
            line, kind = _kill_a_worker_at_random(tiny_shards["train"], rng)
            assert line.startswith("loader worker ") and "was killed by signal SIGKILL" in line, line
            assert "while reading " in line or "before it read a shard" in line, line
            where[kind] = where.get(kind, 0) + 1
    with capsys.disabled():
        print(f"\n{KILLS} worker kills: {where}")
    assert set(where) <= {"transfer", "waiting", "next batch", "queue"}, where
    assert where.get("transfer", 0) >= 1, where  # the race this guards is exercised, not only the easy paths


@pytest.mark.multiproc
def test_a_worker_killed_while_its_batch_is_pinned_is_one_line(tiny_shards, monkeypatch):
    """With pinning on (torch's pinning thread receives each batch; an accelerator is faked and
    pinning itself lets one batch through, then holds the next), both workers are SIGKILLed while
    their next batches wait in the queue; the pinning thread dies receiving one (its storage comes
    by fd from a dead worker) and prints no traceback; the main process says one line."""
    gate = threading.Semaphore(1)

    def pin(data, device=None):
        gate.acquire(timeout=30)
        return data

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(torch_pinning, "pin_memory", pin)
    thread_errors = []
    monkeypatch.setattr(lifecycle, "_HOOK", [thread_errors.append])
    _warm(tiny_shards["train"])
    loader = make_loader(tiny_shards["train"], transform=to_tensor, tokenize=tokenize, batch_size=32, num_workers=2,
                         mode="resampled", shuffle_buffer=32, pin_memory=True)
    stream = loader.epochs()
    next(stream)  # the pinning thread now holds the next batch; the workers fill the queue behind it
    pinning = [t for t in threading.enumerate() if "_pin_memory_loop" in t.name]
    assert len(pinning) == 1, threading.enumerate()
    time.sleep(2.0)
    for pid in loader.board.pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    gate.release(100)
    pinning[0].join(30)
    assert not pinning[0].is_alive()  # it died receiving a dead worker's batch
    with pytest.raises(WorkerDied, match="was killed by signal SIGKILL") as died:
        next(stream)
    stream.close()
    assert str(died.value).count("loader worker ") == 2, str(died.value)
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
