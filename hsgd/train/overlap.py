"""The outer reduce hidden behind inner steps (sync.fragment_delay, Streaming DiLoCo's overlap).

Protocol, on one replica:
    start(key)    from run_inner's at_snapshot, key = (round, epoch, shard, shards) of the standing
                  outer group named in the run_inner call. A reduce running or done for the same
                  key is kept (a re-issued run_inner); one for another key is abandoned first.
    settle(key)   first in the replica's outer_reduce: waits (at most `timeout_s`) for the reduce of
                  `key` and raises what it raised, else returns the outer bytes (sent, and sent +
                  received) and link seconds it spent, or None when no reduce of `key` ran.
    settle(None)  first in every other call that touches the outer group or state (a heal, a
                  commit, a new group): a reduce still running is abandoned.
Abandoning aborts the outer group, so the reduce's collective fails at once and the thread ends.
Invariant 3 holds: the thread runs only outer-level collectives, the phase thread only inner-level ones.
A replica of k ranks: every rank runs its own reduce of its own shard; the ranks agree over the
replica's background group (`hsgd.train.sharding.ReplicaRanks.behind`), so one rank's failure fails the reduce on all k.

Failure cases (all surface at `settle(key)` as what the call answers):
- a holder of another cluster died or never arrives: CollectiveError (peer_gone, or the deadline,
  `arrival_s` longer than a collective started together); the supervisor re-forms and retries
- this cluster's pseudo-gradient is non-finite (on any rank): NonFiniteError; the group is aborted
- the reduce outlives `timeout_s`: the group is aborted, CollectiveError kind `timeout`
- sharded, a thread that ended outside its ranks' agreement: ReplicaOutOfStep (not a
  CollectiveError), so the replica fails whole and comes back with its groups formed afresh
Narrative: docs/scaling.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from hsgd.train.comm import CollectiveError, LevelGroup
from hsgd.train.inner import NonFiniteError
from hsgd.train.trainer import Behind

Key = tuple  # (round, epoch, shard, shards[, the clusters' token weights: OuterReduce.weights])


class ReplicaOutOfStep(RuntimeError):
    """A sharded replica's reduce behind the inner steps ended outside its ranks' agreement (see the
    module's protocol): its ranks may disagree on the background group's order; the replica fails whole."""


@dataclass
class _Reduce:
    key: Key
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # outer_bytes (sent), outer_link_bytes (sent + received), outer_link_s: what settle(key) returns
    spent: dict = field(default_factory=dict)


class BackgroundReduce:
    """At most one outer reduce in the background on one replica (see the module's protocol)."""

    def __init__(self, trainer: Any, outer: LevelGroup, arrival_s: float = 0.0):
        """`arrival_s`: how much later than this holder the other clusters' holders may reach their
        snapshot step (clusters train at their own pace); the reduce's deadline grows by it."""
        self.trainer, self.outer, self.arrival_s = trainer, outer, arrival_s
        self._reduce: _Reduce | None = None

    def start(self, key: Key) -> None:
        if self._reduce is not None and self._reduce.key == key:
            return  # running or done already (a re-issued run_inner)
        self.settle(None)
        self._reduce = reduce = _Reduce(key)
        threading.Thread(target=self._run, args=(reduce,), name=f"hsgd-outer-overlap-r{key[0]}", daemon=True).start()

    def _run(self, reduce: _Reduce) -> None:
        round_index, epoch, shard, shards, *weights = reduce.key
        before, before_s, before_in = self.outer.bytes_sent, self.outer.link_s, self.outer.bytes_received
        self.outer.arrival_s = self.arrival_s
        try:
            self.trainer.outer_reduce(round_index, epoch, self.outer, shard, shards, *weights, behind=True)
        except BaseException as err:  # noqa: BLE001 — handed to settle(), which raises it in the phase
            reduce.error = err
            if not isinstance(err, CollectiveError):  # non-finite, or a bug: the peers must not wait on us
                self.outer.abort()
        finally:
            self.outer.arrival_s = 0.0
            reduce.spent = {
                "outer_bytes": self.outer.bytes_sent - before,
                "outer_link_bytes": self.outer.bytes_sent - before + self.outer.bytes_received - before_in,
                "outer_link_s": self.outer.link_s - before_s,
            }
            reduce.done.set()

    def settle(self, key: Key | None, timeout_s: float = 30.0) -> dict | None:
        """Wait for the reduce of `key` and raise its error; abandon any other (see the protocol)."""
        reduce, self._reduce = self._reduce, None
        if reduce is None:
            return None
        if reduce.key != key:
            if not reduce.done.is_set():
                self.outer.abort()  # its collective fails at once
                reduce.done.wait(timeout_s)
            self._check_in_step(reduce)
            return None
        if not reduce.done.wait(timeout_s):
            self.outer.abort()
            reduce.done.wait(5.0)
            self._check_in_step(reduce)
            raise CollectiveError(
                f"outer reduce of round {key[0]} behind the inner steps did not finish within "
                f"{timeout_s:.0f}s; outer group aborted",
                "timeout",
            )
        self._check_in_step(reduce)
        if reduce.error is not None:
            raise reduce.error
        return reduce.spent

    def _check_in_step(self, reduce: _Reduce) -> None:
        """Sharded: raise ReplicaOutOfStep unless `reduce` ended at its ranks' agreement (done, and
        either fine or with an error every rank raised alike); unsharded ranks cannot be out of step."""
        if self.trainer.ranks is None:
            return
        if not reduce.done.is_set():
            raise ReplicaOutOfStep(
                f"{self.trainer.rid}: its outer reduce behind the inner steps of round "
                f"{reduce.key[0]} did not end once its outer group was aborted; its ranks may be "
                f"out of step on the background group: the replica fails whole"
            )
        if reduce.error is not None and not isinstance(reduce.error, (CollectiveError, NonFiniteError, Behind)):
            raise ReplicaOutOfStep(
                f"{self.trainer.rid}: its outer reduce behind the inner steps of round "
                f"{reduce.key[0]} failed outside its ranks' agreement ({type(reduce.error).__name__}: "
                f"{str(reduce.error).splitlines()[0] if str(reduce.error) else ''}); the replica "
                f"fails whole"
            ) from reduce.error
