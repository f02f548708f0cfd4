"""hsgd/core/round/cluster.py's yield boundary for a replica that comes back mid-round (rejoin `fast`):
the step time it is planned with (this round's samples, else the cluster's learned time from earlier
rounds, else 0.1 s) and how far ahead of the members it lies."""

from types import SimpleNamespace

from hsgd.core.deadlines import PhaseClock
from hsgd.core.round import Progress, RoundMachine, Up, Yield, round_settings
from hsgd.core.topology import Topology
from tests.fakes.round_world import decisions, make_settings

SPR = 40


def _machine(**overrides) -> RoundMachine:
    """Round 0 of one cluster of 3, c0r2 down at the start; c0r0 and c0r1 run inner from step 0."""
    settings = make_settings(steps_per_round=SPR, **overrides)
    progress = {"c0r0": (0, 0), "c0r1": (0, 0)}
    m = RoundMachine(Topology(1, 3), settings, 0, progress=progress, leaders={}, epoch=0, committed_round=0)
    m.start(0.0)
    return m


def _yield(m: RoundMachine, now: float) -> Yield:
    (ask,) = decisions(m.observe(Up("c0r2", 0, 0), now))
    assert isinstance(ask, Yield) and ask.rids == ("c0r0", "c0r1"), f"expected a yield of both members, got {ask}"
    return ask


def test_the_yield_plans_with_this_rounds_step_samples():
    m = _machine(yield_lead_s=1.0)
    for step in (1, 2, 3, 4):  # 0.5 s per step, seen every step
        for rid in ("c0r0", "c0r1"):
            m.observe(Progress(rid, step), 0.5 * step)
    assert m._step_time(0) == 0.5
    # step 4 seen at 2.0 s; at 2.25 s: 4 + (0.25 + 1.0) / 0.5 = 6.5 -> 7
    assert _yield(m, 2.25).at_step == 7


def test_without_samples_the_yield_plans_with_the_clusters_learned_step_time():
    m = _machine(yield_lead_s=1.0, cluster_step_s=(0.25,))
    assert m._step_time(0) == 0.25, "no sample this round: the learned time from earlier rounds"
    m.observe(Progress("c0r0", 10), 3.0)  # one sign each: no step time from them yet
    m.observe(Progress("c0r1", 10), 3.0)
    # 10 + (0.1 + 1.0) / 0.25 = 14.4 -> 15; at the 0.1 s guess it would have been 10 + 11 = 21
    assert _yield(m, 3.1).at_step == 15


def test_with_nothing_known_the_yield_plans_with_a_short_step_a_longer_lead():
    m = _machine(yield_lead_s=1.0)
    assert m._step_time(0) == 0.1
    assert _machine(yield_lead_s=1.0, cluster_step_s=(None,))._step_time(0) == 0.1
    m.observe(Progress("c0r0", 10), 3.0)
    m.observe(Progress("c0r1", 10), 3.0)
    assert _yield(m, 3.1).at_step == 21  # 10 + 1.1 / 0.1


def test_members_not_seen_since_their_phase_began_are_extrapolated_from_its_start():
    """A phase issued just now (a re-form): the members stand at their committed step, exactly; the
    boundary is the 2-step minimum past it, not a board value's age. Unseen for longer, the time since
    the phase began counts twice, the margin at most yield_lead_s."""
    m = _machine(cluster_step_s=(0.25,))
    assert _yield(m, 0.01).at_step == 2
    m = _machine(cluster_step_s=(0.25,), yield_lead_s=1.0)  # began 2 s ago, nobody seen since: (2 + 1) / 0.25
    assert _yield(m, 2.0).at_step == 12
    m = _machine(cluster_step_s=(0.25,), yield_lead_s=1.0)  # 0.4 s ago: (0.4 + 0.4) / 0.25 = 3.2 -> 4
    assert _yield(m, 0.4).at_step == 4


def test_round_settings_carry_each_clusters_learned_step_time():
    clock = PhaseClock()
    for seconds in (0.2, 0.3, 0.25):
        clock.observe("inner_step/c1", seconds)
    sync = SimpleNamespace(inner="ddp", outer="diloco", outer_path="leader", inner_every=1, fragment_delay=0)
    supervisor = SimpleNamespace(
        call_timeout_s=60.0, phase_timeout_s=300.0, min_replicas_per_cluster=1, min_clusters=1, rejoin="fast"
    )
    comm = SimpleNamespace(timeout_s=10.0, configure_timeout_s=30.0, min_gbps=1.0)
    s = round_settings(
        steps_per_round=20, sync=sync, supervisor=supervisor, comm=comm, param_bytes=0, clock=clock, clusters=2
    )
    assert s.cluster_step_s == (None, 0.25)
