"""Issue 45, finding 2: every pacing key (a site's and the run-wide `train.*`) refuses inf, nan, a
negative and a value whose sleep would overflow, before Ray starts: one line naming the key and what is
valid, its upper bound included. A simulated step is never padded past one day (86400 s), however it
straggles; a straggler is at most 1000 times a step."""

from __future__ import annotations

import pytest

from hsgd.config import ConfigError
from hsgd.config.compose import precheck
from tests.fakes.cli import train_isolated as _train

DAY_S = 86400
# key -> the upper bound its error must state
SITE_KEYS = {"min_step_s": "86400", "straggle_p": "1", "straggle_factor": "1000"}
RUN_KEYS = {"train.min_step_s": "86400", "train.straggle_p": "1", "train.straggle_factor": "1000"}
BAD = ("inf", "nan", "-1", "1e300")  # as typed on the command line


def _params(keys):
    return [pytest.param(key, text, id=f"{key}={text}") for key in keys for text in BAD]


def _refused(overrides, field, bound):
    with pytest.raises(ConfigError) as info:
        precheck(overrides)
    text = str(info.value)
    assert info.value.field == field and text.startswith(f"{field}: "), f"must name {field}: {text!r}"
    assert "\n" not in text and "valid:" in text, f"one line saying what is valid: {text!r}"
    assert bound in text.split("valid:", 1)[1], f"the valid values must state the upper bound {bound}: {text!r}"


@pytest.mark.parametrize("key,text", _params(SITE_KEYS))
def test_a_sites_pacing_key_refuses_a_value_no_sleep_takes(key, text):
    site = f"{{replicas:2,{key}:{text}}}"
    _refused([f"topology.sites=[{{replicas:2}},{site}]"], f"topology.sites[1].{key}", SITE_KEYS[key])


@pytest.mark.parametrize("key,text", _params(RUN_KEYS))
def test_a_run_wide_pacing_key_refuses_a_value_no_sleep_takes(key, text):
    _refused([f"{key}={text}"], key, RUN_KEYS[key])


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["topology.sites=[{replicas:2,min_step_s:100,straggle_p:0.5,straggle_factor:1000}]"], "topology.sites[0]"),
        (["train.min_step_s=100", "train.straggle_p=0.5", "train.straggle_factor=1000"], "train"),
        (
            ["topology.sites=[{replicas:2,min_step_s:100}]", "train.straggle_p=0.5", "train.straggle_factor=1000"],
            "train",
        ),
    ],
    ids=["site", "run-wide", "site-step-run-wide-factor"],
)
def test_a_straggling_step_is_never_padded_past_a_day(overrides, field):
    _refused(overrides, f"{field}.straggle_factor", str(DAY_S))


@pytest.mark.parametrize(
    "overrides",
    [
        ["topology.sites=[{replicas:2,min_step_s:86400},{replicas:2,straggle_p:1,straggle_factor:1000}]"],
        ["topology.sites=[{replicas:2,min_step_s:86.4,straggle_p:0.5,straggle_factor:999}]"],
        ["topology.sites=[{replicas:2,min_step_s:10000}]", "train.straggle_factor=1000"],  # never straggles
        ["train.min_step_s=86400", "train.straggle_factor=1000"],
    ],
)
def test_the_bounds_themselves_are_taken(overrides):
    precheck(overrides)


def test_the_command_line_refuses_an_infinite_site_step_with_exit_2_and_one_line_before_ray(tmp_path):
    result = _train(tmp_path, "topology.sites=[{replicas:2,min_step_s:inf},{replicas:2}]")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"exit {result.returncode}, stderr:\n{result.stderr[-2000:]}"
    assert len(lines) == 1, f"one line on stderr, got:\n{result.stderr[-2000:]}"
    assert lines[0].startswith("hsgd: config error: topology.sites[0].min_step_s: "), lines[0]
    assert "valid:" in lines[0] and "86400" in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "ray").exists(), "Ray started (its session folder exists)"
    assert not (tmp_path / "out").exists(), "a run folder was created"
