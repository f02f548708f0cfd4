"""Issue 45, finding 7: a round's `sync.balance=steps` plan is re-made whenever its clusters differ
from the saved plan's. A retried round (below quorum, or after a restore) used to reuse the saved
`round_plan` of N clusters while the round's start had taken in an added site: N + 1 clusters, N
planned steps, an IndexError in the round machine."""

from __future__ import annotations

from hsgd.core.round import StepPlan


def _saved(round_index: int, steps: tuple[int, ...]) -> dict:
    return StepPlan(round_index, steps, tuple(0.1 for _ in steps), "configured").to_dict()


def test_a_saved_plan_of_two_clusters_is_remade_for_three():
    from hsgd.core.round.balance import plan_for_round

    plan, fresh = plan_for_round(
        3, _saved(3, (40, 40)), steps_per_round=40, configured=[0.1, 0.1, 0.2], learned=[None, None, None]
    )
    assert fresh, "the saved plan covers 2 clusters, the round 3: it must be planned again"
    assert plan.steps == (40, 40, 20)


def test_the_saved_plan_of_the_same_round_and_clusters_is_followed():
    from hsgd.core.round.balance import plan_for_round

    plan, fresh = plan_for_round(
        3, _saved(3, (40, 13)), steps_per_round=40, configured=[0.1, 0.1], learned=[None, None]
    )
    assert not fresh and plan.steps == (40, 13) and plan.source == "recorded"


def test_a_round_machine_of_three_clusters_runs_on_the_remade_plan():
    from hsgd.core.round.balance import plan_for_round
    from tests.fakes.round_world import make_settings

    plan, _ = plan_for_round(
        5, _saved(5, (40, 40)), steps_per_round=40, configured=[None, None, None], learned=[0.1, 0.1, 0.1]
    )
    settings = make_settings(steps_per_round=40, cluster_steps=plan.steps)
    assert [settings.steps_of(c) for c in range(3)] == [40, 40, 40]
