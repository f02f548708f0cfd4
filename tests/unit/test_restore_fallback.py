"""Issue 45 finding 1, its restore/resume half: a restore after a total loss, or a resume, lands on
the newest checkpoint the replicas that take part can load — never only the newest on disk (one
written while a replica was down holds no file of it) — and fails in one line naming the rounds
tried when none can; a resume says "resumed" only once a replica loaded it, its params digest equal
to the one the manifest records, and never goes on from a fresh model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from actors import checkpointing, startup
from actors.checkpointing import RestoreFailed
from hsgd.config import ConfigError
from hsgd.core.topology import Topology
from hsgd.record.run_state import RunState
from hsgd.train import checkpoint as ckpt
from tests.fakes.checkpoints import LoadingReplica, write_checkpoint
from tests.fakes.event_log import EventLog
from tests.fakes.roster import FakeRoster


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    for module in (checkpointing, startup):
        monkeypatch.setattr(module.ray, "get", lambda value, timeout=None: value)


def _sup(tmp_path, calls, live, *, fails=(), ignores=()):
    cfg = OmegaConf.create(
        {
            "checkpoint": {"dir": str(tmp_path / "ckpts"), "every": 1},
            "supervisor": {"rejoin_wait_s": 0.0, "phase_timeout_s": 30.0},
            "topology": {"clusters": 2, "replicas_per_cluster": 1, "gpus_per_replica": 1, "sites": None},
        }
    )
    handles = {rid: LoadingReplica(rid, calls, fails=fails, ignores=ignores) for rid in ("c0r0", "c1r0")}
    return SimpleNamespace(
        cfg=cfg,
        run_dir=str(tmp_path),
        state=RunState(committed_round=5),
        roster=FakeRoster(Topology(2, 1), handles=handles, live=live, calls=calls),
        log=EventLog(calls=calls),
        warn=lambda m: None,
        save_state=lambda: None,
        layout=SimpleNamespace(ranks_per_replica=1),  # the run's (hsgd.config.layout.RunLayout): what these read
    )


def _events(calls, name):
    return [c[2] for c in calls if c[0] == "event" and c[1] == name]


# -- a restore after a total loss ------------------------------------------------------------------
def test_a_restore_passes_over_the_newest_checkpoint_no_live_replica_holds(tmp_path):
    """The reported run: round 5 was saved by c1r0 alone (c0r0 was down), then c1 was drained."""
    calls = []
    older = write_checkpoint(tmp_path / "ckpts", 4, ("c0r0", "c1r0"))
    newest = write_checkpoint(tmp_path / "ckpts", 5, ("c1r0",))
    sup = _sup(tmp_path, calls, live=("c0r0",))
    assert checkpointing.restore(sup, "total loss") == 4
    assert sup.roster.live == {"c0r0": (4, 12)}
    assert [c[2] for c in calls if c[0] == "load"] == [older], "c0r0 loads its own file of round 4"
    fallback = _events(calls, "checkpoint_fallback")
    assert [f["path"] for f in fallback] == [newest] and "c0r0" in fallback[0]["reason"], fallback
    assert not [c for c in calls if c[0] == "down"], calls
    assert _events(calls, "restore")[0]["round"] == 4


def test_a_checkpoint_no_live_replica_can_read_falls_back_to_the_one_before(tmp_path):
    calls = []
    older = write_checkpoint(tmp_path / "ckpts", 4, ("c0r0", "c1r0"))
    newest = write_checkpoint(tmp_path / "ckpts", 5, ("c0r0", "c1r0"))
    sup = _sup(tmp_path, calls, live=("c0r0", "c1r0"), fails={newest})
    assert checkpointing.restore(sup, "total loss") == 4
    assert sup.roster.live == {"c0r0": (4, 12), "c1r0": (4, 12)}, "a load that raised left them live to try again"
    assert [c[2] for c in calls if c[0] == "load"] == [newest, newest, older, older]
    assert [f["path"] for f in _events(calls, "checkpoint_fallback")] == [newest]


def test_a_load_that_left_other_params_than_the_manifests_is_passed_over(tmp_path):
    calls = []
    write_checkpoint(tmp_path / "ckpts", 4, ("c0r0",))
    newest = write_checkpoint(tmp_path / "ckpts", 5, ("c0r0",))
    sup = _sup(tmp_path, calls, live=("c0r0",), ignores={newest})
    assert checkpointing.restore(sup, "total loss") == 4
    reasons = [f["reason"] for f in _events(calls, "checkpoint_fallback")]
    assert len(reasons) == 1 and "digest" in reasons[0], reasons


def test_a_live_replica_the_checkpoint_holds_no_file_of_is_left_to_heal_not_taken_down(tmp_path):
    calls = []
    newest = write_checkpoint(tmp_path / "ckpts", 5, ("c1r0",))
    sup = _sup(tmp_path, calls, live=("c0r0", "c1r0"))
    assert checkpointing.restore(sup, "total loss") == 5
    assert [c[1:] for c in calls if c[0] == "load"] == [("c1r0", newest)]
    assert sup.roster.live == {"c0r0": (0, 0), "c1r0": (5, 15)}, "c0r0 heals from c1r0 in the next round"
    assert not [c for c in calls if c[0] == "down"], calls


def test_when_no_checkpoint_is_loadable_the_restore_fails_in_one_line_naming_the_rounds_tried(tmp_path):
    calls = []
    write_checkpoint(tmp_path / "ckpts", 4, ("c1r0",))
    write_checkpoint(tmp_path / "ckpts", 5, ("c1r0",))
    with pytest.raises(RestoreFailed) as err:
        checkpointing.restore(_sup(tmp_path, calls, live=("c0r0",)), "total loss")
    message = str(err.value)
    assert "\n" not in message and "round 5" in message and "round 4" in message, message
    assert "c0r0" in message, message
    assert not [c for c in calls if c[0] == "load"], "no replica holds a file of either"


def test_a_restore_that_always_falls_back_still_gives_up_after_the_restores_without_progress(tmp_path):
    """Trying round 5 first must not reset round 4's count: a run lost after every restore ends."""
    write_checkpoint(tmp_path / "ckpts", 4, ("c0r0",))
    newest = write_checkpoint(tmp_path / "ckpts", 5, ("c0r0",))
    sup = _sup(tmp_path, [], live=("c0r0",), fails={newest})
    for _ in range(checkpointing.RESTORES_WITHOUT_PROGRESS):
        assert checkpointing.restore(sup, "total loss") == 4
        sup.state.committed_round = 4  # what the supervisor records after a restore
    with pytest.raises(RestoreFailed, match="round 4.* without committing a round since"):
        checkpointing.restore(sup, "total loss")


def test_a_live_replica_past_the_restored_round_is_taken_down_so_it_cannot_lead_the_next_round(tmp_path):
    calls = []
    write_checkpoint(tmp_path / "ckpts", 3, ("c0r0",))
    sup = _sup(tmp_path, calls, live=("c0r0", "c1r0"))
    sup.roster.live["c1r0"] = (4, 12)  # behind the committed round 5, past the checkpoint's 3
    assert checkpointing.restore(sup, "total loss") == 3
    assert sup.roster.live == {"c0r0": (3, 9)} and ("down", "c1r0") in calls


# -- a resume --------------------------------------------------------------------------------------
def _cfg(run_dir, *overrides):
    from hsgd.config.schema import HsgdConfig

    return OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist([f"run.dir={run_dir}", *overrides]))


def _drained(run_dir, cluster: str, round_index: int) -> None:
    """The outcome file a drain applied at `round_index` leaves in the run folder (requests/<id>.done)."""
    folder = Path(run_dir) / "requests"
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "id": "1-drain",
        "kind": "drain",
        "cluster": cluster,
        "outcome": "applied",
        "reason": "",
        "round": round_index,
    }
    (folder / "1-drain.done").write_text(json.dumps(record))


def test_a_resume_passes_over_a_checkpoint_no_replica_of_the_run_holds(tmp_path):
    root = tmp_path / "ckpts"
    older = write_checkpoint(root, 4, ("c0r0", "c1r0"))
    newest = write_checkpoint(root, 5, ("c1r0",))
    # a resume on one site: c1 is gone
    point = startup.find_resume_point(
        str(root), _cfg(tmp_path, "topology.clusters=1", "topology.replicas_per_cluster=1")
    )
    assert point.path == older and [p for p, _ in point.skipped] == [newest], point


def test_a_drained_sites_replicas_are_no_replicas_a_resume_can_load_into(tmp_path):
    """The reported resume: c1 stays drained, so round 5 (c1r0's only) cannot start the run."""
    root = tmp_path / "ckpts"
    older = write_checkpoint(root, 4, ("c0r0", "c1r0"))
    write_checkpoint(root, 5, ("c1r0",))
    _drained(tmp_path, "c1", 5)
    cfg = _cfg(tmp_path, "topology.clusters=2", "topology.replicas_per_cluster=1")
    assert startup.resume_takers(cfg, str(tmp_path)) == ["c0r0"]
    assert startup.find_resume_point(str(root), cfg).path == older


def test_a_resume_no_replica_can_load_is_refused_in_one_line_naming_the_rounds_tried(tmp_path):
    root = tmp_path / "ckpts"
    write_checkpoint(root, 4, ("c1r0",))
    write_checkpoint(root, 5, ("c1r0",))
    cfg = _cfg(tmp_path, "topology.clusters=1", "topology.replicas_per_cluster=1")
    with pytest.raises(ConfigError, match="train.resume") as err:
        startup.find_resume_point(str(root), cfg)
    message = str(err.value)
    assert "\n" not in message and "round_000005" in message and "round_000004" in message, message


def _calls():
    return startup.StartupCalls(
        startup.Topology(2, 1), SimpleNamespace(call_timeout_s=0.5, phase_timeout_s=1.0, min_replicas_per_cluster=0)
    )


def test_resumed_is_said_once_a_replica_loaded_with_the_manifests_params_digest(tmp_path, capsys):
    write_checkpoint(tmp_path, 4, ("c0r0",))
    point = ckpt.choose(tmp_path)
    replicas = {rid: LoadingReplica(rid, []) for rid in ("c0r0", "c1r0")}
    _calls().load_resume_point(point, replicas, {})
    out = capsys.readouterr().out
    assert f"resumed from {point.path} (round 4)" in out and "c1r0 heal from peers" in out, out
    assert ckpt.expected_param_digest(point.manifest, "c0r0", 1)[:12] in out, "the line shows the digest checked"


def test_a_resume_whose_load_left_other_params_fails_at_start_and_never_says_resumed(tmp_path, capsys):
    path = write_checkpoint(tmp_path, 4, ("c0r0",))
    replicas = {"c0r0": LoadingReplica("c0r0", [], ignores={path})}  # a load that silently did nothing
    with pytest.raises(ConfigError, match="train.resume: .*digest") as err:
        _calls().load_resume_point(ckpt.choose(tmp_path), replicas, {})
    assert "\n" not in str(err.value)
    assert "resumed" not in capsys.readouterr().out


def test_a_resume_where_no_replica_loaded_never_goes_on_from_a_fresh_model(tmp_path, capsys):
    write_checkpoint(tmp_path, 5, ("c1r0",))
    replicas = {"c0r0": LoadingReplica("c0r0", [])}  # c1r0 not among the run's replicas
    with pytest.raises(ConfigError, match="train.resume: .*round_000005.*c0r0"):
        _calls().load_resume_point(ckpt.choose(tmp_path), replicas, {})
    assert "resumed" not in capsys.readouterr().out
