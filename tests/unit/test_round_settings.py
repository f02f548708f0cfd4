"""hsgd.core.round.machine.round_settings: the round machine's settings from the config, the model's bytes and the
learned phase clock — every deadline scaled to the work it bounds."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from hsgd.config.schema import HsgdConfig
from hsgd.core.deadlines import PhaseClock
from hsgd.core.round import RoundSettings, round_settings

GB = 10**9
MIB = 1 << 20


def sections(**overrides):
    """sync, supervisor, comm as plain namespaces."""
    sync = dict(inner="ddp", outer="diloco", outer_path="leader", inner_every=1, fragment_delay=0)
    supervisor = dict(
        call_timeout_s=60.0, phase_timeout_s=300.0, min_replicas_per_cluster=1, min_clusters=1, rejoin="fast"
    )
    comm = dict(timeout_s=10.0, configure_timeout_s=30.0, min_gbps=1.0)
    for key, value in overrides.items():
        section, name = key.split("__")
        {"sync": sync, "supervisor": supervisor, "comm": comm}[section][name] = value
    return SimpleNamespace(**sync), SimpleNamespace(**supervisor), SimpleNamespace(**comm)


def settings(*, param_bytes=0, clock=None, steps_per_round=20, **overrides) -> RoundSettings:
    sync, supervisor, comm = sections(**overrides)
    return round_settings(
        steps_per_round=steps_per_round,
        sync=sync,
        supervisor=supervisor,
        comm=comm,
        param_bytes=param_bytes,
        clock=clock or PhaseClock(floor_s=15.0, ceiling_s=300.0),
    )


def seen(clock: PhaseClock, phase: str, seconds: float, times: int = 2) -> PhaseClock:
    for _ in range(times):
        clock.observe(phase, seconds)
    return clock


def test_group_grace_is_one_collectives_timeout_for_the_params_at_min_gbps_plus_five_seconds():
    assert settings(param_bytes=0).group_grace_s == 15.0
    assert settings(param_bytes=GB).group_grace_s == pytest.approx(10.0 + 8.0 + 5.0), "1 GB at 1 Gbit/s is 8 s"
    assert settings(param_bytes=GB, comm__min_gbps=0.5).group_grace_s == pytest.approx(10.0 + 16.0 + 5.0), (
        "a slower link assumed must give a member longer to leave a broken collective"
    )


def test_a_heal_covers_its_groups_join_and_the_whole_state_twice_and_grows_with_the_state():
    fixed = 60.0 + 30.0 + 10.0  # call_timeout_s + configure_timeout_s + timeout_s
    small = settings(param_bytes=0).heal_s
    assert small == pytest.approx(fixed + 2 * MIB * 8 / GB), "even an empty model's state has its small tensors"
    big = settings(param_bytes=GB).heal_s
    state = 7 * GB + MIB  # params, AdamW's moments, global params, momentum, residual, snapshot
    assert big == pytest.approx(fixed + 2 * state * 8 / GB), f"heal_s={big}: not the state twice at 1 Gbit/s"
    assert settings(param_bytes=GB, comm__min_gbps=2.0).heal_s == pytest.approx(fixed + state * 8 / GB)


def test_outer_and_commit_follow_the_learned_deadline_plus_grace_capped_by_phase_timeout():
    fresh = settings(param_bytes=GB, supervisor__phase_timeout_s=300.0)
    assert fresh.outer_s == 300.0 and fresh.commit_s == 300.0, "unseen phases: the ceiling + grace, capped"
    clock = seen(seen(PhaseClock(multiple=4.0, floor_s=15.0, ceiling_s=300.0), "outer", 10.0), "outer_commit", 1.0)
    learned = settings(param_bytes=GB, clock=clock, supervisor__phase_timeout_s=300.0)
    grace = learned.group_grace_s
    assert learned.outer_s == pytest.approx(4 * 10.0 + grace), "outer: 4x its median + the group's grace"
    assert learned.commit_s == pytest.approx(15.0 + grace), "commit: the floor + the group's grace"
    capped = settings(param_bytes=GB, clock=clock, supervisor__phase_timeout_s=30.0)
    assert capped.outer_s == 30.0 and capped.commit_s == 30.0, "never past supervisor.phase_timeout_s"


def test_the_step_deadline_is_the_clocks_and_presumed_dead_has_a_quarter_second_floor():
    assert settings().presumed_dead_s == 0.5, "before any step was seen: half a second"
    assert settings().step_deadline_s == 300.0, "before any step was seen: the ceiling"
    fast = seen(PhaseClock(multiple=4.0, floor_s=15.0, ceiling_s=300.0), "inner_step", 0.01)
    assert settings(clock=fast).presumed_dead_s == 0.25, "fast steps must not presume a peer dead sooner"
    assert settings(clock=fast).step_deadline_s == 15.0
    slow = seen(PhaseClock(multiple=4.0, floor_s=15.0, ceiling_s=300.0), "inner_step", 6.0)
    assert settings(clock=slow).presumed_dead_s == 6.0, "members in lockstep fail within a step of each other"
    assert settings(clock=slow).step_deadline_s == 24.0


@pytest.mark.parametrize("configure, timeout, expected", [(30.0, 10.0, 45.0), (5.0, 10.0, 15.0)])
def test_configure_allows_the_rendezvous_then_the_connect_then_a_margin(configure, timeout, expected):
    s = settings(comm__configure_timeout_s=configure, comm__timeout_s=timeout)
    assert s.configure_s == expected, f"configure_s={s.configure_s}: not configure + min(timeout, configure) + 5"


def test_the_typed_config_defaults_fragment_delay_to_0_and_rejoin_to_fast():
    cfg = OmegaConf.structured(HsgdConfig)
    typed = round_settings(
        steps_per_round=20,
        sync=cfg.sync,
        supervisor=cfg.supervisor,
        comm=cfg.comm,
        param_bytes=0,
        clock=PhaseClock(floor_s=15.0, ceiling_s=300.0),
    )
    assert typed.fragment_delay == 0 and typed.rejoin == "fast"
    assert settings(sync__fragment_delay=3).fragment_delay == 3
    assert settings(supervisor__rejoin="boundary").rejoin == "boundary"


def test_sync_and_quorum_rules_pass_through():
    s = settings(
        steps_per_round=7,
        sync__inner="localsgd",
        sync__inner_every=4,
        sync__outer="average",
        sync__outer_path="sharded",
        supervisor__min_replicas_per_cluster=2,
        supervisor__min_clusters=3,
    )
    assert (s.steps_per_round, s.inner, s.inner_every, s.outer, s.outer_path) == (
        7,
        "localsgd",
        4,
        "average",
        "sharded",
    )
    assert (s.min_replicas_per_cluster, s.min_clusters) == (2, 3)


def test_config_nodes_work_as_the_supervisor_holds_them():
    """The typed config, and a plain node of the resolved dict (how the supervisor holds its config:
    OmegaConf.create of the resolved dict, which has every key of the schema)."""
    typed = OmegaConf.structured(HsgdConfig)
    s = round_settings(
        steps_per_round=5,
        sync=typed.sync,
        supervisor=typed.supervisor,
        comm=typed.comm,
        param_bytes=GB,
        clock=PhaseClock(),
    )
    assert s.fragment_delay == typed.sync.fragment_delay and s.rejoin == typed.supervisor.rejoin
    assert s.group_grace_s == pytest.approx(typed.comm.timeout_s + 8 * GB / (typed.comm.min_gbps * GB) + 5.0)
    plain = OmegaConf.create(OmegaConf.to_container(typed))
    assert (
        round_settings(
            steps_per_round=5,
            sync=plain.sync,
            supervisor=plain.supervisor,
            comm=plain.comm,
            param_bytes=GB,
            clock=PhaseClock(),
        )
        == s
    )
