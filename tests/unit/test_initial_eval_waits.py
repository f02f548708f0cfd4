"""The loss before any training is taken from a live replica (found under load: a two-rank run whose
first start outlasted supervisor.quorum_wait_s logged `initial_eval` with `eval_loss: null` and kept
it for good). With nobody up yet the evaluation waits for round 0's start, when the supervisor has
its replicas back; it is still taken once per run, before any training."""

from __future__ import annotations

from types import SimpleNamespace

from actors.round_close import RoundClose
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster


def _close(live: list[str]) -> tuple[RoundClose, SimpleNamespace]:
    saved: list[dict] = []
    state = RunState()
    ports = SimpleNamespace(
        cfg=SimpleNamespace(optim=SimpleNamespace(outer=SimpleNamespace(lr=0.7, momentum=0.9, nesterov=True))),
        state=state,
        roster=FakeRoster(Topology(1, 2), live=live),
        log=EventLog(),
    )
    record = SimpleNamespace(save_state=lambda: saved.append(state.to_dict()))
    close = RoundClose(ports, record)
    close.evaluate = lambda: 4.25  # (a live replica's answer)
    return close, SimpleNamespace(ports=ports, saved=saved)


def test_with_no_replica_up_the_initial_eval_waits_and_is_taken_once_one_is():
    close, world = _close(live=[])
    close.initial_eval()
    assert not world.ports.state.evaluated and world.ports.log.named("initial_eval") == [] and world.saved == []
    world.ports.roster.live["c0r0"] = (0, 0)  # round 0's start: the replicas are back
    close.initial_eval()
    close.initial_eval()  # (asked again: taken once)
    assert world.ports.log.named("initial_eval") == [{"eval_loss": 4.25}]
    assert world.ports.state.initial_eval_loss == 4.25 and world.saved[-1]["initial_eval_loss"] == 4.25


def test_with_replicas_up_it_is_taken_at_the_start_as_before():
    close, world = _close(live=["c0r0", "c0r1"])
    close.initial_eval()
    assert world.ports.log.named("initial_eval") == [{"eval_loss": 4.25}] and world.ports.state.evaluated
