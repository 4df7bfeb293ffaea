"""GPU tests of `fused_moe_bf16_wgrad` (the fused backward's weight gradients), on the dA|dB and
s*h `fused_moe_bf16_dgrad` wrote: every gradient against fp64 truth from the same bf16 operands,
empty experts exactly zero, rows past the used length never read, bit-identical repeats, graph
capture, and the input rules. (The gradients of `moe` through this path are tested in
test_moe_backward_gpu.py.)"""

import pytest
import torch
from cuda_graph_check import assert_graph_replays_eager
from error_measure import rel_err

pytestmark = pytest.mark.gpu


def _setup(kernel, M, K, I, E, top_k, seed, drop=0.0, one_expert=None):
    """Routing, x, grad_out, and the dgrad's dab, sh (rows past the used length poisoned)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * I, K, generator=g, device="cuda") / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:top_k] for _ in range(M)]).int()
    if one_expert is not None:
        ids[:, 0] = one_expert
        ids = ids[:, :1].contiguous()
        top_k = 1
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g, device="cuda") < drop, torch.full_like(ids, -1), ids)
    wts = torch.rand(M, top_k, generator=g, device="cuda")
    grad_out = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    routing = kernel.moe_align(ids, E)
    preact = torch.empty(kernel.preact_numel(routing[0].numel(), I), dtype=torch.bfloat16, device="cuda")
    kernel.fused_moe_bf16(x, w, w2, *routing, wts, torch.empty_like(x), top_k, preact=preact)
    _, dab, sh, _ = kernel.fused_moe_bf16_dgrad(grad_out, w[:, :I].contiguous(), w[:, I:].contiguous(), w2, preact,
                                                *routing, wts, top_k)
    used = int(routing[2])
    dab[used:] = float("nan")
    sh[used:] = float("nan")
    return x, grad_out, dab, sh, ids, routing, top_k


def _truth(x, grad_out, dab, sh, routing, E, top_k):
    """fp64 sums over each expert's live positions of the same bf16 operands."""
    sorted_ids, expert_ids, ntpp = routing
    L, I = sh.shape
    K = x.shape[1]
    pos = torch.arange(L, device="cuda")
    live = (sorted_ids >= 0) & (sorted_ids < x.shape[0] * top_k) & (pos < ntpp)
    exp = expert_ids.long().repeat_interleave(128)[:L]
    gw = torch.zeros(E, 2 * I, K, dtype=torch.float64, device="cuda")
    gw2 = torch.zeros(E, K, I, dtype=torch.float64, device="cuda")
    for e in range(E):
        p = torch.nonzero(live & (exp == e)).flatten()
        t = sorted_ids[p].long() // top_k
        gw[e] = dab[p].double().t() @ x[t].double()
        gw2[e] = grad_out[t].double().t() @ sh[p].double()
    return gw[:, :I], gw[:, I:], gw2


CASES = [
    # M, K, I, E, top_k, drop, one expert
    (300, 512, 256, 8, 2, 0.0, None),
    (257, 320, 192, 6, 2, 0.2, None),  # 2I % 256 != 0 (a tile across w1|w3 and past 2I), K % 128 != 0, -1 ids
    (1, 256, 128, 4, 1, 0.0, None),  # M = 1: three experts without rows
    (600, 384, 128, 8, 1, 0.0, 3),  # all tokens on one expert: 600 rows, a 64-row block with 24 live
    (100, 512, 128, 256, 8, 0.0, None),  # E = 256, a few rows per expert, some experts empty
    (2048, 2048, 768, 64, 8, 0.0, None),  # a real shape's dims (docs/DESIGN.md §5)
    # I = 64, one 64-feature group: each 256-feature A tile mostly past I (s*h: 64 live; dA|dB: 128, w1|w3 at 64)
    (300, 512, 64, 8, 2, 0.0, None),
    (300, 136, 128, 8, 2, 0.0, None),  # K % 128 == 8: the last 128-feature B tile (x, grad_out rows) has 8 live
    (257, 264, 64, 6, 2, 0.2, None),  # K = 264 (three B tiles, the last with 8 live) with I = 64 and -1 ids
    (100, 256, 128, 512, 8, 0.0, None),  # E = 512 (the most num_experts allows): about 100 experts empty
    # experts averaging 4 k-blocks (256 rows) or more, as at the bench shapes 1-4 (the static tile
    # order, with (2048, 2048, 768, 64, 8)), on odd dims:
    (1200, 320, 192, 4, 2, 0.2, None),  # 600 rows an expert, 2I % 256 != 0, K % 128 != 0, -1 ids
    (1100, 384, 128, 4, 1, 0.0, 2),  # 1100 rows on one expert, three experts empty
    (1024, 264, 64, 2, 1, 0.0, None),  # 512 rows an expert, K = 264, I = 64
]


def _static_order(M, top_k, E):
    """heuristics::wgrad_static_order, restated: tiles in a fixed order where the experts average
    4 k-blocks (256 rows) or more, claimed from a counter below."""
    return M * top_k >= 4 * 64 * E


def test_cases_take_both_tile_orders():
    orders = [_static_order(M, 1 if one is not None else top_k, E) for M, _, _, E, top_k, _, one in CASES]
    assert orders.count(True) >= 3 and orders.count(False) >= 3, orders


# bpc 2: CTA pairs take B tiles 2j, 2j + 1; an odd B-tile count (K = 320, 384, 264: three) leaves
# the last pair's second CTA idle.
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("M,K,I,E,top_k,drop,one", CASES)
def test_wgrad_vs_fp64(kernel, M, K, I, E, top_k, drop, one, bpc):
    x, g, dab, sh, ids, routing, top_k = _setup(kernel, M, K, I, E, top_k, seed=M + K + E, drop=drop, one_expert=one)
    got = kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k, bpc=bpc)
    want = _truth(x, g, dab, sh, routing, E, top_k)
    for name, gt, wt, shape in zip(("grad_w1", "grad_w3", "grad_w2"), got, want, ((E, I, K), (E, I, K), (E, K, I))):
        assert gt.dtype == torch.bfloat16 and gt.shape == shape, name
        assert torch.isfinite(gt).all(), name
        # fp32 sums of bf16 products, rounded once to bf16: within a bf16 rounding of the truth
        torch.testing.assert_close(gt.double(), wt, rtol=8e-3, atol=1e-4 * wt.abs().max().item(), msg=name)
        assert rel_err(gt, wt) < 4e-3, (name, rel_err(gt, wt))
        empty = (wt.flatten(1) == 0).all(1)  # experts without rows: exactly zero
        assert torch.equal(gt[empty], torch.zeros_like(gt[empty])), name
    if one is not None or M == 1 or E >= 256:
        assert (want[2].flatten(1) == 0).all(1).any()  # the case has empty experts


def test_wgrad_bit_identical_and_graph_capture(kernel):
    E, top_k = 64, 8
    x, g, dab, sh, ids, routing, _ = _setup(kernel, 2048, 2048, 768, E, top_k, seed=7)
    first = kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k, bpc=1)
    for _ in range(3):
        for a, b in zip(kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k, bpc=1), first):
            assert torch.equal(a, b)
    for a, b in zip(kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k, bpc=2), first):  # CTA pairs
        assert torch.equal(a, b)
    assert_graph_replays_eager(lambda: kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k), first)


def test_wgrad_bad_inputs_name_the_argument(kernel):
    E, top_k = 4, 2
    x, g, dab, sh, ids, routing, _ = _setup(kernel, 64, 256, 128, E, top_k, seed=1)
    with pytest.raises(RuntimeError, match="dab must have dtype"):
        kernel.fused_moe_bf16_wgrad(x, g, dab.float(), sh, *routing, E, top_k)
    with pytest.raises(RuntimeError, match=r"dab must have shape \(len\(sorted_token_ids\), 2\*I\)"):
        kernel.fused_moe_bf16_wgrad(x, g, dab[:, :192].contiguous(), sh, *routing, E, top_k)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.fused_moe_bf16_wgrad(x, g, dab[:, :64].contiguous(), sh[:, :32].contiguous(), *routing, E, top_k)
    with pytest.raises(RuntimeError, match="grad_out must have x's shape"):
        kernel.fused_moe_bf16_wgrad(x, g[:, :128].contiguous(), dab, sh, *routing, E, top_k)
    with pytest.raises(RuntimeError, match="sorted_token_ids must have moe_align's length"):
        kernel.fused_moe_bf16_wgrad(x, g, dab[:128], sh[:128], routing[0][:128], *routing[1:], E, top_k)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        kernel.fused_moe_bf16_wgrad(x.cpu(), g, dab, sh, *routing, E, top_k)
    with pytest.raises(RuntimeError, match="num_experts must be in"):
        kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, 0, top_k)
    with pytest.raises(RuntimeError, match=r"bpc \(CTAs per cluster\) must be 1 or 2, got 3"):
        kernel.fused_moe_bf16_wgrad(x, g, dab, sh, *routing, E, top_k, bpc=3)


def test_wgrad_opcheck(kernel):
    E, top_k = 4, 2
    x, g, dab, sh, ids, routing, _ = _setup(kernel, 64, 256, 128, E, top_k, seed=2)
    used = int(routing[2])
    dab[used:] = 0  # test_schema compares the inputs before and after with allclose (NaN != NaN)
    sh[used:] = 0
    torch.library.opcheck(kernel.ops.fused_moe_bf16_wgrad, (x, g, dab, sh, *routing, E, top_k, 1))
