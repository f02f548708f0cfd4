"""The token-weighted outer mean (issue 32): each cluster's pseudo-gradient weighted by the tokens
it trained in the round. Pure weights first, then real gloo groups, one process per replica: the
reduced buffer equals the hand-computed weighted average on the leader path and the sharded path,
uncompressed and int4 (weighted after decoding), and weights of 1.0 are bitwise the plain mean.
(Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from hsgd.core.outer_plan import token_weights
from tests.fakes.configs import tiny_cfg
from tests.fakes.gloo_world import level_group, run_ranks

SIZES = (2, 2, 2)
UNEQUAL = (0.5, 1.25, 1.25)  # e.g. a site that trained a fifth of the others' tokens
GATHER = "sync.outer_exchange=gather"  # each holder decodes every cluster's payload: the mean computed here
CASES = [(codec, weights) for codec in ("none", "int4") for weights in ((), (1.0, 1.0, 1.0), UNEQUAL)]


def test_weights_are_tokens_over_their_mean_and_empty_when_equal():
    assert token_weights([60, 40, 20]) == (1.5, 1.0, 0.5)  # live members x steps: 3, 2 and 1 replicas
    assert token_weights([3 * 20, 3 * 10]) == (4 / 3, 2 / 3)  # equal sizes, unequal steps
    assert token_weights([40, 40, 40]) == () and token_weights([7]) == ()  # the plain mean, nothing multiplied
    weights = token_weights([5, 9, 13, 2])
    assert sum(weights) == pytest.approx(len(weights))


def _worker(rank, port, results) -> None:
    out = {"rank": rank}
    try:
        from hsgd.core.outer_plan import shard_holders
        from hsgd.core.topology import Topology
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        c, i = divmod(rank, SIZES[0])
        topo = Topology.of_sites(SIZES)
        rid = topo.cluster_members(c)[i]
        members = [tuple(topo.cluster_members(k)) for k in range(len(SIZES))]
        holders = shard_holders(members, [m[0] for m in members], 2)

        inner = level_group("inner", port, f"t/inner/c{c}", i, SIZES[c])
        leader_outer = level_group("outer", port, "t/outer", c, len(SIZES)) if i == 0 else None
        my_shard = next((j for j, g in enumerate(holders) if rid in g), None)
        shard_outer = (
            level_group("outer", port, f"t/outer/s{my_shard}", c, len(SIZES)) if my_shard is not None else None
        )
        for codec, weights in CASES:
            t = ReplicaTrainer(tiny_cfg([f"sync.outer_compress={codec}", "sync.outer_every=3", GATHER]), rid, topo)
            t.run_inner(0, inner)
            # plain lists: a tensor through the queue is shared memory, gone with the process
            rec = {"pseudo_gradient": t._round_pseudo_gradient(0).tolist()}
            if leader_outer is not None:
                t.outer_reduce(0, 1, leader_outer, 0, 1, weights)
                rec["leader"] = t._outer_buffer[1].tolist()
            if shard_outer is not None:
                t.outer_reduce(0, 2, shard_outer, my_shard, 2, weights)
                rec["shard"] = (my_shard, t._outer_buffer[1].tolist())
            out[(codec, weights)] = rec
        for g in (inner, leader_outer, shard_outer):
            if g is not None:
                g.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def outs():
    return run_ranks(functools.partial(_worker), sum(SIZES), timeout_s=300, store_timeout_s=60, join_s=5)


def _expected(outs, codec, weights, numel):
    """Sum over clusters, in cluster (outer-rank) order, of weight x what it sent (decoded), / n."""
    from hsgd.train.codec import make_codec

    sent = [torch.tensor(outs[c * SIZES[0]][(codec, weights)]["pseudo_gradient"]) for c in range(len(SIZES))]
    if codec != "none":
        code = make_codec(codec, 0.01)
        sent = [code.decode(code.encode(g), g.numel()) for g in sent]
    mean = torch.zeros(numel)
    for w, g in zip(weights or (1.0,) * len(SIZES), sent, strict=True):
        mean += g * w
    return mean / len(SIZES)


def _both_paths_ran(outs, case) -> None:
    """Each cluster's leader (its first rank) reduced on the leader path, and both shards were reduced
    by one rank of every cluster: the checks below read records that exist."""
    leaders = sorted(r for r, o in outs.items() if "leader" in o[case])
    assert leaders == [c * SIZES[0] for c in range(len(SIZES))], f"{case}: leader-path records from {leaders}"
    shards: dict[int, list[int]] = {}
    for r, o in outs.items():
        if "shard" in o[case]:
            shards.setdefault(o[case]["shard"][0], []).append(r)
    assert sorted(shards) == [0, 1] and all(len(rs) == len(SIZES) for rs in shards.values()), (
        f"{case}: sharded-path records (shard -> ranks) {shards}"
    )


@pytest.mark.parametrize("codec", ["none", "int4"])
def test_the_reduced_mean_is_the_hand_computed_token_weighted_average_on_both_paths(outs, codec):
    from hsgd.core.outer_plan import shard_bounds
    from hsgd.train.codec import ALIGN

    numel = len(outs[0][(codec, UNEQUAL)]["pseudo_gradient"])
    expected = _expected(outs, codec, UNEQUAL, numel)
    plain = _expected(outs, codec, (), numel)
    assert not torch.allclose(expected, plain), "the weights must change the mean for this check to mean anything"
    _both_paths_ran(outs, (codec, UNEQUAL))
    for out in outs.values():
        rec = out[(codec, UNEQUAL)]
        if "leader" in rec:
            torch.testing.assert_close(torch.tensor(rec["leader"]), expected, rtol=1e-5, atol=1e-7)
        if "shard" in rec:
            j, piece = rec["shard"]
            lo, hi = shard_bounds(numel, 2, ALIGN)[j]
            torch.testing.assert_close(torch.tensor(piece), expected[lo:hi], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("codec", ["none", "int4"])
def test_weights_of_one_are_bitwise_the_plain_mean_on_both_paths(outs, codec):
    _both_paths_ran(outs, (codec, ()))
    _both_paths_ran(outs, (codec, (1.0, 1.0, 1.0)))
    for rank, out in outs.items():
        plain, ones = out[(codec, ())], out[(codec, (1.0, 1.0, 1.0))]
        for path in ("leader", "shard"):
            if path in plain:
                a, b = (plain[path], ones[path]) if path == "leader" else (plain[path][1], ones[path][1])
                assert a == b, f"rank {rank} {codec} {path}: weights of 1.0 changed the plain mean's bits"
