"""actors/round_runner.py reads Ray's actor table at once when an answer says a collective broke (a
peer's death shows there first), not at the next tick: a killed replica's `Lost` reaches the machine
within the table's own lag, not up to TICK_S later (the recovery bench's detection)."""

import random
import time

from actors.round_runner import TICK_S
from benchmarks.fake_ray import patched_ray
from benchmarks.plan import FakeRun
from hsgd.core.topology import Topology


def test_a_broken_collective_has_the_runner_read_the_actor_table_at_once():
    run = FakeRun(Topology(2, 1), 4, random.Random(0))
    with patched_ray(run.world.ray):
        run.round("first_round")  # the groups formed
        # the inner phase lasts 0.7 s: one tick at 0.5 s, none due when the outer exchange starts at 0.7 s;
        # there c1r0 dies with its call held (only the actor table tells), c0r0's reduce fails at once
        run.world.arm("outer_reduce", None, "die_held", "c1r0")
        seen: list[tuple[float, list]] = []
        deaths = run.roster.deaths

        def timed(*args):
            got = deaths(*args)
            seen.append((time.monotonic(), got))
            return got

        run.roster.deaths = timed
        t0 = time.monotonic()
        run.round("fault_free", train_s=0.7)
    # the runner's reads in order: a read on its tick comes TICK_S after the one before; the death's came sooner
    reads = [t for t, _ in seen if t >= t0]
    ((when, _),) = [(t, got) for t, got in seen if got == ["c1r0"]]
    before = max(t for t in reads if t < when)
    assert when < before + TICK_S, (
        f"c1r0's death was read {when - before:.2f} s after the read before it: the runner waited for its next tick"
    )
