"""sync.fragment_delay with a replica of k=2 ranks (issue 34; hsgd.train.overlap, hsgd.train.sharding):
the outer reduce behind the inner steps on real gloo groups. 2 clusters of 1 replica; k=2 spawns 4
processes (replica groups {0,1} and {2,3}, each with its background group; the outer LevelGroup of
shard index j joins rank j of each replica), k=1 spawns 2, on the same seed and tokens. Each runs 3
rounds with 2 fragments and a delay of 2 steps, a slow simulated outer link keeping every rank's
reduce in flight past the round's last inner step, so its thread's agreement runs while the phase
thread's FSDP2 collectives do. Then, k=2 only, in fresh outer groups each time:
  F1. a pseudo-gradient poisoned on rank 0 of cluster 0 alone: both ranks of cluster 0 raise
      NonFiniteError at settle, cluster 1's ranks CollectiveError (cluster 0 aborted its groups);
  F2. rank 1 of cluster 1 finds its outer group aborted: every rank of both replicas raises
      CollectiveError (the ranks whose own collective succeeded learn it from the agreement);
  F3. cluster 1 never starts its reduce; cluster 0 abandons its (settle(None) on both ranks), which
      aborts both ranks' groups, while cluster 1 drops its own: both threads end at once, agreed;
  F4. then a reduce on every rank succeeds and commits: the background groups are still in step.
Without processes: a sharded reduce that ends outside its ranks' agreement (the background group's own
error, or a thread that outlives its aborted group) raises ReplicaOutOfStep: the replica fails whole.
(Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import threading
import time
import traceback

import pytest
import torch

from tests.fakes.gloo_world import run_ranks
from tests.fakes.process_group import IdleLevelGroup

STEPS, DELAY, ROUNDS = 4, 2, 3  # inner steps of a round (outer_every / fragments), the delay, rounds run
BASE = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=4",
    f"train.rounds={ROUNDS + 1}",
    "train.eval_batches=2",
    "topology.clusters=2",
    "topology.replicas_per_cluster=1",
    f"sync.outer_every={2 * STEPS}",
    "sync.fragments=2",
    f"sync.fragment_delay={DELAY}",
    "sync.outer=diloco",
]
OUTER_TIMEOUT_S = 10.0  # one outer collective's base deadline: a failure test that waits it out still ends


def _outer(port: int, prefix: str, cluster: int, link=None):
    from hsgd.train.comm import LevelGroup

    group = LevelGroup("outer", "gloo", timeout_s=OUTER_TIMEOUT_S, configure_timeout_s=60, link=link)
    group.configure(f"127.0.0.1:{port}", prefix, rank=cluster, world_size=2, epoch=1)
    return group


def _settled(background, key) -> dict:
    """What settle(key) did on this rank: {"ok": True} or the error's type and kind, and the seconds."""
    started = time.monotonic()
    try:
        background.settle(key, timeout_s=60)
        out = {"ok": True}
    except Exception as err:  # noqa: BLE001 — reported: the test reads the type and kind
        out = {
            "ok": False,
            "error": type(err).__name__,
            "kind": str(getattr(err, "kind", getattr(err, "what", ""))),
            "message": str(err),
        }
    return {**out, "seconds": time.monotonic() - started}


def _run(k: int, rank: int, port: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train.comm import LevelGroup, allow_level_overlap
    from hsgd.train.overlap import BackgroundReduce
    from hsgd.train.sharding import ReplicaRanks
    from hsgd.train.simulate import LinkModel
    from hsgd.train.trainer import ReplicaTrainer

    torch.set_num_threads(1)
    allow_level_overlap(True)  # as the Replica actor does with a fragment_delay
    cluster, shard = divmod(rank, k)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    ranks = None
    if k > 1:  # the replica's group and its background group, as actors/rank_group.py forms them
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"ov-k{k}/replica{cluster}", store),
            rank=shard,
            world_size=k,
            timeout=timedelta(seconds=60),
        )
        ranks = ReplicaRanks(shard, k, dist.group.WORLD, dist.new_group(backend="gloo", timeout=timedelta(seconds=60)))
    cfg = OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(BASE))
    alone = LevelGroup("inner", "gloo")  # one replica per cluster: its inner level does no communication
    # a slow outer link: each reduce lasts >= 1 s, far longer than the DELAY tiny steps behind it
    outer = _outer(port, f"ov-k{k}/outer/s{shard}", cluster, link=LinkModel(10.0, 1000.0))
    t = ReplicaTrainer(cfg, f"c{cluster}r0", Topology(2, 1), ranks=ranks)
    background = BackgroundReduce(t, outer, arrival_s=30.0)
    out = {"rank": rank, "rounds": []}
    for r in range(ROUNDS):
        key = (r, 1, 0, 1)
        report = t.run_inner(r, alone, at_snapshot=lambda key=key: background.start(key))
        in_flight = not background._reduce.done.is_set()
        spent = background.settle(key, timeout_s=60)
        t.outer_reduce(r, 1, outer, 0, 1)  # the buffer is there: returns at once
        t.outer_commit(r, alone, roots=(0,))
        out["rounds"].append(
            {
                "losses": report.losses,
                "in_flight_at_end": in_flight,
                "spent": spent,
                "digest": t.param_digest(),
                "global": t.global_digest(),
            }
        )
    out["eval"] = t.eval_loss()
    outer.abort()
    if k > 1:
        out["failures"] = _failures(t, store, port, cluster, shard)
        dist.destroy_process_group()
    return out


def _failures(t, store, port: int, cluster: int, shard: int) -> dict:
    """F1..F4 of the module's docstring, on round ROUNDS, each in an outer group of its own."""
    from hsgd.train.comm import LevelGroup
    from hsgd.train.overlap import BackgroundReduce

    r, found = ROUNDS, {}
    alone = LevelGroup("inner", "gloo")

    # F1: rank 0 of cluster 0 alone sends a non-finite pseudo-gradient
    outer = _outer(port, f"ov-fail/f1/s{shard}", cluster)
    background = BackgroundReduce(t, outer)

    poisoned = (cluster, shard) == (0, 0)
    kept = {}

    def poisoned_start():
        if poisoned:  # the snapshot taken just now, on this rank only
            kept["value"] = t._outer_snapshot[1][0].item()
            t._outer_snapshot[1][0] = float("nan")
        background.start((r, 1, 0, 1))

    t.run_inner(r, alone, at_snapshot=poisoned_start)  # the inner steps go on regardless
    found["f1"] = _settled(background, (r, 1, 0, 1))
    if poisoned:  # the round's snapshot is kept until its commit: F2..F4 send it healthy again
        t._outer_snapshot[1][0] = kept["value"]
    outer.abort()

    # F2: rank 1 of cluster 1 finds its outer group aborted (its peer's collective fails; the agreement tells all)
    outer = _outer(port, f"ov-fail/f2/s{shard}", cluster)
    background = BackgroundReduce(t, outer)
    if (cluster, shard) == (1, 1):
        outer.abort()
    t.run_inner(r, alone, at_snapshot=lambda: background.start((r, 2, 0, 1)))  # re-issued: no steps, the start
    found["f2"] = _settled(background, (r, 2, 0, 1))
    outer.abort()

    # F3: cluster 1 never starts; cluster 0's ranks abandon their reduce in flight while cluster 1's holders
    # drop their groups (the supervisor moved on: every holder abandons; gloo's abort alone does not end a
    # collective whose peer is alive and silent, ARCHITECTURE.md, so it ends when the peer's group goes)
    outer = _outer(port, f"ov-fail/f3/s{shard}", cluster)
    background = BackgroundReduce(t, outer, arrival_s=30.0)
    if cluster == 0:
        t.run_inner(r, alone, at_snapshot=lambda: background.start((r, 3, 0, 1)))
        reduce = background._reduce
        time.sleep(1.0)  # both ranks now wait in their shard's outer collective
        waited = not reduce.done.is_set()
        store.set(f"ov-fail/f3/waiting/s{shard}", "1")
        started = time.monotonic()
        background.settle(None, timeout_s=30)  # abandon: aborts this rank's outer group
        found["f3"] = {
            "waited": waited,
            "ended": reduce.done.is_set(),
            "seconds": time.monotonic() - started,
            "error": type(reduce.error).__name__,
            "kind": str(getattr(reduce.error, "kind", "")),
        }
    else:
        store.get(f"ov-fail/f3/waiting/s{shard}")
    outer.abort()

    # F4: every rank reduces and commits in a fresh group: the background groups are still in step
    outer = _outer(port, f"ov-fail/f4/s{shard}", cluster)
    background = BackgroundReduce(t, outer, arrival_s=30.0)
    t.run_inner(r, alone, at_snapshot=lambda: background.start((r, 4, 0, 1)))
    found["f4"] = _settled(background, (r, 4, 0, 1))
    if found["f4"]["ok"]:  # (else the test reports what settle raised)
        t.outer_reduce(r, 4, outer, 0, 1)
        t.outer_commit(r, alone, roots=(0,))
    found["f4"].update(round=t.round, digest=t.param_digest(), global_=t.global_digest())
    outer.abort()
    return found


def _worker(k: int, rank: int, port: int, results) -> None:
    try:
        out = _run(k, rank, port)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out = {"rank": rank, "exception": traceback.format_exc()}
    results.put(out)


@pytest.fixture(scope="module")
def runs() -> dict:
    """{k: {rank: out}}, spawned once for the module's tests."""
    return {
        2: run_ranks(functools.partial(_worker, 2), 4, timeout_s=300, store_timeout_s=60, join_s=10),
        1: run_ranks(functools.partial(_worker, 1), 2, timeout_s=240, store_timeout_s=60, join_s=10),
    }


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_k2_with_a_fragment_delay_matches_k1_in_eval_and_every_steps_loss(runs):
    for cluster in range(2):
        sharded, whole = runs[2][2 * cluster], runs[1][cluster]
        assert _relative(sharded["eval"], whole["eval"]) <= 1e-4, (cluster, sharded["eval"], whole["eval"])
        for r, (s, w) in enumerate(zip(sharded["rounds"], whole["rounds"], strict=True)):
            assert len(s["losses"]) == len(w["losses"]) == STEPS, (cluster, r)
            worst = max(_relative(a, b) for a, b in zip(s["losses"], w["losses"], strict=True))
            assert worst <= 1e-4, f"cluster {cluster} round {r}: a step's loss is {worst:.2e} relative off k=1's"


def test_every_ranks_reduce_ran_behind_the_inner_steps_and_the_replicas_agree(runs):
    ranks = runs[2]
    for rank, out in ranks.items():
        for r, o in enumerate(out["rounds"]):
            assert o["in_flight_at_end"], f"rank {rank} round {r}: the reduce did not overlap the inner steps"
            assert o["spent"]["outer_bytes"] > 0 and o["spent"]["outer_link_s"] >= 1.0, (rank, r, o["spent"])
    for r in range(ROUNDS):
        # a replica's ranks report its one combined digest; the clusters' global params are the same
        assert ranks[0]["rounds"][r]["digest"] == ranks[1]["rounds"][r]["digest"], f"round {r}: cluster 0's ranks"
        assert ranks[2]["rounds"][r]["digest"] == ranks[3]["rounds"][r]["digest"], f"round {r}: cluster 1's ranks"
        assert len({ranks[i]["rounds"][r]["global"] for i in range(4)}) == 1, f"round {r}: global params differ"


def test_a_pseudo_gradient_poisoned_on_one_rank_fails_the_reduce_on_both_ranks(runs):
    f1 = {rank: out["failures"]["f1"] for rank, out in runs[2].items()}
    for rank in (0, 1):  # rank 1's own shard is finite: it learns from the agreement
        assert (f1[rank]["ok"], f1[rank]["error"], f1[rank]["kind"]) == (False, "NonFiniteError", "pseudo_gradient"), (
            rank,
            f1[rank],
        )
    for rank in (2, 3):  # the other cluster's holders: their peers aborted, nobody waits out a deadline
        assert (f1[rank]["ok"], f1[rank]["error"]) == (False, "CollectiveError"), (rank, f1[rank])
    assert not [r for r, f in f1.items() if f["kind"] == "timeout"], f"a rank waited out a deadline: {f1}"


def test_an_outer_group_aborted_on_one_rank_fails_the_reduce_on_every_rank(runs):
    f2 = {rank: out["failures"]["f2"] for rank, out in runs[2].items()}
    for rank, found in f2.items():  # ranks 0 and 2's own collective (shard 0) succeeded
        assert (found["ok"], found["error"]) == (False, "CollectiveError"), (rank, found)
    assert f2[3]["kind"] == "aborted", f2[3]
    assert not [r for r, f in f2.items() if f["kind"] == "timeout"], f"a rank waited out a deadline: {f2}"


def test_abandoning_a_reduce_in_flight_aborts_both_ranks_and_the_next_reduce_commits(runs):
    for rank in (0, 1):
        f3 = runs[2][rank]["failures"]["f3"]
        assert f3["waited"] and f3["ended"], f"rank {rank}: the abandoned reduce was not in flight, or outlived settle"
        assert f3["error"] == "CollectiveError" and f3["kind"] != "timeout", (rank, f3)  # not waited out
    f4 = [runs[2][rank]["failures"]["f4"] for rank in range(4)]
    assert all(f["ok"] and f["round"] == ROUNDS + 1 for f in f4), f4
    assert f4[0]["digest"] == f4[1]["digest"] and f4[2]["digest"] == f4[3]["digest"]
    assert len({f["global_"] for f in f4}) == 1, "after the abandoned reduce the clusters committed different params"


# -- the end of a sharded reduce outside its ranks' agreement fails the replica whole (no processes) --------
class _ReduceThat:
    """A trainer of rank 0 of 2 (k=1 with `sharded=False`) whose outer_reduce raises `error`, or waits
    for `release` (a collective that outlives its aborted group); no process group is touched."""

    def __init__(self, error: BaseException | None = None, sharded: bool = True):
        from hsgd.train.sharding import ReplicaRanks

        self.ranks = ReplicaRanks(0, 2, None) if sharded else None
        self.rid, self.error, self.release = "c0r0", error, threading.Event()

    def outer_reduce(self, *args, behind: bool):
        assert behind, "a reduce behind the inner steps must say so (its ranks agree over the background group)"
        if self.error is not None:
            raise self.error
        self.release.wait(10)


@pytest.mark.parametrize(
    "error,raised",
    [
        ("collective", "CollectiveError"),  # every rank raised it at the agreement: the exchange is retried
        ("non_finite", "NonFiniteError"),
        ("backend", "ReplicaOutOfStep"),  # the background group's own error: past the agreement
    ],
)
def test_a_sharded_reduce_that_fails_outside_its_agreement_fails_the_replica_whole(error, raised):
    from hsgd.train.comm import CollectiveError
    from hsgd.train.overlap import BackgroundReduce
    from hsgd.train.trainer import NonFiniteError

    errors = {
        "collective": CollectiveError("outer: peer gone", "peer_gone"),
        "non_finite": NonFiniteError("pseudo_gradient", "c0r0: non-finite"),
        "backend": RuntimeError("[gloo] Timed out waiting 300000ms for recv operation"),
    }
    background = BackgroundReduce(_ReduceThat(errors[error]), IdleLevelGroup())
    background.start((0, 1, 0, 1))
    with pytest.raises(Exception) as info:
        background.settle((0, 1, 0, 1), timeout_s=10)
    assert type(info.value).__name__ == raised, info.value
    if raised == "ReplicaOutOfStep":
        assert "fails whole" in str(info.value) and info.value.__cause__ is errors[error]


def test_an_abandoned_sharded_reduce_that_does_not_end_fails_the_replica_whole_and_k1_returns():
    from hsgd.train.overlap import BackgroundReduce, ReplicaOutOfStep

    for sharded in (True, False):
        trainer, group = _ReduceThat(sharded=sharded), IdleLevelGroup()
        background = BackgroundReduce(trainer, group)
        background.start((0, 1, 0, 1))
        try:
            if sharded:
                with pytest.raises(ReplicaOutOfStep, match="did not end once its outer group was aborted"):
                    background.settle(None, timeout_s=0.2)
            else:  # one process: nobody to be out of step with (what k=1 always did)
                assert background.settle(None, timeout_s=0.2) is None
            assert group.aborted == 1
        finally:
            trainer.release.set()
