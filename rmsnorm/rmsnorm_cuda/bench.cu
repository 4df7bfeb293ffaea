// Standalone benchmark: every forward/backward launch variant and a copy kernel that moves the
// same bytes (read + write), over input pools larger than L2, CUDA events, median of 30.
//   ./rmsnorm_bench [out.csv]
#include <string>

#include "harness_common.cuh"

using namespace rmsnorm;

// Copy ceiling: 16-byte grid-stride copy of `n16` uint4.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __ldcs(src + i);
}

template <class F>
static double median_ms(F&& f, int sets, int reps = 30, int warm = 5) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f(i % sets);
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f((i + warm) % sets);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  FILE* csv = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (csv) std::fprintf(csv, "op,N,C,variant,vpt,tpr,rpb,ms,GBps,pct_copy\n");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int64_t l2 = prop.l2CacheSize;
  std::printf("%s, %d SMs, L2 %lld MB\n", prop.name, prop.multiProcessorCount, (long long)(l2 >> 20));
  const int64_t shapes[][2] = {{65536, 2048}, {65536, 4096}, {65536, 8192}, {16384, 7168}, {8192, 8192}};
  const float eps = 1e-6f;
  std::printf("%-5s %-12s %-22s %9s %9s %7s\n", "op", "shape", "variant", "ms", "GB/s", "%copy");
  for (auto& sh : shapes) {
    const int64_t N = sh[0], C = sh[1];
    const int64_t sb = scales_bytes(N, C);
    const int64_t set_bytes = 2 * N * C * 2 + N * C + sb;
    const int sets = int(std::max<int64_t>(2, (4 * l2 + set_bytes - 1) / set_bytes));
    std::vector<uint16_t*> B(sets), R(sets), G(sets), GB(sets);
    std::vector<uint8_t*> V(sets), S(sets);
    std::vector<float*> RR(sets);
    uint16_t *W, *GW;
    CK(cudaMalloc(&W, 2 * C)); CK(cudaMalloc(&GW, 2 * C));
    fill_bf16<<<64, 256>>>(W, C, 7, 0);
    for (int i = 0; i < sets; ++i) {
      CK(cudaMalloc(&B[i], 2 * N * C)); CK(cudaMalloc(&R[i], 2 * N * C));
      CK(cudaMalloc(&V[i], N * C)); CK(cudaMalloc(&S[i], sb)); CK(cudaMalloc(&RR[i], 4 * N));
      fill_bf16<<<4096, 256>>>(B[i], N * C, 100 + i, 4);
      fill_bf16<<<4096, 256>>>(R[i], N * C, 200 + i, 4);
    }
    CK(cudaDeviceSynchronize());
    // ---- copy ceiling with the forward's bytes: read+write = 2*2*N*C + N*C + sb + 4N
    const double fwd_bytes = double(2 * N * C * 2 + N * C + sb + 4 * N + 2 * C);
    const int64_t n16 = int64_t(fwd_bytes / 2) / 16;
    uint4 *CS[2], *CD[2];  // dedicated copy buffers, two sets rotated (each > L2)
    for (int i = 0; i < 2; ++i) {
      CK(cudaMalloc(&CS[i], n16 * 16)); CK(cudaMalloc(&CD[i], n16 * 16));
      fill_bf16<<<4096, 256>>>(reinterpret_cast<uint16_t*>(CS[i]), n16 * 8, 300 + i, 4);
    }
    const double copy_ms = median_ms(
        [&](int i) {
          copy_kernel<<<prop.multiProcessorCount * 8, 512>>>(CS[i], CD[i], n16);
        },
        2);
    const double copy_gbps = 2.0 * n16 * 16 / copy_ms / 1e6;
    const double memcpy_ms = median_ms(
        [&](int i) { CK(cudaMemcpyAsync(CD[i], CS[i], n16 * 16, cudaMemcpyDeviceToDevice)); },
        2);
    for (int i = 0; i < 2; ++i) { CK(cudaFree(CS[i])); CK(cudaFree(CD[i])); }
    const double memcpy_gbps = 2.0 * n16 * 16 / memcpy_ms / 1e6;
    char shape[32];
    std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)N, (long long)C);
    std::printf("%-5s %-12s %-22s %9.4f %9.1f %7.1f\n", "copy", shape, "copy_kernel", copy_ms, copy_gbps, 100.0);
    std::printf("%-5s %-12s %-22s %9.4f %9.1f %7.1f\n", "copy", shape, "cudaMemcpy", memcpy_ms, memcpy_gbps,
                100.0 * memcpy_gbps / copy_gbps);
    if (csv) {
      std::fprintf(csv, "copy,%lld,%lld,copy_kernel,0,0,0,%.5f,%.1f,100\n", (long long)N, (long long)C, copy_ms, copy_gbps);
      std::fprintf(csv, "copy,%lld,%lld,cudaMemcpy,0,0,0,%.5f,%.1f,%.1f\n", (long long)N, (long long)C, memcpy_ms,
                   memcpy_gbps, 100.0 * memcpy_gbps / copy_gbps);
    }
    // ---- forward variants
    std::vector<LaunchConfig> fv;
    for (int vpt : {1, 2, 4, 8})
      for (int tgt : {128, 256, 512, 1024}) {
        LaunchConfig c = forward_config(C, vpt, tgt);
        if (c.vpt != vpt || c.tpr * c.rpb > fwd_max_threads(vpt)) continue;
        bool dup = false;
        for (auto& o : fv) dup |= (o.vpt == c.vpt && o.tpr == c.tpr && o.rpb == c.rpb);
        if (!dup) fv.push_back(c);
      }
    const LaunchConfig rule = forward_config(C);
    for (auto& cfg : fv) {
      const double ms = median_ms(
          [&](int i) {
            CK(fused_rmsnorm_residual_forward(B[i], R[i], W, V[i], S[i], RR[i], N, C, eps, 0, &cfg));
          },
          sets);
      const double gbps = fwd_bytes / ms / 1e6;
      char var[48];
      const bool is_rule = cfg.vpt == rule.vpt && cfg.tpr == rule.tpr && cfg.rpb == rule.rpb;
      std::snprintf(var, sizeof var, "v%d t%d r%d%s", cfg.vpt, cfg.tpr, cfg.rpb, is_rule ? " *" : "");
      std::printf("%-5s %-12s %-22s %9.4f %9.1f %7.1f\n", "fwd", shape, var, ms, gbps, 100 * gbps / copy_gbps);
      if (csv)
        std::fprintf(csv, "fwd,%lld,%lld,%s,%d,%d,%d,%.5f,%.1f,%.1f\n", (long long)N, (long long)C, var, cfg.vpt,
                     cfg.tpr, cfg.rpb, ms, gbps, 100 * gbps / copy_gbps);
    }
    // ---- backward variants (reuse R as grad_y and V-sized buffers for grad_branch)
    for (int i = 0; i < sets; ++i) { G[i] = R[i]; CK(cudaMalloc(&GB[i], 2 * N * C)); }
    const double bwd_bytes = double(3 * 2 * N * C + 4 * N + 2 * 2 * C);
    std::vector<LaunchConfig> bv;
    for (int vpt : {1, 2, 4})
      for (int tgt : {128, 256, 512, 1024}) {
        LaunchConfig c = backward_config(C, vpt, tgt);
        if (c.vpt != vpt || c.smem_acc) continue;
        bool dup = false;
        for (auto& o : bv) dup |= (o.vpt == c.vpt && o.tpr == c.tpr && o.rpb == c.rpb);
        if (!dup) bv.push_back(c);
      }
    const LaunchConfig brule = backward_config(C);
    for (auto& cfg : bv) {
      const int64_t P = backward_num_partials(N, C, 0, &cfg);
      float* ws;
      CK(cudaMalloc(&ws, 4 * P * C));
      const double ms = median_ms(
          [&](int i) {
            CK(fused_rmsnorm_residual_backward(G[i], B[i], W, RR[i], GB[i], GW, ws, N, C, 0, 0, &cfg));
          },
          sets);
      CK(cudaFree(ws));
      const double gbps = bwd_bytes / ms / 1e6;
      char var[48];
      const bool is_rule = cfg.vpt == brule.vpt && cfg.tpr == brule.tpr && cfg.rpb == brule.rpb;
      std::snprintf(var, sizeof var, "v%d t%d r%d P%lld%s", cfg.vpt, cfg.tpr, cfg.rpb, (long long)P,
                    is_rule ? " *" : "");
      std::printf("%-5s %-12s %-22s %9.4f %9.1f %7.1f\n", "bwd", shape, var, ms, gbps, 100 * gbps / copy_gbps);
      if (csv)
        std::fprintf(csv, "bwd,%lld,%lld,%s,%d,%d,%d,%.5f,%.1f,%.1f\n", (long long)N, (long long)C, var, cfg.vpt,
                     cfg.tpr, cfg.rpb, ms, gbps, 100 * gbps / copy_gbps);
    }
    for (int i = 0; i < sets; ++i) {
      CK(cudaFree(B[i])); CK(cudaFree(R[i])); CK(cudaFree(V[i])); CK(cudaFree(S[i]));
      CK(cudaFree(RR[i])); CK(cudaFree(GB[i]));
    }
    CK(cudaFree(W)); CK(cudaFree(GW));
  }
  if (csv) std::fclose(csv);
  std::printf("(* = the dispatch rule's choice; GB/s counts each input read once, each output written once)\n");
  return 0;
}
