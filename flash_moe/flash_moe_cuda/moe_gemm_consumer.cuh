// The bf16 path's consumer warpgroups: m64n128k16 wgmma with both operands in shared memory,
// then the epilogues of moe_gemm_epilogue.cuh. ConsumerThread is shared with the MXFP8 consumer.
#pragma once

#include "moe_gemm_epilogue.cuh"
#include "moe_gemm_stages.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- consumer thread
// Both formats' consumers: a thread's warpgroup cw (0 or 1; warpgroup 0 is the producer), its
// warp w4 in that warpgroup and its lane, and two m64n128 fp32 accumulators zeroed once (the
// first wgmma of every tile overwrites them; zeroing only gives them a defined start).
struct ConsumerThread {
  int cw = threadIdx.x / 128 - 1;
  int w4 = (threadIdx.x / 32) & 3;
  int lane = threadIdx.x & 31;
};
template <int kN>
__device__ __forceinline__ void zero_fill(float (&acc)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i] = 0.f;
}
// The accumulator registers of a narrower wgmma: an m64nN tile's fp32 layout is the first N/2
// registers of any wider one's (column groups of 8 in order).
template <int kN, int kM>
__device__ __forceinline__ float (&leading(float (&acc)[kM]))[kN] {
  static_assert(kN <= kM, "a narrower view");
  return *reinterpret_cast<float(*)[kN]>(&acc[0]);
}

// ---------------------------------------------------------------- consumer
// Each consumer warpgroup owns 64 rows of the tile and two m64n128 accumulators (gate/up, or
// the two 128-column halves of the down tile). A stage is released (empty barrier, one
// arrive per warp) once the wgmmas of the next stage are issued and those of it retired.
template <Kind kKind, int kStages>
__device__ void consume_bf16(const CUtensorMap* tmC, const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars,
                             const TileSlots& slots, int nk) {
  using Plan = SmemPlan<kStages>;
  const ConsumerThread me;
  const int cw = me.cw, w4 = me.w4, lane = me.lane;
  const StagedStore staged(sbase + Plan::kEpiOffset, cw);
  float acc0[64], acc1[64];
  zero_fill(acc0);
  zero_fill(acc1);
  HandOff handoff;
  for (uint32_t it = 0;;) {
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    // A warpgroup whose 64 rows are all padding (the tail of an expert's run that fills at most
    // half a tile) skips its wgmmas and its stores: the tensor cores then serve the other
    // warpgroup alone. Both GEMMs split the same 128-row blocks the same way, so the h rows a
    // skipped gate/up half leaves unwritten are read only by a skipped down half.
    // An idle CTA of a pair (kIdle) skips the same way but has no h tile to count.
    const int sid = p.sorted_ids[tile.m0 + cw * 64 + (threadIdx.x & 63)];
    const bool idle = tile.flags & kIdle;
    if (idle || !named_barrier_or(2 + cw, 128, sid >= 0 && sid < p.n_slots)) {
      pass_tile(bars, it, nk, lane);
      if (kKind == Kind::kGateUp && !idle) HandOff::count_empty(p, tile);
      continue;
    }
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(bars.full(s), (it / kStages) & 1);
      const uint32_t a_base = sbase + s * Plan::kStageBytes + cw * (Plan::kABytes / 2);
      const uint32_t b_base = sbase + s * Plan::kStageBytes + Plan::kABytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = make_desc_sw128(a_base + kk * 32);
        const uint64_t db0 = make_desc_sw128(b_base + kk * 32);
        const uint64_t db1 = make_desc_sw128(b_base + Plan::kBBoxBytes + kk * 32);
        const int sc = (kb > 0 || kk > 0) ? 1 : 0;
        wgmma_m64n128k16_bf16(acc0, da, db0, sc);
        wgmma_m64n128k16_bf16(acc1, da, db1, sc);
      }
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();
        if (lane == 0) bars.release((it - 1) % kStages);
      }
    }
    wgmma_wait<0>();
    if (lane == 0) bars.release((it - 1) % kStages);

    if (kKind == Kind::kGateUp) {
      handoff.flush<true>(p, 2 + cw);
      handoff.pending = tile.m0 / kBM;
      stage_swiglu(staged, tmC, tile, cw, w4, lane, acc0, acc1);
    } else {
      stage_weighted(staged, tmC, p, tile, cw, w4, lane, acc0, acc1);
    }
  }
  staged.drain();
  if (kKind == Kind::kGateUp) handoff.flush<true>(p, 2 + cw);
}

}  // namespace gemm
}  // namespace flash_moe
