"""One process group per level: `inner` (a cluster's replicas) and `outer` (the clusters' leaders).

Protocol
- The supervisor hands each replica, per epoch, a store address with a fresh prefix naming the
  level and the epoch (`host:port/epoch7/inner/c1`). `configure` joins that group; it blocks until
  every member joined or `configure_timeout_s` passes, then raises.
- Every collective names its level: `group.allreduce_mean(t, level="inner")`. A call that names the
  wrong level raises `WrongLevelError` at once — the seeds of this project once all-reduced over
  the wrong group and silently trained unsynchronised replicas.
- Every collective waits at most `timeout_s` plus its payload at `min_gbps` (collective_timeout_s),
  set on the operation itself and on the wait. Any error (peer died: gloo fails in milliseconds;
  peer hung: at the timeout) raises `CollectiveError`; the group is then unusable until the next
  `configure`. The caller reports the failure to the supervisor, which re-plans.
- A group of one member does no communication at all.

Backends: gloo on CPU (torchft's reconfigurable ProcessGroupGloo), nccl on GPU (torchft's
ProcessGroupNCCL) behind the same interface. Tensors are flattened into one buffer per call.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

LEVELS = ("inner", "outer")


class CollectiveError(RuntimeError):
    """A collective or a group join failed or timed out; the group must be reconfigured."""


class WrongLevelError(AssertionError):
    """A collective was issued on the group of the other level."""


class OverlappingCollectiveError(AssertionError):
    """Invariant 3: a process is in at most one collective at any instant, whatever the level."""


# One per process: the two stacked managers of this project's seeds deadlocked exactly because a
# process sat in an inner and an outer collective at once. Enforced on every call, not only in tests.
_IN_COLLECTIVE = threading.Lock()


@contextmanager
def _one_collective(what: str):
    if not _IN_COLLECTIVE.acquire(blocking=False):
        raise OverlappingCollectiveError(f"{what} started while another collective is in flight in this process")
    try:
        yield
    finally:
        _IN_COLLECTIVE.release()


def _make_torchft_group(backend: str, timeout_s: float):
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if backend == "nccl":
        return ProcessGroupNCCL(timeout=timedelta(seconds=timeout_s))
    return ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))


def collective_timeout_s(base_s: float, payload_bytes: int, min_gbps: float) -> float:
    """How long one transfer of `payload_bytes` may take: a fixed part (a peer's answer) plus the
    payload at the slowest link speed assumed. Scales a 1 MB inner all-reduce and a multi-GB outer
    one (or a heal) from the same two settings."""
    return base_s + payload_bytes * 8 / (min_gbps * 1e9)


class LevelGroup:
    """A reconfigurable process group that belongs to one level."""

    def __init__(self, level: str, backend: str = "gloo", timeout_s: float = 10.0,
                 configure_timeout_s: float = 30.0, min_gbps: float = 1.0):
        assert level in LEVELS, level
        self.level = level
        self.backend = backend
        self.timeout_s = timeout_s
        self.min_gbps = min_gbps
        self.configure_timeout_s = configure_timeout_s
        self.rank = 0
        self.world_size = 1
        self.prefix: str | None = None
        self.bytes_sent = 0  # payload bytes handed to collectives (what crossed this level's link)
        self._pg = None
        self._usable = True

    # -- membership -----------------------------------------------------------------------------
    def configure(self, store_addr: str | None, prefix: str, rank: int, world_size: int, epoch: int) -> None:
        """Join the group `prefix` as `rank` of `world_size`; world_size 1 needs no store."""
        self.abort()
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        if world_size == 1:
            self._usable = True
            return
        pg = _make_torchft_group(self.backend, self.configure_timeout_s)
        try:
            # Keyword arguments on purpose: torchft 0.2.0's positional order differs from older releases.
            pg.configure(store_addr=f"{store_addr}/{prefix}", replica_id=prefix, rank=rank,
                         world_size=world_size, quorum_id=epoch)
        except Exception as err:  # noqa: BLE001 — any join failure is a failed configure
            self._usable = False
            raise CollectiveError(f"{self.level}: joining {prefix} as rank {rank}/{world_size} failed: {err}") from err
        pg.set_timeout(timedelta(seconds=self.timeout_s))
        self._pg, self._usable = pg, True

    def abort(self) -> None:
        """Drop the current group (also used by the `comm` fault). Never raises."""
        pg, self._pg = self._pg, None
        self._usable = self.world_size == 1
        if pg is not None:
            try:
                pg.abort(errored=False)
            except Exception:  # noqa: BLE001 — aborting a broken group may itself fail
                pass

    # -- collectives ----------------------------------------------------------------------------
    def _check(self, level: str) -> None:
        if level != self.level:
            raise WrongLevelError(f"collective for level {level!r} issued on the {self.level!r} group")
        if not self._usable or (self.world_size > 1 and self._pg is None):
            raise CollectiveError(f"{self.level}: group {self.prefix} is not configured (aborted or failed)")

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One contiguous buffer; on the GPU for NCCL (the outer pseudo-gradients live on the CPU)."""
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        if self.backend == "nccl" and not flat.is_cuda:
            flat = flat.cuda()
        return flat

    def _wait(self, work, what: str, payload_bytes: int = 0) -> None:
        try:
            work.wait(timeout=timedelta(seconds=collective_timeout_s(self.timeout_s, payload_bytes, self.min_gbps)))
        except Exception as err:  # noqa: BLE001 — gloo raises RuntimeError with many texts
            self._usable = False
            raise CollectiveError(f"{self.level}: {what} on {self.prefix} failed: {err}") from err

    def allreduce_mean(self, tensors: list[torch.Tensor], *, level: str) -> None:
        """In place: every tensor becomes the mean over the group's members."""
        self._check(level)
        if self.world_size == 1 or not tensors:
            return
        flat = self._flat(tensors)
        self.bytes_sent += flat.numel() * flat.element_size()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = timedelta(seconds=collective_timeout_s(self.timeout_s, flat.numel() * flat.element_size(),
                                                              self.min_gbps))
        with _one_collective(f"{self.level} allreduce"):
            self._wait(self._pg.allreduce([flat], opts), "allreduce", flat.numel() * flat.element_size())
        flat.div_(self.world_size)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.detach().copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def broadcast(self, tensors: list[torch.Tensor], *, root: int, level: str) -> None:
        """In place: every member's tensors become the root's."""
        self._check(level)
        if self.world_size == 1 or not tensors:
            return
        flat = self._flat(tensors)
        if self.rank == root:
            self.bytes_sent += flat.numel() * flat.element_size() * (self.world_size - 1)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = timedelta(seconds=collective_timeout_s(self.timeout_s, flat.numel() * flat.element_size(),
                                                              self.min_gbps))
        with _one_collective(f"{self.level} broadcast"):
            self._wait(self._pg.broadcast([flat], opts), "broadcast", flat.numel() * flat.element_size())
        if self.rank != root:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.detach().copy_(flat[offset:offset + n].view_as(t))
                offset += n


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll `predicate` until true; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(poll_s)
