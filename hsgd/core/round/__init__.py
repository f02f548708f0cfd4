"""The round machine: what happens in one round, and after any failure in it. Pure: no Ray, no
clocks, no I/O. The supervisor's runner (actors/round_runner.py) carries its effects out and feeds
back what it saw, as typed messages. Read this table first; each file beside it carries out a part:

    messages.py  what goes in (Answer, Progress, Up, Lost, StateReady) and out (Phase, Kill, Reap,
                 Yield, AbortJoin, StepTimed, PhaseEnded), each with its protocol; a Phase's typed
                 calls (CallKind, RunInner, OuterReduce, Heal, ...), a replica's PhaseAnswer, and
                 the stages of a cluster and of the outer exchange (ClusterStage, OuterStage)
    calls.py     the one record of calls in flight
    machine.py   the machine's state, and how each observation is taken in; a round's settings:
                 every deadline, scaled to the bytes and the learned step times
    cluster.py   a cluster's phase: heal, inner, ready; re-form; a replica joining mid-round
    outer.py     the outer exchange (reduce, commit, retry), non-finite clusters, a round's end
    liveness.py  hung vs slow, kill, reap, releasing a rendezvous
    schedule.py  who heals from whom; between rounds: next round, checkpoints and evaluations
                 due, model writers, rounds owed to the record, the final heal

One round r:

    start        every live replica reports its committed (round, step). If none holds the last
                 committed round: `restore` (from the latest durable checkpoint), or `failed` when
                 there is none. Clusters below `min_replicas_per_cluster` sit out; fewer than
                 `min_clusters` left: `below_quorum`.
    per cluster  (independently: one cluster never waits for or disturbs another)
                 heal     members behind the furthest member copy its state (`full`); a cluster
                          with nobody at round r copies the global state from another (`global`)
                 inner    every member runs the round's remaining inner steps (one call), first
                          forming its inner group under a fresh epoch when the members changed
                 average  inner `none` only: the cluster's mean goes to outer sync
    outer        once every participating cluster is ready: the shard holders (on the `leader`
                 path the leaders, one shard; hsgd/core/outer_plan.py) reduce their shard of the
                 round's fragment's pseudo-gradient into buffers keyed by (round, epoch, shard),
                 first forming each shard's group when the holders changed, and commit only if
                 every holder succeeded; then every member gathers the shards and applies the step.
    overlap      sync.fragment_delay = tau: when the standing outer groups are the round's plan,
                 each holder's run_inner names its group (`RunInner.overlap`) and reduces its
                 shard of the pseudo-gradient taken tau steps before the end in the background, so
                 the reduce above only waits for it (hsgd/train/overlap.py). The commit is the same.

After a failure (the whole of "Failure scoping"):
    replica of cluster c died / hung / raised, or c's collective failed
                 -> only c re-forms: its survivors return at their last committed step (a silent
                    one is killed once its group's grace is over), the furthest wins, laggards
                    heal, and c's inner phase is issued again under a new epoch. Other clusters are
                    not interrupted and their results count.
    a leader or another shard holder died, or an outer collective failed
                 -> only the outer exchange is retried, every shard: buffers are never applied
                    without a commit, the dead holder's cluster re-forms (a new leader), the shards
                    are planned again over the live sizes, inner work stays.
    every member of a cluster lost
                 -> the cluster sits the round out; its replicas heal from another cluster next round.
    failure during the commit
                 -> if any replica applied it, the round is committed; the others heal from a
                    committed replica at the next round's start. If none did, the exchange is retried.
    non-finite numbers in c (a member's run_inner answers `non_finite`: a loss or gradient norm
    was NaN/inf; or c's leader's outer_reduce: its pseudo-gradient was)
                 -> c's round is void: nobody is killed, c's pseudo-gradient is never sent (found
                    at the reduce, the exchange is retried without c), the others commit without
                    it, and c restarts the next round with a `global` heal. Non-finite in two rounds
                    running (or twice in one round): c is `benched` until the run's end or a resume.
                    Waiting never cures it: when the benched alone leave fewer than min_clusters,
                    or this round's void ones are all that is missing, the round ends `failed`,
                    never `below_quorum`.
    a reduce behind the inner steps failed (a holder died, a peer never came, non-finite)
                 -> nothing was applied: the holders' outer_reduce answers the failure (a dead
                    holder resets the standing groups, so the retry forms new ones and reduces the
                    same snapshot); a superseded background reduce is aborted, never waited out.
    a member of a group being formed is known dead (died, raised, killed, reaped, lost)
                 -> every member waiting in that rendezvous is released at once (AbortJoin: they
                    answer `collective_failed`, kind `join_aborted`) and the cluster re-forms
                    without it; nobody waits out the configure timeout.
    a replica dies and comes back unseen (its Up names a new incarnation)
                 -> the death is taken in first (one `deaths` entry per death), then it joins.
    hung         = silent AND not advancing: a replica whose step still advances is slow, never
                    hung. Its limit is the learned step deadline, or, once a peer of its group
                    failed, the group's grace (a healthy member leaves a broken collective within
                    its collective timeout).
    the round ends early (below quorum, failed) with calls in flight
                 -> nobody reads their answers, so no group they use is handed on as standing.
    replica answers `behind` (its round is below the one asked)
                 -> it is healed, never counted as done.
    a restarted replica answers again (`Up`, rejoin `fast`)
                 -> it joins its cluster inside the round: the members yield at one step boundary
                    a little ahead of the furthest (no collective is left half-joined), the
                    newcomer heals `full` from the furthest member, the group re-forms, inner goes
                    on. A cluster done with inner takes it in before the outer exchange; one that
                    sat out, or a round in its outer exchange, at the next round's start. Nobody
                    ever waits for a replica that is still starting.

Sites of different speeds (sync.balance=steps, balance.py): each cluster runs its planned steps of
the round; the plan is fixed at the round's start (recorded, never re-measured by a successor),
a heal or rejoin lands on its cluster's plan, the round's end for cluster c is its planned step,
and the outer mean weighs clusters by the tokens they trained.

The machine never issues a call to a replica with one in flight (`busy`): with one call per
replica, each on one level, a replica is in at most one collective at a time. The exception is
overlap (sync.fragment_delay): a holder's run_inner also reduces on the outer level in the
background; at most one collective per level then, never two on one group (hsgd/train/comm.py
enforces both), and no inner step waits on the outer level.
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

# the package's public names: the round machine, its messages and its schedule, re-exported
__all__ = [
    "StepPlan",
    "plan_round",
    "RoundMachine",
    "RoundSettings",
    "round_settings",
    "AbortJoin",
    "Answer",
    "Call",
    "CallKind",
    "ClusterAverage",
    "ClusterStage",
    "Effect",
    "ErrorKind",
    "GroupJoin",
    "Heal",
    "Join",
    "Kill",
    "Lost",
    "NonFinite",
    "Observation",
    "Outcome",
    "OuterCommit",
    "OuterReduce",
    "OuterStage",
    "Overlap",
    "Phase",
    "PhaseAnswer",
    "PhaseEnded",
    "Progress",
    "Reap",
    "RunInner",
    "StateReady",
    "StepTimed",
    "Up",
    "Yield",
    "raised",
    "unanswered_heal",
    "current_round",
    "due",
    "evaluation_order",
    "heals_at_rest",
    "model_writers",
    "unrecorded_rounds",
]
