"""The outer exchange on real gloo groups, one process per replica: the sharded path equals the
leader path (equal and unequal live cluster sizes, uncompressed and compressed), one fragment with
no mixing is plain DiLoCo bitwise, and with several fragments each round changes exactly its
fragment. (Spawns processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from tests.fakes.configs import BASE  # noqa: F401
from tests.fakes.configs import tiny_cfg as _cfg
from tests.fakes.gloo_world import level_group, run_ranks


def _layout(sizes, rank):
    """(cluster, index in cluster) of a process rank, clusters of `sizes` live members."""
    for c, n in enumerate(sizes):
        if rank < n:
            return c, rank
        rank -= n
    raise ValueError(rank)


def _paths_worker(sizes, codecs, rounds, rank, port, results) -> None:
    """Each replica trains two trainers on the same data, one exchanging on the leader path and
    one sharded, and reports their global params after every round."""
    out = {"rank": rank}
    try:
        from hsgd.core.outer_plan import shard_holders
        from hsgd.core.topology import Topology
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        c, i = _layout(sizes, rank)
        topo = Topology(len(sizes), max(sizes))
        rid = topo.cluster_members(c)[i]
        members = [tuple(topo.cluster_members(k)[:n]) for k, n in enumerate(sizes)]
        leaders = [m[0] for m in members]
        holders = shard_holders(members, leaders, min(sizes))

        inner = level_group("inner", port, f"t/inner/c{c}", i, sizes[c])
        leader_outer = level_group("outer", port, "t/outer", c, len(sizes)) if i == 0 else None
        my_shard = next((j for j, g in enumerate(holders) if rid in g), None)
        shard_outer = (
            level_group("outer", port, f"t/outer/s{my_shard}", c, len(sizes)) if my_shard is not None else None
        )
        roots = tuple(members[c].index(g[c]) for g in holders)
        for codec in codecs:
            cfg = _cfg([f"sync.outer_compress={codec}", "sync.outer_every=3"])
            lead, shard = ReplicaTrainer(cfg, rid, topo), ReplicaTrainer(cfg, rid, topo)
            out[codec] = []
            for r in range(rounds):
                for t in (lead, shard):
                    t.run_inner(r, inner)
                if leader_outer is not None:
                    lead.outer_reduce(r, 1, leader_outer, 0, 1)
                lead.outer_commit(r, inner, (0,))
                if shard_outer is not None:
                    shard.outer_reduce(r, 1, shard_outer, my_shard, len(holders))
                shard.outer_commit(r, inner, roots)
                out[codec].append(
                    {
                        "max_diff": max(
                            float((a - b).abs().max())
                            for a, b in zip(lead.outer_opt.global_params, shard.outer_opt.global_params, strict=True)
                        ),
                        "scale": max(float(a.abs().max()) for a in lead.outer_opt.global_params),
                        "digest": shard.global_digest(),
                        "param_digest": shard.param_digest(),
                        "lead_digest": lead.global_digest(),
                    }
                )
        for g in (inner, leader_outer, shard_outer):
            if g is not None:
                g.abort()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module", params=[(2, 2), (3, 2)], ids=["equal-2x2", "unequal-3+2"])
def paths(request):
    sizes = request.param
    worker = functools.partial(_paths_worker, sizes, ("none", "int8"), 2)
    return sizes, run_ranks(worker, sum(sizes), timeout_s=300, store_timeout_s=60, join_s=5)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_sharded_path_equals_the_leader_path_within_fp32_rounding(paths, codec):
    sizes, outs = paths
    for rank, out in outs.items():
        for r, rec in enumerate(out[codec]):
            assert rec["max_diff"] <= 1e-6 * max(1.0, rec["scale"]), (
                f"{sizes} {codec}: rank {rank} round {r}: sharded vs leader global params differ by {rec['max_diff']}"
            )


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_every_replica_holds_the_same_global_params_and_each_cluster_the_same_params(paths, codec):
    sizes, outs = paths
    for r in range(2):
        assert len({o[codec][r]["digest"] for o in outs.values()}) == 1, (
            f"{sizes} {codec} round {r}: global digests differ"
        )
        assert len({o[codec][r]["param_digest"] for o in outs.values()}) == 1, (
            f"{sizes} {codec} round {r}: with one fragment and alpha 0 every replica's params are the global ones"
        )


# -- streaming: fragments and mixing --------------------------------------------------------------------
def _streaming_worker(rank, port, results) -> None:
    """Two clusters of one replica: plain DiLoCo computed by hand next to the trainer with one
    fragment; then three fragments, recording which parameters changed at each round's end."""
    out = {"rank": rank}
    try:
        from hsgd.core.topology import Topology
        from hsgd.train.comm import LevelGroup
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        topo = Topology(2, 1)
        rid = topo.cluster_members(rank)[0]
        inner = LevelGroup("inner", "gloo")
        inner.configure(None, f"t/inner/c{rank}", rank=0, world_size=1, epoch=1)
        outer = LevelGroup("outer", "gloo", timeout_s=30, configure_timeout_s=60)
        outer.configure(f"127.0.0.1:{port}", "t/outer", rank=rank, world_size=2, epoch=1)

        # 1. one fragment, alpha 0 == plain DiLoCo (Nesterov SGD on the mean pseudo-gradient), bitwise
        cfg = _cfg(["sync.outer_every=4", "sync.fragments=1", "sync.fragment_alpha=0"])
        t = ReplicaTrainer(cfg, rid, topo)
        ref_global = [g.detach().clone().requires_grad_(True) for g in t.outer_opt.global_params]
        from hsgd.config.auto import outer_step_of

        lr, momentum = outer_step_of(cfg)
        ref_opt = torch.optim.SGD(ref_global, lr=lr, momentum=momentum, nesterov=True)
        equal = []
        for r in range(3):
            t.run_inner(r, inner)
            local = [p.detach().clone() for p in t.params]
            t.outer_reduce(r, 1, outer)
            # the peer's local params, for the hand-computed mean
            both = outer.all_gather(torch.cat([p.reshape(-1) for p in local]), level="outer")
            t.outer_commit(r, inner, (0,))
            with torch.no_grad():
                offset = 0
                for g in ref_global:
                    n = g.numel()
                    pg = [(g.detach() - b[offset : offset + n].view_as(g)) for b in both]
                    g.grad = (pg[0] + pg[1]) / 2
                    offset += n
                ref_opt.step()
            equal.append(
                all(torch.equal(a, b.detach()) for a, b in zip(t.outer_opt.global_params, ref_global, strict=True))
                and all(torch.equal(p, g.detach()) for p, g in zip(t.params, ref_global, strict=True))
            )
        out["plain_bitwise"] = equal

        # 2. three fragments: round r changes fragment r % 3's global params and only those
        cfg = _cfg(["sync.outer_every=6", "sync.fragments=3"])
        t = ReplicaTrainer(cfg, rid, topo)
        changes = []
        for r in range(4):
            t.run_inner(r, inner)
            before_global = [g.detach().clone() for g in t.outer_opt.global_params]
            before_local = [p.detach().clone() for p in t.params]
            t.outer_reduce(r, 1, outer)
            t.outer_commit(r, inner, (0,))
            changes.append(
                {
                    "global_changed": [
                        i
                        for i, (a, b) in enumerate(zip(before_global, t.outer_opt.global_params, strict=True))
                        if not torch.equal(a, b)
                    ],
                    "local_set_to_global": [
                        i
                        for i, (p, g) in enumerate(zip(t.params, t.outer_opt.global_params, strict=True))
                        if torch.equal(p, g)
                    ],
                    "local_untouched": [
                        i for i, (a, p) in enumerate(zip(before_local, t.params, strict=True)) if torch.equal(a, p)
                    ],
                    "fragment": t.fragment_params(r),
                    "steps_per_round": t.steps_per_round,
                    "step": t.step,
                }
            )
        out["fragments"] = changes
        out["n_params"] = len(t.params)

        # 3. mixing: alpha 0.5 gives the fragment's params halfway between local and global
        cfg = _cfg(["sync.outer_every=4", "sync.fragment_alpha=0.5"])
        t = ReplicaTrainer(cfg, rid, topo)
        t.run_inner(0, inner)
        local = [p.detach().clone() for p in t.params]
        t.outer_reduce(0, 1, outer)
        t.outer_commit(0, inner, (0,))
        out["mix_err"] = max(
            float((p - (0.5 * a + 0.5 * g)).abs().max())
            for p, a, g in zip(t.params, local, t.outer_opt.global_params, strict=True)
        )
        out["mix_param_digest"] = t.param_digest()
        out["mix_global_digest"] = t.global_digest()
        outer.abort()
    except BaseException:  # noqa: BLE001
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def streaming():
    return run_ranks(_streaming_worker, 2, timeout_s=300, store_timeout_s=60, join_s=5)


def test_one_fragment_without_mixing_is_plain_diloco_bitwise(streaming):
    for rank, out in streaming.items():
        assert out["plain_bitwise"] == [True, True, True], f"rank {rank}: {out['plain_bitwise']}"


def test_with_three_fragments_each_round_changes_exactly_its_fragment(streaming):
    out = streaming[0]
    seen = set()
    for r, rec in enumerate(out["fragments"]):
        frag = set(rec["fragment"])
        assert rec["steps_per_round"] == 2 and rec["step"] == 2 * (r + 1), "a round is outer_every / fragments steps"
        assert set(rec["global_changed"]) <= frag and rec["global_changed"], (
            f"round {r}: global params changed {rec['global_changed']}, its fragment is {sorted(frag)}"
        )
        assert frag <= set(rec["local_set_to_global"]), f"round {r}: the synced fragment's params are the global ones"
        others = set(range(out["n_params"])) - frag
        assert others <= set(rec["local_untouched"]), "the commit left the other fragments' working params alone"
        assert not (others & set(rec["global_changed"]))
        seen |= frag
    assert seen == set(range(out["n_params"])), "every parameter is in some fragment synced within 3 rounds"
    assert out["fragments"][3]["fragment"] == out["fragments"][0]["fragment"], "fragment 0 again in round 3"


def test_a_mixing_weight_merges_local_and_global_and_both_clusters_agree_on_the_global_params(streaming):
    for out in streaming.values():
        assert out["mix_err"] <= 1e-6
    assert streaming[0]["mix_global_digest"] == streaming[1]["mix_global_digest"]
    assert streaming[0]["mix_param_digest"] != streaming[1]["mix_param_digest"], (
        "with alpha > 0 the clusters' working params keep their own part (they differ)"
    )


# -- the error-feedback residual is state ---------------------------------------------------------------
def _solo(level):
    from hsgd.train.comm import LevelGroup

    g = LevelGroup(level, "gloo")
    g.configure(None, f"t/{level}", rank=0, world_size=1, epoch=1)
    return g


def _round(t, r, inner, outer):
    t.run_inner(r, inner)
    t.outer_reduce(r, 1, outer)
    t.outer_commit(r, inner, (0,))


def test_the_residual_travels_with_a_full_heal_and_a_checkpoint_and_a_global_heal_starts_it_at_zero():
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import ReplicaTrainer

    cfg = _cfg(["sync.outer_compress=int4", "sync.outer_every=3"])
    inner, outer = _solo("inner"), _solo("outer")
    t = ReplicaTrainer(cfg, "c0r0", Topology(1, 2))
    for r in range(2):
        _round(t, r, inner, outer)
    assert t.outer_residual is not None and any(float(x.abs().max()) > 0 for x in t.outer_residual), (
        "int4 leaves something unsent: the residual holds it"
    )
    healed = ReplicaTrainer(cfg, "c0r1", Topology(1, 2))
    healed.load_state_dict(t.state_dict(), scope="full")
    assert all(torch.equal(a, b) for a, b in zip(healed.outer_residual, t.outer_residual, strict=True))
    # the healed replica goes on exactly as its source (it sends what the source would have)
    _round(t, 2, inner, outer)
    healed.rid, healed.global_index = t.rid, t.global_index  # the same data stream, to compare bitwise
    _round(healed, 2, inner, outer)
    assert healed.global_digest() == t.global_digest()
    fresh = ReplicaTrainer(cfg, "c0r1", Topology(1, 2))
    fresh.load_state_dict(t.global_state(), scope="global")
    assert fresh.outer_residual is None, "another cluster's residual is never taken over"


def test_error_feedback_sends_this_round_what_the_last_round_could_not():
    """With `average` (outer lr 1, no momentum) the new global params are exactly the local ones
    moved by what was held back: global = local - residual_before + residual_after, every round,
    i.e. the residual of round r is sent in round r + 1 and nothing is lost on the way."""
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import ReplicaTrainer

    inner, outer = _solo("inner"), _solo("outer")
    lossy = ReplicaTrainer(
        _cfg(["sync.outer_compress=int4", "sync.outer_every=3", "sync.outer=average"]), "c0r0", Topology(1, 1)
    )
    before = [torch.zeros_like(p) for p in lossy.params]
    for r in range(3):
        lossy.run_inner(r, inner)
        local = [p.detach().clone() for p in lossy.params]
        lossy.outer_reduce(r, 1, outer)
        lossy.outer_commit(r, inner, (0,))
        after = lossy.outer_residual
        for g, p, old, new in zip(lossy.outer_opt.global_params, local, before, after, strict=True):
            assert torch.allclose(g, p - old + new, atol=1e-6), f"round {r}: the update lost more than the residual"
        assert any(float(x.abs().max()) > 0 for x in after)
        before = [x.clone() for x in after]
