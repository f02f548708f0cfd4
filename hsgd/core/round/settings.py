"""The round machine's settings for one round: the config's sync and quorum rules, and every
deadline scaled to the work it bounds — bytes at comm.min_gbps for what moves state, the learned
times (PhaseClock) for what computes."""
from __future__ import annotations

from typing import Any

from hsgd.core.deadlines import PhaseClock, collective_timeout_s, heal_deadline_s, state_bytes_bound
from hsgd.core.round.machine import RoundSettings


def round_settings(*, steps_per_round: int, sync: Any, supervisor: Any, comm: Any, param_bytes: int,
                   clock: PhaseClock) -> RoundSettings:
    """The settings of the next round from the config's sections (read by attribute), the model's
    params in bytes and the run's learned phase times (a round follows what the ones before measured)."""
    # a healthy member leaves a broken collective within its (payload-scaled) timeout
    grace = collective_timeout_s(comm.timeout_s, param_bytes, comm.min_gbps) + 5.0
    heal_s = heal_deadline_s(call_timeout_s=supervisor.call_timeout_s, configure_timeout_s=comm.configure_timeout_s,
                             timeout_s=comm.timeout_s, state_bytes=state_bytes_bound(param_bytes),
                             min_gbps=comm.min_gbps)
    return RoundSettings(steps_per_round=steps_per_round, inner=sync.inner, outer=sync.outer,
                         outer_path=sync.outer_path, fragment_delay=sync.fragment_delay,
                         inner_every=sync.inner_every, rejoin=supervisor.rejoin,
                         min_replicas_per_cluster=supervisor.min_replicas_per_cluster,
                         min_clusters=supervisor.min_clusters,
                         step_deadline_s=clock.deadline("inner_step", 1), group_grace_s=grace,
                         # a closed connection means the peer's process is gone; only Ray's own
                         # notice (which names the cause) is worth a short wait — nothing is killed
                         presumed_dead_s=max(0.25, clock.median("inner_step", 0.5)),
                         # the rendezvous, then the backend's connect among members known present
                         # (hsgd.train.comm.LevelGroup.connect_timeout_s), then a margin
                         configure_s=comm.configure_timeout_s + min(comm.timeout_s, comm.configure_timeout_s) + 5.0,
                         heal_s=heal_s,
                         # the learned time of the exchange (the ceiling until it was seen), plus the
                         # grace a member needs to leave a broken collective; never past phase_timeout_s
                         outer_s=min(supervisor.phase_timeout_s, clock.deadline("outer", 1) + grace),
                         commit_s=min(supervisor.phase_timeout_s, clock.deadline("outer_commit", 1) + grace))
