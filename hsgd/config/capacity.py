"""Will the Ray cluster hold this topology? Pure decisions (only `usable_memory_bytes` reads a
file), so an impossible run is one config error, never actors fighting for two cores or placement
groups that never get ready (the embedded cluster's limits: `ray.num_cpus`,
docs/reference/configuration.md). Backends per level: the driver plans them from the Ray cluster's
resources, never its own CUDA (a CPU-only head node is the usual `ray job submit` target); each
replica resolves them by its GPU.

A replica of k ranks (`topology.gpus_per_replica`, issue 34) is k processes on one node: every
resource check counts a replica as k times one rank's resources on one node, a GPU node's count
must be a multiple of k, and a rank's memory is its shard of the state plus one gathered layer
(`rank_state_bytes`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hsgd.config.layout import BackendPlan, RunLayout, ranks_of, sites_and_ranks
from hsgd.config.schema import ConfigError, HsgdConfig

PROCESS_BYTES = 350 * 2**20  # a replica (or rank) process with torch imported
STATE_COPIES = (
    8  # params, grads, 2 AdamW moments, global params, outer momentum, error-feedback residual, outer snapshot
)
GATHERED_COPIES = 2  # FSDP2's one unsharded layer at a time: its gathered params, and its full gradient in backward
MAX_REPLICAS_PER_CORE = 8
GiB = 2**30
LABEL_KEY = "hsgd-cluster"  # the Ray node label that pins a cluster (`ray start --labels hsgd-cluster=rack-a`)


def model_param_count(n_layer: int, n_embd: int, block_size: int, vocab_size: int = 256) -> int:
    """nanoGPT's parameter count (tied embeddings), for the memory estimate."""
    return vocab_size * n_embd + block_size * n_embd + n_layer * 12 * n_embd * n_embd + 2 * n_embd


def layer_param_count(n_embd: int, block_size: int, vocab_size: int = 256) -> int:
    """The largest unit FSDP2 gathers whole (`fully_shard` per block, then the root): a transformer
    block (attention + MLP, 12 n_embd^2, plus its two layer norms) or the root's embeddings."""
    return max(12 * n_embd * n_embd + 4 * n_embd, vocab_size * n_embd + block_size * n_embd + 2 * n_embd)


def rank_state_bytes(n_layer: int, n_embd: int, block_size: int, ranks: int, vocab_size: int = 256) -> int:
    """Training-state bytes one rank process holds (fp32, activations not counted). The rule: with k
    ranks a rank keeps 1/k of the STATE_COPIES copies of the parameters (its shard of params, grads,
    optimizer and outer state) plus one full gathered layer (GATHERED_COPIES copies of the largest
    unit, `layer_param_count`), which exists only while that layer runs. k = 1: the whole
    STATE_COPIES copies, nothing gathered (no sharding)."""
    params = model_param_count(n_layer, n_embd, block_size, vocab_size)
    if ranks == 1:
        return STATE_COPIES * 4 * params
    shard = -(-params // ranks)  # FSDP2 pads each tensor's dim 0 to a multiple of k: round the shard up
    return STATE_COPIES * 4 * shard + GATHERED_COPIES * 4 * layer_param_count(n_embd, block_size, vocab_size)


def usable_memory_bytes(physical_bytes: int, cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """The memory this process may use: the machine's, or its container's limit when lower (in a
    container the page count is the host's, so a check against it passes and replicas get OOM-killed)."""
    limits = [physical_bytes]
    for name in ("memory.max", "memory/memory.limit_in_bytes"):  # cgroup v2, then v1
        try:
            text = (Path(cgroup_root) / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 says "max" for no limit; v1 says a huge number, which min() ignores
            limits.append(int(text))
    return min(limits)


def embedded_capacity_problem(
    *,
    replicas: int,
    cpus_per_replica: float,
    cores: int,
    memory_bytes: int,
    per_replica_bytes: int,
    num_cpus: int | None,
    ranks: int = 1,
) -> str | None:
    """None if the embedded cluster can hold `replicas` replicas of `ranks` processes each, else a
    one-line reason with a hint. `per_replica_bytes` and `cpus_per_replica` are per process (per rank)."""
    processes = replicas * ranks
    what = f"{replicas} replicas" + (f" x {ranks} ranks (topology.gpus_per_replica)" if ranks > 1 else "")
    need = processes * per_replica_bytes
    if need > 0.8 * memory_bytes:
        return (
            f"{what} need ~{need / GiB:,.0f} GiB but this machine has {memory_bytes / GiB:,.0f} GiB; "
            f"use fewer replicas (topology.clusters x topology.replicas_per_cluster), or attach to a real "
            f"cluster with ray.address=<head>:6379"
        )
    if num_cpus is not None:
        if processes * cpus_per_replica > num_cpus:
            return (
                f"{what} x topology.cpus_per_replica={cpus_per_replica:g} need "
                f"{processes * cpus_per_replica:g} CPUs but ray.num_cpus={num_cpus}; raise ray.num_cpus, lower "
                f"topology.cpus_per_replica, or attach to a real cluster with ray.address=<head>:6379"
            )
        return None
    if processes > MAX_REPLICAS_PER_CORE * cores:
        return (
            f"{what} on {cores} cores is more than {MAX_REPLICAS_PER_CORE} per core; use fewer "
            f"replicas, set ray.num_cpus to size the embedded cluster yourself, or attach to a real cluster "
            f"with ray.address=<head>:6379"
        )
    return None


def describe_resources(need: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in need.items()) + "}"


def replicas_that_fit(node_resources: dict, need: dict) -> int:
    """How many replicas with resources `need` (the whole replica's: all its ranks) one node can hold at most."""
    counts = [int(node_resources.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return min(counts) if counts else 1 << 30


def replica_need(cfg: HsgdConfig, rank_need: dict, layout: RunLayout | None = None) -> dict:
    """One replica's resources: its k ranks' (topology.gpus_per_replica), all on one node."""
    ranks = ranks_of(cfg, layout)
    return {key: amount * ranks for key, amount in rank_need.items()}


def placement_problem(
    cfg: HsgdConfig, rank_need: dict, nodes: list[dict], sizes: list[int] | None = None, layout: RunLayout | None = None
) -> tuple[str, str] | None:
    """(field, one-line reason) when the Ray cluster can never place every cluster's replicas AND hot
    spares (each cluster's placement group holds both), else None. `rank_need`: one rank process's
    resources (a replica is k of them on one node: `replica_need`); `nodes`: the live nodes,
    {"Resources": {...}, "Labels": {...}}; `sizes`: replicas per site when not the topology's own
    (the backend plan caps them); `layout`: the run's (else worked out from `cfg`)."""
    topo, ranks = sites_and_ranks(cfg, layout)
    t = cfg.topology
    need = replica_need(cfg, rank_need, layout)
    total = sum((Counter(nd.get("Resources", {})) for nd in nodes), Counter())  # as ray.cluster_resources() sums
    spares, strategy, cluster_labels = t.spares_per_cluster, t.placement_strategy, topo.labels
    ks = [m + spares for m in (sizes or topo.sizes)]
    k, n = max(ks, default=0), sum(ks)
    label_field = "topology.sites[{c}].label" if t.sites else "topology.cluster_labels[{c}]"
    what = f"{n} replicas" + (" (hot spares included)" if spares else "")
    for key, amount in need.items():
        if amount * n > total.get(key, 0.0) + 1e-9:
            field = "topology.cpus_per_replica" if key == "CPU" else "comm.backend"
            if ranks > 1:
                field += " or topology.gpus_per_replica"
            return (
                "topology.sites" if t.sites else "topology.replicas_per_cluster",
                f"{what} need {amount * n:g} {key} but the Ray cluster has {total.get(key, 0.0):g}; "
                f"use fewer replicas{' or spares' if spares else ''}, lower {field}, or a bigger cluster",
            )
    if any(label is not None for label in cluster_labels):
        return _labelled_problem(nodes, need, ks, cluster_labels, label_field)
    fits = sorted((replicas_that_fit(nd["Resources"], need) for nd in nodes), reverse=True)
    if strategy == "STRICT_PACK":
        # every cluster on one node: the largest first, each on the node with the most room left
        room, placed = list(fits), 0
        for kc in sorted(ks, reverse=True):
            best = max(range(len(room)), key=room.__getitem__, default=None)
            if best is None or room[best] < kc:
                break
            room[best] -= kc
            placed += 1
        if placed < len(ks):
            each = f"{k}" if len(set(ks)) <= 1 else f"(up to {k})"
            return (
                "topology.placement_strategy",
                f"STRICT_PACK needs each cluster's {each} replicas of {describe_resources(need)} on one node, "
                f"but the nodes hold at most {fits[:8]} replicas each, room for {placed} "
                f"of {len(ks)} clusters; use PACK, fewer replicas per cluster, or bigger nodes",
            )
    elif strategy == "STRICT_SPREAD" and (usable := sum(1 for f in fits if f >= 1)) < k:
        return (
            "topology.placement_strategy",
            f"STRICT_SPREAD needs {k} nodes per cluster that each fit one replica of "
            f"{describe_resources(need)}; the Ray cluster has {usable}",
        )
    if sum(fits) < n:
        return (
            "topology.sites" if t.sites else "topology.replicas_per_cluster",
            f"{what} of {describe_resources(need)} do not fit on the nodes (at most {sum(fits)}: "
            f"per node {fits[:8]}); use fewer replicas or a bigger cluster",
        )
    return None


def _labelled_problem(nodes: list[dict], need: dict, ks: list[int], cluster_labels, label_field: str):
    """placement_problem for clusters pinned to labelled nodes: each label's nodes hold its clusters."""
    present = sorted({str(nd["Labels"][LABEL_KEY]) for nd in nodes if LABEL_KEY in nd.get("Labels", {})})
    for c, label in enumerate(cluster_labels):
        if label is None:
            continue
        mine = [nd for nd in nodes if nd.get("Labels", {}).get(LABEL_KEY) == str(label)]
        if not mine:
            return (
                label_field.format(c=c),
                f"no live Ray node has the label {LABEL_KEY}={label}; labelled nodes: "
                f"{present or 'none'} (start nodes with `ray start --labels {LABEL_KEY}={label}`)",
            )
        room = sum(replicas_that_fit(nd["Resources"], need) for nd in mine)
        sharing = [kc for kc, lab in zip(ks, cluster_labels, strict=False) if str(lab) == str(label)]
        if room < sum(sharing):
            return (
                label_field.format(c=c),
                f"nodes labelled {LABEL_KEY}={label} hold at most {room} replicas of "
                f"{describe_resources(need)}; cluster c{c} needs {ks[c]}"
                + (f" ({sum(sharing)} for the {len(sharing)} clusters sharing the label)" if len(sharing) > 1 else ""),
            )
    return None


# -- backends per level --------------------------------------------------------------------------
def gpu_node_problem(ranks: int, nodes: list[dict]) -> str | None:
    """One line when `ranks` (topology.gpus_per_replica) does not divide some GPU node's GPU count
    (a replica's ranks share one node, so the rest of that node's GPUs would idle), else None. Nodes
    without GPUs (a CPU head node) do not count; a cluster without GPUs has nothing to divide."""
    counts = sorted({int(nd.get("Resources", {}).get("GPU", 0.0) + 1e-9) for nd in nodes} - {0})
    if ranks == 1 or not counts:
        return None
    bad = [g for g in counts if g % ranks]
    if not bad:
        return None
    divisors = [d for d in range(1, min(counts) + 1) if all(g % d == 0 for g in counts)]
    return (
        f"{ranks} does not divide the GPUs of every GPU node (per node: {counts[::-1][:8]}; {bad[0]} is not a "
        f"multiple of {ranks}): a replica's ranks share one node; valid: {', '.join(map(str, divisors))}"
    )


def plan_backends(cfg: HsgdConfig, nodes: list[dict], layout: RunLayout | None = None) -> BackendPlan:
    """The per-level backends and GPUs per rank for the live `nodes` (as for `placement_problem`).
    nccl on a level needs every rank of every replica and spare to get a GPU of its own, placed as
    the strategy requires, else ConfigError; so does a `topology.gpus_per_replica` that does not
    divide a GPU node's count. Inner `auto`: nccl only where every rank gets its own GPU, else gloo
    with a notice (none on a cluster without GPUs)."""
    (topo, ranks), c, t = sites_and_ranks(cfg, layout), cfg.comm, cfg.topology
    if (problem := gpu_node_problem(ranks, nodes)) is not None:
        raise ConfigError("topology.gpus_per_replica", problem)
    # comm.backend asks both levels; a per-level key (not null) overrides it
    inner, inner_field = (c.inner_backend, "comm.inner_backend") if c.inner_backend else (c.backend, "comm.backend")
    outer, outer_field = (c.outer_backend, "comm.outer_backend") if c.outer_backend else (c.backend, "comm.backend")
    outer = "gloo" if outer == "auto" else outer  # the slow link between sites is TCP: NCCL over it buys nothing
    spares, replicas_per_cluster = t.spares_per_cluster, topo.replicas_per_cluster
    cpus = {"CPU": float(t.cpus_per_replica)}

    def gpus_fit(per_cluster: int) -> bool:  # every site capped at `per_cluster` replicas
        capped = [min(m, per_cluster) for m in topo.sizes]
        return placement_problem(cfg, {**cpus, "GPU": 1.0}, nodes, capped, layout) is None

    gpus = int(sum(nd.get("Resources", {}).get("GPU", 0.0) for nd in nodes) + 1e-9)
    if gpus_fit(replicas_per_cluster):
        return BackendPlan(inner, outer, 1.0 if "nccl" in (inner, outer) or inner == "auto" else 0.0)
    if placement_problem(cfg, cpus, nodes, layout=layout) is not None:  # short of CPUs whatever the backend
        return BackendPlan("gloo" if inner == "auto" else inner, outer, 1.0 if "nccl" in (inner, outer) else 0.0)
    fewer = next((m for m in range(replicas_per_cluster - 1, 0, -1) if gpus_fit(m)), None)
    counts = _gpu_shortage(t, topo, ranks, nodes, gpus)
    shorter = f"topology.replicas_per_cluster<={fewer}" + (" (spares included)" if spares else "")
    if "nccl" in (inner, outer):
        field = inner_field if inner == "nccl" else outer_field
        valid = " or ".join(
            ([shorter] if fewer else [])
            + [f"{field}=gloo"]
            + ([f"{field}=auto"] if field != "comm.outer_backend" else [])
        )
        raise ConfigError(
            field, f"nccl needs one GPU per {'rank' if ranks > 1 else 'replica'}: {counts}; valid: {valid}"
        )
    if inner == "auto" and gpus > 0:
        hint = f"; {shorter} would give each replica its own GPU" if fewer else ""
        return BackendPlan("gloo", outer, 0.0, f"{inner_field}=auto: gloo on CPU, not nccl: {counts}{hint}")
    return BackendPlan("gloo" if inner == "auto" else inner, outer, 0.0)


def resolve_level_backend(asked: str, *, level: str, gpu: bool) -> str:
    """In the replica: the backend of `level` from what the driver handed it (BackendPlan) and
    whether it has a GPU of its own (Ray gave it one and torch there sees CUDA). `auto`: nccl for
    the inner level with a GPU, else gloo. nccl without a GPU is a ConfigError."""
    if asked == "auto":
        return "nccl" if gpu and level == "inner" else "gloo"
    if asked == "nccl" and not gpu:
        raise ConfigError(
            f"comm.{level}_backend",
            "nccl needs a GPU of this replica's own, but it has none (Ray "
            "gave it no GPU, or torch here lacks CUDA); valid here: gloo|auto",
        )
    return asked


# -- inputs only the cluster knows -------------------------------------------------------------------
def data_path_problem(path: str, answers: dict) -> str | None:
    """One line naming the nodes where `path` does not exist, else None. `answers`: {node name:
    True (exists) | False (missing) | None (no answer in time: not counted as missing)}."""
    missing = sorted(name for name, exists in answers.items() if exists is False)
    if not missing:
        return None
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (
        f"{path!r} does not exist on node{'s' if len(missing) > 1 else ''} {shown} "
        f"({len(missing)} of {len(answers)} nodes that may run replicas); put the data on every node at the "
        f"same path (an absolute path, or relative to the job's working directory), or use shared storage"
    )


def _gpu_shortage(t, topo, ranks: int, nodes: list[dict], gpus: int) -> str:
    """What a nccl plan lacks, in one phrase: `n replicas (shape) need g GPUs, but the cluster has ...`."""
    spares, clusters, replicas_per_cluster = t.spares_per_cluster, topo.clusters, topo.replicas_per_cluster
    k, n = replicas_per_cluster + spares, topo.num_replicas + clusters * spares
    where = (
        f", each cluster's {k} on one node (STRICT_PACK)"
        if t.placement_strategy == "STRICT_PACK" and clusters * k > 1
        else ""
    )
    shape = (
        f"sites of {list(topo.sizes)}"
        if t.sites
        else f"{clusters} cluster{'s' if clusters != 1 else ''} x {replicas_per_cluster}"
    )
    per_node = sorted((int(nd.get("Resources", {}).get("GPU", 0.0) + 1e-9) for nd in nodes), reverse=True)
    return (
        f"{n} replicas ({shape}"
        f"{f' + {spares} spares' if spares else ''}{f' of {ranks} ranks' if ranks > 1 else ''}) "
        f"need {n * ranks} GPUs{where}, but the "
        f"Ray cluster has {gpus} GPU{'s' if gpus != 1 else ''} (per node: {per_node[:8]})"
    )
