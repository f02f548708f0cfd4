"""Start-up survives deaths (actors/startup.py): a dead or unreachable replica is retried, never a
config error; a live replica's own answer or error is the caller's; a replica still away after the
retries is left out only where its cluster keeps supervisor.min_replicas_per_cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError

from actors import startup
from hsgd.core.topology import Topology


class _Ref:
    def __init__(self, outcome):
        self.outcome = outcome


def _calls(script: dict[str, list], seen: list):
    """call(key, handle, first): the next outcome scripted for key (an exception or an answer)."""

    def call(key, handle, first):
        seen.append((key, first))
        return _Ref(script[key].pop(0) if len(script[key]) > 1 else script[key][0])

    return call


@pytest.fixture
def calls(monkeypatch):
    def get(ref, timeout=None):
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    monkeypatch.setattr(startup.ray, "get", get)
    monkeypatch.setattr(startup, "RETRY_PAUSE_S", 0.0)
    return startup.StartupCalls(
        Topology(2, 2), SimpleNamespace(call_timeout_s=0.5, phase_timeout_s=1.0, min_replicas_per_cluster=1)
    )


def test_a_replica_that_died_is_retried_without_its_faults_and_answers(calls):
    seen = []
    died = ActorDiedError()
    answers, errors = calls.call_all({"c0r0": 0, "c0r1": 0}, _calls({"c0r0": ["ok"], "c0r1": [died, "ok"]}, seen), 1.0)
    assert answers == {"c0r0": "ok", "c0r1": "ok"} and errors == {}
    assert seen == [("c0r0", True), ("c0r1", True), ("c0r1", False)], "the retry carries no faults"


def test_a_live_replicas_own_error_is_returned_not_retried(calls):
    seen = []
    boom = RuntimeError("cannot read the checkpoint")
    answers, errors = calls.call_all({"c0r0": 0}, _calls({"c0r0": [boom]}, seen), 1.0)
    assert answers == {} and errors == {"c0r0": boom} and seen == [("c0r0", True)]


def test_a_replica_still_away_is_left_out_where_its_cluster_keeps_quorum(calls, capsys):
    answers, _ = calls.call_all({"c0r0": 0, "c0r1": 0}, _calls({"c0r0": ["ok"], "c0r1": [GetTimeoutError()]}, []), 1.0)
    assert answers == {"c0r0": "ok"} and "starting without c0r1" in capsys.readouterr().out


def test_a_cluster_below_min_replicas_after_the_retries_fails_the_start_not_the_config(calls):
    with pytest.raises(
        RuntimeError,
        match=r"c1r0, c1r1 did not come back .* cluster c1 is below "
        r"supervisor.min_replicas_per_cluster=1",
    ):
        calls.call_all(
            {"c1r0": 0, "c1r1": 0}, _calls({"c1r0": [ActorDiedError()], "c1r1": [ActorDiedError()]}, []), 1.0
        )
