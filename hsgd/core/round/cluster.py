"""A cluster's phase within a round (the "per cluster" rows of the table in __init__.py): who
heals, when its inner group forms, when it is ready for the outer exchange, and how a replica that
comes back mid-round joins. A re-form counts against max_reforms; a void cluster sits out.
"""

from __future__ import annotations

import math

from hsgd.core.membership import leader_of
from hsgd.core.outer_plan import token_weights
from hsgd.core.round.calls import InFlight
from hsgd.core.round.messages import (
    CallKind,
    ClusterAverage,
    ClusterStage,
    Effect,
    Heal,
    Join,
    OuterStage,
    Overlap,
    RunInner,
    Yield,
)
from hsgd.core.round.schedule import assign_cluster_heals


class ClusterPhases:
    """A cluster's phase decisions, mixed into RoundMachine (machine.py), whose state they read and write."""

    def _reform(
        self, c: int, now: float, reason: str, counts: bool = True, members: tuple[str, ...] | None = None
    ) -> list[Effect]:
        """(Re-)form cluster c: heal laggards, then run inner (forming its group if members changed)."""
        st = self.clusters[c]
        self.yielding.pop(c, None)
        members = self.members(c) if members is None else members
        if not members or len(members) < self.floor(c):
            st.stage, st.members = ClusterStage.OUT, members
            if self.outer_stage is OuterStage.WAIT and len(self.participating()) < self.settings.min_clusters:
                return self._lost_quorum()
            return self._maybe_outer(now)
        if reason != "round start" and counts:
            st.reforms += 1
            if st.reforms > self.settings.max_reforms:
                return self._finish(
                    "failed", f"cluster c{c} re-formed {st.reforms} times in round {self.round}; giving up ({reason})"
                )
        st.members = members
        self.leaders[c] = leader_of(members, self.leaders.get(c))
        # the donor, should nobody in c hold the round: the lowest-id holder (heals stay inside c when one does)
        donor = next((rid for ids in self.ids for rid in ids if self.progress.get(rid, (-1,))[0] == self.round), None)
        heals = assign_cluster_heals(
            {rid: self.progress[rid] for rid in members}, {donor: self.progress[donor]} if donor is not None else {}
        )
        if heals:
            st.stage = ClusterStage.HEAL
            calls = {h.target: Heal(h.source, h.scope) for h in heals}
            return [self._issue(c, calls, self.settings.heal_s, now, reason)]
        return self._run_inner(c, now, reason)

    def _run_inner(self, c: int, now: float, reason: str) -> list[Effect]:
        """Run c's inner phase in its standing group when the members are unchanged at a round's
        start, else in a group the same call forms under a fresh epoch (no separate configure
        round trip). The group counts as standing from now: a failure drops it."""
        st = self.clusters[c]
        st.stage = ClusterStage.INNER
        for rid in st.members:  # marks of an earlier inner run this round are stale
            self.advance.pop(rid, None)
        overlap, n = self._overlap_plan(), len(st.members)
        forms = reason != "round start" or st.configured is None or st.configured[1] != st.members
        if forms:
            self.epoch += 1
            st.configured = (self.epoch, st.members)
        steps = self.settings.steps_of(c) if self.settings.cluster_steps else None
        if self.closed:  # the round closed (sync.balance=time): a run starting now takes two steps more
            steps = self._end_after_close(c)
        calls = {
            rid: RunInner(Join(f"epoch{self.epoch}/inner/c{c}", rank, n) if forms else None, overlap.get(rid), steps)
            for rank, rid in enumerate(st.members)
        }
        return [self._issue(c, calls, self.settings.configure_s if forms else 0.0, now, reason)]

    def _overlap_plan(self) -> dict[str, Overlap]:
        """sync.fragment_delay: holder -> its Overlap, only while the standing outer groups are this
        round's plan; when the holders change, the outer exchange forms new groups after the inner
        phase instead (the reduce is not hidden then)."""
        if not self.settings.fragment_delay or self.settings.outer == "none" or self.outer_configured is None:
            return {}
        epoch, groups = self.outer_configured
        if groups != self._shard_groups(expected=True):
            return {}
        # the weights as expected now: every live member finishes the round's steps
        weights = token_weights(
            [
                len(self.members(c)) * self.settings.snapshot_steps_of(c, self.settings.steps_of(c))
                for c in map(self.cluster_of, groups[0])
            ]
        )
        return {rid: Overlap(epoch, j, len(groups), weights) for j, holders in enumerate(groups) for rid in holders}

    def _phase_finished(self, flight: InFlight, now: float) -> list[Effect]:
        """Every member of a phase answered (or was given up on): what the cluster does next."""
        phase, ok = flight.phase, flight.failed_at is None
        if phase.cluster is None:  # outer_reduce, outer_commit
            return self._outer_finished(flight, ok, now)
        c, st = phase.cluster, self.clusters[phase.cluster]
        if st.phase_id != phase.id:
            return []
        st.phase_id = None
        broken = not ok or any(rid not in self.progress for rid in st.members)
        if broken:
            st.configured = None  # a failed collective (or join), or a member lost: the group is unusable
        if c in self.void:  # a non-finite answer: c sits out the outer exchange
            self._bench_or_sit_out(c)
            return self._maybe_outer(now) if self.outer_stage is OuterStage.WAIT else []
        if self.joining.get(c) and self.outer_stage is OuterStage.WAIT:
            return self._admit_joiners(c, now)
        if broken:
            return self._reform(c, now, f"{phase.kind} failed")
        if phase.kind is CallKind.HEAL:
            return self._run_inner(c, now, phase.reason)
        if phase.kind is CallKind.RUN_INNER:
            closed_at = self._closed_at(c)  # yielded at the round's close (sync.balance=time)
            if closed_at is not None and closed_at < self.settings.min_round_steps:
                return self._mark_late(c, f"stopped at step {closed_at} by the close", now) + self._maybe_outer(now)
            if closed_at is not None:
                self.ends[c] = closed_at
            end = (self.round, self.round * self.settings.steps_per_round + self.ends.get(c, self.settings.steps_of(c)))
            if any(self.progress[rid] != end for rid in st.members):
                return self._reform(c, now, "inner phase ended short")
            if self.settings.inner == "none" and len(st.members) > 1:
                st.stage = ClusterStage.AVERAGE
                return [self._issue(c, dict.fromkeys(st.members, ClusterAverage()), self.settings.commit_s, now)]
        st.stage = ClusterStage.READY  # run_inner done, or cluster_average done
        return self._maybe_outer(now)

    # -- a replica that comes back mid-round ----------------------------------------------------------------
    def _join_mid_round(self, rid: str, at: tuple[int, int], now: float) -> list[Effect]:
        """rid (re)started and answers, idle at `at` (rejoin `fast`)."""
        c, st = self.cluster_of(rid), self.clusters[self.cluster_of(rid)]
        if (
            self.settings.rejoin != "fast"
            or self.done
            or rid in self.progress
            or st.stage is ClusterStage.OUT
            or self.outer_stage is not OuterStage.WAIT
            or self.closed  # (sync.balance=time) after the close nobody waits for a newcomer's heal
        ):
            return []  # joins at the next round's start
        self.joining.setdefault(c, {})[rid] = at
        if st.stage is ClusterStage.READY:
            return self._admit_joiners(c, now)
        if st.stage is not ClusterStage.INNER:
            return []  # a heal or the average in flight: taken in when it ends
        flight = self.calls.inflight.get(st.phase_id)
        if c in self.yielding or flight is None or flight.failed_at is not None:
            return []  # asked already, or the phase failed: it re-forms, taking the newcomer in
        running = sorted(flight.pending)  # (members that died or answered are asked nothing)
        step = self._yield_step(running, flight.started, now)
        if step >= self.settings.steps_of(c):
            return []  # the members finish first; the newcomer is taken in when they are ready
        self.yielding[c] = step
        group_epoch = st.configured[0] if st.configured else self.epoch
        return [Yield(c, group_epoch, self.round, step, tuple(running), f"{rid} joins at step {step}")]

    def _step_time(self, c: int) -> float:
        """Cluster c's seconds per inner step: this round's samples, else its learned time from the
        rounds before (RoundSettings.cluster_step_s), else 0.1 (short: a longer lead, never a late one)."""
        recent = sorted(self.step_seconds.get(c, ()))
        learned = self.settings.cluster_step_s[c] if c < len(self.settings.cluster_step_s) else None
        return recent[len(recent) // 2] if recent else learned if learned else 0.1

    def _yield_step(self, running: list[str], started: float, now: float) -> int:
        """A step boundary every member still running reaches after the yield request arrives: each
        member's step extrapolated to `now` at the cluster's step time, from its last sign of progress
        plus yield_lead_s (that sign's age and the request's travel), or, not seen since its phase
        began at `started`, from its committed step then (exact), plus the time since, at most
        yield_lead_s (a phase issued just now needs no more); at least 2 steps past the furthest."""
        s = self.settings
        step_s = max(self._step_time(self.cluster_of(running[0])), 1e-3)
        furthest = max(max(self.advance.get(m, (-1,))[0], self.progress[m][1]) for m in running)
        ahead = max(
            seen[0] + (now - seen[1] + s.yield_lead_s) / step_s
            if (seen := self.advance.get(m))
            else self.progress[m][1] + (now - started + min(now - started, s.yield_lead_s)) / step_s
            for m in running
        )
        at = max(furthest + 2, math.ceil(ahead)) - self.round * s.steps_per_round
        if s.inner != "localsgd":
            return at
        # localsgd: a sync boundary (a balanced cluster also averages at its plan's last step)
        return min(-(-at // s.inner_every) * s.inner_every, s.steps_of(self.cluster_of(running[0])))

    def _admit_joiners(self, c: int, now: float) -> list[Effect]:
        joiners = self.joining.pop(c, {})
        self.yielding.pop(c, None)
        for rid, at in joiners.items():
            self.progress[rid] = at
            self.dead.pop(rid, None)
        self.clusters[c].configured = None
        return self._reform(c, now, "rejoin: " + ",".join(sorted(joiners)), counts=False)
