"""Durable checkpoints: atomic, verifiable, loaded without executing code.

Layout under `<run.dir>/checkpoints/`:
    round_000005/manifest.json      round, step, topology, config fingerprint, replica files + sha256
    round_000005/c0r0.pt ...        one file per replica: its ReplicaTrainer.state_dict()
Protocol: replicas write their files into `round_000005.tmp-<nonce>/` (each file itself written
to a temp name and renamed); the supervisor then writes the manifest the same way and renames the
directory to its final name. A crash at any point leaves either the old checkpoints untouched or
a `.tmp-*` directory that `latest()` ignores and `prune()` removes. Files load with
`torch.load(weights_only=True)`: a foreign or corrupt file is an error, never code execution.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from hsgd.record.rundir import atomic_write_text

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def round_dir_name(round_index: int) -> str:
    return f"round_{round_index:06d}"


def new_temp_dir(root: str | Path, round_index: int) -> Path:
    path = Path(root) / f"{round_dir_name(round_index)}.tmp-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def save_replica_state(directory: str | Path, rid: str, state: dict) -> str:
    """Write one replica's state; returns its sha256 for the manifest."""
    path = Path(directory) / f"{rid}.pt"
    import torch  # imported here so file-only readers (jobs.status) start fast

    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
        digest = hashlib.sha256(f.read()).hexdigest()
    os.replace(tmp, path)
    return digest


def exists(root: str | Path, round_index: int) -> bool:
    """A finalized checkpoint of this round is there (it is never written again)."""
    return (Path(root) / round_dir_name(round_index) / MANIFEST).is_file()


def finalize(temp_dir: str | Path, manifest: dict, replica_rounds: dict[str, int]) -> Path:
    """Write the manifest and rename the directory into place (the commit point). Refuses (and
    removes the temp dir) unless every replica file the manifest names is there and that replica
    reported the manifest's round in `replica_rounds`; never replaces an existing final checkpoint.
    A replica that wrote a file but never reported (its answer was lost) refuses too: its file may
    hold another round's state."""
    temp_dir = Path(temp_dir)
    state_round = int(manifest["round"])
    final = temp_dir.with_name(round_dir_name(state_round))
    files = sorted(manifest.get("files", {}))
    problem = None
    if final.exists():
        problem = f"{final} already exists; checkpoints are never overwritten"
    elif missing := [rid for rid in files if not (temp_dir / f"{rid}.pt").is_file()]:
        problem = f"replica files missing from {temp_dir}: {', '.join(missing)}"
    elif wrong := {rid: replica_rounds.get(rid) for rid in files if replica_rounds.get(rid) != state_round}:
        problem = f"replicas at another round than {state_round} (None: never reported): {wrong}"
    if problem is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise CheckpointError(f"checkpoint of round {state_round} not finalized: {problem}")
    atomic_write_text(temp_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(temp_dir, final)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest finalized checkpoint directory, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("round_") and ".tmp-" not in p.name
                  and (p / MANIFEST).is_file())
    return done[-1] if done else None


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable: {err}") from err


def load_replica_state(directory: str | Path, rid: str, expected_sha256: str | None = None) -> dict:
    path = Path(directory) / f"{rid}.pt"
    data = path.read_bytes()
    if expected_sha256 and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise CheckpointError(f"checkpoint file {path} does not match its manifest sha256 (corrupt)")
    import io

    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 — unpickling errors come in many types
        raise CheckpointError(f"checkpoint file {path} cannot be loaded safely: {err}") from err


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` (at least one) finalized checkpoints; remove leftovers of interrupted
    writes. Called after a new checkpoint is final, so the previous good one outlives its successor's
    write."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if ".tmp-" in p.name and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    done = sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).is_file())
    for p in done[:-max(1, keep)]:
        shutil.rmtree(p, ignore_errors=True)
