"""Non-finite numbers never commit (issue 19, item 8), in the round machine (hsgd/core/round.py).

Driven through test_round's fake `World`, which gains one more kind of fault here: a replica's
numbers turn NaN. In run_inner it answers `non_finite` at the phase's end (with `spread`, as with
ddp, every member of its cluster does: they all-reduced the NaN gradient); in outer_reduce the
leader answers `non_finite` before sending anything and aborts its outer group, so the other
leaders' all-reduce fails (`collective_failed`). The supervisor's carried state (`benched`,
`non_finite_rounds`) goes from one round's machine to the next, as actors/supervisor.py does.
"""

from __future__ import annotations

from hsgd.core.round import Heal, Outcome, RoundMachine
from tests.fakes.round_world import SPR, World, make_settings, outcome_of

NON_FINITE, CFAILED = Outcome.NON_FINITE, Outcome.COLLECTIVE_FAILED


class NanWorld(World):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.benched: set[int] = set()
        self.non_finite_rounds: dict = {}

    def nan(self, rid: str, where: str, round: int, *, spread: bool = True) -> None:
        """rid's numbers turn NaN in `where` (run_inner | outer_reduce) of `round`."""
        self.fault(rid, f"nan_{where}", "spread" if spread else "alone", round=round)

    def machine(self, round_index=None, **overrides) -> RoundMachine:
        overrides.setdefault("benched", self.benched)
        overrides.setdefault("non_finite_rounds", self.non_finite_rounds)
        return super().machine(round_index, **overrides)

    def round(self, round_index=None, **kwargs) -> RoundMachine:
        m = super().round(round_index, **kwargs)
        self.benched, self.non_finite_rounds = set(m.benched), dict(m.non_finite_rounds)
        return m

    def _nan_faults(self, a, kind: str):
        faults = [f for rid in a.calls for f in self._take_faults(rid, kind, a.round)]
        self._consume(faults)
        return faults

    def _do_run_inner(self, a) -> None:
        faults = self._nan_faults(a, "nan_run_inner")
        super()._do_run_inner(a)
        poisoned = {f.rid for f in faults}
        if any(f.what == "spread" for f in faults):
            poisoned = set(a.calls)
        for rid in sorted(poisoned):  # its answer at the phase's end says non_finite instead of done
            rep = self.reps[rid]
            if rep.alive and rep.call == (self.gen, a.id) and rep.token is not None and rep.run is not None:
                t0, s0, stop, dt = rep.run
                self._push(max(0.0, t0 + (stop - s0) * dt - self.now) + 0.01, rep, NON_FINITE, new=(a.round, stop))

    def _do_outer_reduce(self, a) -> None:
        faults = self._nan_faults(a, "nan_outer_reduce")
        super()._do_outer_reduce(a)
        if not faults:
            return
        poisoned = {f.rid for f in faults}
        for rid in sorted(a.calls):
            rep = self.reps[rid]
            if not (rep.alive and rep.call == (self.gen, a.id) and rep.token is not None):
                continue
            self._break_group(rep, "outer")  # the poisoned leader aborts its group; its peers' all-reduce fails
            self._push(0.05, rep, NON_FINITE if rid in poisoned else CFAILED)


def _outer_leaders(w: World) -> list[list[str]]:
    return [sorted(i.action.calls) for i in w.calls("outer_reduce")]


def test_non_finite_inner_phase_voids_only_its_cluster_and_the_others_commit_without_it():
    w = NanWorld(3, 2)
    w.nan("c1r0", "run_inner", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert set(m.void) == {1} and m.void[1].phase == "run_inner" and set(m.void[1].rids) == {"c1r0", "c1r1"}
    assert not w.kills and not m.dead, "a non-finite number kills nobody"
    assert _outer_leaders(w) == [["c0r0", "c2r0"]], "c1's pseudo-gradient is never sent"
    assert (
        "c1r0" not in w.calls("outer_commit")[0].action.calls and "c1r1" not in w.calls("outer_commit")[0].action.calls
    )
    assert w.reps["c1r0"].pos == (0, SPR) and w.reps["c0r0"].pos == (1, SPR)
    assert m.non_finite_rounds == {1: 0} and not m.benched and not m.benched_now
    # the next round: c1 restarts from the committed global params and takes part again
    w.issued.clear()
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert w.calls("heal", 1)[0].action.calls == {"c1r0": Heal("c0r0", "global"), "c1r1": Heal("c0r0", "global")}
    assert _outer_leaders(w)[-1] == ["c0r0", "c1r0", "c2r0"]
    assert all(rep.pos == (2, 2 * SPR) for rep in w.reps.values())
    assert not m.void and not w.benched


def test_non_finite_in_one_member_voids_its_whole_cluster_without_averaging_it():
    w = NanWorld(2, 3, settings=make_settings(inner="none"))
    w.nan("c0r2", "run_inner", round=0, spread=False)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.void[0].rids == ("c0r2",)
    assert not w.calls("cluster_average", 0), "a void cluster's mean is never taken"
    assert len(w.calls("cluster_average", 1)) == 1
    assert _outer_leaders(w) == [["c1r0"]]
    assert {rid for rid, rep in w.reps.items() if rep.pos == (1, SPR)} == {"c1r0", "c1r1", "c1r2"}


def test_non_finite_pseudo_gradient_retries_the_outer_exchange_without_its_cluster():
    w = NanWorld(3, 2)
    w.nan("c1r0", "outer_reduce", round=0)
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert _outer_leaders(w) == [["c0r0", "c1r0", "c2r0"], ["c0r0", "c2r0"]]
    assert len(w.forming("outer")) == 2, "the retry forms a leaders' group without c1"
    assert m.void[1].phase == "outer_reduce" and not w.kills and not m.dead
    commit = w.calls("outer_commit")[0].action.calls
    assert not {"c1r0", "c1r1"} & set(commit) and {"c0r0", "c0r1", "c2r0", "c2r1"} <= set(commit)
    assert not w.calls("run_inner", 0)[1:] and not w.calls("run_inner", 2)[1:], "inner work stays done"
    w.issued.clear()
    assert outcome_of(w, w.round()) == "committed"
    assert all(rep.pos == (2, 2 * SPR) for rep in w.reps.values())


def test_a_cluster_non_finite_in_two_rounds_running_is_benched_until_the_end_with_a_warning():
    w = NanWorld(3, 2)
    w.nan("c2r1", "run_inner", round=0)
    w.nan("c2r0", "outer_reduce", round=1)
    assert outcome_of(w, w.round()) == "committed"
    m = w.round()
    assert outcome_of(w, m) == "committed"
    assert m.benched == {2} and 2 in m.benched_now and "rounds 0 and 1" in m.benched_now[2]
    for _ in range(2):  # it sits out every later round: no call at all, the others commit
        w.issued.clear()
        m = w.round()
        assert outcome_of(w, m) == "committed" and m.clusters[2].stage == "out"
        assert not [i for i in w.issued if set(i.action.calls) & {"c2r0", "c2r1"}]
        assert not m.benched_now, "the warning is given once"
    assert w.reps["c0r0"].pos == (4, 4 * SPR)


def test_non_finite_in_rounds_apart_is_not_benched():
    w = NanWorld(2, 2)
    w.nan("c0r0", "run_inner", round=0)
    w.nan("c0r0", "run_inner", round=2)
    for _ in range(3):
        m = w.round()
        assert outcome_of(w, m) == "committed"
    assert not m.benched and m.non_finite_rounds == {0: 2}


def test_every_cluster_void_in_one_round_fails_with_the_reason_never_commits():
    w = NanWorld(2, 2)
    w.nan("c0r0", "run_inner", round=0)
    w.nan("c1r1", "run_inner", round=0)
    m = w.round()
    assert outcome_of(w, m) == "failed"
    assert "non-finite" in m.reason and "c0" in m.reason and "c1" in m.reason
    assert not w.calls("outer_reduce") and not w.calls("outer_commit") and not m.committed_by


def test_every_cluster_benched_fails_the_run_with_the_reason():
    w = NanWorld(2, 2)
    w.nan("c1r0", "run_inner", round=0)
    w.nan("c1r0", "run_inner", round=1)
    assert outcome_of(w, w.round()) == "committed"
    m = w.round()
    assert outcome_of(w, m) == "committed" and m.benched == {1}
    # c0 alone commits; then c0 too is non-finite twice running
    w.nan("c0r1", "run_inner", round=2)
    m = w.round()
    assert outcome_of(w, m) == "failed" and "non-finite" in m.reason, "no cluster left to commit round 2"
    # as a resumed supervisor would find it (the carried state says both are benched): fails at once
    m = w.machine(2, benched={0, 1}, non_finite_rounds={"0": 2, "1": 1})  # (from JSON: string keys)
    assert m.start(w.now) == [] and m.outcome == "failed"
    assert "2 of 2 clusters benched for non-finite numbers" in m.reason


def test_benched_clusters_below_min_clusters_fail_instead_of_waiting_for_quorum():
    w = NanWorld(3, 2, settings=make_settings(min_clusters=2))
    m = w.machine(0, benched={1, 2})
    m.start(w.now)
    assert m.outcome == "failed" and "min_clusters=2" in m.reason
    m = w.machine(0, benched={2})
    assert m.start(w.now) and not m.done, "two clusters left: the round runs"


def test_a_benched_cluster_and_a_lost_one_wait_for_quorum_the_lost_one_comes_back():
    w = NanWorld(3, 2, settings=make_settings(min_clusters=2))
    w.crash(["c1r0", "c1r1"])
    m = w.machine(0, benched={0})
    m.start(w.now)
    assert m.outcome == "below_quorum", m.reason
