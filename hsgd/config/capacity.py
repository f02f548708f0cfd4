"""Will the embedded (local) Ray cluster hold this topology? Checked before Ray starts, so an
impossible run is one config error instead of thousands of actors fighting for two cores.

A replica is a process with torch, the model, its inner optimizer and the outer state: about
`PROCESS_BYTES` plus `STATE_COPIES` times the model's parameters. Memory must fit in 80 % of the
machine; CPUs may be oversubscribed (replicas of small tests mostly wait on each other) up to
`MAX_REPLICAS_PER_CORE`, unless `ray.num_cpus` is given, which is then honoured exactly.
"""
from __future__ import annotations

PROCESS_BYTES = 350 * 2**20  # a replica process with torch imported
STATE_COPIES = 6  # params, grads, 2 AdamW moments, global params, outer momentum
MAX_REPLICAS_PER_CORE = 8
GiB = 2**30


def model_param_count(n_layer: int, n_embd: int, block_size: int, vocab_size: int = 256) -> int:
    """nanoGPT's parameter count (tied embeddings), for the memory estimate."""
    return vocab_size * n_embd + block_size * n_embd + n_layer * 12 * n_embd * n_embd + 2 * n_embd


def embedded_capacity_problem(*, replicas: int, cpus_per_replica: float, cores: int, memory_bytes: int,
                              per_replica_bytes: int, num_cpus: int | None) -> str | None:
    """None if the embedded cluster can hold `replicas` actors, else a one-line reason with a hint."""
    need = replicas * per_replica_bytes
    if need > 0.8 * memory_bytes:
        return (f"{replicas} replicas need ~{need / GiB:,.0f} GiB but this machine has {memory_bytes / GiB:,.0f} GiB; "
                f"use fewer replicas (topology.clusters x topology.replicas_per_cluster), or attach to a real "
                f"cluster with ray.address=<head>:6379")
    if num_cpus is not None:
        if replicas * cpus_per_replica > num_cpus:
            return (f"{replicas} replicas x topology.cpus_per_replica={cpus_per_replica:g} need "
                    f"{replicas * cpus_per_replica:g} CPUs but ray.num_cpus={num_cpus}; raise ray.num_cpus, lower "
                    f"topology.cpus_per_replica, or attach to a real cluster with ray.address=<head>:6379")
        return None
    if replicas > MAX_REPLICAS_PER_CORE * cores:
        return (f"{replicas} replicas on {cores} cores is more than {MAX_REPLICAS_PER_CORE} per core; use fewer "
                f"replicas, set ray.num_cpus to size the embedded cluster yourself, or attach to a real cluster "
                f"with ray.address=<head>:6379")
    return None
