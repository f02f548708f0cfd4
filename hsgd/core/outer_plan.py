"""What the outer exchange of a round moves, and who moves it: fragments and shards. Pure functions
of names and counts: the round machine plans holders, the trainer cuts vectors, and they agree
because both call these.

Fragments (Streaming DiLoCo, arXiv 2501.18512): with `sync.fragments = F` a round syncs ONE of F
fragments of the parameters (a lower peak on the slow link, the same total bytes), fragment
`round % F` at the end of each `outer_every / F`-step round, so each is synced every `outer_every`
steps. Fragments are strided over depth (depth unit u goes to fragment u % F): every fragment holds
layers from the whole depth, which beats contiguous ones in the paper. F = 1 is plain DiLoCo.

Shards (`sync.outer_path = sharded`): after the inner phase a cluster's replicas hold bitwise-equal
params, so each already holds the cluster's whole pseudo-gradient and the intra-cluster
reduce-scatter is a slice, at no inner traffic. The j-th holder of every cluster exchanges shard j
(one outer group per shard index) and the commit gathers the shards inside each cluster: each
member's link carries 1/S of the payload. S is the smallest live size among the clusters taking
part (members beyond S hold no shard and only receive). `leader` is S = 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_INDEX = re.compile(r"\.(\d+)(\.|$)")


def depth_units(param_names: Sequence[str]) -> list[int]:
    """The depth unit of each parameter, numbered in module order: parameters whose names share
    the prefix up to the first numeric component (`transformer.h.3.`) form one unit (a block of a
    ModuleList); a parameter with no numeric component is a unit of its own (an embedding, a norm)."""
    units: list[int] = []
    keys: dict[str, int] = {}  # a unit's key -> its number, in order of first appearance
    for name in param_names:
        m = _INDEX.search(name)
        units.append(keys.setdefault(name[: m.end(1)] if m else name, len(keys)))
    return units


def fragment_of_params(param_names: Sequence[str], fragments: int) -> list[int]:
    """Fragment index of each parameter: depth unit u → fragment u % fragments; with fewer units
    than fragments, parameters are dealt out one by one (no fragment empty while there are enough)."""
    if fragments <= 1:
        return [0] * len(param_names)
    units = depth_units(param_names)
    if len(set(units)) >= fragments:
        return [u % fragments for u in units]
    return [i % fragments for i in range(len(param_names))]


def fragment_of_round(round_index: int, fragments: int) -> int:
    """The fragment a round syncs."""
    return round_index % max(1, fragments)


def shard_count(live_sizes: Sequence[int], path: str) -> int:
    """How many shards the exchange is cut into: 1 on the leader path; the smallest live cluster
    size among the clusters taking part on the sharded path."""
    return 1 if path == "leader" or not live_sizes else max(1, min(live_sizes))


def shard_holders(members: Sequence[Sequence[str]], leaders: Sequence[str], shards: int) -> tuple[tuple[str, ...], ...]:
    """Shard j → its holder in each taking-part cluster (outer-rank order). `members[k]`: cluster
    k's live members in inner-rank order; `leaders[k]`: its leader, who holds shard 0 (so the
    leader path is the one-shard case); the other members take shards 1.. in inner-rank order."""
    per_cluster = []
    for rids, leader in zip(members, leaders, strict=True):
        order = [leader] + [r for r in rids if r != leader]
        assert len(order) >= shards, f"{len(order)} members for {shards} shards"
        per_cluster.append(order[:shards])
    return tuple(tuple(holders[j] for holders in per_cluster) for j in range(shards))


def shard_bounds(numel: int, shards: int, align: int) -> list[tuple[int, int]]:
    """[lo, hi) of each shard of a flat vector of `numel` elements: contiguous, cut at multiples of
    `align` (a block-wise codec encodes a shard as it encodes that piece of the whole vector), as
    equal as that allows; a vector too short for every shard leaves the last shards empty."""
    blocks = -(-numel // align)
    bounds, start = [], 0
    for j in range(shards):
        take = blocks // shards + (1 if j < blocks % shards else 0)
        end = min(numel, start + take * align)
        bounds.append((start, end))
        start = end
    return bounds


def holds_outer_group(outer_configured: tuple[int, tuple[tuple[str, ...], ...]] | None, rid: str) -> bool:
    """Whether rid is a member of one of the standing outer groups (epoch, shard holders)."""
    return outer_configured is not None and any(rid in holders for holders in outer_configured[1])


def params_agree(digests: dict[str, str], topology, *, streaming: bool) -> bool:
    """Invariant 1 on the working params' digests after a commit (rid -> digest): every replica
    holds the same ones; under streaming (fragments, a mixing weight) every replica of a cluster
    does (the clusters' own progress on unsynced fragments differs by design)."""
    if not streaming:
        return len(set(digests.values())) <= 1
    by_cluster: dict[int, set[str]] = {}
    for rid, digest in digests.items():
        by_cluster.setdefault(topology.cluster_of(rid), set()).add(digest)
    return all(len(d) <= 1 for d in by_cluster.values())


def token_weights(tokens: Sequence[int]) -> tuple[float, ...]:
    """Each cluster's weight in the outer mean, in outer-rank order: n * t_c / sum(t) for the
    tokens t_c it trained in the round (live members x steps). The weighted mean of the clusters'
    pseudo-gradients is then the plain mean of the weighted ones (what the all-reduce computes).
    Equal tokens give () — the plain mean, bit for bit, with nothing multiplied."""
    tokens = [int(t) for t in tokens]
    if len(set(tokens)) <= 1 or sum(tokens) <= 0:
        return ()
    return tuple(len(tokens) * t / sum(tokens) for t in tokens)
