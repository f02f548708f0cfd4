"""The run folder on disk: nothing under run.dir is ever half-written. A file is written to a temp
name in the same folder, fsynced and renamed into place (a crash leaves the old file or the new
one); a JSON-lines append is all or nothing; `FolderWriter` does a folder's writes with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk must not also fill up with our temp files
        raise


def append_lines(path: str | Path, data: str) -> None:
    """Append `data` (whole lines) to `path`, all of it or nothing: a write that fails part-way is
    cut back to where it began, so a retry appends the lines once; a fragment left when even that
    cut failed is closed by a newline first, a line of its own that read_jsonl skips. Raises OSError."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        blob = data.encode("utf-8")
        if size and os.pread(fd, 1, size - 1) != b"\n":
            blob = b"\n" + blob
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        with contextlib.suppress(OSError):  # every byte was written (or the error above is raised): nothing to redo
            os.close(fd)


def read_json(path: str | Path) -> dict:
    """A JSON file the run keeps rewriting (status.json, run.json, supervisor_state.json): {} when it
    is absent or unreadable (a reader elsewhere may race the writer's rename, or a crash)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(path).read_text(encoding="utf-8"))
    return {}


def read_jsonl(path: str | Path) -> list[dict]:
    """Every whole record of a JSON-lines file ([] when it is absent); a line being written right
    now, or a fragment a failed append left, is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines() if Path(path).exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


NO_WRITE = object()  # a FolderWriter job's answer when it had nothing to write: it tells nothing of the folder


class FolderWriter:
    """Does one folder's writes on a thread of its own, so that no write blocks its caller past a
    deadline: a write to a hung NFS mount costs a waiting caller `deadline_s` once; while it is
    stuck, later callers queue theirs and return at once (they run in order when it returns).

    `submit(key, fn, wait)` queues `fn()`, replacing a queued job of the same key (whose caller then
    gets the newer job's result: the newest status.json wins). With `wait`: fn's result (True for
    None) when it returned within the deadline; False when it raised OSError or is late (it may still
    succeed; at once while the thread is stuck); a caller's own `deadline_s` (the run's end) is waited
    in any case. Without `wait`: None at once. OSError is never raised but recorded as the folder's
    health (`health()`: failing from its first failed or stuck write until a write succeeds;
    `on_change(ok, error, down_s)` runs on the writer thread when that flips, never with a lock held:
    it may submit more writes). Any other exception is a bug, re-raised to a waiting caller.
    """

    def __init__(self, deadline_s: float, on_change: Callable[[bool, str, float], None] | None = None):
        self.deadline_s = float(deadline_s)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._queued: dict[object, list] = {}  # key -> [fn, done Event, result]
        self._order: queue.SimpleQueue = queue.SimpleQueue()
        self._failing_since: float | None = None  # monotonic
        self._error = ""
        self._running_since: float | None = None  # the job on the thread now (monotonic)
        self._thread = threading.Thread(target=self._loop, name="hsgd-folder-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        key: object,
        fn: Callable[[], object],
        wait: bool = True,
        deadline_s: float | None = None,
        counts: bool = True,
    ):
        """`counts`: the job is a write whose outcome tells the folder's health (a read is not)."""
        with self._lock:
            job = self._queued.get(key)
            if job is None:
                job = self._queued[key] = [fn, threading.Event(), None, counts]
                self._order.put(key)
            else:
                job[0] = fn
        if not wait:
            return None
        if deadline_s is None and self.stuck_s() > 0:
            return False  # the thread is stuck in an earlier write: do not wait behind it
        if not job[1].wait(self.deadline_s if deadline_s is None else deadline_s):
            return False
        if isinstance(job[2], BaseException):
            raise job[2]
        return job[2]

    def stuck_s(self) -> float:
        """How long the job on the thread has run past the deadline (0: none has)."""
        since = self._running_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since - self.deadline_s)

    def health(self) -> tuple[float, str]:
        """(seconds the folder has failed — 0 when it works —, the last error). A write stuck past
        the deadline counts as failing since it began."""
        now = time.monotonic()
        with self._lock:
            since, error = self._failing_since, self._error
            running = self._running_since
        if running is not None and now - running > self.deadline_s:
            stuck = f"a write has not returned for {now - running:.0f} s (storage hung?)"
            if since is None or running < since:
                since, error = running, stuck
        return (0.0, "") if since is None else (now - since, error)

    def _loop(self) -> None:
        while True:
            key = self._order.get()
            with self._lock:
                fn, done, _, counts = job = self._queued.pop(key)
                self._running_since = time.monotonic()
            ok, error = True, ""
            try:
                result = fn()
                if result is NO_WRITE:
                    result, ok = True, None
                job[2] = True if result is None else result
            except OSError as err:
                job[2], ok, error = False, False, f"{type(err).__name__}: {err}"
            except BaseException as err:  # noqa: BLE001 — a bug: handed to a waiting caller, not swallowed
                job[2], ok = err, None
            ok = ok if counts else None
            now = time.monotonic()
            with self._lock:
                began, self._running_since = self._running_since, None
                was_failing = self._failing_since is not None
                down_s = 0.0 if self._failing_since is None else now - self._failing_since
                if ok:
                    self._failing_since, self._error = None, ""
                elif ok is False:
                    self._error = error
                    if self._failing_since is None:
                        self._failing_since = began
            done.set()
            if self._on_change is not None and ok is not None and was_failing == ok:  # the health flipped
                with contextlib.suppress(Exception):  # the writer thread outlives its listener's bug
                    self._on_change(ok, error, down_s)


def call_with_deadline(fn: Callable[[], object], timeout_s: float, what: str = "a storage call"):
    """fn()'s result (or its exception), or TimeoutError (an OSError) when it has not returned
    within timeout_s. fn runs on a daemon thread, left behind if it hangs (a dead NFS server); not a
    ThreadPoolExecutor, whose workers the interpreter joins at exit: a hung call would hang the exit."""
    from concurrent.futures import Future, wait

    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 — re-raised in the caller's thread by result()
            future.set_exception(err)

    threading.Thread(target=run, name="hsgd-storage-call", daemon=True).start()
    if not wait([future], timeout_s).done:
        raise TimeoutError(f"{what} did not return within {timeout_s:g} s (storage hung?)")
    return future.result(timeout=0)  # done: wait() said so


def write_deadline_s(io_grace_s: float) -> float:
    """How long a caller waits for one write of the run folder: a fraction of the grace, so a hung
    mount is noticed (and survived) well within it, and at most 5 s a write."""
    return max(0.2, min(5.0, io_grace_s / 4))


def write_fault_fired(
    writer: FolderWriter, run_dir: str | Path, rid: str, kind: str, phase: str, round_index, step, **extra
) -> bool:
    """The one writer of faults_fired.jsonl (the supervisor's RunLog writer, a replica's own, the
    drill's): one line per fault as it fired, appended whole through `writer`, waiting at most its
    deadline. False when the line is not written in time (the fault fires all the same)."""
    line = (
        json.dumps(
            {"t": time.time(), "rid": rid, "kind": kind, "phase": phase, "round": round_index, "step": step, **extra}
        )
        + "\n"
    )
    return bool(writer.submit(object(), lambda: append_lines(Path(run_dir) / "faults_fired.jsonl", line)))
