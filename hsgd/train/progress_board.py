"""Replicas' progress pushed to the run's store, read by the supervisor with one round trip per tick
(issue 36): no call per replica per tick through the supervisor actor.

Protocol. Key `<secret>/hsgd_progress/<rid>` in the run's TCPStore (the store the groups rendezvous
in: bound to the supervisor's node address, every key under the run's 128-bit secret). Value
`round,step,pid` (ascii): the replica's latest committed inner step, and the process that wrote it
(a value a dead process wrote before its restart is told apart from its successor's).
- A replica's `Publisher` records (round, step) from the training thread, which never waits on the
  store; a daemon thread writes the latest value at most once per `interval_s`, and only when it
  changed, and again after every `address` (a key the supervisor cleared is written anew). The
  store's address comes with every run_inner call: a restarted supervisor has a new store under a
  new secret.
- The supervisor's `Board` clears the keys of every replica at a round's start (`reset`), then reads
  those of the replicas in an inner phase with one `multi_get` per tick (`read`).
Failure cases. The store unreachable (the supervisor died, its store with it): the publisher's write
fails and is dropped, its client rebuilt at the next write; nothing waits longer than `timeout_s`,
and never the training thread. A replica that has not stepped since the reset reads as empty: no
observation (the machine's limits decide, as for a call not answered). A failed read returns None:
the runner asks by calls for that tick.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

KEYS = "hsgd_progress"


class Publisher:
    def __init__(self, rid: str, *, interval_s: float = 0.5, timeout_s: float = 2.0):
        self.rid, self.interval_s, self.timeout_s = rid, interval_s, timeout_s
        self._latest: tuple[int, int] | None = None
        self._store_addr: str | None = None
        self._sent: tuple[str, tuple[int, int]] | None = None  # (store address, value) last written
        self._client: tuple[str, object] | None = None  # (store address, its client)
        self._warned: str | None = None  # the address a failed write was reported for
        self._thread: threading.Thread | None = None

    def address(self, store_addr: str | None) -> None:
        """The run's store (`host:port/<secret>`), as the supervisor's latest call named it; the
        current value is written again (the supervisor clears keys when a round starts)."""
        if store_addr:
            self._store_addr, self._sent = store_addr, None

    def publish(self, round_index: int, step: int) -> None:
        """The latest committed step (the training thread's: records it, never waits)."""
        self._latest = (round_index, step)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"progress-{self.rid}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            addr, value = self._store_addr, self._latest
            if addr is None or value is None or self._sent == (addr, value):
                continue
            try:
                if self._client is None or self._client[0] != addr:
                    from torchft.process_group import create_store_client

                    self._client = (
                        addr,
                        create_store_client(f"{addr}/{KEYS}", timeout=timedelta(seconds=self.timeout_s)),
                    )
                self._client[1].set(self.rid, f"{value[0]},{value[1]},{os.getpid()}")
                self._sent = (addr, value)
            except Exception as err:  # noqa: BLE001 — the store is gone (its supervisor died): a new address comes
                self._client = None
                if self._warned != addr:  # once per store: a replica that cannot publish looks silent
                    self._warned = addr
                    print(
                        f"[hsgd] {self.rid}: cannot publish its progress ({type(err).__name__}: {err})",
                        file=sys.stderr,
                        flush=True,
                    )


class Board:
    """The supervisor's side: `store` is the run's master TCPStore, `store_addr` its members' address."""

    def __init__(self, store, store_addr: str):
        from torch.distributed import PrefixStore

        self.keys = PrefixStore(f"{store_addr.partition('/')[2]}/{KEYS}", store)
        self.cleared: set[str] = set()  # keys that exist (a multi_get of a missing key would wait for it)

    def reset(self, rids: list[str]) -> bool:
        """Clear every replica's key (a round starts: earlier values are stale). False if the store failed."""
        try:
            if rids:
                self.keys.multi_set(list(rids), [""] * len(rids))
            self.cleared = set(rids)
            return True
        except Exception:  # noqa: BLE001 — the runner falls back to calls
            self.cleared = set()
            return False

    def read(self, rids: list[str]) -> dict[str, tuple[int, int, int]] | None:
        """rid -> (round, step, pid) of each that published since the reset; None when the store
        failed or a key was not cleared."""
        if not set(rids) <= self.cleared:
            return None
        try:
            values = self.keys.multi_get(list(rids)) if rids else []
        except Exception:  # noqa: BLE001
            return None
        out = {}
        for rid, raw in zip(rids, values, strict=True):
            text = bytes(raw).decode("ascii", "replace")
            fields = text.split(",")
            if len(fields) == 3 and fields[0].lstrip("-").isdigit() and fields[1].isdigit() and fields[2].isdigit():
                out[rid] = (int(fields[0]), int(fields[1]), int(fields[2]))
        return out
