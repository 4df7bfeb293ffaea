// quantize_mxfp8 and dequantize_mxfp8 on the GPU (docs/DESIGN.md §6): bandwidth-bound elementwise
// kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"
#include "heuristics.cuh"
#include "mxfp8.cuh"

namespace flash_moe {
namespace {

constexpr int kThreadsPerCta = 256;

int grid_for(int64_t chunks) {
  return heuristics::capped_grid(chunks, kThreadsPerCta, heuristics::kConvertCtasPerSm);
}


// quantize_kernel: every load is 16 bytes per lane and lane-contiguous (a warp reads 512
// contiguous bytes, so no sector is fetched twice), kSlots of them issued before the first use.
// A lane holds kElems elements, kLanesPerBlock lanes share a 32-element scale block, and a
// "unit" = 4 blocks = scale columns 4j..4j+3 of one row (kLanesPerUnit lanes), whose 4 scale
// bytes are contiguous in the blocked layout (and row-major when S % 4 == 0): they are OR-
// gathered by shuffles and stored as one word by the unit's first lane. Units are numbered
// row-major over (out_rows, S4) with out_rows = R, or R rounded up to 128 when blocked: the
// padding rows' units load nothing and store zero words, so the padding needs no memset.
// kPerMatrix (blocked): the R rows are R / mat_rows matrices, each packed on its own, so every
// matrix's rows are padded to a multiple of 128 and a scale row maps back to a source row with a
// division. It is instantiated only where the packings differ (mat_rows % 128 != 0, several
// matrices), so the common shapes keep the division-free loop.
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

template <typename T, bool kPerMatrix>
__global__ void __launch_bounds__(kThreadsPerCta) quantize_kernel(const T* __restrict__ src, int64_t R, int K,
                                                                   uint8_t* __restrict__ vals,
                                                                   uint8_t* __restrict__ scales, int64_t units,
                                                                   int64_t mat_rows, bool blocked, bool words) {
  using G = QuantGeom<T>;
  constexpr int E = G::kElems;
  const int S = K / kMxfp8ScaleBlock;
  const int S4 = (S + 3) / 4;
  const int64_t mat_out_rows = (mat_rows + 127) / 128 * 128;  // kPerMatrix: one matrix's scale rows
  // scale rows written (units = out_rows * S4)
  const int64_t out_rows = kPerMatrix ? R / mat_rows * mat_out_rows : blocked ? (R + 127) / 128 * 128 : R;
  const int ul = threadIdx.x % G::kLanesPerUnit;  // lane within its unit
  const int b = ul / G::kLanesPerBlock;           // block within the unit: scale column 4j + b
  // The loop bound is CTA-uniform, so every lane reaches every shuffle.
  for (int64_t step = blockIdx.x; step * G::kUnitsPerStep < units; step += gridDim.x) {
    int64_t r[kSlots];       // scale row written
    int64_t src_row[kSlots];  // the row it quantizes (r, but for kPerMatrix's padding rows)
    int j[kSlots];
    bool in[kSlots];  // a real block (row < R, column < S)
    uint4 raw[kSlots];
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      // slot c of the CTA covers kThreadsPerCta / kLanesPerUnit consecutive units
      const int64_t u = step * G::kUnitsPerStep + (c * kThreadsPerCta + (int)threadIdx.x) / G::kLanesPerUnit;
      r[c] = u / S4;  // nvcc divides in 32 bits whenever the operands fit
      j[c] = (int)(u - r[c] * S4);
      if constexpr (kPerMatrix) {
        const int64_t mat = r[c] / mat_out_rows, row_in_mat = r[c] - mat * mat_out_rows;
        src_row[c] = mat * mat_rows + row_in_mat;
        in[c] = r[c] < out_rows && row_in_mat < mat_rows && 4 * j[c] + b < S;
      } else {
        src_row[c] = r[c];
        in[c] = r[c] < R && 4 * j[c] + b < S;
      }
      raw[c] = make_uint4(0u, 0u, 0u, 0u);  // padding blocks quantize zeros: scale byte 0
      if (in[c]) raw[c] = ld_stream16(src + src_row[c] * K + j[c] * 128 + ul * E);
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
        uint8_t* const vp = vals + src_row[c] * K + j[c] * 128 + ul * E;
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

// One thread per 16 elements (half a scale block): dequantize_mxfp8, row-major bf16 out.
__global__ void __launch_bounds__(kThreadsPerCta) dequantize_kernel(const uint8_t* __restrict__ vals,
                                                                     const uint8_t* __restrict__ scales, int64_t R,
                                                                     int K, uint16_t* __restrict__ out) {
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
    reinterpret_cast<uint4*>(out + i * 16)[0] = lo;
    reinterpret_cast<uint4*>(out + i * 16)[1] = hi;
  }
}

// The MXFP8 GEMM's x pre-pass: x (R, K) -> 2-byte values with every 64-wide K block written
// K-permuted for the register-operand path (moe_gemm_consumer_mxfp8.cuh, kperm: logical
// 16c + 4s + j at physical 16s + 8(j >> 1) + 2c + (j & 1)). When the scale-window scan found
// every row inside the f16 window (*window.misfit == 0) the values are f16 q * 2^(byte - top + 7)
// (mx::kWindow), else bf16. Thread c of each group of 4 converts chunk c (16 values) of one
// 64-block, whose 8 pairs belong at words 8s + 4h + c (pair 2s + h) of the permuted block. A CTA
// puts kPermBlocks blocks so in shared memory, then stores them with 16-byte stores by
// consecutive lanes, whole sectors (stored from registers, a block took 32 four-byte stores).
struct WindowOut {
  const uint8_t* top;      // per row
  const uint32_t* misfit;  // 0: write f16
};
constexpr int kPermBlocks = kThreadsPerCta / 4;
constexpr int kPermBlockWords = 32 + 4;  // padded: a warp's shared stores hit 32 banks; blocks stay 16-byte aligned

__global__ void __launch_bounds__(kThreadsPerCta) dequantize_k64_permuted_kernel(const uint8_t* __restrict__ vals,
                                                                                  const uint8_t* __restrict__ scales,
                                                                                  int64_t R, int K,
                                                                                  uint16_t* __restrict__ out,
                                                                                  WindowOut window) {
  __shared__ __align__(16) uint32_t staged[kPermBlocks * kPermBlockWords];
  const int chunks_per_row = K / 16;
  const int S = K / kMxfp8ScaleBlock;
  const int64_t total = R * (K / 64);  // 64-blocks
  const bool f16 = *window.misfit == 0u;
  const int b = threadIdx.x / 4, c = threadIdx.x % 4;
  for (int64_t first = (int64_t)blockIdx.x * kPermBlocks; first < total; first += (int64_t)gridDim.x * kPermBlocks) {
    if (first + b < total) {
      const int64_t i = (first + b) * 4 + c;  // the thread's 16-value chunk
      const int64_t r = i / chunks_per_row;
      const int q = (int)(i - r * chunks_per_row);
      const uint4 v = *reinterpret_cast<const uint4*>(vals + i * 16);
      const uint32_t byte = scales[r * S + q / 2];
      uint4 lo, hi;
      if (f16)
        mx::dequant16_f16(v, mx::f16x2_scale(byte, window.top[r]), lo, hi);
      else
        mx::dequant16(v, byte, lo, hi);
      const uint32_t o[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};  // pairs (2k, 2k+1) of the chunk
      uint32_t* block = staged + b * kPermBlockWords;
#pragma unroll
      for (int k = 0; k < 8; ++k) block[8 * (k / 2) + 4 * (k % 2) + c] = o[k];
    }
    __syncthreads();
#pragma unroll
    for (int u = threadIdx.x; u < kPermBlocks * 8; u += kThreadsPerCta) {
      const int ub = u / 8, m = u % 8;
      if (first + ub < total)
        reinterpret_cast<uint4*>(out)[(first + ub) * 8 + m] =
            *reinterpret_cast<const uint4*>(staged + ub * kPermBlockWords + 4 * m);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- the f16 scale window scan
// Per row: top = its largest scale byte other than 255, raised to at least mx::kTopMin. The row
// fits the window when top <= mx::kTopMax and every other byte (255 aside) is at least
// top - mx::kWindow or scales an all-zero block (its 32 values are read to check). One misfit
// row anywhere sets *misfit (zero before the launch); so does `force`.
__device__ __forceinline__ bool block_is_zero(const uint8_t* v) {  // 32 e4m3 values, 16-byte aligned
  const uint4 a = reinterpret_cast<const uint4*>(v)[0], b = reinterpret_cast<const uint4*>(v)[1];
  return ((a.x | a.y | a.z | a.w | b.x | b.y | b.z | b.w) & 0x7f7f7f7fu) == 0u;
}
__device__ __forceinline__ int raise_top(int top) { return top < mx::kTopMin ? mx::kTopMin : top; }
__device__ __forceinline__ bool below_window(uint32_t byte, int top) {
  return byte != 255u && static_cast<int>(byte) < top - mx::kWindow;
}

constexpr int kScanThreads = 128;

// Blocks [0, w_blocks): weight rows, a block per 128-row group. In the blocked layout the
// group's four scale columns 4j..4j+3 are one 512-byte chunk whose 16 bytes at 16 l hold rows
// l, l + 32, l + 64, l + 96: so lane l of a warp reads them with one 16-byte load (a warp a
// whole chunk) and keeps those four rows' top and lowest bytes. The four warps take every
// fourth chunk (so each row's bytes are read by four warps at once, not one after another)
// and meet in shared memory; then thread t finishes row t. Blocks after: token rows, one warp
// per row, row-major scales.
constexpr int kScanWarps = kScanThreads / 32;
__global__ void __launch_bounds__(kScanThreads)
    window_scan_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ w_scales, int64_t w_rows,
                       int64_t w_blocks, const uint8_t* __restrict__ x, const uint8_t* __restrict__ x_scales,
                       int64_t x_rows, int K, uint8_t* __restrict__ w_top, uint8_t* __restrict__ x_top,
                       uint32_t* __restrict__ misfit, bool force) {
  if (force && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(misfit, 1u);
  const int S = K / kMxfp8ScaleBlock;
  bool fits = true;
  if ((int64_t)blockIdx.x < w_blocks) {
    __shared__ uint8_t part_top[kScanWarps][128], part_low[kScanWarps][128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int64_t group = blockIdx.x;
    const int S4 = (S + 3) / 4;
    const uint4* chunks = reinterpret_cast<const uint4*>(w_scales + (uint64_t)group * S4 * 512) + lane;
    int top[4] = {0, 0, 0, 0}, low[4] = {255, 255, 255, 255};
#pragma unroll 4
    for (int j = warp; j < S4; j += kScanWarps) {
      const uint4 v = chunks[(int64_t)j * 32];  // chunk j: 512 bytes = 32 uint4 further
      const uint32_t wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int b = (wd[q] >> (8 * c)) & 255;
          if (4 * j + c < S && b != 255) top[q] = b > top[q] ? b : top[q], low[q] = b < low[q] ? b : low[q];
        }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      part_top[warp][lane + 32 * q] = (uint8_t)top[q];
      part_low[warp][lane + 32 * q] = (uint8_t)low[q];
    }
    __syncthreads();
    const int t = threadIdx.x;  // row t of the group
    const int64_t r = group * 128 + t;
    if (r >= w_rows) return;  // the layout's padding rows
    int row_top = 0, row_low = 255;
#pragma unroll
    for (int k = 0; k < kScanWarps; ++k) {
      row_top = part_top[k][t] > row_top ? part_top[k][t] : row_top;
      row_low = part_low[k][t] < row_low ? part_low[k][t] : row_low;
    }
    const int top_r = raise_top(row_top);
    fits = top_r <= mx::kTopMax;
    if (fits && row_low < top_r - mx::kWindow)  // rare: are the blocks below the window all zero?
      for (int sc = 0; sc < S; ++sc)
        if (below_window(w_scales[mx::blocked_offset((uint64_t)r, (uint32_t)sc, (uint32_t)S)], top_r) &&
            !block_is_zero(w + r * K + 32 * sc))
          fits = false;
    w_top[r] = (uint8_t)top_r;
  } else {
    const int lane = threadIdx.x & 31;
    const int64_t r = ((int64_t)blockIdx.x - w_blocks) * (kScanThreads / 32) + threadIdx.x / 32;
    if (r >= x_rows) return;  // whole warps
    const uint8_t* row = x_scales + r * S;
    int top = 0;
    for (int s = lane; s < S; s += 32) {
      const int b = row[s];
      if (b != 255) top = b > top ? b : top;
    }
    top = raise_top(__reduce_max_sync(0xffffffffu, top));
    fits = top <= mx::kTopMax;
    for (int s = lane; s < S; s += 32)
      if (below_window(row[s], top) && !block_is_zero(x + r * K + 32 * s)) fits = false;
    fits = __all_sync(0xffffffffu, fits);
    if (lane != 0) return;
    x_top[r] = (uint8_t)top;
  }
  if (!fits) atomicOr(misfit, 1u);
}

template <typename T>
cudaError_t launch_quantize(const void* src, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales, int64_t mat_rows,
                            bool blocked, cudaStream_t stream) {
  const int64_t S = K / kMxfp8ScaleBlock;
  // Per-matrix packing equals packing all R rows as one matrix unless mat_rows % 128 != 0.
  const bool per_matrix = blocked && mat_rows < R && mat_rows % 128 != 0;
  const int64_t out_rows = per_matrix ? R / mat_rows * mxfp8_blocked_rows(mat_rows)
                                      : blocked ? mxfp8_blocked_rows(R) : R;
  const int64_t units = out_rows * mxfp8_scale_col_groups(S);
  if (units == 0) return cudaSuccess;
  // Word stores need 4 contiguous, aligned bytes per unit: always in the blocked layout,
  // row-major only when S % 4 == 0; otherwise each block's first lane stores its byte.
  const bool words = (blocked || S % 4 == 0) && reinterpret_cast<uintptr_t>(scales) % 4 == 0;
  // One step per CTA (as rmsnorm's forward: the hardware backfills finished CTAs); the kernel's
  // grid-stride loop only matters past the grid-size limit.
  const int64_t steps = (units + QuantGeom<T>::kUnitsPerStep - 1) / QuantGeom<T>::kUnitsPerStep;
  const int grid = (int)(steps < (1 << 30) ? steps : (1 << 30));
  auto kernel = per_matrix ? quantize_kernel<T, true> : quantize_kernel<T, false>;
  kernel<<<grid, kThreadsPerCta, 0, stream>>>(static_cast<const T*>(src), R, (int)K, vals, scales, units, mat_rows,
                                              blocked, words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_mxfp8(const void* src, FloatKind kind, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales,
                           int64_t mat_rows, bool blocked, cudaStream_t stream) {
  if (K % kMxfp8ScaleBlock != 0 || K <= 0 || R < 0) return cudaErrorInvalidValue;
  if (R == 0) return cudaSuccess;
  if (mat_rows <= 0 || R % mat_rows != 0) return cudaErrorInvalidValue;
  return kind == FloatKind::kBf16 ? launch_quantize<__nv_bfloat16>(src, R, K, vals, scales, mat_rows, blocked, stream)
                                  : launch_quantize<float>(src, R, K, vals, scales, mat_rows, blocked, stream);
}

cudaError_t dequantize_mxfp8(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                             cudaStream_t stream) {
  if (K % kMxfp8ScaleBlock != 0 || K <= 0) return cudaErrorInvalidValue;
  const int64_t chunks = R * (K / 16);
  if (chunks == 0) return cudaSuccess;
  dequantize_kernel<<<grid_for(chunks), kThreadsPerCta, 0, stream>>>(vals, scales, R, (int)K,
                                                                     static_cast<uint16_t*>(out));
  return cudaGetLastError();
}

cudaError_t dequantize_mxfp8_k64_permuted(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                                         const uint8_t* window_top, const uint32_t* window_misfit,
                                         cudaStream_t stream) {
  if (K % 64 != 0 || K <= 0 || window_misfit == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = R * (K / 64);
  if (blocks == 0) return cudaSuccess;
  dequantize_k64_permuted_kernel<<<grid_for(blocks * 4), kThreadsPerCta, 0, stream>>>(
      vals, scales, R, (int)K, static_cast<uint16_t*>(out), WindowOut{window_top, window_misfit});
  return cudaGetLastError();
}

cudaError_t mxfp8_scale_window(const uint8_t* w, const uint8_t* w_scales, int64_t w_rows, const uint8_t* x,
                               const uint8_t* x_scales, int64_t x_rows, int64_t K, bool force_misfit,
                               uint8_t* w_top, uint8_t* x_top, uint32_t* misfit, cudaStream_t stream) {
  if (K % 64 != 0 || K <= 0) return cudaErrorInvalidValue;
  const bool force = force_misfit || K >= mx::kMaxK;
  const int64_t w_blocks = (w_rows + 127) / 128;
  const int64_t x_blocks = (x_rows + kScanThreads / 32 - 1) / (kScanThreads / 32);
  if (w_blocks + x_blocks == 0) return force ? cudaMemsetAsync(misfit, 1, 1, stream) : cudaSuccess;
  window_scan_kernel<<<(unsigned)(w_blocks + x_blocks), kScanThreads, 0, stream>>>(
      w, w_scales, w_rows, w_blocks, x, x_scales, x_rows, (int)K, w_top, x_top, misfit, force);
  return cudaGetLastError();
}

}  // namespace flash_moe
