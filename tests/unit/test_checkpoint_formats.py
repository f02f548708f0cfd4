"""Both checkpoint formats under one root: hsgd.train.checkpoint's chooser, verifier and pruner treat a
"dcp" round folder (one DCP folder per replica, `<rid>/`, each replica manifest's sha256 in the run
manifest) as a checkpoint of its round, refuse a damaged one before DCP reads a byte of it, fall back
past it to the previous good checkpoint of either format with the reason recorded, and prune both by
the same rule. Each replica's DCP folder is written by `save_sharded(group=None)`: a world of one, in
this process, into the round's temp folder, finalized as the supervisor does."""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch

from hsgd.train import checkpoint as ckpt
from hsgd.train import dcp_checkpoint
from hsgd.train.checkpoint import CheckpointError


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}, "step": seed}


@pytest.fixture(autouse=True)
def _world_of_one_is_meant():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


@pytest.fixture(params=["path", "file", "memory"])
def root(request, tmp_path):
    """A checkpoint root as a path, a file:// URL, or fsspec's memory store (no rename: manifest last)."""
    url = {
        "path": str(tmp_path / "ckpts"),
        "file": f"file://{tmp_path}/ckpts",
        "memory": f"memory://hsgd-formats-{uuid.uuid4().hex[:8]}/ckpts",
    }[request.param]
    yield url
    ckpt.remove(url)


def _write(root: str, round_index: int, kind: str, owner: str = "run-a", fingerprint: dict | None = None) -> str:
    """A finalized checkpoint of `kind` ("file": c0r0.pt + c1r0.pt; "dcp": c0r0/ + c1r0/, each one
    replica's DCP folder written by one rank; c0r0 holds _state(round_index))."""
    extra = {"round": round_index, "step": round_index * 20, **({"fingerprint": fingerprint} if fingerprint else {})}
    tmp = ckpt.new_temp_dir(root, round_index, owner=owner)
    rids = ("c0r0", "c1r0")
    if kind == "dcp":
        for i, rid in enumerate(rids):
            dcp_checkpoint.save_sharded(
                _state(round_index + i),
                ckpt.join_url(tmp, rid),
                group=None,
                manifest_extra={"round": round_index, "rid": rid},
            )
        files = {rid: ckpt.sharded_replica_sha256(tmp, rid) for rid in rids}
        extra.update(format="dcp", ranks=1)
    else:
        files = {rid: ckpt.save_replica_state(tmp, rid, _state(i)) for i, rid in enumerate(rids)}
    return ckpt.finalize(tmp, {**extra, "files": files}, {rid: round_index for rid in rids})


def _alter_one_byte(url: str) -> None:
    fs, path = ckpt.url_to_fs(url)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    with fs.open(path, "wb") as f:
        f.write(bytes(data))


def _rewrite_manifest(directory: str, **changes) -> None:
    fs, path = ckpt.url_to_fs(ckpt.join_url(directory, ckpt.MANIFEST))
    manifest = ckpt.read_manifest(directory)
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    with fs.open(path, "wb") as f:
        f.write(json.dumps(manifest).encode())


class DcpReadTheMetadata(AssertionError):
    pass


@pytest.fixture
def dcp_reads_refused(monkeypatch):
    """Any DCP read (load, or its readers' `.metadata` unpickling) fails the test: choosing and
    verifying must hash, never load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    def refuse(*args, **kwargs):
        raise DcpReadTheMetadata("DCP read a checkpoint while it was being chosen or verified")

    monkeypatch.setattr(dcp, "load", refuse)
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", refuse)
    monkeypatch.setattr(FsspecReader, "read_metadata", refuse)


# -- which format, how many ranks -----------------------------------------------------------------
def test_format_and_ranks_of_a_manifest():
    assert ckpt.format_of({"round": 1, "files": {}}) == "file", "a manifest without format is today's format"
    assert ckpt.ranks_of({"round": 1, "files": {}}) == 1
    assert ckpt.format_of({"format": "dcp", "ranks": 2}) == "dcp" and ckpt.ranks_of({"format": "dcp", "ranks": 2}) == 2
    with pytest.raises(CheckpointError, match=r"format 'zarr' is not one this hsgd reads \('file' or 'dcp'\)"):
        ckpt.format_of({"format": "zarr"})
    for ranks in (None, 0, "2", True):
        with pytest.raises(CheckpointError, match=f"ranks={ranks!r}; it must be an integer >= 1"):
            ckpt.ranks_of({"format": "dcp", **({"ranks": ranks} if ranks is not None else {})})


def test_a_dcp_round_folder_is_a_finalized_checkpoint_of_its_round(root):
    file_dir, dcp_dir = _write(root, 1, "file"), _write(root, 2, "dcp")
    assert ckpt.finalized(root) == [file_dir, dcp_dir]
    assert ckpt.exists(root, 2) and not ckpt.exists(root, 3)
    assert ckpt.checkpoint_format(file_dir) == "file" and ckpt.checkpoint_format(dcp_dir) == "dcp"
    manifest = ckpt.verify(dcp_dir)
    assert manifest["round"] == 2 and manifest["ranks"] == 1 and sorted(manifest["files"]) == ["c0r0", "c1r0"]
    replica = ckpt.verify_sharded_replica(dcp_dir, "c1r0", manifest["files"]["c1r0"])
    assert replica["rid"] == "c1r0" and ".metadata" in replica["files"], replica


# -- choose: the newest good checkpoint, of either format --------------------------------------------
def test_choose_picks_a_good_dcp_checkpoint_and_says_how_to_load_it(root, dcp_reads_refused):
    _write(root, 2, "file")
    newest = _write(root, 4, "dcp")
    found = ckpt.choose(root)
    assert found.path == newest and found.manifest["round"] == 4 and found.skipped == (), found
    assert (found.format, found.ranks) == ("dcp", 1), found
    assert (ckpt.Choice(None, None).format, ckpt.Choice(None, None).ranks) == (None, None)


def test_a_caller_that_loads_one_format_passes_over_the_other_and_says_why(root, dcp_reads_refused):
    older = _write(root, 2, "file")
    newest = _write(root, 4, "dcp")
    passed_over = []
    found = ckpt.choose(root, formats=(ckpt.FILE_FORMAT,), on_skip=lambda d, why: passed_over.append((d, why)))
    assert found.path == older and found.format == "file", found
    assert [d for d, _ in found.skipped] == [newest] and passed_over == list(found.skipped)
    assert "dcp checkpoint of 1 ranks" in found.skipped[0][1] and "loads file checkpoints only" in found.skipped[0][1]


def test_the_chosen_dcp_checkpoint_loads_back_bitwise(root):
    _write(root, 3, "dcp")
    found = ckpt.choose(root)
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5)}, "step": 0}
    dcp_checkpoint.load_sharded(state, ckpt.join_url(found.path, "c0r0"), group=None)
    want = _state(3)
    assert state["step"] == 3 and all(torch.equal(state["model"][k], want["model"][k]) for k in want["model"])


@pytest.mark.parametrize("previous", ["file", "dcp"])
@pytest.mark.parametrize("newest_kind", ["dcp", "file"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_of_either_format(
    root, dcp_reads_refused, newest_kind, previous
):
    """Mirrors test_checkpoint.py's one-file fallback: the altered newest is skipped (on_skip and
    Choice.skipped, the reason the restore's checkpoint_fallback event records), the previous chosen."""
    older = _write(root, 2, previous)
    newest = _write(root, 4, newest_kind)
    _alter_one_byte(ckpt.join_url(newest, "c1r0/.metadata" if newest_kind == "dcp" else "c1r0.pt"))
    skipped = []
    found = ckpt.choose(root, on_skip=lambda d, why: skipped.append((d, why)))
    assert found.path == older and found.manifest["round"] == 2 and found.format == previous, found
    assert list(found.skipped) == skipped and [d for d, _ in skipped] == [newest], skipped
    reason = skipped[0][1]
    assert "sha256" in reason and "\n" not in reason, reason
    if newest_kind == "dcp":
        assert "c1r0 refused before loading: .metadata is altered" in reason, reason
    with pytest.raises(CheckpointError):
        ckpt.verify(newest)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("data altered", "c0r0 refused before loading: __0_0.distcp is altered"),
        ("data removed", "__0_0.distcp is missing"),
        ("file added", "__7_0.distcp is not in the manifest"),
        # a replica's manifest rewritten to match its (consistent) files: the run manifest's sha256 refuses it
        ("replica manifest replaced", "c0r0/manifest.json does not match the run manifest's sha256"),
        ("format unknown", "format 'zarr' is not one this hsgd reads"),
        ("ranks missing", "ranks=None; it must be an integer >= 1"),
        ("format removed", "c0r0.pt is unreadable"),  # read as the file format: refused, never loaded
    ],
)
def test_every_damage_of_a_dcp_checkpoint_is_passed_over_before_dcp_reads_it(
    tmp_path, dcp_reads_refused, damage, reason
):
    root = str(tmp_path)
    older, newest = _write(root, 1, "dcp"), _write(root, 2, "dcp")
    fs, path = ckpt.url_to_fs(newest)
    if damage == "data altered":
        _alter_one_byte(f"{newest}/c0r0/__0_0.distcp")
    elif damage == "data removed":
        fs.rm(f"{path}/c0r0/__0_0.distcp")
    elif damage == "file added":
        fs.copy(f"{path}/c0r0/__0_0.distcp", f"{path}/c0r0/__7_0.distcp")
    elif damage == "replica manifest replaced":
        _rewrite_manifest(f"{newest}/c0r0", round=7)
    else:
        _rewrite_manifest(
            newest,
            **{
                "format unknown": {"format": "zarr"},
                "ranks missing": {"ranks": None},
                "format removed": {"format": None},
            }[damage],
        )
    found = ckpt.choose(root)
    assert found.path == older, found
    assert [d for d, _ in found.skipped] == [newest] and reason in found.skipped[0][1], found.skipped


def test_a_dcp_checkpoint_of_another_config_is_skipped_on_restore_and_named_on_resume(root):
    older = _write(root, 1, "file", fingerprint={"model.n_embd": 32})
    newest = _write(root, 2, "dcp", fingerprint={"model.n_embd": 64})
    skipped = []
    found = ckpt.choose(root, {"model.n_embd": 32}, on_skip=lambda d, why: skipped.append(why))
    assert found.path == older and len(skipped) == 1 and "model.n_embd 64 -> 32" in skipped[0], skipped
    resume = ckpt.choose(root, {"model.n_embd": 32}, skip_other_config=False)
    assert resume.path == newest and resume.config_diff == ("model.n_embd 64 -> 32",) and resume.format == "dcp"


# -- prune: one rule for both formats ------------------------------------------------------------
class SimulatedDeath(BaseException):
    """The writer killed after DCP wrote its files, before the manifest: its temp folder is left."""


def _crashed_dcp_save(root: str, round_index: int, owner: str, monkeypatch) -> str:
    def die(*args, **kwargs):
        raise SimulatedDeath()

    with monkeypatch.context() as patch, pytest.raises(SimulatedDeath):
        patch.setattr(dcp_checkpoint, "_finalize", die)
        _write(root, round_index, "dcp", owner=owner)
    prefix = f"{ckpt.round_dir_name(round_index)}.tmp-{ckpt.safe_owner(owner)}-"
    left = [n for n in ckpt._names(root) if n.startswith(prefix)]
    inside = [ckpt.join_url(ckpt.join_url(root, left[0]), n) for n in ckpt._names(ckpt.join_url(root, left[0]))]
    assert len(left) == 1 and any(".metadata" in ckpt._names(d) for d in inside), (left, inside)
    return left[0]


def test_prune_keeps_the_newest_of_either_format_and_removes_this_runs_dcp_leftovers(root, monkeypatch):
    for r, kind in ((1, "file"), (2, "dcp"), (3, "dcp"), (4, "file"), (5, "dcp")):
        _write(root, r, kind)
    mine = _crashed_dcp_save(root, 6, "run-a", monkeypatch)
    theirs = _crashed_dcp_save(root, 6, "run-b", monkeypatch)  # another run's write in progress
    half = ckpt.join_url(root, ckpt.round_dir_name(3) + "x")  # not a round name: never touched
    fs, path = ckpt.url_to_fs(half)
    fs.makedirs(path, exist_ok=True)
    interrupted = ckpt.join_url(root, "round_000000")  # an object-store copy cut before its manifest
    fs.makedirs(ckpt.url_to_fs(interrupted)[1], exist_ok=True)
    fs.pipe(ckpt.url_to_fs(ckpt.join_url(interrupted, ".metadata"))[1], b"x")

    ckpt.prune(root, keep=3, owner="run-a")
    names = ckpt._names(root)
    kept = [n for n in names if ckpt._round_of(n) is not None]
    assert kept == ["round_000003", "round_000004", "round_000005"], names
    assert theirs in names and mine not in names, f"prune must remove only run-a's leftover: {names}"
    assert "round_000003x" in names, names
    for directory in ckpt.finalized(root):  # the kept ones are whole: prune removed nothing inside them
        ckpt.verify(directory)
    assert [ckpt.checkpoint_format(d) for d in ckpt.finalized(root)] == ["dcp", "file", "dcp"]

    ckpt.prune(root, keep=1, owner="run-a")
    assert [d.rsplit("/", 1)[-1] for d in ckpt.finalized(root)] == ["round_000005"]
    assert ckpt.choose(root).format == "dcp"
