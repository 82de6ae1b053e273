"""The `grid:` keys of `vlp compare` (vlp/study), declared as every config key is (vlp.config.keys):
type, default, rule, resume rule (PLAN: a grid's keys plan runs, no run resumes on them) and the
docstring below each. `vlp.config.read_grid` reads them; docs/configuration.md lists them.

    grid.seeds_until.step              # a group of its own keys (SeedsUntil)
    grid.slurm.time                    # the SLURM executor's section (SlurmConfig)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional

from vlp.config.keys import OPTIMIZERS
from vlp.config.rules import ANY, COUNT, PLAN, POSITIVE_INT, TEXT, Rule, key, listed, number, short

WHOLE = replace(POSITIVE_INT, allowed="a positive integer")


def _bounds_problem(table: Any) -> Optional[str]:
    """Why grid.sweep_bounds is not {dotted key: [low, high]} with 0 < low < high, else None."""
    for name, pair in table.items():
        if "." not in str(name) or not (isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair) and 0 < pair[0] < pair[1]):
            return f"entry {name} must be [low, high] with 0 < low < high on a dotted swept key, got {short(pair)}"
    return None


BOUNDS = Rule("{dotted key: [low, high]}", lambda v: _bounds_problem(v) is None,
              ({"optim.lr": [0.1, 0.01]}, {"optim.lr": 0.1}, {"lr": [0.01, 0.1]}, {"optim.lr": [0, 1]}),
              problem=_bounds_problem)


@dataclass(frozen=True)
class AccumPrice:
    """`grid.accum_price:` the price of a large contrastive batch as accumulated micro-batches."""

    batch_per_device: int = key(None, WHOLE, PLAN)
    """Required: b, the micro-batch per GPU."""
    accum_steps: int = key(None, number(2, integer=True), PLAN)
    """Required: k, the micro-batches per step; b·k must be one of grid.batch_per_device."""
    samples: int = key(None, WHOLE, PLAN)
    """Required: train.samples of a price run (at least one step of b·k)."""
    seeds: list[int] = key([0], listed(0), PLAN)
    """The price runs' seeds."""


@dataclass(frozen=True)
class SeedsUntil:
    """`grid.seeds_until:` the rule that gives more seeds where the answer is open (vlp.study.adaptive)."""

    half_width: float = key(None, replace(number(0, lo_open=True), allowed="a number of points > 0"), PLAN)
    """Required: an interval within ± this many points of grid.metric is settled."""
    max_seeds: int = key(None, WHOLE, PLAN)
    """Required: the most seeds a comparison gets (more than grid.final_seeds)."""
    step: int = key(None, WHOLE, PLAN)
    """Required: seeds added at each look."""


SLURM_MEM = Rule("a SLURM memory size: digits with an optional K, M, G or T (e.g. 64G; 0: all of a node's)",
                 lambda v: re.fullmatch(r"[0-9]+[KMGT]?", v) is not None, ("", "64GB", "-1G", "lots"))
SBATCH_LINES = Rule("a list of sbatch options, each starting with '--' (e.g. ['--exclusive', '--reservation=r1'])",
                    lambda v: all(isinstance(x, str) and x.startswith("--") and "\n" not in x for x in v),
                    (["exclusive"], ["--a\n--b"]))


def _resource_tables_problem(table: Any) -> Optional[str]:
    """Why grid.slurm.regimes is not {regime: {resource key: value}}, else None (the keys and
    values of each entry are read as grid.slurm's own: vlp.config.check_given)."""
    for name, entry in table.items():
        if not isinstance(entry, dict):
            return f"entry {name} must map resource keys (nodes, gpus_per_node, time, ...) to values, got {short(entry)}"
    return None


LOCAL_FOLDER = Rule("a local folder (a path, not a URL)", lambda v: bool(v.strip()) and "://" not in v,
                    ("", "s3://b/logs"), path=True)
RESOURCE_TABLES = Rule("{regime: {resource key: value}}", lambda v: _resource_tables_problem(v) is None,
                       ({"lit": 1}, {"lit": [1]}), problem=_resource_tables_problem)


@dataclass
class SlurmResources:
    """The resources of one run's SLURM job: grid.slurm's, or a regime's own (grid.slurm.regimes)."""

    partition: Optional[str] = key(None, TEXT, PLAN)
    """Partition of the jobs (unset: the cluster's default partition)."""
    account: Optional[str] = key(None, TEXT, PLAN)
    """Account charged for the jobs (sbatch --account; unset: your default)."""
    qos: Optional[str] = key(None, TEXT, PLAN)
    """Quality of service of the jobs (sbatch --qos; unset: the default)."""
    time: int = key(60, POSITIVE_INT, PLAN)
    """Time limit of one run's job in minutes (> 0). A run that reaches it ends TIMEOUT and is
    resubmitted (grid.retries), resuming from its last checkpoint (train.checkpoint_every)."""
    nodes: int = key(1, POSITIVE_INT, PLAN)
    """Nodes per run's job: one `accelerate launch` per node, as launch/slurm.sbatch."""
    gpus_per_node: int = key(0, COUNT, PLAN)
    """GPUs per node, one process each (0: one CPU process per node, over gloo). A run's global
    batch is its per-GPU batch times nodes times max(1, gpus_per_node)."""
    cpus_per_task: int = key(1, POSITIVE_INT, PLAN)
    """CPUs per node's task (the launcher, its processes and their loader workers)."""
    mem: Optional[str] = key(None, SLURM_MEM, PLAN)
    """Memory per node (sbatch --mem, e.g. 256G, or "0": all of it; a string: quote a bare number;
    unset: the partition's default)."""
    constraint: Optional[str] = key(None, TEXT, PLAN)
    """Node features the jobs need (sbatch --constraint, e.g. h100)."""
    sbatch: list[str] = key([], SBATCH_LINES, PLAN)
    """More sbatch options, one per item, as written after `#SBATCH` (e.g. ['--exclusive'])."""


@dataclass
class SlurmConfig(SlurmResources):
    """`grid.slurm:` the resources of each run's SLURM job (grid.executor: slurm; vlp/executors/slurm.py),
    a regime's own where grid.slurm.regimes gives them, checked against the cluster (sinfo) before
    any job is submitted; and how the driver watches them."""

    regimes: dict[str, SlurmResources] = key({}, RESOURCE_TABLES, PLAN)
    """{regime: {resource key: value}}: the jobs of a regime of grid.regimes (its runs and its
    feature-cache warm-up) with resources of their own, e.g. {lit: {gpus_per_node: 1, time: 30}}
    beside a scratch run's node of 8 GPUs. Each entry takes the keys above (partition to sbatch),
    each with its rule; a key it leaves out is grid.slurm's."""
    log_dir: Optional[str] = key(None, LOCAL_FOLDER, PLAN)
    """grid.out_dir in a bucket: the local folder of each job's script (job.sh) and SLURM's output
    (slurm-<id>.out), <log_dir>/<bucket>/<path>/<run>/ (SLURM writes output to a file system only).
    Unset: slurm-logs under the folder `vlp compare` runs in, the jobs' working directory (sbatch
    --chdir), which they share. With a local grid.out_dir both stay in each run folder."""
    max_in_flight: int = key(64, number(1, 100_000, integer=True), PLAN)
    """At most this many of the grid's jobs submitted and not yet ended at once."""
    poll_s: float = key(10.0, number(0.2, 3600), PLAN)
    """Seconds between two polls of the scheduler (one squeue or sacct call for all the jobs)."""

    def of_regime(self, regime: str = "") -> SlurmResources:
        """The resources of a regime's jobs: its entry of grid.slurm.regimes (read with grid.slurm's
        keys under the ones it gives, vlp.config.read_entry), else grid.slurm's."""
        return self.regimes.get(regime) or SlurmResources(**{f.name: getattr(self, f.name) for f in fields(SlurmResources)})


@dataclass
class GridConfig:
    """`grid:` the runs of `vlp compare` (vlp/study): the arms, seeds and sweep, where they go and
    how they are reported. Not part of a run's config: popped before the rest becomes one."""

    losses: list[str] = key(None, listed(), PLAN)
    """Losses to compare (loss.name values of vlp/losses/registry.py): an axis of the arms. Required."""
    batch_per_device: list[int] = key(None, listed(1), PLAN)
    """Per-GPU batch sizes to sweep (data.batch_per_device values): an axis of the arms. Required."""
    seeds: list[int] = key(None, listed(0), PLAN)
    """Seeds (train.seed): model init and data order, the same for every loss and batch; a tuned
    study's sweep seeds. Required."""
    out_dir: str = key("runs/compare", TEXT, PLAN)
    """Results folder: one subfolder per run plus runs.csv, the report and its figures; a plain grid's
    may be a bucket (s3://b/grid, gs://...), with either executor."""
    loss_overrides: dict[str, Any] = key({}, ANY, PLAN)
    """Per-loss dotted overrides, e.g. {flatnce: {loss.temperature: split}}."""
    warmup_samples: Optional[int] = key(None, COUNT, PLAN)
    """If set, optim.warmup_steps = warmup_samples // global batch (equal warmup in samples)."""
    log_every_samples: Optional[int] = key(None, COUNT, PLAN)
    """If set, train.log_every = max(1, log_every_samples // global batch) (aligned curves)."""
    keep_checkpoints: bool = key(True, ANY, PLAN)
    """False: delete a run's checkpoints/ once it succeeded (open_clip_model.pt is kept)."""
    keep_models: bool = key(True, ANY, PLAN)
    """False: runs write no final checkpoint and no open_clip_model.pt (train.save_final); a study
    ranks each trained model in memory, and its eval_items.json and log are kept."""
    retries: int = key(1, COUNT, PLAN)
    """Extra attempts for a run that raises, before it is recorded as failed; grid.executor=slurm:
    resubmissions of a run whose job ended without a result (not after a config error)."""
    metric: str = key("mean_R@1", TEXT, PLAN)
    """Eval metric (vlp.eval.keys.EVAL_KEYS) of metric_vs_batch.png; a study's verdict and figures."""
    workers: int = key(1, number(1, 64, integer=True), PLAN)
    """On one process: run this many runs at once in worker processes (2 on a 2-core CPU with
    OMP_NUM_THREADS=1). Results do not depend on it; samples/s share the cores."""
    sweep: dict[str, Any] = key({}, ANY, PLAN)
    """Non-empty: a tuned study (sweep on val, seeds on test). Dotted key -> values, the same for
    every arm, e.g. {optim.lr: [3e-4, 1e-3]}; or optimizer name -> such a map (per-optimizer ranges)."""
    optimizers: list[str] = key([], listed(choices=OPTIMIZERS), PLAN)
    """Study: optim.name values, an axis of the arms (default: the base config's optim.name)."""
    final_seeds: Optional[list[int]] = key(None, listed(0), PLAN)
    """Study: seeds of the final runs of each arm's selected setting (unset: grid.seeds)."""
    select_metric: str = key("mean_R@10", TEXT, PLAN)
    """Study: the val metric (mean over grid.seeds) that selects each arm's setting."""
    test_shards: Optional[str] = key(None, TEXT, PLAN)
    """Study on your own shards: the test set (data.eval_shards is the val set). OpenMoji: unset."""
    regimes: dict[str, Any] = key({}, ANY, PLAN)
    """Study: named regimes, an axis of the arms: {name: {dotted key: value, ..., sweep: {...}?}}
    (e.g. scratch: {} and lit: {model.name: vlp-lit-lite0, model.lock_image: true, ...}); a
    regime's own `sweep` replaces grid.sweep for it; a regime set to false is left out."""
    accum_price: Optional[AccumPrice] = key(None, ANY, PLAN)
    """Study: {batch_per_device: b, accum_steps: k, samples: n, seeds?}: per regime × loss, a timed
    run of the b·k contrastive batch as k micro-batches of b (b·k a grid batch, whose accuracy it
    has): samples/s and peak memory beside batch b."""
    datasets: Any = key({}, ANY, PLAN)
    """Study: the data sets, an axis of the arms ({}: the data config as given). A list of packaged
    names, or {name: {batch_per_device: [...], regimes: [...]}} to run a data set on a subset of
    the grid's batches or regimes; any other name is your own data (vlp.study.userdata): {train:
    spec, val: spec, test: spec} or {shards: spec} split by caption hash."""
    seeds_until: Optional[SeedsUntil] = key(None, ANY, PLAN)
    """Study: seeds where the answer is open, {half_width: points, max_seeds: n, step: k}: after the
    final seeds, every paired Δ (grid.metric) whose interval still contains 0 and is wider than ±
    half_width points gets k more seeds, up to max_seeds; every interval and p-value is then
    corrected for the planned looks (vlp.study.stats.look_level)."""
    sweep_bounds: dict[str, list] = key({}, BOUNDS, PLAN)
    """Study: {dotted key: [low, high]}: an arm selected at an edge of its values of that key gets
    one more value beyond the edge (x3 or /3) until its selection is interior or the next value
    would cross the bound (the report names it)."""
    budget_points: int = key(1, number(1, 64, integer=True), PLAN)
    """Study: rank val and test at this many evenly spaced points of the budget (the steps of every
    run must divide by it); the report gives the verdict at the end and at each arm's val-best point."""
    executor: Literal["local", "slurm"] = key("local", ANY, PLAN)
    """Where the runs run: local (this process, or grid.workers worker processes) or slurm (each
    run one SLURM job with the resources of grid.slurm, or of its regime in grid.slurm.regimes;
    vlp/executors/slurm.py). The table is the same."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """grid.executor=slurm: each run's job resources (SlurmConfig)."""
