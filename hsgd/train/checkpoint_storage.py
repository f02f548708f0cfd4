"""Where checkpoints live: the storage primitives both checkpoint formats share (any fsspec URL or path).

`checkpoint.py` (one file per replica, and the chooser of both formats) and `dcp_checkpoint.py`
(sharded, through torch.distributed.checkpoint) both write through these, so a checkpoint root
holds either format under the same rules: a file appears whole or not at all (`write_atomic`), a
temp folder carries its owner's name (`safe_owner`) so `checkpoint.prune` removes only that run's
leftovers, and every folder removal tolerates an absent folder (`remove`). Its own module because
checkpoint.py reads sharded checkpoints through dcp_checkpoint.py: sharing these through either one
would make an import cycle. No torch here: file-only readers (jobs.status) start fast.
Also the reachability check: a nonce the driver writes under the root, that every replica reads back.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

MANIFEST = "manifest.json"  # a checkpoint exists once its manifest does (written last, or renamed in with it)
FILE_FORMAT = "file"  # one torch.save file per replica: a manifest without `format` (checkpoint.py)
DCP_FORMAT = "dcp"  # sharded by torch.distributed.checkpoint, `format: "dcp"` in the manifest (dcp_checkpoint.py)


class CheckpointError(RuntimeError):
    pass


def url_to_fs(url: str | Path):
    """(fsspec filesystem, its path for url without a trailing slash) for a path or any fsspec URL."""
    fs, path = fsspec.core.url_to_fs(str(url))
    return fs, path.rstrip("/") or "/"


def join_url(url: str | Path, name: str) -> str:
    """`name` under url, a path or an fsspec URL alike (os.path.join would break `s3://`)."""
    return f"{str(url).rstrip('/')}/{name}"


def is_local(url: str | Path) -> bool:
    """The local filesystem: atomic rename exists (an object store has none)."""
    return isinstance(url_to_fs(url)[0], LocalFileSystem)


def safe_owner(owner: str) -> str:
    """The owner (run id) as it appears in a temp folder's name: `<round>.tmp-<owner>-<nonce>`."""
    return "".join(ch if ch.isalnum() or ch in "_." else "_" for ch in owner)


def remove(url: str | Path) -> None:
    """Remove a directory (a refused or interrupted checkpoint write); absent is fine."""
    fs, path = url_to_fs(url)
    with contextlib.suppress(OSError):
        fs.rm(path, recursive=True)


def write_atomic(url: str, write: Callable[[Any], None]) -> None:
    """`write(f)` into url, all or nothing: locally a temp name, fsynced and renamed (a reader never
    sees half a file); an object store's PUT is atomic."""
    fs, path = url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        final = Path(path)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return
    with fs.open(path, "wb") as f:
        write(f)


def load_manifest(directory: str | Path, what: str = "checkpoint") -> tuple[Any, str]:
    """(the parsed JSON of directory's manifest, its URL); CheckpointError naming `what` when it cannot
    be read or parsed. Its shape is the caller's to check."""
    url = join_url(directory, MANIFEST)
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8")), url
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{what} manifest {url} is unreadable: {err}") from err


# -- reachability ---------------------------------------------------------------------------------
REACH_PREFIX = ".hsgd-reach-"


def write_reach_nonce(root: str | Path, run_id: str) -> tuple[str, str]:
    """The driver's half of the reachability check: a nonce file under the checkpoint root.
    Returns (its URL, the nonce); each replica must read it back (`read_reach_nonce`)."""
    nonce = uuid.uuid4().hex
    fs, path = url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    url = join_url(root, f"{REACH_PREFIX}{safe_owner(run_id)}")
    write_atomic(url, lambda f: f.write(nonce.encode("utf-8")))
    return url, nonce


def read_reach_nonce(url: str, nonce: str) -> str | None:
    """A replica's half: None when it reads the driver's nonce at url, else the problem."""
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            got = f.read().decode("utf-8", "replace").strip()
    except Exception as err:  # noqa: BLE001 — any failure to read is the answer
        return f"{type(err).__name__}: {err}"
    return None if got == nonce else f"{url} holds another nonce (another storage under the same name?)"
