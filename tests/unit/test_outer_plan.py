"""What a round's outer exchange moves and who moves it (hsgd/core/outer_plan.py), and the round
machine's sharded exchange: one outer group per shard index, holders of unequal live clusters,
commits that gather every shard, and a holder's death rolling the exchange back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hsgd.config.rounds import steps_per_round as _steps_per_round
from hsgd.core.outer_plan import (
    depth_units,
    fragment_of_params,
    fragment_of_round,
    shard_bounds,
    shard_count,
    shard_holders,
)
from hsgd.core.round import Answer, Outcome, OuterReduce, Phase, RoundMachine, RoundSettings
from hsgd.core.topology import Topology

GPT_NAMES = [
    "transformer.wte.weight",
    "transformer.wpe.weight",
    *[f"transformer.h.{i}.{p}" for i in range(4) for p in ("ln_1.weight", "attn.c_attn.weight", "mlp.c_fc.weight")],
    "transformer.ln_f.weight",
]


def test_depth_units_group_a_block_s_parameters_and_keep_others_apart():
    units = depth_units(GPT_NAMES)
    assert units[:2] == [0, 1]  # two embeddings: a unit each
    assert units[2:5] == [2, 2, 2] and units[5:8] == [3, 3, 3]  # block 0, block 1
    assert units[-1] == 6  # the final norm


def test_fragments_are_strided_over_depth_and_cover_every_parameter():
    frag = fragment_of_params(GPT_NAMES, 2)
    blocks = {i: frag[2 + 3 * i] for i in range(4)}
    assert blocks == {0: 0, 1: 1, 2: 0, 3: 1}, "blocks alternate between fragments (strided, not contiguous)"
    assert all(frag[2 + 3 * i] == frag[2 + 3 * i + k] for i in range(4) for k in range(3)), "a block is never split"
    assert set(frag) == {0, 1}
    assert fragment_of_params(GPT_NAMES, 1) == [0] * len(GPT_NAMES)
    # fewer depth units than fragments: parameters are dealt out so no fragment is empty
    assert sorted(set(fragment_of_params(["a", "b", "c"], 3))) == [0, 1, 2]
    assert sorted(set(fragment_of_params(["w.0.a", "w.0.b", "w.0.c"], 3))) == [0, 1, 2]


def steps_per_round(outer_every: int, fragments: int) -> int:
    return _steps_per_round(SimpleNamespace(sync=SimpleNamespace(outer_every=outer_every, fragments=fragments)))


def test_each_round_syncs_the_next_fragment_so_each_is_synced_every_outer_every_steps():
    assert [fragment_of_round(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert steps_per_round(100, 4) == 25 and steps_per_round(100, 1) == 100
    # fragment f is synced at the end of rounds f, f+F, ...: every F * (H/F) = H steps
    ends = [(r + 1) * steps_per_round(100, 4) for r in range(12) if fragment_of_round(r, 4) == 1]
    assert [b - a for a, b in zip(ends, ends[1:], strict=False)] == [100, 100]


def test_shard_count_is_one_on_the_leader_path_and_the_smallest_live_cluster_when_sharded():
    assert shard_count([3, 2, 4], "leader") == 1
    assert shard_count([3, 2, 4], "sharded") == 2
    assert shard_count([1, 4], "sharded") == 1


def test_the_leader_holds_shard_zero_and_larger_clusters_leave_members_without_a_shard():
    holders = shard_holders([("c0r0", "c0r1", "c0r2"), ("c1r0", "c1r1")], ["c0r1", "c1r0"], 2)
    assert holders == (("c0r1", "c1r0"), ("c0r0", "c1r1"))  # c0r2 holds nothing: it only receives
    assert shard_holders([("a", "b"), ("c", "d")], ["b", "c"], 1) == (("b", "c"),)


@pytest.mark.parametrize(
    "numel,shards,align",
    [(10_000, 3, 256), (4096, 2, 4096), (100, 4, 64), (0, 2, 8), (1, 3, 4096), (8192 * 3 + 5, 3, 4096)],
)
def test_shards_are_contiguous_cover_the_vector_and_start_on_block_boundaries(numel, shards, align):
    bounds = shard_bounds(numel, shards, align)
    assert len(bounds) == shards and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(lo % align == 0 or lo == numel for lo, _ in bounds)
    sizes = [hi - lo for lo, hi in bounds]
    full = [s for s in sizes if s]
    # whole blocks dealt out evenly (one more to the first ones), the last block maybe partial
    assert max(full, default=0) - min(full, default=0) < 2 * align


# -- the round machine's sharded exchange -----------------------------------------------------------------
SPR = 10


def _run_round(m: RoundMachine, fail: dict | None = None) -> list[Phase]:
    """Answer every call `done` in issue order (fail: {(kind, rid): outcome} answers that instead,
    once); return the phases issued."""
    fail = dict(fail or {})
    issued, queue, now = [], list(m.start(0.0)), 0.0
    while queue and not m.done:
        effect = queue.pop(0)
        if not isinstance(effect, Phase):
            continue
        issued.append(effect)
        for rid in effect.calls:
            now += 0.01
            outcome = fail.pop((effect.kind, rid), Outcome.DONE)
            r, step = m.progress.get(rid, (m.round, m.round * SPR))
            if outcome == Outcome.DONE and effect.kind == "run_inner":
                step = (m.round + 1) * SPR
            if outcome == Outcome.DONE and effect.kind == "outer_commit":
                r = m.round + 1
            queue += m.observe(Answer(effect.id, rid, outcome, r, step), now)
    return issued


def _machine(sizes, path="sharded", **kw) -> RoundMachine:
    topo = Topology(len(sizes), max(sizes))
    live = [rid for c, n in enumerate(sizes) for rid in topo.cluster_members(c)[:n]]
    settings = RoundSettings(
        steps_per_round=SPR, outer_path=path, configure_s=5, heal_s=5, outer_s=5, commit_s=5, step_deadline_s=30
    )
    return RoundMachine(
        topo, settings, 0, progress={rid: (0, 0) for rid in live}, leaders={}, epoch=0, committed_round=0, **kw
    )


def test_a_sharded_exchange_forms_one_outer_group_per_shard_and_gathers_every_shard_at_commit():
    m = _machine([3, 2, 3])
    issued = _run_round(m)
    assert m.outcome == "committed"
    reduce = next(p for p in issued if p.kind == "outer_reduce")
    assert reduce.forms_group
    groups: dict[str, list] = {}
    for rid, call in reduce.calls.items():
        assert call.shards == 2 and call.join.world_size == 3
        groups.setdefault(call.join.prefix, []).append((call.join.rank, rid, call.shard))
    assert sorted(groups) == [f"epoch{m.epoch}/outer/s0", f"epoch{m.epoch}/outer/s1"]
    for members in groups.values():
        assert sorted(r for r, _, _ in members) == [0, 1, 2], "one holder per cluster, ranked in cluster order"
        assert len({int(rid[1]) for _, rid, _ in members}) == 3
    assert "c0r2" not in reduce.calls and "c2r2" not in reduce.calls, "members beyond the smallest cluster hold none"
    commit = next(p for p in issued if p.kind == "outer_commit")
    assert set(commit.calls) == set(m.progress), "every live member applies the commit"
    for rid, call in commit.calls.items():
        c, roots = int(rid[1]), call.roots
        members = m.clusters[c].members
        assert len(roots) == 2 and [members[i] for i in roots] == [g[c] for g in m.outer_configured[1]]
    # the next round reuses the standing groups: (shard, shards) only
    m2 = RoundMachine(
        m.topology,
        m.settings,
        1,
        progress=dict(m.progress),
        leaders=m.leaders,
        epoch=m.epoch,
        committed_round=1,
        configured=m.configured_groups(),
        outer_configured=m.outer_configured,
    )
    reduce2 = next(p for p in _run_round(m2) if p.kind == "outer_reduce")
    weights = (1.125, 0.75, 1.125)  # token-weighted: live members 3, 2, 3 of 8 (hsgd.core.outer_plan.token_weights)
    assert not reduce2.forms_group and set(reduce2.calls.values()) == {
        OuterReduce(None, 0, 2, weights),
        OuterReduce(None, 1, 2, weights),
    }


def test_the_leader_path_is_one_shard_held_by_the_leaders():
    m = _machine([2, 2], path="leader")
    issued = _run_round(m)
    reduce = next(p for p in issued if p.kind == "outer_reduce")
    assert set(reduce.calls) == set(m.leaders.values())
    assert {v.join.prefix for v in reduce.calls.values()} == {f"epoch{m.epoch}/outer"}
    assert all((v.shard, v.shards) == (0, 1) for v in reduce.calls.values())
    commit = next(p for p in issued if p.kind == "outer_commit")
    assert all(len(c.roots) == 1 for c in commit.calls.values())


def test_a_failed_shard_reduce_rolls_the_whole_exchange_back_and_retries_it():
    m = _machine([2, 2])
    issued = _run_round(m, fail={("outer_reduce", "c1r1"): Outcome.COLLECTIVE_FAILED})
    assert m.outcome == "committed"
    reduces = [p for p in issued if p.kind == "outer_reduce"]
    assert len(reduces) == 2, "the failed exchange is redone, not half-committed"
    assert [p.kind for p in issued].count("outer_commit") == 1
    assert [p.kind for p in issued].count("run_inner") == 2, "inner work is kept"


def test_a_shard_holder_lost_before_the_commit_leaves_its_cluster_to_heal_next_round():
    m = _machine([2, 2])
    m.outer_configured = None
    _run_round(m, fail={("outer_commit", "c0r1"): Outcome.DIED})
    assert m.outcome == "committed" and "c0r1" not in m.committed_by
    assert m.outer_configured is None or all("c0r1" not in g for g in m.outer_configured[1]), (
        "a dead holder's outer group is never handed on as standing"
    )
