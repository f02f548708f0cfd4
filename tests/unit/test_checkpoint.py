"""hsgd.train.checkpoint: atomic, verifiable checkpoints that load without executing code."""
import builtins
import os
import pickle

import pytest
import torch

from hsgd.train import checkpoint as ckpt
from hsgd.train.checkpoint import CheckpointError


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"rid": "c0r0", "round": 5, "step": 100, "params": [torch.randn(3, 4, generator=g), torch.randn(7, generator=g)],
            "inner_opt": {"state": {}, "param_groups": [{"lr": 0.003, "params": [0, 1]}]},
            "round_losses": [1.5, 1.25]}


def _write_checkpoint(root, round_index, rids=("c0r0", "c1r0")):
    tmp = ckpt.new_temp_dir(root, round_index)
    files = {rid: ckpt.save_replica_state(tmp, rid, _state(i)) for i, rid in enumerate(rids)}
    return ckpt.finalize(tmp, {"round": round_index, "step": round_index * 20, "files": files},
                         {rid: round_index for rid in rids})


def test_save_finalize_latest_load_round_trip(tmp_path):
    final = _write_checkpoint(tmp_path, 5)
    assert final == tmp_path / "round_000005"
    assert ckpt.latest(tmp_path) == final
    manifest = ckpt.read_manifest(final)
    assert manifest["round"] == 5 and set(manifest["files"]) == {"c0r0", "c1r0"}
    for i, rid in enumerate(("c0r0", "c1r0")):
        loaded = ckpt.load_replica_state(final, rid, manifest["files"][rid])
        want = _state(i)
        assert loaded["round"] == want["round"] and loaded["round_losses"] == want["round_losses"]
        assert all(torch.equal(a, b) for a, b in zip(loaded["params"], want["params"])), "params must load bitwise"
    assert not list(tmp_path.glob("*.tmp-*")), "the temp directory is renamed into place by finalize"


def test_save_returns_the_sha256_of_the_file(tmp_path):
    import hashlib
    digest = ckpt.save_replica_state(tmp_path, "c0r1", _state())
    assert digest == hashlib.sha256((tmp_path / "c0r1.pt").read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0r1.pt"], "no temp file may be left behind"


def test_latest_is_none_without_checkpoints(tmp_path):
    assert ckpt.latest(tmp_path / "missing") is None
    assert ckpt.latest(tmp_path) is None


def test_latest_ignores_temp_dirs_and_dirs_without_manifest(tmp_path):
    good = _write_checkpoint(tmp_path, 3)
    crashed = ckpt.new_temp_dir(tmp_path, 9)  # interrupted write of a newer round
    ckpt.save_replica_state(crashed, "c0r0", _state())
    ckpt.atomic_write_text(crashed / ckpt.MANIFEST, '{"round": 9}')  # even with a manifest inside
    (tmp_path / "round_000007").mkdir()  # no manifest: never finalized
    assert ckpt.latest(tmp_path) == good, "latest must only return a finalized checkpoint"


def test_latest_picks_the_newest_round(tmp_path):
    for r in (5, 10, 2):
        _write_checkpoint(tmp_path, r)
    assert ckpt.latest(tmp_path).name == "round_000010"


def test_corrupt_file_is_a_clear_error_when_sha256_given(tmp_path):
    final = _write_checkpoint(tmp_path, 1)
    sha = ckpt.read_manifest(final)["files"]["c0r0"]
    path = final / "c0r0.pt"
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        ckpt.load_replica_state(final, "c0r0", sha)


def test_truncated_file_is_a_checkpoint_error_even_without_sha256(tmp_path):
    path = tmp_path / "c0r0.pt"
    ckpt.save_replica_state(tmp_path, "c0r0", _state())
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
        _write_checkpoint(tmp_path, r)
    leftover = ckpt.new_temp_dir(tmp_path, 5)
    ckpt.save_replica_state(leftover, "c0r0", _state())
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000003", "round_000004"]
    assert ckpt.latest(tmp_path).name == "round_000004"


def test_prune_of_missing_root_is_a_no_op(tmp_path):
    ckpt.prune(tmp_path / "missing", keep=1)


def test_atomic_write_text_leaves_no_temp_files(tmp_path):
    target = tmp_path / "state.json"
    ckpt.atomic_write_text(target, "one")
    ckpt.atomic_write_text(target, "two\nlines ü")
    assert target.read_text(encoding="utf-8") == "two\nlines ü"
    assert os.listdir(tmp_path) == ["state.json"], "atomic writes must not leave temp files behind"


def test_round_dir_names_sort_in_round_order():
    names = [ckpt.round_dir_name(r) for r in (2, 10, 100, 999)]
    assert names == sorted(names) and names[0] == "round_000002"


def test_a_checkpoint_is_never_overwritten(tmp_path):
    first = _write_checkpoint(tmp_path, 3)
    before = (first / "manifest.json").read_text()
    with pytest.raises(CheckpointError, match="never overwritten"):
        _write_checkpoint(tmp_path, 3)
    assert (first / "manifest.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "the refused temp dir must be removed"
    assert ckpt.exists(tmp_path, 3) and not ckpt.exists(tmp_path, 4)


def test_finalize_refuses_replicas_at_another_round(tmp_path):
    tmp = ckpt.new_temp_dir(tmp_path, 5)
    files = {rid: ckpt.save_replica_state(tmp, rid, _state(i)) for i, rid in enumerate(("c0r0", "c0r1"))}
    with pytest.raises(CheckpointError, match="another round"):
        ckpt.finalize(tmp, {"round": 5, "step": 100, "files": files}, {"c0r0": 5, "c0r1": 0})
    assert ckpt.latest(tmp_path) is None


def test_finalize_refuses_a_manifest_naming_a_missing_file(tmp_path):
    tmp = ckpt.new_temp_dir(tmp_path, 2)
    files = {"c0r0": ckpt.save_replica_state(tmp, "c0r0", _state()), "c0r1": "0" * 64}
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.finalize(tmp, {"round": 2, "step": 40, "files": files}, {"c0r0": 2, "c0r1": 2})


def test_prune_keeps_the_newest_final_checkpoint_even_with_keep_zero(tmp_path):
    for r in (1, 2, 3):
        _write_checkpoint(tmp_path, r)
    ckpt.prune(tmp_path, 0)
    assert ckpt.latest(tmp_path).name == "round_000003"


def test_finalize_refuses_a_file_whose_replica_never_reported_its_round(tmp_path):
    """A file is there but its writer's answer was lost: it may hold another round's state."""
    tmp = ckpt.new_temp_dir(tmp_path, 5)
    files = {rid: ckpt.save_replica_state(tmp, rid, _state(i)) for i, rid in enumerate(("c0r0", "c0r1"))}
    with pytest.raises(CheckpointError, match="never reported.*c0r1"):
        ckpt.finalize(tmp, {"round": 5, "step": 100, "files": files}, {"c0r0": 5})
    assert ckpt.latest(tmp_path) is None and not list(tmp_path.iterdir()), "the refused temp dir must be removed"
