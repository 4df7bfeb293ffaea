// fused_moe_bf16 for Hopper (sm_90a): two persistent, warp-specialized wgmma GEMMs plus a
// deterministic top-k reduction.
//
//   GEMM1 (gate/up):  h[p, :] = silu(x[tok(p)] @ Wg[e]^T) * (x[tok(p)] @ Wu[e]^T)   (bf16 h)
//       A rows are GATHERED from x by the producer warpgroup with cp.async (16-byte chunks,
//       written in the 128-byte-swizzled layout wgmma reads; zero-filled for padding rows),
//       B (gate and up rows of w[e]) arrives by TMA. SwiGLU is applied to the fp32
//       accumulators in the epilogue; h is stored in sorted (padded) order.
//   GEMM2 (down):     Y[p, :] = topk_weight[slot(p)] * (h[p] @ W2[e]^T)              (bf16 Y)
//       A = h rows (contiguous in sorted order) and B = w2[e] rows both by TMA. The router
//       weight is applied to the fp32 accumulators in the epilogue.
//   reduce:           out[t] (+)= sum_{k=0..top_k-1} Y[pos(t*top_k+k)]  in fp32, fixed k order
//       pos() is the inverse of sorted_ids (built by a scatter kernel). No float atomics, so
//       the result is bit-identical run after run.
//
// Both GEMMs: 128 x 256 x 64 tiles (GEMM1: 128 gate + 128 up columns -> 128 h columns;
// GEMM2: 256 output columns), kStages-deep smem ring guarded by mbarriers, 1 producer
// warpgroup + 2 consumer warpgroups (64 rows each, two m64n128k16 accumulators), persistent
// grid striding over the (m-block, n-block) tiles that exist (num_tokens_post_padded is read
// on the device).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"

namespace flash_moe {
namespace {

constexpr int kBM = kBlockM;         // 128 rows per tile
constexpr int kBK = 64;              // 64 bf16 = 128 bytes: one swizzle-128B row
constexpr int kABytes = kBM * kBK * 2;        // 16 KB
constexpr int kBBytes = 2 * 128 * kBK * 2;    // 32 KB (two 128-row boxes)
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kThreads = 384;        // producer WG + 2 consumer WGs
[[maybe_unused]] constexpr int kGatherLag = 2;        // cp.async groups kept in flight (FLASH_MOE_GATHER_FENCE=1 variant)
#ifndef FLASH_MOE_GATHER_FENCE
#define FLASH_MOE_GATHER_FENCE 0
#endif

struct GemmParams {
  const __nv_bfloat16* x;       // mode 0: gathered A source (M, K)
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;
  const float* topk_weights;    // mode 1
  __nv_bfloat16* out;           // mode 0: h (L, I); mode 1: Y (L, Kd)
  int64_t lda;                  // mode 0: row stride of x (= K)
  int64_t ldo;                  // row stride of out
  int L;                        // sorted_ids length
  int n_slots;                  // M * top_k (sentinel)
  int top_k;
  int E;
  int K;                        // reduction length
  int n_out;                    // valid output columns
  int num_n;                    // n-blocks per m-block
  int b_second;                 // row offset of the second B box relative to n0-block base
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* tm, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(tm), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* tm, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(tm), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
[[maybe_unused]] __device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// K-major operand, 128-byte swizzle, 8-row core groups 1024 bytes apart.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr) {
  uint64_t d = 0;
  d |= (uint64_t)((addr & 0x3FFFF) >> 4);
  d |= (uint64_t)1 << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}


template <int kMode>
__device__ __forceinline__ bool tile_coords(const GemmParams& p, int tile, int& m0, int& nb, int& e) {
  const int mb = tile / p.num_n;
  nb = tile - mb * p.num_n;
  m0 = mb * kBM;
  e = p.expert_ids[mb];
  return e >= 0 && e < p.E;
}

// kMode 0: gate/up GEMM with gathered A and SwiGLU epilogue. kMode 1: down GEMM with TMA A
// and router-weight epilogue.
template <int kMode, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                    const GemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  const uint32_t full0 = sbase + kStages * kStageBytes;
  const uint32_t empty0 = full0 + kStages * 8;

  int ntpp = *p.ntpp;
  ntpp = ntpp < 0 ? 0 : (ntpp > p.L ? p.L : ntpp);
  const int total = (ntpp + kBM - 1) / kBM * p.num_n;
  const int nk = (p.K + kBK - 1) / kBK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, kMode == 0 ? 129 : 1);
      mbar_init(empty0 + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    const int t = threadIdx.x;
    uint32_t it = 0;
    if constexpr (kMode == 0) {
      const int c = t & 7, r0 = t >> 3;
      const uint32_t swz = (uint32_t)((c ^ (r0 & 7)) << 4);
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        int m0, nb, e;
        if (!tile_coords<kMode>(p, tile, m0, nb, e)) continue;
        const int n0 = nb * 128;
        const __nv_bfloat16* src[8];
        uint32_t okmask = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int sid = p.sorted_ids[m0 + r0 + 16 * j];
          const bool ok = sid >= 0 && sid < p.n_slots;
          okmask |= (ok ? 1u : 0u) << j;
          src[j] = p.x + (ok ? (int64_t)(sid / p.top_k) * p.lda : 0) + c * 8;
        }
        for (int kb = 0; kb < nk; ++kb) {
          const int s = it % kStages;
          mbar_wait(empty0 + 8 * s, ((it / kStages) & 1) ^ 1);
          const uint32_t a_s = sbase + s * kStageBytes;
          if (t == 0) {
            mbar_arrive_expect_tx(full0 + 8 * s, kBBytes);
            tma_load_3d(a_s + kABytes, &tmB, kb * kBK, n0, e, full0 + 8 * s);
            tma_load_3d(a_s + kABytes + kBBytes / 2, &tmB, kb * kBK, p.b_second + n0, e, full0 + 8 * s);
          }
          const bool kok = kb * kBK + c * 8 < p.K;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const bool ok = kok && ((okmask >> j) & 1u);
            const uint32_t dst = a_s + (uint32_t)(r0 + 16 * j) * 128u + swz;
            cp_async_16(dst, ok ? (const void*)(src[j] + kb * kBK) : (const void*)p.x, ok ? 16u : 0u);
          }
#if FLASH_MOE_GATHER_FENCE
          // conservative variant: wait for the group kGatherLag back, fence, arrive
          cp_async_commit();
          if (it >= (uint32_t)kGatherLag) {
            cp_async_wait<kGatherLag>();
            fence_proxy_async();
            mbar_arrive(full0 + 8 * ((it - kGatherLag) % kStages));
          }
#else
          // non-blocking: the arrive fires when this thread's cp.asyncs so far have landed
          // (same scheme as CUTLASS's SM90 cp.async GMMA mainloop)
          cp_async_arrive_noinc(full0 + 8 * s);
#endif
          ++it;
        }
      }
#if FLASH_MOE_GATHER_FENCE
      cp_async_wait<0>();
      fence_proxy_async();
      for (uint32_t q = (it > (uint32_t)kGatherLag ? it - kGatherLag : 0); q < it; ++q)
        mbar_arrive(full0 + 8 * (q % kStages));
#else
      cp_async_wait<0>();
#endif
    } else {
      if (t == 0) {
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
          int m0, nb, e;
          if (!tile_coords<kMode>(p, tile, m0, nb, e)) continue;
          const int n0 = nb * 256;
          for (int kb = 0; kb < nk; ++kb) {
            const int s = it % kStages;
            mbar_wait(empty0 + 8 * s, ((it / kStages) & 1) ^ 1);
            const uint32_t a_s = sbase + s * kStageBytes;
            const uint32_t bar = full0 + 8 * s;
            mbar_arrive_expect_tx(bar, kABytes + kBBytes);
            tma_load_2d(a_s, &tmA, kb * kBK, m0, bar);
            tma_load_3d(a_s + kABytes, &tmB, kb * kBK, n0, e, bar);
            tma_load_3d(a_s + kABytes + kBBytes / 2, &tmB, kb * kBK, n0 + 128, e, bar);
            ++it;
          }
        }
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    const int cw = wg - 1;
    const int w4 = (threadIdx.x / 32) & 3;
    const int lane = threadIdx.x & 31;
    float acc0[64], acc1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      acc0[i] = 0.f;
      acc1[i] = 0.f;
    }
    uint32_t it = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      int m0, nb, e;
      if (!tile_coords<kMode>(p, tile, m0, nb, e)) continue;
      for (int kb = 0; kb < nk; ++kb) {
        const int s = it % kStages;
        mbar_wait(full0 + 8 * s, (it / kStages) & 1);
        const uint32_t a_base = sbase + s * kStageBytes + cw * (kABytes / 2);
        const uint32_t b_base = sbase + s * kStageBytes + kABytes;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = make_desc(a_base + kk * 32);
          const uint64_t db0 = make_desc(b_base + kk * 32);
          const uint64_t db1 = make_desc(b_base + kBBytes / 2 + kk * 32);
          const int sc = (kb > 0 || kk > 0) ? 1 : 0;
          wgmma_m64n128k16(acc0, da, db0, sc);
          wgmma_m64n128k16(acc1, da, db1, sc);
        }
        wgmma_commit();
        if (kb > 0) {
          wgmma_wait<1>();
          if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % kStages));
        }
        ++it;
      }
      wgmma_wait<0>();
      if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % kStages));

      // ---------------------------------------------------------- epilogue
      const int row_base = m0 + cw * 64 + w4 * 16 + (lane >> 2);
      if constexpr (kMode == 0) {
        const int n0 = nb * 128;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          __nv_bfloat16* orow = p.out + (int64_t)(row_base + 8 * h) * p.ldo;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int col = n0 + j * 8 + (lane & 3) * 2;
            if (col < p.n_out) {
              const float g0 = acc0[4 * j + 2 * h], g1 = acc0[4 * j + 2 * h + 1];
              const float u0 = acc1[4 * j + 2 * h], u1 = acc1[4 * j + 2 * h + 1];
              const float v0 = g0 / (1.f + __expf(-g0)) * u0;
              const float v1 = g1 / (1.f + __expf(-g1)) * u1;
              *reinterpret_cast<__nv_bfloat162*>(orow + col) = __floats2bfloat162_rn(v0, v1);
            }
          }
        }
      } else {
        const int n0 = nb * 256;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_base + 8 * h;
          const int sid = p.sorted_ids[row];
          const float wt = (sid >= 0 && sid < p.n_slots) ? p.topk_weights[sid] : 0.f;
          __nv_bfloat16* orow = p.out + (int64_t)row * p.ldo;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int col = n0 + j * 8 + (lane & 3) * 2;
            if (col < p.n_out)
              *reinterpret_cast<__nv_bfloat162*>(orow + col) =
                  __floats2bfloat162_rn(acc0[4 * j + 2 * h] * wt, acc0[4 * j + 2 * h + 1] * wt);
            if (col + 128 < p.n_out)
              *reinterpret_cast<__nv_bfloat162*>(orow + col + 128) =
                  __floats2bfloat162_rn(acc1[4 * j + 2 * h] * wt, acc1[4 * j + 2 * h + 1] * wt);
          }
        }
      }
    }
  }
}

// inv[slot] = position of slot in sorted_ids (only for valid slots in valid blocks).
__global__ void inverse_kernel(const int32_t* __restrict__ sorted_ids, const int32_t* __restrict__ expert_ids,
                               const int32_t* __restrict__ ntpp_ptr, int L, int n_slots, int E,
                               int32_t* __restrict__ inv) {
  int ntpp = *ntpp_ptr;
  ntpp = ntpp < 0 ? 0 : (ntpp > L ? L : ntpp);
  for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < ntpp; pos += gridDim.x * blockDim.x) {
    const int sid = sorted_ids[pos];
    const int e = expert_ids[pos / kBM];
    if (sid >= 0 && sid < n_slots && e >= 0 && e < E) inv[sid] = pos;
  }
}

// out[t, :] (+)= sum_k Y[inv[t*top_k+k], :], fp32, k ascending. 8 columns per thread.
__global__ void reduce_kernel(const __nv_bfloat16* __restrict__ Y, const int32_t* __restrict__ inv,
                              __nv_bfloat16* __restrict__ out, int64_t M, int K, int top_k, bool accumulate) {
  const int cpr = K / 8;
  const int64_t total = M * cpr;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / cpr;
    const int c = (int)(i - t * cpr) * 8;
    float acc[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = 0.f;
    for (int k = 0; k < top_k; ++k) {
      const int pos = inv[t * top_k + k];
      if (pos >= 0) {
        const uint4 v = *reinterpret_cast<const uint4*>(Y + (int64_t)pos * K + c);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(b[q]);
          acc[2 * q] += f.x;
          acc[2 * q + 1] += f.y;
        }
      }
    }
    __nv_bfloat16* o = out + t * K + c;
    if (accumulate) {
      const uint4 v = *reinterpret_cast<const uint4*>(o);
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(b[q]);
        acc[2 * q] += f.x;
        acc[2 * q + 1] += f.y;
      }
    }
    uint4 r;
    __nv_bfloat162* rb = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int q = 0; q < 4; ++q) rb[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    *reinterpret_cast<uint4*>(o) = r;
  }
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn get_encode_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return (EncodeTiledFn) nullptr;
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// bf16 tensor map, innermost dim first; box {64, 128, 1...}, swizzle 128B, OOB -> zeros.
bool make_tmap(CUtensorMap* tm, const void* ptr, int rank, const uint64_t* dims, const uint64_t* strides_bytes) {
  EncodeTiledFn fn = get_encode_fn();
  if (!fn) return false;
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t box[3], estr[3];
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims[i];
    box[i] = i == 0 ? kBK : (i == 1 ? 128 : 1);
    estr[i] = 1;
  }
  for (int i = 0; i < rank - 1; ++i) gstride[i] = strides_bytes[i];
  return fn(tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(ptr), gdim, gstride, box, estr,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return n;
}

template <int kMode, int kStages>
cudaError_t launch_gemm(const CUtensorMap& tmA, const CUtensorMap& tmB, const GemmParams& p, cudaStream_t stream) {
  const int smem = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  auto kern = moe_gemm_kernel<kMode, kStages>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int64_t max_tiles = (int64_t)(p.L / kBM) * p.num_n;
  if (max_tiles == 0) return cudaSuccess;
  const int grid = (int)(max_tiles < num_sms() ? max_tiles : num_sms());
  kern<<<grid, kThreads, smem, stream>>>(tmA, tmB, p);
  return cudaGetLastError();
}

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

size_t fused_moe_bf16_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
  return align256((size_t)L * I * 2) + align256((size_t)L * K * 2) + align256((size_t)M * top_k * 4);
}

cudaError_t fused_moe_bf16(const FusedMoeBf16Args& a, cudaStream_t stream) {
  if (a.stages != 3 && a.stages != 4) return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  uint8_t* ws = static_cast<uint8_t*>(a.workspace);
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(ws);
  __nv_bfloat16* Y = reinterpret_cast<__nv_bfloat16*>(ws + align256((size_t)a.L * a.I * 2));
  int32_t* inv = reinterpret_cast<int32_t*>(ws + align256((size_t)a.L * a.I * 2) + align256((size_t)a.L * a.K * 2));
  const int n_slots = (int)(a.M * a.top_k);

  cudaError_t err = cudaMemsetAsync(inv, 0xFF, (size_t)n_slots * 4, stream);
  if (err != cudaSuccess) return err;

  if (a.L > 0) {
    CUtensorMap tm_w, tm_h, tm_w2;
    {
      const uint64_t dims[3] = {(uint64_t)a.K, (uint64_t)(2 * a.I), (uint64_t)a.E};
      const uint64_t str[2] = {(uint64_t)a.K * 2, (uint64_t)(2 * a.I) * a.K * 2};
      if (!make_tmap(&tm_w, a.w, 3, dims, str)) return cudaErrorInvalidValue;
    }
    {
      const uint64_t dims[2] = {(uint64_t)a.I, (uint64_t)a.L};
      const uint64_t str[1] = {(uint64_t)a.I * 2};
      if (!make_tmap(&tm_h, h, 2, dims, str)) return cudaErrorInvalidValue;
    }
    {
      const uint64_t dims[3] = {(uint64_t)a.I, (uint64_t)a.K, (uint64_t)a.E};
      const uint64_t str[2] = {(uint64_t)a.I * 2, (uint64_t)a.K * a.I * 2};
      if (!make_tmap(&tm_w2, a.w2, 3, dims, str)) return cudaErrorInvalidValue;
    }
    GemmParams p1{};
    p1.x = static_cast<const __nv_bfloat16*>(a.x);
    p1.sorted_ids = a.sorted_ids;
    p1.expert_ids = a.expert_ids;
    p1.ntpp = a.ntpp;
    p1.topk_weights = a.topk_weights;
    p1.out = h;
    p1.lda = a.K;
    p1.ldo = a.I;
    p1.L = (int)a.L;
    p1.n_slots = n_slots;
    p1.top_k = a.top_k;
    p1.E = (int)a.E;
    p1.K = (int)a.K;
    p1.n_out = (int)a.I;
    p1.num_n = (int)((a.I + 127) / 128);
    p1.b_second = (int)a.I;
    GemmParams p2 = p1;
    p2.out = Y;
    p2.ldo = a.K;
    p2.K = (int)a.I;
    p2.n_out = (int)a.K;
    p2.num_n = (int)((a.K + 255) / 256);
    p2.b_second = 128;
    if (a.stages == 4) {
      if ((err = launch_gemm<0, 4>(tm_w, tm_w, p1, stream)) != cudaSuccess) return err;
      if ((err = launch_gemm<1, 4>(tm_h, tm_w2, p2, stream)) != cudaSuccess) return err;
    } else {
      if ((err = launch_gemm<0, 3>(tm_w, tm_w, p1, stream)) != cudaSuccess) return err;
      if ((err = launch_gemm<1, 3>(tm_h, tm_w2, p2, stream)) != cudaSuccess) return err;
    }
    const int ib = 256;
    int ig = (int)((a.L + ib - 1) / ib);
    if (ig > 4 * num_sms()) ig = 4 * num_sms();
    inverse_kernel<<<ig, ib, 0, stream>>>(a.sorted_ids, a.expert_ids, a.ntpp, (int)a.L, n_slots, (int)a.E, inv);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  const int64_t work = a.M * (a.K / 8);
  const int rb = 256;
  int64_t rg = (work + rb - 1) / rb;
  if (rg > 16 * num_sms()) rg = 16 * num_sms();
  reduce_kernel<<<(int)rg, rb, 0, stream>>>(Y, inv, static_cast<__nv_bfloat16*>(a.out), a.M, (int)a.K, a.top_k,
                                            !a.split);
  return cudaGetLastError();
}

}  // namespace flash_moe
