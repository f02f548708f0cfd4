"""Sharded (DCP) checkpoints: a checkpoint written by k=2 FSDP2 ranks loads into k=1 and the other
way round with every full tensor equal (model and AdamW state); nothing DCP would read (its pickled
`.metadata` first) is read before every file matches the manifest; a crash before the rename leaves
nothing under the final name. (Spawns gloo processes: run it under the shared lock.)"""

from __future__ import annotations

import functools
import io
import os
import shutil
import traceback
import warnings

import pytest
import torch

from hsgd.train import dcp_checkpoint
from hsgd.train.checkpoint import CheckpointError
from hsgd.train.dcp_checkpoint import load_sharded, read_manifest, save_sharded
from tests.fakes.gloo_world import run_ranks

SHAPE = dict(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16)
TRAIN_STEPS = 3


# -- one replica of `world` ranks (world 1: plain tensors, no process group) ----------------------
def _replica(seed: int, world: int, group):
    from hsgd.train.model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**SHAPE))
    if world > 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, as FSDP ranks have
    for _ in range(TRAIN_STEPS):
        x = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]), generator=gen)
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt) -> dict:
    """Every full (gathered) tensor of the model and the AdamW state; a collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)  # every rank gets every full tensor
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, opt, options=options)
    out = {f"model/{k}": v.clone() for k, v in model_sd.items()}
    for fqn, slots in optim_sd.get("state", {}).items():
        out.update({f"optim/{fqn}/{slot}": torch.as_tensor(v).clone() for slot, v in slots.items()})
    return out


def _sharded_state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)  # creates AdamW's state on a fresh optimizer
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _apply(model, opt, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class DcpWasCalled(AssertionError):
    pass


def _refusing_dcp_load(*args, **kwargs):
    raise DcpWasCalled("dcp.load was called on a checkpoint that failed verification")


def _failing_saves(root: str, rank: int, group, state: dict) -> dict[str, str]:
    """Two saves that fail on one rank: rank 1's shard write, then rank 0's rename. Returns
    {case: this rank's CheckpointError text} (no error: the case is missing)."""
    import torch.distributed.checkpoint as dcp

    def fail(*args, **kwargs):
        raise OSError("simulated disk failure")

    refusals = {}
    for case, failing_rank, module, name in [
        ("write", 1, dcp.FileSystemWriter, "write_data"),
        ("rename", 0, dcp_checkpoint, "_rename_into_place"),
    ]:
        real = getattr(module, name)
        if rank == failing_rank:
            setattr(module, name, fail)
        try:
            save_sharded(state, os.path.join(root, case), group=group, manifest_extra={"round": 1}, timeout_s=60)
        except CheckpointError as err:
            refusals[case] = str(err)
        finally:
            setattr(module, name, real)
    return refusals


def _worker(job: dict, rank: int, port: int, results) -> None:
    """job: directory, world, mode ('save' | 'load'), seed; 'tampered': a copy to try (and be
    refused on) before the load, with dcp.load made to raise meanwhile."""
    out = {"rank": rank}
    try:
        from datetime import timedelta

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        world, group = job["world"], None
        if world > 1:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
            group = dist.group.WORLD
        model, opt = _replica(job["seed"], world, group)
        if job["mode"] == "failing_saves":
            out["refusals"] = _failing_saves(job["directory"], rank, group, _sharded_state(model, opt, 0))
        elif job["mode"] == "save":
            _train(model, opt, rank)
            out["manifest"] = save_sharded(
                _sharded_state(model, opt, TRAIN_STEPS),
                job["directory"],
                group=group,
                manifest_extra={"round": 1, "step": TRAIN_STEPS},
                timeout_s=60,
            )
        else:
            if job.get("tampered"):
                real_load, dcp.load = dcp.load, _refusing_dcp_load
                try:
                    load_sharded(_sharded_state(model, opt, 0), job["tampered"], group=group, timeout_s=60)
                except CheckpointError as err:
                    out["refusal"] = str(err)
                finally:
                    dcp.load = real_load
            before = _full(model, opt)
            state = _sharded_state(model, opt, 0)
            out["manifest"] = load_sharded(state, job["directory"], group=group, timeout_s=60)
            _apply(model, opt, state)
            out["step"] = state["step"]
        full = _full(model, opt)  # a collective under FSDP2: every rank calls it
        if job["mode"] == "load":
            out["changed"] = any(not torch.equal(v, before[k]) for k, v in full.items() if k in before)
        if rank == 0:  # as bytes: a tensor through the queue is a shared-memory handle that dies with us
            buffer = io.BytesIO()
            torch.save(full, buffer)
            out["full"] = buffer.getvalue()
        if group is not None:  # a peer's gather may still be in flight (the group's 60 s timeout bounds it)
            dist.barrier(group)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


def _run(world: int, **job) -> dict[int, dict]:
    outs = run_ranks(functools.partial(_worker, {"world": world, **job}), world, timeout_s=180, join_s=10)
    outs[0]["full"] = torch.load(io.BytesIO(outs[0]["full"]), weights_only=True)
    return outs


def _assert_same_tensors(saved: dict, loaded: dict, what: str) -> None:
    assert sorted(saved) == sorted(loaded), f"{what}: other tensors: {sorted(set(saved) ^ set(loaded))}"
    assert any(k.startswith("optim/") for k in saved), f"{what}: no AdamW state was compared"
    for name, tensor in saved.items():
        assert torch.equal(tensor, loaded[name]), f"{what}: {name} differs after the resharded load"


def _alter_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """k=2 -> k=1 and k=1 -> k=2, each a save in one set of processes and a load in another; the
    k=2 load first tries a copy with one byte of `.metadata` altered."""
    root = tmp_path_factory.mktemp("dcp")
    by_two, by_one, tampered = str(root / "by_two"), str(root / "by_one"), root / "tampered"
    saved_by_two = _run(2, directory=by_two, mode="save", seed=0)
    loaded_by_one = _run(1, directory=by_two, mode="load", seed=7)
    saved_by_one = _run(1, directory=by_one, mode="save", seed=1)
    shutil.copytree(by_one, tampered)
    _alter_one_byte(tampered / ".metadata")
    loaded_by_two = _run(2, directory=by_one, mode="load", seed=8, tampered=str(tampered))
    return dict(
        by_two=by_two,
        saved_by_two=saved_by_two,
        loaded_by_one=loaded_by_one,
        saved_by_one=saved_by_one,
        loaded_by_two=loaded_by_two,
    )


@pytest.fixture(scope="module")
def failing_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp_failing")
    return root, _run(2, directory=str(root), mode="failing_saves", seed=0)


@pytest.fixture
def plain_checkpoint(tmp_path):
    """A checkpoint of a world of one written in this process, and its state's full tensors."""
    model, opt = _replica(3, 1, None)
    _train(model, opt, 0)
    directory = tmp_path / "round_000001"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save_sharded(_sharded_state(model, opt, TRAIN_STEPS), str(directory), group=None, manifest_extra={"round": 1})
    return directory, _full(model, opt)


def _load_plain(directory) -> dict:
    model, opt = _replica(9, 1, None)
    state = _sharded_state(model, opt, 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load_sharded(state, str(directory), group=None)
    _apply(model, opt, state)
    return {"full": _full(model, opt), "step": state["step"]}


# -- a: a resume may change k ---------------------------------------------------------------------
def test_a_checkpoint_written_by_two_ranks_loads_into_one_with_every_tensor_equal(resharded):
    saved, loaded = resharded["saved_by_two"], resharded["loaded_by_one"]
    assert saved[0]["manifest"] == saved[1]["manifest"], "the two ranks returned different manifests"
    assert saved[0]["manifest"]["ranks"] == 2
    assert sorted(saved[0]["manifest"]["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"], (
        "one data file per rank plus DCP's .metadata, each with its sha256"
    )
    assert loaded[0]["changed"], "the load left the fresh model as it was"
    assert loaded[0]["step"] == TRAIN_STEPS
    _assert_same_tensors(saved[0]["full"], loaded[0]["full"], "k=2 -> k=1")


def test_a_checkpoint_written_by_one_rank_loads_into_two_fsdp_ranks_with_every_tensor_equal(resharded):
    saved, loaded = resharded["saved_by_one"], resharded["loaded_by_two"]
    assert saved[0]["manifest"]["ranks"] == 1
    assert loaded[0]["changed"] and loaded[0]["step"] == loaded[1]["step"] == TRAIN_STEPS
    _assert_same_tensors(saved[0]["full"], loaded[0]["full"], "k=1 -> k=2")


def test_the_manifest_carries_the_callers_fields_and_every_files_sha256(resharded):
    import hashlib

    manifest = read_manifest(resharded["by_two"])
    assert manifest["round"] == 1 and manifest["step"] == TRAIN_STEPS and manifest["format"] == "dcp"
    for name, sha in manifest["files"].items():
        with open(os.path.join(resharded["by_two"], name), "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest() == sha, f"{name}: the manifest's sha256 is not the file's"


# -- b: an altered .metadata is refused before DCP reads it -----------------------------------------
def test_an_altered_metadata_is_refused_on_every_rank_before_dcp_reads_it(resharded):
    # .metadata is rank 1's share to hash: rank 0 refuses through the all-reduce, naming it too
    for rank, out in resharded["loaded_by_two"].items():
        assert "refusal" in out, f"rank {rank}: the altered .metadata was not refused (or DCP was called)"
        assert ".metadata is altered" in out["refusal"], f"rank {rank}: {out['refusal']}"


def test_an_altered_metadata_is_refused_in_a_world_of_one_before_dcp_reads_it(plain_checkpoint, monkeypatch):
    import torch.distributed.checkpoint as dcp

    directory, _ = plain_checkpoint
    _alter_one_byte(directory / ".metadata")
    monkeypatch.setattr(dcp, "load", _refusing_dcp_load)
    with pytest.raises(CheckpointError, match=r"refused before loading: \.metadata is altered"):
        _load_plain(directory)


# -- c: a data file altered, removed, or one added -------------------------------------------------
@pytest.mark.parametrize(
    "damage, named, problem",
    [
        ("alter", "__0_0.distcp", "altered"),
        ("remove", "__0_0.distcp", "missing"),
        ("extra", "__9_0.distcp", "not in the manifest"),
        ("unreadable", "__0_0.distcp", "unreadable"),
    ],
)
def test_a_damaged_folder_is_refused_naming_the_file(plain_checkpoint, monkeypatch, damage, named, problem):
    import torch.distributed.checkpoint as dcp

    directory, _ = plain_checkpoint
    if damage == "alter":
        _alter_one_byte(directory / named)
    elif damage == "remove":
        (directory / named).unlink()
    elif damage == "extra":
        shutil.copy(directory / "__0_0.distcp", directory / named)
    else:  # an I/O error while hashing it (root reads any file: a permission bit would not do)
        real_sha256 = dcp_checkpoint._sha256

        def failing_sha256(url):
            if url.endswith(named):
                raise OSError("input/output error")
            return real_sha256(url)

        monkeypatch.setattr(dcp_checkpoint, "_sha256", failing_sha256)
    monkeypatch.setattr(dcp, "load", _refusing_dcp_load)
    with pytest.raises(CheckpointError) as refused:
        _load_plain(directory)
    assert f"{named} is {problem}" in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_an_intact_folder_loads_every_tensor_back(plain_checkpoint):
    directory, saved = plain_checkpoint
    loaded = _load_plain(directory)
    assert loaded["step"] == TRAIN_STEPS
    _assert_same_tensors(saved, loaded["full"], "k=1 -> k=1")


# -- d: nothing half-written under the final name -------------------------------------------------
class SimulatedDeath(BaseException):
    """A process killed between writing and renaming: no handler of the module runs."""


@pytest.mark.parametrize("crash", [OSError("disk full"), SimulatedDeath()], ids=["error", "death"])
def test_a_crash_before_the_rename_leaves_nothing_under_the_final_name(tmp_path, monkeypatch, crash):
    def crash_instead(temp_path, final_path):
        raise crash

    monkeypatch.setattr(dcp_checkpoint, "_rename_into_place", crash_instead)
    model, opt = _replica(3, 1, None)
    directory = tmp_path / "round_000002"
    with warnings.catch_warnings(), pytest.raises((CheckpointError, SimulatedDeath)):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save_sharded(
            _sharded_state(model, opt, 0), str(directory), group=None, manifest_extra={"round": 2}, owner="run1"
        )
    assert not directory.exists(), "a checkpoint is visible under its final name without its rename"
    left = sorted(p.name for p in tmp_path.iterdir())
    if isinstance(crash, SimulatedDeath):  # the temp folder is left for checkpoint.prune, never read
        assert len(left) == 1 and left[0].startswith("round_000002.tmp-run1-"), left
        assert (tmp_path / left[0] / ".metadata").exists(), "the crash was meant to come after DCP wrote"
    else:  # rank 0 alive: it removes its temp folder
        assert left == [], left


@pytest.mark.parametrize("case, failing_rank", [("write", 1), ("rename", 0)])
def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(failing_saves, case, failing_rank):
    root, outs = failing_saves
    for rank, out in outs.items():
        assert case in out["refusals"], f"rank {rank} returned from a save whose rank {failing_rank} failed"
        assert "\n" not in out["refusals"][case], f"rank {rank}: not one line: {out['refusals'][case]}"
    assert "OSError: simulated disk failure" in outs[0]["refusals"][case], outs[0]["refusals"][case]
    if case == "write":  # DCP carries rank 1's error to rank 0, which names the rank
        assert "rank 1: OSError: simulated disk failure" in outs[0]["refusals"][case], outs[0]["refusals"][case]
    else:  # rank 1 hears of rank 0's failure at the barrier
        assert "rank 0 failed to finalize" in outs[1]["refusals"][case], outs[1]["refusals"][case]
    assert sorted(p.name for p in root.iterdir()) == [], "a final or temp folder was left by the failed saves"


def test_an_existing_checkpoint_is_never_overwritten(plain_checkpoint):
    directory, _ = plain_checkpoint
    before = read_manifest(str(directory))
    model, opt = _replica(4, 1, None)
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match="already exists"):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save_sharded(_sharded_state(model, opt, 0), str(directory), group=None, manifest_extra={"round": 1})
    assert read_manifest(str(directory)) == before
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name], "a temp folder was left"


def test_manifest_extra_may_not_set_the_keys_save_writes(tmp_path):
    model, opt = _replica(4, 1, None)
    with pytest.raises(ValueError, match="manifest_extra may not set \\['files'\\]"):
        save_sharded(_sharded_state(model, opt, 0), str(tmp_path / "x"), group=None, manifest_extra={"files": {}})


# -- fsspec URLs, as checkpoint.dir may be -----------------------------------------------------------
def test_a_url_checkpoint_round_trips_through_dcps_fsspec_writer():
    import fsspec

    model, opt = _replica(5, 1, None)
    _train(model, opt, 0)
    url = "memory://hsgd-dcp-test/round_000003"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            manifest = save_sharded(
                _sharded_state(model, opt, TRAIN_STEPS), url, group=None, manifest_extra={"round": 3}
            )
            assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
            fs = fsspec.filesystem("memory")
            assert [p for p in fs.ls("/hsgd-dcp-test", detail=False) if ".tmp-" in p] == [], "temp left behind"
            fresh, fresh_opt = _replica(6, 1, None)
            state = _sharded_state(fresh, fresh_opt, 0)
            load_sharded(state, url, group=None)
        finally:
            fsspec.filesystem("memory").rm("/hsgd-dcp-test", recursive=True)
    _apply(fresh, fresh_opt, state)
    _assert_same_tensors(_full(model, opt), _full(fresh, fresh_opt), "memory:// URL")
