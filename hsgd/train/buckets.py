"""Overlapped, bucketed gradient all-reduce for inner `ddp` (what torch's DDP reducer does, on a
LevelGroup that is re-formed every epoch).

Protocol (one inner step):
    buckets = GradBuckets(params, bucket_mb)  # once: a post-accumulate-grad hook per param
    buckets.arm(inner)                        # before the LAST micro-batch's backward
    loss.backward()                           # hooks fill buckets; a full one is launched at once
    buckets.finish()                          # before the optimizer step: launches the rest, waits
                                              # every bucket, writes the means into p.grad
After a failure anywhere in between, `disarm()` drops the in-flight work (never raises).

- Buckets hold parameters in reverse order (gradients become ready roughly last layer first), at
  most `bucket_mb` MB each (a larger parameter is a bucket of its own), one dtype and device each.
- Buckets are launched strictly in bucket order on every member (gloo and NCCL match collectives
  by their order); all buckets of a step are ONE logical collective of level "inner"
  (LevelGroup.launch_sum, then wait_sums), holding the one-collective guard from the first launch
  to finish/disarm; a failure with buckets in flight aborts the group (as wait_sums says).
- A hook never raises (the error would escape as the autograd engine's own type): it records the
  CollectiveError and launches nothing more; `finish` raises it. A peer's death mid-backward fails
  the buckets within the collective timeout; the inner group is then aborted until re-formed.
- A group of one launches nothing and leaves p.grad as it is (it already is the mean).
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import ExitStack

import torch

from hsgd.train.comm import LevelGroup, one_collective


def assign_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets as the module says (`bucket_bytes` each)."""
    buckets: list[list[int]] = []
    size, key = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes, pkey = p.numel() * p.element_size(), (p.dtype, p.device)
        if not buckets or pkey != key or (size + nbytes > bucket_bytes and size > 0):
            buckets.append([])
            size, key = 0, pkey
        buckets[-1].append(i)
        size += nbytes
    return buckets


class _Bucket:
    __slots__ = ("members", "offsets", "flat", "ready", "result")

    def __init__(self, members: list[int], params: list[torch.Tensor]):
        self.members = members
        sizes = [params[i].numel() for i in members]
        self.offsets = dict(zip(members, itertools.accumulate(sizes, initial=0), strict=False))
        first = params[members[0]]
        self.flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        self.ready: set[int] = set()
        self.result: torch.Tensor | None = None


class GradBuckets:
    """The buckets of one replica's parameters (the module's protocol)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_mb: float):
        self.params = [p for p in params if p.requires_grad]  # a frozen parameter has no gradient to sync
        assert len({id(p) for p in self.params}) == len(self.params), "a parameter is listed twice"
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.buckets = [_Bucket(m, self.params) for m in assign_buckets(self.params, self.bucket_bytes)]
        self._bucket_of = {i: b for b in self.buckets for i in b.members}
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        self._group: LevelGroup | None = None  # armed: the inner group the hooks launch on
        self._next = 0  # the next bucket to launch (strict bucket order)
        self._error: BaseException | None = None
        self._launched: list[tuple[object, int]] = []  # (work, payload bytes) in flight
        self._started = 0.0  # the first launch (monotonic): the simulated link's clock starts there
        self._guard = ExitStack()  # the one-collective guard, held from the first launch
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook_for(i))

    # -- the protocol ---------------------------------------------------------------------------------
    def arm(self, group: LevelGroup) -> None:
        """Before the last micro-batch's backward: from now on, hooks launch full buckets on `group`.
        Raises WrongLevelError (not the inner group) or CollectiveError (group not usable) at once."""
        self.disarm()
        group._check("inner")
        if group.world_size == 1:
            return
        with self._lock:
            self._group, self._next, self._error = group, 0, None
            for b in self.buckets:
                b.ready.clear()
                b.result = None

    def finish(self) -> None:
        """Launch the buckets not launched yet (a parameter without a gradient this step counts as
        zeros, so members stay alike), wait every bucket, write the means into p.grad; nothing when
        not armed. Raises CollectiveError on any failure or timeout (then all is dropped as by `disarm`)."""
        group = self._group
        if group is None:
            return
        try:
            with self._lock:
                for b in self.buckets[self._next :]:
                    for i in set(b.members) - b.ready:
                        self._fill(b, i)
                self._launch_ready()
                if self._error is not None:
                    raise self._error
            group.wait_sums(self._launched, self._started)
            self._launched = []
            with torch.no_grad():
                for b in self.buckets:
                    b.result.div_(group.world_size)
                    for i in b.members:
                        p = self.params[i]
                        mean = b.result[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
                        if p.grad is None:
                            p.grad = mean.to(p.device, copy=True)
                        else:
                            p.grad.copy_(mean)
        except BaseException:
            self.disarm()
            raise
        self.disarm()  # nothing in flight: releases the guard

    def disarm(self) -> None:
        """Drop in-flight work after a failure, aborting the inner group if any was in flight. Never raises."""
        with self._lock:
            group, self._group = self._group, None
            launched, self._launched = self._launched, []
            if launched:
                for b in self.buckets:  # an aborted op may still write into the old buffers
                    b.flat = torch.empty_like(b.flat)
        if launched:
            group.abort()
        self._guard.close()

    # -- hooks ----------------------------------------------------------------------------------------
    def _hook_for(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self._group is None:
                return
            with self._lock:
                if self._group is None or self._error is not None:
                    return
                b = self._bucket_of[i]
                if i in b.ready:
                    return  # a second backward while armed: the first copy stands (maybe launched)
                self._fill(b, i)
                self._launch_ready()

        return hook

    def _fill(self, b: _Bucket, i: int) -> None:
        p = self.params[i]
        view = b.flat[b.offsets[i] : b.offsets[i] + p.numel()]
        with torch.no_grad():
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.detach().reshape(-1))
        b.ready.add(i)

    def _launch_ready(self) -> None:
        """Launch full buckets in bucket order; record (never raise) a failure, then launch no more."""
        for b in self.buckets[self._next :]:
            if self._error is not None or len(b.ready) < len(b.members):
                return
            try:
                if self._next == 0:
                    self._guard.enter_context(one_collective("inner overlapped allreduce", "inner"))
                    self._started = time.monotonic()
                b.result, work, payload = self._group.launch_sum(b.flat)
            except Exception as err:  # noqa: BLE001 — CollectiveError, OverlappingCollectiveError: raised at finish
                self._error = err
                return
            self._launched.append((work, payload))
            self._next += 1
