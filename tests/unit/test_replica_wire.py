"""The replica's wire is typed (issue 46, Build 2): a call carries its group's join as a GroupJoin,
its faults as the FaultSpec the schedule was parsed into, the phase names are the Phase enum's, and
answers cross as PhaseAnswer — with the public strings (events.jsonl, faults_fired.jsonl, the
config's fault syntax and its errors) exactly as before."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors import rank_group
from actors.rank_group import RankPeers, rank_prefix
from hsgd.core.faults import FaultSpec, FaultSpecError, parse_fault
from hsgd.core.phases import FAULT, MOVES_STATE, PROGRESS, SPAN, SUPERVISOR, Phase
from hsgd.core.round import CallKind, ErrorKind, GroupJoin, Join, Outcome, PhaseAnswer

ROOT = Path(__file__).resolve().parents[2]


def test_a_join_goes_to_the_replica_as_a_group_join_and_each_rank_joins_its_own_prefix():
    join = Join("epoch3/inner/c1", 1, 4).at(3, "h:1/s", "run-x")
    assert join == GroupJoin(3, "h:1/s", "run-x/epoch3/inner/c1", 1, 4)
    assert rank_prefix(join, 0) is join and rank_prefix(None, 2) is None
    other = rank_prefix(join, 2)
    assert (other.epoch, other.store_addr, other.rank, other.world_size) == (3, "h:1/s", 1, 4)
    assert other.prefix != join.prefix and other.prefix.startswith(join.prefix)


def test_the_phase_names_and_what_each_is_for_are_the_public_ones():
    assert "|".join(Phase.having(FAULT)) == "inner|inner_sync|outer|outer_commit|checkpoint|heal|join|startup"
    assert "|".join(Phase.having(SUPERVISOR)) == "inner|outer|outer_commit|checkpoint"
    assert Phase.having(SPAN) == ("inner", "inner_sync", "outer", "outer_commit", "checkpoint", "heal")
    assert Phase.having(PROGRESS) == ("inner", "inner_sync", "outer", "outer_commit")
    assert set(Phase.having(MOVES_STATE)) == {"checkpoint", "heal", "outer", "outer_commit", "inner_sync"}
    records = {kind.value: (kind.record, kind.seconds_key, kind.fault_phases) for kind in CallKind}
    assert records["run_inner"] == ("inner", "inner", ("inner", "inner_sync"))
    assert records["outer_commit"] == ("outer_commit", "outer_commit", ("outer_commit",))
    assert records["heal"] == ("heal", "heal_configure", ("heal",))


def test_a_fault_is_parsed_once_into_a_fault_spec_whose_phase_is_a_phase():
    spec = parse_fault({"kind": "hang", "target": "c0r1", "round": 2, "phase": "inner_sync", "step": 3})
    assert spec.phase is Phase.INNER_SYNC and spec == FaultSpec("hang", "c0r1", 2, "inner_sync", 3)
    assert spec.describe() == "hang c0r1 at round 2 inner_sync step 3"
    with pytest.raises(FaultSpecError, match=re.escape("valid: inner|inner_sync|outer|outer_commit|checkpoint")):
        parse_fault({"kind": "kill", "target": "c0r0", "round": 1, "phase": "backward"})


def _replica_class():
    from actors.replica import Replica

    return Replica.__ray_actor_class__


def test_the_replica_fires_a_carried_fault_spec_at_its_step_and_only_there():
    fired = []
    at_3 = FaultSpec("slow", "c0r1", 0, "inner", 3, seconds=0.25)
    at_0 = FaultSpec("slow", "c0r1", 0, "outer")
    fake = SimpleNamespace(pending_now=[], armed=[at_3, at_0])
    fake._fire = lambda fault, r, s: fired.append((fault, r, s))
    hook = _replica_class()._hook
    hook(fake, "inner", 0, 2)
    assert fired == [], "an inner fault fires at its own step"
    hook(fake, "inner", 0, 3)  # (the trainer's hook names the phase as a string)
    assert fired == [(at_3, 0, 3)] and fake.armed == [at_0]
    hook(fake, Phase.OUTER, 0, 0)
    assert fired[-1] == (at_0, 0, 0) and fake.armed == []


def test_an_answer_is_the_same_typed_or_read_back_from_its_wire():
    answer = PhaseAnswer("c0r1", Outcome.COLLECTIVE_FAILED, 4, 40, "peer gone", ErrorKind.PEER_GONE, "", {"bytes": 7})
    assert PhaseAnswer.read(answer) is answer
    assert PhaseAnswer.read(answer.wire()) == answer


def test_rank_zero_merges_its_ranks_typed_answers(monkeypatch):
    peers = RankPeers("c0r0", handles=[object(), object()], store=None, deadline_s=1.0)
    own = PhaseAnswer("c0r0", result={"outer_bytes": 10, "report": {"inner_bytes": 1, "steps": 3}})
    ranks = [
        PhaseAnswer("c0r0", result={"outer_bytes": 5, "report": {"inner_bytes": 2}}),
        {**PhaseAnswer("c0r0", result={"outer_bytes": 5, "report": {"inner_bytes": 3}}).wire()},
    ]
    monkeypatch.setattr(rank_group.ray, "get", lambda refs, timeout: ranks)
    merged = peers.merge(own, ["r1", "r2"])
    assert merged.outcome is Outcome.DONE and merged.result["outer_bytes"] == 20
    assert merged.result["report"] == {"inner_bytes": 6, "steps": 3}, "each rank moves its own shards"
    ranks[1] = PhaseAnswer("c0r0", Outcome.COLLECTIVE_FAILED, error="rank 2: peer gone", error_kind=ErrorKind.PEER_GONE)
    failed = peers.merge(own, ["r1", "r2"])
    assert (failed.outcome, failed.error, failed.error_kind) == (
        Outcome.COLLECTIVE_FAILED,
        "rank 2: peer gone",
        ErrorKind.PEER_GONE,
    )


def test_no_join_tuple_and_no_fault_dicts_on_the_wire():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in ("hsgd", "actors")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"join: tuple|faults: list\[dict\]", line)
    ]
    assert not found, "\n".join(found)
