"""The run's durable state (hsgd.record.run_state.RunState): typed, defaults in one place, the same
file name and JSON keys as before, so an older run folder still resumes."""

from __future__ import annotations

import json

from hsgd.record.run_state import STATE_FILE, RunState

OLDER = {
    "run_id": "hsgd-abc123",
    "fingerprint": {"model.n_embd": 32},
    "started_at": 5.0,
    "epoch": 4,
    "fired": [0, 2],
    "committed_round": 3,
    "supervisor_starts": 2,
    "initial_eval_loss": None,
    "identity": {"c0r0": "hsgd:x:c0r0"},
    "spares": {"0": []},
    "deaths_seen": {"hsgd:x:c0r0": [1]},
    "benched": [1],
    "non_finite_rounds": {"1": 2},
    "checkpoints_failed": 1,
    "last_restore": {"round": 2, "count": 1},
    "added_faults": [{"kind": "kill"}],
}


def test_an_older_state_file_loads_and_saves_with_the_same_keys(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({**OLDER, "a_key_from_elsewhere": 1}))
    state = RunState.load(tmp_path, "hsgd-abc123")
    assert (state.epoch, state.fired, state.committed_round, state.supervisor_starts) == (4, [0, 2], 3, 2)
    assert state.evaluated and state.initial_eval_loss is None, "a null initial eval loss is still 'evaluated'"
    # the keys it had, plus issue 32's (the index table, quarantine counts) at their defaults
    assert json.loads(state.to_json()) == {**OLDER, "replica_indices": {}, "death_times": {}, "quarantined": {}}


def test_defaults_live_in_one_place_and_another_runs_state_is_never_loaded(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps(OLDER))
    fresh = RunState.load(tmp_path, "hsgd-other")
    assert fresh.run_id == "hsgd-other" and (fresh.epoch, fresh.fired, fresh.committed_round) == (0, [], 0)
    assert "initial_eval_loss" not in fresh.to_dict(), "not evaluated yet: the key is absent, as before"
    (tmp_path / STATE_FILE).write_text("{half-writ")
    assert RunState.read(tmp_path).supervisor_starts == 0


def test_a_resumed_run_keeps_the_epoch_fired_faults_and_initial_eval_loss_only(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({**OLDER, "initial_eval_loss": 4.5}))
    state = RunState.begin(tmp_path, "hsgd-new", {"model.n_embd": 32}, resumed=True)
    state.write(tmp_path)
    on_disk = json.loads((tmp_path / STATE_FILE).read_text())
    assert (on_disk["run_id"], on_disk["epoch"], on_disk["fired"], on_disk["initial_eval_loss"]) == (
        "hsgd-new",
        4,
        [0, 2],
        4.5,
    )
    assert (on_disk["committed_round"], on_disk["identity"], on_disk["supervisor_starts"]) == (0, {}, 0)
    assert "initial_eval_loss" not in RunState.begin(tmp_path, "hsgd-x", {}, resumed=False).to_dict()
