"""Per-step timeline (`logging.step_times=true`; docs/outputs.md; a line's `t`: when the step's
collectives all succeeded). Line-buffered: a SIGKILL loses no line already written. A failed write
turns the log off for the rest of the process: the timeline never stops training.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


class StepLog:
    """Appends one line per committed step to `<folder>/<replica>.jsonl`."""

    def __init__(self, folder: str | os.PathLike, replica: str):
        self.replica = replica
        self.file = None
        with contextlib.suppress(OSError):  # no timeline; training goes on
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(folder) / f"{replica}.jsonl", "a", buffering=1)  # noqa: SIM115 — line-buffered, open until close()

    def committed(self, step: int) -> None:
        if self.file is None:
            return
        try:
            self.file.write(
                json.dumps({"replica": self.replica, "step": int(step), "t": time.time(), "pid": os.getpid()}) + "\n"
            )
        except (OSError, ValueError):  # a full disk, a closed file
            self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
