// The backward's SwiGLU epilogue (kDownDgrad) and the training forward's pre-activation store
// (kGateUp with GemmParams::gate_up.preact), which meet in one layout (preact_chunk).
//
// kDownDgrad's accumulators hold dh = grad_out[tok(p)] @ W2[e] (without the router weight s)
// for 256 h features x the tile's tokens. With the saved gate/up pre-activations a, u of the
// same (feature, position), in fp32:
//   h = silu(a) u                         (recomputed; the forward never stores h for backward)
//   score[p]  += dh . h   over features   (d out / d s: per-warp partial sums, score_part)
//   dA = s dh u silu'(a),  dB = s dh silu(a)   -> dA|dB (L, 2I) bf16: the gate/up dgrad's tokens
//                                                 and the gate/up wgrad's operand
//   s h                                        -> (L, I) bf16: the down wgrad's operand
// so neither the expert outputs nor their gradients are stored. The three outputs leave as
// 64 x 64 boxes through shared memory by TMA, as the forward's h does.
#pragma once

#include "moe_gemm_epilogue.cuh"

namespace flash_moe {
namespace gemm {

// The bf16 halves of a bf16x2 word as fp32 (the low half is the first element).
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// The forward's gate/up warpgroup cw stores its 64-feature group g = 2 nb + cw (acc0 gate, acc1
// up) for the tile's 8-row groups below n. Groups past I (the last tile of an I that is not a
// multiple of 128) are not stored.
__device__ __forceinline__ void store_preact(const GemmParams& p, const Tile& tile, int n, const float (&acc0)[72],
                                             const float (&acc1)[72], int cw, int w4, int lane) {
  const int g = 2 * tile.nb + cw;
  if (64 * g >= p.n_out) return;
#pragma unroll
  for (int j = 0; j < kMaxRows / 8; ++j) {
    if (8 * j >= n) break;
    const uint4 v{bf16x2_bits(acc0[4 * j], acc0[4 * j + 1]), bf16x2_bits(acc0[4 * j + 2], acc0[4 * j + 3]),
                  bf16x2_bits(acc1[4 * j], acc1[4 * j + 1]), bf16x2_bits(acc1[4 * j + 2], acc1[4 * j + 3])};
    p.gate_up.preact[preact_chunk(g, (tile.m0 >> 3) + j, p.L, w4, lane)] = v;
  }
}

// sigmoid(a) with the forward's fast exponential (silu_times): 1 / (1 + 2^(-a log2 e)).
__device__ __forceinline__ float fast_sigmoid(float a) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-a * 1.4426950408889634f));
  return __fdividef(1.f, 1.f + e);
}

// Where kDownDgrad's boxes go: dA|dB (out, out_rows: columns f and I + f), s*h (out2,
// out2_rows), and the warpgroup's three 8 KB staging slots (its two weight blocks of the held
// stage, and its box at SmemPlan::kEpiOffset), used in turn.
struct DgradBoxes {
  const CUtensorMap* dab;
  const CUtensorMap* dab_rows;
  const CUtensorMap* sh;
  const CUtensorMap* sh_rows;
  uint32_t slot[3];
};

// Warpgroup cw's part of a kDownDgrad tile: features 256 nb + 128 cw + 64 b (b = 0, 1: acc0,
// acc1) for the n (<= kBM, a multiple of 8) tokens from tile.m0. wt: the tokens' router weights
// (shared memory, a float each). A block whose features are past I stores nothing and adds 0 to
// the score.
__device__ __forceinline__ void swiglu_dgrad_epilogue(const GemmParams& p, const Tile& tile, int n,
                                                      const float (&acc0)[72], const float (&acc1)[72], int cw, int w4,
                                                      int lane, uint32_t wt, const DgradBoxes& boxes) {
  const int q = threadIdx.x & 127;
  const int g0 = 4 * tile.nb + 2 * cw;  // the 64-feature group of block 0
  const bool valid[2] = {64 * g0 < p.dgrad.I, 64 * (g0 + 1) < p.dgrad.I};
  const int J0 = tile.m0 >> 3;
  const auto chunk = [&](int b, int j) {
    return __ldg(p.gate_up.preact + preact_chunk(g0 + b, J0 + j, p.L, w4, lane));
  };
  const auto dh = [&](int b, int a) { return b ? acc1[a] : acc0[a]; };

  // The score: per token, sum over this thread's 4 features, then over the 8 lanes that share
  // the token (a fixed shuffle tree), one partial per warp: no atomics, a fixed order.
  float* part = p.dgrad.score_part + (int64_t)((tile.nb * 2 + cw) * 4 + w4) * p.L + tile.m0;
#pragma unroll
  for (int j = 0; j < kBM / 8; ++j) {
    if (8 * j >= n) break;
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if (!valid[b]) continue;
      const uint4 c = chunk(b, j);
      const uint32_t gate[2] = {c.x, c.y}, up[2] = {c.z, c.w};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float a0 = bf16_lo(gate[h]), a1 = bf16_hi(gate[h]);
        s[0] += dh(b, 4 * j + 2 * h) * (a0 * fast_sigmoid(a0) * bf16_lo(up[h]));
        s[1] += dh(b, 4 * j + 2 * h + 1) * (a1 * fast_sigmoid(a1) * bf16_hi(up[h]));
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[e] += __shfl_xor_sync(0xffffffffu, s[e], 4);
      s[e] += __shfl_xor_sync(0xffffffffu, s[e], 8);
      s[e] += __shfl_xor_sync(0xffffffffu, s[e], 16);
    }
    if (lane < 4) *reinterpret_cast<float2*>(part + 8 * j + 2 * lane) = make_float2(s[0], s[1]);
  }

  // dA, dB, s*h boxes. value(kind, b, a): accumulator a = 4j + 2h + e of block b.
  const auto token = [&](int a) { return 8 * (a >> 2) + 2 * (lane & 3) + (a & 1); };
  const auto value = [&](int kind, int b, int a) {
    const uint4 c = chunk(b, a >> 2);
    const uint32_t gw = (a & 2) ? c.y : c.x, uw = (a & 2) ? c.w : c.z;
    const float ga = (a & 1) ? bf16_hi(gw) : bf16_lo(gw), u = (a & 1) ? bf16_hi(uw) : bf16_lo(uw);
    const float s = ld_shared_f32(wt + 4 * token(a));
    const float sig = fast_sigmoid(ga), silu = ga * sig;
    if (kind == 0) return s * dh(b, a) * u * sig * (1.f + ga * (1.f - sig));
    if (kind == 1) return s * dh(b, a) * silu;
    return s * silu * u;
  };
  const int nt = n > 64 ? 2 : 1;
  int i = 0;  // boxes issued so far by this warpgroup
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if (!valid[b]) break;  // block 1 is past I too
    const int f = 64 * (g0 + b);
#pragma unroll
    for (int tb = 0; tb < 2; ++tb) {
      if (tb >= nt) break;
      const int row = tile.m0 + 64 * tb, box_rows = n - 64 * tb < 64 ? n - 64 * tb : 64;
#pragma unroll
      for (int kind = 0; kind < 3; ++kind, ++i) {
        const int k3 = i % 3;  // selects, not an indexed (local-memory) array: i is not a constant
        const uint32_t box = k3 == 0 ? boxes.slot[0] : (k3 == 1 ? boxes.slot[1] : boxes.slot[2]);
        if (i >= 3) {  // the slot's previous box has been read by its store
          if (q == 0) bulk_wait_read<2>();
          named_barrier_sync(kEpilogueBarrier + cw, 128);
        }
        put_box_transposed(box, tb, w4, lane, [&](int a) { return value(kind, b, a); });
        fence_proxy_async_shared();
        named_barrier_sync(kEpilogueBarrier + cw, 128);
        if (q == 0) {
          const CUtensorMap* full = kind == 2 ? boxes.sh : boxes.dab;
          const CUtensorMap* rows = kind == 2 ? boxes.sh_rows : boxes.dab_rows;
          const int col = kind == 1 ? p.dgrad.I + f : f;
          if (box_rows == 64)
            tma_store_2d(full, box, col, row);
          else
            for (int r = 0; r < box_rows; r += kStoreRows) tma_store_2d(rows, box + r * 128, col, row + r);
          bulk_commit_group();
        }
      }
    }
  }
}

}  // namespace gemm
}  // namespace flash_moe
