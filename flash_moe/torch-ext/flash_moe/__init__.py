"""flash_moe: fused MoE forward for routed experts on Hopper (sm_90a).

Public surface (DESIGN §5):

- ``moe_align(topk_ids, num_experts, block_m=BLOCK_M, bpc=1)`` -> (sorted_token_ids, expert_ids,
  num_tokens_post_padded), on the GPU, no host synchronisation.
- ``fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
  out, top_k, ...)`` -> out (written in place).
- ``moe(x, w1, w2, w3, topk_ids, topk_weights)``: align + fused op in one call.
- ``BLOCK_M``, ``MXFP8_SCALE_BLOCK``, ``unsupported_shape_reason``, ``quantize_mxfp8`` and
  ``pack_scales_blocked`` (pure-PyTorch for now; GPU versions come with the MXFP8 op, issue #5),
  and ``reference`` (pure-PyTorch references of every op).
"""

from __future__ import annotations

import torch

from . import reference
from ._ops import add_op_namespace_prefix, ops

BLOCK_M = 128
BLOCK_N = 128  # h columns per gate/up tile (the only value the kernel implements)
WARP_N = 128  # n of one wgmma issued by a consumer warpgroup (the only value implemented)
STAGES = 4  # shared-memory pipeline depth (3 or 4 accepted)
MXFP8_SCALE_BLOCK = 32
MAX_EXPERTS = 512
MAX_TOP_K = 16

quantize_mxfp8 = reference.quantize_mxfp8
pack_scales_blocked = reference.pack_scales_blocked

__all__ = [
    "BLOCK_M",
    "MXFP8_SCALE_BLOCK",
    "moe_align",
    "fused_moe_bf16",
    "moe",
    "unsupported_shape_reason",
    "quantize_mxfp8",
    "pack_scales_blocked",
    "reference",
]


def unsupported_shape_reason(dim: int, hidden_dim: int, *, mxfp8: bool = False, split: bool = True) -> str | None:
    """Why the fused op cannot serve a (dim, hidden_dim) expert shape, or None when it can.

    dim is the model dimension K (x is (M, K)), hidden_dim the expert hidden size I
    (w is (E, 2I, K), w2 is (E, K, I)). Both split settings are served.
    """
    if dim <= 0 or hidden_dim <= 0:
        return f"dim and hidden_dim must be positive, got dim={dim}, hidden_dim={hidden_dim}"
    if dim % 8 != 0:
        return f"dim must be a multiple of 8 (16-byte rows for TMA and the gather), got {dim}"
    if hidden_dim % 8 != 0:
        return f"hidden_dim must be a multiple of 8 (16-byte rows for TMA), got {hidden_dim}"
    if mxfp8:
        return "fused_moe_mxfp8 is not implemented yet (issue #5); use fused_moe_bf16"
    return None


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, bpc: int = 1):
    """Group the flat routing slots by expert for the fused MoE kernel.

    Args:
        topk_ids: (M, top_k) int32 CUDA tensor of expert ids. Ids outside [0, num_experts)
            (-1 = token routed to another rank; any other out-of-range id too) are dropped.
        num_experts: E, 1..512.
        block_m: token block of the GEMM; must be BLOCK_M (128).
        bpc: blocks per cluster; must be 1.

    Returns:
        sorted_token_ids: (L,) int32, L = ceil((M*top_k + E*(block_m-1))/block_m)*block_m.
            Flat slot ids t*top_k+k grouped by expert (ascending slot id inside an expert),
            each expert's run padded to a multiple of block_m with the sentinel M*top_k.
        expert_ids: (L/block_m,) int32, the expert of each block; -1 for unused tail blocks.
        num_tokens_post_padded: (1,) int32 device tensor, the padded length used.

    Deterministic, no host synchronisation, CUDA-graph capturable.
    """
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"moe_align: topk_ids must be int32, got {topk_ids.dtype}")
    return ops.moe_align(topk_ids, int(num_experts), int(block_m), int(bpc))


def fused_moe_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    warp_n: int = WARP_N,
    stages: int = STAGES,
    bpc: int = 1,
    cpc: int = 1,
    split: bool = True,
) -> torch.Tensor:
    """Fused MoE forward (routed experts), bf16, Hopper.

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w[e,:I] @ x[t]) * (w[e,I:] @ x[t])),
    e = topk_ids[t,k] (as grouped by `moe_align`); slots dropped by moe_align contribute 0.

    Args:
        x: (M, K) bf16 tokens.
        w: (E, 2I, K) bf16, cat([gate, up], dim=1).
        w2: (E, K, I) bf16 down projection.
        sorted_token_ids, expert_ids, num_tokens_post_padded: from `moe_align`.
        topk_weights: (M, top_k) fp32 router weights.
        out: (M, K) bf16, written in place and returned.
        top_k: routing fan-out, 1..16.
        block_m, block_n, warp_n, stages, bpc, cpc: tuning; accepted values are exactly
            block_m=128, block_n=128, warp_n=128, stages in {3, 4}, bpc=1, cpc=1.
        split: True -> the op overwrites `out` with the result (every row written, rows of
            tokens with no live slot get 0); False -> the op ADDS the result into `out`
            (the caller pre-zeroes it or passes e.g. a shared-expert output).

    Accumulation is fp32; the SwiGLU output h and each slot's weighted row are rounded to
    bf16; the top-k sum is done in fp32 in ascending k order (deterministic: bit-identical
    output run after run, no float atomics). CUDA-graph capturable.
    """
    ops.fused_moe_bf16(
        x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out,
        int(top_k), int(block_m), int(block_n), int(warp_n), int(stages), int(bpc), int(cpc), bool(split),
    )
    return out


def moe(x, w1, w2, w3, topk_ids, topk_weights, out=None, split=True):
    """One-line routed-expert MoE forward: align, then fused_moe_bf16.

    Args:
        x: (M, K) bf16. w1: gate (E, I, K) bf16. w2: down (E, K, I) bf16. w3: up (E, I, K) bf16.
        topk_ids: (M, top_k) integer expert ids (-1 = dropped). topk_weights: (M, top_k) float.
        out: optional (M, K) bf16 output (split=False adds into it).

    Note: concatenates w1 and w3 into (E, 2I, K) on every call; callers on a hot path should
    keep the concatenated weight and call `moe_align` + `fused_moe_bf16` directly.
    """
    E = w1.shape[0]
    top_k = topk_ids.shape[1]
    w = torch.cat([w1, w3], dim=1).contiguous()
    sorted_ids, expert_ids, ntpp = moe_align(topk_ids.to(torch.int32).contiguous(), E)
    if out is None:
        out = torch.empty_like(x)
    return fused_moe_bf16(x, w, w2.contiguous(), sorted_ids, expert_ids, ntpp,
                          topk_weights.to(torch.float32).contiguous(), out, top_k, split=split)


# ---------------------------------------------------------------- fake kernels (meta / compile)

@torch.library.register_fake(add_op_namespace_prefix("moe_align"))
def _moe_align_fake(topk_ids, num_experts, block_m, bpc):
    n = topk_ids.numel()
    L = (n + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    return (
        topk_ids.new_empty((L,)),
        topk_ids.new_empty((L // block_m,)),
        topk_ids.new_empty((1,)),
    )


@torch.library.register_fake(add_op_namespace_prefix("fused_moe_bf16"))
def _fused_moe_bf16_fake(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out,
                         top_k, block_m, block_n, warp_n, stages, bpc, cpc, split):
    return None
