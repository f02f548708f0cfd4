"""sync.balance=time: a round's inner phases end at a time, not a step count (the `close` rows of the
table in __init__.py).

At `close_s` after the round's start every cluster still in its inner phase is asked to yield at its
next step boundary (the mid-round rejoin's `Yield`); the steps it reached are its contribution,
weighed by its tokens (outer.py). A cluster whose inner phase (re)starts after the close ends two
steps past its furthest member (at least `min_round_steps`). At the close plus `late_grace_s` a
cluster that is still not ready (its processes paused, a slow link), or one that stopped before
`min_round_steps`, is **late**: the round goes on without it — unless too few clusters (below
`min_clusters`) are ready to commit without the late ones: then the round waits for them. Its calls
are given up on without a kill (slow is not dead: no fault, no restart), its inner group is not
handed on, and it heals from the new global params at the next round's start; its members' abandoned
calls are the runner's to wait out (`late_members`), under their hang deadline as before.

The close is saved before any yield is asked (`RoundClosed`): a restarted supervisor's machine starts
closed at the recorded steps (`closed_at`), so its clusters end where the yields asked, once.
"""

from __future__ import annotations

from hsgd.core.round.messages import ClusterStage, Effect, Late, OuterStage, PhaseEnded, RoundClosed, Yield


class RoundClose:
    """The close and late clusters, mixed into RoundMachine (machine.py), whose state they read and write."""

    def _close_due(self, now: float) -> list[Effect]:
        """At the close: yields; at the close plus the grace: late clusters (each once)."""
        s = self.settings
        if s.close_s is None or self.done or self.outer_stage is not OuterStage.WAIT or self.started_at is None:
            return []
        effects: list[Effect] = []
        if not self.closed and now >= self.started_at + s.close_s:
            self.closed = True
            for c in self.participating():
                effects += self._close_cluster(c, now)
            ready = {c: s.steps_of(c) for c in self.participating() if self.clusters[c].stage.waits_for_outer}
            effects.insert(0, RoundClosed(self.round, tuple(sorted({**ready, **self.closing}.items()))))
        if self.closed and now >= self.started_at + s.close_s + s.late_grace_s:
            late = [c for c in self.participating() if not self.clusters[c].stage.waits_for_outer]
            if len(self.participating()) - len(late) < s.min_clusters:
                return effects  # nobody could commit without them: the round waits (slow, not dead)
            for c in late:
                effects += self._mark_late(c, f"not ready {s.late_grace_s:.1f}s after the round closed", now)
            if late and not self.done:
                effects += self._maybe_outer(now)
        return effects

    def steps_taken(self, c: int) -> int:
        """Cluster c's inner steps this round: none when it was late (lost to the round), where the close (or
        a run after it) ended it, else its plan's."""
        return 0 if c in self.late else self.ends.get(c, self.settings.steps_of(c))

    def _close_cluster(self, c: int, now: float) -> list[Effect]:
        """Ask c's members to yield at a boundary they all reach after the request arrives."""
        st = self.clusters[c]
        flight = self.calls.inflight.get(st.phase_id) if st.stage is ClusterStage.INNER else None
        if flight is None or flight.failed_at is not None or not flight.pending or c in self.yielding:
            return []  # ready, healing or re-forming (its next run ends early), or asked already
        running = sorted(flight.pending)
        step = self._yield_step(running, flight.started, now)
        if step >= self.settings.steps_of(c):
            return []  # it finishes first
        self.yielding[c] = self.closing[c] = step
        epoch = st.configured[0] if st.configured else self.epoch
        return [Yield(c, epoch, self.round, step, tuple(running), f"the round closes ({self.settings.close_s:.1f}s)")]

    def _end_after_close(self, c: int) -> int:
        """The in-round step a run of c's inner phase that starts after the close ends at: the one recorded
        at the close (a restarted supervisor's), else two steps on; never before where its members are."""
        start = self.round * self.settings.steps_per_round
        furthest = max(self.progress[rid][1] - start for rid in self.clusters[c].members)
        end = self.ends.get(c, self.closing.get(c))  # (a failure after the close: to the step it was asked)
        if end is None:
            end = min(max(self.settings.min_round_steps, furthest + 2), self.settings.steps_of(c))
        self.ends[c] = max(end, furthest)
        return self.ends[c]

    def _closed_at(self, c: int) -> int | None:
        """The step c's members stopped at when the close asked them to yield (None: not asked, or
        they did not all stop at one boundary)."""
        if c not in self.closing:
            return None
        start = self.round * self.settings.steps_per_round
        reached = {self.progress[rid][1] - start for rid in self.clusters[c].members if rid in self.progress}
        return reached.pop() if len(reached) == 1 else None

    def _mark_late(self, c: int, why: str, now: float) -> list[Effect]:
        """c sits the round out, nobody killed: its calls are given up on, its group not handed on."""
        st, effects = self.clusters[c], []
        flight = self.calls.inflight.get(st.phase_id) if st.phase_id is not None else None
        # the steps it took and loses (its last sign of progress, or where it stopped)
        seen = [max(self.advance.get(rid, (0,))[0], self.progress.get(rid, (0, 0))[1]) for rid in st.members]
        steps = max(0, max(seen, default=0) - self.round * self.settings.steps_per_round)
        abandoned: tuple[str, ...] = ()
        if flight is not None:
            abandoned = tuple(sorted(flight.pending))
            for rid in abandoned:
                self.calls.give_up(flight, rid, "late: the round went on without its cluster")
            if self.calls.close(flight):
                effects.append(PhaseEnded(flight.phase, dict(flight.answers), flight.started, now))
        self.late_members.update(abandoned)
        self.yielding.pop(c, None)
        st.phase_id, st.configured, st.stage = None, None, ClusterStage.OUT
        self.late[c] = why
        return [*effects, Late(c, tuple(st.members), abandoned, steps, why)]
