"""Durable site requests in the run folder (README, "Sites that come and go"): an operator asks, a
supervisor applies, each request exactly once.

Protocol:
    ask       `write_request` puts ONE file `<run.dir>/requests/<id>.json` ({"id", "kind", "cluster",
              "t"}; an add-site also "replicas", "label", "name", and "cluster" is "": the
              supervisor names the new site c<K>, the next free index, when it decides), written
              under a temp name (a dot first, never read) then renamed: a reader sees the whole
              file or none. The id is unique (time, kind, cluster, random bits).
    apply     at each round's start the supervisor reads `pending` (requests without an outcome,
              oldest first), `decide`s each against the clusters drained so far, carries out an
              applied one, and records the outcome with `mark_done`: `<id>.done` ({"id", "kind",
              "cluster", "outcome": applied | refused, "reason", "round"}), atomic the same way.
    once      the outcome file is written BEFORE the effect is carried out (for a drain: the
              replicas stopped; for an add-site: its replicas started), so a supervisor restarted
              at any point reads it and never decides again; it carries out what the `.done` files
              say (`drained`, `applied_sites`), which doing again leaves the same (stopped actors
              stay stopped; a site's replicas are found by name before any is started). A request
              with no `.done` was never decided: it is decided once.
    join      an applied add-site's record names its cluster `c<K>` and keeps `replicas`, `label`,
              `name`. Once its replicas are all up, `<id>.joined` ({"id", "cluster", "round",
              "run_id"}) is written, atomic, BEFORE the run's topology takes the site in, so a
              restarted supervisor of the same run builds its topology with every joined site
              (`joined_topology`, hsgd/core/site_topology.py); a resumed run (another run id) starts the site again.
    abandon   an applied add-site whose replicas died for good before they were all up, with too
              few left up (actors/site_changes.py), is stopped, then `<id>.abandoned` is written
              ({"id", "cluster", "round", "reason", "run_id"}): never started again, in this run or
              a resumed one; its index is the next add-site's (it never was in the topology).

Failure cases: a malformed request file (not JSON, a missing field, an unknown kind, a drain's
cluster not named `c<k>`, an add-site's replicas not an integer >= 1) is refused with its reason,
never skipped silently and never retried; a folder that cannot be written raises (OSError) to the
caller, whose run-folder rules apply. No requests folder: `pending` is empty, after one directory
check.

add-site refusals (`add_site_problem`, pure, fed the live nodes and their free resources): a label
that no live node carries, and no room: the free resources of the nodes the site may use (its
label's, else every live node) hold fewer than `replicas` replicas, each one bundle on one node,
placed the way its group places them (`site_room`: a STRICT_PACK group on ONE node).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hsgd.config.capacity import LABEL_KEY, replicas_that_fit
from hsgd.core.topology import Topology
from hsgd.record.rundir import atomic_write_text

REQUESTS_DIR = "requests"


class RequestKind(StrEnum):
    """What a request asks; its value is the `kind` in the request and outcome files (the public contract);
    str() and format() give the value (the file's string in messages and JSON)."""

    DRAIN = "drain"
    ADD_SITE = "add-site"


def _kind(value) -> RequestKind | None:
    """The kind a request file names, or None for one no kind has."""
    try:
        return RequestKind(value)
    except ValueError:
        return None


_VALID_KINDS = "|".join(k.value for k in RequestKind)
APPLIED, REFUSED = "applied", "refused"
_CLUSTER = re.compile(r"^c(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a site's name or label: one token


class RequestError(ValueError):
    """A request that cannot be written (bad kind or cluster name): one line naming what is valid."""


@dataclass(frozen=True)
class SiteRequest:
    id: str
    kind: RequestKind | str  # a RequestKind, or what a malformed file said ("?" when unreadable)
    cluster: str  # as asked: "c2"
    t: float
    problem: str | None = None  # a malformed file: why (the request is refused with it)
    replicas: int | None = None  # add-site: the new site's replicas
    label: str | None = None  # add-site: the node label it is placed by (None: its own placement group)
    name: str | None = None  # add-site: its name (topology.sites[].name)

    def __post_init__(self) -> None:  # a kind given as its string is the enum member: `is` compares it
        object.__setattr__(self, "kind", _kind(self.kind) or self.kind)


@dataclass(frozen=True)
class Decision:
    outcome: str  # applied | refused
    reason: str  # one line; for an applied drain what it leaves
    cluster: int | None  # the cluster index, when the name was valid


@dataclass(frozen=True)
class Outcome:
    """A decided request's record (`<id>.done`, `mark_done`), typed. `of` reads one as written; a field
    missing or of another type (a file edited by hand) reads as none, so such a record applies nothing."""

    id: str
    kind: RequestKind | None
    cluster: int | None  # the index of the cluster it names (an applied add-site: its new cluster)
    applied: bool
    round: int  # the round at whose start it was decided
    replicas: int = 0  # an applied add-site's
    label: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, raw: dict) -> Outcome:
        replicas = raw.get("replicas")
        return cls(
            id=str(raw.get("id", "")),
            kind=_kind(raw.get("kind")),
            cluster=cluster_index(raw.get("cluster") if isinstance(raw.get("cluster"), str) else ""),
            applied=raw.get("outcome") == APPLIED,
            round=int(raw["round"]) if isinstance(raw.get("round"), int) else -1,
            replicas=replicas if isinstance(replicas, int) and not isinstance(replicas, bool) else 0,
            label=raw.get("label"),
            name=raw.get("name"),
        )

    def applied_as(self, kind: RequestKind) -> bool:
        return self.applied and self.kind is kind and self.cluster is not None

    @property
    def site(self) -> str:
        return f"c{self.cluster}"


def requests_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REQUESTS_DIR


def cluster_index(name: str) -> int | None:
    """ "c2" -> 2; None for a name that is not c<k>."""
    m = _CLUSTER.match(name or "")
    return int(m.group(1)) if m else None


def _atomic_write_json(path: Path, payload: dict) -> None:
    atomic_write_text(path, json.dumps(payload, sort_keys=True))


def add_site_fields_problem(replicas, label, name) -> str | None:
    """Why an add-site's fields cannot be valid in any run, one line naming the field; None if they can."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return f"replicas={replicas!r} is not a replica count; valid: an integer >= 1"
    for field_name, value in (("label", label), ("name", name)):
        if value is not None and (not isinstance(value, str) or not _NAME.match(value)):
            return (
                f"{field_name}={value!r} is not valid; valid: one token of letters, digits, '_', '.', '-' "
                f"(at most 64), or leave it out"
            )
    return None


def write_request(
    run_dir: str | Path,
    kind: RequestKind | str,
    cluster: str = "",
    *,
    replicas: int | None = None,
    label: str | None = None,
    name: str | None = None,
    now: float | None = None,
) -> SiteRequest:
    """Write one request file; returns it. Raises RequestError for a kind, cluster name or add-site
    field that cannot be valid in any run (whether the cluster exists, or the site fits, is the
    supervisor's decision). A drain names `cluster`; an add-site gives `replicas` (and optionally
    `label`, `name`) and no cluster."""
    asked, kind = kind, _kind(kind)
    if kind is None:
        raise RequestError(f"request kind {asked!r} unknown; valid: {_VALID_KINDS}")
    extra: dict = {}
    if kind is RequestKind.ADD_SITE:
        if cluster:
            raise RequestError(
                f"add-site names no cluster (got {cluster!r}); valid: leave it out, the run picks the next free c<k>"
            )
        problem = add_site_fields_problem(replicas, label, name)
        if problem:
            raise RequestError(f"add-site: {problem}")
        extra = {"replicas": replicas, "label": label, "name": name}
    elif cluster_index(cluster) is None:
        raise RequestError(f"cluster {cluster!r} is not a cluster name; valid: c0, c1, ...")
    t = time.time() if now is None else now
    request = SiteRequest(
        id=f"{int(t * 1000):013d}-{kind}-{cluster or 'new'}-{uuid.uuid4().hex[:8]}",
        kind=kind,
        cluster=cluster,
        t=t,
        **extra,
    )
    folder = requests_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write_json(
        folder / f"{request.id}.json", {"id": request.id, "kind": kind.value, "cluster": cluster, "t": t, **extra}
    )
    return request


def _parse(path: Path) -> SiteRequest:
    rid = path.stem
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return SiteRequest(id=rid, kind="?", cluster="?", t=0.0, problem=f"unreadable request file: {err}")
    if not isinstance(raw, dict):
        return SiteRequest(id=rid, kind="?", cluster="?", t=0.0, problem="request file is not a JSON object")
    asked, cluster, t = raw.get("kind"), raw.get("cluster"), raw.get("t")
    kind = _kind(asked)
    problem = None
    if raw.get("id") != rid:
        problem = f"request id {raw.get('id')!r} does not match its file name {path.name}"
    elif kind is None:
        problem = f"request kind {asked!r} unknown; valid: {_VALID_KINDS}"
    elif kind is RequestKind.ADD_SITE and cluster not in ("", None):
        problem = f"add-site names no cluster (got {cluster!r}); the run picks the next free c<k>"
    elif kind is RequestKind.ADD_SITE:
        problem = add_site_fields_problem(raw.get("replicas"), raw.get("label"), raw.get("name"))
        problem = problem and f"add-site: {problem}"
    elif not isinstance(cluster, str) or cluster_index(cluster) is None:
        problem = f"cluster {cluster!r} is not a cluster name; valid: c0, c1, ..."
    if problem is None and not isinstance(t, (int, float)):
        problem = f"request time {t!r} is not a number"
    extra = (
        {"replicas": raw.get("replicas"), "label": raw.get("label"), "name": raw.get("name")}
        if kind is RequestKind.ADD_SITE and problem is None
        else {}
    )
    return SiteRequest(
        id=rid,
        kind=kind or str(asked),
        cluster=str(cluster or ""),
        t=float(t) if isinstance(t, (int, float)) else 0.0,
        problem=problem,
        **extra,
    )


def outcomes(run_dir: str | Path) -> dict[str, dict]:
    """Every recorded outcome (`<id>.done`), by request id; {} with no requests folder."""
    folder = requests_dir(run_dir)
    if not folder.is_dir():
        return {}
    done = {}
    for path in sorted(folder.glob("*.done")):
        with contextlib.suppress(OSError, ValueError):  # written atomically: unreadable only if tampered with
            done[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    return done


def pending(run_dir: str | Path, done: dict[str, dict] | None = None) -> list[SiteRequest]:
    """Requests with no outcome yet, oldest first (ties: by id). [] with no requests folder."""
    folder = requests_dir(run_dir)
    if not folder.is_dir():
        return []
    done = outcomes(run_dir) if done is None else done
    found = [_parse(p) for p in folder.glob("*.json") if not p.name.startswith(".") and p.stem not in done]
    return sorted(found, key=lambda r: (r.t, r.id))


def drained(done: dict[str, dict]) -> dict[int, int]:
    """Clusters drained by applied requests -> the round at whose start each left."""
    out: dict[int, int] = {}
    for d in map(Outcome.of, done.values()):
        if d.applied_as(RequestKind.DRAIN):
            out.setdefault(d.cluster, d.round)
    return out


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


def mark_done(run_dir: str | Path, request: SiteRequest, decision: Decision, round_index: int) -> dict:
    """Record the outcome durably (before its effect: the module's `once`); returns what was written.
    An applied add-site's record names its new cluster (`c<K>`) and keeps `replicas`, `label`, `name`:
    what a restarted supervisor needs to find, or start, the site's replicas again."""
    record = {
        "id": request.id,
        "kind": str(request.kind),
        "cluster": request.cluster,
        "outcome": decision.outcome,
        "reason": decision.reason,
        "round": round_index,
    }
    if request.kind is RequestKind.ADD_SITE and decision.outcome == APPLIED:
        record.update(cluster=f"c{decision.cluster}", replicas=request.replicas, label=request.label, name=request.name)
    _atomic_write_json(requests_dir(run_dir) / f"{request.id}.done", record)
    return record


JOINED_SUFFIX = ".joined"


def mark_joined(run_dir: str | Path, request_id: str, cluster: str, round_index: int, run_id: str = "") -> dict:
    """An applied add-site's replicas all answered up and the site joined at round `round_index`'s
    start: `<id>.joined` ({"id", "cluster", "round", "run_id"}), atomic. Written before the run's
    topology is widened, so a restarted supervisor of the same run builds the widened one
    (`joined_topology`); a resumed run (a new run id) starts the site's replicas again instead."""
    record = {"id": request_id, "cluster": cluster, "round": round_index, "run_id": run_id}
    _atomic_write_json(requests_dir(run_dir) / f"{request_id}{JOINED_SUFFIX}", record)
    return record


def joined(run_dir: str | Path, run_id: str | None = None) -> dict[str, dict]:
    """Every site that joined (`<id>.joined`; of run `run_id` only, when given), by request id; {}
    with no requests folder."""
    folder = requests_dir(run_dir)
    if not folder.is_dir():
        return {}
    out = {}
    for path in sorted(folder.glob(f"*{JOINED_SUFFIX}")):
        with contextlib.suppress(OSError, ValueError):  # written atomically: unreadable only if tampered with
            out[path.name[: -len(JOINED_SUFFIX)]] = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in out.items() if run_id is None or v.get("run_id") == run_id}


ABANDONED_SUFFIX = ".abandoned"


def mark_abandoned(
    run_dir: str | Path, request_id: str, cluster: str, round_index: int, reason: str, run_id: str = ""
) -> dict:
    """An applied add-site given up at round `round_index`'s start, before it joined (its replicas died
    for good, too few left up): `<id>.abandoned` ({"id", "cluster", "round", "reason", "run_id"}),
    atomic, written AFTER its replicas were stopped (a supervisor restarted in between starts the site
    again: a fresh try, never a site half stopped). For good, across resumes: such a site is never
    started again, and its index is free for the next add-site (`next_cluster`)."""
    record = {"id": request_id, "cluster": cluster, "round": round_index, "reason": reason, "run_id": run_id}
    _atomic_write_json(requests_dir(run_dir) / f"{request_id}{ABANDONED_SUFFIX}", record)
    return record


def abandoned(run_dir: str | Path) -> dict[str, dict]:
    """Every add-site abandoned before it joined (`<id>.abandoned`), by request id; {} with no requests folder."""
    folder = requests_dir(run_dir)
    if not folder.is_dir():
        return {}
    out = {}
    for path in sorted(folder.glob(f"*{ABANDONED_SUFFIX}")):
        with contextlib.suppress(OSError, ValueError):  # written atomically: unreadable only if tampered with
            out[path.name[: -len(ABANDONED_SUFFIX)]] = json.loads(path.read_text(encoding="utf-8"))
    return out
