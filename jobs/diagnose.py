"""Diagnose a live run: `python -m jobs.diagnose <run.dir>`.
docs/operations.md, "Watching, hangs and diagnosis".

run.json sits in a folder others may write: it is trusted with neither this user's Ray token nor a signal.
- Attach: only to $RAY_ADDRESS when set, else to the cluster of this user's raylet on this node;
  when run.json names another address, refuse with one line (exit 2) and connect nowhere.
- Signal (py-spy, SIGUSR2): only a process Ray's actor table reports as the live
  `actors.replica.Replica` actor named for this run and replica, on this node, owned by this user
  (and, when it answered, with the pid it gave). Any other replica is asked over Ray instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from hsgd.record.rundir import read_json


# -- decisions (pure) ----------------------------------------------------------------------------
def attach_address(recorded: str | None, env_address: str | None, local: set[str]) -> tuple[str | None, str | None]:
    """(address to attach to, None) or (None, one-line refusal). `recorded`: run.json's
    ray_address (untrusted); `env_address`: $RAY_ADDRESS; `local`: the GCS addresses of this
    user's raylets on this node."""
    if not recorded:
        return None, "run.json names no ray_address; give the run.dir of a running job"
    if env_address and env_address != "auto":
        if env_address != recorded:
            return None, (
                f"run.json names the Ray cluster at {recorded}, but RAY_ADDRESS is {env_address}; "
                f"diagnose attaches only where RAY_ADDRESS points (unset it to use this node's cluster)"
            )
        return env_address, None
    if recorded in local:
        return recorded, None
    return None, (
        f"run.json names the Ray cluster at {recorded}, which no Ray node of this user on this machine "
        f"belongs to (local: {sorted(local) or 'none'}); run diagnose on a node of the run's cluster, "
        f"or set RAY_ADDRESS to attach explicitly"
    )


def verified_replica_pid(
    actor: dict | None,
    *,
    expected_name: str,
    here_node: str,
    answered_pid: int | None,
    process_uid: int | None,
    my_uid: int,
) -> tuple[int | None, str]:
    """(pid, "") when the pid may be signalled, else (None, why not). `actor`: Ray's actor table
    entry of the handle diagnose looked up by name (Name, ActorClassName, State, Pid,
    Address.NodeID); `process_uid`: the owner of that pid on this node (None: no such process)."""
    if not actor:
        return None, "not in Ray's actor table"
    pid = int(actor.get("Pid") or 0)
    if actor.get("Name") != expected_name or str(actor.get("ActorClassName", "")).split(".")[-1] != "Replica":
        return None, f"actor {actor.get('Name')!r} ({actor.get('ActorClassName')}) is not this run's replica"
    if actor.get("State") != "ALIVE" or pid <= 0:
        return None, f"actor is {actor.get('State')}"
    if (actor.get("Address") or {}).get("NodeID") != here_node:
        return None, "on another node"
    if answered_pid is not None and int(answered_pid) != pid:
        return None, f"it answered pid {answered_pid}, Ray's table says {pid}"
    if process_uid is None:
        return None, f"no process {pid} on this node"
    if process_uid != my_uid:
        return None, f"process {pid} belongs to another user"
    return pid, ""


# -- what this machine says ----------------------------------------------------------------------
def local_gcs_addresses() -> set[str]:
    """The GCS addresses of the raylets this user runs on this node (their --gcs-address flag)."""
    import psutil
    import ray  # noqa: F401 — puts Ray's bundled psutil on the path

    found: set[str] = set()
    for proc in psutil.process_iter(["cmdline", "uids"]):
        with contextlib.suppress(psutil.Error, OSError):
            cmdline, uids = proc.info["cmdline"] or [], proc.info["uids"]
            if not cmdline or "raylet" not in os.path.basename(cmdline[0]) or uids is None or uids.real != os.getuid():
                continue
            for arg in " ".join(cmdline).split(" "):
                if arg.startswith("--gcs-address=") or arg.startswith("--gcs_address="):
                    found.add(arg.split("=", 1)[1])
    return found


def _process_uid(pid: int) -> int | None:
    import psutil  # Ray's bundled one: local_gcs_addresses imported ray first

    with contextlib.suppress(psutil.Error, OSError):
        return psutil.Process(pid).uids().real
    return None


def _actor_entry(handle) -> dict | None:
    """Ray's own record of the actor behind `handle` (the GCS actor table), or None."""
    from ray._private import state

    with contextlib.suppress(Exception):  # an older/newer Ray without this table: nothing is verified
        return state.actors(actor_id=handle._actor_id.hex()) or None
    return None


def _dump_one(run_id: str, namespace: str, rid: str, here: str, run_dir: Path, timeout_s: float) -> None:
    """One replica's progress and stacks, a signal sent only to a process verified as the run's own."""
    import ray

    from actors.hang import dump_replica
    from actors.roster import replica_actor_name

    name = replica_actor_name(run_id, rid)
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        print(f"\n=== {rid}: not found (run over?) ===")
        return
    try:
        progress = ray.get(handle.progress.remote(), timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 — a hung replica cannot answer: Ray's actor table still can
        progress = {"error": type(err).__name__}
    actor = _actor_entry(handle)
    pid = int((actor or {}).get("Pid") or 0)
    verified, why = verified_replica_pid(
        actor,
        expected_name=name,
        here_node=here,
        my_uid=os.getuid(),
        answered_pid=progress.get("pid"),
        process_uid=_process_uid(pid) if pid > 0 else None,
    )
    print(
        f"\n=== {rid} pid {progress.get('pid') or pid or None} phase {progress.get('phase')} "
        f"round {progress.get('round')} step {progress.get('step')} ==="
    )
    if verified is None:
        print(f"[not signalled: {why}]")
    target = {"pid": verified, "node_id": here if verified else None}
    print(dump_replica(handle, target, str(run_dir), rid, timeout_s=timeout_s).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each replica")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    info_path = run_dir / "run.json"
    if not info_path.is_file():
        print(f"hsgd: diagnose: {run_dir} has no run.json; give the run.dir of a running job", file=sys.stderr)
        return 2
    try:
        info = json.loads(info_path.read_text())
        run_id, namespace, rids = str(info["run_id"]), str(info["namespace"]), [str(r) for r in info["replicas"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(
            f"hsgd: diagnose: {info_path} is not a run.json this version wrote ({type(err).__name__}: {err})",
            file=sys.stderr,
        )
        return 2
    status_path = run_dir / "status.json"
    status = read_json(status_path)

    # Ray turns token auth on by itself only for a cluster it finds on its own, never for an
    # explicit address, so the run's mode is applied; before Ray is imported (it reads the mode
    # once). Nothing is sent anywhere before the address below is verified as this user's own.
    if info.get("auth_mode") == "token":
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    address, refusal = attach_address(info.get("ray_address"), os.environ.get("RAY_ADDRESS"), local_gcs_addresses())
    if refusal:
        print(f"hsgd: diagnose: {refusal}", file=sys.stderr)
        return 2
    import ray

    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    except Exception as err:  # noqa: BLE001
        print(f"hsgd: diagnose: cannot attach to the run's Ray cluster at {address}: {err}", file=sys.stderr)
        return 1
    here = ray.get_runtime_context().get_node_id()
    print(f"=== supervisor view ({status_path}) ===")
    for key in ("phase", "round", "epoch", "members", "leaders", "deadline_s", "last_loss", "updated"):
        print(f"  {key}: {status.get(key)}")
    for rid in rids:
        _dump_one(run_id, namespace, rid, here, run_dir, args.timeout)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
