// The bf16 path's consumer warpgroups: both GEMMs with the weights as wgmma's M side and the
// tokens as N, as the MXFP8 path has them, both operands in shared memory; the epilogues'
// boxes come from moe_gemm_epilogue.cuh. The weights-as-M form lets a CTA pair's tile take
// kTailShare more tokens on N (m64n144k16): its share of the expert's short tail block
// (kCarriesTail), on the weight bytes it reads anyway. A tail computed on its own, a lone
// 128-row tile for at most 32 tokens, cost 81-86 % of a full tile (NOTES.md, session 9).
// ConsumerThread is shared with the MXFP8 consumer.
#pragma once

#include <type_traits>

#include "moe_gemm_epilogue.cuh"
#include "moe_gemm_stages.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- consumer thread
// Both formats' consumers: a thread's warpgroup cw (0 or 1; warpgroup 0 is the producer), its
// warp w4 in that warpgroup and its lane. Accumulators are zeroed once (the first wgmma of every
// tile overwrites them; zeroing only gives them a defined start).
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

// Per warpgroup and k16 both wgmmas read a 2 KB weight block and the 4 KB token block (the
// tokens-as-M form this replaced read as many). Tokens 64..127 all padding: m64n64k16.
//
// Epilogue: 64-token x 64-feature boxes (put_box_transposed), stored by TMA. Shared memory
// leaves room for one 8 KB box per warpgroup (SmemPlan::kEpiOffset), so the warpgroup keeps
// its tile's last stage (`held`) and writes its first two boxes over its own two weight blocks
// there (no other warpgroup reads them), the third into its box; the down GEMM's fourth waits
// for the first's store to read it. The held stage is released once the stores have read it,
// after the next tile's first wgmmas are issued (the producer is then kStages - 1 ahead).
// The tail's kTailShare tokens are stored from registers.
template <Kind kKind, int kStages>
__device__ void consume_bf16(const CUtensorMap* tmC, const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars,
                             const TileSlots& slots, int nk) {
  using Plan = SmemPlan<kStages>;
  constexpr int kCarryN = kBM + kTailShare;
  const ConsumerThread me;
  const int cw = me.cw, w4 = me.w4, lane = me.lane, q = threadIdx.x & 127;
  float* wt = reinterpret_cast<float*>(smem_generic(sbase + Plan::kWtOffset)) + cw * kCarryN;  // down: router weights
  float acc0[kCarryN / 2], acc1[kCarryN / 2];
  zero_fill(acc0);
  zero_fill(acc1);
  HandOff handoff;
  uint32_t it = 0;
  int held = -1;  // the stage kept for this warpgroup's output boxes, or -1
  const auto release_held = [&] {
    if (held < 0) return;
    if (q == 0) bulk_wait_read_all();  // also frees the warpgroup's box at kEpiOffset
    named_barrier_sync(4 + cw, 128);
    if (lane == 0) bars.release(held);
    held = -1;
  };
  // kN: 64, 128 or 144 tokens.
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
        const uint64_t d0 = make_desc_sw128(w0 + kk * 32), d1 = make_desc_sw128(w1 + kk * 32);
        const int sc = (kb > 0 || kk > 0) ? 1 : 0;
        if constexpr (kN == 64) {
          wgmma_m64n64k16_bf16(leading<32>(acc0), d0, dt, sc);
          wgmma_m64n64k16_bf16(leading<32>(acc1), d1, dt, sc);
        } else if constexpr (kN == 128) {
          wgmma_m64n128k16_bf16(leading<64>(acc0), d0, dt, sc);
          wgmma_m64n128k16_bf16(leading<64>(acc1), d1, dt, sc);
        } else {
          wgmma_m64n144k16_bf16(acc0, d0, dt, sc);
          wgmma_m64n144k16_bf16(acc1, d1, dt, sc);
        }
      }
      wgmma_commit();
      if (kb == 0) release_held();
      if (kb > 0) {
        wgmma_wait<1>();
        if (lane == 0) bars.release((it - 1) % kStages);
      }
    }
    wgmma_wait<0>();
    held = (it - 1) % kStages;
  };
  for (;;) {
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    const bool idle = tile.flags & kIdle;
    const bool carry = tile.flags & kCarriesTail;
    const int tail0 = carry ? tail_block(tile.flags) * kBM + kTailShare * (int)slots.rank : 0;  // its first row
    // lo / hi: tokens 0..63 / 64..127 hold a live row (thread q looks at token q). Padding
    // follows the live rows, so !lo means an all-padding tile. Both GEMMs decide alike, so the
    // h rows a gate/up tile leaves unwritten are never read. Every global load is issued before
    // the first barrier; the down GEMM's router weights go to wt only after the mainloop, so
    // their latency hides behind it.
    bool lo = false, hi = false;
    float wq = 0.f, wtail = 0.f;
    if (!idle) {
      const int sid = p.sorted_ids[tile.m0 + q];
      const bool live_q = live_slot(p, sid);
      lo = named_barrier_or(2 + cw, 128, q < 64 && live_q);
      hi = named_barrier_or(2 + cw, 128, q >= 64 && live_q);
      if (kKind == Kind::kDown) {
        const int tsid = carry && q < kTailShare ? p.sorted_ids[tail0 + q] : -1;
        if (live_q) wq = p.topk_weights[sid];
        if (live_slot(p, tsid)) wtail = p.topk_weights[tsid];
      }
    }
    if (!lo) {
      release_held();
      pass_tile(bars, it, nk, lane);
      if (kKind == Kind::kGateUp && !idle) HandOff::count_empty(p, tile);
      continue;
    }
    if (carry)
      mainloop(std::integral_constant<int, kCarryN>{});
    else if (hi)
      mainloop(std::integral_constant<int, kBM>{});
    else
      mainloop(std::integral_constant<int, 64>{});

    if (kKind == Kind::kDown) {  // every thread is past the previous tile's epilogue (the lo barrier)
      wt[q] = wq;
      if (q < kTailShare) wt[kBM + q] = wtail;
      named_barrier_sync(4 + cw, 128);
    }
    // Accumulator a = 4j + 2h + e: feature row 16 w4 + lane/4 + 8h, token 8j + 2(lane%4) + e.
    const auto token = [&](int a) { return 8 * (a >> 2) + 2 * (lane & 3) + (a & 1); };
    const auto value = [&](int block, int a) {
      if constexpr (kKind == Kind::kGateUp)
        return silu_times(acc0[a], acc1[a]);
      else
        return (block ? acc1[a] : acc0[a]) * wt[token(a)];
    };
    if (kKind == Kind::kGateUp) {
      handoff.flush<true>(p, 2 + cw);
      handoff.pending = tile.m0 / kBM;
      handoff.pending_tail = carry ? tail_block(tile.flags) : -1;
    }
    // Box i = block * nt + tb of the tile: feature block `block`, tokens 64 tb.. (nt = 1 or 2
    // token halves).
    constexpr int kBlocks = kKind == Kind::kGateUp ? 1 : 2;  // 64-feature blocks this warpgroup stores
    const int nt = hi ? 2 : 1;
    const uint32_t held_boxes = sbase + held * Plan::kStageBytes + Plan::kABytes;
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
          named_barrier_sync(4 + cw, 128);
          box = weight_block<kKind>(held_boxes, cw, 0);
        }
        put_box_transposed(box, tb, w4, lane, [&](int a) { return value(block, a); });
        fence_proxy_async_shared();
        named_barrier_sync(4 + cw, 128);
        if (q == 0) {
          tma_store_2d(tmC, box, feature<kKind>(tile, cw, block, 0), tile.m0 + 64 * tb);
          bulk_commit_group();
        }
      }
    if (carry) {  // tokens 128..143: rows tail0.. of the tail block, from registers
#pragma unroll
      for (int block = 0; block < kBlocks; ++block)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = feature<kKind>(tile, cw, block, 16 * w4 + (lane >> 2) + 8 * h);
          if (f >= p.n_out) continue;
#pragma unroll
          for (int j = kBM / 8; j < kCarryN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int a = 4 * j + 2 * h + e;
              p.out[(int64_t)(tail0 + token(a) - kBM) * p.ldo + f] = __float2bfloat16_rn(value(block, a));
            }
        }
    }
  }
  release_held();
  if (q == 0) bulk_wait_all();
  if (kKind == Kind::kGateUp) handoff.flush<true>(p, 2 + cw);
}

}  // namespace gemm
}  // namespace flash_moe
