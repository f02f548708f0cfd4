"""`python -m benchmarks convergence` (issue 22, Acceptance 3): the arms and the table's arithmetic,
on fabricated run results (no Ray)."""
import json

import pytest

from benchmarks.convergence import (QUIET, TARGET_GAP, TARGET_RATIO, Arm, arm_overrides, common_overrides,
                                    link_overrides, modeled_link_s, plan_arms, rows, schedule_overrides,
                                    slow_link_bytes, table_md, write_report)

GBPS, LATENCY_MS = 1.0, 50.0


def _composed(arm: Arm, common: list[str]):
    from actors.launch import compose_config
    from hsgd.config import validate

    cfg = compose_config(QUIET + arm_overrides(arm, common, eval_every_steps=500))
    validate(cfg)
    return cfg


def test_every_arm_trains_the_same_steps_seed_model_and_replicas():
    from hsgd.config.rounds import steps_per_round

    arms = plan_arms(2000)
    common = ["model=small", "seed=7", "train.eval_batches=32"]
    seen, batch_size = set(), _composed(arms[0], common).data.batch_size
    for arm in arms:
        cfg = _composed(arm, common)
        assert steps_per_round(cfg) * cfg.train.rounds == 2000, f"{arm.name}: not 2000 inner steps per replica"
        assert steps_per_round(cfg) == arm.steps_per_round and cfg.train.rounds == arm.rounds, arm.name
        assert cfg.seed == 7 and cfg.model.name == "small" and cfg.data.batch_size == batch_size, arm.name
        assert cfg.topology.clusters * cfg.topology.replicas_per_cluster == 4, arm.name
        assert (cfg.topology.clusters == 2) == arm.hierarchical, arm.name
        assert cfg.sync.fragment_delay == arm.delay, arm.name
        seen.add((cfg.sync.outer, cfg.sync.outer_every, cfg.sync.outer_compress, cfg.sync.fragments,
                  cfg.sync.outer_path, cfg.topology.clusters, cfg.sync.fragment_delay, cfg.sync.fragment_alpha))
    assert len(seen) == len(arms), "two arms run the same config"
    kinds = {(o, k) for o, _, _, _, _, k, _, _ in seen}
    assert ("average", 1) in kinds and ("average", 2) in kinds  # flat DDP and hierarchical LocalSGD
    assert len({h for o, h, c, f, p, k, d, _ in seen
                if o == "diloco" and c == "none" and f == 1 and p == "leader" and d == 0}) >= 3
    assert {c for _, _, c, _, _, _, _, _ in seen} >= {"bf16", "int8", "int4", "topk"}
    assert any(f > 1 for _, _, _, f, _, _, _, _ in seen) and any(p == "sharded" for _, _, _, _, p, _, _, _ in seen)
    # overlap alone, and Streaming DiLoCo's combination: 4 fragments, delay 5, alpha 0.5, int4
    assert ("diloco", 100, "none", 1, "leader", 2, 5, 0.5) in seen
    assert ("diloco", 100, "int4", 4, "leader", 2, 5, 0.5) in seen


def test_every_arm_warms_up_then_decays_its_rate_over_the_run_and_set_overrides_it():
    for arm in plan_arms(2000):
        cfg = _composed(arm, ["model=tiny", *schedule_overrides(2000)])
        assert (cfg.optim.inner.schedule, cfg.optim.inner.warmup_steps) == ("cosine", 100), arm.name
    flat = plan_arms(2000)[0]
    cfg = _composed(flat, ["model=tiny", *schedule_overrides(2000), "optim.inner.schedule=constant"])
    assert cfg.optim.inner.schedule == "constant", "--set comes after the bench's schedule and wins"
    assert schedule_overrides(10) == ["optim.inner.schedule=cosine", "optim.inner.warmup_steps=1"]


def test_every_arm_shares_the_batch_and_only_diloco_arms_take_the_outer_step_set():
    from hsgd.train.outer import outer_hyperparameters

    common = common_overrides(model="tiny", seed=3, eval_batches=4, steps=2000, batch_size=32, outer_lr=1.0,
                              outer_momentum=0.3)
    for arm in plan_arms(2000):
        cfg = _composed(arm, common)
        assert cfg.data.batch_size == 32 and cfg.seed == 3 and cfg.train.eval_batches == 4, arm.name
        outer = outer_hyperparameters(cfg.sync.outer, cfg.optim.outer.lr, cfg.optim.outer.momentum,
                                      cfg.optim.outer.nesterov)
        if cfg.sync.outer == "diloco":
            assert outer == {"lr": 1.0, "momentum": 0.3, "nesterov": True}, arm.name
        else:  # flat DDP and LocalSGD average: lr 1, no momentum, whatever optim.outer says
            assert outer == {"lr": 1.0, "momentum": 0.0, "nesterov": False}, arm.name
    again = common_overrides(model="tiny", seed=3, eval_batches=4, steps=2000, batch_size=32, outer_lr=1.0,
                             outer_momentum=0.3, extra=["data.batch_size=8", "optim.outer.momentum=0.9"])
    cfg = _composed(plan_arms(2000)[-1], again)
    assert (cfg.data.batch_size, cfg.optim.outer.momentum) == (8, 0.9), "--set comes last and wins"


def test_every_moves_the_main_arms_and_keeps_the_extra_diloco_ones():
    names = {a.name: a for a in plan_arms(1000, every=40)}
    assert {"localsgd_h40", "localsgd_h40_int4", "diloco_h40", "diloco_h40_int4", "diloco_h50", "diloco_h250",
            "diloco_h40_delay5", "diloco_h40_streaming"} <= set(names)
    assert names["localsgd_h40_int4"].steps_per_round == 40 and names["localsgd_h40_int4"].rounds == 25
    assert names["diloco_h40_frag4"].steps_per_round == 10
    assert len(names) == len(plan_arms(1000)), "the same arms, at another H"


def test_quick_arms_cover_each_path_in_few_runs():
    arms = plan_arms(200, quick=True)
    assert len(arms) <= 8 and {a.rounds * a.steps_per_round for a in arms} == {200}
    names = {a.name for a in arms}
    assert {"flat_ddp", "localsgd_h50", "localsgd_h50_int4", "diloco_h50", "diloco_h50_int4", "diloco_h50_frag2", "diloco_h50_sharded",
            "diloco_h50_delay5"} == names
    delay = next(a for a in arms if a.name == "diloco_h50_delay5")
    assert delay.delay == 5 and delay.steps_per_round == 50 and delay.hierarchical and delay.senders == 2
    assert "sync.fragment_delay=5" in delay.overrides and "sync.fragment_alpha=0.5" in delay.overrides


def test_full_arms_add_overlap_and_streaming_diloco_combination():
    arms = {a.name: a for a in plan_arms(2000)}
    assert list(arms) == ["flat_ddp", "localsgd_h100", "localsgd_h100_int4", "diloco_h50", "diloco_h100", "diloco_h250", "diloco_h100_bf16",
                          "diloco_h100_int8", "diloco_h100_int4", "diloco_h100_topk1", "diloco_h100_frag4",
                          "diloco_h100_sharded", "diloco_h100_delay5", "diloco_h100_streaming"]
    delay, streaming = arms["diloco_h100_delay5"], arms["diloco_h100_streaming"]
    assert (delay.delay, delay.steps_per_round, delay.rounds, delay.senders) == (5, 100, 20, 2)
    assert (streaming.delay, streaming.steps_per_round, streaming.rounds, streaming.senders) == (5, 25, 80, 2)
    for name in ("sync.fragments=4", "sync.fragment_delay=5", "sync.fragment_alpha=0.5", "sync.outer_compress=int4",
                 "sync.outer_path=leader"):
        assert name in streaming.overrides, name
    assert all(a.delay == 0 for n, a in arms.items() if n not in ("diloco_h100_delay5", "diloco_h100_streaming"))


@pytest.mark.parametrize("quick", [False, True])
def test_every_arm_sets_every_sync_key_and_fragment_delay_is_its_delay(quick):
    arms = plan_arms(200 if quick else 2000, quick=quick)
    keys = {a.name: sorted(o.split("=")[0] for o in a.overrides if o.startswith("sync.")) for a in arms}
    assert len({tuple(k) for k in keys.values()}) == 1, keys  # no arm inherits a sync default another overrides
    assert "sync.fragment_delay" in keys["flat_ddp"] and "sync.fragment_alpha" in keys["flat_ddp"]
    for arm in arms:
        assert [o for o in arm.overrides if o.startswith("sync.fragment_delay=")] == [f"sync.fragment_delay={arm.delay}"]


def test_steps_that_are_not_whole_rounds_are_refused():
    with pytest.raises(ValueError, match="diloco_h250"):
        plan_arms(2100)


def test_eval_cadence_is_the_same_inner_steps_for_every_arm_or_the_end_only():
    arms = {a.name: a for a in plan_arms(2000)}
    assert arm_overrides(arms["diloco_h100"], [], eval_every_steps=500)[-1] == "train.eval_every=5"
    assert arm_overrides(arms["diloco_h100_frag4"], [], eval_every_steps=500)[-1] == "train.eval_every=20"
    assert arm_overrides(arms["diloco_h250"], [], eval_every_steps=300)[-1] == "train.eval_every=8"  # the end only


def test_the_simulated_link_is_the_outer_level_for_hierarchical_arms_and_inner_for_flat():
    arms = {a.name: a for a in plan_arms(2000)}
    assert link_overrides(arms["flat_ddp"], 1, 50) == ["links.inner.gbps=1", "links.inner.latency_ms=50"]
    assert link_overrides(arms["diloco_h100"], 1, 50) == ["links.outer.gbps=1", "links.outer.latency_ms=50"]


def test_slow_link_bytes_are_outer_bytes_for_hierarchical_and_inner_bytes_for_flat():
    arms = {a.name: a for a in plan_arms(2000)}
    metrics = [{"outer_bytes": 10, "inner_bytes": 1000}, {"outer_bytes": 5, "inner_bytes": 2000}]
    assert slow_link_bytes(arms["diloco_h100"], metrics) == 15
    assert slow_link_bytes(arms["flat_ddp"], metrics) == 3000


def test_modeled_link_time_is_a_latency_per_collective_plus_one_members_share_of_the_bytes():
    arms = {a.name: a for a in plan_arms(2000)}
    # flat: 20 rounds of 100 steps -> 20 * 101 collectives; 4e9 bytes over 4 members -> 1e9 B = 8 s at 1 Gb/s
    assert modeled_link_s(arms["flat_ddp"], 4_000_000_000, 20, GBPS, LATENCY_MS) == pytest.approx(20 * 101 * 0.05 + 8.0)
    # diloco h100: one outer exchange per round, 2 leaders
    assert modeled_link_s(arms["diloco_h100"], 250_000_000, 20, GBPS, LATENCY_MS) == pytest.approx(20 * 0.05 + 1.0)
    # sharded: every one of the 4 members sends its shard at once
    assert modeled_link_s(arms["diloco_h100_sharded"], 250_000_000, 20, GBPS, LATENCY_MS) == pytest.approx(1.0 + 0.5)
    # without a delay a step's length hides nothing
    assert modeled_link_s(arms["diloco_h100"], 250_000_000, 20, GBPS, LATENCY_MS, step_s=0.1) == \
        modeled_link_s(arms["diloco_h100"], 250_000_000, 20, GBPS, LATENCY_MS)


def test_modeled_link_time_of_a_delay_arm_hides_delay_steps_per_round():
    arms = {a.name: a for a in plan_arms(2000)}
    delay = arms["diloco_h100_delay5"]
    # 20 rounds of 250 MB each, 125 MB per leader: 0.05 s + 1.0 s = 1.05 s per round; 5 steps of 0.1 s
    # hide 0.5 s of it -> 0.55 s per round
    nbytes = 20 * 250_000_000
    assert modeled_link_s(arms["diloco_h100"], nbytes, 20, GBPS, LATENCY_MS) == pytest.approx(20 * 1.05)
    assert modeled_link_s(delay, nbytes, 20, GBPS, LATENCY_MS, step_s=0.1) == pytest.approx(20 * 0.55)
    # 5 steps of 0.25 s >= 1.05 s: fully hidden, never negative
    assert modeled_link_s(delay, nbytes, 20, GBPS, LATENCY_MS, step_s=0.25) == 0
    assert modeled_link_s(delay, nbytes, 20, GBPS, LATENCY_MS, step_s=0.21) == pytest.approx(0, abs=1e-9)  # the edge
    # streaming: 80 rounds of 25 steps, each carrying an 80th of the bytes
    streaming = arms["diloco_h100_streaming"]
    per_round = 0.05 + (nbytes / 80 / 2) * 8 / 1e9
    assert modeled_link_s(streaming, nbytes, 80, GBPS, LATENCY_MS, step_s=0.01) == pytest.approx(80 * (per_round - 0.05))


def test_table_models_the_delay_arm_with_its_own_step_time_and_counts_overlapped_rounds():
    arms = plan_arms(2000)
    results = {"diloco_h100_delay5": {"status": "completed", "final_eval_loss": 2.0, "wall_s": 200.0,
                                      "slow_link_bytes": 20 * 250_000_000, "rounds_committed": 20,
                                      "outer_overlapped_rounds": 19}}
    (row,) = rows(arms, results, gbps=GBPS, latency_ms=LATENCY_MS)
    # 2000 steps in 200 s: 0.1 s a step, 5 of them hide 0.5 s of each round's 1.05 s
    assert row["wan_wall_s_modeled"] == pytest.approx(200.0 + 20 * 0.55)
    assert row["outer_overlapped_rounds"] == 19


def _results():
    def r(loss, nbytes, wall, rounds, status="completed"):
        return {"status": status, "final_eval_loss": loss, "slow_link_bytes": nbytes, "wall_s": wall,
                "rounds_committed": rounds}
    return {"flat_ddp": r(2.0, 1_000_000_000, 100.0, 20), "flat_ddp@wan": r(2.0, 1_000_000_000, 250.0, 20),
            "diloco_h100": r(2.03, 1_000_000, 90.0, 20),  # 1000x, +1.5 %: meets the target
            "diloco_h250": r(2.10, 400_000, 80.0, 8),  # 2500x, +5 %: too far behind
            "diloco_h100_bf16": r(2.01, 2_500_000, 95.0, 20),  # 400x: too many bytes
            "diloco_h100_int4": {"status": "error", "error": "boom", "final_eval_loss": None,
                                 "slow_link_bytes": None, "wall_s": None}}


def test_table_has_the_gap_ratio_and_target_against_flat_ddp_of_the_same_invocation():
    arms = plan_arms(2000)
    table = {r["arm"]: r for r in rows(arms, _results(), gbps=GBPS, latency_ms=LATENCY_MS)}
    assert list(table) == ["flat_ddp", "diloco_h100", "diloco_h250", "diloco_h100_bf16", "diloco_h100_int4"]
    assert table["flat_ddp"]["gap"] == 0 and table["flat_ddp"]["bytes_ratio_vs_flat"] == 1
    assert table["flat_ddp"]["meets_target"] is False and table["flat_ddp"]["wan_wall_s"] == 250.0
    h100 = table["diloco_h100"]
    assert h100["gap"] == pytest.approx(0.015) and h100["bytes_ratio_vs_flat"] == pytest.approx(1000)
    assert h100["meets_target"] is True and h100["wan_wall_s"] is None
    assert h100["wan_wall_s_modeled"] == pytest.approx(90.0 + 20 * 0.05 + (1_000_000 / 2) * 8 / 1e9)
    assert table["diloco_h250"]["gap"] == pytest.approx(0.05) and table["diloco_h250"]["meets_target"] is False
    assert table["diloco_h100_bf16"]["bytes_ratio_vs_flat"] == pytest.approx(400)
    assert table["diloco_h100_bf16"]["meets_target"] is False
    failed = table["diloco_h100_int4"]
    assert failed["gap"] is None and failed["bytes_ratio_vs_flat"] is None and failed["meets_target"] is None
    assert TARGET_RATIO == 500 and TARGET_GAP == 0.02

    text = table_md(list(table.values()), gbps=GBPS, latency_ms=LATENCY_MS)
    line = next(x for x in text.splitlines() if x.startswith("| diloco_h100 |"))
    assert "2.0300" in line and "+1.50 %" in line and "1.00" in line and "1000.0" in line and line.endswith("yes |")
    assert "| diloco_h100_int4 (error) | - |" in text


def test_without_flat_ddp_there_is_no_gap_or_ratio():
    arms = plan_arms(2000)
    results = {k: v for k, v in _results().items() if not k.startswith("flat")}
    table = rows(arms, results, gbps=GBPS, latency_ms=LATENCY_MS)
    assert all(r["gap"] is None and r["bytes_ratio_vs_flat"] is None for r in table)


def test_report_writes_json_table_and_plot(tmp_path):
    arms = plan_arms(2000)
    text = write_report(tmp_path, arms, _results(), {"steps": 2000}, gbps=GBPS, latency_ms=LATENCY_MS)
    report = json.loads((tmp_path / "convergence.json").read_text())
    assert report["steps"] == 2000 and [r["arm"] for r in report["rows"]][0] == "flat_ddp"
    assert "missing_arms" not in report and len(report["arms"]) == len(arms)
    assert [a["delay"] for a in report["arms"] if a["name"] == "diloco_h100_delay5"] == [5]
    assert (tmp_path / "convergence.md").read_text() == text and "diloco_h250" in text
    png = (tmp_path / "convergence.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
