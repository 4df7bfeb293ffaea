// The grouped GEMMs both fused MoE ops run twice per call (Hopper, sm_90a), split by role:
//
//   scheduler              tiles claimed in order from a global counter (TileOrder, TileSlots)
//   producers              token rows gathered from x (cp.async) or h rows (TMA); weights as
//                          bf16 boxes (TMA) or e4m3 boxes + their blocked scales (TMA + bulk copy)
//   consumers              two warpgroups, m64n128k16 bf16 wgmma, fp32 accumulators
//   epilogues              SwiGLU (gate/up GEMM) or router weight (down GEMM), bf16 out: the
//                          bf16 path stages its blocks in shared memory for TMA stores
//                          (StagedStore), the MXFP8 path stores from registers
//
// bf16 (moe_gemm_kernel<Weights::kBf16>): tokens are the M side, 128 x 256 x 64 tiles (128 gate + 128 up
// columns, or 256 output columns). MXFP8 (Weights::kMxfp8): the weights are the M side,
// dequantized in registers into wgmma's register operand; tokens are the 128-column N side.
// One producer warpgroup and two consumer warpgroups share a kStages-deep ring of shared-memory
// stages guarded by mbarriers.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "flash_moe.cuh"
#include "mxfp8.cuh"
#include "sm90.cuh"

namespace flash_moe {
namespace gemm {

using namespace sm90;

constexpr int kBM = kBlockM;  // 128 rows (slots) per tile
constexpr int kBK = 64;       // 64 bf16 = 128 bytes: one swizzle-128B row
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups

enum class Kind { kGateUp, kDown };

struct GemmParams {
  const __nv_bfloat16* x;        // kGateUp: the gathered A source (M, K) bf16
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;
  const float* topk_weights;     // kDown
  __nv_bfloat16* out;            // kGateUp: h (L, I); kDown: Y (L, Kd)
  int64_t lda;                   // kGateUp: row stride of x (= K)
  int64_t ldo;                   // row stride of out
  int L;                         // sorted_ids length
  int n_slots;                   // M * top_k (the padding sentinel)
  int top_k;
  int E;
  int K;                         // reduction length
  int n_out;                     // valid output columns
  int num_n;                     // n-blocks per m-block
  int* tile_counter;             // tiles claimed so far (zero before the launch)
  int b_second;                  // row offset of the second weight box from the first
  // MXFP8 only: weight scales in the blocked layout of the (E * b_rows, K/32) scale matrix.
  const uint8_t* b_scales;
  int b_rows;                    // rows of B per expert (2I for gate/up, Kd for down)
  int scale_col_groups;          // ceil((K/32) / 4): 512-byte chunks per 128-row group
  int scale_row_groups;          // ceil(E * b_rows / 128)
};

// ---------------------------------------------------------------- scheduler
struct Tile {
  int m0, nb, e;  // m0 < 0: the end of the schedule
};

// The (m-block, n-block) grid that num_tokens_post_padded (read on the device) covers, in the
// order tiles are handed out: the n-blocks of an m-block next to each other (they share its
// token rows), then the next m-block (an expert's m-blocks are consecutive, so its weight rows
// are shared num_n tiles apart).
struct TileOrder {
  int num_m, num_n;
  __device__ explicit TileOrder(const GemmParams& p) : num_n(p.num_n) {
    int ntpp = *p.ntpp;
    ntpp = ntpp < 0 ? 0 : (ntpp > p.L ? p.L : ntpp);
    num_m = (ntpp + kBM - 1) / kBM;
  }
  __device__ int count() const { return num_m * num_n; }
};

// Tiles are claimed in TileOrder from a counter in global memory (zeroed before the launch),
// so the tiles running at any moment are neighbours in that order and read their shared rows
// from L2 at nearly the same time. (A static split -- CTA b taking tiles b, b + grid, ... --
// let the CTAs drift apart: at E = 256 the bf16 weights were read 2.4 times from DRAM, 1.8
// times with the counter.) Blocks whose expert is outside [0, E) are skipped, so corrupted
// routing buffers cannot send a CTA out of bounds.
__device__ Tile claim_tile(const GemmParams& p, const TileOrder& order) {
  for (;;) {
    const int t = atomicAdd(p.tile_counter, 1);
    if (t >= order.count()) return Tile{-1, 0, 0};
    const int mb = t / order.num_n, nb = t - mb * order.num_n;
    const int e = p.expert_ids[mb];
    if (e >= 0 && e < p.E) return Tile{mb * kBM, nb, e};
  }
}

// Shared-memory tile slots. The producer's thread 0 claims a tile and hands it to the other
// producer threads through `claim` (two slots alternate, so a write never meets a pending
// read); the tile then travels with its first k-block: the producer writes it into the slot of
// the stage that holds k-block 0 before arriving on that stage's full barrier, and the
// consumers read it after their wait. A stage whose slot says m0 < 0 ends the schedule.
struct TileSlots {
  uint32_t base;  // 16 bytes per slot: [2] claim slots, then [stages] stage slots
  int claims = 0;
  static constexpr int bytes(int stages) { return (2 + stages) * 16; }
  __device__ explicit TileSlots(uint32_t addr) : base(addr) {}
  __device__ uint32_t claim(int i) const { return base + 16 * i; }
  __device__ uint32_t stage(int s) const { return base + 16 * (2 + s); }
  __device__ static void put(uint32_t slot, const Tile& t) { st_shared_v4(slot, (uint32_t)t.m0, (uint32_t)t.nb, (uint32_t)t.e, 0u); }
  __device__ static Tile get(uint32_t slot) {
    const uint4 v = ld_shared_v4(slot);
    return Tile{(int)v.x, (int)v.y, (int)v.z};
  }
  // Producer threads (all `threads` of them call it): the next tile.
  __device__ Tile next(const GemmParams& p, const TileOrder& order, int threads) {
    const uint32_t slot = claim(claims++ & 1);
    if (threadIdx.x == 0) put(slot, claim_tile(p, order));
    if (threads > 1) named_barrier_sync(1, threads);
    return get(slot);
  }
};

// bf16 path: a stage is the 128-row token tile and two 128-row weight boxes.
template <int kStages>
struct SmemPlan {
  static constexpr int kABytes = kBM * kBK * 2;     // 16 KB bf16 token tile
  static constexpr int kBBoxBytes = 128 * kBK * 2;  // 16 KB: one 128-row bf16 weight box
  static constexpr int kStageBytes = kABytes + 2 * kBBoxBytes;
  static constexpr int kEpiOffset = kStages * kStageBytes;  // a 64 x 128 bf16 output block per consumer
  static constexpr int kEpiBytes = 2 * 64 * 128 * 2;
  static constexpr int kBarOffset = kEpiOffset + kEpiBytes;
  static constexpr int kSlotOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kSlotOffset + TileSlots::bytes(kStages);
  static constexpr int kLaunchBytes = kBytes + 1024;  // slack for the 1024-byte alignment
};

template <Kind kKind>
__device__ __forceinline__ int n_origin(const Tile& t) {
  return t.nb * (kKind == Kind::kGateUp ? 128 : 256);
}

// ---------------------------------------------------------------- producer: A operand
// Gate/up A: token rows gathered from x by kGatherThreads threads. Thread t copies 16-byte
// chunk (t % 8) of rows t/8 + j*kGatherThreads/8 straight into the 128-byte-swizzled layout
// wgmma reads; padding rows are zero-filled (src-size 0). The arrive on the stage's full
// barrier fires asynchronously when the thread's copies have landed (CUTLASS's SM90 cp.async
// mainloop does the same), so the gathering threads never wait for their own loads.
template <int kGatherThreads>
struct GatherA {
  static constexpr int kRowStep = kGatherThreads / 8;
  static constexpr int kRows = kBM / kRowStep;  // rows per thread
  const __nv_bfloat16* src[kRows];
  uint32_t okmask;
  int c, r0;
  uint32_t swz;
  __device__ GatherA() {
    const int t = threadIdx.x;
    c = t & 7;
    r0 = t >> 3;
    swz = (uint32_t)((c ^ (r0 & 7)) << 4);  // rows r0 + j*kRowStep share r0's swizzle phase
  }
  __device__ void begin_tile(const GemmParams& p, const Tile& tile) {
    okmask = 0;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int sid = p.sorted_ids[tile.m0 + r0 + kRowStep * j];
      const bool ok = sid >= 0 && sid < p.n_slots;
      okmask |= (ok ? 1u : 0u) << j;
      src[j] = p.x + (ok ? (int64_t)(sid / p.top_k) * p.lda : 0) + c * 8;
    }
  }
  __device__ void issue(const GemmParams& p, int kb, uint32_t a_smem, uint32_t full_bar) const {
    const bool kok = kb * kBK + c * 8 < p.K;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const bool ok = kok && ((okmask >> j) & 1u);
      const uint32_t dst = a_smem + (uint32_t)(r0 + kRowStep * j) * 128u + swz;
      cp_async_16(dst, ok ? (const void*)(src[j] + kb * kBK) : (const void*)p.x, ok ? 16u : 0u);
    }
    cp_async_arrive_noinc(full_bar);
  }
};

// ---------------------------------------------------------------- producer: e4m3 weights
// The e4m3 part of a stage holds the two 128-row weight boxes of a k-block (64-byte rows, TMA
// swizzle 64B) and the blocked-layout scale chunks covering them (one 512-byte chunk per
// 128-row group a box overlaps, two when it does not start on a group boundary).
template <Kind kKind>
struct E4m3Weights {
  static constexpr int kBoxBytes = 128 * kBK;  // 8 KB
  static constexpr int kScaleChunk = 512;      // 128 rows x 4 scales of the blocked layout
  static constexpr int kBytes = 2 * kBoxBytes + 2 * 2 * kScaleChunk;

  __device__ static void box_rows(const GemmParams& p, const Tile& t, int (&row0)[2]) {
    row0[0] = n_origin<kKind>(t);
    row0[1] = row0[0] + p.b_second;
  }

  // One thread: TMA both boxes and bulk-copy their scale chunks into `slot` ([box 0][box 1]
  // [scales]), completing on `bar`.
  __device__ static void fetch(const CUtensorMap& tmB, const GemmParams& p, const Tile& t, int kb, uint32_t slot,
                               uint32_t bar, uint32_t extra_tx = 0) {
    int row0[2];
    box_rows(p, t, row0);
    const uint8_t* src[2][2];
    uint32_t bytes = 2 * kBoxBytes;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int64_t g0 = (int64_t)t.e * p.b_rows + row0[b];
      const int64_t grp = g0 / 128;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool need = (j == 0 || g0 % 128 != 0) && grp + j < p.scale_row_groups;
        src[b][j] = need ? p.b_scales + ((grp + j) * p.scale_col_groups + kb / 2) * kScaleChunk : nullptr;
        bytes += need ? kScaleChunk : 0;
      }
    }
    mbar_arrive_expect_tx(bar, bytes + extra_tx);  // extra_tx: what the caller adds on `bar`
    tma_load_3d(slot, &tmB, kb * kBK, row0[0], t.e, bar);
    tma_load_3d(slot + kBoxBytes, &tmB, kb * kBK, row0[1], t.e, bar);
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (src[b][j])
          bulk_load(slot + 2 * kBoxBytes + (b * 2 + j) * kScaleChunk, src[b][j], kScaleChunk,
                    bar);
  }

};

// ---------------------------------------------------------------- barriers
template <int kStages>
struct Barriers {
  uint32_t base;
  __device__ uint32_t full(int s) const { return base + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + 8 * (kStages + s); }
};

// Arrivals that complete a stage: gathered tokens = one cp.async arrival per producer thread,
// plus thread 0's expect_tx arrive for the weights; down GEMM = thread 0's expect_tx arrive
// covering tokens and weights.
template <Kind kKind>
__host__ __device__ constexpr uint32_t full_arrivals() {
  return kKind == Kind::kGateUp ? 128u + 1u : 1u;
}

// ---------------------------------------------------------------- producers
// The producer loop of both weight formats: claim tiles until the schedule ends, fill one stage
// per k-block, publish each tile with its k-block 0, and end with a stage whose slot says
// m0 = -1. A stage starts with the 128 token rows; the gate/up GEMM's 128 producer threads
// gather them, and thread 0 issues the rest (`load_stage(tile, kb, stage, full_bar)`: the
// weights, and the down GEMM's h rows).
template <Kind kKind, int kStages, int kStageBytes, class LoadStage>
__device__ void produce_tiles(const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars, TileSlots& slots,
                              int nk, LoadStage load_stage) {
  constexpr int kProducers = kKind == Kind::kGateUp ? 128 : 1;
  if (threadIdx.x >= kProducers) return;
  const TileOrder order(p);
  GatherA<128> gather;
  uint32_t it = 0;
  for (;;) {
    const Tile tile = slots.next(p, order, kProducers);
    if (tile.m0 < 0) break;
    if (kKind == Kind::kGateUp) gather.begin_tile(p, tile);
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      const uint32_t stage = sbase + s * kStageBytes;
      mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
      if (threadIdx.x == 0) {
        if (kb == 0) TileSlots::put(slots.stage(s), tile);  // before the arrive in load_stage
        load_stage(tile, kb, stage, bars.full(s));
      }
      if (kKind == Kind::kGateUp) gather.issue(p, kb, stage, bars.full(s));
    }
  }
  const int s = it % kStages;
  mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
  if (threadIdx.x == 0) {
    TileSlots::put(slots.stage(s), Tile{-1, 0, 0});
    mbar_arrive(bars.full(s));
  }
  if (kKind == Kind::kGateUp) {
    mbar_arrive(bars.full(s));  // with thread 0's second arrive: full_arrivals<kGateUp>()
    cp_async_wait_all();
  }
}

// Consumers: wait for the stage that starts the next tile and read the tile it carries.
template <int kStages>
__device__ __forceinline__ Tile wait_tile(const Barriers<kStages>& bars, const TileSlots& slots, uint32_t it) {
  const int s = it % kStages;
  mbar_wait(bars.full(s), (it / kStages) & 1);
  return TileSlots::get(slots.stage(s));
}

template <Kind kKind, int kStages>
__device__ void produce_bf16(const CUtensorMap& tmA, const CUtensorMap& tmB, const GemmParams& p, uint32_t sbase,
                             const Barriers<kStages>& bars, TileSlots& slots, int nk) {
  using Plan = SmemPlan<kStages>;
  produce_tiles<kKind, kStages, Plan::kStageBytes>(
      p, sbase, bars, slots, nk, [&](const Tile& tile, int kb, uint32_t a_s, uint32_t full) {
        const int n0 = n_origin<kKind>(tile);
        const uint32_t b_s = a_s + Plan::kABytes;
        mbar_arrive_expect_tx(full, 2 * Plan::kBBoxBytes + (kKind == Kind::kDown ? Plan::kABytes : 0));
        if (kKind == Kind::kDown) tma_load_2d(a_s, &tmA, kb * kBK, tile.m0, full);
        tma_load_3d(b_s, &tmB, kb * kBK, n0, tile.e, full);
        tma_load_3d(b_s + Plan::kBBoxBytes, &tmB, kb * kBK, n0 + p.b_second, tile.e, full);
      });
}

// ---------------------------------------------------------------- epilogues
// Staged epilogue store (bf16 path): a consumer warpgroup's 64 x 128 bf16 output block goes
// registers -> shared memory (two 64 x 64 boxes of 128-byte rows in the 128-byte swizzle: a
// warp's 4-byte stores to 8 rows hit 32 distinct banks) -> global by one TMA store per box. The
// warpgroup returns to its next tile's wgmmas while the copy drains; TMA clips rows and columns
// outside the output.
struct StagedStore {
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kBoxes = 2;
  uint32_t buf;  // this warpgroup's 16 KB
  int bar_id;    // named barrier of this warpgroup
  __device__ StagedStore(uint32_t sbase_epi, int cw) : buf(sbase_epi + cw * 16384), bar_id(4 + cw) {}
  // Before writing: the previous block's TMA stores have finished reading buf.
  __device__ void acquire() const {
    if ((threadIdx.x & 127) == 0) bulk_wait_read_all();
    named_barrier_sync(bar_id, 128);
  }
  // Row r in [0, 64), even column c in [0, 128): two bf16.
  __device__ void put(int r, int c, uint32_t two_bf16) const {
    const int cc = c & 63;
    st_shared_u32(buf + (c >> 6) * kBoxBytes + r * 128 + ((((cc >> 3) ^ (r & 7)) << 4) | ((cc & 7) * 2)), two_bf16);
  }
  __device__ void release(const CUtensorMap* tm, int col0, int row0) const {
    fence_proxy_async_shared();
    named_barrier_sync(bar_id, 128);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
      for (int b = 0; b < kBoxes; ++b) tma_store_2d(tm, buf + b * kBoxBytes, col0 + 64 * b, row0);
      bulk_commit_group();
    }
  }
  __device__ void drain() const {
    if ((threadIdx.x & 127) == 0) bulk_wait_all();
  }
};

__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// silu(g) * u in fp32 with the fast reciprocal (rcp.approx, within 1 ulp of fp32; the result
// is rounded to bf16): the epilogue runs while the tensor cores wait, and the IEEE division
// made it measurably longer (-4 to -8 % for the whole op at the issue shapes, device run 6).
__device__ __forceinline__ float silu_times(float g, float u) { return __fdividef(g, 1.f + __expf(-g)) * u; }

// Thread (w4, lane) holds rows 16 w4 + lane/4 + {0, 8} of the warpgroup's 64 and columns
// 8j + 2(lane%4) + {0, 1} of each m64n128 accumulator.
__device__ __forceinline__ void stage_swiglu(const StagedStore& st, const CUtensorMap* tm, const Tile& tile, int cw,
                                             int w4, int lane, const float (&gate)[64], const float (&up)[64]) {
  st.acquire();
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float g0 = gate[4 * j + 2 * h], g1 = gate[4 * j + 2 * h + 1];
      const float u0 = up[4 * j + 2 * h], u1 = up[4 * j + 2 * h + 1];
      st.put(16 * w4 + (lane >> 2) + 8 * h, 8 * j + 2 * (lane & 3),
             bf16x2_bits(silu_times(g0, u0), silu_times(g1, u1)));
    }
  st.release(tm, n_origin<Kind::kGateUp>(tile), tile.m0 + 64 * cw);
}

__device__ __forceinline__ void stage_weighted(const StagedStore& st, const CUtensorMap* tm, const GemmParams& p,
                                               const Tile& tile, int cw, int w4, int lane, const float (&lo)[64],
                                               const float (&hi)[64]) {
  float wt[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int sid = p.sorted_ids[tile.m0 + 64 * cw + 16 * w4 + (lane >> 2) + 8 * h];
    wt[h] = (sid >= 0 && sid < p.n_slots) ? p.topk_weights[sid] : 0.f;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float(&acc)[64] = half ? hi : lo;
    st.acquire();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j)
        st.put(16 * w4 + (lane >> 2) + 8 * h, 8 * j + 2 * (lane & 3),
               bf16x2_bits(acc[4 * j + 2 * h] * wt[h], acc[4 * j + 2 * h + 1] * wt[h]));
    st.release(tm, n_origin<Kind::kDown>(tile) + 128 * half, tile.m0 + 64 * cw);
  }
}

// ---------------------------------------------------------------- consumer thread
// Both formats' consumers: a thread's warpgroup cw (0 or 1; warpgroup 0 is the producer), its
// warp w4 in that warpgroup and its lane, and two m64n128 fp32 accumulators zeroed once (the
// first wgmma of every tile overwrites them; zeroing only gives them a defined start).
struct ConsumerThread {
  int cw = threadIdx.x / 128 - 1;
  int w4 = (threadIdx.x / 32) & 3;
  int lane = threadIdx.x & 31;
};
__device__ __forceinline__ void zero_fill(float (&acc)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
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
  for (uint32_t it = 0;;) {
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    // A warpgroup whose 64 rows are all padding (the tail of an expert's run that fills at most
    // half a tile) skips its wgmmas and its stores: the tensor cores then serve the other
    // warpgroup alone. Both GEMMs split the same 128-row blocks the same way, so the h rows a
    // skipped gate/up half leaves unwritten are read only by a skipped down half.
    const int sid = p.sorted_ids[tile.m0 + cw * 64 + (threadIdx.x & 63)];
    if (!named_barrier_or(2 + cw, 128, sid >= 0 && sid < p.n_slots)) {
      for (int kb = 0; kb < nk; ++kb, ++it) {
        mbar_wait(bars.full(it % kStages), (it / kStages) & 1);
        if (lane == 0) mbar_arrive(bars.empty(it % kStages));
      }
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
        if (lane == 0) mbar_arrive(bars.empty((it - 1) % kStages));
      }
    }
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(bars.empty((it - 1) % kStages));

    if (kKind == Kind::kGateUp)
      stage_swiglu(staged, tmC, tile, cw, w4, lane, acc0, acc1);
    else
      stage_weighted(staged, tmC, p, tile, cw, w4, lane, acc0, acc1);
  }
  staged.drain();
}

// ---------------------------------------------------------------- MXFP8: weights in registers
// The weights are the M-side operand (h^T = W x^T, Y^T = W2 h^T) so
// the consumer can dequantize them in registers and feed wgmma with A from registers, as
// CUTLASS's mixed-input Hopper GEMM does; nothing is written back to shared memory. Tokens
// (x as bf16, or h) are the B operand, as a 128-token x 64 tile in the 128-byte swizzle.
//
// One 16-byte e4m3 load must hold exactly a thread's A-fragment bytes for the 4 k16 steps of
// a k-block (lane l: k = 2(l%4) + {0,1} and + 8 of each step). So inside every 64-wide K
// block the bf16 B operand is stored with its K permuted: logical 16c + 4s + j is kept at
// physical 16s + 8(j >> 1) + 2c + (j & 1), and thread l loads logical bytes [16(l%4), +16).
// x gets the permutation from the dequantizing pre-pass, h from the gate/up epilogue.
namespace kperm {
__host__ __device__ constexpr int physical(int logical) {
  return 16 * ((logical >> 2) & 3) + 8 * ((logical & 3) >> 1) + 2 * (logical >> 4) + (logical & 1);
}
// Which row of a 64-row weight block feeds fragment row r. Rows r and r + 8 of a thread then
// produce adjacent output columns: physical h column (gate/up) or output feature (down)
// 16(r/16) + 2(r%8) + (r/8)%2, so the epilogue stores bf16 pairs.
__host__ __device__ constexpr int pair_column(int r) { return 16 * (r >> 4) + 2 * (r & 7) + ((r >> 3) & 1); }
__host__ __device__ constexpr int gate_up_row(int r) {  // logical h feature whose physical column is pair_column(r)
  return 16 * (r & 3) + 4 * (r >> 4) + 2 * ((r >> 2) & 1) + ((r >> 3) & 1);
}
__host__ __device__ constexpr bool maps_consistent() {  // also replayed on the CPU: test_mxfp8_fragment_maps.py
  for (int r = 0; r < 64; ++r) {
    if (physical(gate_up_row(r)) != pair_column(r)) return false;  // gate/up rows land on their pair columns
    if ((r & 8) && pair_column(r) != pair_column(r - 8) + 1) return false;  // rows r, r+8 -> one bf16x2
  }
  return true;
}
static_assert(maps_consistent(), "kperm maps");
}  // namespace kperm

// MXFP8 path: a stage is the 128-row bf16 token tile and the e4m3 weights of the k-block.
template <int kStages>
struct Mxfp8Plan {
  static constexpr int kTokBytes = kBM * kBK * 2;   // 16 KB bf16 token tile (B operand)
  static constexpr int kFp8BoxBytes = E4m3Weights<Kind::kGateUp>::kBoxBytes;
  static constexpr int kScaleChunk = E4m3Weights<Kind::kGateUp>::kScaleChunk;
  static constexpr int kStageBytes = kTokBytes + E4m3Weights<Kind::kGateUp>::kBytes;  // 34 KB
  static constexpr int kWtOffset = kStages * kStageBytes;  // router weights of the tile, per WG
  static constexpr int kBarOffset = kWtOffset + 2 * kBM * 4;
  static constexpr int kSlotOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kSlotOffset + TileSlots::bytes(kStages);
  static constexpr int kLaunchBytes = kBytes + 1024;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
};

template <Kind kKind, int kStages>
__device__ void produce_mxfp8(const CUtensorMap& tmA, const CUtensorMap& tmB, const GemmParams& p, uint32_t sbase,
                              const Barriers<kStages>& bars, TileSlots& slots, int nk) {
  using Plan = Mxfp8Plan<kStages>;
  produce_tiles<kKind, kStages, Plan::kStageBytes>(
      p, sbase, bars, slots, nk, [&](const Tile& tile, int kb, uint32_t tok, uint32_t full) {
        E4m3Weights<kKind>::fetch(tmB, p, tile, kb, tok + Plan::kTokBytes, full,
                                  kKind == Kind::kDown ? Plan::kTokBytes : 0);
        if (kKind == Kind::kDown) tma_load_2d(tok, &tmA, kb * kBK, tile.m0, full);
      });
}

// The weight rows of one consumer thread: fragment rows r0 = 16w + l/4 and r0 + 8 of the
// warpgroup's two m64 blocks. Gate/up: block 0 = gate, block 1 = up, both for the warpgroup's
// 64 h features; down: the warpgroup's 128 output features as two blocks.
template <Kind kKind>
__device__ __forceinline__ int mxfp8_tile_row(int cw, int block, int r) {
  if (kKind == Kind::kGateUp) return block * 128 + 64 * cw + kperm::gate_up_row(r);
  return cw * 128 + 64 * block + kperm::pair_column(r);
}

template <Kind kKind, int kStages>
__device__ void consume_mxfp8(const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars, const TileSlots& slots,
                              int nk) {
  using Plan = Mxfp8Plan<kStages>;
  const ConsumerThread me;
  const int cw = me.cw, w4 = me.w4, lane = me.lane;
  const int cq = lane & 3;  // this thread's 16-byte chunk of every 64-byte e4m3 row
  float acc0[64], acc1[64];
  zero_fill(acc0);
  zero_fill(acc1);
  uint32_t it = 0;
  for (;;) {
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    const int n0 = n_origin<kKind>(tile);
    // per (block, half): row in the 256-row e4m3 tile, its box, validity, scale location
    // A thread's e4m3 chunk of block 1 sits a fixed distance after block 0's (the other box,
    // or 64 rows further in the same box, same swizzle phase): one offset per half.
    constexpr uint32_t kBlockStride = kKind == Kind::kGateUp ? Plan::kFp8BoxBytes : 64 * 64;
    uint32_t q_off[2], sc_off[2][2];
    bool live[2][2];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mxfp8_tile_row<kKind>(cw, b, 16 * w4 + (lane >> 2) + 8 * h);
        const int box = row >> 7, rib = row & 127;
        const int box_row0 = n0 + (box ? p.b_second : 0);
        const int64_t g0 = (int64_t)tile.e * p.b_rows + box_row0;
        const int64_t g = g0 + rib;
        live[b][h] = box_row0 + rib < p.b_rows;
        if (b == 0) q_off[h] = Plan::kTokBytes + box * Plan::kFp8BoxBytes + rib * 64 + ((cq ^ ((rib >> 1) & 3)) << 4);
        sc_off[b][h] = Plan::kTokBytes + 2 * Plan::kFp8BoxBytes +
                       (box * 2 + (int)(g / 128 - g0 / 128)) * Plan::kScaleChunk +
                       (uint32_t)mx::blocked_offset_in_chunk((uint64_t)g, cq >> 1);
      }
    // A fragments of k-block kb: 16 e4m3 bytes per (block, half), dequantized to 8 bf16 pairs.
    // All eight shared loads are issued first and the four chunks take one branch together, so
    // their conversions interleave. Rows past the expert's end are zero (TMA fill); their scale
    // byte, read from the neighbouring rows' scales, is replaced by 0.
    auto load_fragments = [&](uint32_t stage, int kb, uint32_t(&a)[2][2][8]) {
      uint4 q[2][2];
      uint32_t byte[2][2];
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          q[b][h] = ld_shared_v4(stage + q_off[h] + b * kBlockStride);
          asm volatile("ld.shared.u8 %0, [%1];" : "=r"(byte[b][h]) : "r"(stage + sc_off[b][h] + 2 * (kb & 1)));
        }
      bool integer_ok = true;
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          byte[b][h] = live[b][h] ? byte[b][h] : 0u;
          integer_ok &= mx::integer_path_ok(q[b][h], byte[b][h]);
        }
      auto convert = [&](auto dequant) {
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint4 lo, hi;
            dequant(q[b][h], byte[b][h], lo, hi);
            a[b][h][0] = lo.x; a[b][h][1] = lo.y; a[b][h][2] = lo.z; a[b][h][3] = lo.w;
            a[b][h][4] = hi.x; a[b][h][5] = hi.y; a[b][h][6] = hi.z; a[b][h][7] = hi.w;
          }
      };
      if (integer_ok)
        convert(mx::dequant16_integer);
      else
        convert(mx::dequant16_general);
    };
    // Software pipeline: while the wgmmas of k-block kb run, the next k-block's fragments are
    // loaded and dequantized into the other register set, so the tensor cores of this warpgroup
    // wait only for the issue of the next batch, not for a whole conversion. The two sets swap
    // roles every k-block (the loop body is written out twice, so no register copies).
    auto step = [&](const uint32_t(&a)[2][2][8], uint32_t(&a_next)[2][2][8], int kb) {
      const int s = it % kStages;
      const uint32_t stage = sbase + s * Plan::kStageBytes;
      wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        // k16 step st: logical bytes 4st..4st+3 of the thread's chunk = pairs 2st, 2st+1
        const uint64_t db = make_desc_sw128(stage + st * 32);
        const int sc = (kb > 0 || st > 0) ? 1 : 0;
        const uint32_t f0[4] = {a[0][0][2 * st], a[0][1][2 * st], a[0][0][2 * st + 1], a[0][1][2 * st + 1]};
        const uint32_t f1[4] = {a[1][0][2 * st], a[1][1][2 * st], a[1][0][2 * st + 1], a[1][1][2 * st + 1]};
        wgmma_m64n128k16_bf16_rs(acc0, f0, db, sc);
        wgmma_m64n128k16_bf16_rs(acc1, f1, db, sc);
      }
      wgmma_commit();
      if (kb + 1 < nk) {
        const uint32_t n = it + 1;
        mbar_wait(bars.full(n % kStages), (n / kStages) & 1);
        load_fragments(sbase + (n % kStages) * Plan::kStageBytes, kb + 1, a_next);
      }
      wgmma_wait<0>();  // a is rewritten by the step after next; the other warpgroup fills the gap
      if (lane == 0) mbar_arrive(bars.empty(s));
      ++it;
    };
    uint32_t fa[2][2][8], fb[2][2][8];
    load_fragments(sbase + (it % kStages) * Plan::kStageBytes, 0, fa);
    for (int kb = 0; kb < nk; kb += 2) {
      step(fa, fb, kb);
      if (kb + 1 < nk) step(fb, fa, kb + 1);
    }

    // ---------------------------------------------------------- epilogue (transposed tiles)
    // Thread holds rows r0 = 16 w4 + l/4 and r0 + 8 (one bf16 pair of output columns) for
    // tokens 8j + 2(l%4) + {0, 1}, j = 0..15.
    const int pc = kperm::pair_column(16 * w4 + (lane >> 2));
    if (kKind == Kind::kGateUp) {
      const int col = n0 + 64 * cw + pc;  // physical h column (K-permuted for the down GEMM)
      if (n0 + 64 * cw < p.n_out) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = tile.m0 + 8 * j + 2 * cq + e;
            const float g0 = acc0[4 * j + e], g1 = acc0[4 * j + 2 + e];
            const float u0 = acc1[4 * j + e], u1 = acc1[4 * j + 2 + e];
            *reinterpret_cast<__nv_bfloat162*>(p.out + (int64_t)tok * p.ldo + col) =
                __floats2bfloat162_rn(silu_times(g0, u0), silu_times(g1, u1));
          }
      }
    } else {
      float* wt = reinterpret_cast<float*>(smem_generic(sbase + Plan::kWtOffset)) + cw * kBM;
      const int q = threadIdx.x & 127;
      named_barrier_sync(2 + cw, 128);  // the previous tile's epilogue is done reading wt
      {
        const int sid = p.sorted_ids[tile.m0 + q];
        wt[q] = (sid >= 0 && sid < p.n_slots) ? p.topk_weights[sid] : 0.f;
      }
      named_barrier_sync(2 + cw, 128);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int col = n0 + 128 * cw + 64 * b + pc;  // output feature
        if (col >= p.n_out) continue;
        const float(&acc)[64] = b ? acc1 : acc0;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tl = 8 * j + 2 * cq + e;
            const float wv = wt[tl];
            *reinterpret_cast<__nv_bfloat162*>(p.out + (int64_t)(tile.m0 + tl) * p.ldo + col) =
                __floats2bfloat162_rn(acc[4 * j + e] * wv, acc[4 * j + 2 + e] * wv);
          }
      }
    }
  }
}

// ---------------------------------------------------------------- kernel
enum class Weights { kBf16, kMxfp8 };

template <Weights kW, int kStages>
using StagePlan = std::conditional_t<kW == Weights::kBf16, SmemPlan<kStages>, Mxfp8Plan<kStages>>;

template <Weights kW, Kind kKind, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                    const __grid_constant__ CUtensorMap tmC, const GemmParams p) {
  using Plan = StagePlan<kW, kStages>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  const Barriers<kStages> bars{sbase + Plan::kBarOffset};
  TileSlots slots(sbase + Plan::kSlotOffset);
  const int nk = (p.K + kBK - 1) / kBK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars.full(s), full_arrivals<kKind>());
      mbar_init(bars.empty(s), 8);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Register rebalancing: the CTA holds 168 x 384 registers; what the producer gives up
  // (168 - 56) x 128 covers what the consumers take (224 - 168) x 256 (if it did not,
  // setmaxnreg.inc would wait forever).
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if constexpr (kW == Weights::kBf16)
      produce_bf16<kKind, kStages>(tmA, tmB, p, sbase, bars, slots, nk);
    else
      produce_mxfp8<kKind, kStages>(tmA, tmB, p, sbase, bars, slots, nk);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    if constexpr (kW == Weights::kBf16)
      consume_bf16<kKind, kStages>(&tmC, p, sbase, bars, slots, nk);
    else
      consume_mxfp8<kKind, kStages>(p, sbase, bars, slots, nk);
  }
}

}  // namespace gemm
}  // namespace flash_moe
