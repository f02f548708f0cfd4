"""Durable checkpoints: atomic, verifiable, loaded without executing code, on any fsspec storage.

The root is `checkpoint.dir` (any fsspec URL every replica reaches), or `<run.dir>/checkpoints` when
null (`root_url`):

    round_000005/manifest.json      round, step, run id, config fingerprint, replica files + sha256
    round_000005/c0r0.pt ...        "file" format: one file per replica, its ReplicaTrainer.state_dict()
    round_000005/c0r0/ ...          "dcp" format: one sharded checkpoint per replica (dcp_checkpoint.py)

Protocol: replicas write into `round_000005.tmp-<owner>-<nonce>/` (`new_temp_dir`; owner = the run
id, so `prune` removes only this run's leftovers). Locally each file and then the manifest is
`write_atomic` and the directory is renamed (the commit point); on an object store the files are
copied to the final directory and the manifest written LAST: without a manifest a checkpoint does
not exist. A final checkpoint is never overwritten.
Failure cases: a crash leaves the old checkpoints untouched and a temp or manifest-less directory
that is ignored. `verify` checks the manifest and every file's sha256 (a "dcp" replica's folder
through `dcp_checkpoint.verify_sharded`); `choose` walks back from the newest to the first that
verifies (and that a replica in `holders_of` can load), recording each reason. A loaded replica's
params digest must equal the manifest's (`expected_param_digest`). An unknown `format` is refused
like a corrupt file; files load with `torch.load(weights_only=True)`, never executing code.
Narrative (both formats side by side, trust): docs/outputs.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from hsgd.train.checkpoint_storage import (  # re-exported: callers know them as checkpoint.<name>
    DCP_FORMAT,
    FILE_FORMAT,
    MANIFEST,
    CheckpointError,
    join_url,
    load_manifest,
    remove,
    safe_owner,
    url_to_fs,
    write_atomic,
)
from hsgd.train.checkpoint_storage import REACH_PREFIX as REACH_PREFIX  # the reachability check, re-exported as above
from hsgd.train.checkpoint_storage import read_reach_nonce as read_reach_nonce
from hsgd.train.checkpoint_storage import write_reach_nonce as write_reach_nonce

PARAM_DIGESTS = "param_digests"  # manifest key: rid -> its params digest when saved (`expected_param_digest`)


# -- where ----------------------------------------------------------------------------------------
def root_url(checkpoint_dir: str | None, run_dir: str | Path) -> str:
    return str(checkpoint_dir) if checkpoint_dir else str(Path(run_dir) / "checkpoints")


def round_dir_name(round_index: int) -> str:
    return f"round_{round_index:06d}"


def round_of_dir(directory: str | Path) -> int | None:
    """The round of a checkpoint directory (its URL or path), from its name; None for another name."""
    return _round_of(str(directory).rstrip("/").rsplit("/", 1)[-1])


def _round_of(name: str) -> int | None:
    match = re.fullmatch(r"round_(\d+)", name)
    return int(match[1]) if match else None


def _names(url: str | Path) -> list[str]:
    """Base names directly under url ([] when it is not there)."""
    fs, path = url_to_fs(url)
    try:
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})


# -- writing --------------------------------------------------------------------------------------
def new_temp_dir(root: str | Path, round_index: int, owner: str = "") -> str:
    """A fresh temp directory for round `round_index`'s checkpoint, tagged with `owner` (the run id)."""
    tag = f"{safe_owner(owner)}-" if owner else ""
    url = join_url(root, f"{round_dir_name(round_index)}.tmp-{tag}{uuid.uuid4().hex[:8]}")
    fs, path = url_to_fs(url)
    fs.makedirs(path, exist_ok=True)  # the random nonce makes the name new
    return url


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through into `sha` (torch.save streams into it)."""

    def __init__(self, f, sha):
        self.f, self.sha = f, sha

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha.update(b)
        self.f.write(b)
        return len(b)


def save_replica_state(directory: str | Path, rid: str, state: dict) -> str:
    """Write one replica's state into `directory` (a URL or path); returns its sha256 for the manifest."""
    import torch  # imported here so file-only readers (jobs.status) start fast

    sha = hashlib.sha256()
    write_atomic(join_url(directory, f"{rid}.pt"), lambda f: torch.save(state, _HashingWriter(f, sha)))
    return sha.hexdigest()


def replica_entry(rid: str, fmt: str) -> str:
    """What replica `rid` writes into a round folder: `<rid>.pt` (FILE_FORMAT) or its DCP folder `<rid>`."""
    return f"{rid}.pt" if fmt == FILE_FORMAT else rid


def _entry_file(entry: str) -> str:
    """The file whose presence (and sha256) stands for an entry: the `.pt` itself, or a DCP folder's manifest."""
    return entry if entry.endswith(".pt") else f"{entry}/{MANIFEST}"


def sharded_replica_sha256(directory: str | Path, rid: str) -> str:
    """The sha256 the run manifest records for replica `rid`'s DCP folder: that of its manifest.json."""
    fs, path = url_to_fs(join_url(directory, f"{rid}/{MANIFEST}"))
    with fs.open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_text(url: str, text: str) -> None:
    write_atomic(url, lambda f: f.write(text.encode("utf-8")))


def exists(root: str | Path, round_index: int) -> bool:
    """A finalized checkpoint of this round is there (it is never written again)."""
    fs, path = url_to_fs(join_url(root, f"{round_dir_name(round_index)}/{MANIFEST}"))
    return fs.isfile(path)


def finalize(temp_dir: str | Path, manifest: dict, replica_rounds: dict[str, int]) -> str:
    """Commit the checkpoint in `temp_dir`: returns the final directory's URL. Refuses (and removes
    the temp dir) unless every replica file the manifest names is there and that replica reported
    the manifest's round in `replica_rounds` (a lost answer refuses too: its file may hold another
    round's state); never replaces an existing final checkpoint."""
    temp_dir = str(temp_dir).rstrip("/")
    state_round = int(manifest["round"])
    final = join_url(temp_dir.rsplit("/", 1)[0], round_dir_name(state_round))
    fs, temp_path = url_to_fs(temp_dir)
    _, final_path = url_to_fs(final)
    files = sorted(manifest.get("files", {}))
    entries = {rid: replica_entry(rid, format_of(manifest)) for rid in files}  # what each replica wrote
    problem = None
    local = isinstance(fs, LocalFileSystem)
    if fs.exists(url_to_fs(join_url(final, MANIFEST))[1]) or (local and fs.exists(final_path)):
        problem = f"{final} already exists; checkpoints are never overwritten"
    elif missing := [rid for rid in files if not fs.isfile(f"{temp_path}/{_entry_file(entries[rid])}")]:
        problem = f"replica files missing from {temp_dir}: {', '.join(missing)}"
    elif wrong := {rid: replica_rounds.get(rid) for rid in files if replica_rounds.get(rid) != state_round}:
        problem = f"replicas at another round than {state_round} (None: never reported): {wrong}"
    if problem is not None:
        remove(temp_dir)
        raise CheckpointError(f"checkpoint of round {state_round} not finalized: {problem}")
    text = json.dumps(manifest, indent=2, sort_keys=True)
    if local:
        _write_text(join_url(temp_dir, MANIFEST), text)
        os.replace(temp_path, final_path)
        return final
    fs.makedirs(final_path, exist_ok=True)
    for rid in files:
        fs.copy(f"{temp_path}/{entries[rid]}", f"{final_path}/{entries[rid]}", recursive=entries[rid] != f"{rid}.pt")
    _write_text(join_url(final, MANIFEST), text)
    remove(temp_dir)
    return final


# -- reading --------------------------------------------------------------------------------------
def finalized(root: str | Path) -> list[str]:
    """Every finalized checkpoint directory (it has a manifest), oldest first."""
    fs, _ = url_to_fs(root)
    return [
        join_url(root, name)
        for name in _names(root)
        if _round_of(name) is not None and fs.isfile(url_to_fs(join_url(root, f"{name}/{MANIFEST}"))[1])
    ]


def read_manifest(directory: str | Path) -> dict:
    manifest, url = load_manifest(directory)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "round" not in manifest:
        raise CheckpointError(f"checkpoint manifest {url} lacks its round or files")
    return manifest


def format_of(manifest: dict) -> str:
    """FILE_FORMAT (one `.pt` per replica; a manifest without `format`, as all written before sharded
    checkpoints) or DCP_FORMAT (sharded, dcp_checkpoint.py); CheckpointError for anything else."""
    written = manifest.get("format", FILE_FORMAT)
    if written not in (FILE_FORMAT, DCP_FORMAT):
        raise CheckpointError(
            f"checkpoint format {written!r} is not one this hsgd reads ({FILE_FORMAT!r} or {DCP_FORMAT!r})"
        )
    return written


def ranks_of(manifest: dict) -> int:
    """How many ranks wrote the checkpoint: the manifest's `ranks` (k) for a sharded one, 1 for the
    file format (one file per replica, each written whole). A resume may load it with another k."""
    if format_of(manifest) == FILE_FORMAT:
        return 1
    ranks = manifest.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise CheckpointError(f"sharded checkpoint manifest has ranks={ranks!r}; it must be an integer >= 1")
    return ranks


def checkpoint_format(directory: str | Path) -> str:
    """FILE_FORMAT or DCP_FORMAT of the checkpoint in `directory` (its manifest only; verifies nothing)."""
    return format_of(read_manifest(directory))


def verify(directory: str | Path) -> dict:
    """Read a checkpoint of either format back: the manifest parses and every file matches its sha256.
    Returns the manifest; raises CheckpointError naming the first problem. Loads nothing: a sharded
    one goes to dcp_checkpoint.verify_sharded with no process group (a world of one hashes every
    file, `.metadata` included, and refuses one the manifest does not name)."""
    manifest = read_manifest(directory)
    if format_of(manifest) == DCP_FORMAT:
        ranks_of(manifest)
        for rid, expected in sorted(manifest["files"].items()):
            verify_sharded_replica(directory, rid, expected)
        return manifest
    for rid, expected in sorted(manifest["files"].items()):
        url = join_url(directory, f"{rid}.pt")
        fs, path = url_to_fs(url)
        try:
            with fs.open(path, "rb") as f:
                actual = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as err:
            raise CheckpointError(f"checkpoint file {url} is unreadable: {err}") from err
        if actual != expected:
            raise CheckpointError(f"checkpoint file {url} does not match its manifest sha256 (corrupt or truncated)")
    return manifest


def verify_sharded_replica(directory: str | Path, rid: str, expected_sha256: str | None) -> dict:
    """Replica `rid`'s DCP folder of a "dcp" checkpoint: every file against its own manifest (nothing
    read with DCP or pickle), and that manifest against the run manifest's sha256 (`expected_sha256`;
    None: not checked). Returns the replica's manifest; CheckpointError naming the file otherwise."""
    from hsgd.train import dcp_checkpoint  # torch and DCP only where a sharded checkpoint is read

    replica_dir = join_url(directory, rid)
    found = dcp_checkpoint.verify_sharded(replica_dir, group=None)
    try:
        actual = sharded_replica_sha256(directory, rid)
    except OSError as err:
        raise CheckpointError(f"checkpoint file {join_url(replica_dir, MANIFEST)} is unreadable: {err}") from err
    if expected_sha256 and actual != expected_sha256:
        raise CheckpointError(
            f"checkpoint file {join_url(replica_dir, MANIFEST)} does not match the run "
            f"manifest's sha256 (corrupt or replaced)"
        )
    return found


@dataclass(frozen=True)
class Choice:
    """What `choose` found: the checkpoint (None when none is usable), the newer ones passed over
    (directory, reason), and how a verified checkpoint's config differs from this one's."""

    path: str | None
    manifest: dict | None
    skipped: tuple[tuple[str, str], ...] = ()
    config_diff: tuple[str, ...] = ()

    @property
    def format(self) -> str | None:
        """FILE_FORMAT or DCP_FORMAT: which loader a resume uses (None: nothing chosen)."""
        return format_of(self.manifest) if self.manifest is not None else None

    @property
    def ranks(self) -> int | None:
        """How many ranks wrote the chosen checkpoint (`ranks_of`; None: nothing chosen)."""
        return ranks_of(self.manifest) if self.manifest is not None else None


def choose(
    root: str | Path,
    fingerprint: dict | None = None,
    *,
    skip_other_config: bool = True,
    on_skip: Callable[[str, str], None] | None = None,
    formats: tuple[str, ...] | None = None,
    holders_of: Collection[str] | None = None,
    below: int | None = None,
) -> Choice:
    """The one checkpoint chooser, for a resume and a restore after a total loss alike: the newest
    that `verify`s, calling on_skip(directory, reason) for each newer one passed over. Against
    `fingerprint`, `skip_other_config` (a restore) passes over one another config wrote; else (a
    resume, which refuses it) it is chosen with its `config_diff`. `formats` (None: any): the
    formats the caller can load; one in another format is passed over, named as such.
    `holders_of` (None: not asked): the replicas that would load it; one holding no file of any of
    them is passed over (`holders_problem`). `below`: only checkpoints of an earlier round (a
    restore's next try after the newer ones failed to load)."""
    skipped: list[tuple[str, str]] = []
    for directory in reversed(finalized(root)):
        if below is not None and (round_of_dir(directory) or 0) >= below:
            continue  # tried already: not passed over again
        try:
            manifest = verify(directory)
        except CheckpointError as err:
            reason = str(err)
        else:
            reason = _unfit(manifest, formats, holders_of)
            diff = tuple(fingerprint_diff(manifest.get("fingerprint"), fingerprint)) if fingerprint else ()
            if reason is None and not (diff and skip_other_config):
                return Choice(directory, manifest, tuple(skipped), diff)
            reason = reason or f"written with another config ({'; '.join(diff)})"
        skipped.append((directory, reason))
        if on_skip is not None:
            on_skip(directory, reason)
    return Choice(None, None, tuple(skipped))


def _unfit(manifest: dict, formats: tuple[str, ...] | None, holders_of: Collection[str] | None) -> str | None:
    """Why a verified checkpoint cannot serve the caller (another format, or none of its replicas), else None."""
    if formats is not None and format_of(manifest) not in formats:
        return (
            f"a {format_of(manifest)} checkpoint of {ranks_of(manifest)} ranks per replica; "
            f"this launcher loads {', '.join(formats)} checkpoints only (issue 34)"
        )
    return None if holders_of is None else holders_problem(manifest, holders_of)


def holders(manifest: dict, takers: Collection[str]) -> list[str]:
    """The replicas among `takers` whose file (or DCP folder) the checkpoint holds: those that can load it
    (each loads its own; the others heal from them)."""
    return sorted(set(takers) & set(manifest.get("files") or {}))


def holders_problem(manifest: dict, takers: Collection[str]) -> str | None:
    """None when one of `takers` can load the checkpoint; else why not, in one line."""
    if holders(manifest, takers):
        return None
    held = ", ".join(sorted(manifest.get("files") or {})) or "none"
    wanted = ", ".join(sorted(takers)) or "any live replica"
    return f"holds no file of {wanted}, the replicas to load it (its files: {held})"


def expected_param_digest(manifest: dict, rid: str, ranks: int) -> str | None:
    """The params digest replica `rid` of `ranks` ranks must report once it loaded the checkpoint
    (`ReplicaTrainer.param_digest`), or None where it cannot be checked: a manifest from before
    digests were recorded, or one written by replicas of another number of ranks (a sharded
    replica's digest combines its ranks' shard digests, so it depends on k)."""
    digest = (manifest.get(PARAM_DIGESTS) or {}).get(rid)
    return digest if digest and ranks_of(manifest) == ranks else None


def digest_mismatch(rid: str, got: str | None, expected: str) -> str | None:
    """None when replica `rid`'s params digest after a load is the manifest's, else why not (one line)."""
    if got == expected:
        return None
    return (
        f"{rid}'s params digest after loading is {str(got)[:12]}, the manifest's {expected[:12]}: it did not load them"
    )


def load_replica_state(directory: str | Path, rid: str, expected_sha256: str | None = None) -> dict:
    url = join_url(directory, f"{rid}.pt")
    fs, path = url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CheckpointError(f"checkpoint file {url} is unreadable: {err}") from err
    if expected_sha256 and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise CheckpointError(f"checkpoint file {url} does not match its manifest sha256 (corrupt)")
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 — unpickling errors come in many types
        raise CheckpointError(f"checkpoint file {url} cannot be loaded safely: {err}") from err


def prune(root: str | Path, keep: int, owner: str = "") -> None:
    """Keep the newest `keep` (at least one) finalized checkpoints, of either format; remove this
    owner's temp dirs (another run id's are its write in progress; no owner: none; both formats name
    them `<round>.tmp-<owner>-<nonce>`) and manifest-less round directories older than the newest
    final one (interrupted object-store copies). Called after a new checkpoint is final, so the
    previous good one outlives its successor's write."""
    names = _names(root)
    for name in names:
        if owner and f".tmp-{safe_owner(owner)}-" in name:
            remove(join_url(root, name))
    done = finalized(root)
    for directory in done[: -max(1, keep)]:
        remove(directory)
    if done:
        newest = _round_of(done[-1].rsplit("/", 1)[-1])
        final_names = {d.rsplit("/", 1)[-1] for d in done}
        for name in names:
            r = _round_of(name)
            if r is not None and r < newest and name not in final_names:
                remove(join_url(root, name))


# -- what a resume may not change -----------------------------------------------------------------
FINGERPRINT_FIELDS = (
    "model._target_",
    "model.args",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.block_size",
    "data._target_",
    "data.vocab_size",
    "data.path",
    "sync.inner",
    "sync.outer",
    "sync.outer_every",
    "sync.fragments",
    "optim.inner.name",
    "optim.outer.lr",
    "optim.outer.momentum",
    "optim.outer.nesterov",
)


def fingerprint(cfg) -> dict:
    """What a resume may not change: {field: value} of FINGERPRINT_FIELDS plus `data.size`, the bytes
    of the data (a file, or every file of a token folder; None: the packaged corpus, or a path this
    process cannot see). Topology, rounds, timeouts, logging and faults may change. The outer step's lr and
    momentum are the values the run uses (hsgd.config.auto resolves a null one)."""
    from omegaconf import OmegaConf

    out = {}
    for name in FINGERPRINT_FIELDS:
        value = OmegaConf.select(cfg, name)
        if OmegaConf.is_config(value):  # model.args: plain, sorted, JSON-able
            value = json.loads(json.dumps(OmegaConf.to_container(value, resolve=True), sort_keys=True, default=str))
        out[name] = value
    from hsgd.config.auto import outer_step_of  # what the run uses: an auto (null) value resolved

    out["optim.outer.lr"], out["optim.outer.momentum"] = outer_step_of(cfg)
    if out["data.path"]:
        out["data.path"] = os.path.abspath(os.path.expanduser(str(out["data.path"])))
    p = Path(out["data.path"]) if out["data.path"] else None
    out["data.size"] = p.stat().st_size if p and p.is_file() else None
    if p and p.is_dir():
        out["data.size"] = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return out


def fingerprint_diff(saved: dict | None, now: dict) -> list[str]:
    """'field saved -> now' for every field that differs (a field one side lacks counts, except
    that a manifest without a fingerprint, written before fingerprints existed, is not checked)."""
    if not saved:
        return []
    return [
        f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
    ]
