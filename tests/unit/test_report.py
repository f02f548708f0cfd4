"""The figures a run reports (metrics.jsonl records, efficiencies) are computed correctly."""

import math
from types import SimpleNamespace

from hsgd.record.metrics import efficiencies, round_record


def _run(**kw):
    """A round's record as the supervisor hands it (actors/round_record.py RoundRecord's fields)."""
    base = dict(
        inner_bytes=0,
        outer_bytes=0,
        outer_link_s={},
        outer_overlapped=False,
        outer_exchange=None,
        cluster_link_bytes={},
        attempts=1,
        commit_digests={},
        global_digests={},
        late_steps=0,
    )
    return SimpleNamespace(**{**base, **kw})


def test_round_record_means_losses_and_derives_throughput():
    run = _run(
        r=2,
        losses={"c0r0": [2.0, 4.0], "c0r1": [3.0], "c1r0": []},
        tokens=1000,
        inner_bytes=10,
        outer_bytes=4,
        seconds={"inner": 2.0, "outer": 0.5},
        attempts=2,
        commit_digests={"c0r0": "a", "c0r1": "b", "c1r0": "c"},
        global_digests={"c0r0": "g"},
    )
    rec = round_record(
        run, steps_per_round=5, eval_loss=2.5, epoch=4, t=1.0, cluster_steps=[5, 3], cluster_tokens=[600, 400]
    )
    assert rec["round"] == 2 and rec["inner_step"] == 15
    assert math.isclose(rec["loss"], 3.0)
    assert rec["replica_loss"] == {"c0r0": 3.0, "c0r1": 3.0}, "replicas with no committed step are left out"
    assert rec["tokens_per_s"] == 500.0
    assert rec["attempts"] == 2 and rec["epoch"] == 4 and rec["live_replicas"] == 3
    assert rec["cluster_steps"] == [5, 3] and rec["cluster_tokens"] == [600, 400]


def test_round_record_without_steps_or_time_has_no_loss_or_throughput():
    rec = round_record(
        _run(r=0, losses={}, tokens=0, seconds={}),
        steps_per_round=5,
        eval_loss=None,
        epoch=1,
        t=0.0,
        cluster_steps=[5],
        cluster_tokens=[0],
    )
    assert rec["loss"] is None and rec["tokens_per_s"] is None


def test_efficiencies_follow_torchft_definitions():
    assert efficiencies(0, 0, []) == (1.0, 1.0)
    step, training = efficiencies(90, 100, [1.0, 0.5])
    assert math.isclose(step, 0.9) and math.isclose(training, 0.9 * 0.75)
    assert efficiencies(120, 100, [1.0])[0] == 1.0, "capped at 1"


def test_a_failure_nobody_injected_is_reported_as_observed():
    from hsgd.record.metrics import fault_figures

    fired = [{"t": 10.0, "rid": "c0r1", "kind": "kill", "phase": "inner", "round": 1, "step": 2}]
    events = [
        {"t": 10.5, "event": "replica_down", "rid": "c0r1", "cause": "died", "phase": "inner", "round": 1},
        {"t": 11.0, "event": "phase_end", "phase": "inner", "failed": {}},
        {"t": 20.0, "event": "replica_down", "rid": "c1r0", "cause": "died", "phase": "inner", "round": 2},
        {"t": 21.0, "event": "heal_end", "target": "c1r0", "seconds": 0.2, "bytes": 100},
        {"t": 22.0, "event": "phase_end", "phase": "inner", "failed": {}},
        {"t": 30.0, "event": "replica_down", "rid": "c0r1", "cause": "died", "phase": "outer", "round": 3},
    ]
    figures = fault_figures(fired, events)
    assert [(f["source"], f["rid"]) for f in figures] == [
        ("injected", "c0r1"),
        ("observed", "c1r0"),
        ("observed", "c0r1"),
    ], figures
    injected, observed, again = figures
    assert injected["detection_latency_s"] == 0.5
    assert observed["kind"] == "observed" and observed["cause"] == "died" and observed["fired_at"] is None
    assert observed["recovery_latency_s"] == 2.0 and observed["heal_s"] == 0.2
    assert again["round"] == 3, "one injected kill explains one down of its replica, not every later one"


def _down(t, rid, round_index=1, phase="inner", cause="died"):
    return {"t": t, "event": "replica_down", "rid": rid, "cause": cause, "phase": phase, "round": round_index}


def test_a_fault_explains_a_down_only_within_its_window():
    from hsgd.record.metrics import fault_figures

    fired = [{"t": 0.0, "rid": "c0r1", "kind": "crash", "phase": "inner", "round": 0, "step": 1}]
    late = fault_figures(fired, [_down(200.0, "c0r1")])
    assert [f["source"] for f in late] == ["injected", "observed"], "a down minutes after the fault is its own failure"
    soon = fault_figures(fired, [_down(100.0, "c0r1")])
    assert [f["source"] for f in soon] == ["injected"]


def test_a_fault_stamped_just_after_its_down_still_explains_it():
    """faults_fired.jsonl and events.jsonl are stamped by different processes' clocks."""
    from hsgd.record.metrics import fault_figures

    fired = [{"t": 10.4, "rid": "c1r0", "kind": "kill", "phase": "now", "round": None, "step": None}]
    assert [f["source"] for f in fault_figures(fired, [_down(10.0, "c1r0")])] == ["injected"]


def test_each_fault_explains_at_most_one_down_of_its_replica():
    from hsgd.record.metrics import fault_figures

    fired = [{"t": 1.0, "rid": "c0r0", "kind": "slow", "phase": "inner", "round": 0, "step": 0, "seconds": 30}]
    events = [
        _down(5.0, "c0r0", cause="hung"),
        {"t": 9.0, "event": "replica_up", "rid": "c0r0", "pid": 3},
        _down(20.0, "c0r0", round_index=2, phase="outer"),
    ]
    figures = fault_figures(fired, events)
    assert [(f["source"], f["detected_at"]) for f in figures] == [("injected", 5.0), ("observed", 20.0)]


def test_resolved_cluster_targets_explain_each_replica_hit():
    """A `cluster:c1` crash is recorded once per replica it hit, under that replica's id."""
    from hsgd.record.metrics import fault_figures

    fired = [
        {"t": 3.0, "rid": rid, "kind": "crash", "phase": "inner", "round": 1, "step": 0} for rid in ("c1r0", "c1r1")
    ]
    figures = fault_figures(fired, [_down(3.2, "c1r0"), _down(3.3, "c1r1")])
    assert [f["source"] for f in figures] == ["injected", "injected"]


def test_one_failure_logged_twice_is_one_observed_entry_and_a_new_one_after_a_restart_counts():
    from hsgd.record.metrics import fault_figures

    events = [
        _down(5.0, "c0r1"),
        _down(6.0, "c0r1"),  # the same failure, logged again (a restarted supervisor)
        {"t": 9.0, "event": "replica_up", "rid": "c0r1", "pid": 7},
        _down(12.0, "c0r1"),
    ]  # same round and phase, but after it came back: a second failure
    figures = fault_figures([], events)
    assert [(f["source"], f["detected_at"]) for f in figures] == [("observed", 5.0), ("observed", 12.0)]


def test_injected_and_observed_entries_have_the_same_keys():
    from hsgd.record.metrics import fault_figures

    fired = [{"t": 1.0, "rid": "c0r0", "kind": "kill", "phase": "inner", "round": 0, "step": 0}]
    injected, observed = fault_figures(fired, [_down(1.5, "c0r0"), _down(2.0, "c1r0", cause="hung")])
    assert set(injected) == set(observed)
    assert injected["detected_at"] == 1.5 and injected["cause"] == "died"
    assert observed["cause"] == "hung" and observed["detection_latency_s"] is None


def test_late_round_record_invents_nothing():
    from hsgd.record.metrics import late_round_record

    rec = late_round_record(
        round_index=4, steps_per_round=20, live_replicas=3, epoch=9, digests={"c0r0": "ab"}, eval_loss=None, t=1.0
    )
    assert rec["recovered"] is True and rec["inner_step"] == 100
    assert rec["loss"] is None and rec["tokens_per_s"] is None and rec["replica_loss"] == {}


def test_run_summary_counts_steps_of_committed_rounds_and_reports_each_replicas_digest():
    from hsgd.record.metrics import run_summary

    durable = {"committed_round": 5, "started_at": 100.0, "initial_eval_loss": 4.4, "supervisor_starts": 2, "epoch": 12}
    summary = run_summary(
        status="completed",
        reason=None,
        durable=durable,
        steps_per_round=20,
        digests={"c0r0": {"param": "p0", "global": "g"}, "c0r1": {"param": "p1", "global": "g"}},
        metrics=[{"round": 3, "eval_loss": 3.0}, {"round": 4, "eval_loss": None}],
        fired=[],
        events=[],
        not_fired=[],
        committed_steps=180,
        attempted_steps=200,
        participation=[1.0, 0.5],
        supervisor_started=150.0,
        now=160.0,
        run_dir="/r",
    )
    assert summary["inner_steps_committed"] == 100 and summary["final_eval_loss"] == 3.0
    assert summary["wall_s"] == 60.0 and summary["supervisor_wall_s"] == 10.0
    assert summary["replica_param_digests"] == {"c0r0": "p0", "c0r1": "p1"} and summary["global_param_digest"] == "g"
    assert summary["step_efficiency"] == 0.9 and summary["faults"] == [] and summary["supervisor_starts"] == 2


def test_run_summary_takes_the_global_digest_from_a_replica_at_the_committed_round():
    from hsgd.record.metrics import run_summary

    durable = {"committed_round": 5, "started_at": 0.0, "supervisor_starts": 1, "epoch": 3}
    summary = run_summary(
        status="completed",
        reason=None,
        durable=durable,
        steps_per_round=20,
        digests={
            "c0r0": {"param": "fresh", "global": "initial", "round": 0},
            "c0r1": {"param": "p", "global": "g5", "round": 5},
        },
        metrics=[],
        fired=[],
        events=[],
        not_fired=[],
        committed_steps=0,
        attempted_steps=0,
        participation=[],
        supervisor_started=0.0,
        now=1.0,
        run_dir="/r",
    )
    assert summary["global_param_digest"] == "g5"
