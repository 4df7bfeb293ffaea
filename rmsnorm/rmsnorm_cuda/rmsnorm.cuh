// Fused RMSNorm + residual add + MXFP8 quantization (forward) and its backward.
//
// Contract: docs/DESIGN.md §6 (MXFP8 conventions) and §7 (rmsnorm).
//
//   rrms[n]   = 1 / sqrt(mean_c(branch[n,c]^2) + eps)                      (fp32)
//   y[n,c]    = ((branch[n,c] * rrms[n]) * weight[c]) + residual[n,c]      (fp32, each op RN,
//                                                                           no FMA contraction)
//   scale byte per 32-element block (RCEIL), blocked layout (mxfp8_rules.cuh),
//   vals[n,c] = e4m3_satfinite_rne(y[n,c] * 2^(127 - byte)).
//
// Backward (quantization passed straight through, i.e. d vals / d y := identity):
//   grad_residual = grad_y
//   grad_branch   = rrms * (grad_y * weight) - (rrms^3 / C) * branch * sum_c(grad_y * weight * branch)
//   grad_weight   = sum_n grad_y * branch * rrms   (fp32 per-row-slot partials, then a second,
//                                                  fixed-order reduction kernel: deterministic)
//
// This header is plain CUDA C++ (no torch): a small launcher API over raw pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace rmsnorm {

// Largest hidden size the kernels accept (C must also be a multiple of 32).
constexpr int64_t kMaxC = 32768;
constexpr int kScaleBlock = 32;

// Shape of one launch: each row is handled by `tpr` (threads per row) threads, a multiple of 32,
// <= 1024, each thread owning `vpt` (vectors per thread) 16-byte chunks (8 bf16) of the row;
// `rpb` (rows per block) rows share one CTA.
// Largest CTA each variant is compiled for (__launch_bounds__): the register budget of the
// 4- and 8-chunk variants needs more than 64 registers per thread.
constexpr int fwd_max_threads(int vpt) { return vpt >= 4 ? 512 : 1024; }
constexpr int bwd_max_threads(int vpt, bool smem_acc) { return smem_acc ? 1024 : (vpt >= 4 ? 512 : 1024); }

struct LaunchConfig {
  int vpt = 0;  // vectors per thread: 16-byte chunks of a row each thread owns, 1, 2, 4 or 8
  int tpr = 0;  // threads per row (multiple of 32)
  int rpb = 0;  // rows per block: rows sharing one CTA
  bool smem_acc = false;  // backward only: grad_weight partials in shared memory
};

// The configuration the dispatch rule picks for a hidden size C (the H200 measurements behind
// it: rmsnorm/DESIGN.md).  `block_threads_target` <= 0 means "use the rule".
LaunchConfig forward_config(int64_t C, int vpt = 0, int block_threads_target = 0);
LaunchConfig backward_config(int64_t C, int vpt = 0, int block_threads_target = 0);
// Whether fused_rmsnorm_residual_backward accepts `cfg` for hidden size C (harness enumerations).
bool backward_config_valid(const LaunchConfig& cfg, int64_t C);

// Bytes of the flat blocked scale buffer for an (N, C) input:
// roundup(N,128) * roundup(C/32, 4).
inline int64_t scales_bytes(int64_t N, int64_t C) {
  const int64_t S = C / kScaleBlock;
  return ((N + 127) / 128) * 128 * ((S + 3) / 4) * 4;
}

// Forward.  branch, residual: (N, C) bf16 row-major contiguous; weight: (C,) bf16.
// vals: (N, C) e4m3 bytes; scales: scales_bytes(N, C) bytes (padding written as zeros);
// rrms: (N,) fp32.  cfg == nullptr -> dispatch rule.  Returns the launch error, if any.
cudaError_t fused_rmsnorm_residual_forward(const void* branch, const void* residual,
                                           const void* weight, uint8_t* vals, uint8_t* scales,
                                           float* rrms, int64_t N, int64_t C, float eps,
                                           cudaStream_t stream,
                                           const LaunchConfig* cfg = nullptr);

// Backward.  grad_y, branch: (N, C) bf16; weight: (C,) bf16; rrms: (N,) fp32.
// grad_branch: (N, C) bf16; grad_weight: (C,) bf16.
// workspace: backward_workspace_floats(...) floats of scratch (per-row-slot partial sums).
int64_t backward_num_partials(int64_t N, int64_t C, int device, const LaunchConfig* cfg = nullptr);
inline int64_t backward_workspace_floats(int64_t N, int64_t C, int device,
                                         const LaunchConfig* cfg = nullptr) {
  return backward_num_partials(N, C, device, cfg) * C;
}
cudaError_t fused_rmsnorm_residual_backward(const void* grad_y, const void* branch,
                                            const void* weight, const float* rrms,
                                            void* grad_branch, void* grad_weight,
                                            float* workspace, int64_t N, int64_t C, int device,
                                            cudaStream_t stream,
                                            const LaunchConfig* cfg = nullptr);


#ifdef __CUDACC__
// ---- device helpers shared by the two translation units ----
namespace detail {

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  // Read-once data: read-only path, do not allocate in L1.
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_keep(const void* p) {
  // Re-read data (the weight): read-only path, cached.
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
  f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
  f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
  f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}
// fp32 -> bf16 round-to-nearest-even (NaN kept quiet).
__device__ __forceinline__ uint32_t f2bf(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
  return f2bf(lo) | (f2bf(hi) << 16);
}

}  // namespace detail
#endif  // __CUDACC__

}  // namespace rmsnorm
