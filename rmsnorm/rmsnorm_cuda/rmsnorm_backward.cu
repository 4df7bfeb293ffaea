// Backward of y = branch * rrms * weight + residual with the MXFP8 quantisation passed straight
// through (d vals / d y := identity), rrms = 1/sqrt(mean(branch^2) + eps):
//
//   grad_residual = grad_y                                   (no kernel: the caller reuses grad_y)
//   grad_branch   = rrms * (g * w) - branch * (rrms^3 / C) * sum_c(g * w * branch)
//   grad_weight   = sum_n g * branch * rrms
//
// Kernel 1 is persistent: each (CTA, row slot) walks rows with a fixed stride, keeps the weight
// and its running grad_weight partial (fp32) in registers, and at the end stores its partial row
// into a workspace of (num_slots, C) floats.  Kernel 2 reduces the partials over the slots in a
// fixed order (no float atomics), so grad_weight is bit-identical run after run on one GPU.
#include <algorithm>

#include "rmsnorm.cuh"

namespace rmsnorm {
namespace {

using detail::ld_keep;
using detail::ld_stream;
using detail::pack_bf2;
using detail::unpack8;

// VPT: LaunchConfig::vpt (16-byte chunks of a row per thread).
// SACC = false: weight and the grad_weight partial live in registers (C <= 16384).
// SACC = true : the partial lives in shared memory and the weight is re-read (L1) every row,
//               so a 1024-thread CTA fits a 32768-wide row without spilling.
template <int VPT, bool SACC>
__global__ void __launch_bounds__(bwd_max_threads(VPT, SACC))
    rmsnorm_bwd_kernel(const uint16_t* __restrict__ grad_y, const uint16_t* __restrict__ branch,
                       const uint16_t* __restrict__ weight, const float* __restrict__ rrms,
                       uint16_t* __restrict__ grad_branch, float* __restrict__ partials, int64_t N,
                       int C) {
  extern __shared__ float4 smem4[];
  const int tpr = blockDim.x;  // threads per row
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int rpb = blockDim.y;  // rows per CTA
  const int nw = tpr >> 5;
  const int C8 = C >> 3;
  const float invC = 1.0f / static_cast<float>(C);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  float* red = reinterpret_cast<float*>(smem4);  // [2][rpb][nw] (reduction buffers)
  // [rpb][C] fp32 partials when SACC (16-byte aligned: offset rounded up to 4 floats)
  float4* sacc = smem4 + (2 * rpb * nw + 3) / 4 + static_cast<int64_t>(threadIdx.y) * (C / 4);
  const uint4* wp = reinterpret_cast<const uint4*>(weight);

  float fw[SACC ? 1 : VPT][8];
  float acc[SACC ? 1 : VPT][8];
  if constexpr (!SACC) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (c < C8) v = ld_keep(wp + c);
      unpack8(v, fw[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[k][i] = 0.f;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      if (c < C8) {
        sacc[2 * c] = make_float4(0.f, 0.f, 0.f, 0.f);
        sacc[2 * c + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }

  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < N; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool active = row < N;
    uint4 g[VPT], b[VPT];
    float rr = 0.f;
    float dot = 0.f;
    if (active) {
      const uint4* gp = reinterpret_cast<const uint4*>(grad_y + row * static_cast<int64_t>(C));
      const uint4* bp = reinterpret_cast<const uint4*>(branch + row * static_cast<int64_t>(C));
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = t + k * tpr;
        if (c < C8) g[k] = ld_stream(gp + c);
      }
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = t + k * tpr;
        if (c < C8) b[k] = ld_stream(bp + c);
      }
      rr = __ldg(rrms + row);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = t + k * tpr;
        if (c < C8) {
          float fg[8], fb[8], wk[8];
          unpack8(g[k], fg);
          unpack8(b[k], fb);
          if constexpr (SACC) {
            unpack8(ld_keep(wp + c), wk);
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wk[i] = fw[k][i];
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) dot = fmaf(fg[i] * wk[i], fb[i], dot);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (tpr > 32) {
      float* rb = red + (parity * rpb + threadIdx.y) * nw;
      if (lane == 0) rb[t >> 5] = dot;
      __syncthreads();  // one barrier per row: the two buffers alternate
      dot = 0.f;
      for (int i = 0; i < nw; ++i) dot += rb[i];
      parity ^= 1;
    }
    if (active) {
      const float coef = rr * rr * rr * invC * dot;
      uint4* op = reinterpret_cast<uint4*>(grad_branch + row * static_cast<int64_t>(C));
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = t + k * tpr;
        if (c < C8) {
          float fg[8], fb[8], wk[8], o[8], a[8];
          unpack8(g[k], fg);
          unpack8(b[k], fb);
          if constexpr (SACC) {
            unpack8(ld_keep(wp + c), wk);
            const float4 a0 = sacc[2 * c], a1 = sacc[2 * c + 1];
            a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w;
            a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) { wk[i] = fw[k][i]; a[i] = acc[k][i]; }
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            o[i] = fmaf(-fb[i], coef, rr * (fg[i] * wk[i]));
            a[i] = fmaf(fg[i] * fb[i], rr, a[i]);
          }
          if constexpr (SACC) {
            sacc[2 * c] = make_float4(a[0], a[1], a[2], a[3]);
            sacc[2 * c + 1] = make_float4(a[4], a[5], a[6], a[7]);
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[k][i] = a[i];
          }
          uint4 v;
          v.x = pack_bf2(o[0], o[1]);
          v.y = pack_bf2(o[2], o[3]);
          v.z = pack_bf2(o[4], o[5]);
          v.w = pack_bf2(o[6], o[7]);
          __stcs(op + c, v);
        }
      }
    }
  }
  // This slot's grad_weight partial.
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * rpb + threadIdx.y;
  float4* pp = reinterpret_cast<float4*>(partials + slot * static_cast<int64_t>(C));
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = t + k * tpr;
    if (c < C8) {
      if constexpr (SACC) {
        pp[2 * c] = sacc[2 * c];
        pp[2 * c + 1] = sacc[2 * c + 1];
      } else {
        pp[2 * c] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
        pp[2 * c + 1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
      }
    }
  }
}

// grad_weight[c] = sum_p partials[p, c], fixed order: kReduceSlices strided slices
// (p = s, s + kReduceSlices, ...), then slices 0..kReduceSlices-1.  A CTA is 32 columns x 32
// slices (one warp per slice): C/32 CTAs of 32 warps keep enough loads in flight to read the
// partials (up to ~17 MB, mostly still in L2) at L2 rather than latency speed.
constexpr int kReduceSlices = 32;
__global__ void __launch_bounds__(32 * kReduceSlices)
    rmsnorm_bwd_reduce_kernel(const float* __restrict__ partials, uint16_t* __restrict__ grad_weight,
                              int64_t P, int C) {
  __shared__ float sm[kReduceSlices][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.f;
  if (c < C) {
    for (int64_t p = threadIdx.y; p < P; p += kReduceSlices) s += partials[p * C + c];
  }
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < kReduceSlices; ++i) tot += sm[i][threadIdx.x];
    grad_weight[c] = static_cast<uint16_t>(detail::f2bf(tot));
  }
}

template <int VPT, bool SACC>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&rmsnorm_bwd_kernel<VPT, SACC>);
}

const void* bwd_kernel_for(const LaunchConfig& cfg) {
  if (cfg.smem_acc) return cfg.vpt == 4 ? kernel_ptr<4, true>() : nullptr;
  switch (cfg.vpt) {
    case 1: return kernel_ptr<1, false>();
    case 2: return kernel_ptr<2, false>();
    case 4: return kernel_ptr<4, false>();
    default: return nullptr;
  }
}

size_t bwd_smem_bytes(const LaunchConfig& cfg, int64_t C) {
  size_t bytes = sizeof(float4) * ((2 * cfg.rpb * (cfg.tpr / 32) + 3) / 4);
  if (cfg.smem_acc) bytes += sizeof(float) * cfg.rpb * static_cast<size_t>(C);
  return bytes;
}

bool valid_config(const LaunchConfig& cfg, int64_t C) {
  return bwd_kernel_for(cfg) != nullptr && cfg.tpr % 32 == 0 && cfg.rpb >= 1 &&
         cfg.tpr * cfg.rpb <= bwd_max_threads(cfg.vpt, cfg.smem_acc) &&
         int64_t(cfg.tpr) * cfg.vpt * 8 >= C && bwd_smem_bytes(cfg, C) <= 200 * 1024;
}

int64_t num_blocks(int64_t N, int64_t C, const LaunchConfig& cfg, int device) {
  if (N <= 0) return 0;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sms = 1;
  const void* k = bwd_kernel_for(cfg);
  const size_t smem = bwd_smem_bytes(cfg, C);
  if (k && smem > 48 * 1024)
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  int occ = 0;
  if (!k || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, cfg.tpr * cfg.rpb, smem) !=
                cudaSuccess || occ < 1) {
    cudaGetLastError();
    occ = 1;
  }
  const int64_t need = (N + cfg.rpb - 1) / cfg.rpb;
  return std::min<int64_t>(need, static_cast<int64_t>(sms) * occ);
}

}  // namespace

LaunchConfig backward_config(int64_t C, int vpt, int block_threads_target) {
  const int64_t C8 = C / 8;
  bool rule = false;
  if (vpt <= 0) {
    // Dispatch rule (the H200 measurements behind it: rmsnorm/DESIGN.md): one row per CTA (the
    // persistent loop's per-row barrier stalls every row slot of a CTA together), 4 chunks per
    // thread, fewer chunks per thread while that leaves fewer than 128 threads per row.
    vpt = 4;
    while (vpt > 1 && (C8 + vpt - 1) / vpt < 128) vpt /= 2;
    rule = block_threads_target <= 0;
    if (block_threads_target <= 0) block_threads_target = 1;
  }
  if (block_threads_target <= 0) block_threads_target = 256;
  LaunchConfig cfg;
  while (vpt < 4 && (C8 + vpt - 1) / vpt > bwd_max_threads(vpt, false)) vpt *= 2;
  if ((C8 + vpt - 1) / vpt > bwd_max_threads(vpt, false)) {
    // Row too wide for register partials: shared-memory partials, one row per CTA.
    vpt = 4;
    cfg.smem_acc = true;
  }
  // Two rows per CTA where a row is exactly 128 threads of 4 chunks (C = 4096), one row
  // elsewhere: two rows measured faster at C = 4096 only (rmsnorm/DESIGN.md).
  if (rule && vpt == 4 && (C8 + 3) / 4 == 128) block_threads_target = 256;
  cfg.vpt = vpt;
  int64_t tpr = (C8 + vpt - 1) / vpt;
  tpr = (tpr + 31) / 32 * 32;
  if (tpr < 32) tpr = 32;
  cfg.tpr = static_cast<int>(tpr);
  int rpb = cfg.smem_acc ? 1 : static_cast<int>(block_threads_target / tpr);
  if (rpb < 1) rpb = 1;
  while (rpb > 1 && rpb * cfg.tpr > bwd_max_threads(vpt, cfg.smem_acc)) --rpb;
  cfg.rpb = rpb;
  return cfg;
}

bool backward_config_valid(const LaunchConfig& cfg, int64_t C) { return valid_config(cfg, C); }

int64_t backward_num_partials(int64_t N, int64_t C, int device, const LaunchConfig* cfg_in) {
  const LaunchConfig cfg = cfg_in ? *cfg_in : backward_config(C);
  return num_blocks(N, C, cfg, device) * cfg.rpb;
}

cudaError_t fused_rmsnorm_residual_backward(const void* grad_y, const void* branch,
                                            const void* weight, const float* rrms,
                                            void* grad_branch, void* grad_weight,
                                            float* workspace, int64_t N, int64_t C, int device,
                                            cudaStream_t stream, const LaunchConfig* cfg_in) {
  if (N < 0 || C <= 0 || C % 32 != 0 || C > kMaxC) return cudaErrorInvalidValue;
  const LaunchConfig cfg = cfg_in ? *cfg_in : backward_config(C);
  if (!valid_config(cfg, C)) return cudaErrorInvalidConfiguration;
  const int64_t blocks = num_blocks(N, C, cfg, device);
  if (blocks > 0) {
    const size_t smem = bwd_smem_bytes(cfg, C);
    const dim3 blk(cfg.tpr, cfg.rpb);
    const auto* gy = static_cast<const uint16_t*>(grad_y);
    const auto* br = static_cast<const uint16_t*>(branch);
    const auto* w = static_cast<const uint16_t*>(weight);
    auto* gb = static_cast<uint16_t*>(grad_branch);
    const int c = static_cast<int>(C);
    const auto nb = static_cast<unsigned>(blocks);
    if (cfg.smem_acc) {
      rmsnorm_bwd_kernel<4, true><<<nb, blk, smem, stream>>>(gy, br, w, rrms, gb, workspace, N, c);
    } else {
      switch (cfg.vpt) {
        case 1: rmsnorm_bwd_kernel<1, false><<<nb, blk, smem, stream>>>(gy, br, w, rrms, gb, workspace, N, c); break;
        case 2: rmsnorm_bwd_kernel<2, false><<<nb, blk, smem, stream>>>(gy, br, w, rrms, gb, workspace, N, c); break;
        case 4: rmsnorm_bwd_kernel<4, false><<<nb, blk, smem, stream>>>(gy, br, w, rrms, gb, workspace, N, c); break;
        default: return cudaErrorInvalidConfiguration;
      }
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const int64_t P = blocks * cfg.rpb;
  rmsnorm_bwd_reduce_kernel<<<static_cast<unsigned>((C + 31) / 32), dim3(32, kReduceSlices), 0,
                              stream>>>(
      workspace, static_cast<uint16_t*>(grad_weight), P, static_cast<int>(C));
  return cudaGetLastError();
}

}  // namespace rmsnorm
