"""issue 33, Build 2: the guard against a bad outer step fires once, on a global eval loss rising two
outer steps in a row while every cluster's own loss falls inside those rounds, and is silent otherwise."""

from hsgd.core.topology import Topology
from hsgd.record.outer_watch import OuterStepWatch, cluster_trends

FELL = {0: (3.0, 2.6), 1: (3.1, 2.7)}  # each cluster's (early, late) training loss in a round
ROSE = {0: (3.0, 2.6), 1: (3.1, 3.3)}  # cluster 1 got worse inside the round


def _feed(evals, trends):
    watch = OuterStepWatch("optim.outer.lr=2.0, optim.outer.momentum=0.95, optim.outer.nesterov=True")
    return [watch.observe(r, e, t) for r, (e, t) in enumerate(zip(evals, trends, strict=True))]


def test_fires_once_when_the_global_loss_rises_twice_while_every_cluster_falls():
    said = _feed([2.5, 2.6, 2.7, 2.8, 2.9], [FELL] * 5)
    assert said[:2] == [None, None]
    assert said[2] is not None and "2.5000 -> 2.6000 -> 2.7000" in said[2] and "rounds 0..2" in said[2]
    assert "optim.outer.lr=2.0" in said[2] and "optim.outer.momentum=0.95" in said[2]
    assert said[3:] == [None, None], "said once"


def test_silent_when_the_global_loss_falls_or_rises_only_once():
    assert _feed([2.5, 2.4, 2.3, 2.2, 2.1], [FELL] * 5) == [None] * 5
    assert _feed([2.5, 2.6, 2.55, 2.6, 2.58], [FELL] * 5) == [None] * 5


def test_silent_when_a_cluster_got_worse_inside_a_round():
    # the run diverges inside the clusters too (or the data got harder): not the outer step's fault
    assert _feed([2.5, 2.6, 2.7], [FELL, FELL, ROSE]) == [None] * 3
    assert _feed([2.5, 2.6, 2.7], [FELL, ROSE, FELL]) == [None] * 3
    assert _feed([2.5, 2.6, 2.7], [FELL, {}, FELL]) == [None] * 3, "no trend known: no verdict"


def test_rounds_without_an_evaluation_do_not_count():
    watch = OuterStepWatch("k")
    assert watch.observe(0, 2.5, FELL) is None
    assert watch.observe(1, None, ROSE) is None  # eval_every > 1: no eval this round
    assert watch.observe(2, 2.6, FELL) is None
    assert watch.observe(3, 2.7, FELL) is not None


def test_cluster_trends_average_each_clusters_first_and_last_thirds():
    topo = Topology(2, 2)
    got = cluster_trends(
        {"c0r0": [4.0, 3.0, 3.0, 2.0, 1.0, 0.0], "c0r1": [2.0, 2.0, 2.0], "c1r0": [5.0], "c1r1": []}, topo.cluster_of
    )
    # c0r0: first 2 mean 3.5, last 2 mean 0.5; c0r1: (2, 2); c1: fewer than 2 steps each -> left out
    assert got == {0: ((3.5 + 2.0) / 2, (0.5 + 2.0) / 2)}
