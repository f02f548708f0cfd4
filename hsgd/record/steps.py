"""Per-step timeline (`logging.step_times=true`): one JSON line per committed inner step in
`run.dir/steps/<rid>.jsonl`,

    {"replica": "c0r1", "step": 412, "t": 1764036000.12, "pid": 81234}

`step`: the replica's global step count after the step; `t`: when its collectives all succeeded;
`pid`: the process that wrote it (a restarted replica appends under its new pid). Line-buffered: a
SIGKILL loses no line already written. A failed write turns the log off for the rest of the
process: the timeline never stops training. The benchmarks time a kill's stall and rejoin from it.
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
            self.file = open(Path(folder) / f"{replica}.jsonl", "a", buffering=1)  # line-buffered

    def committed(self, step: int) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps({"replica": self.replica, "step": int(step), "t": time.time(),
                                        "pid": os.getpid()}) + "\n")
        except (OSError, ValueError):  # a full disk, a closed file
            self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
