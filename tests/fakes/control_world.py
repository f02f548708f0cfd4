"""A control-plane world for the seeded simulation of issue 45: what happens between rounds when
sites, drains, quarantine, balance, spares, restarts, supervisor deaths, checkpoint faults and
resumes meet. The decisions are the product's (`hsgd.core.run_control.round_start` / `round_end`,
`hsgd.core.quarantine`); this module only plays the world around them, at round granularity
(the phases inside a round are `tests/unit/test_round_simulation.py`'s).

The world knows the ground truth the decisions may not: which deaths were a node's loss, which
checkpoint holds which params (a digest chain: round r's params are `digest(r)`; a fresh model's
is "fresh"). Invariants are checked after every event; a broken one raises `Violation` with the
seed, so one line replays it: `python -m tests.unit.test_control_simulation --seeds <seed>`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hsgd.core import run_control
from hsgd.core.quarantine import DeathLog
from hsgd.core.run_control import Checkpoint, CheckpointWrite, SiteNow, StartInput
from hsgd.core.site_requests import APPLIED, RequestKind, SiteRequest
from hsgd.core.site_rules import add_site_problem, join_overdue

ROUND_S = 30.0  # the regime users run: rounds of >= 30 s
QUARANTINE_AFTER, QUARANTINE_WINDOW_S, NODE_LOSS_WINDOW_S = 3, 600.0, 5.0
JOIN_TIMEOUT_S = 2 * ROUND_S  # supervisor.join_timeout_s: an added site not up by then is abandoned
NODE_CPUS = 4.0  # each node's CPUs; a replica needs one


class Violation(AssertionError):
    pass


def digest(round_index: int) -> str:
    return "fresh" if round_index == 0 else f"d{round_index}"


@dataclass
class Rep:
    cluster: int
    node: str
    up: bool = True
    round: int = 0  # the committed round whose params it holds
    params: str = "fresh"
    spare: bool = False
    kept_out: bool = False  # quarantined with nowhere to go
    stopped: bool = False  # its site was drained (or abandoned): stopped for good
    back_at: int | None = None  # the round index at whose start a restart is up
    restarts_left: int = 8  # faults.max_restarts
    own_deaths: int = 0  # ground truth: deaths that were not a node's loss

    @property
    def active(self) -> bool:
        return self.up and not (self.spare or self.kept_out or self.stopped)


@dataclass
class Site:
    floor: int
    step_s: float
    drained: bool = False
    joining_since: int | None = None  # an applied add-site not yet in the topology


@dataclass
class Rates:
    """Per round."""

    death: float = 0.3
    node_loss: float = 0.12
    whole_site: float = 0.06
    every_replica: float = 0.03
    supervisor: float = 0.12
    write_failed: float = 0.08
    write_hung: float = 0.08
    drain: float = 0.10
    add_site: float = 0.08
    resume: float = 0.03
    restart_late: float = 0.3  # a restart that takes two rounds
    corrupt_checkpoint: float = 0.03


class ControlWorld:
    """One scenario: a seeded random topology and schedule, driven for `rounds` rounds."""

    def __init__(self, seed: int, rounds: int = 30, rates: Rates | None = None):
        self.seed, self.rounds, self.rng, self.rates = seed, rounds, random.Random(seed), rates or Rates()
        rng = self.rng
        one_node = rng.random() < 0.3
        self.sites: list[Site] = []
        self.reps: dict[str, Rep] = {}
        self.spares = rng.choice((0, 0, 1))
        for _ in range(rng.randint(2, 4)):
            self._add_site(rng.randint(1, 3), node=("n0" if one_node else None))
        self.min_clusters = 1
        self.balance = rng.random() < 0.5
        self.checkpoint_every = rng.choice((1, 1, 2, 3))
        self.spr = 20
        self.committed = 0
        self.checkpoints: dict[int, tuple[str, bool]] = {}  # round -> (params, loadable)
        self.outcomes: dict[str, str] = {}  # request id -> outcome (durable: decided once)
        self.pending: list[SiteRequest] = []
        self.saved_plan: dict | None = None
        self.t = 0.0
        self.status: str | None = None
        self.reason = ""
        self.log: list[str] = []
        self.node_losses: list[tuple[float, str]] = []
        self.abandoned = 0
        self.death_log = DeathLog(
            after=QUARANTINE_AFTER, window_s=QUARANTINE_WINDOW_S, node_loss_window_s=NODE_LOSS_WINDOW_S
        )
        self.due: set[str] = set()  # replicas the death log says are due for quarantine

    # -- the world ---------------------------------------------------------------------------------------
    def _add_site(self, replicas: int, node: str | None = None, joining_since: int | None = None) -> int:
        c = len(self.sites)
        self.sites.append(
            Site(floor=self.rng.randint(1, max(1, replicas - 1)), step_s=self.rng.choice((1.0, 1.5, 3.0)))
        )
        self.sites[c].joining_since = joining_since
        for i in range(replicas + self.spares):
            rep = Rep(cluster=c, node=node or f"n{c}", spare=i >= replicas)
            if joining_since is not None:
                rep.up = self.rng.random() < 0.8
                rep.back_at = None if rep.up else joining_since + 1
            self.reps[f"c{c}r{i}"] = rep
        return c

    def fail(self, what: str) -> None:
        raise Violation(
            f"seed {self.seed}: {what} (replay: python -m tests.unit.test_control_simulation --seeds {self.seed})"
        )

    def _die(self, rid: str, *, node_loss: bool) -> None:
        rep = self.reps[rid]
        if not rep.up or rep.stopped:
            return
        rep.up = False
        rep.own_deaths += not node_loss
        if self.death_log.died(self.t, rep.node, rid):
            self.due.add(rid)
        if rep.restarts_left > 0:
            rep.restarts_left -= 1
            rep.back_at = self.round + (2 if self.rng.random() < self.rates.restart_late else 1)
        self.log.append(f"t={self.t:.0f} {rid} died{' (node)' if node_loss else ''}")

    def _holders(self) -> list[str]:
        return [rid for rid, r in self.reps.items() if r.active and r.round == self.committed]

    def _check_after(self, event: str) -> None:
        """Invariants that hold after every event."""
        for rid, rep in self.reps.items():
            # a death is judged when reported: the first replica reported of a node loss counts it as
            # its own until a second one joins (hsgd/core/quarantine.py), so one may lag the truth
            if rep.kept_out and rep.own_deaths < QUARANTINE_AFTER - 1:
                self.fail(f"{rid} set aside for deaths that were its node's losses ({event})")

    # -- one round ---------------------------------------------------------------------------------------
    def run(self) -> ControlWorld:
        self.round = 0
        guard = 0
        while self.status is None:
            guard += 1
            if guard > self.rounds * 6:
                self.fail("the run makes no progress")
            if self.committed >= self.rounds:
                self.status = "completed"
                break
            try:
                self._one_round()
            except Violation:
                raise
            except Exception as err:  # noqa: BLE001 — an exception out of the decisions is a violation
                self.fail(f"the supervisor raised {type(err).__name__}: {err}")
        self._check_end()
        return self

    def _requests_arrive(self) -> None:
        rng, r = self.rng, self.rates
        if rng.random() < r.drain:
            c = rng.randrange(len(self.sites) + 1)  # sometimes no such cluster
            self.pending.append(
                SiteRequest(
                    id=f"q{len(self.outcomes) + len(self.pending)}-{self.seed}",
                    kind=RequestKind.DRAIN,
                    cluster=f"c{c}",
                    t=self.t,
                )
            )
        if rng.random() < r.add_site:
            self.pending.append(
                SiteRequest(
                    id=f"q{len(self.outcomes) + len(self.pending)}-{self.seed}",
                    kind=RequestKind.ADD_SITE,
                    cluster="",
                    t=self.t,
                    replicas=rng.randint(1, 2),
                )
            )

    def _start_of_round(self) -> run_control.RoundStart:
        for rep in self.reps.values():  # restarts that are up by now, behind: they heal below
            if not rep.up and rep.back_at is not None and rep.back_at <= self.round and not rep.stopped:
                rep.up, rep.back_at, rep.round, rep.params = True, None, 0, "fresh"
        self._join_or_abandon_added_sites()
        topo = self._topology()
        views = []
        for c in topo:
            members = [r for r in self.reps.values() if r.cluster == c and r.active]
            holders = [r for r in members if r.round == self.committed]
            views.append(SiteNow(len(members), len(holders), self.sites[c].floor, self.sites[c].drained))
        joining = len(topo) < len(self.sites)
        add_problems = {
            q.id: "still starting" if joining else self._room_problem(q)
            for q in self.pending
            if q.kind is RequestKind.ADD_SITE
        }
        return run_control.round_start(
            StartInput(
                round=self.committed,
                committed_round=self.committed,
                sites=tuple(views),
                min_clusters=self.min_clusters,
                requests=tuple(self.pending),
                add_site_problems=add_problems,
                next_cluster=len(self.sites),
                checkpoints=tuple(Checkpoint(r, ok) for r, (_, ok) in self.checkpoints.items()),
                balance=self.balance,
                saved_plan=self.saved_plan,
                steps_per_round=self.spr,
                configured_step_s=tuple(self.sites[c].step_s for c in topo),
                learned_step_s=tuple(None for _ in topo),
            )
        )

    def _room_problem(self, request: SiteRequest) -> str | None:
        """The product's room check (STRICT_PACK: the new site on one node) over the world's nodes, each
        with NODE_CPUS less one CPU per replica placed on it."""
        used: dict[str, float] = {}
        for rep in self.reps.values():
            if not (rep.stopped or rep.kept_out):
                used[rep.node] = used.get(rep.node, 0.0) + 1.0
        nodes = [{"NodeID": n, "Alive": True, "Labels": {}} for n in sorted(used)]
        free = {n: {"CPU": NODE_CPUS - u} for n, u in used.items()}
        return add_site_problem(
            request, nodes=nodes, free=free, need={"CPU": 1.0}, new_cluster=len(self.sites), strategy="STRICT_PACK"
        )

    def _join_or_abandon_added_sites(self) -> None:
        for c, site in enumerate(self.sites):
            if site.joining_since is None:
                continue
            members = [r for r in self.reps.values() if r.cluster == c and not r.spare]
            if all(r.up for r in members):
                site.joining_since = None
                self.log.append(f"c{c} joined at round {self.round}")
            elif join_overdue(
                site.joining_since * ROUND_S, self.round * ROUND_S, JOIN_TIMEOUT_S
            ):  # the last site: its index is free again
                self.sites.pop()
                self.reps = {rid: r for rid, r in self.reps.items() if r.cluster != c}
                self.abandoned += 1
                self.log.append(f"c{c} abandoned at round {self.round}")

    def _carry_out(self, start: run_control.RoundStart) -> bool:
        """Carry out the start's decisions, each outcome recorded before its effect; False when the
        supervisor died between two of them (the rest stay pending, for its successor to decide)."""
        before, died = self._holders(), True
        for request, decision in start.decisions:
            if request.id in self.outcomes:
                self.fail(f"request {request.id} decided twice")
            self.outcomes[request.id] = decision.outcome
            if decision.outcome != APPLIED:
                self.log.append(f"{request.kind} refused: {decision.reason}")
                continue
            if request.kind is RequestKind.DRAIN:
                self.sites[decision.cluster].drained = True
                for rep in self.reps.values():
                    if rep.cluster == decision.cluster:
                        rep.stopped, rep.up = True, False
            else:
                self._add_site(int(request.replicas), joining_since=self.round)
            if self.rng.random() < self.rates.supervisor / 3:  # dies between the outcome and the next one
                self.log.append("supervisor died between two decisions")
                break
        else:
            died = False
        self.pending = [q for q in self.pending if q.id not in self.outcomes]
        if before and self.committed > 0 and not self._holders() and start.restore_from is None:
            self.fail(f"a decision left no live replica holding committed round {self.committed}")
        return not died

    def _one_round(self) -> None:
        rng, rates = self.rng, self.rates
        self.t = self.round * ROUND_S
        self._requests_arrive()
        start = self._start_of_round()
        if not self._carry_out(start):  # its successor starts the round again
            self.round += 1
            return
        if start.failure:
            self.status, self.reason = "failed", start.failure
            return
        if start.restore_from is not None:
            params, ok = self.checkpoints[start.restore_from]
            assert ok
            for rep in self.reps.values():
                if rep.active:
                    rep.round, rep.params = start.restore_from, params
            self.log.append(f"restore from {start.restore_from} (committed {self.committed})")
            self.committed = start.restore_from
        if self._holders():  # heals: every active replica behind takes the committed params from a holder
            for rep in self.reps.values():
                if rep.active and rep.round != self.committed and not self.sites[rep.cluster].drained:
                    rep.round, rep.params = self.committed, digest(self.committed)
        if start.plan is not None:
            if start.plan_is_new:
                self.saved_plan = start.plan.to_dict()
            steps = {c: start.plan.steps[c] for c in self._topology()}  # an IndexError is a violation
            if any(n < 1 or n > self.spr for n in steps.values()):
                self.fail(f"a plan of {steps} steps")
        training = set(self._training(start))
        if len(training) < self.min_clusters:  # below quorum: wait for restarts, or fail when none will come
            coming = [r for r in self.reps.values() if not r.up and r.back_at is not None and not r.stopped]
            if not coming:
                self.status, self.reason = "failed", f"quorum lost at round {self.committed}: no replica will return"
            self.round += 1
            return
        # the round: failures at random moments, the supervisor maybe among them
        self._failures_during_round(training)
        survivors = {c for c in training if any(r.active and r.cluster == c for r in self.reps.values())}
        supervisor_died = rng.random() < rates.supervisor
        commit = len(survivors) >= self.min_clusters and not (supervisor_died and rng.random() < 0.5)
        if supervisor_died:
            self.log.append(f"supervisor died in round {self.committed} ({'after' if commit else 'before'} the commit)")
        if commit:
            for rep in self.reps.values():
                if rep.active and rep.cluster in survivors and rep.round == self.committed:
                    rep.round, rep.params = self.committed + 1, digest(self.committed + 1)
            self.committed += 1
            self.log.append(f"round {self.committed - 1} committed by {sorted(survivors)}")
            self._round_end()
        self._quarantine()
        self._check_after(f"round {self.round}")
        self.round += 1
        if rng.random() < rates.resume:
            self._resume()

    def _topology(self) -> list[int]:
        """The clusters in the run's topology: all but an added site still joining (always the last)."""
        return [c for c, s in enumerate(self.sites) if s.joining_since is None]

    def _training(self, start: run_control.RoundStart) -> list[int]:
        return list(start.training)

    def _failures_during_round(self, training: set[int]) -> None:
        rng, rates = self.rng, self.rates
        up = [rid for rid, r in self.reps.items() if r.up and not r.stopped]
        if not up:
            return
        self.t = self.round * ROUND_S + rng.uniform(1, ROUND_S - 2)
        if rng.random() < rates.death:
            for rid in rng.sample(up, k=min(len(up), rng.randint(1, 2))):
                self._die(rid, node_loss=False)
        if rng.random() < rates.node_loss:
            node = self.reps[rng.choice(up)].node
            self.node_losses.append((self.t, node))
            on_node = [rid for rid in up if self.reps[rid].node == node]
            for rid in on_node:
                self.t += rng.uniform(0, 1.0)
                self._die(rid, node_loss=len(on_node) > 1)
        if rng.random() < rates.whole_site:
            c = self.reps[rng.choice(up)].cluster
            for rid in up:
                if self.reps[rid].cluster == c:
                    self._die(rid, node_loss=False)
        if rng.random() < rates.every_replica:
            for rid in up:
                self._die(rid, node_loss=False)

    def _round_end(self) -> None:
        rng, rates = self.rng, self.rates
        due = (self.committed % self.checkpoint_every == 0 or self.committed == self.rounds) and (
            self.committed not in self.checkpoints  # never overwritten (actors/checkpointing.py: "already exists")
        )
        write = CheckpointWrite.NONE
        if due:
            roll = rng.random()
            write = (
                CheckpointWrite.FAILED
                if roll < rates.write_failed
                else CheckpointWrite.TIMED_OUT
                if roll < rates.write_failed + rates.write_hung
                else CheckpointWrite.SAVED
            )
        good = [r for r, (_, ok) in self.checkpoints.items() if ok]
        end = run_control.round_end(self.committed, write, max(good, default=None))
        if write is not CheckpointWrite.SAVED and end.checkpoint_round != max(good, default=None):
            self.fail(f"a checkpoint write that {write.value} moved the restore point to {end.checkpoint_round}")
        if write is CheckpointWrite.SAVED and self.committed not in self.checkpoints:  # one that exists: skipped
            self.checkpoints[self.committed] = (digest(self.committed), rng.random() >= rates.corrupt_checkpoint)

    def _quarantine(self) -> None:
        for rid in sorted(self.due):
            rep = self.reps.get(rid)
            if rep is None or rep.kept_out or rep.stopped:
                continue
            nodes = {r.node for r in self.reps.values()}
            if len(nodes) > 1:  # moved to another node: a new actor, a fresh count
                rep.node = next(n for n in sorted(nodes) if n != rep.node)
                self.death_log.forget(rid)
            else:
                rep.kept_out, rep.up = True, False
            self.log.append(f"{rid} quarantined ({'kept out' if rep.kept_out else 'moved'})")
        self.due.clear()

    def _resume(self) -> None:
        """The driver restarted with train.resume=true: every process is new; the run loads its resume point."""
        self.log.append(f"driver resumed at committed round {self.committed}")
        good = sorted((r for r, (_, ok) in self.checkpoints.items() if ok), reverse=True)
        point, why = run_control.restore_choice(
            self.committed, [Checkpoint(r, ok) for r, (_, ok) in self.checkpoints.items()]
        )
        for rep in self.reps.values():
            rep.up = not (rep.stopped or rep.kept_out)
            rep.round, rep.params, rep.back_at = 0, "fresh", None
        if point is None:
            if self.checkpoints:
                self.status, self.reason = "failed", why
            self.committed = 0  # nothing was ever saved: a fresh start is what resume means
            return
        if point != (good[0] if good else None):
            self.fail(f"resume from {point}, the newest loadable is {good[:1]}")
        for rep in self.reps.values():
            if rep.active:
                rep.round, rep.params = point, self.checkpoints[point][0]
        self.committed = point
        for rid, rep in self.reps.items():
            if rep.active and (rep.params != digest(point) or rep.round != point):
                self.fail(
                    f"{rid} resumed with params {rep.params} at round {rep.round}, "
                    f"checkpoint {point} holds {digest(point)}"
                )

    def _check_end(self) -> None:
        if self.status == "failed" and not self.reason:
            self.fail("failed without a reason")
        if self.status == "completed" and self.committed < self.rounds:
            self.fail("completed short of its rounds")
        if len(set(self.outcomes)) != len(self.outcomes):
            self.fail("a request decided twice")
        for c, site in enumerate(self.sites):
            if site.drained and any(r.up for r in self.reps.values() if r.cluster == c):
                self.fail(f"c{c} drained but a replica of it is up")
