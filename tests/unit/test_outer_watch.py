"""issue 33, Build 2: the guard against a bad outer step fires once, on a rising global eval loss
while every cluster's own loss falls, and is silent otherwise."""
from hsgd.core.topology import Topology
from hsgd.record.outer_watch import OuterStepWatch, cluster_losses


def _feed(evals, losses):
    watch = OuterStepWatch("optim.outer.lr=2.0, optim.outer.momentum=0.95, optim.outer.nesterov=True")
    return [watch.observe(r, e, l) for r, (e, l) in enumerate(zip(evals, losses))]


FALLING = [{0: 3.0, 1: 3.1}, {0: 2.8, 1: 2.9}, {0: 2.6, 1: 2.7}, {0: 2.4, 1: 2.5}, {0: 2.2, 1: 2.3}]


def test_fires_once_when_the_global_loss_rises_twice_while_every_cluster_falls():
    said = _feed([2.5, 2.6, 2.7, 2.8, 2.9], FALLING)
    assert said[:2] == [None, None]
    assert said[2] is not None and "2.5000 -> 2.6000 -> 2.7000" in said[2] and "rounds 0..2" in said[2]
    assert "optim.outer.lr=2.0" in said[2] and "optim.outer.momentum=0.95" in said[2]
    assert said[3:] == [None, None], "said once"


def test_silent_when_the_global_loss_falls_or_rises_only_once():
    assert _feed([2.5, 2.4, 2.3, 2.2, 2.1], FALLING) == [None] * 5
    assert _feed([2.5, 2.6, 2.55, 2.6, 2.58], FALLING) == [None] * 5


def test_silent_when_a_cluster_rises_too():
    # the whole run diverges (or the data got harder): not the outer step's fault
    losses = [dict(d) for d in FALLING]
    losses[1][1], losses[2][1] = 3.2, 3.3
    assert _feed([2.5, 2.6, 2.7], losses[:3]) == [None] * 3


def test_rounds_without_an_evaluation_do_not_count():
    watch = OuterStepWatch("k")
    assert watch.observe(0, 2.5, FALLING[0]) is None
    assert watch.observe(1, None, FALLING[1]) is None  # eval_every > 1: no eval this round
    assert watch.observe(2, 2.6, FALLING[2]) is None
    assert watch.observe(3, 2.7, FALLING[3]) is not None


def test_cluster_losses_means_each_clusters_replicas():
    topo = Topology(2, 2)
    got = cluster_losses({"c0r0": 2.0, "c0r1": 4.0, "c1r0": 1.0}, topo.cluster_of)
    assert got == {0: 3.0, 1: 1.0}
