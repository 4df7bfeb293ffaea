"""prime-rl's MoE backward, restated as the peer of the backward's tests and benchmark.

From prime-rl's src/prime_rl/trainer/models/layers/moe.py: `prime_rl_backward` restates
`_run_experts_fused_backward_bf16` (padded copies of the sorted x and grad_out, the gate/up GEMMs
re-run, fp32 temporaries, an index_add for grad_x) and `PrimeRlFusedMoE` its `_FusedMoE` (our
forward with that backward), and `to_mx_rceil` the torchao rule its MXFP8 path quantizes with.
test_moe_backward_gpu.py holds our gradients to 1.5x its error, benchmarks/compare.py times it
beside ours, test_prime_rl_dropin_gpu.py runs prime-rl's forward calls with its quantizer.
"""

import torch
import torch.nn.functional as F


def _aligned_group_layout(counts, num_routed, num_experts, align_m):
    aligned_counts = torch.clamp((counts + align_m - 1) // align_m, min=1) * align_m
    shift = (torch.cumsum(aligned_counts, 0) - aligned_counts) - (torch.cumsum(counts, 0) - counts)
    dst = torch.arange(num_routed, device=counts.device) + shift.repeat_interleave(counts)
    buf_rows = -(-(num_routed + align_m * num_experts) // align_m) * align_m
    aligned_counts[-1] += buf_rows - aligned_counts.sum()
    return aligned_counts, dst, buf_rows


def prime_rl_backward(grad_out, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts,
                      needs_input_grad=(True,) * 5):
    """prime-rl's bf16 MoE backward: [grad_x, grad_w1, grad_w2, grad_w3, grad_top_scores], each in
    its input's dtype, None where `needs_input_grad` (over those five) says so, as prime-rl skips
    them. Shapes as `flash_moe.moe`: grad_out and x (M, K), w1 and w3 (E, I, K), w2 (E, K, I),
    selected_experts_indices and top_scores (M, top_k). Every id must be in [0, E): prime-rl runs
    without expert parallelism, and its padded layout does not take dropped slots."""
    needs_x, needs_w1, needs_w2, needs_w3, needs_scores = needs_input_grad
    top_k = selected_experts_indices.shape[1]
    flat_experts = selected_experts_indices.reshape(-1)
    num_tokens_per_expert = torch.histc(flat_experts.float(), bins=num_experts, min=0, max=num_experts)
    order = torch.argsort(flat_experts, stable=True)
    token_idx = order // top_k
    counts = num_tokens_per_expert.to(torch.int64)
    aligned_counts, dst, buf_rows = _aligned_group_layout(counts, order.numel(), num_experts, 16)
    offs = torch.cumsum(aligned_counts, dim=0, dtype=torch.int32)
    w1b, w2b, w3b = w1.bfloat16(), w2.bfloat16(), w3.bfloat16()
    x_sorted = x.new_zeros(buf_rows, x.shape[1], dtype=torch.bfloat16)
    x_sorted[dst] = x[token_idx].bfloat16()
    g_sorted = grad_out.new_zeros(buf_rows, grad_out.shape[1], dtype=torch.bfloat16)
    g_sorted[dst] = grad_out[token_idx].bfloat16()
    scores_sorted = top_scores.new_zeros(buf_rows, 1)
    scores_sorted[dst] = top_scores.reshape(-1)[order].reshape(-1, 1)
    a = torch._grouped_mm(x_sorted, w1b.transpose(-2, -1), offs=offs)
    b = torch._grouped_mm(x_sorted, w3b.transpose(-2, -1), offs=offs)
    silu_a = F.silu(a)
    h = silu_a * b
    g2 = torch._grouped_mm(g_sorted, w2b, offs=offs)
    grad_scores = None
    if needs_scores:
        grad_s = (h.float() * g2.float()).sum(dim=-1)[dst]
        grad_scores = torch.zeros_like(top_scores.reshape(-1)).index_copy(0, order, grad_s.to(top_scores.dtype))
        grad_scores = grad_scores.reshape_as(top_scores)
    grad_h = (g2.float() * scores_sorted).to(torch.bfloat16)
    grad_a = torch.ops.aten.silu_backward(grad_h * b, a)
    grad_b = grad_h * silu_a
    grad_x = None
    if needs_x:
        grad_rows = torch._grouped_mm(grad_a, w1b, offs=offs) + torch._grouped_mm(grad_b, w3b, offs=offs)
        grad_x = torch.zeros_like(x).index_add(0, token_idx, grad_rows[dst].type_as(x))
    grad_w1 = torch._grouped_mm(grad_a.t(), x_sorted, offs=offs).type_as(w1) if needs_w1 else None
    grad_w3 = torch._grouped_mm(grad_b.t(), x_sorted, offs=offs).type_as(w3) if needs_w3 else None
    grad_w2 = None
    if needs_w2:
        grad_y = (g_sorted.float() * scores_sorted).to(torch.bfloat16)
        grad_w2 = torch._grouped_mm(grad_y.t(), h, offs=offs).type_as(w2)
    return [grad_x, grad_w1, grad_w2, grad_w3, grad_scores]


class PrimeRlFusedMoE(torch.autograd.Function):
    """prime-rl's `_FusedMoE` with our forward and its hand-written bf16 backward, for mxfp8 too.
    (prime-rl's own mxfp8 backward runs its bf16 reference through autograd: the same gradients
    for plain tensors, MXFP8 grouped GEMMs when its weights are torchao's MXFP8 training tensors.)
    The caller sets `PrimeRlFusedMoE.kernel` to the loaded flash_moe first."""

    kernel = None

    @staticmethod
    def forward(ctx, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts, mxfp8):
        ctx.save_for_backward(x, w1, w2, w3, selected_experts_indices, top_scores)
        ctx.num_experts = num_experts
        return PrimeRlFusedMoE.kernel.moe(x.detach(), w1.detach(), w2.detach(), w3.detach(), selected_experts_indices,
                                           top_scores.detach(), mxfp8=mxfp8)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, w1, w2, w3, ids, scores = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 5))
        gx, gw1, gw2, gw3, gs = prime_rl_backward(grad_out, x, w1, w2, w3, ids, scores, ctx.num_experts, needs)
        return gx, gw1, gw2, gw3, None, gs, None, None


# ---------------------------------------------------------------- prime-rl's MXFP8 quantizer
E8M0_BIAS = 127
E4M3_MAX = 448.0


def to_mx_rceil(t: torch.Tensor, block_size: int):
    """torchao's `to_mx(t, float8_e4m3fn, block_size, scaling_mode=RCEIL)` rule, which prime-rl's
    MXFP8 path quantizes with, restated: per block, descale = amax / 448 (fp32), scale byte =
    clamp(ceil(log2(descale)), -127, 127) + 127 (NaN amax: 255), values = clamp(t * 2^(127 - byte),
    -448, 448) (byte 0: times 1) cast to e4m3. Returns (scales as e8m0, shape t.shape[:-1] +
    (K/block,); data, t's shape), to_mx's order."""
    blocks = t.float().reshape(*t.shape[:-1], t.shape[-1] // block_size, block_size)
    descale = blocks.abs().amax(-1, keepdim=True) / E4M3_MAX
    exponent = torch.clamp(torch.ceil(torch.log2(descale)), min=-E8M0_BIAS, max=E8M0_BIAS) + E8M0_BIAS
    exponent = torch.where(torch.isnan(descale), torch.full_like(exponent, 255), exponent).to(torch.uint8)
    multiplier = torch.where(exponent == 0, 1.0, torch.exp2(E8M0_BIAS - exponent.float()))
    data = torch.clamp(blocks * multiplier, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(t.shape)
    return exponent.squeeze(-1).view(torch.float8_e8m0fnu), data
