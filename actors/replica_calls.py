"""The Ray calls that carry out a round machine's phases on replicas, and what their answers
become (typed observations). Shared by the round's runner and the final heal."""

from __future__ import annotations

import time

import ray

from actors.heals import Heals
from actors.round_record import RoundRecord
from hsgd.core.round import (
    ClusterAverage,
    Heal,
    Outcome,
    OuterCommit,
    OuterReduce,
    Phase,
    PhaseAnswer,
    PhaseEnded,
    RunInner,
    Up,
    unanswered_heal,
)
from hsgd.train.progress_board import Board

FETCH_S = 5.0  # fetching an answer already ready (a few hundred bytes)


def call(phase: Phase, rid: str, armed: dict, p, heals: Heals, live: dict):
    """The Ray call carrying out rid's part of `phase` (its ref). `p`: the runner's RunnerPorts."""
    h, faults, c = p.roster.handles[rid], armed.get(rid), phase.calls[rid]
    join = getattr(c, "join", None)  # the call forms its level's group first
    join = join.at(phase.epoch, p.store_addr, p.run_id) if join else None
    match c:
        case Heal(source=source):  # the source's (round, step) as chosen, for a fallback's check
            return heals.issue(phase.id, phase.epoch, phase.calls, rid, armed, source_at=live.get(source))
        case RunInner(overlap=overlap, steps=steps):
            return h.run_inner.remote(phase.round, faults, join, overlap, steps, p.store_addr)
        case ClusterAverage():
            return h.cluster_average.remote(phase.round, phase.epoch, faults)
        case OuterReduce(shard=shard, shards=shards, weights=weights):
            return h.outer_reduce.remote(phase.round, phase.epoch, faults, join, shard, shards, weights)
        case OuterCommit(roots=roots):
            return h.outer_commit.remote(phase.round, roots, faults)
    raise TypeError(f"not a call: {c!r}")


def progress_board(ports, rids: list[str]) -> Board | None:
    """The round's progress board (hsgd/train/progress_board.py), every replica's key cleared; None
    without the run's store (the runner then asks by calls)."""
    if ports.store is None or not ports.store_addr:
        return None
    board = Board(ports.store, ports.store_addr)
    board.reset(rids)
    return board


def heal_at_rest(phase: Phase, ports, live: dict, deadline_s: float) -> None:
    """A heal outside a round (the final heal): issue it and wait for it at most `deadline_s`
    (scaled to the state's bytes: hsgd.core.deadlines.heal_deadline_s); heal_end for each that healed."""
    heals = Heals(
        ports.roster.handles, ports.log, store_addr=ports.store_addr, run_id=ports.run_id, round_index=phase.round
    )
    record, started = RoundRecord(phase.round, ports.log, ports.clock), time.monotonic()
    refs = {rid: call(phase, rid, {}, ports, heals, live) for rid in phase.calls}
    answers = {}
    for rid, ref in heals.settle(refs, deadline_s).items():
        if not ray.wait([ref], timeout=0, fetch_local=False)[0]:  # past the deadline: not healed
            answer = PhaseAnswer(
                rid, unanswered_heal(False, in_time=False), error=f"no answer within {deadline_s:.0f}s"
            )
        else:
            try:
                answer = PhaseAnswer.read(ray.get(ref, timeout=FETCH_S))
            except Exception as err:  # noqa: BLE001 — not healed: it heals at the next start, or stays behind
                answer = PhaseAnswer(
                    rid,
                    unanswered_heal(heals.source_failed(phase.id, rid)),
                    error=f"{type(err).__name__}: {str(err)[-200:]}",
                )
        record.answered(phase, answer)
        answers[rid] = (
            answer.outcome.value if answer.outcome == Outcome.DONE else f"{answer.outcome.value}: {answer.error[:200]}"
        )
    record.phase_ended(PhaseEnded(phase, answers, started, time.monotonic()))


def up(rid: str, answer: dict) -> Up:
    return Up(rid, int(answer["round"]), int(answer["step"]), answer.get("pid"), int(answer.get("incarnation") or 0))
