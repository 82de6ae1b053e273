"""A train step with no host read, replayed as CUDA graphs (`train.cuda_graphs: true`).

    step = StaticStep(trainer)     # the Trainer's step when train.cuda_graphs is on
    metrics = step(micro_batches)  # what Trainer.train_step returns, the same weights to 1e-6

The step is a function of static buffers and device tensors with no host read, as the table
in docs/performance.md ("Small per-GPU batches") tells part by part: inputs copied into one
buffer set (and one graph) per trimmed text length, a 0-d device lr per group that the
scheduler fills in place, a non-finite loss setting `found_inf` (all-reduced inside the graph)
so fused AdamW leaves weights and moments bit-untouched, and skip counters read on `sync` steps
only (log, checkpoint, eval and the last step). A stateful loss's rows are looked up before
the step into a static buffer (`hold`) and committed after it.

On CPU (and with `capture=False`) the same function runs eagerly with the same buffers, device lr
and masked skip: that is what the CPU tests compare with Trainer.train_step. On CUDA the first
`WARMUP_STEPS` steps run eagerly on the capture's side stream (real steps; DDP needs 11 before a
capture), then each text length is captured once and replayed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from vlp.distributed import all_reduce
from vlp.losses.diagnostics import DeviceScalars
from vlp.train.step import contrastive_backward, trimmed_texts

WARMUP_STEPS = 11  # eager steps before the first capture (PyTorch's CUDA graphs notes: DDP needs 11)


def static_step(trainer) -> Optional["StaticStep"]:
    """The step train.cuda_graphs asks for (None: the Trainer's eager step). Only CUDA captures:
    elsewhere one ConfigError line (the config's own conflicts are refused by vlp.config)."""
    if not trainer.cfg.train.cuda_graphs:
        return None
    device = trainer.accelerator.device
    if device.type != "cuda":
        from vlp.config import ConfigError

        raise ConfigError(f"config: train.cuda_graphs=true needs a CUDA device (this run trains on "
                          f"{device.type}): set train.cuda_graphs=false")
    return StaticStep(trainer)


def _same(x):
    return x


class StaticStep:
    """The Trainer's step without host reads (module docstring); `trainer` owns every part."""

    def __init__(self, trainer, capture: Optional[bool] = None):
        self.t = trainer
        self.device = trainer.accelerator.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.found_inf = torch.zeros((), device=self.device)  # 1.0: this step's loss is not finite on some rank
        # skipped steps: since the last sync, in a row now, the longest run since the last sync
        self.skips = torch.zeros(3, device=self.device)
        self.buffers: dict = {}  # text length -> static micro-batches
        self.graphs: dict = {}  # text length -> (CUDAGraph, its metrics)
        self.pool = None  # the graphs' shared memory pool
        self.eager_steps = 0
        self.held_rows = None  # a stateful loss's static (b, width) buffer of old rows
        self.started = False

    # ------------------------------------------------------------------ host side
    def start(self) -> None:
        """Once, after a resume: the lr as device tensors, the optimizer's found_inf."""
        opt = self.t.torch_optimizer
        dtype = torch.float32 if self.device.type == "cuda" else torch.float64  # CPU: the float lr exactly
        for group in opt.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=dtype, device=self.device)
        opt.found_inf = self.found_inf  # fused AdamW skips its update where it is 1 (as under GradScaler)
        self.started = True

    def __call__(self, micro_batches: list) -> dict:
        t = self.t
        if not self.started:
            self.start()
        if not (t.train_mode_set and t.model.training):
            t.model.train()
            t.train_mode_set = True
        length, static = self.fill(t.data.feed(micro_batches))
        metrics = self.run(length, static)
        if t.loss_spec.stateful:  # its state moves on the host: the one read of the flag
            t.loss.commit() if self.found_inf.item() == 0 else t.loss.discard()
        t.samples_seen += t.global_batch
        t.scheduler.step()  # fills the device lr in place
        t.step += 1
        lr = t.scheduler.base_lrs[0] * t.scheduler.lr_lambdas[0](t.scheduler.last_epoch)
        if self.is_sync_step():
            if self.sync():
                return {"nonfinite": 1.0, "lr": lr}
        elif t.world > 1:  # no signal agreed between syncs: Preemption.should_stop makes no collective
            t.preemption.agree(0.0)
        return metrics.plus(lr=lr) if isinstance(metrics, DeviceScalars) else {**metrics, "lr": lr}

    def fill(self, batches: list) -> tuple[int, list]:
        """Copy the micro-batches into this text length's static buffers; (length, buffers)."""
        t = self.t
        features = batches[0].features
        prepare = None if features else t.data.device_images
        images = [b.image if prepare is None else prepare(b.image) for b in batches]
        texts = trimmed_texts(batches, t.unwrapped.trim_text)  # as the eager step trims them
        length = texts[0].shape[1]
        static = self.buffers.get(length)
        if static is None:  # one image buffer for all lengths, one token buffer per length
            shared = next(iter(self.buffers.values()), None) or [
                replace(b, image=torch.empty_like(x, device=self.device)) for b, x in zip(batches, images)]
            static = self.buffers[length] = [replace(s, text=torch.empty_like(y, device=self.device))
                                             for s, y in zip(shared, texts)]
        for s, x, y in zip(static, images, texts):
            s.image.copy_(x, non_blocking=True)
            s.text.copy_(y, non_blocking=True)
        static = [replace(s, sample_id=b.sample_id) for s, b in zip(static, batches)]  # host-side ids
        if t.loss_spec.stateful:
            self.hold_rows(torch.cat([b.sample_id for b in batches]))
        return length, static

    def hold_rows(self, ids: torch.Tensor) -> None:
        """The stateful loss's old rows of this step's anchors, into one static device buffer."""
        loss = self.t.loss
        if self.held_rows is None or self.held_rows.shape[0] != ids.numel():
            self.held_rows = torch.empty(ids.numel(), loss.WIDTH, device=self.device)
        loss.hold(ids, self.device, self.held_rows)

    def is_sync_step(self) -> bool:
        """A step whose records need the device counters: logged, checkpointed, evaluated, last."""
        t, c = self.t, self.t.cfg.train
        return (t.step % c.log_every == 0 or t.step >= t.total_steps
                or any(every and t.step % every == 0 for every in (c.checkpoint_every, c.eval_every)))

    def sync(self) -> bool:
        """Read the skip counters (one transfer) into the Trainer's, agree on a preemption
        signal (one all-reduce at > 1 rank); whether the last step was skipped. The Trainer's
        nonfinite_in_row becomes the longest run of skips since the last sync."""
        t = self.t
        total, in_row, longest = self.skips.tolist()
        self.skips[0], self.skips[2] = 0, in_row  # fills: no read
        t.nonfinite_total += int(total)
        t.nonfinite_in_row = int(longest)  # max_nonfinite sees a run that ended between syncs too
        if t.world > 1:
            t.preemption.agree(all_reduce(torch.full((1,), t.preemption.local_flag(), device=self.device)).item())
        return in_row > 0

    # ------------------------------------------------------------------ device side
    def run(self, length: int, static: list):
        """This step on the device: replayed when captured, else eager (then captured once warm)."""
        if length in self.graphs:
            graph, metrics = self.graphs[length]
            graph.replay()
            return metrics
        opt = self.t.optimizer
        if not self.capture or self.eager_steps < WARMUP_STEPS:
            self.eager_steps += 1
            opt.zero_grad(set_to_none=True)  # a replay's gradients are no eager step's
            with on_capture_stream(self.device, self.capture):
                metrics = self.device_step(static)
            opt.zero_grad(set_to_none=True)
            return metrics
        for group in self.t.torch_optimizer.param_groups:
            group["capturable"] = True  # fused AdamW under capture (its state is on the device already)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device),
                              capture_error_mode="thread_local"):  # loader threads may pin memory meanwhile
            # the graphs share one set of gradients: None before the first capture (allocated in
            # its pool), zeroed inside every later one (0 + g == g: the same step)
            opt.zero_grad(set_to_none=False)
            metrics = self.device_step(static)
        self.pool = graph.pool()
        self.graphs[length] = (graph, metrics)
        graph.replay()  # capture only recorded: this step runs now
        return metrics

    def device_step(self, static: list):
        """Backward of the loss, clipping, the optimizer step masked by found_inf, the clamp: no
        host read (capturable). Returns the loss's metrics (device scalars)."""
        t = self.t
        checked = []
        _, metrics = contrastive_backward(t.model, t.strategy, t._loss, static, self.device, _same,
                                          lambda loss: checked.append(loss.detach()) or True)
        bad = (~torch.isfinite(checked[0])).any().float()
        if t.world > 1:
            bad = (all_reduce(bad.reshape(1)) > 0).float().reshape(())
        self.found_inf.copy_(bad)
        in_row = (self.skips[1] + bad) * bad
        self.skips.copy_(torch.stack([self.skips[0] + bad, in_row, torch.maximum(self.skips[2], in_row)]))
        t.strategy.finish_grads(t.model, t.cfg.optim.grad_clip)
        t.optimizer.step()
        t.temperature.clamp_(t.unwrapped.log_logit_scale)
        return metrics


_STREAMS: dict = {}


def capture_stream(device) -> Optional["torch.cuda.Stream"]:
    """The one side stream of a CUDA device on which DDP is built, the warm-up steps run and the
    step is captured (NVIDIA's checklist: DDP and the first backward on the capture's side stream,
    not the default stream); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _STREAMS.setdefault(device, torch.cuda.Stream(device))


class on_capture_stream:
    """Run a block on `capture_stream(device)` (it waits for the current stream, which waits for
    it afterwards); a no-op off CUDA or when `on` is false."""

    def __init__(self, device, on: bool = True):
        self.stream = capture_stream(device) if on else None

    def __enter__(self):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self.ctx = torch.cuda.stream(self.stream)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.stream is not None:
            self.ctx.__exit__(*exc)
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
