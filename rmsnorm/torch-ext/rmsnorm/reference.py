"""Pure-PyTorch reference of the rmsnorm ops (CPU-capable; no native code).

DESIGN §6/§7.  This file is loaded by path in the tests, so it imports nothing of the package.

    rrms = 1 / sqrt(mean(branch^2) + eps)                      fp32
    y    = ((branch * rrms) * weight) + residual               fp32, each op rounded (no FMA)
    byte = RCEIL e8m0 scale of each 32-element block of y      (see `rceil_scale_bytes`)
    vals = e4m3_satfinite_rne(y * 2^(127 - byte))
    scales: the (N, C/32) bytes in the blocked layout (see `blocked_offsets`), zero padded.
"""

from __future__ import annotations

import torch

MXFP8_SCALE_BLOCK = 32
E4M3_MAX = 448.0
_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # fp32(1/448), round-to-nearest


def rceil_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8) for fp32 block maxima `amax` (>= 0 or NaN), DESIGN §6:
    0 for amax == 0; t = amax * fp32(1/448) (fp32, RN); biased exponent of t, +1 if t has any
    mantissa bit; clamped to [0, 254]; 255 for a non-finite amax."""
    amax = amax.to(torch.float32)
    t = amax * _INV_448
    tb = t.contiguous().view(torch.int32).to(torch.int64)
    byte = ((tb >> 23) & 0xFF) + ((tb & 0x7FFFFF) != 0).to(torch.int64)
    byte = byte.clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isfinite(amax), byte, torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def scale_multiplier(byte: torch.Tensor) -> torch.Tensor:
    """2^(127 - byte) as an exact fp32 (a subnormal for bytes 254 and 255)."""
    e = 254 - byte.to(torch.int64)
    normal = e << 23
    sub = torch.full_like(e, 0x00400000) >> (-e).clamp(min=0)
    bits = torch.where(e >= 1, normal, sub).to(torch.int32)
    return bits.view(torch.float32)


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating to +-448 (Inf too); NaN -> 0x7f."""
    x = x.to(torch.float32)
    q = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(x), torch.full_like(q, 0x7F), q)
    return q.view(torch.float8_e4m3fn)


def blocked_offsets(R: int, S: int) -> torch.Tensor:
    """int64 (R, S): byte offset of scale (r, s) in the blocked layout (DESIGN §6)."""
    r = torch.arange(R, dtype=torch.int64)[:, None]
    s = torch.arange(S, dtype=torch.int64)[None, :]
    s4 = (S + 3) // 4
    return ((r // 128) * s4 + s // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + s % 4


def scales_numel(R: int, S: int) -> int:
    return ((R + 127) // 128) * 128 * ((S + 3) // 4) * 4


def pack_scales_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(R, S) uint8 scale bytes -> flat uint8 buffer in the blocked layout, zeros in the padding.
    (pad to (128*ceil(R/128), 4*ceil(S/4)), view (R/128, 4, 32, S/4, 4), order (0, 3, 2, 1, 4):
    the same bytes as `blocked_offsets`, written with reshapes so torch.compile handles it.)"""
    R, S = scales.shape
    Rp, Sp = (R + 127) // 128 * 128, (S + 3) // 4 * 4
    padded = torch.nn.functional.pad(scales.to(torch.uint8), (0, Sp - S, 0, Rp - R))
    blocks = padded.reshape(Rp // 128, 4, 32, Sp // 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(-1)


def rrms_reference(branch: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    b = branch.to(torch.float32)
    return 1.0 / torch.sqrt((b * b).mean(dim=-1) + epsilon)


def y_reference(branch, residual, weight, epsilon: float = 1e-6, rrms=None, dtype=torch.float32):
    """y = branch * rrms * weight + residual in `dtype` (differentiable; use float64 for truth)."""
    b = branch.to(dtype)
    if rrms is None:
        rrms = torch.rsqrt((b * b).mean(dim=-1) + epsilon) if dtype == torch.float64 else None
        if rrms is None:
            rrms = rrms_reference(branch, epsilon).to(dtype)
    return (b * rrms.to(dtype)[:, None]) * weight.to(dtype) + residual.to(dtype)


def fused_rmsnorm_residual(branch, residual, weight, epsilon: float = 1e-6, rrms=None):
    """Reference of the forward op: (vals float8_e4m3fn (N, C), scales float8_e8m0fnu flat
    blocked, rrms float32 (N,)).  `rrms` overrides the row statistics (tests feed the kernel's)."""
    N, C = branch.shape
    assert C % MXFP8_SCALE_BLOCK == 0, "C must be a multiple of 32"
    S = C // MXFP8_SCALE_BLOCK
    if rrms is None:
        rrms = rrms_reference(branch, epsilon)
    rrms = rrms.to(torch.float32)
    b = branch.to(torch.float32)
    y = (b * rrms[:, None]) * weight.to(torch.float32) + residual.to(torch.float32)
    blocks = y.reshape(N, S, MXFP8_SCALE_BLOCK)
    amax = blocks.abs().amax(dim=-1) if N and S else torch.zeros(N, S)  # NaN propagates
    byte = rceil_scale_bytes(amax)
    q = e4m3_satfinite(blocks * scale_multiplier(byte)[..., None]).reshape(N, C)
    scales = pack_scales_blocked(byte).view(torch.float8_e8m0fnu)
    return q, scales, rrms


def fused_rmsnorm_residual_backward(grad_y, branch, weight, rrms, dtype=torch.float32):
    """Reference backward (quantisation passed straight through): (grad_branch, grad_weight) in
    `dtype`; grad_residual is grad_y."""
    g = grad_y.to(dtype)
    b = branch.to(dtype)
    w = weight.to(dtype)
    r = rrms.to(dtype)[:, None]
    C = b.shape[-1]
    dot = (g * w * b).sum(dim=-1, keepdim=True)
    grad_branch = r * g * w - b * (r**3) * dot / C
    grad_weight = (g * b * r).sum(dim=0)
    return grad_branch, grad_weight
