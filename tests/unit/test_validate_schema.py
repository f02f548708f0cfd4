"""hsgd.config.validate derives its checks from the schema (hsgd/config/schema.py): every numeric
field has a range and every choice field its choices on the field itself. One generic test over the
schema: each bounded or choice field refuses nan, inf, its nearest out-of-range values (or an unknown
name) with a one-line error that starts with the field and says what is valid, and takes the values
at the edges of what is valid."""

import math
import sys
import typing

import pytest

from actors.launch import SupervisorLosses, precheck
from hsgd.config import CHOICE_FIELDS, NUMERIC_FIELDS, ConfigError, HsgdConfig, field_value, validate
from hsgd.config.validate import MAX_RANDOM_FAULTS, schema_fields
from tests.fakes.configs import default_cfg as _cfg


def _assert_one_line_naming(err: ConfigError, path: str):
    text = str(err)
    assert "\n" not in text, f"error for {path} must be one line: {text!r}"
    assert err.field == path and text.startswith(f"{path}:"), f"error must start with {path!r}: {text!r}"


def _nearest_invalid(bound):
    """The out-of-range values closest to each end of the field's range."""
    step = (lambda x, direction: x + direction) if bound.kind is int else math.nextafter
    values = []
    if bound.low is not None:
        below = bound.low if bound.low_open else step(bound.low, -math.inf if bound.kind is float else -1)
        values.append(-2 if bound.forever and below == -1 else below)  # -1 means "forever" there
    if bound.high is not None:
        values.append(bound.high if bound.high_open else step(bound.high, math.inf if bound.kind is float else 1))
    if bound.kind is int:
        values.append(1.5)  # not an int
    return values


def _edges(bound):
    """The valid values at the edges: the closed ends (else just inside an open one), -1 and null where allowed."""
    inside = (lambda x, d: x + d) if bound.kind is int else (lambda x, d: math.nextafter(x, d * math.inf))
    values = [
        bound.kind(end if not is_open else inside(end, d))
        for end, is_open, d in ((bound.low, bound.low_open, 1), (bound.high, bound.high_open, -1))
        if end is not None
    ]
    return values + ([-1] if bound.forever else []) + ([None] if bound.optional else [])


def _refused(path, value, *words):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{path: value}))
    _assert_one_line_naming(info.value, path)
    assert "valid:" in str(info.value), f"error for {path}={value!r} must say what is valid: {info.value}"
    for word in words:
        assert word in str(info.value), f"error for {path}={value!r} must say {word!r}: {info.value}"


def _accepted(path, value, valid):
    try:
        validate(_cfg(**{path: value}))
    except ConfigError as err:  # a rule across fields may object to the combination, never the field's own range
        own = f"{path}: got {value!r}; valid: {valid}", f"{path}: unknown value {value!r}; valid: {valid}"
        assert str(err) not in own, f"{path}={value!r} is valid but was refused: {err}"


@pytest.fixture
def valid_elsewhere(monkeypatch):
    """Credentials present, the corpus not test-loaded: a good value must pass on its own merits."""
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(sys.modules["hsgd.config.validate"], "_check_data", lambda cfg: None)


def test_every_numeric_schema_field_has_a_range_and_every_choice_field_is_in_the_schema():
    numeric = {path for path, hint, _ in schema_fields() if {int, float} & (set(typing.get_args(hint)) or {hint})}
    assert {"seed", "topology.clusters", "optim.inner.lr", "data.vocab_size", "ray.num_cpus"} <= numeric
    assert "train.resume" not in numeric, "bool is not a numeric field"
    assert set(NUMERIC_FIELDS) == numeric
    assert set(CHOICE_FIELDS) <= {path for path, _, _ in schema_fields()}
    for path, bound in NUMERIC_FIELDS.items():
        assert bound.problem(field_value(HsgdConfig(), path)) is None, f"the default of {path} fails its own bound"


@pytest.mark.parametrize("path", sorted(NUMERIC_FIELDS))
def test_a_bounded_field_refuses_nan_inf_and_its_nearest_invalid_values_and_takes_its_edges(path, valid_elsewhere):
    bound = NUMERIC_FIELDS[path]
    for bad in [math.nan, math.inf, -math.inf] + _nearest_invalid(bound):
        _refused(path, bad, bound.describe())
    for good in _edges(bound):
        _accepted(path, good, bound.describe())


@pytest.mark.parametrize("path", sorted(CHOICE_FIELDS))
def test_a_choice_field_refuses_an_unknown_value_listing_the_valid_ones_and_takes_each(path, valid_elsewhere):
    valid = CHOICE_FIELDS[path]
    shown = "|".join("null" if v is None else v for v in valid)
    _refused(path, "no-such-value", "'no-such-value'", shown)
    for good in valid:
        _accepted(path, good, shown)


@pytest.mark.parametrize("path", sorted(NUMERIC_FIELDS))
def test_numeric_field_given_on_the_command_line_refuses_nan(path):
    """The same through Hydra/OmegaConf (which refuses nan for an int itself): still one line naming
    the field (one compose per field: the in-process test above covers the other values)."""
    with pytest.raises(ConfigError) as info:
        precheck([f"{path}=nan"])
    _assert_one_line_naming(info.value, path)
    assert "valid:" in str(info.value), f"error for {path}=nan must say what is valid: {info.value}"


@pytest.mark.parametrize("path", ["supervisor.max_restarts", "faults.max_restarts"])
def test_restart_count_minus_one_means_forever_and_other_negatives_are_refused(path):
    validate(_cfg(**{path: -1}))
    for bad in (-2, -5):
        with pytest.raises(ConfigError) as info:
            validate(_cfg(**{path: bad}))
        assert "-1 for forever" in str(info.value)


def test_the_driver_treats_minus_one_supervisor_restarts_as_forever_like_ray():
    losses = SupervisorLosses(-1, restart_wait_s=60.0)
    verdicts = [losses.on_error(starts=k, now=10.0 * k) for k in range(1, 50)]
    assert all(v.new_loss and not v.gone for v in verdicts), "max_restarts=-1 must never be exhausted"
    assert SupervisorLosses(0, restart_wait_s=60.0).on_error(1, 0.0).gone, "0 restarts: the first death is the end"


def test_a_random_fault_schedule_is_bounded():
    # default run: 15 rounds * 20 steps * 0.1 s = 30 s, so mtbf 0.003 s -> 10,000 faults
    run_s = 15 * 20 * 0.1
    validate(_cfg(**{"faults.mtbf_s": run_s / MAX_RANDOM_FAULTS}))
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"faults.mtbf_s": run_s / MAX_RANDOM_FAULTS / 1.01}))
    _assert_one_line_naming(info.value, "faults.mtbf_s")
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"faults.mtbf_s": 1e-7}))  # ~3e8 faults: hung before the first step
    assert "0.003" in str(info.value), f"the error should give the smallest valid mtbf_s: {info.value}"


@pytest.mark.parametrize("bad", ["", "   ", 3])
def test_checkpoint_dir_is_null_or_a_non_empty_string(bad):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"checkpoint.dir": bad}))
    _assert_one_line_naming(info.value, "checkpoint.dir")


def test_checkpoint_dir_may_be_a_url():
    validate(_cfg(**{"checkpoint.dir": "memory://hsgd/ckpt"}))


@pytest.mark.parametrize("path", ["model._target_", "data._target_", "loss._target_"])
@pytest.mark.parametrize(
    "target,words",
    [
        ("no_such_module_hsgd.build", "ModuleNotFoundError"),
        ("hsgd.train.model.no_such_factory", "AttributeError"),
        ("os.sep", "not a callable"),
        ("build_gpt", "not a dotted path"),
    ],
)
def test_a_target_that_does_not_import_to_a_callable_is_one_line(path, target, words):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{path: target}))
    _assert_one_line_naming(info.value, path)
    assert words in str(info.value) and repr(target) in str(info.value)


def test_wandb_online_without_credentials_is_refused(no_wandb_credentials):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"logging.wandb.mode": "online"}))
    _assert_one_line_naming(info.value, "logging.wandb.mode")
    assert "offline|disabled" in str(info.value) and "WANDB_API_KEY" in str(info.value)
    validate(_cfg(**{"logging.wandb.mode": "offline"}))


def test_wandb_online_with_a_key_in_the_environment_passes(no_wandb_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    validate(_cfg(**{"logging.wandb.mode": "online"}))


def test_wandb_online_with_a_key_in_netrc_passes(no_wandb_credentials):
    (no_wandb_credentials / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    validate(_cfg(**{"logging.wandb.mode": "online"}))


def test_a_netrc_key_for_another_host_does_not_count(no_wandb_credentials):
    (no_wandb_credentials / "netrc").write_text("machine example.com login user password secret\n")
    with pytest.raises(ConfigError):
        validate(_cfg(**{"logging.wandb.mode": "online"}))


@pytest.mark.parametrize("path", ["run.dir", "run.sweep_dir"])
def test_run_folder_is_never_a_filesystem_root(path):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{path: "/"}))
    _assert_one_line_naming(info.value, path)
    assert "filesystem root" in str(info.value)


def test_run_folder_is_never_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for home in (str(tmp_path), "~", str(tmp_path) + "/"):
        with pytest.raises(ConfigError) as info:
            validate(_cfg(**{"run.dir": home}))
        _assert_one_line_naming(info.value, "run.dir")
        assert "home folder" in str(info.value)
    validate(_cfg(**{"run.dir": str(tmp_path / "outputs" / "run1")}))


@pytest.mark.parametrize("content", [bytes(range(256)) * 64, b"\xff\xfe\x00\x01" * 4096])
def test_a_binary_data_file_is_one_line_naming_data_path(tmp_path, content):
    binary = tmp_path / "corpus.txt"
    binary.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"data.path": str(binary)}))
    _assert_one_line_naming(info.value, "data.path")


def test_a_too_small_corpus_is_one_line_naming_data_path(tmp_path):
    small = tmp_path / "tiny.txt"
    small.write_text("to be or not to be")
    with pytest.raises(ConfigError) as info:
        validate(_cfg(**{"data.path": str(small)}))
    _assert_one_line_naming(info.value, "data.path")
