"""What a run reports (metrics.jsonl's records, summary.json's figures), as pure functions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hsgd.core.phases import PROGRESS, Phase


def round_record(
    run: Any,
    *,
    steps_per_round: int,
    eval_loss: float | None,
    epoch: int,
    t: float,
    cluster_steps: list[int],
    cluster_tokens: list[int],
) -> dict:
    """One line of metrics.jsonl for the committed round `run.r` (`run`: the round's record that the
    supervisor kept, actors/round_record.py). `run.losses`: every committed step's loss per replica
    in this round (steps redone after a failure count once, in the attempt that committed).
    `cluster_steps`: each cluster's inner steps this round (sync.balance's plan, else steps_per_round);
    `cluster_tokens`: the tokens each cluster's members at the commit trained in them."""
    all_losses = [x for v in run.losses.values() for x in v]
    inner_s = run.seconds.get("inner", 0.0)
    return {
        "round": run.r,
        "inner_step": (run.r + 1) * steps_per_round,
        "loss": sum(all_losses) / len(all_losses) if all_losses else None,
        "replica_loss": {rid: sum(v) / len(v) for rid, v in sorted(run.losses.items()) if v},
        "eval_loss": eval_loss,
        "tokens_per_s": run.tokens / inner_s if inner_s > 0 else None,
        "inner_bytes": run.inner_bytes,
        "outer_bytes": run.outer_bytes,
        "outer_link_s": sum(run.outer_link_s.values()),
        "outer_overlapped": run.outer_overlapped,
        "outer_exchange": run.outer_exchange,
        "cluster_link_bytes": [run.cluster_link_bytes.get(c, 0) for c in range(len(cluster_steps))],
        "live_replicas": len(run.commit_digests),
        "epoch": epoch,
        "attempts": run.attempts,
        "phase_s": dict(run.seconds),
        "replica_digests": dict(run.commit_digests),
        "global_digests": dict(run.global_digests),
        "cluster_steps": list(cluster_steps),
        "cluster_tokens": list(cluster_tokens),
        "late_steps": run.late_steps,
        "t": t,
    }


def link_bytes_per_cluster(metrics: list[dict]) -> list[int]:
    """Each cluster's slow-link bytes (its holders' sent + received) over the recorded rounds: the sum of
    metrics' `cluster_link_bytes` (a site added later has fewer rounds; older records have none)."""
    total: list[int] = []
    for m in metrics:
        for c, n in enumerate(m.get("cluster_link_bytes") or []):
            total.extend([0] * (c + 1 - len(total)))
            total[c] += int(n)
    return total


def committed_tokens(committed: Iterable[str], topology: Any, steps_of, tokens_per_step: int) -> list[int]:
    """Each cluster's tokens in a committed round: its members at the commit x its steps x a step's tokens
    (from the plan, not the calls' reports: a restarted supervisor never saw its predecessor's)."""
    at_commit = [topology.cluster_of(rid) for rid in committed]
    return [at_commit.count(c) * steps_of(c) * tokens_per_step for c in range(topology.clusters)]


def late_round_record(
    *,
    round_index: int,
    steps_per_round: int,
    live_replicas: int,
    epoch: int,
    digests: dict[str, str],
    eval_loss: float | None,
    t: float,
) -> dict:
    """metrics.jsonl's line for a round a supervisor committed but did not live to record (its
    successor records it on resume, `recovered`): what the replicas still tell, nothing invented."""
    return {
        "round": round_index,
        "inner_step": (round_index + 1) * steps_per_round,
        "loss": None,
        "replica_loss": {},
        "eval_loss": eval_loss,
        "tokens_per_s": None,
        "inner_bytes": 0,
        "outer_bytes": 0,
        "outer_link_s": None,
        "outer_overlapped": None,
        "outer_exchange": None,
        "cluster_link_bytes": [],
        "late_steps": None,
        "live_replicas": live_replicas,
        "epoch": epoch,
        "replica_digests": dict(digests),
        "recovered": True,
        "t": t,
    }


def efficiencies(committed_steps: int, attempted_steps: int, participation: list[float]) -> tuple[float, float]:
    """torchft's figures (docs/faults.md): step efficiency, and training efficiency = step
    efficiency x mean fraction of the replicas that took part in each round's inner phase."""
    step = min(1.0, committed_steps / attempted_steps) if attempted_steps else 1.0
    return step, step * (sum(participation) / len(participation) if participation else 1.0)


_DETECTIONS = ("replica_down", "hang_detected", "collective_failed", "supervisor_start")
# faults_fired.jsonl is stamped by the replica's clock, events.jsonl by the supervisor's: on
# another node a fault may seem to fire just after the down it caused.
_CLOCK_SKEW_S = 2.0


def _distinct_downs(events: list[dict]) -> list[dict]:
    """replica_down events, each failure once. A down naming its `incarnation` (Ray's restart count
    of the `actor` serving rid) is one death of that process: a repeat of (rid, actor, incarnation)
    is that death logged again; a kill while Ray restarts it is another. A down without one (older
    runs) repeats an open one of the same round, phase and cause with no replica_up of rid between."""
    downs, open_down, deaths = [], {}, set()
    for e in events:
        rid = e.get("rid")
        if e["event"] == "replica_up":
            open_down.pop(rid, None)
        elif e["event"] == "replica_down" and rid:
            if e.get("incarnation") is not None:
                death = (rid, e.get("actor"), e["incarnation"])
                if death not in deaths:
                    deaths.add(death)
                    downs.append(e)
                continue
            key = (e.get("round"), e.get("phase"), e.get("cause"))
            if open_down.get(rid) != key:
                downs.append(e)
            open_down[rid] = key
    return downs


def fault_figures(fired: list[dict], events: list[dict], explain_window_s: float = 120.0) -> list[dict]:
    """summary.json's `faults` (docs/faults.md: each entry's figures and sources), from
    faults_fired.jsonl (a fired record's rid is the replica actually hit, whatever its target) and
    events.jsonl. A fault of any kind (even `comm` or `slow`: a down soon after it is likelier its
    effect than a coincidence) explains at most one down of its replica: the first within
    `explain_window_s` after it fired. A `nan` fault explains only a `non_finite` event naming its
    replica (each such event is one entry). What no fault explains is `observed`, a spare's death
    (`spare_lost`) included. Every entry has the same keys."""
    events = sorted(events, key=lambda e: e["t"])
    fired = sorted(fired, key=lambda f: f["t"])
    non_finite = [e for e in events if e["event"] == "non_finite"]
    figures, explained = _injected_entries(fired, events, non_finite)
    downs = _distinct_downs(events)
    claimed = _claimed_downs(fired, downs, explain_window_s)
    figures += [
        _observed_fault(events, down, cause=down.get("cause"), detected_by="replica_down")
        for i, down in enumerate(downs)
        if i not in claimed
    ]
    figures += [
        _observed_fault(events, e, cause="non_finite", detected_by="non_finite")
        for i, e in enumerate(non_finite)
        if i not in explained
    ]
    spare_deaths: dict[tuple, dict] = {}  # each death of a spare's process once (by spare and incarnation)
    for e in events:
        if e["event"] == "spare_lost":
            spare_deaths.setdefault((e.get("spare"), e.get("incarnation")), e)
    figures += [
        _observed_fault(events, {**e, "rid": e.get("spare"), "phase": "spare"}, cause="died", detected_by="spare_lost")
        for e in spare_deaths.values()
    ]
    return figures


def _injected_entries(fired: list[dict], events: list[dict], non_finite: list[dict]) -> tuple[list[dict], set[int]]:
    """One entry per fired fault (in time order), and the non_finite events a nan fault explains."""
    figures, explained = [], set()
    for f in fired:
        t0, rid = f["t"], f["rid"]
        if f["kind"] == "nan":
            i = next(
                (
                    i
                    for i, e in enumerate(non_finite)
                    if i not in explained and e["t"] >= t0 - _CLOCK_SKEW_S and rid in e.get("rids", (e.get("rid"),))
                ),
                None,
            )
            detected = None if i is None else non_finite[i]
            explained.add(i)  # (None when nothing explained: never an index)
        else:
            detected = next(
                (
                    e
                    for e in events
                    if e["t"] >= t0
                    and e["event"] in _DETECTIONS
                    and (rid == "supervisor") == (e["event"] == "supervisor_start")
                    and (e.get("rid") in (rid, None) or e["event"] == "collective_failed")
                ),
                None,
            )
        seen = detected or {}
        figures.append(
            {
                "source": "injected",
                "rid": rid,
                "kind": f["kind"],
                "cause": "non_finite" if seen.get("event") == "non_finite" else seen.get("cause"),
                "phase": f.get("phase"),
                "round": f.get("round"),
                "step": f.get("step"),
                "fired_at": t0,
                "detected_at": seen.get("t"),
                "detection_latency_s": None if detected is None else detected["t"] - t0,
                "detected_by": seen.get("event"),
                **_after(events, rid, t0, seen.get("t", t0)),
            }
        )
    return figures, explained


def _claimed_downs(fired: list[dict], downs: list[dict], explain_window_s: float) -> set[int]:
    """The downs a fault explains: each fault its replica's first unclaimed down within the window."""
    claimed: set[int] = set()
    for f in fired:
        if f["kind"] == "nan":
            continue  # it kills nobody: a down after it is another failure
        first = next(
            (
                i
                for i, d in enumerate(downs)
                if i not in claimed
                and d.get("rid") == f["rid"]
                and f["t"] - _CLOCK_SKEW_S <= d["t"] <= f["t"] + explain_window_s
            ),
            None,
        )
        if first is not None:
            claimed.add(first)
    return claimed


def _after(events: list[dict], rid: str, t: float, detected_at: float) -> dict:
    """A fault entry's recovery latency from t (to the survivors' next phase that completed with no
    failure after `detected_at`) and the figures of the next heal of `rid` after t."""
    recovered = next(
        (
            e
            for e in events
            if e["t"] > detected_at
            and e["event"] == "phase_end"
            and e.get("phase") in Phase.having(PROGRESS)
            and not e.get("failed")
        ),
        None,
    )
    heal = next((e for e in events if e["t"] > t and e["event"] == "heal_end" and e.get("target") == rid), None)
    return {
        "recovery_latency_s": None if recovered is None else recovered["t"] - t,
        "heal_s": None if heal is None else heal.get("seconds"),
        "heal_bytes": None if heal is None else heal.get("bytes"),
    }


def _observed_fault(events: list[dict], seen: dict, *, cause: str | None, detected_by: str) -> dict:
    """A fault entry for a failure no injected fault explains (`seen`: its replica_down or non_finite event)."""
    rid, t = seen["rid"], seen["t"]
    return {
        "source": "observed",
        "rid": rid,
        "kind": "observed",
        "cause": cause,
        "phase": seen.get("phase"),
        "round": seen.get("round"),
        "step": None,
        "fired_at": None,
        "detected_at": t,
        "detection_latency_s": None,
        "detected_by": detected_by,
        **_after(events, rid, t, t),
    }


def run_summary(
    *,
    status: str,
    reason: str | None,
    durable: dict,
    steps_per_round: int,
    digests: dict[str, dict],
    metrics: list[dict],
    fired: list[dict],
    events: list[dict],
    not_fired: list,
    committed_steps: int,
    attempted_steps: int,
    participation: list[float],
    supervisor_started: float,
    now: float,
    run_dir: str,
) -> dict:
    """summary.json: `fallback_summary`'s figures of the durable state and metrics, plus what only the
    live run knows. `digests`: each live replica's digests answer ({param, global, round})."""
    summary = fallback_summary(
        status=status,
        reason=reason,
        durable=durable,
        metrics=metrics,
        now=now,
        steps_per_round=steps_per_round,
        run_dir=run_dir,
        supervisor_started=supervisor_started,
    )
    rounds = durable["committed_round"]
    summary["step_efficiency"], summary["training_efficiency"] = efficiencies(
        committed_steps, attempted_steps, participation
    )
    # the global digest from a replica holding the committed round (one restarted at the very end may not)
    holders = sorted(digests.values(), key=lambda d: d.get("round") != rounds)
    summary.update(
        replica_param_digests={rid: d["param"] for rid, d in digests.items()},
        global_param_digest=next((d["global"] for d in holders if d.get("global")), None),
        faults=fault_figures(fired, events),
        faults_not_fired=not_fired,
    )
    return summary


def fallback_summary(
    *,
    status: str,
    reason: str | None,
    durable: dict,
    metrics: list[dict],
    steps_per_round: int,
    now: float,
    run_dir: str,
    supervisor_started: float | None = None,
) -> dict:
    """summary.json when run_summary cannot be had (the supervisor failed making it, or is gone): the
    same keys, from the durable state and metrics.jsonl; None (or empty) for what only the live run knew."""
    evals = [m["eval_loss"] for m in metrics if m.get("eval_loss") is not None]
    rounds, started = durable.get("committed_round"), durable.get("started_at")
    return {
        "status": status,
        "reason": reason,
        "rounds_committed": rounds,
        "inner_steps_committed": None if rounds is None else rounds * steps_per_round,
        "initial_eval_loss": durable.get("initial_eval_loss"),
        "final_eval_loss": evals[-1] if evals else None,
        "wall_s": None if started is None else now - started,  # the whole run, across supervisor restarts
        "supervisor_wall_s": None if supervisor_started is None else now - supervisor_started,
        "replica_param_digests": {},
        "global_param_digest": None,
        "step_efficiency": None,
        "training_efficiency": None,
        "faults": [],
        "faults_not_fired": [],
        "checkpoints_failed": int(durable.get("checkpoints_failed", 0)),
        "supervisor_starts": durable.get("supervisor_starts", 0),
        "epoch": durable.get("epoch"),
        "tokens_per_cluster": list(durable.get("tokens_per_cluster") or []),
        "link_bytes_per_cluster": link_bytes_per_cluster(metrics),
        "run_dir": run_dir,
    }
