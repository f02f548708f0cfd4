"""Goodput: where a fault's time went, read from a run's record. Pure functions over the records
of faults_fired.jsonl and events.jsonl, so the benchmark's figures are unit-tested.

Per fault on a replica (t0 = when it fired):
    detection_s  t0 -> the supervisor marked the replica down (replica_down / hang_detected)
    replan_s     detection -> its cluster trains again without it (the next `inner` phase_begin of
                 that cluster: the survivors' group re-formed)
    restart_s    detection -> the replica (or a spare taking its place) answered again (replica_up)
    heal_s       the heal that brought it back (heal_end.seconds)
    rejoin_s     t0 -> the replica is in an inner phase again (phase_begin `inner` naming it)
Goodput of a run = fault-free wall time / its wall time, both of the same config and step count.
"""

from __future__ import annotations

from statistics import median


def _first(events: list[dict], t: float | None, pred) -> dict | None:
    """The first event at or after t that pred accepts (None: no such event, or no t)."""
    return None if t is None else next((e for e in events if e["t"] >= t and pred(e)), None)


def fault_costs(fired: list[dict], events: list[dict]) -> list[dict]:
    """One record per fired replica fault with the split above (None where it never happened)."""
    events = sorted(events, key=lambda e: e["t"])
    inner = [e for e in events if e["event"] == "phase_begin" and e.get("phase") == "inner"]
    out = []
    for f in sorted(fired, key=lambda f: f["t"]):
        rid, t0 = f.get("rid"), f["t"]
        if not rid or rid == "supervisor":
            continue
        cluster = int(rid[1:].split("r")[0])
        down = _first(events, t0, lambda e: e["event"] in ("replica_down", "hang_detected") and e.get("rid") == rid)  # noqa: B023 — called within the iteration
        t1 = down["t"] if down else None
        replan = _first(inner, t1, lambda e: e.get("cluster") == cluster)  # noqa: B023 — called within the iteration
        up = _first(events, t1, lambda e: e["event"] == "replica_up" and e.get("rid") == rid)  # noqa: B023 — called within the iteration
        heal = _first(events, t1, lambda e: e["event"] == "heal_end" and e.get("target") == rid)  # noqa: B023 — called within the iteration
        back = _first(inner, t1, lambda e: rid in (e.get("replicas") or []))  # noqa: B023 — called within the iteration
        out.append(
            {
                "rid": rid,
                "kind": f.get("kind"),
                "fired_at": t0,
                "detection_s": None if t1 is None else t1 - t0,
                "replan_s": None if replan is None else replan["t"] - t1,
                "restart_s": None if up is None else up["t"] - t1,
                "heal_s": None if heal is None else heal.get("seconds"),
                "rejoin_s": None if back is None else back["t"] - t0,
            }
        )
    return out


def summarize_costs(costs: list[dict]) -> dict:
    """Median of each part over the faults that have it, and how many faults there were."""
    parts = ("detection_s", "replan_s", "restart_s", "heal_s", "rejoin_s")
    return {
        "faults": len(costs),
        **{p: (median(v) if (v := [c[p] for c in costs if c[p] is not None]) else None) for p in parts},
    }


def goodput(fault_free_wall_s: float, wall_s: float) -> float:
    """Fraction of fault-free throughput kept under faults (same config, same committed steps)."""
    return fault_free_wall_s / wall_s if wall_s > 0 else 0.0
