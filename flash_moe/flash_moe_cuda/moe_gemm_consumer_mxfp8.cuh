// The MXFP8 path's consumer warpgroups: e4m3 weights dequantized in registers into wgmma's A
// operand, tokens from shared memory as B, epilogues storing from registers.
#pragma once

#include "moe_gemm_consumer.cuh"
#include "moe_gemm_epilogue_mxfp8.cuh"
#include "mxfp8.cuh"

namespace flash_moe {
namespace gemm {

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

// The weight rows of one consumer thread: fragment rows r0 = 16w + l/4 and r0 + 8 of the
// warpgroup's two m64 blocks. Gate/up: block 0 = gate, block 1 = up, both for the warpgroup's
// 64 h features; down: the warpgroup's 128 output features as two blocks.
template <Kind kKind>
__device__ __forceinline__ int mxfp8_tile_row(int cw, int block, int r) {
  if (kKind == Kind::kGateUp) return block * 128 + 64 * cw + kperm::gate_up_row(r);
  return cw * 128 + 64 * block + kperm::pair_column(r);
}

// kT = RsType::kF16 (gate/up only, every row in the f16 scale window, mx::kWindow): the weights
// become f16 (cvt + one multiply per pair, no NaN test) against f16 tokens, and the epilogue
// scales the accumulators back by the rows' and tokens' window factors.
template <Kind kKind, int kStages, RsType kT = RsType::kBf16>
__device__ void consume_mxfp8(const GemmParams& p, uint32_t sbase, const Barriers<kStages>& bars, const TileSlots& slots,
                              int nk) {
  using Plan = Mxfp8Plan<kStages>;
  const ConsumerThread me;
  const int cw = me.cw, w4 = me.w4, lane = me.lane;
  const int cq = lane & 3;  // this thread's 16-byte chunk of every 64-byte e4m3 row
  float acc0[64], acc1[64];
  zero_fill(acc0);
  zero_fill(acc1);
  HandOff handoff;
  for (uint32_t t = 0;; ++t) {
    uint32_t it = t * nk;  // stages taken so far: see ConsumerThread
    const Tile tile = wait_tile(bars, slots, it);
    if (tile.m0 < 0) break;
    if (tile.flags & kIdle) {  // a CTA pair's idle CTA: keep the stages in step, nothing else
      pass_tile(bars, it, nk, lane);
      continue;
    }
    const int n0 = n_origin<kKind>(tile);
    // An expert's last block often holds 64 tokens or fewer (moe_align puts the padding at the
    // end of the block): its tiles multiply only the first 64 token rows (m64n64 wgmma, half
    // the tensor work). The down GEMM makes the same choice for the same block, so the h rows
    // 64..127 of such a block (written from stale accumulators) are never read, and it stores
    // only the first 64 rows of Y.
    const bool half = !live_slot(p, p.sorted_ids[tile.m0 + 64]);
    // The tile's per-token factors, one float per token (wt): the down GEMM's router weights
    // are copied there now, by cp.async, so the two dependent global loads land during the
    // mainloop instead of between it and the epilogue, where both warpgroups wait together
    // (down GEMM -5 %). The f16 gate/up path's window factors are written in its epilogue: the
    // same copy at its tile start made that kernel 0.5-1.7 % slower (flash_moe/DESIGN.md §5).
    // (The bf16 consumer keeps its router weights in registers; this kernel has none to spare.)
    const uint32_t wt = sbase + Plan::kWtOffset + cw * kBM * 4;
    if constexpr (kKind == Kind::kDown) {
      const int q = threadIdx.x & 127;
      const int sid = p.sorted_ids[tile.m0 + q];
      const bool live = live_slot(p, sid);
      named_barrier_sync(kTileBarrier + cw, 128);  // the previous tile's epilogue is done reading wt
      cp_async_4(wt + 4 * q, p.down.topk_weights + (live ? sid : 0), live ? 4u : 0u);  // padding: 0
    }
    // per (block, half): row in the 256-row e4m3 tile, its box, validity, scale location
    // A thread's e4m3 chunk of block 1 sits a fixed distance after block 0's (the other box,
    // or 64 rows further in the same box, same swizzle phase): one offset per half.
    constexpr uint32_t kBlockStride = kKind == Kind::kGateUp ? Plan::kFp8BoxBytes : 64 * 64;
    uint32_t q_off[2], sc_off[2][2], top[2][2];
    bool live[2][2];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mxfp8_tile_row<kKind>(cw, b, 16 * w4 + (lane >> 2) + 8 * h);
        const int box = row >> 7, rib = row & 127;
        const int box_row0 = n0 + (box ? p.b_second : 0);
        // g: the row in the scale layout (experts packed on their own, scale_rows apart). For
        // gate/up that is the weight row (2I % 128 == 0), the index of the f16 window's w_top.
        const int64_t g0 = (int64_t)tile.e * (kKind == Kind::kGateUp ? p.mx.b_rows : p.mx.scale_rows) + box_row0;
        const int64_t g = g0 + rib;
        live[b][h] = box_row0 + rib < p.mx.b_rows;
        if constexpr (kT == RsType::kF16) top[b][h] = live[b][h] ? p.mx.w_top[g] : (uint32_t)mx::kTopMin;
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
          if constexpr (kT == RsType::kBf16) integer_ok &= mx::integer_path_ok(q[b][h], byte[b][h]);
        }
      // dequant(b, h, lo, hi): chunk (b, h) -> 16 bf16 or f16 in lo, hi
      auto convert = [&](auto dequant) {
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint4 lo, hi;
            dequant(b, h, lo, hi);
            a[b][h][0] = lo.x; a[b][h][1] = lo.y; a[b][h][2] = lo.z; a[b][h][3] = lo.w;
            a[b][h][4] = hi.x; a[b][h][5] = hi.y; a[b][h][6] = hi.z; a[b][h][7] = hi.w;
          }
      };
      if constexpr (kT == RsType::kF16)
        convert([&](int b, int h, uint4& lo, uint4& hi) {
          mx::dequant16_f16(q[b][h], mx::f16x2_scale(byte[b][h], top[b][h]), lo, hi);
        });
      else if (integer_ok)
        convert([&](int b, int h, uint4& lo, uint4& hi) { mx::dequant16_integer(q[b][h], byte[b][h], lo, hi); });
      else
        convert([&](int b, int h, uint4& lo, uint4& hi) { mx::dequant16_general(q[b][h], byte[b][h], lo, hi); });
    };
    // Software pipeline: while the wgmmas of k-block kb run, the next k-block's fragments are
    // loaded and dequantized into the other register set, so the tensor cores of this warpgroup
    // wait only for the issue of the next batch, not for a whole conversion. The two sets swap
    // roles every k-block (the loop body is written out twice, so no register copies).
    auto step = [&](const uint32_t(&a)[2][2][8], uint32_t(&a_next)[2][2][8], int kb, auto half_tile) {
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
        if constexpr (decltype(half_tile)::value) {
          wgmma_rs<kT, 64>(leading<32>(acc0), f0, db, sc);
          wgmma_rs<kT, 64>(leading<32>(acc1), f1, db, sc);
        } else {
          wgmma_rs<kT, 128>(acc0, f0, db, sc);
          wgmma_rs<kT, 128>(acc1, f1, db, sc);
        }
      }
      wgmma_commit();
      if (kb + 1 < nk) {
        const uint32_t n = it + 1;
        mbar_wait(bars.full(n % kStages), (n / kStages) & 1);
        load_fragments(sbase + (n % kStages) * Plan::kStageBytes, kb + 1, a_next);
      }
      wgmma_wait<0>();  // a is rewritten by the step after next; the other warpgroup fills the gap
      if (lane == 0) bars.release(s);
      ++it;
    };
    // The k loop, compiled once per wgmma width, so no branch sits between the wgmmas.
    auto mainloop = [&](auto half_tile) {
      uint32_t fa[2][2][8], fb[2][2][8];
      load_fragments(sbase + (it % kStages) * Plan::kStageBytes, 0, fa);
      for (int kb = 0; kb < nk; kb += 2) {
        step(fa, fb, kb, half_tile);
        if (kb + 1 < nk) step(fb, fa, kb + 1, half_tile);
      }
    };
    if (half)
      mainloop(std::true_type{});
    else
      mainloop(std::false_type{});

    // ---------------------------------------------------------- epilogue (moe_gemm_epilogue_mxfp8.cuh)
    const int pc = kperm::pair_column(16 * w4 + (lane >> 2));
    const uint32_t wt_s = wt + 8 * cq;  // + 4e + 32j: token 8j + 2cq + e
    if constexpr (kKind == Kind::kDown) {  // every thread's router weight has landed
      cp_async_wait_all();
      named_barrier_sync(kTileBarrier + cw, 128);
    }
    __nv_bfloat16* const rows0 = p.out + (int64_t)(tile.m0 + 2 * cq) * p.ldo;
    const int64_t row_step = 8 * p.ldo;
    if (kKind == Kind::kGateUp) {
      handoff.flush<false>(p, kTileBarrier + cw);
      handoff.pending = tile.group;
      // f16 path: the rows' window factors in registers, the 128 tokens' in wt.
      float fw[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
      if constexpr (kT == RsType::kF16) {
        const int q = threadIdx.x & 127;
        // The previous tile's epilogue is done reading wt. (The flush above syncs too, but only
        // when it counts a tile; this barrier keeps wt's protocol here, at one bar.sync a tile.)
        named_barrier_sync(kTileBarrier + cw, 128);
        {
          const int sid = p.sorted_ids[tile.m0 + q];
          st_shared_f32(wt + 4 * q, live_slot(p, sid) ? mx::window_factor(p.mx.x_top[sid / p.top_k]) : 1.f);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h) fw[b][h] = mx::window_factor(top[b][h]);
        named_barrier_sync(kTileBarrier + cw, 128);
      }
      const int col = n0 + 64 * cw + pc;  // physical h column (K-permuted for the down GEMM)
      if (n0 + 64 * cw < p.n_out) store_h_mxfp8<kT>(acc0, acc1, fw, rows0 + col, p.ldo, row_step, wt_s);
    } else {
      const int col0 = n0 + 128 * cw + pc;  // output features col0 (block 0) and col0 + 64 (block 1)
      store_y_mxfp8(acc0, acc1, rows0 + col0, p.ldo, row_step, wt_s, col0 < p.n_out, col0 + 64 < p.n_out, half);
    }
  }
  if (kKind == Kind::kGateUp) handoff.flush<false>(p, kTileBarrier + cw);
}

}  // namespace gemm
}  // namespace flash_moe
