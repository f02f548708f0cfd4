"""Ray's actor table and the run log, as the roster's and the watch's tests see them: a table the test
sets row by row (or makes unreadable), and a log that keeps typed events."""

from __future__ import annotations

RUN = "hsgd:run-1"


def name(short: str) -> str:
    return f"{RUN}:{short}"


class Table:
    """Ray's actor table as the watch reads it: one row per actor, set by the test."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.fail = False
        self.namesakes: list[dict] = []

    def set(self, short: str, state: str, restarts: int, pid: int = 0) -> None:
        self.rows[name(short)] = {
            "Name": name(short),
            "State": state,
            "NumRestarts": restarts,
            "Pid": pid,
            "StartTime": 1,
        }

    def add_dead_namesake(self, short: str) -> None:
        """A DEAD row under `short`'s name that never started: an actor registered by a supervisor
        killed before it created it (Ray keeps the row once a new actor takes the name)."""
        self.namesakes.append({"Name": name(short), "State": "DEAD", "NumRestarts": 0, "Pid": 0, "StartTime": 0})

    def __call__(self):
        if self.fail:
            raise ConnectionError("GCS unreachable")
        return self.namesakes + list(self.rows.values())
