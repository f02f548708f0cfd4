"""The round runner's questions to replicas outside a phase call: `progress` (the step of one in
run_inner, when the progress board cannot be read), `up` (is a replica that is down back?) and
`idle` (does a live replica with no call in flight still run the process the roster knows?). At
most one outstanding question per replica; each answer becomes the machine's observations
(Progress, Up, Lost). Asked through actors/round_runner.py; it decides nothing.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from actors.replica_calls import FETCH_S, up
from hsgd.core.round import Lost, Progress, RoundMachine


class Probes:
    def __init__(self, machine: RoundMachine, ports, board):
        """`board`: the run's progress board (actors.replica_calls.progress_board), or None: steps asked by calls."""
        self.m, self.p, self.r, self.board = machine, ports, machine.round, board
        self.asked: dict[Any, tuple[str, str, int | None]] = {}  # ref -> (progress | up | idle, rid, pid asked)

    def __contains__(self, ref) -> bool:
        return ref in self.asked

    def refs(self) -> list:
        return list(self.asked)

    def forget(self, rid: str) -> None:
        """Questions to rid's old process (a spare took its id): their answers are not the new one's."""
        self.asked = {ref: q for ref, q in self.asked.items() if q[1] != rid}

    def ask(self, *, idle: bool) -> list:
        """The machine's probes (RoundMachine.probes), one outstanding call per replica; the steps of those in
        run_inner read off the progress board in one round trip (by calls if it fails): this round's, from the
        process the roster knows (not a dead one's), never below the committed step, as observations."""
        roster, probes = self.p.roster, self.m.probes(idle=idle, gone=self.p.roster.gone)
        board = self.board.read([rid for what, rid in probes if what == "progress"]) if self.board else None
        asked = {rid for _, rid, _ in self.asked.values()}
        for what, rid in probes:  # an idle one's death or restart shows in the actor table, read every tick
            if (
                rid in asked
                or (what == "idle" and roster.table_tells(rid))
                or (what == "progress" and board is not None)
            ):
                continue
            asked.add(rid)
            self.asked[roster.handles[rid].progress.remote()] = (what, rid, roster.pids.get(rid))
        return [
            Progress(rid, step)
            for rid, (r, step, pid) in (board or {}).items()
            if r == self.r and pid == roster.pids.get(rid) and step >= self.m.progress.get(rid, (r, step))[1]
        ]

    def answer(self, ref) -> list:
        what, rid, known_pid = self.asked.pop(ref)
        try:
            answer = ray.get(ref, timeout=FETCH_S)
        except ActorUnavailableError:  # unreachable for now, not known dead: asked again at the next tick
            return []
        except RayActorError as err:  # its process is gone (the actor table reports the death too)
            if what == "idle" and rid in self.m.progress and self.p.roster.pids.get(rid) == known_pid:
                self.p.log.event(
                    "idle_replica_lost", rid=rid, round=self.r, detail=f"died while idle ({type(err).__name__})"
                )
                return [Lost(rid, "died")]
            return []
        except Exception:  # noqa: BLE001 — no answer in time is no sign of life: the machine's limits decide
            return []
        if what == "progress":  # (its pid and node as it answered up: actors/roster.py note_up)
            return [Progress(rid, int(answer["step"]))]
        if answer.get("phase", "idle") != "idle" or answer.get("spare"):
            return []
        if what == "idle":
            if known_pid is None or answer.get("pid") == known_pid or rid not in self.m.progress:
                return []  # the same process: alive
            self.p.log.event(
                "idle_replica_lost",
                rid=rid,
                round=self.r,
                detail=f"restarted while idle (pid {known_pid} -> {answer.get('pid')})",
            )
            self.p.roster.note_up(rid, answer)
            return [Lost(rid, "died"), up(rid, answer)]  # it died unseen, and is back
        self.p.roster.note_up(rid, answer)
        return [up(rid, answer)]
