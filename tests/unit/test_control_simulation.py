"""Issue 45, Build 2: the seeded control-plane simulation. The product's decisions between rounds
(`hsgd.core.run_control.round_start` / `round_end` / `restore_choice`, `hsgd.core.quarantine.DeathLog`) are driven
through random schedules that mix single deaths, a node's correlated deaths, whole sites, every
replica, supervisor deaths, checkpoint writes that fail or hang, corrupt checkpoints, add-site and
drain-site requests (also right after a death), hot spares, `sync.balance=steps` over sites of
different sizes and speeds, and driver resumes (`tests/fakes/control_world.py` plays the world and
checks the invariants after every event).

Run many seeds outside CI: `python -m tests.unit.test_control_simulation --seeds 0:20000`
(a failing seed prints the one line that replays it: `--seeds <seed>`).
"""

from __future__ import annotations

import argparse
import sys
import time

from hsgd.core import run_control
from hsgd.core.round.balance import StepPlan, plan_round
from tests.fakes.control_world import ControlWorld, Violation

DEFAULT_SEEDS = range(500)
ROUNDS = 30


def test_500_seeded_scenarios_of_30_rounds_hold_every_invariant():
    failed = []
    for seed in DEFAULT_SEEDS:
        try:
            ControlWorld(seed, rounds=ROUNDS).run()
        except Violation as err:
            failed.append(str(err))
    assert not failed, f"{len(failed)} of {len(DEFAULT_SEEDS)} seeds broke an invariant:\n" + "\n".join(failed[:10])


def test_the_scenarios_reach_every_kind_of_event():
    """The schedules are not vacuous: over the default seeds every kind of event happens."""
    text = "\n".join(line for seed in range(60) for line in ControlWorld(seed, rounds=ROUNDS).run().log)
    for what in (
        "died",
        "(node)",
        "supervisor died",
        "restore from",
        "quarantined",
        "joined",
        "driver resumed",
        "committed",
    ):
        assert what in text, f"no scenario of 60 had a {what!r} event"


# -- the simulation has teeth: the fixes of findings 7 and 8 (and 1's drain refusal) reverted -------------
def _first_violation(seeds=range(300)) -> str | None:
    for seed in seeds:
        try:
            ControlWorld(seed, rounds=ROUNDS).run()
        except Violation as err:
            return str(err)
    return None


def test_reverting_finding_7s_fix_makes_a_seed_fail(monkeypatch):
    def old_plan_for_round(round_index, saved, *, steps_per_round, configured, learned):
        if saved and saved.get("round") == round_index:  # the old rule: the round alone, not its clusters
            return StepPlan.from_dict(saved), False
        return plan_round(round_index, steps_per_round, configured, learned), True

    monkeypatch.setattr(run_control, "plan_for_round", old_plan_for_round)
    found = _first_violation()
    assert found and "IndexError" in found, found


def test_reverting_finding_8s_fix_makes_a_seed_fail(monkeypatch):
    from hsgd.core import quarantine

    real = quarantine.own_deaths
    monkeypatch.setattr(quarantine, "own_deaths", lambda deaths, window_s: real(deaths, 0.0))  # no node losses
    found = _first_violation()
    assert found and "node's losses" in found, found


def test_reverting_finding_1s_drain_refusal_makes_a_seed_fail(monkeypatch):
    real = run_control.decide

    def without_holders(request, **kw):  # the old rule: a drain looks at live sites only
        return real(request, **{**kw, "holders": None})

    monkeypatch.setattr(run_control, "decide", without_holders)
    found = _first_violation()
    assert found and "left no live replica holding committed round" in found, found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:500", help="a seed, or start:end")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    a, _, b = args.seeds.partition(":")
    seeds = range(int(a), int(b)) if b else [int(a)]
    start, bad = time.monotonic(), 0
    for seed in seeds:
        world = ControlWorld(seed, rounds=args.rounds)
        try:
            world.run()
        except Violation as err:
            bad += 1
            print("\n".join(world.log[-40:]) + "\n" if len(seeds) == 1 else "", err, sep="")
            continue
        if len(seeds) == 1:
            print("\n".join(world.log), f"\n{world.status}: {world.reason}")
    print(f"{len(seeds)} scenarios of {args.rounds} rounds, {bad} broke an invariant, {time.monotonic() - start:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
