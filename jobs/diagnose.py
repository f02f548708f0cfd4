"""Diagnose a live run: `python -m jobs.diagnose <run.dir>`.

Prints the supervisor's phase view (status.json) and one stack section per replica, taken the
same way the hang watchdog takes them (py-spy, faulthandler, or the replica's own answer). It
attaches to the run's Ray cluster through `run.json`, which the driver writes when it starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


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
    info = json.loads(info_path.read_text())
    status_path = run_dir / "status.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}

    if info.get("auth_mode") == "token":  # our own cluster, token auth on: attach with the local token
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # before Ray is imported: it reads the mode once
    import ray

    from actors.hang import dump_replica
    from actors.roster import replica_actor_name

    try:
        ray.init(address=info["ray_address"], namespace=info["namespace"], log_to_driver=False,
                 logging_level="ERROR")
    except Exception as err:  # noqa: BLE001
        print(f"hsgd: diagnose: cannot attach to the run's Ray cluster at {info['ray_address']}: {err}", file=sys.stderr)
        return 1
    print(f"=== supervisor view ({status_path}) ===")
    for key in ("phase", "round", "epoch", "members", "leaders", "deadline_s", "last_loss", "updated"):
        print(f"  {key}: {status.get(key)}")
    for rid in info["replicas"]:
        try:
            handle = ray.get_actor(replica_actor_name(info["run_id"], rid), namespace=info["namespace"])
        except ValueError:
            print(f"\n=== {rid}: not found (run over?) ===")
            continue
        try:
            progress = ray.get(handle.progress.remote(), timeout=args.timeout)
        except Exception as err:  # noqa: BLE001 — a hung replica cannot answer; fall back to its last pid
            progress = {"error": type(err).__name__, **(info.get("pids", {}).get(rid) or {})}
        header = f"{rid} pid {progress.get('pid')} phase {progress.get('phase')} round {progress.get('round')} step {progress.get('step')}"
        print(f"\n=== {header} ===")
        print(dump_replica(handle, progress, str(run_dir), rid, timeout_s=args.timeout).rstrip())
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
