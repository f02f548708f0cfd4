"""`python -m benchmarks plan`: the round machine and its runner driven together, as the supervisor
drives them, against the fake Ray of benchmarks/fake_ray.py — at a quick size (4 clusters x 3 replicas,
2 rounds a case). Timings are never checked here; what is: plan.json's schema, that the machine and
the runner both ran every case (every round committed with agreeing digests; the failures armed
happened and took their paths), and that the runner's `ray` is the real one again afterwards."""

from __future__ import annotations

import json

import ray

import actors.heals
import actors.round_runner
from benchmarks.plan import main

STATS = {"mean", "max"}
CASES = {"first_round", "fault_free", "few_failures"}


def test_plan_bench_drives_the_machine_and_its_runner_through_every_case(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plan.json").read_text())

    assert (report["suite"], report["replicas"], report["clusters"]) == ("plan", 12, 4)
    assert report["budget_ms_per_round"] == 600.0
    assert set(report["per_round_ms"]) == {"machine_plus_runner", "machine", "machine_one_call_per_answer"}
    for figure in report["per_round_ms"].values():
        assert set(figure) == STATS and all(v > 0 for v in figure.values())
    assert set(report["cases"]) == CASES
    for case in report["cases"].values():
        for key in ("machine_plus_runner_ms", "machine_ms", "runner_ms", "machine_one_call_per_answer_ms"):
            assert set(case[key]) == STATS, key
    assert report["while_training"]["ticks"] > 1, "the round that trains was ticked while its calls ran"
    assert report["reference_ms"] > 0

    rounds = report["rounds"]
    assert [r["case"] for r in rounds] == ["first_round"] + ["fault_free"] * 2 + ["few_failures"] * 2 + [
        "while_training"
    ]
    assert [r["round"] for r in rounds] == list(range(6)), "each round starts where the last one committed"
    checks = report["checks"]
    assert checks["committed"] == checks["rounds"] == 6 and checks["digests_agree"]
    for r in rounds:  # the machine took every answer, the runner carried out every phase
        assert r["outcome"] == "committed" and r["digests_agree"]
        assert r["machine_ms"] > 0 and r["observations"] >= r["phase_calls"] > 0

    events, calls = checks["events"], checks["fake_calls"]
    assert events["commit_decision"] == 6
    assert events["phase_begin"] == events["phase_end"] > 6 * 3
    for method in ("run_inner", "outer_reduce", "outer_commit", "progress", "send_state", "receive_state"):
        assert calls[method] > 0, f"the runner never called {method}"
    assert checks["waits_fetching_local"] == 0, "the runner waited with fetch_local=True"
    assert {"actors.round_runner", "actors.heals"} <= set(checks["ray_patched_in"])

    # the failures happened and took their paths
    assert {"die", "die_held", "collective"} <= set(checks["failures_fired"])
    failing = [r for r in rounds if r["case"] == "few_failures"]
    deaths = sum(r["deaths"] for r in rounds)
    assert deaths == sum(r["deaths"] for r in failing) > 0
    assert events["replica_down"] == deaths, "each death logged once (from the call, or from the actor table)"
    assert events["replica_up"] == deaths, "every dead replica came back"
    assert events["heal_end"] == deaths, "and healed at the next round's start"
    assert events["join_aborted"] >= 1, "a member dying as its group formed released its peers"
    assert events["collective_failed"] > 0 and events["cluster_reform"] > 0
    assert all(r["phase_calls"] > rounds[1]["phase_calls"] for r in failing), "failed calls were issued again"

    assert actors.round_runner.ray is ray and actors.heals.ray is ray, "the fake Ray was left patched in"
