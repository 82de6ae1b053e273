"""The training loop: the only module that touches the Accelerator.

    Trainer(cfg).train()     # same code on 1 CPU process, N GPUs, several nodes

One optimizer step (`train_step`) sees `accum_steps` micro-batches per rank; the contrastive
batch is per_device × world × accum (every micro-batch's anchors meet every other's features,
see compute_gradients). Features are gathered across ranks with
autograd (vlp.distributed), every anchor is contrasted with the global batch, and DDP averages
the per-rank gradients, which equals the gradient of the global mean loss.

`train.parallel=fsdp` shards the model instead (vlp.train.parallel, FSDP2): the reduce-scatter averages
like DDP, checkpoints are DCP directories (each rank writes its shards), and evaluation and the
final export use the full weights gathered on the main process.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, gather_object, set_seed

from data_pipelines.messages import first_line
from eval import keys
from vlp.train import checkpoint as ckpt
from vlp import records
from vlp.train import parallel, resume
from vlp.config import Config, ConfigError, save_config
from vlp.distributed import exit_with_launcher, gather_with_grad, positive_offset
from vlp.losses import get_loss
from vlp.models.model import DualEncoder, build_model
from vlp.train.optim import build_optimizer
from vlp.models.temperature import temperature_policy


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases, norms, gains and logit_scale/bias (open_clip rule)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def optimizer_param_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in the order `param_groups` hands them to AdamW: name i is parameter i of
    a torch optimizer state dict (to load a replicated .pt checkpoint's optimizer under FSDP)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in param_groups(model, 0.0) for p in group["params"]]


def lr_multiplier(step: int, total: int, warmup: int, schedule: str, cooldown: int = 0) -> float:
    """LR factor at `step` (0-based): linear warmup, then cosine to 0 / constant / constant + linear cooldown."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "const-cooldown":
        start = total - cooldown
        return 1.0 if step < start else max(0.0, (total - step) / max(1, cooldown))
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, cfg: Config, accelerator: Optional[Accelerator] = None):
        self.cfg = cfg
        self.accelerator = accelerator or Accelerator(
            mixed_precision="no" if cfg.train.precision == "fp32" else cfg.train.precision,
            # a collective waits at most this long for a dead rank, then fails with an error
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.train.dist_timeout_s))],
        )
        acc = self.accelerator
        exit_with_launcher()
        if cfg.train.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("config: train.wandb_project is set but wandb is not installed (pip install wandb)")
        set_seed(cfg.train.seed)
        self.world = acc.num_processes
        self.accum = cfg.train.accum_steps
        self.global_batch = cfg.data.batch_per_device * self.world * self.accum
        self.total_steps = cfg.train.samples // self.global_batch
        self.samples_seen = 0  # global samples in the steps taken (true across layout changes)
        if self.total_steps < 1:
            raise ValueError(
                f"train.samples={cfg.train.samples} is smaller than one global batch "
                f"({cfg.data.batch_per_device} per device x {self.world} processes x {self.accum} accum)"
            )
        model, self.tokenizer, self.train_transform, self.eval_transform = build_model(cfg.model, cfg.loss)
        self.train_loader = self.make_train_loader()  # validates the shard spec before any work
        self.eval_suite()  # and the eval suite file: a malformed one fails now, not after training
        self.sharded = cfg.train.parallel == "fsdp"
        if acc.distributed_type == DistributedType.FSDP:
            raise ConfigError("the accelerate launch config sets distributed_type: FSDP, which vlp does not use: "
                              "launch with a plain multi-GPU config (launch/fsdp.yaml) and set train.parallel=fsdp")
        if self.sharded:  # before the optimizer: FSDP2 replaces the parameters by DTensor shards
            model = self.shard(model)
        self.loss_fn = self.make_loss_fn()  # sogclr: stateful (per-sample normalisers)
        self.temperature = temperature_policy(cfg.loss)  # gradient routing and clamp of logit_scale
        # fused AdamW: one kernel over all parameters (1.3x end-to-end on CPU, BENCHMARKS.md)
        optimizer = build_optimizer(param_groups(model, cfg.optim.weight_decay), cfg.optim, acc.device.type)
        o = cfg.optim
        # the schedule follows samples seen (in steps of the current global batch), so a resume
        # with another global batch (train.resume_mode=continue) keeps it continuous
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda _: lr_multiplier(self.samples_seen // self.global_batch,
                                               cfg.train.samples // self.global_batch,
                                               o.warmup_steps, o.schedule, o.cooldown_steps)
        )
        if cfg.train.compile:
            model = torch.compile(model)
        # The scheduler is not prepared: Accelerate would step it once per process.
        self.torch_optimizer = optimizer  # not Accelerate's wrapper: DCP state dicts need the optimizer itself
        if self.sharded:  # already parallel (Accelerate would add DDP); the optimizer steps plain
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)
        self.out_dir = Path(cfg.train.output_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.epoch_pieces = None  # the rest of an epoch begun under another layout (vlp.train.resume)
        self.data_loader = self.train_loader  # the loader the current epoch comes from
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        self.skipped: dict[str, int] = {}
        self._log_file = None
        self._tb = None
        self._wandb = None

    def shard(self, model: DualEncoder) -> DualEncoder:
        """train.parallel=fsdp: FSDP2 over all ranks (vlp.train.parallel). The project shards the model
        itself because Accelerate cannot on CPU; Accelerate keeps the launch and the process group."""
        if self.world < 2:
            raise ConfigError("config: train.parallel=fsdp needs >= 2 processes (accelerate launch); "
                              "one process trains with train.parallel=ddp")
        device = self.accelerator.device
        return parallel.apply_fsdp(model.to(device), device.type, self.cfg.train.precision)

    def make_loss_fn(self):
        """The loss callable; SogCLR's keeps one normaliser per training sample and direction,
        indexed by the stream's sample_id (the shard list's size) and committed after each step."""
        loss = self.cfg.loss
        self.loss_state = None  # a stateful loss (checkpointed, committed after each step)
        if loss.name != "sogclr":
            return get_loss(loss.name)
        from vlp.losses.sogclr import SogCLRLoss

        state = self.loss_state = SogCLRLoss(sum(self.train_loader.plan.sizes), loss.gamma, loss.gamma_min,
                                             loss.gamma_schedule, self.total_steps)
        return lambda *args, **kwargs: state(*args, ids=self._sample_ids, **kwargs)

    def no_sync(self):
        """Keep a non-last micro-step's gradients local: DDP's no_sync, or FSDP2's
        set_requires_gradient_sync(False)."""
        return parallel.no_grad_sync(self.model) if self.sharded else self.accelerator.no_sync(self.model)

    # ------------------------------------------------------------------ data
    @property
    def unwrapped(self) -> DualEncoder:
        return self.accelerator.unwrap_model(self.model)

    def make_train_loader(self, **extra):
        """This rank's training stream (``extra``: e.g. ``pieces``, the rest of an epoch)."""
        from data_pipelines.stream import make_loader

        d = self.cfg.data
        return make_loader(
            d.train_shards, batch_size=d.batch_per_device, transform=self.train_transform,
            tokenize=self.tokenizer, seed=self.cfg.train.seed, rank=self.accelerator.process_index,
            world_size=self.world, num_workers=d.num_workers, mode=d.mode, shuffle_buffer=d.shuffle_buffer,
            decode_size=d.decode_size, **({"weights": d.weights} if d.weights else {}), **extra,
            num_samples=d.num_samples, io_retries=d.io_retries, io_backoff_s=d.io_backoff_s,
        )

    def stream(self):
        """Every batch from the current position on. An epoch begun under another layout
        (``epoch_pieces``, vlp.train.resume) is finished first by a loader over its remaining pieces."""
        if self.epoch_pieces is not None:
            loader = self.data_loader = self.make_train_loader(pieces=self.epoch_pieces)
            if self.batch_in_epoch < loader.num_batches:
                batches = loader.epochs(self.epoch, self.batch_in_epoch)
                try:
                    for batch in batches:
                        yield batch
                        if loader.position == loader.num_batches:
                            break
                finally:
                    batches.close()
            self.epoch, self.batch_in_epoch, self.epoch_pieces = self.epoch + 1, 0, None
        self.data_loader = self.train_loader
        yield from self.train_loader.epochs(self.epoch, self.batch_in_epoch)

    def batches(self):
        """Yield lists of `accum` micro-batches forever, tracking the stream position
        (epoch, batches of it consumed). One stream spans all epochs: the loader's workers
        live for the whole run and prefetch across epoch boundaries."""
        group = []
        for batch in self.stream():
            self.epoch, self.batch_in_epoch = batch.pop("epoch"), batch.pop("index") + 1
            for kind, n in batch.get("skipped", {}).items():
                self.skipped[kind] = self.skipped.get(kind, 0) + n
            group.append(batch)
            if len(group) == self.accum:
                yield group
                group = []

    # ------------------------------------------------------------------ step
    def _loss(self, img_local, txt_local, scale, bias):
        img_global = gather_with_grad(img_local)
        txt_global = gather_with_grad(txt_local)
        offset = positive_offset(img_local.shape[0], img_global.shape[0])
        return self.loss_fn(
            img_local, txt_local, img_global, txt_global, scale, bias,
            offset=offset, scale_grad=self.temperature.scale_grad,
        )

    def compute_gradients(self, micro_batches: list[dict]) -> tuple[torch.Tensor, dict]:
        """Backward of the global loss over all micro-batches; returns (loss, metrics), metrics
        empty when the loss is not finite on some rank (then nothing was backpropagated).

        k = 1: one forward/backward. k > 1 (GradCache / open_clip accum_freq): embed every
        micro-batch without grad, then re-embed each with grad against the cached features of
        the others; micro-batch j's backward gives exactly the global loss's gradient w.r.t. its
        own features. logit_scale/bias get their gradient once (in the last micro-step). DDP
        syncs only on the last backward.
        """
        dev = self.accelerator.device
        images = [b["image"].to(dev, non_blocking=True) for b in micro_batches]
        # drop all-padding text columns on the host (no device sync; exact, see DualEncoder)
        trim = self.unwrapped.trim_text
        texts = [trim(b["text"]).to(dev, non_blocking=True) for b in micro_batches]
        k = len(micro_batches)
        if self.loss_state is not None:  # a stateful loss: the ids of all local anchors
            self._sample_ids = torch.cat([b["sample_id"] for b in micro_batches])
        if k == 1:
            out = self.model(images[0], texts[0])
            loss, metrics = self._loss(out.image_emb, out.text_emb, out.logit_scale, out.logit_bias)
            if not self._finite(loss):
                return loss, {}
            self.accelerator.backward(loss)
            return loss, metrics
        with torch.no_grad():
            cached = [self.model(x, t) for x, t in zip(images, texts)]
        img_cache = [c.image_emb for c in cached]
        txt_cache = [c.text_emb for c in cached]
        # the non-finite check is made on the no-grad loss so every micro-step agrees
        with torch.no_grad():
            c0 = cached[0]
            loss0, _ = self._loss(torch.cat(img_cache), torch.cat(txt_cache), c0.logit_scale, c0.logit_bias)
        if not self._finite(loss0):
            return loss0, {}
        for j in range(k):
            last = j == k - 1
            ctx = contextlib.nullcontext() if last else self.no_sync()
            with ctx:
                out = self.model(images[j], texts[j])
                img = torch.cat(img_cache[:j] + [out.image_emb] + img_cache[j + 1:])
                txt = torch.cat(txt_cache[:j] + [out.text_emb] + txt_cache[j + 1:])
                scale = out.logit_scale if last else out.logit_scale.detach()
                bias = out.logit_bias
                if bias is not None and not last:
                    bias = bias.detach()
                loss, metrics = self._loss(img, txt, scale, bias)
                self.accelerator.backward(loss)
        return loss, metrics

    def _finite(self, loss: torch.Tensor) -> bool:
        """All ranks agree on whether the loss is finite (so DDP never waits on a skipped rank)."""
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        if self.world > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        return bool(bad.item() == 0)

    def train_step(self, micro_batches: list[dict]) -> dict:
        self.model.train()
        loss, metrics = self.compute_gradients(micro_batches)
        finite = bool(metrics)  # decided once, on all ranks, by compute_gradients
        if finite:
            if self.sharded:  # the 0-d parameters FSDP leaves replicated get DDP's average here
                parallel.sync_replicated_grads(self.model)
            if self.cfg.optim.grad_clip and self.sharded:  # one norm over sharded and replicated grads
                parallel.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            elif self.cfg.optim.grad_clip:
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.optimizer.step()
            if self.loss_state is not None:  # SogCLR's u of this step's samples (collective)
                self.loss_state.commit()
            self.nonfinite_in_row = 0
        else:
            self.nonfinite_in_row += 1
            self.nonfinite_total += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += self.global_batch
        self.scheduler.step()
        self.temperature.clamp_(self.unwrapped.log_logit_scale)
        self.step += 1
        metrics = dict(metrics) if finite else {"nonfinite": 1.0}
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def global_skipped(self) -> dict[str, int]:
        """Skipped samples by kind, summed over ranks (each rank's already sums its workers).
        A collective: every rank calls it."""
        if self.world == 1:
            return dict(self.skipped)
        total: dict[str, int] = {}
        for counts in gather_object([dict(self.skipped)]):
            for kind, n in counts.items():
                total[kind] = total.get(kind, 0) + n
        return dict(sorted(total.items()))

    def global_metrics(self, metrics: dict) -> dict:
        """Average per-rank metrics (each a mean over that rank's anchors) into global ones."""
        if self.world == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self.accelerator.device)
        values = self.accelerator.reduce(values, reduction="mean")
        return dict(zip(keys, values.tolist()))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The replicated checkpoint (step_N.pt, train.parallel=ddp): full model and optimizer state
        plus `meta_state`. Under FSDP the tensors go to a DCP directory instead (save_checkpoint)."""
        return {"model": self.unwrapped.clip.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.meta_state()}

    def meta_state(self) -> dict:
        """Everything but the model and optimizer tensors (position, counters, per-rank RNG, config,
        LR schedule): one dict for both checkpoint formats, beside the weights in a .pt and as
        meta.pt in a DCP directory. A collective (gathers per-rank state)."""
        # what differs by rank, in one gather: RNG, skip counts, and the pieces of the epoch this
        # rank has not consumed (vlp.train.resume finishes them under another layout)
        mine = {"rng": ckpt.rng_state(), "skipped": dict(self.skipped),
                "rest": self.data_loader.rest_of_epoch(self.epoch)}
        ranks = gather_object([mine]) if self.world > 1 else [mine]
        state = {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples_seen": self.samples_seen,
            "world_size": self.world,
            "nonfinite_total": self.nonfinite_total,
            "skipped": dict(self.skipped),  # this rank's; every rank's below
            "skipped_per_rank": [r["skipped"] for r in ranks],
            "rng": [r["rng"] for r in ranks],
            "config": self.cfg.to_dict(),
            "preprocess": dict(self.unwrapped.preprocess),  # the tower's image preprocessing, for vlp eval
            "epoch_pieces": self.epoch_pieces,
            "epoch_batches": self.data_loader.num_batches,
            "data_rest": [r["rest"] for r in ranks],
        }
        if self.accelerator.scaler is not None:
            state["scaler"] = self.accelerator.scaler.state_dict()
        if self.loss_state is not None:  # SogCLR's per-sample u (replicated on every rank)
            state["loss_state"] = self.loss_state.state_dict()
        return state

    def load_state_dict(self, state: dict, path: str = "the checkpoint") -> None:
        changed = resume.check_resume(state, self.cfg, self.world, str(path))  # refuses by name
        self.load_weights(state, path)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.loss_state is not None and "loss_state" in state:
            self.loss_state.load_state_dict(state["loss_state"])
        if "scaler" in state and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.samples_seen = state.get("samples_seen", self.step * self.global_batch)
        self.nonfinite_total = state.get("nonfinite_total", 0)
        self.skipped = ckpt.rank_skipped(state, self.accelerator.process_index, self.world)
        rank = self.accelerator.process_index
        if not changed:
            self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
            self.epoch_pieces = state.get("epoch_pieces")
            ckpt.set_rng_state(state["rng"][rank])
        else:  # train.resume_mode=continue: the same global sample position, new layout
            where = resume.position_after_change(state, self.cfg, self.world)
            self.epoch, self.batch_in_epoch, self.epoch_pieces = where.epoch, where.batch, where.pieces
            set_seed(self.cfg.train.seed + rank)  # fresh per-rank RNG (dropout etc.)
        self.total_steps = self.step + (self.cfg.train.samples - self.samples_seen) // self.global_batch

    def load_weights(self, state: dict, path) -> None:
        """Model and optimizer state from either format into either parallelism. `state` is a .pt
        checkpoint (full tensors) or a DCP directory's meta (the tensors are read from `path`,
        resharded by DCP to this run's layout). A collective under FSDP or for a DCP directory."""
        if "model" not in state:  # DCP directory
            target = parallel.sharded_state(self.unwrapped, self.torch_optimizer)
            ckpt.load_sharded(target, path)
            parallel.set_sharded_state(self.unwrapped, self.torch_optimizer, target)
        elif self.sharded:  # replicated .pt under FSDP: every rank reads it whole, keeps its shards
            model = {f"clip.{k}": v for k, v in state["model"].items()}
            optim = parallel.name_keyed_optimizer_state(state["optimizer"], optimizer_param_names(self.model))
            parallel.set_full_state(self.model, self.torch_optimizer, model, optim)
        else:
            self.unwrapped.clip.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

    def weights_finite(self) -> bool:
        """Whether every parameter is finite, agreed by all ranks (a collective)."""
        bad = torch.stack([(~torch.isfinite(parallel.local(p.detach()))).any() for p in self.model.parameters()]).any()
        bad = bad.float().reshape(1).to(self.accelerator.device)
        if self.world > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        return bool(bad.item() == 0)

    def newest_valid_checkpoint(self) -> str:
        """For messages: the checkpoint a user should resume from, in words."""
        try:
            found = ckpt.latest_valid(self.ckpt_dir)
        except ckpt.CheckpointError:
            found = None
        return f"the last valid checkpoint is {found[0]}" if found else f"no valid checkpoint exists in {self.ckpt_dir}"

    def save_checkpoint(self) -> Optional[Path]:
        """Write step_N.pt (main process) and prune old ones. Weights with nan/inf are never
        written: FloatingPointError names the checkpoint to use instead."""
        if not self.weights_finite():
            raise FloatingPointError(f"model weights are not finite at step {self.step}: no checkpoint written; "
                                     f"{self.newest_valid_checkpoint()}")
        if self.sharded:  # every rank writes its own shards (DCP), rank 0 the meta and the rename
            path = self.ckpt_dir / f"step_{self.step:08d}"
            ckpt.save_sharded(parallel.sharded_state(self.model, self.torch_optimizer), self.meta_state(), path)
            if self.accelerator.is_main_process:
                ckpt.prune(self.ckpt_dir, self.cfg.train.keep_last)
            self.accelerator.wait_for_everyone()
            return path
        state = self.state_dict()  # collective: every rank takes part
        path = None
        if self.accelerator.is_main_process:
            path = self.ckpt_dir / f"step_{self.step:08d}.pt"
            ckpt.atomic_save(state, path)
            ckpt.prune(self.ckpt_dir, self.cfg.train.keep_last)
        self.accelerator.wait_for_everyone()
        return path

    def stop_nonfinite(self) -> str:
        """The message for a run stopped by non-finite losses, after saving the last good state:
        skipped steps leave the weights as they were, so they are saved when finite."""
        head = f"{self.nonfinite_in_row} non-finite losses in a row at step {self.step}"
        if self.weights_finite():
            path = self.save_checkpoint() or self.ckpt_dir / f"step_{self.step:08d}.pt"
            return (f"{head}; saved the last good weights to {path} (lower optim.lr or set optim.grad_clip, "
                    "then resume with train.resume=latest)")
        return f"{head}; the weights are not finite, nothing saved; {self.newest_valid_checkpoint()}"

    def clean_checkpoint_dir(self) -> None:
        """Remove temp files of killed saves (main process), saying so."""
        if self.accelerator.is_main_process:
            for tmp in ckpt.remove_stale_temps(self.ckpt_dir):
                self.print(f"[vlp] removed {tmp.name}: temp file of a checkpoint save that was killed")

    def find_resume_checkpoint(self) -> Optional[tuple[Path, dict]]:
        """(path, state) to resume from. resume=latest falls back past checkpoints that do not
        load or check (ckpt.check_state): each is renamed to *.corrupt (kept, never resumed from
        again nor overwritten) and named in the log."""
        resume = self.cfg.train.resume
        if resume != "latest":
            return Path(resume), ckpt.load_valid(resume)
        found = ckpt.latest_valid(self.ckpt_dir)
        self.accelerator.wait_for_everyone()  # every rank has read its file before one is renamed
        if found is None:
            return None
        path, state, rejected = found
        for bad, reason in rejected:
            if self.accelerator.is_main_process:
                kept = ckpt.set_aside(bad)
                self.print(f"[vlp] skipped {reason}; kept as {kept.name}; falling back to {path.name}")
        return path, state

    def maybe_resume(self) -> None:
        self.clean_checkpoint_dir()
        if not self.cfg.train.resume:
            return
        found = self.find_resume_checkpoint()
        if found is None:
            self.print(f"[vlp] resume=latest: no checkpoint in {self.ckpt_dir}, starting fresh")
            return
        path, state = found
        try:
            self.load_state_dict(state, path)
        except (RuntimeError, KeyError, ValueError) as e:  # parameters or optimizer groups differ
            if isinstance(e, ConfigError):
                raise
            changes = ckpt.changed_settings(state.get("config"), self.cfg.to_dict())
            why = "; ".join(changes) if changes else first_line(e)
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this run ({why}): resume needs the same "
                                       "model and loss; use a new train.output_dir to start over") from None
        self.print(f"[vlp] resumed from {path} at step {self.step}, {self.samples_seen} samples seen "
                   f"(epoch {self.epoch}, batch {self.batch_in_epoch}"
                   f"{' of its rest under the new layout' if self.epoch_pieces else ''})")

    # ------------------------------------------------------------------ eval
    def eval_suite(self) -> dict:
        """data.eval_shards as the 'heldout' retrieval set, plus eval.suite's tasks."""
        suite = {"batch_size": self.cfg.eval.batch_size, "retrieval": [], "classification": []}
        if self.cfg.eval.suite:
            from eval.suite import load_suite

            extra = load_suite(self.cfg.eval.suite)
            suite.update({k: v for k, v in extra.items() if k not in ("retrieval", "classification")})
            suite["retrieval"] += extra.get("retrieval") or []
            suite["classification"] += extra.get("classification") or []
        if self.cfg.data.eval_shards:
            suite["retrieval"].insert(0, {"name": keys.HELDOUT, "shards": self.cfg.data.eval_shards})
        return suite

    def eval_model(self) -> Optional[DualEncoder]:
        """The model to evaluate or export on the main process: the replica under DDP; under FSDP
        a full copy gathered from the shards (a collective; None on the other ranks)."""
        if not self.sharded:
            return self.unwrapped
        full = parallel.full_model_state(self.model)
        if not self.accelerator.is_main_process:
            return None
        with torch.random.fork_rng(devices=[]):  # its init draws random weights: keep the training RNG
            model = build_model(self.cfg.model, self.cfg.loss)[0]
        model.load_state_dict(full)
        return model.to(self.accelerator.device).eval()

    def evaluate(self) -> dict:
        """Zero-shot retrieval / classification on the main process; a flat dict of floats.

        The 'heldout' set's metrics keep their plain names (image_to_text_R@1, ...); other
        tasks are prefixed with their name (imagenet/top1, ...).
        """
        suite = self.eval_suite()
        if not suite["retrieval"] and not suite["classification"]:
            return {}
        flat: dict = {}
        model = self.eval_model()  # collective under FSDP
        if self.accelerator.is_main_process:
            from eval.suite import run_eval_suite

            self.model.eval()
            results = run_eval_suite(model, self.tokenizer, self.eval_transform, suite,
                                     self.accelerator.device, out_dir=str(self.out_dir / f"eval_step{self.step}"),
                                     show_progress=False)
            self.model.train()
            for name, res in results.items():
                flat.update({keys.task_key(k, name): v for k, v in res["metrics"].items()})
                if "n_images" in res:
                    flat[keys.task_key(keys.NUM_IMAGES, name)] = res["n_images"]
                    flat[keys.task_key(keys.CHANCE_R1, name)] = 1.0 / res["n_images"]
        self.accelerator.wait_for_everyone()
        return flat

    # ------------------------------------------------------------------ logging
    def print(self, *args) -> None:
        if self.accelerator.is_main_process:
            print(*args, flush=True)

    def log(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        if self._log_file is None:
            self._log_file = open(self.out_dir / "log.jsonl", "a")
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        self._log_file.write(json.dumps(record) + "\n")
        self._log_file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
        if self.cfg.train.wandb_project:
            if self._wandb is None:
                import wandb  # present: __init__ refused train.wandb_project without it

                self._wandb = wandb.init(project=self.cfg.train.wandb_project, config=self.cfg.to_dict(),
                                         dir=str(self.out_dir))
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def _log_step(self, metrics: dict, bar) -> None:
        metrics = self.global_metrics(metrics)
        now, (t_last, step_last) = time.time(), self._last_log
        sps = (self.step - step_last) * self.global_batch / max(now - t_last, 1e-9)
        self._last_log = (now, self.step)
        kind = records.NONFINITE if "nonfinite" in metrics else records.TRAIN
        self.log({"type": kind, "step": self.step, "samples_seen": self.samples_seen, "epoch": self.epoch,
                  "samples_per_s": sps, **metrics, **{f"skipped_{k}": v for k, v in self.global_skipped().items()}})
        bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}",
                        infonce=f"{metrics.get('infonce', float('nan')):.3f}",
                        scale=f"{metrics.get('logit_scale', float('nan')):.1f}", sps=f"{sps:.0f}", refresh=False)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / "config.yaml")
        self.maybe_resume()
        self.print(
            f"[vlp] loss={cfg.loss.name} temperature={cfg.loss.temperature} "
            f"global batch={self.global_batch} (= {cfg.data.batch_per_device} per device x {self.world} "
            f"processes x {self.accum} accum) steps={self.total_steps} device={acc.device}"
        )
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, disable=not acc.is_main_process,
                   dynamic_ncols=True, mininterval=1.0)
        t_start = time.time()
        self._last_log = (t_start, self.step)
        data = self.batches()
        try:  # the bar ends its line and the loader workers stop, also on an error
            while self.step < self.total_steps:
                metrics = self.train_step(next(data))
                bar.update(1)
                is_last = self.step == self.total_steps
                if self.step % cfg.train.log_every == 0 or is_last:
                    self._log_step(metrics, bar)
                if "nonfinite" in metrics and not self.step % cfg.train.log_every == 0:
                    self.log({"type": records.NONFINITE, "step": self.step, "samples_seen": self.samples_seen,
                              **metrics})
                if self.nonfinite_in_row >= cfg.train.max_nonfinite:
                    raise FloatingPointError(self.stop_nonfinite())
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0 and not is_last:
                    self.save_checkpoint()
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and not is_last:
                    self.log({"type": records.EVAL, "step": self.step,
                              **{keys.EVAL_PREFIX + k: v for k, v in self.evaluate().items()}})
        finally:
            bar.close()
            data.close()
        train_time = time.time() - t_start
        self.save_checkpoint()
        final = self.eval_model()  # collective under FSDP (full_state_dict gather)
        if acc.is_main_process:
            from vlp.models.model import export_open_clip

            export_open_clip(final, self.out_dir / "open_clip_model.pt")
        last_eval = self.evaluate()
        result = {"step": self.step, "samples_seen": self.samples_seen, "train_time_s": train_time,
                  "global_batch": self.global_batch, "nonfinite_steps": self.nonfinite_total,
                  "skipped": self.global_skipped(), **{keys.EVAL_PREFIX + k: v for k, v in last_eval.items()}}
        if acc.is_main_process:
            self.log({"type": records.RESULT, **{k: v for k, v in result.items() if not isinstance(v, dict)}})
            (self.out_dir / "result.json").write_text(json.dumps(result, indent=2))
        if self._log_file:
            self._log_file.close()
        if self._tb:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        return result
