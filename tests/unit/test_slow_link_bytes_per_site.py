"""Slow-link bytes per site (issue 47, Build 3): the round's record adds each holder's bytes sent +
received to its cluster, every attempt's, and keeps the exchange of the round's last outer reduce;
metrics.jsonl's `cluster_link_bytes` and `outer_exchange` and summary.json's `link_bytes_per_cluster`
are made from them; jobs.status shows each cluster's total."""

from __future__ import annotations

import json

from actors.round_record import RoundRecord
from hsgd.core.round import CallKind, Outcome, Phase, PhaseAnswer
from hsgd.record.metrics import fallback_summary, link_bytes_per_cluster, round_record


def _reduce(phase_id: int, answers: dict[str, dict]) -> tuple[Phase, list[PhaseAnswer]]:
    phase = Phase(id=phase_id, kind=CallKind.OUTER_REDUCE, round=0, cluster=None, epoch=phase_id, calls={})
    return phase, [PhaseAnswer(rid=rid, outcome=Outcome.DONE, result=value) for rid, value in answers.items()]


def _answer(link: int, exchange: str) -> dict:
    return {"outer_bytes": link // 2, "outer_link_bytes": link, "outer_exchange": exchange, "outer_link_s": 0.1}


def test_each_holders_bytes_both_ways_count_for_its_cluster_in_every_attempt():
    record = RoundRecord(0, log=None, clock=None)
    failed, answers = _reduce(1, {"c0r0": _answer(100, "gather"), "c1r0": _answer(100, "gather")})
    for a in answers:
        record.answered(failed, a)
    record.answered(failed, PhaseAnswer(rid="c2r0", outcome=Outcome.DIED))  # a death counts no bytes
    retried, answers = _reduce(
        2,
        {
            "c0r0": _answer(60, "reduce_scatter"),
            "c0r1": _answer(40, "reduce_scatter"),  # the sharded path: a cluster's second holder
            "c2r0": _answer(60, "reduce_scatter"),
        },
    )
    for a in answers:
        record.answered(retried, a)
    assert record.cluster_link_bytes == {0: 200, 1: 100, 2: 60}
    assert record.outer_exchange == "reduce_scatter", "the exchange of the round's last outer reduce"
    line = round_record(
        record, steps_per_round=5, eval_loss=None, epoch=2, t=0.0, cluster_steps=[5, 5, 5, 5], cluster_tokens=[0] * 4
    )
    assert line["cluster_link_bytes"] == [200, 100, 60, 0] and line["outer_exchange"] == "reduce_scatter"
    assert line["outer_bytes"] == 180, "outer_bytes keeps its meaning: bytes sent"
    json.dumps(line)


def test_a_round_without_an_outer_reduce_names_no_exchange():
    record = RoundRecord(0, log=None, clock=None)
    line = round_record(
        record, steps_per_round=5, eval_loss=None, epoch=1, t=0.0, cluster_steps=[5], cluster_tokens=[0]
    )
    assert line["outer_exchange"] is None and line["cluster_link_bytes"] == [0]


def test_the_runs_bytes_per_cluster_sum_the_rounds_and_a_later_site_has_fewer_rounds():
    metrics = [
        {"cluster_link_bytes": [10, 20]},
        {"cluster_link_bytes": []},  # a round recorded late: nothing known
        {"round": 2},  # a record from before the field existed
        {"cluster_link_bytes": [1, 2, 3]},  # a site added at round 3
    ]
    assert link_bytes_per_cluster(metrics) == [11, 22, 3]
    summary = fallback_summary(
        status="completed", reason=None, durable={}, metrics=metrics, steps_per_round=5, now=0.0, run_dir="x"
    )
    assert summary["link_bytes_per_cluster"] == [11, 22, 3]


def test_jobs_status_shows_each_clusters_slow_link_bytes(tmp_path):
    from rich.console import Console

    from jobs.status import collect_state, render
    from tests.fakes.runs import make_run

    run = make_run(tmp_path / "run")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        m["cluster_link_bytes"] = [1_500_000, 2_500_000]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    state = collect_state(run)
    assert state["link_bytes"] == [1_500_000 * len(lines), 2_500_000 * len(lines)]
    console = Console(record=True, width=160)
    console.print(render(state))
    text = console.export_text()
    assert f"{1.5 * len(lines):.1f} MB" in text and f"{2.5 * len(lines):.1f} MB" in text, text
