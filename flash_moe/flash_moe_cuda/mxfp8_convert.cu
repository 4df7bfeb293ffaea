// quantize_mxfp8 and dequantize_mxfp8 on the GPU (DESIGN §6): bandwidth-bound elementwise
// kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"
#include "mxfp8.cuh"

namespace flash_moe {
namespace {

constexpr int kThreadsPerCta = 256;

int grid_for(int64_t chunks) {
  const int64_t want = (chunks + kThreadsPerCta - 1) / kThreadsPerCta;
  const int64_t cap = (int64_t)sm_count() * 16;  // enough CTAs to keep every SM's load queue full
  return (int)(want < cap ? want : cap);
}


// quantize_kernel: every load is 16 bytes per lane and lane-contiguous (a warp reads 512
// contiguous bytes, so no sector is fetched twice), kSlots of them issued before the first use.
// A lane holds kElems elements, kLanesPerBlock lanes share a 32-element scale block, and a
// "unit" = 4 blocks = scale columns 4j..4j+3 of one row (kLanesPerUnit lanes), whose 4 scale
// bytes are contiguous in the blocked layout (and row-major when S % 4 == 0): they are OR-
// gathered by shuffles and stored as one word by the unit's first lane. Units are numbered
// row-major over (out_rows, S4) with out_rows = R, or R rounded up to 128 when blocked: the
// padding rows' units load nothing and store zero words, so the padding needs no memset.
constexpr int kSlots = 4;  // 64 B of loads in flight per thread

template <typename T>
struct QuantGeom {
  static constexpr int kElems = 16 / sizeof(T);                       // 8 bf16 / 4 fp32
  static constexpr int kLanesPerBlock = kMxfp8ScaleBlock / kElems;     // 4 / 8
  static constexpr int kLanesPerUnit = 4 * kLanesPerBlock;             // 16 / 32
  static constexpr int kUnitsPerStep = kSlots * kThreadsPerCta / kLanesPerUnit;
};

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreadsPerCta) quantize_kernel(const T* __restrict__ src, int64_t R, int K,
                                                                   uint8_t* __restrict__ vals,
                                                                   uint8_t* __restrict__ scales, int64_t units,
                                                                   bool blocked, bool words) {
  using G = QuantGeom<T>;
  constexpr int E = G::kElems;
  const int S = K / kMxfp8ScaleBlock;
  const int S4 = (S + 3) / 4;
  const int64_t out_rows = blocked ? (R + 127) / 128 * 128 : R;  // scale rows written (units = out_rows * S4)
  const int ul = threadIdx.x % G::kLanesPerUnit;  // lane within its unit
  const int b = ul / G::kLanesPerBlock;           // block within the unit: scale column 4j + b
  // The loop bound is CTA-uniform, so every lane reaches every shuffle.
  for (int64_t step = blockIdx.x; step * G::kUnitsPerStep < units; step += gridDim.x) {
    int64_t r[kSlots];
    int j[kSlots];
    bool in[kSlots];  // a real block (row < R, column < S)
    uint4 raw[kSlots];
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      // slot c of the CTA covers kThreadsPerCta / kLanesPerUnit consecutive units
      const int64_t u = step * G::kUnitsPerStep + (c * kThreadsPerCta + (int)threadIdx.x) / G::kLanesPerUnit;
      r[c] = u / S4;  // nvcc divides in 32 bits whenever the operands fit
      j[c] = (int)(u - r[c] * S4);
      in[c] = r[c] < R && 4 * j[c] + b < S;
      raw[c] = make_uint4(0u, 0u, 0u, 0u);  // padding blocks quantize zeros: scale byte 0
      if (in[c]) raw[c] = ld_stream16(src + r[c] * K + j[c] * 128 + ul * E);
    }
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      float f[E];
      const uint32_t w[4] = {raw[c].x, raw[c].y, raw[c].z, raw[c].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if constexpr (E == 8) {  // bf16 pairs, element 2q in the low half
          f[2 * q] = __uint_as_float(w[q] << 16);
          f[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
        } else {
          f[q] = __uint_as_float(w[q]);
        }
      }
      uint32_t amax = 0;
#pragma unroll
      for (int q = 0; q < E; ++q) amax = max(amax, __float_as_uint(f[q]) & 0x7fffffffu);
#pragma unroll
      for (int o = 1; o < G::kLanesPerBlock; o <<= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const uint32_t byte = mx::scale_byte_from_amax_bits(amax);
      const float m = mx::quant_multiplier(byte);
      uint32_t q4[E / 4];  // e4m3 of elements 4q..4q+3, lowest byte first
#pragma unroll
      for (int q = 0; q < E / 4; ++q)
        q4[q] = mx::e4m3x2_from_floats(__fmul_rn(f[4 * q], m), __fmul_rn(f[4 * q + 1], m)) |
                (mx::e4m3x2_from_floats(__fmul_rn(f[4 * q + 2], m), __fmul_rn(f[4 * q + 3], m)) << 16);
      if (in[c]) {
        uint8_t* const vp = vals + r[c] * K + j[c] * 128 + ul * E;
        if constexpr (E == 8)
          __stcs(reinterpret_cast<uint2*>(vp), make_uint2(q4[0], q4[1]));
        else
          __stcs(reinterpret_cast<unsigned int*>(vp), q4[0]);
      }
      // The unit's 4 scale bytes as one word (padding blocks give 0: the layout's zero padding).
      uint32_t word = byte << (8 * b);
#pragma unroll
      for (int o = G::kLanesPerBlock; o < G::kLanesPerUnit; o <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, o);
      const int s = 4 * j[c] + (words ? 0 : b);
      const int64_t off = blocked ? (int64_t)mx::blocked_offset(r[c], s, S) : r[c] * S + s;
      if (r[c] < out_rows) {
        if (words) {
          if (ul == 0) *reinterpret_cast<uint32_t*>(scales + off) = word;
        } else if (ul % G::kLanesPerBlock == 0 && (blocked || s < S)) {  // one byte per block
          scales[off] = (uint8_t)byte;
        }
      }
    }
  }
}

// One thread per 16 elements (half a scale block). kK64Permuted: every 64-wide K block is
// written K-permuted for the MXFP8 GEMM's register-operand path (moe_gemm_consumer_mxfp8.cuh, kperm):
// logical 16c + 4s + j -> physical 16s + 8(j >> 1) + 2c + (j & 1); a thread's 16 elements are
// one c of one block.
template <bool kK64Permuted>
__global__ void __launch_bounds__(kThreadsPerCta) dequantize_kernel(const uint8_t* __restrict__ vals,
                                                                     const uint8_t* __restrict__ scales, int64_t R,
                                                                     int K, __nv_bfloat16* __restrict__ out) {
  const int chunks_per_row = K / 16;
  const int S = K / kMxfp8ScaleBlock;
  const int64_t total = R * chunks_per_row;
  for (int64_t i = (int64_t)blockIdx.x * kThreadsPerCta + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * kThreadsPerCta) {
    const int64_t r = i / chunks_per_row;
    const int q = (int)(i - r * chunks_per_row);
    const uint4 v = *reinterpret_cast<const uint4*>(vals + i * 16);
    uint4 lo, hi;
    mx::dequant16(v, scales[r * S + q / 2], lo, hi);
    if constexpr (!kK64Permuted) {
      reinterpret_cast<uint4*>(out + i * 16)[0] = lo;
      reinterpret_cast<uint4*>(out + i * 16)[1] = hi;
    } else {
      const uint32_t o[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};  // pairs (2k, 2k+1)
      __nv_bfloat16* block = out + r * K + (q / 4) * 64;
      const int c = q % 4;
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        *reinterpret_cast<uint32_t*>(block + 16 * st + 2 * c) = o[2 * st];          // logical 4st, 4st+1
        *reinterpret_cast<uint32_t*>(block + 16 * st + 8 + 2 * c) = o[2 * st + 1];  // logical 4st+2, 4st+3
      }
    }
  }
}

template <bool kK64Permuted>
cudaError_t launch_dequantize(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                              cudaStream_t stream) {
  if (K % (kK64Permuted ? 64 : kMxfp8ScaleBlock) != 0 || K <= 0) return cudaErrorInvalidValue;
  const int64_t chunks = R * (K / 16);
  if (chunks == 0) return cudaSuccess;
  dequantize_kernel<kK64Permuted><<<grid_for(chunks), kThreadsPerCta, 0, stream>>>(
      vals, scales, R, (int)K, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_quantize(const void* src, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales, bool blocked,
                            cudaStream_t stream) {
  const int64_t S = K / kMxfp8ScaleBlock;
  const int64_t units = (blocked ? mxfp8_scale_row_groups(R) * 128 : R) * mxfp8_scale_col_groups(S);
  if (units == 0) return cudaSuccess;
  // Word stores need 4 contiguous, aligned bytes per unit: always in the blocked layout,
  // row-major only when S % 4 == 0; otherwise each block's first lane stores its byte.
  const bool words = (blocked || S % 4 == 0) && reinterpret_cast<uintptr_t>(scales) % 4 == 0;
  // One step per CTA (as rmsnorm's forward: the hardware backfills finished CTAs); the kernel's
  // grid-stride loop only matters past the grid-size limit.
  const int64_t steps = (units + QuantGeom<T>::kUnitsPerStep - 1) / QuantGeom<T>::kUnitsPerStep;
  const int grid = (int)(steps < (1 << 30) ? steps : (1 << 30));
  quantize_kernel<T><<<grid, kThreadsPerCta, 0, stream>>>(static_cast<const T*>(src), R, (int)K, vals, scales,
                                                          units, blocked, words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_mxfp8(const void* src, FloatKind kind, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales,
                           bool blocked, cudaStream_t stream) {
  if (K % kMxfp8ScaleBlock != 0 || K <= 0 || R < 0) return cudaErrorInvalidValue;
  return kind == FloatKind::kBf16 ? launch_quantize<__nv_bfloat16>(src, R, K, vals, scales, blocked, stream)
                                  : launch_quantize<float>(src, R, K, vals, scales, blocked, stream);
}

cudaError_t dequantize_mxfp8(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                             cudaStream_t stream) {
  return launch_dequantize<false>(vals, scales, R, K, out, stream);
}

cudaError_t dequantize_mxfp8_k64_permuted(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                                         cudaStream_t stream) {
  return launch_dequantize<true>(vals, scales, R, K, out, stream);
}

}  // namespace flash_moe
