"""The peer suites' shared parts that need no process: the failure process both sides of `goodput`
share, the recovery ratios, and BENCHMARKS.md from the suites' JSONs."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.cli import main as bench
from benchmarks.goodput import failure_process
from benchmarks.recovery import ratios
from benchmarks.report import OPTIONAL, SUITES, newest_reports, portable, render

REPO = Path(__file__).resolve().parents[2]


def test_the_failure_process_is_one_seeded_draw_within_the_span():
    a = failure_process(10.0, 200.0, 3, seed=1)
    assert a == failure_process(10.0, 200.0, 3, seed=1)
    assert a != failure_process(10.0, 200.0, 3, seed=2)
    assert all(3.0 < t < 200.0 and 0 <= victim < 3 for t, victim in a)
    assert [t for t, _ in a] == sorted(t for t, _ in a)
    assert 8 <= len(a) <= 35  # ~ (200 - 3) / 10 failures
    assert failure_process(1000.0, 5.0, 3, seed=1) == []


def test_recovery_ratios_are_hsgd_over_each_peer_and_none_without_a_figure():
    sides = {
        "hsgd_1x3": {"recovery": {"survivors_stall_median_s": 0.5, "rejoin_s": 4.0}},
        "torchft_fast": {"recovery": {"survivors_stall_median_s": 0.25, "rejoin_s": None}},
    }
    assert ratios(sides) == {"hsgd_1x3 / torchft_fast stall": 2.0, "hsgd_1x3 / torchft_fast rejoin": None}


def _report(suite, date, quick=False, **figures):
    return {
        "suite": suite,
        "date": date,
        "quick": quick,
        "command": f"python -m benchmarks {suite}",
        "machine": {"platform": "Linux", "cpus": 2, "gpu": None, "torch": "2.13.0", "python": "3.11"},
        **figures,
    }


def test_the_newest_full_report_of_each_suite_is_rendered_under_a_header_with_its_date_machine_and_command(tmp_path):
    old = _report(
        "straggler",
        "2026-01-01T00:00:00Z",
        steps=40,
        arms=[{"name": "flat_ddp", "wall_s": 20.0, "speedup_vs_flat": 1.0}],
    )
    new = _report(
        "straggler",
        "2026-02-01T00:00:00Z",
        steps=400,
        arms=[
            {"name": "flat_ddp", "wall_s": 50.0, "speedup_vs_flat": 1.0},
            {"name": "diloco", "wall_s": 25.0, "speedup_vs_flat": 2.0},
        ],
    )
    new["command"] = "python -m benchmarks straggler --out /somewhere/else/straggler --steps 400"
    quick = _report("straggler", "2026-03-01T00:00:00Z", quick=True, steps=4, arms=[])
    for i, r in enumerate((old, new, quick)):
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "straggler.json").write_text(json.dumps(r))
    (tmp_path / "r1" / "straggler.png").write_bytes(b"png")
    (tmp_path / "r0" / "notes.json").write_text("[1, 2]")  # not a suite's report: ignored
    reports = newest_reports([tmp_path])
    assert set(reports) == {"straggler"} and reports["straggler"]["date"] == new["date"]
    text = render(reports, tmp_path)
    assert (
        "- Date: 2026-02-01T00:00:00Z\n- Machine: Linux, 2 CPUs, no GPU, torch 2.13.0\n"
        "- Command: `python -m benchmarks straggler --steps 400`\n"
    ) in text  # --out (a machine's path) dropped
    assert (
        "| diloco: time to 400 steps | 25.0 s | speed-up vs flat 2.00× |\n" in text
    )  # no date/machine/command columns
    assert "![straggler](r1/straggler.png)" in text  # the plot beside the JSON, relative to the file written
    assert "/somewhere" not in text
    assert "Not measured yet: `python -m benchmarks recovery`." in text


def test_a_recorded_out_argument_is_dropped_from_the_command_shown():
    assert (
        portable("python -m jobs.bench overhead --out /work/main/bench-results/overhead")
        == "python -m jobs.bench overhead"
    )
    assert portable("python -m benchmarks scale --out=/tmp/x --quick") == "python -m benchmarks scale --quick"
    assert portable("python -m benchmarks ddp --out '/a b/c' --steps 3") == "python -m benchmarks ddp --steps 3"
    assert portable("python -m benchmarks straggler --p 0.1") == "python -m benchmarks straggler --p 0.1"


def test_benchmarks_md_renders_each_committed_suite_with_its_command_its_plot_and_never_a_newer_quick_run(tmp_path):
    """The suites' own JSONs (benchmarks/, written by full runs), each beside a quick run of the same
    suite dated later: BENCHMARKS.md renders the full one of every suite, with its command (no
    absolute path) and its PNG."""
    committed = {p.stem: json.loads(p.read_text()) for p in sorted((REPO / "benchmarks").glob("*.json"))}
    assert set(SUITES) <= set(committed) <= set(SUITES) | set(OPTIONAL)  # an optional suite once measured
    assert not any(r["quick"] for r in committed.values())
    for suite, report in committed.items():
        (tmp_path / "quick" / suite).mkdir(parents=True)
        quick = {
            **report,
            "quick": True,
            "date": "2999-01-01T00:00:00Z",
            "command": f"python -m benchmarks {suite} --quick",
        }
        (tmp_path / "quick" / suite / f"{suite}.json").write_text(json.dumps(quick))
    target = tmp_path / "BENCHMARKS.md"
    assert bench(["report", "--from", str(REPO / "benchmarks"), str(tmp_path / "quick"), "--to", str(target)]) == 0
    text = target.read_text()
    for suite, report in committed.items():
        assert f"- Command: `{portable(report['command'])}`" in text, suite
        assert f"- Date: {report['date']}" in text, suite
        assert f"![{suite}](" in text and (REPO / "benchmarks" / f"{suite}.png").is_file(), suite
    assert "--quick" not in text and "2999" not in text and "Not measured yet" not in text
    assert "--out" not in text and "bench-results" not in text  # the recorded commands' absolute --out paths


def test_the_committed_benchmarks_md_is_the_render_of_the_committed_jsons():
    """BENCHMARKS.md at the root is what `python -m benchmarks report --from benchmarks` writes:
    every suite's plot embedded as benchmarks/<suite>.png, and no absolute path."""
    text = (REPO / "BENCHMARKS.md").read_text()
    assert text == render(newest_reports([REPO / "benchmarks"]), REPO)
    for suite in SUITES:
        assert f"![{suite}](benchmarks/{suite}.png)" in text
    assert "/work/" not in text and "--out" not in text


def test_every_suite_takes_quick_the_report_too(tmp_path):
    assert bench(["report", "--quick", "--from", str(REPO / "benchmarks"), "--to", str(tmp_path / "B.md")]) == 0
    assert (tmp_path / "B.md").read_text() == render(newest_reports([REPO / "benchmarks"]), tmp_path)


def test_recovery_renders_hsgd_detection_the_way_back_per_stage_and_the_spare_side(tmp_path):
    """A synthetic recovery.json: hsgd's sides carry detect_s and restart_breakdown (a peer's do not);
    the spare side's rejoin is held against its 2-s target."""
    spare = {
        "name": "hsgd_1x3_spare",
        "step_time_s": 0.25,
        "recovery": {"survivors_stall_median_s": 0.9, "rejoin_s": 1.74},
        "detect_s": {"median": 0.59, "p95": 0.6, "each": [0.594, 0.6, 0.576]},
        "restart_breakdown": {"promote": 0.606, "wait_heal": 0.512, "heal": 0.335, "first_step": 0.303},
    }
    slow = {**spare, "name": "hsgd_1x3_spare", "recovery": {"survivors_stall_median_s": 0.9, "rejoin_s": 2.76}}
    peer = {
        "name": "torchft_readme",
        "step_time_s": 0.25,
        "recovery": {"survivors_stall_median_s": 1.0, "rejoin_s": 5.1},
    }
    report = _report(
        "recovery", "2026-11-27T00:00:00Z", sides=[spare, peer], ratios={}, json_path=str(tmp_path / "recovery.json")
    )
    text = render({"recovery": report})
    assert (
        "| hsgd_1x3_spare: survivors' stall (median) / killed replica's rejoin | 0.90 s / 1.74 s | "
        "step 0.25 s; one hot spare: target rejoin ≤ 2 s holds |" in text
    )
    assert "| hsgd_1x3_spare: SIGKILL to `replica_down` (median / p95) | 0.59 s / 0.60 s | 3 kills |" in text
    assert (
        "| hsgd_1x3_spare: the way back, median of each stage | promote 0.61 s, wait_heal 0.51 s, heal 0.34 s, "
        "first_step 0.30 s | in order; `promote` from the kill |" in text
    )
    assert "torchft_readme: SIGKILL" not in text and "torchft_readme: the way back" not in text
    assert "target rejoin ≤ 2 s does not hold" in render({"recovery": {**report, "sides": [slow]}})


def _convergence(date="2026-11-27T00:00:00Z", quick=False):
    def row(arm, at, loss, gap, best_gap, ratio, meets, meets_best, rates=3, what="DiLoCo every 50, fp32"):
        return {
            "arm": arm,
            "what": what,
            "at": at,
            "status": "completed",
            "final_eval_loss": loss,
            "gap": gap,
            "gap_vs_best_flat": best_gap,
            "flat_rates": rates,
            "bytes_ratio_vs_flat": ratio,
            "meets_target": meets,
            "meets_target_vs_best_flat": meets_best,
        }

    rates = [
        {"arm": "flat_ddp", "inner_lr": 3e-3, "final_eval_loss": 1.65},
        {"arm": "flat_ddp_lr6e-3", "inner_lr": 6e-3, "final_eval_loss": 1.62},
    ]
    return _report(
        "convergence",
        date,
        quick=quick,
        target={"bytes_ratio_vs_flat": 500.0, "gap": 0.02},
        rows=[
            row("flat_ddp", "bench", 1.65, 0.0, 0.0185, 1.0, False, False, what="1 cluster x 4"),
            row("diloco_h50", "bench", 1.678, 0.017, 0.0358, 1563.0, True, False),
            row("diloco_h50@defaults", "defaults", 1.70, 0.03, 0.03, 1563.0, False, False, rates=1),
        ],
        flat_best={
            "bench": {"arm": "flat_ddp_lr6e-3", "inner_lr": 6e-3, "final_eval_loss": 1.62, "rates": rates},
            "defaults": {"arm": "flat_ddp@defaults", "inner_lr": 3e-3, "final_eval_loss": 1.65, "rates": rates[:1]},
        },
        peer_comparison={
            "50": {
                "hsgd_arm": "diloco_h50",
                "torchft_arm": "torchft_diloco_h50",
                "hsgd_eval_loss": 1.678,
                "torchft_eval_loss": 1.7,
                "ratio": 0.987,
            }
        },
        plots=["convergence.png", "convergence_curves.png"],
    )


def test_convergence_renders_its_table_best_flat_rate_peer_ratio_and_both_plots_once_measured(tmp_path):
    """A synthetic convergence.json (benchmarks/convergence.py): a row per arm with its gap against
    flat DDP at its own rate and at the best one, flat DDP's best rate, the torchft ratio, both plots."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "convergence.json").write_text(json.dumps(_convergence()))
    for name in ("convergence.png", "convergence_curves.png"):
        (tmp_path / "full" / name).write_bytes(b"png")
    (tmp_path / "quick").mkdir()  # a later quick run is never rendered
    (tmp_path / "quick" / "convergence.json").write_text(json.dumps(_convergence("2999-01-01T00:00:00Z", quick=True)))
    reports = newest_reports([tmp_path])
    assert reports["convergence"]["date"] == "2026-11-27T00:00:00Z"
    text = render(reports, tmp_path)
    section = text[text.index("## Convergence") :]
    assert "(`convergence`)" in section.splitlines()[0]
    assert (
        "| `diloco_h50`: eval loss / gap vs flat DDP (its rate / best rate) / flat ÷ arm slow-link bytes | "
        "1.6780 / +1.70 % / +3.58 % / 1,563.0× | DiLoCo every 50, fp32; target (≥ 500×, ≤ 2 %): yes / no |" in section
    )
    assert (
        "| `diloco_h50@defaults`: eval loss / gap vs flat DDP (its rate) / flat ÷ arm slow-link bytes | "
        "1.7000 / +3.00 % / 1,563.0× |" in section
    )  # no sweep at the defaults: one gap
    assert (
        "| flat DDP's best inner rate (bench) | lr 0.006: 1.6200 (`flat_ddp_lr6e-3`) | "
        "tried lr 0.003: 1.6500, lr 0.006: 1.6200 |" in section
    )
    assert "flat DDP's best inner rate (defaults)" not in section  # one rate tried: nothing to choose
    assert (
        "| hsgd DiLoCo / torchft DiLoCo eval loss, H=50 | 0.9870 | `diloco_h50` 1.6780 / `torchft_diloco_h50` "
        "1.7000 (< 1: hsgd ends lower) |" in section
    )
    assert (
        "![convergence](full/convergence.png)" in section and "![convergence](full/convergence_curves.png)" in section
    )
    assert "2999" not in text


def test_convergence_gets_no_section_until_measured():
    text = render({})
    assert "convergence" not in text.lower()
    assert all(f"Not measured yet: `python -m benchmarks {suite}`." in text for suite in SUITES)
