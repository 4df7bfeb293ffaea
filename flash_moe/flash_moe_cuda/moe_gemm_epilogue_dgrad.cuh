// The backward's SwiGLU epilogue (kDownDgrad) and the training forward's pre-activation store
// (kGateUp with GemmParams::gather.preact), which meet in one layout (preact_chunk).
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
// 32-row x 64-feature boxes through shared memory by TMA. Every row of an m-block
// with a live row is written, padding rows as zeros: the weight-gradient GEMMs read dA|dB and s*h
// by TMA in 64-row blocks up to an expert's last live row, and multiply what lies past it by zeros.
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
__device__ __forceinline__ void store_preact(const GemmParams& p, const Tile& tile, int n,
                                             const float (&acc0)[kMaxRows / 2], const float (&acc1)[kMaxRows / 2],
                                             int cw, int w4, int lane) {
  const int g = 2 * tile.nb + cw;
  if (64 * g >= p.n_out) return;
#pragma unroll
  for (int j = 0; j < kMaxRows / 8; ++j) {
    if (8 * j >= n) break;
    const uint4 v{bf16x2_bits(acc0[4 * j], acc0[4 * j + 1]), bf16x2_bits(acc0[4 * j + 2], acc0[4 * j + 3]),
                  bf16x2_bits(acc1[4 * j], acc1[4 * j + 1]), bf16x2_bits(acc1[4 * j + 2], acc1[4 * j + 3])};
    p.gather.preact[preact_chunk(g, (tile.m0 >> 3) + j, p.L, w4, lane)] = v;
  }
}

// Late in warpgroup cw's kDownDgrad mainloop: its tile's pre-activations (for each of its two
// 64-feature groups, the n / 8 chunks of 2 KB from the tile's first 8-row group, contiguous) are
// pulled into L2, so the epilogue's loads find them there.
__device__ __forceinline__ void prefetch_preact(const GemmParams& p, const Tile& tile, int n, int cw) {
  if ((threadIdx.x & 127) != 0) return;
  const int g0 = 4 * tile.nb + 2 * cw;
#pragma unroll
  for (int b = 0; b < 2; ++b)
    if (64 * (g0 + b) < p.n_out)
      bulk_prefetch_l2(p.gather.preact + preact_chunk(g0 + b, tile.m0 >> 3, p.L, 0, 0), (uint32_t)(n / 8) * 2048u);
}

// sigmoid(a) with the forward's fast exponential (silu_times): 1 / (1 + 2^(-a log2 e)).
__device__ __forceinline__ float fast_sigmoid(float a) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-a * 1.4426950408889634f));
  return __fdividef(1.f, 1.f + e);
}

// Where kDownDgrad's boxes go: dA|dB (out: columns f and I + f), s*h (out2), and the
// warpgroup's three 8 KB staging slots (its two weight blocks of the held stage, and its box at
// SmemPlan::kEpiOffset), one per output.
struct DgradBoxes {
  const CUtensorMap* dab;
  const CUtensorMap* sh;
  uint32_t slot[3];
};

// Rows per TMA store of kDownDgrad's outputs: half a 64-row slot, so consecutive passes write
// different halves (the host's dA|dB and s*h maps use boxes of this many rows).
constexpr int kDgradStoreRows = 32;

// Warpgroup cw's part of a kDownDgrad tile: features 256 nb + 128 cw + 64 b (b = 0, 1: acc0,
// acc1) for the n (<= kBM, a multiple of 8) tokens from tile.m0, and zeros for the m-block's
// rows n.. (no pre-activations read there). wt: the tokens' router weights (shared memory, a
// float each; 0 for padding). A block whose features are past I stores nothing.
//
// One pass per block and 32-token quarter, two 8-token groups (two preact chunks) at a time; each
// element's sigmoid feeds all four results: the score term, then dA, dB and s*h, which go to
// the three slots (stmatrix .trans, as put_box<true>) and leave as three TMA stores. Pass p + 1's
// four pre-activation chunks are loaded during pass p, and the passes alternate between the
// slots' two 32-row halves, so a pass waits only for the stores of the pass before last: about
// one load latency per tile rather than one per pass. The score partials are per warp and per
// block: part[((nb * 2 + cw) * 2 + b) * 4 + w4][position].
__device__ __forceinline__ void swiglu_dgrad_epilogue(const GemmParams& p, const Tile& tile, int n,
                                                      const float (&acc0)[kMaxRows / 2],
                                                      const float (&acc1)[kMaxRows / 2], int cw, int w4, int lane,
                                                      uint32_t wt, const DgradBoxes& boxes) {
  constexpr uint32_t kHalfBytes = kDgradStoreRows * 128;
  const int q = threadIdx.x & 127;
  const int g0 = 4 * tile.nb + 2 * cw;  // the 64-feature group of block 0
  const int J0 = tile.m0 >> 3;
  const int mh = (lane >> 3) & 1, mj = lane >> 4, mi = lane & 7;  // stmatrix .trans addressing
  const int blocks = 64 * g0 >= p.n_out ? 0 : (64 * (g0 + 1) >= p.n_out ? 1 : 2);  // blocks before I
  const auto load = [&](int pass, uint4 (&c)[4]) {
    const int b = pass >> 2, j0 = 4 * (pass & 3);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      c[jj] = 8 * (j0 + jj) < n ? __ldg(p.gather.preact + preact_chunk(g0 + b, J0 + j0 + jj, p.L, w4, lane))
                                : make_uint4(0u, 0u, 0u, 0u);
  };
  uint4 cur[4];
  if (blocks > 0) load(0, cur);
#pragma unroll
  for (int pass = 0; pass < 8; ++pass) {
    if (pass >= 4 * blocks) break;
    const int b = pass >> 2, quarter = pass & 3, half = pass & 1;
    const int f = 64 * (g0 + b);
    float* part = p.dgrad.score_part + (int64_t)(((tile.nb * 2 + cw) * 2 + b) * 4 + w4) * p.L + tile.m0;
    uint4 nxt[4];
    // This half's boxes of two passes ago have been read by their stores (the previous tile's were
    // waited for when its held stage was released, at this tile's first k-block).
    if (pass >= 2) {
      if (q == 0) bulk_wait_read<1>();
      named_barrier_sync(kEpilogueBarrier + cw, 128);
    }
#pragma unroll
    for (int jj = 0; jj < 4; jj += 2) {
      // The next pass's chunks, in flight during this pass's second half, its stores and its
      // barriers (issued once cur[0..1] are spent: loading them first spilled registers).
      if (jj == 2 && pass + 1 < 4 * blocks) load(pass + 1, nxt);
      uint32_t v[3][2][2];  // [output][dj][h]: bf16x2 of tokens e = 0, 1
#pragma unroll
      for (int dj = 0; dj < 2; ++dj) {
        const int j = 4 * quarter + jj + dj;  // the tile's 8-row group
        if (8 * j >= n) {  // rows past the tile's tokens: zeros (the accumulators are stale)
#pragma unroll
          for (int o = 0; o < 3; ++o) v[o][dj][0] = v[o][dj][1] = 0u;
          continue;
        }
        const uint4 cj = cur[jj + dj];
        const uint32_t gate[2] = {cj.x, cj.y}, up[2] = {cj.z, cj.w};
        float score[2] = {0.f, 0.f};
        float r[3][2][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float s = ld_shared_f32(wt + 4 * (8 * j + 2 * (lane & 3) + e));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float ga = e ? bf16_hi(gate[h]) : bf16_lo(gate[h]), u = e ? bf16_hi(up[h]) : bf16_lo(up[h]);
            const float d = b ? acc1[4 * j + 2 * h + e] : acc0[4 * j + 2 * h + e];
            const float sig = fast_sigmoid(ga), silu = ga * sig, hv = silu * u, sd = s * d;
            score[e] += d * hv;
            r[0][h][e] = sd * u * sig * (1.f + ga * (1.f - sig));
            r[1][h][e] = sd * silu;
            r[2][h][e] = s * hv;
          }
        }
#pragma unroll
        for (int o = 0; o < 3; ++o)
#pragma unroll
          for (int h = 0; h < 2; ++h) v[o][dj][h] = bf16x2_bits(r[o][h][0], r[o][h][1]);
        // The score: over the 8 lanes that share the tokens (a fixed shuffle tree).
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          score[e] += __shfl_xor_sync(0xffffffffu, score[e], 4);
          score[e] += __shfl_xor_sync(0xffffffffu, score[e], 8);
          score[e] += __shfl_xor_sync(0xffffffffu, score[e], 16);
        }
        if (lane < 4) *reinterpret_cast<float2*>(part + 8 * j + 2 * lane) = make_float2(score[0], score[1]);
      }
      // Slot row 32 half + 8 (jj + mj) + mi, whose low 3 bits (mi) are the swizzle phase; the half's
      // offset added apart keeps one address register for both halves (no spill).
      const uint32_t off = half * kHalfBytes + (8 * (jj + mj) + mi) * 128 + (((2 * w4 + mh) ^ mi) << 4);
#pragma unroll
      for (int o = 0; o < 3; ++o) stmatrix_x4_trans(boxes.slot[o] + off, v[o][0][0], v[o][0][1], v[o][1][0], v[o][1][1]);
    }
    fence_proxy_async_shared();
    named_barrier_sync(kEpilogueBarrier + cw, 128);
    if (q == 0) {
#pragma unroll
      for (int o = 0; o < 3; ++o)
        tma_store_2d(o == 2 ? boxes.sh : boxes.dab, boxes.slot[o] + half * kHalfBytes, o == 1 ? p.n_out + f : f,
                     tile.m0 + kDgradStoreRows * quarter);
      bulk_commit_group();
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) cur[jj] = nxt[jj];  // after the last pass unused (a guard here spilled)
  }
}

}  // namespace gemm
}  // namespace flash_moe
