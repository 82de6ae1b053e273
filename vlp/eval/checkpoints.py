"""`vlp eval`: load a checkpoint (ours or an open_clip file) or published open_clip weights (a
pretrained tag or hf-hub name), run an eval suite, write reports."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from vlp.config import ConfigError, LossConfig, ModelConfig, from_dict
from vlp.locations import is_local, is_url
from vlp.checkpoint.storage import open_run_folder
from vlp.checkpoint import files as ckpt


def load_model_from_checkpoint(path: str, model_name: Optional[str] = None, device: str = "cpu"):
    """(model, tokenizer, eval_transform) from a vlp `step_*.pt` file or `step_*/` DCP directory
    (train.parallel=fsdp), or an open_clip state-dict file."""
    from vlp.models.model import build_model, state_dict_mismatch

    # DCP dir or file, checked against its checksum manifest (a damaged one is refused by name)
    state, verified = (load_sharded_full(path), True) if Path(path).is_dir() else ckpt.load_checked(path)
    if not isinstance(state, dict):
        raise ckpt.CheckpointError(f"{path} is not a checkpoint: it holds a {type(state).__name__}, not a dict of weights")
    if "model" in state and "config" in state:  # a vlp training checkpoint
        model_cfg = from_dict(state["config"]["model"], ModelConfig, "model.")
        loss_cfg = from_dict(state["config"]["loss"], LossConfig, "loss.")
        weights = state["model"]
    else:  # open_clip checkpoint: {"state_dict": ...} or a bare state dict
        if model_name is None:
            raise ConfigError("vlp eval: --model is required for an open_clip checkpoint (no vlp config inside)")
        model_cfg, loss_cfg = ModelConfig(), LossConfig()
        weights = state.get("state_dict", state)
        if not isinstance(weights, dict) or not all(isinstance(k, str) for k in weights):
            raise ckpt.CheckpointError(f"{path} is not a model state dict (no name -> tensor mapping)")
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    ckpt.check_finite(weights, path)  # metrics of nan weights would be silently meaningless
    if model_name is not None:
        model_cfg.name = model_name
    model, tokenizer, _, eval_tf = build_model(model_cfg, loss_cfg, device=device, init_weights=False)
    if "config" not in state and getattr(model.clip, "logit_bias", None) is None:
        # an open_clip file says nothing of its loss; a sigmoid-loss model's bias adds the same
        # constant to every logit, so no rank (retrieval, zero-shot) depends on it: not loaded
        weights = {k: v for k, v in weights.items() if k != "logit_bias"}
    preprocess = state.get("preprocess") or state.get("preprocess_cfg")
    if preprocess:  # the tower's preprocessing as trained, not the config's default
        from vlp.models.towers import transforms

        model.preprocess = dict(preprocess)
        eval_tf = transforms(model.preprocess)[1]
    try:
        model.clip.load_state_dict(weights)
    except (RuntimeError, TypeError, AttributeError) as e:
        hint = " (drop --model to use the checkpoint's own)" if model_name and "config" in state else ""
        raise ckpt.CheckpointError(f"checkpoint {path} does not fit model '{model_cfg.name}'{hint}: "
                                   f"{state_dict_mismatch(e)}") from None
    model.eval()
    if not verified:  # from before checksums: one warning; vlp's own without them: refused
        ckpt.unverified(path, state)
    return model, tokenizer, eval_tf


def load_sharded_full(path: str | Path) -> dict:
    """A DCP folder read whole by one process, shaped like a .pt checkpoint without the
    optimizer: its meta plus the full model weights under open_clip's names."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    meta = ckpt.load_valid(path)
    model = ckpt.read_dcp(path, "cannot be read",
                          lambda: _load_state_dict_from_keys({"model"}, checkpoint_id=Path(path)))["model"]
    return {**meta, "model": {k.removeprefix("clip."): v for k, v in model.items()}}


def load_published(model_name: str, pretrained: Optional[str], device: str = "cpu"):
    """(model, tokenizer, eval_transform) of an open_clip model with published weights: a
    pretrained tag of `model_name` or hf-hub:org/repo (from the Hugging Face cache; offline once
    cached), or `model_name` hf-hub:org/repo with its own weights. Preprocessing: the tag's or
    the repository's (vlp.models.model.build_model)."""
    from vlp.models.model import build_model, model_config_dict

    if not pretrained and not model_name.startswith("hf-hub:"):
        raise ConfigError("vlp eval: --model needs --pretrained (a tag, hf-hub:org/name or a file), "
                          "unless it is hf-hub:org/name")
    # a sigmoid-loss model (SigLIP) carries a logit bias: its config says so with init_logit_bias
    loss = LossConfig(name="siglip") if "init_logit_bias" in model_config_dict(model_name) else LossConfig()
    model, tokenizer, _, eval_tf = build_model(ModelConfig(name=model_name, pretrained=pretrained), loss,
                                               device=device)
    return model.eval(), tokenizer, eval_tf


def _is_dir(path: str, flag: str) -> bool:
    """Path.is_dir, with the OS errors it passes on (a name over 255 bytes, a symlink loop, no
    permission) as one ValueError line naming the flag."""
    import os

    try:
        return Path(path).is_dir()
    except OSError as e:
        raise ValueError(f"{flag} {_clip(path)}: {os.strerror(e.errno) if e.errno else e}") from None


def _clip(path: str, limit: int = 120) -> str:
    return path if len(path) <= limit else path[:limit - 3] + "..."


def build_suite(suite: Optional[str], shards: Optional[str], imagenet: Optional[str], templates: str,
                batch_size: int, precision: str, classes: Sequence[str] = (), wds: Sequence[str] = ()) -> dict:
    """The suite `vlp eval` runs: --suite's file plus one entry per --shards, --imagenet, --classes
    (a class-folder set) and --wds (a CLIP_benchmark webdataset folder) given."""
    from vlp.eval.suite import check_suite, load_suite, wds_entry

    spec = load_suite(suite) if suite else {}
    spec.setdefault("batch_size", batch_size)
    spec.setdefault("precision", {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}[precision])
    if shards:
        spec.setdefault("retrieval", []).append({"name": "retrieval", "shards": shards})
    if imagenet:
        if not _is_dir(imagenet, "--imagenet"):
            raise FileNotFoundError(f"ImageNet val folder not found: {imagenet}")
        spec.setdefault("classification", []).append({"name": "imagenet", "root": imagenet, "templates": templates})
    for folder in classes:
        if not _is_dir(folder, "--classes"):
            raise FileNotFoundError(f"--classes: no such folder: {folder}")
        spec.setdefault("classification", []).append(
            {"name": Path(folder).resolve().name, "type": "folder", "root": folder, "templates": templates})
    for root in wds:
        task, entry = wds_entry(root)
        spec.setdefault(task, []).append(entry)
    if not spec.get("retrieval") and not spec.get("classification"):
        raise ConfigError("vlp eval: nothing to evaluate: give --shards, --imagenet, --classes, --wds or --suite")
    return check_suite(spec)


def evaluate_checkpoint(checkpoint: Optional[str] = None, model_name: Optional[str] = None,
                        suite: Optional[str] = None, shards: Optional[str] = None, imagenet: Optional[str] = None,
                        templates: str = "openai", out_dir: Optional[str] = None, batch_size: int = 256,
                        precision: str = "fp32", device: Optional[str] = None, pretrained: Optional[str] = None,
                        classes: Sequence[str] = (), wds: Sequence[str] = ()) -> dict:
    """Run the suite on a vlp / open_clip checkpoint file (`checkpoint`, or `pretrained` as a
    file) or on published weights (`model_name` + `pretrained` tag / hf-hub name). Results go to
    out_dir (default: eval/ beside the checkpoint, else runs/eval/<model>)."""
    from vlp.eval.suite import run_eval_suite

    spec = build_suite(suite, shards, imagenet, templates, batch_size, precision, classes, wds)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if checkpoint and pretrained:
        raise ConfigError("vlp eval: give --checkpoint or --pretrained, not both")
    if pretrained and (is_url(pretrained) or Path(pretrained).exists()):
        checkpoint, pretrained = pretrained, None
    if checkpoint:
        with local_checkpoint(checkpoint) as path:  # a bucket's download is removed once loaded
            model, tokenizer, eval_tf = load_model_from_checkpoint(path, model_name, device)
        default = f"{checkpoint.rstrip('/').rsplit('/', 1)[0]}/eval" if is_url(checkpoint) else None
        out_dir = out_dir or default or str(Path(checkpoint).resolve().parent / "eval")
    elif model_name:
        model, tokenizer, eval_tf = load_published(model_name, pretrained, device)
        out_dir = out_dir or str(Path("runs", "eval", f"{model_name}-{pretrained or 'hub'}".replace("/", "_")))
    else:
        raise ConfigError("vlp eval: give --checkpoint FILE, or --model NAME with --pretrained TAG|hf-hub:...|FILE")
    if not is_url(out_dir):
        with StopBetweenBatches() as stop:
            return run_eval_suite(model, tokenizer, eval_tf, spec, device, out_dir, stop=stop)
    folder = open_run_folder(out_dir, option="vlp eval --out")  # written locally, then uploaded
    with StopBetweenBatches() as stop:
        results = run_eval_suite(model, tokenizer, eval_tf, spec, device, str(folder.local_dir("")), stop=stop)
    folder.sync_dir("")
    folder.close()
    return results


class StopBetweenBatches:
    """Ctrl-C while `vlp eval` runs its suite: SIGINT sets a flag that the suite reads before every
    task and batch (`stop()` raises KeyboardInterrupt there: vlp.cli's one line, status 130), as
    Python's own handler raises wherever the main thread is, also where the exception is printed
    and dropped (a worker's fork, a finalizer). A second Ctrl-C raises at once. Off the main thread
    it installs nothing."""

    def __init__(self):
        self.count, self.previous = 0, None

    def __enter__(self) -> "StopBetweenBatches":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __call__(self) -> None:
        if self.count:
            raise KeyboardInterrupt


@contextlib.contextmanager
def local_checkpoint(checkpoint: str) -> Iterator[str]:
    """A local path for --checkpoint while the block runs: the path itself, or for a URL (s3://,
    gs://) a download with its per-rank files, removed when the block ends (a checkpoint verifies
    itself: vlp.checkpoint.files)."""
    if is_local(checkpoint):
        yield checkpoint.removeprefix("file://")
        return
    from vlp.checkpoint.storage import RunFolder
    from vlp.checkpoint.checkpointer import fetch

    folder, name = RunFolder.of(checkpoint)
    try:
        yield str(fetch(folder, name))
    finally:
        folder.close()  # the download folder ($TMPDIR/vlp-run-PID-*) goes
