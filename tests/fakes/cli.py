"""`python -m jobs.train` as a user types it, with Ray's session folder, the outputs and the
credentials under a test's tmp_path (so a test can tell whether Ray started or a folder was made)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train_isolated(tmp_path, *overrides):
    """`python -m jobs.train <overrides>`: Ray's session folder under tmp_path/ray, outputs under tmp_path/out."""
    env = dict(
        os.environ,
        RAY_TMPDIR=str(tmp_path / "ray"),
        HSGD_OUTPUT_ROOT=str(tmp_path / "out"),
        NETRC=str(tmp_path / "netrc"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb"),
    )
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "RAY_ADDRESS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "jobs.train", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
