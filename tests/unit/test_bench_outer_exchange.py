"""benchmarks/outer_exchange.py's figures from its rows (no training): the growth of a site's bytes
with the sites under each exchange and `auto`, Acceptance 1's ratios and Acceptance 2's gaps, and the
rows BENCHMARKS.md shows; plus one bytes job through the sweep tool."""

from __future__ import annotations

import json

from benchmarks.outer_exchange import bytes_row, exchanges_of, summarize
from benchmarks.report import ROWS


def _row(sites: int, codec: str, exchange: str, per_site: float) -> dict:
    return {
        "sites": sites,
        "codec": codec,
        "exchange": exchange,
        "bytes_per_site": per_site,
        "messages": sites,
        "link_s": [0.1, 0.2],
    }


def _report() -> dict:
    payload = 1000.0
    rows = []
    for codec in ("int8", "int4"):
        for n in (2, 4, 8):
            rows.append(_row(n, codec, "gather", 2 * (n - 1) * payload))
            rows.append(_row(n, codec, "reduce_scatter", 4 * (n - 1) / n * payload + 1))
    loss = [
        {"sites": 4, "steps": 100, "exchange": "gather", "final_eval_loss": 2.0},
        {"sites": 4, "steps": 100, "exchange": "reduce_scatter", "final_eval_loss": 2.004},
    ]
    return {"bytes": rows, "loss": loss, "reencoding": [], "links": [{"gbps": 1.0, "latency_ms": 50.0}] * 2}


def test_auto_gathers_at_two_sites_and_reduce_scatters_from_three_in_the_growth_figures():
    report = _report()
    summarize(report)
    assert report["growth"]["int4"]["gather"] == {"4": 3.0, "8": 7.0}
    auto = report["growth"]["int4"]["auto"]
    assert abs(auto["4"] - 3001 / 2000) < 1e-9 and abs(auto["8"] - 3501 / 2000) < 1e-9
    assert report["acceptance_1"]["int8"]["8"]["holds"] and report["acceptance_1"]["int4"]["4"]["holds"]
    assert report["loss_gaps"]["4"]["holds"] and abs(report["loss_gaps"]["4"]["gap"] - 0.002) < 1e-9
    assert exchanges_of("none") == ("allreduce",) and exchanges_of("topk") == ("gather",)


def test_the_report_rows_render_from_the_written_json():
    report = _report()
    summarize(report)
    rows = ROWS["outer_exchange"](json.loads(json.dumps(report)))  # as BENCHMARKS.md reads it back
    text = "\n".join(" | ".join(r) for r in rows)
    assert "`int4` reduce_scatter" in text and "8: 1.75x" in text and "gap +0.20 %" in text, text


def test_a_bytes_job_counts_what_the_trainers_exchange_move():
    row = bytes_row(3, "int8", "reduce_scatter", 1, [(1.0, 50.0)])
    assert row["exchange"] == "reduce_scatter" and row["messages"] == 3
    assert row["sent_per_site"] > 0 and row["bytes_per_site"] >= row["sent_per_site"] + row["received_per_site"] - 1
    assert row["link_s"][0] >= 0.15, "three sequential messages at 50 ms each"
