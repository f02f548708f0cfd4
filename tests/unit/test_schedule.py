"""Between rounds (hsgd/core/round/schedule.py): who evaluates, who writes the final model, which
rounds a restarted supervisor still owes the record."""

from __future__ import annotations

from hsgd.core.round import evaluation_order, model_writers, unrecorded_rounds
from hsgd.core.topology import Topology


def test_evaluation_asks_the_furthest_round_first_leaders_first_then_by_index():
    live = {"c0r0": (3, 0), "c0r1": (3, 0), "c1r0": (2, 0), "c1r1": (3, 0)}  # c1r0 sat out a round
    order = evaluation_order(Topology(2, 2), live, leaders={0: "c0r1", 1: "c1r1"})
    assert order == ["c0r1", "c1r1", "c0r0", "c1r0"], "a replica behind (maybe NaN params) is asked last"


def test_the_final_model_is_written_by_a_replica_at_the_furthest_round():
    live = {"c1r0": (5, 0), "c0r1": (4, 0), "c0r0": (5, 0)}
    assert model_writers(live) == ["c0r0", "c1r0"]
    assert model_writers({}) == []


def test_a_restarted_supervisor_records_only_the_committed_rounds_it_has_no_record_of():
    assert unrecorded_rounds(5, [0, 1, 3]) == [2, 4]
    assert unrecorded_rounds(3, iter([0, 1, 2])) == []
    assert unrecorded_rounds(0, []) == []
