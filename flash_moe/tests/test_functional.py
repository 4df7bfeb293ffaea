"""The differentiable `moe` on the CPU, the references standing in for the kernels (same
layouts): its two backwards, `composed_backward` and `fused_backward`, and `moe` itself (which
backward it picks, and its gradients), against fp64 autograd through the reference; and the
pre-activation layout. The GPU tests (test_moe_backward_gpu.py, test_fused_dgrad_gpu.py,
test_fused_wgrad_gpu.py) run them with the kernels."""

import pytest
import reference_kernel
import torch
import torch.nn.functional as F
from error_measure import rel_err

@pytest.fixture(scope="module")
def functional():
    return reference_kernel.load().functional


def _problem(M, K, I, E, top_k, drop, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w1, w3 = (torch.randn(E, I, K, generator=g) / K ** 0.5 for _ in range(2))  # fp32 master weights
    w2 = torch.randn(E, K, I, generator=g) / I ** 0.5
    scores, ids = F.softmax(torch.randn(M, E, generator=g), -1).topk(top_k, -1)
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g) < drop, torch.full_like(ids, -1), ids)
    return x, w1, w2, w3, ids, scores, torch.randn(M, K, generator=g).bfloat16()


def _assert_fp64_close(reference, grads, x, w1, w2, w3, ids, scores, grad_out):
    """grads (x, w1, w2, w3, topk_weights) against fp64 autograd through the reference: dtypes,
    shapes, relative error (bf16 operands), and a dropped slot's score gradient exactly 0."""
    leaves = [t.double().requires_grad_() for t in (x, w1, w2, w3, scores)]
    out = reference.moe_fp32(leaves[0], torch.cat([leaves[1], leaves[3]], 1), leaves[2], ids.to(torch.int32),
                             leaves[4], dtype=torch.float64)
    out.backward(grad_out.double())
    for name, got, leaf, src in zip(("x", "w1", "w2", "w3", "topk_weights"), grads, leaves, (x, w1, w2, w3, scores)):
        assert got.dtype == src.dtype and got.shape == src.shape, name
        assert rel_err(got, leaf.grad) < 2e-2, (name, rel_err(got, leaf.grad))
    dropped = ids < 0
    assert torch.equal(grads[4][dropped], torch.zeros_like(grads[4][dropped]))


@pytest.mark.parametrize("M,K,I,E,top_k,drop", [(64, 64, 32, 4, 2, 0.0), (50, 128, 64, 8, 3, 0.25),
                                                 (1, 64, 32, 8, 2, 0.0), (40, 64, 32, 16, 1, 0.0)])
def test_backward_matches_fp64_autograd(functional, reference, M, K, I, E, top_k, drop):
    x, w1, w2, w3, ids, scores, grad_out = _problem(M, K, I, E, top_k, drop, seed=M + E)
    routing = (*reference.moe_align(ids.to(torch.int32), E), top_k)
    grads = functional.composed_backward(grad_out, x, w1, w2, w3, scores, routing)
    _assert_fp64_close(reference, grads, x, w1, w2, w3, ids, scores, grad_out)
    again = functional.composed_backward(grad_out, x, w1, w2, w3, scores, routing)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    only_w2 = functional.composed_backward(grad_out, x, w1, w2, w3, scores, routing, (False, False, True, False, False))
    assert only_w2[2] is not None and all(t is None for i, t in enumerate(only_w2) if i != 2)
    assert torch.equal(only_w2[2], grads[2])


@pytest.mark.parametrize("M,K,I,E,top_k,drop", [(64, 64, 64, 4, 2, 0.0), (50, 128, 128, 8, 3, 0.25),
                                                 (1, 64, 64, 8, 2, 0.0)])
def test_fused_backward_matches_fp64_autograd(functional, reference, M, K, I, E, top_k, drop):
    x, w1, w2, w3, ids, scores, grad_out = _problem(M, K, I, E, top_k, drop, seed=M + E)
    sorted_ids, expert_ids, ntpp = reference.moe_align(ids.to(torch.int32), E)
    preact = torch.full((2 * sorted_ids.numel() * I,), float("nan"), dtype=torch.bfloat16)
    w = torch.cat([w1, w3], 1).bfloat16()
    reference.fused_moe_bf16(x, w, w2.bfloat16(), sorted_ids, expert_ids, ntpp, scores, torch.empty_like(x), top_k,
                             preact=preact)
    grads = functional.fused_backward(grad_out, x, w1, w2, w3, scores, (sorted_ids, expert_ids, ntpp, top_k), preact)
    _assert_fp64_close(reference, grads, x, w1, w2, w3, ids, scores, grad_out)


def test_fused_backward_hands_its_bpc_to_both_ops(functional, reference, monkeypatch):
    """fused_backward passes its bpc to the dgrad and the wgrad op, and `moe` passes None, so that
    each op takes preferred_bpc(..., backward=True) of the shape (test_reference.py holds that)."""
    seen = []
    for name in ("fused_moe_bf16_dgrad", "fused_moe_bf16_wgrad"):
        original = getattr(functional, name)
        monkeypatch.setattr(functional, name,
                            lambda *a, _f=original, _n=name, **k: seen.append((_n, k["bpc"])) or _f(*a, **k))
    x, w1, w2, w3, ids, scores, grad_out = _problem(48, 64, 64, 8, 2, 0.0, seed=3)
    routing = (*reference.moe_align(ids.to(torch.int32), 8), 2)
    preact = torch.empty(2 * routing[0].numel() * 64, dtype=torch.bfloat16)
    reference.fused_moe_bf16(x, torch.cat([w1, w3], 1).bfloat16(), w2.bfloat16(), *routing[:3], scores,
                             torch.empty_like(x), 2, preact=preact)
    functional.fused_backward(grad_out, x, w1, w2, w3, scores, routing, preact, bpc=2)
    assert seen == [("fused_moe_bf16_dgrad", 2), ("fused_moe_bf16_wgrad", 2)]
    seen.clear()
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, scores)]
    functional.moe(leaves[0], leaves[1], leaves[2], leaves[3], ids, leaves[4]).backward(grad_out)
    assert seen == [("fused_moe_bf16_dgrad", None), ("fused_moe_bf16_wgrad", None)]


@pytest.mark.parametrize("I,fused", [(32, False), (64, True)])
def test_moe_picks_its_backward_and_matches_fp64_autograd(functional, reference, monkeypatch, I, fused):
    """`moe` runs `fused_backward` exactly when fused_backward_serves(I), else `composed_backward`;
    its output and gradients (fp32 master weights: fp32 gradients) match fp64 autograd, and a
    repeat gives the same bits."""
    x, w1, w2, w3, ids, scores, grad_out = _problem(48, 64, I, 8, 2, 0.2, seed=I)
    assert functional.fused_backward_serves(I) == fused
    ran = []
    for name in ("fused_backward", "composed_backward"):
        original = getattr(functional, name)
        monkeypatch.setattr(functional, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, scores)]
        out = functional.moe(leaves[0], leaves[1], leaves[2], leaves[3], ids, leaves[4])
        out.backward(grad_out)
        return out.detach(), [t.grad for t in leaves]

    out, grads = run()
    assert ran == ["fused_backward" if fused else "composed_backward"]
    _assert_fp64_close(reference, grads, x, w1, w2, w3, ids, scores, grad_out)
    want = reference.moe_fp32(x.double(), torch.cat([w1, w3], 1).double(), w2.double(), ids.to(torch.int32),
                              scores.double(), dtype=torch.float64)
    assert out.dtype == x.dtype and rel_err(out, want) < 2e-2
    out2, grads2 = run()
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_fused_moe_apply_takes_prime_rls_call(functional):
    """FusedMoE.apply takes prime-rl's `_FusedMoE.apply` arguments and is `moe`, gradients too;
    a num_experts other than the weights' expert count is refused by name."""
    x, w1, w2, w3, ids, scores, grad_out = _problem(40, 64, 64, 8, 2, 0.0, seed=3)
    results = []
    for call in (lambda *a: functional.FusedMoE.apply(*a, 8, False), lambda *a: functional.moe(*a, mxfp8=False)):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, scores)]
        out = call(leaves[0], leaves[1], leaves[2], leaves[3], ids, leaves[4])
        out.backward(grad_out)
        results.append([out.detach()] + [t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="num_experts must equal w1.shape"):
        functional.FusedMoE.apply(x, w1, w2, w3, ids, scores, 16, False)


def test_preact_layout_is_a_permutation(reference):
    L, I = 256, 192
    idx = reference._preact_index(L, I).reshape(-1)
    assert torch.equal(idx.sort().values, torch.arange(2 * L * I))
    a, u = torch.randn(L, I).bfloat16(), torch.randn(L, I).bfloat16()
    packed = reference.pack_preact(a, u)
    got_a, got_u = reference.unpack_preact(packed, L, I)
    assert torch.equal(got_a, a) and torch.equal(got_u, u)
    # one 16-byte chunk: thread (w4=1, lane=5) of group 0, rows 8..15: gate then up, (h, e) order
    c = ((0 * (L // 8) + 1) * 4 + 1) * 32 + 5
    f, p = 16 + 5 // 4, 8 + 2 * (5 % 4)
    want = [a[p, f], a[p + 1, f], a[p, f + 8], a[p + 1, f + 8], u[p, f], u[p + 1, f], u[p, f + 8], u[p + 1, f + 8]]
    assert torch.equal(packed[8 * c:8 * c + 8], torch.stack(want))


def test_mxfp8_backward_recomputes_the_preactivations_alone(functional, reference, monkeypatch):
    """`moe(mxfp8=True)`'s backward gets its bf16 pre-activations from fused_moe_bf16 with
    preact_only=True (the gate/up GEMM alone), once; its gradients are the bf16 moe's
    (straight-through). The MXFP8 op is stood in for by the bf16 reference."""
    calls = []

    def bf16(*a, **k):
        calls.append(k.get("preact_only", False))
        return reference.fused_moe_bf16(*a, **k)

    monkeypatch.setattr(functional, "fused_moe_bf16", bf16)
    monkeypatch.setattr(functional, "quantize_mxfp8", lambda t, blocked=False: (t, None))
    monkeypatch.setattr(functional, "fused_moe_mxfp8",
                        lambda x, xs, w, ws, w2, w2s, *rest: reference.fused_moe_bf16(x, w, w2, *rest))
    x, w1, w2, w3, ids, scores, grad_out = _problem(48, 64, 64, 8, 2, 0.2, seed=7)
    grads = {}
    for mxfp8 in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, scores)]
        functional.moe(leaves[0], leaves[1], leaves[2], leaves[3], ids, leaves[4], mxfp8=mxfp8).backward(grad_out)
        grads[mxfp8] = [t.grad for t in leaves]
        if mxfp8:
            assert calls == [True]  # the forward ran the MXFP8 op; the backward one preact_only call
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_reference_preact_only_fills_preact_alone(reference):
    """The reference of fused_moe_bf16(preact_only=True), as the MXFP8 forward's backward calls it:
    the whole op's preact, out untouched; refused without preact."""
    x, w1, w2, w3, ids, scores, _ = _problem(48, 64, 64, 8, 2, 0.2, seed=5)
    routing = reference.moe_align(ids.to(torch.int32), 8)
    w, w2 = torch.cat([w1, w3], 1).bfloat16(), w2.bfloat16()
    full, alone = (torch.full((2 * routing[0].numel() * 64,), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    reference.fused_moe_bf16(x, w, w2, *routing, scores, torch.empty_like(x), 2, preact=full)
    out = torch.full_like(x, float("nan"))
    reference.fused_moe_bf16(x, w, w2, *routing, scores, out, 2, preact=alone, preact_only=True)
    assert torch.equal(alone, full) and out.isnan().all()
    with pytest.raises(RuntimeError, match="preact_only=True needs preact"):
        reference.fused_moe_bf16(x, w, w2, *routing, scores, out, 2, preact_only=True)
