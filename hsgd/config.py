"""The run's configuration: a typed schema (Hydra structured configs) and its validation.

Every key here is public contract (README, "Configuration"). `validate(cfg)` checks the values
that the types cannot: names of algorithms, positive periods, divisibility, paths. It raises
`ConfigError` whose message is ONE line naming the field and what would be valid; the entry point
prints it and exits with code 2 before any actor starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

INNER_ALGORITHMS = ("ddp", "localsgd", "none")
OUTER_ALGORITHMS = ("average", "diloco", "none")
INNER_OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("auto", "gloo", "nccl")
WANDB_MODES = ("offline", "online", "disabled")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD", "NONE")


class ConfigError(ValueError):
    """A bad configuration value. `str(err)` is one line: '<field>: <problem>; <what is valid>'."""

    def __init__(self, field_name: str, problem: str):
        self.field = field_name
        super().__init__(f"{field_name}: {problem}")


@dataclass
class TopologyConfig:
    clusters: int = 2
    replicas_per_cluster: int = 2
    cpus_per_replica: float = 1.0
    # How a cluster's replicas are kept together on a real Ray cluster (see actors/placement.py).
    placement_strategy: str = "STRICT_PACK"
    # Optional Ray node label per cluster, e.g. ["rack-a", "rack-b"]: cluster c lands on nodes with
    # label `hsgd-cluster=<cluster_labels[c]>`.
    cluster_labels: List[str] = field(default_factory=list)


@dataclass
class SyncConfig:
    inner: str = "ddp"  # ddp | localsgd | none
    inner_every: int = 1  # localsgd: average parameters in the cluster every this many steps
    outer: str = "diloco"  # average | diloco | none
    outer_every: int = 20  # inner steps per round


@dataclass
class InnerOptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    momentum: float = 0.9  # sgd momentum; adamw beta1
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm, 0 = off


@dataclass
class OuterOptimConfig:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class OptimConfig:
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    outer: OuterOptimConfig = field(default_factory=OuterOptimConfig)


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0


@dataclass
class DataConfig:
    path: Optional[str] = None  # None = the Shakespeare corpus shipped in the package
    batch_size: int = 8
    val_fraction: float = 0.1


@dataclass
class TrainConfig:
    rounds: int = 15
    resume: bool = False
    eval_every: int = 1  # rounds between evaluations of the global model
    eval_batches: int = 8


@dataclass
class RunConfig:
    name: str = "hsgd"  # the experiment name: wandb group, part of the default folders
    # A relative path is relative to the launch directory, except under `ray job submit` (whose
    # working dir is a temporary copy) or when $HSGD_OUTPUT_ROOT is set: then it is relative to
    # the persistent output root (see output_root()). Absolute paths are taken as they are.
    dir: str = "outputs/${now:%Y%m%d-%H%M%S}-${run.name}"
    sweep_dir: str = "outputs/multirun/${now:%Y%m%d-%H%M%S}-${run.name}"


OUTPUT_ROOT_ENV = "HSGD_OUTPUT_ROOT"
RAY_JOB_OUTPUT_ROOT = "~/hsgd"  # the persistent root under `ray job submit` when $HSGD_OUTPUT_ROOT is unset


def under_ray_job() -> bool:
    """True in the entrypoint of `ray job submit` (Ray's job supervisor sets this variable)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def output_root() -> Optional[str]:
    """Where relative run.dir / run.sweep_dir land: $HSGD_OUTPUT_ROOT, else ~/hsgd under a Ray
    job, else None (the launch directory)."""
    root = os.environ.get(OUTPUT_ROOT_ENV, "").strip()
    if root:
        return os.path.abspath(os.path.expanduser(root))
    if under_ray_job():
        return os.path.expanduser(RAY_JOB_OUTPUT_ROOT)
    return None


def output_path(path: str) -> str:
    """run.dir / run.sweep_dir as the job will use it: `~` expanded, a relative path joined to
    output_root() when there is one (left relative to the launch directory otherwise)."""
    p = os.path.expanduser(str(path))
    root = output_root()
    return os.path.join(root, p) if root is not None and not os.path.isabs(p) else p


@dataclass
class CheckpointConfig:
    every: int = 5  # rounds between durable checkpoints, 0 = never
    keep: int = 2


@dataclass
class CommConfig:
    backend: str = "auto"  # auto (nccl when CUDA is present) | gloo | nccl
    timeout_s: float = 10.0  # one collective
    configure_timeout_s: float = 30.0  # joining a process group (store rendezvous)


@dataclass
class SupervisorConfig:
    phase_timeout_s: float = 300.0  # hard deadline for one phase call on a replica
    call_timeout_s: float = 60.0  # small control calls (configure, status, heal)
    max_restarts: int = 10  # restarts of the supervisor actor itself
    min_replicas_per_cluster: int = 1  # a cluster with fewer live replicas sits out outer sync
    min_clusters: int = 1  # fewer clusters in quorum: wait up to quorum_wait_s, then fail the run
    quorum_wait_s: float = 60.0
    rejoin_wait_s: float = 30.0  # at a round boundary, wait this long for a restarting replica


@dataclass
class WatchdogConfig:
    # deadline of a phase = clamp(multiple * median recent seconds per step * steps, floor_s, ceiling_s)
    multiple: float = 4.0
    floor_s: float = 15.0
    ceiling_s: float = 300.0
    stack_dumps: bool = True  # on a missed deadline: dump every replica's stacks into hangs/


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "hsgd"
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # console progress bar


@dataclass
class FaultsConfig:
    # List of {kind, target, round, phase, step}; see hsgd/faults.py and the README.
    schedule: List[Any] = field(default_factory=list)
    mtbf_s: float = 0.0  # random faults with this mean time between failures, 0 = off
    kinds: List[str] = field(default_factory=lambda: ["kill", "crash"])
    seed: int = 0
    # Random faults land on step boundaries, mapped from time assuming this many seconds per inner
    # step, so a seed always gives the same schedule (and the same result) on any machine.
    step_s: float = 0.1
    max_restarts: int = 10  # restarts allowed per replica actor


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: attach when RAY_ADDRESS/job context is set, else embedded
    num_cpus: Optional[int] = None  # embedded cluster only; None = max(cores, replicas + 1)


@dataclass
class HsgdConfig:
    seed: int = 0
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def _choice(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(name, f"unknown value {value!r}; valid: {'|'.join(valid)}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(name, f"got {value}; must be {bound}")


def validate(cfg: Any) -> None:
    """Check a resolved config (HsgdConfig or a DictConfig of the same shape). Raises ConfigError."""
    t, s, o = cfg.topology, cfg.sync, cfg.optim
    _positive("topology.clusters", t.clusters)
    _positive("topology.replicas_per_cluster", t.replicas_per_cluster)
    _positive("topology.cpus_per_replica", t.cpus_per_replica, allow_zero=True)
    _choice("topology.placement_strategy", t.placement_strategy, PLACEMENT_STRATEGIES)
    if t.cluster_labels and len(t.cluster_labels) != t.clusters:
        raise ConfigError("topology.cluster_labels",
                          f"has {len(t.cluster_labels)} labels; need one per cluster ({t.clusters}) or none")
    _choice("sync.inner", s.inner, INNER_ALGORITHMS)
    _choice("sync.outer", s.outer, OUTER_ALGORITHMS)
    _positive("sync.inner_every", s.inner_every)
    _positive("sync.outer_every", s.outer_every)
    if s.inner == "localsgd" and s.outer_every % s.inner_every != 0:
        raise ConfigError("sync.outer_every", f"{s.outer_every} is not a multiple of sync.inner_every="
                          f"{s.inner_every}; localsgd needs outer_every = k * inner_every")
    _choice("optim.inner.name", o.inner.name, INNER_OPTIMIZERS)
    _positive("optim.inner.lr", o.inner.lr)
    _positive("optim.inner.grad_clip", o.inner.grad_clip, allow_zero=True)
    _positive("optim.inner.weight_decay", o.inner.weight_decay, allow_zero=True)
    if not 0 <= o.inner.momentum < 1:
        raise ConfigError("optim.inner.momentum", f"got {o.inner.momentum}; must be in [0, 1)")
    _positive("optim.outer.lr", o.outer.lr)
    if not 0 <= o.outer.momentum < 1:
        raise ConfigError("optim.outer.momentum", f"got {o.outer.momentum}; must be in [0, 1)")
    m = cfg.model
    _choice("model.name", m.name, ("tiny", "small", "custom"))
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        _positive(f"model.{key}", getattr(m, key))
    if m.n_embd % m.n_head != 0:
        raise ConfigError("model.n_embd", f"{m.n_embd} is not divisible by model.n_head={m.n_head}")
    if not 0 <= m.dropout < 1:
        raise ConfigError("model.dropout", f"got {m.dropout}; must be in [0, 1)")
    d = cfg.data
    if d.path is not None and not os.path.exists(os.path.expanduser(str(d.path))):
        raise ConfigError("data.path", f"{d.path!r} does not exist; give a text file (.txt/.xz/.gz), "
                          "a folder of .txt files, or null for the built-in Shakespeare corpus")
    _positive("data.batch_size", d.batch_size)
    if not 0 < d.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"got {d.val_fraction}; must be in (0, 1)")
    _positive("train.rounds", cfg.train.rounds)
    _positive("train.eval_every", cfg.train.eval_every)
    _positive("train.eval_batches", cfg.train.eval_batches)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _choice("comm.backend", cfg.comm.backend, BACKENDS)
    _positive("comm.timeout_s", cfg.comm.timeout_s)
    _positive("comm.configure_timeout_s", cfg.comm.configure_timeout_s)
    _positive("supervisor.phase_timeout_s", cfg.supervisor.phase_timeout_s)
    _positive("supervisor.call_timeout_s", cfg.supervisor.call_timeout_s)
    sup = cfg.supervisor
    if not 1 <= sup.min_replicas_per_cluster <= t.replicas_per_cluster:
        raise ConfigError("supervisor.min_replicas_per_cluster", f"got {sup.min_replicas_per_cluster}; "
                          f"must be in [1, topology.replicas_per_cluster={t.replicas_per_cluster}]")
    if not 1 <= sup.min_clusters <= t.clusters:
        raise ConfigError("supervisor.min_clusters", f"got {sup.min_clusters}; must be in [1, topology.clusters={t.clusters}]")
    _positive("supervisor.quorum_wait_s", sup.quorum_wait_s)
    _positive("supervisor.rejoin_wait_s", sup.rejoin_wait_s, allow_zero=True)
    w = cfg.watchdog
    if w.multiple < 1:
        raise ConfigError("watchdog.multiple", f"got {w.multiple}; must be >= 1 (a multiple of the median phase time)")
    _positive("watchdog.floor_s", w.floor_s)
    if w.ceiling_s < w.floor_s:
        raise ConfigError("watchdog.ceiling_s", f"got {w.ceiling_s}; must be >= watchdog.floor_s={w.floor_s}")
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    if not str(cfg.run.dir).strip():
        raise ConfigError("run.dir", "is empty; give a folder path (relative or absolute)")
    _positive("faults.mtbf_s", cfg.faults.mtbf_s, allow_zero=True)
    _positive("faults.step_s", cfg.faults.step_s)
    _positive("faults.max_restarts", cfg.faults.max_restarts, allow_zero=True)
    if cfg.ray.num_cpus is not None:
        _positive("ray.num_cpus", cfg.ray.num_cpus)
    # Fault specs have their own grammar; parse them here so a typo fails before any actor starts.
    from hsgd.faults import parse_schedule, FAULT_KINDS

    for kind in cfg.faults.kinds:
        _choice("faults.kinds", kind, FAULT_KINDS)
    if cfg.faults.mtbf_s > 0 and not cfg.faults.kinds:
        raise ConfigError("faults.kinds", f"is empty but faults.mtbf_s={cfg.faults.mtbf_s}; name at least one of {'|'.join(FAULT_KINDS)}")
    specs = parse_schedule(list(cfg.faults.schedule), clusters=t.clusters, replicas_per_cluster=t.replicas_per_cluster)
    for i, spec in enumerate(specs):  # a fault that can never fire is a typo, not a plan
        if spec.round >= cfg.train.rounds:
            raise ConfigError(f"faults.schedule[{i}].round", f"{spec.round} is past the run's last round "
                              f"(train.rounds={cfg.train.rounds}); valid: 0..{cfg.train.rounds - 1}")
        if spec.phase.startswith("inner") and spec.step >= s.outer_every:
            raise ConfigError(f"faults.schedule[{i}].step", f"{spec.step} is past the round's last step "
                              f"(sync.outer_every={s.outer_every}); valid: 0..{s.outer_every - 1}")


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """`auto` means nccl when CUDA is present, else gloo."""
    if backend == "auto":
        return "nccl" if cuda_available else "gloo"
    if backend == "nccl" and not cuda_available:
        raise ConfigError("comm.backend", "nccl needs CUDA, which this machine lacks; valid here: auto|gloo")
    return backend


def register_schema() -> None:
    """Make the schema the base of conf/config.yaml (its `hsgd_schema` default)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="hsgd_schema", node=HsgdConfig)
    register_resolvers()


def register_resolvers() -> None:
    """`${hsgd.output_path:<path>}` (conf/config.yaml's hydra.run.dir / hydra.sweep.dir)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("hsgd.output_path", output_path, replace=True)
