"""`python -m benchmarks convergence` (issue 22, Acceptance 3): the arms and the table's arithmetic,
on fabricated run results (no Ray)."""

import json

import pytest

from benchmarks.convergence import (
    QUIET,
    TARGET_GAP,
    TARGET_RATIO,
    Arm,
    arm_overrides,
    best_flat,
    common_overrides,
    defaults_overrides,
    eval_points,
    flat_lr_arms,
    invocation_arms,
    link_overrides,
    lr_label,
    modeled_link_s,
    peer_arms,
    peer_eval_points,
    peer_ratios,
    plan_arms,
    rows,
    schedule_overrides,
    slow_link_bytes,
    table_md,
    write_report,
)

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
        seen.add(
            (
                cfg.sync.outer,
                cfg.sync.outer_every,
                cfg.sync.outer_compress,
                cfg.sync.fragments,
                cfg.sync.outer_path,
                cfg.topology.clusters,
                cfg.sync.fragment_delay,
                cfg.sync.fragment_alpha,
            )
        )
    assert len(seen) == len(arms), "two arms run the same config"
    kinds = {(o, k) for o, _, _, _, _, k, _, _ in seen}
    assert ("average", 1) in kinds and ("average", 2) in kinds  # flat DDP and hierarchical LocalSGD
    assert (
        len(
            {
                h
                for o, h, c, f, p, k, d, _ in seen
                if o == "diloco" and c == "none" and f == 1 and p == "leader" and d == 0
            }
        )
        >= 3
    )
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

    common = common_overrides(
        model="tiny", seed=3, eval_batches=4, steps=2000, batch_size=32, outer_lr=1.0, outer_momentum=0.3
    )
    for arm in plan_arms(2000):
        cfg = _composed(arm, common)
        assert cfg.data.batch_size == 32 and cfg.seed == 3 and cfg.train.eval_batches == 4, arm.name
        outer = outer_hyperparameters(
            cfg.sync.outer, cfg.optim.outer.lr, cfg.optim.outer.momentum, cfg.optim.outer.nesterov
        )
        if cfg.sync.outer == "diloco":
            assert outer == {"lr": 1.0, "momentum": 0.3, "nesterov": True}, arm.name
        else:  # flat DDP and LocalSGD average: lr 1, no momentum, whatever optim.outer says
            assert outer == {"lr": 1.0, "momentum": 0.0, "nesterov": False}, arm.name
    again = common_overrides(
        model="tiny",
        seed=3,
        eval_batches=4,
        steps=2000,
        batch_size=32,
        outer_lr=1.0,
        outer_momentum=0.3,
        extra=["data.batch_size=8", "optim.outer.momentum=0.9"],
    )
    cfg = _composed(plan_arms(2000)[-1], again)
    assert (cfg.data.batch_size, cfg.optim.outer.momentum) == (8, 0.9), "--set comes last and wins"


def test_every_moves_the_main_arms_and_keeps_the_extra_diloco_ones():
    names = {a.name: a for a in plan_arms(1000, every=40)}
    assert {
        "localsgd_h40",
        "localsgd_h40_int4",
        "diloco_h40",
        "diloco_h40_int4",
        "diloco_h50",
        "diloco_h250",
        "diloco_h40_delay5",
        "diloco_h40_streaming",
    } <= set(names)
    assert names["localsgd_h40_int4"].steps_per_round == 40 and names["localsgd_h40_int4"].rounds == 25
    assert names["diloco_h40_frag4"].steps_per_round == 10
    assert len(names) == len(plan_arms(1000)), "the same arms, at another H"


def test_quick_arms_cover_each_path_in_few_runs():
    arms = plan_arms(200, quick=True)
    assert len(arms) <= 8 and {a.rounds * a.steps_per_round for a in arms} == {200}
    names = {a.name for a in arms}
    assert {
        "flat_ddp",
        "localsgd_h50",
        "localsgd_h50_int4",
        "diloco_h50",
        "diloco_h50_int4",
        "diloco_h50_frag2",
        "diloco_h50_sharded",
        "diloco_h50_delay5",
    } == names
    delay = next(a for a in arms if a.name == "diloco_h50_delay5")
    assert delay.delay == 5 and delay.steps_per_round == 50 and delay.hierarchical and delay.senders == 2
    assert "sync.fragment_delay=5" in delay.overrides and "sync.fragment_alpha=0.5" in delay.overrides


def test_full_arms_add_overlap_and_streaming_diloco_combination():
    arms = {a.name: a for a in plan_arms(2000)}
    assert list(arms) == [
        "flat_ddp",
        "localsgd_h100",
        "localsgd_h100_int4",
        "diloco_h50",
        "diloco_h100",
        "diloco_h250",
        "diloco_h100_bf16",
        "diloco_h100_int8",
        "diloco_h100_int4",
        "diloco_h100_topk1",
        "diloco_h100_frag4",
        "diloco_h100_sharded",
        "diloco_h100_delay5",
        "diloco_h100_streaming",
    ]
    delay, streaming = arms["diloco_h100_delay5"], arms["diloco_h100_streaming"]
    assert (delay.delay, delay.steps_per_round, delay.rounds, delay.senders) == (5, 100, 20, 2)
    assert (streaming.delay, streaming.steps_per_round, streaming.rounds, streaming.senders) == (5, 25, 80, 2)
    for name in (
        "sync.fragments=4",
        "sync.fragment_delay=5",
        "sync.fragment_alpha=0.5",
        "sync.outer_compress=int4",
        "sync.outer_path=leader",
    ):
        assert name in streaming.overrides, name
    assert all(a.delay == 0 for n, a in arms.items() if n not in ("diloco_h100_delay5", "diloco_h100_streaming"))


@pytest.mark.parametrize("quick", [False, True])
def test_every_arm_sets_every_sync_key_and_fragment_delay_is_its_delay(quick):
    arms = plan_arms(200 if quick else 2000, quick=quick)
    keys = {a.name: sorted(o.split("=")[0] for o in a.overrides if o.startswith("sync.")) for a in arms}
    assert len({tuple(k) for k in keys.values()}) == 1, keys  # no arm inherits a sync default another overrides
    assert "sync.fragment_delay" in keys["flat_ddp"] and "sync.fragment_alpha" in keys["flat_ddp"]
    for arm in arms:
        assert [o for o in arm.overrides if o.startswith("sync.fragment_delay=")] == [
            f"sync.fragment_delay={arm.delay}"
        ]


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
    assert modeled_link_s(arms["diloco_h100"], 250_000_000, 20, GBPS, LATENCY_MS, step_s=0.1) == modeled_link_s(
        arms["diloco_h100"], 250_000_000, 20, GBPS, LATENCY_MS
    )


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
    assert modeled_link_s(streaming, nbytes, 80, GBPS, LATENCY_MS, step_s=0.01) == pytest.approx(
        80 * (per_round - 0.05)
    )


def test_table_models_the_delay_arm_with_its_own_step_time_and_counts_overlapped_rounds():
    arms = plan_arms(2000)
    results = {
        "diloco_h100_delay5": {
            "status": "completed",
            "final_eval_loss": 2.0,
            "wall_s": 200.0,
            "slow_link_bytes": 20 * 250_000_000,
            "rounds_committed": 20,
            "outer_overlapped_rounds": 19,
        }
    }
    (row,) = rows(arms, results, gbps=GBPS, latency_ms=LATENCY_MS)
    # 2000 steps in 200 s: 0.1 s a step, 5 of them hide 0.5 s of each round's 1.05 s
    assert row["wan_wall_s_modeled"] == pytest.approx(200.0 + 20 * 0.55)
    assert row["outer_overlapped_rounds"] == 19


def _results():
    def r(loss, nbytes, wall, rounds, status="completed"):
        return {
            "status": status,
            "final_eval_loss": loss,
            "slow_link_bytes": nbytes,
            "wall_s": wall,
            "rounds_committed": rounds,
        }

    return {
        "flat_ddp": r(2.0, 1_000_000_000, 100.0, 20),
        "flat_ddp@wan": r(2.0, 1_000_000_000, 250.0, 20),
        "diloco_h100": r(2.03, 1_000_000, 90.0, 20),  # 1000x, +1.5 %: meets the target
        "diloco_h250": r(2.10, 400_000, 80.0, 8),  # 2500x, +5 %: too far behind
        "diloco_h100_bf16": r(2.01, 2_500_000, 95.0, 20),  # 400x: too many bytes
        "diloco_h100_int4": {
            "status": "error",
            "error": "boom",
            "final_eval_loss": None,
            "slow_link_bytes": None,
            "wall_s": None,
        },
    }


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


# --- issue 33, Build 4: arms at the config's defaults, flat DDP at its best rate, curves ---------------


def test_arms_at_defaults_keep_what_makes_each_arm_and_take_nothing_else_from_the_bench():
    from hsgd.config.auto import outer_step_of, run_steps, warmup_steps_of
    from hsgd.config.layout import layout_of
    from hsgd.config.schema import DataConfig

    bench = plan_arms(2000)
    arms = invocation_arms(bench, at="both")
    assert [a.name for a in arms] == [a.name for a in bench] + [f"{a.name}@defaults" for a in bench]
    assert [a.name for a in invocation_arms(bench, at="defaults")] == [f"{a.name}@defaults" for a in bench]
    assert invocation_arms(bench, at="bench") == bench  # today's behaviour
    defaults = defaults_overrides(model="tiny", seed=3, eval_batches=4, extra=["train.min_step_s=0"])
    assert defaults == ["model=tiny", "seed=3", "train.eval_batches=4", "train.min_step_s=0"]
    for arm, at in zip(bench, arms[len(bench) :], strict=True):
        assert at.at == "defaults" and arm.at == "bench", at.name
        assert (at.overrides, at.rounds, at.steps_per_round, at.hierarchical, at.senders, at.delay) == (
            arm.overrides,
            arm.rounds,
            arm.steps_per_round,
            arm.hierarchical,
            arm.senders,
            arm.delay,
        ), at.name
        cfg = _composed(at, defaults)
        assert cfg.seed == 3 and cfg.model.name == "tiny" and cfg.train.eval_batches == 4, at.name
        # nothing of the bench's: the config's batch, schedule, auto warmup and auto outer step
        assert cfg.data.batch_size == DataConfig.batch_size, at.name
        assert cfg.optim.inner.warmup_steps is None and cfg.optim.outer.lr is None and cfg.optim.outer.momentum is None
        assert warmup_steps_of(cfg.optim.inner, run_steps(cfg, layout_of(cfg))) == 100, at.name  # 5 % of 2000
        assert outer_step_of(cfg)[0] == 1.0, at.name
        same = _composed(arm, defaults)  # the same arm's sync and topology, whichever kind
        assert (cfg.sync, cfg.topology, cfg.train.rounds) == (same.sync, same.topology, same.train.rounds), at.name
    for o in ("data.batch_size", "optim.inner.schedule", "optim.inner.warmup_steps", "optim.outer."):
        assert not any(x.startswith(o) for a in arms for x in a.overrides), o


def test_flat_lr_arms_run_flat_ddp_once_per_rate_the_own_rate_only_once_and_the_sweep_rate_wins():
    flat = plan_arms(200, quick=True)[0]
    swept = flat_lr_arms(flat, [1.5e-3, 3e-3, 6e-3, 6e-3], own_lr=3e-3)
    assert [a.name for a in swept] == ["flat_ddp_lr1.5e-3", "flat_ddp_lr6e-3"]
    assert [a.inner_lr for a in swept] == [1.5e-3, 6e-3] and not any(a.hierarchical for a in swept)
    assert all(a.overrides[:-1] == flat.overrides for a in swept)
    cfg = _composed(swept[1], ["model=tiny", "optim.inner.lr=1e-4"])  # --set comes before the arm's own
    assert cfg.optim.inner.lr == 6e-3 and cfg.topology.clusters == 1 and cfg.sync.outer_every == flat.steps_per_round
    assert [lr_label(x) for x in (6e-3, 1.5e-3, 0.1, 3e-4)] == ["6e-3", "1.5e-3", "1e-1", "3e-4"]
    arms = invocation_arms(
        plan_arms(200, quick=True)[:1] + plan_arms(200, quick=True)[3:4], at="both", flat_lrs=[3e-3, 6e-3], own_lr=3e-3
    )
    assert [a.name for a in arms] == [
        "flat_ddp",
        "flat_ddp_lr6e-3",
        "diloco_h50",
        "flat_ddp@defaults",
        "flat_ddp_lr6e-3@defaults",
        "diloco_h50@defaults",
    ]
    with pytest.raises(ValueError, match="flat_ddp"):
        invocation_arms(plan_arms(200, quick=True)[3:4], at="bench", flat_lrs=[6e-3], own_lr=3e-3)


def _swept_results():
    def r(loss, nbytes, lr=None):
        return {
            "status": "completed",
            "final_eval_loss": loss,
            "slow_link_bytes": nbytes,
            "wall_s": 10.0,
            "rounds_committed": 4,
            **({} if lr is None else {"inner_lr": lr}),
        }

    return {
        "flat_ddp": r(2.0, 1_000_000_000, 3e-3),
        "flat_ddp_lr6e-3": r(1.9, 1_000_000_000),
        "flat_ddp_lr1.5e-3": r(2.2, 1_000_000_000),
        "diloco_h50": r(2.03, 1_000_000),
        "flat_ddp@defaults": r(2.5, 250_000_000, 3e-3),
        "flat_ddp_lr6e-3@defaults": r(2.6, 250_000_000),
        "flat_ddp_lr1.5e-3@defaults": {
            "status": "error",
            "final_eval_loss": None,
            "slow_link_bytes": None,
            "wall_s": None,
        },
        "diloco_h50@defaults": r(2.55, 400_000),
    }


def _swept_arms():
    quick = plan_arms(200, quick=True)
    return invocation_arms([quick[0], quick[3]], at="both", flat_lrs=[1.5e-3, 6e-3], own_lr=3e-3)


def test_every_arm_has_its_gap_against_flat_ddp_at_its_own_rate_and_at_flat_ddps_best_of_its_kind():
    arms, results = _swept_arms(), _swept_results()
    best = best_flat(arms, results, "bench")
    assert (best["arm"], best["inner_lr"], best["final_eval_loss"]) == ("flat_ddp_lr6e-3", 6e-3, 1.9)
    assert [(t["arm"], t["inner_lr"]) for t in best["rates"]] == [
        ("flat_ddp", 3e-3),
        ("flat_ddp_lr1.5e-3", 1.5e-3),
        ("flat_ddp_lr6e-3", 6e-3),
    ]
    # at the defaults the own rate wins; the failed rate is listed, not chosen
    assert best_flat(arms, results, "defaults")["arm"] == "flat_ddp@defaults"
    table = {r["arm"]: r for r in rows(arms, results, gbps=GBPS, latency_ms=LATENCY_MS)}
    h50 = table["diloco_h50"]
    assert h50["gap"] == pytest.approx(0.015) and h50["gap_vs_best_flat"] == pytest.approx(0.13 / 1.9)
    assert h50["best_flat_arm"] == "flat_ddp_lr6e-3" and h50["flat_rates"] == 3
    assert h50["meets_target"] is True and h50["meets_target_vs_best_flat"] is False
    assert h50["bytes_ratio_vs_flat"] == pytest.approx(1000)
    # @defaults against flat DDP @defaults only: its gap, bytes ratio and best
    d50 = table["diloco_h50@defaults"]
    assert d50["gap"] == pytest.approx(0.02) and d50["gap_vs_best_flat"] == pytest.approx(0.02)
    assert d50["bytes_ratio_vs_flat"] == pytest.approx(625) and d50["best_flat_arm"] == "flat_ddp@defaults"
    assert table["flat_ddp_lr6e-3"]["gap"] == pytest.approx(-0.05) and table["flat_ddp_lr6e-3"]["gap_vs_best_flat"] == 0
    text = table_md(list(table.values()), gbps=GBPS, latency_ms=LATENCY_MS)
    assert "| gap vs flat | gap vs best flat |" in text and text.splitlines()[0].endswith("| target vs best flat |")
    line = next(x for x in text.splitlines() if x.startswith("| diloco_h50 |"))
    assert "| +1.50 % | +6.84 % |" in line and line.endswith("| yes | no |")
    assert len({x.count("|") for x in text.splitlines()}) == 1, "every line has the header's columns"


def test_without_a_sweep_the_table_keeps_todays_columns():
    arms = plan_arms(200, quick=True)
    results = {k: v for k, v in _swept_results().items() if k in ("flat_ddp", "diloco_h50")}
    table = rows(arms, results, gbps=GBPS, latency_ms=LATENCY_MS)
    assert all(r["gap"] == r["gap_vs_best_flat"] and r["flat_rates"] == 1 for r in table)
    assert "best flat" not in table_md(table, gbps=GBPS, latency_ms=LATENCY_MS)


def test_the_torchft_ratio_compares_like_with_like():
    results = {
        "diloco_h50": {"final_eval_loss": 2.0},
        "torchft_diloco_h50": {"final_eval_loss": 2.5},
        "diloco_h50@defaults": {"final_eval_loss": 3.0},
        "torchft_diloco_h50@defaults": {"final_eval_loss": 2.0},
        "torchft_diloco_h50@defaults@wan": {"final_eval_loss": 9.0},
    }
    ratios = peer_ratios(results)
    assert {h: c["ratio"] for h, c in ratios.items()} == {"50": pytest.approx(0.8), "50@defaults": pytest.approx(1.5)}
    assert ratios["50@defaults"]["hsgd_arm"] == "diloco_h50@defaults"
    assert (
        peer_ratios({"torchft_diloco_h50@defaults": {"final_eval_loss": 2.0}, "diloco_h50": {"final_eval_loss": 1}})
        == {}
    )
    (peer,) = invocation_arms(peer_arms(200, quick=True), at="defaults")
    assert peer.name == "torchft_diloco_h50@defaults" and peer.peer == "torchft_diloco"


def test_eval_points_carry_tokens_and_cumulative_slow_link_bytes():
    flat, h50 = plan_arms(200, quick=True)[0], plan_arms(200, quick=True)[3]
    metrics = [
        {"inner_step": 50, "outer_bytes": 10, "inner_bytes": 1000, "eval_loss": None, "cluster_tokens": [5, 5]},
        {"inner_step": 100, "outer_bytes": 10, "inner_bytes": 1000, "eval_loss": 3.0, "cluster_tokens": [5, 5]},
        {"inner_step": 150, "outer_bytes": 10, "inner_bytes": 1000, "eval_loss": None, "cluster_tokens": [5, 5]},
        {"inner_step": 200, "outer_bytes": 10, "inner_bytes": 1000, "eval_loss": 2.5, "cluster_tokens": [5, 5]},
    ]
    points = eval_points(h50, metrics, initial_eval_loss=4.0, step_tokens=7)
    assert points == [
        {"inner_step": 0, "tokens": 0, "slow_link_bytes": 0, "eval_loss": 4.0},
        {"inner_step": 100, "tokens": 20, "slow_link_bytes": 20, "eval_loss": 3.0},
        {"inner_step": 200, "tokens": 40, "slow_link_bytes": 40, "eval_loss": 2.5},
    ]
    # flat: inner bytes; without the metrics' own token counts, inner steps x a step's tokens
    bare = [{k: v for k, v in m.items() if k != "cluster_tokens"} for m in metrics]
    assert [
        (p["tokens"], p["slow_link_bytes"]) for p in eval_points(flat, bare, initial_eval_loss=None, step_tokens=7)
    ] == [(700, 2000), (1400, 4000)]
    peer = peer_eval_points(
        {"eval_curve": [[0, 4.0], [100, 3.0], [200, 2.5]], "slow_link_bytes": 80}, steps=200, step_tokens=7
    )
    assert [(p["inner_step"], p["tokens"], p["slow_link_bytes"], p["eval_loss"]) for p in peer] == [
        (0, 0, 0, 4.0),
        (100, 700, 40, 3.0),
        (200, 1400, 80, 2.5),
    ]


def test_report_writes_the_curves_plot_the_best_rate_and_the_header_fields(tmp_path):
    arms, results = _swept_arms(), _swept_results()
    for i, name in enumerate(results):
        if results[name]["final_eval_loss"] is not None:
            loss = results[name]["final_eval_loss"]
            results[name]["eval_points"] = [
                {
                    "inner_step": s,
                    "tokens": s * 2048,
                    "slow_link_bytes": s * (i + 1) * 1000,
                    "eval_loss": loss + (200 - s) / 100,
                }
                for s in (0, 50, 100, 150, 200)
            ]
    text = write_report(
        tmp_path, arms, results, {"suite": "convergence", "quick": False}, gbps=GBPS, latency_ms=LATENCY_MS
    )
    report = json.loads((tmp_path / "convergence.json").read_text())
    assert report["suite"] == "convergence" and report["plots"] == ["convergence.png", "convergence_curves.png"]
    assert report["flat_best"]["bench"]["arm"] == "flat_ddp_lr6e-3"
    assert report["flat_best"]["defaults"]["arm"] == "flat_ddp@defaults"
    assert (
        "flat DDP's best inner rate (bench): flat_ddp_lr6e-3, lr 6e-3, eval loss 1.9000 (tried lr: eval loss "
        "3e-3: 2.0000, 1.5e-3: 2.2000, 6e-3: 1.9000)" in text
    )
    for name in ("convergence.png", "convergence_curves.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


def test_a_run_records_what_it_trained_with_auto_values_resolved_and_its_tokens_per_step():
    from benchmarks.convergence import tokens_per_step, trained_with

    h50 = plan_arms(200, quick=True)[3]
    cfg = _composed(h50, defaults_overrides(model="tiny", seed=0, eval_batches=4))
    assert trained_with(cfg) == {
        "inner_lr": cfg.optim.inner.lr,
        "batch_size": 8,
        "schedule": "cosine",
        "warmup_steps": 10,
        "outer_lr": 1.0,
        "outer_momentum": 0.3,
    }  # 4 outer steps
    assert tokens_per_step(cfg) == 4 * 8 * 1 * 64  # replicas x batch x grad_accum x block
    bench = _composed(
        h50,
        common_overrides(
            model="tiny", seed=0, eval_batches=4, steps=200, batch_size=16, outer_lr=0.7, outer_momentum=0.9
        ),
    )
    assert trained_with(bench)["batch_size"] == 16 and trained_with(bench)["outer_momentum"] == 0.9
