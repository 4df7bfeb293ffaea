// The last step of both fused MoE ops: each token's top_k weighted expert rows Y summed in fp32,
// k ascending (deterministic: no atomics), into out.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"
#include "heuristics.cuh"
#include "launch.cuh"

namespace flash_moe {
namespace {

// 8 bf16 added into 8 fp32 in order.
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(b[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

// out[t, :] (+)= sum_k Y[inv[t*top_k+k], :], fp32, k ascending. 8 columns per thread.
__global__ void reduce_kernel(const __nv_bfloat16* __restrict__ Y, const int32_t* __restrict__ inv,
                              __nv_bfloat16* __restrict__ out, int64_t M, int K, int top_k, bool accumulate) {
  sm90::griddep_wait();  // launched while the down GEMM still runs: Y is complete after this
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
      if (pos >= 0) add_bf16x8(acc, *reinterpret_cast<const uint4*>(Y + (int64_t)pos * K + c));
    }
    __nv_bfloat16* o = out + t * K + c;
    if (accumulate) add_bf16x8(acc, *reinterpret_cast<const uint4*>(o));
    uint4 r;
    __nv_bfloat162* rb = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int q = 0; q < 4; ++q) rb[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    *reinterpret_cast<uint4*>(o) = r;
  }
}

}  // namespace

cudaError_t topk_sum(const void* Y, const int32_t* inv, void* out, int64_t M, int64_t K, int top_k,
                     bool split, cudaStream_t stream) {
  using namespace heuristics;
  const int grid = capped_grid(M * (K / 8), kReduceThreads, kReduceCtasPerSm);  // 8 columns per thread
  return host::launch(reduce_kernel, grid, kReduceThreads, 0, true, 1, stream, static_cast<const __nv_bfloat16*>(Y),
                      inv, static_cast<__nv_bfloat16*>(out), M, (int)K, top_k, !split);
}

}  // namespace flash_moe
