"""hsgd itself as one side of a peer benchmark: a real run (`actors.launch.run_training` on the
caller's Ray) with `logging.step_times=true`, its replicas SIGKILLed from outside by the bench —
not by hsgd's fault injector, so hsgd learns of each death as it would in production — and the
same figures as the peers' (benchmarks/peers/common.py) read from its step logs (`run.dir/steps`).

Replicas are hsgd's ids (`c0r1`); the step counted is a replica's global inner step. Ray restarts a
killed replica; it rejoins inside the round (`supervisor.rejoin=fast`) and heals from a live peer
(with `topology.spares_per_cluster`, a warm spare takes its id at once and the restart becomes a spare).
The caller must have called `ray.init` (the bench's one embedded Ray for every side).

`restart_breakdown` (per kill): where the time from the SIGKILL to the victim's next committed step
went, from the run's events and the restarted process's own start-up marks (its `progress()`
answer's `startup`, asked by the bench once Ray has restarted it): seconds from the kill to Ray's
`replica_down`, to the new process, to its module loading, imports done, __init__'s parts, the
supervisor's `replica_up` (or `spare_promoted`), the heal and the first step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.peers.common import (
    Kill,
    committed_steps,
    kill_at_step,
    read_steps,
    recovery,
    step_time_s,
    wait_for_step,
)

QUIET = [
    "logging.wandb.mode=disabled",
    "logging.progress=false",
    "checkpoint.every=0",
    "train.eval_every=1000",
    "logging.step_times=true",
    "supervisor.rejoin=fast",
]


def run_hsgd(
    *,
    model: str,
    clusters: int,
    replicas_per_cluster: int,
    steps: int,
    min_step_s: float,
    out: Path,
    outer_every: int | None = None,
    kills: Sequence[tuple[str, int]] = (),
    kill_times_s: Sequence[tuple[float, str]] = (),
    timeout_s: float = 600,
    seed: int = 0,
    overrides: Sequence[str] = (),
) -> dict:
    """One hsgd run of `steps` inner steps per replica (rounds of `outer_every` steps, default a
    quarter of them), with the given kills from outside. `kills`: (replica,
    at_step); `kill_times_s`: (seconds after the first committed step, replica). Returns the same
    dict as the peers' runners (`peer`: "hsgd")."""
    from actors.launch import compose_config, run_training
    from hsgd.config import validate

    outer_every = outer_every or max(1, steps // 4)
    if steps % outer_every:
        raise ValueError(f"steps ({steps}) must be a multiple of outer_every ({outer_every})")
    settings = [
        f"model={model}",
        f"seed={seed}",
        f"topology.clusters={clusters}",
        f"topology.replicas_per_cluster={replicas_per_cluster}",
        f"sync.outer_every={outer_every}",
        f"train.rounds={steps // outer_every}",
        f"train.min_step_s={min_step_s}",
        *(["sync.outer=average"] if clusters == 1 else []),
        *overrides,
    ]
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
    startups: list[dict] = []
    for replica, at_step in kills:
        done.append(kill_at_step(steps_dir, replica, at_step, max(1.0, deadline - time.monotonic())))
        startups.append(restarted_startup(run_dir, replica, done[-1].pid, deadline, alive=thread.is_alive))
    if kill_times_s:
        first = wait_for_step(steps_dir, "c0r0", 1, max(1.0, deadline - time.monotonic()))["t"]
        done += kill_on_schedule(steps_dir, first, kill_times_s, deadline, alive=thread.is_alive)
    thread.join(max(1.0, deadline - time.monotonic()))
    if thread.is_alive():
        result.setdefault("error", f"the run did not end within {timeout_s:.0f} s")
    summary = result.get("summary") or {}
    steps_log = read_steps(steps_dir)
    return {
        "peer": "hsgd",
        "topology": f"{clusters}x{replicas_per_cluster}",
        "replicas": clusters * replicas_per_cluster,
        "steps": steps,
        "outer_every": outer_every,
        "min_step_s": min_step_s,
        "settings": settings,
        "wall_s": time.time() - start,
        "status": summary.get("status"),
        "result_error": result.get("error"),
        "kills": [k.__dict__ for k in done],
        "recoveries": [recovery(steps_log, k).as_dict() for k in done],
        "restart_breakdown": [
            restart_breakdown(run_dir, steps_log, k, st) for k, st in zip(done, startups, strict=False)
        ],
        "step_time_s": step_time_s(steps_log, before_t=done[0].t if done else None),
        "committed_steps": committed_steps(steps_log),
        "faults_in_summary": len(summary.get("faults") or []),
        "digests_agree": len(set((summary.get("replica_param_digests") or {}).values())) == 1
        if clusters == 1
        else None,
        "run_dir": str(run_dir),
    }


def kill_on_schedule(
    steps_dir: Path, first_t: float, kill_times_s: Sequence[tuple[float, str]], deadline: float, alive=lambda: True
) -> list[Kill]:
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


def restarted_startup(run_dir: Path, replica: str, killed_pid: int, deadline: float, alive=lambda: True) -> dict:
    """The start-up marks of the process Ray restarts for `replica`'s actor after `killed_pid` was
    killed (asked in the background while the run is `alive`: the kill's caller goes on). A dict
    filled in when it answers."""
    out: dict = {}

    def ask() -> None:
        import ray

        try:
            info = json.loads((run_dir / "run.json").read_text())
            handle = ray.get_actor(f"hsgd:{info['run_id']}:{replica}", namespace=info["namespace"])
        except Exception as err:  # noqa: BLE001 — only a figure
            out["error"] = f"{type(err).__name__}: {err}"
            return
        while time.monotonic() < deadline and alive():
            try:
                answer = ray.get(handle.progress.remote(), timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 — the dead process's call failed: the restarted one answers next
                time.sleep(0.1)
                continue
            if answer.get("pid") != killed_pid:
                out.update(answer.get("startup") or {}, pid=answer.get("pid"), spare=answer.get("spare"))
                if "built" in out:  # (a restart builds its trainer behind __init__: asked again until it did)
                    return
            time.sleep(0.1)

    threading.Thread(target=ask, name=f"startup-{replica}", daemon=True).start()
    return out


def restart_breakdown(run_dir: Path, steps_log: dict, kill: Kill, startup: dict) -> dict:
    """Seconds from `kill` to each mark of the victim's way back (None: not seen); `stages`: each
    stage's own length, in order (ray_restart: the kill to the new process, negative when Ray reused
    an idle one; worker_boot: to this module's loading, torch's import included when Ray's class
    unpickling pulls it in first; imports, class_load, init: identity, config, rest; up_probe,
    wait_heal, heal, first_step); `build_s`: the trainer and groups (inside init_rest on a first
    start, behind __init__ on a restart: `build_slack_s` < 0 when the heal waited for it)."""
    events = _events(run_dir)
    rid, t0 = kill.replica, kill.t

    def first(name: str, **match) -> float | None:
        return next(
            (
                e["t"] - t0
                for e in events
                if e["event"] == name and e["t"] >= t0 and all(e.get(k) == v for k, v in match.items())
            ),
            None,
        )

    def mark(key: str) -> float | None:
        value = startup.get(key)
        return value - t0 if isinstance(value, (int, float)) else None

    after = [row["t"] - t0 for row in steps_log.get(rid, []) if row["t"] > t0]
    marks = {
        "replica_down": first("replica_down", rid=rid),
        "process_start": mark("process_start"),
        "module_t0": mark("module_t0"),
        "module_t1": mark("module_t1"),
        "init_begin": mark("init_begin"),
        "identity": mark("identity"),
        "config": mark("config"),
        "trainer": mark("trainer"),
        "init_end": mark("init_end"),
        "built": mark("built"),
        "replica_up": first("replica_up", rid=rid),
        "spare_promoted": first("spare_promoted", rid=rid),
        "heal_begin": first("heal_begin", target=rid),
        "heal_end": first("heal_end", target=rid),
        "first_step": after[0] if after else None,
    }
    back = marks["spare_promoted"] if marks["spare_promoted"] is not None else marks["replica_up"]
    order = [
        ("ray_restart", None, "process_start"),
        ("worker_boot", "process_start", "module_t0"),
        ("imports", "module_t0", "module_t1"),
        ("class_load", "module_t1", "init_begin"),
        ("init_identity", "init_begin", "identity"),
        ("init_config", "identity", "config"),
        ("init_rest", "config", "init_end"),
    ]
    stages = {name: _gap(0.0 if a is None else marks[a], marks[b]) for name, a, b in order}
    if marks["spare_promoted"] is not None:  # a spare took the id: the restart is not on the way back
        stages = {"promote": marks["spare_promoted"]}
    else:
        stages["up_probe"] = _gap(marks["init_end"], back)
    stages.update(
        wait_heal=_gap(back, marks["heal_begin"]),
        heal=_gap(marks["heal_begin"], marks["heal_end"]),
        first_step=_gap(marks["heal_end"], marks["first_step"]),
    )
    return {
        "victim": rid,
        "marks_s": marks,
        "stages_s": stages,
        "detect_s": marks["replica_down"],
        "build_s": _gap(marks["config"], marks["built"]),  # trainer + groups (+ warm-up: a spare)
        "build_slack_s": _gap(marks["built"], marks["heal_begin"]),  # < 0: the heal waited for the build
        "init_s": startup.get("init_s"),
        "restarted_pid": startup.get("pid"),
        "error": startup.get("error"),
    }


def _gap(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _events(run_dir: Path) -> list[dict]:
    rows = []
    path = Path(run_dir) / "events.jsonl"
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
