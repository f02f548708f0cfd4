"""hsgd.train.checkpoint: atomic, verifiable checkpoints that load without executing code."""

import builtins
import hashlib
import json
import os
import pickle
import uuid
from pathlib import Path

import pytest
import torch

from hsgd.record.rundir import atomic_write_text
from hsgd.train import checkpoint as ckpt
from hsgd.train.checkpoint import CheckpointError
from tests.fakes.checkpoint_states import replica_state, write_checkpoint


def test_save_finalize_list_load_round_trip(tmp_path):
    final = write_checkpoint(tmp_path, 5)
    assert final == tmp_path / "round_000005"
    assert Path(ckpt.finalized(tmp_path)[-1]) == final
    manifest = ckpt.read_manifest(final)
    assert manifest["round"] == 5 and set(manifest["files"]) == {"c0r0", "c1r0"}
    for i, rid in enumerate(("c0r0", "c1r0")):
        loaded = ckpt.load_replica_state(final, rid, manifest["files"][rid])
        want = replica_state(i)
        assert loaded["round"] == want["round"] and loaded["round_losses"] == want["round_losses"]
        assert all(torch.equal(a, b) for a, b in zip(loaded["params"], want["params"], strict=True)), (
            "params must load bitwise"
        )
    assert not list(tmp_path.glob("*.tmp-*")), "the temp directory is renamed into place by finalize"


def test_save_returns_the_sha256_of_the_file(tmp_path):
    digest = ckpt.save_replica_state(tmp_path, "c0r1", replica_state())
    assert digest == hashlib.sha256((tmp_path / "c0r1.pt").read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0r1.pt"], "no temp file may be left behind"


def test_finalized_is_empty_without_checkpoints(tmp_path):
    assert ckpt.finalized(tmp_path / "missing") == []
    assert ckpt.finalized(tmp_path) == []


def test_finalized_ignores_temp_dirs_and_dirs_without_manifest(tmp_path):
    good = write_checkpoint(tmp_path, 3)
    crashed = Path(ckpt.new_temp_dir(tmp_path, 9))  # interrupted write of a newer round
    ckpt.save_replica_state(crashed, "c0r0", replica_state())
    atomic_write_text(crashed / ckpt.MANIFEST, '{"round": 9, "files": {}}')  # even with a manifest inside
    (tmp_path / "round_000007").mkdir()  # no manifest: never finalized
    assert Path(ckpt.finalized(tmp_path)[-1]) == good, "only a finalized checkpoint counts"


def test_finalized_picks_the_newest_round(tmp_path):
    for r in (5, 10, 2):
        write_checkpoint(tmp_path, r)
    assert ckpt.finalized(tmp_path)[-1].endswith("/round_000010")


def test_corrupt_file_is_a_clear_error_when_sha256_given(tmp_path):
    final = write_checkpoint(tmp_path, 1)
    sha = ckpt.read_manifest(final)["files"]["c0r0"]
    path = final / "c0r0.pt"
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        ckpt.load_replica_state(final, "c0r0", sha)


def test_truncated_file_is_a_checkpoint_error_even_without_sha256(tmp_path):
    path = tmp_path / "c0r0.pt"
    ckpt.save_replica_state(tmp_path, "c0r0", replica_state())
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError):
        ckpt.load_replica_state(tmp_path, "c0r0")


def test_unreadable_manifest_is_a_checkpoint_error(tmp_path):
    (tmp_path / ckpt.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest"):
        ckpt.read_manifest(tmp_path)
    with pytest.raises(CheckpointError):
        ckpt.read_manifest(tmp_path / "nowhere")


class _Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


def test_checkpoint_with_code_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"params": [torch.zeros(2)], "evil": _Payload(marker)}, tmp_path / "c0r0.pt")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="safely"):
        ckpt.load_replica_state(tmp_path, "c0r0")
    assert not marker.exists(), "SECURITY: loading a checkpoint executed code (weights_only must be on)"


def test_code_payload_is_live_so_the_refusal_test_means_something(tmp_path):
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists(), "the payload used above must actually run code when unpickled unsafely"


def test_prune_keeps_newest_n_and_removes_temp_dirs(tmp_path):
    for r in (1, 2, 3, 4):
        write_checkpoint(tmp_path, r)
    leftover = ckpt.new_temp_dir(tmp_path, 5, owner="run-a")
    ckpt.save_replica_state(leftover, "c0r0", replica_state())
    ckpt.prune(tmp_path, keep=2, owner="run-a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000003", "round_000004"]
    assert ckpt.finalized(tmp_path)[-1].endswith("/round_000004")


def test_prune_of_missing_root_is_a_no_op(tmp_path):
    ckpt.prune(tmp_path / "missing", keep=1)


def test_atomic_write_text_leaves_no_temp_files(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two\nlines ü")
    assert target.read_text(encoding="utf-8") == "two\nlines ü"
    assert os.listdir(tmp_path) == ["state.json"], "atomic writes must not leave temp files behind"


def test_round_dir_names_sort_in_round_order():
    names = [ckpt.round_dir_name(r) for r in (2, 10, 100, 999)]
    assert names == sorted(names) and names[0] == "round_000002"


def test_a_checkpoint_is_never_overwritten(tmp_path):
    first = write_checkpoint(tmp_path, 3)
    before = (first / "manifest.json").read_text()
    with pytest.raises(CheckpointError, match="never overwritten"):
        write_checkpoint(tmp_path, 3)
    assert (first / "manifest.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "the refused temp dir must be removed"
    assert ckpt.exists(tmp_path, 3) and not ckpt.exists(tmp_path, 4)


def test_finalize_refuses_replicas_at_another_round(tmp_path):
    tmp = ckpt.new_temp_dir(tmp_path, 5, owner="run-a")
    files = {rid: ckpt.save_replica_state(tmp, rid, replica_state(i)) for i, rid in enumerate(("c0r0", "c0r1"))}
    with pytest.raises(CheckpointError, match="another round"):
        ckpt.finalize(tmp, {"round": 5, "step": 100, "files": files}, {"c0r0": 5, "c0r1": 0})
    assert ckpt.finalized(tmp_path) == []


def test_finalize_refuses_a_manifest_naming_a_missing_file(tmp_path):
    tmp = ckpt.new_temp_dir(tmp_path, 2, owner="run-a")
    files = {"c0r0": ckpt.save_replica_state(tmp, "c0r0", replica_state()), "c0r1": "0" * 64}
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.finalize(tmp, {"round": 2, "step": 40, "files": files}, {"c0r0": 2, "c0r1": 2})


def test_prune_keeps_the_newest_final_checkpoint_even_with_keep_zero(tmp_path):
    for r in (1, 2, 3):
        write_checkpoint(tmp_path, r)
    ckpt.prune(tmp_path, 0)
    assert ckpt.finalized(tmp_path)[-1].endswith("/round_000003")


def test_finalize_refuses_a_file_whose_replica_never_reported_its_round(tmp_path):
    """A file is there but its writer's answer was lost: it may hold another round's state."""
    tmp = ckpt.new_temp_dir(tmp_path, 5, owner="run-a")
    files = {rid: ckpt.save_replica_state(tmp, rid, replica_state(i)) for i, rid in enumerate(("c0r0", "c0r1"))}
    with pytest.raises(CheckpointError, match="never reported.*c0r1"):
        ckpt.finalize(tmp, {"round": 5, "step": 100, "files": files}, {"c0r0": 5})
    assert ckpt.finalized(tmp_path) == [] and not list(tmp_path.iterdir()), "the refused temp dir must be removed"


# -- fsspec storage: the same protocol on a local path, a file:// URL and an object store (memory://) ---
@pytest.fixture(params=["path", "file", "memory"])
def root(request, tmp_path):
    """A checkpoint root as a plain path, a file:// URL, or fsspec's in-process memory store (no
    atomic rename: the manifest written last is the commit point)."""
    url = {
        "path": str(tmp_path / "ckpts"),
        "file": f"file://{tmp_path}/ckpts",
        "memory": f"memory://hsgd-test-{uuid.uuid4().hex[:8]}/ckpts",
    }[request.param]
    yield url
    ckpt.remove(url)


def _corrupt(url: str, how: str) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    data = fs.cat_file(path)
    data = (
        data[: len(data) // 3]
        if how == "truncate"
        else data[:100] + bytes(b ^ 0xFF for b in data[100:108]) + data[108:]
    )
    with fs.open(path, "wb") as f:
        f.write(data)


def test_round_trip_on_every_storage(root):
    final = ckpt.finalize(*_temp_with_files(root, 4), {"c0r0": 4, "c1r0": 4})
    assert final.rstrip("/").endswith("round_000004") and ckpt.finalized(root)[-1] == final
    assert ckpt.exists(root, 4) and not ckpt.exists(root, 5)
    manifest = ckpt.verify(final)
    for i, rid in enumerate(("c0r0", "c1r0")):
        loaded = ckpt.load_replica_state(final, rid, manifest["files"][rid])
        assert all(torch.equal(a, b) for a, b in zip(loaded["params"], replica_state(i)["params"], strict=True)), (
            f"{rid} not bitwise"
        )
    assert [n for n in ckpt._names(root) if ".tmp-" in n] == [], "the temp directory must be gone after finalize"


def _temp_with_files(root, round_index, owner="run-a", rids=("c0r0", "c1r0")):
    tmp = ckpt.new_temp_dir(root, round_index, owner=owner)
    files = {rid: ckpt.save_replica_state(tmp, rid, replica_state(i)) for i, rid in enumerate(rids)}
    return tmp, {"round": round_index, "step": round_index * 20, "files": files}


def test_a_manifest_less_directory_is_not_a_checkpoint_on_every_storage(root):
    """Object stores: files copied, manifest not yet written (a crash mid-commit) = no checkpoint."""
    good = ckpt.finalize(*_temp_with_files(root, 2), {"c0r0": 2, "c1r0": 2})
    half = f"{root}/round_000003"
    fs, path = ckpt.url_to_fs(half)
    fs.makedirs(path, exist_ok=True)
    ckpt.save_replica_state(half, "c0r0", replica_state())
    assert ckpt.finalized(root)[-1] == good and not ckpt.exists(root, 3)


def test_final_checkpoint_is_never_overwritten_on_every_storage(root):
    first = ckpt.finalize(*_temp_with_files(root, 3), {"c0r0": 3, "c1r0": 3})
    before = ckpt.read_manifest(first)
    tmp, manifest = _temp_with_files(root, 3)
    manifest["t"] = "second"
    with pytest.raises(CheckpointError, match="never overwritten"):
        ckpt.finalize(tmp, manifest, {"c0r0": 3, "c1r0": 3})
    assert ckpt.read_manifest(first) == before
    assert [n for n in ckpt._names(root) if ".tmp-" in n] == []


@pytest.mark.parametrize("damage", ["bad manifest", "sha mismatch", "truncated"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(root, damage):
    older = ckpt.finalize(*_temp_with_files(root, 2), {"c0r0": 2, "c1r0": 2})
    newest = ckpt.finalize(*_temp_with_files(root, 4), {"c0r0": 4, "c1r0": 4})
    if damage == "bad manifest":
        import fsspec

        fs, path = fsspec.core.url_to_fs(f"{newest}/{ckpt.MANIFEST}")
        with fs.open(path, "wb") as f:
            f.write(b'{"round": 4, "files": {"c0r0": ')
    else:
        _corrupt(f"{newest}/c1r0.pt", "truncate" if damage == "truncated" else "flip")
    skipped = []
    found = ckpt.choose(root, on_skip=lambda d, why: skipped.append((d, why)))
    assert found.path == older and found.manifest["round"] == 2, f"no fallback to {older}: {found}"
    assert list(found.skipped) == skipped
    assert [d for d, _ in skipped] == [newest], skipped
    assert ("manifest" in skipped[0][1]) if damage == "bad manifest" else ("sha256" in skipped[0][1]), skipped
    with pytest.raises(CheckpointError):
        ckpt.verify(newest)


def test_no_good_checkpoint_at_all_is_none(root):
    only = ckpt.finalize(*_temp_with_files(root, 1), {"c0r0": 1, "c1r0": 1})
    _corrupt(f"{only}/c0r0.pt", "truncate")
    assert ckpt.choose(root).path is None
    assert ckpt.choose(f"{root}/nothing-here").path is None


def test_choose_skips_a_checkpoint_of_another_config_or_names_the_difference(root):
    older = ckpt.finalize(*_temp_with_files(root, 1), {"c0r0": 1, "c1r0": 1})
    newest = ckpt.finalize(*_temp_with_files(root, 2), {"c0r0": 2, "c1r0": 2})
    _set_fingerprint(newest, {"model.n_embd": 64})
    skipped = []
    found = ckpt.choose(root, {"model.n_embd": 32}, on_skip=lambda d, why: skipped.append(why))
    assert found.path == older and len(skipped) == 1 and "model.n_embd 64 -> 32" in skipped[0], skipped
    refused = ckpt.choose(root, {"model.n_embd": 32}, skip_other_config=False)  # a resume: chosen, the caller refuses
    assert refused.path == newest and refused.config_diff == ("model.n_embd 64 -> 32",)


def _set_fingerprint(directory, fingerprint):
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{directory}/{ckpt.MANIFEST}")
    manifest = ckpt.read_manifest(directory)
    with fs.open(path, "wb") as f:
        f.write(json.dumps({**manifest, "fingerprint": fingerprint}).encode())


def test_prune_removes_only_this_runs_temp_folders(root):
    for r in (1, 2, 3):
        ckpt.finalize(*_temp_with_files(root, r), {"c0r0": r, "c1r0": r})
    mine, _ = _temp_with_files(root, 4, owner="run-a")
    theirs, _ = _temp_with_files(root, 4, owner="run-b")  # another run writing into the same root right now
    ckpt.prune(root, keep=2, owner="run-a")
    names = ckpt._names(root)
    assert theirs.rsplit("/", 1)[-1] in names, f"prune removed another run's write in progress: {names}"
    assert mine.rsplit("/", 1)[-1] not in names, "prune must remove this run's leftover"
    assert [n for n in names if ".tmp-" not in n] == ["round_000002", "round_000003"], names
    ckpt.prune(root, keep=2)  # no owner: no temp folder is anybody's to remove
    assert theirs.rsplit("/", 1)[-1] in ckpt._names(root)


def test_reach_nonce_round_trip(root):
    url, nonce = ckpt.write_reach_nonce(root, "run-a")
    assert ckpt.read_reach_nonce(url, nonce) is None
    assert "another nonce" in ckpt.read_reach_nonce(url, "0" * 32)
    ckpt.remove(url)
    assert ckpt.read_reach_nonce(url, nonce) is not None, "an unreachable nonce must be reported"


def test_root_url_defaults_to_the_run_folder(tmp_path):
    assert ckpt.root_url(None, tmp_path) == str(tmp_path / "checkpoints")
    assert ckpt.root_url("s3://bucket/x", tmp_path) == "s3://bucket/x"


# -- the config fingerprint ---------------------------------------------------------------------
def _cfg(**over):
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    cfg = OmegaConf.structured(HsgdConfig)
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_fingerprint_names_what_a_resume_may_not_change():
    base = ckpt.fingerprint(_cfg())
    json.dumps(base)  # it goes into the manifest
    for field, value in [
        ("model.n_embd", 64),
        ("model.n_layer", 7),
        ("model.n_head", 8),
        ("model.block_size", 16),
        ("model._target_", "x.y"),
        ("data.vocab_size", 99),
        ("sync.inner", "localsgd"),
        ("sync.outer", "average"),
        ("sync.outer_every", 7),
        ("optim.inner.name", "sgd"),
        ("optim.outer.lr", 0.5),
        ("optim.outer.momentum", 0.1),
        ("optim.outer.nesterov", False),
    ]:
        diff = ckpt.fingerprint_diff(base, ckpt.fingerprint(_cfg(**{field: value})))
        assert len(diff) == 1 and diff[0].startswith(field + " "), f"{field}: {diff}"


def test_fingerprint_ignores_what_a_resume_may_change():
    # an auto (null) outer step follows the rounds; a resume adopts the recorded one (tests/unit/test_auto_defaults.py)
    pinned = {"optim.outer.lr": 1.0, "optim.outer.momentum": 0.3}
    base = ckpt.fingerprint(_cfg(**pinned))
    changed = _cfg(
        **pinned,
        **{
            "topology.clusters": 3,
            "topology.replicas_per_cluster": 1,
            "train.rounds": 99,
            "comm.timeout_s": 3.0,
            "supervisor.phase_timeout_s": 9.0,
            "logging.progress": False,
            "faults.mtbf_s": 5.0,
            "checkpoint.every": 1,
            "optim.inner.lr": 0.1,
            "seed": 3,
        },
    )
    assert ckpt.fingerprint_diff(base, ckpt.fingerprint(changed)) == []


def test_fingerprint_has_the_data_path_and_size(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("abc" * 100)
    first = ckpt.fingerprint(_cfg(**{"data.path": str(data)}))
    assert first["data.size"] == 300 and first["data.path"] == str(data)
    data.write_text("abc" * 101)
    diff = ckpt.fingerprint_diff(first, ckpt.fingerprint(_cfg(**{"data.path": str(data)})))
    assert diff == ["data.size 300 -> 303"], diff


def test_a_manifest_without_fingerprint_is_not_checked():
    assert ckpt.fingerprint_diff(None, ckpt.fingerprint(_cfg())) == []
