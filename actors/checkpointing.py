"""Durable checkpoints, carried out for the supervisor between rounds: every replica at the round
writes its shard into a temporary folder, which becomes final only if every file reports that round
(hsgd.train.checkpoint.finalize; an existing checkpoint is never overwritten, the previous good one
is pruned only after the new one is final); after a total loss every live replica loads the latest
final one and the rounds after it are trained (and recorded) again.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import ray

from hsgd.core.round import Outcome
from hsgd.record.rundir import read_jsonl
from hsgd.train import checkpoint

ATTEMPTS = 3  # a replica lost while saving: the others save again, up to this many times


def save(sup, state_round: int) -> str | None:
    """Durable checkpoint of the state at `state_round` (after round state_round - 1 committed).
    Returns its path, or None when it exists already or every attempt lost a replica."""
    roster, root = sup.roster, Path(sup.run_dir) / "checkpoints"
    if checkpoint.exists(root, state_round):
        sup.log.event("checkpoint_skipped", round=state_round, reason="already exists")
        return None
    for _ in range(ATTEMPTS):
        sup.injector.supervisor_faults(state_round - 1, "checkpoint")
        temp = checkpoint.new_temp_dir(root, state_round)
        members = [rid for rid in sorted(roster.live) if roster.live[rid][0] == state_round]
        armed = sup.injector.arm(state_round - 1, ("checkpoint",), roster.plan(sup.durable["epoch"]), only=set(members))
        refs = {rid: roster.handles[rid].save_checkpoint.remote(str(temp), state_round, armed.get(rid))
                for rid in members}
        saved, failed = {}, {}
        for rid, ref in refs.items():
            try:
                answer = ray.get(ref, timeout=sup.cfg.supervisor.phase_timeout_s)
                (saved if answer["outcome"] == Outcome.DONE.value else failed)[rid] = answer
            except Exception as err:  # noqa: BLE001 — that replica's failure
                failed[rid] = str(err)
                roster.down_after(rid, err, "checkpoint", state_round - 1)
        if failed or not saved or any(a["round"] != state_round for a in saved.values()):
            shutil.rmtree(temp, ignore_errors=True)
            continue
        manifest = {"round": state_round, "step": state_round * sup.spr, "run_id": sup.run_id,
                    "topology": [sup.topology.clusters, sup.topology.replicas_per_cluster],
                    "files": {rid: a["sha256"] for rid, a in saved.items()}, "t": time.time()}
        try:
            final = checkpoint.finalize(temp, manifest, {rid: a["round"] for rid, a in saved.items()})
        except checkpoint.CheckpointError as err:
            sup.log.event("checkpoint_refused", round=state_round, reason=str(err))
            continue
        checkpoint.prune(root, sup.cfg.checkpoint.keep)
        sup.log.event("checkpoint", round=state_round, path=str(final), replicas=sorted(saved))
        return str(final)
    sup.log.event("checkpoint_skipped", round=state_round, reason="replicas failed while saving")
    return None


def restore(sup, reason: str) -> int | None:
    """Total loss: every live replica loads the latest durable checkpoint; metrics of the rounds
    after it are dropped (they are trained again, and each is recorded once). Returns the
    checkpoint's round, or None when there is no checkpoint (the caller fails the run)."""
    roster = sup.roster
    roster.rejoin(sup.cfg.supervisor.rejoin_wait_s)
    latest = checkpoint.latest(Path(sup.run_dir) / "checkpoints")
    if latest is None:
        return None
    manifest = checkpoint.read_manifest(latest)
    for rid in sorted(roster.live):
        try:
            answer = ray.get(roster.handles[rid].load_checkpoint.remote(str(latest), manifest["files"].get(rid)),
                             timeout=sup.cfg.supervisor.phase_timeout_s)
            roster.live[rid] = (answer["round"], answer["step"])
        except Exception as err:  # noqa: BLE001 — it heals from a restored peer later
            roster.down_after(rid, err, "restore", -1)
    metrics_path = Path(sup.run_dir) / "metrics.jsonl"
    sup.log.rewrite_metrics([m for m in read_jsonl(metrics_path) if m.get("round", 0) < manifest["round"]])
    roster.configured, roster.outer_configured = {}, None
    sup.log.event("restore", round=manifest["round"], path=str(latest), reason=reason, replicas=sorted(roster.live))
    return manifest["round"]
