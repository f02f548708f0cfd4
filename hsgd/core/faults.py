"""Fault specs: what to break, where and when (public form: docs/faults.md), e.g.

    faults.schedule='[{kind:kill,target:c0r1,round:2,phase:inner,step:3}]'

Parsing with one-line errors per field, the random schedule (a pure function of `faults.seed`),
and which scheduled faults are due in a phase call. Faults fire at step/phase boundaries, so a
run with the same seed and schedule is reproducible.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hsgd.config.schema import ConfigError
from hsgd.core.phases import FAULT, STEPS, Phase
from hsgd.core.topology import parse_replica_id, replica_id

FAULT_KINDS = ("kill", "crash", "hang", "comm", "slow", "error", "nan")
_FIELDS = ("kind", "target", "round", "phase", "step", "seconds")
_GROUP_TARGET = re.compile(r"(?:leader|cluster):c(\d+)")


class FaultSpecError(ConfigError):
    """One-line error about one fault spec; `field` names the config key (validate's contract)."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault, parsed once (parse_fault) and carried as it is: a replica's phase call carries the
    ones due in it, a drill's `now` fault is one too (phase `now`: at the phase thread's next boundary)."""

    kind: str
    target: str  # "c0r1" | "leader:c1" | "cluster:c1" | "supervisor"
    round: int
    phase: Phase = Phase.INNER
    step: int = 0
    seconds: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))  # a name read from a file or a drill

    @property
    def target_kind(self) -> str:
        """replica | leader | cluster | supervisor"""
        if self.target == "supervisor":
            return "supervisor"
        return self.target.split(":", 1)[0] if ":" in self.target else "replica"

    @property
    def target_cluster(self) -> int | None:
        if self.target_kind == "supervisor":
            return None
        return int(self.target.partition(":c")[2]) if ":" in self.target else parse_replica_id(self.target)[0]

    def describe(self) -> str:
        where = f"round {self.round} {self.phase}" + (f" step {self.step}" if STEPS in self.phase.traits else "")
        return f"{self.kind} {self.target} at {where}"


def _check_target(
    name: str, target: str, clusters: int, replicas_per_cluster: int, sizes: Sequence[int] | None = None
) -> None:
    if target == "supervisor":
        return
    group = _GROUP_TARGET.fullmatch(target)
    if group and int(group[1]) >= clusters:
        raise FaultSpecError(name, f"target {target!r} names a cluster beyond topology.clusters={clusters}")
    if group:
        return
    try:
        cluster, index = parse_replica_id(target)
    except ValueError:
        raise FaultSpecError(
            name, f"unknown target {target!r}; valid: a replica id like c0r1, leader:c<k>, cluster:c<k> or supervisor"
        ) from None
    if replica_id(cluster, index) != target:
        raise FaultSpecError(
            name, f"target {target!r} is not a canonical replica id; write {replica_id(cluster, index)!r}"
        )
    if sizes is not None:  # topology.sites
        if cluster >= len(sizes) or index >= sizes[cluster]:
            raise FaultSpecError(name, f"target {target!r} is not in the topology (sites of {list(sizes)} replicas)")
    elif cluster >= clusters or index >= replicas_per_cluster:
        raise FaultSpecError(name, f"target {target!r} is not in the {clusters}x{replicas_per_cluster} topology")


def parse_fault(
    raw: Mapping[str, Any],
    *,
    index: int = 0,
    clusters: int = 2,
    replicas_per_cluster: int = 2,
    sizes: Sequence[int] | None = None,
) -> FaultSpec:
    """One schedule entry, checked against the topology (`sizes`: replicas per site, when they differ)."""
    name = f"faults.schedule[{index}]"
    if not isinstance(raw, Mapping):
        raise FaultSpecError(name, f"got {raw!r}; each entry is {{kind:..,target:..,round:..,phase:..,step:..}}")
    unknown = sorted(set(map(str, raw)) - set(_FIELDS))
    if unknown:
        raise FaultSpecError(f"{name}.{unknown[0]}", f"unknown key; valid keys: {', '.join(_FIELDS)}")
    for key in ("kind", "target", "round"):
        if key not in raw:
            raise FaultSpecError(f"{name}.{key}", "is missing")
    # str(): YAML and Hydra read the kind `nan` as a float NaN, whose str() is "nan"
    kind, target, phase = str(raw["kind"]), str(raw["target"]), str(raw.get("phase", "inner"))
    if kind not in FAULT_KINDS:
        raise FaultSpecError(f"{name}.kind", f"unknown kind {kind!r}; valid: {'|'.join(FAULT_KINDS)}")
    if phase not in Phase.having(FAULT):
        raise FaultSpecError(f"{name}.phase", f"unknown phase {phase!r}; valid: {'|'.join(Phase.having(FAULT))}")
    _check_target(f"{name}.target", target, clusters, replicas_per_cluster, sizes)
    if target == "supervisor" and kind not in ("kill", "crash"):
        raise FaultSpecError(f"{name}.kind", f"{kind!r} cannot target the supervisor; valid: kill|crash")
    ints = {"round": raw["round"], "step": raw.get("step", 0)}
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FaultSpecError(f"{name}.{key}", f"got {value!r}; must be an integer >= 0")
    seconds = raw.get("seconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise FaultSpecError(f"{name}.seconds", f"got {seconds!r}; must be a number > 0")
    return FaultSpec(
        kind=kind,
        target=target,
        round=ints["round"],
        phase=phase,
        step=ints["step"],
        seconds=None if seconds is None else float(seconds),
    )


def topology_shape(topology) -> dict:
    """The keyword arguments the parsers take for `topology` (hsgd.core.topology.Topology)."""
    return {
        "clusters": topology.clusters,
        "replicas_per_cluster": topology.replicas_per_cluster,
        "sizes": None if topology.uniform else topology.sizes,
    }


def parse_schedule(
    raw: list, *, clusters: int, replicas_per_cluster: int, sizes: Sequence[int] | None = None
) -> list[FaultSpec]:
    if not isinstance(raw, (list, tuple)):
        raise FaultSpecError(
            "faults.schedule", f"got {raw!r}; must be a list like '[{{kind:kill,target:c0r1,round:1}}]'"
        )
    return [
        parse_fault(entry, index=i, clusters=clusters, replicas_per_cluster=replicas_per_cluster, sizes=sizes)
        for i, entry in enumerate(raw)
    ]


def random_schedule(
    *,
    mtbf_s: float,
    kinds: list[str],
    seed: int,
    rounds: int,
    round_s_estimate: float,
    steps_per_round: int,
    clusters: int,
    replicas_per_cluster: int,
    sizes: Sequence[int] | None = None,
) -> list[FaultSpec]:
    """Draw faults with exponential gaps (mean `mtbf_s`), mapped to (round, step) boundaries using
    an estimate of one round's seconds so the schedule is a pure function of the seed."""
    rng = random.Random(seed)
    faults, t, horizon = [], 0.0, rounds * round_s_estimate
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon:
            return faults
        cluster = rng.randrange(clusters)
        target = f"c{cluster}r{rng.randrange(sizes[cluster] if sizes else replicas_per_cluster)}"
        faults.append(
            FaultSpec(
                kind=rng.choice(list(kinds)),
                target=target,
                round=int(t // round_s_estimate),
                phase=Phase.INNER,
                step=int((t % round_s_estimate) / round_s_estimate * steps_per_round),
            )
        )


def fired_as(spec: FaultSpec, line: Mapping[str, Any]) -> bool:
    """Whether a faults_fired.jsonl `line` records `spec` firing: its kind, round and phase, on a
    replica it targets, at its step in inner phases (a line written from outside has no pid)."""
    rid, f = str(line.get("rid")), spec
    if f.target_kind == "replica":
        hit = rid == f.target
    else:  # leader:c1 | cluster:c1: a replica of c1 (the supervisor's own faults are recorded as fired)
        hit = f.target_kind != "supervisor" and rid.startswith(f"c{f.target_cluster}r")
    return (
        hit
        and line.get("kind") == f.kind
        and line.get("round") == f.round
        and line.get("phase") == f.phase
        and not (STEPS in f.phase.traits and line.get("pid") is not None and line.get("step") != f.step)
    )


@dataclass(frozen=True)
class Delivery:
    """One scheduled fault, due now, resolved to the replicas it hits."""

    index: int  # position in the schedule: recorded as fired so it never fires twice
    spec: FaultSpec  # what a replica's phase call carries to fire it at the right boundary
    targets: tuple[str, ...]


def due_faults(
    faults: list[FaultSpec], fired, *, round_index: int, phases: tuple[str, ...], plan, only: set[str] | None = None
) -> list[Delivery]:
    """Replica faults of the schedule that are due in a phase call of `round_index` covering
    `phases`, with targets resolved under `plan` (a membership.Plan): `leader:c1` is whoever leads
    c1 now, `cluster:c1` every live member. A fault whose targets are all gone (or outside `only`)
    stays pending. Supervisor faults are the supervisor's own business and never listed here."""
    due = []
    for i, f in enumerate(faults):
        if i in fired or f.round != round_index or f.phase not in phases or f.target_kind == "supervisor":
            continue
        if f.target_kind == "replica":
            targets = [f.target] if f.target in plan.live else []
        elif f.target_kind == "leader":
            targets = [plan.leaders[f.target_cluster]] if f.target_cluster in plan.leaders else []
        else:
            targets = list(plan.members.get(f.target_cluster, ()))
        targets = [t for t in targets if only is None or t in only]
        if targets:
            due.append(Delivery(index=i, spec=f, targets=tuple(targets)))
    return due
