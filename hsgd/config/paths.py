"""Where a run writes: run.dir / run.sweep_dir resolved against the persistent output root."""

from __future__ import annotations

import functools
import os
import secrets


def under_ray_job() -> bool:
    """True in the entrypoint of `ray job submit` (Ray's job supervisor sets this variable)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def output_path(path: str) -> str:
    """run.dir / run.sweep_dir as the job will use it: `~` expanded, a relative path joined to the
    output root — $HSGD_OUTPUT_ROOT, else ~/hsgd under a Ray job — and, with neither, left relative
    to the launch directory."""
    p = os.path.expanduser(str(path))
    root = os.environ.get("HSGD_OUTPUT_ROOT", "").strip() or ("~/hsgd" if under_ray_job() else "")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), p) if root and not os.path.isabs(p) else p


@functools.cache
def run_suffix() -> str:
    """`${hsgd.suffix:}`: 6 random hex digits, drawn once per process. The default run.dir ends with
    it, so two jobs started in the same second get different folders; one per process because
    Hydra resolves hydra.run.dir and cfg.run.dir separately, and both must name the same folder."""
    return secrets.token_hex(3)
