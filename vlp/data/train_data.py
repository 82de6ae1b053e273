"""The training data as the loop sees it: typed batches, and one part that owns the position.

    data = TrainData(cfg, transform, tokenize, rank, world)   # validates the shard spec now
    for micro_batches in data.groups(accum):                  # lists of `accum` Batch, forever
        ...
    checkpointer.register("data", data, PER_RANK)             # its position, in every checkpoint

The stream (vlp.data.stream) yields dicts that mix the data with bookkeeping (epoch, index
in it, skip counts, which pieces of the epoch each worker has left). TrainData keeps the
bookkeeping: the epoch and batch reached, the rest of an epoch begun under another layout
(`relayout`: where the position goes on after a layout change), and this rank's skip counts;
the loop gets only `Batch`es.
The position is a per-rank part of the checkpoint (vlp.checkpoint.checkpointer): `load_state_dict`
gets every rank's entry and takes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional, Union

import torch

from vlp.config import Config, ConfigError, global_batch
from vlp.data.decode import image_decoder
from vlp.data.device import PackedImages
from vlp.data.stream import make_loader

@dataclass(frozen=True)
class Batch:
    """One rank's micro-batch: images as the workers ship them (float (b, 3, H, W), uint8
    (b, H, W, 3) or PackedImages; vlp.data.device turns them into the model's input on the
    device), token ids (b, L), stable int64 sample ids. features=True: image and text are the
    towers' cached stem outputs (b, Di), (b, Dt) (vlp.train.feature_cache); the model then runs
    only its heads."""

    image: Union[torch.Tensor, PackedImages]
    text: torch.Tensor
    sample_id: torch.Tensor
    features: bool = False

    @classmethod
    def from_stream(cls, item: dict) -> "Batch":
        return cls(image=item["image"], text=item["text"], sample_id=item["sample_id"])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this batch holds (for memory accounting)."""
        image = [self.image.pixels, self.image.boxes] if isinstance(self.image, PackedImages) else [self.image]
        return [*image, self.text]

    def images_to(self, device, non_blocking: bool = False) -> "Batch":
        """The images on ``device``. Tokens stay on the host until the step has trimmed their
        padding columns there (vlp.train.step), sample ids for host-side per-sample state."""
        return replace(self, image=self.image.to(device, non_blocking=non_blocking))


def image_output(decode: str, device: torch.device) -> str:
    """What the workers ship (vlp.data.device): 'jpeg' for data.decode=gpu (refused without
    CUDA) and for auto on CUDA, else 'region' when the model is on a CUDA device (the resize
    runs there), else 'uint8' (on CPU the workers resize: the main process has the step to run)."""
    if decode == "gpu" or (decode == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ValueError(f"data.decode=gpu needs a CUDA device (this process trains on {device}); "
                             "use data.decode=cpu")
        return "jpeg"
    return "region" if device.type == "cuda" else "uint8"


class DeviceFeed:
    """Moves a step's micro-batches to the device on a side stream, the compute stream waiting on
    them; no batch taken from the stream early (docs/data-path.md, "Transfer"). On CPU: a passthrough."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, group: list[Batch]) -> list[Batch]:
        if self.stream is None:
            return group
        with torch.cuda.stream(self.stream):
            moved = [b.images_to(self.device, non_blocking=True) for b in group]
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for b in moved:  # the compute stream uses memory the side stream allocated
            for t in b.tensors():
                if t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(self.device))
        return moved


class TrainData:
    """This rank's training stream and its position in it (epoch, batches consumed, the rest
    of an epoch begun under another layout, skip counts), with state_dict / load_state_dict."""

    def __init__(self, cfg, transform, tokenize, rank: int, world: int, device: Optional[torch.device] = None):
        self.cfg, self.transform, self.tokenize = cfg, transform, tokenize
        self.rank, self.world = rank, world
        # device given: the workers ship uint8 and ``device_images`` finishes the transform there
        # (vlp.data.device); None: the whole transform in the workers (float)
        self.image_output = "float" if device is None else image_output(cfg.data.decode, torch.device(device))
        self.pin_memory = device is not None and torch.device(device).type == "cuda"
        self.loader = self.make_loader()  # validates the shard spec before any work
        self.device_images = None if transform is None else \
            image_decoder(transform, cfg.data.decode_size, self.image_output).device_part()
        self.feed = DeviceFeed(device or "cpu")  # pinned, non-blocking, on a side stream (CUDA)
        self.current = self.loader  # the loader the current epoch comes from
        self.epoch = 0
        self.batch_in_epoch = 0
        self.pieces: Optional[list] = None  # the rest of an epoch begun under another layout
        self.skipped: dict[str, int] = {}
        self.features = None  # a FeatureCache (data.feature_cache): batches carry stem outputs

    @property
    def num_samples(self) -> int:
        """Training samples in the shard list (the range of the stream's sample ids)."""
        return sum(self.loader.plan.sizes)

    def make_loader(self, **extra):
        """This rank's stream (``extra``: e.g. ``pieces``, the rest of an epoch). Cached features:
        images are checked, not decoded (the same samples)."""
        return make_loader(self.cfg.data, transform=None if self.cfg.data.feature_cache else self.transform,
                           tokenize=self.tokenize, seed=self.cfg.train.seed, rank=self.rank, world_size=self.world,
                           image_output=self.image_output, pin_memory=self.pin_memory, **extra)

    def stream(self) -> Iterator[dict]:
        """Every stream item from the current position on. An epoch begun under another layout
        (``pieces``) is finished first by a loader over its remaining pieces."""
        if self.pieces is not None:
            loader = self.current = self.make_loader(pieces=self.pieces)
            if self.batch_in_epoch < loader.num_batches:
                items = loader.epochs(self.epoch, self.batch_in_epoch)
                try:
                    for item in items:
                        yield item
                        if loader.position == loader.num_batches:
                            break
                finally:
                    items.close()
            self.epoch, self.batch_in_epoch, self.pieces = self.epoch + 1, 0, None
        self.current = self.loader
        yield from self.loader.epochs(self.epoch, self.batch_in_epoch)

    def groups(self, accum: int) -> Iterator[list[Batch]]:
        """Lists of ``accum`` micro-batches forever, the position tracked as they are taken. One
        stream spans all epochs: the loader's workers live for the whole run and prefetch across
        epoch boundaries."""
        group: list[Batch] = []
        for item in self.stream():
            self.epoch, self.batch_in_epoch = item["epoch"], item["index"] + 1
            for kind, n in item.get("skipped", {}).items():
                self.skipped[kind] = self.skipped.get(kind, 0) + n
            group.append(self.batch(item))
            if len(group) == accum:
                yield group
                group = []

    def batch(self, item: dict) -> Batch:
        """The Batch of a stream item: its images and tokens, or with a feature cache the cached
        stem outputs of its sample ids."""
        if self.features is None:
            return Batch.from_stream(item)
        image, text = self.features.lookup(item["sample_id"])
        return Batch(image=image, text=text, sample_id=item["sample_id"], features=True)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's position: the epoch and batches of it taken, the epoch's size, the pieces
        of the epoch this rank has not consumed, its skip counts; rank 0 also the pieces of an
        epoch begun under another layout (the same on every rank)."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "epoch_batches": self.current.num_batches,
                "epoch_pieces": self.pieces if self.rank == 0 else None,
                "rest": self.current.rest_of_epoch(self.epoch), "skipped": dict(self.skipped)}

    def load_state_dict(self, ranks: list[dict]) -> None:
        """Continue from every rank's saved entry (rank order; `relayout` writes them for this
        run's ranks after a layout change)."""
        mine = ranks[self.rank]
        self.epoch, self.batch_in_epoch = mine["epoch"], mine["batch_in_epoch"]
        self.pieces, self.skipped = ranks[0].get("epoch_pieces"), dict(mine.get("skipped") or {})


# ---------------------------------------------------------------------- a changed layout
def sum_skipped(ranks: list[dict]) -> dict[str, int]:
    """Skip counts by kind, summed over ranks' dicts, in kind order."""
    total: dict[str, int] = {}
    for counts in ranks:
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
    return dict(sorted(total.items()))


def relayout(saved: dict, cfg: Config, world_size: int) -> list[dict]:
    """The data entries of this run's ranks after a layout change: the same global position
    (split mode: the rest of the epoch as pieces every rank's rest adds up to, read under the new
    layout; resampled: the position in samples), and the skip counts summed on rank 0."""
    data, old_cfg = saved["data"], saved["config"]
    epoch, batch_in_epoch, pieces = data[0]["epoch"], data[0]["batch_in_epoch"], None
    if batch_in_epoch >= (data[0].get("epoch_batches") or batch_in_epoch + 1):  # the epoch was complete
        epoch, batch_in_epoch = epoch + 1, 0
    elif old_cfg["data"]["mode"] == "resampled":  # with replacement: carry the position in samples
        batch_in_epoch = batch_in_epoch * global_batch(old_cfg, len(data), 1) // global_batch(cfg, world_size, 1)
    elif any(d.get("rest") is None for d in data):
        raise ConfigError("resume: this checkpoint does not record the rest of its epoch (written "
                          "before vlp saved it); resume it with the old layout")
    else:
        pieces = [tuple(piece) for d in data for piece in d["rest"]]
        batch_in_epoch = 0
        if sum(end - begin for _, begin, end in pieces) < global_batch(cfg, world_size, 1):
            epoch, pieces = epoch + 1, None  # less than one batch per rank
    skipped = [d.get("skipped") or {} for d in data]
    if len(skipped) != world_size:
        skipped = [sum_skipped(skipped)] + [{}] * (world_size - 1)
    return [{"epoch": epoch, "batch_in_epoch": batch_in_epoch, "epoch_pieces": pieces if r == 0 else None,
             "skipped": skipped[r]} for r in range(world_size)]
