"""flash_moe: fused MoE for routed experts on Hopper (sm_90a), forward and a differentiable `moe`.

Public surface (docs/DESIGN.md §5):

- ``moe_align(topk_ids, num_experts, block_m=BLOCK_M, bpc=1)`` -> (sorted_token_ids, expert_ids,
  num_tokens_post_padded), on the GPU, no host synchronisation.
- ``fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
  out, top_k, ...)`` -> out (written in place).
- ``fused_moe_bf16_dgrad(grad_out, w1, w3, w2, preact, ...)`` -> (grad_x, dA|dB, s*h, score): the
  backward's data gradients from the pre-activations ``fused_moe_bf16(..., preact=)`` saved.
- ``fused_moe_bf16_wgrad(x, grad_out, dab, sh, ...)`` -> (grad_w1, grad_w3, grad_w2): the
  backward's weight gradients from the dgrad's dA|dB and s*h.
- ``fused_moe_mxfp8(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
  num_tokens_post_padded, topk_weights, out, top_k, ...)`` -> out: the same MoE with MXFP8 (e4m3
  + e8m0 per 32 elements) inputs, exact MX semantics.
- ``quantize_mxfp8(t, blocked=False)`` / ``dequantize_mxfp8(vals, scales)`` on the GPU (docs/DESIGN.md §6),
  ``pack_scales_blocked(scales)`` ((..., MN, K/32) -> flat, each leading index packed on its own;
  pure PyTorch, runs on the GPU too).
- ``moe(x, w1, w2, w3, topk_ids, topk_weights, *, mxfp8=False)``: align + fused op in one call,
  differentiable w.r.t. x, w1, w2, w3 and topk_weights (its backwards are in `functional`;
  docs/DESIGN.md §5.1); ``FusedMoE.apply`` the same with prime-rl's ``_FusedMoE.apply`` arguments;
  ``layers.MoEExperts`` the layer for `kernels.kernelize`.
- ``preferred_bpc(num_tokens, dim, hidden_dim, num_experts, top_k, mxfp8=False, backward=False)``:
  the ``bpc`` (1, or 2 = CTA pairs) measured fastest for a shape; the fused ops (forward and,
  with ``backward=True``, dgrad and wgrad) use it when ``bpc=None`` (their default).
- ``BLOCK_M`` (defined in ``reference``, which the kernels' layout rules need without the native
  code), ``BLOCK_N``, ``WARP_N``, ``STAGES``, ``STAGES_MXFP8`` (the tuning arguments' defaults),
  ``MXFP8_K_BLOCK``, ``MXFP8_SCALE_BLOCK``, ``unsupported_shape_reason``, and ``reference``
  (pure-PyTorch references of every op).
"""

from __future__ import annotations

import torch

from . import reference
from ._ops import add_op_namespace_prefix, ops
from .reference import BLOCK_M, MXFP8_SCALE_BLOCK

# The binding's TORCH_CHECKs are the contract; these defaults and unsupported_shape_reason restate
# it, and flash_moe/tests/test_op_contract_gpu.py holds them equal to what the built ops accept.
BLOCK_N = 128  # h columns per gate/up tile (the only value the kernel implements)
WARP_N = 128  # n of one wgmma issued by a consumer warpgroup (the only value implemented)
STAGES = 4  # shared-memory pipeline depth (3 or 4 accepted)
STAGES_MXFP8 = 6  # shared-memory stages of the MXFP8 kernel (the only value implemented)
MXFP8_K_BLOCK = 64  # fused_moe_mxfp8 needs dim and hidden_dim to be multiples of this

pack_scales_blocked = reference.pack_scales_blocked

__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "WARP_N",
    "STAGES",
    "STAGES_MXFP8",
    "MXFP8_K_BLOCK",
    "MXFP8_SCALE_BLOCK",
    "moe_align",
    "fused_moe_bf16",
    "fused_moe_bf16_dgrad",
    "fused_moe_bf16_wgrad",
    "preact_numel",
    "fused_moe_mxfp8",
    "moe",
    "FusedMoE",
    "preferred_bpc",
    "unsupported_shape_reason",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "pack_scales_blocked",
    "functional",
    "layers",
    "reference",
]


def unsupported_shape_reason(dim: int, hidden_dim: int, *, mxfp8: bool = False, split: bool = True) -> str | None:
    """Why the fused op cannot serve a (dim, hidden_dim) expert shape, or None when it can.

    dim is the model dimension K (x is (M, K)), hidden_dim the expert hidden size I
    (w is (E, 2I, K), w2 is (E, K, I)). Both split settings are served. The rules restate the
    binding's checks of K and I: None exactly when the op accepts the shape
    (flash_moe/tests/test_op_contract_gpu.py).
    """
    if dim <= 0 or hidden_dim <= 0:
        return f"dim and hidden_dim must be positive, got dim={dim}, hidden_dim={hidden_dim}"
    if dim % 8 != 0:
        return f"dim must be a multiple of 8 (16-byte rows for TMA and the gather), got {dim}"
    if hidden_dim % 8 != 0:
        return f"hidden_dim must be a multiple of 8 (16-byte rows for TMA), got {hidden_dim}"
    if mxfp8 and dim % MXFP8_K_BLOCK != 0:
        return f"dim must be a multiple of {MXFP8_K_BLOCK} for fused_moe_mxfp8 (its K block), got {dim}"
    if mxfp8 and hidden_dim % MXFP8_K_BLOCK != 0:
        return f"hidden_dim must be a multiple of {MXFP8_K_BLOCK} for fused_moe_mxfp8 (its K block), got {hidden_dim}"
    return None


def preferred_bpc(num_tokens: int, dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                  mxfp8: bool = False, backward: bool = False) -> int:
    """The `bpc` that measured fastest on the H200 for a shape, 2 (CTA pairs sharing weight loads)
    or 1; the ops take it when called with `bpc=None` (their default). The output bits do not
    depend on `bpc`, only the time does.

    Forward (`fused_moe_bf16` / `fused_moe_mxfp8`): 2 for the bf16 op when the experts average at
    least two BLOCK_M-slot blocks (pairs split each expert's rows evenly and carry its short
    tail); else 1: bf16 slower with one block an expert, MXFP8 never faster
    (flash_moe/DESIGN.md §5).

    backward=True (`fused_moe_bf16_dgrad` / `fused_moe_bf16_wgrad`, whatever the forward's
    format): the bf16 forward's rule. Measured (flash_moe/DESIGN.md §8.4): -3 to -7 % at the
    backward's shape 4 in every run, level spaced and -2 to -3 % back to back at shape 3, level
    spaced and -1.3 / -1.4 % back to back (means of five runs) at dim 2048, +0.5 to +9 % with 64
    rows an expert.
    """
    if mxfp8 and not backward:  # the backward is bf16 whatever the forward ran
        return 1
    return 2 if num_tokens * top_k >= 2 * BLOCK_M * num_experts else 1


def _default_bpc(x: torch.Tensor, num_experts: int | None, hidden_dim: int | None, top_k: int, **rule) -> int:
    # Shapes are only read when they are what the op accepts (None: a dim the caller could not
    # read); anything else gets bpc=1 and the op's own check names the bad argument.
    if x.dim() != 2 or num_experts is None or hidden_dim is None:
        return 1
    return preferred_bpc(x.shape[0], x.shape[1], hidden_dim, num_experts, int(top_k), **rule)


def _experts_and_hidden(w: torch.Tensor, rows_per_hidden: int) -> tuple[int | None, int | None]:
    """(E, I) of a weight (E, rows_per_hidden * I, K); (None, None) when w is not 3-D."""
    return (w.shape[0], w.shape[1] // rows_per_hidden) if w.dim() == 3 else (None, None)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, bpc: int = 1):
    """Group the flat routing slots by expert for the fused MoE kernel.

    Args:
        topk_ids: (M, top_k) int32 CUDA tensor of expert ids. Ids outside [0, num_experts)
            (-1 = token routed to another rank; any other out-of-range id too) are dropped.
        num_experts: E, 1..512.
        block_m: token block of the GEMM; must be BLOCK_M (128).
        bpc: blocks per cluster; must be 1 (fused_moe_bf16 with bpc=2 uses the same alignment).

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
    bpc: int | None = None,
    cpc: int = 1,
    split: bool = True,
    preact: torch.Tensor | None = None,
    w3: torch.Tensor | None = None,
    preact_only: bool = False,
) -> torch.Tensor:
    """Fused MoE forward (routed experts), bf16, Hopper.

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w[e,:I] @ x[t]) * (w[e,I:] @ x[t])),
    e = topk_ids[t,k] (as grouped by `moe_align`); slots dropped by moe_align contribute 0.

    Args:
        x: (M, K) bf16 tokens.
        w: (E, 2I, K) bf16, cat([gate, up], dim=1); or, with `w3`, the gate rows w1 (E, I, K).
        w2: (E, K, I) bf16 down projection.
        sorted_token_ids, expert_ids, num_tokens_post_padded: from `moe_align`. The kernels
            rely on its layout: inside each expert's padded run the live slot ids come first,
            then the sentinel (a live id after a sentinel in the same run may be skipped).
            Ids outside [0, M*top_k) and blocks of experts outside [0, E) are skipped, never
            read out of bounds.
        topk_weights: (M, top_k) fp32 router weights.
        out: (M, K) bf16, written in place and returned.
        top_k: routing fan-out, 1..16.
        block_m, block_n, warp_n, stages, bpc, cpc: tuning; accepted values are exactly
            block_m=128, block_n=128, warp_n=128, stages in {3, 4}, bpc in {None, 1, 2}, cpc=1.
            cpc is a cluster-shape argument reserved beside bpc in the op's signature
            (docs/DESIGN.md §5); only 1 is implemented, and it stays so that callers written
            against that signature keep working.
            bpc=None (the default) takes `preferred_bpc` of the call's shape, the value
            measured fastest; the output bits do not depend on bpc, only the time does.
            bpc=2 runs both GEMMs as clusters of two CTAs: two m-blocks of one expert share
            each weight load (TMA multicast) and split their live slots evenly between the
            two CTAs; an expert's odd last block splits its n-blocks over the pair, or, when
            it holds at most 32 live slots, joins the pair's parts. Same output bits as
            bpc=1. Needs no change to `moe_align`.
        split: True -> the op overwrites `out` with the result (every row written, rows of
            tokens with no live slot get 0); False -> the op ADDS the result into `out`
            (the caller pre-zeroes it or passes e.g. a shared-expert output).
        preact: for training, a bf16 tensor of `preact_numel(len(sorted_token_ids), I)`
            elements the op fills with the gate/up pre-activations (in the GEMM's own order,
            opaque) for `fused_moe_bf16_dgrad`; needs I % 64 == 0. None: not saved.
        w3: (E, I, K) bf16 up rows, w1's shape: the kernel reads w1 and w3 where they are, so a
            caller holding them apart (as `moe` does) copies no weights. Same output bits as
            w = cat([w1, w3], dim=1). None: `w` holds both.
        preact_only: run the gate/up GEMM alone: `preact` (required) gets the same bits as
            the whole op writes there, `out` is not written (the MXFP8 forward's backward
            recomputes only these).

    Accumulation is fp32; the SwiGLU output h and each slot's weighted row are rounded to
    bf16; the top-k sum is done in fp32 in ascending k order (deterministic: bit-identical
    output run after run, no float atomics). CUDA-graph capturable.
    """
    if bpc is None:
        bpc = _default_bpc(x, *_experts_and_hidden(w, 1 if w3 is not None else 2), top_k)
    ops.fused_moe_bf16(
        x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out,
        int(top_k), int(block_m), int(block_n), int(warp_n), int(stages), int(bpc), int(cpc), bool(split), preact, w3,
        bool(preact_only),
    )
    return out


def preact_numel(sorted_len: int, hidden_dim: int) -> int:
    """Elements (bf16) of the pre-activations `fused_moe_bf16(..., preact=)` saves: 2 * L * I."""
    return 2 * int(sorted_len) * int(hidden_dim)


def fused_moe_bf16_dgrad(
    grad_out: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    preact: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    top_k: int,
    bpc: int | None = None,
):
    """Data gradients of `fused_moe_bf16`, given the forward's routing buffers and `preact`.

    With a = x W_gate^T, u = x W_up^T (the saved pre-activations, bf16), h = silu(a) u,
    g = grad_out rows of each slot's token and s its router weight:

    Returns:
        grad_x: (M, K) bf16, sum over the token's slots (ascending k, fp32) of
            dA @ w1[e] + dB @ w3[e] (each slot's row rounded to bf16).
        dab: (L, 2I) bf16 by sorted position: s * (g W2[e]) * u * silu'(a) | s * (g W2[e]) * silu(a);
            zero at padding positions of the experts' m-blocks; rows past them (from
            num_tokens_post_padded) are unspecified.
        sh: (L, I) bf16 by sorted position: s * h; as dab at padding positions.
        score: (M, top_k) fp32, d out / d topk_weights = <g W2[e], h>; 0 for dropped slots.

    dab and sh are the wgrads' operands: grad_w1|w3[e] = dab_e^T x_e, grad_w2[e] = g_e^T sh_e.
    w1, w3: (E, I, K) bf16 gate and up projections (the forward's w = cat([w1, w3], 1), kept
    apart here so the backward never copies them); the rest as `fused_moe_bf16` (grad_out like
    x); I % 64 == 0. bpc: 1, or 2 to run both GEMMs as CTA pairs sharing each weight load (the
    down dgrad a whole m-block per CTA, the gate/up dgrad two m-blocks split by live rows, as
    `fused_moe_bf16(bpc=2)` splits them); None (the default) takes `preferred_bpc(...,
    backward=True)` of the call's shape; the output bits do not depend on it. Deterministic (no
    float atomics), no host synchronisation.
    """
    if bpc is None:
        bpc = _default_bpc(grad_out, *_experts_and_hidden(w1, 1), top_k, backward=True)
    return ops.fused_moe_bf16_dgrad(grad_out, w1, w3, w2, preact, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    topk_weights, int(top_k), int(bpc))


def fused_moe_bf16_wgrad(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    dab: torch.Tensor,
    sh: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    num_experts: int,
    top_k: int,
    bpc: int | None = None,
):
    """Weight gradients of `fused_moe_bf16` from `fused_moe_bf16_dgrad`'s dab and sh.

    For each expert e, over its live sorted positions p (slot s = sorted_token_ids[p], token
    t = s // top_k), fp32 sums in position order, rounded once:

    Returns:
        grad_w1, grad_w3: (E, I, K) bf16, sum_p dab[p, :I] (resp. dab[p, I:]) outer x[t].
        grad_w2: (E, K, I) bf16, sum_p grad_out[t] outer sh[p].
        An expert with no live position gets zeros.

    x, grad_out: (M, K) bf16; dab (L, 2I), sh (L, I) bf16 as fused_moe_bf16_dgrad returned them
    for the same routing buffers, which must have moe_align's layout (an expert's m-blocks
    consecutive, padding after its live rows; with other buffers reads stay in bounds and the
    gradients are undefined); I % 64 == 0. bpc: 1, or 2 to run both GEMMs as CTA pairs (two
    output tiles of one expert's rows per pair, sharing the loads of dab or sh; K <= 128, one
    such tile, runs unpaired); None (the default) takes `preferred_bpc(..., backward=True)` of the
    call's shape; the output bits do not depend on it. Each output tile is one CTA's (no float
    atomics): bit-identical run to run; no host synchronisation.
    """
    if bpc is None:
        bpc = _default_bpc(x, int(num_experts), sh.shape[1] if sh.dim() == 2 else None, top_k, backward=True)
    return ops.fused_moe_bf16_wgrad(x, grad_out, dab, sh, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                    int(num_experts), int(top_k), int(bpc))


def fused_moe_mxfp8(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    warp_n: int = WARP_N,
    stages: int = STAGES_MXFP8,
    bpc: int | None = None,
    cpc: int = 1,
    split: bool = True,
) -> torch.Tensor:
    """Fused MoE forward with MXFP8 inputs, Hopper: the `fused_moe_bf16` computation on
    x = q_x * 2^(s_x - 127), w = q_w * 2^(s_w - 127), w2 = q_w2 * 2^(s_w2 - 127).

    Args:
        x: (M, K) float8_e4m3fn; x_scales: (M, K/32) float8_e8m0fnu, row-major (one scale per
            32 consecutive elements of a row).
        w: (E, 2I, K) float8_e4m3fn, cat([gate, up], dim=1); w_scales: `pack_scales_blocked`
            of its (E, 2I, K/32) scales (each expert packed on its own), i.e.
            `quantize_mxfp8(w, blocked=True)[1]`.
        w2: (E, K, I) float8_e4m3fn; w2_scales: `pack_scales_blocked` of its (E, K, I/32) scales.
            Packing the (E*K, I/32) flattening as one matrix instead is refused where it differs
            (K % 128 != 0) with an error that says so.
        K and I multiples of 64 (`unsupported_shape_reason(K, I, mxfp8=True)` says so).
            Routing buffers, topk_weights, out, top_k, split: as in `fused_moe_bf16`.
            stages: 6 (the only depth implemented). bpc: None, 1 or 2, as in `fused_moe_bf16`
            (None takes `preferred_bpc(..., mxfp8=True)`, which is 1: 2 measured no faster). block_m,
            block_n, warp_n, cpc: the bf16 op's only values.

    Semantics (exact MX): every product (q_a 2^sa)(q_b 2^sb) is exact and sums are fp32. The
    kernel dequantizes x once and the weights in registers to bf16 for bf16 wgmma, which is
    exact for every scale byte in [3, 246] (bf16 has fp32's exponent range and 8 significant
    bits, e4m3 has 4); outside that range values are rounded as bf16 would. A scale byte of
    255 (the e8m0 NaN) makes its block NaN, so NaN reaches exactly the rows that use it. The
    SwiGLU output h stays bf16 (not requantized: the down GEMM runs on bf16 tensor cores either
    way), each slot's weighted row is rounded to bf16, the top-k sum is fp32 in ascending k.
    Deterministic and CUDA-graph capturable.

    Speed path (same output bits): the gate/up GEMM runs on f16 operands, which are cheaper to
    convert from e4m3, when every row of x and of w has its scale bytes (255 aside) within 22 of
    its largest, that largest in [95, 174], or the lower blocks all zero. A scan of the scales
    decides this on the GPU on each call (no host sync); otherwise the call takes the bf16
    path. Environment variable FLASH_MOE_MXFP8_GENERAL=1 forces the bf16 path (for tests).
    """
    if bpc is None:
        bpc = _default_bpc(x, *_experts_and_hidden(w, 2), top_k, mxfp8=True)
    ops.fused_moe_mxfp8(
        x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids, num_tokens_post_padded,
        topk_weights, out, int(top_k), int(block_m), int(block_n), int(warp_n), int(stages), int(bpc), int(cpc),
        bool(split),
    )
    return out


def quantize_mxfp8(t: torch.Tensor, *, blocked: bool = False):
    """MXFP8-quantize `t` along its last dim (docs/DESIGN.md §6): returns (vals, scales).

    t: bf16 or fp32, last dim K a multiple of 32, contiguous. vals: float8_e4m3fn, t's shape.
    scales: float8_e8m0fnu, shape t.shape[:-1] + (K/32,) row-major, or with blocked=True
    `pack_scales_blocked` of those: flat, each leading index's (MN, K/32) matrix packed on its own
    (what fused_moe_mxfp8 takes for w_scales / w2_scales of (E, MN, K) weights). RCEIL scales, saturating round-to-nearest-even values; a block
    holding NaN/Inf gets scale byte 255. Runs on the GPU for CUDA tensors (bit-exact to
    `reference.quantize_mxfp8`), on the reference otherwise.
    """
    if t.device.type != "cuda":
        return reference.quantize_mxfp8(t, blocked=blocked)
    return ops.quantize_mxfp8(t, bool(blocked))


def dequantize_mxfp8(vals: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """vals (..., K) float8_e4m3fn, scales (..., K/32) float8_e8m0fnu row-major -> q * 2^(s - 127).

    Scale byte 255 makes its block NaN. bf16 output on the GPU (exact for scale bytes 3..246);
    any other dtype or device goes through the reference (exact in fp32).
    """
    if vals.device.type == "cuda" and dtype == torch.bfloat16:
        return ops.dequantize_mxfp8(vals, scales)
    return reference.dequantize_mxfp8(vals, scales, dtype=dtype)


# ---------------------------------------------------------------- fake kernels (meta / compile)

@torch.library.register_fake(add_op_namespace_prefix("moe_align"))
def _moe_align_fake(topk_ids, num_experts, block_m, bpc):
    L = reference.aligned_length(topk_ids.numel(), num_experts, block_m)
    return (
        topk_ids.new_empty((L,)),
        topk_ids.new_empty((L // block_m,)),
        topk_ids.new_empty((1,)),
    )


@torch.library.register_fake(add_op_namespace_prefix("fused_moe_bf16"))
def _fused_moe_bf16_fake(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out,
                         top_k, block_m, block_n, warp_n, stages, bpc, cpc, split, preact=None, w3=None,
                         preact_only=False):
    return None


@torch.library.register_fake(add_op_namespace_prefix("fused_moe_bf16_dgrad"))
def _fused_moe_bf16_dgrad_fake(grad_out, w1, w3, w2, preact, sorted_token_ids, expert_ids, num_tokens_post_padded,
                               topk_weights, top_k, bpc):
    L, I = sorted_token_ids.shape[0], w1.shape[1]
    return (grad_out.new_empty(grad_out.shape), grad_out.new_empty((L, 2 * I)), grad_out.new_empty((L, I)),
            grad_out.new_empty(topk_weights.shape, dtype=torch.float32))


@torch.library.register_fake(add_op_namespace_prefix("fused_moe_bf16_wgrad"))
def _fused_moe_bf16_wgrad_fake(x, grad_out, dab, sh, sorted_token_ids, expert_ids, num_tokens_post_padded,
                               num_experts, top_k, bpc):
    K, I = x.shape[1], sh.shape[1]
    return (x.new_empty((num_experts, I, K)), x.new_empty((num_experts, I, K)), x.new_empty((num_experts, K, I)))


@torch.library.register_fake(add_op_namespace_prefix("fused_moe_mxfp8"))
def _fused_moe_mxfp8_fake(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids,
                          num_tokens_post_padded, topk_weights, out, top_k, block_m, block_n, warp_n, stages, bpc,
                          cpc, split):
    return None


@torch.library.register_fake(add_op_namespace_prefix("quantize_mxfp8"))
def _quantize_mxfp8_fake(t, blocked):
    K = t.shape[-1]
    S = K // MXFP8_SCALE_BLOCK
    vals = t.new_empty(t.shape, dtype=torch.float8_e4m3fn)
    if blocked:  # each (mat_rows, S) matrix of the leading indices packed on its own
        mat_rows = t.shape[-2] if t.dim() >= 2 else 1
        mats = t.numel() // (K * mat_rows) if mat_rows else 0
        Rp, Sp = reference.blocked_padded_shape(mat_rows, S)
        scales = t.new_empty((mats * Rp * Sp,), dtype=torch.float8_e8m0fnu)
    else:
        scales = t.new_empty((*t.shape[:-1], S), dtype=torch.float8_e8m0fnu)
    return vals, scales


@torch.library.register_fake(add_op_namespace_prefix("dequantize_mxfp8"))
def _dequantize_mxfp8_fake(vals, scales):
    return vals.new_empty(vals.shape, dtype=torch.bfloat16)


# Last: the differentiable `moe` and the layers call the ops above.
from . import functional, layers  # noqa: E402
from .functional import FusedMoE, moe  # noqa: E402
