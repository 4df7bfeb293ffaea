"""CPU tests of the MXFP8 references: dequantization, the blocked-layout inverse and the
fused_moe_mxfp8 reference (docs/DESIGN.md §5, §6). No GPU needed."""

import math

import pytest
import torch
from error_measure import rel_err


def _e4m3_value(p: int) -> float:
    """Decode an e4m3fn bit pattern by hand (independent of torch's conversion)."""
    sign = -1.0 if p & 0x80 else 1.0
    exp, man = (p >> 3) & 0xF, p & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


BYTES = [0, 1, 2, 3, 60, 119, 127, 128, 200, 253, 254, 255]


def test_dequantize_every_bit_pattern(reference):
    # one row per scale byte, all 256 e4m3 patterns in each row (8 blocks of 32)
    pats = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = pats.repeat(len(BYTES), 1).view(torch.float8_e4m3fn)
    scales = torch.tensor(BYTES, dtype=torch.uint8)[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    got = reference.dequantize_mxfp8(vals, scales)
    assert got.dtype == torch.float32 and got.shape == vals.shape
    exact = torch.tensor([[_e4m3_value(p) * 2.0 ** (b - 127) if b != 255 else math.nan for p in range(256)]
                          for b in BYTES], dtype=torch.float64)
    # every product is exact in fp32 except overflow past its range (byte 254 with |q| >= 2)
    torch.testing.assert_close(got, exact.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[BYTES.index(255)]).all()  # byte 255 poisons the block, zeros included
    assert got[BYTES.index(0), 1].item() == 2.0 ** -9 * 2.0 ** -127  # smallest: a subnormal fp32
    # uint8 scale bytes are accepted as well
    torch.testing.assert_close(reference.dequantize_mxfp8(vals, scales.view(torch.uint8)), got, rtol=0, atol=0,
                               equal_nan=True)
    # bf16: one rounding of the fp32 result; exact for bytes 3..200 (bf16 keeps fp32's exponent range
    # down to 2^-133 and e4m3's 3 mantissa bits fit in bf16's 7)
    bf = reference.dequantize_mxfp8(vals, scales, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf, got.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    for i, b in enumerate(BYTES):
        if 3 <= b <= 200:
            torch.testing.assert_close(bf[i].float(), got[i], rtol=0, atol=0, equal_nan=True)


def test_dequantize_shapes_and_errors(reference):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 64, generator=g)
    v, s = reference.quantize_mxfp8(y)
    assert s.shape == (2, 3, 2)
    d = reference.dequantize_mxfp8(v, s)
    assert d.shape == (2, 3, 64)
    assert torch.equal(d.reshape(6, 64), reference.dequantize_mxfp8(v.reshape(6, 64), s.reshape(6, 2)))
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.dequantize_mxfp8(v[..., :48], s)
    with pytest.raises(ValueError, match="scales must have shape"):
        reference.dequantize_mxfp8(v, s[..., :1])


def _spread(R, K, seed):
    """Random rows spanning a wide exponent range, with zero, 448-edge, tiny and non-finite blocks."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, K, generator=g) * torch.exp2(torch.randint(-100, 100, (R, 1), generator=g).float())
    y[0, :32] = 0.0
    y[1, :32] = 448.0 * 2.0 ** 10  # t exactly 2^10: byte 137, values 448
    y[1, 32:64] = torch.nextafter(torch.tensor(448.0 * 2.0 ** -20), torch.tensor(1.0))  # just above the edge
    y[2, :32] = 1e-40
    y[3, 5] = float("nan")
    y[3, 40] = float("-inf")
    return y


def test_quantize_dequantize_round_trip(reference):
    R, K = 67, 160
    y = _spread(R, K, 1)
    v, s = reference.quantize_mxfp8(y)
    d = reference.dequantize_mxfp8(v, s)
    bad = s.view(torch.uint8) == 255
    assert bad[3, 0] and bad[3, 1] and bad.sum() == 2
    assert torch.isnan(d.view(R, K // 32, 32)[bad]).all()
    assert torch.isfinite(d.view(R, K // 32, 32)[~bad]).all()
    # the dequantized values are a fixed point of quantize -> dequantize
    v2, s2 = reference.quantize_mxfp8(d)
    d2 = reference.dequantize_mxfp8(v2, s2)
    torch.testing.assert_close(d2, d, rtol=0, atol=0, equal_nan=True)
    # and the bytes are reproduced, except for blocks whose largest |q| rounded to 224 (their amax is
    # then a power of two times 448/2, so RCEIL picks the next byte down, with the same values)
    qmax = v.float().abs().view(R, K // 32, 32).amax(-1)
    keep = (qmax > 224) & ~bad
    assert keep.float().mean() > 0.8
    assert torch.equal(s2.view(torch.uint8)[keep], s.view(torch.uint8)[keep])
    assert torch.equal(v2.view(torch.uint8).view(R, K // 32, 32)[keep], v.view(torch.uint8).view(R, K // 32, 32)[keep])
    # the error of quantization is within e4m3's half-ulp (2^-4 relative) of the block's scale
    fin = ~bad
    err = (d - y).abs().view(R, K // 32, 32)[fin]
    step = reference._e8m0_to_float(s)[fin][:, None] * 2.0 ** -6  # half the subnormal spacing 2^-9 * 2^3
    big = y.abs().view(R, K // 32, 32)[fin] * 2.0 ** -4
    assert (err <= torch.maximum(step, big)).all()


@pytest.mark.parametrize("R,S", [(1, 1), (129, 3), (257, 5), (130, 7), (128, 4), (300, 1), (5, 9)])
def test_unpack_inverts_pack(reference, R, S):
    g = torch.Generator().manual_seed(R * 31 + S)
    sc = torch.randint(0, 256, (R, S), generator=g, dtype=torch.int32).to(torch.uint8)
    flat = reference.pack_scales_blocked(sc)
    back = reference.unpack_scales_blocked(flat, R, S)
    assert back.dtype == torch.uint8 and back.shape == (R, S) and torch.equal(back, sc)
    e = reference.unpack_scales_blocked(reference.pack_scales_blocked(sc.view(torch.float8_e8m0fnu)), R, S)
    assert e.dtype == torch.float8_e8m0fnu and torch.equal(e.view(torch.uint8), sc)
    # the padding bytes carry nothing: garbage there does not change the result
    Rp, Sp = (R + 127) // 128 * 128, (S + 3) // 4 * 4
    pad = torch.ones(Rp, Sp, dtype=torch.bool)
    pad[:R, :S] = False
    pad_flat = reference.pack_scales_blocked(pad.to(torch.uint8)).bool()
    dirty = torch.where(pad_flat, torch.full_like(flat, 77), flat)
    if pad_flat.any():
        assert not torch.equal(dirty, flat)
    assert torch.equal(reference.unpack_scales_blocked(dirty, R, S), sc)
    with pytest.raises(ValueError, match="packs to"):
        reference.unpack_scales_blocked(flat[:-1] if flat.numel() > 1 else torch.zeros(3, dtype=torch.uint8), R, S)


def test_unpack_3d_weights(reference):
    g = torch.Generator().manual_seed(2)
    E, I, K = 3, 48, 160
    for t in [torch.randn(E, 2 * I, K, generator=g), torch.randn(E, K, I * 2, generator=g)]:
        v_rm, s_rm = reference.quantize_mxfp8(t)
        v_bl, s_bl = reference.quantize_mxfp8(t, blocked=True)
        assert torch.equal(v_rm.view(torch.uint8), v_bl.view(torch.uint8))
        R, S = t.shape[1], t.shape[2] // 32
        assert s_rm.shape == (E, R, S)
        # each expert's (R, S) matrix packed on its own
        assert s_bl.dim() == 1 and s_bl.numel() == E * ((R + 127) // 128 * 128) * ((S + 3) // 4 * 4)
        back = reference.unpack_scales_blocked(s_bl, E, R, S)
        assert torch.equal(back.view(torch.uint8), s_rm.view(torch.uint8))


@pytest.mark.parametrize("shape", [(3, 96, 5), (2, 128, 4), (4, 192, 24), (2, 3, 64, 2), (1, 130, 7)])
def test_pack_3d_is_per_expert_packing(reference, shape):
    """(..., R, S) scales pack each leading index on its own, concatenated: what prime-rl passes
    (torchao's to_mx of (E, 2I, K) weights gives (E, 2I, K/32) scales) and fused_moe_mxfp8 reads."""
    g = torch.Generator().manual_seed(sum(shape))
    sc = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    mats = sc.reshape(-1, *shape[-2:])
    want = torch.cat([reference.pack_scales_blocked(m) for m in mats])
    got = reference.pack_scales_blocked(sc)
    assert torch.equal(got, want)
    e8 = reference.pack_scales_blocked(sc.view(torch.float8_e8m0fnu))
    assert e8.dtype == torch.float8_e8m0fnu and torch.equal(e8.view(torch.uint8), want)
    # per-expert packing differs from packing the (E*R, S) flattening exactly when R % 128 != 0
    flat = reference.pack_scales_blocked(sc.reshape(-1, shape[-1]))
    R = shape[-2]
    assert (flat.numel() == got.numel() and torch.equal(flat, got)) == (R % 128 == 0 or mats.shape[0] == 1)
    assert torch.equal(reference.unpack_scales_blocked(got, *shape), sc)
    with pytest.raises(ValueError, match=r"must be \(\.\.\., R, S\)"):
        reference.pack_scales_blocked(sc.reshape(-1)[:5])


# ---------------------------------------------------------------- fused_moe_mxfp8 reference

def _mx_inputs(reference, M, K, I, E, top_k, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, 2 * I, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, I, generator=g) / I ** 0.5
    ids = torch.rand(M, E, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    if drop:
        ids = torch.where(torch.rand(M, top_k, generator=g) < drop, torch.full_like(ids, -1), ids)
    wt = torch.rand(M, top_k, generator=g)
    xq, xs = reference.quantize_mxfp8(x)
    wq, ws = reference.quantize_mxfp8(w, blocked=True)
    w2q, w2s = reference.quantize_mxfp8(w2, blocked=True)
    return dict(x=x, w=w, w2=w2, ids=ids, wt=wt, xq=xq, xs=xs, wq=wq, ws=ws, w2q=w2q, w2s=w2s)


def _deq(reference, d, dtype=torch.float32):
    """Dequantized x, w, w2 (row-major scales recovered from the blocked ones)."""
    E, N, K = d["wq"].shape
    I = N // 2
    ws = reference.unpack_scales_blocked(d["ws"], E, N, K // 32)
    w2s = reference.unpack_scales_blocked(d["w2s"], E, K, I // 32)
    return (reference.dequantize_mxfp8(d["xq"], d["xs"], dtype), reference.dequantize_mxfp8(d["wq"], ws, dtype),
            reference.dequantize_mxfp8(d["w2q"], w2s, dtype))


def _mx_run(reference, d, out=None, split=True):
    M, K = d["xq"].shape
    E = d["wq"].shape[0]
    s, e, n = reference.moe_align(d["ids"], E)
    if out is None:
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
    return reference.fused_moe_mxfp8(d["xq"], d["xs"], d["wq"], d["ws"], d["w2q"], d["w2s"], s, e, n, d["wt"], out,
                                     d["ids"].shape[1], split=split)


@pytest.mark.parametrize("M,K,I,E,top_k,drop", [(1, 64, 32, 2, 1, 0.0), (45, 96, 64, 6, 3, 0.2),
                                                (130, 160, 96, 4, 2, 0.0)])
def test_fused_mxfp8_reference(reference, M, K, I, E, top_k, drop):
    d = _mx_inputs(reference, M, K, I, E, top_k, seed=M + K, drop=drop)
    out = _mx_run(reference, d)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    xd, wd, w2d = _deq(reference, d)
    # the dequantized inputs are exact in bf16, so the mxfp8 reference must be the bf16 reference on
    # them, bit for bit (same shared code path, same fp32 operands)
    xb, wb, w2b = _deq(reference, d, torch.bfloat16)
    assert torch.equal(xb.float(), xd) and torch.equal(wb.float(), wd) and torch.equal(w2b.float(), w2d)
    s, e, n = reference.moe_align(d["ids"], E)
    bf = torch.full_like(out, float("nan"))
    reference.fused_moe_bf16(xb, wb, w2b, s, e, n, d["wt"], bf, top_k)
    assert torch.equal(out, bf)
    # against the exact fp64 MoE of the dequantized inputs: only the bf16 roundings of h, the slot rows
    # and out remain (each <= 2^-9 relative)
    exact_dq = reference.moe_fp32(xd, wd, w2d, d["ids"], d["wt"], dtype=torch.float64)
    assert rel_err(out, exact_dq) < 6e-3
    # against truth on the original inputs: the quantization floor dominates, and the reference sits
    # within the 1.5x-of-floor bound the GPU kernel is held to
    truth = reference.moe_fp32(d["x"], d["w"], d["w2"], d["ids"], d["wt"], dtype=torch.float64)
    floor = rel_err(exact_dq, truth)
    assert 5e-3 < floor < 0.1
    assert rel_err(out, truth) <= 1.5 * floor


def test_fused_mxfp8_reference_split_false(reference):
    d = _mx_inputs(reference, 50, 96, 64, 4, 2, seed=7, drop=0.1)
    g = torch.Generator().manual_seed(8)
    base = torch.randn(50, 96, generator=g).bfloat16()
    added = _mx_run(reference, d, out=base.clone(), split=False)
    alone = _mx_run(reference, d)
    assert not torch.equal(added, alone)
    assert rel_err(added.float() - base.float(), alone) < 1e-2
    # bit for bit what the bf16 reference does with the (bf16-exact) dequantized inputs
    xb, wb, w2b = _deq(reference, d, torch.bfloat16)
    s, e, n = reference.moe_align(d["ids"], 4)
    bf = reference.fused_moe_bf16(xb, wb, w2b, s, e, n, d["wt"], base.clone(), 2, split=False)
    assert torch.equal(added, bf)
    over = _mx_run(reference, d, out=base.clone(), split=True)
    assert torch.equal(over, alone)


def test_fused_mxfp8_reference_nan_scale_poisons_one_row(reference):
    M, K, I, E, top_k = 40, 128, 64, 4, 2
    d = _mx_inputs(reference, M, K, I, E, top_k, seed=3)
    d["ids"][9] = -1  # token 9 is routed nowhere: its x is never read
    clean = _mx_run(reference, d)
    xs = d["xs"].view(torch.uint8).clone()
    xs[17, 2] = 255  # one block of token 17
    xs[9, 0] = 255
    d["xs"] = xs.view(torch.float8_e8m0fnu)
    out = _mx_run(reference, d)
    nan_rows = torch.isnan(out).any(1)
    assert nan_rows.tolist() == [t == 17 for t in range(M)]
    assert torch.isnan(out[17]).all()  # every column: the NaN enters through the GEMMs
    keep = torch.arange(M) != 17
    assert torch.equal(out[keep], clean[keep])
    assert torch.equal(out[9], torch.zeros(K, dtype=torch.bfloat16))


def test_fused_mxfp8_reference_rejects_bad_scales(reference):
    d = _mx_inputs(reference, 8, 64, 32, 2, 1, seed=4)
    s, e, n = reference.moe_align(d["ids"], 2)
    out = torch.empty(8, 64, dtype=torch.bfloat16)
    args = [d["xq"], d["xs"], d["wq"], d["ws"], d["w2q"], d["w2s"], s, e, n, d["wt"], out, 1]
    bad = list(args)
    bad[1] = d["xs"][:, :1]
    with pytest.raises(ValueError, match="x_scales"):
        reference.fused_moe_mxfp8(*bad)
    bad = list(args)
    bad[3] = d["ws"][:-4]
    with pytest.raises(ValueError, match="packs to"):
        reference.fused_moe_mxfp8(*bad)


def test_quantize_matches_torchaos_rceil_rule_on_bf16(reference):
    """prime-rl quantizes bf16 tensors with torchao's to_mx RCEIL rule (amax / 448, ceil of log2);
    our rule (amax * fp32(1/448), the exponent bits) gives the same bytes on bf16 inputs: random
    blocks over 2^-30..2^30 and every bf16 amax in [448 * 2^-20, 448 * 2^20) in its own block."""
    from prime_rl_peer import to_mx_rceil

    g = torch.Generator().manual_seed(0)
    t = (torch.randn(2048, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (2048, 1), generator=g).float()))
    amax = torch.tensor([448.0 * 2.0 ** k * (1 + m / 128) for k in range(-20, 20) for m in range(128)])
    edge = torch.zeros(amax.numel(), 32)
    edge[:, 0], edge[:, 1] = amax, 0.5
    for y in (t.bfloat16(), edge.bfloat16()):
        vals, scales = reference.quantize_mxfp8(y)
        torch_scales, torch_vals = to_mx_rceil(y, 32)
        assert torch.equal(scales.view(torch.uint8), torch_scales.view(torch.uint8))
        assert torch.equal(vals.view(torch.uint8), torch_vals.view(torch.uint8))
