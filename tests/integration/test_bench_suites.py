"""Issue 23's peer suites, each once with `--quick`: the JSON's schema, and that both sides of every
comparison ran (hsgd and plain DDP, torchft; Ray Train's kill in test_peer_raytrain.py) — never a timing.
BENCHMARKS.md is made from the JSONs and names each suite's command. (`scale` has its own test:
tests/integration/test_bench_scale.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main as bench

pytestmark = pytest.mark.long  # each suite starts Ray or processes and trains several runs: minutes on 2 cores

HEADER = {"suite", "date", "machine", "command", "quick"}


def _report(out: Path, suite: str) -> dict:
    report = json.loads((out / f"{suite}.json").read_text())
    assert set(report) >= HEADER and report["suite"] == suite and report["quick"] is True
    assert report["command"].startswith(f"python -m benchmarks {suite}")
    assert (out / f"{suite}.png").stat().st_size > 0
    return report


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


def test_overhead_measures_hsgd_and_torch_ddp(results):
    out = results / "overhead"
    assert bench(["overhead", "--quick", "--out", str(out)]) == 0
    (model,) = _report(out, "overhead")["models"]
    assert model["model"] == "tiny" and model["hsgd_tokens_per_s"] > 0 and model["torch_ddp_tokens_per_s"] > 0
    assert model["ratio_min"] <= model["ratio_median"] <= model["ratio_max"]


# The quick run takes two sides: hsgd and torchft (fast settings), each killed and back. The others
# are the same runners under other settings (hsgd_3x1: 3 clusters; torchft_readme: the README's
# timeouts, tests/integration/test_peer_torchft.py checks their flags) or have their own test
# (ray_train: tests/integration/test_peer_raytrain.py kills and restarts its group): ~2 minutes saved.
QUICK_SIDES = ("hsgd_1x3", "torchft_fast")


# steps padded to 0.2 s, processes mostly asleep: beside the busy long runs (tests/run_all.sh)
@pytest.mark.paced
def test_recovery_kills_a_replica_of_hsgd_and_of_torchft_and_each_comes_back(results):
    out = results / "recovery"
    assert bench(["recovery", "--quick", "--sides", ",".join(QUICK_SIDES), "--out", str(out)]) == 0
    report = _report(out, "recovery")
    sides = {s["name"]: s for s in report["sides"]}
    assert set(sides) == set(QUICK_SIDES)
    for name, side in sides.items():
        (run,) = side["runs"]
        assert run["result_error"] is None, (name, run["result_error"])
        (kill,) = run["kills"]
        (rec,) = run["recoveries"]
        assert rec["rejoin_s"] is not None and rec["rejoin_s"] > 0, name  # the victim committed again
        assert rec["survivors_stall_s"], name  # the survivors went on past the kill
        assert run["step_time_s"] > 0
    assert set(report["ratios"]) == {"hsgd_1x3 / torchft_fast stall", "hsgd_1x3 / torchft_fast rejoin"}
    assert all(v is not None and v > 0 for v in report["ratios"].values()), report["ratios"]
    assert sides["hsgd_1x3"]["runs"][0]["faults_in_summary"] == 1  # hsgd saw the outside kill as one fault
    assert sides["hsgd_1x3"]["runs"][0]["digests_agree"]


def test_goodput_runs_hsgd_and_torchft_under_the_same_failure_process(results):
    out = results / "goodput"
    assert bench(["goodput", "--quick", "--out", str(out)]) == 0
    runs = _report(out, "goodput")["runs"]
    assert {(r["side"], r["mtbf_s"]) for r in runs} == {
        ("hsgd", None),
        ("torchft", None),
        ("hsgd", 4.0),
        ("torchft", 4.0),
    }
    faulted = [r for r in runs if r["mtbf_s"]]
    assert faulted[0]["failure_process"] == faulted[1]["failure_process"] and faulted[0]["failure_process"]
    for r in runs:
        if r["side"] == "torchft" and r["mtbf_s"]:
            # torchft's job ends with its first finished replica: only a killed one, still restarting on
            # busy cores then, may be left behind; a replica never killed always finishes
            assert set(r["unfinished"]) <= set(r["killed"]), r
        else:
            assert r["result_error"] is None, r
        # (goodput's value is a figure, not a check: on shared cores a fault-free run may be the slower)
        assert r["span_s"] > 0 and r["goodput"] > 0
        assert 0 < r["step_efficiency"] <= 1  # a share of the steps, not a time
    assert all(r["faults"] >= 1 for r in faulted)


def test_straggler_times_flat_ddp_local_sgd_and_diloco(results):
    out = results / "straggler"
    assert bench(["straggler", "--quick", "--out", str(out)]) == 0
    report = _report(out, "straggler")
    assert [a["name"] for a in report["arms"]] == ["flat_ddp", "local_sgd", "diloco"]
    for arm in report["arms"]:
        assert arm["completed"] and arm["wall_s"] > 0 and arm["final_eval_loss"] is not None
    assert report["arms"][0]["speedup_vs_flat"] == 1.0


@pytest.mark.paced  # steps padded (the sites' min_step_s): mostly asleep
def test_sites_runs_balance_none_and_steps_on_the_same_tokens(results):
    out = results / "sites"
    assert bench(["sites", "--quick", "--out", str(out)]) == 0
    report = _report(out, "sites")
    assert [a["name"] for a in report["arms"]] == ["none", "steps"]
    none, steps = report["arms"]
    for arm in report["arms"]:
        assert arm["completed"] and arm["final_eval_loss"] is not None and arm["tokens"] > 0
        assert len(arm["curve"]) == arm["rounds"] + 1  # the initial eval, then every round's
        assert arm["tokens"] == sum(arm["tokens_per_cluster"])  # the rounds' record agrees with the summary
        assert set(arm["outer_wait_fraction_median"]) == {"c0", "c1"}
    spr = report["settings"]["outer_every"]
    assert none["cluster_steps"] == [[spr, spr]] * none["rounds"]
    assert steps["cluster_steps"] == [[spr, spr // 2]] * steps["rounds"]  # the slow site plans half
    assert steps["tokens"] == none["tokens"]  # the same total tokens
    assert set(report["ratios"]) == set(report["targets"]) == set(report["holds"]) == {"tokens_per_s", "time_to_loss"}
    assert report["ratios"]["tokens_per_s"] > 0


@pytest.mark.paced  # steps padded (the sites' min_step_s): mostly asleep
def test_sites_transient_runs_none_steps_and_time_with_a_rotating_slow_site(results):
    out = results / "sites_transient"
    assert bench(["sites", "--transient", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "sites_transient.json").read_text())
    assert set(report) >= HEADER and report["suite"] == "sites_transient" and report["quick"] is True
    assert report["command"].startswith("python -m benchmarks sites --transient")
    assert (out / "sites_transient.png").stat().st_size > 0
    assert [a["name"] for a in report["arms"]] == ["none", "steps", "time"]
    for arm in report["arms"]:
        assert arm["status"] == "completed" and arm["tokens"] == sum(arm["tokens_per_cluster"]) > 0
        assert set(arm["outer_wait_fraction_median"]) == {"c0", "c1", "c2"}
    assert report["settings"]["slowed"] == [None, 0, 0]
    assert report["tokens_per_s_time_vs_steps"] > 0 and report["predicted_time_vs_steps"] > 1
    assert set(report["eval_loss_at_equal_tokens"]) == {"none", "steps", "time"}
