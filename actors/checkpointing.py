"""Durable checkpoints, carried out for the supervisor (through its `RunnerPorts`): `save` between
rounds, `restore` after a total loss, `save_model` at the run's end. Replicas of one rank write the
"file" format (`<rid>.pt`), replicas of k > 1 ranks the "dcp" format (`<rid>/`, one DCP checkpoint of
its ranks): hsgd.train.checkpoint. A restore loads either, into any k (its format passed to each replica).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import ray

from actors.round_runner import RunnerPorts
from hsgd.config.auto import inner_schedule
from hsgd.core.deadlines import collective_timeout_s
from hsgd.core.round import Outcome, current_round, model_writers
from hsgd.record.rundir import call_with_deadline
from hsgd.train import checkpoint

ATTEMPTS = 3  # a replica lost while saving: the others save again, up to this many times
WRITE_POLL_S = 0.5  # how often a replica whose write passed its deadline is asked whether it still writes


def save(sup: RunnerPorts, state_round: int) -> str | None:
    """Durable checkpoint of the state at `state_round`: its path, or None when it exists already,
    every attempt lost a replica, or storage refused it. Storage faults are the run's, never a
    replica's (nobody is killed): a replica's `io_error`, its write passing `supervisor.phase_timeout_s`,
    or the supervisor's own steps raising OSError or passing `supervisor.call_timeout_s` (a hung
    mount), skip this checkpoint (`checkpoint_failed`); training goes on, the previous one stays. A
    write past its deadline may still run: `_await_writes`. Failed pruning: `write_failed`."""
    root = checkpoint.root_url(sup.cfg.checkpoint.dir, sup.run_dir)

    def storage(fn, what: str):
        return call_with_deadline(fn, sup.cfg.supervisor.call_timeout_s, f"{what} under {root}")

    try:
        if storage(lambda: checkpoint.exists(root, state_round), "checking for a checkpoint"):
            sup.log.event("checkpoint_skipped", round=state_round, reason="already exists")
            return None
        for _ in range(ATTEMPTS):
            sup.injector.supervisor_faults(state_round - 1, "checkpoint")
            temp = storage(
                lambda: checkpoint.new_temp_dir(root, state_round, owner=sup.run_id),
                "making the checkpoint's temp folder",
            )
            saved, failed, io_errors, stalled = _write_shards(sup, str(temp), state_round)
            complete = bool(saved) and not failed and all(a["round"] == state_round for a in saved.values())
            if io_errors or not complete:
                with contextlib.suppress(OSError):  # a temp folder left behind is `prune`'s
                    storage(lambda temp=temp: checkpoint.remove(temp), f"removing {temp}")
            if io_errors:  # the disk will not do better on a second try right away
                _failed(
                    sup,
                    state_round,
                    "; ".join(f"{rid}: {e}" for rid, e in sorted(io_errors.items())),
                    replicas=sorted(io_errors),
                )
                return _await_writes(sup, stalled)
            if not complete:
                continue
            manifest = _manifest(sup, state_round, saved)
            try:
                final = storage(
                    lambda temp=temp, manifest=manifest, saved=saved: checkpoint.finalize(
                        temp, manifest, {rid: a["round"] for rid, a in saved.items()}
                    ),
                    "finalizing the checkpoint",
                )
            except checkpoint.CheckpointError as err:
                sup.log.event("checkpoint_refused", round=state_round, reason=str(err))
                continue
            sup.log.event("checkpoint", round=state_round, path=str(final), replicas=sorted(saved))
            _prune(sup, storage, root)
            return str(final)
    except OSError as err:  # the supervisor's own storage steps (TimeoutError included)
        return _failed(sup, state_round, f"{type(err).__name__}: {err}")
    sup.log.event("checkpoint_skipped", round=state_round, reason="replicas failed while saving")
    return None


def _manifest(sup: RunnerPorts, state_round: int, saved: dict) -> dict:
    """The checkpoint's manifest.json: what a restore or resume checks and keeps."""
    return {
        "round": state_round,
        "step": state_round * sup.steps_per_round,
        "run_id": sup.run_id,
        "topology": [sup.topology.clusters, sup.topology.replicas_per_cluster],
        "sites": list(sup.topology.sizes),
        "replica_indices": dict(sup.topology.index_table),
        # the driver's (data size and path as it sees them), carried in the durable state
        "fingerprint": sup.state.fingerprint or checkpoint.fingerprint(sup.cfg),
        "inner_schedule": inner_schedule(sup.cfg, sup.layout),  # what a resume keeps for keys left auto
        "files": {rid: a["sha256"] for rid, a in saved.items()},
        # what a restore or resume checks each loaded replica against (issue 45 finding 1)
        checkpoint.PARAM_DIGESTS: {rid: a["param_digest"] for rid, a in saved.items() if a.get("param_digest")},
        "t": time.time(),
        **_format_keys(sup.layout.ranks_per_replica),
    }


def _prune(sup: RunnerPorts, storage, root: str) -> None:
    """Older checkpoints beyond checkpoint.keep removed; a failure is `write_failed`, no more."""
    try:
        storage(lambda: checkpoint.prune(root, sup.cfg.checkpoint.keep, owner=sup.run_id), "pruning old checkpoints")
    except OSError as err:
        sup.log.event(
            "write_failed", what=f"pruning old checkpoints under {root}", error=f"{type(err).__name__}: {err}"
        )


def _format_keys(k: int) -> dict:
    """k = 1: the "file" format, a manifest without `format` (as ever); k > 1: each replica wrote its
    `<rid>/` DCP folder (hsgd.train.checkpoint's "dcp" format), `ranks` saying how many ranks wrote it."""
    return {} if k == 1 else {"format": checkpoint.DCP_FORMAT, "ranks": k}


def _write_shards(sup: RunnerPorts, temp: str, state_round: int) -> tuple[dict, dict, dict, list[str]]:
    """(saved, failed, io_errors, stalled): each live replica at the round writes into `temp`; one
    lost is down. One deadline for all, `supervisor.phase_timeout_s`: a write past it is storage's
    (in io_errors, and in stalled: it may still run), never its replica's."""
    roster, deadline_s = sup.roster, sup.cfg.supervisor.phase_timeout_s
    members = [rid for rid in sorted(roster.live) if roster.live[rid][0] == state_round]
    armed = sup.injector.arm(state_round - 1, ("checkpoint",), roster.plan(sup.state.epoch), only=set(members))
    refs = {rid: roster.handles[rid].save_checkpoint.remote(temp, state_round, armed.get(rid)) for rid in members}
    done = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=deadline_s)[0]) if refs else set()
    saved, failed, io_errors = {}, {}, {}
    stalled = [rid for rid, ref in refs.items() if ref not in done]
    for rid in stalled:
        io_errors[rid] = f"{rid} writing {temp}: no answer within supervisor.phase_timeout_s={deadline_s:g} s (hung?)"
    for rid, ref in refs.items():
        if rid in stalled:
            continue
        try:
            answer = ray.get(ref, timeout=sup.cfg.supervisor.call_timeout_s)
        except Exception as err:  # noqa: BLE001 — that replica's failure (it died, or raised)
            failed[rid] = str(err)
            roster.down_after(rid, err, "checkpoint", state_round - 1)
            continue
        if answer["outcome"] == Outcome.DONE.value:
            saved[rid] = answer
        elif answer["outcome"] == Outcome.IO_ERROR.value:
            io_errors[rid] = answer.get("error", "")
        else:
            failed[rid] = answer
    return saved, failed, io_errors, stalled


def _await_writes(sup: RunnerPorts, rids: list[str]) -> None:
    """Replicas whose write passed its deadline may still be in it, and a replica takes one phase call
    at a time: the next round's would queue behind the write and look hung. So wait, killing nobody,
    while they answer `progress` from their checkpoint phase, up to another `phase_timeout_s`. One
    that died, falls silent or still writes after that is the round machine's, as any replica that
    does not step."""
    deadline = time.monotonic() + sup.cfg.supervisor.phase_timeout_s
    while rids and time.monotonic() < deadline:
        sup.set_status(phase="waiting_for_replicas", busy=list(rids))
        time.sleep(WRITE_POLL_S)
        asked = {rid: sup.roster.probe(rid, sup.cfg.supervisor.call_timeout_s) for rid in rids}
        rids = [rid for rid, answer in asked.items() if (answer or {}).get("phase") == "checkpoint"]


def _failed(sup: RunnerPorts, state_round: int, error: str, replicas: list[str] | None = None) -> None:
    sup.state.checkpoints_failed += 1
    sup.save_state()
    sup.log.event("checkpoint_failed", round=state_round, error=error, replicas=replicas or [])
    sup.warn(f"checkpoint of round {state_round} skipped, training goes on (the previous one stays): {error}")


def save_model(sup: RunnerPorts) -> None:
    """model.safetensors, written by a replica at the last committed round (never the supervisor); failure: an event."""
    roster, path = sup.roster, str(Path(sup.run_dir) / "model.safetensors")
    top = current_round(roster.live.values())
    timeout = collective_timeout_s(sup.cfg.supervisor.call_timeout_s, roster.param_bytes, sup.cfg.comm.min_gbps)
    error = "no live replica holds the last round"
    for rid in model_writers(roster.live):
        try:
            saved = ray.get(roster.handles[rid].save_model.remote(path), timeout=timeout)
        except Exception as err:  # noqa: BLE001 — storage or that replica: try the next one
            error = f"{rid}: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
            continue
        sup.log.event("model_saved", path=path, round=top, rid=rid, bytes=saved["bytes"])
        return
    sup.log.event("write_failed", what="model.safetensors", error=error)


class RestoreFailed(RuntimeError):
    """No checkpoint can bring the run back; the message (one line) says why."""


RESTORES_WITHOUT_PROGRESS = 3  # restores of one checkpoint with no round committed since: then give up


def restore(sup: RunnerPorts, reason: str) -> int:
    """Total loss: choose the newest checkpoint that verifies, touching no replica; bring back
    restarted replicas; each live one that holds a file in it loads its own (the others heal from
    them in the next round). One no live replica holds a file of (saved while they were down), or
    that none of them loads to the params digest its manifest records, is passed over for the one
    before (`checkpoint_fallback`): the run lands on the newest checkpoint the live replicas can load.
    Metrics after it are dropped (trained and recorded again). Returns its round (with no live
    replica too: the caller waits for quorum). RestoreFailed when no checkpoint verifies, none can
    be loaded (naming each round tried and why), or after RESTORES_WITHOUT_PROGRESS restores of it
    with no commit since (a failure recurring after every restore must not loop until restarts run out)."""
    roster = sup.roster
    path, manifest = _choose(sup)
    roster.rejoin(sup.cfg.supervisor.rejoin_wait_s)
    if roster.live:
        path, manifest = _load_newest_loadable(sup, path, manifest)
    else:  # nobody to load it yet: counted as a restore all the same
        _counted(sup, int(manifest["round"]), _repeats(sup, path, int(manifest["round"])))
    state_round = int(manifest["round"])
    # the record's metrics, those still in memory (a run folder outage) included
    sup.log.rewrite_metrics([m for m in sup.log.records("metrics") if m.get("round", 0) < state_round])
    roster.configured, roster.outer_configured = {}, None
    sup.log.event("restore", round=state_round, path=path, reason=reason, replicas=sorted(roster.live))
    return state_round


def _repeats(sup: RunnerPorts, path: str, state_round: int) -> int:
    """How many restores of `state_round` in a row this one would make; RestoreFailed past RESTORES_WITHOUT_PROGRESS."""
    last = sup.state.last_restore
    again = last.get("round") == state_round and sup.state.committed_round <= state_round
    repeats = last.get("count", 0) + 1 if again else 1
    if repeats > RESTORES_WITHOUT_PROGRESS:
        raise RestoreFailed(
            f"checkpoint {path} (round {state_round}) restored {repeats - 1} times without "
            f"committing a round since; giving up"
        )
    return repeats


def _counted(sup: RunnerPorts, state_round: int, repeats: int) -> None:
    """The restore of `state_round`, durably counted (only the one restored: a newer one tried first
    must not reset its count, or a restore that always falls back would loop)."""
    sup.state.last_restore = {"round": state_round, "count": repeats}
    sup.save_state()


def _load_newest_loadable(sup: RunnerPorts, path: str, manifest: dict) -> tuple[str, dict]:
    """From the checkpoint chosen down, the first one a live replica loads: (its path, its manifest)."""
    tried: list[str] = []

    def passed_over(directory: str, why: str) -> None:
        tried.append(f"round {checkpoint.round_of_dir(directory)}: {why}")

    while True:
        state_round = int(manifest["round"])
        problem = checkpoint.holders_problem(manifest, sup.roster.live)
        if problem is None:
            repeats = _repeats(sup, path, state_round)
            problem = _load(sup, path, manifest)
            if problem is None:
                _counted(sup, state_round, repeats)
                return path, manifest
        _skipped(sup, path, problem)
        passed_over(path, problem)
        older = _choose(sup, below=state_round, on_skip=passed_over) if sup.roster.live else None
        if older is None:
            live = ", ".join(sorted(sup.roster.live)) or "none left"
            raise RestoreFailed(f"no replica could load a checkpoint (live: {live}); tried {'; '.join(tried)}")
        path, manifest = older


def _load(sup: RunnerPorts, path: str, manifest: dict) -> str | None:
    """Each live replica holding a file in the checkpoint loads it: None once one did (those that
    failed are then down, restarted clean, and heal from it; a live one past its round too, so it
    cannot lead the next round), else why none did. A replica whose load raised keeps its state
    (it loads nothing half) and stays live for an older checkpoint; one that died or hung is down."""
    roster, timeout = sup.roster, sup.cfg.supervisor.phase_timeout_s
    state_round, loaded, failed = int(manifest["round"]), [], {}
    for rid in checkpoint.holders(manifest, roster.live):
        handle = roster.handles[rid]
        try:
            fmt = checkpoint.format_of(manifest)
            answer = ray.get(handle.load_checkpoint.remote(path, manifest["files"][rid], fmt=fmt), timeout=timeout)
            problem = _digest_problem(sup, handle, manifest, rid)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:  # gone, or stuck loading
            failed[rid] = _one_line(err)
            roster.down_after(rid, err, "restore", -1)
            continue
        except Exception as err:  # noqa: BLE001 — its own error (unreadable, unfit): its state untouched
            failed[rid] = _one_line(err)
            continue
        if problem is not None:
            failed[rid] = problem
            continue
        roster.live[rid] = (answer["round"], answer["step"])
        loaded.append(rid)
    if not loaded:
        return "; ".join(f"{rid}: {why}" for rid, why in failed.items())
    for rid, (r, _) in roster.live.items():
        if r > state_round:
            failed.setdefault(rid, f"holds round {r}, past the restored round {state_round}")
    for rid, why in failed.items():
        if rid in roster.live:
            roster.down_after(rid, checkpoint.CheckpointError(why), "restore", -1)
    return None


def _digest_problem(sup: RunnerPorts, handle, manifest: dict, rid: str) -> str | None:
    """Why the replica's params after its load are not the checkpoint's (None: they are, or the
    manifest records no digest it can be checked against: checkpoint.expected_param_digest)."""
    if not manifest.get(checkpoint.PARAM_DIGESTS):
        return None  # (a checkpoint from before digests were recorded)
    expected = checkpoint.expected_param_digest(manifest, rid, sup.layout.ranks_per_replica)
    if expected is None:
        return None
    got = ray.get(handle.digests.remote(), timeout=sup.cfg.supervisor.phase_timeout_s)["param"]
    return checkpoint.digest_mismatch(rid, got, expected)


def _one_line(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err  # a RayTaskError: the replica's own exception
    return " ".join(str(cause).split())[:300]


def _skipped(sup: RunnerPorts, path: str, why: str) -> None:
    sup.log.event("checkpoint_fallback", path=path, reason=why)
    sup.warn(f"checkpoint {path} skipped: {why}")


def _choose(sup: RunnerPorts, *, below: int | None = None, on_skip=None) -> tuple[str, dict] | None:
    """The checkpoint a restore loads (hsgd.train.checkpoint.choose), or RestoreFailed when none
    verifies. `below`: the next try, older than round `below`, holding a file of a live replica
    (None when there is none)."""
    root = checkpoint.root_url(sup.cfg.checkpoint.dir, sup.run_dir)

    def skipped(path: str, why: str) -> None:
        _skipped(sup, path, why)
        if on_skip is not None:
            on_skip(path, why)

    try:
        found = call_with_deadline(
            lambda: checkpoint.choose(
                root,
                sup.state.fingerprint,
                on_skip=skipped,
                holders_of=None if below is None else set(sup.roster.live),
                below=below,
            ),
            sup.cfg.supervisor.phase_timeout_s,
            f"verifying checkpoints under {root}",
        )
    except OSError as err:
        raise RestoreFailed(f"checkpoints under {root} cannot be read: {type(err).__name__}: {err}") from err
    if found.path is not None:
        return found.path, found.manifest
    if below is not None:
        return None
    none_good = f", {len(found.skipped)} failed verification (checkpoint_fallback events)" if found.skipped else ""
    raise RestoreFailed(
        f"no durable checkpoint to restore under {root}{none_good} (checkpoint.every={sup.cfg.checkpoint.every})"
    )
