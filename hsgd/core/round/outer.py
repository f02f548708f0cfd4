"""The outer exchange (reduce, commit, retry), void and benched clusters, and how a round ends:
committed | restore (total loss) | below_quorum (fewer than min_clusters can take part: waiting
brings replicas back) | failed (a cause waiting cannot cure: too many re-forms, non-finite numbers
everywhere, a round nobody holds), by the table in __init__.py."""

from __future__ import annotations

from collections.abc import Iterable

from hsgd.core.membership import leader_of, quorum_problem
from hsgd.core.outer_plan import shard_count, shard_holders, token_weights
from hsgd.core.round.calls import InFlight
from hsgd.core.round.messages import CallKind, ClusterStage, Effect, Join, OuterCommit, OuterReduce, OuterStage


class OuterExchange:
    """The outer exchange and a round's end, mixed into RoundMachine (machine.py), whose state they read and write."""

    def _maybe_outer(self, now: float) -> list[Effect]:
        if self.done or self.outer_stage is not OuterStage.WAIT:
            return []
        if len(self.participating()) < self.settings.min_clusters:
            return self._lost_quorum()
        if self.not_ready:
            return []
        groups = self._shard_groups()
        self.exchange = (self.participating(), groups)
        # each cluster's weight in the outer mean: the tokens it trained this round, its live members
        # x the steps they reached (every batch holds the same tokens); under sync.fragment_delay only
        # the steps before the snapshot its pseudo-gradient was taken at
        start, tokens = self.round * self.settings.steps_per_round, []
        for c in self.exchange[0]:
            live = [m for m in self.clusters[c].members if m in self.progress]
            reached = max((self.progress[m][1] - start for m in live), default=0)
            tokens.append(len(live) * self.settings.snapshot_steps_of(c, reached))  # what its pseudo-gradient holds
        weights = token_weights(tokens)
        self.outer_stage = OuterStage.REDUCE
        # the holders changed: the reduce first forms their groups (one per shard) under a fresh epoch
        forms = self.settings.outer != "none" and (self.outer_configured is None or self.outer_configured[1] != groups)
        if forms:
            self.epoch += 1
        shards = len(groups)
        prefixes = [f"epoch{self.epoch}/outer" + (f"/s{j}" if shards > 1 else "") for j in range(shards)]
        calls = {
            rid: OuterReduce(Join(prefixes[j], rank, len(holders)) if forms else None, j, shards, weights)
            for j, holders in enumerate(groups)
            for rank, rid in enumerate(holders)
        }
        return [self._issue(None, calls, self.settings.outer_s + (self.settings.configure_s if forms else 0.0), now)]

    def _shard_groups(self, expected: bool = False) -> tuple[tuple[str, ...], ...]:
        """Shard j -> its holder in each participating cluster, in outer-rank order. `expected`: what it
        will be if every cluster keeps its live replicas (the same quorum and leader rules)."""
        if expected:
            clusters = [c for c in self.participating() if len(self.members(c)) >= max(1, self.floor(c))]
            members = [self.members(c) for c in clusters]
        else:
            clusters = self.participating()
            members = [self.clusters[c].members for c in clusters]
        # the real exchange reads the formed groups' leaders (a missing one is a bug: fail loudly)
        leaders = [
            leader_of(m, self.leaders.get(c)) if expected else self.leaders[c]
            for c, m in zip(clusters, members, strict=True)
        ]
        return shard_holders(members, leaders, shard_count([len(m) for m in members], self.settings.outer_path))

    def _outer_commit(self, now: float) -> list[Effect]:
        """Every live member of a participating cluster whose shard holders are all live applies
        the commit, receiving shard j from its holder's inner rank."""
        self.outer_stage = OuterStage.COMMIT
        calls: dict[str, OuterCommit] = {}
        clusters, groups = self.exchange
        for position, c in enumerate(clusters):
            holders = [g[position] for g in groups]
            if any(h not in self.progress for h in holders):
                continue  # a holder was lost after the reduce: the cluster heals next round
            members = self.clusters[c].members
            commit = OuterCommit(tuple(members.index(h) for h in holders))
            calls.update((rid, commit) for rid in members if rid in self.progress)
        if not calls:
            return self._outer_retry(now, "no cluster can apply the commit")
        return [self._issue(None, calls, self.settings.commit_s, now, "commit decided")]

    def _outer_finished(self, flight: InFlight, ok: bool, now: float) -> list[Effect]:
        phase = flight.phase
        if phase.kind is CallKind.OUTER_REDUCE:
            voided = [c for c in self.void if self.clusters[c].stage is not ClusterStage.OUT]
            if voided:  # a leader's pseudo-gradient was non-finite: it was never sent; retry without its cluster
                self.outer_configured = None
                for c in voided:
                    self._bench_or_sit_out(c)
                if self.done:
                    return []
                voided_text = ",".join(f"c{c}" for c in sorted(voided))
                return self._outer_retry(now, f"non-finite pseudo-gradient from {voided_text}")
            if ok:
                if phase.forms_group:
                    self.outer_configured = (phase.epoch, self.exchange[1])
                return self._outer_commit(now)
            self.outer_configured = None
            return self._outer_retry(now, "outer reduce incomplete")
        # outer_commit: who applied it is known once every member answered (or was given up on)
        self.committed_by.update(phase.calls.keys() - flight.not_applied)
        if self.committed_by:
            self.outer_stage = OuterStage.DONE
            return self._finish("committed")
        self.outer_configured = None
        return self._outer_retry(now, "no replica applied the commit")

    def _outer_retry(self, now: float, reason: str) -> list[Effect]:
        """Only the outer exchange is redone: a participating cluster with a member lost or off the
        round (or whose commit broadcast broke its group) re-forms; the others keep their inner work."""
        self.outer_attempts += 1
        if self.outer_attempts > self.settings.max_reforms:
            return self._finish(
                "failed", f"outer sync of round {self.round} failed {self.outer_attempts} times; giving up ({reason})"
            )
        self.outer_stage = OuterStage.WAIT
        broken = [
            c
            for c in self.participating()
            if self.clusters[c].configured is None
            or any(self.progress.get(rid, (-1, -1))[0] != self.round for rid in self.clusters[c].members)
        ]
        for c in broken:
            self.clusters[c].configured = None
            self.clusters[
                c
            ].stage = ClusterStage.REFORM  # not ready: no exchange starts until every broken cluster re-formed
        effects: list[Effect] = []
        for c in broken:
            effects += self._reform(c, now, reason)
            if self.done:
                return effects
        return effects + self._maybe_outer(now)

    # -- non-finite numbers ---------------------------------------------------------------------------------
    def _bench_or_sit_out(self, c: int) -> None:
        """c's round is void: it sits out this round; non-finite in the last round too (or in an
        earlier attempt of this one), it is benched for the rest of the run."""
        self.yielding.pop(c, None)
        self.clusters[c].stage = ClusterStage.OUT
        last = self.non_finite_rounds.get(c)
        self.non_finite_rounds[c] = self.round
        if last is not None and self.round - 1 <= last <= self.round and c not in self.benched:
            self.benched.add(c)
            self.benched_now[c] = (
                f"non-finite numbers in rounds {last} and {self.round} "
                f"({self.void[c].phase}: {self.void[c].detail}); c{c} sits out until the "
                f"run's end or a resume"
            )

    # -- the end of a round ---------------------------------------------------------------------------------
    def _finish(self, outcome: str, reason: str = "") -> list[Effect]:
        self.done, self.outcome, self.reason = True, outcome, reason
        # ended early: calls left in flight, whose answers nobody reads, may still break the groups
        # they use, so none of those is handed on as standing
        for flight in self.calls.inflight.values():
            kind = flight.phase.kind
            if kind is CallKind.OUTER_REDUCE:
                self.outer_configured = None
            elif kind is CallKind.OUTER_COMMIT:
                for rid in flight.pending:
                    self.clusters[self.cluster_of(rid)].configured = None
            elif kind is not CallKind.HEAL:  # heals use no level's group
                self.clusters[flight.phase.cluster].configured = None
        return []

    def _lost_quorum(self) -> list[Effect]:
        """Fewer than min_clusters clusters can take part: `below_quorum`, or `failed` when waiting
        cannot cure it (non-finite clusters: the table's rule)."""
        s, clusters = self.settings, self.topology.clusters
        if len(self.benched) > clusters - s.min_clusters:
            return self._finish(
                "failed",
                f"{len(self.benched)} of {clusters} clusters benched for non-finite numbers "
                f"({self._non_finite_text(self.benched)}); fewer than "
                f"supervisor.min_clusters={s.min_clusters} can train",
            )
        if self.void and len(self.participating()) + len(self.void) >= s.min_clusters:
            return self._finish(
                "failed",
                f"round {self.round}: no {s.min_clusters} cluster(s) left to commit: "
                f"non-finite numbers in {self._non_finite_text(self.void)}",
            )
        problem = quorum_problem(
            [len(self.members(c)) for c in range(clusters)],
            self.topology.floors(s.min_replicas_per_cluster),
            s.min_clusters,
        )
        return self._finish("below_quorum", problem or "below quorum")

    def _non_finite_text(self, clusters: Iterable[int]) -> str:
        return ", ".join(
            f"c{c}"
            + (
                f" (round {self.round}: {self.void[c].phase}: {self.void[c].detail})"
                if c in self.void
                else f" (benched, last non-finite in round {self.non_finite_rounds.get(c, '?')})"
            )
            for c in sorted(clusters)
        )
