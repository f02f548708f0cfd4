"""Sharded checkpoints of one replica's k ranks through torch.distributed.checkpoint (DCP),
sha256-verified against hsgd's manifest before DCP reads a byte.

Layout: `directory/manifest.json` (format "dcp", ranks k, every file's sha256, manifest_extra),
`directory/.metadata` (DCP's index, rank 0's, unpickled by DCP), one `.distcp` data file per rank.
Save (`save_sharded`, every rank, the same directory; collectives on `group`, each within `timeout_s`):
  1. rank 0's nonce, broadcast: every rank writes into `<directory>.tmp-<owner>-<nonce>`.
  2. `dcp.save` into that temp folder, one writer per rank (DCP's fsspec writer for a URL).
  3. barrier; rank 0 hashes EVERY file (`.metadata` included), writes `manifest.json` and moves
     the folder to `directory` (one rename; on an object store copies, the manifest LAST).
  4. barrier carrying rank 0's outcome: every rank returns the manifest, or raises.
Load (`load_sharded`, every rank; any k: DCP reshards on load):
  1. every rank reads the manifest (JSON) and checks its round-robin share of the files' sha256s.
  2. one all-reduce (MIN of the first problem) so every rank refuses with the SAME one-line error
     naming the file: missing, altered, or not in the manifest. Only then
  3. `dcp.load` into the caller's state dict, in place.
Failure cases:
- A rank dies or raises mid-save: the others raise CheckpointError (DCP's collective or a barrier's
  deadline), and no `directory` appears; the temp folder is never read (`checkpoint.prune`).
- A crash after the files but before the rename: the same. An existing `directory` is refused.
- A rank that dies after rank 0's rename: the checkpoint is complete; the survivors' error names the barrier.
- A verify failure: CheckpointError on every rank, naming the file; the state dict is untouched.
- `group=None`: a world of one (no process group, DCP without collectives).
Narrative (the chain of hashes, why verify first): docs/outputs.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from hsgd.train.checkpoint_storage import (
    DCP_FORMAT,
    MANIFEST,
    CheckpointError,
    is_local,
    join_url,
    load_manifest,
    remove,
    safe_owner,
    url_to_fs,
    write_atomic,
)

FORMAT = DCP_FORMAT  # checkpoint.py reads this format too: its chooser routes it to verify_sharded
METADATA = ".metadata"  # DCP's index: unpickled by DCP, so it is verified like every data file
DEFAULT_TIMEOUT_S = 300.0
_OK = 2**62  # "no problem found" in the load check's all-reduce (MIN picks the first problem)
_PROBLEMS = {1: "missing", 2: "altered (does not match its manifest sha256)", 3: "not in the manifest", 4: "unreadable"}


# -- the replica's group: a world of one needs no collective ----------------------------------------
def _rank_and_size(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


@contextmanager
def _quiet_world_of_one(group):
    """DCP warns on every call without a process group; a world of one is meant, not a mistake."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        done = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 — gloo raises many types for a dead or late peer
        raise CheckpointError(f"sharded checkpoint: {what} failed within {timeout_s:.0f} s: {err}") from err
    if done is False:
        raise CheckpointError(f"sharded checkpoint: {what} did not finish within {timeout_s:.0f} s")


def _reduce(group, value: int, op, timeout_s: float, what: str) -> int:
    """All-reduce one int64 over the replica's group (the shard level), bounded by timeout_s."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    _wait(dist.all_reduce(t, op=op, group=group, async_op=True), timeout_s, f"shard-level {what}")
    return int(t.item())


def _broadcast_nonce(group, timeout_s: float) -> str:
    """Rank 0's random temp-folder tag, the same on every rank (a tensor: nothing is unpickled)."""
    t = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    if group is not None:
        _wait(dist.broadcast(t, group_src=0, group=group, async_op=True), timeout_s, "shard-level nonce broadcast")
    return f"{int(t.item()):016x}"[-8:]


def _one_line(err: BaseException) -> str:
    """DCP's CheckpointException holds every failed rank's error with its traceback: one line of it."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        # each failure is (exception, its stack summary)
        return "; ".join(
            f"rank {rank}: {_one_line(e[0] if isinstance(e, tuple) else e)}" for rank, e in sorted(failures.items())
        )
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# -- files --------------------------------------------------------------------------------------
def _writer(url: str):
    import torch.distributed.checkpoint as dcp

    if is_local(url):
        return dcp.FileSystemWriter(url_to_fs(url)[1])
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # DCP's fsspec writer

    return FsspecWriter(url)


def _reader(url: str):
    import torch.distributed.checkpoint as dcp

    if is_local(url):
        return dcp.FileSystemReader(url_to_fs(url)[1])
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url)


def _files(url: str) -> list[str]:
    """Every file under url, relative to it, sorted ([] when url is not there)."""
    fs, path = url_to_fs(url)
    try:
        found = fs.find(path)
    except FileNotFoundError:
        return []
    base = path.rstrip("/") + "/"
    return sorted(str(f)[len(base) :] if str(f).startswith(base) else str(f).rsplit("/", 1)[-1] for f in found)


def _sha256(url: str) -> str:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- save ---------------------------------------------------------------------------------------
def save_sharded(
    state: dict, directory: str, *, group, manifest_extra: dict, owner: str = "", timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict:
    """Write `state` (DTensors, plain tensors, ints) of every rank of `group` as the sharded
    checkpoint `directory` (module protocol). Every rank calls it; returns the manifest on every
    rank, or raises CheckpointError on every rank still alive, with nothing under `directory`."""
    import torch.distributed.checkpoint as dcp

    directory = str(directory).rstrip("/")
    reserved = {"format", "files", "ranks"} & set(manifest_extra)
    if reserved:
        raise ValueError(f"manifest_extra may not set {sorted(reserved)}: save_sharded writes them")
    rank, world = _rank_and_size(group)
    tag = f"{safe_owner(owner)}-" if owner else ""
    temp = f"{directory}.tmp-{tag}{_broadcast_nonce(group, timeout_s)}"
    try:
        with _quiet_world_of_one(group):
            dcp.save(state, storage_writer=_writer(temp), process_group=group, no_dist=group is None)
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 — DCP's is a BaseException
        if rank == 0:
            remove(temp)
        raise CheckpointError(f"sharded checkpoint {directory}: writing the shards failed: {_one_line(err)}") from err
    _reduce(group, 0, dist.ReduceOp.MAX, timeout_s, "barrier after the shards were written")
    problem = ""
    if rank == 0:
        try:
            _finalize(temp, directory, {**manifest_extra, "format": FORMAT, "ranks": world})
        except Exception as err:  # noqa: BLE001 — any failure here leaves the final name empty
            remove(temp)
            problem = _one_line(err)
    failed = _reduce(group, int(bool(problem)), dist.ReduceOp.MAX, timeout_s, "barrier after the rename")
    if failed:
        raise CheckpointError(
            f"sharded checkpoint {directory} not finalized: "
            f"{problem or 'rank 0 failed to finalize it (its error names why)'}"
        )
    return read_manifest(directory)


def _finalize(temp: str, directory: str, manifest: dict) -> None:
    """Rank 0: hash every file DCP wrote, write the manifest and move the folder into place."""
    names = _files(temp)
    if METADATA not in names:
        raise CheckpointError(f"DCP wrote no {METADATA} into {temp}")
    manifest["files"] = {name: _sha256(join_url(temp, name)) for name in names}
    text = json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")
    fs, final_path = url_to_fs(directory)
    if fs.exists(final_path):
        raise CheckpointError(f"{directory} already exists; checkpoints are never overwritten")
    if is_local(directory):
        write_atomic(join_url(temp, MANIFEST), lambda f: f.write(text))
        _rename_into_place(url_to_fs(temp)[1], final_path)
        return
    fs.makedirs(final_path, exist_ok=True)
    temp_path = url_to_fs(temp)[1]
    for name in names:
        fs.copy(f"{temp_path}/{name}", f"{final_path}/{name}")
    write_atomic(join_url(directory, MANIFEST), lambda f: f.write(text))  # LAST: the commit point
    remove(temp)


def _rename_into_place(temp_path: str, final_path: str) -> None:
    """The local commit point: one rename of the whole folder."""
    os.rename(temp_path, final_path)


# -- load ---------------------------------------------------------------------------------------
def read_manifest(directory: str) -> dict:
    """The manifest of a sharded checkpoint (JSON); CheckpointError if it is unreadable or not DCP's."""
    manifest, url = load_manifest(directory, "sharded checkpoint")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if files is None or manifest.get("format") != FORMAT or not isinstance(files, dict) or METADATA not in files:
        raise CheckpointError(
            f"{url} is not a sharded (dcp) checkpoint's manifest: it needs format 'dcp' and files naming {METADATA}"
        )
    return manifest


def _first_problem(directory: str, rank: int, world: int) -> tuple[int, list[str], str]:
    """(code, names, text): code = position * 8 + problem kind of the first problem among `names`
    (the manifest's and the folder's files, sorted: the same on every rank), _OK when none; this
    rank hashes only its round-robin share. Code 0 is a bad manifest, whose text is `text`."""
    try:
        expected = read_manifest(directory)["files"]
    except CheckpointError as err:
        return 0, [], str(err)
    present = set(_files(directory)) - {MANIFEST}
    names = sorted(set(expected) | present)
    for position, name in enumerate(names, start=1):
        if name not in present:
            kind = 1
        elif name not in expected:
            kind = 3
        elif position % world == rank:
            try:
                kind = 2 if _sha256(join_url(directory, name)) != expected[name] else 0
            except OSError:  # reported through the all-reduce, so no rank is left waiting in it
                kind = 4
            if not kind:
                continue
        else:
            continue
        return position * 8 + kind, names, ""
    return _OK, names, ""


def verify_sharded(directory: str, *, group=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Check every file of `directory` against its manifest without reading any with DCP (or pickle);
    every rank of `group` calls it and gets the manifest or the same CheckpointError naming the file."""
    directory = str(directory).rstrip("/")
    rank, world = _rank_and_size(group)
    code, names, text = _first_problem(directory, rank, world)
    code = _reduce(group, code, dist.ReduceOp.MIN, timeout_s, "checkpoint verification")
    if code == 0:
        raise CheckpointError(text or f"sharded checkpoint {directory}: another rank could not read its manifest")
    if code != _OK:
        position, kind = divmod(code, 8)
        name = names[position - 1] if position <= len(names) else f"file #{position}"
        raise CheckpointError(f"sharded checkpoint {directory} refused before loading: {name} is {_PROBLEMS[kind]}")
    return read_manifest(directory)


def load_sharded(state: dict, directory: str, *, group, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Verify `directory` (every file against the manifest's sha256), then `dcp.load` it into
    `state` in place, resharded to this group's k. Every rank calls it; returns the manifest."""
    import torch.distributed.checkpoint as dcp

    manifest = verify_sharded(directory, group=group, timeout_s=timeout_s)
    try:
        with _quiet_world_of_one(group):
            dcp.load(
                state, storage_reader=_reader(str(directory).rstrip("/")), process_group=group, no_dist=group is None
            )
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 — DCP's is a BaseException
        raise CheckpointError(f"sharded checkpoint {directory} could not be loaded: {_one_line(err)}") from err
    return manifest
