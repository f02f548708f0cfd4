"""The Ray calls that carry out a round machine's phases on replicas, and what their answers
become (typed observations). Shared by the round's runner and the final heal."""
from __future__ import annotations

import time

import ray

from actors.heals import Heals
from actors.round_record import RoundRecord
from hsgd.core.round import ErrorKind, Outcome, Phase, PhaseEnded, Up, run_inner_overlap

FETCH_S = 5.0  # fetching an answer already ready (a few hundred bytes)


def call(phase: Phase, rid: str, args: tuple, armed: dict, p, heals: Heals, live: dict):
    """The Ray call carrying out rid's part of `phase` (its ref). `p`: the runner's RunnerPorts."""
    h, faults, kind = p.roster.handles[rid], armed.get(rid), phase.kind
    if kind == "heal":  # the source's (round, step) as chosen, for a fallback's check
        return heals.issue(phase.id, phase.epoch, phase.calls, rid, armed, source_at=live.get(args[0]))
    # (prefix, rank, world_size): the call forms its level's group first
    join = (phase.epoch, p.store_addr, f"{p.run_id}/{args[0]}", args[1], args[2]) if phase.forms_group else None
    if kind == "run_inner":
        return h.run_inner.remote(phase.round, faults, join, run_inner_overlap(args))
    if kind == "cluster_average":
        return h.cluster_average.remote(phase.round, phase.epoch, faults)
    if kind == "outer_reduce":
        shard, shards = args[-2:]
        return h.outer_reduce.remote(phase.round, phase.epoch, faults, join, shard, shards)
    if kind == "outer_commit":
        return h.outer_commit.remote(phase.round, args[0], faults)
    raise ValueError(f"unknown phase {kind}")


def heal_at_rest(phase: Phase, ports, live: dict, deadline_s: float) -> None:
    """A heal outside a round (the final heal): issue it and wait for it at most `deadline_s`
    (scaled to the state's bytes: hsgd.core.deadlines.heal_deadline_s); heal_end for each that healed."""
    heals = Heals(ports.roster.handles, ports.log, store_addr=ports.store_addr, run_id=ports.run_id,
                  round_index=phase.round)
    record, started = RoundRecord(phase.round, ports.log, ports.clock), time.monotonic()
    refs = {rid: call(phase, rid, args, {}, ports, heals, live) for rid, args in phase.calls.items()}
    answers = {}
    for rid, ref in heals.settle(refs, deadline_s).items():
        if not ray.wait([ref], timeout=0, fetch_local=False)[0]:  # past the deadline: not healed
            value, outcome = {"error": f"no answer within {deadline_s:.0f}s"}, Outcome.COLLECTIVE_FAILED
        else:
            try:
                value = ray.get(ref, timeout=FETCH_S)
                outcome = Outcome(value.get("outcome", "done"))
            except Exception as err:  # noqa: BLE001 — not healed: it heals at the next start, or stays behind
                value = {"error": f"{type(err).__name__}: {str(err)[-200:]}"}
                outcome = Outcome.COLLECTIVE_FAILED if heals.source_failed(phase.id, rid) else Outcome.DIED
        record.answered(phase, rid, outcome, value, value.get("error", ""))
        answers[rid] = outcome.value if outcome == Outcome.DONE else f"{outcome.value}: {value.get('error', '')[:200]}"
    record.phase_ended(PhaseEnded(phase, answers, started, time.monotonic()))


def up(rid: str, answer: dict) -> Up:
    return Up(rid, int(answer["round"]), int(answer["step"]), answer.get("pid"), int(answer.get("incarnation") or 0))


def error_kind(value) -> ErrorKind:
    try:
        return ErrorKind(value or "")
    except ValueError:  # a kind this supervisor does not know (a newer replica): no kind
        return ErrorKind.NONE
