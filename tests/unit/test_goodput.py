"""benchmarks.fault_costs: where a fault's time went, from the run's own records."""

import pytest

from benchmarks.fault_costs import fault_costs, goodput, summarize_costs


def _events():
    return [
        {"t": 10.0, "event": "phase_begin", "phase": "inner", "cluster": 0, "replicas": ["c0r0", "c0r1"]},
        {"t": 11.5, "event": "replica_down", "rid": "c0r1", "cluster": 0, "cause": "died"},
        {"t": 11.7, "event": "phase_begin", "phase": "inner", "cluster": 0, "replicas": ["c0r0"]},
        {"t": 15.0, "event": "replica_up", "rid": "c0r1", "pid": 2},
        {"t": 16.0, "event": "heal_end", "target": "c0r1", "source": "c0r0", "scope": "full", "seconds": 0.25},
        {"t": 16.4, "event": "phase_begin", "phase": "inner", "cluster": 0, "replicas": ["c0r0", "c0r1"]},
    ]


def test_fault_cost_is_split_into_detection_replan_restart_heal_and_rejoin():
    (cost,) = fault_costs([{"t": 11.0, "rid": "c0r1", "kind": "kill"}], _events())
    assert cost["detection_s"] == 0.5
    assert cost["replan_s"] == pytest.approx(0.2)
    assert cost["restart_s"] == 3.5 and cost["heal_s"] == 0.25
    assert cost["rejoin_s"] == pytest.approx(5.4)


def test_an_undetected_fault_has_no_figures_and_supervisor_faults_are_skipped():
    costs = fault_costs(
        [{"t": 20.0, "rid": "c1r0", "kind": "kill"}, {"t": 1.0, "rid": "supervisor", "kind": "kill"}], _events()
    )
    assert len(costs) == 1 and costs[0]["detection_s"] is None and costs[0]["rejoin_s"] is None
    assert summarize_costs(costs)["detection_s"] is None


def test_goodput_is_the_fault_free_wall_time_over_the_wall_time():
    assert goodput(100.0, 125.0) == 0.8
