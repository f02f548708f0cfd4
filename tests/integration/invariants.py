"""The one invariant checker every integration test that runs a job uses. Each check reads only
what the run wrote (metrics.jsonl, events.jsonl, summary.json, faults_fired.jsonl, checkpoints/)
and fails with a message naming the invariant and the replica or round that broke it. They check
what must have happened and what must NOT have: no healthy replica harmed, no round recorded
twice, no checkpoint overwritten."""
from __future__ import annotations

import json
from pathlib import Path

from hsgd.record.rundir import read_jsonl


def _read(run_dir) -> tuple[list[dict], list[dict], dict]:
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl"), summary


def rounds_recorded_once(metrics: list[dict], rounds: int, steps_per_round: int) -> None:
    """Invariant 2: rounds 0..rounds-1 each recorded exactly once, with their inner step."""
    seen = [m["round"] for m in metrics]
    dupes = sorted({r for r in seen if seen.count(r) > 1})
    assert not dupes, f"invariant 2 broken: rounds recorded more than once: {dupes} (metrics rounds {seen})"
    assert seen == list(range(rounds)), f"invariant 2 broken: recorded rounds {seen}, expected 0..{rounds - 1}"
    for m in metrics:
        assert m["inner_step"] == (m["round"] + 1) * steps_per_round, \
            f"invariant 2 broken: round {m['round']} recorded at inner step {m['inner_step']}"


def digests_agree_every_round(metrics: list[dict]) -> None:
    """Invariant 1: after every committed outer sync, every live replica holds identical params."""
    for m in metrics:
        digests = m.get("replica_digests") or {}
        if m.get("recovered") and not digests:
            continue  # recorded late by a restarted supervisor: no digests of that moment exist
        assert len(set(digests.values())) == 1, \
            f"invariant 1 broken in round {m['round']}: replica digests differ: {digests}"


def no_healthy_replica_harmed(events: list[dict], victims: set[str]) -> None:
    """Invariant 7: only replicas the test broke were marked down, hung, killed or restarted."""
    harmed = {}
    for e in events:
        if e["event"] in ("replica_down", "hang_detected", "kill") and e.get("rid") not in victims:
            harmed.setdefault(e["rid"], []).append(e["event"])
    pids: dict[str, set] = {}
    for e in events:
        if e["event"] == "replica_up" and e.get("pid") is not None:
            pids.setdefault(e["rid"], set()).add(e["pid"])
    for rid, seen in pids.items():
        if len(seen) > 1 and rid not in victims:
            harmed.setdefault(rid, []).append(f"restarted ({len(seen)} processes)")
    assert not harmed, f"invariant 7 broken: healthy replicas harmed (victims were {sorted(victims)}): {harmed}"


def commits_only_grow(events: list[dict]) -> None:
    """Committed rounds only grow; only a restore from a checkpoint may take them back."""
    last = -1
    for e in events:
        if e["event"] == "restore":
            last = e["round"] - 1
        elif e["event"] == "commit":
            assert e["round"] == last + 1, f"commit of round {e['round']} after round {last}: a round committed " \
                                           f"twice or skipped"
            last = e["round"]


def checkpoints_never_overwritten(run_dir, events: list[dict]) -> None:
    rounds = [e["round"] for e in events if e["event"] == "checkpoint"]
    dupes = sorted({r for r in rounds if rounds.count(r) > 1})
    assert not dupes, f"checkpoint of round(s) {dupes} written more than once"
    root = Path(run_dir) / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        assert ".tmp-" not in d.name or not (d / "manifest.json").exists(), f"half-written checkpoint {d}"
        if (d / "manifest.json").exists():
            manifest = json.loads((d / "manifest.json").read_text())
            assert d.name == f"round_{manifest['round']:06d}", f"{d.name} holds the manifest of round {manifest['round']}"


def every_scheduled_fault_fired(summary: dict) -> None:
    assert not summary.get("faults_not_fired"), f"scheduled faults never fired: {summary['faults_not_fired']}"


def victims_from_faults(run_dir) -> set[str]:
    return {f["rid"] for f in read_jsonl(Path(run_dir) / "faults_fired.jsonl") if f.get("rid") != "supervisor"}


def check_run(run_dir, *, rounds: int, steps_per_round: int, victims: set[str] | None = None,
              expect_status: str = "completed") -> dict:
    """Every invariant above on one finished run; returns its summary."""
    metrics, events, summary = _read(run_dir)
    assert summary.get("status") == expect_status, f"status {summary.get('status')}: {summary.get('reason')}"
    if expect_status == "completed":
        rounds_recorded_once(metrics, rounds, steps_per_round)
        assert summary["rounds_committed"] == rounds and summary["inner_steps_committed"] == rounds * steps_per_round, \
            f"invariant 2 broken: {summary['rounds_committed']} rounds / {summary['inner_steps_committed']} steps committed"
    digests_agree_every_round(metrics)
    no_healthy_replica_harmed(events, victims_from_faults(run_dir) if victims is None else set(victims))
    commits_only_grow(events)
    checkpoints_never_overwritten(run_dir, events)
    every_scheduled_fault_fired(summary)
    return summary
