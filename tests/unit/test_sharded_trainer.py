"""A replica sharded over k=2 rank processes with FSDP2 (hsgd.train.sharding) against the same run
with k=1, over real gloo groups: one spawn of 4 processes (2 replicas x 2 ranks; replica groups
{0,1} and {2,3}, and the inner/outer LevelGroups of shard index j joining rank j of each replica)
and one of 2 processes (2 replicas x 1 rank), on the same seed and tokens. Each process runs:
  A. one `ddp` cluster of 2 replicas (warmed up first) with grad_accum 2 and grad clipping, one diloco round whose
     pseudo-gradient is reduced in 2 shards (one per replica) and committed by broadcast;
  B. 2 clusters of 1 replica, int4 + error feedback, 2 fragments: 2 outer rounds over level outer;
  C. one `localsgd` cluster (average every 2 steps) stopped after 2 steps, `cluster_average`, the
     final model saved by replica 0, then one step with rank 0 of each replica alone poisoned: every
     rank raises for the loss (rank 1's own loss is finite: the flags are OR'd over the replica);
  D. replica 0 of B runs one more round, then replica 1 builds a fresh trainer and loads rank j's
     `state_dict` of replica 0 (sent through the store as bytes, loaded weights_only): a `full` heal
     shard by shard. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import io
import traceback

import pytest
import torch

from hsgd.train.sharding import ReplicaRanks, rows_of
from tests.fakes.gloo_world import level_group, run_ranks

STEPS = 6  # inner steps of scenario A's round and of B's two fragment rounds (3 each)
BASE = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=4",
    "train.rounds=3",
    "train.eval_batches=2",
]
SCENARIO_A = [
    "topology.clusters=1",
    "topology.replicas_per_cluster=2",
    "sync.inner=ddp",
    f"sync.outer_every={STEPS}",
    "data.grad_accum=2",
    "optim.inner.grad_clip=0.5",
]
SCENARIO_C = [
    "topology.clusters=1",
    "topology.replicas_per_cluster=2",
    "sync.inner=localsgd",
    "sync.inner_every=2",
    "sync.outer_every=4",
]
SCENARIO_B = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=1",
    f"sync.outer_every={STEPS}",
    "sync.fragments=2",
    "sync.outer_compress=int4",
]


def _level(level: str, port: int, prefix: str, rank: int, world: int):
    return level_group(level, port if world > 1 else None, prefix, rank, world)


def _stop_after(steps: int):
    from hsgd.train.trainer import YieldNow

    def hook(phase, round_index, step_in_round):
        if phase == "inner" and step_in_round == steps:
            raise YieldNow()

    return hook


def _run(k: int, rank: int, port: int, folder: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import NonFiniteError, ReplicaTrainer

    torch.set_num_threads(1)
    replica, shard = divmod(rank, k)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    ranks = None
    if k > 1:  # the replica's own group: its k processes, as the actor layer would make it
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"sharded-k{k}/replica{replica}", store),
            rank=shard,
            world_size=k,
            timeout=timedelta(seconds=60),
        )
        ranks = ReplicaRanks(shard, k, dist.group.WORLD)

    def config(overrides):
        return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(BASE + overrides))

    out = {"rank": rank}
    # A: one ddp cluster of 2 replicas (HSDP), one round, the pseudo-gradient reduced in 2 shards
    inner = _level("inner", port, f"sharded-k{k}/a/inner/s{shard}", replica, 2)
    outer = _level("outer", port, f"sharded-k{k}/a/outer/c0/h{replica}", 0, 1)  # one cluster: itself
    t = ReplicaTrainer(config(SCENARIO_A), f"c0r{replica}", Topology(1, 2), ranks=ranks)
    t.warm_up()  # a forward/backward whose gradients are dropped: the replica's state is untouched
    report = t.run_inner(0, inner)
    t.outer_reduce(0, 1, outer, shard=replica, shards=2)
    t.outer_commit(0, inner, roots=(0, 1))
    out["a"] = {
        "eval": t.eval_loss(),
        "digest": t.param_digest(),
        "global": t.global_digest(),
        "losses": report.losses,
        "shapes": [tuple(p.shape) for p in t.params],
        "steps_done": report.steps_done,
        "tokens": report.tokens,
    }
    inner.abort()

    # C: localsgd, cluster_average, the final model, a non-finite loss on one rank of each replica
    inner = _level("inner", port, f"sharded-k{k}/c/inner/s{shard}", replica, 2)
    t = ReplicaTrainer(config(SCENARIO_C), f"c0r{replica}", Topology(1, 2), ranks=ranks)
    t.run_inner(0, inner, hook=_stop_after(2))
    out["c"] = {"eval": t.eval_loss(), "digest": t.param_digest()}
    t.cluster_average(0, 1, inner)
    out["c"]["averaged"] = t.param_digest()
    if replica == 0:
        out["c"]["saved"] = t.save_model(f"{folder}/k{k}.safetensors")["global_digest"]
    if shard == 0:
        t.poison()
    try:
        t.run_inner(0, inner, hook=_stop_after(3))  # one step: rank 1's own loss stays finite
        out["c"]["raised"] = None
    except NonFiniteError as err:
        out["c"]["raised"] = err.what
    inner.abort()

    # B: 2 clusters of 1 replica, int4 + error feedback, 2 fragments, 2 outer rounds
    cfg_b = config(SCENARIO_B)
    alone = _level("inner", port, "unused", 0, 1)
    outer = _level("outer", port, f"sharded-k{k}/b/outer/s{shard}", replica, 2)
    t = ReplicaTrainer(cfg_b, f"c{replica}r0", Topology(2, 1), ranks=ranks)
    for r in range(2):
        t.run_inner(r, alone)
        t.outer_reduce(r, 1, outer)
        t.outer_commit(r, alone, roots=(0,))
    out["b"] = {"eval": t.eval_loss(), "global": t.global_digest()}
    outer.abort()

    # D: a full heal, shard by shard, from replica 0 into a fresh replica 1
    if replica == 0:
        t.run_inner(2, alone)
        buf = io.BytesIO()
        torch.save(t.state_dict(), buf)
        store.set(f"sharded-k{k}/heal/s{shard}", buf.getvalue())
    else:
        t = ReplicaTrainer(cfg_b, "c1r0", Topology(2, 1), ranks=ranks)
        state = torch.load(io.BytesIO(store.get(f"sharded-k{k}/heal/s{shard}")), weights_only=True)
        t.load_state_dict(state, scope="full")
    out["d"] = {"digest": t.param_digest(), "global": t.global_digest(), "step": t.step, "round": t.round}
    store.get(f"sharded-k{k}/heal/s{shard}")  # replica 0 stays until its shard was read
    if k > 1:
        dist.destroy_process_group()
    return out


def _worker(k: int, folder: str, rank: int, port: int, results) -> None:
    try:
        out = _run(k, rank, port, folder)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out = {"rank": rank, "exception": traceback.format_exc()}
    results.put(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sharded"))
    sharded = run_ranks(functools.partial(_worker, 2, folder), 4, timeout_s=240, store_timeout_s=60, join_s=10)
    whole = run_ranks(functools.partial(_worker, 1, folder), 2, timeout_s=180, store_timeout_s=60, join_s=10)
    return {2: [sharded[0], sharded[2]], 1: [whole[0], whole[1]], "ranks": sharded, "folder": folder}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_every_rank_holds_a_piece_of_every_param_and_all_ranks_of_a_replica_agree(runs):
    ranks = runs["ranks"]
    assert len(ranks[0]["a"]["shapes"]) == len(ranks[1]["a"]["shapes"]) > 0
    assert ranks[0]["a"]["shapes"] == ranks[2]["a"]["shapes"], "rank 0's shapes differ between replicas"
    for a, b in ((0, 1), (2, 3)):  # the replica-level numbers are the same on each of its ranks
        assert ranks[a]["a"] == {**ranks[b]["a"], "shapes": ranks[a]["a"]["shapes"]}
        assert ranks[a]["b"] == ranks[b]["b"] and ranks[a]["c"] == ranks[b]["c"]


def test_localsgd_matches_k1_and_a_non_finite_loss_on_one_rank_fails_every_rank(runs):
    for replica in range(2):
        sharded, whole = runs[2][replica]["c"], runs[1][replica]["c"]
        assert _relative(sharded["eval"], whole["eval"]) <= 1e-4, (sharded["eval"], whole["eval"])
    assert runs[2][0]["c"]["digest"] == runs[2][1]["c"]["digest"], "localsgd left the sharded replicas apart"
    assert runs[2][0]["c"]["averaged"] == runs[2][1]["c"]["averaged"]
    assert [r["c"]["raised"] for r in runs["ranks"].values()] == ["loss"] * 4, "only rank 0 was poisoned"


def test_the_sharded_final_model_is_the_whole_model_k1_writes(runs):
    from safetensors.torch import load_file

    sharded, whole = (load_file(f"{runs['folder']}/k{k}.safetensors") for k in (2, 1))
    assert sharded.keys() == whole.keys() and len(sharded) > 0
    for name in whole:
        assert sharded[name].shape == whole[name].shape, name
        assert torch.allclose(sharded[name], whole[name], rtol=1e-4, atol=1e-5), name
    assert runs["ranks"][1]["c"]["saved"] == runs["ranks"][0]["c"]["saved"]  # rank 1 gathered, did not write


def test_hsdp_and_a_sharded_outer_round_match_k1(runs):
    for replica in range(2):
        sharded, whole = runs[2][replica]["a"], runs[1][replica]["a"]
        assert _relative(sharded["eval"], whole["eval"]) <= 1e-4, (sharded["eval"], whole["eval"])
        # grad_accum 2 with clipping: each step's loss is k=1's to fp32 rounding (1.2e-7 measured), so the
        # micro-batches' gradients accumulate exactly as k=1's; a mis-scaled micro-batch is ~1e-2 off
        assert max(_relative(s, w) for s, w in zip(sharded["losses"], whole["losses"], strict=True)) <= 1e-6
        assert sharded["steps_done"] == whole["steps_done"] == STEPS  # the round record counts them
        assert len(sharded["losses"]) == STEPS and sharded["tokens"] > 0
    a0, a1 = runs[2][0]["a"], runs[2][1]["a"]
    assert a0["digest"] == a1["digest"] and a0["global"] == a1["global"], "the two sharded replicas differ"


def test_int4_with_error_feedback_and_2_fragments_matches_k1(runs):
    for replica in range(2):
        sharded, whole = runs[2][replica]["b"], runs[1][replica]["b"]
        assert _relative(sharded["eval"], whole["eval"]) <= 1e-3, (sharded["eval"], whole["eval"])
    assert runs[2][0]["b"]["global"] == runs[2][1]["b"]["global"], "the clusters' global params differ"


@pytest.mark.parametrize("k", [1, 2])
def test_a_full_heal_shard_by_shard_makes_the_replicas_equal(runs, k):
    source, healed = runs[k][0]["d"], runs[k][1]["d"]
    assert source == healed
    assert source["step"] > runs[k][0]["d"]["round"] * (STEPS // 2), "the source ran past the commit"


def test_rows_of_splits_a_batch_evenly_and_refuses_an_uneven_one():
    x = torch.arange(12).reshape(4, 3)
    first, second = (rows_of((x, {"y": x}), ReplicaRanks(r, 2, None)) for r in range(2))
    assert torch.equal(torch.cat([first[0], second[0]]), x) and torch.equal(second[1]["y"], x[2:])
    assert rows_of(x, None) is x and rows_of(x, ReplicaRanks(0, 1, None)) is x
    with pytest.raises(ValueError, match="data.batch_size"):
        rows_of(x[:3], ReplicaRanks(0, 2, None))
    with pytest.raises(ValueError, match="rank"):
        ReplicaRanks(2, 2, None)
