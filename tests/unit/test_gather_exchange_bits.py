"""The `gather` outer exchange keeps today's bits (issue 47, Build 0 / Acceptance 5): a fixed exchange
of 3 clusters, int4, unequal token weights, through the trainer's own `_reduce_piece` over an
in-process outer group, gives every holder the reduced buffer whose sha256 was recorded before the
`reduce_scatter` exchange existed. The inputs are made with integer arithmetic only (no RNG, no
transcendental functions), so the digest depends on the codec and the reduction alone."""

from __future__ import annotations

import threading

import torch
from omegaconf import open_dict

from benchmarks.outer_sweep import ThreadGroup
from hsgd.core.topology import Topology
from hsgd.train.trainer import ReplicaTrainer, param_digest
from tests.fakes.configs import tiny_cfg

CLUSTERS = 3
NUMEL = 3 * 4096 + 1000  # several codec blocks and a partial last one
WEIGHTS = (0.5, 1.25, 1.25)
# recorded at 5049c48 (before issue 47 changed anything), int4
PINNED = "c8b01f1f7fe21e6b24af70f429f0d491597d0bc41396624c1a186758438ec8ff"


def _piece(cluster: int) -> torch.Tensor:
    """A deterministic fp32 vector with blocks of very different magnitudes (exact in fp32)."""
    i = torch.arange(NUMEL, dtype=torch.int64)
    mixed = (i * 2654435761 + cluster * 40503) % 65536 - 32768  # in [-32768, 32767]
    scale = 2.0 ** (-((i // 256 + cluster) % 7) - 12)  # a power of two per block: the product is exact
    return mixed.to(torch.float32) * scale.to(torch.float32)


def _gather_trainer(cluster: int) -> ReplicaTrainer:
    cfg = tiny_cfg(["sync.outer_compress=int4", f"topology.clusters={CLUSTERS}", "topology.replicas_per_cluster=1"])
    with open_dict(cfg.sync):  # the exchange pinned here, whatever the default is
        cfg.sync.outer_exchange = "gather"
    return ReplicaTrainer(cfg, f"c{cluster}r0", Topology(CLUSTERS, 1))


def _exchange(trainers: list[ReplicaTrainer], weights: tuple[float, ...]) -> list[torch.Tensor]:
    group = ThreadGroup(len(trainers))
    results: list = [None] * len(trainers)
    errors: list[BaseException] = []

    def reduce(k: int) -> None:
        try:
            results[k] = trainers[k]._reduce_piece(_piece(k), ThreadGroup.Rank(group, k), weights)
        except BaseException as err:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(err)
            group._barrier.abort()

    threads = [threading.Thread(target=reduce, args=(k,)) for k in range(len(trainers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def test_the_gather_exchange_keeps_the_reduced_bits_recorded_before_issue_47():
    trainers = [_gather_trainer(k) for k in range(CLUSTERS)]
    reduced = _exchange(trainers, WEIGHTS)
    digests = [param_digest([r]) for r in reduced]
    assert len(set(digests)) == 1, f"the holders' reduced buffers differ: {digests}"
    assert digests[0] == PINNED, f"the gather exchange's bits changed: {digests[0]} (pinned {PINNED})"
