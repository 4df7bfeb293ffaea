// Shared bits of the standalone harness (test.cu, bench.cu). Not part of the extension.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>

#include "rmsnorm.cuh"

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #x,                     \
                   cudaGetErrorString(e_));                                                 \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

// Deterministic hash -> bf16 with a per-32-block random exponent (dynamic range ~2^+-12).
__device__ __host__ inline uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed, int range) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(seed * 0x9E3779B97F4A7C15ULL + uint64_t(i));
    const uint32_t hb = hash32(seed * 0x632BE59BD9B4E019ULL + uint64_t(i / 32));
    const float u = (float((h >> 8) & 0xffff) + 0.5f) / 65536.f * 2.f - 1.f;  // (-1,1), never 0
    const float f = ldexpf(u, range ? int(hb % (2 * range + 1)) - range : 0);
    p[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);  // truncation is fine here
  }
}

inline float bf2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t fbits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf_host(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(((u >> 16) | 0x40u) & 0xffffu);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// ---- CPU reference of docs/DESIGN.md §6 (independent of the kernel code) ----
inline uint8_t ref_scale_byte(float amax) {
  if (!std::isfinite(amax)) return 255;
  if (amax == 0.f) return 0;
  const float t = amax * (1.0f / 448.0f);  // fp32, RN (no contraction possible)
  const uint32_t tb = fbits(t);
  uint32_t byte = (tb >> 23) + ((tb & 0x7fffffu) ? 1 : 0);
  return uint8_t(std::min<uint32_t>(byte, 254));
}
inline uint8_t ref_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7e;  // satfinite (+-Inf too)
  uint8_t mag;
  if (a < std::ldexp(1.0, -6)) {
    const double m = std::nearbyint(a / std::ldexp(1.0, -9));  // RNE, 0..8 (8 == min normal)
    mag = uint8_t(m);
  } else {
    int e;
    double fr = std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5,1)
    e -= 1;                          // a = (2fr) * 2^e, 2fr in [1,2)
    double m = std::nearbyint((2 * fr - 1) * 8);
    if (m == 8) { m = 0; e += 1; }
    mag = uint8_t(((e + 7) << 3) | int(m));
    if (mag > 0x7e) mag = 0x7e;
  }
  return sign | mag;
}
inline float ref_multiplier(uint8_t byte) { return std::ldexp(1.0f, 127 - int(byte)); }

// ---- the launch variants
inline bool same(const rmsnorm::LaunchConfig& a, const rmsnorm::LaunchConfig& b) {
  return a.vpt == b.vpt && a.tpr == b.tpr && a.rpb == b.rpb && a.smem_acc == b.smem_acc;
}
// Every forward variant the harnesses run (test.cu checks each, bench.cu times each).
inline std::vector<rmsnorm::LaunchConfig> fwd_variants(int64_t C) {
  std::vector<rmsnorm::LaunchConfig> out;
  auto add = [&](const rmsnorm::LaunchConfig& c) {
    for (auto& o : out)
      if (same(o, c)) return;
    out.push_back(c);
  };
  for (int vpt : {1, 2, 4, 8})
    for (int tgt : {128, 256, 512, 1024}) {
      rmsnorm::LaunchConfig c = rmsnorm::forward_config(C, vpt, tgt);
      if (c.vpt != vpt) continue;
      if (c.tpr * c.rpb > rmsnorm::fwd_max_threads(c.vpt)) continue;
      add(c);
    }
  add(rmsnorm::forward_config(C));  // the dispatch rule itself
  return out;
}
// Every backward variant, each 4-chunk one also with shared-memory partials (rpb as given).
inline std::vector<rmsnorm::LaunchConfig> bwd_variants(int64_t C) {
  std::vector<rmsnorm::LaunchConfig> out;
  auto add = [&](const rmsnorm::LaunchConfig& c) {
    if (!rmsnorm::backward_config_valid(c, C)) return;
    for (auto& o : out)
      if (same(o, c)) return;
    out.push_back(c);
  };
  for (int vpt : {1, 2, 4})
    for (int tgt : {128, 256, 512, 1024}) {
      rmsnorm::LaunchConfig c = rmsnorm::backward_config(C, vpt, tgt);
      if (c.vpt != vpt && !c.smem_acc) continue;
      add(c);
      if (vpt == 4 && !c.smem_acc) {
        c.smem_acc = true;
        add(c);
      }
    }
  add(rmsnorm::backward_config(C));  // the dispatch rule itself
  return out;
}
