"""CPU check of the arithmetic behind the MXFP8 gate/up GEMM's f16 path (mxfp8.cuh, "the f16
scale window"), by enumeration.

The kernel claims: for a row whose scale bytes lie in [top - kWindow, top], every e4m3 value q
times 2^(byte - top + 7) is an exact f16; the multiplier it builds from the bits
(byte - top + kExpOffset) << 10 (0x0200 at the bottom of the window, 0 below it) is exactly
that power of two; and with top in [kTopMin, kTopMax] and K < kMaxK the fp32 accumulator and its
two epilogue factors 2^(top - kTopBias) stay in the normal range, so scaling back is exact.
The constants and the bit formula are copies of the C++ ones; keep them in sync.
"""

import math

import torch

K_WINDOW = 22
K_EXP_OFFSET = 15 + 7
K_TOP_MIN, K_TOP_MAX = 95, 174
K_MAX_K = 1 << 14
K_TOP_BIAS = 134

F16_MAX = 65504.0
FP32_MIN_NORMAL = 2.0 ** -126
FP32_MAX = float(torch.finfo(torch.float32).max)


def _e4m3_values():
    """Every finite e4m3 value (NaN codes 0x7f / 0xff excluded), from the bit patterns."""
    codes = torch.arange(256, dtype=torch.uint8)
    v = codes.view(torch.float8_e4m3fn).to(torch.float64)
    return v[~torch.isnan(v)]


def f16x2_scale_bits(byte, top):  # mx::f16x2_scale, one half
    e = byte - top + K_EXP_OFFSET
    bits = e << 10 if e > 0 else (0x0200 if e == 0 else 0)
    return 0x7E00 if byte == 255 else bits


def _f16_from_bits(bits):
    return torch.tensor([bits], dtype=torch.int16).view(torch.float16).item()


def test_multiplier_bits_are_the_power_of_two():
    top = 130
    for byte in range(top - K_WINDOW, top + 1):
        assert _f16_from_bits(f16x2_scale_bits(byte, top)) == 2.0 ** (byte - top + 7), byte
    assert _f16_from_bits(f16x2_scale_bits(top - K_WINDOW - 1, top)) == 0.0  # below: all-zero blocks only
    assert math.isnan(_f16_from_bits(f16x2_scale_bits(255, top)))


def test_every_e4m3_value_times_every_window_multiplier_is_an_exact_f16():
    q = _e4m3_values()
    for t in range(7 - K_WINDOW, 8):  # 2^(byte - top + 7) over the window
        exact = q * 2.0 ** t
        assert exact.abs().max() <= F16_MAX
        assert torch.equal(exact.to(torch.float16).to(torch.float64), exact), t


def test_products_and_sums_stay_exact_and_normal():
    # every f16 x f16 product of window values is exact in fp32 (11 + 11 significant bits)
    q = _e4m3_values()
    a = (q * 2.0 ** 7).to(torch.float16).to(torch.float64)
    b = (q * 2.0 ** (7 - K_WINDOW)).to(torch.float16).to(torch.float64)
    prod = torch.outer(a, b)
    assert torch.equal(prod.to(torch.float32).to(torch.float64), prod)
    # |acc| bounds the docs state: smallest nonzero product 2^-48, largest sum below 2^46
    nonzero = prod[prod != 0].abs()
    smallest = (q[q != 0].abs().min() * 2.0 ** (7 - K_WINDOW)) ** 2
    assert smallest == 2.0 ** -48 and nonzero.min() >= smallest
    largest = (448.0 * 2.0 ** 7) ** 2 * K_MAX_K
    assert largest < 2.0 ** 46
    # both epilogue factors and acc times them stay normal fp32, so scaling back is exact
    for top_w in (K_TOP_MIN, K_TOP_MAX):
        for top_x in (K_TOP_MIN, K_TOP_MAX):
            fw, fx = 2.0 ** (top_w - K_TOP_BIAS), 2.0 ** (top_x - K_TOP_BIAS)
            for acc in (2.0 ** -48, 2.0 ** 46):
                assert FP32_MIN_NORMAL <= acc * fw <= FP32_MAX
                assert FP32_MIN_NORMAL <= acc * fw * fx <= FP32_MAX


def test_scaling_back_reproduces_the_true_dot_product():
    # A small dot product in both forms: true MX values in fp64, and the kernel's f16 operands
    # times the epilogue factors: equal (every step exact).
    g = torch.Generator().manual_seed(0)
    q = _e4m3_values()
    k = 64
    qa, qb = q[torch.randint(len(q), (k,), generator=g)], q[torch.randint(len(q), (k,), generator=g)]
    top_w, top_x = 120, 131
    bw = top_w - torch.randint(0, K_WINDOW + 1, (k // 32,), generator=g).repeat_interleave(32)
    bx = top_x - torch.randint(0, K_WINDOW + 1, (k // 32,), generator=g).repeat_interleave(32)
    true = (qa * 2.0 ** (bw - 127).double() * qb * 2.0 ** (bx - 127).double()).sum()
    a16 = (qa * 2.0 ** (bw - top_w + 7).double()).to(torch.float16)
    b16 = (qb * 2.0 ** (bx - top_x + 7).double()).to(torch.float16)
    acc = (a16.double() * b16.double()).sum()
    assert acc * 2.0 ** (top_w - K_TOP_BIAS) * 2.0 ** (top_x - K_TOP_BIAS) == true
