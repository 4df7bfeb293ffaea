// The shared-memory pipeline of the grouped GEMM: what one stage holds for each weight format
// (SmemPlan, Mxfp8Plan: byte offsets of stages, staging buffers, barriers and slots), the
// full/empty mbarriers of the stage ring, and the consumers' wait for a tile's first stage.
#pragma once

#include "moe_gemm_schedule.cuh"

namespace flash_moe {
namespace gemm {

// bf16 path: a stage is the token tile -- up to kMaxRows rows, 16 more than an m-block for a
// CTA pair's longer part (Tile) -- and two 128-row weight boxes.
// With four stages there is room for one 64 x 64 output box per consumer warpgroup (the
// consumers stage their other boxes in the tile's last stage, see consume_bf16) and the down
// tile's router weights.
template <int kStages>
struct SmemPlan {
  static constexpr int kTokenRows = kMaxRows;
  static constexpr int kABytes = kTokenRows * kBK * 2;  // 18 KB bf16 token tile
  static constexpr int kBBoxBytes = 128 * kBK * 2;      // 16 KB: one 128-row bf16 weight box
  static constexpr int kStageBytes = kABytes + 2 * kBBoxBytes;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
  static constexpr int kEpiOffset = kStages * kStageBytes;  // per consumer: one 64 x 64 bf16 box
  static constexpr int kEpiBytes = 2 * 64 * 64 * 2;
  static constexpr int kWtOffset = kEpiOffset + kEpiBytes;  // per consumer: kTokenRows floats
  static constexpr int kBarOffset = kWtOffset + 2 * kTokenRows * 4;
  static constexpr int kSlotOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kSlotOffset + TileSlots::bytes(kStages);
  static constexpr int kLaunchBytes = kBytes + 1024;  // slack for the 1024-byte alignment
  static_assert(kLaunchBytes <= 227 * 1024, "fits an SM's shared memory");
};

// MXFP8 path: the e4m3 part of a stage holds the two 128-row weight boxes of a k-block (64-byte
// rows, TMA swizzle 64B) and the blocked-layout scale chunks covering them (one 512-byte chunk
// per 128-row group a box overlaps, two when it does not start on a group boundary).
struct E4m3Stage {
  static constexpr int kBoxBytes = 128 * kBK;  // 8 KB
  static constexpr int kScaleChunk = 512;      // 128 rows x 4 scales of the blocked layout
  static constexpr int kBytes = 2 * kBoxBytes + 2 * 2 * kScaleChunk;
};

// MXFP8 path: a stage is the 128-row bf16 token tile and the e4m3 weights of the k-block.
template <int kStages>
struct Mxfp8Plan {
  static constexpr int kTokBytes = kBM * kBK * 2;   // 16 KB bf16 token tile (B operand)
  static constexpr int kFp8BoxBytes = E4m3Stage::kBoxBytes;
  static constexpr int kScaleChunk = E4m3Stage::kScaleChunk;
  static constexpr int kStageBytes = kTokBytes + E4m3Stage::kBytes;  // 34 KB
  static constexpr int kWtOffset = kStages * kStageBytes;  // per WG: the tile's router weights (down)
  // or its tokens' window factors (gate/up, f16 path)
  static constexpr int kBarOffset = kWtOffset + 2 * kBM * 4;
  static constexpr int kSlotOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kSlotOffset + TileSlots::bytes(kStages);
  static constexpr int kLaunchBytes = kBytes + 1024;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
};

// ---------------------------------------------------------------- barriers
// CTA pairs: both CTAs load into each other's stages (multicast), so a stage may be refilled only
// when the consumers of both are done with it: each consumer warp releases a stage on both
// CTAs' empty barriers (16 arrivals instead of 8).
template <int kStages>
struct Barriers {
  uint32_t base;
  uint32_t peer = 0;  // `base` in the other CTA of the pair (peer_smem), or 0 without pairs
  __device__ uint32_t full(int s) const { return base + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + 8 * (kStages + s); }
  __device__ static constexpr uint32_t empty_arrivals(bool paired) { return paired ? 16u : 8u; }
  // One lane per consumer warp: this warp is done with stage s.
  __device__ void release(int s) const {
    mbar_arrive(empty(s));
    if (peer) mbar_arrive_peer_relaxed(peer + 8 * (kStages + s));
  }
};

// A consumer warpgroup's hold on its tile's last stage, over whose shared memory its epilogue
// stages output boxes (besides its own box or boxes): released once the boxes' TMA stores have read
// them, after the next tile's first wgmmas (if any) are issued (the producer is then kStages - 1
// ahead).
template <int kStages>
struct HeldStage {
  int stage = -1;
  __device__ void release(const Barriers<kStages>& bars, int cw) {
    if (stage < 0) return;
    if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();  // also frees the warpgroup's own box(es)
    named_barrier_sync(kEpilogueBarrier + cw, 128);
    if ((threadIdx.x & 31) == 0) bars.release(stage);
    stage = -1;
  }
  // The ring step after k-block kb's wgmmas are committed (`it`: kb's stage number): at kb = 0
  // the previous tile's held stage goes; later, k-block kb - 1 is waited for and its stage goes.
  __device__ __forceinline__ void after_k_block(const Barriers<kStages>& bars, int kb, uint32_t it, int cw, int lane) {
    if (kb == 0) release(bars, cw);
    if (kb > 0) {
      wgmma_wait<1>();
      if (lane == 0) bars.release((it - 1) % kStages);
    }
  }
  // After the tile's last k-block (`it`: one past its stage): every wgmma done, that stage kept.
  __device__ __forceinline__ void hold_last(uint32_t it) {
    wgmma_wait<0>();
    stage = (it - 1) % kStages;
  }
};

// The gate/up GEMM's producer threads that gather token rows: all 128, or warps 1-3 when warp 0
// issues the weight copies (kLoaderWarp, the MXFP8 GEMMs; see produce_tiles).
template <bool kLoaderWarp>
__host__ __device__ constexpr int gather_threads() {
  return kLoaderWarp ? 96 : 128;
}
// Arrivals that complete a stage: gathered tokens = one cp.async arrival per gathering thread,
// plus thread 0's expect_tx arrive for the weights; down GEMM = thread 0's expect_tx arrive
// covering tokens and weights.
template <Kind kKind, bool kLoaderWarp>
__host__ __device__ constexpr uint32_t full_arrivals() {
  return gathers(kKind) ? gather_threads<kLoaderWarp>() + 1u : 1u;
}

// Consumers (whole warps): wait for the stage that starts the next tile and read the tile it
// carries. Lane 0 reads the slot and broadcasts it because lane 0 is the thread that releases the
// stage: its own arrive orders the read before the producer's next put. Racecheck credits an order
// only through the reading thread's own arrive; with every lane reading it reported the next put
// as a race (DESIGN.md §8.1 (g)).
template <int kStages>
__device__ __forceinline__ Tile wait_tile(const Barriers<kStages>& bars, const TileSlots& slots, uint32_t it) {
  const int s = it % kStages;
  mbar_wait(bars.full(s), (it / kStages) & 1);
  return TileSlots::get_lane0<Tile>(slots.stage(s));
}

// Consumers with nothing to compute in a tile (all-padding rows, a pair's idle CTA): take and
// release its nk stages in turn, so the ring stays in step. `it` advances past the tile.
template <int kStages>
__device__ __forceinline__ void pass_tile(const Barriers<kStages>& bars, uint32_t& it, int nk, int lane) {
  for (int kb = 0; kb < nk; ++kb, ++it) {
    mbar_wait(bars.full(it % kStages), (it / kStages) & 1);
    if (lane == 0) bars.release(it % kStages);
  }
}

}  // namespace gemm
}  // namespace flash_moe
