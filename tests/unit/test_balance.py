"""sync.balance=steps (issue 35): each cluster's inner steps per round (hsgd/core/round/balance.py),
the round machine on such a plan (hsgd/core/round/), the trainer running a plan (hsgd/train/trainer.py),
per-site pacing (hsgd/config/sites.py, hsgd/train/simulate.py), the config's refusals and the durable
plan (hsgd/record/run_state.py).

The round simulation world (tests/fakes/round_world.py) is not driven here: its replicas always run
to (round + 1) * steps_per_round, whatever the RunInner call's `steps`, so a plan cannot be passed to it
without changing it. The machine is driven by hand below, as the lower-level tests of test_round.py do.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import replace

import pytest
import torch

from hsgd.core.outer_plan import token_weights
from hsgd.core.round import (
    Answer,
    ClusterStage,
    Kill,
    OuterReduce,
    Overlap,
    Phase,
    Progress,
    RoundMachine,
    RunInner,
    StepPlan,
    Up,
    Yield,
    plan_round,
)
from hsgd.core.round.balance import fragment_delay_of, plan_steps
from hsgd.core.topology import Topology
from tests.fakes.gloo_world import run_ranks
from tests.fakes.round_world import DONE, decisions, make_settings
from tests.fakes.trainer import _solo, _trainer, dataset  # noqa: F401 — (dataset: the module's fixture)


# -- 1. the plan ------------------------------------------------------------------------------------------------
def test_plan_steps_gives_the_slower_cluster_spr_times_the_ratio_of_step_times():
    assert plan_steps(20, [0.1, 0.2]) == (20, 10)
    assert plan_steps(20, [0.4, 0.1, 0.2]) == (5, 20, 10), "the fastest is whichever cluster it is"


def test_plan_steps_runs_a_cluster_of_unknown_step_time_at_spr():
    assert plan_steps(20, [0.1, None]) == (20, 20)
    assert plan_steps(20, [None, 0.1, 0.2]) == (20, 20, 10)
    assert plan_steps(20, [0.1, 0.0]) == (20, 20), "a step time of 0 is no measure: unknown"


def test_plan_steps_clamps_a_100x_slower_cluster_to_one_step():
    assert plan_steps(20, [0.1, 10.0]) == (20, 1), "20 * 0.01 rounds to 0: at least one step"


def test_plan_steps_with_nothing_known_runs_every_cluster_at_spr():
    assert plan_steps(20, [None, None, None]) == (20, 20, 20)
    assert plan_steps(7, []) == ()


def test_plan_steps_is_never_above_spr_nor_below_one():
    for times in ([0.3, 0.1, 0.2], [1.0, 1.0], [0.05, 5.0, 0.5, None], [2.0, 1e-6]):
        for spr in (1, 3, 10, 20):
            steps = plan_steps(spr, times)
            assert all(1 <= n <= spr for n in steps), (spr, times, steps)
            fastest = min(t for t in times if t is not None)
            assert all(n == spr for n, t in zip(steps, times, strict=True) if t == fastest), (
                "the fastest runs the whole round"
            )


def test_plan_round_from_configured_step_times_only_is_configured():
    plan = plan_round(3, 20, configured=[0.1, 0.2], learned=[None, None])
    assert plan == StepPlan(3, (20, 10), (0.1, 0.2), "configured")


def test_plan_round_from_learned_step_times_only_is_learned():
    plan = plan_round(3, 20, configured=[None, None], learned=[0.5, 0.25])
    assert plan == StepPlan(3, (10, 20), (0.5, 0.25), "learned")
    nothing = plan_round(0, 20, configured=[None, None], learned=[None, None])
    assert nothing.steps == (20, 20) and nothing.step_s == (None, None), "first round, nothing learned: spr"


def test_plan_round_from_both_is_mixed():
    plan = plan_round(1, 20, configured=[0.1, None], learned=[None, 0.4])
    assert plan == StepPlan(1, (20, 5), (0.1, 0.4), "mixed")


def test_plan_round_takes_a_clusters_configured_time_over_its_learned_one():
    plan = plan_round(2, 20, configured=[0.1, 0.2], learned=[0.4, 0.1])
    assert plan.step_s == (0.1, 0.2) and plan.steps == (20, 10) and plan.source == "configured"
    plan = plan_round(2, 20, configured=[None, 0.2], learned=[0.1, 0.05])
    assert plan.step_s == (0.1, 0.2) and plan.steps == (20, 10) and plan.source == "mixed"


def test_a_step_plan_round_trips_through_its_dict_and_reads_back_as_recorded():
    plan = plan_round(4, 20, configured=[0.1, None, None], learned=[None, 0.2, None])
    raw = json.loads(json.dumps(plan.to_dict()))  # as supervisor_state.json holds it
    assert raw == {"round": 4, "steps": [20, 10, 20], "step_s": [0.1, 0.2, None], "source": "mixed"}
    back = StepPlan.from_dict(raw)
    assert back == replace(plan, source="recorded")
    assert isinstance(back.steps, tuple) and isinstance(back.step_s, tuple)


def test_fragment_delay_of_clamps_the_delay_into_the_planned_round():
    assert fragment_delay_of(3, 10) == 3
    assert fragment_delay_of(8, 3) == 3, "a delay beyond the plan: the snapshot at the round's first step"
    assert fragment_delay_of(5, 5) == 5
    assert fragment_delay_of(0, 4) == 0


def test_fragment_delay_of_moves_a_localsgd_snapshot_back_to_the_last_average():
    # plan 5, inner_every 2: the members agree after steps 2 and 4 (and 5); a delay of 2 would snapshot
    # after 3 steps, between two averages: moved back to after 2 (delay 3)
    assert fragment_delay_of(2, 5, 2) == 3
    assert fragment_delay_of(2, 10, 2) == 2, "no plan (spr a multiple of inner_every): unchanged"
    assert fragment_delay_of(1, 3, 4) == 3, "no average inside the plan: the round's start"


def test_plan_steps_rounds_halves_up():
    assert plan_steps(5, [0.1, 0.2]) == (5, 3)


# -- 2. the round machine on a plan -----------------------------------------------------------------------------
SPR = 20


def _machine(clusters: int, per_cluster: int, plan: tuple[int, ...] = (20, 10), r: int = 1, *, down=(), **overrides):
    """Round r of a machine whose every replica holds (r, r * SPR), but those `down`; nothing configured."""
    topo = Topology(clusters, per_cluster)
    settings = make_settings(steps_per_round=SPR, cluster_steps=plan, **overrides)
    progress = {rid: (r, r * SPR) for rid in topo.replica_ids() if rid not in down}
    return RoundMachine(topo, settings, r, progress=progress, leaders={}, epoch=0, committed_round=r)


def _runs(effects) -> dict[int, Phase]:
    return {e.cluster: e for e in effects if isinstance(e, Phase) and e.kind == "run_inner"}


def test_each_clusters_run_inner_carries_its_planned_steps():
    m = _machine(2, 2, (20, 10))
    runs = _runs(m.start(0.0))
    assert {c: {rid: call.steps for rid, call in run.calls.items()} for c, run in runs.items()} == {
        0: {"c0r0": 20, "c0r1": 20},
        1: {"c1r0": 10, "c1r1": 10},
    }
    assert all(isinstance(call, RunInner) for run in runs.values() for call in run.calls.values())


def test_without_a_plan_run_inner_carries_no_steps_and_a_cluster_ends_at_the_rounds_end():
    m = _machine(2, 1, ())
    runs = _runs(m.start(0.0))
    assert [call.steps for run in runs.values() for call in run.calls.values()] == [None, None]
    assert m.settings.steps_of(1) == SPR
    assert decisions(m.observe(Answer(runs[1].id, "c1r0", DONE, 1, 2 * SPR), 1.0)) == []
    assert m.clusters[1].stage is ClusterStage.READY


def test_a_cluster_that_answers_at_its_planned_step_is_ready():
    m = _machine(2, 1, (20, 10), r=1)
    runs = _runs(m.start(0.0))
    # c1 ends at round * spr + its 10 steps: ready, nothing re-issued; c0 still runs its 20
    assert decisions(m.observe(Answer(runs[1].id, "c1r0", DONE, 1, 30), 1.0)) == []
    assert m.clusters[1].stage is ClusterStage.READY and m.clusters[1].reforms == 0
    (reduce,) = decisions(m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 40), 2.0))
    assert reduce.kind == "outer_reduce"


@pytest.mark.parametrize("answered_at", [25, 40], ids=["short_of_its_plan", "at_the_unbalanced_end"])
def test_a_cluster_that_answers_off_its_planned_step_re_forms(answered_at):
    m = _machine(2, 1, (20, 10), r=1)
    runs = _runs(m.start(0.0))
    (again,) = decisions(m.observe(Answer(runs[1].id, "c1r0", DONE, 1, answered_at), 1.0))
    assert again.kind == "run_inner" and again.cluster == 1 and again.reason == "inner phase ended short"
    assert again.calls["c1r0"].steps == 10, "the re-issued call keeps the cluster's plan"
    assert m.clusters[1].reforms == 1


def test_the_outer_mean_weighs_clusters_by_live_members_times_planned_steps():
    m = _machine(2, 1, (20, 10), r=1)
    runs = _runs(m.start(0.0))
    m.observe(Answer(runs[1].id, "c1r0", DONE, 1, 30), 1.0)
    (reduce,) = decisions(m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 40), 2.0))
    weights = {call.weights for call in reduce.calls.values()}
    assert all(isinstance(call, OuterReduce) for call in reduce.calls.values())
    assert weights == {token_weights([20, 10])} == {(4 / 3, 2 / 3)}, "2 : 1, in outer-rank order"


def test_equal_tokens_of_unequal_plans_give_the_plain_mean():
    # c0: 2 live members x 10 planned steps; c1: 1 live member x 20 (its second member is down)
    m = _machine(2, 2, (10, 20), r=0, down=("c1r1",))
    runs = _runs(m.start(0.0))
    for rid in ("c0r0", "c0r1"):
        m.observe(Answer(runs[0].id, rid, DONE, 0, 10), 1.0)
    (reduce,) = decisions(m.observe(Answer(runs[1].id, "c1r0", DONE, 0, 20), 2.0))
    assert {call.weights for call in reduce.calls.values()} == {()}, "20 tokens each: the plain mean"


def test_the_reduce_behind_the_steps_carries_the_planned_token_weights_the_exchange_then_uses():
    """sync.fragment_delay: holders reduce during run_inner with the weights expected then (live
    members x the planned steps before the snapshot); the exchange after the steps computes the same,
    so nothing is redone."""
    from hsgd.core.outer_plan import shard_holders

    topo = Topology(2, 1)
    groups = shard_holders([("c0r0",), ("c1r0",)], ["c0r0", "c1r0"], 1)
    settings = make_settings(steps_per_round=SPR, cluster_steps=(20, 10), fragment_delay=3)
    m = RoundMachine(
        topo,
        settings,
        1,
        progress={"c0r0": (1, 20), "c1r0": (1, 20)},
        leaders={0: "c0r0", 1: "c1r0"},
        epoch=9,
        committed_round=1,
        outer_configured=(7, groups),
    )
    runs = _runs(m.start(0.0))
    expected = token_weights([20 - 3, 10 - 3])  # the steps before each cluster's snapshot (delay 3)
    assert {rid: call.overlap for run in runs.values() for rid, call in run.calls.items()} == {
        "c0r0": Overlap(7, 0, 1, expected),
        "c1r0": Overlap(7, 0, 1, expected),
    }
    m.observe(Answer(runs[1].id, "c1r0", DONE, 1, 30), 1.0)
    (reduce,) = decisions(m.observe(Answer(runs[0].id, "c0r0", DONE, 1, 40), 2.0))
    assert {call.weights for call in reduce.calls.values()} == {expected}


def test_each_cluster_is_taken_for_hung_at_its_own_step_deadline():
    """c0's deadline is 5 s, c1's 60 s, the run's 30 s: both stop stepping at t=2; c0 is killed
    past 2 + 5 s, c1 still not at 2 + 30 s (where the run's deadline would kill it)."""
    m = _machine(2, 1, (20, 10), r=0, cluster_step_deadline_s=(5.0, 60.0), step_deadline_s=30.0, group_grace_s=1.0)
    m.start(0.0)
    for t, step in ((1.0, 1), (2.0, 2)):
        for rid in ("c0r0", "c1r0"):
            m.observe(Progress(rid, step), t)
    assert m.settings.step_deadline_of(0) == 5.0 and m.settings.step_deadline_of(1) == 60.0
    assert [e for e in m.tick(6.5) if isinstance(e, Kill)] == []
    kills = [e.rid for e in m.tick(7.5) if isinstance(e, Kill)]
    assert kills == ["c0r0"]
    assert [e for e in m.tick(40.0) if isinstance(e, Kill)] == [], "c1 was killed at the run's deadline"
    assert [e.rid for e in m.tick(62.5) if isinstance(e, Kill)] == ["c1r0"]


def _rejoin(plan, furthest, **overrides) -> list:
    """c0 steps every 0.1 s, c1 every 1 s up to step `furthest` of round 0; then c1r1 (down at the round's
    start) comes back: what the machine asks of c1's running member."""
    m = _machine(2, 2, plan, r=0, down=("c1r1",), **overrides)
    m.start(0.0)
    for step in range(1, 11):
        m.observe(Progress("c0r0", step), 0.1 * step)
        m.observe(Progress("c0r1", step), 0.1 * step)
    for step in range(1, furthest + 1):
        m.observe(Progress("c1r0", step), float(step))
    return decisions(m.observe(Up("c1r1", 0, 0), furthest + 0.1))


def test_a_replica_rejoining_the_short_cluster_gets_a_yield_step_below_that_clusters_plan():
    # c1's own step time (1 s) sets the lead: 2 steps past its furthest (c0's 0.1 s would make it 16)
    (ask,) = _rejoin((20, 10), furthest=2)
    assert isinstance(ask, Yield) and ask.cluster == 1 and ask.rids == ("c1r0",)
    assert ask.at_step == 4 < 10


def test_a_replica_rejoining_the_short_cluster_near_its_plans_end_waits_for_it():
    assert _rejoin((20, 10), furthest=8) == [], "step 10 is the plan's end: the members finish first"
    (ask,) = _rejoin((20, 20), furthest=8)  # the same cluster on an unbalanced round yields at step 10
    assert isinstance(ask, Yield) and ask.at_step == 10


@pytest.mark.parametrize("furthest,expected", [(2, 4), (5, 8), (7, None)])
def test_a_localsgd_yield_lands_on_a_sync_boundary_inside_the_plan(furthest, expected):
    asks = _rejoin((20, 10), furthest=furthest, inner="localsgd", inner_every=4)
    if expected is None:  # the next boundary (12) lies past the plan's end (10, where it averages)
        assert asks == []
    else:
        (ask,) = asks
        assert isinstance(ask, Yield) and ask.at_step == expected


# -- 4. the trainer on a plan -----------------------------------------------------------------------------------
TSPR = 10
SCHEDULE = ("sync.outer_every=10", "train.rounds=2", "optim.inner.warmup_steps=3", "optim.inner.schedule=cosine")


class _Batches:
    """The trainer's dataset, recording the step of every training batch it hands out."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def batch(self, split, **kw):
        if split == "train":
            self.steps.append(kw["step"])
        return self.inner.batch(split, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _recording_trainer(dataset, *overrides, rid="c0r0", **sync):  # noqa: F811 — the dataset fixture's value, passed in
    t = _trainer(dataset, rid, *SCHEDULE, *overrides, **sync)
    t.dataset = _Batches(t.dataset)
    return t


def _run(t, r, steps="omit"):
    """run_inner of round r (steps passed unless "omit"); returns each step's lr, read from the optimizer."""
    lrs = []

    def hook(phase, round_index, s):
        if phase == "inner" and s > 0:
            lrs.append(t.inner_opt.param_groups[0]["lr"])  # the previous step's

    kwargs = {} if steps == "omit" else {"steps": steps}
    report = t.run_inner(r, _solo("inner"), hook, **kwargs)
    lrs.append(t.inner_opt.param_groups[0]["lr"])
    return report, lrs


def _commit(t, r):
    t.outer_reduce(r, r + 1, _solo("outer"))
    t.outer_commit(r, _solo("inner"), roots=(0,))


def test_run_inner_on_a_plan_runs_exactly_its_steps_and_the_commit_lands_on_the_rounds_end(dataset):  # noqa: F811 — the module's dataset fixture
    t = _recording_trainer(dataset)
    assert t.steps_per_round == TSPR
    report, _ = _run(t, 0, steps=5)
    assert report.steps_done == 5 and len(report.losses) == 5 and report.tokens == 5 * t.tokens_per_step
    assert (t.round, t.step, report.step) == (0, 5, 5)
    again, _ = _run(t, 0, steps=5)  # re-issued at the plan's end: nothing more to run
    assert again.steps_done == 0 and t.step == 5
    _commit(t, 0)
    assert (t.round, t.step) == (1, TSPR), "the next round starts at (round + 1) * spr"
    report, _ = _run(t, 1, steps=5)
    assert report.steps_done == 5 and (t.round, t.step) == (1, TSPR + 5)
    assert t.dataset.steps == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14], "the data stream is indexed by (round, step)"


def test_a_planned_round_covers_the_same_stretch_of_the_lr_schedule(dataset):  # noqa: F811 — the module's dataset fixture
    from hsgd.train.inner import inner_lr

    t = _recording_trainer(dataset)
    o, total = t.cfg.optim.inner, t.cfg.train.rounds * TSPR
    _, lrs0 = _run(t, 0, steps=5)
    _commit(t, 0)
    _, lrs1 = _run(t, 1, steps=5)
    for r, lrs in ((0, lrs0), (1, lrs1)):
        expected = [inner_lr(o, r * TSPR + s * TSPR / 5, total) for s in range(5)]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=0.0), f"round {r}"
    assert lrs0[1] == pytest.approx(o.lr) and lrs0[0] == pytest.approx(o.lr / 3), "warmup over schedule steps 0..2"
    assert lrs1[-1] == pytest.approx(inner_lr(o, 18, total)) != pytest.approx(inner_lr(o, 14, total))


def test_under_balance_time_a_run_that_ends_early_is_not_stretched_over_the_schedule(dataset):  # noqa: F811
    """sync.balance=time (issue 48): a run after the close ends early (`steps`), but its step s stays at
    round * spr + s: its steps were not known at the round's start, so nothing is stretched."""
    from hsgd.train.inner import inner_lr

    t = _recording_trainer(dataset, "sync.balance=time")
    o, total = t.cfg.optim.inner, t.cfg.train.rounds * TSPR
    _, lrs = _run(t, 0, steps=5)
    assert lrs == pytest.approx([inner_lr(o, s, total) for s in range(5)], rel=1e-12, abs=0.0)


@pytest.mark.parametrize("steps", [None, TSPR], ids=["steps_none", "steps_spr"])
def test_a_plan_of_none_or_spr_steps_is_bit_identical_to_no_plan(dataset, steps):  # noqa: F811 — the module's dataset fixture
    plain, planned = _recording_trainer(dataset), _recording_trainer(dataset)
    lrs = {}
    for name, t, kw in (("plain", plain, "omit"), ("planned", planned, steps)):
        _, a = _run(t, 0, kw)
        _commit(t, 0)
        _, b = _run(t, 1, kw)
        lrs[name] = a + b
    assert lrs["plain"] == lrs["planned"], "the lr schedule moved"
    assert plain.dataset.steps == planned.dataset.steps == list(range(2 * TSPR))
    assert (plain.round, plain.step) == (planned.round, planned.step) == (1, 2 * TSPR)
    assert plain.param_digest() == planned.param_digest() and plain.global_digest() == planned.global_digest()


class _AveragingPeer:
    """A localsgd inner group of two whose other member holds params of 0.5: records each average's step."""

    level, rank, world_size, bytes_sent = "inner", 0, 2, 0

    def __init__(self, trainer):
        self.trainer, self.at = trainer, []

    def allreduce_mean(self, tensors, *, level):
        self.at.append(self.trainer.step_in_round)  # (the step is counted after its average)
        for x in tensors:
            x.mul_(0.5).add_(0.25)


@pytest.mark.parametrize(
    "inner_every,steps,averages",
    [
        (10, 5, [4]),  # inner_every past the plan: one average, at the plan's last step
        (4, 5, [3, 4]),  # at its boundary, and at the plan's last step
        (5, 10, [4, 9]),  # no plan: every inner_every steps only (the last step is a boundary)
        (4, 8, [3, 7]),  # the plan's last step is a boundary: averaged once there
    ],
)
def test_localsgd_averages_at_the_plans_last_step(dataset, inner_every, steps, averages):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", *SCHEDULE, inner="localsgd", inner_every=inner_every)
    group = _AveragingPeer(t)
    report = t.run_inner(0, group, steps=steps)
    assert report.steps_done == steps and group.at == averages


def test_a_localsgd_snapshot_on_a_plan_lies_where_the_members_agree(dataset):  # noqa: F811 — the module's dataset fixture
    # spr 10, inner_every 2, fragment_delay 2 (both valid); plan 5: averages after steps 2, 4 and 5 (the plan's
    # last); the snapshot is taken after 5 - 2 = 3 steps, past the average at 2
    t = _trainer(dataset, "c0r0", *SCHEDULE, inner="localsgd", inner_every=2, fragment_delay=2)
    group = _AveragingPeer(t)
    seen = []
    t.run_inner(0, group, at_snapshot=lambda: seen.append(t.step_in_round), steps=5)
    assert group.at == [1, 3, 4] and len(seen) == 1
    done = seen[0]  # steps done when the snapshot was taken
    assert done == 0 or done - 1 in group.at, f"snapshot after {done} steps; averages after {[a + 1 for a in group.at]}"


def _localsgd_worker(rank: int, port: int, results) -> None:
    """Member `rank` of one localsgd cluster of two over gloo: a round planned at 5 of 10 steps,
    inner_every=10: their only average is the plan's last step."""
    out = {"rank": rank}
    try:
        from hsgd.train.comm import LevelGroup
        from hsgd.train.trainer import ReplicaTrainer
        from tests.fakes.trainer import _cfg

        torch.set_num_threads(1)
        group = LevelGroup("inner", "gloo", timeout_s=20, configure_timeout_s=30)
        group.configure(f"127.0.0.1:{port}", "test/epoch1/inner/c0", rank=rank, world_size=2, epoch=1)
        cfg = _cfg("sync.outer_every=10", inner="localsgd", inner_every=10)
        t = ReplicaTrainer(cfg, f"c0r{rank}", Topology(1, 2))
        report = t.run_inner(0, group, steps=5)
        out.update(digest=t.param_digest(), step=t.step, steps_done=report.steps_done, bytes=report.inner_bytes)
        group.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


def test_localsgd_members_on_a_plan_agree_at_its_last_step_over_gloo():
    outs = run_ranks(_localsgd_worker, 2, timeout_s=120, store_timeout_s=30, join_s=5)
    a, b = outs[0], outs[1]
    assert a["steps_done"] == b["steps_done"] == 5 and a["step"] == b["step"] == 5
    assert a["bytes"] > 0, "no average was sent"
    assert a["digest"] == b["digest"], "members of a localsgd cluster differ at the end of their planned round"


def test_a_fragment_delay_counts_back_from_the_plans_end(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", *SCHEDULE, fragment_delay=2)
    seen = []
    t.run_inner(0, _solo("inner"), at_snapshot=lambda: seen.append(t.step_in_round), steps=5)
    assert seen == [3], "the snapshot is 2 steps before the plan's end (5), not the round's (10)"


def test_a_fragment_delay_beyond_the_plan_takes_the_snapshot_at_the_first_step(dataset):  # noqa: F811 — the module's dataset fixture
    t = _trainer(dataset, "c0r0", *SCHEDULE, fragment_delay=8)
    start = [p.detach().clone() for p in t.params]
    seen = []
    t.run_inner(0, _solo("inner"), at_snapshot=lambda: seen.append(t.step_in_round), steps=3)
    assert seen == [0] and t.step == 3
    r, snapshot = t._outer_snapshot
    assert r == 0 and torch.count_nonzero(snapshot) == 0, "the snapshot holds the round's start: global - local = 0"
    assert any(not torch.equal(p, q) for p, q in zip(t.params, start, strict=True)), "the params moved after it"


# -- 5. per-site pacing ---------------------------------------------------------------------------------------
def _sites_cfg(sites: str, *train: str):
    from hsgd.config.compose import compose_config

    return compose_config([f"topology.sites={sites}", *train])


def test_a_sites_own_pacing_wins_and_null_takes_the_run_wide_value():
    from hsgd.train.simulate import StepPacer, pacer_from_config

    cfg = _sites_cfg(
        "[{replicas:1,min_step_s:0.25,straggle_p:0.5,straggle_factor:3},{replicas:1},{replicas:1,min_step_s:0.5}]",
        "train.min_step_s=0.1",
        "train.straggle_p=0.2",
        "train.straggle_factor=2",
        "seed=7",
    )
    assert pacer_from_config(cfg, 0) == StepPacer(0.25, 0.5, 3.0, 7)
    assert pacer_from_config(cfg, 1) == StepPacer(0.1, 0.2, 2.0, 7)
    assert pacer_from_config(cfg, 2) == StepPacer(0.5, 0.2, 2.0, 7), "only min_step_s is the site's own"


def test_no_pacing_set_anywhere_gives_no_pacer():
    from hsgd.train.simulate import pacer_from_config

    cfg = _sites_cfg("[{replicas:1},{replicas:1,straggle_factor:4}]")
    assert pacer_from_config(cfg, 0) is None and pacer_from_config(cfg, 1) is None
    paced = _sites_cfg("[{replicas:1},{replicas:1,min_step_s:0.2}]")
    assert pacer_from_config(paced, 0) is None and pacer_from_config(paced, 1).min_step_s == 0.2


def test_the_expected_step_time_is_min_step_s_stretched_by_the_expected_straggle():
    from hsgd.config.sites import expected_step_s

    cfg = _sites_cfg(
        "[{replicas:1,min_step_s:0.25,straggle_p:0.5,straggle_factor:3},{replicas:1},{replicas:1,straggle_p:0.5}]",
        "train.straggle_p=0.2",
        "train.straggle_factor=2",
    )
    assert expected_step_s(cfg, 0) == pytest.approx(0.25 * (1 + 0.5 * 3))
    assert expected_step_s(cfg, 1) is None and expected_step_s(cfg, 2) is None, "no min_step_s: learned"
    run_wide = _sites_cfg(
        "[{replicas:1},{replicas:1,min_step_s:0.3,straggle_p:0}]",
        "train.min_step_s=0.1",
        "train.straggle_p=0.2",
        "train.straggle_factor=2",
    )
    assert expected_step_s(run_wide, 0) == pytest.approx(0.1 * 1.4)
    assert expected_step_s(run_wide, 1) == pytest.approx(0.3), "a site's straggle_p of 0 is its own, not null"


# -- 6. the config's refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,field,valid",
    [
        (["topology.sites=[{replicas:1},{replicas:1,min_step_s:-1}]"], "topology.sites[1].min_step_s", ">= 0"),
        (["topology.sites=[{replicas:1},{replicas:1,straggle_p:1.5}]"], "topology.sites[1].straggle_p", "[0, 1]"),
        (
            ["topology.sites=[{replicas:1},{replicas:1,straggle_factor:-2}]"],
            "topology.sites[1].straggle_factor",
            ">= 0",
        ),
        (["sync.balance=fast"], "sync.balance", "none|steps"),
    ],
)
def test_bad_balance_and_pacing_values_are_one_line_config_errors(overrides, field, valid):
    from hsgd.config import ConfigError
    from hsgd.config.compose import precheck

    with pytest.raises(ConfigError) as info:
        precheck(overrides)
    text = str(info.value)
    assert info.value.field == field and "\n" not in text and text.startswith(f"{field}:"), text
    assert "valid" in text and valid in text, text


def test_good_balance_and_pacing_values_pass_the_checks():
    from hsgd.config.compose import precheck

    precheck(
        [
            "topology.sites=[{replicas:1,min_step_s:0.25,straggle_p:1,straggle_factor:0},"
            "{replicas:1,min_step_s:0,straggle_p:0}]",
            "sync.balance=steps",
        ]
    )


def test_the_command_line_refuses_an_unknown_balance_with_exit_2_before_ray(tmp_path):
    from tests.fakes.cli import train_isolated

    result = train_isolated(tmp_path, "sync.balance=fast")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[0].startswith("hsgd: config error: sync.balance: ")
    assert not (tmp_path / "ray").exists(), "Ray started"


# -- 7. the durable plan ---------------------------------------------------------------------------------------
def test_the_round_plan_and_tokens_per_cluster_are_saved_and_read_back(tmp_path):
    from hsgd.record.run_state import STATE_FILE, RunState

    state = RunState(run_id="hsgd-bal")
    plan = plan_round(6, 20, configured=[0.1, 0.2], learned=[None, None])
    state.round_plan, state.tokens_per_cluster = plan.to_dict(), [6400, 3200]
    state.write(tmp_path)
    on_disk = json.loads((tmp_path / STATE_FILE).read_text())
    assert on_disk["round_plan"] == {"round": 6, "steps": [20, 10], "step_s": [0.1, 0.2], "source": "configured"}
    assert on_disk["tokens_per_cluster"] == [6400, 3200]
    back = RunState.load(tmp_path, "hsgd-bal")
    assert back.round_plan == plan.to_dict() and back.tokens_per_cluster == [6400, 3200]
    assert StepPlan.from_dict(back.round_plan) == replace(plan, source="recorded")
    fresh = RunState(run_id="hsgd-bal").to_dict()
    assert "round_plan" not in fresh and "tokens_per_cluster" not in fresh, "empty: an older file's keys"


def test_a_clusters_weight_counts_only_the_steps_before_its_snapshot():
    """Under sync.fragment_delay a pseudo-gradient holds the steps before the snapshot: a cluster whose
    plan the delay covers whole sends nothing and weighs nothing; without a delay, the steps reached."""
    from hsgd.core.round.machine import RoundSettings

    s = RoundSettings(steps_per_round=20, cluster_steps=(20, 5), fragment_delay=5)
    assert [s.snapshot_steps_of(c, s.steps_of(c)) for c in (0, 1)] == [15, 0]
    assert s.snapshot_steps_of(0, 12) == 12, "members short of the snapshot: the steps they reached"
    assert RoundSettings(steps_per_round=20, cluster_steps=(20, 5)).snapshot_steps_of(1, 5) == 5
    lsgd = RoundSettings(steps_per_round=20, cluster_steps=(20, 5), fragment_delay=2, inner="localsgd", inner_every=2)
    assert lsgd.snapshot_steps_of(1, 5) == 2, "moved back to the last average (after step 2)"
