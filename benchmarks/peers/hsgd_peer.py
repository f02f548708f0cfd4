"""hsgd itself as one side of a peer benchmark: a real run (`actors.launch.run_training` on the
caller's Ray) with `logging.step_times=true`, its replicas SIGKILLed from outside by the bench —
not by hsgd's fault injector, so hsgd learns of each death as it would in production — and the
same figures as the peers' (benchmarks/peers/common.py) read from its step logs (`run.dir/steps`).

Replicas are hsgd's ids (`c0r1`); the step counted is a replica's global inner step. Ray restarts a
killed replica; it rejoins inside the round (`supervisor.rejoin=fast`) and heals from a live peer.
The caller must have called `ray.init` (the bench's one embedded Ray for every side).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Sequence

from benchmarks.peers.common import (Kill, committed_steps, kill_at_step, read_steps, recovery, step_time_s,
                               wait_for_step)

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.every=0", "train.eval_every=1000",
         "logging.step_times=true", "supervisor.rejoin=fast"]


def run_hsgd(*, model: str, clusters: int, replicas_per_cluster: int, steps: int, min_step_s: float, out: Path,
             outer_every: int | None = None, kills: Sequence[tuple[str, int]] = (),
             kill_times_s: Sequence[tuple[float, str]] = (), timeout_s: float = 600, seed: int = 0,
             overrides: Sequence[str] = ()) -> dict:
    """One hsgd run of `steps` inner steps per replica (rounds of `outer_every` steps, default a
    quarter of them), with the given kills from outside. `kills`: (replica,
    at_step); `kill_times_s`: (seconds after the first committed step, replica). Returns the same
    dict as the peers' runners (`peer`: "hsgd")."""
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    outer_every = outer_every or max(1, steps // 4)
    if steps % outer_every:
        raise ValueError(f"steps ({steps}) must be a multiple of outer_every ({outer_every})")
    settings = [f"model={model}", f"seed={seed}", f"topology.clusters={clusters}",
                f"topology.replicas_per_cluster={replicas_per_cluster}", f"sync.outer_every={outer_every}",
                f"train.rounds={steps // outer_every}", f"train.min_step_s={min_step_s}",
                *(["sync.outer=average"] if clusters == 1 else []), *overrides]
    cfg = compose_config(QUIET + settings)
    validate(cfg)
    run_dir = Path(out) / "run"
    steps_dir = run_dir / "steps"
    result: dict = {}

    def train() -> None:
        try:
            result["summary"] = run_training(cfg, str(run_dir))
        except BaseException as err:  # noqa: BLE001 — reported in the figures, the bench goes on
            result["error"] = f"{type(err).__name__}: {err}"

    start = time.time()
    thread = threading.Thread(target=train, name="hsgd-run", daemon=True)
    thread.start()
    done: list[Kill] = []
    deadline = time.monotonic() + timeout_s
    for replica, at_step in kills:
        done.append(kill_at_step(steps_dir, replica, at_step, max(1.0, deadline - time.monotonic())))
    if kill_times_s:
        first = wait_for_step(steps_dir, "c0r0", 1, max(1.0, deadline - time.monotonic()))["t"]
        done += kill_on_schedule(steps_dir, first, kill_times_s, deadline, alive=thread.is_alive)
    thread.join(max(1.0, deadline - time.monotonic()))
    if thread.is_alive():
        result.setdefault("error", f"the run did not end within {timeout_s:.0f} s")
    summary = result.get("summary") or {}
    steps_log = read_steps(steps_dir)
    return {"peer": "hsgd", "topology": f"{clusters}x{replicas_per_cluster}", "replicas": clusters * replicas_per_cluster,
            "steps": steps, "outer_every": outer_every, "min_step_s": min_step_s, "settings": settings,
            "wall_s": time.time() - start, "status": summary.get("status"), "result_error": result.get("error"),
            "kills": [k.__dict__ for k in done], "recoveries": [recovery(steps_log, k).as_dict() for k in done],
            "step_time_s": step_time_s(steps_log, before_t=done[0].t if done else None),
            "committed_steps": committed_steps(steps_log), "faults_in_summary": len(summary.get("faults") or []),
            "digests_agree": len(set((summary.get("replica_param_digests") or {}).values())) == 1 if clusters == 1
            else None, "run_dir": str(run_dir)}


def kill_on_schedule(steps_dir: Path, first_t: float, kill_times_s: Sequence[tuple[float, str]], deadline: float,
                     alive=lambda: True) -> list[Kill]:
    """SIGKILL each (seconds after `first_t`, replica) at its time: the replica's newest pid (the
    live process), unless it has not come back since its last kill (that fault is skipped, as a
    failure process would not hit a dead machine twice). Shared with the peers' failure processes."""
    done: list[Kill] = []
    for after_s, replica in sorted(kill_times_s):
        while time.time() < first_t + after_s and time.monotonic() < deadline and alive():
            time.sleep(0.05)
        if not alive() or time.monotonic() >= deadline:
            break
        rows = read_steps(steps_dir).get(replica, [])
        if not rows or (done and any(k.replica == replica and k.pid == rows[-1]["pid"] for k in done)):
            continue
        try:
            os.kill(rows[-1]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        done.append(Kill(replica=replica, pid=rows[-1]["pid"], t=time.time()))
    return done
