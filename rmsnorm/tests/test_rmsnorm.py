"""rmsnorm tests: CPU (reference vs fp64 math, scale bit patterns, blocked layout, N=0) and GPU
(bit-exact kernel vs reference fed the kernel's rrms, backward vs fp64 autograd, bad inputs)."""

import math
import struct

import pytest
import torch

SHAPES_GPU = [(1, 32), (3, 96), (127, 160), (257, 2048), (129, 4096), (33, 7168), (65, 8192),
              (5, 32768), (200, 1056), (131, 224)]


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def scale_byte_fp64(amax: float) -> int:
    """Independent restatement of docs/DESIGN.md §6's RCEIL rule in Python floats."""
    if math.isnan(amax) or math.isinf(amax):
        return 255
    if amax == 0.0:
        return 0
    t = f32(f32(amax) * f32(1.0 / 448.0))
    if t == 0.0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", t))[0]
    byte = (bits >> 23) + (1 if bits & 0x7FFFFF else 0)
    return min(byte, 254)


def rand_inputs(N, C, device="cpu", seed=0, wide=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = torch.randn(N, C, generator=g)
    r = torch.randn(N, C, generator=g)
    if wide and N and C:
        # per-block exponents: large dynamic range inside a row
        e = torch.randint(-10, 11, (N, C // 32, 1), generator=g).float()
        b = (b.view(N, C // 32, 32) * torch.exp2(e)).view(N, C)
        e2 = torch.randint(-10, 11, (N, C // 32, 1), generator=g).float()
        r = (r.view(N, C // 32, 32) * torch.exp2(e2)).view(N, C)
    w = 1.0 + 0.5 * torch.randn(C, generator=g)
    return (b.bfloat16().to(device), r.bfloat16().to(device), w.bfloat16().to(device))


# ------------------------------------------------------------------------------------- CPU


def test_scale_bytes_hand_picked(reference):
    vals = [0.0, 448.0, 449.0, 447.0, 448.0 * 2**-20, 448.0 * 2**20, 1.0, 2.0**-149, 2.0**-126,
            1e-40, 3.0e38, 3.4028234663852886e38, float("nan"), float("inf"), float("-inf") * 0 + 1.0,
            448.0 * (1 + 2**-23), 448.0 * (1 - 2**-24)]
    amax = torch.tensor([abs(v) if not math.isnan(v) else v for v in vals], dtype=torch.float32)
    got = reference.rceil_scale_bytes(amax).tolist()
    want = [scale_byte_fp64(float(a)) for a in amax.tolist()]
    assert got == want
    # spot values written out by hand
    assert reference.rceil_scale_bytes(torch.tensor([448.0])).item() == 127  # t = 1 exactly
    assert reference.rceil_scale_bytes(torch.tensor([450.0])).item() == 128  # mantissa -> +1
    assert reference.rceil_scale_bytes(torch.tensor([0.0])).item() == 0
    assert reference.rceil_scale_bytes(torch.tensor([float("nan")])).item() == 255
    assert reference.rceil_scale_bytes(torch.tensor([float("inf")])).item() == 255
    assert reference.rceil_scale_bytes(torch.tensor([1e-40])).item() == 1  # subnormal t
    assert reference.rceil_scale_bytes(torch.tensor([3.0e38])).item() == 247


def test_scale_multiplier_exact(reference):
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    m = reference.scale_multiplier(b).to(torch.float64)
    want = torch.tensor([2.0 ** (127 - i) for i in range(256)], dtype=torch.float64)
    assert torch.equal(m, want)


def test_e4m3_satfinite(reference):
    x = torch.tensor([0.0, -0.0, 448.0, 464.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan"),
                      2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-6, 17.0, 18.0, 19.0])
    q = reference.e4m3_satfinite(x).view(torch.uint8).tolist()
    assert q[0] == 0x00 and q[1] == 0x80
    assert q[2] == q[3] == q[4] == q[6] == 0x7E and q[5] == q[7] == 0xFE
    assert q[8] == 0x7F
    assert q[9] == 0x01 and q[10] == 0x00 and q[11] == 0x01  # RNE at the subnormal ties
    assert q[12] == 0x08
    # 17 = 16 * 1.0625: tie between 16 and 18 -> even mantissa (16); 19 -> tie -> 20
    assert q[13] == 0x58 and q[14] == 0x59 and q[15] == 0x5A


def test_blocked_layout_offsets(reference):
    for R, S in [(1, 1), (130, 5), (256, 8), (7, 3), (129, 257)]:
        off = reference.blocked_offsets(R, S)
        for r in range(0, R, max(1, R // 17)):
            for s in range(0, S, max(1, S // 7)):
                want = ((r // 128) * ((S + 3) // 4) + s // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + s % 4
                assert off[r, s].item() == want
        assert len(set(off.reshape(-1).tolist())) == R * S  # a bijection into the buffer
        assert off.max().item() < reference.scales_numel(R, S)
        src = torch.randint(1, 256, (R, S), dtype=torch.int64).to(torch.uint8)
        packed = reference.pack_scales_blocked(src)
        assert packed.numel() == reference.scales_numel(R, S)
        assert torch.equal(packed[off.reshape(-1)], src.reshape(-1))
        assert int((packed == 0).sum()) == packed.numel() - R * S  # padding is zero


@pytest.mark.parametrize("N,C", [(5, 64), (33, 96), (3, 1024)])
def test_reference_forward_vs_fp64(reference, N, C):
    b, r, w = rand_inputs(N, C, seed=N * C)
    vals, scales, rrms = reference.fused_rmsnorm_residual(b, r, w, 1e-6)
    bd = b.double()
    rr64 = 1.0 / torch.sqrt((bd * bd).mean(-1) + 1e-6)
    torch.testing.assert_close(rrms.double(), rr64, rtol=1e-6, atol=0)
    y64 = bd * rr64[:, None] * w.double() + r.double()
    # dequantised values within half an e4m3 ulp (2^-4 relative) of the fp64 truth
    byte = scales.view(torch.uint8)[reference.blocked_offsets(N, C // 32)].long()
    deq = vals.float().double().view(N, C // 32, 32) * torch.exp2(byte.double() - 127)[..., None]
    err = (deq - y64.view(N, C // 32, 32)).abs()
    bound = y64.view(N, C // 32, 32).abs() * 2.0**-4 + torch.exp2(byte.double() - 127 - 9)[..., None]
    assert bool((err <= bound * 1.0001).all())
    # the block's largest |value| lands in (224, 448]: RCEIL never overflows, at most one binade low
    blockmax = vals.float().abs().view(N, C // 32, 32).amax(-1)
    assert bool((blockmax <= 448).all()) and bool((blockmax > 192).all())


def test_reference_nan_block_and_n0(reference):
    b, r, w = rand_inputs(4, 128, seed=3)
    r[1, 40] = float("nan")
    vals, scales, _ = reference.fused_rmsnorm_residual(b, r, w)
    off = reference.blocked_offsets(4, 4)
    sb = scales.view(torch.uint8)
    assert sb[off[1, 1]].item() == 255
    others = [sb[off[i, j]].item() for i in range(4) for j in range(4) if (i, j) != (1, 1)]
    assert 255 not in others
    v, s, rr = reference.fused_rmsnorm_residual(b[:0], r[:0], w)
    assert v.shape == (0, 128) and s.numel() == 0 and rr.numel() == 0


def test_reference_backward_vs_autograd(reference):
    b, r, w = rand_inputs(6, 256, seed=9, wide=False)
    bd, rd, wd = (t.double().requires_grad_() for t in (b, r, w))
    y = reference.y_reference(bd, rd, wd, 1e-6, dtype=torch.float64)
    g = torch.randn_like(y)
    gb, gr, gw = torch.autograd.grad(y, (bd, rd, wd), g)
    rr = 1.0 / torch.sqrt((b.double() ** 2).mean(-1) + 1e-6)
    gb2, gw2 = reference.fused_rmsnorm_residual_backward(g, b, w, rr, dtype=torch.float64)
    torch.testing.assert_close(gb2, gb, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw2, gw, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gr, g)


# ------------------------------------------------------------------------------------- GPU


def _check_forward(kernel, reference, b, r, w, eps=1e-6):
    N, C = b.shape
    vals, scales, rrms = kernel.fused_rmsnorm_residual(b, r, w, eps)
    assert vals.dtype == torch.float8_e4m3fn and vals.shape == (N, C)
    assert scales.dtype == torch.float8_e8m0fnu and scales.numel() == kernel.scales_numel(N, C)
    assert rrms.dtype == torch.float32 and rrms.shape == (N,)
    rv, rs, _ = reference.fused_rmsnorm_residual(b.cpu(), r.cpu(), w.cpu(), eps, rrms=rrms.cpu())
    qa, qb = vals.cpu().view(torch.uint8), rv.view(torch.uint8)
    mism = (qa != qb).nonzero()
    assert mism.numel() == 0, f"{mism.shape[0]} vals differ, first at {mism[:3].tolist()}"
    assert torch.equal(scales.cpu().view(torch.uint8), rs.view(torch.uint8))
    bd = b.double()
    rr64 = 1.0 / torch.sqrt((bd * bd).mean(-1) + eps)
    torch.testing.assert_close(rrms.double(), rr64, rtol=1e-6, atol=0)
    return vals, scales, rrms


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES_GPU)
def test_forward_bit_exact(kernel, reference, N, C):
    b, r, w = rand_inputs(N, C, "cuda", seed=torch.randint(0, 2**30, ()).item())
    _check_forward(kernel, reference, b, r, w)


@pytest.mark.gpu
def test_forward_scale_boundaries_and_specials(kernel, reference):
    N, C = 9, 512
    b, r, w = rand_inputs(N, C, "cuda", seed=5)
    b[3] = 0  # y == residual exactly on row 3: craft amax on and around 448 * 2^k
    for blk, v in enumerate([448.0, 450.0, 446.0, 448.0 * 2**-10, 2.0**-133, 0.0, 3.0e38, 448 * 2.0**7]):
        r[3, blk * 32:(blk + 1) * 32] = r[3, blk * 32:(blk + 1) * 32] * 1e-3
        r[3, blk * 32 + 5] = v
    r[3, 8 * 32:9 * 32] = 0
    r[5, 70] = float("nan")
    r[6, 130] = float("inf")
    b[7, 200] = float("-inf")  # makes the whole row's rrms 0 / NaN: only row 7 is affected
    vals, scales, rrms = kernel.fused_rmsnorm_residual(b, r, w)
    rv, rs, _ = reference.fused_rmsnorm_residual(b.cpu(), r.cpu(), w.cpu(), 1e-6, rrms=rrms.cpu())
    assert torch.equal(vals.cpu().view(torch.uint8), rv.view(torch.uint8))
    assert torch.equal(scales.cpu().view(torch.uint8), rs.view(torch.uint8))
    sb = scales.cpu().view(torch.uint8)[reference.blocked_offsets(N, C // 32)]
    assert sb[5, 2] == 255 and sb[6, 4] == 255
    # nothing else in rows 5 and 6 is 255, and other rows match a NaN-free run
    assert int((sb[5] == 255).sum()) == 1 and int((sb[6] == 255).sum()) == 1
    r2 = r.clone()
    r2[5, 70] = 0
    r2[6, 130] = 0
    v2, s2, _ = kernel.fused_rmsnorm_residual(b, r2, w)
    s2b = s2.cpu().view(torch.uint8)[reference.blocked_offsets(N, C // 32)]
    keep = torch.ones(N, C // 32, dtype=torch.bool)
    keep[5, 2] = keep[6, 4] = False
    assert torch.equal(sb[keep], s2b[keep])
    va, vb = vals.cpu().view(torch.uint8).view(N, C // 32, 32), v2.cpu().view(torch.uint8).view(N, C // 32, 32)
    assert torch.equal(va[keep], vb[keep])


@pytest.mark.gpu
def test_forward_poisoned_outputs_and_padding(kernel, reference):
    # Poison the caching allocator's blocks first so unwritten bytes would show up.
    for _ in range(3):
        junk = torch.full((1 << 22,), 0xFF, dtype=torch.uint8, device="cuda")
        del junk
    N, C = 130, 96  # row padding 130 -> 256, column padding S=3 -> 4
    b, r, w = rand_inputs(N, C, "cuda", seed=11)
    vals, scales, rrms = _check_forward(kernel, reference, b, r, w)
    sb = scales.cpu().view(torch.uint8)
    mask = torch.ones(sb.numel(), dtype=torch.bool)
    mask[reference.blocked_offsets(N, C // 32).reshape(-1)] = False
    assert int(sb[mask].ne(0).sum()) == 0


@pytest.mark.gpu
def test_forward_n0(kernel):
    b = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(256, dtype=torch.bfloat16, device="cuda")
    vals, scales, rrms = kernel.fused_rmsnorm_residual(b, b, w)
    assert vals.shape == (0, 256) and scales.numel() == 0 and rrms.shape == (0,)
    gb, gw = kernel.fused_rmsnorm_residual_backward(b, b, w, rrms)
    assert gb.shape == (0, 256) and torch.equal(gw.cpu(), torch.zeros(256, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", [(257, 2048), (33, 7168), (64, 8192), (3, 32768), (300, 96)])
def test_backward_vs_fp64_autograd(kernel, reference, N, C):
    b, r, w = rand_inputs(N, C, "cuda", seed=N + C, wide=False)
    g = torch.randn(N, C, device="cuda").bfloat16()
    _, _, rrms = kernel.fused_rmsnorm_residual(b, r, w)
    gb = torch.full_like(b, float("nan"))
    gb, gw = kernel.fused_rmsnorm_residual_backward(g, b, w, rrms)
    bd, rd, wd = (t.cpu().double().requires_grad_() for t in (b, r, w))
    y = reference.y_reference(bd, rd, wd, 1e-6, dtype=torch.float64)
    tb, tr, tw = torch.autograd.grad(y, (bd, rd, wd), g.cpu().double())
    err_b = (gb.cpu().double() - tb).abs()
    assert bool((err_b <= tb.abs() * 2.0**-8 + 2e-3 * tb.abs().max()).all()), float(err_b.max())
    err_w = (gw.cpu().double() - tw).abs()
    assert bool((err_w <= tw.abs() * 2.0**-8 + 2e-3 * tw.abs().max()).all()), float(err_w.max())
    # deterministic grad_weight
    _, gw2 = kernel.fused_rmsnorm_residual_backward(g, b, w, rrms)
    assert torch.equal(gw, gw2)


@pytest.mark.gpu
def test_autograd_through_grad_port(kernel, reference):
    N, C = 64, 1024
    b, r, w = rand_inputs(N, C, "cuda", seed=21, wide=False)
    b.requires_grad_()
    r.requires_grad_()
    w.requires_grad_()
    vals, scales, rrms, port = kernel.fused_rmsnorm_residual_with_grad_port(b, r, w)
    assert port.dtype == torch.bfloat16 and port.shape == (N, C)
    g = torch.randn(N, C, device="cuda").bfloat16()
    # a consumer hands d loss / d y to the port (bf16, not cast)
    (port.float() * g.float()).sum().backward()
    gb, gw = kernel.fused_rmsnorm_residual_backward(g, b.detach(), w.detach(), rrms)
    assert torch.equal(b.grad, gb) and torch.equal(w.grad, gw) and torch.equal(r.grad, g)
    # the fp8 output refuses gradients instead of silently quantising them
    vals2, _, _ = kernel.fused_rmsnorm_residual(b, r, w)
    with pytest.raises(RuntimeError, match="y_port|grad_port"):
        vals2.float().sum().backward()


@pytest.mark.gpu
def test_opcheck(kernel):
    from torch.library import opcheck

    N, C = 40, 256
    b, r, w = rand_inputs(N, C, "cuda", seed=2, wide=False)
    _, _, rrms = kernel.fused_rmsnorm_residual(b, r, w)
    g = torch.randn(N, C, device="cuda").bfloat16()
    opcheck(kernel.ops.fused_rmsnorm_residual.default, (b, r, w, 1e-6))
    opcheck(kernel.ops.fused_rmsnorm_residual_backward.default, (g, b, w, rrms))
    opcheck(kernel.ops.fused_rmsnorm_residual_grad_port.default,
            (b.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(), rrms))


def _bad_inputs():
    C = 256
    ok = dict(branch=torch.randn(4, C).bfloat16(), residual=torch.randn(4, C).bfloat16(),
              weight=torch.ones(C).bfloat16())
    cases = []
    cases.append(("branch", dict(ok, branch=ok["branch"].float()), "bfloat16"))
    cases.append(("residual", dict(ok, residual=ok["residual"].half()), "bfloat16"))
    cases.append(("weight", dict(ok, weight=ok["weight"].float()), "bfloat16"))
    cases.append(("branch", dict(ok, branch=ok["branch"][None], residual=ok["residual"][None]), "rank"))
    cases.append(("branch", dict(ok, branch=ok["branch"][:, :100], residual=ok["residual"][:, :100].contiguous()), "multiple of 32|contiguous"))
    cases.append(("branch", dict(ok, branch=torch.randn(4, 96).bfloat16(), residual=torch.randn(4, 96).bfloat16()), "weight"))
    cases.append(("weight", dict(ok, weight=torch.ones(C - 32).bfloat16()), "C=256"))
    cases.append(("residual", dict(ok, residual=torch.randn(5, C).bfloat16()), "shape"))
    cases.append(("branch", dict(ok, branch=torch.randn(C, 4).bfloat16().t(), residual=torch.randn(4, C).bfloat16()), "contiguous|multiple of 32"))
    cases.append(("residual", dict(ok, residual=torch.randn(C, 4).bfloat16().t()), "contiguous"))
    cases.append(("branch", dict(ok, branch=torch.randn(4, 32800).bfloat16(), residual=torch.randn(4, 32800).bfloat16(), weight=torch.ones(32800).bfloat16()), "32768"))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_bad_inputs_forward(kernel, case):
    name, kw, rule = _bad_inputs()[case]
    kw = {k: v.cuda() for k, v in kw.items()}
    with pytest.raises(RuntimeError) as ei:
        kernel.fused_rmsnorm_residual(kw["branch"], kw["residual"], kw["weight"])
    msg = str(ei.value)
    assert name in msg or "weight" in msg, msg
    import re

    assert re.search(rule, msg), msg


@pytest.mark.gpu
def test_bad_inputs_device_and_backward(kernel):
    C = 128
    b = torch.randn(4, C, device="cuda").bfloat16()
    w = torch.ones(C, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="residual"):
        kernel.fused_rmsnorm_residual(b, b.cpu(), w)
    with pytest.raises(RuntimeError, match="weight"):
        kernel.fused_rmsnorm_residual(b, b, w.cpu())
    rr = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="rrms"):
        kernel.fused_rmsnorm_residual_backward(b, b, w, rr.double())
    with pytest.raises(RuntimeError, match="rrms"):
        kernel.fused_rmsnorm_residual_backward(b, b, w, rr[:3])
    with pytest.raises(RuntimeError, match="grad_y"):
        kernel.fused_rmsnorm_residual_backward(b.float(), b, w, rr)
    with pytest.raises(RuntimeError, match="grad_y"):
        kernel.fused_rmsnorm_residual_backward(b[:3], b, w, rr)
    with pytest.raises(RuntimeError, match="rrms"):
        kernel.fused_rmsnorm_residual_backward(b, b, w, rr.cpu())
