"""The binding's TORCH_CHECKs are the op contract: the Python surface that restates it
(`unsupported_shape_reason`, `BLOCK_M`, the tuning defaults and the documented limits) must say
exactly what the built ops accept."""

import pytest
import torch

pytestmark = pytest.mark.gpu

M, E, TOP_K = 4, 2, 1
# (dim, hidden_dim): every pair of small sizes (zero; not a multiple of 8, 32 or 64; multiples),
# the real shapes of docs/DESIGN.md §5, and refused shapes next to them.
SMALL = [0, 8, 12, 16, 24, 32, 40, 64, 96, 128, 192]
REAL = [(2048, 768), (4096, 1536), (7168, 2048), (2048, 1408), (5120, 1536), (2048, 512), (2880, 2880)]
NEAR_REAL = [(2050, 768), (2048, 770), (2056, 768), (2080, 768), (2048, 800), (2048, 776), (2056, 776)]
SHAPES = [(d, h) for d in SMALL for h in SMALL] + REAL + NEAR_REAL


def _routing(kernel):
    ids = torch.arange(M, dtype=torch.int32, device="cuda").remainder(E).reshape(M, TOP_K).contiguous()
    s, e, n = kernel.moe_align(ids, E)
    wt = torch.rand(M, TOP_K, device="cuda")
    return s, e, n, wt


def _call(kernel, dim, hidden, mxfp8, split, routing):
    """The op on tiny inputs of expert shape (dim, hidden): None when it runs, else the error text."""
    s, e, n, wt = routing
    out = torch.empty(M, dim, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, dim, device="cuda").bfloat16()
    w = torch.randn(E, 2 * hidden, dim, device="cuda").bfloat16()
    w2 = torch.randn(E, dim, hidden, device="cuda").bfloat16()
    try:
        if not mxfp8:
            kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, out, TOP_K, split=split)
        elif dim % 32 == 0 and hidden % 32 == 0 and dim and hidden:
            (xq, xs), (wq, ws), (w2q, w2s) = (kernel.quantize_mxfp8(x), kernel.quantize_mxfp8(w, blocked=True),
                                              kernel.quantize_mxfp8(w2, blocked=True))
            kernel.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, wt, out, TOP_K, split=split)
        else:  # not quantizable: e4m3 zeros and any scales (the shape is refused before they are read)
            f8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
            sc = torch.full((M, dim // 32), 127, dtype=torch.uint8, device="cuda").view(e8)
            kernel.fused_moe_mxfp8(x.to(f8), sc, w.to(f8), sc.reshape(-1), w2.to(f8), sc.reshape(-1), s, e, n, wt, out,
                                   TOP_K, split=split)
        torch.cuda.synchronize()
        return None
    except RuntimeError as err:
        return str(err)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("mxfp8", [False, True])
def test_unsupported_shape_reason_is_what_the_op_refuses(kernel, mxfp8, split):
    op = "fused_moe_mxfp8" if mxfp8 else "fused_moe_bf16"
    routing = _routing(kernel)
    wrong = []
    for dim, hidden in SHAPES:
        reason = kernel.unsupported_shape_reason(dim, hidden, mxfp8=mxfp8, split=split)
        error = _call(kernel, dim, hidden, mxfp8, split, routing)
        if (reason is None) != (error is None):
            wrong.append(f"({dim}, {hidden}): unsupported_shape_reason says {reason!r}, the op says {error!r}")
            continue
        if error is None:
            continue
        # the error names an argument that is wrong on its own: x.size(1) for dim, w.size(1) for hidden_dim
        dim_bad = kernel.unsupported_shape_reason(dim, 64, mxfp8=mxfp8) is not None
        hidden_bad = kernel.unsupported_shape_reason(64, hidden, mxfp8=mxfp8) is not None
        named = (dim_bad and "x.size(1)" in error) or (hidden_bad and "w.size(1)" in error)
        if not (error.startswith(f"{op}: ") and named):
            wrong.append(f"({dim}, {hidden}): the error does not name the wrong argument: {error!r}")
    assert not wrong, "\n".join(wrong)


def test_block_m_and_limits_are_the_bindings(kernel):
    """BLOCK_M is moe_align's only block_m; num_experts 1..512 and top_k 1..16 as documented."""
    ids = torch.zeros(M, 16, dtype=torch.int32, device="cuda")
    s, e, n = kernel.moe_align(ids, 512, block_m=kernel.BLOCK_M)
    assert s.numel() == kernel.reference.aligned_length(ids.numel(), 512, kernel.BLOCK_M)
    for bad in (kernel.BLOCK_M // 2, kernel.BLOCK_M * 2):
        with pytest.raises(RuntimeError, match=r"^moe_align: block_m must be"):
            kernel.moe_align(ids, 4, block_m=bad)
    with pytest.raises(RuntimeError, match=r"^moe_align: num_experts must be in \[1, 512\]"):
        kernel.moe_align(ids, 513)
    with pytest.raises(RuntimeError, match=r"^moe_align: topk_ids.size\(1\) \(top_k\) must be in \[1, 16\]"):
        kernel.moe_align(torch.zeros(M, 17, dtype=torch.int32, device="cuda"), 4)


def test_tuning_defaults_and_documented_values_are_accepted(kernel):
    """The defaults (BLOCK_N, WARP_N, STAGES, STAGES_MXFP8) and the values the docstrings list are
    exactly what the binding accepts."""
    dim, hidden = 128, 128
    routing = _routing(kernel)
    s, e, n, wt = routing
    x = torch.randn(M, dim, device="cuda").bfloat16()
    w = torch.randn(E, 2 * hidden, dim, device="cuda").bfloat16()
    w2 = torch.randn(E, dim, hidden, device="cuda").bfloat16()
    out = torch.empty_like(x)
    q = [kernel.quantize_mxfp8(x), kernel.quantize_mxfp8(w, blocked=True), kernel.quantize_mxfp8(w2, blocked=True)]
    (xq, xs), (wq, ws), (w2q, w2s) = q

    def bf16(**tuning):
        kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, out, TOP_K, **tuning)

    def mx(**tuning):
        kernel.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, wt, out, TOP_K, **tuning)

    for op in (bf16, mx):
        op()  # the defaults
        op(block_m=kernel.BLOCK_M, block_n=kernel.BLOCK_N, warp_n=kernel.WARP_N, cpc=1)
        for bpc in (None, 1, 2):
            op(bpc=bpc)
        for name, bad in (("block_m", kernel.BLOCK_M * 2), ("block_n", kernel.BLOCK_N // 2),
                          ("warp_n", kernel.WARP_N // 2), ("bpc", 3), ("cpc", 2)):
            with pytest.raises(RuntimeError, match=rf": {name} "):
                op(**{name: bad})
    assert kernel.STAGES in (3, 4)
    for stages in (3, 4):
        bf16(stages=stages)
    mx(stages=kernel.STAGES_MXFP8)
    for stages in (2, 5):
        with pytest.raises(RuntimeError, match=r"^fused_moe_bf16: stages must be in \[3, 4\]"):
            bf16(stages=stages)
    for stages in (kernel.STAGES_MXFP8 - 1, kernel.STAGES_MXFP8 + 1):
        with pytest.raises(RuntimeError, match=rf"^fused_moe_mxfp8: stages must be {kernel.STAGES_MXFP8} "):
            mx(stages=stages)
    torch.cuda.synchronize()
