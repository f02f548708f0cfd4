"""Drill API (issue 4): each fault kind injected through the API is recovered from, and the
live state shows the fault (replica down, epoch bumped) and the recovery (replica back, digests equal)."""
from __future__ import annotations

import pytest

from actors.drill import Drill
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    # padded steps: replicas mostly sleep, so restarts (CPU-bound process boots) are not starved
    d = Drill(FAST + ["train.rounds=2000", "sync.outer_every=6", "train.min_step_s=0.05", "checkpoint.every=0",
                      "comm.timeout_s=4", "watchdog.floor_s=5"], run_dir=str(tmp_path_factory.mktemp("drill")))
    d.start()
    yield d
    if d.summary is None:
        d.stop()


def _epoch(d):
    return d.state()["epoch"]


@pytest.mark.parametrize("kind,target", [("kill", "c0r1"), ("crash", "leader:c1"), ("hang", "c1r1"),
                                         ("comm", "c0r0"), ("kill", "supervisor"), ("crash", "cluster:c1")])
def test_each_fault_kind_through_the_api_is_recovered(drill, kind, target):
    drill.wait_for(phase="inner", timeout_s=60)
    epoch = _epoch(drill)
    victims = drill._resolve(target) if target != "supervisor" else []
    drill.inject(kind, target)
    if victims and kind in ("kill", "crash", "hang"):
        drill.wait_for(lambda st: any(v not in [r for m in (st.get("members") or {}).values() for r in m]
                                      for v in victims), 60, f"{victims} to show as down")
        down = {rid for c in drill.state()["clusters"].values() for rid in c["down"]}
        assert down & set(victims), f"live state does not show {victims} down: {drill.state()['clusters']}"
    result = drill.wait_recovered(timeout_s=120)
    state = drill.state()
    assert all(not c["down"] for c in state["clusters"].values()), state["clusters"]
    if kind != "kill" or target != "supervisor":
        assert state["epoch"] > epoch, "a fault must bump the membership epoch"
    assert result["recovered_s"] is not None and result["recovered_s"] < 120


def test_scheduled_fault_and_clean_stop(drill):
    status = drill.wait_for(phase="inner", timeout_s=60)
    r = (status.get("round") or 0) + 2
    drill.inject("crash", "c1r0", round=r, phase="outer_commit")
    drill.wait_for(round=r + 1, timeout_s=120)
    drill.wait_recovered(timeout_s=120)
    summary = drill.stop()
    assert summary["status"] == "stopped"
    assert len(set(summary["replica_param_digests"].values())) == 1
    assert len(summary["replica_param_digests"]) == 4
    # victims: every replica a fault of this module hit (faults_fired.jsonl)
    check_run(drill.run_dir, rounds=summary["rounds_committed"], steps_per_round=6, expect_status="stopped")
    assert any(e["event"] == "run_stopped" for e in events(drill.run_dir))
    for name in ("loss.png", "timeline.png", "membership.png"):
        assert (drill.run_dir / name).stat().st_size > 5000
    # the pictures are drawn from the run's own record: spans, downs and fault markers are there
    from hsgd.record.plots import membership_data, timeline_data

    timeline = timeline_data(drill.run_dir)
    kinds = {span[2] for spans in timeline["spans"].values() for span in spans}
    assert {"inner", "outer", "outer_commit", "down", "heal"} <= kinds, kinds
    assert any(span[2] == "down" for span in timeline["spans"]["c0r1"]), "the killed c0r1 shows a down span"
    assert {f[1] for f in timeline["faults"]} >= {"c0r1", "supervisor"}, timeline["faults"]
    series = membership_data(drill.run_dir)
    assert series, "membership chart has no data"
