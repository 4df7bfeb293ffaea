// The MXFP8 rules both kernels implement (docs/DESIGN.md §6): the RCEIL scale byte of a
// 32-element block, the quantization multiplier, e4m3 packing and the blocked scale layout.
// Device code (the layout offsets are host code too), no torch. Copied into each member by
// scripts/sync_common.py, so that each builds alone.
#pragma once

#include <cstdint>
#include <cuda_fp8.h>

namespace mxfp8_rules {

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

// Two fp32 -> two e4m3 (cvt.rn.satfinite.e4m3x2.f32: saturating, round-to-nearest-even, NaN ->
// 0x7f): a -> low byte, b -> high byte.
__device__ __forceinline__ uint32_t e4m3x2_from_floats(float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// The blocked layout of an (R, S) scale matrix: 512-byte chunks of 128 rows x 4 columns, chunk
// (r / 128, s / 4) at ((r / 128) * ceil(S / 4) + s / 4) * 512. Unsigned, so the divisions and
// remainders by powers of two are shifts and masks.
// Byte offset of scale (r, s) inside its chunk.
__host__ __device__ __forceinline__ uint64_t blocked_offset_in_chunk(uint64_t r, uint32_t s) {
  return (r % 32) * 16 + ((r % 128) / 32) * 4 + s % 4;
}
// Byte offset of scale (r, s).
__host__ __device__ __forceinline__ uint64_t blocked_offset(uint64_t r, uint32_t s, uint32_t S) {
  return ((r / 128) * ((S + 3) / 4) + s / 4) * 512 + blocked_offset_in_chunk(r, s);
}

}  // namespace mxfp8_rules
