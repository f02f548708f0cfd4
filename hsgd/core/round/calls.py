"""The one record of calls in flight: which phase each replica is answering, who has not answered
yet, and what went wrong in each phase so far (the runner only maps a call id, (phase id, rid), to
its transport). One call at a time per replica: issuing a second is a bug of the machine, and raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsgd.core.round.messages import CallKind, Phase


@dataclass(slots=True, eq=False)
class InFlight:
    """A phase the machine waits on."""

    phase: Phase
    started: float
    pending: set[str] = field(init=False)  # members still to answer (and not given up on)
    failed_at: float | None = None  # when the phase saw its first failure
    # group -> when a member of that group first failed: a failure shortens the wait only for its own
    # group (one phase may span several: a commit broadcasts in every cluster, heals are one transfer each)
    failed_groups: dict[object, float] = field(default_factory=dict)
    peer_gone: dict[object, float] = field(default_factory=dict)  # group -> when a member saw a peer's connection close
    delivered: set[str] = field(default_factory=set)  # heal sources whose state arrived
    not_applied: set[str] = field(default_factory=set)  # (a commit) members that answered not done, or given up on
    aborted: bool = False  # (a forming phase) its rendezvous was released
    answers: dict[str, str] = field(default_factory=dict)  # rid -> how its call ended (PhaseEnded)

    def __post_init__(self) -> None:
        self.pending = set(self.phase.calls)

    @property
    def id(self) -> int:
        return self.phase.id

    def group_of(self, rid: str, cluster_of) -> object:
        """The group of rid within this phase: one cluster's broadcast in a commit, its own
        transfer in a heal, else the phase's single group."""
        if self.phase.kind is CallKind.OUTER_COMMIT:
            return cluster_of(rid)
        if self.phase.kind is CallKind.HEAL:
            return rid
        return None

    def failed(self, group: object, now: float) -> None:
        if self.failed_at is None:
            self.failed_at = now
        self.failed_groups.setdefault(group, now)


class CallBook:
    def __init__(self) -> None:
        self.inflight: dict[int, InFlight] = {}  # phase id -> its record
        self.busy: dict[str, InFlight] = {}  # rid -> the phase it has a call in flight in

    def issue(self, phase: Phase, now: float) -> InFlight:
        clash = next((rid for rid in phase.calls if rid in self.busy), None)
        if clash is not None:
            raise AssertionError(f"{clash} already has phase {self.busy[clash].id} in flight")
        flight = self.inflight[phase.id] = InFlight(phase, now)
        self.busy.update(dict.fromkeys(phase.calls, flight))
        return flight

    def take(self, phase_id: int, rid: str, how: str) -> InFlight | None:
        """rid answered its call of `phase_id`: its record, or None when the answer is stale (the
        call was given up on, or answered already)."""
        flight = self.busy.get(rid)
        if flight is None or flight.id != phase_id:
            return None
        del self.busy[rid]
        flight.pending.discard(rid)
        flight.answers[rid] = how
        return flight

    def give_up(self, flight: InFlight, rid: str, why: str) -> None:
        """Stop waiting for rid's answer (it was killed or is gone): a late one is stale."""
        if self.take(flight.id, rid, why) is not None and flight.phase.kind is CallKind.OUTER_COMMIT:
            flight.not_applied.add(rid)

    def close(self, flight: InFlight) -> bool:
        """Drop a phase every member answered (or was given up on). False: closed already."""
        return self.inflight.pop(flight.id, None) is not None
