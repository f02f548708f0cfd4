"""Cores kept busy by another process, as on a loaded machine: `busy_cores()` starts busy-loop
processes at normal priority and kills them on exit, whatever the body raised.

    with busy_cores():
        ...  # the run's supervisor and replicas get what the loops leave

    python -m tests.integration.load [-n N] -- python -m pytest -q tests/integration/test_drill.py

Ray starts its workers (the supervisor and the replicas) at nice 15, so next to a busy loop at
nice 0 a worker gets about 1/30 of that core: one loop per core starves the run (a replica's
restart takes minutes), which is not what a drill has to survive. The default leaves one core to
the run and keeps every other core busy (at least one loop).

Each loop process exits by itself after `max_s`, and when the process that started it is gone,
so a test killed before its `finally` leaves nothing spinning."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

# spin until max_s passes or the parent (the process that started it) is gone, then exit
_LOOP = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    n += 1
    if n % 200000 == 0 and os.getppid() != parent:
        break
"""


def default_processes() -> int:
    return max(1, (os.cpu_count() or 1) - 1)


@contextlib.contextmanager
def busy_cores(processes: int | None = None, max_s: float = 900.0):
    """`processes` busy loops (default: one per core but one, at least one) for the body's
    duration, each at most max_s. Yields their Popen objects."""
    count = default_processes() if processes is None else processes
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOOP, str(os.getpid()), str(max_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILLed: reaped by the OS once this process exits
                p.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.integration.load", description="run a command while busy loops keep the cores busy"
    )
    parser.add_argument(
        "-n",
        "--processes",
        type=int,
        default=None,
        help=f"busy loops (default: cores - 1, at least 1; here {default_processes()})",
    )
    parser.add_argument("--max-s", type=float, default=3600.0, help="the loops stop after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    with busy_cores(args.processes, max_s=args.max_s):
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
