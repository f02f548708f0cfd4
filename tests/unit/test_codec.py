"""hsgd.train.codec: outer-payload codecs (error bounds, payload sizes, block-wise pieces,
determinism) and error feedback."""

import math

import pytest
import torch

from hsgd.train.codec import ALIGN, CODECS, compress_with_feedback, make_codec

LENGTHS = [1, 255, 256, 257, 4095, 4096, 4097, 10_000]
BITS = {"int8": 127, "int4": 7}


def _vector(n, seed=0):
    """Gaussian values whose magnitude changes from one 256-block to the next by up to ~e^6, so a
    codec with one scale (or one top-k) for the whole vector instead of per block is caught."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(2 * torch.randn(-(-n // 256), generator=g)).repeat_interleave(256)[:n]
    return torch.randn(n, generator=g) * magnitude


def _bits(t):
    return t.view(torch.int32)


def _blocks(t, width):
    """(blocks, width) float64, zero-padded."""
    rows = -(-t.numel() // width)
    return torch.nn.functional.pad(t.double(), (0, rows * width - t.numel())).view(rows, width)


def _round_trip(codec, x):
    return codec.decode(codec.encode(x), x.numel())


@pytest.mark.parametrize("n", LENGTHS)
def test_none_round_trip_is_exact(n):
    x = _vector(n)
    assert torch.equal(_bits(_round_trip(make_codec("none"), x)), _bits(x)), "codec none must send fp32 as is"


@pytest.mark.parametrize("n", LENGTHS)
def test_bf16_round_trip_relative_error_at_most_2_pow_minus_8(n):
    x = _vector(n)
    got = _round_trip(make_codec("bf16"), x)
    err = (got.double() - x.double()).abs()
    worst = (err / x.double().abs()).max().item()
    assert worst <= 2**-8, f"bf16 must round to nearest (relative error <= 2^-8), worst {worst:.3g}"
    assert torch.equal(got, x.to(torch.bfloat16).float()), "bf16 must be torch's round-to-nearest-even cast"


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("n", LENGTHS)
def test_int_round_trip_error_at_most_half_a_step_of_its_block(name, n):
    x = _vector(n, seed=n)
    got = _round_trip(make_codec(name), x)
    scale = _blocks(x, 256).abs().amax(dim=1, keepdim=True) / BITS[name]  # exact, per block
    err = _blocks(got, 256) - _blocks(x, 256)
    bound = scale * (0.5 + 2**-15)  # half a step, plus fp32 rounding of x/scale and q*scale
    worst = (err.abs() / bound).max().item()
    assert worst <= 1.0, f"{name}: an element is off by {worst:.4f} x (scale/2) of its block"
    levels = (_blocks(got, 256) / scale).nan_to_num()
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= BITS[name] + 1e-4, (
        f"{name}: decoded values must be integer multiples of the block scale within +-{BITS[name]}"
    )


def test_int_all_zero_blocks_decode_to_zeros_without_nan():
    x = _vector(5 * 256 + 10)
    x[256:768] = 0.0  # two whole zero blocks between non-zero ones
    x[-10:] = 0.0  # and a zero partial last block
    for name in ("int8", "int4", "topk"):
        got = _round_trip(make_codec(name), x)
        assert torch.isfinite(got).all(), f"{name}: an all-zero block must not decode to NaN/inf"
        assert (got[256:768] == 0).all() and (got[-10:] == 0).all(), f"{name}: all-zero blocks must decode to 0"
    assert (_round_trip(make_codec("topk"), torch.zeros(5000)) == 0).all()


@pytest.mark.parametrize("density", [0.01, 0.1])
@pytest.mark.parametrize("n", LENGTHS)
def test_topk_keeps_exactly_k_largest_per_chunk_as_bf16(n, density):
    x = _vector(n, seed=n)  # no exact zeros: kept <=> decoded non-zero
    got = _round_trip(make_codec("topk", density), x)
    for start in range(0, n, 4096):
        xs, gs = x[start : start + 4096], got[start : start + 4096]
        kept = gs != 0
        k = max(1, round(density * xs.numel()))
        assert kept.sum().item() == k, f"topk chunk at {start}: kept {kept.sum().item()} entries, want {k}"
        assert torch.equal(gs[kept], xs[kept].to(torch.bfloat16).float()), (
            f"topk chunk at {start}: kept entries must be the bf16 rounding of the originals"
        )
        if k < xs.numel():
            assert xs[~kept].abs().max() <= xs[kept].abs().min(), (
                f"topk chunk at {start}: a dropped |x| is larger than a kept |x|"
            )


def test_topk_breaks_ties_towards_the_lowest_indices():
    x = torch.ones(3 * 4096) * torch.tensor([1.0, -1.0]).repeat(3 * 2048)  # every |x| equal
    got = _round_trip(make_codec("topk", 0.01), x)
    k = round(0.01 * 4096)
    want = torch.zeros_like(x)
    for start in range(0, x.numel(), 4096):
        want[start : start + k] = x[start : start + k]
    assert torch.equal(got, want), "topk ties must keep the lowest indices of each chunk"


def _expected_bytes(name, n, density=0.01):
    blocks = -(-n // 256)
    if name == "none":
        return 4 * n
    if name == "bf16":
        return 2 * n
    if name == "int8":
        return n + 4 * blocks
    if name == "int4":
        full, rest = divmod(n, 256)
        return full * (4 + 128) + (4 + -(-rest // 2) if rest else 0)
    full, rest = divmod(n, 4096)
    return 4 * (full * max(1, round(density * 4096)) + (max(1, round(density * rest)) if rest else 0))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_payload_bytes_is_the_encoded_length(name, n):
    codec = make_codec(name)
    payload = codec.encode(_vector(n))
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.payload_bytes(n) == _expected_bytes(name, n), (
        f"{name}, n={n}: encoded {payload.numel()} bytes, payload_bytes says {codec.payload_bytes(n)}, "
        f"the documented layout {_expected_bytes(name, n)}"
    )


def test_compression_ratios_vs_fp32_are_as_documented():
    n = 10_000_000
    ratio = {name: 4 * n / make_codec(name).payload_bytes(n) for name in CODECS}
    assert ratio["none"] == 1.0 and ratio["bf16"] == 2.0
    assert 3.9 < ratio["int8"] < 4.0, f"int8: 1 byte + a fp32 scale per 256 -> ~3.94x, got {ratio['int8']:.3f}"
    assert 7.7 < ratio["int4"] < 8.0, f"int4: 8x minus the scales -> ~7.76x, got {ratio['int4']:.3f}"
    assert 95 < ratio["topk"] <= 100, f"topk at 1%: 4 bytes per kept element -> ~100x, got {ratio['topk']:.1f}"
    assert 9.5 < 4 * n / make_codec("topk", 0.1).payload_bytes(n) <= 10


PIECES = [(0, 4096), (4096, 3 * 4096), (0, 5 * 4096), (2 * 4096, None), (5 * 4096, None), (0, None)]


@pytest.mark.parametrize("name", CODECS)
def test_encoding_of_a_piece_is_the_piece_of_the_encoding(name):
    """For a multiple of ALIGN and b a multiple of ALIGN or the end: what a shard holder sends for its
    slice is, byte for byte, the slice of what a replica computes on the whole vector."""
    assert ALIGN % 4096 == 0 and ALIGN % 256 == 0
    codec = make_codec(name)
    for seed in range(3):
        x = _vector(5 * ALIGN + 1234, seed=seed)
        n = x.numel()
        whole = codec.encode(x)
        decoded = codec.decode(whole, n)
        for a, b in PIECES:
            b = n if b is None else b
            piece = codec.encode(x[a:b])
            assert torch.equal(piece, whole[codec.payload_bytes(a) : codec.payload_bytes(b)]), (
                f"{name}: encode(x[{a}:{b}]) is not the matching slice of encode(x)"
            )
            assert torch.equal(_bits(codec.decode(piece, b - a)), _bits(decoded[a:b])), (
                f"{name}: decode(encode(x[{a}:{b}])) differs bitwise from decode(encode(x))[{a}:{b}]"
            )


@pytest.mark.parametrize("name", CODECS)
def test_encoding_is_deterministic(name):
    codec = make_codec(name)
    x = _vector(3 * ALIGN + 77)
    first = codec.encode(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # replicas run with one thread; the bytes must not depend on it
        again = codec.encode(x.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, again) and torch.equal(first, codec.encode(x)), f"{name}: same input, other bytes"
    x.add_(1.0)
    assert torch.equal(first, again), f"{name}: the payload must not alias the input vector"


def test_decode_rejects_a_payload_of_the_wrong_length():
    for name in CODECS:
        codec = make_codec(name)
        payload = codec.encode(_vector(1000))
        with pytest.raises(ValueError):
            codec.decode(payload[:-1], 1000)
        with pytest.raises(ValueError):
            codec.decode(payload, 1001 if name != "topk" else 5000)
    with pytest.raises(ValueError):
        make_codec("fp8")
    with pytest.raises(ValueError):
        make_codec("topk", 0.0)


def _contraction(codec, n):
    """gamma < 1 with ||c - C(c)|| <= gamma ||c|| for topk: each chunk keeps its k largest of len
    entries, so it drops at most (1 - k/len) of the chunk's squared norm; kept values are off by at
    most 2^-8 relative (bf16)."""
    lens = [min(4096, n - s) for s in range(0, n, 4096)]
    delta = min(max(1, round(codec.density * m)) / m for m in lens)
    return math.sqrt(1 - delta + 2**-16)


@pytest.mark.parametrize("name", ["int4", "topk"])
def test_error_feedback_carries_the_residual_so_sent_sums_track_true_sums(name):
    codec = make_codec(name, 0.01)
    n, rounds = 3 * 4096 + 400, 400
    g = torch.Generator().manual_seed(1)
    drift = torch.randn(n, generator=g)  # pseudo-gradients share a direction from round to round
    residual = None
    sent_sum, true_sum, plain_sum = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    tol, max_update, with_fb, without_fb = 0.0, 0.0, [], []
    for t in range(rounds):
        update = drift + torch.randn(n, generator=g)
        corrected = update.double() + (0 if residual is None else residual.double())
        sent, new_residual = compress_with_feedback(codec, update, residual)
        fp32 = update if residual is None else update + residual
        assert torch.equal(sent, codec.decode(codec.encode(fp32), n)), "sent must be exactly what the peers decode"
        residual = new_residual
        sent_sum += sent.double()
        true_sum += update.double()
        plain_sum += codec.decode(codec.encode(update), n).double()  # the same codec, no feedback
        # fp32 rounding of update + residual and of corrected - sent, at most 2^-24 |corrected| each
        tol += 2**-23 * corrected.abs().max().item()
        gap = (sent_sum + residual.double() - true_sum).abs().max().item()
        assert gap <= tol, f"{name} round {t}: sum(sent) + residual != sum(updates) (off by {gap:.3g} > {tol:.3g})"
        max_update = max(max_update, update.norm().item())
        with_fb.append((sent_sum - true_sum).norm().item())
        without_fb.append((plain_sum - true_sum).norm().item())
    quarter = rounds // 4
    assert max(with_fb[-quarter:]) <= 1.5 * max(with_fb[:quarter]), (
        f"{name}: with feedback ||sum sent - sum updates|| kept growing: {with_fb[quarter - 1]:.1f} at round "
        f"{quarter}, {with_fb[-1]:.1f} at round {rounds}"
    )
    assert without_fb[-1] >= 1.8 * max(without_fb[:quarter]), (
        f"{name}: the test's premise broke: without feedback the error should grow with the rounds"
    )
    assert with_fb[-1] * 4 <= without_fb[-1], (
        f"{name}: feedback must track the true sum far better than no feedback "
        f"({with_fb[-1]:.1f} vs {without_fb[-1]:.1f})"
    )
    if name == "topk":  # the bound EF theory gives a contractive compressor, whatever the number of rounds
        gamma = _contraction(codec, n)
        bound = gamma / (1 - gamma) * max_update
        assert max(with_fb) <= bound, f"topk: residual {max(with_fb):.1f} beyond the EF bound {bound:.1f}"


def test_feedback_residual_none_means_zeros_and_inputs_are_left_alone():
    codec = make_codec("int4")
    update = _vector(5000)
    kept = update.clone()
    sent_none, residual_none = compress_with_feedback(codec, update, None)
    sent_zero, residual_zero = compress_with_feedback(codec, update, torch.zeros(5000))
    assert torch.equal(sent_none, sent_zero) and torch.equal(residual_none, residual_zero)
    assert torch.equal(update, kept), "compress_with_feedback must not modify the update"
    residual = residual_none.clone()
    sent, new_residual = compress_with_feedback(codec, update, residual)
    assert torch.equal(residual, residual_none), "compress_with_feedback must not modify the residual it was given"
    assert torch.equal(sent + new_residual, update + residual), "new residual = (update + residual) - sent"


@pytest.mark.parametrize("name", CODECS)
def test_decode_reads_a_payload_that_is_a_view_at_an_odd_byte_offset(name):
    """Received payloads may be views into one gathered buffer, at any byte offset."""
    codec = make_codec(name)
    x = _vector(4097)
    payload = codec.encode(x)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])
    assert torch.equal(_bits(codec.decode(buffer[3:], x.numel())), _bits(codec.decode(payload, x.numel())))
