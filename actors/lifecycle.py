"""Every death of the run's replica and spare actors, seen once, from Ray's own restart count.

Ray's actor table gives NumRestarts (the live process is incarnation NumRestarts, from 0) and State:
incarnations 0..n-1 died, and n too when DEAD. The count grows whatever the process was doing (idle,
constructing, warming up, healing), so it misses no death, where a call can: Ray holds a call to a
RESTARTING actor, and a process that dies and comes back between two calls fails none.

`ActorWatch.poll()` (one GCS call) returns each incarnation dead since the last poll, once; a death
learned from a call is told with `note_death`; whichever comes first reports it. An incarnation dies
as the replica id it served (a promoted spare as `c0r1`). The reported ones live in the supervisor's
durable dict (`seen`). Table unreadable: `poll` returns nothing and the next catches up (the count
only grows); an actor not in the table yet is skipped.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from typing import NamedTuple

import ray
from ray._private.state import state as gcs
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put


class Death(NamedTuple):
    name: str  # the actor's name (hsgd:<run_id>:...)
    incarnation: int  # the actor's NumRestarts while that process lived
    rid: str | None  # the replica id it served, or None: a spare
    cluster: int | None  # a spare's cluster; None for a replica (topology knows)
    state: str  # the actor's State when the death was seen: RESTARTING, ALIVE (already back), DEAD


# Ray restarts an actor with its constructor's arguments: a promoted spare's identity (its data
# stream) lives in Ray's internal KV store (on the GCS, unlike a run folder that may be failing),
# written before it serves under it, read by its constructor.
KV_NAMESPACE = "hsgd"


def write_identity(actor_name: str, rid: str | None, *, spare: bool) -> None:
    """`actor_name` is replica `rid` from now on, or a spare (None). A KV store error raises (identity not taken)."""
    _internal_kv_put(
        f"{actor_name}:identity", json.dumps({"rid": rid, "spare": spare}), overwrite=True, namespace=KV_NAMESPACE
    )


def read_identity(actor_name: str | None) -> dict | None:
    """{"rid", "spare"} as last written for `actor_name`, or None (its constructor's arguments say)."""
    if not actor_name:
        return None
    raw = _internal_kv_get(f"{actor_name}:identity", namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def own_incarnation() -> int | None:
    """In an actor: its NumRestarts (counted before the new process starts), or None (table unreadable)."""
    with contextlib.suppress(Exception):  # unknown; the supervisor's watch still counts its deaths
        return int(gcs.actor_table(ray.get_runtime_context().get_actor_id()).get("NumRestarts", 0))
    return None


def current_rows(rows: Iterable[dict]) -> list[dict]:
    """One row per actor name: the actor holding the name now. Ray keeps the row of a dead actor whose
    name a new actor took since: a supervisor killed between registering a site's replica and
    creating it leaves a DEAD row that never ran, and its successor creates the replica again under
    that name. The live row wins, else the one started last."""
    current: dict[str, dict] = {}
    for row in rows:
        held = current.get(row["Name"])
        if held is None or _holds_name(row) > _holds_name(held):
            current[row["Name"]] = row
    return list(current.values())


def _holds_name(row: dict) -> tuple[bool, int]:
    return row.get("State") != "DEAD", int(row.get("StartTime") or 0)


class ActorWatch:
    """`identity`: replica id -> actor name (the roster's map itself, so a promotion is followed);
    `spares`: cluster (str) -> spare actor names (the pool's dict); `seen`: actor name -> [floor,
    *extra]: every incarnation below floor was reported, and so were `extra` (durable, mutated here);
    `table`: every actor of the cluster (`Name`, State, NumRestarts), one GCS call that may raise."""

    def __init__(
        self,
        identity: dict[str, str],
        spares: dict[str, list[str]],
        seen: dict[str, list[int]],
        *,
        table: Callable[[], Iterable[dict]] = lambda: gcs.actor_table(None).values(),
        save: Callable[[], None] = lambda: None,
    ):
        self.identity, self.spares, self.seen = identity, spares, seen
        self._table, self._save = table, save
        # rid -> the processes seen serving it, oldest first: (actor name, incarnation); a death
        # learned from a call is the oldest of them not yet known dead
        self._noted: dict[str, list[tuple[str, int]]] = {}
        self._last: dict[str, tuple[str, int]] = {}  # rid -> the process that answered last
        # actor name -> [(first incarnation, rid or None: a spare)], in order: who it served from when
        self._roles: dict[str, list[tuple[int, str | None]]] = {n: [(0, None)] for ns in spares.values() for n in ns}
        self._roles.update({name: [(0, rid)] for rid, name in identity.items()})
        self._listed: set[str] = set()  # the watched actors the last poll's table listed (none: no table)

    def note_up(self, rid: str, incarnation: int | None) -> None:
        """The process serving `rid` answered, as `incarnation` (None: it did not say)."""
        name = self.identity.get(rid)
        if incarnation is None or name is None:
            return
        self._serves(name, incarnation, rid)
        self._last[rid] = (name, incarnation)
        noted = [(n, i) for n, i in self._noted.get(rid, ()) if not self._is_reported(n, i)]
        if (name, incarnation) not in noted:
            noted.append((name, incarnation))
        self._noted[rid] = noted
        floor, extra = self._reported(name)
        if incarnation in extra:  # declared dead, yet it answers: it was not dead
            extra.discard(incarnation)
            self._store(name, floor, extra)
            self._noted[rid] = sorted(noted, key=lambda p: p != (name, incarnation))  # the one to die next

    def promoted(self, rid: str, spare: str, incarnation: int | None, replaced: str) -> None:
        """`spare` (at `incarnation`) now serves `rid`; `replaced`, its old actor, is a spare from its next one on."""
        self._serves(spare, incarnation if incarnation is not None else self._reported(spare)[0], rid)
        last = max((i for n, i in self._noted.get(rid, ()) if n == replaced), default=self._reported(replaced)[0])
        self._serves(replaced, last + 1, None)

    def note_death(self, rid: str) -> tuple[str, int] | None:
        """The process serving `rid` died, learned from a call (or killed): the oldest seen serving it not
        yet known dead (a newer one may have answered). (actor name, incarnation) to log, or None: polled first."""
        if rid in self._noted:
            noted = self._noted[rid]
        else:  # never seen answering: the oldest process of the actor the identity map names
            name = self.identity.get(rid)
            noted = [] if name is None else [(name, self._reported(name)[0])]
        noted = [(n, i) for n, i in noted if not self._is_reported(n, i)]
        if not noted:
            return None
        name, incarnation = noted[0]
        self._noted[rid] = noted[1:]
        floor, extra = self._reported(name)
        extra.add(incarnation)
        self._store(name, floor, extra)
        self._save()
        return name, incarnation

    def latest(self, death: Death) -> bool:
        """`death` is of the process that last answered for its replica, a newer one of that actor, or
        none answered yet: the replica as the supervisor holds it is gone (an older one's is not)."""
        last = self._last.get(death.rid)
        return last is None or (last[0] == death.name and last[1] <= death.incarnation)

    def answered(self, death: Death) -> bool:
        return self._last.get(death.rid) == (death.name, death.incarnation)

    def poll(self) -> list[Death]:
        """Watched actors' incarnations dead since the last poll (or `note_death`), oldest first; [] if no table."""
        watched = set(self.identity.values()) | {n for names in self.spares.values() for n in names}
        try:
            rows = current_rows(r for r in self._table() if r.get("Name") in watched)
        except Exception:  # noqa: BLE001 — the GCS briefly unreachable: the count keeps, next poll
            self._listed = set()
            return []
        self._listed = {r["Name"] for r in rows}
        deaths = []
        for row in rows:
            name, state = row["Name"], row.get("State", "")
            lost = int(row.get("NumRestarts", 0)) + (state == "DEAD")  # incarnations < lost died (DEAD: no restart)
            floor, extra = self._reported(name)
            if lost <= floor:
                continue
            for incarnation in range(floor, lost):
                if incarnation not in extra:
                    rid = self._role(name, incarnation)
                    cluster = None if rid else next((int(c) for c, ns in self.spares.items() if name in ns), None)
                    deaths.append(Death(name, incarnation, rid, cluster, state))
            self._store(name, lost, {i for i in extra if i >= lost})
        if deaths:
            self._save()
        return deaths

    def given_up(self, name: str) -> None:
        """Every death the table shows so far for actor `name` is known: a new site's replica the run
        gave up before it ever joined (actors/site_changes.py, `lost`) died outside the run, and its
        name enters the identity map only to keep it out; reporting those deaths now would count faults
        (and quarantine it) for a replica that never served. A table not read: nothing changes."""
        try:
            rows = current_rows(r for r in self._table() if r.get("Name") == name)
        except Exception:  # noqa: BLE001 — its deaths are then reported once, as any
            return
        for row in rows:
            self._store(name, int(row.get("NumRestarts", 0)) + (row.get("State") == "DEAD"), set())
        self._save()

    def tells(self, name: str | None) -> bool:
        """The last poll's table listed actor `name`: a death or restart of it shows at the next poll."""
        return name in self._listed

    def _is_reported(self, name: str, incarnation: int) -> bool:
        floor, extra = self._reported(name)
        return incarnation < floor or incarnation in extra

    def _reported(self, name: str) -> tuple[int, set[int]]:
        floor, *extra = self.seen.get(name) or [0]
        return floor, set(extra)

    def _store(self, name: str, floor: int, extra: set[int]) -> None:
        # only the table moves the floor (a death it shows is certain); one a caller noted stays an
        # extra until then, so the same process answering again can take it back (note_up)
        self.seen[name] = [floor, *sorted(extra)]

    def _serves(self, name: str, incarnation: int, rid: str | None) -> None:
        roles = self._roles.setdefault(name, [])
        roles[:] = [(i, r) for i, r in roles if i < incarnation] + [(incarnation, rid)]

    def _role(self, name: str, incarnation: int) -> str | None:
        """The replica id `name` served at `incarnation` (None: a spare then)."""
        roles = self._roles.get(name)  # (first incarnation, rid) in order
        if not roles:  # never told: the identity map now
            return next((rid for rid, n in self.identity.items() if n == name), None)
        return next((rid for first, rid in reversed(roles) if first <= incarnation), None)
