// Forward: fused RMSNorm + residual add + MXFP8 (e4m3, RCEIL e8m0 scales in the blocked layout).
//
// One pass: every thread loads its 16-byte chunks of `branch` and `residual` (and the weight)
// up front, the row's sum of squares is reduced (warp shuffles, then shared memory across the
// warps of a row), and the row is normalised, quantised and written from registers.
// A 32-element scale block is 4 consecutive chunks = 4 consecutive lanes; 4 consecutive blocks
// (16 lanes) form the 4-byte word the blocked layout stores contiguously, so one lane in 16
// writes one 32-bit word of scales.  Rows in [N, roundup(N,128)) only write zero scale words
// (the layout's row padding); the column padding (S -> multiple of 4) is the zero bytes of the
// last word of a row.
#include "mxfp8_rules.cuh"
#include "rmsnorm.cuh"

namespace rmsnorm {
namespace {

using detail::ld_keep;
using detail::ld_stream;
using detail::unpack8;
// The MXFP8 rules flash_moe implements too: one source, common/mxfp8_rules.cuh.
using mxfp8_rules::e4m3x2_from_floats;
using mxfp8_rules::quant_multiplier;
using mxfp8_rules::scale_byte_from_amax_bits;

// VPT: LaunchConfig::vpt (16-byte chunks of a row per thread).
template <int VPT>
__global__ void __launch_bounds__(fwd_max_threads(VPT))
    rmsnorm_fwd_kernel(const uint16_t* __restrict__ branch, const uint16_t* __restrict__ residual,
                       const uint16_t* __restrict__ weight, uint8_t* __restrict__ vals,
                       uint8_t* __restrict__ scales, float* __restrict__ rrms_out, int64_t N,
                       int64_t Npad, int C, float eps) {
  extern __shared__ float red[];  // [rpb][tpr / 32]: rows per CTA x warps per row
  const int tpr = blockDim.x;  // threads per row
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int C8 = C >> 3;
  const int S4 = ((C >> 5) + 3) >> 2;
  const bool active = row < N;

  uint4 b[VPT], r[VPT], w[VPT];
  float ss = 0.f;
  if (active) {
    const uint4* bp = reinterpret_cast<const uint4*>(branch + row * static_cast<int64_t>(C));
    const uint4* rp = reinterpret_cast<const uint4*>(residual + row * static_cast<int64_t>(C));
    const uint4* wp = reinterpret_cast<const uint4*>(weight);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      if (c < C8) b[k] = ld_stream(bp + c);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      if (c < C8) r[k] = ld_stream(rp + c);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      if (c < C8) w[k] = ld_keep(wp + c);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = t + k * tpr;
      if (c < C8) {
        float f[8];
        unpack8(b[k], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
      }
    }
  }
  // Row reduction of the sum of squares.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (tpr > 32) {
    const int nw = tpr >> 5;
    float* rr = red + threadIdx.y * nw;
    if (lane == 0) rr[t >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int i = 0; i < nw; ++i) ss += rr[i];
  }
  const float rrms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(C)), eps)));
  if (active && t == 0) rrms_out[row] = rrms;

  uint8_t* vrow = vals + row * static_cast<int64_t>(C);
  // Scale word (row, columns 4j..4j+3) of the blocked layout (mxfp8_rules::blocked_offset, spelled
  // out: its unsigned form compiles to other instructions here): sbase + j * 512.
  const int64_t sbase = (row >> 7) * S4 * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = t + k * tpr;
    const bool valid = active && c < C8;
    float y[8];
    uint32_t ab = 0u;
    if (valid) {
      float fb[8], fr[8], fw[8];
      unpack8(b[k], fb);
      unpack8(r[k], fr);
      unpack8(w[k], fw);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        y[i] = __fadd_rn(__fmul_rn(__fmul_rn(fb[i], rrms), fw[i]), fr[i]);
        ab = max(ab, __float_as_uint(y[i]) & 0x7fffffffu);
      }
    }
    ab = max(ab, __shfl_xor_sync(0xffffffffu, ab, 1));
    ab = max(ab, __shfl_xor_sync(0xffffffffu, ab, 2));
    const uint32_t byte = scale_byte_from_amax_bits(ab);
    if (valid) {
      const float m = quant_multiplier(byte);
      uint2 q;
      q.x = e4m3x2_from_floats(__fmul_rn(y[0], m), __fmul_rn(y[1], m)) |
            (e4m3x2_from_floats(__fmul_rn(y[2], m), __fmul_rn(y[3], m)) << 16);
      q.y = e4m3x2_from_floats(__fmul_rn(y[4], m), __fmul_rn(y[5], m)) |
            (e4m3x2_from_floats(__fmul_rn(y[6], m), __fmul_rn(y[7], m)) << 16);
      __stcs(reinterpret_cast<uint2*>(vrow + static_cast<int64_t>(c) * 8), q);
    }
    // Gather the 4 block bytes of a 16-lane group into one word (invalid lanes contribute 0).
    uint32_t word = (valid ? byte : 0u) << (8 * ((lane >> 2) & 3));
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
    word |= __shfl_xor_sync(0xffffffffu, word, 8);
    if ((lane & 15) == 0 && c < C8 && row < Npad) {
      *reinterpret_cast<uint32_t*>(scales + sbase + static_cast<int64_t>(c >> 4) * 512) = word;
    }
  }
}

template <int VPT>
cudaError_t launch(const LaunchConfig& cfg, const void* branch, const void* residual,
                   const void* weight, uint8_t* vals, uint8_t* scales, float* rrms, int64_t N,
                   int64_t C, float eps, cudaStream_t stream) {
  const int64_t Npad = (N + 127) / 128 * 128;
  const int64_t grid = (Npad + cfg.rpb - 1) / cfg.rpb;
  const size_t smem = cfg.tpr > 32 ? sizeof(float) * cfg.rpb * (cfg.tpr / 32) : 0;
  rmsnorm_fwd_kernel<VPT><<<static_cast<unsigned>(grid), dim3(cfg.tpr, cfg.rpb), smem, stream>>>(
      static_cast<const uint16_t*>(branch), static_cast<const uint16_t*>(residual),
      static_cast<const uint16_t*>(weight), vals, scales, rrms, N, Npad, static_cast<int>(C), eps);
  return cudaGetLastError();
}

}  // namespace

LaunchConfig forward_config(int64_t C, int vpt, int block_threads_target) {
  const int64_t C8 = C / 8;
  bool rule = false;
  if (vpt <= 0) {
    // Dispatch rule (the H200 measurements behind it: rmsnorm/DESIGN.md): 4 chunks (64 B of each
    // input) per thread; rows per CTA = 512 / threads-per-row when that is a power of two, else 1
    // row per CTA.
    vpt = 4;
    rule = block_threads_target <= 0;
  }
  if (block_threads_target <= 0) block_threads_target = 512;
  // The row must fit in one CTA.
  while (vpt < 8 && (C8 + vpt - 1) / vpt > fwd_max_threads(vpt)) vpt *= 2;
  LaunchConfig cfg;
  cfg.vpt = vpt;
  int64_t tpr = (C8 + vpt - 1) / vpt;
  tpr = (tpr + 31) / 32 * 32;
  if (tpr < 32) tpr = 32;
  cfg.tpr = static_cast<int>(tpr);
  int rpb = static_cast<int>(block_threads_target / tpr);
  if (rule && (tpr & (tpr - 1)) != 0) rpb = 1;
  if (rpb < 1) rpb = 1;
  while (rpb > 1 && rpb * cfg.tpr > fwd_max_threads(vpt)) --rpb;
  cfg.rpb = rpb;
  return cfg;
}

cudaError_t fused_rmsnorm_residual_forward(const void* branch, const void* residual,
                                           const void* weight, uint8_t* vals, uint8_t* scales,
                                           float* rrms, int64_t N, int64_t C, float eps,
                                           cudaStream_t stream, const LaunchConfig* cfg_in) {
  if (N < 0 || C <= 0 || C % 32 != 0 || C > kMaxC) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const LaunchConfig cfg = cfg_in ? *cfg_in : forward_config(C);
  if (cfg.tpr % 32 != 0 || cfg.rpb < 1 || cfg.tpr * cfg.rpb > fwd_max_threads(cfg.vpt) ||
      int64_t(cfg.tpr) * cfg.vpt * 8 < C)
    return cudaErrorInvalidConfiguration;
  switch (cfg.vpt) {
    case 1: return launch<1>(cfg, branch, residual, weight, vals, scales, rrms, N, C, eps, stream);
    case 2: return launch<2>(cfg, branch, residual, weight, vals, scales, rrms, N, C, eps, stream);
    case 4: return launch<4>(cfg, branch, residual, weight, vals, scales, rrms, N, C, eps, stream);
    case 8: return launch<8>(cfg, branch, residual, weight, vals, scales, rrms, N, C, eps, stream);
    default: return cudaErrorInvalidConfiguration;
  }
}

}  // namespace rmsnorm
