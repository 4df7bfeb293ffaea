// MXFP8 element and scale conversions (docs/DESIGN.md §6) shared by the quantize/dequantize
// kernels and the GEMM's B-operand dequantization. Device code only.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "mxfp8_rules.cuh"

namespace flash_moe {
namespace mx {

// The rules rmsnorm implements too (scale byte, multiplier, e4m3 packing, blocked layout): one
// source, common/mxfp8_rules.cuh.
using mxfp8_rules::blocked_offset;
using mxfp8_rules::blocked_offset_in_chunk;
using mxfp8_rules::e4m3x2_from_floats;
using mxfp8_rules::quant_multiplier;
using mxfp8_rules::scale_byte_from_amax_bits;

// Bytes kI and kJ of w (two e4m3) -> two bf16 holding q * 2^-120 exactly (the low half from
// byte kI). prmt puts each byte in the low half of a 16-bit lane with its sign replicated into
// the high half (0xSSbb); after << 4, bits 4..10 hold the e4m3 exponent and mantissa bits in
// bf16's place (bf16's bias is 120 more; normal and subnormal e4m3 alike) and bit 15 a copy of
// the sign, and the mask keeps exactly those: three instructions per pair.
template <int kI, int kJ>
__device__ __forceinline__ uint32_t bf16x2_bits_from_e4m3(uint32_t w) {
  constexpr uint32_t kSel = kI | ((kI | 8) << 4) | (kJ << 8) | ((kJ | 8) << 12);
  uint32_t t;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(w), "r"(0u), "n"(kSel));
  return (t << 4) & 0x87f087f0u;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two e4m3 (low byte first) times `factor` -> two bf16: the exact general path. e4m3 -> f16
// -> f32 is exact (NaN codes stay NaN) and so is the product by a power of two unless it leaves
// the fp32 range; the bf16 rounding is the only rounding.
__device__ __forceinline__ uint32_t bf16x2_from_e4m3x2(uint32_t two_bytes, float factor) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  __half2 h;
  *reinterpret_cast<__half2_raw*>(&h) = hr;
  const float2 f = __half22float2(h);
  const __nv_bfloat162 r = __floats2bfloat162_rn(__fmul_rn(f.x, factor), __fmul_rn(f.y, factor));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// 2^(byte - 127) as an exact fp32, NaN for byte 255 (the e8m0 NaN).
__device__ __forceinline__ float dequant_factor(uint32_t byte) {
  if (byte == 255u) return __uint_as_float(0x7fc00000u);
  return byte == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(byte << 23);
}

// True if any of the 16 e4m3 bytes is a NaN code (0x7f / 0xff): adding 1 to a byte's low 7
// bits carries into its bit 7 exactly for those.
__device__ __forceinline__ bool has_nan_code(const uint4& q) {
  constexpr uint32_t kLow7 = 0x7f7f7f7fu, kOnes = 0x01010101u;
  return ((((q.x & kLow7) + kOnes) | ((q.y & kLow7) + kOnes) | ((q.z & kLow7) + kOnes) | ((q.w & kLow7) + kOnes)) &
          0x80808080u) != 0u;
}

// 16 e4m3 values (one 16-byte chunk, element 0 in the lowest byte) times 2^(byte - 127) ->
// 16 bf16 (two chunks), rounded once: exact whenever q * 2^(byte-127) is representable in bf16
// (every e4m3 value for bytes 3..246). Byte 255 (the e8m0 NaN) makes the chunk NaN, e4m3 NaN
// codes stay NaN. Two paths: the integer one (bit placement + one bf16 multiply by
// 2^(byte-7), a normal bf16 for bytes <= 134, which covers real tensors) where
// `integer_path_ok`, else the general fp32 one. `dequant16` picks per chunk; the GEMM tests
// its four chunks of a k-block at once and branches once.
__device__ __forceinline__ bool integer_path_ok(const uint4& q, uint32_t byte) {
  return byte <= 134u && !has_nan_code(q);
}

__device__ __forceinline__ void dequant16_integer(const uint4& q, uint32_t byte, uint4& lo, uint4& hi) {
  const uint32_t f = ((byte + 120u) << 7) * 0x00010001u;
  lo = make_uint4(bf16x2_mul(bf16x2_bits_from_e4m3<0, 1>(q.x), f), bf16x2_mul(bf16x2_bits_from_e4m3<2, 3>(q.x), f),
                  bf16x2_mul(bf16x2_bits_from_e4m3<0, 1>(q.y), f), bf16x2_mul(bf16x2_bits_from_e4m3<2, 3>(q.y), f));
  hi = make_uint4(bf16x2_mul(bf16x2_bits_from_e4m3<0, 1>(q.z), f), bf16x2_mul(bf16x2_bits_from_e4m3<2, 3>(q.z), f),
                  bf16x2_mul(bf16x2_bits_from_e4m3<0, 1>(q.w), f), bf16x2_mul(bf16x2_bits_from_e4m3<2, 3>(q.w), f));
}

__device__ __forceinline__ void dequant16_general(const uint4& q, uint32_t byte, uint4& lo, uint4& hi) {
  const float factor = dequant_factor(byte);
  lo = make_uint4(bf16x2_from_e4m3x2(q.x & 0xffffu, factor), bf16x2_from_e4m3x2(q.x >> 16, factor),
                  bf16x2_from_e4m3x2(q.y & 0xffffu, factor), bf16x2_from_e4m3x2(q.y >> 16, factor));
  hi = make_uint4(bf16x2_from_e4m3x2(q.z & 0xffffu, factor), bf16x2_from_e4m3x2(q.z >> 16, factor),
                  bf16x2_from_e4m3x2(q.w & 0xffffu, factor), bf16x2_from_e4m3x2(q.w >> 16, factor));
}

__device__ __forceinline__ void dequant16(const uint4& q, uint32_t byte, uint4& lo, uint4& hi) {
  if (integer_path_ok(q, byte))
    dequant16_integer(q, byte, lo, hi);
  else
    dequant16_general(q, byte, lo, hi);
}

// ---------------------------------------------------------------- the f16 scale window
// The gate/up GEMM's fast path multiplies in f16 instead of bf16. A row (a weight row of w, or a
// token of x) whose scale bytes stay within a window of kWindow below its largest byte `top`
// can hold every q * 2^(byte - top + 7) exactly in f16: |q| <= 448 times 2^7 stays below 65504,
// and the smallest e4m3 step 2^-9 times 2^-15 is f16's smallest subnormal 2^-24. The row's true
// values are those f16 values times 2^(top - 134), so the GEMM's fp32 accumulator carries the
// products scaled by 2^(268 - top_w - top_x), exactly, and the epilogue multiplies that back.
// Blocks below the window are allowed when all their values are zero (an all-zero block has
// scale byte 0); byte 255 (NaN) is outside every window and makes its block NaN. `top` must lie
// in [kTopMin, kTopMax] and K below kMaxK: then |acc| is 0 or in [2^-48, 2^46], both epilogue
// factors 2^(top - 134) and every product of them with acc are normal fp32, so scaling back is
// exact, and the result equals the bf16 path's bit for bit (neither path can overflow).
constexpr int kWindow = 22;
constexpr int kTopMin = 95, kTopMax = 174;
constexpr int kMaxK = 1 << 14;
constexpr int kTopBias = 134;  // top - kTopBias: the exponent of a row's epilogue factor

// f16 bits of 2^(byte - top + 7) in both halves: byte in the window [top - 22, top]. Below the
// window (all-zero blocks, zero-filled rows) 0; byte 255 an f16 NaN.
constexpr int kExpOffset = 15 + 7;  // f16's exponent bias, plus the 7 of 2^(byte - top + 7)
static_assert(kWindow <= kExpOffset, "the window's lowest multiplier 2^(7 - kWindow) must be an f16");
__device__ __forceinline__ uint32_t f16x2_scale(uint32_t byte, uint32_t top) {
  const int e = static_cast<int>(byte) - static_cast<int>(top) + kExpOffset;  // f16 biased exponent
  uint32_t bits = e > 0 ? static_cast<uint32_t>(e) << 10 : (e == 0 ? 0x0200u : 0u);
  bits = byte == 255u ? 0x7e00u : bits;
  return bits * 0x00010001u;
}

// 2^(top - kTopBias) as fp32: a row's epilogue factor.
__device__ __forceinline__ float window_factor(uint32_t top) {
  return __uint_as_float(static_cast<uint32_t>(static_cast<int>(top) - kTopBias + 127) << 23);
}

__device__ __forceinline__ uint32_t f16x2_from_e4m3x2(uint32_t two_bytes) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(static_cast<uint16_t>(two_bytes)));
  return d;
}

__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 16 e4m3 values times the f16x2 multiplier `scale` (f16x2_scale) -> 16 f16, exact; e4m3 NaN
// codes stay NaN. Two instructions per pair, no branch.
__device__ __forceinline__ void dequant16_f16(const uint4& q, uint32_t scale, uint4& lo, uint4& hi) {
  lo = make_uint4(f16x2_mul(f16x2_from_e4m3x2(q.x), scale), f16x2_mul(f16x2_from_e4m3x2(q.x >> 16), scale),
                  f16x2_mul(f16x2_from_e4m3x2(q.y), scale), f16x2_mul(f16x2_from_e4m3x2(q.y >> 16), scale));
  hi = make_uint4(f16x2_mul(f16x2_from_e4m3x2(q.z), scale), f16x2_mul(f16x2_from_e4m3x2(q.z >> 16), scale),
                  f16x2_mul(f16x2_from_e4m3x2(q.w), scale), f16x2_mul(f16x2_from_e4m3x2(q.w >> 16), scale));
}

}  // namespace mx
}  // namespace flash_moe
