"""The `nan` fault kind (issue 19, item 8's test hook): parsed from the forms a user writes it in,
and never drawn by default in random mode."""

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from hsgd.config.schema import FaultsConfig
from hsgd.core.faults import FAULT_KINDS, parse_schedule


def _hydra(text: str):
    (override,) = OverridesParser.create().parse_overrides([text])
    return override.value()


@pytest.mark.parametrize(
    "raw",
    [
        _hydra("faults.schedule=[{kind:nan,target:c1r0,round:1,phase:inner,step:3}]"),  # the command line
        yaml.safe_load("[{kind: .nan, target: c1r0, round: 1, phase: inner, step: 3}]"),  # config.yaml, read back
        [{"kind": "nan", "target": "c1r0", "round": 1, "phase": "inner", "step": 3}],  # a drill's add_fault
    ],
)
def test_nan_parses_although_hydra_and_yaml_read_it_as_a_float(raw):
    (spec,) = parse_schedule(list(raw), clusters=2, replicas_per_cluster=2)
    assert (spec.kind, spec.target, spec.round, spec.phase, spec.step) == ("nan", "c1r0", 1, "inner", 3)


def test_nan_is_a_kind_but_not_among_the_default_random_kinds():
    assert "nan" in FAULT_KINDS
    assert "nan" not in FaultsConfig().kinds
