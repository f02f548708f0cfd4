"""The rules a site request is decided by (docs/sites.md, "Refusals and edge cases"), pure: fed the
request (hsgd/core/site_requests.py), the run's topology, its live replicas and Ray's node table, so
every refusal is tested with fake resources; hsgd/core/site_plan.py applies them (`decide_drain`,
`decide_add`). A decision is `applied` or `refused`, with its reason in one line.

Failure cases, each a refusal (the run goes on; the operator may ask again):
    drain     a malformed request, a cluster that does not exist, one already drained, the last live
              site, one that would leave no other live site holding the last committed round at its
              floor (`round_holders`), or fewer than supervisor.min_clusters sites (`decide`).
    add-site  a malformed request; another site still starting; an index that could never start (a
              resume with fewer clusters than a site added before); Ray's tables unreadable; a label
              no live node carries; no room: the free resources of the nodes the site may use (its
              label's, else every live node) hold fewer than `replicas` replicas, each one bundle on
              one node, placed the way its group places them (`site_room`: STRICT_PACK on ONE node).
    join      an added site not all up within supervisor.join_timeout_s is abandoned (`join_overdue`).
A new site's index: `next_cluster` (a drained site's is never reused; an abandoned one's is).
"""

from __future__ import annotations

from collections.abc import Callable

from hsgd.config.capacity import LABEL_KEY, replicas_that_fit
from hsgd.core.round import current_round
from hsgd.core.site_requests import APPLIED, REFUSED, Decision, Outcome, RequestKind, SiteRequest, cluster_index
from hsgd.core.topology import Topology


def next_cluster(clusters: int, done: dict[str, dict], abandoned_ids=()) -> int:
    """The index a new site gets: past every cluster the run started with and every one added since
    (a drained site's index is never reused: drained sites keep theirs). A site abandoned before it
    joined (`abandoned_ids`, `mark_abandoned`) never was in the topology: its index is free again."""
    added = [
        d.cluster
        for d in map(Outcome.of, done.values())
        if d.applied_as(RequestKind.ADD_SITE) and d.id not in abandoned_ids
    ]
    return max([clusters - 1, *added]) + 1


def site_room(per_node: list[int], strategy: str) -> int:
    """How many replicas a new site can place, given how many fit on each node it may use, the way Ray
    places its group (`strategy`, actors/placement.py `site_strategy`): STRICT_PACK all on one node (the
    roomiest), STRICT_SPREAD one per node, PACK, SPREAD and NONE (each replica placed on its own)
    anywhere (the sum)."""
    if strategy == "STRICT_PACK":
        return max(per_node, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(1 for n in per_node if n >= 1)
    return sum(per_node)


def add_site_problem(
    request: SiteRequest,
    *,
    nodes: list[dict],
    free: dict[str, dict],
    need: dict,
    new_cluster: int,
    strategy: str,
) -> str | None:
    """Why the add-site `request` is refused now, one line; None when it may go ahead. `nodes`: Ray's
    node table (`ray.nodes()`: NodeID, Alive, Labels); `free`: NodeID -> free resources; `need`: one
    replica's bundle (all its ranks); `strategy`: how its replicas are placed (`site_room`): room split
    over nodes is no room for a STRICT_PACK group, which Ray would never place (issue 45, finding 5).
    Pure, so refusals are tested with fake resources."""
    alive = [nd for nd in nodes if nd.get("Alive")]
    what = f"add-site c{new_cluster} ({request.replicas} replica(s))"
    if request.label is not None:
        alive = [nd for nd in alive if str((nd.get("Labels") or {}).get(LABEL_KEY)) == request.label]
        if not alive:
            known = sorted(
                {
                    str(v)
                    for nd in nodes
                    if nd.get("Alive")
                    for k, v in (nd.get("Labels") or {}).items()
                    if k == LABEL_KEY
                }
            )
            return (
                f"{what}: label {request.label!r} has no live node ({LABEL_KEY}); live labels: "
                f"{', '.join(known) or 'none'}"
            )
    per_node = [replicas_that_fit(free.get(nd.get("NodeID"), {}), need) for nd in alive]
    room = site_room(per_node, strategy)
    if room < int(request.replicas or 0):
        where = f"label {request.label!r}'s nodes" if request.label is not None else "the live nodes"
        how = {"STRICT_PACK": " on one node", "STRICT_SPREAD": ", one per node,"}.get(strategy, "")
        return (
            f"{what}: no room: {where} have free resources{how} for {room} replica(s) of "
            f"{', '.join(f'{k}={v:g}' for k, v in sorted(need.items()))} each ({strategy} placement; "
            f"{sum(per_node)} in all)"
        )
    return None


def join_overdue(started_at: float, now: float, timeout_s: float) -> bool:
    """An applied add-site not up `timeout_s` (supervisor.join_timeout_s) after it was started: abandoned,
    so a site whose group is never placed (its replicas neither answer nor die) does not keep every later
    add-site refused as "still starting". Monotonic seconds."""
    return now - started_at >= timeout_s


def round_holders(
    topology: Topology, live: dict[str, tuple[int, int]], drained_clusters, default_floor: int
) -> set[int]:
    """The clusters that hold the last committed round and can train on it: a live replica of theirs at
    the furthest round any live replica holds (`live`: rid -> (round, step), the roster's), and live
    replicas at least their floor (`topology.sites[].min_replicas`, else `default_floor`:
    supervisor.min_replicas_per_cluster). A drained cluster holds nothing. Pure."""
    top = max((r for r, _ in live.values()), default=0)
    out = set()
    for c in set(range(topology.clusters)) - set(drained_clusters):
        members = [live[rid] for rid in topology.cluster_members(c) if rid in live]
        if any(r == top for r, _ in members) and len(members) >= topology.min_replicas_of(c, default_floor):
            out.add(c)
    return out


def decide(
    request: SiteRequest,
    *,
    clusters: int,
    drained_clusters,
    min_clusters: int,
    live_clusters=None,
    holders: set[int] | None = None,
    committed_round: int | None = None,
) -> Decision:
    """Whether the drain `request` may be applied now (an add-site is decided by `add_site_problem`).
    `drained_clusters`: those already drained;
    `min_clusters`: supervisor.min_clusters; `live_clusters`: those with a live replica now (None:
    every cluster not drained), so a drain never leaves no live site while another is down.
    `holders`: the clusters holding the last committed round at their floor (`round_holders`; None: not
    known, not checked): a drain that would leave none is REFUSED (issue 45, finding 1), not deferred: it
    would drop the only copy of that round, and a request waiting on the run's future is one the operator
    cannot see the end of; the operator may ask again once another site holds the round.
    `committed_round`: that round, for the reason's words only. Pure."""
    if request.problem:
        return Decision(REFUSED, request.problem, None)
    c = cluster_index(request.cluster)
    if c is None or c >= clusters:
        return Decision(REFUSED, f"drain {request.cluster}: no such cluster; valid: c0..c{clusters - 1}", None)
    if c in drained_clusters:
        return Decision(REFUSED, f"drain {request.cluster}: already drained", c)
    live = set(range(clusters)) - set(drained_clusters) if live_clusters is None else set(live_clusters)
    left = len(live - {c})
    if left == 0:
        return Decision(REFUSED, f"drain {request.cluster}: it is the last live site", c)
    if holders is not None and not holders - {c}:
        which = "the last committed round" if committed_round is None else f"committed round {committed_round}"
        return Decision(
            REFUSED,
            f"drain {request.cluster}: no other live site holds {which} with replicas at its floor, so draining "
            f"it would lose that round; ask again once another site holds it",
            c,
        )
    if left < min_clusters:
        return Decision(
            REFUSED,
            f"drain {request.cluster}: would leave {left} site(s), below supervisor.min_clusters={min_clusters}",
            c,
        )
    return Decision(APPLIED, f"drain {request.cluster}: {left} site(s) go on", c)


def decide_drain(
    request: SiteRequest,
    *,
    topology: Topology,
    live: dict[str, tuple[int, int]],
    drained_clusters,
    min_clusters: int,
    default_floor: int,
) -> Decision:
    """A drain's decision from the roster's live replicas (rid -> (round, step)): the sites live now,
    and those holding the last committed round at their floor (`decide`, `round_holders`)."""
    return decide(
        request,
        clusters=topology.clusters,
        drained_clusters=drained_clusters,
        min_clusters=min_clusters,
        live_clusters={topology.cluster_of(rid) for rid in live} - set(drained_clusters),
        holders=round_holders(topology, live, drained_clusters, default_floor),
        committed_round=current_round(live.values()),
    )


def decide_add(
    request: SiteRequest,
    *,
    new: int,
    clusters: int,
    starting: int | None,
    stranded: list[Outcome],
    resources: Callable[[], tuple[list[dict], dict[str, dict], dict]],
    strategy: str,
) -> Decision:
    """An add-site's decision: it would be cluster `new` of a topology of `clusters`; `starting`: the
    cluster still starting, if any; `resources`: Ray's nodes, their free resources and one replica's
    bundle, read only when nothing else refuses (whatever it raises refuses, in one line); `strategy`:
    how its replicas are placed (`add_site_problem`)."""
    if request.problem:
        return Decision(REFUSED, request.problem, None)
    if starting is None and new != clusters:  # applied, it would never start
        return Decision(
            REFUSED,
            f"add-site c{new}: it could never start in this run: added site(s) before it "
            f"({', '.join(d.site for d in stranded) or '?'}) are not in its topology of "
            f"{clusters} cluster(s); resume with them configured to add a site",
            None,
        )
    if starting is not None:
        why = f"site c{starting} is still starting; ask again once it joined (one site starts at a time)"
        return Decision(REFUSED, f"add-site c{new}: {why}", None)
    try:
        nodes, free, need = resources()
    except Exception as err:  # noqa: BLE001 — Ray's tables unreadable: refused, the run goes on
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        return Decision(REFUSED, f"add-site c{new}: cannot read the Ray cluster's nodes: {why}", None)
    problem = add_site_problem(request, nodes=nodes, free=free, need=need, new_cluster=new, strategy=strategy)
    if problem is not None:
        return Decision(REFUSED, problem, None)
    where = f"label {request.label!r}" if request.label is not None else "a placement group of its own"
    return Decision(
        APPLIED,
        f"add-site c{new}: {request.replicas} replica(s) starting ({where}); the site "
        f"joins at the first round's start after all answer up",
        new,
    )
