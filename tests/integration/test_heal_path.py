"""Heal state never passes through the supervisor (issue 21, Build 7 / Acceptance 4), with real
Ray actors: the test process drives actors/heals.py as the supervisor does, with `ray.get` and
`ray.wait` wrapped to record everything it fetched or pulled to its node, and heals real Replicas
whose state is larger than a second's transfer at `comm.min_gbps`. Then one real run: a whole
cluster killed comes back healed through the object store at that link speed. (Starts Ray: run
it under the shared lock.)"""

from __future__ import annotations

import pickle

import pytest
import ray
import torch
from omegaconf import OmegaConf

from actors.heals import Heals
from hsgd.core.deadlines import heal_deadline_s, state_bytes_bound
from hsgd.core.faults import FaultSpec
from hsgd.core.round import GroupJoin, Heal, StateReady
from tests.fakes.event_log import EventLog
from tests.integration.invariants import check_run
from tests.integration.runs import FAST, events, train

MIN_GBPS = 0.0005  # 62.5 kB a second: the states below take several seconds' worth
SPR = 2
OVERRIDES = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=1",
    "model.n_embd=64",
    f"comm.min_gbps={MIN_GBPS}",
    "comm.timeout_s=2",
    "comm.configure_timeout_s=2",
    f"sync.outer_every={SPR}",
]
SECOND_AT_MIN_GBPS = MIN_GBPS * 1e9 / 8  # bytes


class Fetches:
    """Every value `ray.get` returned to this process, and every ref `ray.wait` pulled to its node."""

    def __init__(self, monkeypatch):
        self.values: list = []
        self.refs: list = []
        self.pulled: list = []  # refs waited on with fetch_local=True
        real_get, real_wait = ray.get, ray.wait

        def get(refs, *args, **kwargs):
            value = real_get(refs, *args, **kwargs)
            self.refs += refs if isinstance(refs, list) else [refs]
            self.values.append(value)
            return value

        def wait(refs, *args, **kwargs):
            if kwargs.get("fetch_local", True):
                self.pulled += list(refs)
            return real_wait(refs, *args, **kwargs)

        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(ray, "wait", wait)

    def assert_never_held(self, state_refs, state_bytes: int) -> None:
        for ref in state_refs:
            assert ref not in self.refs, "a state's ref was fetched into the supervisor's process"
            assert ref not in self.pulled, "a state's ref was waited on with fetch_local=True (pulled to its node)"
        for value in self.values:
            assert not _tensors(value), f"the supervisor fetched tensors: {str(value)[:200]}"
            assert len(pickle.dumps(value)) < state_bytes // 10, "the supervisor fetched a state-sized value"


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@ray.remote
class SlowLink:
    """A heal source behind a slow link: its answer (meta and state, from a real replica) comes
    `delay_s` late, as a large state on a slow network would."""

    def __init__(self, replica, delay_s: float):
        self.replica, self.delay_s = replica, delay_s

    def global_state(self):
        import time

        time.sleep(self.delay_s)
        meta, state = self.replica.global_state.remote()
        return ray.get(meta, timeout=60), ray.get(state, timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """c0r0 trained and committed round 0 alone (groups of one) and ran round 1's inner steps;
    c1r0 fresh at round 0. Yields (cfg, handles, run_dir)."""
    from actors.launch import compose_config
    from actors.replica import Replica

    cfg = compose_config(FAST + OVERRIDES)
    run_dir = str(tmp_path_factory.mktemp("heal_path"))
    container = OmegaConf.to_container(cfg, resolve=True)
    handles = {
        rid: Replica.options(max_restarts=0).remote(container, rid, run_dir, {"inner": "gloo", "outer": "gloo"})
        for rid in ("c0r0", "c1r0")
    }
    src = handles["c0r0"]
    alone = lambda level: GroupJoin(0, None, f"solo/{level}", 0, 1)  # noqa: E731 — a group of one needs no store
    assert ray.get(src.run_inner.remote(0, None, alone("inner")), timeout=180).outcome == "done"
    assert ray.get(src.outer_reduce.remote(0, 0, None, alone("outer")), timeout=60).outcome == "done"
    assert ray.get(src.outer_commit.remote(0, (0,), None), timeout=60).outcome == "done"
    assert ray.get(src.run_inner.remote(1, None), timeout=60).outcome == "done"
    yield cfg, handles, run_dir
    for h in handles.values():
        ray.kill(h)


def _digests(h) -> dict:
    return ray.get(h.digests.remote(), timeout=60)


def _deadline_s(cfg, param_bytes: int, call_timeout_s: float | None = None) -> float:
    return heal_deadline_s(
        call_timeout_s=call_timeout_s or cfg.supervisor.call_timeout_s,
        configure_timeout_s=cfg.comm.configure_timeout_s,
        timeout_s=cfg.comm.timeout_s,
        state_bytes=state_bytes_bound(param_bytes),
        min_gbps=cfg.comm.min_gbps,
    )


def test_a_global_heal_larger_than_a_seconds_transfer_never_passes_through_the_supervisor(cluster, monkeypatch):
    cfg, handles, _ = cluster
    source_digests = _digests(handles["c0r0"])
    assert _digests(handles["c1r0"])["global"] != source_digests["global"]
    fetched = Fetches(monkeypatch)
    heals = Heals(handles, EventLog(), store_addr=None, run_id="t", round_index=1)
    target = heals.issue(1, 0, {"c1r0": Heal("c0r0", "global")}, "c1r0", {})
    states = list(heals.states.values())
    (meta,) = heals.watched()
    assert ray.wait([meta], timeout=120, fetch_local=False)[0], "the source never answered"
    assert heals.source_answer(meta) == StateReady(1, "c0r0")
    assert ray.wait([target], timeout=120, fetch_local=False)[0], "the target never answered"
    answer = ray.get(target, timeout=10).wire()
    assert answer["outcome"] == "done", answer
    assert answer["bytes"] > SECOND_AT_MIN_GBPS, f"the state ({answer['bytes']} bytes) must take over a second"
    fetched.assert_never_held(states, answer["bytes"])
    after = _digests(handles["c1r0"])
    assert after["global"] == source_digests["global"] and after["round"] == source_digests["round"] == 1
    assert after["param"] == after["global"] != source_digests["param"], "a global heal starts from the global params"


def test_a_full_heal_whose_group_fails_falls_back_through_the_object_store_and_never_through_the_supervisor(
    cluster, monkeypatch
):
    from hsgd.train.comm import new_run_secret, rendezvous_address, start_store

    cfg, handles, _ = cluster
    store = start_store("127.0.0.1", cfg.comm.configure_timeout_s)
    log = EventLog()
    source_at = (lambda p: (p["round"], p["step"]))(ray.get(handles["c0r0"].progress.remote(), timeout=60))
    param_bytes = ray.get(handles["c0r0"].progress.remote(), timeout=60)["param_bytes"]
    fetched = Fetches(monkeypatch)
    heals = Heals(
        handles,
        log,
        store_addr=rendezvous_address("127.0.0.1", store.port, new_run_secret()),
        run_id="t",
        round_index=1,
    )
    # the target joins the heal's group only after the source gave up waiting for it (configure_timeout_s=2)
    hang = FaultSpec("hang", "c1r0", 1, "heal", seconds=cfg.comm.configure_timeout_s + 1.5)
    target = heals.issue(2, 0, {"c1r0": Heal("c0r0", "full")}, "c1r0", {"c1r0": [hang]}, source_at=source_at)
    final = heals.settle({"c1r0": target}, _deadline_s(cfg, param_bytes))
    answer = ray.get(final["c1r0"], timeout=10).wire()
    assert final["c1r0"] is not target and [f["target"] for f in log.named("heal_fallback")] == ["c1r0"]
    assert answer["outcome"] == "done" and answer.get("transport", "object_store") == "object_store", answer
    assert answer["bytes"] > 4 * param_bytes > SECOND_AT_MIN_GBPS, "the whole state moved, over a second's worth"
    fetched.assert_never_held(list(heals.states.values()), answer["bytes"])
    assert not log.named("heal_source_lost")
    assert _digests(handles["c1r0"]) == _digests(handles["c0r0"]), "the target is not the source after a full heal"


def test_a_source_slower_than_the_call_timeout_is_waited_for_as_its_bytes_allow(cluster, monkeypatch):
    cfg, handles, _ = cluster
    param_bytes = ray.get(handles["c0r0"].progress.remote(), timeout=60)["param_bytes"]
    slow = SlowLink.remote(handles["c0r0"], 4.0)
    call_timeout_s = 1.0  # the old final heal waited this long, fixed, whatever the state's size
    deadline_s = _deadline_s(cfg, param_bytes, call_timeout_s)
    assert deadline_s > 4.0 + 2 * call_timeout_s
    log = EventLog()
    heals = Heals({"slow": slow, "c1r0": handles["c1r0"]}, log, store_addr=None, run_id="t", round_index=1)
    fetched = Fetches(monkeypatch)
    target = heals.issue(3, 0, {"c1r0": Heal("slow", "global")}, "c1r0", {})
    (meta,) = heals.watched()
    assert not ray.wait([meta], timeout=call_timeout_s + 0.5, fetch_local=False)[0]
    assert heals.source_answer(meta) is None and heals.watched() == [meta], "a slow source is not a lost one"
    final = heals.settle({"c1r0": target}, deadline_s)
    answer = ray.get(final["c1r0"], timeout=10).wire()
    assert answer["outcome"] == "done", answer
    assert not log.named("heal_source_lost") and heals.watched() == []
    fetched.assert_never_held(list(heals.states.values()), answer["bytes"])
    ray.kill(slow)


def test_a_whole_cluster_killed_is_healed_through_the_object_store_at_a_slow_link(tmp_path):
    run_dir = tmp_path / "run"
    rounds = 4
    s = train(
        run_dir,
        OVERRIDES
        + [
            f"train.rounds={rounds}",
            "checkpoint.every=0",
            "supervisor.rejoin=boundary",
            "supervisor.rejoin_wait_s=30",
            "supervisor.phase_timeout_s=60",
            "faults.schedule=[{kind:kill,target:c0r0,round:1,phase:inner,step:1}]",
        ],
    )
    assert s["status"] == "completed", s.get("reason")
    check_run(run_dir, rounds=rounds, steps_per_round=SPR)  # digests agree after every commit, nobody else harmed
    ev = events(run_dir)
    heals = [e for e in ev if e["event"] == "heal_end" and e["target"] == "c0r0"]
    assert heals, "c0r0 was never healed"
    h = heals[0]
    assert h["scope"] == "global" and h["source"] == "c1r0" and h["transport"] == "object_store", h
    assert h["bytes"] > SECOND_AT_MIN_GBPS, f"the heal moved {h['bytes']} bytes: under a second at min_gbps"
    assert not [e for e in ev if e["event"] == "heal_source_lost"], "no source died: none may be reported lost"
    assert len(set(s["replica_param_digests"].values())) == 1, s["replica_param_digests"]
