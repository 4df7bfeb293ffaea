"""GPU tests of `fused_moe_bf16_dgrad` (the fused backward's data gradients) and the
pre-activations `fused_moe_bf16(..., preact=)` saves for it: every output by sorted position
against fp64 truth, dropped slots and padding rows, bit-identical repeats, graph capture, and the
input rules. (The gradients of `moe` through this path are tested in test_moe_backward_gpu.py.)"""

import pytest
import torch
from cuda_graph_check import assert_graph_replays_eager
from error_measure import rel_err

pytestmark = pytest.mark.gpu


def _setup(kernel, M, K, I, E, top_k, seed, drop=0.0, bpc=1, ids=None):
    """Random inputs and routing (or the given (M, top_k) ids), and the forward's preact."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * I, K, generator=g, device="cuda") / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:top_k] for _ in range(M)]).int()
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g, device="cuda") < drop, torch.full_like(ids, -1), ids)
    wts = torch.rand(M, top_k, generator=g, device="cuda")
    grad_out = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    sorted_ids, expert_ids, ntpp = kernel.moe_align(ids, E)
    preact = torch.full((kernel.preact_numel(sorted_ids.numel(), I),), float("nan"), dtype=torch.bfloat16,
                        device="cuda")
    out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
    kernel.fused_moe_bf16(x, w, w2, sorted_ids, expert_ids, ntpp, wts, out, top_k, bpc=bpc, preact=preact)
    return x, w, w2, ids, wts, grad_out, (sorted_ids, expert_ids, ntpp), preact


def _defined(outputs, routing):
    """(grad_x, dab, sh, score) with dab and sh cut to the rows below num_tokens_post_padded (the
    rest is unspecified)."""
    used = int(routing[2])
    gx, dab, sh, score = outputs
    return gx, dab[:used], sh[:used], score


def _halves(w):
    """w1, w3 of the forward's w = cat([w1, w3], 1)."""
    I = w.shape[1] // 2
    return w[:, :I].contiguous(), w[:, I:].contiguous()


def _truth(x, w, w2, ids, wts, grad_out, routing, top_k):
    """fp64: per sorted position p (slot s, token t, expert e, weight r): dA|dB, s*h, and per slot
    the score gradient; grad_x per token."""
    sorted_ids, expert_ids, ntpp = routing
    M, K = x.shape
    E, I2, _ = w.shape
    I = I2 // 2
    L = sorted_ids.numel()
    n_slots = ids.numel()
    pos = torch.arange(L, device="cuda")
    live = (sorted_ids >= 0) & (sorted_ids < n_slots) & (pos < ntpp)
    exp = expert_ids.long().repeat_interleave(128)[:L]
    dab = torch.zeros(L, 2 * I, dtype=torch.float64, device="cuda")
    sh = torch.zeros(L, I, dtype=torch.float64, device="cuda")
    score = torch.zeros(n_slots, dtype=torch.float64, device="cuda")
    gx = torch.zeros(M, K, dtype=torch.float64, device="cuda")
    for e in range(E):
        p = torch.nonzero(live & (exp == e)).flatten()
        if p.numel() == 0:
            continue
        slot = sorted_ids[p].long()
        t = slot // top_k
        r = wts.reshape(-1)[slot].double().unsqueeze(1)
        xe, ge = x[t].double(), grad_out[t].double()
        a = xe @ w[e, :I].double().t()
        u = xe @ w[e, I:].double().t()
        sig = torch.sigmoid(a)
        h = a * sig * u
        dh = ge @ w2[e].double()
        da = r * dh * u * sig * (1 + a * (1 - sig))
        db = r * dh * a * sig
        dab[p] = torch.cat([da, db], 1)
        sh[p] = r * h
        score[slot] = (dh * h).sum(1)
        gx.index_add_(0, t, torch.cat([da, db], 1) @ w[e].double())
    return gx, dab, sh, score.reshape(ids.shape), live


CASES = [
    # M, K, I, E, top_k, drop, bpc (the forward's, which saved preact)
    (300, 512, 256, 8, 2, 0.0, 1),
    (257, 320, 192, 6, 2, 0.2, 1),  # I % 256 != 0 (a half-empty n-block), K % 256 != 0, -1 ids
    (500, 1024, 768, 16, 4, 0.0, 2),  # preact saved by the CTA-pair forward
    (1, 256, 128, 4, 1, 0.0, 1),  # M = 1, top_k = 1
    # Fewer k-blocks per tile than stages (K = 64, 136), several tiles per CTA, K % 64 != 0, an
    # n-block mostly past I (I = 320)
    (8192, 64, 128, 8, 4, 0.05, 1),
    (700, 136, 320, 5, 3, 0.0, 1),
]


# dgrad_bpc 2: both GEMMs as CTA pairs, the gate/up dgrad's splitting two blocks by live rows, the
# down dgrad's a whole block per CTA. The cases give them pairs of blocks (8192 x 4 slots over 8
# experts, 700 x 3 over 5), lone blocks (500 x 4 over 16, 300 x 2 over 8), and odd n-block
# counts, where a lone block leaves one CTA of its pair idle (gate/up: K = 136, num_n 1; down:
# I = 128, 192, 256, 768, num_n 1 or 3).
@pytest.mark.parametrize("dgrad_bpc", [1, 2])
@pytest.mark.parametrize("M,K,I,E,top_k,drop,bpc", CASES)
def test_dgrad_outputs_vs_fp64(kernel, M, K, I, E, top_k, drop, bpc, dgrad_bpc):
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, M, K, I, E, top_k, seed=M + K, drop=drop, bpc=bpc)
    gx, dab, sh, score = kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, top_k, bpc=dgrad_bpc)
    t_gx, t_dab, t_sh, t_score, live = _truth(x, w, w2, ids, wts, g, routing, top_k)
    assert gx.dtype == torch.bfloat16 and gx.shape == x.shape
    assert dab.shape == t_dab.shape and sh.shape == t_sh.shape and score.shape == ids.shape
    used = int(routing[2])  # dab and sh rows past it are unspecified
    for name, got, want in (("grad_x", gx, t_gx), ("dab", dab[:used], t_dab[:used]), ("sh", sh[:used], t_sh[:used]),
                            ("score", score, t_score)):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 2e-2, (name, rel_err(got, want))
    # Padding rows inside the experts' m-blocks are written as zeros (the wgrad's A operand reads
    # them); rows past num_tokens_post_padded are unspecified.
    pad = ~live & (torch.arange(live.numel(), device="cuda") < routing[2])
    assert pad.any()
    assert torch.equal(dab[pad], torch.zeros_like(dab[pad]))
    assert torch.equal(sh[pad], torch.zeros_like(sh[pad]))
    dropped = ids < 0
    assert torch.equal(score[dropped], torch.zeros_like(score[dropped]))
    gone = dropped.all(1)  # tokens routed elsewhere entirely: grad_x exactly zero
    assert torch.equal(gx[gone], torch.zeros_like(gx[gone]))


def test_dgrad_bit_identical_repeats_and_bpc(kernel):
    args = _setup(kernel, 2048, 2048, 768, 64, 8, seed=7)
    x, w, w2, ids, wts, g, routing, preact = args

    def dgrad(bpc):
        return _defined(kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, 8, bpc=bpc), routing)

    first = dgrad(1)
    for _ in range(3):
        for a, b in zip(dgrad(1), first):
            assert torch.equal(a, b)
    # the CTA-pair gate/up dgrad gives the same bits
    paired = dgrad(2)
    for a, b in zip(paired, first):
        assert torch.equal(a, b)
    # the CTA-pair forward saves the same pre-activations (NaN where neither writes: the fill)
    preact2 = _setup(kernel, 2048, 2048, 768, 64, 8, seed=7, bpc=2)[-1]
    torch.testing.assert_close(preact2, preact, rtol=0, atol=0, equal_nan=True)


def test_dgrad_pairs_carry_a_short_tail(kernel):
    """bpc 2 with a carried tail: expert 0 holds 2 x 128 + 20 rows, so its pair's two parts exceed
    128 rows (dA|dB rows 128.. through the tail map, dx rows 128.. stored from registers); expert 1
    holds 100 (a lone block). Bits equal bpc 1's, grad_x within bf16 error of fp64."""
    M, K, I, E, top_k = 376, 512, 256, 2, 1
    ids = (torch.arange(M, device="cuda") >= 276).int().unsqueeze(1)
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, M, K, I, E, top_k, seed=9, ids=ids)
    single = _defined(kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, top_k, bpc=1), routing)
    paired = _defined(kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, top_k, bpc=2), routing)
    for a, b in zip(paired, single):
        assert torch.equal(a, b)
    t_gx = _truth(x, w, w2, ids, wts, g, routing, top_k)[0]
    assert rel_err(paired[0], t_gx) < 2e-2


def test_dgrad_graph_capture_replays_eager(kernel):
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, 1024, 1024, 512, 32, 4, seed=5)
    eager = kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, 4)
    assert_graph_replays_eager(lambda: kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, 4),
                               eager, defined=lambda outputs: _defined(outputs, routing))


def test_dgrad_bad_inputs_name_the_argument(kernel):
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, 64, 256, 128, 4, 2, seed=1)
    with pytest.raises(RuntimeError, match="preact must hold"):
        kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact[:-8], *routing, wts, 2)
    with pytest.raises(RuntimeError, match=r"bpc \(CTAs per cluster\) must be 1 or 2, got 3"):
        kernel.fused_moe_bf16_dgrad(g, *_halves(w), w2, preact, *routing, wts, 2, bpc=3)
    with pytest.raises(RuntimeError, match="grad_out must have dtype"):
        kernel.fused_moe_bf16_dgrad(g.float(), *_halves(w), w2, preact, *routing, wts, 2)
    with pytest.raises(RuntimeError, match=r"w1.size\(2\) must equal grad_out.size\(1\)"):
        kernel.fused_moe_bf16_dgrad(g[:, :128].contiguous(), *_halves(w), w2, preact, *routing, wts, 2)
    w1, w3 = _halves(w)
    with pytest.raises(RuntimeError, match="w3 must have w1's shape"):
        kernel.fused_moe_bf16_dgrad(g, w1, w3[:, :64].contiguous(), w2, preact, *routing, wts, 2)
    # I = 96: no 64-feature groups; the forward refuses to save for it
    w96, w2_96 = w[:, :192].contiguous(), w2[:, :, :96].contiguous()
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.fused_moe_bf16(x, w96, w2_96, *routing, wts, out, 2, preact=preact)
    # no tokens: the forward has nothing to run, and a preact of the wrong size still fails
    x0, wts0 = x[:0], wts[:0]
    routing0 = kernel.moe_align(ids[:0].int(), 4)
    want = kernel.preact_numel(routing0[0].numel(), 128)
    kernel.fused_moe_bf16(x0, w, w2, *routing0, wts0, torch.empty_like(x0), 2,
                          preact=torch.empty(want, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(RuntimeError, match="preact must hold"):
        kernel.fused_moe_bf16(x0, w, w2, *routing0, wts0, torch.empty_like(x0), 2,
                              preact=torch.empty(want + 8, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("bpc,split_w3", [(1, False), (2, True)])
def test_preact_only_fills_the_same_bits_and_leaves_out(kernel, bpc, split_w3):
    """fused_moe_bf16(preact_only=True) runs the gate/up GEMM alone: preact gets the whole op's
    bits (NaN where neither writes: the fill), out keeps its poison; without preact it is refused."""
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, 700, 512, 256, 8, 3, seed=11, drop=0.1, bpc=bpc)
    gate, up = _halves(w) if split_w3 else (w, None)
    alone = torch.full_like(preact, float("nan"))
    out = torch.full_like(x, float("nan"))
    kernel.fused_moe_bf16(x, gate, w2, *routing, wts, out, 3, bpc=bpc, preact=alone, preact_only=True, w3=up)
    torch.testing.assert_close(alone, preact, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().all()
    with pytest.raises(RuntimeError, match="preact_only=True needs preact"):
        kernel.fused_moe_bf16(x, w, w2, *routing, wts, out, 3, preact_only=True)


def test_saved_preact_is_the_reference_layout(kernel, reference):
    """The kernel's preact, unpacked with the reference's layout, is x W_gate^T | x W_up^T by
    sorted position (fp32-accumulated, bf16-rounded: within a bf16 rounding of the reference)."""
    M, K, I, E, top_k = 300, 512, 192, 8, 2
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, M, K, I, E, top_k, seed=3)
    want = torch.zeros_like(preact)
    reference.fused_moe_bf16(x, w, w2, *routing, wts, torch.empty_like(x), top_k, preact=want)
    L = routing[0].numel()
    live = reference._live_positions(routing[0], routing[2], M * top_k)
    for got_t, want_t in zip(reference.unpack_preact(preact, L, I), reference.unpack_preact(want, L, I)):
        torch.testing.assert_close(got_t[live].float(), want_t[live].float(), rtol=1.6e-2, atol=1e-3)


def test_dgrad_opcheck(kernel):
    x, w, w2, ids, wts, g, routing, preact = _setup(kernel, 64, 256, 128, 4, 2, seed=2)
    preact = torch.nan_to_num(preact)  # test_schema compares inputs before and after (NaN != NaN)
    # Not test_aot_dispatch_dynamic: it compares every output element of two calls, and dab's and
    # sh's rows past num_tokens_post_padded are unspecified (allocated, never written).
    torch.library.opcheck(kernel.ops.fused_moe_bf16_dgrad, (g, *_halves(w), w2, preact, *routing, wts, 2, 1),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
