"""The torchft peer: hsgd's own model trained by flat fault-tolerant DDP under torchft 0.2.0, the
way torchft's README and its `train_ddp.py` set it up, for `python -m benchmarks recovery` and
`goodput`.

What is measured
    N replica groups of one process each (world size 1 per group) train the same model, batches
    (`dataset.batch(seed, replica_index=i, step)`), loss, AdamW, learning rate and gradient
    clipping as hsgd (`hsgd.train.task`, `build_inner_optimizer`, `inner_lr`), every step padded
    to `min_step_s` with a sleep at its end, as hsgd's `train.min_step_s` is. Each worker appends
    a line to the shared step log (benchmarks/peers/common.py) after every step whose optimizer update
    committed, and a digest of its params (sha256 of the bytes, hsgd's `param_digest`) at its
    last step and every `digest_every` steps. The bench SIGKILLs replicas from outside (at a
    logged step, or at the times of a failure process), restarts the process at once with the
    same replica id (what torchx or Kubernetes would do) and reads from the logs: the survivors'
    stall, the victim's rejoin, the fault-free step time and the committed steps.

How (torchft's protocol)
    - Lighthouse (`torchft.coordination.LighthouseServer`, in this process): the replicas'
      managers heartbeat to it every `heartbeat_interval`; a replica is healthy while its last
      heartbeat is younger than `heartbeat_timeout_ms`. A quorum is formed when every member of
      the previous one asked again (fast quorum), or else when at least `min_replicas` healthy
      replicas, more than half of the healthy ones, asked and either every healthy replica asked
      or `join_timeout_ms` passed since the first of them asked; re-checked every
      `quorum_tick_ms` and at every request.
    - Manager (one per worker, its own TCPStore, pg `torchft.process_group.ProcessGroupGloo`): `Optimizer.zero_grad()`
      asks for the quorum at every step (asynchronously, overlapping the forward); a new quorum
      reconfigures the gloo group. A replica behind the quorum's max step heals: a live peer
      sends its `state_dict()` (model + AdamW) over the process group
      (`torchft.checkpointing.pg_transport.PGTransport`, as train_ddp.py does) and this replica loads
      it (`load_state_dict`) before its optimizer step; a healing replica's gradients count as zeros
      in that step's all-reduce.
    - `torchft.DistributedDataParallel` all-reduces the gradients (the mean over the
      participants) through the Manager; `torchft.Optimizer.step()` asks
      `manager.should_commit()` and steps AdamW only if no rank of the group reported an error
      and at least `min_replica_size` replicas took part; the manager's step count rises by one
      exactly when it commits, which is when the worker logs the step.

What can fail
    - A killed peer holds the survivors' next quorum until its heartbeat expires or the join
      timeout passes (the stall measured here). A peer that died between steps costs no failed
      step: the quorum is asked for before each step's all-reduce. The dead incarnation's
      heartbeats also delay the restarted one's admission (more than half of the healthy
      replicas must ask).
    - A peer killed DURING the all-reduce makes the survivors' all-reduce fail (its sockets
      close). torchft's Manager logs and reports the error so that should_commit() says no, but
      torchft 0.2.0's `torchft.ddp.DistributedDataParallel._comm_hook` then asserts on the missing future
      (`assert fut._fut`): the survivor's backward raises AssertionError and its process exits.
    - A peer killed after it asked for a quorum but before the new gloo group was configured
      holds the survivors in `pg.configure` (a store wait) for the gloo timeout; the Manager then
      reports the error and hands the all-reduce a dummy work, on which the same comm hook
      raises AttributeError (`'Future' object has no attribute '_fut'`): the survivor exits too.
      Such exits are restarted like kills and listed in `crashes` with their reason.
      `patch_ddp_hook=True` replaces that hook with one that returns the bucket unreduced when
      the Manager reported an error, so the step is skipped (not committed), as torchft intends,
      and nobody exits; `settings_detail["ddp"]` says which ran.
    - With a join timeout shorter than a step (the "fast" settings), the quorum can re-form
      step after step with no fault: a replica left out of one quorum (late by a few ms, or
      just restarted) asks for the next one a whole step early, which starts the join timer, so
      that quorum closes as soon as the first of the others asks, leaving out the next one, and
      so on. Each worker counts the quorums it saw and its heals (`final`).
    - At the start, a replica whose manager asks before the others' heartbeat commits step 0 alone,
      then meets them at the same step count and is never healed (torchft compares step counts
      only): its params stay different for the whole run. Each worker therefore waits, its Manager
      heartbeating, until every replica's is (`_start_barrier`), as a launcher starts them together.
    - The job ends at `steps`: a replica left out of the last quorum waits for the others'
      heartbeats to expire and commits the last step alone (min_replica_size=1), so its final
      params differ. `params_agree` compares the digests of every step only across commits made
      in a quorum of two or more (`solo_commits` counts the others).
    - A restarted replica that comes up after the others finished has nobody to heal from: the
      run ends when the first replica finishes and the others had `grace_s` to follow; the ones
      that did not are stopped and listed in `unfinished`.
    - A worker that exits non-zero without being killed is restarted too (before the first one
      finished) and listed in `crashes`; more than `MAX_CRASHES` raise RuntimeError. Every wait
      here has a timeout (`timeout_s` for the whole run -> TimeoutError), and every child is
      killed in a `finally`.

Settings
    "readme": the README's lighthouse flags `--min_replicas 1 --quorum_tick_ms 100
    --join_timeout_ms 10000` with the lighthouse's default heartbeat timeout (5000 ms, the CLI's
    default), and train_ddp.py's Manager: `min_replica_size=1`, `timeout=30 s`,
    ProcessGroupGloo(timeout=5 s), PGTransport(timeout=10 s); the rest at the Manager's
    defaults (quorum_timeout 60 s, connect_timeout 60 s, heartbeat_interval 100 ms).
    "fast": join_timeout_ms=100 (a dead member no longer holds the quorum for long);
    quorum_tick_ms=10 (what torchft's own lighthouse tests use: an expired timeout is noticed
    within 10 ms); heartbeat_timeout_ms=1000 (ten heartbeat intervals: a dead incarnation stops
    counting as healthy after 1 s, which admits the restarted one sooner; shorter risks expiring
    live replicas whose heartbeat thread is starved on a loaded 2-core machine); Manager
    timeout 10 s (should_commit and checkpoint RPCs, which take milliseconds here). Unchanged:
    the gloo timeout 5 s (it bounds the all-reduce wait for the slowest replica, which must
    cover a padded step plus a heal on a loaded machine; it is also what a peer killed between
    quorum and configure costs), the transport timeout 10 s, quorum_timeout and
    connect_timeout 60 s (a restarted replica may wait that long for its first quorum while the
    survivors stall; shortening them only adds ways for a live replica to fail).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.peers import common

ROOT = Path(__file__).resolve().parents[2]
MAX_CRASHES = 5  # unplanned worker exits tolerated (restarted) before the run is declared broken

SETTINGS: dict[str, dict] = {
    "readme": {
        "lighthouse": {
            "min_replicas": 1,
            "join_timeout_ms": 10000,
            "quorum_tick_ms": 100,
            "heartbeat_timeout_ms": 5000,
        },
        "manager": {
            "min_replica_size": 1,
            "timeout_s": 30.0,
            "quorum_timeout_s": 60.0,
            "connect_timeout_s": 60.0,
            "heartbeat_interval_ms": 100,
        },
        "pg_gloo_timeout_s": 5.0,
        "checkpoint_transport": "PGTransport",
        "transport_timeout_s": 10.0,
    },
    "fast": {
        "lighthouse": {"min_replicas": 1, "join_timeout_ms": 100, "quorum_tick_ms": 10, "heartbeat_timeout_ms": 1000},
        "manager": {
            "min_replica_size": 1,
            "timeout_s": 10.0,
            "quorum_timeout_s": 60.0,
            "connect_timeout_s": 60.0,
            "heartbeat_interval_ms": 100,
        },
        "pg_gloo_timeout_s": 5.0,
        "checkpoint_transport": "PGTransport",
        "transport_timeout_s": 10.0,
    },
}


# -- the bench side ------------------------------------------------------------------------------


class _Replicas:
    """The worker processes by replica name: spawn, kill, restart, and stop them all."""

    def __init__(self, out: Path, spec: dict):
        self.out, self.spec = out, spec
        self.procs: dict[str, subprocess.Popen] = {}
        self.attempts: dict[str, int] = {}
        self.handled: set[int] = set()  # pids whose exit was seen (or that were killed)
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def spawn(self, replica: str) -> subprocess.Popen:
        n = self.attempts.get(replica, 0)
        self.attempts[replica] = n + 1
        spec = dict(self.spec, replica=replica, index=int(replica[1:]))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.logs / f"{replica}.{n}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.peers.torchft_peer", "worker", json.dumps(spec)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs[replica] = proc
        with open(self.logs / "processes.jsonl", "a") as f:  # every worker ever started, for the record
            f.write(json.dumps({"replica": replica, "attempt": n, "pid": proc.pid, "t": time.time()}) + "\n")
        return proc

    def kill(self, replica: str) -> common.Kill:
        proc = self.procs[replica]
        proc.send_signal(signal.SIGKILL)
        kill = common.Kill(replica=replica, pid=proc.pid, t=time.time())
        self.reap(replica)
        return kill

    def reap(self, replica: str) -> None:
        """Wait for a killed worker's exit (SIGKILL: at once; 30 s at most)."""
        proc = self.procs[replica]
        self.handled.add(proc.pid)
        proc.wait(timeout=30)

    def log_tail(self, replica: str, chars: int = 3000) -> str:
        n = self.attempts.get(replica, 1) - 1
        path = self.logs / f"{replica}.{n}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(
                subprocess.TimeoutExpired
            ):  # a SIGKILLed process that outlives 30 s: nothing more to do
                proc.wait(timeout=30)


def _lighthouse_class():
    """torchft's LighthouseServer, imported with its Rust logger at "warn" unless RUST_LOG says
    otherwise (it logs every quorum request at "info" to this process's stderr; the level is read
    once, on the first import of torchft)."""
    quiet = "torchft._torchft" not in sys.modules and "RUST_LOG" not in os.environ
    if quiet:
        os.environ["RUST_LOG"] = "warn"
    try:
        from torchft.coordination import LighthouseServer
    finally:
        if quiet:
            del os.environ["RUST_LOG"]
    return LighthouseServer


def _crash_reason(log_tail: str) -> str:
    """The last exception line of a worker's log ("" if none)."""
    lines = [line for line in log_tail.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return lines[-1][:300] if lines else ""


def run_torchft(
    *,
    model: str,
    replicas: int,
    steps: int,
    min_step_s: float,
    settings: str,
    out: Path,
    kills: Sequence[tuple[str, int]] = (),
    kill_times_s: Sequence[tuple[float, str]] = (),
    timeout_s: float = 300,
    seed: int = 0,
    overrides: Sequence[str] = (),
    digest_every: int = 0,
    patch_ddp_hook: bool = False,
    grace_s: float | None = None,
) -> dict:
    """Train under torchft with `replicas` replica groups ("r0".."r{N-1}") to `steps` committed
    steps, killing as told, and return the figures (see the module docstring).

    kills: (replica, at_step): SIGKILL once that replica logged that step (in list order).
    kill_times_s: (seconds after the first committed step, replica): a failure process.
    overrides: extra hsgd config overrides (e.g. a smaller model for tests).
    digest_every: also digest the params every that many committed steps (0: at the last step
    only; a digest of the small model costs tens of ms, so benches leave it at 0).
    patch_ddp_hook: False = torchft.DistributedDataParallel as shipped; True = the same wrapper
    with a comm hook that lets a failed all-reduce skip the step instead of raising.
    grace_s: how long the others may take to finish after the first replica did (default
    max(10 s, 20 steps)).
    Raises ValueError for bad arguments, TimeoutError after timeout_s, RuntimeError after more
    than MAX_CRASHES unplanned worker exits.
    """
    if settings not in SETTINGS:
        raise ValueError(f"settings must be one of {sorted(SETTINGS)}, not {settings!r}")
    names = [f"r{i}" for i in range(replicas)]
    unknown = ({r for r, _ in kills} | {r for _, r in kill_times_s}) - set(names)
    if unknown:
        raise ValueError(f"kills of unknown replicas {sorted(unknown)} (replicas are {names})")
    detail = dict(
        SETTINGS[settings],
        patch_ddp_hook=patch_ddp_hook,
        ddp="torchft.DistributedDataParallel"
        + (" with an error-reporting comm hook (patched here)" if patch_ddp_hook else " (as shipped)"),
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "started", ignore_errors=True)  # the start barrier's (a previous run's would pass it)
    folder = out / "steps"
    grace_s = max(10.0, 20 * min_step_s) if grace_s is None else grace_s
    lighthouse = _lighthouse_class()(bind="[::]:0", **detail["lighthouse"])
    spec = {
        "model": model,
        "steps": steps,
        "min_step_s": min_step_s,
        "seed": seed,
        "out": str(out),
        "lighthouse": lighthouse.address(),
        "settings": detail,
        "overrides": list(overrides),
        "digest_every": digest_every,
        "replicas": replicas,
    }
    workers = _Replicas(out, spec)
    step_kills, time_kills = list(kills), sorted(kill_times_s)
    done_kills: list[common.Kill] = []
    down_skips: list[dict] = []  # failures of the process that fell on a replica still down
    crashes: list[dict] = []
    finished: dict[str, float] = {}  # replica -> when its worker exited 0
    unfinished: list[str] = []
    restarts = 0
    start = time.time()
    deadline = time.monotonic() + timeout_s
    try:
        for replica in names:
            workers.spawn(replica)
        first_t = None
        while True:
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {r} ---\n{workers.log_tail(r, 1500)}" for r in names)
                raise TimeoutError(
                    f"torchft run did not finish within {timeout_s:.0f} s (finished: {sorted(finished)})\n{logs}"
                )
            steps_now = common.read_steps(folder)
            if first_t is None:
                ts = [row["t"] for rows in steps_now.values() for row in rows]
                first_t = min(ts) if ts else None
            for replica, proc in list(workers.procs.items()):  # exits
                rc = proc.poll()
                if rc is None or replica in finished or proc.pid in workers.handled:
                    continue
                workers.handled.add(proc.pid)
                if rc == 0:
                    finished[replica] = time.time()
                    continue
                tail = workers.log_tail(replica, 3000)
                crashes.append(
                    {
                        "replica": replica,
                        "pid": proc.pid,
                        "rc": rc,
                        "t": time.time(),
                        "reason": _crash_reason(tail),
                        "log_tail": tail[-1500:],
                    }
                )
                if len(crashes) > MAX_CRASHES:
                    raise RuntimeError(f"{len(crashes)} unplanned torchft worker exits; last: {crashes[-1]}")
                if not finished:
                    workers.spawn(replica)
                    restarts += 1
            if finished:  # the job is done when the first replica is; the rest get grace_s to follow
                pending = [r for r in names if r not in finished]
                if not pending:
                    break
                if time.time() - min(finished.values()) > grace_s:
                    unfinished = pending
                    break
            else:
                victim = None
                if step_kills and _logged_live(steps_now, workers, *step_kills[0]):
                    replica, at_step = step_kills.pop(0)
                    victim = common.kill_at_step(folder, replica, at_step, timeout_s=5.0)
                    workers.reap(replica)
                elif time_kills and first_t is not None and time.time() >= first_t + time_kills[0][0]:
                    at_s, replica = time_kills.pop(0)
                    # the rule of every side's failure process (benchmarks/peers/hsgd_peer.kill_on_schedule): a
                    # replica that has not committed a step since its last kill is still down, not hit again
                    last_kill = max((k.t for k in done_kills if k.replica == replica), default=None)
                    if last_kill is None or any(row["t"] > last_kill for row in steps_now.get(replica, [])):
                        victim = workers.kill(replica)
                    else:
                        down_skips.append({"replica": replica, "at_s": at_s, "reason": "not back since its last kill"})
                if victim is not None:
                    done_kills.append(victim)
                    workers.spawn(victim.replica)  # at once, same replica id: it heals from a live peer
                    restarts += 1
            time.sleep(0.02)
    finally:
        workers.stop_all()
        lighthouse.shutdown()

    steps_all = common.read_steps(folder)
    reached = [next((row["t"] for row in steps_all.get(r, []) if row["step"] >= steps), None) for r in names]
    reached = [t for t in reached if t is not None]
    final = {}
    for replica in names:
        path = out / "digests" / f"{replica}.json"
        final[replica] = json.loads(path.read_text()) if path.exists() else None
    return {
        "peer": "torchft",
        "settings": settings,
        "replicas": replicas,
        "steps": steps,
        "min_step_s": min_step_s,
        "model": model,
        "overrides": list(overrides),
        "wall_s": (max(reached) - start) if reached else None,
        "kills": [asdict(k) for k in done_kills],
        "recoveries": [common.recovery(steps_all, k).as_dict() for k in done_kills],
        "step_time_s": common.step_time_s(steps_all, before_t=done_kills[0].t if done_kills else None),
        "committed_steps": common.committed_steps(steps_all),
        "restarts": restarts,
        "crashes": crashes,
        "kills_skipped": [{"replica": r, "at_step": s} for r, s in step_kills]
        + [{"replica": r, "at_s": s} for s, r in time_kills]
        + down_skips,
        "unfinished": unfinished,
        # the field every side's runner has: None when every replica reached `steps`
        "result_error": f"replicas did not reach step {steps}: {unfinished}" if unfinished else None,
        "final": final,
        **_digest_agreement(out / "digests"),
        "settings_detail": detail,
    }


def _logged_live(steps: dict[str, list[dict]], workers: _Replicas, replica: str, at_step: int) -> bool:
    """Has `replica`'s live process logged `at_step` (or later)? (A line of a dead incarnation,
    killed earlier, does not count: kill_at_step kills the newest line's writer.)"""
    rows = steps.get(replica, [])
    proc = workers.procs.get(replica)
    return bool(rows) and proc is not None and rows[-1]["pid"] == proc.pid and rows[-1]["step"] >= at_step


def _digest_agreement(folder: Path) -> dict:
    """Across every digest the workers logged: the steps where two commits made in quorums of two
    or more disagree (none, if healing is right), and the commits made alone."""
    by_step: dict[int, set[str]] = {}
    solo: dict[str, int] = {}
    checked = 0
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                continue
            if row["quorum_size"] < 2:
                solo[row["replica"]] = solo.get(row["replica"], 0) + 1
                continue
            checked += 1
            by_step.setdefault(row["step"], set()).add(row["digest"])
    mismatched = sorted(step for step, digests in by_step.items() if len(digests) > 1)
    return {
        "params_agree": checked > 0 and not mismatched,
        "digest_steps_checked": sorted(by_step),
        "digest_mismatch_steps": mismatched,
        "solo_commits": solo,
    }


# -- the worker side -----------------------------------------------------------------------------


class _CountQuorums:
    """A logging handler on torchft's "torchft_quorums" / "torchft_commits" loggers (one record per
    new quorum / per should_commit): counts what the worker saw."""

    def __init__(self):
        import logging

        counts = self

        class Handler(logging.Handler):
            def emit(self, record):
                if record.name == "torchft_quorums":
                    counts.quorum_ids.add(getattr(record, "quorum_id", None))
                elif record.name == "torchft_commits" and getattr(record, "commit_result", True) is False:
                    counts.commit_failures += 1

        self.quorum_ids: set = set()
        self.commit_failures = 0
        for name in ("torchft_quorums", "torchft_commits"):
            lg = logging.getLogger(name)
            lg.setLevel(logging.INFO)
            lg.propagate = False
            lg.addHandler(Handler())


def _reporting_ddp_class(timeout):
    """`timeout`: the Manager's (a timedelta); the hook's wait is bounded by it."""
    import torch
    import torchft

    class ReportingDDP(torchft.DistributedDataParallel):
        """torchft's DDP wrapper whose comm hook, when the all-reduce failed (the Manager logged and
        reported the error, so should_commit() will say no), returns the bucket as it is instead of
        asserting on the missing future (torchft 0.2.0's hook raises AssertionError there, or
        AttributeError for the buckets after the first failed one)."""

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            # bounded twice: the Manager wraps the all-reduce's future in its own timeout, and the wait says it too
            ok = work.wait(timeout=timeout)
            inner = getattr(work.get_future(), "_fut", None)
            if ok and inner is not None:
                return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())  # garbage, never applied: the step does not commit
            return done

    return ReportingDDP


def _start_barrier(folder: Path, replica: str, replicas: int, *, timeout_s: float, heartbeat_s: float) -> None:
    """A worker's first incarnation waits here, its Manager already heartbeating to the lighthouse,
    until every replica's is (a file each in `folder`), then two heartbeats more: the first quorum
    then waits for all of them (every healthy replica asks within the join timeout) instead of
    forming around whichever process started first. Without it, a replica that committed step 0
    alone meets the others at the same step count, and torchft (which compares step counts only)
    never heals it: its params stay different. A job launcher starts a torchft job's replicas
    together, as hsgd's. A restarted incarnation finds every file there and passes at once (it is
    behind, and heals). Raises TimeoutError after `timeout_s`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / replica).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{replica}: only {sorted(f.name for f in folder.iterdir())} of {replicas} replicas "
                f"started within {timeout_s:g} s"
            )
        time.sleep(0.01)
    time.sleep(2 * heartbeat_s)


def _worker(spec: dict) -> int:
    import logging
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    from actors.launch import compose_config
    from hsgd.train import task
    from hsgd.train.inner import build_inner_optimizer, inner_lr, optimizer_implementation
    from hsgd.train.trainer import param_digest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    replica, index, steps, detail = spec["replica"], spec["index"], spec["steps"], spec["settings"]
    cfg = compose_config(
        [f"model={spec['model']}", f"seed={spec['seed']}", "logging.wandb.mode=disabled", *spec["overrides"]]
    )
    dataset = task.build_dataset(cfg)
    torch.manual_seed(cfg.seed)  # identical initial params everywhere, as hsgd's replicas
    model = task.build_model(cfg, dataset.vocab_size)
    params = list(model.parameters())
    loss_fn = task.build_loss(cfg)
    inner = build_inner_optimizer(cfg, params)
    foreach = optimizer_implementation(cfg) != "single"
    clip, accum, o = float(cfg.optim.inner.grad_clip), int(cfg.data.grad_accum), cfg.optim.inner

    def batch(step: int, micro: int):
        return dataset.batch("train", seed=cfg.seed, replica_index=index, step=step, micro=micro)

    # warm-up before joining (a fresh process's first forward/backward is slow): grads dropped
    loss_fn(model, batch(0, 0)).backward()
    for p in params:
        p.grad = None

    import torchft
    from torch.distributed import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport

    counts = _CountQuorums()
    heals = [0]
    manager_ref: list = []

    def set_lr(step: int) -> None:  # a pure function of the step, as hsgd's inner_lr
        for group in inner.param_groups:
            group["lr"] = inner_lr(o, step, steps)

    def load_state_dict(state: dict) -> None:  # healing: what a live peer sent
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        set_lr(manager_ref[0].current_step())  # the peer's lr was its previous step's
        heals[0] += 1

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    m = detail["manager"]
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=m["connect_timeout_s"])
    )
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=detail["pg_gloo_timeout_s"]))
    transport = PGTransport(pg, timeout=timedelta(seconds=detail["transport_timeout_s"]), device=torch.device("cpu"))
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=m["min_replica_size"],
        replica_id=replica,
        lighthouse_addr=spec["lighthouse"],
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=m["timeout_s"]),
        quorum_timeout=timedelta(seconds=m["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=m["connect_timeout_s"]),
        heartbeat_interval=timedelta(milliseconds=m["heartbeat_interval_ms"]),
        checkpoint_transport=transport,
    )
    manager_ref.append(manager)
    _start_barrier(
        Path(spec["out"]) / "started",
        replica,
        int(spec["replicas"]),
        timeout_s=m["connect_timeout_s"],
        heartbeat_s=m["heartbeat_interval_ms"] / 1000,
    )
    ddp = (
        _reporting_ddp_class(timedelta(seconds=m["timeout_s"]))
        if detail["patch_ddp_hook"]
        else torchft.DistributedDataParallel
    )(manager, model)
    optimizer = torchft.Optimizer(manager, inner)
    log = common.StepLog(Path(spec["out"]) / "steps", replica)
    digests = Path(spec["out"]) / "digests"
    digests.mkdir(parents=True, exist_ok=True)
    with open(digests / f"{replica}.jsonl", "a", buffering=1) as digest_log:
        every = int(spec["digest_every"])
        while manager.current_step() < steps:
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)  # asks for the quorum, asynchronously
            step = manager.current_step()  # a healing replica's is stale, but its gradients count as zeros
            for micro in range(accum):
                if micro < accum - 1:
                    with ddp.no_sync():
                        (loss_fn(ddp, batch(step, micro)) / accum).backward()
                else:
                    loss = loss_fn(ddp, batch(step, micro))
                    (loss / accum if accum > 1 else loss).backward()
            manager.wait_quorum()  # done already (the all-reduce waited for it): the step count is final
            before = manager.current_step()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=foreach)
            set_lr(before)
            optimizer.step()  # should_commit(): AdamW steps only if the quorum's step committed
            done = manager.current_step()
            if done == before + 1:
                log.committed(done)
                if done == steps or (every > 0 and done % every == 0):
                    digest_log.write(
                        json.dumps(
                            {
                                "replica": replica,
                                "pid": os.getpid(),
                                "step": done,
                                "digest": param_digest(params),
                                "quorum_size": pg.size(),
                            }
                        )
                        + "\n"
                    )
            time.sleep(max(0.0, spec["min_step_s"] - (time.perf_counter() - started)))  # as hsgd's train.min_step_s
        tmp = digests / f".{replica}.{os.getpid()}.json"
        tmp.write_text(
            json.dumps(
                {
                    "replica": replica,
                    "pid": os.getpid(),
                    "step": manager.current_step(),
                    "digest": param_digest(params),
                    "quorums": len(counts.quorum_ids),
                    "heals": heals[0],
                    "commit_failures": counts.commit_failures,
                }
            )
        )
        tmp.replace(digests / f"{replica}.json")
    log.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torchft's server threads need not wind down: everything is written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.torchft_peer", description="a torchft worker (spawned by run_torchft)"
    )
    parser.add_argument("role", choices=["worker"])
    parser.add_argument("spec", help="the worker's spec as JSON")
    args = parser.parse_args(argv)
    return _worker(json.loads(args.spec))


if __name__ == "__main__":
    sys.exit(main())
