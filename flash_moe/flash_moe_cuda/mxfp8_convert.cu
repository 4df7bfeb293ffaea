// quantize_mxfp8 and dequantize_mxfp8 on the GPU (DESIGN §6): bandwidth-bound elementwise
// kernels, 16 elements (half a scale block) per thread.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"
#include "mxfp8.cuh"

namespace flash_moe {
namespace {

constexpr int kThreadsPerCta = 256;

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = __uint_as_float(w[q] << 16);
    f[2 * q + 1] = __uint_as_float(w[q] & 0xffff0000u);
  }
}

__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p + 4 * h));
    f[4 * h] = v.x;
    f[4 * h + 1] = v.y;
    f[4 * h + 2] = v.z;
    f[4 * h + 3] = v.w;
  }
}

int grid_for(int64_t chunks) {
  const int64_t want = (chunks + kThreadsPerCta - 1) / kThreadsPerCta;
  const int64_t cap = (int64_t)sm_count() * 16;  // enough CTAs to keep every SM's load queue full
  return (int)(want < cap ? want : cap);
}


// A thread owns 16 consecutive elements (half a scale block: the 2 threads of a block are
// adjacent lanes and exchange amax with one shuffle) and stores 16 e4m3 bytes at once. A CTA
// step covers kUnroll x 256 such units, every load of a step issued before the first use. The
// loop bound is CTA-uniform so every lane reaches the shuffle; lanes past the end carry zeros
// and store nothing.
constexpr int kUnroll = 2;

template <typename T>
__global__ void __launch_bounds__(kThreadsPerCta) quantize_kernel(const T* __restrict__ src, int64_t R, int K,
                                                                   uint8_t* __restrict__ vals,
                                                                   uint8_t* __restrict__ scales, bool blocked) {
  const int units_per_row = K / 16;
  const int S = K / kMxfp8ScaleBlock;
  const int64_t total = R * units_per_row;
  constexpr int64_t kStep = (int64_t)kUnroll * kThreadsPerCta;
  for (int64_t base = (int64_t)blockIdx.x * kStep; base < total; base += (int64_t)gridDim.x * kStep) {
    float f[kUnroll][16];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreadsPerCta + threadIdx.x;
      if (i < total) {
        load8(src + i * 16, *reinterpret_cast<float(*)[8]>(&f[u][0]));
        load8(src + i * 16 + 8, *reinterpret_cast<float(*)[8]>(&f[u][8]));
      } else {
#pragma unroll
        for (int q = 0; q < 16; ++q) f[u][q] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreadsPerCta + threadIdx.x;
      uint32_t amax = 0;
#pragma unroll
      for (int q = 0; q < 16; ++q) amax = max(amax, __float_as_uint(f[u][q]) & 0x7fffffffu);
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      const uint32_t byte = mx::scale_byte_from_amax_bits(amax);
      const float m = mx::quant_multiplier(byte);
      if (i >= total) continue;
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = mx::e4m3x2_from_floats(__fmul_rn(f[u][4 * j], m), __fmul_rn(f[u][4 * j + 1], m)) |
               (mx::e4m3x2_from_floats(__fmul_rn(f[u][4 * j + 2], m), __fmul_rn(f[u][4 * j + 3], m)) << 16);
      *reinterpret_cast<uint4*>(vals + i * 16) = make_uint4(w[0], w[1], w[2], w[3]);
      if ((i & 1) == 0) {
        const int64_t r = i / units_per_row;
        const int s = (int)(i - r * units_per_row) / 2;
        scales[blocked ? mx::blocked_offset(r, s, S) : r * S + s] = (uint8_t)byte;
      }
    }
  }
}

// One thread per 16 elements (half a scale block). kK64Permuted: every 64-wide K block is
// written K-permuted for the MXFP8 GEMM's register-operand path (moe_gemm.cuh, kperm):
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

}  // namespace

cudaError_t quantize_mxfp8(const void* src, FloatKind kind, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales,
                           bool blocked, cudaStream_t stream) {
  if (K % kMxfp8ScaleBlock != 0 || K <= 0) return cudaErrorInvalidValue;
  const int64_t S = K / kMxfp8ScaleBlock;
  if (blocked) {  // padding rows/columns of the blocked layout are zeros
    const cudaError_t err = cudaMemsetAsync(scales, 0, (size_t)((R + 127) / 128 * 128) * ((S + 3) / 4 * 4), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t units = R * (K / 16);
  if (units == 0) return cudaSuccess;
  const int grid = grid_for((units + kUnroll - 1) / kUnroll);
  if (kind == FloatKind::kBf16)
    quantize_kernel<__nv_bfloat16><<<grid, kThreadsPerCta, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), R,
                                                                         (int)K, vals, scales, blocked);
  else
    quantize_kernel<float><<<grid, kThreadsPerCta, 0, stream>>>(static_cast<const float*>(src), R, (int)K, vals,
                                                                scales, blocked);
  return cudaGetLastError();
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
