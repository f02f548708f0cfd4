"""How a compressed pseudo-gradient crosses the slow link (sync.outer_exchange): each shard holder's
encoded piece in, the token-weighted mean over the outer group out, bitwise the same on every holder.

    gather          all-gather every holder's encoded piece; each holder decodes all N, weights them
                    and sums them in outer-rank order, then divides by N.
    reduce_scatter  cut the encoded piece into N chunks at codec-block boundaries (`chunk_bounds`); an
                    all-to-all hands chunk j of every holder to the holder of outer rank j (its owner),
                    which decodes the N chunks, weights and sums them in outer-rank order, divides by N
                    and re-encodes that reduced chunk once, with the same codec; an all-gather hands each
                    owner's encoded chunk to every holder, and every holder (the owner too) decodes those
                    same bytes.
    auto            reduce_scatter from 3 holders on (REDUCE_SCATTER_FROM), gather at 2: a function of
                    the formed group's size, so it changes only when the group is formed anew.
Without a codec (`none`) the outer reduce is an all-reduce, unchanged; `topk` always gathers.
Error feedback: each cluster's residual is what its own encoding of its piece did not send
(codec.compress_with_feedback); the owner's re-encoding of the reduced chunk keeps no residual.

Failure: either collective's CollectiveError propagates; nothing is returned, the caller's buffer is
untouched, and the outer phase fails as any failed exchange does.
Narrative (the bytes, why an all-to-all): docs/scaling.md.
"""

from __future__ import annotations

import torch

from hsgd.core.outer_plan import shard_bounds
from hsgd.train.codec import Codec

EXCHANGES = ("gather", "reduce_scatter", "auto")
REDUCE_SCATTER_FROM = 3  # auto: the smallest group that reduce-scatters (at 2 both move the same bytes)


def exchange_of(setting: str, codec: Codec | None, world_size: int) -> str:
    """What an outer reduce over a group of `world_size` runs: `allreduce` without a codec, `gather`
    for topk, else `setting` (`auto`: reduce_scatter from REDUCE_SCATTER_FROM members on)."""
    if codec is None:
        return "allreduce"
    if codec.name == "topk":
        return "gather"
    if setting == "auto":
        return "reduce_scatter" if world_size >= REDUCE_SCATTER_FROM else "gather"
    return setting


def chunk_bounds(numel: int, world_size: int, codec: Codec) -> list[tuple[int, int]]:
    """[lo, hi) of the chunk each outer rank owns: cut at the codec's block boundaries, so each chunk's
    bytes are a slice of the whole piece's encoding (codec.py); a piece shorter than one block per
    rank leaves the last ranks' chunks empty."""
    return shard_bounds(numel, world_size, codec.block)


def _weighted_mean(codec: Codec, payloads: list[torch.Tensor], numel: int, weights: tuple[float, ...]) -> torch.Tensor:
    """sum over ranks, in rank order, of weight x decoded payload, over the rank count (a weight of
    1.0 is never multiplied): the same arithmetic on every holder, so the same bits."""
    mean = torch.zeros(numel)
    for rank, payload in enumerate(payloads):
        decoded = codec.decode(payload.to("cpu"), numel)  # NCCL hands them back on the GPU
        weight = weights[rank] if weights else 1.0
        mean += decoded if weight == 1.0 else decoded.mul_(weight)
    return mean.div_(len(payloads))


def gather_mean(codec: Codec, piece: torch.Tensor, outer, weights: tuple[float, ...]) -> torch.Tensor:
    """The `gather` exchange of `piece` (fp32, 1-D, CPU) over `outer`: the weighted mean."""
    payloads = outer.all_gather(codec.encode(piece), level="outer")
    return _weighted_mean(codec, payloads, piece.numel(), weights)


def reduce_scatter_mean(codec: Codec, piece: torch.Tensor, outer, weights: tuple[float, ...]) -> torch.Tensor:
    """The `reduce_scatter` exchange of `piece` (fp32, 1-D, CPU) over `outer`: the weighted mean,
    each chunk as its owner re-encoded it."""
    bounds = chunk_bounds(piece.numel(), outer.world_size, codec)
    payload = codec.encode(piece)
    chunks = [payload[codec.payload_bytes(lo) : codec.payload_bytes(hi)] for lo, hi in bounds]
    lo, hi = bounds[outer.rank]
    mine = outer.all_to_all(chunks, codec.payload_bytes(hi - lo), level="outer")  # chunk `rank` of every holder
    reduced = _weighted_mean(codec, mine, hi - lo, weights)
    widths = [codec.payload_bytes(b - a) for a, b in bounds]
    own = torch.zeros(max(widths), dtype=torch.uint8)  # all_gather moves equal lengths: pad to the longest
    if hi > lo:
        own[: widths[outer.rank]] = codec.encode(reduced)
    encoded = outer.all_gather(own, level="outer")
    parts = [codec.decode(e.to("cpu")[:w], b - a) for e, w, (a, b) in zip(encoded, widths, bounds, strict=True)]
    return torch.cat(parts)


def link_messages(exchange: str, world_size: int) -> int:
    """Sequential messages one exchange costs a holder (each pays the link's latency): a ring
    all-reduce 2 (N - 1), a ring all-gather N - 1, an all-to-all one round, then the all-gather."""
    if world_size <= 1:
        return 0
    return {"allreduce": 2 * (world_size - 1), "gather": world_size - 1, "reduce_scatter": world_size}[exchange]
