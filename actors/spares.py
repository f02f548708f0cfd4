"""Hot spares: warmed replica processes, per cluster, that take over a dead replica's identity.

A spare is a Replica actor that has paid a fresh process's one-time costs (torch import, model and
optimizer built, the first step's lazy imports) and sits idle. When a replica dies, a ready spare
of its cluster `assume`s the dead one's id (its data stream) and joins the cluster like a restarted
replica: a heal, not a process start. The dead actor's own restart is told to `become_spare`, so
the pool refills in the background. The pool's names are the supervisor's durable state (a
restarted supervisor finds the same spares).
"""
from __future__ import annotations

from typing import Any, Callable

import ray


class SparePool:
    def __init__(self, names: dict[str, list[str]], lookup: Callable[[str], Any]):
        self.names = names  # cluster (as str, JSON's key type) -> actor names; the durable view itself
        self.handles = {n: lookup(n) for group in names.values() for n in group}
        self.ready: set[str] = set()
        self._warming: set[int] = set()  # pids told to become spares

    def __bool__(self) -> bool:
        return any(self.names.values())

    def check(self, log) -> None:
        """Ask every spare whether it is ready (idle and warmed); a restarted replica whose identity
        a spare took over is turned into a spare here. Each question waits at most 0.2 s."""
        for c, names in self.names.items():
            for name in names:
                handle = self.handles.get(name)
                if handle is None or name in self.ready:
                    continue
                try:
                    answer = ray.get(handle.progress.remote(), timeout=0.2)
                except Exception:  # noqa: BLE001 — still starting or restarting: asked again later
                    continue
                if answer.get("phase") != "idle":
                    continue
                if not answer.get("spare"):
                    if answer.get("pid") not in self._warming:
                        self._warming.add(answer.get("pid"))
                        handle.become_spare.remote()  # warms up, then answers spare=True
                    continue
                self.ready.add(name)
                log.event("spare_ready", cluster=int(c), spare=name, pid=answer.get("pid"))

    def promote(self, rid: str, cluster: int, dead_handle, dead_name: str, timeout_s: float):
        """Hand `rid` to a ready spare of `cluster`; the dead actor takes the spare's place in the
        pool. Returns (spare name, spare handle, its progress answer), or None."""
        c = str(cluster)
        for name in [n for n in self.names.get(c, []) if n in self.ready]:
            handle = self.handles[name]
            self.ready.discard(name)
            try:
                answer = ray.get(handle.assume.remote(rid), timeout=timeout_s)
            except Exception:  # noqa: BLE001 — that spare is gone too: try the next one
                continue
            self.names[c].remove(name)
            self.names[c].append(dead_name)
            del self.handles[name]
            self.handles[dead_name] = dead_handle
            return name, handle, answer
        return None
