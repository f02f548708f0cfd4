"""Liveness: who is hung, who is only slow, who is gone, and who must not wait for the dead (the
`hung` and rendezvous rows of the table in __init__.py), with these limits:

    hung       the last sign of progress plus the learned step deadline (with sync.balance=steps, its
               cluster's own); before its first step,
               a call that forms its group may first spend its join allowance. With sync.balance=time
               never before the round's close plus its grace: a silent cluster is late then, not hung.
    peer       a peer of its own group failed (a commit broadcasts per cluster, each heal is its
    failed     own transfer): the limit shrinks to the group's grace from the failure.
    peer gone  every other member of a group saw its connection to a peer close: the silent one
               is presumed dead after presumed_dead_s and reaped (not killed: Ray is restarting it
               already; a kill could hit the new process).
    heal       while a target's source state has not arrived, the silent one is the source: it is
               the one killed.
"""

from __future__ import annotations

from hsgd.core.round.calls import InFlight
from hsgd.core.round.messages import AbortJoin, CallKind, Effect, Kill, Progress, Reap, StepTimed


class Liveness:
    """Liveness decisions, mixed into RoundMachine (machine.py), whose state they read and write."""

    def _progress(self, seen: Progress, now: float) -> list[Effect]:
        """A replica in an inner phase reported its committed step (on its control channel)."""
        last = self.advance.get(seen.rid)
        if last is None:
            self.advance[seen.rid] = (seen.step, now)
        elif seen.step > last[0]:
            step_s = (now - last[1]) / (seen.step - last[0])
            self.step_seconds[self.cluster_of(seen.rid)].append(step_s)
            self.advance[seen.rid] = (seen.step, now)
            return [StepTimed(seen.rid, step_s)]
        return []

    def tick(self, now: float) -> list[Effect]:
        """Kill replicas that are silent and not advancing past their limit. The machine gives up
        on a killed replica's call at once (its late answer is stale) and goes on without it.
        Under sync.balance=time, the round's close comes first (close.py)."""
        effects: list[Effect] = self._close_due(now)
        for flight in list(self.calls.inflight.values()):
            window = max(self._step_deadline(flight), self.settings.group_grace_s)
            if (
                flight.phase.kind is CallKind.RUN_INNER
                and not flight.failed_groups
                and not flight.peer_gone
                and now <= flight.started + window
            ):
                continue  # every member's limit is at least started + window (see _limit): nobody is due
            for rid in sorted(flight.pending):
                if rid not in flight.pending or now <= self._limit(flight, rid):
                    continue
                source = getattr(flight.phase.calls[rid], "source", None)  # a heal's
                if source is not None and source not in flight.delivered:
                    # a target waits for its source's state: the silent one is the source; once it
                    # is killed, the target's call fails by itself (its argument is lost)
                    if source in self.progress:
                        effects.append(self._kill_source(source, flight, now))
                        continue
                    if flight.failed_at is not None and now <= flight.failed_at + self.settings.group_grace_s:
                        continue
                effects += self._kill(rid, flight, now)
            effects += self._close_if_answered(flight, now)
        return effects

    def _limit(self, flight: InFlight, rid: str) -> float:
        """When rid's silence in `flight` makes it hung."""
        s, phase = self.settings, flight.phase
        if phase.kind is CallKind.RUN_INNER:
            seen = self.advance.get(rid)
            if seen is not None and self._stepped(rid):
                last = max(flight.started, seen[1])
            else:  # no step yet: a run that forms its group may spend its join allowance (deadline_s) first
                first = flight.started + phase.deadline_s
                last = max(first, seen[1]) if seen else first
            limit = last + max(self._step_deadline(flight), s.group_grace_s)
            if s.close_s is not None and self.started_at is not None:  # sync.balance=time: late, never hung, first
                limit = max(limit, self.started_at + s.close_s + s.late_grace_s + s.group_grace_s)
        else:
            limit = flight.started + phase.deadline_s
        group = flight.group_of(rid, self.cluster_of)
        failed_at = flight.failed_groups.get(group)
        if failed_at is not None:
            # a healthy member leaves a broken collective within the grace; one forming its group that
            # has not stepped yet may still be in the rendezvous (released by an abort when a peer is
            # known dead, else by the configure timeout)
            grace = (
                max(s.group_grace_s, s.configure_s) if phase.forms_group and not self._stepped(rid) else s.group_grace_s
            )
            limit = min(limit, max(failed_at, self._last_sign(flight, rid)) + grace)
        gone_at = flight.peer_gone.get(group)
        if gone_at is not None and self._only_suspects_pending(flight, group):
            limit = min(limit, gone_at + s.presumed_dead_s)
        return limit

    def _step_deadline(self, flight: InFlight) -> float:
        """The learned step deadline of the flight's cluster (sync.balance: each its own), else the run's."""
        c = flight.phase.cluster
        return self.settings.step_deadline_s if c is None else self.settings.step_deadline_of(c)

    def _stepped(self, rid: str) -> bool:
        """rid's step advanced in its current inner run (so it is past any join that run began with)."""
        seen = self.advance.get(rid)
        return seen is not None and seen[0] > self.progress.get(rid, (-1, -1))[1]

    def _only_suspects_pending(self, flight: InFlight, group) -> bool:
        """Every member of `group` but one answered (the silent one is the peer whose connection closed)."""
        members = [r for r in flight.phase.calls if flight.group_of(r, self.cluster_of) == group]
        answered = [r for r in members if r not in flight.pending]
        return bool(answered) and len(answered) >= len(members) - 1

    def _last_sign(self, flight: InFlight, rid: str) -> float:
        seen = self.advance.get(rid)
        return max(flight.started, seen[1]) if seen and flight.phase.kind is CallKind.RUN_INNER else flight.started

    def _kill(self, rid: str, flight: InFlight, now: float) -> list[Effect]:
        """rid is past its limit: reaped when its peers saw its connection close (it is gone, not
        hung: no hang report, nothing to kill), else killed as hung."""
        phase, last_sign = flight.phase, self._last_sign(flight, rid)
        limit_s = self._limit(flight, rid) - last_sign
        group = flight.group_of(rid, self.cluster_of)
        gone = (
            group in flight.peer_gone
            and self._only_suspects_pending(flight, group)
            and now - flight.peer_gone[group] < self.settings.group_grace_s
        )
        self._mark_dead(rid, "died" if gone else "hung")
        self.calls.give_up(
            flight, rid, "died: presumed, its peers saw its connection close" if gone else "hung: killed"
        )
        effects = self._release_rendezvous(flight, rid)
        if gone:
            return [
                Reap(rid, phase.cluster, phase.kind, now - last_sign, "its peers saw its connection close")
            ] + effects
        flight.failed(group, now)
        return [
            Kill(
                rid,
                phase.cluster,
                phase.kind,
                now - last_sign,
                limit_s,
                f"silent and not advancing in {phase.kind} for {now - last_sign:.1f}s (limit {limit_s:.1f}s)",
            )
        ] + effects

    def _kill_source(self, source: str, flight: InFlight, now: float) -> Kill:
        """A heal's source never delivered its state: kill it; its targets' calls then fail (their
        argument is lost) and the cluster re-forms without it."""
        silent_s = now - flight.started
        self._mark_dead(source, "hung")
        if flight.failed_at is None:
            flight.failed_at = now
        return Kill(
            source,
            flight.phase.cluster,
            CallKind.HEAL,
            silent_s,
            flight.phase.deadline_s,
            f"heal source silent for {silent_s:.1f}s (limit {flight.phase.deadline_s:.1f}s)",
        )

    def _release_rendezvous(self, flight: InFlight, dead: str) -> list[Effect]:
        """`dead` was a member of a phase that forms its group: release the members still waiting
        in its rendezvous (once per phase; members already past it are not affected)."""
        phase = flight.phase
        if not phase.forms_group or flight.aborted or not flight.pending:
            return []
        flight.aborted = True
        prefix = (
            phase.calls[dead].join.prefix if dead in phase.calls else phase.prefix
        )  # sharded: the dead holder's group
        return [
            AbortJoin(
                phase.cluster,
                phase.epoch,
                prefix,
                (dead,),
                f"{dead} is gone ({self.dead.get(dead, 'lost')}): group {prefix} cannot form",
            )
        ]
