"""hsgd.train.trainer: the promises one replica keeps when phases are retried or it is healed."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from hsgd.config.schema import HsgdConfig
from hsgd.core.topology import Topology
from hsgd.train.comm import CollectiveError
from hsgd.train.data import load_corpus
from hsgd.train.trainer import Behind, ReplicaTrainer


def _cfg(**sync):
    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 16, 2, 16
    cfg.data.batch_size, cfg.train.eval_batches = 2, 1
    cfg.sync.outer_every = 3
    for key, value in sync.items():
        cfg.sync[key] = value
    return cfg


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, 0.1, block_size=16)


def _trainer(corpus, rid="c0r0", **sync):
    return ReplicaTrainer(_cfg(**sync), rid, Topology(2, 2), corpus=corpus)


class PeerMeanGroup:
    """An inner group whose other member holds `peer` params: allreduce_mean averages with them.
    `fail_after_apply` models a member that got the result while its peer's call failed."""

    level, rank, world_size, bytes_sent = "inner", 0, 2, 0

    def __init__(self, peer: list[torch.Tensor], fail_after_apply: bool = False):
        self.peer, self.fail_after_apply = peer, fail_after_apply

    def allreduce_mean(self, tensors, *, level):
        for t, p in zip(tensors, self.peer):
            t.copy_((t + p) / 2)
        if self.fail_after_apply:
            raise CollectiveError("inner: peer died after the reduction")


class OuterOf:
    level, rank, world_size, bytes_sent = "outer", 0, 2, 0

    def __init__(self):
        self.calls = 0

    def allreduce_mean(self, tensors, *, level):
        self.calls += 1


def test_phase_call_for_a_round_not_reached_answers_behind_never_done(corpus):
    t = _trainer(corpus)
    with pytest.raises(Behind):
        t.run_inner(1, OuterOf())
    with pytest.raises(Behind):
        t.outer_reduce(2, 0, OuterOf())
    assert (t.round, t.step) == (0, 0)


def test_retried_cluster_average_never_averages_an_averaged_replica_again(corpus):
    t = _trainer(corpus, inner="none")
    mine = [p.detach().clone() for p in t.params]
    peer = [torch.full_like(p, 1.0) for p in t.params]
    with pytest.raises(CollectiveError):  # averaged here, but the peer failed: the call is retried
        t.cluster_average(0, 5, PeerMeanGroup(peer, fail_after_apply=True))
    t.cluster_average(0, 6, PeerMeanGroup(peer))  # retry under a new epoch
    for p, m, q in zip(t.params, mine, peer):
        assert torch.equal(p.detach(), (m + q) / 2), "the retry averaged the already-averaged params"
    before = [p.detach().clone() for p in t.params]
    t.cluster_average(0, 6, PeerMeanGroup(peer))  # re-issued for the same (round, epoch): a no-op
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, t.params))


def test_outer_buffer_is_keyed_by_round_and_epoch(corpus):
    t = _trainer(corpus)
    outer = OuterOf()
    t.outer_reduce(0, 3, outer)
    t.outer_reduce(0, 3, outer)  # the same (round, epoch): idempotent
    assert outer.calls == 1
    t.outer_reduce(0, 4, outer)  # a new epoch never reuses the old buffer
    assert outer.calls == 2 and t._outer_buffer[:2] == (0, 4)


def test_global_heal_gives_every_cluster_member_the_same_inner_optimizer_state(corpus):
    donor = _trainer(corpus, "c1r0")
    a, b = _trainer(corpus, "c0r0"), _trainer(corpus, "c0r1")
    group = type("Solo", (), {"level": "inner", "rank": 0, "world_size": 1, "bytes_sent": 0,
                              "allreduce_mean": lambda self, t, level: None})()
    a.run_inner(0, group)  # a has AdamW moments, b is fresh (as if restarted)
    state = donor.global_state()
    a.load_state_dict(state, scope="global")
    b.load_state_dict(state, scope="global")
    sa, sb = a.inner_opt.state_dict(), b.inner_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name, value in sa["state"][k].items():
            assert torch.equal(value, sb["state"][k][name]), f"inner optimizer state {k}.{name} differs"
    assert (a.round, a.step) == (b.round, b.step) == (0, 0)
    assert a.param_digest() == b.param_digest() == donor.global_digest()
