"""The phase names, in one place: the `phase` of events.jsonl (`phase_begin`, `phase_end`), of
faults_fired.jsonl and of a replica's progress; what each may be used for is a trait of the name,
never a list kept in step by hand. The values are public (events.jsonl, faults.schedule's `phase`).
"""

from __future__ import annotations

from enum import StrEnum

# the traits a phase may have
FAULT = "fault"  # a scheduled fault may name it (faults.schedule's `phase`; docs/faults.md)
STEPS = "steps"  # a fault in it fires at its `step` (the others at the phase's start)
SUPERVISOR = "supervisor"  # the supervisor has it too: a fault targeting the supervisor may name it
SPAN = "span"  # timeline.png draws it (a replica's time in it, between phase_begin and phase_end)
PROGRESS = "progress"  # a phase_end of it without failure shows the run moving again (recovery latency)
MOVES_STATE = "moves_state"  # its work is sized by the state it moves: held to that limit when it stalls


class Phase(StrEnum):
    """A phase of a round (or of a run's start), by the name events.jsonl gives it."""

    traits: frozenset[str]

    def __new__(cls, value: str, traits: str = ""):
        member = str.__new__(cls, value)
        member._value_ = value
        member.traits = frozenset(traits.split())
        return member

    INNER = "inner", f"{FAULT} {STEPS} {SUPERVISOR} {SPAN} {PROGRESS}"
    INNER_SYNC = "inner_sync", f"{FAULT} {STEPS} {SPAN} {PROGRESS} {MOVES_STATE}"
    OUTER = "outer", f"{FAULT} {SUPERVISOR} {SPAN} {PROGRESS} {MOVES_STATE}"
    OUTER_COMMIT = "outer_commit", f"{FAULT} {SUPERVISOR} {SPAN} {PROGRESS} {MOVES_STATE}"
    CHECKPOINT = "checkpoint", f"{FAULT} {SUPERVISOR} {SPAN} {MOVES_STATE}"
    HEAL = "heal", f"{FAULT} {SPAN} {MOVES_STATE}"
    JOIN = "join", FAULT  # forming a level's group, before its rendezvous
    STARTUP = "startup", FAULT  # a run's start (a resumed run's: at the round it resumes at)
    NOW = "now"  # a drill's fault, at the next boundary (faults_fired.jsonl)
    CONFIGURE = "configure"  # a replica in its group's rendezvous (its progress)
    IDLE = "idle"  # a replica between calls

    @classmethod
    def having(cls, trait: str) -> tuple[Phase, ...]:
        """The phases with `trait`, in this order (an error message lists them so)."""
        return tuple(phase for phase in cls if trait in phase.traits)
