"""The replica group of a replica of k ranks (actors/rank_group.py), on the shared local Ray, CPU,
gloo: a rank that never comes fails the one that came within its timeout, with one line naming the
replica and the missing rank; an abort of the forming group (a rank known dead) releases it at once.
A whole replica of k ranks training like k=1 through jobs.train is tests/integration/test_gpus_per_replica.py."""

from __future__ import annotations

import time

import pytest
import ray

from actors.rank_group import form_replica_group
from hsgd.train.comm import CollectiveError, abort_rendezvous, new_run_secret, rendezvous_address, start_store

RANK = {"num_cpus": 1}
TIMEOUT_S = 60


@ray.remote(max_restarts=0)
class _Rank:
    """One process that joins a replica group as rank `rank` (what a Replica actor's build does first)."""

    def __init__(self, rid: str, rank: int):
        self.rid, self.rank = rid, rank

    def form(self, size: int, store_addr: str, prefix: str, timeout_s: float) -> int:
        return form_replica_group(self.rank, size, store_addr, prefix, timeout_s, replica=self.rid).size


@pytest.fixture
def run_store():
    """(a store, the master; its rendezvous address)"""
    store = start_store("127.0.0.1", TIMEOUT_S)
    yield store, rendezvous_address("127.0.0.1", store.port, new_run_secret())
    del store


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
    worker = _Rank.options(**RANK).remote("c1r3", 0)
    try:
        ray.get(worker.__ray_ready__.remote(), timeout=TIMEOUT_S)  # up: time only the join
        missing, took = _form_error(worker, store_addr, "replica-group/c1r3/lonely", 3.0)
        assert str(missing) == "replica c1r3: replica group: rank(s) 1 of 2 did not arrive within 3s (rank 0 waited)"
        assert missing.kind == "configure" and took >= 3.0, (missing.kind, took)  # its timeout, not sooner

        def abort():  # the supervisor, once it knows rank 1 is dead
            time.sleep(1.0)
            assert abort_rendezvous(store, store_addr, "replica-group/c1r3/aborted", "c1r3.1 died")

        aborted, took = _form_error(worker, store_addr, "replica-group/c1r3/aborted", 30.0, during=abort)
        assert str(aborted) == "replica c1r3: replica group aborted: c1r3.1 died"
        # released by the abort (its kind), not by its 30-s timeout (kind configure)
        assert aborted.kind == "join_aborted", (aborted.kind, took)
    finally:
        ray.kill(worker)
