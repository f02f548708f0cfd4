"""hsgd.train.state_stream: a `full` heal over the process group (issue 20, Build 7 / Acceptance 6).

Without processes: chunk plans cover every byte once, packing and unpacking round-trip bitwise for
every dtype, the meta refuses what is not a state. With two processes over gloo (one spawned
session; run it under the shared lock): a ReplicaTrainer healed over the group holds exactly the
state a load through state_dict (the object-store path) gives, with chunks far smaller than its
tensors and with one chunk; and a source that dies mid-stream fails the target with
CollectiveError, its own state untouched.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
import traceback

import pytest
import torch

from hsgd.train.comm import CollectiveError, LevelGroup
from hsgd.train.state_stream import (
    Piece,
    StreamError,
    TensorSpec,
    chunk_length,
    decode_meta,
    encode_meta,
    join_state,
    pack_chunk,
    plan_chunks,
    split_state,
    unpack_chunk,
)
from tests.fakes.deadlines import HANG_S
from tests.fakes.gloo_world import run_ranks


# -- no processes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes,chunk",
    [([10, 3, 0, 25], 8), ([100], 7), ([1, 1, 1], 64), ([64, 64], 64), ([], 5), ([0, 0], 4), ([5, 17, 2, 40, 9], 16)],
)
def test_a_chunk_plan_covers_every_byte_once_in_full_chunks(sizes, chunk):
    plan = plan_chunks(sizes, chunk)
    covered = {i: [] for i in range(len(sizes))}
    for k, pieces in enumerate(plan):
        length = chunk_length(pieces)
        assert 0 < length <= chunk, f"chunk {k} holds {length} bytes (limit {chunk})"
        if k < len(plan) - 1:
            assert length == chunk, f"chunk {k} is not full: only the last may be short"
        offset = 0
        for p in pieces:
            assert p.chunk_offset == offset and p.nbytes > 0, f"chunk {k}: pieces must lie back to back: {pieces}"
            offset += p.nbytes
            covered[p.tensor].append((p.tensor_offset, p.nbytes))
    for i, size in enumerate(sizes):
        at = 0
        for start, n in covered[i]:  # in order, no gap, no overlap
            assert start == at, f"tensor {i}: bytes from {at} missing or repeated ({covered[i]})"
            at += n
        assert at == size, f"tensor {i}: {at} of {size} bytes planned"
    assert sum(chunk_length(p) for p in plan) == sum(sizes)


def test_a_tensor_larger_than_a_chunk_spans_several():
    plan = plan_chunks([20], 8)
    assert plan == [[Piece(0, 0, 0, 8)], [Piece(0, 8, 0, 8)], [Piece(0, 16, 0, 4)]]


def _mixed_tensors():
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(5, 7, generator=g),
        torch.randn(33, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (9,), generator=g),
        torch.rand(6, generator=g) > 0.5,
        torch.tensor(4.0),
        torch.empty(0),
        torch.randn(3, 3, generator=g).to(torch.float16),
        torch.tensor([float("nan"), float("inf"), -0.0]),
    ]


@pytest.mark.parametrize("chunk", [1, 5, 64, 4096])
def test_pack_and_unpack_round_trip_bitwise(chunk):
    src = _mixed_tensors()
    dst = [torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for t in src]
    staging = torch.empty(chunk, dtype=torch.uint8)
    for pieces in plan_chunks([t.numel() * t.element_size() for t in src], chunk):
        unpack_chunk(pieces, pack_chunk(pieces, src, staging).clone(), dst)
    for a, b in zip(src, dst, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.view(-1).view(torch.uint8).tolist() == b.view(-1).view(torch.uint8).tolist(), (
            f"{a.dtype} {tuple(a.shape)} not bitwise equal after chunk size {chunk}"
        )


def test_split_and_join_keep_the_tree():
    t = _mixed_tensors()
    tree = {
        "round": 3,
        "params": [t[0], t[1]],
        "opt": {
            "state": {0: {"step": t[4], "m": t[2]}},
            "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0], "foreach": None}],
        },
        "losses": [1.5, 2.5],
        "pair": (t[3], "x"),
    }
    skeleton, tensors = split_state(tree)
    assert [id(x) for x in tensors] == [id(t[0]), id(t[1]), id(t[4]), id(t[2]), id(t[3])], "no copies, tree order"
    back = join_state(skeleton, tensors)
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.95) and isinstance(back["pair"], tuple)
    assert back["opt"]["state"][0]["m"] is t[2] and back["round"] == 3 and back["losses"] == [1.5, 2.5]


def test_meta_round_trips_and_refuses_foreign_bytes():
    skeleton, tensors = split_state({"a": [torch.zeros(2, 3, dtype=torch.bfloat16)], "b": (1, None)})
    specs = [TensorSpec.of(x) for x in tensors]
    got_skeleton, got_specs = decode_meta(encode_meta(skeleton, specs))
    assert got_skeleton == skeleton and got_specs == specs and got_specs[0].nbytes == 12
    with pytest.raises(StreamError):
        decode_meta(b"not a torch file")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    buf = io.BytesIO()
    torch.save({"skeleton": Evil(), "specs": []}, buf)
    with pytest.raises(StreamError):  # weights_only: a peer's pickle never runs code here
        decode_meta(buf.getvalue())
    assert isinstance(StreamError("x"), CollectiveError), "a bad stream must take the heal's fallback path"


# -- two processes over gloo ----------------------------------------------------------------------
def _cfg():
    from omegaconf import OmegaConf

    from hsgd.config.schema import HsgdConfig

    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.block_size = 1, 32, 2, 16
    cfg.data.batch_size, cfg.train.eval_batches = 2, 1
    cfg.sync.outer_every = 3
    return cfg


def _solo(level):
    g = LevelGroup(level)
    g.configure(None, f"test/{level}", rank=0, world_size=1, epoch=0)
    return g


def full_state_digest(trainer) -> str:
    """sha256 of everything a `full` heal carries (state_dict minus the replica's own name):
    params, AdamW state, outer (global params + momentum), round, step, round losses."""
    state = trainer.state_dict()
    state.pop("rid")
    skeleton, tensors = split_state(state)
    h = hashlib.sha256(repr(skeleton).encode())
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _DiesAfter(LevelGroup):
    """A source whose process ends after `n` broadcasts: mid-stream."""

    n = 0

    def broadcast(self, tensors, *, root, level):
        if self.n == 0:
            os._exit(0)
        self.n -= 1
        return super().broadcast(tensors, root=root, level=level)


def _heal_worker(rank: int, port: int, results) -> None:
    out = {"rank": rank}
    try:
        from hsgd.core.topology import Topology
        from hsgd.train.state_stream import receive_state, send_state
        from hsgd.train.trainer import ReplicaTrainer

        torch.set_num_threads(1)
        addr = f"127.0.0.1:{port}"
        trainer = ReplicaTrainer(_cfg(), f"c0r{rank}", Topology(1, 2))

        def group(prefix, cls=LevelGroup):
            g = cls("inner", "gloo", timeout_s=10, configure_timeout_s=30)
            g.configure(addr, prefix, rank=rank, world_size=2, epoch=1)
            return g

        if rank == 0:  # the source: a committed round (outer momentum), then a round of AdamW steps
            trainer.run_inner(0, _solo("inner"))
            trainer.outer_reduce(0, 0, _solo("outer"))
            trainer.outer_commit(0, _solo("inner"), (0,))
            trainer.run_inner(1, _solo("inner"))
            buf = io.BytesIO()
            torch.save(trainer.state_dict(), buf)  # what the object-store path would carry
            out.update(digest=full_state_digest(trainer), state_bytes=buf.getvalue(), param=trainer.param_digest())
            for prefix, chunk_mb in (("test/heal/a", 0.004), ("test/heal/b", 64.0)):  # 4 KB: every tensor split
                g = group(prefix)
                out[prefix] = send_state(g, trainer.live_state(), chunk_mb=chunk_mb)
                g.abort()
            results.put(out)
            results.close()
            results.join_thread()  # flush the queue's feeder thread: os._exit skips it
            g = group("test/heal/c", _DiesAfter)
            g.n = 3  # header, meta, the first chunk: then the process is gone
            send_state(g, trainer.live_state(), chunk_mb=0.004)
            os._exit(0)
        before = full_state_digest(trainer)
        for prefix in ("test/heal/a", "test/heal/b"):
            g = group(prefix)
            state, nbytes = receive_state(g)
            g.abort()
            healed = trainer if prefix.endswith("a") else ReplicaTrainer(_cfg(), "c0r1", Topology(1, 2))
            healed.load_state_dict(state, scope="full")
            out[prefix] = {"digest": full_state_digest(healed), "bytes": nbytes, "param": healed.param_digest()}
        out["before"] = before
        out["healed"] = full_state_digest(trainer)
        g = group("test/heal/c")
        start = time.monotonic()
        try:
            receive_state(g)
            out["mid_stream"] = "no error"
        except CollectiveError as err:
            out["mid_stream"] = f"CollectiveError {err.kind}"
        out["detect_s"] = time.monotonic() - start
        out["after_failure"] = full_state_digest(trainer)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        out["exception"] = traceback.format_exc()
    results.put(out)


@pytest.fixture(scope="module")
def healed():
    return run_ranks(_heal_worker, 2, timeout_s=180, store_timeout_s=60, join_s=20)


def _load_through_state_dict(state_bytes: bytes) -> str:
    """The object-store path: the source's state_dict, serialized, loaded by a fresh replica."""
    from hsgd.core.topology import Topology
    from hsgd.train.trainer import ReplicaTrainer

    fresh = ReplicaTrainer(_cfg(), "c0r1", Topology(1, 2))
    fresh.load_state_dict(torch.load(io.BytesIO(state_bytes), weights_only=False), scope="full")
    return full_state_digest(fresh)


@pytest.mark.parametrize("prefix", ["test/heal/a", "test/heal/b"])
def test_a_heal_over_the_group_gives_the_state_a_load_through_the_object_store_gives(healed, prefix):
    source, target = healed[0], healed[1]
    via_store = _load_through_state_dict(source["state_bytes"])
    assert via_store == source["digest"], "the object-store path itself must reproduce the source's state"
    assert target[prefix]["digest"] == via_store, (
        f"{prefix}: params, AdamW state, outer state, round/step/losses differ from the object-store heal"
    )
    assert target[prefix]["param"] == source["param"]
    assert target[prefix]["digest"] != target["before"], "the target must have started from another state"


def test_the_heal_reports_the_bytes_it_moved(healed):
    for prefix in ("test/heal/a", "test/heal/b"):
        assert healed[1][prefix]["bytes"] == healed[0][prefix] > 0


def test_a_source_dying_mid_stream_fails_the_target_and_leaves_its_state(healed):
    t = healed[1]
    assert t["mid_stream"].startswith("CollectiveError"), t["mid_stream"]
    assert t["detect_s"] < HANG_S, f"took {t['detect_s']:.1f}s (the collective timeout is 10 s: a hang)"
    assert t["after_failure"] == t["healed"], "a failed receive must not touch the target's own state"
