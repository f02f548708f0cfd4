"""The run's configuration as a typed schema (Hydra structured configs). Every key is public
contract, documented in README's "Configuration" table. A field's valid values live on the field:
`one_of(default, choices)` or a numeric range (`count`, `seconds`, ...) in its metadata, from which
`hsgd.config.validate` derives its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("auto", "gloo", "nccl")
# Longer than any sane deadline, far below what timedelta / threading / time.sleep overflow at (~1e9 s).
MAX_SECONDS = 1e7


def one_of(default: Any, choices: tuple) -> Any:
    """A field naming one of `choices` (null too when the field is Optional); hsgd.config.validate checks it."""
    return field(default=default, metadata={"choices": choices})


def _ranged(low=None, high=None, *, low_open=False, high_open=False, forever=False):
    """Fields of a numeric range, [low, high] with an end refused when open, -1 also allowed when `forever`
    (Ray's max_restarts). Every int/float field has one; its type and null come from its annotation."""
    rule = {"low": low, "high": high, "low_open": low_open, "high_open": high_open, "forever": forever}
    return lambda default: field(default=default, metadata={"range": rule})


count = _ranged(1)  # sizes, periods, multiples: at least one
count_or_zero = _ranged(0)  # 0 = none / off
positive = _ranged(0, low_open=True)
non_negative = _ranged(0)
seconds = _ranged(0, MAX_SECONDS, low_open=True)  # timeouts and waits: > 0
seconds_or_zero = _ranged(0, MAX_SECONDS)  # 0 = off
milliseconds_or_zero = _ranged(0, MAX_SECONDS * 1e3)  # simulated latencies
fraction = _ranged(0, 1, high_open=True)  # [0, 1): momentum, dropout
open_fraction = _ranged(0, 1, low_open=True, high_open=True)  # (0, 1)
ratio = _ranged(0, 1)  # [0, 1]
share = _ranged(0, 1, low_open=True)  # (0, 1]
restarts = _ranged(0, forever=True)  # as Ray's max_restarts: -1 = restart forever
seed_range = _ranged(0, 2**63, high_open=True)


class ConfigError(ValueError):
    """A bad configuration value. `str(err)` is one line: '<field>: <problem>; <what is valid>'."""

    def __init__(self, field_name: str, problem: str):
        self.field = field_name
        super().__init__(f"{field_name}: {problem}")


@dataclass
class SiteConfig:
    """One cluster of `topology.sites`: its replicas, the Ray node label they land on (sites may share
    one), a name for the record, its own quorum floor. Checked by hsgd.config.sites."""

    replicas: int = "???"  # required (OmegaConf: missing), an int >= 1
    label: str | None = None
    name: str | None = None
    min_replicas: int | None = None
    # the site's simulated step time and stragglers (null: train.min_step_s / straggle_p / straggle_factor)
    min_step_s: float | None = None
    straggle_p: float | None = None
    straggle_factor: float | None = None
    # the site's ranks per replica (null: topology.gpus_per_replica); every site must end up with the same one
    gpus_per_replica: int | None = None


@dataclass
class TopologyConfig:
    clusters: int = count(2)
    replicas_per_cluster: int = count(2)
    # k rank processes make one replica, placed together on one node, the model sharded over them (FSDP2,
    # issue 34); on GPU one GPU each, on CPU k processes over gloo. 1 = one process with a full copy
    gpus_per_replica: int = count(1)
    cpus_per_replica: float = non_negative(1.0)  # Ray CPUs per RANK process (per replica when gpus_per_replica=1)
    spares_per_cluster: int = count_or_zero(0)  # warmed replicas that take over a dead one's identity
    placement_strategy: str = one_of("STRICT_PACK", ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD", "NONE"))
    cluster_labels: list[str] = field(default_factory=list)
    sites: list[SiteConfig] = field(default_factory=list)  # one per cluster; [] = the uniform keys above


@dataclass
class SyncConfig:
    inner: str = one_of("ddp", ("ddp", "localsgd", "none"))
    inner_every: int = count(1)  # localsgd: average parameters in the cluster every this many steps
    outer: str = one_of("diloco", ("average", "diloco", "none"))
    outer_every: int = count(20)  # a round is outer_every / fragments inner steps (hsgd.config.rounds)
    outer_compress: str = one_of("none", ("none", "bf16", "int8", "int4", "topk"))  # hsgd/train/codec.py
    outer_topk: float = share(0.01)  # topk: the fraction of each chunk's entries sent
    outer_path: str = one_of("leader", ("leader", "sharded"))  # hsgd/core/outer_plan.py
    # how a codec's payloads cross the slow link (hsgd/train/exchange.py): each holder decodes every
    # site's (gather), or each owns a chunk and reduces it (reduce_scatter: flat in the sites); auto:
    # reduce_scatter from 3 sites in the formed outer group, gather at 2
    outer_exchange: str = one_of("auto", ("auto", "gather", "reduce_scatter"))
    fragments: int = count(1)  # Streaming DiLoCo: parameter fragments synced in turn
    fragment_alpha: float = fraction(0.0)  # weight of the LOCAL copy when merging a synced fragment
    fragment_delay: int = count_or_zero(0)
    # steps: each cluster takes its own number of inner steps per round, planned at the round's start so
    # every cluster's inner phase lasts about as long as the fastest one's (hsgd/core/round/balance.py)
    balance: str = one_of("none", ("none", "steps"))


@dataclass
class InnerOptimConfig:
    name: str = one_of("adamw", ("adamw", "sgd"))
    lr: float = positive(3e-3)
    momentum: float = fraction(0.9)  # sgd momentum; adamw beta1
    weight_decay: float = non_negative(0.0)
    grad_clip: float = non_negative(1.0)  # max global grad norm, 0 = off
    warmup_steps: int | None = count_or_zero(None)  # null = auto: 5 % of the run's steps (hsgd/config/auto.py)
    schedule: str | None = one_of(None, ("constant", "cosine"))  # null = auto: cosine
    min_lr_ratio: float = ratio(0.1)
    implementation: str = one_of("auto", ("auto", "fused", "foreach", "single"))


@dataclass
class OuterOptimConfig:
    # null = auto (hsgd/config/auto.py), from the run's N outer steps and clusters: lr 1.0 with momentum 0.3
    # below 50 (0.5 with 4 clusters or more), 0.5 below 500, DiLoCo's 0.7 / 0.9 from 500 (README "Defaults
    # that converge"); explicit values win
    lr: float | None = positive(None)
    momentum: float | None = fraction(None)
    nesterov: bool = True


@dataclass
class OptimConfig:
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    outer: OuterOptimConfig = field(default_factory=OuterOptimConfig)


@dataclass
class ModelConfig:
    _target_: str = "hsgd.train.model.build_gpt"
    args: dict[str, Any] = field(default_factory=dict)
    name: str = one_of("tiny", ("tiny", "small", "custom"))
    n_layer: int = count(4)
    n_head: int = count(4)
    n_embd: int = count(128)
    block_size: int = count(64)
    dropout: float = fraction(0.0)


@dataclass
class DataConfig:
    _target_: str = "hsgd.train.data.build_dataset"
    args: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # None = the Shakespeare corpus shipped in the package
    batch_size: int = count(8)
    val_fraction: float = open_fraction(0.1)
    grad_accum: int = count(1)  # micro-batches per inner step (each of batch_size sequences)
    vocab_size: int | None = count(None)  # token folders without meta.json (nanoGPT's GPT-2 .bin files)


@dataclass
class LossConfig:
    _target_: str = "hsgd.train.model.lm_loss"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    rounds: int = count(15)
    resume: bool = False
    eval_every: int = count(1)  # rounds between evaluations of the global model
    eval_batches: int = count(8)
    min_step_s: float = seconds_or_zero(0.0)
    straggle_p: float = fraction(0.0)
    straggle_factor: float = non_negative(10.0)
    precision: str = one_of("fp32", ("fp32", "bf16"))
    compile: bool = False  # torch.compile the model
    deterministic: bool = False


@dataclass
class RunConfig:
    name: str = "hsgd"  # the experiment name: wandb group, part of the default folders
    dir: str = "outputs/${now:%Y%m%d-%H%M%S}-${run.name}-${hsgd.suffix:}"
    sweep_dir: str = "outputs/multirun/${now:%Y%m%d-%H%M%S}-${run.name}-${hsgd.suffix:}"
    io_grace_s: float = seconds(60.0)


@dataclass
class CheckpointConfig:
    every: int = count_or_zero(5)  # rounds between durable checkpoints, 0 = never
    keep: int = count(2)
    dir: str | None = None


@dataclass
class CommConfig:
    backend: str = one_of("auto", BACKENDS)
    timeout_s: float = seconds(10.0)  # one collective
    configure_timeout_s: float = seconds(30.0)  # joining a process group (store rendezvous)
    min_gbps: float = positive(1.0)  # the slowest link a payload-scaled wait assumes (hsgd/core/deadlines.py)
    inner_backend: str | None = one_of(None, BACKENDS)
    outer_backend: str | None = one_of(None, BACKENDS)
    bucket_mb: float = positive(25.0)  # inner ddp: gradient buckets all-reduced from backward hooks as they fill


@dataclass
class LinkConfig:
    gbps: float = non_negative(0.0)
    latency_ms: float = milliseconds_or_zero(0.0)
    jitter_ms: float = milliseconds_or_zero(0.0)


@dataclass
class LinksConfig:
    outer: LinkConfig = field(default_factory=LinkConfig)  # between clusters (the slow link)
    inner: LinkConfig = field(default_factory=LinkConfig)  # inside a cluster


@dataclass
class SupervisorConfig:
    phase_timeout_s: float = seconds(300.0)  # hard deadline for one phase call on a replica
    call_timeout_s: float = seconds(60.0)  # small control calls (configure, status, heal)
    max_restarts: int = restarts(10)  # restarts of the supervisor actor itself
    min_replicas_per_cluster: int = count(1)  # a cluster with fewer live replicas sits out outer sync
    min_clusters: int = count(1)  # fewer clusters in quorum: wait up to quorum_wait_s, then fail the run
    quorum_wait_s: float = seconds(60.0)
    rejoin: str = one_of("fast", ("fast", "boundary"))  # a restarted replica joins inside the round, or at the next
    rejoin_wait_s: float = seconds_or_zero(30.0)  # boundary: wait this long for a restarting replica


@dataclass
class WatchdogConfig:
    multiple: float = count(4.0)
    floor_s: float = seconds(15.0)
    ceiling_s: float = seconds(300.0)
    stack_dumps: bool = True  # on a missed deadline: dump every replica's stacks into hangs/


@dataclass
class WandbConfig:
    mode: str = one_of("offline", ("offline", "online", "disabled"))
    project: str = "hsgd"
    entity: str | None = None
    group: str | None = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # console progress bar
    step_times: bool = False  # run.dir/steps/<rid>.jsonl (hsgd.record.steps)


@dataclass
class FaultsConfig:
    schedule: list[Any] = field(default_factory=list)
    mtbf_s: float = non_negative(0.0)  # random faults with this mean time between failures, 0 = off
    kinds: list[str] = field(default_factory=lambda: ["kill", "crash"])
    seed: int = seed_range(0)
    step_s: float = seconds(0.1)  # seconds per inner step assumed: a seed gives one schedule on any machine
    max_restarts: int = restarts(10)  # restarts allowed per replica actor
    quarantine_after: int = count_or_zero(3)  # deaths in quarantine_window_s (hsgd/core/quarantine.py)
    quarantine_window_s: float = seconds(600.0)


@dataclass
class RayConfig:
    address: str | None = None
    num_cpus: int | None = count(None)  # embedded cluster only


@dataclass
class HsgdConfig:
    seed: int = seed_range(0)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    links: LinksConfig = field(default_factory=LinksConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def register_schema() -> None:
    """Make the schema the base of conf/config.yaml (its `hsgd_schema` default), and register its
    resolvers: `${hsgd.output_path:<path>}` (hydra.run.dir / hydra.sweep.dir) and `${hsgd.suffix:}`."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from hsgd.config.paths import output_path, run_suffix

    ConfigStore.instance().store(name="hsgd_schema", node=HsgdConfig)
    OmegaConf.register_new_resolver("hsgd.output_path", output_path, replace=True)
    OmegaConf.register_new_resolver("hsgd.suffix", run_suffix, replace=True)
