"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_wandb_credentials(monkeypatch, tmp_path):
    """No wandb credentials anywhere this process could find them (env, netrc, wandb's settings);
    returns the folder the netrc and settings paths point into."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    return tmp_path
