"""GPU tests of quantize_mxfp8, dequantize_mxfp8 and fused_moe_mxfp8 against the
pure-PyTorch references and fp32 truth on the original (unquantized) inputs."""

import math

import pytest
import torch
from cuda_graph_check import assert_graph_replays_eager
from error_measure import rel_err

pytestmark = pytest.mark.gpu


def _bytes(t):
    return t.view(torch.uint8)


def _e8m0(t):
    # e8m0 tensors are reshaped / copied as their uint8 bytes: few kernels are implemented for the dtype
    return t.view(torch.float8_e8m0fnu)


def _op_call(op, *positional, **named):
    """(args, kwargs) for a raw op: the leading arguments positionally, the rest of its schema by name
    (only the names the schema has; a required one missing fails with the schema in the message)."""
    schema = op.default._schema
    kwargs = {}
    for a in schema.arguments[len(positional):]:
        if a.name in named:
            kwargs[a.name] = named[a.name]
        elif not a.has_default_value():
            raise KeyError(f"no test value for argument {a.name!r} of {schema}")
    return positional, kwargs


# ---------------------------------------------------------------- quantize_mxfp8

def _step(v: torch.Tensor, n: int) -> torch.Tensor:
    """v moved by n units in the last place of its own dtype (bit-pattern arithmetic, v > 0)."""
    it = torch.int16 if v.dtype == torch.bfloat16 else torch.int32
    return (v.view(it) + n).view(v.dtype)


def _quant_input(shape, dtype, seed):
    """Random values over a wide exponent range plus the blocks that stress RCEIL and the e4m3 rounding:
    zero, NaN, +-Inf, near the top and bottom of the range, exactly 448*2^k and one ulp either side,
    e4m3 rounding ties after scaling."""
    K = shape[-1]
    R = math.prod(shape[:-1])
    nb = K // 32
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(R, K, generator=g, device="cuda")
    y *= torch.exp2(torch.randint(-60, 61, (R, 1), generator=g, device="cuda").float())
    y = y.to(dtype)
    blocks = y.view(R * nb, 32)
    ones = torch.ones(32, device="cuda", dtype=dtype)
    specials = []
    specials.append(torch.zeros(32, device="cuda", dtype=dtype))
    b = torch.randn(32, generator=g, device="cuda").to(dtype)
    b[7] = float("nan")  # positive NaN (the e4m3 NaN pattern of a negative NaN is not pinned down)
    specials.append(b)
    b = torch.randn(32, generator=g, device="cuda").to(dtype)
    b[0], b[31] = float("inf"), float("-inf")
    specials.append(b)
    specials.append((torch.rand(32, generator=g, device="cuda") * 3.3e38).to(dtype))  # near the top of the range
    specials.append((torch.randn(32, generator=g, device="cuda") * 1e-38).to(dtype))  # normal/subnormal edge
    specials.append((torch.randn(32, generator=g, device="cuda") * 1e-40).to(dtype))  # subnormal amax
    for k in (-100, -20, -3, 0, 5, 37, 100):
        edge = torch.tensor(448.0 * 2.0 ** k, device="cuda", dtype=dtype)
        for n in (-1, 0, 1):
            b = (torch.rand(32, generator=g, device="cuda") * 400.0 * 2.0 ** k).to(dtype)
            b[n + 5] = _step(edge, n)
            b[20] = -_step(edge, n)  # the same magnitude negative: amax is |y|
            specials.append(b)
    # e4m3 ties once scaled by 2^(127-byte) with byte 127 (amax 448): 1 + 1/16 sits between 1 and 1.125,
    # 2^-10 between 0 and the smallest subnormal 2^-9, 3*2^-10 between 2^-9 and 2^-8, 464 between 448 and 480
    b = torch.tensor([448.0, 1.0625, -1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10), 13.0, 13.5, 27.0]
                     + [0.0] * 22, device="cuda").to(dtype)
    specials.append(b)
    specials.append((torch.tensor([464.0 * 2.0 ** -40] + [1.0 * 2.0 ** -40] * 31, device="cuda")).to(dtype))
    specials.append(ones * 3)
    for i, s in enumerate(specials):
        blocks[(i * 7919) % (R * nb)] = s  # spread over rows and columns; small inputs keep the last ones
    return y.view(shape)


QSHAPES = [(1, 32), (1, 4096), (129, 160), (1000, 2048), (3, 5, 96), (300, 2880)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", QSHAPES)
@pytest.mark.parametrize("blocked", [False, True])
def test_quantize_bit_exact(kernel, reference, dtype, shape, blocked):
    y = _quant_input(shape, dtype, seed=sum(shape) + (dtype == torch.float32) * 1000)
    vals, scales = kernel.quantize_mxfp8(y, blocked=blocked)
    want_v, want_s = reference.quantize_mxfp8(y.cpu(), blocked=blocked)
    assert vals.is_cuda and scales.is_cuda
    assert vals.dtype == torch.float8_e4m3fn and vals.shape == y.shape
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == want_s.shape
    assert torch.equal(_bytes(scales).cpu(), _bytes(want_s))
    assert torch.equal(_bytes(vals).cpu(), _bytes(want_v))
    # the inputs really hit the special cases (so a pass means something)
    rm = _bytes(reference.quantize_mxfp8(y.cpu())[1]).reshape(-1)
    if rm.numel() >= 40:
        assert (rm == 0).any() and (rm == 255).any() and (rm >= 240).any() and (rm == 1).any()


def test_quantize_raw_op_matches_public(kernel):
    y = _quant_input((257, 512), torch.bfloat16, seed=3)
    for blocked in (False, True):
        args, kwargs = _op_call(kernel.ops.quantize_mxfp8, y, blocked=blocked)
        v, s = kernel.ops.quantize_mxfp8(*args, **kwargs)
        pv, ps = kernel.quantize_mxfp8(y, blocked=blocked)
        assert torch.equal(_bytes(v), _bytes(pv)) and torch.equal(_bytes(s).reshape(-1), _bytes(ps).reshape(-1))


def test_quantize_bad_inputs(kernel):
    with pytest.raises(RuntimeError, match="quantize_mxfp8"):
        kernel.quantize_mxfp8(torch.randn(4, 48, device="cuda"))
    with pytest.raises(RuntimeError, match="quantize_mxfp8"):
        kernel.quantize_mxfp8(torch.randint(0, 5, (4, 64), device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()


# ---------------------------------------------------------------- dequantize_mxfp8

@pytest.mark.parametrize("shape", [(1, 32), (130, 256), (2, 3, 2880)])
def test_dequantize_matches_reference(kernel, reference, shape):
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    K = shape[-1]
    vals = torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    # scale bytes 3..246, where the op promises exact bf16 products (below: bf16 subnormals, above:
    # overflow, both left to bf16 rounding), and 255 (NaN block)
    byte = torch.randint(3, 247, (*shape[:-1], K // 32), generator=g, device="cuda", dtype=torch.int32)
    nan = torch.rand(byte.shape, generator=g, device="cuda") < 0.1
    byte = torch.where(nan, torch.full_like(byte, 255), byte).to(torch.uint8)
    vals, scales = vals.view(torch.float8_e4m3fn), byte.view(torch.float8_e8m0fnu)
    got = kernel.dequantize_mxfp8(vals, scales)
    want = reference.dequantize_mxfp8(vals.cpu(), scales.cpu(), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == vals.shape
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    nan_blocks = byte == 255
    if nan_blocks.any():
        assert torch.isnan(got.view(*shape[:-1], K // 32, 32)[nan_blocks]).all()


def test_dequantize_round_trip(kernel, reference):
    y = torch.randn(333, 1024, device="cuda") * 10
    v, s = kernel.quantize_mxfp8(y)
    d = kernel.dequantize_mxfp8(v, s)
    want = reference.dequantize_mxfp8(v.cpu(), s.cpu(), torch.bfloat16)
    assert torch.equal(d.cpu(), want)
    assert rel_err(d, y) < 0.05  # e4m3: 3 mantissa bits


# ---------------------------------------------------------------- fused_moe_mxfp8 accuracy

def _inputs(kernel, M, K, I, E, top_k, seed=0, drop=0.0, one_expert=None, src=torch.bfloat16):
    """Random originals in `src`, their MXFP8 quantization, routing."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").to(src)
    w = (torch.randn(E, 2 * I, K, generator=g, device="cuda") / K ** 0.5).to(src)
    w2 = (torch.randn(E, K, I, generator=g, device="cuda") / I ** 0.5).to(src)
    ids = torch.rand(M, E, generator=g, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    if one_expert is not None:
        ids = torch.full((M, top_k), one_expert, dtype=torch.int32, device="cuda")
    if drop > 0:
        ids = torch.where(torch.rand(M, top_k, generator=g, device="cuda") < drop, torch.full_like(ids, -1), ids)
    wt = torch.rand(M, top_k, generator=g, device="cuda")
    xq, xs = kernel.quantize_mxfp8(x)
    wq, ws = kernel.quantize_mxfp8(w, blocked=True)
    w2q, w2s = kernel.quantize_mxfp8(w2, blocked=True)
    return dict(x=x, w=w, w2=w2, ids=ids.contiguous(), wt=wt.contiguous(), q=(xq, xs, wq, ws, w2q, w2s))


def _dequantized(reference, q):
    """fp32 x, w, w2 exactly as the op must read them (row-major scales recovered from the blocked ones)."""
    xq, xs, wq, ws, w2q, w2s = q
    E, N, K = wq.shape
    I = N // 2
    wsr = reference.unpack_scales_blocked(ws, E, N, K // 32)
    w2sr = reference.unpack_scales_blocked(w2s, E, K, I // 32)
    return (reference.dequantize_mxfp8(xq, xs), reference.dequantize_mxfp8(wq, wsr),
            reference.dequantize_mxfp8(w2q, w2sr))


def _run(kernel, d, out=None, split=True, **tuning):
    xq = d["q"][0]
    s, e, n = kernel.moe_align(d["ids"], d["q"][2].shape[0])
    if out is None:
        out = torch.full((xq.shape[0], xq.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    kernel.fused_moe_mxfp8(*d["q"], s, e, n, d["wt"], out, d["ids"].shape[1], split=split, **tuning)
    return out


def _ref_run(kernel, reference, d, out=None, split=True):
    xq = d["q"][0]
    s, e, n = kernel.moe_align(d["ids"], d["q"][2].shape[0])
    if out is None:
        out = torch.full((xq.shape[0], xq.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    return reference.fused_moe_mxfp8(*d["q"], s, e, n, d["wt"], out, d["ids"].shape[1], split=split)


CASES = [
    # M, K, I, E, top_k, drop, one_expert, originals
    (1, 256, 128, 4, 1, 0.0, None, torch.bfloat16),     # M = 1, top_k = 1
    (1, 2048, 768, 64, 8, 0.0, None, torch.float32),    # M = 1, most experts empty
    (200, 512, 256, 8, 1, 0.0, None, torch.float32),    # top_k = 1
    (300, 1024, 512, 16, 4, 0.2, None, torch.bfloat16),  # -1 ids
    (257, 512, 384, 8, 2, 0.0, 5, torch.bfloat16),      # all tokens on one expert, others empty
    (3, 512, 256, 64, 2, 0.0, None, torch.float32),     # nearly every expert empty
    (512, 2048, 768, 256, 8, 0.0, None, torch.bfloat16),  # E = 256
    (96, 2048, 768, 8, 2, 0.0, None, torch.float32),
    (96, 2880, 2880, 8, 2, 0.0, None, torch.bfloat16),  # K, I multiples of 64 but not of 128
    (64, 4096, 1536, 32, 8, 0.0, None, torch.bfloat16),  # a real shape, small M
    (96, 7168, 2048, 8, 2, 0.1, None, torch.bfloat16),
    (64, 320, 192, 4, 2, 0.0, None, torch.float32),    # K = 5 and I = 3 k-blocks (odd), partial scale groups
]


@pytest.mark.parametrize("M,K,I,E,top_k,drop,one,src", CASES)
def test_fused_mxfp8_accuracy(kernel, reference, M, K, I, E, top_k, drop, one, src):
    d = _inputs(kernel, M, K, I, E, top_k, seed=M * 7 + K, drop=drop, one_expert=one, src=src)
    out = _run(kernel, d)
    assert torch.isfinite(out).all()  # poisoned: every row written
    truth = reference.moe_fp32(d["x"], d["w"], d["w2"], d["ids"], d["wt"])
    xd, wd, w2d = _dequantized(reference, d["q"])
    floor = rel_err(reference.moe_fp32(xd, wd, w2d, d["ids"], d["wt"]), truth)  # what quantizing alone costs
    assert 1e-3 < floor < 0.1, floor
    err = rel_err(out, truth)
    assert err <= 1.5 * floor, (err, floor)
    ref = _ref_run(kernel, reference, d)
    assert rel_err(out, ref) <= 1e-2, rel_err(out, ref)  # same roundings, only the fp32 summation order differs


def test_fused_mxfp8_split_false_accumulates(kernel, reference):
    d = _inputs(kernel, 300, 1024, 512, 16, 4, seed=3, drop=0.1)
    base = torch.randn(300, 1024, device="cuda").bfloat16()
    out = _run(kernel, d, out=base.clone(), split=False)
    ref = _ref_run(kernel, reference, d, out=base.clone(), split=False)
    assert rel_err(out.float() - base.float(), ref.float() - base.float()) < 1e-2
    truth = reference.moe_fp32(d["x"], d["w"], d["w2"], d["ids"], d["wt"])
    xd, wd, w2d = _dequantized(reference, d["q"])
    floor = rel_err(reference.moe_fp32(xd, wd, w2d, d["ids"], d["wt"]), truth)
    assert rel_err(out.float() - base.float(), truth) <= 1.5 * floor
    # split=True ignores what was in out
    assert torch.equal(_run(kernel, d, out=base.clone(), split=True), _run(kernel, d))


def test_fused_mxfp8_all_slots_dropped_gives_zero(kernel):
    d = _inputs(kernel, 50, 256, 128, 4, 2)
    d["ids"] = torch.full_like(d["ids"], -1)
    out = _run(kernel, d)
    assert torch.equal(out, torch.zeros_like(out))


def test_fused_mxfp8_bit_identical_repeats(kernel):
    d = _inputs(kernel, 2048, 2048, 768, 64, 8, seed=11)
    first = _run(kernel, d)
    for _ in range(3):
        assert torch.equal(_run(kernel, d), first)


# CTA pairs (bpc = 2): same instructions in the same order per output element, so the same bits.
# Shapes: pairs and lone blocks, an odd gate/up n-block count (I = 384: 3), an odd down n-block
# count (K = 640: 3), both with a pair and a lone block per expert, one expert holding every
# token, E = 256, dropped slots, M = 1.
PAIR_CASES = [
    # M, K, I, E, top_k, drop, one_expert
    (1, 256, 128, 4, 1, 0.0, None),
    (777, 640, 384, 8, 2, 0.0, None),
    (3000, 1024, 256, 4, 1, 0.1, 2),
    (2048, 2048, 768, 256, 8, 0.05, None),
    (2500, 7168, 2048, 32, 8, 0.0, None),
    (1500, 640, 384, 4, 1, 0.0, None),
]


@pytest.mark.parametrize("M,K,I,E,top_k,drop,one", PAIR_CASES)
def test_fused_mxfp8_pairs_bit_identical_to_single(kernel, M, K, I, E, top_k, drop, one):
    d = _inputs(kernel, M, K, I, E, top_k, seed=M + K + I, drop=drop, one_expert=one)
    single = _run(kernel, d, bpc=1)
    paired = _run(kernel, d, bpc=2)
    assert torch.isfinite(single).all()
    assert torch.equal(paired, single)


# The f16 scale-window gate/up GEMM (mx::kWindow in mxfp8.cuh) against the general one
# (FLASH_MOE_MXFP8_GENERAL=1): products exact in both, the accumulator scaled by a power of two,
# so the same bits. Shapes: half tiles (E = 256), pairs, K and I not multiples of 128, long K.
WINDOW_CASES = [
    # M, K, I, E, top_k, drop, bpc
    (1, 256, 128, 4, 1, 0.0, 1),
    (777, 640, 384, 8, 2, 0.0, 1),
    (2048, 2048, 768, 256, 8, 0.05, 1),
    (2048, 2048, 768, 64, 8, 0.0, 2),
    (300, 7168, 2048, 8, 2, 0.1, 1),
    (64, 320, 192, 4, 2, 0.0, 1),
]


def _general(kernel, d, monkeypatch, **tuning):
    monkeypatch.setenv("FLASH_MOE_MXFP8_GENERAL", "1")
    try:
        return _run(kernel, d, **tuning)
    finally:
        monkeypatch.delenv("FLASH_MOE_MXFP8_GENERAL")


@pytest.mark.parametrize("M,K,I,E,top_k,drop,bpc", WINDOW_CASES)
def test_fused_mxfp8_window_bit_identical_to_general(kernel, monkeypatch, M, K, I, E, top_k, drop, bpc):
    d = _inputs(kernel, M, K, I, E, top_k, seed=M + 3 * K, drop=drop)
    fast = _run(kernel, d, bpc=bpc)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, _general(kernel, d, monkeypatch, bpc=bpc))


def _spread_inputs(kernel, spread, seed):
    """Token and weight rows whose 32-blocks are one pattern times 2^0 .. 2^spread, so every row's
    scale bytes span exactly `spread`; token 5 and weight row 7 of expert 1 are all zero."""
    M, K, I, E, top_k = 200, 1024, 256, 4, 2
    d = _inputs(kernel, M, K, I, E, top_k, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    shifts = torch.arange(K // 32, device="cuda") % (spread + 1)
    shifts = shifts[torch.randperm(K // 32, generator=g, device="cuda")]
    factor = torch.exp2(shifts.float() - spread / 2).repeat_interleave(32)
    pattern = torch.randn(32, generator=g, device="cuda").repeat(K // 32)
    x = (pattern * factor * torch.randn(M, 1, generator=g, device="cuda").abs()).bfloat16()
    x[5] = 0
    w = (d["w"].float() * 0 + pattern * factor / K ** 0.5 * torch.rand(E, 2 * I, 1, generator=g, device="cuda")).bfloat16()
    w[1, 7] = 0
    xq, xs = kernel.quantize_mxfp8(x)
    wq, ws = kernel.quantize_mxfp8(w, blocked=True)
    d.update(x=x, w=w, q=(xq, xs, wq, ws) + d["q"][4:])
    return d


@pytest.mark.parametrize("spread", [22, 23])  # the f16 window's width, and one past it
def test_fused_mxfp8_window_edge(kernel, reference, monkeypatch, spread):
    d = _spread_inputs(kernel, spread, seed=spread)
    span = _bytes(d["q"][1]).int().cpu()
    assert (span.max(1).values - span.min(1).values)[torch.arange(200) != 5].eq(spread).all()
    out = _run(kernel, d)
    assert torch.isfinite(out).all()
    assert torch.equal(out, _general(kernel, d, monkeypatch))
    assert rel_err(out, _ref_run(kernel, reference, d)) <= 1e-2
    assert torch.equal(out[5], torch.zeros_like(out[5]))


def test_fused_mxfp8_cuda_graph_replay_equals_eager(kernel):
    d = _inputs(kernel, 1024, 1024, 512, 32, 4, seed=5)
    out = torch.empty(1024, 1024, dtype=torch.bfloat16, device="cuda")
    eager = _run(kernel, d).clone()
    graph, _ = assert_graph_replays_eager(lambda: _run(kernel, d, out=out), eager)
    # new routing and new token values in the same buffers replay correctly too
    d["ids"].copy_(torch.roll(d["ids"], 1, dims=0))
    xq, xs = kernel.quantize_mxfp8(torch.randn(1024, 1024, device="cuda"))
    _bytes(d["q"][0]).copy_(_bytes(xq))
    _bytes(d["q"][1]).copy_(_bytes(xs))
    graph.replay()
    assert torch.equal(out, _run(kernel, d))


def test_fused_mxfp8_nan_scale_poisons_one_row(kernel):
    M, K = 300, 512
    d = _inputs(kernel, M, K, 256, 8, 2, seed=13)
    d["ids"][9] = -1  # token 9 is routed nowhere: its x must never be read
    clean = _run(kernel, d).clone()
    xs = _bytes(d["q"][1])
    xs[17, 3] = 255  # one block of token 17 (it has live slots)
    xs[9, 0] = 255
    out = _run(kernel, d)
    rows = torch.isnan(out).any(1).cpu()
    assert rows.tolist() == [t == 17 for t in range(M)]
    assert torch.isnan(out[17]).all()
    keep = torch.arange(M, device="cuda") != 17
    assert torch.equal(out[keep], clean[keep])  # the other rows of the same tiles are untouched
    assert torch.equal(out[9], torch.zeros(K, dtype=torch.bfloat16, device="cuda"))


# opcheck's test_schema compares every input before and after the call with torch.allclose, which
# has no float8 kernels (pytorch/pytorch#135998); for the ops taking e4m3/e8m0 inputs it is replaced
# by _check_schema_mutations, the same check done on the bytes.
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _check_schema_mutations(op, args, mutated):
    """The schema marks exactly `mutated` as written, the call changes only those, returns alias nothing."""
    schema = op.default._schema
    for a, v in zip(schema.arguments, args):
        if isinstance(v, torch.Tensor):
            writes = a.alias_info is not None and a.alias_info.is_write
            assert writes == (a.name in mutated), (a.name, str(schema))
    before = [_bytes(v.contiguous()).clone() if isinstance(v, torch.Tensor) else None for v in args]
    result = op(*args)
    torch.cuda.synchronize()
    for a, v, b in zip(schema.arguments, args, before):
        if b is not None:
            same = torch.equal(_bytes(v.contiguous()), b)
            assert same != (a.name in mutated), f"{a.name}: {'not written' if same else 'changed'}"
    outs = result if isinstance(result, (tuple, list)) else [result] if result is not None else []
    storages = {v.untyped_storage().data_ptr() for v in args if isinstance(v, torch.Tensor)}
    assert all(o.untyped_storage().data_ptr() not in storages for o in outs)


def test_opcheck(kernel):
    d = _inputs(kernel, 64, 256, 128, 4, 2)
    s, e, n = kernel.moe_align(d["ids"], 4)
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    args = (*d["q"], s, e, n, d["wt"], out, 2, 128, 128, 128, kernel.STAGES_MXFP8, 1, 1, True)
    torch.library.opcheck(kernel.ops.fused_moe_mxfp8, args, test_utils=NO_SCHEMA)
    out.fill_(float("nan"))
    _check_schema_mutations(kernel.ops.fused_moe_mxfp8, args, {"out"})
    y = torch.randn(130, 96, device="cuda").bfloat16()
    for blocked in (False, True):
        torch.library.opcheck(kernel.ops.quantize_mxfp8, *_op_call(kernel.ops.quantize_mxfp8, y, blocked=blocked))
    v, sc = kernel.quantize_mxfp8(y)
    dq_args, dq_kwargs = _op_call(kernel.ops.dequantize_mxfp8, v, sc, dtype=torch.bfloat16)
    torch.library.opcheck(kernel.ops.dequantize_mxfp8, dq_args, dq_kwargs, test_utils=NO_SCHEMA)
    _check_schema_mutations(kernel.ops.dequantize_mxfp8, (*dq_args, *dq_kwargs.values()), set())


# ---------------------------------------------------------------- bad input

def _bad(kernel, name, **over):
    """The call fails with a RuntimeError whose message starts with `fused_moe_mxfp8: <name>`."""
    d = _inputs(kernel, 64, 256, 128, 4, 2)
    xq, xs, wq, ws, w2q, w2s = d["q"]
    s, e, n = kernel.moe_align(d["ids"], 4)
    args = dict(x=xq, x_scales=xs, w=wq, w_scales=ws, w2=w2q, w2_scales=w2s, sorted_token_ids=s, expert_ids=e,
                num_tokens_post_padded=n, topk_weights=d["wt"], out=torch.empty(64, 256, dtype=torch.bfloat16,
                                                                                 device="cuda"), top_k=2)
    args.update(over)
    with pytest.raises(RuntimeError, match=rf"^fused_moe_mxfp8: {name}\b"):
        kernel.fused_moe_mxfp8(**args)
    torch.cuda.synchronize()


def _zeros_with_k(K, M=64, I=128, E=4):
    f8 = torch.float8_e4m3fn
    return dict(x=torch.zeros(M, K, device="cuda").to(f8),
                x_scales=_e8m0(torch.full((M, max(K // 32, 1)), 127, dtype=torch.uint8, device="cuda")),
                w=torch.zeros(E, 2 * I, K, device="cuda").to(f8), w2=torch.zeros(E, K, I, device="cuda").to(f8),
                out=torch.empty(M, K, dtype=torch.bfloat16, device="cuda"))


def test_bad_inputs(kernel):
    d = _inputs(kernel, 64, 256, 128, 4, 2)
    xq, xs, wq, ws, w2q, w2s = d["q"]
    _bad(kernel, "x", x=xq.to(torch.float8_e5m2))
    _bad(kernel, "x", x=xq.to(torch.bfloat16))
    _bad(kernel, "x_scales", x_scales=xs.view(torch.uint8))
    _bad(kernel, "x_scales", x_scales=_e8m0(_bytes(xs)[:, :-1].contiguous()))
    _bad(kernel, "x_scales", x_scales=_e8m0(_bytes(xs)[:-1].contiguous()))
    _bad(kernel, "x_scales", x_scales=xs.reshape(-1))  # right bytes, not (M, K/32)
    _bad(kernel, "x_scales", x_scales=_e8m0(_bytes(xs).cpu()))
    _bad(kernel, "w_scales", w_scales=ws[:-512])
    _bad(kernel, "w_scales", w_scales=_bytes(ws))
    _bad(kernel, "w_scales", w_scales=_e8m0(_bytes(ws)[::2]))  # not contiguous
    _bad(kernel, "w2_scales", w2_scales=_e8m0(torch.cat([_bytes(w2s), _bytes(w2s)])))
    _bad(kernel, "w", w=wq.to(torch.bfloat16))
    _bad(kernel, "w", w=wq.transpose(1, 2).contiguous().transpose(1, 2))  # (E, 2I, K) but not contiguous
    _bad(kernel, "w2", w2=w2q.to(torch.float8_e5m2))
    # K = 48: a multiple of 8 (the bf16 op's rule) but not of 32; K = 160: of 32 (the scale
    # block) but not of 64 (the kernel's K block)
    for K in (48, 160):
        _bad(kernel, "x", **_zeros_with_k(K))
    # I = 40: a multiple of 8 but not of 32
    _bad(kernel, "(I|w)", w=torch.zeros(4, 80, 256, device="cuda").to(torch.float8_e4m3fn),
         w2=torch.zeros(4, 256, 40, device="cuda").to(torch.float8_e4m3fn))
    _bad(kernel, "stages", stages=9)
    _bad(kernel, "bpc", bpc=3)


def test_flat_packed_weight_scales_are_refused_where_they_differ(kernel, reference):
    """Expert-batched weight scales are read packed per expert (pack_scales_blocked of (E, MN, S)).
    Packing the (E*MN, S) flattening instead gives other bytes when MN % 128 != 0: the op names
    that mistake instead of reading wrong scales; where the two agree, both are the same tensor."""
    for K, differs in ((320, True), (256, False)):  # w2's MN is K
        d = _inputs(kernel, 64, K, 128, 4, 2, seed=K)
        w2_rm = kernel.quantize_mxfp8(d["w2"])[1]
        flat = reference.pack_scales_blocked(_bytes(w2_rm).reshape(-1, w2_rm.shape[-1]).cpu())
        per_expert = kernel.pack_scales_blocked(w2_rm)
        assert torch.equal(_bytes(per_expert), _bytes(d["q"][5]))  # quantize_mxfp8(blocked=True) agrees
        q = list(d["q"])
        q[5] = _e8m0(flat.cuda())
        if differs:
            with pytest.raises(RuntimeError, match=r"w2_scales holds .* flattening .* packed as one matrix.*"
                                                   r"not a multiple of 128.*pack_scales_blocked"):
                _run(kernel, dict(d, q=tuple(q)))
        else:
            assert torch.equal(_bytes(q[5]), _bytes(d["q"][5]))


def test_default_bpc_is_preferred_and_bit_identical(kernel, monkeypatch):
    """bpc=None (the default) takes preferred_bpc of the call's shape; bits never depend on bpc."""
    d = _inputs(kernel, 1024, 512, 256, 4, 2, seed=21)  # 2048 slots >= 2 * 128 * 4: preferred 2 for bf16
    assert kernel.preferred_bpc(1024, 512, 256, 4, 2) == 2
    assert kernel.preferred_bpc(1024, 512, 256, 4, 2, mxfp8=True) == 1
    seen = []
    real = kernel.ops.fused_moe_mxfp8
    monkeypatch.setattr(kernel.ops, "fused_moe_mxfp8", lambda *a: (seen.append(a[16]), real(*a))[1])
    default = _run(kernel, d).clone()
    assert seen == [1]
    assert torch.equal(default, _run(kernel, d, bpc=2)) and torch.equal(default, _run(kernel, d, bpc=1))
    assert seen[1:] == [2, 1]
