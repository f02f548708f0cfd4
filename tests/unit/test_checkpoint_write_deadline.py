"""Issue 45 finding 6: a checkpoint write past `supervisor.phase_timeout_s` is a storage fault (a
stalled mount), never the replica's: the checkpoint is skipped (`checkpoint_failed`), nobody is
killed, the previous checkpoint stays, and the supervisor calls the replica again only once its
write has ended (a replica takes one phase call at a time: the next would queue behind the write)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors import checkpointing
from hsgd.config.layout import layout_of
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from hsgd.train import checkpoint as ckpt
from tests.fakes.configs import tiny_cfg
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster

RIDS = ("c0r0", "c1r0")  # Topology(2, 1)'s


class _Ref:
    def __init__(self, value=None, hung=False):
        self.value, self.hung = value, hung


class _Handle:
    """A replica: writes its part of the checkpoint, or (hung) never answers; `busy` progress answers
    in the checkpoint phase before it answers idle (its write ended)."""

    def __init__(self, rid: str, hung: bool, busy: int):
        self.rid, self.hung, self.busy, self.asked = rid, hung, busy, 0
        self.save_checkpoint = SimpleNamespace(remote=self._save)

    def _save(self, directory, round_index, faults):
        if self.hung:
            return _Ref(hung=True)
        sha = ckpt.save_replica_state(directory, self.rid, {"rid": self.rid, "round": round_index})
        return _Ref({"outcome": "done", "round": round_index, "step": 0, "sha256": sha})

    def progress(self) -> dict:
        self.asked += 1
        return {"phase": "checkpoint" if self.asked <= self.busy else "idle"}


def _roster(at_round=1, hung=(), busy=0) -> FakeRoster:
    """Every replica live at `at_round`; `hung` never answer their write; `busy`: as _Handle's."""
    handles = {rid: _Handle(rid, rid in hung, busy) for rid in RIDS}
    return FakeRoster(
        Topology(2, 1), handles=handles, at=(at_round, 4 * at_round), answers=lambda rid: handles[rid].progress()
    )


def _fake_ray():
    def get(ref, timeout=None):
        if ref.hung:
            import ray

            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout} s")
        return ref.value

    def wait(refs, num_returns=1, timeout=None, **_):
        ready = [r for r in refs if not r.hung][:num_returns]
        return ready, [r for r in refs if r not in ready]

    return SimpleNamespace(get=get, wait=wait)


@pytest.fixture
def sup(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "ray", _fake_ray())
    cfg = tiny_cfg([f"checkpoint.dir={tmp_path / 'ckpts'}", "supervisor.phase_timeout_s=30", "checkpoint.keep=3"])
    statuses: list[dict] = []
    return SimpleNamespace(
        cfg=cfg,
        run_dir=str(tmp_path),
        run_id="run-1",
        state=RunState(run_id="run-1", fingerprint={"model.n_embd": 32}),
        roster=_roster(),
        log=EventLog(),
        injector=SimpleNamespace(supervisor_faults=lambda *a: None, arm=lambda *a, **k: {}),
        topology=Topology(2, 1),
        steps_per_round=4,
        layout=layout_of(cfg),
        save_state=lambda: None,
        warn=lambda m: None,
        set_status=lambda **kw: statuses.append(kw),
        statuses=statuses,
    )


def test_a_healthy_checkpoint_is_written_as_ever(sup):
    path = checkpointing.save(sup, 1)
    assert path is not None and ckpt.exists(sup.cfg.checkpoint.dir, 1)
    assert [e["round"] for e in sup.log.named("checkpoint")] == [1] and not sup.roster.downed


def test_a_write_past_its_deadline_skips_the_checkpoint_and_kills_nobody(sup):
    assert checkpointing.save(sup, 1) is not None  # the last good checkpoint
    sup.roster = _roster(2, hung={"c1r0"}, busy=2)
    assert checkpointing.save(sup, 2) is None
    assert sup.roster.downed == [] and set(sup.roster.live) == set(RIDS), "a stalled write cost a replica"
    (failed,) = sup.log.named("checkpoint_failed")
    assert failed["round"] == 2 and failed["replicas"] == ["c1r0"], failed
    assert "supervisor.phase_timeout_s" in failed["error"], failed
    assert sup.state.checkpoints_failed == 1
    assert not ckpt.exists(sup.cfg.checkpoint.dir, 2) and ckpt.exists(sup.cfg.checkpoint.dir, 1)
    assert ckpt.choose(sup.cfg.checkpoint.dir, sup.state.fingerprint).manifest["round"] == 1
    # its write still runs: asked until it answers idle (never called for a phase meanwhile)
    assert sup.roster.handles["c1r0"].asked == 3 and sup.roster.handles["c0r0"].asked == 0
    assert {"phase": "waiting_for_replicas", "busy": ["c1r0"]} in sup.statuses
