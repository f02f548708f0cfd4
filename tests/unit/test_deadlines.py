"""hsgd.core.deadlines: learned phase deadlines and the stall rule (advancing = alive)."""

from hsgd.core.deadlines import STUCK, PhaseClock, StallWatch


def test_deadline_is_the_ceiling_until_the_phase_was_seen_then_a_clamped_multiple_of_its_median():
    clock = PhaseClock(multiple=4.0, floor_s=15.0, ceiling_s=300.0, min_samples=2)
    assert clock.deadline("inner", 10) == 300.0
    clock.observe("inner", 20.0, 10)  # 2 s per step
    assert clock.deadline("inner", 10) == 300.0, "one sample is not enough"
    clock.observe("inner", 40.0, 10)  # 4 s per step: median 3 s
    assert clock.deadline("inner", 10) == 120.0
    assert clock.deadline("inner", 1) == 15.0, "never below the floor"
    assert clock.deadline("inner", 100) == 300.0, "never above the ceiling"
    assert clock.median("inner", 0.5) == 3.0 and clock.median("outer", 0.5) == 0.5


def test_a_replica_whose_step_moves_is_never_stuck_and_one_that_stops_is_after_the_limit():
    watch = StallWatch(limit_s=10.0)

    def stuck(rid, step, now):
        return watch.verdict(rid, {"phase": "inner", "step": step}, now) == STUCK

    assert not stuck("c0r0", 5, now=0.0)
    assert not stuck("c0r0", 6, now=9.0)
    assert not stuck("c0r0", 7, now=30.0), "it advanced: the clock starts again"
    assert not stuck("c0r0", 7, now=40.0)
    assert stuck("c0r0", 7, now=40.5)
    assert not stuck("c0r1", 7, now=40.5), "per replica"
