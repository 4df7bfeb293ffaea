"""Pure-PyTorch reference of the rmsnorm ops (CPU-capable; no native code).

docs/DESIGN.md §6/§7.  It imports nothing of the package but its sibling `mxfp8_rules` (the MXFP8
rules flash_moe's reference shares), so tests and benchmarks load it without the package's
__init__ and native code (kernel_package.load_reference).

    rrms = 1 / sqrt(mean(branch^2) + eps)                      fp32
    y    = ((branch * rrms) * weight) + residual               fp32, each op rounded (no FMA)
    byte = RCEIL e8m0 scale of each 32-element block of y      (see `rceil_scale_bytes`)
    vals = e4m3_satfinite_rne(y * 2^(127 - byte))
    scales: the (N, C/32) bytes in the blocked layout (see `blocked_offsets`), zero padded.
"""

from __future__ import annotations

import torch

from .mxfp8_rules import (  # noqa: F401  (the rules are part of this module's surface)
    MXFP8_SCALE_BLOCK,
    blocked_offsets,
    blocked_padded_shape,
    e4m3_satfinite,
    pack_scales_blocked,
    rceil_scale_bytes,
    scale_multiplier,
    scales_numel,
    unpack_scales_blocked,
)


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
