"""Durable site requests in the run folder (docs/sites.md, "Sites that come and go"): an operator
asks, a supervisor applies, each request exactly once. The rules a request is decided by are
hsgd/core/site_rules.py; the supervisor's plan, hsgd/core/site_plan.py.

Protocol (each file written under a temp name, a dot first and never read, then renamed):
    ask       `write_request`: ONE file `<run.dir>/requests/<id>.json` ({"id", "kind", "cluster", "t"};
              an add-site also "replicas", "label", "name", and "cluster" is ""). The id is unique.
    apply     at each round's start the supervisor reads `pending` (no outcome yet, oldest first),
              decides each, and records it with `mark_done`: `<id>.done` ({"id", "kind", "cluster",
              "outcome": applied | refused, "reason", "round"}; an applied add-site names c<K>).
    once      the outcome is written BEFORE the effect is carried out, so a restarted supervisor never
              decides again; it carries out what the `.done` files say (`drained`), which doing again
              leaves the same. A request with no `.done` was never decided: it is decided once.
    join      `<id>.joined` ({"id", "cluster", "round", "run_id"}) once an added site's replicas are all
              up, BEFORE the run's topology takes it in (hsgd/core/site_topology.py).
    abandon   `<id>.abandoned` ({"id", "cluster", "round", "reason", "run_id"}) AFTER its replicas were
              stopped: never started again, in this run or a resumed one.

Failure cases: a malformed request file (not JSON, a missing field, an unknown kind, a drain's cluster
not named `c<k>`, an add-site's replicas not an integer >= 1) is refused with its reason, never
skipped silently and never retried; a folder that cannot be written raises (OSError) to the caller,
whose run-folder rules apply. No requests folder: `pending` is empty, after one directory check.
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
