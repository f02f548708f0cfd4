"""The torchft DiLoCo peer (benchmarks/peers/torchft_diloco.py) as the convergence benchmark runs it:
torchft's DiLoCo (Manager + Lighthouse, 2 groups x 2 ranks, torch DDP inside) trains hsgd's model on
the config of hsgd's `diloco_h<H>` arm; its loss falls, its slow-link bytes are counted, and the
comparison with hsgd's arm reaches the report."""

import json

import pytest

from benchmarks.convergence import (
    _run_peer,
    arm_overrides,
    common_overrides,
    peer_arms,
    peer_ratios,
    plan_arms,
    write_report,
)
from benchmarks.peers.torchft_diloco import run_diloco

STEPS, H = 40, 10


def _common():
    return common_overrides(
        model="tiny",
        seed=0,
        eval_batches=4,
        steps=STEPS,
        batch_size=4,
        outer_lr=1.0,
        outer_momentum=0.3,
        extra=["model.n_layer=1"],
    )


def test_the_peer_arm_runs_the_config_of_hsgds_diloco_arm_at_the_same_h():
    (arm,) = peer_arms(200, quick=True)
    hsgd = {a.name: a for a in plan_arms(200, quick=True)}["diloco_h50"]
    assert arm.name == "torchft_diloco_h50" and arm.peer == "torchft_diloco" and arm.hierarchical
    assert arm.overrides == hsgd.overrides and (arm.steps_per_round, arm.rounds) == (50, 4)
    assert arm.senders == 4  # under DDP every rank of both groups sends its whole pseudo-gradient
    assert peer_arms(1000, every=40)[0].name == "torchft_diloco_h40"


def test_torchft_diloco_trains_hsgds_model_its_loss_falls_and_its_slow_link_bytes_are_counted(tmp_path):
    (arm,) = peer_arms(STEPS, every=H)
    overrides = arm_overrides(arm, _common(), eval_every_steps=20)
    r = _run_peer(arm, overrides, tmp_path / "run", STEPS)
    assert r["status"] == "completed", r.get("error")
    assert r["rounds_committed"] == STEPS // H and r["commit_failures"] == 0
    assert r["params_agree"] is True  # all 4 ranks end with the same global params
    # the invocation's outer step: torch SGD, Nesterov, lr 1.0, momentum 0.3
    assert r["outer"] == {"lr": 1.0, "momentum": 0.3, "nesterov": True}
    # rank r of group g reads hsgd replica c{g}r{r}'s batches
    assert {n: p["index"] for n, p in r["per_rank"].items()} == {"g0r0": 0, "g0r1": 1, "g1r0": 2, "g1r1": 3}

    # it trains: the eval loss (hsgd's evaluation batches) falls from the initial params'
    steps = [s for s, _ in r["eval_curve"]]
    losses = [loss for _, loss in r["eval_curve"]]
    assert steps == [0, 20, 40] and r["initial_eval_loss"] == losses[0] and r["final_eval_loss"] == losses[-1]
    assert losses[-1] < losses[1] < losses[0]

    # slow-link bytes: every rank hands its fp32 pseudo-gradient (every parameter) to the
    # cross-group all-reduce once per outer step; the total is their sum
    payload = r["param_count"] * 4
    for name, rank in r["per_rank"].items():
        assert rank["bytes_per_outer_step"] == [payload] * (STEPS // H), name
        assert rank["bytes_sent"] == payload * (STEPS // H), name
    assert r["slow_link_bytes"] == r["outer_bytes"] == 4 * payload * (STEPS // H)

    # in the report beside hsgd's arm of the same H: a row each and the eval-loss ratio
    hsgd = {
        "status": "completed",
        "final_eval_loss": r["final_eval_loss"] * 0.99,
        "wall_s": 10.0,
        "slow_link_bytes": 2 * payload * (STEPS // H),
        "rounds_committed": STEPS // H,
    }
    results = {"diloco_h10": hsgd, arm.name: r}
    assert peer_ratios(results)["10"]["ratio"] == pytest.approx(0.99)
    arms = [a for a in plan_arms(STEPS, every=H, quick=True) if a.name == "diloco_h10"] + [arm]
    text = write_report(tmp_path, arms, results, {"steps": STEPS}, gbps=1.0, latency_ms=50.0)
    report = json.loads((tmp_path / "convergence.json").read_text())
    assert [row["arm"] for row in report["rows"]] == ["diloco_h10", "torchft_diloco_h10"]
    assert report["hsgd_diloco_vs_torchft_diloco"] == {"10": pytest.approx(0.99)}
    assert "| torchft_diloco_h10 |" in text and "hsgd_diloco_vs_torchft_diloco (H=10)" in text


def test_configs_the_peer_does_not_reproduce_are_refused_before_any_process_starts(tmp_path):
    overrides = arm_overrides(peer_arms(STEPS, every=H)[0], _common(), eval_every_steps=0)
    with pytest.raises(ValueError, match="outer_compress"):
        run_diloco(overrides=overrides + ["sync.outer_compress=int4"], out=tmp_path)
    assert not (tmp_path / "logs").exists()
