"""CPU tests: the pure-PyTorch references, layouts, bit patterns, shape rules (no GPU needed)."""

import pathlib
import re

import package_stub
import pytest
import torch

MEMBER = pathlib.Path(__file__).resolve().parents[1]


def test_moe_align_small_exact(reference):
    ids = torch.tensor([[3, 1], [1, -1], [0, 3], [7, 1]], dtype=torch.int32)  # 7 >= E: dropped like -1
    s, e, n = reference.moe_align(ids, 4, block_m=4)
    S = 8  # sentinel M*top_k
    # expert 0: slot 4; expert 1: slots 1, 2, 7; expert 3: slots 0, 5
    assert s[:12].tolist() == [4, S, S, S, 1, 2, 7, S, 0, 5, S, S]
    assert n.tolist() == [12]
    assert e.tolist()[:3] == [0, 1, 3]
    assert all(v == -1 for v in e.tolist()[3:])
    assert (s[12:] == S).all()
    assert s.numel() == reference.aligned_length(8, 4, 4) == (8 + 4 * 3 + 3) // 4 * 4


@pytest.mark.parametrize("M,top_k,E,bm", [(1, 1, 1, 128), (37, 4, 16, 128), (300, 8, 64, 128), (64, 16, 512, 128),
                                          (50, 2, 3, 16)])
def test_moe_align_invariants(reference, M, top_k, E, bm):
    g = torch.Generator().manual_seed(M * 131 + E)
    ids = torch.randint(-1, E, (M, top_k), generator=g, dtype=torch.int32)
    s, e, n = reference.moe_align(ids, E, block_m=bm)
    n_slots = M * top_k
    L = reference.aligned_length(n_slots, E, bm)
    assert s.numel() == L and L % bm == 0 and e.numel() == L // bm
    used_len = int(n)  # num_tokens_post_padded: the padded length filled
    assert used_len % bm == 0 and used_len <= L
    flat = ids.reshape(-1)
    live = s[:used_len][s[:used_len] != n_slots]
    # every live slot once, -1 slots never
    assert sorted(live.tolist()) == torch.nonzero(flat >= 0).reshape(-1).tolist()
    for b in range(used_len // bm):
        blk = s[b * bm:(b + 1) * bm]
        real = blk[blk != n_slots]
        assert (flat[real.long()] == e[b]).all()
        assert real.tolist() == sorted(real.tolist())  # stable inside the expert
    assert (e[used_len // bm:] == -1).all()
    assert (s[used_len:] == n_slots).all()


def test_reference_fused_matches_fp32_truth(reference):
    g = torch.Generator().manual_seed(0)
    M, K, I, E, top_k = 33, 64, 32, 5, 3
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(E, 2 * I, K, generator=g) / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) / I ** 0.5).bfloat16()
    ids = torch.randint(-1, E, (M, top_k), generator=g, dtype=torch.int32)
    wt = torch.rand(M, top_k, generator=g)
    s, e, n = reference.moe_align(ids, E)
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
    reference.fused_moe_bf16(x, w, w2, s, e, n, wt, out, top_k)
    out3 = torch.full((M, K), float("nan"), dtype=torch.bfloat16)  # gate and up rows as two tensors
    reference.fused_moe_bf16(x, w[:, :I].contiguous(), w2, s, e, n, wt, out3, top_k, w3=w[:, I:].contiguous())
    assert torch.equal(out3, out)
    truth = reference.moe_fp32(x, w, w2, ids, wt, dtype=torch.float64)
    err = ((out.double() - truth).norm() / truth.norm()).item()
    assert err < 1e-2
    base = torch.randn(M, K, generator=g).bfloat16()
    out2 = base.clone()
    reference.fused_moe_bf16(x, w, w2, s, e, n, wt, out2, top_k, split=False)
    assert ((out2.double() - base.double() - truth).norm() / truth.norm()).item() < 2e-2
    gm = reference.grouped_mm_path(x, w, w2, ids, wt)
    assert ((gm.double() - truth).norm() / truth.norm()).item() < 3e-2


def test_pack_scales_blocked_offsets(reference):
    g = torch.Generator().manual_seed(1)
    for R, S in [(1, 1), (130, 5), (256, 8), (129, 3)]:
        sc = torch.randint(0, 255, (R, S), generator=g, dtype=torch.int32).to(torch.uint8)
        p = reference.pack_scales_blocked(sc)
        Rp, Sp = (R + 127) // 128 * 128, (S + 3) // 4 * 4
        assert p.numel() == Rp * Sp
        expect = torch.zeros(Rp * Sp, dtype=torch.uint8)
        for r in range(R):
            for s in range(S):
                expect[reference.blocked_offset(r, s, S)] = sc[r, s]
        assert torch.equal(p, expect)
        e8m0 = reference.pack_scales_blocked(sc.view(torch.float8_e8m0fnu))
        assert e8m0.dtype == torch.float8_e8m0fnu and torch.equal(e8m0.view(torch.uint8), expect)


def test_quantize_mxfp8_bit_patterns(reference):
    # block 0: amax 448 -> t = 1.0 exactly -> byte 127; block 1: zeros -> byte 0;
    # block 2: amax 449 -> t > 1 with mantissa -> byte 128; block 3: inf -> 255
    y = torch.zeros(1, 128)
    y[0, 0] = 448.0
    y[0, 64] = 449.0
    y[0, 96] = float("inf")
    vals, sc = reference.quantize_mxfp8(y)
    assert sc.dtype == torch.float8_e8m0fnu
    assert sc.view(torch.uint8).tolist() == [[127, 0, 128, 255]]
    assert vals[0, 0].float().item() == 448.0
    assert vals[0, 64].float().item() == 224.0  # 449/2 -> rne to e4m3 224
    assert vals.dtype == torch.float8_e4m3fn
    # all ones: t = 1/448 has exponent -9 and a mantissa -> scale 2^-8, byte 119, every value 256
    v2, s2 = reference.quantize_mxfp8(torch.ones(1, 32))
    assert s2.view(torch.uint8).item() == 127 - 8
    assert v2.float().eq(256.0).all()
    # saturation: RCEIL scaling keeps a block's values <= 448, so only the e4m3 rule itself sees
    # larger ones (and infinities): they clamp to +-448, a value between two e4m3 numbers rounds
    # to nearest even
    sat = reference.e4m3_saturating(torch.tensor([449.0, 1e9, float("inf"), -500.0, -float("inf"), 17.0]))
    assert sat.float().tolist() == [448.0, 448.0, 448.0, -448.0, -448.0, 16.0]


@pytest.fixture(scope="module")
def pkg():
    return package_stub.load()


def test_unsupported_shape_reason(pkg):
    for dim, hidden in [(2048, 768), (4096, 1536), (7168, 2048), (2048, 1408), (5120, 1536), (2048, 512),
                        (2880, 2880)]:
        assert pkg.unsupported_shape_reason(dim, hidden) is None
        assert pkg.unsupported_shape_reason(dim, hidden, split=False) is None
        assert pkg.unsupported_shape_reason(dim, hidden, mxfp8=True) is None  # all multiples of 64
    assert "multiple of 8" in pkg.unsupported_shape_reason(2050, 768)
    assert "hidden_dim" in pkg.unsupported_shape_reason(2048, 770)
    assert "multiple of 64" in pkg.unsupported_shape_reason(2056, 768, mxfp8=True)
    assert "multiple of 64" in pkg.unsupported_shape_reason(2080, 768, mxfp8=True)  # 32 | 2080, 64 does not
    assert "hidden_dim" in pkg.unsupported_shape_reason(2048, 800, mxfp8=True)
    assert "hidden_dim" in pkg.unsupported_shape_reason(2048, 776, mxfp8=True)
    assert pkg.unsupported_shape_reason(2056, 776) is None  # bf16: multiples of 8 suffice
    assert pkg.BLOCK_M == 128 and pkg.MXFP8_SCALE_BLOCK == 32


def test_preferred_bpc(pkg):
    """CTA pairs where they measured faster: the bf16 op once experts average two blocks; never MXFP8."""
    shapes = [(8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (8192, 4096, 1536, 128, 8),
              (8192, 7168, 2048, 256, 8), (1024, 2048, 768, 128, 8)]
    assert [pkg.preferred_bpc(*s) for s in shapes] == [2, 2, 2, 2, 1]
    assert [pkg.preferred_bpc(*s, mxfp8=True) for s in shapes] == [1, 1, 1, 1, 1]
    assert pkg.preferred_bpc(255, 2048, 768, 1, 1) == 1 and pkg.preferred_bpc(256, 2048, 768, 1, 1) == 2
    # The backward (either forward format): the bf16 forward's rule (flash_moe/DESIGN.md §8.4), so
    # bpc 1 only with one block an expert (the backward's shape 5 and the last).
    backward = [(8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (32768, 4096, 1024, 64, 4),
                (8192, 4096, 1536, 128, 8), (1024, 2048, 768, 128, 8), (1024, 4096, 1536, 128, 8)]
    for mxfp8 in (False, True):
        assert [pkg.preferred_bpc(*s, mxfp8=mxfp8, backward=True) for s in backward] == [2, 2, 2, 2, 1, 1]


def test_default_bpc_reaches_each_op(pkg, monkeypatch):
    """bpc=None (every fused op's default) passes the op `preferred_bpc` of the call's shape
    (backward=True for dgrad and wgrad), read from the arguments as the binding reads them; an
    explicit bpc passes unchanged; a tensor of the wrong rank gets 1 and is left to the op's check."""
    seen = {}

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: seen.__setitem__(name, args)

    monkeypatch.setattr(pkg, "ops", Recorder())
    T, K, I, E, k = 8192, 4096, 1536, 128, 8  # the backward's shape 4: pairs everywhere

    def empty(*shape):  # shapes only: nothing runs
        return torch.empty(*shape, device="meta")

    x, g = empty(T, K), empty(T, K)
    w1, w, w2 = empty(E, I, K), empty(E, 2 * I, K), empty(E, K, I)
    L = T * k + E * pkg.BLOCK_M
    dab, sh = empty(L, 2 * I), empty(L, I)
    ids, blocks, ntpp, wt = empty(L), empty(L // pkg.BLOCK_M), empty(1), empty(T, k)
    calls = {
        "fused_moe_bf16": (lambda bpc: pkg.fused_moe_bf16(x, w, w2, ids, blocks, ntpp, wt, x, k, bpc=bpc), 13),
        "fused_moe_mxfp8": (lambda bpc: pkg.fused_moe_mxfp8(x, x, w, w, w2, w2, ids, blocks, ntpp, wt, x, k, bpc=bpc),
                            16),
        "fused_moe_bf16_dgrad": (lambda bpc: pkg.fused_moe_bf16_dgrad(g, w1, w1, w2, sh, ids, blocks, ntpp, wt, k,
                                                                      bpc=bpc), 10),
        "fused_moe_bf16_wgrad": (lambda bpc: pkg.fused_moe_bf16_wgrad(x, g, dab, sh, ids, blocks, ntpp, E, k, bpc=bpc),
                                 9),
    }
    want = {"fused_moe_bf16": 2, "fused_moe_mxfp8": 1, "fused_moe_bf16_dgrad": 2, "fused_moe_bf16_wgrad": 2}
    for name, (call, at) in calls.items():
        call(None)
        assert seen[name][at] == want[name], name
        call(3 - want[name])
        assert seen[name][at] == 3 - want[name], name
    pkg.fused_moe_bf16(x, w, w2, ids, blocks, ntpp, wt, x, k, w3=w1)  # w holds the gate rows alone
    assert seen["fused_moe_bf16"][13] == 2
    pkg.fused_moe_bf16_dgrad(g, w1[0], w1, w2, sh, ids, blocks, ntpp, wt, k)  # w1 2-D: the op refuses it
    assert seen["fused_moe_bf16_dgrad"][10] == 1
    pkg.fused_moe_bf16_wgrad(x, g, dab, sh[0], ids, blocks, ntpp, E, k)
    assert seen["fused_moe_bf16_wgrad"][9] == 1
    K2 = 2048  # dim 2048: pairs too (the rule reads the rows an expert, not the dim)
    pkg.fused_moe_bf16_dgrad(g[:, :K2], w1[..., :K2], w1[..., :K2], w2[:, :K2], sh, ids, blocks, ntpp, wt, k)
    assert seen["fused_moe_bf16_dgrad"][10] == 2
    pkg.fused_moe_bf16_wgrad(x[:, :K2], g[:, :K2], dab, sh, ids, blocks, ntpp, E, k)
    assert seen["fused_moe_bf16_wgrad"][9] == 2
    T2 = 2 * pkg.BLOCK_M * E // k - 1  # one slot short of two blocks an expert: 1 (the E each op reads)
    pkg.fused_moe_bf16_dgrad(g[:T2], w1, w1, w2, sh, ids, blocks, ntpp, wt[:T2], k)
    pkg.fused_moe_bf16_wgrad(x[:T2], g[:T2], dab, sh, ids, blocks, ntpp, E, k)
    assert seen["fused_moe_bf16_dgrad"][10] == seen["fused_moe_bf16_wgrad"][9] == 1
    pkg.fused_moe_bf16_dgrad(g[:T2 + 1], w1, w1, w2, sh, ids, blocks, ntpp, wt, k)
    pkg.fused_moe_bf16_wgrad(x[:T2 + 1], g[:T2 + 1], dab, sh, ids, blocks, ntpp, E, k)
    assert seen["fused_moe_bf16_dgrad"][10] == seen["fused_moe_bf16_wgrad"][9] == 2


def test_fake_kernels_shapes(pkg):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.empty(100, 8, dtype=torch.int32)
        s, e, n = pkg.ops.moe_align(ids, 64, 128, 1)
        L = (800 + 64 * 127 + 127) // 128 * 128
        assert s.shape == (L,) and e.shape == (L // 128,) and n.shape == (1,)
        x, sh = torch.empty(100, 256, dtype=torch.bfloat16), torch.empty(L, 192, dtype=torch.bfloat16)
        g1, g3, g2 = pkg.ops.fused_moe_bf16_wgrad(x, x, torch.empty(L, 384, dtype=torch.bfloat16), sh, s, e, n, 64, 8, 1)
        assert g1.shape == g3.shape == (64, 192, 256) and g2.shape == (64, 256, 192)


def test_fake_kernels_mxfp8_match_reference(pkg, reference):
    """The MXFP8 fake kernels give the shapes and dtypes the reference returns (torch.compile relies on them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape in [(1, 32), (3, 5, 96), (130, 2880)]:
        for blocked in (False, True):
            rv, rs = reference.quantize_mxfp8(torch.randn(shape), blocked=blocked)
            with FakeTensorMode():
                v, sc = pkg.ops.quantize_mxfp8(torch.empty(shape, dtype=torch.bfloat16), blocked)
                d = pkg.ops.dequantize_mxfp8(torch.empty(shape, dtype=torch.float8_e4m3fn),
                                             torch.empty(*shape[:-1], shape[-1] // 32, dtype=torch.float8_e8m0fnu))
            assert (v.shape, v.dtype, sc.shape, sc.dtype) == (rv.shape, rv.dtype, rs.shape, rs.dtype)
            assert d.shape == shape and d.dtype == torch.bfloat16


def test_build_toml_src_matches_sources():
    text = (MEMBER / "build.toml").read_text()
    kernel = text.split("[kernel.flash_moe]")[1]
    src = re.findall(r'"(flash_moe_cuda/[^"]+)"', kernel)
    on_disk = sorted(p.relative_to(MEMBER).as_posix() for p in (MEMBER / "flash_moe_cuda").iterdir()
                     if p.suffix in (".cu", ".cuh"))
    assert sorted(src) == on_disk
