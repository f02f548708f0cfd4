"""A `reduce_scatter` outer exchange that fails part-way is a failed outer phase like any other (issue 47,
Build 2): whichever of its two collectives fails, every holder's outer_reduce raises CollectiveError and
keeps no buffer, its params and error-feedback residual untouched; the retry under a new epoch reduces
to the same bits as an exchange that never failed, and commits as it does. Three sites of one replica,
int4, unequal token weights, on an in-process outer group."""

from __future__ import annotations

import pytest

from hsgd.core.topology import Topology
from hsgd.train.comm import CollectiveError, LevelGroup
from hsgd.train.trainer import ReplicaTrainer, param_digest
from tests.fakes.configs import tiny_cfg
from tests.fakes.exchange_world import run_holders

SITES = 3
WEIGHTS = (0.5, 1.25, 1.25)


def _trainers() -> list[ReplicaTrainer]:
    cfg = tiny_cfg(["sync.outer_compress=int4", "sync.outer_every=3", "sync.outer_exchange=auto"])
    topo = Topology(SITES, 1)
    solo = LevelGroup("inner")
    trainers = [ReplicaTrainer(cfg, f"c{k}r0", topo) for k in range(SITES)]
    for t in trainers:
        t.run_inner(0, solo)
    return trainers


def _reduce(trainers, epoch: int, fail_at: str | None = None) -> list:
    def work(k, outer):
        try:
            trainers[k].outer_reduce(0, epoch, outer, 0, 1, WEIGHTS)
        except CollectiveError as err:
            return err
        return param_digest([trainers[k]._outer_buffer[1]])

    return run_holders(work, SITES, fail_at=fail_at)[0]


@pytest.mark.parametrize("fail_at", ["all_to_all", "all_gather"])
def test_a_failed_reduce_scatter_keeps_nothing_and_its_retry_gives_the_fault_free_bits(fail_at):
    reference = _trainers()
    expected = _reduce(reference, epoch=1)
    assert len(set(expected)) == 1 and all(t.last_exchange == "reduce_scatter" for t in reference)

    trainers = _trainers()
    before = [(t.param_digest(), t.global_digest(), t.outer_residual) for t in trainers]
    failed = _reduce(trainers, epoch=1, fail_at=fail_at)
    for k, (t, answer) in enumerate(zip(trainers, failed, strict=True)):
        assert isinstance(answer, CollectiveError) and answer.kind == "peer_gone", f"site {k}: {answer!r}"
        assert t._outer_buffer is None, f"site {k} kept a buffer of a failed exchange"
        assert (t.param_digest(), t.global_digest(), t.outer_residual) == before[k], f"site {k}'s state moved"

    assert _reduce(trainers, epoch=2) == expected, "the retry's reduced buffer differs from the fault-free one"
    solo = LevelGroup("inner")
    for t, ref in zip(trainers, reference, strict=True):
        t.outer_commit(0, solo, (0,))
        ref.outer_commit(0, solo, (0,))
        assert t.global_digest() == ref.global_digest() and t.param_digest() == ref.param_digest()
        assert param_digest(t.outer_residual) == param_digest(ref.outer_residual)
