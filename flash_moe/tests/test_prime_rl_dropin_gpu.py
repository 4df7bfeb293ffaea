"""prime-rl's two calling sequences, restated from its public MoE layer
(`src/prime_rl/trainer/models/layers/moe.py`: `_run_experts_fused_kernel` and
`_run_experts_fused_mxfp8_kernel`), run unchanged through `prime_kernels.load("flash_moe")` and
checked against fp32 truth. The MXFP8 path quantizes with torchao's `to_mx` RCEIL rule (restated in
prime_rl_peer.py independently of flash_moe's own quantizer), and hands the 3-D scales straight to
`pack_scales_blocked`, as prime-rl does."""

import pytest
import torch
import torch.nn.functional as F
from prime_rl_peer import to_mx_rceil
from error_measure import rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def flash_moe():
    import prime_kernels

    reason = prime_kernels.unavailable_reason("flash_moe")
    if reason is not None:
        pytest.skip(reason)
    return prime_kernels.load("flash_moe")


def prime_rl_quantize_mxfp8(t, block_size):
    """prime-rl's `_quantize_mxfp8`: to_mx of the bf16 tensor, returned as (data, scales)."""
    scales, data = to_mx_rceil(t.to(torch.bfloat16), block_size)
    return data, scales


def prime_rl_bf16(kernel, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts):
    """prime-rl's `_run_experts_fused_kernel`, call for call (the op's defaults as it leaves them)."""
    gate_up_weight = torch.cat((w1.to(torch.bfloat16), w3.to(torch.bfloat16)), dim=1)
    sorted_token_ids, expert_ids, num_tokens_post_padded = kernel.moe_align(
        selected_experts_indices.to(torch.int32).contiguous(), num_experts, kernel.BLOCK_M
    )
    out = torch.empty_like(x, dtype=torch.bfloat16)
    kernel.fused_moe_bf16(
        x.to(torch.bfloat16), gate_up_weight, w2.to(torch.bfloat16).contiguous(), sorted_token_ids, expert_ids,
        num_tokens_post_padded, top_scores.to(torch.float32), out, selected_experts_indices.shape[1],
        block_m=kernel.BLOCK_M, split=True,
    )
    return out.type_as(x)


def prime_rl_mxfp8(kernel, x, w1, w2, w3, selected_experts_indices, top_scores, num_experts):
    """prime-rl's `_run_experts_fused_mxfp8_kernel`, call for call: 3-D weight scales straight into
    `pack_scales_blocked`, activation scales row-major."""
    block_size = kernel.MXFP8_SCALE_BLOCK
    gate_up_weight, gate_up_scales = prime_rl_quantize_mxfp8(torch.cat((w1, w3), dim=1), block_size)
    down_weight, down_scales = prime_rl_quantize_mxfp8(w2, block_size)
    x_data, x_scales = prime_rl_quantize_mxfp8(x, block_size)
    sorted_token_ids, expert_ids, num_tokens_post_padded = kernel.moe_align(
        selected_experts_indices.to(torch.int32).contiguous(), num_experts, kernel.BLOCK_M
    )
    out = torch.empty_like(x, dtype=torch.bfloat16)
    kernel.fused_moe_mxfp8(
        x_data, x_scales, gate_up_weight, kernel.pack_scales_blocked(gate_up_scales), down_weight,
        kernel.pack_scales_blocked(down_scales), sorted_token_ids, expert_ids, num_tokens_post_padded,
        top_scores.to(torch.float32), out, selected_experts_indices.shape[1], block_m=kernel.BLOCK_M, split=True,
    )
    return out.type_as(x)


def _layer_inputs(T, dim, hidden, E, top_k, seed, weight_dtype, drop=0.0):
    """A router's top-k of softmax scores, weights as prime-rl's GroupedExperts holds them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, dim, generator=g, device="cuda").bfloat16()
    w1 = (torch.randn(E, hidden, dim, generator=g, device="cuda") / dim ** 0.5).to(weight_dtype)
    w3 = (torch.randn(E, hidden, dim, generator=g, device="cuda") / dim ** 0.5).to(weight_dtype)
    w2 = (torch.randn(E, dim, hidden, generator=g, device="cuda") / hidden ** 0.5).to(weight_dtype)
    probs = F.softmax(torch.randn(T, E, generator=g, device="cuda"), dim=-1)
    top_scores, ids = probs.topk(top_k, dim=-1)
    if drop:  # expert parallelism: slots routed to another rank arrive as -1
        ids = torch.where(torch.rand(T, top_k, generator=g, device="cuda") < drop, torch.full_like(ids, -1), ids)
    return x, w1, w2, w3, ids, top_scores


def _truth(reference, x, w1, w2, w3, ids, scores):
    w = torch.cat((w1, w3), dim=1).float()
    return reference.moe_fp32(x.float(), w, w2.float(), ids.to(torch.int32), scores.float())


SHAPES = [
    # tokens, dim, hidden, experts, top_k, weight dtype, dropped share
    (256, 2048, 768, 64, 8, torch.float32, 0.0),
    (512, 2048, 768, 128, 8, torch.bfloat16, 0.1),
    (96, 2880, 2880, 8, 4, torch.float32, 0.0),  # dim % 128 == 64: down scales' per-expert padding matters
    (300, 320, 192, 4, 2, torch.bfloat16, 0.0),
    (2048, 1024, 512, 4, 2, torch.float32, 0.0),  # experts of many blocks: preferred bpc is 2
]


@pytest.mark.parametrize("T,dim,hidden,E,top_k,wdtype,drop", SHAPES)
def test_prime_rl_bf16_sequence(flash_moe, reference, T, dim, hidden, E, top_k, wdtype, drop):
    x, w1, w2, w3, ids, scores = _layer_inputs(T, dim, hidden, E, top_k, seed=T + dim, weight_dtype=wdtype, drop=drop)
    out = prime_rl_bf16(flash_moe, x, w1, w2, w3, ids, scores, E)
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    truth = _truth(reference, x, w1, w2, w3, ids, scores)
    w = torch.cat((w1, w3), dim=1).bfloat16()
    peer = reference.grouped_mm_path(x, w, w2.bfloat16(), ids, scores)  # the unfused bf16 path's error
    assert rel_err(out, truth) <= 1.5 * rel_err(peer, truth), (rel_err(out, truth), rel_err(peer, truth))


@pytest.mark.parametrize("T,dim,hidden,E,top_k,wdtype,drop", SHAPES)
def test_prime_rl_mxfp8_sequence(flash_moe, reference, T, dim, hidden, E, top_k, wdtype, drop):
    x, w1, w2, w3, ids, scores = _layer_inputs(T, dim, hidden, E, top_k, seed=T + dim + 1, weight_dtype=wdtype,
                                               drop=drop)
    out = prime_rl_mxfp8(flash_moe, x, w1, w2, w3, ids, scores, E)
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    truth = _truth(reference, x, w1, w2, w3, ids, scores)
    # the floor: fp32 MoE of the quantized inputs, dequantized exactly with their own scales
    deq = []
    for t in (x, torch.cat((w1, w3), dim=1), w2):
        data, scales = prime_rl_quantize_mxfp8(t, 32)
        deq.append(reference.dequantize_mxfp8(data, scales))
    floor = rel_err(reference.moe_fp32(deq[0], deq[1], deq[2], ids.to(torch.int32), scores.float()), truth)
    assert 1e-3 < floor < 0.1, floor
    assert rel_err(out, truth) <= 1.5 * floor, (rel_err(out, truth), floor)
