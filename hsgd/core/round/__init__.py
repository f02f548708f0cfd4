"""The round machine: what happens in one round, and after any failure in it. Pure: no Ray, no
clocks, no I/O; actors/round_runner.py carries out its effects and feeds back what it saw, as typed
messages. The round step by step and the full failure table: docs/concepts.md.

After a failure (cluster c; the page's table says what each one interrupts and what is recorded):
    a replica of c dies, hangs or raises, or c's collective fails -> c alone re-forms; the rest go on
    a shard holder dies, or an outer collective fails -> only the outer exchange is retried
    every member of c lost            -> c sits the round out and heals `global` the next round
    a failure during the commit       -> committed if any replica applied it, else retried
    non-finite numbers in c           -> c's round is void, nobody killed; twice running: `benched`
    a reduce behind the inner steps failed -> nothing applied; the exchange reduces again after inner
    a member of a forming group is known dead -> `AbortJoin` releases its rendezvous at once
    a replica back unseen (a new incarnation) -> its death is taken in first, then it joins
    the round ends early with calls in flight -> no group they use is handed on as standing
    a replica answers `behind`        -> it is healed, never counted as done
    a restarted replica answers (`Up`) -> it joins its cluster mid-round, at one step boundary
    the round closes (sync.balance=time) -> clusters in their inner phase yield at a step boundary
    a cluster not ready by the close plus its grace -> late: the round goes on without it, nobody
                                      killed; it heals `global` the next round
    hung = silent AND not advancing: a replica whose step still advances is slow, never killed.
One call per replica at a time (`busy`), so a replica is in at most one collective at a time; with
overlap (sync.fragment_delay), at most one per level, never two on one group.

Files: messages.py (what goes in and out, each with its protocol), calls.py (calls in flight),
machine.py (state, settings, deadlines), cluster.py (a cluster's phase, re-form, rejoin), outer.py
(the outer exchange, non-finite clusters, a round's end), liveness.py (hung vs slow, kill, reap),
schedule.py (who heals from whom; between rounds), balance.py (steps per site, sync.balance=steps),
close.py (a round closed by the clock, late clusters: sync.balance=time).
"""

from hsgd.core.round.balance import StepPlan, plan_round
from hsgd.core.round.machine import RoundMachine, RoundSettings, round_settings
from hsgd.core.round.messages import (
    AbortJoin,
    Answer,
    Call,
    CallKind,
    ClusterAverage,
    ClusterStage,
    Effect,
    ErrorKind,
    GroupJoin,
    Heal,
    Join,
    Kill,
    Late,
    Lost,
    NonFinite,
    Observation,
    Outcome,
    OuterCommit,
    OuterReduce,
    OuterStage,
    Overlap,
    Phase,
    PhaseAnswer,
    PhaseEnded,
    Progress,
    Reap,
    RoundClosed,
    RunInner,
    StateReady,
    StepTimed,
    Up,
    Yield,
    raised,
    unanswered_heal,
)
from hsgd.core.round.schedule import (
    current_round,
    due,
    evaluation_order,
    heals_at_rest,
    model_writers,
    unrecorded_rounds,
)
