"""Stack dumps of replica processes, for hang reports and `jobs.diagnose`. Best first: py-spy
(native + Python frames, even while the process holds the GIL; same node), faulthandler through
SIGUSR2 (a C handler that needs no GIL; same node), the replica's own `stack_dump` (any node, if the
replica can still run Python).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from hsgd.record.hangs import hang_report, stuck_function

DUMP_SIGNAL = signal.SIGUSR2
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def faulthandler_path(run_dir: str, rid: str, pid: int) -> Path:
    return Path(run_dir) / "stacks" / f"{rid}-{pid}.txt"


def install_faulthandler(run_dir: str, rid: str) -> None:
    """Called in the replica: SIGUSR2 writes all threads' stacks to stacks/<rid>-<pid>.txt."""
    path = faulthandler_path(run_dir, rid, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")  # noqa: SIM115 — kept open for the life of the process, as faulthandler requires
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)


def dump_local_pid(pid: int, run_dir: str, rid: str, timeout_s: float = 10.0) -> tuple[str, str] | None:
    """(method, text) for a process on this node, or None."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            out = subprocess.run(
                [spy, "dump", "--pid", str(pid), "--native"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "NO_COLOR": "1", "TERM": "dumb"},
            )
            if out.returncode == 0 and out.stdout.strip():
                return "py-spy", _ANSI.sub("", out.stdout)  # some terminals' settings make it colour anyway
    path = faulthandler_path(run_dir, rid, pid)
    try:
        before = path.stat().st_size if path.exists() else 0
        os.kill(pid, DUMP_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return None
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > before:
            time.sleep(0.2)  # let the handler finish writing
            return "faulthandler", path.read_text(errors="replace")[before:]
        time.sleep(0.05)
    return None


def thread_stacks(title: str) -> str:
    """Python stacks of every thread in this process, under `title` (a replica's `stack_dump`)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = [title]
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---")
        out.extend(line.rstrip() for line in traceback.format_stack(frame))
    return "\n".join(out)


def dump_replica(handle, info: dict, run_dir: str, rid: str, *, timeout_s: float = 3.0) -> str:
    """Best available stack dump of one replica; never raises, never blocks past its timeouts."""
    pid = info.get("pid")
    if pid and info.get("node_id") == ray.get_runtime_context().get_node_id():
        got = dump_local_pid(int(pid), run_dir, rid)
        if got:
            return f"[{got[0]} dump of pid {pid}]\n{got[1]}"
    try:
        return "[replica's own stack_dump]\n" + ray.get(handle.stack_dump.remote(), timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 — a hung or dead replica cannot answer
        return (
            f"[no stack: {type(err).__name__}: replica did not answer within {timeout_s:.0f}s and is not on this node]"
        )


def kill_hung(kill, ports, machine) -> None:
    """`machine` (the round's RoundMachine) found `kill.rid` hung (a Kill): write a hang report with
    its group's stacks (hangs/<time>-<rid>.txt), log `hang_detected` and `kill`, kill it restartable."""
    rid, roster, run_dir, log, round_index = kill.rid, ports.roster, ports.run_dir, ports.log, machine.round
    group = sorted(
        x
        for x in (machine.ids[kill.cluster] if kill.cluster is not None else roster.handles)
        if x in machine.progress or x == rid
    )
    dumps: dict[str, str] = {}
    if ports.stack_dumps:
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = {
                p: pool.submit(
                    dump_replica,
                    roster.handles[p],
                    {**roster.replica_info.get(p, {}), "pid": roster.pids.get(p)},
                    run_dir,
                    p,
                )
                for p in group
            }
            for p, fut in futures.items():
                try:
                    dumps[p] = fut.result(timeout=30.0)
                except Exception as err:  # noqa: BLE001 — a dump that failed is reported as such
                    dumps[p] = f"(no stack: {err})"
    peers = {p: ("stuck" if p == rid else "in its group") for p in group}
    text = hang_report(
        rid=rid,
        phase=kill.phase,
        round_index=round_index,
        waited_s=kill.silent_s,
        deadline_s=kill.limit_s,
        peers=peers,
        dumps=dumps,
        view={"epoch": machine.epoch, "leaders": machine.leaders},
    )
    path = Path(run_dir) / "hangs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{rid}.txt"
    log.write_file(path, text, make_parent=True)  # with a deadline; a failure is the folder's health
    log.event(
        "hang_detected",
        rid=rid,
        phase=kill.phase.record,
        round=round_index,
        cluster=kill.cluster,
        reason=kill.reason,
        waited_s=kill.silent_s,
        deadline_s=kill.limit_s,
        stuck_in=stuck_function(dumps.get(rid, "")),
        report=str(path),
        waiting=[p for p in group if p != rid],
    )
    log.event("kill", rid=rid, reason=kill.reason)
    try:
        ray.kill(roster.handles[rid], no_restart=False)
    except Exception as err:  # noqa: BLE001 — already dead is fine
        log.event("kill_failed", rid=rid, error=str(err))
