"""Codecs for the outer payload: the pseudo-gradient that crosses the slow link between clusters.

    payload = codec.encode(flat)              # fp32 1-D CPU -> uint8 1-D of codec.payload_bytes(numel)
    flat_hat = codec.decode(payload, numel)   # fp32, 1-D; what every peer sees from this sender
Accumulation, the outer optimizer and the global params stay fp32: only the wire is narrow.

What each codec sends, one record per block (the last may be partial, its record short):
    none   fp32 values                                 block 1
    bf16   bfloat16 values (round to nearest even)     block 1
    int8   [scale fp32][int8 values]                   block 256    scale = absmax / 127
    int4   [scale fp32][4-bit values]                  block 256    scale = absmax / 7
    topk   [k indices int16][k values bf16]            block 4096   k = max(1, round(density * block len))
int8/int4: q = round(x / scale) in [-qmax, qmax] (half to even); int4 stores q + 8 in a nibble,
element 2i in the low nibble of byte i. topk: ties keep the lowest indices; indices ascend.
Multi-byte fields are little-endian.

Block-wise: for a, b multiples of ALIGN (or b == n), with x of n elements,
    encode(x[a:b]) == encode(x)[payload_bytes(a):payload_bytes(b)]           (bytes, exactly)
so shards and fragments are cut only at multiples of ALIGN. `compress_with_feedback`: sent =
decode(encode(update + residual)), residual = update + residual - sent (error feedback).

Encoding is deterministic. Non-finite input is not handled: the trainer never sends it.
Narrative (each codec's error bound, why block-wise, error feedback): docs/scaling.md.
"""

from __future__ import annotations

import torch

CODECS = ("none", "bf16", "int8", "int4", "topk")
QUANT_BLOCK = 256  # int8/int4: elements per scale
TOPK_CHUNK = 4096  # topk: elements per chunk (indices are int16 within a chunk, so <= 32768)
ALIGN = 4096  # every codec's block divides it: lcm(1, 256, 4096)


class Codec:
    """encode/decode as in the module's protocol; decode raises ValueError when the payload's length
    is not payload_bytes(numel) (a payload cut or joined wrongly is never decoded silently). A codec
    defines `block`, `_record_bytes(numel)` (one block's record), `_encode_rows(x)` (blocks as the
    rows of x -> uint8) and `_decode_rows(data, width)`, handed the full blocks, then the partial last."""

    name: str
    block: int  # elements per block; divides ALIGN

    def payload_bytes(self, numel: int) -> int:
        """Bytes handed to the network for `numel` elements: everything needed to decode them."""
        full, rest = divmod(numel, self.block)
        return full * self._record_bytes(self.block) + (self._record_bytes(rest) if rest else 0)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dim() != 1 or flat.dtype != torch.float32 or flat.device.type != "cpu":
            raise ValueError(
                f"codec {self.name}: encode takes a 1-D fp32 CPU tensor, "
                f"got {tuple(flat.shape)} {flat.dtype} on {flat.device}"
            )
        flat, full = flat.contiguous(), flat.numel() // self.block * self.block
        parts = [self._encode_rows(flat[:full].view(-1, self.block)).reshape(-1)]
        if full < flat.numel():
            parts.append(self._encode_rows(flat[full:].view(1, -1)).reshape(-1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if payload.dim() != 1 or payload.dtype != torch.uint8:
            raise ValueError(
                f"codec {self.name}: decode takes a 1-D uint8 tensor, got {tuple(payload.shape)} {payload.dtype}"
            )
        want = self.payload_bytes(numel)
        if payload.numel() != want:
            raise ValueError(f"codec {self.name}: payload of {payload.numel()} bytes, {numel} elements need {want}")
        payload, full = payload.contiguous(), numel // self.block * self.block
        split = self.payload_bytes(full)
        parts = [self._decode_rows(payload[:split], self.block).reshape(-1)]
        if full < numel:
            parts.append(self._decode_rows(payload[split:], numel - full).reshape(-1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret contiguous bytes as `dtype` (copying when the bytes are not aligned for it)."""
    data = data.contiguous()
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)


class _Cast(Codec):
    """none / bf16: the values in a narrower (or the same) float type."""

    block = 1

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def _record_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def _encode_rows(self, x):
        return x.to(self.dtype, copy=True).view(torch.uint8)  # a copy: never aliases the caller's vector

    def _decode_rows(self, data, width):
        return _as(data, self.dtype).to(torch.float32, copy=True)


class _Quantize(Codec):
    """int8 / int4: symmetric per-block absmax scaling. Record: [scale fp32][values]."""

    block = QUANT_BLOCK

    def __init__(self, name: str, bits: int):
        self.name, self.bits = name, bits
        self.qmax = 2 ** (bits - 1) - 1  # 127 / 7: symmetric, so -qmax..qmax

    def _record_bytes(self, numel: int) -> int:
        return 4 + -(-numel * self.bits // 8)

    def _encode_rows(self, x):
        scale = x.abs().amax(dim=1) / self.qmax  # (blocks,)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: q = 0
        q = torch.round(x / safe[:, None]).clamp_(-self.qmax, self.qmax).to(torch.int8)
        if self.bits == 4:  # an odd last element gets q = 0 in its high nibble
            u = (torch.nn.functional.pad(q, (0, q.shape[1] % 2)) + 8).view(torch.uint8)  # 1..15
            q = u[:, 0::2] | (u[:, 1::2] << 4)  # (blocks, 128)
        return torch.cat([scale.view(torch.uint8).view(-1, 4), q.view(torch.uint8)], dim=1)

    def _decode_rows(self, data, width):
        records = data.view(-1, self._record_bytes(width))  # (blocks, 4 + body)
        scale = _as(records[:, :4].reshape(-1), torch.float32)  # (blocks,)
        body = records[:, 4:].contiguous()
        q = (
            body.view(torch.int8)
            if self.bits == 8
            else torch.stack([body & 0xF, body >> 4], dim=2).flatten(1)[:, :width].to(torch.int8) - 8
        )
        return q.to(torch.float32) * scale[:, None]


class _TopK(Codec):
    """topk: per chunk, the k largest |x| as (int16 index, bf16 value). Record: [indices][values]."""

    block = TOPK_CHUNK

    def __init__(self, density: float):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"topk density must be in (0, 1], got {density}")
        self.name, self.density = "topk", density

    def kept(self, chunk_len: int) -> int:
        return min(chunk_len, max(1, round(self.density * chunk_len)))

    def _record_bytes(self, numel: int) -> int:
        return 4 * self.kept(numel)

    def _encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        rows, width = x.shape
        k = self.kept(width)
        mag = x.abs()
        kth = mag.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)  # (rows, 1)
        above = mag > kth
        at = mag == kth
        # ties at the k-th magnitude: keep the lowest indices, whatever order topk returned them in
        room = k - above.sum(dim=1, keepdim=True)
        keep = above | (at & (at.cumsum(dim=1, dtype=torch.int16) <= room))
        idx = keep.nonzero()[:, 1].view(rows, k)  # ascending within each row
        values = x.gather(1, idx).to(torch.bfloat16)
        return torch.cat([idx.to(torch.int16).view(torch.uint8), values.view(torch.uint8)], dim=1)

    def _decode_rows(self, data: torch.Tensor, width: int) -> torch.Tensor:
        k = self.kept(width)
        records = data.view(-1, 4 * k)  # (rows, 4k)
        idx = _as(records[:, : 2 * k], torch.int16).view(-1, k).long()
        values = _as(records[:, 2 * k :], torch.bfloat16).view(-1, k).to(torch.float32)
        return torch.zeros(records.shape[0], width).scatter_(1, idx, values)


def make_codec(name: str, topk_density: float = 0.01) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {CODECS}")
    return {
        "none": lambda: _Cast("none", torch.float32),
        "bf16": lambda: _Cast("bf16", torch.bfloat16),
        "int8": lambda: _Quantize("int8", 8),
        "int4": lambda: _Quantize("int4", 4),
        "topk": lambda: _TopK(topk_density),
    }[name]()


def compress_with_feedback(
    codec: Codec, update: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sent, new_residual) for one round of error feedback (the module's); residual None means
    zeros. `sent` is what the peers see from this cluster: use it for the local share of the
    reduction, so the sender and its peers use the same values. Inputs are not modified."""
    if residual is not None and residual.shape != update.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match update {tuple(update.shape)}")
    corrected = update.clone() if residual is None else update + residual
    sent = codec.decode(codec.encode(corrected), corrected.numel())
    return sent, corrected.sub_(sent)
