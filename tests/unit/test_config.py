"""hsgd.config: every rule across fields names its field in a one-line error (each field's own range
or choices: tests/unit/test_validate_schema.py)."""

import pytest

from hsgd.config import ConfigError, HsgdConfig, validate
from hsgd.core.faults import FAULT_KINDS
from tests.fakes.configs import default_cfg as _cfg


def _rejects(cfg, field, *, choices=()):
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    err = info.value
    text = str(err)
    assert err.field == field, f"rule broke: error should name field {field!r}, named {err.field!r} ({text})"
    assert "\n" not in text, f"rule broke: ConfigError text must be ONE line, got {text!r}"
    assert text.startswith(f"{field}:"), f"rule broke: error text must start with the field name: {text!r}"
    for choice in choices:
        assert choice in text, f"rule broke: error for {field} must list valid choice {choice!r}: {text!r}"
    return err


def test_default_config_is_valid():
    validate(HsgdConfig())


def test_unknown_fault_kind_in_random_mode_kinds_is_rejected():
    _rejects(_cfg(**{"faults.kinds": ["kill", "explode"]}), "faults.kinds", choices=FAULT_KINDS)


def test_localsgd_outer_every_must_be_a_multiple_of_inner_every():
    err = _rejects(
        _cfg(**{"sync.inner": "localsgd", "sync.inner_every": 3, "sync.outer_every": 20}), "sync.outer_every"
    )
    assert "sync.inner_every" in str(err), f"error should name the other field involved: {err}"
    validate(_cfg(**{"sync.inner": "localsgd", "sync.inner_every": 4, "sync.outer_every": 20}))


@pytest.mark.parametrize("inner", ["ddp", "none"])
def test_outer_every_need_not_be_a_multiple_of_inner_every_without_localsgd(inner):
    validate(_cfg(**{"sync.inner": inner, "sync.inner_every": 3, "sync.outer_every": 20}))


def test_zero_inner_every_fails_as_a_period_not_a_division_by_zero():
    # localsgd is the one mode whose relation checks divide by inner_every
    _rejects(_cfg(**{"sync.inner": "localsgd", "sync.inner_every": 0}), "sync.inner_every")


def test_missing_data_path_is_rejected(tmp_path):
    err = _rejects(_cfg(**{"data.path": str(tmp_path / "nope.txt")}), "data.path")
    assert "does not exist" in str(err), f"error should say what is wrong with the path: {err}"
    existing = tmp_path / "a.txt"
    existing.write_text("hello, world. " * 400)
    validate(_cfg(**{"data.path": str(existing)}))


def test_n_embd_must_be_divisible_by_n_head():
    err = _rejects(_cfg(**{"model.n_embd": 130, "model.n_head": 4}), "model.n_embd")
    assert "model.n_head" in str(err)


def test_min_clusters_must_be_within_topology():  # below 1: the field's own range (test_validate_schema.py)
    err = _rejects(_cfg(**{"topology.clusters": 2, "supervisor.min_clusters": 3}), "supervisor.min_clusters")
    assert "topology.clusters=2" in str(err), f"error should show the valid range: {err}"


def test_min_replicas_per_cluster_must_be_within_topology():
    _rejects(
        _cfg(**{"topology.replicas_per_cluster": 2, "supervisor.min_replicas_per_cluster": 3}),
        "supervisor.min_replicas_per_cluster",
    )


def test_cluster_labels_need_one_per_cluster():
    _rejects(_cfg(**{"topology.cluster_labels": ["rack-a"]}), "topology.cluster_labels")
    validate(_cfg(**{"topology.cluster_labels": ["rack-a", "rack-b"]}))


def test_empty_run_dir_is_rejected():
    _rejects(_cfg(**{"run.dir": "  "}), "run.dir")


# FaultSpecError is a ConfigError: the field and one-line text are the contract.
@pytest.mark.parametrize(
    "entry,field",
    [
        ({"kind": "explode", "target": "c0r0", "round": 1}, "faults.schedule[0].kind"),
        ({"kind": "kill", "target": "c9r0", "round": 1}, "faults.schedule[0].target"),
        ({"kind": "kill", "target": "c0r0", "round": -1}, "faults.schedule[0].round"),
        ({"kind": "kill", "target": "c0r0", "round": 1, "when": 3}, "faults.schedule[0].when"),
    ],
)
def test_bad_fault_schedule_entry_fails_validation_naming_the_entry(entry, field):
    _rejects(_cfg(**{"faults.schedule": [entry]}), field)


def test_good_fault_schedule_passes_validation():
    validate(_cfg(**{"faults.schedule": [{"kind": "kill", "target": "c0r1", "round": 2, "phase": "inner", "step": 3}]}))


@pytest.mark.parametrize(
    "changes,field,words",
    [
        (
            {
                "checkpoint.every": 5,
                "train.rounds": 15,
                "faults.schedule": [{"kind": "kill", "target": "c0r1", "round": 1, "phase": "checkpoint"}],
            },
            "faults.schedule[0].phase",
            ("never happens in round 1", "4, 9, 14"),
        ),
        (
            {
                "checkpoint.every": 0,
                "faults.schedule": [{"kind": "crash", "target": "supervisor", "round": 2, "phase": "checkpoint"}],
            },
            "faults.schedule[0].phase",
            ("never happens", "none"),
        ),
        (
            {
                "sync.inner": "none",
                "topology.replicas_per_cluster": 1,
                "faults.schedule": [{"kind": "crash", "target": "c0r0", "round": 0, "phase": "inner_sync"}],
            },
            "faults.schedule[0].phase",
            ("inner_sync never happens",),
        ),
        (
            {
                "sync.inner": "localsgd",
                "sync.inner_every": 4,
                "sync.outer_every": 20,
                "faults.schedule": [{"kind": "comm", "target": "c0r0", "round": 0, "phase": "inner_sync", "step": 2}],
            },
            "faults.schedule[0].step",
            ("3, 7, 11", "never happens"),
        ),
        (
            {"faults.schedule": [{"kind": "kill", "target": "supervisor", "round": 0, "phase": "heal"}]},
            "faults.schedule[0].phase",
            ("no 'heal' phase",),
        ),
    ],
)
def test_a_fault_whose_moment_never_comes_is_a_config_error(changes, field, words):
    err = _rejects(_cfg(**changes), field)
    for word in words:
        assert word in str(err), f"{word!r} missing from {err}"


@pytest.mark.parametrize(
    "changes",
    [
        {
            "checkpoint.every": 5,
            "train.rounds": 15,
            "faults.schedule": [{"kind": "kill", "target": "c0r1", "round": 4, "phase": "checkpoint"}],
        },
        {
            "checkpoint.every": 5,
            "train.rounds": 12,
            "faults.schedule": [{"kind": "kill", "target": "c0r1", "round": 11, "phase": "checkpoint"}],
        },  # the last round
        {
            "sync.inner": "localsgd",
            "sync.inner_every": 4,
            "sync.outer_every": 20,
            "faults.schedule": [{"kind": "comm", "target": "c0r0", "round": 0, "phase": "inner_sync", "step": 7}],
        },
    ],
)
def test_faults_whose_moment_comes_pass(changes):
    validate(_cfg(**changes))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"sync.fragment_delay": 20}, "below a round's 20 steps"),  # outer_every 20: a delay of a whole round
        ({"sync.fragment_delay": 10, "sync.outer_every": 40, "sync.fragments": 4}, "below a round's 10 steps"),
        ({"sync.fragment_delay": 2, "sync.outer": "none"}, "sync.outer is none"),
        ({"sync.fragment_delay": 2, "sync.inner": "none"}, "sync.inner=none"),
        ({"sync.fragment_delay": 3, "sync.inner": "localsgd", "sync.inner_every": 2}, "inner_every=2"),
    ],
)
def test_a_fragment_delay_that_cannot_overlap_is_refused_naming_the_field(overrides, needle):
    err = _rejects(_cfg(**overrides), "sync.fragment_delay")
    assert needle in str(err), str(err)


def test_a_fragment_delay_below_the_round_and_on_a_localsgd_boundary_is_valid():
    validate(_cfg(**{"sync.fragment_delay": 5}))
    validate(_cfg(**{"sync.fragment_delay": 4, "sync.inner": "localsgd", "sync.inner_every": 2}))
    validate(_cfg(**{"sync.fragment_delay": 4, "sync.outer_every": 20, "sync.fragments": 2}))


@pytest.mark.parametrize(
    "overrides,field,needle",
    [
        ({"sync.fragment_delay": 2}, "sync.fragment_delay", "known only at its close"),
        ({"sync.min_round_steps": 21}, "sync.min_round_steps", "above a round's 20 steps"),
        ({"sync.round_s": 0.0}, "sync.round_s", ""),
        ({"sync.grace_s": -1.0}, "sync.grace_s", ""),
    ],
)
def test_balance_time_refuses_what_its_close_cannot_honour_naming_the_field(overrides, field, needle):
    err = _rejects(_cfg(**{"sync.balance": "time", **overrides}), field)
    assert needle in str(err), str(err)


def test_balance_time_with_its_defaults_or_a_round_s_is_valid():
    validate(_cfg(**{"sync.balance": "time"}))
    validate(_cfg(**{"sync.balance": "time", "sync.round_s": 30.0, "sync.grace_s": 0.0, "sync.min_round_steps": 20}))


def test_outer_every_must_split_into_whole_fragments():
    err = _rejects(_cfg(**{"sync.outer_every": 10, "sync.fragments": 3}), "sync.outer_every")
    assert "fragments=3" in str(err)
    validate(_cfg(**{"sync.outer_every": 12, "sync.fragments": 3}))


def test_nothing_to_compress_or_fragment_without_an_outer_sync():
    _rejects(_cfg(**{"sync.outer": "none", "sync.outer_compress": "int4"}), "sync.outer")


def test_a_fault_step_past_a_fragment_round_is_refused_with_the_round_length():
    err = _rejects(
        _cfg(
            **{
                "sync.outer_every": 20,
                "sync.fragments": 4,
                "faults.schedule": [{"kind": "kill", "target": "c0r1", "round": 0, "phase": "inner", "step": 7}],
            }
        ),
        "faults.schedule[0].step",
    )
    assert "0..4" in str(err)
