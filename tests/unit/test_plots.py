"""Run pictures: the data they are drawn from (synthetic run dirs, no Ray), and that they get written."""

import json

import pytest

from hsgd.record.plots import (
    loss_plot_data,
    membership_data,
    timeline_data,
    write_loss_png,
    write_membership_png,
    write_run_plots,
    write_timeline_png,
)
from tests.fakes.runs import LEADERS, RIDS, T0, _write_jsonl, make_run  # noqa: F401


def _kinds(spans):
    return {k for _, _, k in spans}


def test_timeline_spans_per_replica(tmp_path):
    data = timeline_data(make_run(tmp_path / "run"))
    assert data["replicas"] == RIDS
    for rid in RIDS:
        assert {"inner", "inner_sync", "outer_commit", "checkpoint"} <= _kinds(data["spans"][rid]), rid
    assert "outer" in _kinds(data["spans"]["c0r0"]) and "outer" not in _kinds(data["spans"]["c0r1"])
    for spans in data["spans"].values():
        assert all(0 <= s <= e <= data["end"] for s, e, _ in spans)
    # the first inner phase of round 0 runs 0.1 .. 0.6 s after the run's first event
    assert (pytest.approx(0.1), pytest.approx(0.6), "inner") in data["spans"]["c1r1"]


def test_timeline_down_heal_fault_and_recovery(tmp_path):
    data = timeline_data(make_run(tmp_path / "run"))
    down = [(s, e) for s, e, k in data["spans"]["c0r1"] if k == "down"]
    assert down == [(pytest.approx(5.0), pytest.approx(8.0))], "down from the fault (earlier than replica_down)"
    assert [(s, e) for s, e, k in data["spans"]["c0r1"] if k == "heal"] == [(pytest.approx(8.0), pytest.approx(8.3))]
    assert not any(k == "down" for rid in ("c0r0", "c1r0", "c1r1") for _, _, k in data["spans"][rid])
    # after its failed inner phase (4.95-5.2) c0r1 is in no phase until it is back
    assert not any(k not in ("down", "heal") and s < 8.0 and e > 5.21 for s, e, k in data["spans"]["c0r1"])
    assert data["faults"] == [(pytest.approx(5.0), "c0r1", "kill")]
    assert data["recoveries"] == [(pytest.approx(5.0), pytest.approx(5.9))]


def test_timeline_down_from_replica_down_without_fault_record(tmp_path):
    run = make_run(tmp_path / "run", summary=False)
    (run / "faults_fired.jsonl").unlink()
    data = timeline_data(run)
    assert [(s, e) for s, e, k in data["spans"]["c0r1"] if k == "down"] == [(pytest.approx(5.2), pytest.approx(8.0))]
    assert data["faults"] == [] and data["recoveries"] == []


def test_recoveries_computed_when_summary_missing(tmp_path):
    data = timeline_data(make_run(tmp_path / "run", status=None))
    assert len(data["recoveries"]) == 1 and data["recoveries"][0][0] == pytest.approx(5.0)
    assert data["recoveries"][0][1] > 5.2


def test_membership_dips_and_returns(tmp_path):
    data = membership_data(make_run(tmp_path / "run"))
    assert set(data["clusters"]) == {"c0", "c1"} and data["size"] == {"c0": 2, "c1": 2}
    c0 = data["clusters"]["c0"]
    assert [n for _, n in c0] == [0, 2, 1, 2, 2]
    assert c0[2][0] == pytest.approx(5.2) and c0[3][0] == pytest.approx(8.0)
    assert [n for _, n in data["clusters"]["c1"]] == [0, 2, 2]
    assert [e for _, e in data["epochs"]] == [1, 2, 3]


def test_unfinished_run_closes_open_spans_and_down(tmp_path):
    run = make_run(tmp_path / "run", status=None, rounds=7)  # still going: c0r1 down, no run_end
    data = timeline_data(run)
    down = [(s, e) for s, e, k in data["spans"]["c0r1"] if k == "down"]
    assert down == [(pytest.approx(5.0), pytest.approx(data["end"]))]
    assert [n for _, n in membership_data(run)["clusters"]["c0"]][-1] == 1


def test_loss_plot_data_marks_fault(tmp_path):
    data = loss_plot_data(make_run(tmp_path / "run"))
    assert data["faults"] == [(5 * 4 + 2, "kill c0r1")]
    assert len(data["replica_loss"]["c0r1"]) == 9 and len(data["replica_loss"]["c0r0"]) == 12
    assert [s for s, _ in data["eval_loss"]] == [12, 24, 36, 48]


@pytest.mark.parametrize("kind", ["faulty", "no_faults", "no_metrics", "failed", "empty"])
def test_pngs_written(tmp_path, kind):
    run = tmp_path / kind
    if kind == "empty":
        run.mkdir()
    else:
        make_run(
            run,
            faults=kind != "no_faults",
            metrics=kind != "no_metrics",
            status="failed" if kind == "failed" else "completed",
            rounds=6 if kind == "failed" else 12,
        )
    paths = write_run_plots(run)
    assert [p.name for p in paths] == ["loss.png", "timeline.png", "membership.png"]
    for p in paths:
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if kind != "empty":
            assert p.stat().st_size > 5_000, p
    assert not list(run.glob(".*.tmp.png")), "temp files renamed away"


def test_single_writers(tmp_path):
    run = make_run(tmp_path / "run")
    assert write_loss_png(run).name == "loss.png"
    assert write_timeline_png(run).name == "timeline.png"
    assert write_membership_png(run).name == "membership.png"


def _two_cluster_events(run_dir, rounds=3):
    """events.jsonl as the round runner writes it for 2 clusters x 2 replicas: each cluster's own
    phases carry `cluster` and overlap the other cluster's (c1 begins its inner phase 0.05 s after
    c0 and ends 0.1 s after it); the outer level's phase carries cluster None. Fields checked
    against the event schema, so the fixture stays what a run writes."""
    from hsgd.record.events import check_event

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("topology:\n  clusters: 2\n  replicas_per_cluster: 2\n")
    ev, ends = [], []

    def event(t, name, **fields):
        check_event(name, fields)
        ev.append({"t": T0 + t, "event": name, **fields})

    members = {0: ["c0r0", "c0r1"], 1: ["c1r0", "c1r1"]}
    event(0.0, "supervisor_start", starts=1, pid=1)
    for r in range(rounds):
        base = r * 2.0
        for c, (begin, end) in {0: (0.1, 1.7), 1: (0.15, 1.8)}.items():
            event(base + begin, "phase_begin", phase="inner", round=r, cluster=c, epoch=1, replicas=members[c])
            ends.append((c, base + end, end - begin))
        for c, at, seconds in sorted(ends, key=lambda x: x[1]):
            event(at, "phase_end", phase="inner", round=r, cluster=c, seconds=seconds, ok=members[c], failed={})
        ends.clear()
        event(base + 1.85, "phase_begin", phase="outer", round=r, cluster=None, epoch=1, replicas=["c0r0", "c1r0"])
        event(
            base + 1.9, "phase_end", phase="outer", round=r, cluster=None, seconds=0.05, ok=["c0r0", "c1r0"], failed={}
        )
        for c in (0, 1):
            event(
                base + 1.9 + 0.01 * c,
                "phase_begin",
                phase="outer_commit",
                round=r,
                cluster=c,
                epoch=1,
                replicas=members[c],
            )
        for c in (0, 1):
            event(
                base + 1.95 + 0.01 * c,
                "phase_end",
                phase="outer_commit",
                round=r,
                cluster=c,
                seconds=0.05,
                ok=members[c],
                failed={},
            )
    _write_jsonl(run_dir / "events.jsonl", sorted(ev, key=lambda e: e["t"]))
    return run_dir, ev


def test_timeline_spans_are_each_clusters_own(tmp_path):
    """Two clusters' inner phases overlap: each replica's inner spans last what its own cluster's
    phase_end says (c1's phase_begin never ends c0's span)."""
    run, ev = _two_cluster_events(tmp_path / "run")
    data = timeline_data(run)
    for c in (0, 1):
        said = [e["seconds"] for e in ev if e["event"] == "phase_end" and e["phase"] == "inner" and e["cluster"] == c]
        for rid in (f"c{c}r0", f"c{c}r1"):
            drawn = [stop - start for start, stop, kind in data["spans"][rid] if kind == "inner"]
            assert drawn == pytest.approx(said), rid
        assert len([1 for _, _, k in data["spans"][f"c{c}r0"] if k == "outer_commit"]) == 3
    assert [k for _, _, k in data["spans"]["c0r1"]].count("outer") == 0
    assert [k for _, _, k in data["spans"]["c1r0"]].count("outer") == 3


def test_membership_shows_a_drained_site_leaving_and_every_site_change(tmp_path):
    run = make_run(tmp_path / "run")
    with open(run / "events.jsonl", "a", encoding="utf-8") as fh:  # c1 drained at +9s; a refusal is no change
        for t, kind, cluster, outcome in ((9.0, "drain", "c1", "applied"), (9.5, "add-site", "", "refused")):
            fh.write(
                json.dumps(
                    {
                        "t": T0 + t,
                        "event": "site_request",
                        "id": f"r{t}",
                        "kind": kind,
                        "cluster": cluster,
                        "outcome": outcome,
                        "reason": "x",
                        "round": 4,
                    }
                )
                + "\n"
            )
    data = membership_data(run)
    assert data["sites"] == [(pytest.approx(9.0), "drain", "c1")]
    c1 = data["clusters"]["c1"]
    assert [n for _, n in c1] == [0, 2, 0, 0] and c1[2][0] == pytest.approx(9.0)
    assert [n for _, n in data["clusters"]["c0"]] == [0, 2, 1, 2, 2], "the other site is unchanged"
    assert write_membership_png(run).stat().st_size > 0
