"""GPU tests of moe_align and fused_moe_bf16 against the references and fp32 truth."""

import pytest
import torch
from cuda_graph_check import assert_graph_replays_eager
from error_measure import rel_err

pytestmark = pytest.mark.gpu


def _inputs(M, K, I, E, top_k, seed=0, drop=0.0, one_expert=None, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).bfloat16()
    w = (torch.randn(E, 2 * I, K, generator=g, device=device) / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g, device=device) / I ** 0.5).bfloat16()
    scores = torch.rand(M, E, generator=g, device=device)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    if one_expert is not None:
        ids = torch.full((M, top_k), one_expert, dtype=torch.int32, device=device)
    if drop > 0:
        mask = torch.rand(M, top_k, generator=g, device=device) < drop
        ids = torch.where(mask, torch.full_like(ids, -1), ids)
    wt = torch.rand(M, top_k, generator=g, device=device)
    return x, w, w2, ids.contiguous(), wt.contiguous()


def _run(kernel, x, w, w2, ids, wt, split=True, out=None, **tuning):
    E = w.shape[0]
    s, e, n = kernel.moe_align(ids, E)
    if out is None:
        out = torch.full_like(x, float("nan"))  # poisoned: unwritten rows fail
    kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, out, ids.shape[1], split=split, **tuning)
    return out


# ---------------------------------------------------------------- moe_align

@pytest.mark.parametrize("M,top_k,E,drop", [(1, 1, 1, 0.0), (1, 8, 64, 0.0), (1000, 8, 64, 0.1), (4096, 8, 256, 0.0),
                                            (333, 16, 512, 0.3), (8192, 2, 7, 0.0), (70000, 4, 128, 0.05),
                                            (65536, 8, 256, 0.02)])
def test_moe_align_matches_reference(kernel, reference, M, top_k, E, drop):
    g = torch.Generator(device="cuda").manual_seed(M + E)
    ids = torch.randint(0, E, (M, top_k), generator=g, device="cuda", dtype=torch.int32)
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g, device="cuda") < drop, torch.full_like(ids, -1), ids)
    got = kernel.moe_align(ids, E)
    want = reference.moe_align(ids.cpu(), E)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


def test_moe_align_out_of_range_ids_dropped(kernel, reference):
    ids = torch.tensor([[0, 5], [9, 1], [-3, 2]], dtype=torch.int32, device="cuda")
    got = kernel.moe_align(ids, 4)
    want = reference.moe_align(ids.cpu(), 4)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


def test_moe_align_all_one_expert(kernel, reference):
    ids = torch.full((5000, 8), 3, dtype=torch.int32, device="cuda")
    for a, b in zip(kernel.moe_align(ids, 8), reference.moe_align(ids.cpu(), 8)):
        assert torch.equal(a.cpu(), b.cpu())


# ---------------------------------------------------------------- fused_moe_bf16 accuracy

CASES = [
    # M, K, I, E, top_k, drop, one_expert
    (1, 256, 128, 4, 1, 0.0, None),
    (1, 2048, 768, 64, 8, 0.0, None),
    (200, 512, 256, 8, 1, 0.0, None),
    (300, 1024, 512, 16, 4, 0.2, None),
    (257, 512, 384, 8, 2, 0.0, 5),         # all tokens on one expert, others empty
    (512, 2048, 768, 256, 8, 0.0, None),   # E = 256, many empty experts
    (96, 2048, 768, 8, 2, 0.0, None),
    (96, 4096, 1536, 8, 2, 0.0, None),
    (96, 7168, 2048, 8, 2, 0.0, None),
    (96, 2048, 1408, 8, 2, 0.0, None),
    (96, 5120, 1536, 8, 2, 0.0, None),
    (96, 2048, 512, 8, 2, 0.0, None),
    (96, 2880, 2880, 8, 2, 0.0, None),
    (64, 200, 72, 4, 2, 0.0, None),        # K, I not multiples of 64 (TMA / gather tails)
]


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("M,K,I,E,top_k,drop,one", CASES)
def test_fused_accuracy_vs_fp32(kernel, reference, M, K, I, E, top_k, drop, one, bpc):
    x, w, w2, ids, wt = _inputs(M, K, I, E, top_k, seed=M * 7 + K, drop=drop, one_expert=one)
    out = _run(kernel, x, w, w2, ids, wt, bpc=bpc)
    truth = reference.moe_fp32(x, w, w2, ids, wt)
    unfused = reference.grouped_mm_path(x, w, w2, ids, wt)
    err, err_unfused = rel_err(out, truth), rel_err(unfused, truth)
    assert torch.isfinite(out).all()
    assert err <= 1.5 * err_unfused + 1e-6, (err, err_unfused)
    assert err < 2e-2


def test_fused_split_false_accumulates(kernel, reference):
    x, w, w2, ids, wt = _inputs(300, 1024, 512, 16, 4, seed=3, drop=0.1)
    base = torch.randn_like(x)
    out = base.clone()
    _run(kernel, x, w, w2, ids, wt, split=False, out=out)
    truth = reference.moe_fp32(x, w, w2, ids, wt) + base.float()
    assert rel_err(out, truth) < 1e-2
    # split=True ignores what was in out
    out2 = base.clone()
    _run(kernel, x, w, w2, ids, wt, split=True, out=out2)
    assert rel_err(out2, reference.moe_fp32(x, w, w2, ids, wt)) < 2e-2


def test_all_slots_dropped_gives_zero(kernel):
    x, w, w2, ids, wt = _inputs(50, 256, 128, 4, 2)
    ids = torch.full_like(ids, -1)
    out = _run(kernel, x, w, w2, ids, wt)
    assert torch.equal(out, torch.zeros_like(out))


def test_fused_bit_identical_repeats(kernel):
    x, w, w2, ids, wt = _inputs(2048, 2048, 768, 64, 8, seed=11)
    first = _run(kernel, x, w, w2, ids, wt)
    for _ in range(5):
        assert torch.equal(_run(kernel, x, w, w2, ids, wt), first)


# CTA pairs (bpc = 2) compute every output element with the same k order as single CTAs (how a
# pair splits an expert's rows only changes the wgmma's N), so the outputs must be
# bit-identical. The shapes cover pairs and lone blocks (odd and even block counts per expert),
# odd n-block counts in either GEMM (I = 384, 640: 3 and 5 gate/up n-blocks; K = 640: 3 down
# n-blocks; an idle CTA in the lone block's last claim; a three-block run per expert with odd
# n-block counts in both GEMMs), one expert holding every token, E = 256, dropped slots and
# M = 1.
PAIR_CASES = [
    # M, K, I, E, top_k, drop, one_expert, stages
    (1, 256, 128, 4, 1, 0.0, None, 4),
    (777, 640, 384, 8, 2, 0.0, None, 4),
    (1000, 512, 640, 5, 3, 0.1, None, 3),
    (3000, 1024, 256, 4, 1, 0.0, 2, 4),
    (2048, 2048, 768, 256, 8, 0.05, None, 4),
    (4096, 2048, 768, 64, 8, 0.0, None, 3),
    (2500, 7168, 2048, 32, 8, 0.0, None, 4),
    (1500, 640, 384, 4, 1, 0.0, None, 4),
]


def test_default_bpc_takes_the_preferred_value(kernel, monkeypatch):
    """bpc=None (the default) takes preferred_bpc of the call's shape: 2 where experts average at
    least two m-blocks, else 1; an explicit value wins; the bits are the same either way."""
    seen = []
    real = kernel.ops.fused_moe_bf16
    monkeypatch.setattr(kernel.ops, "fused_moe_bf16", lambda *a: (seen.append(a[13]), real(*a))[1])
    for M, E, want in ((1024, 4, 2), (256, 8, 1)):  # 2048 slots vs 2*128*4; 512 vs 2*128*8
        x, w, w2, ids, wt = _inputs(M, 512, 256, E, 2, seed=M)
        assert kernel.preferred_bpc(M, 512, 256, E, 2) == want
        seen.clear()
        default = _run(kernel, x, w, w2, ids, wt).clone()
        explicit = _run(kernel, x, w, w2, ids, wt, bpc=3 - want)
        assert seen == [want, 3 - want]
        assert torch.equal(default, explicit)


@pytest.mark.parametrize("M,K,I,E,top_k,drop,one,stages", PAIR_CASES)
def test_pairs_bit_identical_to_single(kernel, M, K, I, E, top_k, drop, one, stages):
    x, w, w2, ids, wt = _inputs(M, K, I, E, top_k, seed=M + K + I, drop=drop, one_expert=one)
    single = _run(kernel, x, w, w2, ids, wt, stages=stages, bpc=1)
    paired = _run(kernel, x, w, w2, ids, wt, stages=stages, bpc=2)
    assert torch.isfinite(single).all()
    assert torch.equal(paired, single)
    assert torch.equal(_run(kernel, x, w, w2, ids, wt, stages=stages, bpc=2), paired)


# wgmma's N is fitted to a tile's live rows in steps of 8; CTA pairs split an expert's rows
# evenly between their two CTAs and carry its short tail block (at most 32 live rows after a
# pair of its blocks). Expert counts here put every case side by side: tails of 1, 16, 17 and
# 32 rows after one pair, 5 rows after two pairs (carried); 33 rows (not carried), a tail after
# a lone full block (not carried), an even block count ending in a short block (a pair, not
# carried; 135 rows split 72 + 64, 200 as 104 + 96, 249 as 128 + 128), 281 rows as 144 + 144, an
# exact multiple of 128 (no tail), lone blocks of 3, 61 and 100 rows (N = 8, 64, 104), an
# empty expert. Both pipeline depths.
TAIL_COUNTS = [256 + 1, 256 + 16, 256 + 17, 256 + 32, 256 + 33, 512 + 5, 128 + 7, 384 + 3, 200, 249, 281, 384, 3, 61,
               100, 0]


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("K,I", [(640, 384), (2048, 768), (7168, 2048)])
def test_fitted_tiles_bit_identical_to_single(kernel, reference, K, I, stages):
    E = len(TAIL_COUNTS)
    g = torch.Generator(device="cuda").manual_seed(K + I)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(TAIL_COUNTS)]).cuda()
    ids = ids[torch.randperm(ids.numel(), generator=g, device="cuda")][:, None].contiguous()
    M = ids.shape[0]
    x, w, w2, _, wt = _inputs(M, K, I, E, 1, seed=K + I + 1)
    single = _run(kernel, x, w, w2, ids, wt, stages=stages, bpc=1)
    paired = _run(kernel, x, w, w2, ids, wt, stages=stages, bpc=2)
    assert torch.isfinite(paired).all()
    assert torch.equal(paired, single)
    truth = reference.moe_fp32(x, w, w2, ids, wt)
    assert rel_err(paired, truth) <= 1.5 * rel_err(reference.grouped_mm_path(x, w, w2, ids, wt), truth) + 1e-6


@pytest.mark.parametrize("bpc", [1, 2])
def test_cuda_graph_replay_equals_eager(kernel, bpc):
    x, w, w2, ids, wt = _inputs(1024, 1024, 512, 32, 4, seed=5)
    out = torch.empty_like(x)
    eager = _run(kernel, x, w, w2, ids, wt, bpc=bpc).clone()
    graph, _ = assert_graph_replays_eager(lambda: _run(kernel, x, w, w2, ids, wt, out=out, bpc=bpc), eager)
    # new routing in the same buffers replays correctly too
    ids.copy_(torch.roll(ids, 1, dims=0))
    graph.replay()
    assert torch.equal(out, _run(kernel, x, w, w2, ids, wt, bpc=bpc))


# The gate and up rows as tensors of their own (w3=): the kernel reads w1 and w3 through maps of
# their own, so a caller holding them apart (`moe`) copies no weights. The same bits as the
# concatenated w, pre-activations included: I a multiple of 128, I = 192 (an n-block half past I,
# whose rows read as zeros), both bpc, a real shape.
@pytest.mark.parametrize("M,K,I,E,top_k,bpc", [(1000, 512, 256, 8, 4, 1), (1000, 512, 256, 8, 4, 2),
                                               (700, 320, 192, 6, 2, 1), (700, 320, 192, 6, 2, 2),
                                               (2048, 2048, 768, 64, 8, 2)])
def test_separate_w3_bit_identical_to_concatenated(kernel, M, K, I, E, top_k, bpc):
    x, w, w2, ids, wt = _inputs(M, K, I, E, top_k, seed=M + I)
    w1, w3 = w[:, :I].clone(), w[:, I:].clone()  # tensors of their own, not views of w
    s, e, n = kernel.moe_align(ids, E)
    results = []
    for gate, up in ((w, None), (w1, w3)):
        out = torch.full_like(x, float("nan"))
        pre = torch.full((kernel.preact_numel(s.numel(), I),), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernel.fused_moe_bf16(x, gate, w2, s, e, n, wt, out, top_k, bpc=bpc, preact=pre, w3=up)
        results.append((out, pre))
    (out, pre), (out3, pre3) = results
    assert torch.isfinite(out).all()
    assert torch.equal(out3, out)
    torch.testing.assert_close(pre3, pre, rtol=0, atol=0, equal_nan=True)


def test_moe_convenience(kernel, reference):
    x, w, w2, ids, wt = _inputs(128, 512, 256, 8, 2, seed=9)
    I = w.shape[1] // 2
    out = kernel.moe(x, w[:, :I], w2, w[:, I:], ids.long(), wt.double())
    assert rel_err(out, reference.moe_fp32(x, w, w2, ids, wt)) < 2e-2


def test_opcheck(kernel):
    x, w, w2, ids, wt = _inputs(64, 256, 128, 4, 2)
    s, e, n = kernel.moe_align(ids, 4)
    out = torch.empty_like(x)
    torch.library.opcheck(kernel.ops.moe_align, (ids, 4, 128, 1))
    torch.library.opcheck(kernel.ops.fused_moe_bf16, (x, w, w2, s, e, n, wt, out, 2, 128, 128, 128, 4, 1, 1, True))
    w1, w3 = w[:, :128].contiguous(), w[:, 128:].contiguous()
    torch.library.opcheck(kernel.ops.fused_moe_bf16,
                          (x, w1, w2, s, e, n, wt, out, 2, 128, 128, 128, 4, 1, 1, True, None, w3))


# ---------------------------------------------------------------- bad input

def _bad(kernel, match, **over):
    x, w, w2, ids, wt = _inputs(64, 256, 128, 4, 2)
    s, e, n = kernel.moe_align(ids, 4)
    args = dict(x=x, w=w, w2=w2, sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=n, topk_weights=wt,
                out=torch.empty_like(x), top_k=2)
    args.update(over)
    with pytest.raises(RuntimeError, match=match):
        kernel.fused_moe_bf16(**args)
    torch.cuda.synchronize()


def test_bad_inputs(kernel):
    x, w, w2, ids, wt = _inputs(64, 256, 128, 4, 2)
    _bad(kernel, "x must have dtype", x=x.float())
    _bad(kernel, "w2.size\\(1\\) must equal", w2=torch.zeros(4, 128, 128, dtype=torch.bfloat16, device="cuda"))
    _bad(kernel, "w.size\\(2\\) must equal", w=torch.zeros(4, 256, 128, dtype=torch.bfloat16, device="cuda"))
    _bad(kernel, "w2.size\\(0\\) must equal", w2=w2[:3].contiguous())
    _bad(kernel, "sorted_token_ids must have moe_align's length",
         sorted_token_ids=torch.zeros(128, dtype=torch.int32, device="cuda"))
    _bad(kernel, "block_n must be", block_n=64)
    _bad(kernel, "stages must be", stages=7)
    _bad(kernel, "bpc \\(CTAs per cluster\\) must be 1 or 2", bpc=3)
    _bad(kernel, "x must be contiguous", x=torch.randn(256, 64, device="cuda").bfloat16().t())
    _bad(kernel, "w must be a CUDA tensor|w must be on the same device", w=w.cpu())
    _bad(kernel, "top_k must be in", top_k=17)
    w1 = w[:, :128].contiguous()
    _bad(kernel, "w3 must have w1's shape", w=w1, w3=w[:, :64].contiguous())
    _bad(kernel, "w3 must have dtype", w=w1, w3=w1.float())
    _bad(kernel, "w2.size\\(2\\) must equal w1.size\\(1\\)", w=w[:, :64].contiguous(), w3=w[:, 64:128].contiguous())
    _bad(kernel, "topk_weights must have dtype", topk_weights=wt.half())
    _bad(kernel, "topk_weights must have shape", topk_weights=torch.rand(64, 3, device="cuda"))
    _bad(kernel, "out must have shape", out=torch.empty(63, 256, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(RuntimeError, match="topk_ids must have dtype"):
        kernel.ops.moe_align(ids.long(), 4, 128, 1)
    with pytest.raises(RuntimeError, match="num_experts must be in"):
        kernel.moe_align(ids, 513)
    with pytest.raises(RuntimeError, match="block_m must be"):
        kernel.moe_align(ids, 4, block_m=64)


@pytest.mark.parametrize("bpc", [1, 2])
def test_garbage_routing_buffers_never_fault(kernel, bpc):
    """Out-of-range ids in user-made sorted_token_ids / expert_ids are skipped, no illegal access."""
    x, w, w2, ids, wt = _inputs(64, 256, 128, 4, 2)
    s, e, n = kernel.moe_align(ids, 4)
    s2 = torch.randint(-10**6, 10**6, s.shape, dtype=torch.int32, device="cuda")
    e2 = torch.randint(-100, 100, e.shape, dtype=torch.int32, device="cuda")
    e2[1::3] = e2[0::3][: e2[1::3].numel()]  # runs of one (possibly valid) expert: pairs
    n2 = torch.tensor([10**9], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    kernel.fused_moe_bf16(x, w, w2, s2, e2, n2, wt, out, 2, bpc=bpc)
    torch.cuda.synchronize()
