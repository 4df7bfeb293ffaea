"""The MXFP8 rules both kernels' pure-PyTorch references implement (docs/DESIGN.md §6).

A 32-element block along the last dimension shares one e8m0 scale byte (RCEIL of the block's
amax); each value is y * 2^(127 - byte) rounded to e4m3, saturating; an (R, S) scale matrix is
stored in the blocked layout. The kernels' CUDA twin of these rules is mxfp8_rules.cuh.
Pure PyTorch, no native code; imported relatively by each reference.py.
"""

from __future__ import annotations

import math

import torch

MXFP8_SCALE_BLOCK = 32
E4M3_MAX = 448.0
_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # fp32(1/448), round-to-nearest


def rceil_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8) for fp32 block maxima `amax` (>= 0 or NaN): 0 for amax == 0;
    t = amax * fp32(1/448) (fp32, RN); biased exponent of t, +1 if t has any mantissa bit;
    clamped to [0, 254]; 255 for a non-finite amax."""
    amax = amax.to(torch.float32)
    t = amax * _INV_448
    tb = t.contiguous().view(torch.int32).to(torch.int64)
    byte = ((tb >> 23) & 0xFF) + ((tb & 0x7FFFFF) != 0).to(torch.int64)
    byte = byte.clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isfinite(amax), byte, torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def scale_multiplier(byte: torch.Tensor) -> torch.Tensor:
    """2^(127 - byte) as an exact fp32 (a subnormal for bytes 254 and 255): the quantization
    multiplier, built from its bit pattern so no libm rounding is involved."""
    e = 254 - byte.to(torch.int64)
    normal = e << 23
    sub = torch.full_like(e, 0x00400000) >> (-e).clamp(min=0)
    bits = torch.where(e >= 1, normal, sub).to(torch.int32)
    return bits.view(torch.float32)


def e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating to +-448 (Inf too); a NaN stays a
    NaN of its sign (0x7f or 0xff: torch's conversion keeps the sign bit)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """`e4m3_saturating` with every NaN -> 0x7f, what the kernels' cvt.rn.satfinite gives."""
    x = x.to(torch.float32)
    q = e4m3_saturating(x).view(torch.uint8)
    q = torch.where(torch.isnan(x), torch.full_like(q, 0x7F), q)
    return q.view(torch.float8_e4m3fn)


def blocked_offset(r, s, S: int):
    """Byte offset of scale (r, s) in the blocked layout of an (R, S) scale matrix: 512-byte
    chunks of 128 rows x 4 columns, chunk (r // 128, s // 4) at ((r // 128) * ceil(S / 4) + s // 4)
    * 512. r, s: ints, or int64 tensors that broadcast."""
    return ((r // 128) * ((S + 3) // 4) + s // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + s % 4


def blocked_offsets(R: int, S: int) -> torch.Tensor:
    """int64 (R, S): `blocked_offset` of every scale of an (R, S) matrix."""
    r = torch.arange(R, dtype=torch.int64)[:, None]
    s = torch.arange(S, dtype=torch.int64)[None, :]
    return blocked_offset(r, s, S)


def blocked_padded_shape(R: int, S: int) -> tuple[int, int]:
    """The (R, S) scale matrix padded as the blocked layout stores it: R to 128 rows, S to 4."""
    return (R + 127) // 128 * 128, (S + 3) // 4 * 4


def scales_numel(R: int, S: int) -> int:
    """Bytes of the blocked layout of an (R, S) scale matrix, padding included."""
    Rp, Sp = blocked_padded_shape(R, S)
    return Rp * Sp


def pack_scales_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(..., R, S) scale bytes (uint8 or float8_e8m0fnu) -> a flat buffer of the same dtype in the
    blocked layout, zeros in the padding; each leading index's (R, S) matrix packed on its own,
    one after another (so packing an (E, R, S) stack equals packing its (E*R, S) flattening only
    when R % 128 == 0). Pad to `blocked_padded_shape`, view (B, R/128, 4, 32, S/4, 4), order
    (0, 1, 4, 3, 2, 5): the bytes `blocked_offset` places, written with reshapes (torch.compile
    handles it)."""
    if scales.dim() < 2:
        raise ValueError(f"pack_scales_blocked: scales must be (..., R, S), got shape {tuple(scales.shape)}")
    dtype = scales.dtype
    b = scales.view(torch.uint8) if dtype == torch.float8_e8m0fnu else scales.to(torch.uint8)
    *lead, R, S = b.shape
    B = math.prod(lead)
    Rp, Sp = blocked_padded_shape(R, S)
    padded = torch.nn.functional.pad(b.reshape(B, R, S), (0, Sp - S, 0, Rp - R))
    blocks = padded.reshape(B, Rp // 128, 4, 32, Sp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    flat = blocks.reshape(-1)
    return flat.view(dtype) if dtype == torch.float8_e8m0fnu else flat


def unpack_scales_blocked(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """Inverse of `pack_scales_blocked`: the flat blocked layout -> the row-major scales of
    `shape` = (..., R, S), same dtype (uint8 or float8_e8m0fnu). The padding bytes are dropped."""
    dtype = flat.dtype
    b = flat.view(torch.uint8) if dtype == torch.float8_e8m0fnu else flat
    *lead, R, S = shape
    B = math.prod(lead)
    Rp, Sp = blocked_padded_shape(R, S)
    if b.numel() != B * Rp * Sp:
        raise ValueError(f"unpack_scales_blocked: scales of shape {tuple(shape)} packs to {B * Rp * Sp} bytes, "
                         f"got {b.numel()}")
    # The permutation swaps dims 2 and 4 of (B, Rp/128, 4, 32, Sp/4, 4): it is its own inverse.
    p = b.reshape(B, Rp // 128, Sp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(B, Rp, Sp)
    return p[:, :R, :S].reshape(*shape).contiguous().view(dtype)
