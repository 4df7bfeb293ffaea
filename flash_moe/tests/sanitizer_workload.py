"""Small-shape calls of every flash_moe training kernel, for compute-sanitizer (not a pytest file).

    for tool in memcheck racecheck synccheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 python flash_moe/tests/sanitizer_workload.py
    done

Covers: the forward at bpc 1 and 2 (CTA pairs) writing the pre-activations, with w1|w3 concatenated
and as two tensors; kDownDgrad + kGateUpDgrad and both wgrads at the same bpcs (2: the gate/up
dgrad and the wgrads as CTA pairs, the wgrads with an idle CTA at K = 320; at K = 64 they run
unpaired); -1 ids. The second shape has one k-block per tile (K = 64), and at I = 256 every tile
starts in stage 0 (k-blocks a multiple of the stages), the case where racecheck once reported the
tile-slot hand-off (flash_moe/DESIGN.md §8.1 (g)).
"""

import prime_kernels
import torch

fm = prime_kernels.load("flash_moe")
E, TOP_K = 6, 2


def training_calls(M, K, I, bpcs, seed):
    torch.manual_seed(seed)
    x = torch.randn(M, K, device="cuda").bfloat16()
    g = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * I, K, device="cuda") / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, I, device="cuda") / I**0.5).bfloat16()
    ids = torch.randint(0, E, (M, TOP_K), device="cuda", dtype=torch.int32)
    ids[::7, 0] = -1  # tokens routed to another rank
    wts = torch.rand(M, TOP_K, device="cuda")
    s, e, n = fm.moe_align(ids, E)
    pre = torch.empty(fm.preact_numel(s.numel(), I), dtype=torch.bfloat16, device="cuda")
    w1, w3 = w[:, :I].contiguous(), w[:, I:].contiguous()
    for bpc in bpcs:
        fm.fused_moe_bf16(x, w, w2, s, e, n, wts, torch.empty_like(x), TOP_K, bpc=bpc, preact=pre)
        fm.fused_moe_bf16(x, w1, w2, s, e, n, wts, torch.empty_like(x), TOP_K, bpc=bpc, preact=pre, w3=w3)
    grads = []
    for bpc in bpcs:
        data_grads = list(fm.fused_moe_bf16_dgrad(g, w1, w3, w2, pre, s, e, n, wts, TOP_K, bpc=bpc))
        grads += list(fm.fused_moe_bf16_wgrad(x, g, data_grads[1], data_grads[2], s, e, n, E, TOP_K, bpc=bpc))
        grads += data_grads
    return grads


if __name__ == "__main__":
    sums = []
    for shape in ((200, 320, 192, (1, 2)), (1500, 64, 128, (1, 2)), (1500, 64, 256, (1, 2))):
        sums += [t.float().abs().sum().item() for t in training_calls(*shape, seed=0)]
    torch.cuda.synchronize()
    print("sanitizer workload ran; output sums", sums)
