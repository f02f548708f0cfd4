"""The run's configuration as a typed schema (Hydra structured configs). Every key is public
contract, described by the docstring under its field, from which the manual's configuration reference
is generated (`python -m hsgd.config.reference` writes docs/reference/configuration.md). A field's
valid values live on the field: `one_of(default, choices)` or a numeric range (`count`, `seconds`, ...)
in its metadata, from which `hsgd.config.validate` derives its checks."""

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
    """The site's replicas (required): an int >= 1."""
    label: str | None = None
    """The Ray node label value its replicas land on (`hsgd-cluster=<label>`, as `topology.cluster_labels`); several
    sites may share one; null: anywhere."""
    name: str | None = None
    """A name for the record (the summary's `topology`, the pictures)."""
    min_replicas: int | None = None
    """The site's quorum floor, in [1, replicas]; null: `supervisor.min_replicas_per_cluster`."""
    min_step_s: float | None = None
    """The site's simulated step time, in [0, 86400]; null: `train.min_step_s`. `sync.balance=steps` plans by it."""
    straggle_p: float | None = None
    """The site's straggler probability, in [0, 1]; null: `train.straggle_p`."""
    straggle_factor: float | None = None
    """The site's straggler factor, in [0, 1000]; null: `train.straggle_factor`. A straggling step is never padded
    past a day (see `train.straggle_p`)."""
    gpus_per_replica: int | None = None
    """The site's ranks per replica, restating `topology.gpus_per_replica`; null: that key. Every site must end up
    with the same one."""


@dataclass
class TopologyConfig:
    clusters: int = count(2)
    """How many clusters (sites) of `replicas_per_cluster` replicas each, when `topology.sites` is `[]`."""
    replicas_per_cluster: int = count(2)
    """Replicas per cluster, when `topology.sites` is `[]`."""
    gpus_per_replica: int = count(1)
    """Rank processes per replica, on one node, the model sharded over them with FSDP2 (one GPU each on GPU; gloo on
    CPU); must divide every GPU node's GPU count and `data.batch_size`. See Scaling."""
    cpus_per_replica: float = non_negative(1.0)  # Ray CPUs per RANK process (per replica when gpus_per_replica=1)
    """Ray CPUs per rank actor (per replica actor when `gpus_per_replica` is 1; the key keeps its name)."""
    spares_per_cluster: int = count_or_zero(0)  # warmed replicas that take over a dead one's identity
    """Hot spares per cluster: warmed replicas that take over a dead replica's identity at once (placed with their
    cluster, same resources as a replica)."""
    placement_strategy: str = one_of("STRICT_PACK", ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD", "NONE"))
    """The strategy of each cluster's placement group (one group per cluster); `STRICT_PACK` puts a cluster on one
    node."""
    cluster_labels: list[str] = field(default_factory=list)
    """One Ray node label value per cluster (`hsgd-cluster=<value>`), instead of placement groups; `[]`: none."""
    sites: list[SiteConfig] = field(default_factory=list)  # one per cluster; [] = the uniform keys above
    """Sites of different sizes, one entry per cluster (the keys below); `[]`: the uniform keys above. Refused
    together with a non-default `clusters`, `replicas_per_cluster` or `cluster_labels`. See Sites."""


@dataclass
class SyncConfig:
    inner: str = one_of("ddp", ("ddp", "localsgd", "none"))
    """Inner sync inside a cluster: `ddp` (gradient all-reduce every step), `localsgd` (parameter averaging every
    `inner_every` steps), `none`."""
    inner_every: int = count(1)  # localsgd: average parameters in the cluster every this many steps
    """`localsgd`: average the parameters inside the cluster every this many steps; `outer_every / fragments` must
    be a multiple."""
    outer: str = one_of("diloco", ("average", "diloco", "none"))
    """Outer sync across clusters: `diloco` (the mean pseudo-gradient through Nesterov SGD, `optim.outer.*`),
    `average` (plain averaging: lr 1, no momentum), `none`."""
    outer_every: int = count(20)  # a round is outer_every / fragments inner steps (hsgd.config.rounds)
    """Inner steps between two syncs of the same parameters; a multiple of `sync.fragments`. A round is `outer_every
    / fragments` inner steps."""
    outer_compress: str = one_of("none", ("none", "bf16", "int8", "int4", "topk"))  # hsgd/train/codec.py
    """What crosses the slow link (`hsgd/train/codec.py`), bytes per parameter: `none` 4 (fp32), `bf16` 2, `int8`
    1.016, `int4` 0.516, `topk` 0.04 at 1 %; every lossy codec keeps an error-feedback residual. See Scaling."""
    outer_topk: float = share(0.01)  # topk: the fraction of each chunk's entries sent
    """`topk`: the fraction of each chunk's entries sent."""
    outer_path: str = one_of("leader", ("leader", "sharded"))  # hsgd/core/outer_plan.py
    """`leader`: the leaders exchange the whole payload. `sharded`: the j-th holder of every cluster exchanges shard
    j of S (the smallest live cluster size), so each link carries 1/S. See Scaling."""
    outer_exchange: str = one_of("auto", ("auto", "gather", "reduce_scatter"))
    """How a codec's payloads cross the slow link (`hsgd/train/exchange.py`): `gather` (each holder decodes every
    site's payload: per-site bytes grow as N - 1), `reduce_scatter` (each site owns a chunk, reduces and re-encodes
    it, then all-gathers: flat in N), `auto` (reduce_scatter from 3 sites in the formed outer group, gather at 2).
    `none` stays an all-reduce and `topk` always gathers. See Scaling."""
    fragments: int = count(1)  # Streaming DiLoCo: parameter fragments synced in turn
    """Streaming DiLoCo: F fragments strided over depth, round r syncs fragment r mod F, so the slow link carries
    1/F of the model per round; 1 = plain DiLoCo, bitwise. See Scaling."""
    fragment_alpha: float = fraction(0.0)  # weight of the LOCAL copy when merging a synced fragment
    """torchft's convention: the weight of the LOCAL copy when a synced fragment is merged, params = α·local +
    (1−α)·global; 0 takes the global fragment as is."""
    fragment_delay: int = count_or_zero(0)
    """Overlap (τ): the pseudo-gradient is taken τ steps before the round's end and reduced in the background; in
    [0, steps of a round), a multiple of `inner_every` under localsgd, needs `outer` and `inner` ≠ none. See
    Scaling."""
    balance: str = one_of("none", ("none", "steps", "time"))
    """`none`: every cluster runs `outer_every / fragments` steps per round. `steps`: each its own number, planned
    so every inner phase lasts about as long as the fastest. `time`: the inner phases close at a time (`round_s`)
    and each cluster contributes the steps it took; one not ready by the close plus `grace_s` is late: the round
    commits without it. See Sites."""
    round_s: float | None = seconds(None)
    """`balance=time`: seconds from a round's start to its close; null = the fastest site's learned time for the
    round's steps (the first round runs its steps and learns it)."""
    grace_s: float = seconds_or_zero(10.0)
    """`balance=time`: how long after the close a site may still answer before it is late (a paused process
    cannot yield). A late site is slow, not dead: nobody is killed; it heals from the new global params."""
    min_round_steps: int = count(1)
    """`balance=time`: a site that took fewer steps than this by the close is late."""


@dataclass
class InnerOptimConfig:
    name: str = one_of("adamw", ("adamw", "sgd"))
    """The inner optimizer."""
    lr: float = positive(3e-3)
    """The inner learning rate (the peak of the schedule)."""
    momentum: float = fraction(0.9)  # sgd momentum; adamw beta1
    """SGD momentum; AdamW beta1 (beta2 = 0.95)."""
    weight_decay: float = non_negative(0.0)
    """Weight decay of the inner optimizer."""
    grad_clip: float = non_negative(1.0)  # max global grad norm, 0 = off
    """Max global gradient norm; 0 = off."""
    warmup_steps: int | None = count_or_zero(None)  # null = auto: 5 % of the run's steps (hsgd/config/auto.py)
    """Linear warmup of the inner rate over this many steps; null = auto: 5 % of the run's steps. A resume keeps
    what its checkpoint recorded for a key left null. See Converging."""
    schedule: str | None = one_of(None, ("constant", "cosine"))  # null = auto: cosine
    """After warmup, `constant` or `cosine` decay to `lr × min_lr_ratio` at the run's last step; null = auto:
    cosine. A resume keeps what its checkpoint recorded for a key left null. See Converging."""
    min_lr_ratio: float = ratio(0.1)
    """Where the cosine decay ends, as a fraction of `lr`."""
    implementation: str = one_of("auto", ("auto", "fused", "foreach", "single"))
    """`auto` (fused on CUDA, single-tensor on CPU), `fused`, `foreach`, `single`: each keeps replicas bitwise equal."""


@dataclass
class OuterOptimConfig:
    lr: float | None = positive(None)
    """`diloco` only. null = auto from the run's outer steps N (`train.rounds / sync.fragments`): 1.0 below 500,
    DiLoCo's 0.7 from 500 on; an explicit value wins. See Converging."""
    momentum: float | None = fraction(None)
    """`diloco` only. null = auto: 0.3 for N < 50 (0.5 with 4 clusters or more), 0.5 for N < 500, 0.9 from 500 on.
    See Converging."""
    nesterov: bool = True
    """`diloco` only: Nesterov momentum."""


@dataclass
class OptimConfig:
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    """The optimizer each replica steps every inner step."""
    outer: OuterOptimConfig = field(default_factory=OuterOptimConfig)
    """The outer optimizer, applied to the clusters' mean pseudo-gradient at each outer sync (`sync.outer=diloco`)."""


@dataclass
class ModelConfig:
    _target_: str = "hsgd.train.model.build_gpt"
    """The model factory: any importable callable returning an `nn.Module`, called as `target(**model.args,
    **context)` (context `model_cfg`, `vocab_size`). See Your own model and data."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model factory (`+model.args.hidden=64` on the command line); a key that is also a
    context name is refused."""
    name: str = one_of("tiny", ("tiny", "small", "gpt-30m", "gpt-86m", "custom"))
    """The preset's name (the `model` group: tiny ~0.8 M params, small ~10.7 M, gpt-30m ~30 M, gpt-86m ~86 M)."""
    n_layer: int = count(4)
    """Transformer blocks of the built-in GPT."""
    n_head: int = count(4)
    """Attention heads; must divide `n_embd`."""
    n_embd: int = count(128)
    """Embedding width."""
    block_size: int = count(64)
    """Context length in tokens (for the built-in data: the window a batch's sequences take)."""
    dropout: float = fraction(0.0)
    """Dropout of the built-in GPT."""


@dataclass
class DataConfig:
    _target_: str = "hsgd.train.data.build_dataset"
    """The dataset factory, called as `target(**data.args, **context)` (context `data_cfg`, `block_size`,
    `batch_size`, `seed`); its `batch(...)` must be pure in its arguments. See Your own model and data."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the dataset factory."""
    path: str | None = None  # None = the Shakespeare corpus shipped in the package
    """null = the built-in Shakespeare; a `.txt`/`.xz`/`.gz` file or a folder of `.txt` files (char-level); or a
    folder of token files `train.bin`/`val.bin` (+ `meta.json`). See Your own model and data."""
    batch_size: int = count(8)
    """Sequences per replica per micro-batch, split evenly across its `topology.gpus_per_replica` ranks."""
    val_fraction: float = open_fraction(0.1)
    """The held-out split: the last fraction of the text."""
    grad_accum: int = count(1)  # micro-batches per inner step (each of batch_size sequences)
    """Micro-batches of `data.batch_size` per inner step; the loss is their mean."""
    vocab_size: int | None = count(None)  # token folders without meta.json (nanoGPT's GPT-2 .bin files)
    """The vocabulary of a token folder without `meta.json` (GPT-2's files: 50257); with `meta.json` or text, a
    larger value pads the embedding (e.g. 50304), a smaller one is refused."""


@dataclass
class LossConfig:
    _target_: str = "hsgd.train.model.lm_loss"
    """The loss, called as `target(model, batch, **loss.args)` per micro-batch; returns a scalar tensor."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the loss."""


@dataclass
class TrainConfig:
    rounds: int = count(15)
    """Rounds to train; the run trains `rounds × sync.outer_every / sync.fragments` inner steps."""
    resume: bool = False
    """Continue from the newest checkpoint under `checkpoint.dir` that verifies; also takes over the stale lock of a
    run that died. See Outputs."""
    eval_every: int = count(1)  # rounds between evaluations of the global model
    """Rounds between evaluations of the global model."""
    eval_batches: int = count(8)
    """Held-out batches per evaluation (the same for every replica and run)."""
    min_step_s: float = seconds_or_zero(0.0)
    """Pad each inner step to at least this many seconds by sleeping (an accelerator's step time on CPU, for tests
    and drills), up to a day; 0 = off."""
    straggle_p: float = fraction(0.0)
    """Simulated stragglers: at each inner step a replica sleeps, with this probability, `straggle_factor` × the
    step's time; seeded, so a run replays; 0 = off. See Scaling."""
    straggle_factor: float = non_negative(10.0)
    """A straggling step's sleep, in step times. Where a cluster straggles, `min_step_s × (1 + straggle_factor)` ≤
    86400 (a site's values, else these)."""
    precision: str = one_of("fp32", ("fp32", "bf16"))
    """`fp32`, or `bf16`: forward and loss under `torch.autocast` (CUDA and CPU); params, gradients, optimizer
    state, pseudo-gradients and outer state stay fp32."""
    compile: bool = False  # torch.compile the model
    """`torch.compile` the model for the inner steps (heals, checkpoints, evaluation and the digests use the
    module's own params)."""
    deterministic: bool = False
    """On GPU: deterministic algorithms, `CUBLAS_WORKSPACE_CONFIG=:4096:8`, the math attention kernel: bitwise
    replay of a drill across runs, at ~8 % fewer tokens/s. CPU runs are deterministic anyway. See Scaling."""


@dataclass
class RunConfig:
    name: str = "hsgd"  # the experiment name: wandb group, part of the default folders
    """The experiment's name: the wandb group, part of the default folders."""
    dir: str = "outputs/${now:%Y%m%d-%H%M%S}-${run.name}-${hsgd.suffix:}"
    """The run folder, owned by one run (a lock). `<suffix>`: 6 random hex digits per process. Relative to the
    current directory, or to `$HSGD_OUTPUT_ROOT` (under `ray job submit` default `~/hsgd`). See Outputs."""
    sweep_dir: str = "outputs/multirun/${now:%Y%m%d-%H%M%S}-${run.name}-${hsgd.suffix:}"
    """The folder of a sweep (`-m`), one sub-folder per job; resolved as `run.dir`."""
    io_grace_s: float = seconds(60.0)
    """A run folder that fails writes for this long ends the run `failed` (the summary on the console); a shorter
    outage is survived, records waiting in memory. Every supervisor write waits at most min(5, io_grace_s / 4) s."""


@dataclass
class CheckpointConfig:
    every: int = count_or_zero(5)  # rounds between durable checkpoints, 0 = never
    """Rounds between durable checkpoints; 0 = never (the last round is always saved otherwise)."""
    keep: int = count(2)
    """How many checkpoints to keep."""
    dir: str | None = None
    """null = `<run.dir>/checkpoints`; or a path or fsspec URL every replica reaches (a shared mount, `s3://...`,
    `gs://...`), checked at start. A fresh run refuses one that holds checkpoints. See Outputs."""


@dataclass
class CommConfig:
    backend: str = one_of("auto", BACKENDS)
    """Both levels' backend (the per-level keys override it). `auto`: nccl on the inner level only where every
    replica gets a GPU of its own on the Ray cluster, else gloo. See Operations."""
    timeout_s: float = seconds(10.0)  # one collective
    """Seconds one collective may take, scaled by its payload at `comm.min_gbps`."""
    configure_timeout_s: float = seconds(30.0)  # joining a process group (store rendezvous)
    """Seconds for every member to arrive in a group's rendezvous (released at once when a member is known dead);
    the backend's connect then gets min(`timeout_s`, this)."""
    min_gbps: float = positive(1.0)  # the slowest link a payload-scaled wait assumes (hsgd/core/deadlines.py)
    """The slowest link assumed when a deadline is scaled by its payload: a collective or heal waits at most
    `comm.timeout_s` + bytes × 8 / (`min_gbps` × 10⁹) s."""
    inner_backend: str | None = one_of(None, BACKENDS)
    """null = follow `comm.backend`; the backend of the inner level (a cluster's replicas, the fast link)."""
    outer_backend: str | None = one_of(None, BACKENDS)
    """null = follow `comm.backend`; the backend of the outer level (the clusters' leaders, across sites); `auto`
    here means gloo: the slow link is TCP, and the pseudo-gradients stay in host memory."""
    bucket_mb: float = positive(25.0)  # inner ddp: gradient buckets all-reduced from backward hooks as they fill
    """Inner `ddp`: gradients all-reduced in buckets of this many MB, launched from backward hooks as they fill; 0 =
    one all-reduce after the backward. Unused with `gpus_per_replica` > 1. See Scaling."""


@dataclass
class LinkConfig:
    gbps: float = non_negative(0.0)
    """The simulated link's speed: each collective of the level lasts at least latency + jitter + bytes × 8 /
    (`gbps` × 10⁹) s. 0 = off (then latency and jitter must be 0), else ≥ `comm.min_gbps`. See Scaling."""
    latency_ms: float = milliseconds_or_zero(0.0)
    """The simulated link's latency per collective, in ms."""
    jitter_ms: float = milliseconds_or_zero(0.0)
    """A random extra latency per collective, uniform in [0, `jitter_ms`], seeded by `seed`."""


@dataclass
class LinksConfig:
    outer: LinkConfig = field(default_factory=LinkConfig)  # between clusters (the slow link)
    """A simulated slow link between clusters (the outer level), for experiments on one machine."""
    inner: LinkConfig = field(default_factory=LinkConfig)  # inside a cluster
    """A simulated link inside a cluster: its all-reduces, the commit's broadcast, heals over the process group."""


@dataclass
class SupervisorConfig:
    phase_timeout_s: float = seconds(300.0)  # hard deadline for one phase call on a replica
    """Deadline of a phase call on a replica."""
    call_timeout_s: float = seconds(60.0)  # small control calls (configure, status, heal)
    """Deadline of a control call (configure, status, heal)."""
    max_restarts: int = restarts(10)  # restarts of the supervisor actor itself
    """Restarts of the supervisor actor, as Ray's `max_restarts` (−1 = forever; the driver agrees)."""
    min_replicas_per_cluster: int = count(1)  # a cluster with fewer live replicas sits out outer sync
    """Quorum: a cluster with fewer live replicas sits the round out (a site's own `min_replicas` overrides it)."""
    min_clusters: int = count(1)  # fewer clusters in quorum: wait up to quorum_wait_s, then fail the run
    """Quorum: with fewer clusters left the supervisor waits `quorum_wait_s`, then ends the run `failed`."""
    quorum_wait_s: float = seconds(60.0)
    """Below quorum: wait this long, then fail the run (the last checkpoint intact for `train.resume=true`). Also
    how long resources that exist may stay busy at placement."""
    rejoin: str = one_of("fast", ("fast", "boundary"))  # a restarted replica joins inside the round, or at the next
    """`fast`: a restarted replica joins its cluster inside the round, at a step boundary. `boundary`: at the next
    round (same seed + schedule → same digest)."""
    rejoin_wait_s: float = seconds_or_zero(30.0)  # boundary: wait this long for a restarting replica
    """`boundary` rejoin: wait this long for a restarting replica at a round boundary."""
    join_timeout_s: float = seconds(600.0)
    """An added site not up this long after it was started is abandoned (`site_abandoned`); the default covers
    placement, the replicas' start and a resumed site's load, with margin."""


@dataclass
class WatchdogConfig:
    multiple: float = count(4.0)
    """A replica in an inner phase is hung when its step stops advancing for clamp(`multiple` × median recent
    seconds per step, `floor_s`, `ceiling_s`). See Operations."""
    floor_s: float = seconds(15.0)
    """The shortest hang limit of an inner phase."""
    ceiling_s: float = seconds(300.0)
    """The longest hang limit of an inner phase; ≥ `floor_s`."""
    stack_dumps: bool = True  # on a missed deadline: dump every replica's stacks into hangs/
    """On a hang, dump the stuck replica's group's stacks (py-spy or faulthandler) into `hangs/`."""


@dataclass
class WandbConfig:
    mode: str = one_of("offline", ("offline", "online", "disabled"))
    """`offline` (files under `run.dir/wandb`), `online` (needs credentials: `WANDB_API_KEY`, or a key for the W&B
    host in `~/.netrc`; refused at start without), `disabled`."""
    project: str = "hsgd"
    """The wandb project."""
    entity: str | None = None
    """The wandb entity; null: wandb's default."""
    group: str | None = None
    """The wandb group; null: `run.name`."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """One wandb run per job, with the resolved config and the supervisor's global metrics. See Operations."""
    progress: bool = True  # console progress bar
    """A console progress bar."""
    step_times: bool = False  # run.dir/steps/<rid>.jsonl (hsgd.record.steps)
    """Write `steps/<rid>.jsonl` in the run folder, one line per committed inner step (`replica`, `step`, `t`,
    `pid`); the benchmarks time stalls and rejoins from it."""


@dataclass
class FaultsConfig:
    schedule: list[Any] = field(default_factory=list)
    """Faults to inject, e.g. `[{kind:kill,target:c0r1,round:2,phase:inner,step:3}]`; a fault whose moment never
    comes is refused. See Faults and drills."""
    mtbf_s: float = non_negative(0.0)  # random faults with this mean time between failures, 0 = off
    """Random faults of `faults.kinds` with this mean time between failures (exponential gaps from `faults.seed`),
    at most 10,000 expected; 0 = off."""
    kinds: list[str] = field(default_factory=lambda: ["kill", "crash"])
    """The kinds random faults draw from: `kill`, `crash`, `hang`, `comm`, `slow`, `error`, `nan`."""
    seed: int = seed_range(0)
    """The seed of the random faults: a seed always gives the same schedule."""
    step_s: float = seconds(0.1)  # seconds per inner step assumed: a seed gives one schedule on any machine
    """Seconds per inner step assumed when random fault times are mapped to step boundaries, so a seed gives one
    schedule on any machine."""
    max_restarts: int = restarts(10)  # restarts allowed per replica actor
    """Restarts allowed per replica actor (−1 = forever)."""
    quarantine_after: int = count_or_zero(3)  # deaths in quarantine_window_s (hsgd/core/quarantine.py)
    """Deaths within `quarantine_window_s` (injected ones not counted) after which a replica is re-created on
    another node, or kept out; 0 = off. See Sites."""
    quarantine_window_s: float = seconds(600.0)
    """The window of `quarantine_after`, in seconds."""
    node_loss_window_s: float = seconds_or_zero(5.0)
    """Replicas of one node dying within this many seconds of each other are one death of the node, counted
    against none of them (a raylet crash or an OOM kills a node's actors within ~1-2 s; 5 s holds that and the
    0.5-s reporting tick, far below a replica's restart-and-die-again cycle); 0 = every death its own."""


@dataclass
class RayConfig:
    address: str | None = None
    """Attach to a Ray cluster (also via `RAY_ADDRESS`, or under `ray job submit`); null: an embedded local one."""
    num_cpus: int | None = count(None)  # embedded cluster only
    """CPUs of the embedded cluster; unset, more than 8 replicas per core are refused (set, more than `num_cpus`),
    as is more than 80 % of the machine's memory."""


@dataclass
class HsgdConfig:
    seed: int = seed_range(0)
    """Every replica's random streams derive from it and the global replica index."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """How many clusters (sites), replicas and spares, and where Ray places them."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How replicas sync inside a cluster and clusters across the slow link."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The inner and outer optimizers."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model plug-in and the built-in GPT's sizes (the `model` group picks a preset)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The dataset plug-in and its batches."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The loss plug-in."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run's length, evaluation, precision and step pacing."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run's name and folders."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Durable checkpoints."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Process groups: backends, timeouts, buckets."""
    links: LinksConfig = field(default_factory=LinksConfig)
    """Simulated links, for experiments on one machine."""
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    """Deadlines, quorum and rejoins."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The hang watchdog."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """wandb, the progress bar, per-step timelines."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Fault injection, restarts and quarantine."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster to run on."""


def register_schema() -> None:
    """Make the schema the base of conf/config.yaml (its `hsgd_schema` default), and register its
    resolvers: `${hsgd.output_path:<path>}` (hydra.run.dir / hydra.sweep.dir) and `${hsgd.suffix:}`."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from hsgd.config.paths import output_path, run_suffix

    ConfigStore.instance().store(name="hsgd_schema", node=HsgdConfig)
    OmegaConf.register_new_resolver("hsgd.output_path", output_path, replace=True)
    OmegaConf.register_new_resolver("hsgd.suffix", run_suffix, replace=True)
