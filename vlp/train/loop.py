"""The training loop: it conducts the parts, each of which owns its state.

    Trainer(cfg).train()     # same code on 1 CPU process, N GPUs, several nodes

    train() -> train_step(micro_batches) -> compute_gradients -> the loss over the gathered batch

The parts: `TrainData` (the stream and its position, vlp.data.train_data), the parallel strategy
(DDP or FSDP2: wrap, no_sync, gradient finish, full model, the weights' checkpoint format;
vlp.train.strategy), the LR `Schedule` (vlp.train.optim), the loss from
the registry (vlp.losses.registry), the `Evaluator` and the `RunLogger`. Each part that owns
state registers it with the `Checkpointer` (vlp.checkpoint.checkpointer), which saves and resumes
them without calling back into the loop.

One optimizer step sees `accum_steps` micro-batches per rank; the contrastive batch is
per_device × world × accum (docs/design.md, "Gather and gradient scale" and "Accumulation").
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, set_seed

from vlp import records
from vlp.checkpoint import lock as runlock, storage
from vlp.checkpoint.checkpointer import PER_RANK, RANK_FILES, Checkpointer
from vlp.config import Config, global_batch, steps_for
from vlp.data.lifecycle import WorkerDied
from vlp.data.train_data import Batch, TrainData, relayout, sum_skipped
from vlp.distributed import (all_reduce, barrier, exit_with_launcher, gather_object, gather_with_grad, is_main,
                             positive_offset)
from vlp.eval import keys
from vlp.losses.diagnostics import DeviceScalars
from vlp.losses.registry import get_spec
from vlp.models.model import DualEncoder, build_model
from vlp.train import parallel, preempt
from vlp.eval.evaluator import Evaluator
from vlp.train.feature_cache import training_features
from vlp.train.logger import RunLogger, show_step
from vlp.train.memory import StepMemory
from vlp.train.optim import Schedule, build_optimizer, param_groups
from vlp.train.parts import RNG, Counters
from vlp.train.static_step import static_step
from vlp.train.step import contrastive_backward
from vlp.train.strategy import make_strategy


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v))


class Trainer:
    step, samples_seen, nonfinite_total = _counter("step"), _counter("samples_seen"), _counter("nonfinite_total")

    def __init__(self, cfg: Config, accelerator: Optional[Accelerator] = None):
        self.cfg = cfg
        self.accelerator = acc = accelerator or Accelerator(
            mixed_precision="no" if cfg.train.precision == "fp32" else cfg.train.precision,
            # a collective waits at most this long for a dead rank, then fails with an error
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.train.dist_timeout_s)),
                             # no bucket rebuild after the first backward: a resumed process sums its
                             # gradients in the same order as the uninterrupted one (at >= 3 ranks a
                             # gloo/NCCL sum depends on it; bench/many_ranks.py --only rounding)
                             DistributedDataParallelKwargs(find_unused_parameters=True)],
        )
        exit_with_launcher()
        # the run folder: a local path or a bucket URL, checked before any work (vlp.checkpoint.storage);
        # the run's records go there (main process; a train.wandb_project without wandb is refused now)
        self.folder = storage.open_run_folder(cfg.train.output_dir)
        self.logger = RunLogger(self.folder, is_main(), cfg.train.wandb_project, cfg.to_dict())
        self.evaluator = Evaluator(cfg, self.folder)  # reads the eval suite now: a bad one fails before any build
        set_seed(cfg.train.seed)
        self.world, self.accum = acc.num_processes, cfg.train.accum_steps
        self.global_batch = global_batch(cfg, self.world)
        self.counters = Counters()
        schedule_steps = steps_for(cfg.train.samples, self.global_batch)  # total_steps before any resume
        # the LR schedule's (step, total) in steps of the current global batch: a resume with another
        # global batch (train.resume_mode=continue) keeps it continuous
        lr_position = lambda: (steps_for(self.samples_seen, self.global_batch), schedule_steps)  # noqa: E731
        self.nonfinite_in_row = 0
        self.peak_step_bytes: Optional[int] = None  # of this process's second step (run_steps, vlp.train.memory)
        self.train_mode_set = False  # train_step has called model.train() (see there)
        if self.total_steps < 1:
            raise ValueError(f"train.samples={cfg.train.samples} is smaller than one global batch "
                             f"({cfg.data.batch_per_device} per device x {self.world} processes x {self.accum} accum)")
        # the model, its temperature policy and the train transform (data.train_transform), chosen once
        model, self.tokenizer, self.train_transform, self.eval_transform = build_model(cfg.model, cfg.loss,
                                                                                       data_cfg=cfg.data)
        self.data = TrainData(cfg, self.train_transform, self.tokenizer, acc.process_index, self.world,
                              device=acc.device)  # workers ship uint8, the device finishes (vlp.data.train_data)
        self.loss_spec = get_spec(cfg.loss.name)  # stateful: per-sample state, checkpointed
        self.loss = self.loss_spec.build(cfg.loss, self.data.num_samples, self.total_steps)
        self.temperature = model.temperature  # build_model's policy: gradient routing and clamp of logit_scale
        if cfg.data.feature_cache:  # LiT: the locked stems' outputs once per sample, reused every epoch
            self.data.features = training_features(cfg, model, self.train_transform, self.tokenizer,
                                                   self.data.loader.plan, acc.device)
        self.preemption = preempt.Preemption()  # installed by train(); agreed on in _finite
        self.strategy = make_strategy(cfg, acc)
        # fused AdamW: one kernel over all parameters (1.3x end-to-end on CPU, BENCHMARKS.md)
        self.model, self.optimizer = self.strategy.prepare(model, lambda m: build_optimizer(
            param_groups(m, cfg.optim.weight_decay), cfg.optim, acc.device.type))
        self.torch_optimizer = self.strategy.torch_optimizer
        # not prepared: Accelerate would step it once per process
        self.scheduler = Schedule(self.torch_optimizer, cfg.optim, lr_position)
        self.checkpoints = self.checkpointer(cfg, acc)
        self.static_step = static_step(self)  # train.cuda_graphs: the step without host reads, else None

    def checkpointer(self, cfg: Config, acc: Accelerator) -> Checkpointer:
        """The checkpointer of train.output_dir/checkpoints, with every part that owns state, in
        the order they load: model and optimizer (the strategy, in its format), counters, LR schedule
        (which then follows this config: it reads the counters), the loss's per-sample state, the
        AMP scaler, each rank's data position and RNG."""
        facts = {"config": cfg.to_dict(), "world_size": self.world, "preprocess": dict(self.unwrapped.preprocess)}
        checkpoints = Checkpointer(self.folder.sub("checkpoints"), self.strategy, cfg.train.keep_last, facts, self.print)
        checkpoints.register("train", self.counters)
        checkpoints.register("scheduler", self.scheduler)
        if self.loss_spec.stateful:  # per-sample state sharded by rank (SogCLR's u): one file per rank
            checkpoints.register("loss", self.loss, RANK_FILES)
        if acc.scaler is not None:
            checkpoints.register("scaler", acc.scaler)
        checkpoints.register("data", self.data, PER_RANK, relayout)
        checkpoints.register("rng", RNG(cfg.train.seed, acc.process_index), PER_RANK)
        return checkpoints

    @property
    def total_steps(self) -> int:
        """Steps taken + those the rest of train.samples makes (the same all run long, resumed or not)."""
        return self.step + steps_for(self.cfg.train.samples - self.samples_seen, self.global_batch)

    @property
    def unwrapped(self) -> DualEncoder:
        if getattr(self, "_unwrapped", None) is None:  # accelerate's unwrap walks the modules
            self._unwrapped = self.strategy.unwrap(self.model)
        return self._unwrapped

    @property
    def skipped(self) -> dict[str, int]:
        return self.data.skipped

    # ------------------------------------------------------------------ step
    def _loss(self, img_local, txt_local, scale, bias, ids):
        img_global = gather_with_grad(img_local)
        txt_global = gather_with_grad(txt_local)
        offset = positive_offset(img_local.shape[0], img_global.shape[0])
        return self.loss(img_local, txt_local, img_global, txt_global, scale, bias,
                         offset=offset, scale_grad=self.temperature.scale_grad, ids=ids)

    def compute_gradients(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, dict]:
        """Backward of the global loss over all micro-batches (vlp.train.step); returns
        (loss, metrics), metrics empty when the loss is not finite on some rank."""
        return contrastive_backward(self.model, self.strategy, self._loss, micro_batches, self.accelerator.device,
                                    self.unwrapped.trim_text, self._finite, prepare=self.data.device_images)

    def _finite(self, loss: torch.Tensor) -> bool:
        """All ranks agree whether the loss is finite and (same all-reduce, the step's one host
        sync) whether any rank got a preemption signal (kept for Preemption.should_stop)."""
        bad = (~torch.isfinite(loss.detach())).any().float().reshape(1).to(self.accelerator.device)
        flags = torch.cat([bad, torch.full((1,), self.preemption.local_flag(), device=bad.device)])
        nonfinite, signalled = (all_reduce(flags) if self.world > 1 else flags).tolist()
        self.preemption.agree(signalled)
        return nonfinite == 0

    def _any_rank(self, flag: torch.Tensor) -> bool:
        bad = flag.float().reshape(1).to(self.accelerator.device)
        return bool(all_reduce(bad).item() != 0) if self.world > 1 else bool(bad.item() != 0)

    def train_step(self, micro_batches: list[Batch]) -> dict:
        if self.static_step is not None:  # train.cuda_graphs (vlp.train.static_step)
            return self.static_step(micro_batches)
        # train() walks every module (a cost per step for a small head); the first call also puts
        # locked towers in eval mode (DualEncoder.train), which a freshly built model is not in
        if not (self.train_mode_set and self.model.training):
            self.model.train()
            self.train_mode_set = True
        loss, metrics = self.compute_gradients(self.data.feed(micro_batches))  # to the device (CUDA)
        finite = bool(metrics)  # decided once, on all ranks, by compute_gradients
        if finite:
            self.strategy.finish_grads(self.model, self.cfg.optim.grad_clip)
            self.optimizer.step()
            self.loss.commit()  # a stateful loss's per-sample state of this step (collective)
            self.nonfinite_in_row = 0
        else:
            self.loss.discard()
            self.nonfinite_in_row += 1
            self.nonfinite_total += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += self.global_batch
        self.scheduler.step()
        self.temperature.clamp_(self.unwrapped.log_logit_scale)
        self.step += 1
        lr = self.scheduler.get_last_lr()[0]  # diagnostics stay on the device until logged (global_metrics)
        if not finite:
            return {"nonfinite": 1.0, "lr": lr}
        return metrics.plus(lr=lr) if isinstance(metrics, DeviceScalars) else {**metrics, "lr": lr}

    def global_skipped(self) -> dict[str, int]:
        """Skipped samples by kind, summed over ranks (each rank's already sums its workers).
        A collective: every rank calls it."""
        if self.world == 1:
            return dict(self.skipped)
        return sum_skipped(gather_object([dict(self.skipped)]))

    def global_metrics(self, metrics) -> dict:
        """Average per-rank diagnostics (each a mean over that rank's anchors) into global ones
        (logging steps only: one collective, one transfer)."""
        if self.world == 1 or not isinstance(metrics, DeviceScalars):  # host values: the same on all ranks
            return dict(metrics)
        values = all_reduce(metrics.tensor.detach().to(torch.float64), op="mean").tolist()
        return {**dict(zip(metrics.names, values)), **metrics.host}

    # ------------------------------------------------------------------ state
    def weights_finite(self) -> bool:
        """Whether every parameter is finite, agreed by all ranks (a collective)."""
        return not self._any_rank(torch.stack([(~torch.isfinite(parallel.local(p.detach()))).any()
                                               for p in self.model.parameters()]).any())

    def save_checkpoint(self) -> str:
        """Write this step's checkpoint (collective). Weights with nan/inf are never written:
        FloatingPointError names the checkpoint to use instead."""
        if not self.weights_finite():
            raise FloatingPointError(f"model weights are not finite at step {self.step}: no checkpoint written; "
                                     f"{self.checkpoints.newest_valid()}")
        path = self.checkpoints.save(self.step)
        self.logger.flush()  # a bucket's log.jsonl keeps up with its checkpoints
        return path

    def stop_nonfinite(self) -> str:
        """The message for a run stopped by non-finite losses, after saving the last good state:
        skipped steps leave the weights as they were, so they are saved when finite."""
        head = f"{self.nonfinite_in_row} non-finite losses in a row at step {self.step}"
        if self.weights_finite():
            path = self.save_checkpoint()
            return (f"{head}; saved the last good weights to {path} (lower optim.lr or set optim.grad_clip, "
                    "then resume with train.resume=latest)")
        return f"{head}; the weights are not finite, nothing saved; {self.checkpoints.newest_valid()}"

    def maybe_resume(self) -> None:
        """Resume from train.resume: the checkpointer loads every part and says what changed (the
        counters decide the steps left, total_steps; the schedule makes the optimizer follow this config)."""
        found = self.checkpoints.resume(self.cfg.train.resume, self.cfg)
        if found is not None:
            (path, _), d = found, self.data
            self.print(f"[vlp] resumed from {path} at step {self.step}, {self.samples_seen} samples seen (epoch "
                       f"{d.epoch}, batch {d.batch_in_epoch}{' of its rest under the new layout' if d.pieces else ''})")

    # ------------------------------------------------------------------ eval and output
    def eval_model(self) -> Optional[DualEncoder]:
        """The model to evaluate or export on the main process (a collective under FSDP; None
        on the other ranks there)."""
        return self.strategy.full_model(self.model, lambda: build_model(self.cfg.model, self.cfg.loss)[0])

    def evaluate(self) -> dict:
        """Zero-shot retrieval / classification on the main process; a flat dict of floats."""
        if not self.evaluator.has_tasks:
            return {}
        model = self.eval_model()  # collective under FSDP
        flat: dict = {}
        if is_main():
            self.model.eval()
            flat = self.evaluator.run(model, self.tokenizer, self.eval_transform, self.step, self.accelerator.device)
            self.model.train()
        barrier()
        return flat

    def print(self, *args) -> None:
        if is_main():
            print(*args, flush=True)

    def _log_step(self, metrics: dict, bar) -> None:
        metrics = self.global_metrics(metrics)
        now, (t_last, step_last) = time.time(), self._last_log
        sps = (self.step - step_last) * self.global_batch / max(now - t_last, 1e-9)
        self._last_log = (now, self.step)
        kind = records.NONFINITE if "nonfinite" in metrics else records.TRAIN
        self.logger.log({"type": kind, "step": self.step, "samples_seen": self.samples_seen, "epoch": self.data.epoch,
                         "samples_per_s": sps, **metrics,
                         **{f"skipped_{k}": v for k, v in self.global_skipped().items()}})
        show_step(bar, metrics, sps)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        """One writer per run folder (a lock), SIGTERM/SIGUSR1/SIGINT saved at the next step boundary."""
        lock = runlock.acquire_on_main(self.folder, self.cfg.train.break_lock, is_main(), self.print)
        with contextlib.ExitStack() as leave:  # undone last to first, each whatever the others raised
            leave.callback(self.folder.close)  # a bucket's temp folder (stage, downloads) goes
            if lock is not None:
                leave.callback(lock.release)
            leave.callback(self.checkpoints.close)  # a bucket: the upload in flight ends (its error raised)
            self.preemption = leave.enter_context(preempt.Preemption())  # its handlers: restored first
            try:
                return self._train()
            except WorkerDied as e:  # a loader worker died on its own (OOM killer, segfault): one line
                raise WorkerDied(f"{e}, at step {self.step}; not saved: the checkpoints written before are "
                                 "intact, resume with train.resume=latest (docs/reliability.md)") from e

    def _train(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        if is_main():  # the folder's config.yaml: this run's, once a resume has accepted it
            self.logger.save_config(cfg)
        self.print(f"[vlp] loss={cfg.loss.name} temperature={cfg.loss.temperature} "
                   f"global batch={self.global_batch} (= {cfg.data.batch_per_device} per device x {self.world} "
                   f"processes x {self.accum} accum) steps={self.total_steps} device={self.accelerator.device}")
        t_start = time.time()
        self.run_steps()
        train_time = time.time() - t_start
        if cfg.train.save_final:
            self.save_checkpoint()
        return self.finish(train_time)

    def run_steps(self) -> None:
        """Steps until total_steps, with logging, checkpoints and evaluation on their schedules."""
        from tqdm.auto import tqdm

        t = self.cfg.train
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not is_main(), dynamic_ncols=True, mininterval=1.0)
        self._last_log = (time.time(), self.step)
        groups = self.data.groups(self.accum)
        try:  # the bar ends its line and the loader workers stop, also on an error
            first = self.step
            while self.step < self.total_steps:
                batches = next(groups)
                if self.step - first == min(1, self.total_steps - first - 1):  # a step with optimizer state:
                    held = (self.unwrapped, self.torch_optimizer, *(t for b in batches for t in b.tensors()))
                    with StepMemory(self.accelerator.device, held) as mem:  # its peak tensor memory, for result.json
                        metrics = self.train_step(batches)
                    self.peak_step_bytes = mem.peak_bytes
                else:
                    metrics = self.train_step(batches)
                bar.update(1)
                is_last = self.step == self.total_steps
                logged = self.step % t.log_every == 0
                if logged or is_last:
                    self._log_step(metrics, bar)
                if "nonfinite" in metrics and not logged:
                    self.logger.log({"type": records.NONFINITE, "step": self.step, "samples_seen": self.samples_seen,
                                     **metrics})
                if self.nonfinite_in_row >= t.max_nonfinite:
                    raise FloatingPointError(self.stop_nonfinite())
                if t.checkpoint_every and self.step % t.checkpoint_every == 0 and not is_last:
                    self.save_checkpoint()
                if t.eval_every and self.step % t.eval_every == 0 and not is_last:
                    self.logger.log({"type": records.EVAL, "step": self.step,
                                     **{keys.EVAL_PREFIX + k: v for k, v in self.evaluate().items()}})
                if self.preemption.should_stop(self.accelerator.device) and not is_last:  # agreed in _finite
                    raise self.preemption.stopped(self.step, self.save_checkpoint(), is_main())
        finally:
            bar.close()
            groups.close()

    def finish(self, train_time: float) -> dict:
        """The export, the final evaluation and result.json."""
        if self.cfg.train.save_final:
            final = self.eval_model()  # collective under FSDP (full_state_dict gather)
            if is_main():
                from vlp.models.model import export_open_clip

                with self.folder.file("open_clip_model.pt") as path:
                    export_open_clip(final, path)
        last_eval = self.evaluate()
        result = {"step": self.step, "samples_seen": self.samples_seen, "train_time_s": train_time,
                  "global_batch": self.global_batch, "nonfinite_steps": self.nonfinite_total,
                  "peak_step_mem_mb": None if self.peak_step_bytes is None else self.peak_step_bytes / 2**20,
                  "skipped": self.global_skipped(), **{keys.EVAL_PREFIX + k: v for k, v in last_eval.items()}}
        if is_main():
            self.logger.log({"type": records.RESULT, **{k: v for k, v in result.items() if not isinstance(v, dict)}})
            self.logger.write_result(result)
        self.logger.close()
        return result
