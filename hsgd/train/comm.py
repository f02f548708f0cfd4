"""One process group per level: `inner` (a cluster's replicas) and `outer` (the clusters' leaders).

Protocol
- `LevelGroup.configure` joins a group, per epoch, in two steps: 1. the arrival barrier in the run's
  store (hsgd.train.rendezvous: every member arrived, or the supervisor's abort), bounded by
  `configure_timeout_s`; 2. torchft's configure (the backend's connect), bounded by the short
  `connect_timeout_s`. So `configure` takes at most configure_timeout_s + connect_timeout_s.
- Every collective names its level (`allreduce_mean(t, level="inner")`); the wrong level raises
  `WrongLevelError` at once (else replicas would silently train unsynchronised).
- Every collective waits at most `timeout_s` plus its payload at `min_gbps` (collective_timeout_s),
  set on the operation itself and on the wait.
- A process is in at most one collective at any instant (OverlappingCollectiveError otherwise);
  with `allow_level_overlap`, at most one per level. An overlapped collective (`launch_sum` ...
  `wait_sums`) is ONE logical collective of one level: its caller holds that guard throughout.
- A group of one member does no communication at all.
Failures: every failure in torch.distributed / torchft raises `CollectiveError`, never torch's own
types. Its `kind` (`ErrorKind`): configure (a member did not come, the store is gone), join_aborted
(the supervisor's abort, with its reason), issue (starting the op), wait (failed in flight),
peer_gone (the peer's connection closed), timeout (past its deadline), aborted (the `comm` fault,
torchft's watchdog, an earlier error). After any CollectiveError the group is unusable until the
next `configure`. `abort` never raises. Narrative (backends, byte counts, the link): docs/concepts.md.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from hsgd.core.deadlines import collective_timeout_s  # the transfer deadline rule (pure), also importable from here
from hsgd.core.round.messages import ErrorKind
from hsgd.train.rendezvous import (  # re-exported: the supervisor and the rank group know them as comm.<name>
    abort_rendezvous,
    new_run_secret,
    rendezvous_address,
    shard_prefix,
    start_store,
)
from hsgd.train.rendezvous import await_members as _await_members  # a module global: tests stand in for it

__all__ = [
    "CollectiveError",
    "LevelGroup",
    "OverlappingCollectiveError",
    "WrongLevelError",
    "abort_rendezvous",
    "allow_level_overlap",
    "apply_nccl_environment",
    "collective_timeout_s",
    "new_run_secret",
    "one_collective",
    "rendezvous_address",
    "shard_prefix",
    "start_store",
]

LEVELS = ("inner", "outer")
SECRET_BITS = 128


class CollectiveError(RuntimeError):
    """A collective or a group join failed or timed out; `kind`: how (the module's error model)."""

    def __init__(self, message: str, kind: ErrorKind | str = ErrorKind.WAIT):
        super().__init__(message)
        self.kind = ErrorKind(kind)  # (a kind it does not name raises ValueError)

    def __reduce__(self):  # crosses Ray and process boundaries with its kind
        return type(self), (str(self), self.kind)


class WrongLevelError(AssertionError):
    """A collective was issued on the group of the other level."""


class OverlappingCollectiveError(AssertionError):
    """Invariant 3 broken: a second collective in this process (per level with `allow_level_overlap`)."""


# One per process, on every call: a process in an inner and an outer collective at once can
# deadlock. The exception, asked for explicitly: an outer reduce hidden behind inner steps
# (sync.fragment_delay), planned so that no inner step ever waits on it; then one per level.
_PROCESS_GUARD = threading.Lock()
_LEVEL_GUARDS = {level: threading.Lock() for level in LEVELS}
_per_level = False


def allow_level_overlap(allowed: bool) -> None:
    """Per-level guards (see above) or one for the process; set once, before any collective."""
    global _per_level
    _per_level = bool(allowed)


@contextmanager
def one_collective(what: str, level: str = "inner"):
    """Hold the one-collective guard of `level` (of the process without `allow_level_overlap`) for
    the block; raises OverlappingCollectiveError at once when another collective holds it."""
    guard = _LEVEL_GUARDS[level] if _per_level else _PROCESS_GUARD
    if not guard.acquire(blocking=False):
        scope = f"on the {level} level" if _per_level else "in this process"
        raise OverlappingCollectiveError(f"{what} started while another collective is in flight {scope}")
    try:
        yield
    finally:
        guard.release()


# -- NCCL ------------------------------------------------------------------------------------------
def apply_nccl_environment(configure_timeout_s: float) -> dict[str, str]:
    """Set (overriding) the NCCL settings hsgd's error model needs, before the process makes its
    first group (torch reads them when a communicator is built); returns them.
    - TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): an error or a watchdog timeout aborts the
      communicators and fails the op; torch's default (3) kills the process, a survivor's crash.
    - TORCH_NCCL_BLOCKING_WAIT=0: waits do not block the host in NCCL; torchft's non-blocking
      communicators with its own timer (which aborts the group at the op's deadline) bound them.
    - TORCH_NCCL_NONBLOCKING_TIMEOUT=configure_timeout_s: how long a non-blocking communicator's
      init or abort may take (torchft warns and falls back to 30 minutes' behaviour otherwise).
    The NCCL watchdog keeps torch's default (10 min): hsgd's own, far shorter deadlines fire first.
    """
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": f"{configure_timeout_s:g}",
    }
    os.environ.update(env)
    return env


def _make_torchft_group(backend: str, timeout_s: float):
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return (ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo)(timeout=timedelta(seconds=timeout_s))


_PEER_GONE_TEXT = ("closed by peer", "reset by peer", "broken pipe", "connection closed")


class LevelGroup:
    """A reconfigurable process group that belongs to one level (see the module's protocol)."""

    def __init__(
        self,
        level: str,
        backend: str = "gloo",
        timeout_s: float = 10.0,
        configure_timeout_s: float = 30.0,
        min_gbps: float = 1.0,
        link=None,
    ):
        assert level in LEVELS, level
        self.level, self.backend, self.link = level, backend, link
        self.timeout_s, self.configure_timeout_s, self.min_gbps = timeout_s, configure_timeout_s, min_gbps
        # after the barrier only the backend's connect among members known present is left: a
        # handful of peer answers, each bounded like one collective's fixed part (timeout_s)
        self.connect_timeout_s = min(timeout_s, configure_timeout_s)
        self.rank, self.world_size, self.prefix = 0, 1, None
        self.bytes_sent = 0  # payload bytes handed to collectives (what crossed this level's link)
        self.bytes_received = 0  # payload bytes the collectives brought in over it
        self.link_s = 0.0  # seconds held in this group's collectives, the simulated link's sleep included
        self._pg = None
        # added to every deadline: a collective a member starts before its peers are known to be there
        # (hsgd.train.overlap, while it runs; no other thread uses the group meanwhile)
        self.arrival_s = 0.0
        self._usable = True
        self._secret = ""  # the rendezvous secret in store_addr: never repeated in an error's text

    # -- membership -----------------------------------------------------------------------------
    def configure(self, store_addr: str | None, prefix: str, rank: int, world_size: int, epoch: int) -> None:
        """Join the group `prefix` as `rank` of `world_size` (1 needs no store; `store_addr` from
        `rendezvous_address`) in the module protocol's two steps. Raises CollectiveError kind
        `join_aborted` or `configure`, each in the cases the module's protocol names."""
        self.abort()
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self._secret = (store_addr or "").partition("/")[2]
        self._usable = world_size == 1
        if world_size == 1:
            return
        what = f"{self.level}: joining {prefix} as rank {rank}/{world_size}"
        pg, step = None, f": building the {self.backend} group"  # (e.g. NCCL without a usable CUDA)
        try:  # built before the barrier: once everyone arrived, only the connect is left
            pg = _make_torchft_group(self.backend, self.configure_timeout_s)
            step = ": waiting for every member"  # a member never came, the store is gone
            aborted = _await_members(store_addr, prefix, rank, world_size, self.configure_timeout_s)
            if aborted is None:
                step = ""
                pg.set_timeout(timedelta(seconds=self.connect_timeout_s))  # torchft's configure reads it
                # Keyword arguments on purpose: torchft 0.2.0's positional order differs from older releases.
                pg.configure(
                    store_addr=f"{store_addr}/{prefix}",
                    replica_id=prefix,
                    rank=rank,
                    world_size=world_size,
                    quorum_id=epoch,
                )
                pg.set_timeout(timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 — any join failure is a failed configure
            if pg is not None:
                _abort_quietly(pg)
            raise CollectiveError(f"{what}{step} failed: {self._scrub(err)}", "configure") from err
        if aborted is not None:
            _abort_quietly(pg)
            raise CollectiveError(f"{what}: the rendezvous was aborted: {aborted}", "join_aborted")
        self._pg, self._usable = pg, True

    def abort(self) -> None:
        """Drop the current group (also used by the `comm` fault). Never raises."""
        pg, self._pg = self._pg, None
        self._usable = self.world_size == 1
        if pg is not None:
            _abort_quietly(pg)

    # -- collectives ----------------------------------------------------------------------------
    def _check(self, level: str) -> None:
        if level != self.level:
            raise WrongLevelError(f"collective for level {level!r} issued on the {self.level!r} group")
        if not self._usable or (self.world_size > 1 and self._pg is None):
            raise CollectiveError(f"{self.level}: group {self.prefix} is not configured (aborted or failed)", "aborted")

    def _fail(self, message: str, kind: str, err: BaseException | None = None) -> CollectiveError:
        """Mark the group unusable and make the error to raise."""
        self._usable = False
        text = f"{self.level}: {message} on {self.prefix}" + (f": {self._scrub(err)}" if err is not None else "")
        return CollectiveError(text, kind)

    def _scrub(self, err: BaseException) -> str:
        """The error's text without the rendezvous secret (a store timeout names its keys)."""
        return str(err).replace(self._secret, "<secret>") if self._secret else str(err)

    @contextmanager
    def _failing_as(self, kind: str, what: str):
        """Any error inside the block (torch raises DistBackendError, RuntimeError with many texts;
        NCCL's async errors surface in device copies) is a CollectiveError of `kind`."""
        try:
            yield
        except Exception as err:  # noqa: BLE001
            raise self._fail(what, kind, err) from err

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One contiguous buffer; on the GPU for NCCL (the outer pseudo-gradients live on the CPU)."""
        with self._failing_as("issue", "copying the payload to the device"):  # part of issuing the op
            return self._on_device(torch.cat([t.detach().reshape(-1) for t in tensors]))

    def _on_device(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.cuda() if self.backend == "nccl" and not flat.is_cuda else flat

    def deadline_s(self, payload_bytes: int) -> float:
        """The longest one collective moving `payload_bytes` may hold a member: its deadline
        (collective_timeout_s) plus the simulated link's sleep after it."""
        return collective_timeout_s(self.timeout_s, payload_bytes, self.min_gbps) + (
            self.link.seconds(payload_bytes, most=True) if self.link is not None else 0.0
        )

    def _timeout(self, payload_bytes: int) -> timedelta:
        return timedelta(seconds=collective_timeout_s(self.timeout_s, payload_bytes, self.min_gbps) + self.arrival_s)

    def _issue(self, op: str, flat: torch.Tensor, opts, payload_bytes: int, outputs: list | None = None):
        """Start `op` with the deadline of `payload_bytes` (`outputs`: allgather's result buffers)."""
        opts.timeout = self._timeout(payload_bytes)
        with self._failing_as("issue", f"issuing {op}"):
            return getattr(self._pg, op)(*(([flat],) if outputs is None else ([outputs], [flat])), opts)

    @contextmanager
    def _held(self, what: str | None = None):
        """Count the time inside the block in `link_s` (a failure's time too), holding the
        one-collective guard for `what` when given; yields its start."""
        with one_collective(what, self.level) if what else nullcontext():
            start = time.monotonic()
            try:
                yield start
            finally:
                self.link_s += time.monotonic() - start

    def _pace(self, start: float, link_bytes: int) -> None:
        if self.link is not None:  # a simulated link: its sleep, after the op succeeded
            self.link.pace(start, link_bytes)

    def _wait(self, work, what: str, payload_bytes: int = 0, check_group: bool = True) -> None:
        """Wait `work` within its payload's deadline, then check the group's error state: a wait that
        raises, returns False, or leaves the group errored (torchft's NCCL group aborted by its
        timer) is a CollectiveError, never a silent return."""
        deadline = self._timeout(payload_bytes)
        start = time.monotonic()
        try:
            ok = work.wait(timeout=deadline)
        except Exception as err:  # noqa: BLE001 — gloo raises RuntimeError with many texts
            text = str(err).lower()  # the backend's text is read here, in the one module that knows backends
            kind = (
                "timeout"
                if time.monotonic() - start >= 0.95 * deadline.total_seconds()
                else "peer_gone"
                if any(t in text for t in _PEER_GONE_TEXT)
                else "timeout"
                if "timed out" in text or "timeout" in text
                else "wait"
            )
            raise self._fail(f"{what} failed", kind, err) from err
        if ok is False:  # torch's Work.wait: False = not completed
            raise self._fail(f"{what} did not complete within {deadline.total_seconds():.1f}s", "timeout")
        if check_group and getattr(self._pg, "errored", None) is not None:  # NCCL's errored() syncs the device
            try:
                errored = self._pg.errored()
            except Exception as err:  # noqa: BLE001 — asking a broken group may fail itself
                errored = err
            if errored is not None:
                raise self._fail(f"{what} returned but the group errored", "aborted", errored)

    def allreduce_mean(self, tensors: list[torch.Tensor], *, level: str) -> None:
        """In place: every tensor becomes the mean over the group's members. Counts the payload
        in `bytes_sent`; a simulated link paces it by the payload. Raises CollectiveError."""
        self._in_place("allreduce", tensors, level, dist.AllreduceOptions())  # (its reduceOp: SUM)

    def broadcast(self, tensors: list[torch.Tensor], *, root: int, level: str) -> None:
        """In place: every member's tensors become the root's. The root counts the payload once
        per other member in `bytes_sent`; a simulated link paces the root by what it sent and
        every other member by the payload it received. Raises CollectiveError."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._in_place("broadcast", tensors, level, opts, root)

    def _in_place(self, op: str, tensors: list[torch.Tensor], level: str, opts, root: int | None = None) -> None:
        """allreduce_mean (`root` None) or broadcast from `root`, as one flat buffer."""
        self._check(level)
        if self.world_size == 1 or not tensors:
            return
        with self._held(f"{self.level} {op}") as start:
            flat = self._flat(tensors)
            payload = flat.numel() * flat.element_size()
            sent = payload if root is None else payload * (self.world_size - 1) if self.rank == root else 0
            self.bytes_sent += sent
            self.bytes_received += payload if root is None or self.rank != root else 0
            self._wait(self._issue(op, flat, opts, payload), op, payload)
            if root is None:
                flat.div_(self.world_size)
            if self.rank != root:
                with self._failing_as("wait", "copying the result back"):
                    offset = 0
                    for t in tensors:
                        t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()
            self._pace(start, max(sent, payload))

    def all_gather(self, payload: torch.Tensor, *, level: str) -> list[torch.Tensor]:
        """Every member's `payload`, in rank order (this member's own as a copy), on `payload`'s
        device. Every member passes a 1-D tensor of the same dtype and length, not checked (a round
        trip over the slow link): gloo aborts a process that receives more than it expected, its
        peers see kind `peer_gone`. `bytes_sent` and the link count payload bytes * (world_size - 1)
        (a ring all-gather); the deadline scales with the whole result. A group of one returns
        [payload] itself. Raises WrongLevelError, ValueError (not 1-D), CollectiveError."""
        self._check(level)
        if payload.dim() != 1:
            raise ValueError(f"{self.level} all_gather: payload must be a 1-D tensor, got shape {tuple(payload.shape)}")
        if self.world_size == 1:
            return [payload]
        with self._held(f"{self.level} all_gather") as start:
            flat = self._flat([payload])
            size = flat.numel() * flat.element_size()
            self.bytes_sent += size * (self.world_size - 1)
            self.bytes_received += size * (self.world_size - 1)
            with self._failing_as("issue", "allocating the all_gather result"):
                outputs = [torch.empty_like(flat) for _ in range(self.world_size)]
            self._wait(
                self._issue("allgather", flat, AllgatherOptions(), size * self.world_size, outputs),
                "all_gather",
                size * self.world_size,
            )
            with self._failing_as("wait", "copying the result back"):
                gathered = [t.to(payload.device) for t in outputs]
            self._pace(start, size * (self.world_size - 1))
            return gathered

    def all_to_all(self, chunks: list[torch.Tensor], recv_numel: int, *, level: str) -> list[torch.Tensor]:
        """chunks[j] goes to rank j; returns the chunk each rank sent this one, in rank order (this
        member's own as a copy), on chunks' device. Every member passes world_size 1-D tensors of one
        dtype, and every rank's chunk for rank r has `recv_numel` elements for the r that receives it
        (not checked: a round trip over the slow link). `bytes_sent` counts the chunks to the others,
        `bytes_received` theirs to this one; the link paces by what was sent; the deadline scales with
        the larger of the two buffers. A group of one returns [chunks[0]] itself. Raises
        WrongLevelError, ValueError (not world_size 1-D chunks), CollectiveError."""
        self._check(level)
        if len(chunks) != self.world_size or any(c.dim() != 1 for c in chunks):
            raise ValueError(f"{self.level} all_to_all: needs {self.world_size} 1-D chunks, got {len(chunks)}")
        if self.world_size == 1:
            return [chunks[0]]
        with self._held(f"{self.level} all_to_all") as start:
            flat = self._flat(chunks)
            item = flat.element_size()
            sent = (flat.numel() - chunks[self.rank].numel()) * item
            received = recv_numel * (self.world_size - 1) * item
            self.bytes_sent += sent
            self.bytes_received += received
            with self._failing_as("issue", "allocating the all_to_all result"):
                output = torch.empty(recv_numel * self.world_size, dtype=flat.dtype, device=flat.device)
            payload = max(flat.numel(), output.numel()) * item
            opts = dist.AllToAllOptions()
            opts.timeout = self._timeout(payload)
            with self._failing_as("issue", "issuing alltoall"):
                work = self._pg.alltoall_base(
                    output, flat, [recv_numel] * self.world_size, [c.numel() for c in chunks], opts
                )
            self._wait(work, "all_to_all", payload)
            with self._failing_as("wait", "copying the result back"):
                received_chunks = [
                    output[k * recv_numel : (k + 1) * recv_numel].to(chunks[0].device) for k in range(self.world_size)
                ]
            self._pace(start, sent)
            return received_chunks

    def launch_sum(self, flat: torch.Tensor) -> tuple[torch.Tensor, object, int]:
        """Start, not wait, the sum all-reduce of `flat` in place on the backend's device: one launch
        of an overlapped collective, whose caller holds `one_collective` until `wait_sums` ends.
        Returns (the buffer that will hold the sum: for NCCL with a CPU input a device copy, its
        work, payload bytes). Raises CollectiveError (kind issue / aborted)."""
        with self._held():
            if not self._usable or self._pg is None:
                raise self._fail("overlapped allreduce on a group not configured (aborted or failed)", "aborted")
            with self._failing_as("issue", "copying a bucket to the device"):
                buf = self._on_device(flat)
            payload = buf.numel() * buf.element_size()
            self.bytes_sent += payload
            return buf, self._issue("allreduce", buf, dist.AllreduceOptions(), payload), payload

    def wait_sums(self, launched: list[tuple[object, int]], started: float) -> None:
        """Wait each (work, payload bytes) of `launch_sum`, in launch order, then pace the simulated
        link from `started` (the first launch) by all their bytes: one latency, so compute between
        launches hides it. Raises CollectiveError at the first failure; the caller must then
        `abort` the group (the rest are in flight, the members' collectives no longer line up)."""
        with self._held():
            for i, (work, payload) in enumerate(launched):
                what = f"overlapped allreduce (bucket {i + 1}/{len(launched)})"
                self._wait(work, what, payload, check_group=i == len(launched) - 1)
            if launched:
                self._pace(started, sum(payload for _, payload in launched))


def _abort_quietly(pg) -> None:
    with suppress(Exception):  # aborting a broken group may itself fail
        pg.abort(errored=False)
