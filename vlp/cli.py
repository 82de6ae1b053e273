"""`vlp shards | train | eval | compare | demo` — thin argument parsing over the library.

Errors a user can fix (bad config, missing path, bad data) print one line
`vlp: error: ...` and exit 2; set VLP_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import sys

from vlp.config import ConfigError, parse_overrides
from vlp.experiment import load_config

USER_ERRORS = (ConfigError, FileNotFoundError, NotADirectoryError, ValueError, FloatingPointError,
               FileExistsError, IsADirectoryError, PermissionError)


class _Once(argparse.Action):
    """Store an option's value; giving the option a second time is refused in one line
    (argparse would keep the last value without a word: `vlp eval --out a --out b` writes to b)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", {})  # dest -> the first value given
        if self.dest in given and self.option_strings:  # (a positional is argparse's to fill)
            raise ConfigError(f"{'/'.join(self.option_strings)} is given twice ({given[self.dest]!r} and "
                              f"{values!r}): give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """vlp's parsers: every single-valued option is given at most once (_Once); repeatable
    options say so with action="append"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.name=flatnce data.batch_per_device=32")


def _local_only(value, option: str, hint: str) -> None:
    """Refuse a URL (s3://, gs://, ...) for an option that writes local files, in one line
    (never a local folder named 's3:')."""
    from vlp.locations import is_local

    if not is_local(value):
        raise ConfigError(f"{option} {value}: a URL is not supported here, only a local folder ({hint})")


def cmd_shards(args) -> int:
    from vlp.data.write import shards_from_source

    _local_only(args.out, "vlp shards OUT", "write the shards locally, then copy them to the bucket; "
                "training reads s3:// and gs:// shards directly")

    summary = shards_from_source(
        args.source, args.out, samples_per_shard=args.samples_per_shard, image_ext=args.image_format,
        jpeg_quality=args.jpeg_quality, resize_longest=args.resize_longest, workers=args.workers,
        split=args.split, prefix=args.prefix, image_column=args.image_column,
        caption_column=args.caption_column, separator=args.separator, overwrite=args.overwrite,
    )
    print(summary)
    return 0


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides, once=True)  # config errors come before torch's import
    if not cfg.data.train_shards:
        raise ConfigError("config: data.train_shards is empty: give a shard spec (see `vlp shards`)")
    from vlp.distributed import cpu_when_launched_without_gpu
    from vlp.train.loop import Trainer
    from vlp.train.preempt import Preempted

    cpu_when_launched_without_gpu()  # plain torchrun on CPU: one gloo group, not N lone runs
    trainer, stop = Trainer(cfg), None
    try:
        # no rank tears the process group down while another still talks to it, and no
        # collective's leftover (in an autograd cycle) outlives the group: either can make gloo
        # abort the process at exit ("terminate called without an active exception")
        try:
            result = trainer.train()
        except Preempted as e:  # every rank stopped after the same step; its frames hold that step's
            stop = e.with_traceback(None)  # tensors and collectives: let them go before the group
        gc.collect()
        trainer.accelerator.wait_for_everyone()  # preempted too: a rank that ended first aborted (SLURM test)
    finally:
        trainer.accelerator.end_training()
    if stop is not None:
        raise stop
    if trainer.accelerator.is_main_process:
        _print_eval(result)
    return 0


def cmd_eval(args) -> int:
    from vlp.eval.checkpoints import evaluate_checkpoint

    results = evaluate_checkpoint(
        checkpoint=args.checkpoint, model_name=args.model, suite=args.suite, shards=args.shards,
        imagenet=args.imagenet, templates=args.templates, out_dir=args.out, batch_size=args.batch_size,
        precision=args.precision, device=args.device, pretrained=args.pretrained, classes=args.classes,
        wds=args.wds,
    )
    from vlp.eval.report import markdown_tables

    print(markdown_tables(results))
    return 0


def cmd_compare(args) -> int:
    from vlp.study.compare import DEFAULT_CONFIG, load_compare_config, run_grid

    base, grid = load_compare_config(args.config or DEFAULT_CONFIG, args.overrides, quick=args.quick, once=True)
    if args.status or args.cancel:  # the grid's scheduler jobs: nothing trains, nothing is submitted
        from vlp.executors.batch import scheduler_of
        from vlp.executors.status import cancel_study, study_status

        scheduler = scheduler_of(grid)
        print(study_status(grid, scheduler) if args.status else
              f"vlp: cancelled {cancel_study(grid, scheduler)} job(s) of {grid.out_dir}")
        return 0
    result = run_grid(base, grid, report_only=args.report_only)
    if grid.executor != "local":  # a scheduler's failed cells: the report is written, the status says so
        from vlp.executors.status import exit_on_failures

        line = exit_on_failures(result["sweep"] + result["final"] + result["price"])
        if line:
            print(f"vlp: error: {line}", file=sys.stderr)
            return 1
    return 0


def cmd_demo(args) -> int:
    from vlp.demo import run_demo

    _local_only(args.out, "vlp demo --out", "the demo writes its shards and runs locally")
    parse_overrides(args.overrides, once=True)  # each key once, before any shard is written
    run_demo(out_dir=args.out, overrides=args.overrides, config=args.config)
    return 0


def _print_eval(result: dict) -> None:
    from vlp.eval.keys import EVAL_PREFIX

    names = [k for k in result if k.startswith(EVAL_PREFIX)]
    if names:
        print("eval (fractions in [0, 1]): " + "  ".join(
            f"{k.removeprefix(EVAL_PREFIX)}={result[k]:.4g}" for k in names if isinstance(result[k], (int, float))))


def _add_shards(sub) -> None:
    p = sub.add_parser("shards", help="write webdataset shards from a source of image-text pairs")
    p.add_argument("source", help="a packaged data set: 'openmoji', 'openclipart' or 'material_icons' (optionally "
                   ":<px>, the render size; docs/datasets.md), an image folder with .txt sidecars, "
                   "a .csv/.tsv, a .parquet, or a Hugging Face datasets directory")
    p.add_argument("out", help="output folder for {prefix}-NNNNNN.tar and sizes.json")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--image-format", choices=["png", "jpg"], default=None,
                   help="re-encode images (default: keep source bytes where possible)")
    p.add_argument("--jpeg-quality", type=int, default=None, help="re-encode JPEGs at this quality (default: keep bytes)")
    p.add_argument("--resize-longest", type=int, default=None, help="resize so the longest side is at most N px")
    p.add_argument("--workers", type=int, default=0, help="parallel encoding processes (0: in-process)")
    p.add_argument("--split", choices=["train", "eval", "all", "fit", "val", "test"], default="all",
                   help="(packaged data sets) which split to write: fit + val = train, test = eval")
    p.add_argument("--prefix", default="shard", help="shard file name prefix")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing {prefix}-*.tar shards in OUT (default: refuse, nothing is touched)")
    p.add_argument("--image-column", default=None, help="CSV/parquet/HF image column (default: filepath / image)")
    p.add_argument("--caption-column", default=None, help="CSV/parquet/HF caption column (default: title / text)")
    p.add_argument("--separator", default=None, help="CSV separator (default: tab, as open_clip)")
    p.set_defaults(func=cmd_shards)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a dual encoder from a YAML config")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="zero-shot retrieval / classification of a checkpoint or published model",
                       description="Metrics are printed and written to metrics.md in percent, to metrics.json "
                       "as fractions in [0, 1].")
    p.add_argument("--checkpoint", default=None,
                   help="vlp checkpoint (step_*.pt, or step_*/ under fsdp) or open_clip checkpoint file")
    p.add_argument("--model", default=None, help="open_clip model name, hf-hub:org/name or JSON "
                   "(default: from the vlp checkpoint)")
    p.add_argument("--pretrained", default=None, help="with --model: an open_clip pretrained tag (e.g. "
                   "laion2b_s34b_b79k), hf-hub:org/name or a weights file; tags and hub names come from the "
                   "Hugging Face cache (HF_HUB_OFFLINE=1 works once cached)")
    p.add_argument("--classes", action="append", default=[], metavar="DIR",
                   help="zero-shot classification on a class-folder set DIR/<class name>/*.jpg (repeatable)")
    p.add_argument("--wds", action="append", default=[], metavar="DIR",
                   help="a CLIP_benchmark webdataset folder (DIR/test/*.tar; classification when it has "
                   "classnames.txt, else retrieval; repeatable)")
    p.add_argument("--suite", default=None, help="eval suite YAML (configs/eval_*.yaml)")
    p.add_argument("--shards", default=None, help="retrieval on these eval shards")
    p.add_argument("--imagenet", default=None, help="zero-shot ImageNet from this val folder (one folder per synset)")
    p.add_argument("--templates", default="openai", help="openai (80) | simple (7) | path to a template file")
    p.add_argument("--out", default=None, help="folder for metrics.json and metrics.md")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.set_defaults(func=cmd_eval)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="grid of runs (loss × per-GPU batch × seed) at an equal sample "
                       "budget → runs.csv, results.md, plots")
    p.add_argument("--config", "-c", default=None, help="compare YAML: a vlp config plus a 'grid:' section "
                   "(default: the packaged configs/compare_small_batch.yaml)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: rebuild runs.csv, results.md and the plots from the run folders")
    p.add_argument("--quick", action="store_true",
                   help="apply the config's 'quick:' overrides first (the same study in a few minutes)")
    jobs = p.add_mutually_exclusive_group()
    jobs.add_argument("--status", action="store_true",
                      help="grid.executor=slurm: print the grid's runs by state (pending, running, done, requeued, "
                      "failed with the reason); submits nothing")
    jobs.add_argument("--cancel", action="store_true", help="grid.executor=slurm: cancel the grid's jobs")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.samples=4096 grid.seeds=[0]")
    p.set_defaults(func=cmd_compare)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="embedded OpenMoji data: shards, train InfoNCE and FlatNCE, evaluate, print a table")
    p.add_argument("--out", default="runs/demo", help="output folder")
    _add_config_args(p)
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vlp", description="CLIP-style contrastive pretraining (InfoNCE, FlatNCE, SigLIP)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for add in (_add_shards, _add_train, _add_eval, _add_compare, _add_demo):
        add(sub)
    return parser


def user_message(error: BaseException) -> str:
    """One line for the user. An exception from a DataLoader worker arrives re-raised by torch as
    'Caught ValueError in DataLoader worker process 0.' + the worker's traceback, whose last line
    is 'ValueError: <the message>': report that message."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    lines = text.splitlines()
    if lines[0].startswith("Caught ") and "Original Traceback" in text:
        last = lines[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return lines[0]


def peer_failure(error: BaseException) -> bool:
    """True for a collective that failed because another rank or node died or timed out (gloo /
    NCCL connection errors, the process group's timeout): not this rank's bug, so one line. gloo's
    words differ with where the wait ended (docs/schedulers.md; tests/cli/test_cluster.py)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(needle in text for needle in PEER_FAILURE_WORDS)


PEER_FAILURE_WORDS = ("gloo", "NCCL", "Connection reset by peer", "Connection closed by peer", "imed out",
                      "timeout caused pair closure", "Socket closed")


def main(argv: list[str] | None = None) -> int:
    from vlp.util import cap
    from vlp.distributed import end_process_group
    from vlp.data.lifecycle import WorkerDied
    from vlp.train.preempt import Preempted, mark_lost_peers

    try:
        args = build_parser().parse_args(argv)  # a repeated option: one line below, like a config error
        return args.func(args)
    except Preempted as e:  # saved; the scheduler requeues on this status (launch/slurm.sbatch)
        if e.is_main:  # one line for the job, not one per rank
            print(f"vlp: {e}", file=sys.stderr)
        end_process_group()  # every rank stopped after the same step: leave the group cleanly
        return e.status
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (eval, compare, start-up): one line
        if os.environ.get("VLP_DEBUG"):
            raise
        print("vlp: interrupted (Ctrl-C); what was already written is kept", file=sys.stderr)
        return 130
    except WorkerDied as e:  # not the user's to fix, not this rank's peers: one line, status 1
        print(f"vlp: error: {e}", file=sys.stderr)
        return 1
    except USER_ERRORS as e:
        if os.environ.get("VLP_DEBUG"):
            raise
        if not getattr(e, "echo", False):  # an error every rank agreed on: rank 0 says it
            print(f"vlp: error: {cap(user_message(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        # a full or read-only disk while writing logs, configs or results: the user's to fix
        if os.environ.get("VLP_DEBUG") or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        print(f"vlp: error: cannot write {e.filename or 'output'}: {os.strerror(e.errno)} "
              "(checkpoints already written are unchanged)", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  (only peer failures are turned into one line)
        if os.environ.get("VLP_DEBUG") or not peer_failure(e):
            raise
        rank = os.environ.get("RANK", "?")
        print(f"vlp: error: rank {rank} lost its peers (another rank or node died, or a collective "
              f"waited longer than train.dist_timeout_s): {user_message(e)[:300]}", file=sys.stderr)
        mark_lost_peers()  # a batch script requeues the job (launch/slurm.sbatch)
        return 1


def run() -> None:
    """The `vlp` command and `python -m vlp`: main(), then an exit without the interpreter's last
    garbage collection over everything torch and open_clip made at import (docs/performance.md);
    atexit handlers, finalizers and flushes still run. Not in main(), which tests call in process."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
