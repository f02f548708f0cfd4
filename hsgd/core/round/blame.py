"""Whose failure it is when a replica's call gives no answer of its own (the runner's rules, pure:
it only reports what Ray said). Read with the failure table in __init__.py.
"""
from __future__ import annotations

from hsgd.core.round.messages import Outcome


def raised(*, actor_gone: bool, source_failed: bool) -> Outcome:
    """The outcome of a round's call that raised instead of answering: its heal source's state never
    came (Ray fails a call whose argument failed): the source's failure, the target is fine and
    heals again; else Ray says the actor is gone; else the replica raised (OOM, I/O, a bug), its
    own failure, never the job's."""
    return Outcome.COLLECTIVE_FAILED if source_failed else Outcome.DIED if actor_gone else Outcome.ERROR


def restarts(outcome: Outcome) -> bool:
    """The replica raised: it is killed and restarted clean."""
    return outcome == Outcome.ERROR


def unanswered_heal(source_failed: bool, *, in_time: bool = True) -> Outcome:
    """A final heal's target (outside a round: nobody is killed) that gave no answer: not by the
    deadline, or its source failed: not healed, it heals at the next start; else it raised: died."""
    return Outcome.COLLECTIVE_FAILED if source_failed or not in_time else Outcome.DIED


def restarted_unseen(known_pid: int | None, pid: int | None) -> bool:
    """An idle live replica answered from another process than the one last seen up: it died
    unseen and is back; its death is taken in first."""
    return known_pid is not None and pid != known_pid
