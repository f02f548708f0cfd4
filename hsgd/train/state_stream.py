"""A replica's state streamed over a process group in chunks: how an in-cluster (`full`) heal moves
it from source to target without the object store (GPU to GPU with NCCL, no host copy of the whole
state), as torchft's PGTransport does. A state is a tree (dicts, lists, tuples) of tensors and
plain values.

Protocol (every message a `broadcast` from `root`, level `inner`: the group holds the source and
every target healed from it, never leaving the cluster):
    1. header   int64[4]: MAGIC, meta length, total payload bytes, chunk bytes
    2. meta     uint8[meta length]: torch.save of {"skeleton", "specs"}; specs = one (shape, torch
                dtype, device type) per tensor, loaded with weights_only=True (a peer's bytes never
                run code here)
    3. chunks   uint8[<= chunk bytes] each: the tensors' bytes back to back, in `plan_chunks` order.
Both sides plan the chunks from the specs and the chunk size, so they agree by construction. The
source packs one chunk at a time into a reused buffer on the group's device (`cuda` for NCCL, else
the CPU); the target unpacks into tensors on its own device (a tensor the source held on the CPU —
the outer state, AdamW's `step` — stays on the CPU).

Failure: a failed or timed-out broadcast raises CollectiveError (comm.py's error model) on every
member; a header not of this protocol, or meta that does not match the bytes, raises StreamError
(kind `wait`: the transfer is unusable, the heal falls back). The target's own state is untouched
until it loads the whole received state.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hsgd.train.comm import CollectiveError, LevelGroup

MAGIC = 0x48534744  # "HSGD": a header from anything else is refused
CHUNK_MB = 64.0  # default chunk size: large enough to keep a link busy, small enough to stage twice
TENSOR = "__hsgd_tensor__"  # placeholder key in the skeleton: {TENSOR: index into the tensor list}
LEVEL = "inner"  # a `full` heal never leaves its cluster


class StreamError(CollectiveError):
    """What arrived is not a consistent state (wrong header, meta that does not match the bytes)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str  # the source's device type: "cuda" or "cpu"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype, t.device.type)


@dataclass(frozen=True)
class Piece:
    """Bytes [tensor_offset, tensor_offset + nbytes) of tensor `tensor` sit at chunk_offset in a chunk."""

    tensor: int
    tensor_offset: int
    chunk_offset: int
    nbytes: int


# -- pure: trees and chunk plans -------------------------------------------------------------------
def _tree_map(x: Any, is_leaf: Callable[[Any], bool], leaf: Callable[[Any], Any]) -> Any:
    """x with leaf(node) for every node is_leaf claims, depth-first; dict keys keep their order."""
    if is_leaf(x):
        return leaf(x)
    if isinstance(x, dict):
        return {k: _tree_map(v, is_leaf, leaf) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(v, is_leaf, leaf) for v in x)
    return x


def split_state(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): the tree with each tensor replaced by {TENSOR: i}, and the tensors in
    depth-first order (the tree's own tensors, not copies)."""
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> dict:
        tensors.append(t)
        return {TENSOR: len(tensors) - 1}

    return _tree_map(tree, lambda x: isinstance(x, torch.Tensor), take), tensors


def join_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """split_state's inverse: the tree with each placeholder replaced by its tensor."""
    return _tree_map(
        skeleton, lambda x: isinstance(x, dict) and len(x) == 1 and TENSOR in x, lambda x: tensors[x[TENSOR]]
    )


def plan_chunks(sizes: list[int], chunk_bytes: int) -> list[list[Piece]]:
    """Lay tensors of `sizes` bytes back to back into chunks of at most `chunk_bytes` (a tensor continues
    in the next chunk): every chunk but the last is full; empty tensors take no piece."""
    assert chunk_bytes > 0, chunk_bytes
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for i, size in enumerate(sizes):
        done = 0
        while done < size:
            n = min(size - done, chunk_bytes - used)
            current.append(Piece(i, done, used, n))
            done += n
            used += n
            if used == chunk_bytes:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def chunk_length(pieces: list[Piece]) -> int:
    return pieces[-1].chunk_offset + pieces[-1].nbytes if pieces else 0


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat uint8 view (t must be contiguous; every dtype, bool and 0-d included)."""
    return t.detach().reshape(-1).view(torch.uint8)


def pack_chunk(pieces: list[Piece], tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the pieces' bytes into `out` (uint8, at least chunk_length long); returns the used part."""
    for p in pieces:
        out[p.chunk_offset : p.chunk_offset + p.nbytes].copy_(
            _bytes_of(tensors[p.tensor])[p.tensor_offset : p.tensor_offset + p.nbytes], non_blocking=True
        )
    return out[: chunk_length(pieces)]


def unpack_chunk(pieces: list[Piece], chunk: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """pack_chunk's inverse: the pieces' bytes from `chunk` into `tensors` (contiguous)."""
    for p in pieces:
        _bytes_of(tensors[p.tensor])[p.tensor_offset : p.tensor_offset + p.nbytes].copy_(
            chunk[p.chunk_offset : p.chunk_offset + p.nbytes], non_blocking=True
        )


def encode_meta(skeleton: Any, specs: list[TensorSpec]) -> bytes:
    buf = io.BytesIO()
    torch.save({"skeleton": skeleton, "specs": [(s.shape, s.dtype, s.device) for s in specs]}, buf)
    return buf.getvalue()


def decode_meta(data: bytes) -> tuple[Any, list[TensorSpec]]:
    """Raises StreamError for bytes that are not encode_meta's (weights_only: no code runs)."""
    try:
        meta = torch.load(io.BytesIO(data), weights_only=True)
        skeleton = meta["skeleton"]
        specs = [TensorSpec(tuple(shape), dtype, device) for shape, dtype, device in meta["specs"]]
    except Exception as err:  # noqa: BLE001 — unpickling refused or malformed
        raise StreamError(f"state stream: unreadable meta ({type(err).__name__}: {err})") from err
    for s in specs:
        if (
            not isinstance(s.dtype, torch.dtype)
            or s.device not in ("cpu", "cuda")
            or not all(isinstance(d, int) and d >= 0 for d in s.shape)
        ):
            raise StreamError(f"state stream: bad tensor spec {s!r}")
    return skeleton, specs


# -- over a group ----------------------------------------------------------------------------------
def _staging(group: LevelGroup, device: str | torch.device, chunk_bytes: int, total: int) -> torch.Tensor:
    """The one chunk buffer, reused: on the GPU for NCCL, else the CPU (gloo sends host memory)."""
    d = torch.device(device)
    d = d if group.backend == "nccl" and d.type == "cuda" else torch.device("cpu")
    return torch.empty(min(chunk_bytes, max(total, 1)), dtype=torch.uint8, device=d)


def send_state(
    group: LevelGroup, state: Any, *, chunk_mb: float = CHUNK_MB, root: int = 0, device: str | torch.device = "cpu"
) -> int:
    """Broadcast `state` from this member (`root`) to the others; returns the payload bytes.
    `device`: the sender's device (chunks are staged there for NCCL). The state's tensors are read,
    never modified; the caller keeps them unchanged until this returns. Raises CollectiveError."""
    assert group.rank == root, f"send_state on rank {group.rank}, root is {root}"
    skeleton, tensors = split_state(state)
    tensors = [t.detach().contiguous() for t in tensors]  # (a copy only for a non-contiguous one)
    specs = [TensorSpec.of(t) for t in tensors]
    sizes = [s.nbytes for s in specs]
    chunk_bytes = max(1, int(chunk_mb * 2**20))
    meta = encode_meta(skeleton, specs)
    header = torch.tensor([MAGIC, len(meta), sum(sizes), chunk_bytes], dtype=torch.int64)
    group.broadcast([header], root=root, level=LEVEL)
    group.broadcast([torch.frombuffer(bytearray(meta), dtype=torch.uint8)], root=root, level=LEVEL)
    staging = _staging(group, device, chunk_bytes, sum(sizes))
    for pieces in plan_chunks(sizes, chunk_bytes):
        group.broadcast([pack_chunk(pieces, tensors, staging)], root=root, level=LEVEL)
    return sum(sizes)


def receive_state(group: LevelGroup, *, root: int = 0, device: str | torch.device = "cpu") -> tuple[Any, int]:
    """Receive a state `send_state` broadcasts from `root` onto `device` (the module's protocol):
    (state, payload bytes). Raises CollectiveError (StreamError: not a consistent state)."""
    assert group.rank != root, "receive_state on the root"
    header = torch.zeros(4, dtype=torch.int64)
    group.broadcast([header], root=root, level=LEVEL)
    magic, meta_len, total, chunk_bytes = (int(x) for x in header.tolist())
    if magic != MAGIC or meta_len <= 0 or total < 0 or chunk_bytes <= 0:
        raise StreamError(f"state stream: bad header {header.tolist()} on {group.prefix}")
    meta = torch.zeros(meta_len, dtype=torch.uint8)
    group.broadcast([meta], root=root, level=LEVEL)
    skeleton, specs = decode_meta(meta.numpy().tobytes())
    sizes = [s.nbytes for s in specs]
    if sum(sizes) != total:
        raise StreamError(f"state stream: meta names {sum(sizes)} bytes, header {total}, on {group.prefix}")
    target = torch.device(device)
    tensors = [
        torch.empty(s.shape, dtype=s.dtype, device=target if s.device == "cuda" and target.type == "cuda" else "cpu")
        for s in specs
    ]
    staging = _staging(group, device, chunk_bytes, total)
    for pieces in plan_chunks(sizes, chunk_bytes):
        chunk = staging[: chunk_length(pieces)]
        group.broadcast([chunk], root=root, level=LEVEL)
        unpack_chunk(pieces, chunk, tensors)
    if target.type == "cuda":
        torch.cuda.synchronize(target)  # the non-blocking unpack copies, before anyone reads the tensors
    return join_state(skeleton, tensors), total
