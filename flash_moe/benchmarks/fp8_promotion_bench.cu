// Microbenchmark behind flash_moe/DESIGN.md's "fp8 wgmma with per-32-K promotion" alternative for
// fused_moe_mxfp8: can fp8 wgmma with exact MX block scaling (acc += partial * 2^(sa_row +
// sb_col) after every k32 wgmma) beat bf16 wgmma on Hopper? Four loops of the same FLOPs per
// CTA, one CTA per SM, 2 warpgroups each computing m64n128 per step; the operands are whatever
// shared memory holds, since only throughput is measured:
//   bf16:  2 x m64n128k16 bf16 wgmma per step (k32), accumulated in place
//   fp8:   1 x m64n128k32 e4m3 wgmma per step, accumulated in place (no MX scaling: the ceiling)
//   fp8 + promotion, 1 partial: wgmma into a fresh partial (scale-d 0), wait, then
//          acc += partial * (sa[row] * sb[col]): a multiply and an FMA per accumulator
//   fp8 + promotion, 2 partials: two partials alternate, so the promotion of one can overlap
//          the warpgroup's next wgmma (ptxas still serializes part of it: warning C7514)
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/fp8_promotion_bench \
//     flash_moe/benchmarks/fp8_promotion_bench.cu && /tmp/fp8_promotion_bench
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "../flash_moe_cuda/sm90.cuh"

using namespace flash_moe::sm90;

// D(64x128, fp32) (+)= A(64x32, e4m3, smem) * B(128x32, e4m3, smem)^T; scale_d = 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <int kMode>
__global__ void __launch_bounds__(256, 1) bench(int steps, float* sink, const float* scales) {
  __shared__ __align__(1024) uint8_t smem[2 * 8192 + 16384];
  for (int i = threadIdx.x; i < (int)sizeof(smem) / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t a_s = base + wg * 8192, b_s = base + 16384;
  float acc[64], p0[64], p1[kMode == 3 ? 64 : 1];
#pragma unroll
  for (int i = 0; i < 64; ++i) { acc[i] = 0.f; p0[i] = 0.f; }
#pragma unroll
  for (int i = 0; i < (kMode == 3 ? 64 : 1); ++i) p1[i] = 0.f;
  // per-thread scale factors: 2 rows x 32 columns, varying per step (exact powers of two)
  const int lane = threadIdx.x & 31;
  float sa0 = scales[lane], sa1 = scales[lane + 32];
  float sb[kMode == 3 ? 8 : 32];
#pragma unroll
  for (int j = 0; j < (kMode == 3 ? 8 : 32); ++j) sb[j] = scales[(j + lane) & 63];
  if constexpr (kMode <= 1) {
    // k32 per step, accumulated in place: two bf16 k16 halves (32 bytes each), or one e4m3 k32
    // (32 bytes); either way the steps walk the 128-byte rows
    for (int s = 0; s < steps; ++s) {
      const int k = kMode == 0 ? (s & 1) * 64 : (s & 3) * 32;
      wgmma_fence();
      if constexpr (kMode == 0) {
        wgmma_m64n128k16_bf16(acc, make_desc_sw128(a_s + k), make_desc_sw128(b_s + k), 1);
        wgmma_m64n128k16_bf16(acc, make_desc_sw128(a_s + k + 32), make_desc_sw128(b_s + k + 32), 1);
      } else {
        wgmma_m64n128k32_e4m3(acc, make_desc_sw128(a_s + k), make_desc_sw128(b_s + k), 1);
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
  } else if constexpr (kMode == 2) {
    // one partial per warpgroup: wgmma, wait, promote (the other warpgroup's wgmma overlaps)
    for (int s = 0; s < steps; ++s) {
      const int k = s & 3;
      wgmma_fence();
      wgmma_m64n128k32_e4m3(p0, make_desc_sw128(a_s + k * 32), make_desc_sw128(b_s + k * 32), 0);
      wgmma_commit();
      wgmma_wait<0>();
      const float f = (s & 1) ? 0.5f : 1.f, r0 = sa0 * f, r1 = sa1 * f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[4 * j + e] = fmaf(p0[4 * j + e], ((e & 2) ? r1 : r0) * sb[(2 * j + (e & 1)) & 31], acc[4 * j + e]);
    }
  } else {
    // two partials alternating: the promotion of one overlaps this warpgroup's next wgmma
    // (8 column scales reused, to fit 3 x 64 accumulators in the register file)
    auto promote = [&](const float (&p)[64], float f) {
      const float r0 = sa0 * f, r1 = sa1 * f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[4 * j + e] = fmaf(p[4 * j + e], ((e & 2) ? r1 : r0) * sb[(2 * j + (e & 1)) & 7], acc[4 * j + e]);
    };
    wgmma_fence();
    wgmma_m64n128k32_e4m3(p0, make_desc_sw128(a_s), make_desc_sw128(b_s), 0);
    wgmma_commit();
    for (int s = 0; s + 1 < steps; s += 2) {
      wgmma_fence();
      wgmma_m64n128k32_e4m3(p1, make_desc_sw128(a_s + 32), make_desc_sw128(b_s + 32), 0);
      wgmma_commit();
      wgmma_wait<1>();
      promote(p0, 1.f);
      wgmma_fence();
      wgmma_m64n128k32_e4m3(p0, make_desc_sw128(a_s + 64), make_desc_sw128(b_s + 64), 0);
      wgmma_commit();
      wgmma_wait<1>();
      promote(p1, 0.5f);
    }
    wgmma_wait<0>();
    promote(p0, 1.f);
  }
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) t += acc[i];
  if (t == 12345.f) sink[threadIdx.x] = t;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float *sink, *scales;
  cudaMalloc(&sink, 1024 * 4);
  cudaMalloc(&scales, 64 * 4);
  float h[64];
  for (int i = 0; i < 64; ++i) h[i] = (float)(1 << (i % 7)) / 8.f;
  cudaMemcpy(scales, h, sizeof(h), cudaMemcpyHostToDevice);
  const int steps = 1 << 15;
  const char* names[4] = {"bf16 wgmma (2 x m64n128k16 per k32)", "fp8 wgmma m64n128k32, no promotion",
                          "fp8 + per-32 promotion, 1 partial", "fp8 + per-32 promotion, 2 partials"};
  for (int rep = 0; rep < 2; ++rep)
    for (int mode = 0; mode < 4; ++mode) {
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      auto launch = [&]() {
        if (mode == 0) bench<0><<<sms, 256>>>(steps, sink, scales);
        else if (mode == 1) bench<1><<<sms, 256>>>(steps, sink, scales);
        else if (mode == 2) bench<2><<<sms, 256>>>(steps, sink, scales);
        else bench<3><<<sms, 256>>>(steps, sink, scales);
      };
      launch();
      cudaEventRecord(a);
      for (int i = 0; i < 3; ++i) launch();
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      const double flops = 3.0 * sms * 2 /*warpgroups*/ * (double)steps * 2.0 * 64 * 128 * 32;
      printf("%-40s %8.1f TFLOP/s  (%.3f ms per launch)  %s\n", names[mode], flops / (ms * 1e-3) / 1e12, ms / 3,
             cudaGetErrorString(cudaGetLastError()));
    }
  return 0;
}
