"""A replica's state through a sharded (DCP) checkpoint, resharded on load, over real gloo: one spawn of
3 processes — ranks 0 and 1 are one replica of k=2 (FSDP2, its own replica group), rank 2 a replica of
k=1 — on the same seed and config (2 rounds of diloco with int4 + error feedback, so the inner AdamW
moments, the outer momentum and the residual all exist). Phase 1: each trains and writes
`ReplicaTrainer.sharded_state()` with hsgd.train.dcp_checkpoint (k=1 also its `.pt` state_dict).
Phase 2: a fresh k=1 trainer loads the k=2 checkpoint, a fresh k=2 replica loads the k=1 checkpoint,
and the k=2 replica loads the k=1 `.pt` cut to its shards (`rank_slice`): every whole tensor (params,
AdamW moments and step, global params, outer momentum, residual) equals the writer's bit for bit.
(Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import os
import traceback
import warnings

import pytest
import torch

from tests.fakes.gloo_world import level_group, run_ranks

CONFIG = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "data.batch_size=4",
    "train.rounds=3",
    "train.eval_batches=2",
    "topology.clusters=1",
    "topology.replicas_per_cluster=1",
    "sync.outer_every=3",
    "sync.outer_compress=int4",
]
ROUNDS = 2


def _level(level: str, prefix: str):
    return level_group(level, None, prefix, 0, 1)  # one cluster of one replica: itself


def _trainer(ranks):
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import ReplicaTrainer

    cfg = OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist(CONFIG))
    return ReplicaTrainer(cfg, "c0r0", Topology(1, 1), ranks=ranks)


def _whole_state(t) -> dict:
    """sha256 of every whole tensor of the trainer's state, by kind (k=2: gathered, a collective)."""
    from hsgd.train import sharding
    from hsgd.train.trainer import param_digest

    inner = t.inner_opt.state_dict()["state"]
    sgd = t.outer_opt.state_dict()["sgd"]["state"]
    n = len(t.params)
    kinds = {
        "param": list(t.params),
        "global": list(t.outer_opt.global_params),
        "exp_avg": [inner[i]["exp_avg"] for i in range(n)],
        "exp_avg_sq": [inner[i]["exp_avg_sq"] for i in range(n)],
        "momentum": [sgd[i]["momentum_buffer"] for i in range(n)],
        "residual": list(t.outer_residual),
    }
    whole = {
        kind: param_digest(ts if t.ranks is None else sharding.full_tensors(ts, t.sharded))
        for kind, ts in kinds.items()
    }
    return {
        **whole,
        "round": t.round,
        "step": t.step,
        "adam_steps": sorted({float(inner[i]["step"]) for i in range(n)}),
        "eval": t.eval_loss(),
    }


def _run(folder: str, rank: int, port: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from hsgd.train import checkpoint, dcp_checkpoint, sharding
    from hsgd.train.sharding import ReplicaRanks
    from hsgd.train.trainer import param_digest

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    k = 2 if rank < 2 else 1
    ranks, group = None, None
    if k == 2:  # the replica's own group, as actors/rank_group.py makes it
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("replica", store), rank=rank, world_size=2, timeout=timedelta(seconds=60)
        )
        ranks, group = ReplicaRanks(rank, 2, dist.group.WORLD), dist.group.WORLD
    written = os.path.join(folder, f"k{k}")
    # phase 1: train ROUNDS rounds and write
    t = _trainer(ranks)
    inner, outer = _level("inner", f"inner/{rank}"), _level("outer", f"outer/{rank}")
    for r in range(ROUNDS):
        t.run_inner(r, inner)
        t.outer_reduce(r, 1, outer)
        t.outer_commit(r, inner, roots=(0,))
    out = {"rank": rank, "written": _whole_state(t)}
    dcp_checkpoint.save_sharded(
        t.sharded_state(), written, group=group, manifest_extra={"round": t.round}, timeout_s=60
    )
    if k == 1:
        checkpoint.save_replica_state(folder, "k1", t.state_dict())
    store.set(f"written/{rank}", "1")
    store.wait([f"written/{r}" for r in range(3)], timedelta(seconds=120))

    # phase 2: fresh trainers load the other k's checkpoint (and k=2 the k=1 file, cut to its shards)
    fresh = _trainer(ranks)
    out["fresh_param"] = param_digest(
        fresh.params if ranks is None else sharding.full_tensors(fresh.params, fresh.sharded)
    )
    target = fresh.sharded_template()
    manifest = dcp_checkpoint.load_sharded(
        target, os.path.join(folder, "k1" if k == 2 else "k2"), group=group, timeout_s=60
    )
    fresh.load_sharded_state(target)
    out["loaded"] = {**_whole_state(fresh), "ranks_written": manifest["ranks"]}
    if k == 2:
        fresh = _trainer(ranks)
        fresh.load_state_dict(fresh.rank_slice(checkpoint.load_replica_state(folder, "k1")), scope="full")
        out["sliced"] = _whole_state(fresh)
        with pytest.raises(ValueError, match="cuts to"):  # a file of another model's shapes is refused, not cut
            state = checkpoint.load_replica_state(folder, "k1")
            state["params"][0] = torch.zeros(3, *state["params"][0].shape[1:])
            fresh.rank_slice(state)
        dist.destroy_process_group()
    return out


def _worker(folder: str, rank: int, port: int, results) -> None:
    try:
        out = _run(folder, rank, port)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out = {"rank": rank, "exception": traceback.format_exc()}
    results.put(out)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sharded-state"))
    return run_ranks(functools.partial(_worker, folder), 3, timeout_s=300, store_timeout_s=120, join_s=10)


WHOLE = ("param", "global", "exp_avg", "exp_avg_sq", "momentum", "residual", "round", "step", "adam_steps")


def _same(loaded: dict, written: dict) -> list[str]:
    return [key for key in WHOLE if loaded[key] != written[key]]


def test_a_checkpoint_written_by_two_ranks_loads_into_one_rank_bitwise(world):
    written, loaded = world[0]["written"], world[2]["loaded"]
    assert written == world[1]["written"], "the two ranks of the writer disagree on the whole state"
    assert not _same(loaded, written), f"differs after k=2 -> k=1: {_same(loaded, written)}"
    assert loaded["ranks_written"] == 2 and written["round"] == ROUNDS
    assert abs(loaded["eval"] - written["eval"]) <= 1e-5 * abs(written["eval"]), (loaded["eval"], written["eval"])


def test_a_checkpoint_written_by_one_rank_loads_into_two_ranks_bitwise(world):
    written = world[2]["written"]
    for rank in (0, 1):
        loaded = world[rank]["loaded"]
        assert not _same(loaded, written), f"rank {rank} differs after k=1 -> k=2: {_same(loaded, written)}"
        assert loaded["ranks_written"] == 1


def test_a_one_rank_file_cut_to_two_ranks_shards_is_the_same_state(world):
    written = world[2]["written"]
    for rank in (0, 1):
        sliced = world[rank]["sliced"]
        assert not _same(sliced, written), f"rank {rank} differs after the k=1 file was cut: {_same(sliced, written)}"
    # the file's state and the DCP checkpoint's state are one state
    assert world[0]["sliced"] == {key: value for key, value in world[0]["loaded"].items() if key != "ranks_written"}


def test_a_fresh_replica_differs_from_the_trained_one_it_loads(world):
    # (so the bitwise comparisons above compare a load, not two untouched builds from one seed)
    for rank, writer in ((0, 2), (2, 0)):
        assert world[rank]["fresh_param"] != world[writer]["written"]["param"], rank
