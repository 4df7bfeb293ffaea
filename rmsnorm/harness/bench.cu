// Standalone benchmark: every forward/backward launch variant and a copy kernel that moves the
// same bytes (read + write), over input pools larger than L2, CUDA events, median of 30.
//   ./rmsnorm_bench [out.csv] [NxC ...]          e.g. ./rmsnorm_bench b.csv 16384x7168 65536x4096
// With shapes given only those run (default: the five of docs/DESIGN.md §9).  Timing as compare.py: a
// short GPU spin before the start event, so the host's launch gap is not timed; each variant is
// measured in ROUNDS interleaved rounds (all variants of a shape, then again) and the median of
// the round medians is reported with the spread (max - min of the rounds, in % of the median).
// `%1GiB` is GB/s against compare.py's ceiling: cudaMemcpy of 1 GiB (read + write), same run.
#include <array>
#include <cstring>
#include <string>

#include "harness_common.cuh"

using namespace rmsnorm;

constexpr int ROUNDS = 3;

// Copy ceiling: 16-byte grid-stride copy of `n16` uint4.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __ldcs(src + i);
}

// Keeps the GPU busy while the host enqueues the timed call (as torch.cuda._sleep in compare.py).
__global__ void spin_kernel(int64_t cycles) {
  const int64_t t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

template <class F>
static double median_ms(F&& f, int sets, int reps = 30, int warm = 5) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f(i % sets);
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    spin_kernel<<<1, 1>>>(400000);  // ~0.2 ms
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


static std::string label(const LaunchConfig& c, const LaunchConfig& rule, const char* extra = "") {
  char s[64];
  std::snprintf(s, sizeof s, "v%d t%d r%d%s%s%s", c.vpt, c.tpr, c.rpb,
                c.smem_acc ? " S" : "", extra, same(c, rule) ? " *" : "");
  return s;
}

// Median over rounds and spread (max - min) in % of it.
static void summarize(const std::vector<double>& v, double& med, double& spread) {
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  med = s[s.size() / 2];
  spread = 100.0 * (s.back() - s.front()) / med;
}

int main(int argc, char** argv) {
  FILE* csv = nullptr;
  std::vector<std::array<int64_t, 2>> shapes;
  for (int i = 1; i < argc; ++i) {
    long long n = 0, c = 0;
    char tail = 0;
    if (std::sscanf(argv[i], "%lldx%lld%c", &n, &c, &tail) == 2 && n > 0 && c > 0) {
      shapes.push_back({n, c});
    } else if (!csv) {
      csv = std::fopen(argv[i], "w");
      if (!csv) { std::fprintf(stderr, "cannot write %s\n", argv[i]); return 2; }
    }
  }
  if (shapes.empty())
    shapes = {{65536, 2048}, {65536, 4096}, {65536, 8192}, {16384, 7168}, {8192, 8192}};
  if (csv) std::fprintf(csv, "op,N,C,variant,vpt,tpr,rpb,ms,GBps,pct_copy,pct_1GiB,spread_pct\n");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int64_t l2 = prop.l2CacheSize;
  std::printf("%s, %d SMs, L2 %lld MB\n", prop.name, prop.multiProcessorCount, (long long)(l2 >> 20));
  // compare.py's ceiling: 1 GiB device-to-device copy, two buffer pairs rotated.
  double ceil_gbps = 0;
  {
    const int64_t n = int64_t(1) << 30;
    uint8_t *src[2], *dst[2];
    for (int i = 0; i < 2; ++i) {
      CK(cudaMalloc(&src[i], n)); CK(cudaMalloc(&dst[i], n));
      fill_bf16<<<4096, 256>>>(reinterpret_cast<uint16_t*>(src[i]), n / 2, 400 + i, 4);
    }
    const double ms = median_ms(
        [&](int i) { CK(cudaMemcpyAsync(dst[i], src[i], n, cudaMemcpyDeviceToDevice)); }, 2);
    ceil_gbps = 2.0 * n / ms / 1e6;
    for (int i = 0; i < 2; ++i) { CK(cudaFree(src[i])); CK(cudaFree(dst[i])); }
  }
  std::printf("ceiling: 1 GiB cudaMemcpy %.1f GB/s (compare.py's copy ceiling)\n", ceil_gbps);
  const float eps = 1e-6f;
  std::printf("%-5s %-12s %-26s %9s %9s %7s %7s %7s\n", "op", "shape", "variant", "ms", "GB/s", "%copy",
              "%1GiB", "spread");
  for (auto& sh : shapes) {
    const int64_t N = sh[0], C = sh[1];
    if (C % 32 != 0 || C > kMaxC) { std::fprintf(stderr, "bad shape C=%lld\n", (long long)C); return 2; }
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
    std::printf("%-5s %-12s %-26s %9.4f %9.1f %7.1f %7.1f\n", "copy", shape, "copy_kernel", copy_ms, copy_gbps,
                100.0, 100.0 * copy_gbps / ceil_gbps);
    std::printf("%-5s %-12s %-26s %9.4f %9.1f %7.1f %7.1f\n", "copy", shape, "cudaMemcpy", memcpy_ms, memcpy_gbps,
                100.0 * memcpy_gbps / copy_gbps, 100.0 * memcpy_gbps / ceil_gbps);
    if (csv) {
      std::fprintf(csv, "copy,%lld,%lld,copy_kernel,0,0,0,%.5f,%.1f,100,%.1f,0\n", (long long)N, (long long)C,
                   copy_ms, copy_gbps, 100.0 * copy_gbps / ceil_gbps);
      std::fprintf(csv, "copy,%lld,%lld,cudaMemcpy,0,0,0,%.5f,%.1f,%.1f,%.1f,0\n", (long long)N, (long long)C,
                   memcpy_ms, memcpy_gbps, 100.0 * memcpy_gbps / copy_gbps, 100.0 * memcpy_gbps / ceil_gbps);
    }
    auto report = [&](const char* op, const std::string& var, const LaunchConfig& cfg,
                      const std::vector<double>& rounds, double bytes) {
      double ms, spread;
      summarize(rounds, ms, spread);
      const double gbps = bytes / ms / 1e6;
      std::printf("%-5s %-12s %-26s %9.4f %9.1f %7.1f %7.1f %6.1f%%\n", op, shape, var.c_str(), ms, gbps,
                  100 * gbps / copy_gbps, 100 * gbps / ceil_gbps, spread);
      if (csv)
        std::fprintf(csv, "%s,%lld,%lld,%s,%d,%d,%d,%.5f,%.1f,%.1f,%.1f,%.1f\n", op, (long long)N, (long long)C,
                     var.c_str(), cfg.vpt, cfg.tpr, cfg.rpb, ms, gbps, 100 * gbps / copy_gbps,
                     100 * gbps / ceil_gbps, spread);
    };
    // ---- forward variants
    const std::vector<LaunchConfig> fv = fwd_variants(C);
    const LaunchConfig rule = forward_config(C);
    std::vector<std::vector<double>> fms(fv.size());
    for (int round = 0; round < ROUNDS; ++round)
      for (size_t v = 0; v < fv.size(); ++v) {
        const LaunchConfig cfg = fv[v];
        fms[v].push_back(median_ms(
            [&](int i) {
              CK(fused_rmsnorm_residual_forward(B[i], R[i], W, V[i], S[i], RR[i], N, C, eps, 0, &cfg));
            },
            sets));
      }
    for (size_t v = 0; v < fv.size(); ++v) report("fwd", label(fv[v], rule), fv[v], fms[v], fwd_bytes);
    // ---- backward variants (reuse R as grad_y and V-sized buffers for grad_branch), each
    // 4-chunk one also with shared-memory partials
    for (int i = 0; i < sets; ++i) { G[i] = R[i]; CK(cudaMalloc(&GB[i], 2 * N * C)); }
    const double bwd_bytes = double(3 * 2 * N * C + 4 * N + 2 * 2 * C);
    const std::vector<LaunchConfig> bv = bwd_variants(C);
    const LaunchConfig brule = backward_config(C);
    std::vector<float*> ws(bv.size());
    std::vector<int64_t> parts(bv.size());
    for (size_t v = 0; v < bv.size(); ++v) {
      parts[v] = backward_num_partials(N, C, 0, &bv[v]);
      CK(cudaMalloc(&ws[v], 4 * std::max<int64_t>(1, parts[v] * C)));
    }
    std::vector<std::vector<double>> bms(bv.size());
    for (int round = 0; round < ROUNDS; ++round)
      for (size_t v = 0; v < bv.size(); ++v) {
        const LaunchConfig cfg = bv[v];
        float* w = ws[v];
        bms[v].push_back(median_ms(
            [&](int i) {
              CK(fused_rmsnorm_residual_backward(G[i], B[i], W, RR[i], GB[i], GW, w, N, C, 0, 0, &cfg));
            },
            sets));
      }
    for (size_t v = 0; v < bv.size(); ++v) {
      char extra[32];
      std::snprintf(extra, sizeof extra, " P%lld", (long long)parts[v]);
      report("bwd", label(bv[v], brule, extra), bv[v], bms[v], bwd_bytes);
      CK(cudaFree(ws[v]));
    }
    for (int i = 0; i < sets; ++i) {
      CK(cudaFree(B[i])); CK(cudaFree(R[i])); CK(cudaFree(V[i])); CK(cudaFree(S[i]));
      CK(cudaFree(RR[i])); CK(cudaFree(GB[i]));
    }
    CK(cudaFree(W)); CK(cudaFree(GW));
  }
  if (csv) std::fclose(csv);
  std::printf("(* = the dispatch rule's choice; S = shared-memory "
              "grad_weight partials; GB/s counts each input read once, each output written once; "
              "spread = max - min of %d rounds)\n", ROUNDS);
  return 0;
}
