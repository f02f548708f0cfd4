"""A synthetic run folder (events, faults, metrics, summary; no Ray), for the tests of what reads
one (hsgd/record/plots.py, jobs/status.py)."""

import json

T0 = 1_700_000_000.0
RIDS = ["c0r0", "c0r1", "c1r0", "c1r1"]
LEADERS = {"c0": "c0r0", "c1": "c1r0"}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def make_run(run_dir, *, faults=True, metrics=True, summary=True, status="completed", rounds=12):
    """2 clusters x 2 replicas, round r in [r, r+1): inner r+.1-.6, inner_sync -.7, outer (leaders) -.8,
    outer_commit -.9, a checkpoint after round 9. Faults: kill c0r1 at t=5 inside round 5's first
    inner attempt (begun at 4.95), which fails at 5.2 (replica_down); the retry runs without c0r1;
    at 8.0 c0r1 is back (replica_up), healed 8.0-8.3, and a member again from round 8."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("topology:\n  clusters: 2\n  replicas_per_cluster: 2\n")
    ev = [{"t": T0, "event": "supervisor_start", "starts": 1, "pid": 1}]

    def event(t, name, **fields):
        ev.append({"t": T0 + t, "event": name, **fields})

    def phase(t0, t1, name, r, who, failed=None):
        event(t0, "phase_begin", phase=name, round=r, epoch=epoch, replicas=sorted(who))
        failed = failed or {}
        event(t1, "phase_end", phase=name, round=r, seconds=t1 - t0, ok=sorted(set(who) - set(failed)), failed=failed)

    def membership(t, c0):
        event(t, "membership", epoch=epoch, members={"c0": c0, "c1": ["c1r0", "c1r1"]}, leaders=LEADERS, standby=[])

    epoch, live = 1, list(RIDS)
    membership(0.05, ["c0r0", "c0r1"])
    for r in range(rounds):
        inner_from = r + 0.1
        if faults and r == 5:
            phase(4.95, 5.2, "inner", r, live, failed={"c0r1": ["died", "ActorDiedError"]})
            event(5.2, "replica_down", rid="c0r1", phase="inner", round=5, cause="died")
            live, epoch = ["c0r0", "c1r0", "c1r1"], epoch + 1
            membership(5.25, ["c0r0"])
            inner_from = 5.3
        if faults and r == 8:
            event(8.0, "replica_up", rid="c0r1", round=0, step=0)
            event(8.0, "heal_begin", target="c0r1", source="c0r0", scope="full")
            event(8.3, "heal_end", target="c0r1", source="c0r0", scope="full", seconds=0.3, bytes=1000)
            live, epoch = list(RIDS), epoch + 1
            membership(8.35, ["c0r0", "c0r1"])
            inner_from = 8.4
        phase(inner_from, r + 0.6, "inner", r, live)
        phase(r + 0.6, r + 0.7, "inner_sync", r, live)
        phase(r + 0.7, r + 0.8, "outer", r, ["c0r0", "c1r0"])
        phase(r + 0.8, r + 0.9, "outer_commit", r, live)
        event(r + 0.9, "commit", round=r, epoch=epoch, replicas=sorted(live))
        if r == 9:
            phase(9.91, 9.98, "checkpoint", r, live)
    if status:
        ev.append({"t": T0 + rounds, "event": "run_end", "status": status})
    _write_jsonl(run_dir / "events.jsonl", sorted(ev, key=lambda e: e["t"]))
    if faults:
        _write_jsonl(
            run_dir / "faults_fired.jsonl",
            [{"t": T0 + 5.0, "rid": "c0r1", "kind": "kill", "phase": "inner", "round": 5, "step": 2}],
        )
    if metrics:
        _write_jsonl(
            run_dir / "metrics.jsonl",
            [
                {
                    "t": T0 + r + 0.95,
                    "round": r,
                    "inner_step": (r + 1) * 4,
                    "loss": 4.0 - 0.1 * r,
                    "replica_loss": {
                        rid: 4.0 - 0.1 * r + 0.01 * i
                        for i, rid in enumerate(RIDS)
                        if not (faults and rid == "c0r1" and 5 <= r < 8)
                    },
                    "eval_loss": 4.05 - 0.1 * r if r % 3 == 2 else None,
                    "tokens_per_s": 1000.0,
                    "live_replicas": 3 if faults and 5 <= r < 8 else 4,
                    "epoch": 1,
                }
                for r in range(rounds)
            ],
        )
    if summary and status:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "rounds_committed": rounds,
                    "faults": [
                        {
                            "rid": "c0r1",
                            "kind": "kill",
                            "fired_at": T0 + 5.0,
                            "detection_latency_s": 0.2,
                            "recovery_latency_s": 0.9,
                            "heal_s": 0.3,
                        }
                    ]
                    if faults
                    else [],
                }
            )
        )
    return run_dir
