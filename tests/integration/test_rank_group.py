"""A replica of k=2 rank processes as 2 Ray actors (actors/rank_group.py) on the shared local Ray, CPU,
gloo: both form the replica group through the run's store (a TCPStore in this process, behind a
rendezvous secret), build the FSDP2-sharded trainer, run one round (inner steps on a solo inner
group, the outer reduce and commit on solo groups) and must agree on the replica's digest and match
a k=1 trainer in this process on the same seed and config. And a rank that never comes: the one that
did fails within its timeout with one line naming the replica and the missing rank; the supervisor's
abort of the forming group (a rank known dead) releases it at once."""
from __future__ import annotations

import time
import uuid

import pytest
import ray
from omegaconf import OmegaConf

from actors.rank_group import RankWorker, start_rank_workers
from hsgd.train.comm import CollectiveError, abort_rendezvous, new_run_secret, rendezvous_address, start_store

CONFIG = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "data.batch_size=4",
          "train.eval_batches=2", "topology.clusters=1", "topology.replicas_per_cluster=1", "sync.inner=ddp",
          "sync.outer_every=4"]
RANK = {"num_cpus": 1}  # one rank's resources (ClusterPlacement.options without a placement group)
TIMEOUT_S = 60


def _config():
    from hsgd.config.compose import compose_config

    return compose_config(CONFIG)


@pytest.fixture
def run_store():
    """(the run's store, the master; its rendezvous address, as the replicas get it)"""
    store = start_store("127.0.0.1", TIMEOUT_S)
    yield store, rendezvous_address("127.0.0.1", store.port, new_run_secret())
    del store


def _whole_replica() -> tuple[float, list[float], int]:
    """The same round by a k=1 trainer in this process (solo groups: no communication)."""
    from hsgd.core.topology import Topology
    from hsgd.train.comm import LevelGroup
    from hsgd.train.trainer import ReplicaTrainer

    solo = {level: LevelGroup(level, "gloo", TIMEOUT_S, TIMEOUT_S) for level in ("inner", "outer")}
    for level, group in solo.items():
        group.configure(None, f"whole/{level}", rank=0, world_size=1, epoch=1)
    trainer = ReplicaTrainer(_config(), "c0r0", Topology(1, 1))
    losses = trainer.run_inner(0, solo["inner"]).losses
    trainer.outer_reduce(0, 1, solo["outer"])
    trainer.outer_commit(0, solo["inner"], (0,))
    return trainer.eval_loss(), losses, sum(p.numel() for p in trainer.params)


def _all(refs: list) -> list:
    return ray.get(refs, timeout=TIMEOUT_S * 2)


@pytest.mark.timeout(180)
def test_a_replica_of_two_rank_actors_trains_like_one_process(run_store):
    _, store_addr = run_store
    rid = "c0r0"
    workers = [RankWorker.options(**RANK).remote(rid, 0)] + start_rank_workers(rid, 2, RANK)
    assert len(workers) == 2
    try:
        prefix = f"replica-group/{rid}/{uuid.uuid4().hex[:8]}"  # one incarnation's prefix
        assert _all([w.form.remote(2, store_addr, prefix, TIMEOUT_S) for w in workers]) == [2, 2]
        cfg = OmegaConf.to_container(_config(), resolve=True)
        sizes = _all([w.build.remote(cfg, (1, 1)) for w in workers])
        for level in ("inner", "outer"):  # one replica, one cluster: each rank alone at its shard index
            _all([w.join.remote(level, "gloo", None, f"{rid}.{j}/{level}", 0, 1, 1, TIMEOUT_S)
                  for j, w in enumerate(workers)])
        losses = _all([w.run_inner.remote(0) for w in workers])
        _all([w.outer_reduce.remote(0, 1) for w in workers])
        _all([w.outer_commit.remote(0, (0,)) for w in workers])
        digests = _all([w.param_digest.remote() for w in workers])
        evals = _all([w.eval_loss.remote() for w in workers])
        _all([w.leave.remote() for w in workers])
    finally:
        for w in workers:
            ray.kill(w)
    whole_eval, whole_losses, whole_size = _whole_replica()
    assert sum(sizes) == whole_size and max(sizes) < whole_size, (sizes, whole_size)  # each rank holds a part
    assert digests[0] == digests[1], "the replica's ranks disagree on its combined digest"
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert max(abs(s - w) / abs(w) for s, w in zip(losses[0], whole_losses)) <= 1e-4, (losses[0], whole_losses)
    assert evals[0] == evals[1]
    assert abs(evals[0] - whole_eval) / abs(whole_eval) <= 1e-4, (evals[0], whole_eval)


def _form_error(worker, store_addr: str, prefix: str, timeout_s: float, during=lambda: None):
    """(the CollectiveError the worker's form raised, seconds from the call to the answer)"""
    began = time.monotonic()
    ref = worker.form.remote(2, store_addr, prefix, timeout_s)
    during()
    with pytest.raises(CollectiveError) as err:
        ray.get(ref, timeout=TIMEOUT_S)
    return err.value.cause, time.monotonic() - began


@pytest.mark.timeout(90)
def test_a_rank_that_never_comes_fails_the_other_within_its_timeout_and_an_abort_releases_it_at_once(run_store):
    store, store_addr = run_store
    worker = RankWorker.options(**RANK).remote("c1r3", 0)
    try:
        ray.get(worker.__ray_ready__.remote(), timeout=TIMEOUT_S)  # up: time only the join
        missing, took = _form_error(worker, store_addr, "replica-group/c1r3/lonely", 3.0)
        assert str(missing) == "replica c1r3: replica group: rank(s) 1 of 2 did not arrive within 3s (rank 0 waited)"
        assert missing.kind == "configure" and 3.0 <= took <= 15.0, (missing.kind, took)

        def abort():  # the supervisor, once it knows rank 1 is dead
            time.sleep(1.0)
            assert abort_rendezvous(store, store_addr, "replica-group/c1r3/aborted", "c1r3.1 died")
        aborted, took = _form_error(worker, store_addr, "replica-group/c1r3/aborted", 30.0, during=abort)
        assert str(aborted) == "replica c1r3: replica group aborted: c1r3.1 died"
        assert aborted.kind == "join_aborted" and took < 10.0, (aborted.kind, took)
    finally:
        ray.kill(worker)
