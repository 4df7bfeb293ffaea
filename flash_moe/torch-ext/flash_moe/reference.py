"""Pure-PyTorch references of every flash_moe op (CPU-capable, no native code).

It imports nothing of the package but its sibling `mxfp8_rules` (the MXFP8 rules rmsnorm's
reference shares), so tests and benchmarks load it without the package's __init__ and native
code (kernel_package.load_reference). The references define the semantics the CUDA kernels are
held to:

- `moe_align`: flat slot ids `t*top_k + k` grouped by expert, ascending slot id inside an
  expert (stable), each expert's run padded to a multiple of `block_m` with the sentinel
  `M*top_k`, `expert_ids[b]` per block of `block_m`, -1 for unused tail blocks, total buffer
  length `ceil((n + E*(block_m-1))/block_m)*block_m`. Ids outside `[0, E)` (-1: routed to
  another rank) are dropped.
- `fused_moe_bf16`: fp32 accumulation, the SwiGLU output rounded to bf16 between the GEMMs
  (as the kernel does), per-slot results rounded to bf16, top-k sum in fp32 in ascending k.
- `fused_moe_mxfp8`: the same computation (one shared implementation, `_fused_moe_blocks`) on
  the exactly dequantized MXFP8 inputs `q * 2^(byte-127)` (fp32); h is rounded to bf16, not
  requantized. A scale byte of 255 (e8m0 NaN) makes its whole block NaN.
- `fused_moe_bf16_dgrad`, `fused_moe_bf16_wgrad`: the backward's data and weight gradients by
  sorted position, fp32 sums rounded to bf16 as the kernels round; `pack_preact` /
  `unpack_preact`: the saved pre-activations' layout (the kernels' fragment order).
- `grouped_mm_path`: the unfused bf16 path (sort, gather, three `torch._grouped_mm`, weight,
  index_add; its slot order `grouped_mm_layout`): the accuracy peer the tests hold the fused op
  to, and the benchmark's peer.
- `moe_fp32`: the exact definition in fp32 (truth for accuracy tests).
- `quantize_mxfp8`, `pack_scales_blocked`: docs/DESIGN.md §6 (RCEIL scales, e4m3 saturating
  RNE, blocked 128x4 scale layout; the rules themselves are in `mxfp8_rules`);
  `dequantize_mxfp8` and `unpack_scales_blocked` invert them (row-major scales).
"""

from __future__ import annotations

import torch

from .mxfp8_rules import (  # noqa: F401  (blocked_offset: part of this module's surface)
    MXFP8_SCALE_BLOCK,
    blocked_offset,
    blocked_padded_shape,
    e4m3_saturating,
    pack_scales_blocked,
    rceil_scale_bytes,
    scale_multiplier,
    unpack_scales_blocked,
)

BLOCK_M = 128  # the binding's only block_m (kBlockM); flash_moe/tests/test_op_contract_gpu.py checks it


def aligned_length(n_slots: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Length of moe_align's sorted_token_ids buffer for n_slots = M*top_k flat slots (the one
    Python statement of it: the package's fake kernel calls this; the binding has its own C++ one)."""
    return (n_slots + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, bpc: int = 1):
    """Reference of `flash_moe.moe_align`; returns (sorted_token_ids, expert_ids, num_tokens_post_padded)."""
    if bpc != 1:
        raise ValueError(f"moe_align: bpc must be 1, got {bpc}")
    ids = topk_ids.reshape(-1).to(torch.int64).cpu()
    n = ids.numel()
    L = aligned_length(n, num_experts, block_m)
    sentinel = n
    sorted_ids = torch.full((L,), sentinel, dtype=torch.int32)
    expert_ids = torch.full((L // block_m,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        slots = torch.nonzero(ids == e).reshape(-1)  # ascending slot order
        c = slots.numel()
        if c == 0:
            continue
        sorted_ids[pos:pos + c] = slots.to(torch.int32)
        padded = (c + block_m - 1) // block_m * block_m
        expert_ids[pos // block_m:(pos + padded) // block_m] = e
        pos += padded
    dev = topk_ids.device
    return sorted_ids.to(dev), expert_ids.to(dev), torch.tensor([pos], dtype=torch.int32, device=dev)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def moe_fp32(x, w, w2, topk_ids, topk_weights, dtype=torch.float32):
    """Truth: out[t] = sum_k wt[t,k] * w2[e] @ (silu(w[e,:I] @ x[t]) * (w[e,I:] @ x[t])), in `dtype`.

    x (M, K), w (E, 2I, K), w2 (E, K, I), topk_ids (M, top_k) (ids outside [0, E) dropped),
    topk_weights (M, top_k). Returns (M, K) in `dtype`.
    """
    M, K = x.shape
    E, N, _ = w.shape
    I = N // 2
    xf = x.to(dtype)
    out = torch.zeros(M, K, dtype=dtype, device=x.device)
    ids = topk_ids.to(torch.int64)
    for e in range(E):
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        xe = xf[t]
        we, w2e = w[e].to(dtype), w2[e].to(dtype)  # one expert at a time: all of w in fp32 can be tens of GB
        h = _silu_mul(xe @ we[:I].T, xe @ we[I:].T)
        y = (h @ w2e.T) * topk_weights[t, k].to(dtype)[:, None]
        out.index_add_(0, t, y)
    return out


def _fused_moe_blocks(xf, expert_weights, num_experts, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      topk_weights, out, top_k, block_m, split):
    """The fused op's computation on fp32 inputs, walking moe_align's blocks like the kernel.

    xf: (M, K) fp32 tokens. expert_weights(e) -> (w_e (2I, K), w2_e (K, I)) fp32, fetched per
    expert so a caller can dequantize one expert at a time. Accumulation is fp32, h and each
    weighted slot row are rounded to bf16, the top-k sum is fp32 in ascending k. Block entries
    outside [0, E) and sorted ids outside [0, M*top_k) are skipped, as the kernel skips them.
    """
    M, K = xf.shape
    E = num_experts
    n_slots = M * top_k
    used_len = int(num_tokens_post_padded.reshape(-1)[0])  # the padded length moe_align filled
    used_len = max(0, min(used_len, sorted_token_ids.numel()))
    sid = sorted_token_ids[:used_len].to(torch.int64).cpu()
    eid = expert_ids.to(torch.int64).cpu()
    acc = torch.zeros(n_slots, K, dtype=torch.float32, device=xf.device)
    wts = topk_weights.reshape(-1).float()
    for b in range(min(used_len // block_m, eid.numel())):
        e = int(eid[b])
        if e < 0 or e >= E:
            continue
        rows = sid[b * block_m:(b + 1) * block_m]
        rows = rows[(rows >= 0) & (rows < n_slots)]
        if rows.numel() == 0:
            continue
        rows_d = rows.to(xf.device)
        xe = xf[rows_d // top_k]
        we, w2e = expert_weights(e)
        I = we.shape[0] // 2
        h = _silu_mul(xe @ we[:I].T, xe @ we[I:].T).to(torch.bfloat16).float()
        y = (h @ w2e.T) * wts[rows_d][:, None]
        acc[rows_d] = y.to(torch.bfloat16).float()
    res = acc.view(M, top_k, K).sum(1)
    if not split:
        res = res + out.float()
    out.copy_(res.to(out.dtype))
    return out


def fused_moe_bf16(x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, out, top_k,
                   block_m: int = BLOCK_M, block_n: int = 128, warp_n: int = 128, stages: int = 4, bpc=None,
                   cpc: int = 1, split: bool = True, preact=None, w3=None, preact_only: bool = False):
    """Reference of `flash_moe.fused_moe_bf16` (fp32 accumulation, bf16 h, bf16 per-slot rows),
    with the op's signature.

    Writes `out` in place and returns it: split=True overwrites out, split=False adds into it.
    preact: filled with `pack_preact` of the bf16 pre-activations by sorted position (zero at
    padding positions). w3: the up rows, `w` then being the gate rows w1. preact_only: fill
    preact alone, leaving out as it is. block_n, warp_n, stages, bpc, cpc are the kernel's
    tuning arguments; they do not change the result and are ignored here.
    """
    if preact_only and preact is None:
        raise RuntimeError("fused_moe_bf16: preact_only=True needs preact (the pre-activations are all it computes)")
    if w3 is not None:
        w = torch.cat([w, w3], dim=1)
    if preact is not None:
        a, u = _preactivations(x, w, sorted_token_ids, num_tokens_post_padded, expert_ids, top_k, block_m)
        preact.copy_(pack_preact(a.bfloat16(), u.bfloat16()))
        if preact_only:
            return out
    return _fused_moe_blocks(x.float(), lambda e: (w[e].float(), w2[e].float()), w.shape[0], sorted_token_ids,
                             expert_ids, num_tokens_post_padded, topk_weights, out, top_k, block_m, split)


# ---------------------------------------------------------------- the backward's data gradients

def _preact_index(L: int, I: int, device=None) -> torch.Tensor:
    """(2, L, I) int64: where (gate | up, position p, feature f) lives in the flat preact.

    The kernel's fragment order (flash_moe/DESIGN.md §8): 16-byte chunk
    c = ((f // 64 * L/8 + p // 8) * 4 + w4) * 32 + lane with r = f % 64, w4 = r // 16,
    lane = 4 * (r % 8) + (p % 8) // 2; in it, gate at 2h + e and up at 4 + 2h + e, with
    h = (r % 16) // 8, e = p % 2.
    """
    p = torch.arange(L, device=device).view(L, 1)
    f = torch.arange(I, device=device).view(1, I)
    r = f % 64
    chunk = ((f // 64 * (L // 8) + p // 8) * 4 + r // 16) * 32 + 4 * (r % 8) + (p % 8) // 2
    elem = 2 * ((r % 16) // 8) + p % 2
    return torch.stack([8 * chunk + elem, 8 * chunk + 4 + elem])


def pack_preact(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The flat preact (2 * L * I,) of gate and up pre-activations a, u (L, I) by sorted position."""
    L, I = a.shape
    out = a.new_zeros(2 * L * I)
    out[_preact_index(L, I, a.device).reshape(-1)] = torch.stack([a, u]).reshape(-1)
    return out


def unpack_preact(preact: torch.Tensor, L: int, I: int):
    """(a, u), each (L, I): the inverse of `pack_preact`."""
    both = preact[_preact_index(L, I, preact.device)]
    return both[0], both[1]


def _live_positions(sorted_token_ids, num_tokens_post_padded, n_slots):
    L = sorted_token_ids.numel()
    pos = torch.arange(L, device=sorted_token_ids.device)
    used = int(num_tokens_post_padded.reshape(-1)[0])
    return (sorted_token_ids >= 0) & (sorted_token_ids < n_slots) & (pos < used)


def _preactivations(x, w, sorted_token_ids, num_tokens_post_padded, expert_ids, top_k, block_m):
    """fp32 gate and up pre-activations (L, I) by sorted position (zero at padding positions)."""
    L, (E, N, _) = sorted_token_ids.numel(), w.shape
    I = N // 2
    live = _live_positions(sorted_token_ids, num_tokens_post_padded, x.shape[0] * top_k)
    expert = expert_ids.to(torch.int64).repeat_interleave(block_m)[:L]
    a = torch.zeros(L, I, device=x.device)
    u = torch.zeros(L, I, device=x.device)
    for e in range(E):
        p = torch.nonzero(live & (expert == e)).flatten()
        if p.numel():
            xe = x[sorted_token_ids[p].long() // top_k].float()
            a[p], u[p] = xe @ w[e, :I].float().T, xe @ w[e, I:].float().T
    return a, u


def fused_moe_bf16_dgrad(grad_out, w1, w3, w2, preact, sorted_token_ids, expert_ids, num_tokens_post_padded,
                         topk_weights, top_k, bpc: int | None = None, block_m: int = BLOCK_M):
    """Reference of `flash_moe.fused_moe_bf16_dgrad` (any bpc: the kernel's bits do not depend on
    it), in fp32 from the bf16 pre-activations:
    per live position p (slot s, token t, expert e, router weight r), with a, u from preact,
    h = silu(a) u and dh = grad_out[t] @ w2[e]: dA|dB[p] = r dh (u silu'(a) | silu(a)) and
    sh[p] = r h (bf16, zero at padding positions), score[s] = dh . h (fp32, 0 if dropped), and
    grad_x[t] = sum over k ascending of the bf16 rows dA|dB[p] @ (w1|w3)[e] (fp32 sum, bf16 result)."""
    M, K = grad_out.shape
    E, I, _ = w1.shape
    N, L = 2 * I, sorted_token_ids.numel()
    n_slots = M * top_k
    a, u = (t.float() for t in unpack_preact(preact, L, I))
    live = _live_positions(sorted_token_ids, num_tokens_post_padded, n_slots)
    expert = expert_ids.to(torch.int64).repeat_interleave(block_m)[:L]
    dab = torch.zeros(L, N, device=grad_out.device)
    sh = torch.zeros(L, I, device=grad_out.device)
    score = torch.zeros(n_slots, device=grad_out.device)
    dx = torch.zeros(n_slots, K, device=grad_out.device)
    wts = topk_weights.reshape(-1).float()
    for e in range(E):
        p = torch.nonzero(live & (expert == e)).flatten()
        if p.numel() == 0:
            continue
        slot = sorted_token_ids[p].long()
        r = wts[slot].unsqueeze(1)
        sig = torch.sigmoid(a[p])
        silu = a[p] * sig
        h = silu * u[p]
        dh = grad_out[slot // top_k].float() @ w2[e].float()
        dab[p] = torch.cat([r * dh * u[p] * sig * (1 + a[p] * (1 - sig)), r * dh * silu], 1).bfloat16().float()
        sh[p] = r * h
        score[slot] = (dh * h).sum(1)
        dx[slot] = (dab[p] @ torch.cat([w1[e], w3[e]]).float()).bfloat16().float()
    grad_x = dx.view(M, top_k, K).sum(1).bfloat16()
    return grad_x, dab.bfloat16(), sh.bfloat16(), score.view(M, top_k)


def fused_moe_bf16_wgrad(x, grad_out, dab, sh, sorted_token_ids, expert_ids, num_tokens_post_padded, num_experts,
                         top_k, bpc: int | None = None, block_m: int = BLOCK_M):
    """Reference of `flash_moe.fused_moe_bf16_wgrad` (any bpc), in fp32: over expert e's
    live positions p (slot s, token t = s // top_k), grad_w1|w3[e] = sum_p dab[p, :I | I:] outer x[t] (E, I, K) and
    grad_w2[e] = sum_p grad_out[t] outer sh[p] (E, K, I), bf16; zeros for an expert without rows."""
    M, K = x.shape
    L, I = sh.shape
    live = _live_positions(sorted_token_ids, num_tokens_post_padded, M * top_k)
    expert = expert_ids.to(torch.int64).repeat_interleave(block_m)[:L]
    gw = torch.zeros(num_experts, 2 * I, K, device=x.device)
    gw2 = torch.zeros(num_experts, K, I, device=x.device)
    for e in range(num_experts):
        p = torch.nonzero(live & (expert == e)).flatten()
        if p.numel() == 0:
            continue
        t = sorted_token_ids[p].long() // top_k
        gw[e] = dab[p].float().t() @ x[t].float()
        gw2[e] = grad_out[t].float().t() @ sh[p].float()
    gw = gw.bfloat16()
    return gw[:, :I].contiguous(), gw[:, I:].contiguous(), gw2.bfloat16()


def fused_moe_mxfp8(x, x_scales, w, w_scales, w2, w2_scales, sorted_token_ids, expert_ids, num_tokens_post_padded,
                    topk_weights, out, top_k, block_m: int = BLOCK_M, block_n: int = 128, warp_n: int = 128,
                    stages: int = 6, bpc: int = 1, cpc: int = 1, split: bool = True):
    """Reference of `flash_moe.fused_moe_mxfp8`: `fused_moe_bf16`'s computation on the exactly
    dequantized MXFP8 inputs.

    x (M, K) e4m3 with x_scales (M, K/32) e8m0 row-major; w (E, 2I, K) e4m3 with w_scales
    `pack_scales_blocked` of its (E, 2I, K/32) scales; w2 (E, K, I) e4m3 with w2_scales
    `pack_scales_blocked` of its (E, K, I/32) scales (each expert packed on its own, what
    `quantize_mxfp8(..., blocked=True)` returns). Scales may
    be float8_e8m0fnu or uint8 bytes. block_n, warp_n, stages, bpc, cpc are the kernel's tuning
    arguments; they do not change the result and are ignored here.
    """
    M, K = x.shape
    E, N, _ = w.shape
    I = N // 2
    if K % MXFP8_SCALE_BLOCK or I % MXFP8_SCALE_BLOCK:
        raise ValueError(f"fused_moe_mxfp8: K and I must be multiples of 32, got K={K}, I={I}")
    if tuple(x_scales.shape) != (M, K // MXFP8_SCALE_BLOCK):
        raise ValueError(f"fused_moe_mxfp8: x_scales must have shape ({M}, {K // 32}), got {tuple(x_scales.shape)}")
    ws = unpack_scales_blocked(w_scales, E, N, K // MXFP8_SCALE_BLOCK)
    w2s = unpack_scales_blocked(w2_scales, E, K, I // MXFP8_SCALE_BLOCK)
    xf = dequantize_mxfp8(x, x_scales)

    def expert_weights(e):  # one expert at a time: the whole fp32 weight set can be tens of GB
        return dequantize_mxfp8(w[e], ws[e]), dequantize_mxfp8(w2[e], w2s[e])

    return _fused_moe_blocks(xf, expert_weights, E, sorted_token_ids, expert_ids, num_tokens_post_padded,
                             topk_weights, out, top_k, block_m, split)


def grouped_mm_layout(topk_ids, num_experts: int):
    """The unfused path's slot order: (order, live, token, offs): the flat slots sorted by expert
    (stable; ids outside [0, E) last, past every group), whether each sorted slot is live, its
    token, and torch._grouped_mm's group ends (int32). No host synchronisation."""
    flat = topk_ids.reshape(-1).long()
    live = (flat >= 0) & (flat < num_experts)
    key = torch.where(live, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # not bincount: it sizes its output on the host
    offs = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return order, live[order], order // topk_ids.shape[1], offs


def grouped_mm_path(x, w, w2, topk_ids, topk_weights):
    """The unfused bf16 path: slots sorted by expert, x gathered, three `torch._grouped_mm` GEMMs
    (gate, up, down) with SwiGLU between, each row weighted, `index_add` over tokens.

    Shapes and dtypes as `fused_moe_bf16` (x (M, K), w (E, 2I, K), w2 (E, K, I) bf16), topk_ids
    (M, top_k), topk_weights (M, top_k); ids outside [0, E) contribute nothing. No host
    synchronisation. The accuracy yardstick of the tests (the fused op's error vs fp32 must be
    <= 1.5x this path's) and the benchmark's `grouped_mm` peer.
    """
    E, N, _ = w.shape
    I = N // 2
    order, live, tok, offs = grouped_mm_layout(topk_ids, E)
    xs = x[tok]
    h = torch.nn.functional.silu(torch._grouped_mm(xs, w[:, :I].transpose(1, 2), offs=offs)) * torch._grouped_mm(
        xs, w[:, I:].transpose(1, 2), offs=offs)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    y = torch.where(live[:, None], y, 0)  # rows past the last group are not computed
    return torch.zeros_like(x).index_add_(0, tok, y)


# ---------------------------------------------------------------- MXFP8 (docs/DESIGN.md §6)


def quantize_mxfp8(t: torch.Tensor, *, blocked: bool = False):
    """MXFP8 quantization along the last dim (blocks of 32): returns (values e4m3, scales e8m0).

    scales are `torch.float8_e8m0fnu` (one biased-exponent byte each, as rmsnorm returns them;
    `.view(torch.uint8)` gives the bytes), row-major t.shape[:-1] + (K/32,) unless blocked=True
    (then `pack_scales_blocked` of them: each leading index's matrix packed on its own; a 1-D t
    is one row).
    """
    K = t.shape[-1]
    if K % MXFP8_SCALE_BLOCK != 0:
        raise ValueError(f"quantize_mxfp8: last dim must be a multiple of 32, got {K}")
    y = t.float().reshape(-1, K // MXFP8_SCALE_BLOCK, MXFP8_SCALE_BLOCK)
    amax = y.abs().amax(-1)
    byte = rceil_scale_bytes(amax)
    # y * 2^(127 - byte), literally as docs/DESIGN.md §6 writes it: an exact power of two, a
    # subnormal for bytes 254 and 255 (so a non-finite block keeps its NaNs, saturates its Infs and
    # flushes the rest; a consumer reading byte 255 as the e8m0 NaN makes the whole block NaN
    # anyway). A NaN keeps its sign bit (0x7f or 0xff): e4m3_saturating, not e4m3_satfinite.
    vals = e4m3_saturating(y * scale_multiplier(byte)[..., None]).reshape(t.shape)
    scales = byte.reshape(*t.shape[:-1], K // MXFP8_SCALE_BLOCK)
    if blocked:
        scales = pack_scales_blocked(scales if scales.dim() >= 2 else scales[None])
    return vals, scales.view(torch.float8_e8m0fnu)


def _e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8 or float8_e8m0fnu) -> fp32 2^(byte-127), exactly; byte 255 -> NaN.

    Built from the fp32 bit pattern rather than pow() so no libm rounding is involved; byte 0 is
    the subnormal 2^-127.
    """
    byte = (scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales).to(torch.int32)
    bits = torch.where(byte == 0, torch.full_like(byte, 1 << 22), byte << 23)
    bits = torch.where(byte == 255, torch.full_like(byte, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_mxfp8(vals: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 -> `dtype`: vals (..., K) e4m3, scales (..., K/32) row-major e8m0 (or uint8 bytes).

    Returns q * 2^(byte-127), computed in fp32 and rounded once to `dtype`. The fp32 product is
    exact for every byte 0..254 (the smallest, 2^-9 * 2^-127, is a subnormal above 2^-149) unless
    it exceeds the fp32 range (large bytes: then +-inf). A block whose byte is 255 is all NaN.
    """
    K = vals.shape[-1]
    if K % MXFP8_SCALE_BLOCK != 0:
        raise ValueError(f"dequantize_mxfp8: last dim must be a multiple of 32, got {K}")
    if tuple(scales.shape) != (*vals.shape[:-1], K // MXFP8_SCALE_BLOCK):
        raise ValueError(f"dequantize_mxfp8: scales must have shape {(*vals.shape[:-1], K // 32)}, "
                         f"got {tuple(scales.shape)}")
    q = vals.float().reshape(*vals.shape[:-1], K // MXFP8_SCALE_BLOCK, MXFP8_SCALE_BLOCK)
    y = q * _e8m0_to_float(scales)[..., None]
    return y.reshape(vals.shape).to(dtype)
