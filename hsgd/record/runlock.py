"""A run owns its folder: an exclusive lock file `run.dir/hsgd.lock` (docs/outputs.md, "Run folders,
checkpoints and resume").

- `acquire` creates the lock with O_CREAT | O_EXCL (one creator wins). A lock already there is
  live unless stale: its process is gone (same host) or its refresh is older than STALE_AFTER_S
  (another host, or a pid reused). A live lock is refused (`RunLocked`); a stale one too, unless
  the caller takes it over (`train.resume=true`).
- A takeover renames the stale lock to a private name and reads it back: if that is not the lock
  it judged (another taker won meanwhile), it puts it back and refuses. Two takers never both hold it.
- A daemon thread refreshes the lock every REFRESH_S; it stops when the lock no longer names this
  run (taken over after this one stalled) and says so in `lost`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

LOCK_NAME = "hsgd.lock"
STALE_AFTER_S = 60.0
REFRESH_S = 10.0


class RunLocked(RuntimeError):
    """The folder is another run's (live, or stale without a takeover). `str(err)` is one line."""


def read_lock(run_dir: str | Path, name: str = LOCK_NAME) -> dict | None:
    """The lock's content; None when there is no lock; {} when it is unreadable (being written)."""
    try:
        info = json.loads((Path(run_dir) / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def stale_reason(info: dict, path: Path) -> str | None:
    """Why the lock at `path` (read: `info`) is stale, or None when it is live. An unreadable lock
    (being created right now) is live until its file is older than STALE_AFTER_S."""
    now, host = time.time(), socket.gethostname()
    if not info:
        with contextlib.suppress(OSError):
            age = now - path.stat().st_mtime
            if age > STALE_AFTER_S:
                return f"unreadable lock not written for {age:.0f} s"
        return None
    pid = info.get("pid")
    if info.get("host") == host and isinstance(pid, int) and not _pid_alive(pid):
        return f"its process {pid} on {host} is gone"
    age = now - float(info.get("refreshed_at") or 0.0)
    if age > STALE_AFTER_S:
        return f"not refreshed for {age:.0f} s (more than {STALE_AFTER_S:.0f} s)"
    return None


def describe(info: dict) -> str:
    if not info:
        return "a run whose lock is being written"
    age = time.time() - float(info.get("refreshed_at") or 0.0)
    return (
        f"run {info.get('run_id')} (pid {info.get('pid')} on {info.get('host')}, refreshed {max(0.0, age):.0f} s ago)"
    )


def check(run_dir: str | Path, takeover: bool) -> None:
    """Read-only: raise RunLocked when `acquire(takeover)` would refuse (a pre-check before anything
    is written; the lock itself is the authority)."""
    info = read_lock(run_dir)
    if info is not None:
        _refuse(run_dir, info, stale_reason(info, Path(run_dir) / LOCK_NAME), takeover)


def _refuse(run_dir, info: dict, reason: str | None, takeover: bool) -> None:
    """Raise RunLocked unless this lock is stale and the caller takes it over."""
    if reason is None:
        raise RunLocked(f"{run_dir} is in use by {describe(info)}; wait for it to end or choose another run.dir")
    if not takeover:
        raise RunLocked(
            f"{run_dir} holds the stale lock of run {info.get('run_id')} ({reason}); "
            f"add train.resume=true to take it over and resume"
        )


class RunLock:
    def __init__(self, run_dir: str | Path, run_id: str, *, refresh_s: float = REFRESH_S):
        self.dir, self.run_id, self.refresh_s = Path(run_dir), run_id, refresh_s
        self.path = self.dir / LOCK_NAME
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.started_at = time.time()
        self.taken_over: dict | None = None  # the stale lock this one replaced
        self.lost: str | None = None  # set when another run took the lock from this one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "host": self.host,
                "pid": self.pid,
                "started_at": self.started_at,
                "refreshed_at": time.time(),
            }
        )

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._content().encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def acquire(self, takeover: bool) -> RunLock:
        """Hold the lock or raise RunLocked (one line). With `takeover`, a stale lock is replaced
        (`taken_over` holds what it said). Starts the refresher."""
        for _ in range(3):  # a lock removed between our O_EXCL and our read: try again
            if self._create():
                self._start_refresher()
                return self
            info = read_lock(self.dir)
            if info is None:
                continue
            reason = stale_reason(info, self.path)
            _refuse(self.dir, info, reason, takeover)
            aside = self.path.with_name(f".{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            moved = read_lock(self.dir, aside.name)
            if moved != info:  # another taker's fresh lock: give it back
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                aside.unlink(missing_ok=True)
                raise RunLocked(f"{self.dir} was just taken by {describe(moved or {})}")
            aside.unlink(missing_ok=True)
            self.taken_over = {**info, "reason": reason}
        raise RunLocked(f"{self.dir}: could not create {LOCK_NAME} (another run keeps racing for it)")

    def still_mine(self) -> bool:
        info = read_lock(self.dir)
        return bool(info) and info.get("run_id") == self.run_id and info.get("pid") == self.pid

    def refresh(self) -> bool:
        """Rewrite the refresh time (temp file + rename). False when the lock is no longer ours."""
        if not self.still_mine():
            self.lost = f"{LOCK_NAME} in {self.dir} now names {describe(read_lock(self.dir) or {})}"
            return False
        with contextlib.suppress(OSError):  # an unwritable folder: the run's storage handling reports it
            atomic_write_text(self.path, self._content())
        return True

    def _start_refresher(self) -> None:
        def loop():
            while not self._stop.wait(self.refresh_s):
                if not self.refresh():
                    return

        self._thread = threading.Thread(target=loop, name="hsgd-runlock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still this run's (never another's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.still_mine():
            with contextlib.suppress(OSError):
                self.path.unlink()
