"""What the round machine and its runner say to each other, all typed: nothing in hsgd/core
reads error text or a dict.

Effects (out of the machine, for the runner to carry out):

    Phase      calls the machine waits on: each of `calls` is answered by exactly one
               `Answer(phase id, rid, ...)` (the call id), or given up on (the replica was killed,
               reaped or lost: a late answer is stale and ignored).
    Kill       a replica silent and not advancing past its limit: report it (stacks), kill it
               restartable. No answer expected; its call in flight is already given up on.
    Reap       a replica presumed dead (every peer of its group saw its connection close): nothing
               to kill (Ray is restarting it), no hang report; its call is given up on.
    Yield      ask members in `run_inner` of group `epoch` to return at a step boundary (control
               channel; their run_inner answers `yielded`).
    AbortJoin  release every member waiting in the rendezvous of group `prefix` (a member is known
               dead): their calls answer `collective_failed`, kind `join_aborted`. Aborting a group
               that already formed changes nothing (it is read only while waiting).
    StepTimed  a measured inner step time (the supervisor's learned deadlines).
    RoundClosed (sync.balance=time) the round closed: the in-round step each cluster's inner phase
               ends at, to be saved before any yield is asked (a restarted supervisor follows it).
    Late       (sync.balance=time) a cluster not ready by the round's close plus its grace sits the
               round out, nobody killed; `abandoned`: its members whose calls were given up on (still
               running or paused): the runner calls them again only once those calls have ended.
    PhaseEnded every call of a phase was answered or given up on (the record's phase_end).

Observations (into the machine): `Observation`, each with its docstring. The machine's own
stages (`ClusterStage`, `OuterStage`) are here too: what is derived from a stage is a property of
it, never a set kept in step by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import ClassVar, NamedTuple

from hsgd.core.phases import Phase as PhaseName


class Outcome(str, Enum):  # noqa: UP042 — str() is "Outcome.DONE"; a StrEnum's would be "done"
    """What one replica's call came to."""

    DONE = "done"  # the phase's work for the round is done (also: it was already done)
    BEHIND = "behind"  # the replica has not reached the round asked: it needs a heal
    COLLECTIVE_FAILED = "collective_failed"  # alive, but its group broke (a peer failed) or never formed
    YIELDED = "yielded"  # stopped at a step boundary on request (a mid-round rejoin, the round's close)
    DIED = "died"  # the actor is gone (Ray said so, or we killed it)
    ERROR = "error"  # the replica raised: that replica's failure; it is killed and restarted
    IO_ERROR = "io_error"  # a write to the run's storage failed (a checkpoint): the run's problem, nobody is killed
    NON_FINITE = "non_finite"  # a loss, gradient norm or pseudo-gradient was NaN/inf: the cluster's round is void


def raised(*, actor_gone: bool, source_failed: bool) -> Outcome:
    """Whose failure a round's call that raised instead of answering is: its heal source's (the state
    never came: Ray fails a call whose argument failed; the target heals again), else the actor is
    gone (Ray says so), else the replica raised (OOM, I/O, a bug): its own, never the job's."""
    return Outcome.COLLECTIVE_FAILED if source_failed else Outcome.DIED if actor_gone else Outcome.ERROR


def unanswered_heal(source_failed: bool, *, in_time: bool = True) -> Outcome:
    """A final heal's target (outside a round: nobody is killed) that gave no answer: not by the
    deadline, or its source failed: not healed, it heals at the next start; else it raised: died."""
    return Outcome.COLLECTIVE_FAILED if source_failed or not in_time else Outcome.DIED


class ClusterStage(StrEnum):
    """Where a cluster is in its round (cluster.py)."""

    NEW = "new"  # the round has not started it yet
    HEAL = "heal"  # laggards copy state
    INNER = "inner"  # its inner phase runs (forming its group first when its members changed)
    AVERAGE = "average"  # inner `none`: the cluster's mean
    READY = "ready"  # done: waiting for the outer exchange
    REFORM = "reform"  # an outer retry broke it: it re-forms before the next exchange
    OUT = "out"  # it sits the round out (too few members, void, benched)

    @property
    def waits_for_outer(self) -> bool:
        """Nothing left to do before the outer exchange (ready, or sitting out)."""
        return self in (ClusterStage.READY, ClusterStage.OUT)


class OuterStage(StrEnum):
    """Where the outer exchange is (outer.py)."""

    WAIT = "wait"  # for every participating cluster to be ready
    REDUCE = "reduce"
    COMMIT = "commit"
    DONE = "done"


class ErrorKind(StrEnum):
    """How a collective failed: hsgd.train.comm.CollectiveError.kind, the `error_kind` of an answer
    and of a `collective_failed` event. The one definition of the kinds."""

    NONE = ""  # no collective error (or the runner could not tell)
    CONFIGURE = "configure"  # the group could not be built or joined in time
    ISSUE = "issue"  # the collective could not be started
    WAIT = "wait"  # the collective failed while in flight
    PEER_GONE = "peer_gone"  # a peer's connection closed: its process is gone, not hung
    TIMEOUT = "timeout"  # the collective timed out: a peer may be hung or slow
    ABORTED = "aborted"  # the group was aborted locally (a fault, or an earlier failure)
    JOIN_ABORTED = "join_aborted"  # the rendezvous was released: a member is known dead (AbortJoin)


# -- observations --------------------------------------------------------------------------------------
class Answer(NamedTuple):
    """One replica's answer to its call of phase `phase_id`, or Ray's error for it as the runner
    classified it (`died`: the actor is gone; `error`: the replica raised). A tuple: tens of
    thousands a round at scale. `round`/`step`: its committed position after the call (-1: unknown)."""

    phase_id: int
    rid: str
    outcome: Outcome
    round: int = -1
    step: int = -1
    error_kind: ErrorKind = ErrorKind.NONE
    detail: str = ""


@dataclass(frozen=True)
class PhaseAnswer:
    """A replica's answer to a call (actors/replica.py, and a heal source's meta): its outcome, its
    committed (round, step) after the call, why it failed (`error`; `error_kind` for a collective;
    `what` the non-finite number: loss | grad_norm | pseudo_gradient), and `result`, the call's own
    numbers. Crosses Ray as it is; `wire()` is its flat dict (the calls whose callers read one),
    read back with `read` (a missing field, e.g. from another build of the replica, reads as its default)."""

    rid: str
    outcome: Outcome = Outcome.DONE
    round: int = -1
    step: int = -1
    error: str = ""
    error_kind: ErrorKind = ErrorKind.NONE
    what: str = ""
    result: dict = field(default_factory=dict)

    def wire(self) -> dict:
        return {
            **self.result,
            "rid": self.rid,
            "outcome": self.outcome.value,
            "round": self.round,
            "step": self.step,
            "error": self.error,
            "error_kind": self.error_kind.value,
            "what": self.what,
        }

    @classmethod
    def read(cls, wire: dict | PhaseAnswer) -> PhaseAnswer:
        """An answer as the replica gave it: typed, or its `wire()` dict (a fake's, an older call's)."""
        if isinstance(wire, PhaseAnswer):
            return wire
        result = {k: v for k, v in wire.items() if k not in _ANSWER_FIELDS}
        try:
            kind = ErrorKind(wire.get("error_kind") or "")
        except ValueError:  # a kind this supervisor does not know (a newer replica): no kind
            kind = ErrorKind.NONE
        return cls(
            wire["rid"],
            Outcome(wire["outcome"]),
            int(wire.get("round", -1)),
            int(wire.get("step", -1)),
            wire.get("error") or "",
            kind,
            wire.get("what") or "",
            result,
        )


_ANSWER_FIELDS = ("rid", "outcome", "round", "step", "error", "error_kind", "what")  # never in `result`


class Progress(NamedTuple):
    """rid, in run_inner, has committed inner step `step` (control channel)."""

    rid: str
    step: int


class Up(NamedTuple):
    """A (re)started replica answers, idle, at committed (round, step). `incarnation`: Ray's
    restart count of the actor serving rid (a new process under the same id has a higher one)."""

    rid: str
    round: int
    step: int
    pid: int | None = None
    incarnation: int = 0


class Lost(NamedTuple):
    """rid is gone and no answer will say so (Ray's actor table, an idle probe, a heal source's
    failure). `cause`: died | error | hung."""

    rid: str
    cause: str = "died"


class StateReady(NamedTuple):
    """The heal of phase `phase_id` has its source's state: a silent target is now the one to blame."""

    phase_id: int
    source: str


Observation = Answer | Progress | Up | Lost | StateReady


# -- calls ---------------------------------------------------------------------------------------------
class CallKind(StrEnum):
    """A phase's call: `record` (its `phase` in events.jsonl and the injector), `seconds_key` (its
    time in metrics.jsonl's `seconds`), `fault_phases` (the scheduled fault phases it fires)."""

    record: PhaseName
    seconds_key: str
    fault_phases: tuple[PhaseName, ...]

    def __new__(cls, value: str, record: PhaseName, seconds_key: str, fault_phases: tuple[PhaseName, ...]):
        member = str.__new__(cls, value)
        member._value_ = value
        member.record, member.seconds_key, member.fault_phases = record, seconds_key, fault_phases
        return member

    HEAL = "heal", PhaseName.HEAL, "heal_configure", (PhaseName.HEAL,)
    RUN_INNER = "run_inner", PhaseName.INNER, PhaseName.INNER, (PhaseName.INNER, PhaseName.INNER_SYNC)
    CLUSTER_AVERAGE = "cluster_average", PhaseName.INNER_SYNC, PhaseName.INNER_SYNC, (PhaseName.INNER_SYNC,)
    OUTER_REDUCE = "outer_reduce", PhaseName.OUTER, PhaseName.OUTER, (PhaseName.OUTER,)
    # (the replica's method is named after its phase)
    OUTER_COMMIT = (
        PhaseName.OUTER_COMMIT.value,
        PhaseName.OUTER_COMMIT,
        PhaseName.OUTER_COMMIT,
        (PhaseName.OUTER_COMMIT,),
    )

    @property
    def voids(self) -> bool:
        """A non-finite answer to it voids the cluster's round (its numbers would reach the outer exchange)."""
        return self in (CallKind.RUN_INNER, CallKind.CLUSTER_AVERAGE, CallKind.OUTER_REDUCE)


@dataclass(frozen=True)
class Join:
    """Form the level's group `prefix` (under the phase's epoch) as `rank` of `world_size` first."""

    prefix: str
    rank: int
    world_size: int

    def at(self, epoch: int, store_addr: str | None, run_id: str) -> GroupJoin:
        """This join as the replica's call carries it: the run's prefix, its store, the phase's epoch."""
        return GroupJoin(epoch, store_addr, f"{run_id}/{self.prefix}", self.rank, self.world_size)


@dataclass(frozen=True)
class GroupJoin:
    """What a replica's call carries to form a group first (a level's, or a heal's): group `prefix`
    at the rendezvous `store_addr` (None: a group of one needs none) under `epoch`, as `rank` of `world_size`."""

    epoch: int
    store_addr: str | None
    prefix: str
    rank: int
    world_size: int


@dataclass(frozen=True)
class Overlap:
    """Reduce shard `shard` of `shards` in the standing outer group of `epoch` behind the round's
    last inner steps (sync.fragment_delay; hsgd/train/overlap.py), with the clusters' token
    `weights` as expected then (OuterReduce); an exchange with other weights redoes the reduce."""

    epoch: int
    shard: int
    shards: int
    weights: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunInner:
    """Run the round's remaining inner steps in the cluster's inner group: the standing one, or the
    one `join` forms first (the rendezvous waits for every member; the machine aborts it when one
    is known dead). A shard holder's call carries an `overlap` under sync.fragment_delay. `steps`: the
    round's inner steps for this cluster under sync.balance=steps (None: sync.outer_every / fragments)."""

    kind: ClassVar[CallKind] = CallKind.RUN_INNER
    join: Join | None = None
    overlap: Overlap | None = None
    steps: int | None = None


@dataclass(frozen=True)
class ClusterAverage:
    kind: ClassVar[CallKind] = CallKind.CLUSTER_AVERAGE


@dataclass(frozen=True)
class OuterReduce:
    """Reduce shard `shard` of `shards` in the group of that shard's holders (the leaders: shard 0
    of 1), the standing one or the one `join` forms first. `weights`: each cluster's token weight
    in outer-rank order (hsgd.core.outer_plan.token_weights); () or all 1.0 is the plain mean."""

    kind: ClassVar[CallKind] = CallKind.OUTER_REDUCE
    join: Join | None = None
    shard: int = 0
    shards: int = 1
    weights: tuple[float, ...] = ()


@dataclass(frozen=True)
class Heal:
    kind: ClassVar[CallKind] = CallKind.HEAL
    source: str
    scope: str  # full | global (hsgd/core/round/schedule.py)


@dataclass(frozen=True)
class OuterCommit:
    kind: ClassVar[CallKind] = CallKind.OUTER_COMMIT
    roots: tuple[int, ...]  # roots[j]: the inner rank of shard j's holder


Call = RunInner | ClusterAverage | OuterReduce | Heal | OuterCommit


# -- effects -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """Calls the machine waits on, one typed call per replica, all of one `kind`; a group a call
    joins is formed under `epoch`. `deadline_s`: the limit of a call whose work is fixed; inner
    phases use progress instead (a forming run_inner: its members' join allowance before step one)."""

    id: int
    kind: CallKind
    round: int
    cluster: int | None  # None: the outer level
    epoch: int
    calls: dict[str, Call] = field(compare=False)
    deadline_s: float = 0.0
    reason: str = ""

    @property
    def forms_group(self) -> bool:
        """A run_inner or outer_reduce whose members first form their level's group."""
        return self.prefix is not None

    @property
    def prefix(self) -> str | None:
        """The group a forming call joins (None: it uses the standing one)."""
        join = getattr(next(iter(self.calls.values()), None), "join", None)
        return join.prefix if join is not None else None


@dataclass(frozen=True)
class Kill:
    kind: ClassVar[str] = "kill"
    rid: str
    cluster: int | None
    phase: CallKind  # the kind of the call it was silent in
    silent_s: float
    limit_s: float
    reason: str


@dataclass(frozen=True)
class Reap:
    kind: ClassVar[str] = "reap"
    rid: str
    cluster: int | None
    phase: CallKind
    silent_s: float
    reason: str


@dataclass(frozen=True)
class Yield:
    kind: ClassVar[str] = "yield"
    cluster: int
    epoch: int  # the group whose run_inner is asked (a request for another epoch is stale at the replica)
    round: int
    at_step: int  # step within the round: every member returns at this same boundary
    rids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class RoundClosed:
    kind: ClassVar[str] = "round_closed"
    round: int
    ends: tuple[tuple[int, int], ...]  # (cluster, in-round step its inner phase ends at), the clusters it knows


@dataclass(frozen=True)
class Late:
    kind: ClassVar[str] = "late"
    cluster: int
    members: tuple[str, ...]
    abandoned: tuple[str, ...]  # members whose call was given up on (busy until it ends)
    steps: int  # the in-round steps it took, lost to this round
    reason: str


@dataclass(frozen=True)
class AbortJoin:
    kind: ClassVar[str] = "abort_join"
    cluster: int | None  # None: the leaders' group
    epoch: int
    prefix: str
    dead: tuple[str, ...]  # the members known dead
    reason: str


@dataclass(frozen=True)
class StepTimed:
    kind: ClassVar[str] = "step_timed"
    rid: str
    seconds: float  # per inner step, since rid's last sign of progress


@dataclass(frozen=True)
class PhaseEnded:
    kind: ClassVar[str] = "phase_ended"
    phase: Phase
    answers: dict[str, str]  # rid -> outcome value (`done`, `yielded`), or `<outcome>: <detail>` / why given up
    started: float
    ended: float


Effect = Phase | Kill | Reap | Yield | RoundClosed | Late | AbortJoin | StepTimed | PhaseEnded


class NonFinite(NamedTuple):
    """Why a cluster's round is void: its members' non-finite answers to one call."""

    phase: CallKind  # run_inner | cluster_average | outer_reduce
    rids: tuple[str, ...]  # the members that answered `non_finite`, in answer order
    detail: str  # the first one's error
