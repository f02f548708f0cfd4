"""Heals as Ray calls: a replica's state moves from its source to the replicas it heals; the
supervisor that issues them never holds it.

Protocol
- Through the object store (`global` heals; a `full` heal's fallback): the source answers a small
  meta (a PhaseAnswer with `pid`, `bytes`) and the state (num_returns=2), whose ref goes straight
  into the target's `load_state`; only the meta is fetched here. A source that refuses
  (`heal_state`: not the process it was chosen as) answers `collective_failed` and no state; the
  target's `load_state` then answers `collective_failed`, untouched.
- Over the process group (`full` heals): one `send_state` on the source (rank 0), one
  `receive_state` per target, in a group of their own. A target whose transfer fails is healed
  once more, in the same action, through the object store (`heal_fallback`).
- The source watch (`watched()`, then `source_answer`): `Lost(source, cause)` when the source
  raised or refused (`heal_source_lost`), `StateReady(action, source)` when it delivered (from then
  on a silent target is to blame), nothing for a failed group transfer. A slow answer is never a
  loss: the heal's deadline is the round machine's.
- A target's call that raised is its source's failure when the source's meta raised or refused
  (`source_failed`): Ray fails a call whose argument failed with the argument's error.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from hsgd.core.round import GroupJoin, Heal, Lost, Outcome, PhaseAnswer, StateReady
from hsgd.train import state_stream

FETCH_S = 30.0  # fetching an answer already ready (a few hundred bytes): bounds the call, decides nothing
SETTLE_POLL_S = 0.5  # settle's longest wait before it looks at its deadline again


class Heals:
    """The heals of one round (or the final heal); `store_addr`: the heal groups' rendezvous."""

    def __init__(self, handles: Mapping[str, Any], log, *, store_addr: str | None, run_id: str, round_index: int):
        self.handles, self.log = handles, log
        self.store_addr, self.run_id, self.r = store_addr, run_id, round_index
        # keyed (action, source): the state's ref (handed to targets, never fetched) and its meta's
        self.states: dict[tuple[int, str], Any] = {}
        self.metas: dict[tuple[int, str], Any] = {}
        self.watch: dict[Any, tuple[int, str]] = {}  # sources' answers not yet taken in -> (action, source)
        self.sends: set = set()  # the send_state calls among them
        self.source_of: dict[tuple[int, str], str] = {}  # (action, target) -> its source
        # over the group, (action, source) -> (its group's prefix, the source's (round, step) when chosen)
        self.groups: dict[tuple[int, str], tuple[str, tuple[int, int] | None]] = {}
        self.members: dict[str, tuple[str, ...]] = {}  # a heal group's prefix -> its source and targets
        self.released: set[str] = set()  # heal groups whose rendezvous was aborted
        self.receives: dict[Any, tuple[int, str, str]] = {}  # target refs -> (action, target, source)

    def issue(
        self,
        action_id: int,
        epoch: int,
        calls: Mapping[str, Heal],
        target: str,
        faults: Mapping[str, Any],
        source_at: tuple[int, int] | None = None,
    ):
        """Heal `target` as action `action_id`'s `calls` say (a source's state is asked once however
        many targets it heals). `source_at`: the source's (round, step) when chosen, which a `full`
        heal's fallback checks. Returns the target's call (a `full` heal's goes through `group_answer`)."""
        source, scope = calls[target].source, calls[target].scope
        key = (action_id, source)
        self.source_of[(action_id, target)] = source
        self.log.event("heal_begin", target=target, source=source, scope=scope)
        if scope != "full":
            return self._load_state(key, target, scope, faults.get(target), self.handles[source].global_state)
        # over the group: one send_state per source (watched like a meta), one receive_state per target
        targets = sorted(t for t, h in calls.items() if h.source == source and h.scope == "full")
        world = 1 + len(targets)
        if key not in self.groups:
            prefix = f"{self.run_id}/epoch{epoch}/heal/r{self.r}/{source}/{secrets.token_hex(4)}"
            self.members[prefix] = (source, *targets)
            self.groups[key] = (prefix, source_at)
            send = self.handles[source].send_state.remote(
                self.r, GroupJoin(epoch, self.store_addr, prefix, 0, world), state_stream.CHUNK_MB, faults.get(source)
            )
            self.watch[send] = key
            self.sends.add(send)
        ref = self.handles[target].receive_state.remote(
            self.r,
            GroupJoin(epoch, self.store_addr, self.groups[key][0], 1 + targets.index(target), world),
            faults.get(target),
        )
        self.receives[ref] = (action_id, target, source)
        return ref

    def watched(self) -> list:
        """The sources' answers to wait on (metas and send_state answers, never a state)."""
        return list(self.watch)

    def source_answer(self, ref) -> StateReady | Lost | None:
        """Take in a source's answer (`ref` from `watched()`): StateReady, Lost (logged), or None
        (its transfer over the group failed, or the answer is not ready: it stays watched)."""
        ready, said, detail = self._read(ref, self.watch[ref])
        if not ready:
            return None
        del self.watch[ref]
        self.sends.discard(ref)
        if isinstance(said, Lost):
            self.log.event("heal_source_lost", source=said.rid, round=self.r, detail=detail)
        return said

    def _read(self, ref, key: tuple[int, str]) -> tuple[bool, StateReady | Lost | None, str]:
        """(ready, what a source's answer says, why it was lost), without taking it in."""
        action_id, source = key
        if not ray.wait([ref], num_returns=1, timeout=0, fetch_local=False)[0]:
            return False, None, ""
        try:
            answer = PhaseAnswer.read(ray.get(ref, timeout=FETCH_S))
        except GetTimeoutError:
            return False, None, ""
        except Exception as err:  # noqa: BLE001 — the source died or raised while giving its state
            cause = "died" if isinstance(err, RayActorError) else "error"
            return True, Lost(source, cause), f"{type(err).__name__}: {' '.join(str(err).split())[-300:]}"
        if answer.outcome == Outcome.DONE:
            return True, StateReady(action_id, source), ""
        if ref in self.sends:  # its transfer over the group failed: its targets fall back to the object store
            return True, None, ""
        return True, Lost(source, "died"), answer.error[:300]  # it refused: the process it was chosen as is gone

    def source_failed(self, action_id: int, target: str) -> bool:
        """`target`'s heal call of `action_id` raised: was it its source's failure? A meta not yet
        ready says no: a target's call fails on its argument only once the source's call did."""
        key = (action_id, self.source_of.get((action_id, target)))
        meta = self.metas.get(key)
        return meta is not None and isinstance(self._read(meta, key)[1], Lost)

    def group_answer(self, ref, waited: bool = True):
        """A target's receive_state answered (`ref` ready). Returns the ref whose answer is its heal's:
        `ref` itself (done; it died or raised; or its heal is no longer `waited` on), or, when its
        transfer failed, its `load_state` of the source's `heal_state` through the object store."""
        action_id, target, source = self.receives.pop(ref)
        try:
            answer = PhaseAnswer.read(ray.get(ref, timeout=FETCH_S))  # the target's answer: a few hundred bytes
        except Exception:  # noqa: BLE001 — the target died or raised: its answer says so
            return ref
        if answer.outcome != Outcome.COLLECTIVE_FAILED or not waited:
            return ref
        key = (action_id, source)
        self.log.event("heal_fallback", target=target, source=source, round=self.r, detail=answer.error[:300])
        return self._load_state(key, target, "full", None, self.handles[source].heal_state, self.groups[key][1])

    def _load_state(self, key: tuple[int, str], target: str, scope: str, faults, method, *args):
        """`target`'s load_state of the state `method` gives (asked once per key; its meta watched)."""
        if key not in self.states:
            meta, self.states[key] = method.options(num_returns=2).remote(*args)
            self.metas[key] = meta
            self.watch[meta] = key
        return self.handles[target].load_state.remote(self.states[key], scope, faults)

    def settle(self, targets: Mapping[str, Any], deadline_s: float) -> dict[str, Any]:
        """The final heal's wait: until every target's call (from `issue`) answered, failed transfers
        falling back, or `deadline_s` passed. Returns target -> the ref whose answer is its heal's."""
        final = dict(targets)
        pending = {ref: rid for rid, ref in final.items()}
        end = time.monotonic() + deadline_s
        while pending and (left := end - time.monotonic()) > 0:
            waiting = list(pending) + self.watched()
            ready = ray.wait(waiting, num_returns=1, timeout=min(left, SETTLE_POLL_S), fetch_local=False)[0]
            if ready:  # and every other answer already in
                ready = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=False)[0]
            for ref in ready:
                if ref in self.watch:
                    self.source_answer(ref)
                    continue
                rid = pending.pop(ref)
                after = self.group_answer(ref) if ref in self.receives else ref
                if after is not ref:  # a fallback through the object store: its answer is the heal's
                    final[rid] = after
                    pending[after] = rid
        for ref in self.watched():  # a source lost on the way is logged, however its targets ended
            self.source_answer(ref)
        return final

    def groups_of(self, rid: str) -> list[str]:
        return [prefix for prefix, members in self.members.items() if rid in members and prefix not in self.released]

    def release_groups_of(self, rid: str, cause: str, abort, *, cluster: int, epoch: int) -> None:
        """rid is dead: `abort(prefix, reason)` each of its heal groups once, as AbortJoin does (a
        `join_aborted` event); a group already formed is not affected (the abort is a compare-and-set)."""
        for prefix in self.groups_of(rid):
            self.released.add(prefix)
            reason = f"{rid} is gone ({cause}): heal group {prefix} cannot form"
            self.log.event(
                "join_aborted", cluster=cluster, round=self.r, epoch=epoch, prefix=prefix, dead=[rid], reason=reason
            )
            abort(prefix, reason)

    def forget(self, action_id: int) -> None:
        """Action `action_id` ended: drop its states' refs (freed when no call holds them); its sources stay watched."""
        for key in [k for k in self.states if k[0] == action_id]:
            del self.states[key]
