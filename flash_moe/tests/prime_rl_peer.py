"""prime-rl's MoE backward, restated as the peer of the backward's tests and benchmark.

From prime-rl's src/prime_rl/trainer/models/layers/moe.py: `prime_rl_backward` restates
`_run_experts_fused_backward_bf16` (padded copies of the sorted x and grad_out, the gate/up GEMMs
re-run, fp32 temporaries, an index_add for grad_x) and `PrimeRlFusedMoE` its `_FusedMoE` (our
forward with that backward). test_moe_backward_gpu.py holds our gradients to 1.5x its error and
benchmarks/compare.py times it beside ours.
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


def prime_rl_backward(grad_out, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts):
    """prime-rl's bf16 MoE backward: [grad_x, grad_w1, grad_w2, grad_w3, grad_top_scores], each in
    its input's dtype. Shapes as `flash_moe.moe`: grad_out and x (M, K), w1 and w3 (E, I, K), w2
    (E, K, I), selected_experts_indices and top_scores (M, top_k)."""
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
    grad_s = (h.float() * g2.float()).sum(dim=-1)[dst]
    grad_scores = torch.zeros_like(top_scores.reshape(-1)).index_copy(0, order, grad_s.to(top_scores.dtype))
    grad_h = (g2.float() * scores_sorted).to(torch.bfloat16)
    grad_a = torch.ops.aten.silu_backward(grad_h * b, a)
    grad_b = grad_h * silu_a
    grad_rows = torch._grouped_mm(grad_a, w1b, offs=offs) + torch._grouped_mm(grad_b, w3b, offs=offs)
    grad_x = torch.zeros_like(x).index_add(0, token_idx, grad_rows[dst].type_as(x))
    grad_w1 = torch._grouped_mm(grad_a.t(), x_sorted, offs=offs).type_as(w1)
    grad_w3 = torch._grouped_mm(grad_b.t(), x_sorted, offs=offs).type_as(w3)
    grad_y = (g_sorted.float() * scores_sorted).to(torch.bfloat16)
    grad_w2 = torch._grouped_mm(grad_y.t(), h, offs=offs).type_as(w2)
    return [grad_x, grad_w1, grad_w2, grad_w3, grad_scores.reshape_as(top_scores)]



class PrimeRlFusedMoE(torch.autograd.Function):
    """prime-rl's `_FusedMoE`: our forward, its hand-written bf16 backward (for MXFP8 prime-rl
    re-runs a bf16 reference through autograd: the same gradients, computed another way). The
    caller sets `PrimeRlFusedMoE.kernel` to the loaded flash_moe first."""

    kernel = None

    @staticmethod
    def forward(ctx, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts, mxfp8):
        ctx.save_for_backward(x, w1, w2, w3, selected_experts_indices, top_scores)
        ctx.num_experts = num_experts
        return PrimeRlFusedMoE.kernel.moe(x.detach(), w1.detach(), w2.detach(), w3.detach(), selected_experts_indices,
                                           top_scores.detach(), mxfp8=mxfp8)

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w2, w3, ids, scores = ctx.saved_tensors
        gx, gw1, gw2, gw3, gs = prime_rl_backward(grad_out, x, w1, w2, w3, ids, scores, ctx.num_experts)
        return gx, gw1, gw2, gw3, None, gs, None, None
