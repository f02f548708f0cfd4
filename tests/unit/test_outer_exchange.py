"""sync.outer_exchange (issue 47, hsgd/train/exchange.py) on an in-process outer group: every holder of a
`reduce_scatter` exchange holds the same bits, each chunk is its owner's re-encoding of the weighted mean
of the holders' own encodings, each holder's slow-link bytes stay flat as holders are added, and `auto`
picks by the group's size."""

from __future__ import annotations

import pytest
import torch

from hsgd.train.codec import make_codec
from hsgd.train.exchange import chunk_bounds, exchange_of, gather_mean, link_messages, reduce_scatter_mean
from hsgd.train.trainer import param_digest
from tests.fakes.exchange_world import run_holders


def _piece(holder: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + holder)
    scales = torch.rand(-(-numel // 256), generator=g).repeat_interleave(256)[:numel] * 3
    return torch.randn(numel, generator=g) * scales


def _weights(world: int, weighted: bool) -> tuple[float, ...]:
    if not weighted:
        return ()
    raw = [1.0 + 0.5 * k for k in range(world)]
    return tuple(w * world / sum(raw) for w in raw)


def _exchange(fn, codec: str, world: int, numel: int, weights=()):
    code = make_codec(codec)
    return run_holders(lambda k, outer: fn(code, _piece(k, numel), outer, weights), world)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("numel", [1, 700, 3 * 4096 + 77])
def test_every_holder_of_a_reduce_scatter_holds_the_same_bits(codec, world, numel):
    reduced, _ = _exchange(reduce_scatter_mean, codec, world, numel, _weights(world, True))
    digests = {k: param_digest([r]) for k, r in enumerate(reduced)}
    assert len(set(digests.values())) == 1, f"{codec}, {world} holders, {numel} elements: digests {digests}"
    assert reduced[0].shape == (numel,) and reduced[0].dtype == torch.float32


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("weighted", [False, True])
def test_each_chunk_is_its_owners_reencoding_of_the_weighted_mean_of_the_holders_encodings(codec, weighted):
    world, numel = 4, 5 * 4096 + 300
    weights = _weights(world, weighted)
    reduced, _ = _exchange(reduce_scatter_mean, codec, world, numel, weights)
    code = make_codec(codec)
    sent = [code.decode(code.encode(_piece(k, numel)), numel) for k in range(world)]
    mean = torch.zeros(numel)
    for k, g in enumerate(sent):  # outer-rank order, a weight of 1.0 never multiplied
        w = weights[k] if weights else 1.0
        mean += g if w == 1.0 else g * w
    mean /= world
    for lo, hi in chunk_bounds(numel, world, code):
        expected = code.decode(code.encode(mean[lo:hi].contiguous()), hi - lo)
        assert torch.equal(reduced[0][lo:hi], expected), f"{codec}: chunk [{lo}, {hi}) is not its owner's encoding"
    gathered, _ = _exchange(gather_mean, codec, world, numel, weights)
    assert torch.equal(gathered[0], mean), "gather's mean is the weighted mean of what every holder sent"


def test_a_group_of_one_moves_nothing_and_reduces_to_the_encoded_piece():
    reduced, ranks = _exchange(reduce_scatter_mean, "int8", 1, 1000)
    code = make_codec("int8")
    once = code.decode(code.encode(_piece(0, 1000)), 1000)
    assert torch.equal(reduced[0], code.decode(code.encode(once), 1000))
    assert ranks[0].bytes_sent == ranks[0].bytes_received == 0


def _per_holder_bytes(fn, codec: str, world: int, numel: int) -> int:
    _, ranks = _exchange(fn, codec, world, numel)
    both = {r.bytes_sent + r.bytes_received for r in ranks}
    return max(both)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_holders_slow_link_bytes_stay_flat_as_holders_are_added(codec):
    """Acceptance 1 on the counted bytes (sent + received by one holder, one exchange of the tiny
    model's size): reduce_scatter at 8 holders <= 2.0x, at 4 <= 1.6x, its bytes at 2; gather grows N - 1."""
    numel = 400_000
    rs = {n: _per_holder_bytes(reduce_scatter_mean, codec, n, numel) for n in (2, 4, 8)}
    gather = {n: _per_holder_bytes(gather_mean, codec, n, numel) for n in (2, 4, 8)}
    assert rs[8] <= 2.0 * rs[2] and rs[4] <= 1.6 * rs[2], f"{codec} reduce_scatter per holder: {rs}"
    assert gather[8] == 7 * gather[2] and gather[4] == 3 * gather[2], f"{codec} gather per holder: {gather}"
    assert rs[2] <= gather[2] * 1.01, f"at 2 holders both move the same bytes: {rs[2]} vs {gather[2]}"


def test_auto_reduce_scatters_from_three_holders_and_topk_and_no_codec_keep_theirs():
    int4, topk = make_codec("int4"), make_codec("topk")
    assert [exchange_of("auto", int4, n) for n in (1, 2, 3, 8)] == ["gather", "gather"] + ["reduce_scatter"] * 2
    assert exchange_of("gather", int4, 8) == "gather" and exchange_of("reduce_scatter", int4, 2) == "reduce_scatter"
    assert exchange_of("reduce_scatter", topk, 8) == "gather" and exchange_of("auto", topk, 8) == "gather"
    assert exchange_of("auto", None, 8) == "allreduce"
    assert link_messages("gather", 8) == 7 and link_messages("reduce_scatter", 8) == 8
    assert link_messages("gather", 1) == 0


def test_chunks_are_cut_at_codec_blocks_so_a_chunks_bytes_are_a_slice_of_the_whole_encoding():
    code = make_codec("int4")
    x = _piece(0, 3 * 256 * 5 + 13)
    whole = code.encode(x)
    for lo, hi in chunk_bounds(x.numel(), 4, code):
        assert lo % code.block == 0
        assert torch.equal(code.encode(x[lo:hi].contiguous()), whole[code.payload_bytes(lo) : code.payload_bytes(hi)])
