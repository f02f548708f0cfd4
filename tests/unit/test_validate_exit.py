"""Issue 19, acceptance 4: the values that used to pass validation and then break a run are refused
before Ray starts — in-process through `actors.launch.precheck`, and a handful through the real
command line: exit 2, a few lines on stderr, no traceback, no Ray."""

import pytest

from hsgd.config import ConfigError
from hsgd.config.compose import precheck
from tests.fakes.cli import train_isolated as _train


@pytest.fixture
def binary_file(tmp_path):
    path = tmp_path / "corpus.bin.txt"
    path.write_bytes(bytes(range(256)) * 64)
    return path


# Each from issue 19's "Values that pass validation and then break a run".
BAD_VALUES = [
    ("comm.timeout_s=nan", "comm.timeout_s"),
    ("watchdog.ceiling_s=nan", "watchdog.ceiling_s"),
    ("optim.inner.lr=inf", "optim.inner.lr"),
    ("supervisor.max_restarts=-5", "supervisor.max_restarts"),
    ("faults.mtbf_s=1e-7", "faults.mtbf_s"),
    ("seed=1e23", "seed"),
    ("seed=-1", "seed"),
    ("seed=9223372036854775808", "seed"),  # 2^63
    ("run.dir=/", "run.dir"),
    ("logging.wandb.mode=online", "logging.wandb.mode"),
]


@pytest.mark.parametrize("override,field", BAD_VALUES)
def test_a_value_that_used_to_break_a_run_is_refused_before_ray(override, field, no_wandb_credentials):
    with pytest.raises(ConfigError) as info:
        precheck([override])
    text = str(info.value)
    assert info.value.field == field and text.startswith(f"{field}: "), f"{override}: must name {field}: {text!r}"
    assert "\n" not in text and "valid" in text, f"{override}: one line saying what is valid: {text!r}"


def test_a_binary_data_file_is_refused_before_ray(binary_file):
    with pytest.raises(ConfigError) as info:
        precheck([f"data.path={binary_file}"])
    assert info.value.field == "data.path" and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override,field",
    [
        ("comm.timeout_s=nan", "comm.timeout_s"),
        ("seed=1e23", "seed"),
        ("run.dir=/", "run.dir"),
        ("logging.wandb.mode=online", "logging.wandb.mode"),
        ("data.path=<binary>", "data.path"),
    ],
)
def test_the_command_line_exits_2_with_one_line_and_never_starts_ray(tmp_path, binary_file, override, field):
    result = _train(tmp_path, override.replace("<binary>", str(binary_file)))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"{override}: exit {result.returncode}, stderr:\n{result.stderr[-2000:]}"
    assert 1 <= len(lines) <= 3, f"{override}: at most a few lines on stderr, got:\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0].startswith(f"hsgd: config error: {field}: "), f"{override}: {lines[0]!r}"
    assert not (tmp_path / "ray").exists(), f"{override}: Ray started (its session folder exists)"
    assert "Ray" not in result.stdout + result.stderr, f"{override}: Ray said something:\n{result.stdout[-2000:]}"
    assert not (tmp_path / "out").exists(), f"{override}: a run folder was created"
