"""Validation of a resolved config: the rules the types cannot express.

`validate(cfg)` raises `ConfigError` whose message is ONE line naming the field and what would be
valid; the entry point prints it and exits with code 2 before any actor starts.
"""
from __future__ import annotations

import os
from typing import Any

from hsgd.config.schema import (BACKENDS, INNER_ALGORITHMS, INNER_OPTIMIZERS, OUTER_ALGORITHMS,
                                PLACEMENT_STRATEGIES, REJOIN_MODES, WANDB_MODES, ConfigError)


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
    _positive("topology.spares_per_cluster", t.spares_per_cluster, allow_zero=True)
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
    _positive("train.min_step_s", cfg.train.min_step_s, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _choice("comm.backend", cfg.comm.backend, BACKENDS)
    _positive("comm.timeout_s", cfg.comm.timeout_s)
    _positive("comm.configure_timeout_s", cfg.comm.configure_timeout_s)
    _positive("comm.min_gbps", cfg.comm.min_gbps)
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
    _choice("supervisor.rejoin", sup.rejoin, REJOIN_MODES)
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
    from hsgd.core.faults import parse_schedule, FAULT_KINDS

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
        problem = unfirable_reason(spec, cfg)
        if problem is not None:
            raise ConfigError(f"faults.schedule[{i}].{problem[0]}", problem[1])


def unfirable_reason(spec, cfg) -> tuple[str, str] | None:
    """(field, one-line reason) when a scheduled fault's moment never comes in this config: a drill
    must not "pass" a failure that never happened."""
    s, t = cfg.sync, cfg.topology
    if spec.target_kind == "supervisor" and spec.phase not in ("inner", "outer", "outer_commit", "checkpoint"):
        return "phase", f"the supervisor has no {spec.phase!r} phase; valid for it: inner|outer|outer_commit|checkpoint"
    if spec.phase == "checkpoint":
        every, rounds = cfg.checkpoint.every, cfg.train.rounds
        saved = [r for r in range(rounds) if every and ((r + 1) % every == 0 or r + 1 == rounds)]
        if spec.round not in saved:
            shown = ", ".join(map(str, saved[:6])) + (", ..." if len(saved) > 6 else "")
            return "phase", (f"checkpoint never happens in round {spec.round} (checkpoint.every={every} saves after "
                             f"rounds {shown or 'none'}); valid rounds for checkpoint: {shown or 'none'}")
    if spec.phase == "inner_sync":
        if s.inner == "none" and t.replicas_per_cluster == 1:
            return "phase", "inner_sync never happens with sync.inner=none and one replica per cluster; valid: inner|outer|outer_commit|checkpoint"
        if s.inner == "localsgd" and (spec.step + 1) % s.inner_every != 0:
            steps = [k for k in range(s.outer_every) if (k + 1) % s.inner_every == 0]
            return "step", (f"localsgd syncs after steps {', '.join(map(str, steps[:6]))}{', ...' if len(steps) > 6 else ''} "
                            f"(sync.inner_every={s.inner_every}); inner_sync at step {spec.step} never happens")
        if s.inner == "none" and spec.step != 0:
            return "step", "with sync.inner=none the cluster average happens once, at the round's end; use step 0"
    return None  # outer and outer_commit happen in every round, whatever the algorithm


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """`auto` means nccl when CUDA is present, else gloo."""
    if backend == "auto":
        return "nccl" if cuda_available else "gloo"
    if backend == "nccl" and not cuda_available:
        raise ConfigError("comm.backend", "nccl needs CUDA, which this machine lacks; valid here: auto|gloo")
    return backend
