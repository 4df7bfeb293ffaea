"""The differentiable `moe`'s backward (functional.moe_backward) on the CPU: its gradients against
fp64 autograd through the reference, with the reference `moe_align` standing in for the kernel's
(same layout). The GPU tests (test_moe_backward_gpu.py) run it with the kernels."""

import pathlib

import kernel_package
import pytest
import torch
import torch.nn.functional as F

MEMBER_DIR = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def functional(reference):
    def unused(*args, **kwargs):
        raise AssertionError("the backward runs no forward op")

    return kernel_package.load_submodule(
        "flash_moe_functional_parent", MEMBER_DIR / "torch-ext" / "flash_moe", "functional",
        moe_align=reference.moe_align, fused_moe_bf16=unused, fused_moe_mxfp8=unused, quantize_mxfp8=unused)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("M,K,I,E,top_k,drop", [(64, 64, 32, 4, 2, 0.0), (50, 128, 64, 8, 3, 0.25),
                                                 (1, 64, 32, 8, 2, 0.0), (40, 64, 32, 16, 1, 0.0)])
def test_backward_matches_fp64_autograd(functional, reference, M, K, I, E, top_k, drop):
    g = torch.Generator().manual_seed(M + E)
    x = torch.randn(M, K, generator=g).bfloat16()
    w1, w3 = (torch.randn(E, I, K, generator=g) / K ** 0.5 for _ in range(2))  # fp32 master weights
    w2 = torch.randn(E, K, I, generator=g) / I ** 0.5
    scores, ids = F.softmax(torch.randn(M, E, generator=g), -1).topk(top_k, -1)
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g) < drop, torch.full_like(ids, -1), ids)
    grad_out = torch.randn(M, K, generator=g).bfloat16()
    grads = functional.moe_backward(grad_out, x, w1, w2, w3, ids, scores)

    leaves = [t.double().requires_grad_() for t in (x, w1, w2, w3, scores)]
    out = reference.moe_fp32(leaves[0], torch.cat([leaves[1], leaves[3]], 1), leaves[2], ids.to(torch.int32),
                             leaves[4], dtype=torch.float64)
    out.backward(grad_out.double())
    for name, got, leaf, src in zip(("x", "w1", "w2", "w3", "topk_weights"), grads, leaves, (x, w1, w2, w3, scores)):
        assert got.dtype == src.dtype and got.shape == src.shape, name
        assert _rel(got, leaf.grad) < 2e-2, (name, _rel(got, leaf.grad))  # bf16 operands
    dropped = ids < 0
    assert torch.equal(grads[4][dropped], torch.zeros_like(grads[4][dropped]))
    assert all(torch.equal(a, b) for a, b in zip(grads, functional.moe_backward(grad_out, x, w1, w2, w3, ids, scores)))
    only_w2 = functional.moe_backward(grad_out, x, w1, w2, w3, ids, scores, (False, False, True, False, False))
    assert only_w2[2] is not None and all(t is None for i, t in enumerate(only_w2) if i != 2)
    assert torch.equal(only_w2[2], grads[2])
