// The bf16 path's consumer warpgroups: both GEMMs with the weights as wgmma's M side and the
// tokens as N, as the MXFP8 path has them, both operands in shared memory; the epilogues'
// boxes come from moe_gemm_epilogue.cuh. On the token side wgmma's N fits the tile's live rows
// in steps of 8 (m64nNk16, N = 8 .. kMaxRows), so padding costs at most 7 columns; a CTA
// pair's part of an expert's rows may be up to kMaxRows long (Tile). ConsumerThread is shared
// with the MXFP8 consumer.
#pragma once

#include <type_traits>

#include "moe_gemm_epilogue.cuh"
#include "moe_gemm_epilogue_dgrad.cuh"
#include "moe_gemm_stages.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- consumer thread
// Both formats' consumers: a thread's warpgroup cw (0 or 1; warpgroup 0 is the producer), its
// warp w4 in that warpgroup and its lane. Accumulators are zeroed once (the first wgmma of every
// tile overwrites them; zeroing only gives them a defined start).
//
// Warp-uniform values: ptxas keeps the stage addresses and wgmma descriptors in uniform
// registers only when it can prove them the same across the warp. cw comes through a shuffle
// (as CUTLASS does), the consumers' stage counter is rebuilt from the tile counter every tile
// (`it = t * nk`: each tile, idle or empty ones too, takes nk stages), the tile comes through
// redux.sync (wait_tile) and the bf16 consumer's n through a shuffle. (The wgrad consumer, whose
// tiles take different stage counts, carries its counter, adding a shuffled count per tile: two
// R2UR per k-block in its SASS.) Without them (a counter carried through data-dependent branches,
// threadIdx arithmetic) every wgmma waited on R2UR moves and each batch on a WARPSYNC: the MXFP8
// op was 5-6 % slower (flash_moe/DESIGN.md §5).
struct ConsumerThread {
  int cw = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;
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

// f(std::integral_constant<int, n>) for the runtime n = 8, 16, .., kMaxRows: one mainloop per
// wgmma N.
template <int kN = 8, class F>
__device__ __forceinline__ void with_tokens(int n, F&& f) {
  if constexpr (kN <= kMaxRows) {
    if (n == kN)
      f(std::integral_constant<int, kN>{});
    else
      with_tokens<kN + 8>(n, f);
  }
}

// ---------------------------------------------------------------- consumer
// Warpgroup cw's two m64 weight blocks in a stage's two 128-row boxes. Gate/up: gate rows
// 64cw.. of box 0 and up rows 64cw.. of box 1 (h features 64cw..64cw+63 of the n-block). Down:
// rows 0..63 and 64..127 of box cw (output features 128cw.. of the 256-column n-block).
template <Kind kKind>
__device__ __forceinline__ uint32_t weight_block(uint32_t boxes, int cw, int block) {
  constexpr uint32_t kBoxBytes = 128 * kBK * 2, kBlockBytes = 64 * kBK * 2;
  return kKind == Kind::kGateUp ? boxes + block * kBoxBytes + cw * kBlockBytes
                                : boxes + cw * kBoxBytes + block * kBlockBytes;
}

// Output feature (h column or Y column) of accumulator row r of weight block `block`.
template <Kind kKind>
__device__ __forceinline__ int feature(const Tile& t, int cw, int block, int r) {
  return kKind == Kind::kGateUp ? n_origin<kKind>(t) + 64 * cw + r : n_origin<kKind>(t) + 128 * cw + 64 * block + r;
}

// Per warpgroup and k16 both wgmmas read a 2 KB weight block and the tile's N token rows.
//
// Epilogue: 64-token x 64-feature boxes (put_box<true>), stored by TMA (`out`; a box with
// fewer live tokens in kStoreRows-row pieces through `out_rows`, so no store reaches past the tile's
// rows into a peer CTA's). Shared memory leaves room for one 8 KB box per warpgroup
// (SmemPlan::kEpiOffset), so the warpgroup keeps its tile's last stage (`held`) and writes its
// first two boxes over its own two weight blocks there (no other warpgroup reads them), the
// third into its box; the down GEMM's fourth waits for the first's store to read it. The held
// stage is released once the stores have read it, after the next tile's first wgmmas are issued
// (the producer is then kStages - 1 ahead). Tokens kBM.. of a longer tile are stored from
// registers.
// kDownDgrad: out stores dA|dB, out2 s*h, in 32-row boxes (DgradBoxes, kDgradStoreRows).
template <Kind kKind, int kStages>
__device__ void consume_bf16(const CUtensorMap* out, const CUtensorMap* out_rows, const CUtensorMap* out2,
                             const GemmParams& p, uint32_t sbase,
                             const Barriers<kStages>& bars, const TileSlots& slots, int nk) {
  using Plan = SmemPlan<kStages>;
  constexpr int kExtra = kMaxRows - kBM;
  const ConsumerThread me;
  const int cw = me.cw, w4 = me.w4, lane = me.lane, q = threadIdx.x & 127;
  const uint32_t wt = sbase + Plan::kWtOffset + cw * kMaxRows * 4;  // down: router weights, a float per token
  float acc0[kMaxRows / 2], acc1[kMaxRows / 2];
  zero_fill(acc0);
  zero_fill(acc1);
  HandOff handoff;
  uint32_t it;  // stages taken so far
  HeldStage<kStages> held;
  Tile prefetch_tile{-1, 0, 0};  // kDownDgrad: the tile whose pre-activations go to L2 (its N is kN)
  // kN: the tile's wgmma N, 8 .. kMaxRows tokens.
  auto mainloop = [&](auto n_tokens) {
    constexpr int kN = decltype(n_tokens)::value;
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(bars.full(s), (it / kStages) & 1);
      const uint32_t tok = sbase + s * Plan::kStageBytes;
      const uint32_t w0 = weight_block<kKind>(tok + Plan::kABytes, cw, 0);
      const uint32_t w1 = weight_block<kKind>(tok + Plan::kABytes, cw, 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t dt = make_desc_sw128(tok + kk * 32);
        // M-major weights: a k16 step is 16 rows of 128 bytes further; K-major: 32 bytes.
        const uint64_t d0 = mn_major(kKind) ? make_desc_sw128_mn(w0 + kk * 2048) : make_desc_sw128(w0 + kk * 32);
        const uint64_t d1 = mn_major(kKind) ? make_desc_sw128_mn(w1 + kk * 2048) : make_desc_sw128(w1 + kk * 32);
        const int sc = (kb > 0 || kk > 0) ? 1 : 0;
        wgmma_ss_bf16<kN, mn_major(kKind)>(acc0, d0, dt, sc);
        wgmma_ss_bf16<kN, mn_major(kKind)>(acc1, d1, dt, sc);
      }
      wgmma_commit();
      held.after_k_block(bars, kb, it, cw, lane);
      // Four k-blocks (~4 us) before the epilogue reads them: earlier, the kernel's own traffic
      // through L2 (~3 TB/s) would evict them again.
      if constexpr (kKind == Kind::kDownDgrad)
        if (kb == (nk > 4 ? nk - 4 : 0)) prefetch_preact(p, prefetch_tile, kN, cw);
    }
    held.hold_last(it);
  };
  for (uint32_t t = 0;; ++t) {
    it = t * nk;  // see ConsumerThread
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    const bool idle = tile.flags & kIdle;
    // Thread q looks at token q and, for q < kExtra, at token kBM + q. moe_align puts an
    // expert's padding after its live rows, so the live count ends the live rows: n, rounded
    // up to 8, is wgmma's N (at most tile.rows, a multiple of 8), and n = 0 an all-padding
    // tile. Both GEMMs decide alike, so the h rows a gate/up tile leaves unwritten are never
    // read. Every global load is issued before the first barrier; the down GEMM's router
    // weights go to wt only after the mainloop, so their latency hides behind it.
    int n = 0;
    float wq = 0.f, wx = 0.f;
    if (!idle) {
      const int sid = q < tile.rows ? p.sorted_ids[tile.m0 + q] : -1;
      const int xsid = q < kExtra && kBM + q < tile.rows ? p.sorted_ids[tile.m0 + kBM + q] : -1;
      const bool live_q = live_slot(p, sid), live_x = live_slot(p, xsid);
      if (kKind != Kind::kGateUp) {  // kGateUpDgrad: no router weights (weight 1)
        if (live_q) wq = p.down.topk_weights ? p.down.topk_weights[sid] : 1.f;
        if (live_x) wx = p.down.topk_weights ? p.down.topk_weights[xsid] : 1.f;
      }
      n = named_barrier_popc(kTileBarrier + cw, 128, live_q);
      if (n == kBM && tile.rows > kBM) n += named_barrier_popc(kTileBarrier + cw, 128, live_x);
      n = __shfl_sync(0xffffffffu, (n + 7) & ~7, 0);  // the same in every thread: see ConsumerThread
    }
    if (n == 0) {
      held.release(bars, cw);
      pass_tile(bars, it, nk, lane);
      if (kKind == Kind::kGateUp && !idle) HandOff::count_empty(p, tile);
      continue;
    }
    if constexpr (kKind == Kind::kDownDgrad) prefetch_tile = tile;
    with_tokens(n, mainloop);

    if (kKind != Kind::kGateUp) {  // every thread is past the previous tile's epilogue (the popc barrier)
      st_shared_f32(wt + 4 * q, wq);
      if (q < kExtra) st_shared_f32(wt + 4 * (kBM + q), wx);
      named_barrier_sync(kEpilogueBarrier + cw, 128);
    }
    if constexpr (kKind == Kind::kDownDgrad) {
      const uint32_t held_boxes = sbase + held.stage * Plan::kStageBytes + Plan::kABytes;
      const DgradBoxes boxes{out, out2, weight_block<kKind>(held_boxes, cw, 0),
                             weight_block<kKind>(held_boxes, cw, 1), sbase + Plan::kEpiOffset + cw * (Plan::kEpiBytes / 2)};
      swiglu_dgrad_epilogue(p, tile, n, acc0, acc1, cw, w4, lane, wt, boxes);
      continue;
    }
    // Accumulator a = 4j + 2h + e: feature row 16 w4 + lane/4 + 8h, token 8j + 2(lane%4) + e.
    const auto token = [&](int a) { return 8 * (a >> 2) + 2 * (lane & 3) + (a & 1); };
    const auto value = [&](int block, int a) {
      if constexpr (kKind == Kind::kGateUp)
        return silu_times(acc0[a], acc1[a]);
      else
        return (block ? acc1[a] : acc0[a]) * ld_shared_f32(wt + 4 * token(a));
    };
    if (kKind == Kind::kGateUp) {
      handoff.flush<true>(p, kTileBarrier + cw);
      handoff.pending = tile.group;
      handoff.pending_regs = n > kBM;
    }
    // Box i = block * nt + tb of the tile: feature block `block`, tokens 64 tb.. (nt = 1 or 2
    // token halves).
    constexpr int kBlocks = kKind == Kind::kGateUp ? 1 : 2;  // 64-feature blocks this warpgroup stores
    const int nt = n > 64 ? 2 : 1;
    const uint32_t held_boxes = sbase + held.stage * Plan::kStageBytes + Plan::kABytes;
#pragma unroll
    for (int block = 0; block < kBlocks; ++block)
#pragma unroll
      for (int tb = 0; tb < 2; ++tb) {
        if (tb >= nt) continue;
        const int i = block * nt + tb;
        uint32_t box;
        if (i < 2) {
          box = weight_block<kKind>(held_boxes, cw, i);
        } else if (i == 2) {
          box = sbase + Plan::kEpiOffset + cw * (Plan::kEpiBytes / 2);
        } else {  // i == 3: once the first box's store has read it
          if (q == 0) bulk_wait_read<2>();
          named_barrier_sync(kEpilogueBarrier + cw, 128);
          box = weight_block<kKind>(held_boxes, cw, 0);
        }
        put_box<true>(box, tb, w4, lane, [&](int a) { return value(block, a); });
        fence_proxy_async_shared();
        named_barrier_sync(kEpilogueBarrier + cw, 128);
        if (q == 0) {
          const int f = feature<kKind>(tile, cw, block, 0), row = tile.m0 + 64 * tb;
          const int box_rows = n - 64 * tb < 64 ? n - 64 * tb : 64;
          if (box_rows == 64)
            tma_store_2d(out, box, f, row);
          else
            for (int r = 0; r < box_rows; r += kStoreRows) tma_store_2d(out_rows, box + r * 128, f, row + r);
          bulk_commit_group();
        }
      }
    if (n > kBM) {  // tokens kBM.. from registers
#pragma unroll
      for (int block = 0; block < kBlocks; ++block)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = feature<kKind>(tile, cw, block, 16 * w4 + (lane >> 2) + 8 * h);
          if (f >= p.n_out) continue;
#pragma unroll
          for (int j = kBM / 8; j < kMaxRows / 8; ++j) {
            if (8 * j >= n) break;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int a = 4 * j + 2 * h + e;
              p.out[(int64_t)(tile.m0 + token(a)) * p.ldo + f] = __float2bfloat16_rn(value(block, a));
            }
          }
        }
    }
    if (kKind == Kind::kGateUp && p.gather.preact) store_preact(p, tile, n, acc0, acc1, cw, w4, lane);
  }
  held.release(bars, cw);
  if (q == 0) bulk_wait_all();
  if (kKind == Kind::kGateUp) handoff.flush<true>(p, kTileBarrier + cw);
}

}  // namespace gemm
}  // namespace flash_moe
