"""The one invariant checker every integration test that runs a job uses.

Each check reads only what the run wrote (metrics.jsonl, events.jsonl, summary.json,
faults_fired.jsonl, config.yaml, checkpoints/) and fails with a message that names the invariant
(ARCHITECTURE.md, "Invariants") and the replica or round that broke it. They check what must have
happened and what must NOT have: no round recorded twice or skipped, no healthy replica harmed, no
checkpoint written twice or rewritten, no scheduled fault silently never fired.

    summary = check_run(run_dir, rounds=4, steps_per_round=20, victims={"c0r1"})

`victims` are the replicas the test broke; left out, they are the replicas named in
faults_fired.jsonl (each line names the concrete replica a fault hit, so `cluster:c1` is never
expanded here). A replica outside `victims` that was marked down, declared hung, killed or
restarted is a healthy replica harmed (invariant 7).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from hsgd.config.rounds import is_streaming
from hsgd.record.rundir import read_jsonl

HARM_EVENTS = ("replica_down", "hang_detected", "kill")
MTIME_SLACK_S = 1.0  # file-system timestamps vs time.time() on the same machine


# -- reading a run -----------------------------------------------------------------------------
def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def scheduled_faults(run_dir) -> list[dict]:
    """The faults the run was asked to fire: config.yaml's faults.schedule plus any a drill added
    (supervisor_state.json `added_faults`). Random faults (faults.mtbf_s) are not listed here; the
    summary's `faults_not_fired` covers them."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    schedule = list(((config or {}).get("faults") or {}).get("schedule") or [])
    return schedule + list(_json(run_dir / "supervisor_state.json").get("added_faults") or [])


def victims_from_faults(run_dir) -> set[str]:
    """The replicas that faults_fired.jsonl says were hit (the supervisor is no replica)."""
    return {
        f["rid"] for f in read_jsonl(Path(run_dir) / "faults_fired.jsonl") if f.get("rid") not in (None, "supervisor")
    }


def _jobs(events: list[dict]) -> list[list[dict]]:
    """events.jsonl split per job (driver): a resumed run appends to the same file, and its first
    supervisor says `supervisor_start` with starts == 1. Supervisor restarts stay in one job."""
    jobs: list[list[dict]] = [[]]
    for e in events:
        if e["event"] == "supervisor_start" and e.get("starts") == 1 and jobs[-1]:
            jobs.append([])
        jobs[-1].append(e)
    return jobs


# -- the invariants ----------------------------------------------------------------------------
def rounds_recorded_once(metrics: list[dict], rounds: int, steps_per_round: int) -> None:
    """Invariant 2: rounds 0..rounds-1 each recorded exactly once, in order, at their inner step."""
    seen = [m["round"] for m in metrics]
    dupes = sorted({r for r in seen if seen.count(r) > 1})
    assert not dupes, (
        f"invariant 2 (each round recorded once) broken: round(s) {dupes} recorded more than "
        f"once in metrics.jsonl (rounds in file order: {seen})"
    )
    missing, extra = sorted(set(range(rounds)) - set(seen)), sorted(set(seen) - set(range(rounds)))
    assert not missing and not extra, (
        f"invariant 2 (no round lost or invented) broken: metrics.jsonl lacks "
        f"round(s) {missing} and has unexpected round(s) {extra}; expected 0..{rounds - 1}"
    )
    assert seen == sorted(seen), f"invariant 2: metrics.jsonl records rounds out of order: {seen}"
    for m in metrics:
        assert m["inner_step"] == (m["round"] + 1) * steps_per_round, (
            f"invariant 2 (no step lost) broken: round {m['round']} recorded at inner step {m['inner_step']}, "
            f"expected {(m['round'] + 1) * steps_per_round}"
        )


def _disagreement(digests: dict[str, str]) -> str:
    by_digest: dict[str, list[str]] = {}
    for rid, d in sorted(digests.items()):
        by_digest.setdefault(d, []).append(rid)
    return "; ".join(f"{rids} hold {d[:12]}" for d, rids in sorted(by_digest.items(), key=lambda kv: -len(kv[1])))


def _by_cluster(digests: dict[str, str]) -> dict[str, dict[str, str]]:
    """rid -> digest, split by cluster (rids are c<cluster>r<index>)."""
    out: dict[str, dict[str, str]] = {}
    for rid, d in digests.items():
        out.setdefault(rid.split("r")[0], {})[rid] = d
    return out


def digests_agree_every_round(metrics: list[dict], *, streaming: bool = False) -> None:
    """Invariant 1: after every committed outer sync, every live replica holds bitwise-identical
    parameters (and the same global parameters). `streaming` (fragments or a mixing weight): the
    working params agree within each cluster only; the global params still agree everywhere."""
    for m in metrics:
        digests = m.get("replica_digests") or {}
        if m.get("recovered") and not digests:
            continue  # recorded late by a restarted supervisor: no digests of that moment exist
        assert digests, f"invariant 1: round {m['round']} was recorded as committed with no replica digests"
        for group in _by_cluster(digests).values() if streaming else [digests]:
            assert len(set(group.values())) == 1, (
                f"invariant 1 (identical params after every commit) broken in round {m['round']}: "
                f"{_disagreement(group)}"
            )
        globals_ = m.get("global_digests") or {}
        assert len(set(globals_.values())) <= 1, (
            f"invariant 1 (identical global params after every commit) broken in round {m['round']}: "
            f"{_disagreement(globals_)}"
        )


def summary_matches(
    summary: dict, *, rounds: int, steps_per_round: int, expect_status: str, streaming: bool = False
) -> None:
    """summary.json says what happened: its status, and invariant 2's committed rounds and steps."""
    assert summary, "summary.json is missing: the run never ended"
    assert summary.get("status") == expect_status, (
        f"summary status {summary.get('status')!r}, expected {expect_status!r}: {summary.get('reason')}"
    )
    assert summary["rounds_committed"] == rounds and summary["inner_steps_committed"] == rounds * steps_per_round, (
        f"invariant 2 broken: summary says {summary['rounds_committed']} rounds / {summary['inner_steps_committed']} "
        f"inner steps committed, expected {rounds} / {rounds * steps_per_round}"
    )
    if expect_status == "completed":
        final = summary.get("replica_param_digests") or {}
        assert final, "invariant 1: no replica digests at the end of the run"
        for group in _by_cluster(final).values() if streaming else [final]:
            assert len(set(group.values())) == 1, f"invariant 1 broken at the end of the run: {_disagreement(group)}"


def no_healthy_replica_harmed(events: list[dict], victims: set[str]) -> None:
    """Invariant 7: only replicas the test broke were marked down, declared hung, killed or
    restarted (a second process for the same replica id within one job)."""
    harmed: dict[str, list[str]] = {}
    for e in events:
        if e["event"] in HARM_EVENTS and e.get("rid") not in victims:
            harmed.setdefault(e.get("rid"), []).append(
                f"{e['event']}({e.get('cause') or e.get('reason') or e.get('phase') or ''})"
            )
    for job in _jobs(events):
        pids: dict[str, set] = {}
        for e in job:
            if e.get("rid") is not None and e.get("pid") is not None:  # replica_up, spare_promoted
                pids.setdefault(e["rid"], set()).add(e["pid"])
        for rid, seen in sorted(pids.items()):
            if len(seen) > 1 and rid not in victims:
                harmed.setdefault(rid, []).append(f"restarted ({len(seen)} processes: {sorted(seen)})")
    assert not harmed, (
        f"invariant 7 (no healthy replica harmed) broken: replicas outside the victims "
        f"{sorted(victims)} were harmed: {harmed}"
    )


def commits_only_grow(events: list[dict], metrics: list[dict]) -> None:
    """Committed rounds only grow, one at a time: no round committed twice, none skipped. A round a
    restarted supervisor recorded late (`round_recorded_late`) counts as its commit. Only a
    `restore` after a total loss, or a resumed job, may go back, to the checkpoint's round. Every
    round recorded in metrics.jsonl was committed (nothing recorded that was not done)."""
    committed: set[int] = set()
    for job in _jobs(events):
        last = None  # a resumed job starts at its checkpoint's round, unknown until its first commit
        for e in job:
            if e["event"] == "restore":
                assert last is None or e["round"] <= last + 1, (
                    f"restore to round {e['round']} after round {last} committed: it skips rounds"
                )
                last = e["round"] - 1
            elif e["event"] in ("commit", "round_recorded_late"):
                r = e["round"]
                if e["event"] == "round_recorded_late" and r in committed and last is not None and r <= last:
                    continue  # its commit was announced; the supervisor died before recording it
                assert last is None or r == last + 1, (
                    f"commits only grow, one round at a time: {e['event']} of round {r} after round {last}: "
                    + (
                        "a round committed twice"
                        if r <= last
                        else f"round(s) {list(range(last + 1, r))} never committed"
                    )
                )
                last = r
                committed.add(r)
    uncommitted = sorted({m["round"] for m in metrics} - committed)
    assert not uncommitted, (
        f"round(s) {uncommitted} recorded in metrics.jsonl with no commit event: "
        f"recorded as committed but never committed"
    )


def checkpoints_never_overwritten(run_dir, events: list[dict], damaged: set[str] = frozenset()) -> None:
    """A checkpoint is written once and never rewritten: one `checkpoint` event per round; each
    final directory holds its own round's manifest and files that match the manifest's sha256 and
    were not touched after the checkpoint was announced; no half-written directory looks final.
    `damaged`: the directories the test itself corrupted (not read)."""
    rounds = [e["round"] for e in events if e["event"] == "checkpoint"]
    dupes = sorted({r for r in rounds if rounds.count(r) > 1})
    assert not dupes, f"checkpoint of round(s) {dupes} written more than once (checkpoint events: {rounds})"
    announced = {e["round"]: e for e in events if e["event"] == "checkpoint"}
    root = Path(run_dir) / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.name in damaged:
            continue
        if ".tmp-" in d.name:
            assert not (d / "manifest.json").exists(), f"half-written checkpoint {d.name} holds a manifest"
            continue
        manifest = json.loads((d / "manifest.json").read_text())
        assert d.name == f"round_{manifest['round']:06d}", (
            f"checkpoint {d.name} holds the manifest of round {manifest['round']}"
        )
        sharded = manifest.get("format") == "dcp"  # each replica's DCP folder: its manifest.json, then its files
        for rid, sha in (manifest.get("files") or {}).items():
            listed = [(f"{rid}/manifest.json", sha)] if sharded else [(f"{rid}.pt", sha)]
            if sharded and (d / rid / "manifest.json").is_file():
                listed += [
                    (f"{rid}/{name}", h)
                    for name, h in json.loads((d / rid / "manifest.json").read_text())["files"].items()
                ]
            for name, expected in listed:
                path = d / name
                assert path.is_file(), f"checkpoint {d.name} lacks {name} that its manifest lists"
                actual = hashlib.sha256(path.read_bytes()).hexdigest()
                assert actual == expected, (
                    f"checkpoint {d.name}/{name} was rewritten: sha256 {actual[:12]} != manifest {expected[:12]}"
                )
        event = announced.get(manifest["round"])
        if event is None:
            continue  # brought in from elsewhere (a checkpoint copied in to resume from)
        assert manifest.get("t", 0) <= event["t"], (
            f"checkpoint {d.name} was rewritten: its manifest (t={manifest.get('t')}) "
            "is newer than its checkpoint event"
        )
        for f in d.iterdir():
            assert f.stat().st_mtime <= event["t"] + MTIME_SLACK_S, (
                f"checkpoint {d.name}/{f.name} was rewritten {f.stat().st_mtime - event['t']:.1f}s "
                "after the checkpoint was final"
            )


def _hits(target: str, rid: str) -> bool:
    if target == "supervisor":
        return rid == "supervisor"
    if ":" in target:  # leader:c1 | cluster:c1
        return rid.startswith(target.split(":", 1)[1] + "r")
    return rid == target


def _matches(spec: dict, fired: dict) -> bool:
    # str(): YAML reads the kind `nan` as a float (config.yaml says `.nan`), as parse_fault does
    if not (
        fired.get("kind") == str(spec["kind"])
        and fired.get("round") == spec["round"]
        and fired.get("phase") == spec.get("phase", "inner")
        and _hits(str(spec["target"]), str(fired.get("rid")))
    ):
        return False
    # a fault fired inside a replica at an inner step boundary records that step; one fired from
    # outside (ray.kill of a target that takes no part in the call) has no pid and step 0
    inner = spec.get("phase", "inner") in ("inner", "inner_sync")
    return not (inner and fired.get("pid") is not None and fired.get("step") != spec.get("step", 0))


def _describe(spec: dict) -> str:
    where = f"round {spec['round']} {spec.get('phase', 'inner')}"
    return f"{spec['kind']} {spec['target']} at {where}" + (
        f" step {spec.get('step', 0)}" if spec.get("phase", "inner").startswith("inner") else ""
    )


def every_scheduled_fault_fired(run_dir, summary: dict) -> None:
    """Every fault of the schedule fired (a line in faults_fired.jsonl, at its round, phase and
    step), and no fault fired twice: a drill must never pass on a failure that did not happen."""
    fired = read_jsonl(Path(run_dir) / "faults_fired.jsonl")
    specs = scheduled_faults(run_dir)
    # the most specific targets first, so a replica fault never takes a cluster fault's line
    order = sorted(
        range(len(specs)), key=lambda i: ("cluster:" in str(specs[i]["target"]), "leader:" in str(specs[i]["target"]))
    )
    used: set[int] = set()
    never = []
    for i in order:
        line = next((j for j, f in enumerate(fired) if j not in used and _matches(specs[i], f)), None)
        if line is None:
            never.append(f"faults.schedule[{i}] {_describe(specs[i])}")
        else:
            used.add(line)
            if "cluster:" in str(specs[i]["target"]):  # every member it hit wrote its own line
                used |= {j for j, f in enumerate(fired) if _matches(specs[i], f)}
    assert not never, (
        f"scheduled faults never fired: {never} ({len(fired)} line(s) in faults_fired.jsonl for {len(specs)} scheduled)"
    )
    assert not summary.get("faults_not_fired"), f"scheduled faults never fired: {summary['faults_not_fired']}"
    keys = [
        (f.get("rid"), f.get("kind"), f.get("round"), f.get("phase"), f.get("step"))
        for f in fired
        if f.get("phase") != "now"
    ]  # drills' injections "now" carry no round
    twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    assert not twice, f"a fault fired more than once (rid, kind, round, phase, step): {twice}"


def run_is_streaming(run_dir) -> bool:
    """The run synced fragments or mixed with a weight (its config.yaml says): working params then
    differ between clusters between syncs, by design (ARCHITECTURE.md, invariant 1)."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        return False
    config = OmegaConf.load(path)
    return "sync" in config and is_streaming(config)


def final_params_agree(summary: dict, run_dir) -> bool:
    """Invariant 1 at the end of a run: every replica's working params are the same (per cluster
    under streaming, `run_is_streaming`)."""
    final = summary.get("replica_param_digests") or {}
    groups = _by_cluster(final).values() if run_is_streaming(run_dir) else [final]
    return bool(final) and all(len(set(g.values())) == 1 for g in groups)


# -- all of them -------------------------------------------------------------------------------
def replica_indices_stable(run_dir, events: list[dict]) -> None:
    """Invariant: a replica id keeps its global replica index (its data stream) for the whole run:
    every process that came up as `rid` (replica_up, in every job of a resumed run) read the index
    the run's table gives it, and every checkpoint's table agrees with the run's on the ids both hold."""
    run_dir = Path(run_dir)
    table = _json(run_dir / "supervisor_state.json").get("replica_indices") or {}
    if not table:
        return  # a run from before the table
    assert len(set(table.values())) == len(table), f"two replicas share a global index: {table}"
    for e in events:
        if e["event"] == "replica_up" and e.get("replica_index") is not None:
            assert e["replica_index"] == table.get(e["rid"]), (
                f"{e['rid']} came up reading stream {e['replica_index']}, "
                f"but the run's table gives {table.get(e['rid'])}"
            )
    for manifest in sorted((run_dir / "checkpoints").glob("round_*/manifest.json")):
        kept = _json(manifest).get("replica_indices") or {}
        moved = {rid: (i, table[rid]) for rid, i in kept.items() if rid in table and table[rid] != i}
        assert not moved, f"{manifest.parent.name}: replica indices moved (checkpoint, run): {moved}"


def plans_followed(events: list[dict], metrics: list[dict]) -> None:
    """sync.balance=steps: a round's plan is decided once — every `round_plan` event of a round (a
    restarted supervisor's, a retry's) names the same steps, the later ones `recorded` — and each
    committed round's `cluster_steps` is that plan. Without plans: every cluster ran the same steps."""
    plans: dict[int, list[int]] = {}
    for job in _jobs(events):  # a resume may plan a round afresh (its learned times start over)
        plans_in_job: dict[int, dict] = {}
        for e in (e for e in job if e["event"] == "round_plan"):
            first = plans_in_job.setdefault(e["round"], e)
            assert e["steps"] == first["steps"], (
                f"round {e['round']}'s plan changed from {first['steps']} to {e['steps']} (planned once, then followed)"
            )
            assert e is first or e["source"] == "recorded", f"round {e['round']} was planned twice: {e}"
        plans.update({r: e["steps"] for r, e in plans_in_job.items()})
    # sync.balance=time: a round closes once (a successor follows the recorded close, logging none), and each
    # cluster ran at least the steps its close asked (a yield lands on the first boundary at or after the one
    # asked), none when it was late
    closes: dict[int, dict] = {}
    for job in _jobs(events):  # (a resume may run a round afresh)
        in_job = [e for e in job if e["event"] == "round_closed"]
        twice = sorted({e["round"] for e in in_job if sum(x["round"] == e["round"] for x in in_job) > 1})
        assert not twice, f"rounds {twice} closed twice in one job (a successor follows the recorded close)"
        closes.update({e["round"]: e for e in in_job})
    late = {(e["round"], e["cluster"]) for e in events if e["event"] == "site_late"}
    for m in metrics:
        steps = m.get("cluster_steps")
        if steps is None or m.get("recovered"):
            continue
        if m["round"] in closes:
            named = {int(c): n for c, n in closes[m["round"]]["steps"].items()}
            for c, n in enumerate(steps):
                late_c = (m["round"], c) in late
                ok = n == 0 if late_c else named.get(c, 0) <= n
                assert ok, f"round {m['round']}: c{c} ran {n} steps, its close asked {named.get(c)} (late: {late_c})"
        elif m["round"] in plans:
            assert steps == plans[m["round"]], f"round {m['round']} ran {steps}, not its plan {plans[m['round']]}"
        else:
            assert len(set(steps)) <= 1, f"round {m['round']} has unequal cluster steps {steps} but no round_plan"


def check_run(
    run_dir,
    *,
    rounds: int,
    steps_per_round: int,
    victims: set[str] | None = None,
    expect_status: str = "completed",
    summary: dict | None = None,
    recorded: int | None = None,
    damaged: set[str] = frozenset(),
) -> dict:
    """Every invariant above on one finished run; returns its summary. `rounds`: the rounds that
    must be committed and recorded (for a failed run, those committed before it failed). A run whose
    folder was gone when it ended: `summary`, the one it printed on the console (no summary.json),
    and `recorded`, the rounds its folder holds (the later ones' records were lost with it).
    `damaged`: the checkpoint directories the test corrupted on purpose."""
    run_dir = Path(run_dir)
    metrics, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    summary = _json(run_dir / "summary.json") if summary is None else summary
    streaming = run_is_streaming(run_dir)
    summary_matches(
        summary, rounds=rounds, steps_per_round=steps_per_round, expect_status=expect_status, streaming=streaming
    )
    rounds_recorded_once(metrics, rounds if recorded is None else recorded, steps_per_round)
    digests_agree_every_round(metrics, streaming=streaming)
    no_healthy_replica_harmed(events, victims_from_faults(run_dir) if victims is None else set(victims))
    commits_only_grow(events, metrics)
    checkpoints_never_overwritten(run_dir, events, damaged)
    every_scheduled_fault_fired(run_dir, summary)
    replica_indices_stable(run_dir, events)
    plans_followed(events, metrics)
    return summary
