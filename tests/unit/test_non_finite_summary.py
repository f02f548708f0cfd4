"""summary.json `faults` for non-finite numbers (issue 19, item 8): one entry per occurrence (one
`non_finite` event per cluster and round), `cause: non_finite`, injected or observed."""

from hsgd.record.metrics import fault_figures


def _nan_fired(t: float, rid: str) -> dict:
    return {"t": t, "rid": rid, "kind": "nan", "phase": "inner", "round": 1, "step": 3}


def _non_finite(t: float, rids: list[str], cluster: int = 1) -> dict:
    return {
        "t": t,
        "event": "non_finite",
        "rid": rids[0],
        "rids": rids,
        "cluster": cluster,
        "round": 1,
        "phase": "inner",
        "what": "loss",
    }


def test_a_nan_fault_is_one_injected_non_finite_entry_whoever_reported_it_first():
    events = [
        _non_finite(10.0, ["c1r1", "c1r0"]),  # ddp: every member reports; c1r1's answer came first
        {
            "t": 12.0,
            "event": "heal_end",
            "target": "c1r0",
            "source": "c0r0",
            "scope": "global",
            "seconds": 0.2,
            "bytes": 100,
        },
    ]
    figures = fault_figures([_nan_fired(9.0, "c1r0")], events)
    assert len(figures) == 1
    (f,) = figures
    assert (f["source"], f["kind"], f["cause"], f["detected_by"]) == ("injected", "nan", "non_finite", "non_finite")
    assert f["detection_latency_s"] == 1.0 and f["heal_bytes"] == 100


def test_non_finite_numbers_nobody_injected_are_an_observed_entry():
    figures = fault_figures([], [_non_finite(5.0, ["c0r0"], cluster=0)])
    assert [(f["source"], f["cause"], f["rid"], f["detected_by"]) for f in figures] == [
        ("observed", "non_finite", "c0r0", "non_finite")
    ]


def test_a_nan_fault_explains_no_down_and_no_other_clusters_non_finite():
    down = {
        "t": 11.0,
        "event": "replica_down",
        "rid": "c1r0",
        "cluster": 1,
        "cause": "died",
        "round": 1,
        "phase": "inner",
    }
    figures = fault_figures([_nan_fired(9.0, "c1r0")], [_non_finite(10.0, ["c0r0"], cluster=0), down])
    by_source = sorted((f["source"], f["cause"], f["rid"]) for f in figures)
    assert by_source == [("injected", None, "c1r0"), ("observed", "died", "c1r0"), ("observed", "non_finite", "c0r0")]
