"""The figures a run reports (metrics.jsonl records, efficiencies) are computed correctly."""
import math

from hsgd.record.metrics import efficiencies, round_record


def test_round_record_means_losses_and_derives_throughput():
    rec = round_record(round_index=2, steps_per_round=5, losses={"c0r0": [2.0, 4.0], "c0r1": [3.0], "c1r0": []},
                       tokens=1000, inner_bytes=10, outer_bytes=4, phase_s={"inner": 2.0, "outer": 0.5},
                       eval_loss=2.5, live_replicas=3, epoch=4, attempts=2, digests={"c0r0": "a"},
                       global_digests={"c0r0": "g"}, t=1.0)
    assert rec["round"] == 2 and rec["inner_step"] == 15
    assert math.isclose(rec["loss"], 3.0)
    assert rec["replica_loss"] == {"c0r0": 3.0, "c0r1": 3.0}, "replicas with no committed step are left out"
    assert rec["tokens_per_s"] == 500.0
    assert rec["attempts"] == 2 and rec["epoch"] == 4 and rec["live_replicas"] == 3


def test_round_record_without_steps_or_time_has_no_loss_or_throughput():
    rec = round_record(round_index=0, steps_per_round=5, losses={}, tokens=0, inner_bytes=0, outer_bytes=0,
                       phase_s={}, eval_loss=None, live_replicas=4, epoch=1, attempts=1, digests={},
                       global_digests={}, t=0.0)
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
    assert [(f["source"], f["rid"]) for f in figures] == [("injected", "c0r1"), ("observed", "c1r0"),
                                                          ("observed", "c0r1")], figures
    injected, observed, again = figures
    assert injected["detection_latency_s"] == 0.5
    assert observed["kind"] == "observed" and observed["cause"] == "died" and observed["fired_at"] is None
    assert observed["recovery_latency_s"] == 2.0 and observed["heal_s"] == 0.2
    assert again["round"] == 3, "one injected kill explains one down of its replica, not every later one"
