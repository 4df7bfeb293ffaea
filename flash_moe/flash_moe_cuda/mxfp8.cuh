// MXFP8 element and scale conversions (DESIGN §6) shared by the quantize/dequantize kernels and
// the GEMM's B-operand dequantization. Device code only.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace flash_moe {
namespace mx {

// RCEIL scale byte from the bit pattern of amax = max|y| over a block. The unsigned order of
// |y| bit patterns is the float order with NaN above +Inf, so one integer max carries
// "non-finite" too (-> 255).
__device__ __forceinline__ uint32_t scale_byte_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return 255u;
  const float t = __fmul_rn(__uint_as_float(amax_bits), 1.0f / 448.0f);
  const uint32_t tb = __float_as_uint(t);
  const uint32_t byte = (tb >> 23) + ((tb & 0x007fffffu) != 0u ? 1u : 0u);
  return byte > 254u ? 254u : byte;
}

// 2^(127 - byte) as an exact fp32 (subnormal for bytes 254 and 255): the quantization multiplier.
__device__ __forceinline__ float quant_multiplier(uint32_t byte) {
  const int e = 254 - static_cast<int>(byte);
  return e >= 1 ? __uint_as_float(static_cast<uint32_t>(e) << 23) : __uint_as_float(0x00400000u >> (-e));
}

// Two fp32 -> two e4m3 (saturating, round-to-nearest-even): a -> low byte, b -> high byte.
__device__ __forceinline__ uint32_t e4m3x2_from_floats(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// Two e4m3 bytes in the low byte of each 16-bit lane (0x00BB00AA) -> two bf16 holding
// q * 2^-120 exactly: e4m3's exponent/mantissa bits shifted into bf16's place (normal and
// subnormal e4m3 alike: bf16's bias is 120 more), the sign moved to bit 15. Integer ops
// only: (b << 4) + (b & 0x80) * 240 == ((b & 0x7f) << 4) | ((b & 0x80) << 8).
__device__ __forceinline__ uint32_t bf16x2_bits_from_e4m3_lanes(uint32_t lanes) {
  return (lanes << 4) + (lanes & 0x00800080u) * 240u;
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

// True if any of the 4 e4m3 bytes of `w` is a NaN code (0x7f / 0xff).
__device__ __forceinline__ bool has_nan_code(uint32_t w) {
  return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u;
}

// 16 e4m3 values (one 16-byte chunk, element 0 in the lowest byte) times 2^(byte - 127) ->
// 16 bf16 (two chunks), rounded once: exact whenever q * 2^(byte-127) is representable in bf16
// (every e4m3 value for bytes 3..246). Byte 255 (the e8m0 NaN) makes the chunk NaN, e4m3 NaN
// codes stay NaN. Fast path (integer bit placement + one bf16 multiply by 2^(byte-7), a normal
// bf16 for bytes <= 134, which covers real tensors); anything else takes the fp32 path.
__device__ __forceinline__ void dequant16(const uint4& q, uint32_t byte, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  uint32_t o[8];
  if (byte <= 134u && !(has_nan_code(q.x) | has_nan_code(q.y) | has_nan_code(q.z) | has_nan_code(q.w))) {
    const uint32_t f = ((byte + 120u) << 7) * 0x00010001u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = bf16x2_mul(bf16x2_bits_from_e4m3_lanes(__byte_perm(w[i], 0, 0x4140)), f);
      o[2 * i + 1] = bf16x2_mul(bf16x2_bits_from_e4m3_lanes(__byte_perm(w[i], 0, 0x4342)), f);
    }
  } else {
    const float factor = dequant_factor(byte);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = bf16x2_from_e4m3x2(w[i] & 0xffffu, factor);
      o[2 * i + 1] = bf16x2_from_e4m3x2(w[i] >> 16, factor);
    }
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

// Byte offset of scale (r, s) in the blocked layout of an (R, S) scale matrix (DESIGN §6).
__host__ __device__ __forceinline__ int64_t blocked_offset(int64_t r, int64_t s, int64_t S) {
  return ((r / 128) * ((S + 3) / 4) + s / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + s % 4;
}

}  // namespace mx
}  // namespace flash_moe
