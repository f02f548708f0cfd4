"""`python -m benchmarks scale --quick`: the supervisor's decisions at two simulated sizes (through
`python -m benchmarks plan`'s measurement) and the Ray control plane at 4 and 8 real lightweight replica
actors (a local Ray, started and shut down by the suite). Timings are never checked here; what is:
scale.json's schema, that every size of both sides ran with positive figures and committed every
round with agreeing digests, that the Ray side's round after a restart healed over real actors,
that both sides were fitted and extrapolated, and that scale.png was written. Part 3 (rounds whose
inner phase lasts 2 s, issue 36): the JSON's shape, and that the actors' own counts are consistent —
one run_inner per replica in each fault-free round; by calls, progress calls in the lasting round
and all the extra calls progress calls; with the progress board, steps written to the store and no
progress call for them — never its timings or whether the issue's targets hold."""

from __future__ import annotations

import json
import math

import ray

from benchmarks.scale import QUICK_DECISION_SIZES, QUICK_INNER_S, QUICK_RAY_SIZES, main

MS = ("machine_ms", "runner_ms", "machine_plus_runner_ms")
FIT = {"growth_exponent", "coefficient_ms", "r2", "sizes"}


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_scale_quick_measures_decisions_and_the_ray_control_plane_at_every_size(tmp_path):
    ray_was_up = ray.is_initialized()  # the test session's shared Ray, when it runs with the other integration tests
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())

    assert (report["suite"], report["quick"], report["budget_ms"]) == ("scale", True, 600.0)
    assert isinstance(report["date"], str) and report["command"].startswith("python -m benchmarks scale --quick")
    assert report["machine"]["cpus"] >= 1 and report["machine"]["platform"]

    decisions = report["decisions"]
    assert [(d["clusters"], d["replicas_per_cluster"]) for d in decisions] == list(QUICK_DECISION_SIZES)
    for d in decisions:
        assert d["replicas"] == d["clusters"] * d["replicas_per_cluster"]
        for case in ("first_round", "fault_free", "with_failures"):
            assert d[case]["rounds"] >= 1, case
            assert all(_positive(d[case][key]) for key in MS), (d["replicas"], case, d[case])
        assert all(d[key] == d["fault_free"][key] for key in MS), "the headline is the fault-free median"
        assert all(_positive(d[key]) for key in ("plan_ms", "heal_assignment_ms", "outer_plan_ms")), d
        checks = d["checks"]
        assert checks["committed"] == checks["rounds"] >= 3 and checks["digests_agree"], checks
    assert sum(d["checks"]["failures_fired"].get("die", 0) for d in decisions) >= 1, (
        "the rounds with failures had replicas die"
    )
    fit = report["decisions_fit"]
    assert set(fit) >= FIT and fit["sizes"] == len(QUICK_DECISION_SIZES) and _positive(fit["coefficient_ms"])
    assert {"plan_ms", "heal_assignment_ms", "outer_plan_ms", "with_failures_machine_plus_runner_ms"} <= set(
        fit["by_figure"]
    )

    ray_rows = report["ray_control_plane"]
    assert [(r["clusters"], r["replicas"]) for r in ray_rows] == [(c, c * n) for c, n in QUICK_RAY_SIZES]
    for r in ray_rows:
        assert all(
            _positive(r[key]) for key in ("round_ms_median", "first_round_ms", "heal_round_ms", "driver_cpu_ms_median")
        ), r
        assert isinstance(r["round_ms_spread"], float) and r["round_ms_spread"] >= 0
        assert r["committed"] == r["rounds"] + 2, "the first round, the fault-free ones and the one after a restart"
        assert r["heals"] >= 1 and r["events"]["heal_end"] >= 1, "the restarted actor healed from its peer's actor"
        assert r["events"]["commit_decision"] == r["committed"]
    rfit = report["ray_fit"]
    assert set(rfit) >= FIT and rfit["sizes"] == len(QUICK_RAY_SIZES)
    assert _positive(report["ray_extrapolated_10000_ms"])
    assert math.isfinite(rfit["affine"]["at_10000_ms"]) and _positive(rfit["driver_cpu"]["at_10000_ms"])

    assert report["lasting_inner_s"] == QUICK_INNER_S
    lasting = report["lasting_rounds"]
    assert [(r["clusters"], r["replicas"]) for r in lasting] == [(c, c * n) for c, n in QUICK_RAY_SIZES]
    for r in lasting:
        n, clusters = r["replicas"], r["clusters"]
        assert r["ticks"] == QUICK_INNER_S / r["tick_s"]
        for path, f in (("board", r), ("by calls", r["by_calls"])):
            assert f["target_extra_calls"] == 2 * clusters * r["ticks"], path
            for case in ("lasting", "instant"):
                by = f[case]["calls_by_method"]
                assert f[case]["calls_per_round"] == sum(by.values()), (path, case, by)
                assert by["run_inner"] == n and by["outer_commit"] == n, (path, case, by)  # fault-free: one each
                assert 1 <= by["outer_reduce"] <= n, (path, case, by)
                assert set(by) <= {
                    "progress",
                    "run_inner",
                    "outer_reduce",
                    "outer_commit",
                    "request_yield",
                    "send_state",
                    "receive_state",
                }, by
                assert f[case]["table_reads"] >= 1 and f[case]["idle_probes_untold"] <= f[case]["idle_probes_wanted"]
            assert f["calls_per_round"] == f["lasting"]["calls_per_round"]
            assert f["instant_calls_per_round"] == f["instant"]["calls_per_round"]
            assert f["extra_calls_per_round"] == f["calls_per_round"] - f["instant_calls_per_round"]
            assert (
                f["progress_calls_lasting"] + f["idle_liveness_calls_lasting"]
                == f["lasting"]["calls_by_method"]["progress"]
            )
            assert f["lasting"]["inner_wall_s"] >= QUICK_INNER_S * 0.9 and f["lasting"]["machine_ticks"] >= 1
            assert f["supervisor_cpu_per_inner_s"] >= 0 and f["supervisor_main_thread_cpu_per_inner_s"] >= 0
            assert isinstance(f["extra_calls_hold"], bool)
        # by calls: replicas in a lasting run_inner are polled with a call each per tick, and that is all the extra
        calls = r["by_calls"]
        assert calls["progress_calls_lasting"] > 0 and calls["lasting"]["board_writes"] == 0
        assert calls["extra_calls_per_round"] == calls["extra_calls_by_method"]["progress"] > 0
        # the progress board: the steps come from the store (written), no progress call is needed for them
        assert r["lasting"]["board_writes"] > 0 and r["progress_calls_lasting"] == 0, r["lasting"]
        assert 0 <= r["extra_calls_per_round"] < calls["extra_calls_per_round"]
    lfit = report["lasting_fit"]
    for fit in (lfit, lfit["by_calls"]):
        for key in ("extra_calls", "supervisor_cpu_per_inner_s", "calls_per_round", "instant_calls_per_round"):
            assert {"fixed", "per_replica", "r2", "sizes"} <= set(fit[key]) and fit[key]["sizes"] == len(lasting)
    for holds in (report["lasting_holds"], report["lasting_holds"]["by_calls"]):
        assert isinstance(holds["extra_calls_le_2_clusters_ticks"], bool)
        assert isinstance(holds["cpu_le_5pct_at_largest"], bool)
        assert holds["largest_replicas"] == lasting[-1]["replicas"]
    assert report["lasting_targets"] == {"extra_calls_per_cluster_tick": 2, "cpu_fraction_at_largest": 0.05}
    assert report["driver_idle_cpu_per_s"] >= 0

    assert (tmp_path / "scale.png").stat().st_size > 0
    assert ray.is_initialized() == ray_was_up, "the suite leaves Ray as it found it"
