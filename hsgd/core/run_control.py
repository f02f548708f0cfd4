"""What the supervisor decides between rounds, pure (issue 45): one round-start function and one
round-end function over typed records. `actors/supervisor.py` carries their decisions out and the
control-plane simulation (`tests/unit/test_control_simulation.py`) drives them under seeded random
schedules, so the order of the decisions is written once, here, never again in a test.

Round start, in this order:
  1. site requests, oldest first, each decided once (`hsgd/core/site_requests.py`): a drain
     against the sites drained so far (by earlier requests of this start too) and the sites that
     hold the last committed round: a drain that would leave no live replica holding it is refused;
     an add-site by the problem the actors measured for it (room, label), None when it fits;
  2. the restore choice: when replicas are live but none holds the last committed round (a total
     loss by deaths), the newest checkpoint the live replicas can load; none loadable: the run fails with a
     reason naming the rounds tried — never "commit" fresh replicas;
  3. admission: the sites that train this round (live holders at or above their floor; a drained
     site never); none: the supervisor waits for quorum (replicas that come back), or fails;
  4. the balance plan (`sync.balance=steps`): the saved plan when it is this round's and covers
     this round's clusters, else a new one (`plan_for_round`).
Round end:
  1. quarantine: who is set aside is `hsgd/core/quarantine.py`'s `DeathLog` (deaths of replicas on
     one node within the node-loss window count once, for the node, not once per replica);
  2. a checkpoint write: saved -> recorded; failed or past its deadline -> a storage fault: the
     checkpoint is skipped and reported, nobody is killed, the last good one stays the restore point.

Failure cases: none raise. A request that cannot be decided (malformed) is refused with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from hsgd.core.round.balance import StepPlan, plan_for_round
from hsgd.core.site_requests import APPLIED, REFUSED, Decision, RequestKind, SiteRequest
from hsgd.core.site_rules import decide


@dataclass(frozen=True)
class SiteNow:
    """One cluster at a round's start: its live replicas (not spares, not quarantined), how many of
    them hold the last committed round, its floor, and whether it was drained."""

    live: int
    holders: int
    floor: int
    drained: bool = False

    @property
    def holds_commit(self) -> bool:
        return not self.drained and self.holders >= 1


@dataclass(frozen=True)
class Checkpoint:
    """A durable checkpoint: its round and whether the live replicas can load it (a manifest that
    reads, shards for every rank they need)."""

    round: int
    loadable: bool


@dataclass(frozen=True)
class StartInput:
    round: int
    committed_round: int
    sites: tuple[SiteNow, ...]
    min_clusters: int
    requests: tuple[SiteRequest, ...] = ()  # pending, oldest first
    add_site_problems: Mapping[str, str | None] = field(default_factory=dict)  # request id -> why not
    next_cluster: int = 0  # the index an applied add-site names (site_requests.next_cluster)
    checkpoints: tuple[Checkpoint, ...] = ()
    balance: bool = False
    saved_plan: dict | None = None
    steps_per_round: int = 1
    configured_step_s: tuple[float | None, ...] = ()
    learned_step_s: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class RoundStart:
    decisions: tuple[tuple[SiteRequest, Decision], ...]
    drained: frozenset[int]  # every drained cluster after the decisions
    restore_from: int | None  # a total loss: the checkpoint round every replica loads
    failure: str | None  # the run cannot go on: why, in one line
    training: tuple[int, ...]  # the clusters that train this round
    plan: StepPlan | None
    plan_is_new: bool  # save it before any call


def restore_choice(committed_round: int, checkpoints: Sequence[Checkpoint]) -> tuple[int | None, str]:
    """The newest checkpoint the live replicas can load, with what was skipped; (None, why) when none can."""
    tried = sorted(checkpoints, key=lambda c: c.round, reverse=True)
    skipped = [c.round for c in tried if not c.loadable]
    for ckpt in tried:
        if ckpt.loadable:
            note = f"; newer not loadable: {', '.join(map(str, skipped[:5]))}" if skipped else ""
            return ckpt.round, f"restore from round {ckpt.round} (committed {committed_round}){note}"
    if not tried:
        return None, f"no live replica holds committed round {committed_round} and there is no checkpoint"
    return None, (
        f"no live replica holds committed round {committed_round} and no checkpoint can be loaded "
        f"(tried rounds {', '.join(map(str, [c.round for c in tried][:5]))})"
    )


def _decide_requests(inp: StartInput) -> tuple[list[tuple[SiteRequest, Decision]], set[int]]:
    drained = {c for c, s in enumerate(inp.sites) if s.drained}
    holders = {c for c, s in enumerate(inp.sites) if s.holds_commit and s.live >= s.floor}
    live = {c for c, s in enumerate(inp.sites) if not s.drained and s.live > 0}
    decisions, next_cluster = [], inp.next_cluster
    for request in inp.requests:
        if request.kind is RequestKind.DRAIN or request.problem:
            decision = decide(
                request,
                clusters=len(inp.sites),
                drained_clusters=drained,
                min_clusters=inp.min_clusters,
                live_clusters=live,
                holders=holders,
                committed_round=inp.committed_round,
            )
            if decision.outcome == APPLIED:
                drained.add(decision.cluster)
                live.discard(decision.cluster)
                holders.discard(decision.cluster)
        else:
            problem = inp.add_site_problems.get(request.id)
            decision = (
                Decision(REFUSED, problem, None)
                if problem
                else Decision(APPLIED, f"add-site c{next_cluster}", next_cluster)
            )
            next_cluster += decision.outcome == APPLIED
        decisions.append((request, decision))
    return decisions, drained


def round_start(inp: StartInput) -> RoundStart:
    """Round `inp.round`'s start (the module docstring's order)."""
    decisions, drained = _decide_requests(inp)
    sites = [SiteNow(s.live, s.holders, s.floor, s.drained or c in drained) for c, s in enumerate(inp.sites)]
    restore_from, failure = None, None
    if not any(s.holds_commit for s in sites) and any(s.live for s in sites if not s.drained):
        restore_from, why = restore_choice(inp.committed_round, inp.checkpoints)
        failure = None if restore_from is not None else why
    if restore_from is not None:  # everyone loads it: every live replica holds it now
        sites = [SiteNow(s.live, s.live, s.floor, s.drained) for s in sites]
    training = tuple(c for c, s in enumerate(sites) if not s.drained and s.holders >= max(1, s.floor))
    plan, fresh = None, False
    if inp.balance and failure is None:
        plan, fresh = plan_for_round(
            inp.round,
            inp.saved_plan,
            steps_per_round=inp.steps_per_round,
            configured=[None if c in drained else t for c, t in enumerate(inp.configured_step_s)],
            learned=[None if c in drained else t for c, t in enumerate(inp.learned_step_s)],
        )
    return RoundStart(tuple(decisions), frozenset(drained), restore_from, failure, training, plan, fresh)


class CheckpointWrite(StrEnum):
    """How a round's checkpoint write ended."""

    NONE = "none"  # not due
    SAVED = "saved"
    FAILED = "failed"  # the storage raised
    TIMED_OUT = "timed_out"  # past its deadline (a stalled mount)


@dataclass(frozen=True)
class RoundEnd:
    checkpoint_round: int | None  # the newest good checkpoint after this round
    checkpoint_event: str | None  # checkpoint | checkpoint_failed | None (a storage fault kills nobody)


def round_end(committed_round: int, write: CheckpointWrite, last_good_checkpoint: int | None) -> RoundEnd:
    """After round `committed_round - 1` committed: what its checkpoint write means. A failed or timed-out
    write is a storage fault: skipped and reported, the last good checkpoint stays the restore point."""
    if write is CheckpointWrite.SAVED:
        return RoundEnd(committed_round, "checkpoint")
    return RoundEnd(last_good_checkpoint, "checkpoint_failed" if write is not CheckpointWrite.NONE else None)
