"""A short demo of each kernel that can run here: one call on random data, checked against fp32."""

import torch

import prime_kernels


def demo_rmsnorm(rmsnorm) -> str:
    n, c = 4096, 4096
    branch, residual = (torch.randn(n, c, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.rand(c, device="cuda", dtype=torch.bfloat16) + 0.5
    vals, scales, rrms = rmsnorm.fused_rmsnorm_residual(branch, residual, weight)
    b = branch.float()
    y = b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float() + residual.float()
    # The blocked scales (docs/DESIGN.md §6) back to one exponent per 32-wide block, then dequantize.
    s = c // 32
    exponent = rmsnorm.reference.unpack_scales_blocked(scales, n, s).view(torch.uint8).float() - 127
    deq = vals.float().view(n, s, 32) * torch.exp2(exponent)[..., None]
    err = ((deq.view(n, c) - y).norm() / y.norm()).item()
    return f"fused_rmsnorm_residual ({n}x{c}): MXFP8 round trip vs fp32, rel. error {err:.2e} (e4m3: ~3e-2)"


def demo_flash_moe(flash_moe) -> str:
    tokens, dim, hidden, experts, top_k = 1024, 2048, 768, 64, 8
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(experts, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    logits = torch.randn(tokens, experts, device="cuda")
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    out = flash_moe.moe(x, w1, w2, w3, topk_ids.int(), topk_weights)
    ref = flash_moe.reference.moe_fp32(x, torch.cat([w1, w3], 1), w2, topk_ids, topk_weights)  # the definition, fp32
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return f"moe ({tokens} tokens, {dim}/{hidden}, {experts} experts, top-{top_k}): rel. error vs fp32 {err:.2e}"


DEMOS = {"rmsnorm": demo_rmsnorm, "flash_moe": demo_flash_moe}

if __name__ == "__main__":
    torch.manual_seed(0)
    for name in prime_kernels.KERNELS:
        reason = prime_kernels.unavailable_reason(name)
        print(f"{name}: " + (f"not run: {reason}" if reason else DEMOS[name](prime_kernels.load(name))))
