"""Every model preset the manual names (conf/model/*.yaml) composes and validates: `model=gpt-30m`
was refused (`model.name: unknown value`) while the docs offered it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsgd.config.compose import compose_config

PRESETS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "model").glob("*.yaml"))


def test_there_are_presets():
    assert {"tiny", "small", "gpt-30m", "gpt-86m"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_model_preset_composes(preset):
    cfg = compose_config([f"model={preset}"])
    assert cfg.model.name == preset
