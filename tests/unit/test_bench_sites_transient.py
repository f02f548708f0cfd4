"""benchmarks/sites_transient.py (issue 48's transient bench): the slow schedule it injects, the ratio it
predicts, and how it reads eval loss at equal tokens and wall (no run: benchmarks/sites.py reads those)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.report import ROWS
from benchmarks.sites_transient import arms, at, compare, predicted, schedule, slowed_site


def test_one_site_at_a_time_is_slowed_for_two_rounds_in_turn_never_in_round_0():
    assert [slowed_site(r) for r in range(9)] == [None, 0, 0, 1, 1, 2, 2, 0, 0]


def test_each_arm_composes_and_validates_with_slow_faults_on_whole_sites():
    from actors.launch import compose_config
    from hsgd.config import validate

    for overrides in arms(SimpleNamespace(min_step_s=0.25, seed=0, outer_every=40, rounds=4, slow=3.0)).values():
        cfg = compose_config(overrides)
        validate(cfg)
        assert [(f["kind"], f["target"], f["round"], f["step"], f["seconds"]) for f in cfg.faults.schedule] == [
            ("slow", "cluster:c0", 1, 0, 0.5),
            ("slow", "cluster:c0", 2, 0, 0.5),
            ("slow", "cluster:c1", 3, 0, 0.5),
        ]
    assert schedule(1, 0.25, 3.0) == "faults.schedule=[]"


def test_the_three_arms_differ_only_in_their_balance():
    got = arms(SimpleNamespace(min_step_s=0.25, seed=0, outer_every=40, rounds=8, slow=3.0))
    assert list(got) == ["none", "steps", "time"]
    assert {tuple(a[:-1]) for a in got.values()} == {tuple(got["none"][:-1])}
    assert [a[-1] for a in got.values()] == ["sync.balance=none", "sync.balance=steps", "sync.balance=time"]


def test_the_prediction_is_seven_ninths_of_three_rounds_in_one_without_sync_costs():
    assert predicted(3.0, 10.0, 0.0) == pytest.approx(7 / 3)
    assert predicted(3.0, 10.0, 5.0) == pytest.approx((7 / 9) * 35 / 15)
    assert predicted(1.0, 10.0, 5.0) == pytest.approx(1.0), "nothing slowed: nothing to gain"


def test_eval_loss_is_read_between_evals_and_not_past_a_curves_end():
    curve = [{"tokens": 0, "eval_loss": 4.0}, {"tokens": 100, "eval_loss": 3.0}, {"tokens": 300, "eval_loss": 2.0}]
    assert at(curve, "tokens", 200) == pytest.approx(2.5)
    assert at(curve, "tokens", 100) == pytest.approx(3.0)
    assert at(curve, "tokens", 301) is None


def _arm(name, tokens, wall, losses):
    curve = [{"tokens": t, "wall_s": w, "eval_loss": x} for t, w, x in losses]
    parts = {"inner_s": 10.0, "sync_s": 2.0, "between_s": 1.0}
    return {"name": name, "tokens": tokens, "train_wall_s": wall, "tokens_per_s": tokens / wall, "curve": curve,
            "round_parts_median_s": parts, "rounds": 2, "final_eval_loss": losses[-1][2],
            "outer_wait_fraction_median": {"c0": 0.5}}  # fmt: skip


def test_compare_takes_the_fewest_tokens_and_the_shortest_wall_and_renders_its_rows():
    results = {
        "none": _arm("none", 600, 60.0, [(0, 0.0, 4.0), (600, 60.0, 3.0)]),
        "steps": _arm("steps", 600, 60.0, [(0, 0.0, 4.0), (600, 60.0, 3.0)]),
        "time": _arm("time", 480, 24.0, [(0, 0.0, 4.0), (480, 24.0, 3.2)]),
    }
    cmp = compare(results, SimpleNamespace(slow=3.0, outer_every=40, min_step_s=0.25))
    assert cmp["equal_tokens"] == 480 and cmp["equal_wall_s"] == 24.0
    assert cmp["eval_loss_at_equal_tokens"]["steps"] == pytest.approx(3.2)
    assert cmp["tokens_per_s_time_vs_steps"] == pytest.approx(2.0) and cmp["holds"]["tokens_per_s"]
    assert cmp["loss_gap_at_equal_tokens"] == pytest.approx(0.0) and cmp["holds"]["loss_at_equal_tokens"]
    report = {**cmp, "arms": list(results.values()), "targets": {"tokens_per_s_time_vs_steps": 1.3,
              "loss_at_equal_tokens": 0.01}}  # fmt: skip
    rows = ROWS["sites_transient"](report)
    assert len(rows) == 6 and rows[3][0] == "tokens/s, time / steps (time / none)" and "holds" in rows[3][2]
