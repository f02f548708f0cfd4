"""Seeded random simulation of the round machine at scale: 10,000 replicas in 1,000 clusters.

A simulated supervisor (the loop actors/supervisor.py runs: admit live replicas at a round
boundary, build a RoundMachine, carry out its actions, record the outcome) drives test_round's
`World` of fake replicas through several rounds while failures of every class happen at random:
single replicas dying, hanging or breaking their group's collective in any phase, leaders dying in
the outer exchange, whole clusters and several clusters at once, crashes from outside at any
moment (idle or mid-call), every replica at once (the next round must `restore`), and the
supervisor itself dying mid-round (the machine is discarded; a new one is built from the
replicas' actual progress once they are idle, as a restarted supervisor does).

Invariants, checked at every step (the world flags a broken one the moment it happens):
- no replica that did not fail is ever killed: kills target only replicas the simulator hung;
- at most one call in flight per replica;
- collectives only over groups every member configured; an inner phase's members at one step;
- no committed step lost: a replica never goes back in (round, step) except by restart/restore;
and at every round's end:
- committed rounds only grow (a restore goes back to the checkpoint, and only after a total loss);
- after a commit, every replica that applied it holds round r+1 at step (r+1)*steps and the same
  reduced buffer.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest

from hsgd.core.round import Up
from tests.fakes.round_world import World, make_settings


@dataclass
class Rates:
    """Per replica and round (die/hang/collective), or per round (the rest)."""

    die: float = 3e-4
    hang: float = 1e-4
    collective: float = 2e-4
    leader_in_outer: float = 0.5
    whole_cluster: float = 0.3
    several_clusters: float = 0.2
    outside_crash: float = 0.3
    supervisor: float = 0.2
    # per round: dead replicas are restarted mid-round and announce themselves (rejoin `fast`: the
    # machine's Up; their cluster yields at a step boundary, heals them in and goes on)
    rejoin: float = 0.0
    # per round, with sync.balance=time (a close): 1-3 sites step 3x slower for the round (they yield at
    # the close), one whole site stops stepping and answering at one step, as a paused site (late)
    slowed: float = 0.0
    paused: float = 0.0


@dataclass
class Report:
    rounds_committed: int = 0
    machines: int = 0
    outcomes: dict = field(default_factory=dict)
    supervisor_restarts: int = 0
    restores: int = 0
    kills: int = 0
    injected: dict = field(default_factory=dict)
    wall_s: float = 0.0
    closed: int = 0  # machines whose round closed by the clock
    late: int = 0  # clusters late in them


SIM_SETTINGS = dict(
    steps_per_round=20, step_deadline_s=3.0, group_grace_s=2.0, configure_s=3.0, heal_s=3.0, outer_s=4.0, commit_s=3.0
)
# (configure_<level>: in the join a call that forms its group starts with)
PHASES = ("run_inner", "heal", "configure_inner", "outer_reduce", "outer_commit", "configure_outer")


class Simulation:
    def __init__(
        self,
        clusters: int,
        per_cluster: int,
        *,
        rounds: int,
        seed: int,
        rates: Rates,
        all_lost_round: int | None = None,
        checkpoint_every: int = 2,
        max_machines: int | None = None,
        persist_epoch: bool = True,
        forced: dict[int, set[str]] | None = None,
        **settings,
    ):
        self.w = World(
            clusters,
            per_cluster,
            settings=make_settings(**{**SIM_SETTINGS, **settings}),
            step_s=0.1,
            timeout_s=1.0,
            configure_timeout_s=1.5,
        )
        self.spr = self.w.spr
        self.rounds, self.rates, self.rng = rounds, rates, random.Random(seed)
        self.all_lost_round = all_lost_round
        self.checkpoint_every = checkpoint_every
        self.checkpoint = 0  # the latest durable checkpoint's round
        self.durable_epoch = 0
        # True: the supervisor saves the epoch whenever the machine issues a new one, so a restarted
        # supervisor never reuses one (see test_round's test_restarted_supervisor_never_reuses_an_epoch_...)
        self.persist_epoch = persist_epoch
        # round -> failure classes that happen in that round whatever the dice say (coverage at any seed):
        # hang | leader_in_outer | whole_cluster | several_clusters | outside_crash | supervisor
        self.forced = {r: set(v) for r, v in (forced or {}).items()}
        self.max_machines = max_machines or rounds * 4 + 10
        self.report = Report()
        self.total_loss_pending = False
        self.history: list[int] = []  # committed_round after each machine

    # -- failures ----------------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.report.injected[what] = self.report.injected.get(what, 0) + n

    def _happens(self, r: int, what: str, p: float) -> bool:
        forced = what in self.forced.get(r, ())
        self.forced.get(r, set()).discard(what)  # once per round, even if the round is run again
        return self.rng.random() < p or forced

    def _arm(self, r: int) -> None:
        w, rng, rates = self.w, self.rng, self.rates
        live = [rid for rid, rep in w.reps.items() if rep.alive]
        n = len(live)
        if self._happens(r, "hang", 0.0):
            w.fault(rng.choice(live), "run_inner", "hang", round=r, step=rng.randrange(self.spr))
            self._count("hang in run_inner")
        for what, p in (("die", rates.die), ("hang", rates.hang), ("collective", rates.collective)):
            for rid in rng.sample(live, min(n, _poisson(rng, p * n))):
                kind = rng.choice(PHASES)
                w.fault(rid, kind, what, round=r, step=rng.randrange(self.spr))
                self._count(f"{what} in {kind}")
        if self._happens(r, "leader_in_outer", rates.leader_in_outer):
            clusters = rng.sample(range(w.topo.clusters), min(w.topo.clusters, rng.randint(1, 3)))
            for c in clusters:
                leader = w.leaders.get(c) or next((x for x in w.members(c) if w.reps[x].alive), None)
                if leader is not None:
                    w.fault(leader, "outer_reduce", rng.choice(("die", "die", "hang")), round=r)
                    self._count("leader in outer")
        groups = []
        if self._happens(r, "whole_cluster", rates.whole_cluster):
            groups.append(rng.sample(range(w.topo.clusters), 1))
        if self._happens(r, "several_clusters", rates.several_clusters):
            groups.append(rng.sample(range(w.topo.clusters), min(w.topo.clusters, rng.randint(2, 6))))
        for clusters in groups:
            step = rng.randrange(self.spr)
            for c in clusters:
                for rid in w.members(c):
                    w.fault(rid, "run_inner", "die", round=r, step=step)
            self._count("whole cluster" if len(clusters) == 1 else "several clusters", len(clusters))
        w.slow.clear()
        if self._happens(r, "slowed", rates.slowed):
            for c in rng.sample(range(w.topo.clusters), min(w.topo.clusters, rng.randint(1, 3))):
                w.slow.update(dict.fromkeys(w.members(c), 3 * w.step_s))
                self._count("slowed site")
        if self._happens(r, "paused", rates.paused):
            c, step = rng.randrange(w.topo.clusters), rng.randrange(self.spr)
            for rid in w.members(c):
                w.fault(rid, "run_inner", "hang", round=r, step=step)
            self._count("paused site")
        start = w.now
        if self._happens(r, "outside_crash", rates.outside_crash):
            for _ in range(rng.randint(1, 3)):
                victims = rng.sample(live, min(n, rng.randint(1, 3)))
                w.at(start + rng.uniform(0.0, 4.0), lambda world, v=victims: world.crash(v))
                self._count("outside crash", len(victims))
        if self._happens(r, "rejoin", rates.rejoin):
            for _ in range(rng.randint(1, 3)):
                w.at(start + rng.uniform(0.5, 8.0), self._restart_mid_round)
        if self.all_lost_round == r:
            self.all_lost_round = None
            self.total_loss_pending = True
            w.at(start + rng.uniform(0.5, 2.5), lambda world: world.crash(list(world.reps)))
            self._count("every replica")

    def _restart_mid_round(self, world) -> None:
        """Ray restarted the dead the machine knows of (a fresh process: seed state, no groups); the
        runner, polling them (actors/round_runner.py polls only replicas the machine holds not
        live), tells the machine each one is up."""
        m = world.m
        if m is None:
            return
        for rid, rep in sorted(world.reps.items()):
            if not rep.alive and rep.call is None and rid not in m.progress:
                world.reps[rid] = type(rep)(rid, 0, 0, restarts=rep.restarts + 1)
                self._count("restarted mid-round")
                world.carry_out(m.observe(Up(rid, 0, 0), world.now))
                if world.m is not m:
                    return

    # -- the supervisor's loop ---------------------------------------------------------------------------
    def run(self) -> Report:
        t0 = time.perf_counter()
        w = self.w
        while w.committed_round < self.rounds:
            assert self.report.machines < self.max_machines, f"no progress: {self.report}"
            w.drain()
            w.restart_dead()
            live = w.live_progress()
            if not live:
                continue
            r = max(p[0] for p in live.values())
            w.clear_faults()
            self._arm(r)
            m = w.machine(r)
            self.report.machines += 1
            w.sup_dead = False
            if self._happens(r, "supervisor", self.rates.supervisor):

                def supervisor_dies(world, machine=m):
                    world.sup_dead = world.sup_dead or world.m is machine

                w.at(w.now + self.rng.uniform(0.0, 5.0), supervisor_dies)
            committed_before = w.committed_round
            w.drive(m, stop=lambda: w.sup_dead)
            self.report.kills = len(w.kills)
            self.report.closed += m.closed
            self.report.late += len(m.late)
            assert not w.violations, "the machine broke a promise:\n" + "\n".join(w.violations[:20])
            if not m.done:
                if self.persist_epoch:
                    self.durable_epoch = m.epoch
                self._supervisor_restart()
                continue
            self.report.outcomes[m.outcome] = self.report.outcomes.get(m.outcome, 0) + 1
            w.epoch = self.durable_epoch = m.epoch
            w.leaders, w.configured, w.outer_configured = dict(m.leaders), m.configured_groups(), m.outer_configured
            if m.outcome == "committed":
                self._check_commit(m, r)
                w.committed_round = r + 1
                if (r + 1) % self.checkpoint_every == 0:
                    self.checkpoint = r + 1
            elif m.outcome == "restore":
                holders = [rid for rid, rep in w.reps.items() if rep.alive and rep.round >= w.committed_round]
                assert not holders, f"restore while {holders[:5]} hold committed round {w.committed_round}: {m.reason}"
                self._restore()
            elif m.outcome == "below_quorum":
                pass  # replicas come back at the next boundary
            else:
                raise AssertionError(f"round {r}: {m.outcome}: {m.reason}")
            assert w.committed_round >= committed_before or m.outcome == "restore"
            self.history.append(w.committed_round)
        w.drain()
        self.report.rounds_committed = w.committed_round
        self.report.wall_s = time.perf_counter() - t0
        assert not w.violations, "the machine broke a promise:\n" + "\n".join(w.violations[:20])
        return self.report

    def _supervisor_restart(self) -> None:
        """The supervisor died mid-round: its machine is gone. A new one waits until the replicas
        are idle (killing stuck ones), asks each for its progress, and resumes: max wins."""
        w = self.w
        self.report.supervisor_restarts += 1
        w.drain()
        w.leaders, w.configured, w.outer_configured = {}, {}, None
        w.epoch = self.durable_epoch
        live = w.live_progress()
        if live:
            w.committed_round = max(w.committed_round, max(p[0] for p in live.values()))
            if w.committed_round % self.checkpoint_every == 0:
                self.checkpoint = max(self.checkpoint, w.committed_round)

    def _check_commit(self, m, r: int) -> None:
        w = self.w
        assert r == w.committed_round, f"round {r} committed, but {w.committed_round} was the next to commit"
        assert m.committed_by, "committed with nobody applying it"
        applied = set()
        for rid in m.committed_by:
            rep = w.reps[rid]
            if rep.alive:
                assert rep.pos == (r + 1, (r + 1) * self.spr), f"{rid} committed round {r} but holds {rep.pos}"
                applied.add(rep.applied)
        assert len(applied) <= 1, f"replicas applied different outer steps in round {r}: {applied}"
        for rid, rep in w.reps.items():
            if rep.alive and rep.round > r + 1:
                raise AssertionError(f"{rid} is ahead of the committed round: {rep.pos}")

    def _restore(self) -> None:
        w = self.w
        self.report.restores += 1
        self.total_loss_pending = False
        ck = self.checkpoint
        for rep in w.reps.values():
            if rep.alive:
                rep.round, rep.step = ck, ck * self.spr
                rep.inner = rep.outer = rep.buffer = None
        w.committed_round = ck
        w.configured, w.outer_configured = {}, None


def _poisson(rng: random.Random, lam: float) -> int:
    """Poisson(lam) by counting exponential gaps (lam is small here)."""
    n, t = 0, rng.expovariate(1.0) if lam > 0 else 1.0
    while lam > 0 and t < lam:
        n += 1
        t += rng.expovariate(1.0)
    return n


# -- tests --------------------------------------------------------------------------------------------------

EVERY_CLASS = {
    0: {"hang", "leader_in_outer"},
    1: {"whole_cluster", "supervisor"},
    2: {"several_clusters", "hang"},
    4: {"outside_crash", "leader_in_outer", "supervisor"},
    5: {"several_clusters", "whole_cluster"},
}


def test_ten_thousand_replicas_every_failure_class():
    sim = Simulation(1000, 10, rounds=8, seed=7, rates=Rates(), all_lost_round=3, forced=EVERY_CLASS)
    report = sim.run()
    assert report.rounds_committed == 8
    assert report.restores == 1, report
    assert report.supervisor_restarts >= 2, report
    assert report.kills >= 2, "hangs were injected: the hung replicas must have been found and killed"
    for what in (
        "hang in run_inner",
        "leader in outer",
        "whole cluster",
        "several clusters",
        "outside crash",
        "every replica",
    ):
        assert report.injected.get(what), (what, report)
    assert sum(n for k, n in report.injected.items() if k.startswith("collective")) >= 1, report


@pytest.mark.parametrize("seed", range(40))
def test_small_topologies_high_failure_rates(seed):
    """Many interleavings fast: few clusters, failures in most rounds."""
    rates = Rates(
        die=0.03,
        hang=0.01,
        collective=0.02,
        leader_in_outer=0.4,
        whole_cluster=0.15,
        several_clusters=0.05,
        outside_crash=0.3,
        supervisor=0.15,
    )
    # odd seeds overlap the outer reduce with the inner steps (sync.fragment_delay): the machine plans
    # it at every (re-)formed inner phase, whatever failed before
    sim = Simulation(
        6,
        3,
        rounds=15,
        seed=seed,
        rates=rates,
        all_lost_round=7 if seed % 3 == 0 else None,
        min_replicas_per_cluster=1 + seed % 2,
        fragment_delay=5 * (seed % 2),
    )
    report = sim.run()
    assert report.rounds_committed == 15
    if seed % 3 == 0:
        assert report.restores >= 1, report  # (at these rates a total loss may also happen by chance)


# 15 and 17: a round ended below quorum while other clusters were mid-collective (their groups were
# handed on as standing, and broke afterwards)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 15, 17])
def test_medium_topology_with_min_clusters(seed):
    """50 clusters of 4; a round needs 46 clusters of >= 2 live replicas: quorum losses happen and pass."""
    rates = Rates(die=0.01, hang=0.003, collective=0.005, whole_cluster=0.5, several_clusters=0.3)
    sim = Simulation(
        50,
        4,
        rounds=10,
        seed=seed,
        rates=rates,
        all_lost_round=6,
        min_clusters=46,
        min_replicas_per_cluster=2,
        forced={1: {"supervisor", "hang"}, 3: {"several_clusters"}},
    )
    report = sim.run()
    assert report.rounds_committed == 10 and report.restores >= 1, report


@pytest.mark.long  # ~20 s of CPU per seed
@pytest.mark.parametrize("seed", range(3))
def test_ten_thousand_replicas_long_run(seed):
    sim = Simulation(
        1000,
        10,
        rounds=25,
        seed=100 + seed,
        rates=Rates(die=6e-4, hang=2e-4, collective=4e-4),
        all_lost_round=12,
        forced={r: {"hang", "supervisor"} for r in range(0, 25, 5)},
    )
    report = sim.run()
    assert report.rounds_committed == 25 and report.restores == 1, report


@pytest.mark.parametrize("seed", range(30))
def test_restarted_replicas_rejoin_mid_round_through_yields(seed):
    """Rejoin `fast` under steady crashes from outside: the dead restart inside the round, their
    cluster yields at a step boundary, heals them in and goes on (ddp, localsgd, none), while the
    other failure classes keep happening now and then."""
    rates = Rates(
        die=0.01,
        hang=0.002,
        collective=0.002,
        leader_in_outer=0.1,
        whole_cluster=0.1,
        several_clusters=0.02,
        outside_crash=0.7,
        supervisor=0.05,
        rejoin=1.0,
    )
    sim = Simulation(
        4 + seed % 4,
        3 + seed % 3,
        rounds=10,
        seed=seed,
        rates=rates,
        min_replicas_per_cluster=1 + seed % 2,
        steps_per_round=80,
        inner=("ddp", "localsgd", "none")[seed % 3],
        inner_every=4 if seed % 3 == 1 else 1,
    )
    report = sim.run()
    assert report.rounds_committed == 10, report
    assert report.injected.get("restarted mid-round"), report


def test_mid_round_rejoins_do_yield():
    """The seeds above do exercise the yield path (not only joins at a re-form)."""
    yields = 0
    for seed in range(6):
        rates = Rates(
            die=0.01,
            hang=0.002,
            collective=0.002,
            leader_in_outer=0.1,
            whole_cluster=0.1,
            several_clusters=0.02,
            outside_crash=0.7,
            supervisor=0.05,
            rejoin=1.0,
        )
        sim = Simulation(
            4 + seed % 4,
            3 + seed % 3,
            rounds=10,
            seed=seed,
            rates=rates,
            min_replicas_per_cluster=1 + seed % 2,
            steps_per_round=80,
        )
        sim.run()
        yields += sum(i.action.kind == "yield" for i in sim.w.issued)
    assert yields >= 10, yields


@pytest.mark.parametrize("seed", range(30))
def test_mid_round_rejoins_under_high_failure_rates(seed):
    rates = Rates(
        die=0.03,
        hang=0.01,
        collective=0.02,
        leader_in_outer=0.3,
        whole_cluster=0.15,
        several_clusters=0.05,
        outside_crash=0.3,
        supervisor=0.1,
        rejoin=0.8,
    )
    sim = Simulation(
        4 + seed % 4,
        3 + seed % 3,
        rounds=12,
        seed=seed,
        rates=rates,
        all_lost_round=7 if seed % 3 == 0 else None,
        min_replicas_per_cluster=1 + seed % 2,
    )
    report = sim.run()
    assert report.rounds_committed == 12, report


@pytest.mark.parametrize("seed", [3, 11])
def test_rounds_closed_by_the_clock_compose_with_slowed_and_paused_sites_and_every_failure(seed):
    """sync.balance=time (issue 48) in the same world: slowed sites yield at the close, paused ones are
    late (never killed in their round: the next boundary's drain kills the still-stuck, as the roster
    does past supervisor.phase_timeout_s), beside deaths, hangs, broken collectives, rejoins and
    supervisor deaths; every round commits once and the invariants hold at every step."""
    rates = Rates(die=2e-3, hang=5e-4, collective=1e-3, rejoin=0.4, slowed=0.7, paused=0.3)
    sim = Simulation(40, 3, rounds=12, seed=seed, rates=rates, close_s=2.5, late_grace_s=1.0)
    report = sim.run()
    assert report.rounds_committed == 12
    assert report.closed and report.late, report
    assert report.injected.get("slowed site") and report.injected.get("paused site"), report.injected
