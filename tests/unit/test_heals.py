"""actors/heals.py without a cluster: what the supervisor's side of a heal fetches, waits on and
concludes, against replicas whose answers the test scripts (a fake `ray.wait` / `ray.get` record
every ref waited on and fetched). The same protocol with real Ray actors:
tests/integration/test_heal_path.py."""

from __future__ import annotations

import time

import pytest
import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayTaskError

from actors import heals
from actors.heals import Heals
from hsgd.core.deadlines import heal_deadline_s, state_bytes_bound
from hsgd.core.round import Heal, Lost, Outcome, PhaseAnswer, StateReady
from hsgd.train import state_stream
from hsgd.train.comm import collective_timeout_s
from tests.fakes.clock import FakeClock
from tests.fakes.event_log import EventLog

DONE = PhaseAnswer("any").wire()  # (a PhaseAnswer as it crosses Ray)
FAILED = PhaseAnswer("any", Outcome.COLLECTIVE_FAILED, error="inner: joining ... failed").wire()


class Ref:
    """An object ref whose answer the test sets: a value, or an error; `ready` False until it comes."""

    def __init__(self, name: str, value=None, error: Exception | None = None, ready: bool = True):
        self.name, self.value, self.error, self.ready = name, value, error, ready

    def __repr__(self):
        return f"Ref({self.name})"


class FakeRay:
    """ray.wait / ray.get over Refs, recording what was waited on (with fetch_local) and fetched."""

    def __init__(self):
        self.fetched: list[Ref] = []
        self.waited_local: list[Ref] = []  # refs waited on with fetch_local=True (pulled to the caller's node)

    def wait(self, refs, *, num_returns=1, timeout=None, fetch_local=True):
        if fetch_local:
            self.waited_local += refs
        ready = [r for r in refs if r.ready][:num_returns]
        if not ready and timeout:
            time.sleep(min(timeout, 0.01))
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, *, timeout=None):
        self.fetched.append(ref)
        if not ref.ready:
            raise GetTimeoutError("not ready")
        if ref.error is not None:
            raise ref.error
        return ref.value


class Method:
    def __init__(self, actor: Replica, name: str, num_returns: int = 1):
        self.actor, self.name, self.num_returns = actor, name, num_returns

    def options(self, num_returns: int = 1):
        return Method(self.actor, self.name, num_returns)

    def remote(self, *args):
        self.actor.calls.append((self.name, args, self.num_returns))
        refs = self.actor.answers[self.name](*args)
        assert (len(refs) if isinstance(refs, tuple) else 1) == self.num_returns, (
            f"{self.name} answers {self.num_returns} object(s) as called"
        )
        return refs


class Replica:
    """A handle whose methods answer what `answers[name](*args)` returns (a Ref, or a tuple of them)."""

    def __init__(self, rid: str, **answers):
        self.rid, self.calls, self.answers = rid, [], answers

    def __getattr__(self, name):
        if name in ("rid", "calls", "answers"):
            raise AttributeError(name)
        return Method(self, name)


def source_answer(name="c1r0", meta_ready=True, error=None, ok=True):
    meta = Ref(
        f"{name}.meta",
        PhaseAnswer(
            name,
            Outcome.DONE if ok else Outcome.COLLECTIVE_FAILED,
            3,
            12,
            "" if ok else "restarted since it was chosen",
            result={"pid": 1, "bytes": 1 << 30},
        ).wire(),
        error=error,
        ready=meta_ready,
    )
    state = Ref(f"{name}.state", "<the state: never to be fetched here>", error=error, ready=meta_ready)
    return meta, state


def load_answer(target):
    def load_state(state, scope, faults):
        return Ref(f"{target}.load_state", {**DONE, "rid": target}, error=state.error, ready=state.ready)

    return load_state


@pytest.fixture
def fake(monkeypatch):
    f = FakeRay()
    monkeypatch.setattr(ray, "wait", f.wait)
    monkeypatch.setattr(ray, "get", f.get)
    return f


def _heals(handles, log=None, round_index=3):
    return Heals(handles, log or EventLog(), store_addr="127.0.0.1:1/secret", run_id="run", round_index=round_index)


def _no_state_fetched(fake, *states):
    for s in states:
        assert s not in fake.fetched, f"{s} was fetched into the supervisor"
        assert s not in fake.waited_local, f"{s} was waited on with fetch_local=True (pulled to the supervisor's node)"


def test_a_global_heal_hands_the_states_ref_to_each_target_and_fetches_only_the_meta(fake):
    meta, state = source_answer()
    src = Replica("c1r0", global_state=lambda: (meta, state))
    targets = {t: Replica(t, load_state=load_answer(t)) for t in ("c0r0", "c0r1")}
    h = _heals({"c1r0": src, **targets})
    calls = {"c0r0": Heal("c1r0", "global"), "c0r1": Heal("c1r0", "global")}
    refs = {t: h.issue(7, 2, calls, t, {"c0r0": ["f"]}) for t in calls}
    assert [c[0] for c in src.calls] == ["global_state"], "one state per source, however many targets"
    assert src.calls[0][2] == 2, "the source answers two objects: meta and state"
    for t, replica in targets.items():
        ((name, (arg, scope, faults), _),) = replica.calls
        assert name == "load_state" and arg is state and scope == "global", (
            f"{t}'s load_state must take the state's ref itself, not a value fetched from it"
        )
    assert targets["c0r0"].calls[0][1][2] == ["f"] and targets["c0r1"].calls[0][1][2] is None
    assert h.watched() == [meta]
    assert h.source_answer(meta) == StateReady(7, "c1r0")
    assert h.watched() == [], "an answer is taken in once"
    assert [ray.get(r)["outcome"] for r in refs.values()] == ["done", "done"]
    _no_state_fetched(fake, state)


def test_a_slow_source_is_never_lost_it_stays_watched_until_it_answers(fake):
    meta, state = source_answer(meta_ready=False)
    h = _heals(
        {
            "c1r0": Replica("c1r0", global_state=lambda: (meta, state)),
            "c0r0": Replica("c0r0", load_state=load_answer("c0r0")),
        }
    )
    h.issue(1, 0, {"c0r0": Heal("c1r0", "global")}, "c0r0", {})
    for _ in range(3):  # asked early and again: nothing is concluded from a slow answer
        assert h.source_answer(meta) is None
        assert h.watched() == [meta]
    assert meta not in fake.fetched, "a meta is fetched only once it is ready (no fetch timeout decides)"
    meta.ready = state.ready = True
    assert h.source_answer(meta) == StateReady(1, "c1r0")
    _no_state_fetched(fake, state)


def test_a_source_that_dies_giving_its_state_is_lost_and_its_targets_failure_is_not_the_targets(fake):
    died = ActorDiedError()
    meta, state = source_answer(error=died)
    log = EventLog()
    h = _heals(
        {
            "c1r0": Replica("c1r0", global_state=lambda: (meta, state)),
            "c0r0": Replica("c0r0", load_state=load_answer("c0r0")),
        },
        log,
    )
    target = h.issue(4, 0, {"c0r0": Heal("c1r0", "global")}, "c0r0", {})
    with pytest.raises(ActorDiedError):  # Ray fails the target's call with its argument's error
        ray.get(target)
    assert h.source_failed(4, "c0r0"), "the target's call failed on its source's state: the source's failure"
    assert h.source_answer(meta) == Lost("c1r0", "died")
    assert [f["source"] for f in log.named("heal_source_lost")] == ["c1r0"]
    assert "ActorDiedError" in log.named("heal_source_lost")[0]["detail"]
    _no_state_fetched(fake, state)


def test_a_source_that_raises_is_lost_with_cause_error(fake):
    meta, state = source_answer(error=RayTaskError("global_state", "Traceback ...", RuntimeError("boom")))
    h = _heals(
        {
            "c1r0": Replica("c1r0", global_state=lambda: (meta, state)),
            "c0r0": Replica("c0r0", load_state=load_answer("c0r0")),
        }
    )
    h.issue(4, 0, {"c0r0": Heal("c1r0", "global")}, "c0r0", {})
    assert h.source_answer(meta) == Lost("c1r0", "error")


def test_a_target_that_dies_on_its_own_is_not_its_sources_failure(fake):
    meta, state = source_answer()
    h = _heals(
        {
            "c1r0": Replica("c1r0", global_state=lambda: (meta, state)),
            "c0r0": Replica("c0r0", load_state=lambda s, scope, f: Ref("load", error=ActorDiedError())),
        }
    )
    h.issue(4, 0, {"c0r0": Heal("c1r0", "global")}, "c0r0", {})
    assert not h.source_failed(4, "c0r0")
    slow_meta, slow_state = source_answer("c1r1", meta_ready=False)
    h.handles["c1r1"] = Replica("c1r1", global_state=lambda: (slow_meta, slow_state))
    h.issue(5, 0, {"c0r0": Heal("c1r1", "global")}, "c0r0", {})
    assert not h.source_failed(5, "c0r0"), "a source that has not answered is not known to have failed"
    _no_state_fetched(fake, state, slow_state)


def _group(send_answer, receive_answers, fallback_meta_ok=True):
    """c0r0 heals c0r1 and c0r2 over a group; their transfers answer `receive_answers`."""
    meta, state = source_answer("c0r0", ok=fallback_meta_ok)
    send = Ref("c0r0.send_state", send_answer)
    src = Replica("c0r0", send_state=lambda *a: send, heal_state=lambda expect: (meta, state))
    targets = {
        t: Replica(
            t, receive_state=lambda *a, t=t: Ref(f"{t}.receive_state", receive_answers[t]), load_state=load_answer(t)
        )
        for t in receive_answers
    }
    return src, targets, send, meta, state


def test_a_failed_transfer_over_the_group_falls_back_through_the_object_store_once_per_source(fake):
    src, targets, send, meta, state = _group(FAILED, {"c0r1": FAILED, "c0r2": FAILED})
    log = EventLog()
    h = _heals({"c0r0": src, **targets}, log, round_index=5)
    calls = {"c0r1": Heal("c0r0", "full"), "c0r2": Heal("c0r0", "full")}
    refs = {t: h.issue(9, 4, calls, t, {"c0r0": ["sf"]}, source_at=(5, 30)) for t in calls}
    ((name, (round_index, join, chunk_mb, faults), _),) = src.calls
    assert name == "send_state" and round_index == 5 and (join.epoch, join.rank, join.world_size) == (4, 0, 3)
    assert faults == ["sf"] and join.prefix.startswith("run/epoch4/heal/r5/c0r0/")
    ranks = {t: r.calls[0][1][1].rank for t, r in targets.items()}
    assert ranks == {"c0r1": 1, "c0r2": 2} and all(r.calls[0][1][1].prefix == join.prefix for r in targets.values())
    assert h.watched() == [send] and h.source_answer(send) is None, "a failed transfer is not the source's loss"
    after = {t: h.group_answer(ref) for t, ref in refs.items()}
    assert all(after[t] is not refs[t] for t in refs), "each target is healed again through the object store"
    assert [c[:2] for c in src.calls[1:]] == [("heal_state", ((5, 30),))], (
        "one heal_state per source, checking the progress the source was chosen holding"
    )
    for replica in targets.values():
        name, (arg, scope, faults), _ = replica.calls[-1]
        assert name == "load_state" and arg is state and scope == "full"
    assert [f["target"] for f in log.named("heal_fallback")] == ["c0r1", "c0r2"]
    assert h.source_answer(meta) == StateReady(9, "c0r0")
    _no_state_fetched(fake, state)


def test_a_transfer_over_the_group_that_is_done_or_no_longer_waited_on_is_the_heals_answer(fake):
    src, targets, send, meta, state = _group(
        {**DONE, "bytes": 10}, {"c0r1": {**DONE, "transport": "group"}, "c0r2": FAILED}
    )
    h = _heals({"c0r0": src, **targets})
    calls = {"c0r1": Heal("c0r0", "full"), "c0r2": Heal("c0r0", "full")}
    refs = {t: h.issue(9, 4, calls, t, {}) for t in calls}
    assert h.source_answer(send) == StateReady(9, "c0r0")
    assert h.group_answer(refs["c0r1"]) is refs["c0r1"]
    assert h.group_answer(refs["c0r2"], waited=False) is refs["c0r2"], "a target given up on is not healed again"
    assert [c[0] for c in src.calls] == ["send_state"]


def test_a_refused_fallback_loses_the_source_and_its_target_is_told_so_not_blamed(fake):
    src, targets, send, meta, state = _group(FAILED, {"c0r1": FAILED}, fallback_meta_ok=False)
    h = _heals({"c0r0": src, **targets})
    ref = h.issue(2, 1, {"c0r1": Heal("c0r0", "full")}, "c0r1", {}, source_at=(1, 4))
    h.group_answer(ref)
    assert h.source_failed(2, "c0r1")
    assert h.source_answer(meta) == Lost("c0r0", "died"), "refused: the process chosen as the source is gone"


def test_the_final_heal_waits_for_its_fallbacks_and_gives_up_at_its_deadline(fake, monkeypatch):
    src, targets, send, meta, state = _group(FAILED, {"c0r1": FAILED, "c0r2": FAILED})
    h = _heals({"c0r0": src, **targets})
    calls = {"c0r1": Heal("c0r0", "full"), "c0r2": Heal("c0r0", "full")}
    refs = {t: h.issue(-1, 1, calls, t, {}) for t in calls}
    final = h.settle(refs, deadline_s=5.0)
    assert set(final) == set(calls) and all(final[t] is not refs[t] for t in calls)
    assert all(ray.get(final[t])["outcome"] == "done" for t in calls)
    assert h.watched() == [], "the sources' answers were taken in on the way"
    _no_state_fetched(fake, state)

    never = Ref("c0r1.receive_state", ready=False)
    h2 = _heals(
        {
            "c0r0": Replica("c0r0", send_state=lambda *a: Ref("send", ready=False)),
            "c0r1": Replica("c0r1", receive_state=lambda *a: never),
        }
    )
    clock = FakeClock()  # the heals' clock moves only by what ray.wait waits
    monkeypatch.setattr(heals, "time", clock)

    def wait(refs, *, timeout=None, **kw):
        clock.sleep(timeout or 0)
        return fake.wait(refs, **kw)

    monkeypatch.setattr(ray, "wait", wait)
    t0 = clock.now
    final = h2.settle({"c0r1": h2.issue(-1, 1, {"c0r1": Heal("c0r0", "full")}, "c0r1", {})}, deadline_s=0.3)
    assert final == {"c0r1": never}
    assert clock.now - t0 == pytest.approx(0.3), "it gave up at its deadline, not before or after"


def test_forgetting_an_ended_heal_drops_its_states_refs_but_keeps_watching_its_source(fake):
    meta, state = source_answer(meta_ready=False)
    h = _heals(
        {
            "c1r0": Replica("c1r0", global_state=lambda: (meta, state)),
            "c0r0": Replica("c0r0", load_state=load_answer("c0r0")),
        }
    )
    h.issue(3, 0, {"c0r0": Heal("c1r0", "global")}, "c0r0", {})
    h.forget(3)
    assert state not in h.states.values() and h.watched() == [meta]


# -- deadlines ---------------------------------------------------------------------------------------
def test_a_full_state_never_holds_more_than_the_bound_its_deadline_assumes():
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train import task
    from hsgd.train.comm import LevelGroup
    from hsgd.train.trainer import ReplicaTrainer

    def solo(level):
        g = LevelGroup(level)
        g.configure(None, f"t/{level}", rank=0, world_size=1, epoch=0)
        return g

    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 16, 2, 16
    cfg.data.batch_size, cfg.train.eval_batches, cfg.sync.outer_every = 2, 1, 2
    dataset = task.build_dataset(cfg)
    for inner in ("adamw", "sgd"):
        cfg.optim.inner.name = inner
        t = ReplicaTrainer(cfg, "c0r0", Topology(1, 1), dataset=dataset)
        t.run_inner(0, solo("inner"))
        t.outer_reduce(0, 1, solo("outer"))
        t.outer_commit(0, solo("inner"), roots=(0,))  # every buffer exists now: optimizer moments, outer momentum
        t.run_inner(1, solo("inner"))
        nbytes = sum(x.numel() * x.element_size() for x in state_stream.split_state(t.state_dict())[1])
        assert nbytes <= state_bytes_bound(t.param_bytes), (
            f"inner {inner}: a full state of {nbytes} bytes, params {t.param_bytes}: over the bound"
        )
        if inner == "adamw":  # the bound is not loose: AdamW's state is over 4x the params
            assert nbytes > 4 * t.param_bytes, f"{nbytes} bytes, params {t.param_bytes}"


def test_a_heals_deadline_covers_its_group_the_state_twice_at_min_gbps_and_grows_with_the_bytes():
    kw = dict(call_timeout_s=60.0, configure_timeout_s=30.0, timeout_s=10.0, min_gbps=1.0)
    fixed = heal_deadline_s(state_bytes=0, **kw)
    assert fixed == 100.0
    state = 4 << 30  # 4 GiB: ~34 s per transfer at 1 Gbit/s
    deadline = heal_deadline_s(state_bytes=state, **kw)
    assert deadline == pytest.approx(fixed + 2 * state * 8 / 1e9)
    assert deadline > fixed + collective_timeout_s(0.0, state, 1.0) * 2 - 1e-6
    assert heal_deadline_s(state_bytes=state, **{**kw, "min_gbps": 0.5}) == pytest.approx(fixed + 4 * state * 8 / 1e9)


def test_a_dead_member_s_heal_groups_are_released_once_and_only_those_it_was_in(fake):
    """A heal group's source or target known dead: the runner aborts that group's rendezvous (the
    others waiting in it are released at once, as for inner and outer groups), once."""
    src, targets, send, meta, state = _group(DONE, {"c0r1": DONE, "c0r2": DONE})
    other_src = Replica("c1r0", send_state=lambda *a: Ref("c1r0.send_state", DONE))
    other_target = Replica("c1r1", receive_state=lambda *a: Ref("c1r1.receive_state", DONE))
    h = _heals({"c0r0": src, **targets, "c1r0": other_src, "c1r1": other_target}, round_index=5)
    calls = {"c0r1": Heal("c0r0", "full"), "c0r2": Heal("c0r0", "full"), "c1r1": Heal("c1r0", "full")}
    for t in calls:
        h.issue(9, 4, calls, t, {}, source_at=(5, 30))
    c0_group = src.calls[0][1][1].prefix
    c1_group = other_src.calls[0][1][1].prefix
    assert h.groups_of("c0r2") == [c0_group], "a target's death releases its source's group"
    assert h.groups_of("c0r0") == [c0_group] and h.groups_of("c1r1") == [c1_group]
    aborted = []
    h.release_groups_of("c0r2", "died", lambda *a: aborted.append(a), cluster=0, epoch=4)
    h.release_groups_of("c0r0", "died", lambda *a: aborted.append(a), cluster=0, epoch=4)
    assert [prefix for prefix, _ in aborted] == [c0_group] and "c0r2 is gone (died)" in aborted[0][1]
    assert h.groups_of("c0r1") == [] and h.groups_of("c0r0") == [], "released once"
    assert h.groups_of("c1r0") == [c1_group], "another cluster's heal group is untouched"
