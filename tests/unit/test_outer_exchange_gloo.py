"""The `reduce_scatter` outer exchange on real gloo groups, one process per replica (issue 47,
Acceptance 4): three sites of unequal sizes with token weights, bf16 / int8 / int4, on the leader path
and on the sharded path with two fragments: after every commit each holder's reduced buffer is bitwise
its group's, every replica's global params are bitwise the same, and the working params agree where
they must (everywhere without fragments, within a cluster with them). Also LevelGroup.all_to_all:
chunks of unequal and zero length, and its byte counts. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from tests.fakes.configs import tiny_cfg
from tests.fakes.gloo_world import level_group, run_ranks

SIZES = (2, 3, 2)
CODECS = ("bf16", "int8", "int4")
ROUNDS = 2
EVERY = 3  # inner steps of an outer round


def _layout(rank: int) -> tuple[int, int]:
    for c, n in enumerate(SIZES):
        if rank < n:
            return c, rank
        rank -= n
    raise ValueError(rank)


def _trainers(codec: str, rid: str, topo):
    from hsgd.train.trainer import ReplicaTrainer

    base = [f"sync.outer_compress={codec}", "sync.outer_exchange=reduce_scatter", f"sync.outer_every={EVERY}"]
    streaming = [f"sync.outer_every={2 * EVERY}", "sync.fragments=2", "sync.fragment_alpha=0.5"]
    return ReplicaTrainer(tiny_cfg(base), rid, topo), ReplicaTrainer(tiny_cfg(base + streaming), rid, topo)


def _worker(rank, port, results) -> None:
    out = {"rank": rank}
    try:
        from hsgd.core.outer_plan import shard_holders, token_weights
        from hsgd.core.topology import Topology
        from hsgd.train.trainer import param_digest

        torch.set_num_threads(1)
        c, i = _layout(rank)
        topo = Topology.of_sites(SIZES)
        rid = topo.cluster_members(c)[i]
        members = [tuple(topo.cluster_members(k)) for k in range(len(SIZES))]
        holders = shard_holders(members, [m[0] for m in members], min(SIZES))
        roots = tuple(members[c].index(g[c]) for g in holders)
        weights = token_weights([n * EVERY for n in SIZES])

        inner = level_group("inner", port, f"t/inner/c{c}", i, SIZES[c])
        leader_outer = level_group("outer", port, "t/outer", c, len(SIZES)) if i == 0 else None
        my_shard = next((j for j, g in enumerate(holders) if rid in g), None)
        shard_outer = (
            level_group("outer", port, f"t/outer/s{my_shard}", c, len(SIZES)) if my_shard is not None else None
        )
        for codec in CODECS:
            lead, shard = _trainers(codec, rid, topo)
            rows = []
            for r in range(ROUNDS):
                row = {}
                for t in (lead, shard):
                    t.run_inner(r, inner)
                if leader_outer is not None:
                    lead.outer_reduce(r, 1, leader_outer, 0, 1, weights)
                    row["lead_buffer"] = (lead.last_exchange, param_digest([lead._outer_buffer[1]]))
                if shard_outer is not None:
                    shard.outer_reduce(r, 1, shard_outer, my_shard, len(holders), weights)
                    row["shard_buffer"] = (my_shard, shard.last_exchange, param_digest([shard._outer_buffer[1]]))
                lead.outer_commit(r, inner, (0,))
                shard.outer_commit(r, inner, roots)
                row.update(
                    lead_global=lead.global_digest(),
                    lead_params=lead.param_digest(),
                    shard_global=shard.global_digest(),
                    shard_params=shard.param_digest(),
                )
                rows.append(row)
            out[codec] = rows
        out["all_to_all"] = _all_to_all(port, rank)
        for g in (inner, leader_outer, shard_outer):
            if g is not None:
                g.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


def _all_to_all(port: int, rank: int) -> dict:
    """Every process in one group: rank k sends rank j a chunk of j elements (rank 0's are empty),
    each element k * 10 + j."""
    world = sum(SIZES)
    g = level_group("outer", port, "t/a2a", rank, world)
    chunks = [torch.full((j,), rank * 10 + j, dtype=torch.uint8) for j in range(world)]
    got = g.all_to_all(chunks, rank, level="outer")
    return {"got": [t.tolist() for t in got], "sent": g.bytes_sent, "received": g.bytes_received}


@pytest.fixture(scope="module")
def outs():
    return run_ranks(functools.partial(_worker), sum(SIZES), timeout_s=600, store_timeout_s=60, join_s=5)


@pytest.mark.parametrize("codec", CODECS)
def test_every_holder_and_every_replica_holds_the_same_bits_after_each_commit(outs, codec):
    for r in range(ROUNDS):
        rows = {rank: out[codec][r] for rank, out in outs.items()}
        leads = {rank: row["lead_buffer"] for rank, row in rows.items() if "lead_buffer" in row}
        assert len(leads) == len(SIZES) and len(set(leads.values())) == 1, f"{codec} round {r} leader path: {leads}"
        assert next(iter(leads.values()))[0] == "reduce_scatter"
        for j in range(min(SIZES)):
            held = {rank: row["shard_buffer"] for rank, row in rows.items() if row.get("shard_buffer", (None,))[0] == j}
            assert len(held) == len(SIZES) and len(set(held.values())) == 1, f"{codec} round {r} shard {j}: {held}"
        for key in ("lead_global", "lead_params", "shard_global"):
            got = {rank: row[key] for rank, row in rows.items()}
            assert len(set(got.values())) == 1, f"{codec} round {r}: {key} differ across replicas: {got}"
        for c in range(len(SIZES)):  # fragments: a cluster's own progress on the unsynced one is its own
            got = {rank: row["shard_params"] for rank, row in rows.items() if _layout(rank)[0] == c}
            assert len(set(got.values())) == 1, f"{codec} round {r}: cluster {c}'s working params differ: {got}"


def test_all_to_all_hands_chunk_j_of_every_rank_to_rank_j_and_counts_its_bytes(outs):
    world = sum(SIZES)
    for rank, out in outs.items():
        a2a = out["all_to_all"]
        assert a2a["got"] == [[k * 10 + rank] * rank for k in range(world)], f"rank {rank}: {a2a['got']}"
        assert a2a["sent"] == sum(range(world)) - rank, f"rank {rank} sent {a2a['sent']} bytes"
        assert a2a["received"] == rank * (world - 1), f"rank {rank} received {a2a['received']} bytes"
