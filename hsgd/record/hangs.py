"""Hang reports (`hangs/<time>-<rid>.txt`): which replica is stuck, in which function, and who waits
on it, from the stack dumps of the broken group (py-spy, faulthandler, or the replica's own answer).
"""

from __future__ import annotations

import re

from hsgd.core.round.messages import CallKind

# One frame of a stack dump, in the three formats we read:
#   traceback:    File "/x/trainer.py", line 140, in run_inner
#   faulthandler: File "/x/trainer.py", line 140 in run_inner
#   py-spy:       run_inner (hsgd/train/trainer.py:140)
_TB = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>[\w<>.]+)')
_SPY = re.compile(r"^\s+(?P<func>[\w<>.]+) \((?P<file>[^:()]+):(?P<line>\d+)\)")
_PHASE_METHODS = (  # the replica's methods that run a phase (a CallKind is named after its method)
    CallKind.RUN_INNER,
    CallKind.CLUSTER_AVERAGE,
    CallKind.OUTER_REDUCE,
    CallKind.OUTER_COMMIT,
    "save_checkpoint",
    "load_state",
    "inject",
    "_fire",
)


def _frames(block: str) -> list[tuple[str, str, int]]:
    """Frames of one thread, innermost first, whatever the dump format."""
    frames, innermost_last = [], False
    for line in block.splitlines():
        m = _TB.search(line) or _SPY.match(line)
        if m:
            innermost_last = innermost_last or '", line ' in line and ", in " in line  # traceback module
            frames.append((m["func"], m["file"], int(m["line"])))
    return frames[::-1] if innermost_last else frames


def stuck_function(dump: str) -> str | None:
    """'func (dir/file.py:line)' of the innermost frame of the thread that runs a phase, or None."""
    for block in re.split(r"\n(?=Thread |--- thread|Current thread |\s*$)", dump):
        frames = _frames(block)
        if frames and any(f[0].rsplit(".", 1)[-1] in _PHASE_METHODS for f in frames):
            func, file, line = frames[0]
            return f"{func} ({'/'.join(file.split('/')[-2:])}:{line})"
    return None


def hang_report(
    *,
    rid: str,
    phase: str,
    round_index: int,
    waited_s: float,
    deadline_s: float,
    peers: dict[str, str],
    dumps: dict[str, str],
    view: dict,
) -> str:
    """The text of hangs/<time>-<rid>.txt. peers: rid -> what that peer was doing."""
    # everyone else in the call who did not finish was blocked on the stuck replica
    waiting = sorted(p for p, state in peers.items() if p != rid and state != "returned ok")
    lines = [
        f"HANG: replica {rid} missed the {phase} deadline of round {round_index}",
        f"  deadline {deadline_s:.1f}s, waited {waited_s:.1f}s",
        f"  stuck in: {stuck_function(dumps.get(rid, '')) or 'unknown (no stack available)'}",
        f"  peers waiting on it: {', '.join(waiting) if waiting else 'none'}",
        "",
        "supervisor view:",
    ]
    lines += [f"  {p}: {state}" for p, state in sorted(peers.items())]
    lines += [f"  {k}: {v}" for k, v in sorted(view.items())]
    for p in sorted(dumps):
        lines += ["", f"=== stacks of {p} ===", dumps[p].rstrip()]
    return "\n".join(lines) + "\n"
