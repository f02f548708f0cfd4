"""Heals over the process group in a real run (issue 20, Build 7 / Acceptance 6): a replica killed
mid-inner-phase comes back healed over its cluster's process group (`heal_end` transport `group`,
the whole state's bytes); one whose heal over the group cannot complete (it hangs past the group's
join timeout) is healed through the object store instead (`heal_fallback`, transport
`object_store`); digests agree after every commit. (Starts Ray: run it under the shared lock.)"""

from __future__ import annotations

import pytest

from tests.integration.invariants import check_run
from tests.integration.runs import events, train

ROUNDS, SPR = 5, 6
# rejoin `boundary`: the killed replica is waited for at the next round's start and healed there,
# so the heal (and the fault scheduled on it) lands in a known round
BASE = [
    f"sync.outer_every={SPR}",
    f"train.rounds={ROUNDS}",
    "comm.timeout_s=4",
    "comm.configure_timeout_s=4",
    "supervisor.phase_timeout_s=40",
    "supervisor.rejoin=boundary",
    "supervisor.rejoin_wait_s=30",
    "optim.inner.lr=0.01",
]


def schedule(*faults: str) -> str:
    return "faults.schedule=[" + ",".join("{" + f + "}" for f in faults) + "]"


@pytest.mark.long  # ~50 s: a run with two kills and a forced fallback
def test_a_killed_replica_heals_over_the_group_and_falls_back_to_the_object_store(tmp_path):
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        BASE
        + [
            schedule(
                "kind:kill,target:c0r1,round:1,phase:inner,step:2",
                "kind:kill,target:c1r1,round:3,phase:inner,step:2",
                # c1r1's heal at round 4's start stalls past the group's join timeout (4 s): the source gives up on
                # the group, and c1r1 is healed through the object store once it is back
                "kind:hang,target:c1r1,round:4,phase:heal,seconds:7",
            )
        ],
    )
    check_run(run_dir, rounds=ROUNDS, steps_per_round=SPR)  # digests agree after every commit, no harm
    assert s["status"] == "completed", s.get("reason")
    ev = events(run_dir)
    heals = [e for e in ev if e["event"] == "heal_end" and e["scope"] == "full"]
    first = [e for e in heals if e["target"] == "c0r1"]  # at round 2's start
    assert first and first[0]["transport"] == "group", f"c0r1's heal did not go over the group: {first}"
    assert first[0]["source"] == "c0r0" and first[0]["bytes"] > 0 and first[0]["gbps"] > 0, first[0]
    fallbacks = [e for e in ev if e["event"] == "heal_fallback"]
    assert [e["target"] for e in fallbacks] == ["c1r1"], f"expected one fallback, for c1r1: {fallbacks}"
    after = [e for e in heals if e["target"] == "c1r1" and e["t"] > fallbacks[0]["t"]]
    assert after and after[0]["transport"] == "object_store", f"c1r1's fallback heal: {after}"
    assert not [e for e in ev if e["event"] == "heal_source_lost"], "no source died: none may be reported lost"


def test_a_heal_target_dying_before_it_joins_releases_its_source_from_the_heal_rendezvous(tmp_path):
    """c0r1 is killed, comes back at round 2's start, and is killed again as its heal starts,
    before it joins the heal group: its source is released from that group's rendezvous at once
    (`join_aborted` naming the heal group), not after comm.configure_timeout_s; the run completes."""
    run_dir = tmp_path / "run"
    s = train(
        run_dir,
        [
            "sync.outer_every=4",
            "train.rounds=4",
            "comm.timeout_s=4",
            "comm.configure_timeout_s=60",
            "supervisor.phase_timeout_s=120",
            "supervisor.rejoin=boundary",
            "supervisor.rejoin_wait_s=30",
            "checkpoint.every=0",
            schedule("kind:kill,target:c0r1,round:1,phase:inner,step:1", "kind:kill,target:c0r1,round:2,phase:heal"),
        ],
    )
    assert s["status"] == "completed", s.get("reason")
    check_run(run_dir, rounds=4, steps_per_round=4, victims={"c0r1"})
    ev = events(run_dir)
    released = [e for e in ev if e["event"] == "join_aborted" and "/heal/" in e["prefix"]]
    assert released and released[0]["dead"] == ["c0r1"], (
        f"the heal group c0r1 never joined was not released: {[e for e in ev if e['event'] == 'join_aborted']}"
    )
