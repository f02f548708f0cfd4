"""Hot spares: warmed Replica actors (torch imported, model and optimizer built, first step run),
idle per cluster. A ready spare `assume`s a dead replica's id and is healed like a restarted one;
the dead actor's restart is told to `become_spare`, refilling the pool. The pool's names are the
supervisor's durable state. A ready spare is asked nothing more: once ActorWatch sees it die, it
leaves `ready` until it answers again as a warm spare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import ray

from actors.lifecycle import write_identity


class SparePool:
    def __init__(self, names: dict[str, list[str]], lookup: Callable[[str], Any]):
        self.names = names  # cluster (as str, JSON's key type) -> actor names; the durable view itself
        self.handles = {n: lookup(n) for group in names.values() for n in group}
        self.ready: set[str] = set()
        self._warming: set[int] = set()  # pids told to become spares
        self._asked: dict[str, object] = {}  # spare name -> its progress answer, still to collect

    def __bool__(self) -> bool:
        return any(self.names.values())

    def check(self, log, wait_s: float = 0.0) -> None:
        """Ask every spare not yet ready whether it is; a replaced replica's restart is told to become
        one. Blocks at most `wait_s` (0 in the round loop: an answer is collected on a later call)."""
        if wait_s > 0 and self._asked:
            ray.wait(list(self._asked.values()), num_returns=len(self._asked), timeout=wait_s)
        for c, names in self.names.items():
            for name in [n for n in names if self.handles.get(n) is not None and n not in self.ready]:
                if name not in self._asked:
                    self._asked[name] = self.handles[name].progress.remote()
                elif ray.wait([self._asked[name]], timeout=0)[0]:  # else still (re)starting: asked later
                    self._take_answer(int(c), name, self._asked.pop(name), log)

    def _take_answer(self, cluster: int, name: str, ref, log) -> None:
        try:
            answer = ray.get(ref, timeout=1.0)
        except Exception:  # noqa: BLE001 — it died meanwhile: asked again next time
            return
        if answer.get("phase") != "idle":
            return
        if answer.get("spare"):
            self.ready.add(name)
            log.event("spare_ready", cluster=cluster, spare=name, pid=answer.get("pid"))
        elif answer.get("pid") not in self._warming:
            self._warming.add(answer.get("pid"))
            self.handles[name].become_spare.remote()  # warms up, then answers spare=True

    def promote(self, rid: str, cluster: int, dead_handle, dead_name: str, timeout_s: float):
        """Hand `rid` to a ready spare of `cluster` (the dead actor joins the pool): (name, handle, answer) or None."""
        c = str(cluster)
        for name in [n for n in self.names.get(c, []) if n in self.ready]:
            handle = self.handles[name]
            self.ready.discard(name)
            try:
                answer = ray.get(handle.assume.remote(rid), timeout=timeout_s)
            except Exception:  # noqa: BLE001 — that spare is gone too: try the next one
                continue
            # its restart warms up as a spare at once (the KV store unreachable: `check` tells it to)
            with contextlib.suppress(Exception):
                write_identity(dead_name, None, spare=True)
            self.names[c].remove(name)
            self.names[c].append(dead_name)
            del self.handles[name]
            self.handles[dead_name] = dead_handle
            self._asked.pop(name, None)
            return name, handle, answer
        return None
