// The producer warpgroup of the grouped GEMM: the token gather (GatherA, cp.async), the e4m3
// weight and scale fetch (E4m3Weights), and the producer loop both formats share
// (produce_tiles) with each format's per-stage loads (produce_bf16, produce_mxfp8).
#pragma once

#include "moe_gemm_stages.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- producer: A operand
// Gate/up A: token rows gathered from x by the last kThreads threads of the producer
// warpgroup. Gathering thread t copies 16-byte chunk (t % 8) of rows t/8 + j*kThreads/8 straight
// into the 128-byte-swizzled layout wgmma reads; padding rows are zero-filled (src-size 0). The
// arrive on the stage's full barrier fires asynchronously when the thread's copies have landed
// (CUTLASS's SM90 cp.async mainloop does the same), so the gathering threads never wait for
// their own loads.
template <int kThreads>
struct GatherA {
  static constexpr int kFirst = 128 - kThreads;  // the producer thread that is gathering thread 0
  static constexpr int kRowStep = kThreads / 8;
  static constexpr int kSlots = (kMaxRows + kRowStep - 1) / kRowStep;  // rows per thread, extras included
  static constexpr int kFull = kBM / kRowStep;  // slots below kBM for every thread
  static_assert(kThreads % 32 == 0 && kRowStep * kSlots == kMaxRows, "whole warps; every row of a token tile once");
  // Byte address of the thread's chunk in k-block 0 of each row (slot j: tile row r0 +
  // kRowStep j; rows past kBM are gathered when the tile has more than kBM rows); a padding
  // row points at x's first row instead (valid memory, never read: its copies zero-fill), so
  // issue() only adds the k-block offset: two integer adds per copy, no select.
  const uint8_t* src[kSlots];
  uint32_t okmask;  // bit j: row j is live
  bool extra_on = false;
  int c, r0;
  uint32_t swz[2];  // the swizzle phase of the thread's even and odd slots
  __device__ GatherA() {
    const int t = (int)threadIdx.x - kFirst;
    c = t & 7;
    r0 = t >> 3;
    swz[0] = (uint32_t)((c ^ (r0 & 7)) << 4);
    swz[1] = (uint32_t)((c ^ ((r0 + kRowStep) & 7)) << 4);
  }
  __device__ static constexpr bool below_bm(int j, int r) { return j < kFull || r < kBM; }
  __device__ const uint8_t* chunk_src(const GemmParams& p, int sid, bool ok) const {
    return reinterpret_cast<const uint8_t*>(p.gather.rows + (ok ? (int64_t)(sid / p.top_k) * p.gather.ld : 0) + c * 8);
  }
  // Rows at or past tile.rows belong to the peer CTA's part (or to nothing): zero-filled, and
  // never read by the consumers, which compute at most tile.rows columns.
  __device__ void begin_tile(const GemmParams& p, const Tile& tile) {
    okmask = 0;
    extra_on = tile.rows > kBM;
    const bool idle = tile.flags & kIdle;  // zero-fills: its consumers read nothing
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int r = r0 + kRowStep * j;
      const int sid = (below_bm(j, r) || extra_on) && r < tile.rows ? p.sorted_ids[tile.m0 + r] : -1;
      const bool ok = !idle && live_slot(p, sid);
      okmask |= (ok ? 1u : 0u) << j;
      src[j] = chunk_src(p, sid, ok);
    }
  }
  __device__ void issue(const GemmParams& p, int kb, uint32_t a_smem, uint32_t full_bar) const {
    const uint32_t live = kb * kBK + c * 8 < p.K ? okmask : 0u;
    const uint32_t koff = (uint32_t)kb * (kBK * 2);
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (!below_bm(j, r0 + kRowStep * j) && !extra_on) break;  // the later slots are past kBM too
      const uint32_t dst = a_smem + (uint32_t)(r0 + kRowStep * j) * 128u + swz[kRowStep % 8 == 0 ? 0 : j & 1];
      cp_async_16(dst, src[j] + koff, ((live >> j) & 1u) ? 16u : 0u);
    }
    cp_async_arrive_noinc(full_bar);
  }
};

// ---------------------------------------------------------------- producer: e4m3 weights
// The e4m3 part of a stage (E4m3Stage): two weight boxes by TMA, their scale chunks by bulk copy.
template <Kind kKind>
struct E4m3Weights {
  static constexpr int kBoxBytes = E4m3Stage::kBoxBytes;
  static constexpr int kScaleChunk = E4m3Stage::kScaleChunk;

  __device__ static void box_rows(const GemmParams& p, const Tile& t, int (&row0)[2]) {
    row0[0] = n_origin<kKind>(t);
    row0[1] = row0[0] + p.b_second;
  }

  // TMA both boxes and bulk-copy their scale chunks into `slot` ([box 0][box 1][scales]),
  // completing on `bar`; the thread with `issue` issues (see sm90's FM_PRED). A CTA pair's tile
  // (kMulticast): CTA `rank` loads box `rank` and its scale chunks for both CTAs.
  __device__ static void fetch(const CUtensorMap& weights, const GemmParams& p, const Tile& t, int kb, uint32_t slot,
                               uint32_t bar, uint32_t extra_tx, uint32_t rank, bool issue) {
    int row0[2];
    box_rows(p, t, row0);
    const uint8_t* src[2][2];
    uint32_t bytes = 2 * kBoxBytes;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int64_t g0 = (int64_t)t.e * p.mx.scale_rows + row0[b];  // the box's first row in the scale layout
      const int64_t grp = g0 / 128;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool need = (j == 0 || g0 % 128 != 0) && grp + j < p.mx.scale_row_groups;
        src[b][j] = need ? p.mx.b_scales + ((grp + j) * p.mx.scale_col_groups + kb / 2) * kScaleChunk : nullptr;
        bytes += need ? kScaleChunk : 0;
      }
    }
    mbar_arrive_expect_tx(bar, bytes + extra_tx, issue);  // extra_tx: what the caller adds on `bar`
    const bool shared = t.flags & kMulticast;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if (shared && b != (int)rank) continue;
      const uint32_t box = slot + b * kBoxBytes;
      if (shared)
        tma_load_3d_multicast(box, &weights, kb * kBK, row0[b], t.e, bar, 0x3, issue);
      else
        tma_load_3d(box, &weights, kb * kBK, row0[b], t.e, bar, issue);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (!src[b][j]) continue;
        const uint32_t chunk = slot + 2 * kBoxBytes + (b * 2 + j) * kScaleChunk;
        if (shared)
          bulk_load_multicast(chunk, src[b][j], kScaleChunk, bar, 0x3, issue);
        else
          bulk_load(chunk, src[b][j], kScaleChunk, bar, issue);
      }
    }
  }

};

// ---------------------------------------------------------------- producers
// The producer loop of both weight formats: claim tiles until the schedule ends, fill one stage
// per k-block, publish each tile with its k-block 0, and end with a stage whose slot says
// m0 = -1. A stage starts with the 128 token rows; the gate/up GEMM's producer threads gather
// them (all 128, or warps 1-3 with kLoaderWarp), and thread 0 issues the rest
// (`load_stage(tile, kb, stage, full_bar, issue)`: the weights, and the down GEMM's h rows).
// kLoaderWarp (the MXFP8 GEMMs): all of warp 0 runs load_stage, converged, with the tile and
// the stage counter made warp-uniform, so ptxas keeps the copies' operands in uniform registers
// (lane 0 issues), and the gate/up GEMM's warps 1-3 gather: down kernel -2 to -3 %, gate/up
// kernel -1 to -2 %. Not for the bf16 GEMMs: their down GEMM is 1-2 % slower with it; and a
// gate/up warp 0 that both issues and gathers is 9-11 % slower (flash_moe/DESIGN.md §5).
template <Kind kKind, int kStages, int kStageBytes, bool kLoaderWarp = false, class LoadStage>
__device__ void produce_tiles(const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars, TileSlots& slots,
                              int nk, LoadStage load_stage) {
  constexpr int kProducers = gathers(kKind) ? 128 : (kLoaderWarp ? 32 : 1);
  if (threadIdx.x >= kProducers) return;
  const TileOrder order(p);
  GatherA<gather_threads<kLoaderWarp>()> gather;
  const bool gathering = gathers(kKind) && (int)threadIdx.x >= decltype(gather)::kFirst;
  const bool loader = !kLoaderWarp ? threadIdx.x == 0
                                   : !gathers(kKind) || __shfl_sync(0xffffffffu, threadIdx.x / 32, 0) == 0;
  uint32_t it = 0;
  for (uint32_t t = 0;; ++t) {
    Tile tile = slots.next(p, order, kProducers);
    if constexpr (kLoaderWarp) {  // the same in every lane, which ptxas cannot see through shared memory
      tile.m0 = __shfl_sync(0xffffffffu, tile.m0, 0);
      tile.nb = __shfl_sync(0xffffffffu, tile.nb, 0);
      tile.e = __shfl_sync(0xffffffffu, tile.e, 0);
      tile.flags = __shfl_sync(0xffffffffu, tile.flags, 0);
      tile.rows = __shfl_sync(0xffffffffu, tile.rows, 0);
      tile.group = __shfl_sync(0xffffffffu, tile.group, 0);
      it = t * nk;  // every tile takes nk stages (see ConsumerThread)
    }
    if (tile.m0 < 0) break;
    if (gathering) gather.begin_tile(p, tile);
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      const uint32_t stage = sbase + s * kStageBytes;
      mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
      if (loader) {
        const bool issue = threadIdx.x == 0;
        if (issue && kb == 0) TileSlots::put(slots.stage(s), tile);  // before the arrive in load_stage
        if (kKind == Kind::kDown && kb == 0 && !(tile.flags & kIdle)) HandOff::wait_ready(p, tile);
        load_stage(tile, kb, stage, bars.full(s), issue);
      }
      if (gathering) gather.issue(p, kb, stage, bars.full(s));
    }
  }
  const int s = it % kStages;
  mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
  if (threadIdx.x == 0) {
    TileSlots::put(slots.stage(s), Tile{-1, 0, 0});
    mbar_arrive(bars.full(s));
  }
  if (gathering) {
    mbar_arrive(bars.full(s));  // with thread 0's arrive: full_arrivals<kGateUp>()
    cp_async_wait_all();
  }
}

// A tile of more than kBM rows (a CTA pair's part) has up to kMaxRows - kBM more token rows:
// the gate/up gather adds them; the down GEMM loads them from h through `tokens_tail` (boxes of
// kMaxRows - kBM rows). The down GEMM loads kBM h rows even for a shorter part; the rows past
// it are read, not used.
// Maps: Bf16Maps (moe_gemm.cuh).
template <Kind kKind, int kStages, class Maps>
__device__ void produce_bf16(const Maps& tm, const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars,
                             TileSlots& slots, int nk) {
  const CUtensorMap &tokens = tm.tokens, &weights = tm.weights, &tokens_tail = tm.tokens_tail;
  using Plan = SmemPlan<kStages>;
  constexpr uint32_t kRowBytes = kBK * 2;
  auto load = [&](const Tile& tile, int kb, uint32_t a_s, uint32_t full, bool) {
    const int n0 = n_origin<kKind>(tile);
    const uint32_t b_s = a_s + Plan::kABytes;
    const bool extra = tile.rows > kBM;
    uint32_t tx = 2 * Plan::kBBoxBytes;
    if (!gathers(kKind)) tx += (extra ? kMaxRows : kBM) * kRowBytes;
    mbar_arrive_expect_tx(full, tx);
    if (!gathers(kKind)) {
      tma_load_2d(a_s, &tokens, kb * kBK, tile.m0, full);
      if (extra) tma_load_2d(a_s + kBM * kRowBytes, &tokens_tail, kb * kBK, tile.m0 + kBM, full);
    }
    if constexpr (mn_major(kKind)) {
      // Box i: features n0 + 64i .. (contiguous) x reduction rows kb * kBK ..; box i is the
      // 8 KB weight block (cw, block) = (i / 2, i % 2) (weight_block). kGateUpDgrad reduces over
      // gate rows, then up rows (b_second = I, a multiple of kBK): w1's, then w3's. A CTA pair's
      // tile (kGateUpDgrad only): CTA r loads boxes 2r and 2r + 1 for both.
      const bool up = kKind == Kind::kGateUpDgrad && kb * kBK >= p.b_second;
      const CUtensorMap* map = up ? &tm.weights2 : &weights;
      const int r0 = kb * kBK - (up ? p.b_second : 0);
      constexpr uint32_t kMnBoxBytes = Plan::kBBoxBytes / 2;
      // slots.paired is the kernel's kPaired, a constant once inlined: the unpaired SASS is as before
      if (slots.paired && (tile.flags & kMulticast)) {
        const int i0 = 2 * (int)slots.rank;
#pragma unroll
        for (int i = i0; i < i0 + 2; ++i)
          tma_load_3d_multicast(b_s + i * kMnBoxBytes, map, n0 + 64 * i, r0, tile.e, full, 0x3);
        return;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) tma_load_3d(b_s + i * kMnBoxBytes, map, n0 + 64 * i, r0, tile.e, full);
      return;
    }
    // Box 1: gate/up, the up rows (w3's map); down, the n-block's second 128 rows.
    const CUtensorMap* map1 = kKind == Kind::kGateUp ? &tm.weights2 : &weights;
    const int row1 = kKind == Kind::kGateUp ? n0 : n0 + p.b_second;
    if (tile.flags & kMulticast) {
      // CTA r of the pair loads box r for both: each weight byte leaves L2 once per pair.
      const uint32_t r = slots.rank;
      tma_load_3d_multicast(b_s + r * Plan::kBBoxBytes, r ? map1 : &weights, kb * kBK, r ? row1 : n0, tile.e, full,
                            0x3);
    } else {
      tma_load_3d(b_s, &weights, kb * kBK, n0, tile.e, full);
      tma_load_3d(b_s + Plan::kBBoxBytes, map1, kb * kBK, row1, tile.e, full);
    }
  };
  produce_tiles<kKind, kStages, Plan::kStageBytes>(p, sbase, bars, slots, nk, load);
}

template <Kind kKind, int kStages>
__device__ void produce_mxfp8(const CUtensorMap& tokens, const CUtensorMap& weights, const GemmParams& p,
                              uint32_t sbase, const Barriers<kStages>& bars, TileSlots& slots, int nk) {
  using Plan = Mxfp8Plan<kStages>;
  produce_tiles<kKind, kStages, Plan::kStageBytes, true>(
      p, sbase, bars, slots, nk, [&](const Tile& tile, int kb, uint32_t tok, uint32_t full, bool issue) {
        E4m3Weights<kKind>::fetch(weights, p, tile, kb, tok + Plan::kTokBytes, full,
                                  kKind == Kind::kDown ? Plan::kTokBytes : 0, slots.rank, issue);
        if (kKind == Kind::kDown) tma_load_2d(tok, &tokens, kb * kBK, tile.m0, full, issue);
      });
}

}  // namespace gemm
}  // namespace flash_moe
