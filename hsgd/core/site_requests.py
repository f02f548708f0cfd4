"""Durable site requests in the run folder (README, "Sites that come and go"): an operator asks, a
supervisor applies, each request exactly once.

Protocol:
    ask       `write_request` puts ONE file `<run.dir>/requests/<id>.json` ({"id", "kind", "cluster",
              "t"}), written under a temp name (a dot first, never read) then renamed: a reader sees
              the whole file or none. The id is unique (time, kind, cluster, random bits).
    apply     at each round's start the supervisor reads `pending` (requests without an outcome,
              oldest first), `decide`s each against the clusters drained so far, carries out an
              applied one, and records the outcome with `mark_done`: `<id>.done` ({"id", "kind",
              "cluster", "outcome": applied | refused, "reason", "round"}), atomic the same way.
    once      the outcome file is written BEFORE the effect is carried out (for a drain: the
              replicas stopped), so a supervisor restarted at any point reads it and never decides
              again; it carries out what the `.done` files say (`drained`), which stopping again
              leaves the same. A request with no `.done` was never decided: it is decided once.

Failure cases: a malformed request file (not JSON, a missing field, an unknown kind, a cluster not
named `c<k>`) is refused with its reason, never skipped silently and never retried; a folder that
cannot be written raises (OSError) to the caller, whose run-folder rules apply. No requests folder:
`pending` is empty, after one directory check.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from hsgd.record.rundir import atomic_write_text

REQUESTS_DIR = "requests"
KINDS = ("drain",)  # add-site is issue 37's next slice
APPLIED, REFUSED = "applied", "refused"
_CLUSTER = re.compile(r"^c(\d+)$")


class RequestError(ValueError):
    """A request that cannot be written (bad kind or cluster name): one line naming what is valid."""


@dataclass(frozen=True)
class SiteRequest:
    id: str
    kind: str
    cluster: str  # as asked: "c2"
    t: float
    problem: str | None = None  # a malformed file: why (the request is refused with it)


@dataclass(frozen=True)
class Decision:
    outcome: str  # applied | refused
    reason: str  # one line; for an applied drain what it leaves
    cluster: int | None  # the cluster index, when the name was valid


def requests_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / REQUESTS_DIR


def cluster_index(name: str) -> int | None:
    """"c2" -> 2; None for a name that is not c<k>."""
    m = _CLUSTER.match(name or "")
    return int(m.group(1)) if m else None


def _atomic_write_json(path: Path, payload: dict) -> None:
    atomic_write_text(path, json.dumps(payload, sort_keys=True))


def write_request(run_dir: str | Path, kind: str, cluster: str, *, now: float | None = None) -> SiteRequest:
    """Write one request file; returns it. Raises RequestError for a kind or cluster name that
    cannot be valid in any run (whether the cluster exists is the supervisor's decision)."""
    if kind not in KINDS:
        raise RequestError(f"request kind {kind!r} unknown; valid: {'|'.join(KINDS)}")
    if cluster_index(cluster) is None:
        raise RequestError(f"cluster {cluster!r} is not a cluster name; valid: c0, c1, ...")
    t = time.time() if now is None else now
    request = SiteRequest(id=f"{int(t * 1000):013d}-{kind}-{cluster}-{uuid.uuid4().hex[:8]}", kind=kind,
                          cluster=cluster, t=t)
    folder = requests_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write_json(folder / f"{request.id}.json", {"id": request.id, "kind": kind, "cluster": cluster, "t": t})
    return request


def _parse(path: Path) -> SiteRequest:
    rid = path.stem
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return SiteRequest(id=rid, kind="?", cluster="?", t=0.0, problem=f"unreadable request file: {err}")
    if not isinstance(raw, dict):
        return SiteRequest(id=rid, kind="?", cluster="?", t=0.0, problem="request file is not a JSON object")
    kind, cluster, t = raw.get("kind"), raw.get("cluster"), raw.get("t")
    problem = None
    if raw.get("id") != rid:
        problem = f"request id {raw.get('id')!r} does not match its file name {path.name}"
    elif kind not in KINDS:
        problem = f"request kind {kind!r} unknown; valid: {'|'.join(KINDS)}"
    elif not isinstance(cluster, str) or cluster_index(cluster) is None:
        problem = f"cluster {cluster!r} is not a cluster name; valid: c0, c1, ..."
    elif not isinstance(t, (int, float)):
        problem = f"request time {t!r} is not a number"
    return SiteRequest(id=rid, kind=str(kind), cluster=str(cluster), t=float(t) if isinstance(t, (int, float)) else 0.0,
                       problem=problem)


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
    out = {}
    for d in done.values():
        if d.get("kind") == "drain" and d.get("outcome") == APPLIED and cluster_index(d.get("cluster", "")) is not None:
            out.setdefault(cluster_index(d["cluster"]), int(d.get("round", -1)))
    return out


def decide(request: SiteRequest, *, clusters: int, drained_clusters, min_clusters: int,
           live_clusters=None) -> Decision:
    """Whether `request` may be applied now. `drained_clusters`: those already drained;
    `min_clusters`: supervisor.min_clusters; `live_clusters`: those with a live replica now (None:
    every cluster not drained), so a drain never leaves no live site while another is down. Pure."""
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
    if left < min_clusters:
        return Decision(REFUSED, f"drain {request.cluster}: would leave {left} site(s), below "
                                 f"supervisor.min_clusters={min_clusters}", c)
    return Decision(APPLIED, f"drain {request.cluster}: {left} site(s) go on", c)


def mark_done(run_dir: str | Path, request: SiteRequest, decision: Decision, round_index: int) -> dict:
    """Record the outcome durably (before its effect: the module's `once`); returns what was written."""
    record = {"id": request.id, "kind": request.kind, "cluster": request.cluster, "outcome": decision.outcome,
              "reason": decision.reason, "round": round_index}
    _atomic_write_json(requests_dir(run_dir) / f"{request.id}.done", record)
    return record
