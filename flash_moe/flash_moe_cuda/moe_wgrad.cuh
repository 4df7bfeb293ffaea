// The backward's weight gradients (Hopper, sm_90a): for each expert e, a GEMM whose reduction
// runs over the expert's sorted positions p (a variable count, no padding to a fixed size):
//
//   kDownWgrad    grad_W2[e] (K, I)     = sum_p grad_out[tok(p)]^T (s h)[p]
//   kGateUpWgrad  grad_W1|W3[e] (I, K)  = sum_p (dA|dB)[p]^T x[tok(p)]
//
// One CTA computes an output tile from its first position to its last, in order, and stores it
// once: no split over p, no atomics, bit-identical run to run. An expert without rows gets zeros.
//
// Operands (both have the feature dimension contiguous and p as the row, so both are MN-major):
//   A (wgmma M, 256 features): the (L, C) rows fused_moe_bf16_dgrad wrote by sorted position,
//     s*h or dA|dB, by TMA: four 64-feature x 64-row boxes per stage (M-major, trans-a).
//   B (wgmma N, 128 features): the token rows (grad_out or x) gathered by sorted id with
//     cp.async, as the forward gathers x: two 64-feature x 64-row boxes (N-major, trans-b).
// Rows past the expert's last live row inside its last 64-row block are zeros in A (the dgrad
// epilogue writes its m-blocks whole) and zero-filled in B.
//
// Roles, as the forward's kernel (moe_gemm.cuh): a producer warpgroup (thread 0 issues A's TMA
// and hands each tile to the consumers; all 128 gather B) and two consumer warpgroups (rows 128 cw.. of the
// tile's 256 A features, two m64 blocks each, N = 128). Each tile takes ceil(rows / 64) stages,
// or one (carrying no data) for an expert without rows, so the stage counter is carried from
// tile to tile. Epilogue: 64 x 64 bf16 boxes staged in the tile's last stage and two 8 KB boxes per
// warpgroup, stored by TMA (kDownWgrad transposed: grad_W2's rows are B's features).
//
// CTA pairs (kPaired, bpc = 2): the two CTAs of a cluster take B tiles 2j and 2j + 1 of one
// (expert, A tile), so they reduce over the same rows in step, and each TMA-multicasts two of a
// stage's four A boxes to both: A leaves L2 once per pair. With an odd B tile count the last
// pair's rank 1 is idle: it loads its A half and passes its stages, computing and storing nothing.
//
// Tile order (Params::tile_counter): claimed from a global counter (rank 0 of a pair claims for
// both through the forward's claim exchange, gemm::TileSlots), or, with no counter, static: CTA
// (or pair) u of U takes claims u, u + U, ..., each producer thread knowing its next tile a whole
// tile ahead, so a tile switch waits on no atomic, claim barrier, span or token load. The host
// takes the static order where the experts average 4 k-blocks or more
// (heuristics::wgrad_static_order): with one or two k-blocks a tile, a fixed share leaves CTAs
// unevenly loaded where the counter balances them.
#pragma once

#include "moe_gemm_consumer.cuh"

namespace flash_moe {
namespace wgrad {

using namespace sm90;
using gemm::kBK;
using gemm::kEpilogueBarrier;
using gemm::kProducerBarrier;

enum class Kind { kDownWgrad, kGateUpWgrad };

constexpr int kTileM = 256;                    // A features per tile (2 warpgroups x 2 m64 blocks)
constexpr int kTileN = 128;                    // B features per tile (wgmma N)
constexpr int kBoxBytes = 64 * kBK * 2;        // 8 KB: 64 features x 64 rows, 128-byte swizzle
constexpr int kThreads = gemm::kThreads;       // producer warpgroup + 2 consumer warpgroups
constexpr int kGatherers = 128;                // the producer warpgroup
constexpr int kRowsPerGather = kBK * (kTileN / 8) / kGatherers;  // rows a gathering thread copies per stage

struct Params {
  const int32_t* token;          // (L,) per sorted position: the slot's token, or -1 for padding
  int E;
  const __nv_bfloat16* b_rows;   // (M, n_b) token rows B gathers: grad_out (kDownWgrad), x (kGateUpWgrad)
  int n_b;                       // K
  int m_a;                       // A's columns: I (kDownWgrad) or 2I (kGateUpWgrad)
  int split;                     // kGateUpWgrad: A columns from `split` (= I) are grad_W3's rows
  int a_tiles, b_tiles;          // tiles per expert along A's and B's features
  const int32_t* span;           // per expert: [2e] INT_MAX - first m-block (0: none), [2e+1] end of live rows
  int* tile_counter;             // zero before the launch; null: the static tile order
};
struct Maps {
  CUtensorMap a;     // (L, m_a) bf16 rows, 64 x 64 boxes
  CUtensorMap out;   // kDownWgrad: grad_W2 (E, K, I); kGateUpWgrad: grad_W1 (E, I, K); 64 x 64 boxes
  CUtensorMap out2;  // kGateUpWgrad: grad_W3 (E, I, K)
};

template <int kStages>
struct Plan {
  static constexpr int kABytes = 4 * kBoxBytes;
  static constexpr int kStageBytes = kABytes + 2 * kBoxBytes;  // 48 KB
  static constexpr int kEpiOffset = kStages * kStageBytes;      // per consumer warpgroup: two boxes
  static constexpr int kBarOffset = kEpiOffset + 4 * kBoxBytes;
  static constexpr int kSlotOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kSlotOffset + gemm::TileSlots::bytes(kStages);  // claim and stage slots
  static constexpr int kLaunchBytes = kBytes + 1024;
  static_assert(kLaunchBytes <= 227 * 1024, "fits an SM's shared memory");
};

// A tile: expert e's A features [256 a_tile, +256) x B features [128 b_tile, +128), reduced over the
// `rows` sorted positions from row0. e < 0 ends the schedule. flags: gemm::kIdle (CTA pairs).
struct Tile {
  int e, a_tile, b_tile, row0, rows;
  int flags = 0;
  // As a tile slot's eight words (gemm::TileSlots), and back.
  __device__ void to_words(uint32_t (&v)[8]) const {
    const uint32_t w[8] = {(uint32_t)e, (uint32_t)a_tile, (uint32_t)b_tile, (uint32_t)row0, (uint32_t)rows,
                           (uint32_t)flags, 0u, 0u};
    for (int i = 0; i < 8; ++i) v[i] = w[i];
  }
  __device__ static Tile from_words(const uint32_t (&v)[8]) {
    return Tile{(int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5]};
  }
};
__device__ __forceinline__ int k_blocks(int rows) { return (rows + kBK - 1) / kBK; }

// Tiles in expert order, an expert's A-feature tiles each with its B-feature tiles: claim c of
// the order (the tiles running at once are neighbours and share the expert's rows in L2).
// kPaired: claim c covers B tiles 2j and 2j + 1 (ceil(b_tiles / 2) claims per A tile), one per CTA
// of the pair.
template <bool kPaired = false>
__device__ inline Tile tile_at(const Params& p, int c) {
  const int b_claims = kPaired ? (p.b_tiles + 1) / 2 : p.b_tiles;
  const int per_expert = p.a_tiles * b_claims;
  if (c >= p.E * per_expert) return Tile{-1, 0, 0, 0, 0};
  const int e = c / per_expert, r = c - e * per_expert;
  const int first = p.span[2 * e] > 0 ? 0x7FFFFFFF - p.span[2 * e] : -1;
  const int row0 = first >= 0 ? first * gemm::kBM : 0;
  const int rows = first >= 0 && p.span[2 * e + 1] > row0 ? p.span[2 * e + 1] - row0 : 0;
  return Tile{e, r / b_claims, (kPaired ? 2 : 1) * (r % b_claims), row0, rows};
}
// The pair's second tile: the next B tile, or the first's tile marked idle past the last B tile.
__device__ inline Tile partner_tile(const Params& p, Tile t) {
  if (t.e < 0) return t;
  if (t.b_tile + 1 < p.b_tiles)
    ++t.b_tile;
  else
    t.flags = gemm::kIdle;
  return t;
}
// The static order: this CTA's tile of claim c (rank 1 of a pair: the partner's).
template <bool kPaired>
__device__ inline Tile cta_tile(const Params& p, int c, uint32_t rank) {
  const Tile t = tile_at<kPaired>(p, c);
  return kPaired && rank == 1 ? partner_tile(p, t) : t;
}

// ---------------------------------------------------------------- producer
// Thread t gathers 16-byte chunk c = t % 16 (B features 128 b_tile + 8c ..) of the stage's rows
// t / 16 + 8j, into box c / 8 of the stage's B part in the 128-byte swizzle (the swizzle phase
// is the row's low 3 bits, the same for all of the thread's rows). Rows past the tile's `rows`,
// padding ids and features past n_b are zero-filled.
//
// The rows change every stage, so their tokens are a load per stage that the copies wait for:
// lane m of warp w loads the token of row 2w + m%2 + 8(m/2 % 8) (the 16 rows its warp gathers)
// from the position -> token table, two stages ahead, and each thread takes its row j's from
// lane 2j + t%32/16. The producer warps issue for the whole stage, so every instruction per
// copy counts: the table (no sorted id / top_k division here) made both kernels 1.7x faster.
// An idle CTA of a pair (kIdle) gathers nothing: its arrivals fire at once.
template <int kStages, bool kPaired>
__device__ void produce(const Maps& tm, const Params& p, uint32_t sbase, const gemm::Barriers<kStages>& bars,
                        gemm::TileSlots& slots) {
  using P = Plan<kStages>;
  const int c = threadIdx.x & 15, r0 = threadIdx.x >> 4, lane = threadIdx.x & 31;
  const int id_row = 2 * (int)(threadIdx.x >> 5) + (lane & 1) + 8 * ((lane >> 1) & 7);
  const uint32_t b_off = P::kABytes + (c >> 3) * kBoxBytes + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
  const auto load_id = [&](const Tile& t, int kb) {
    const int r = kBK * kb + id_row;
    return r < t.rows ? p.token[t.row0 + r] : -1;
  };
  const bool claimed = p.tile_counter != nullptr;  // else the static order (see the header)
  const int units = kPaired ? (int)gridDim.x / 2 : (int)gridDim.x;
  int claim = kPaired ? (int)blockIdx.x / 2 : (int)blockIdx.x;
  Tile tile{-1, 0, 0, 0, 0};
  int id_next = -1, id_after = -1;
  if (!claimed) {
    tile = cta_tile<kPaired>(p, claim, slots.rank);
    id_next = load_id(tile, 0), id_after = load_id(tile, 1);
  }
  uint32_t it = 0;
  for (;;) {
    if (claimed) {
      // Two claim slots: a write never meets a pending read.
      tile = slots.next<Tile>(
          kGatherers,
          [&](uint32_t own) {
            const int t = atomicAdd(p.tile_counter, 1);
            gemm::TileSlots::put(own, tile_at(p, t));
          },
          [&](uint32_t own, uint32_t peer) {
            const Tile t = tile_at<true>(p, atomicAdd(p.tile_counter, 1));
            gemm::TileSlots::put(own, t);
            gemm::TileSlots::put<true>(peer, partner_tile(p, t));
          });
      id_next = load_id(tile, 0), id_after = load_id(tile, 1);
    }
    if (tile.e < 0) break;
    const bool gather = !(kPaired && (tile.flags & gemm::kIdle));
    const int nk = k_blocks(tile.rows), stages = nk > 0 ? nk : 1;
    const int col = kTileN * tile.b_tile + 8 * c;
    const bool col_ok = col < p.n_b;
    Tile next{-1, 0, 0, 0, 0};
    int next_id0 = -1, next_id1 = -1;
    for (int kb = 0; kb < stages; ++kb, ++it) {
      const int id = id_next;
      id_next = id_after;
      id_after = load_id(tile, kb + 2);
      const int s = it % kStages;
      const uint32_t stage = sbase + s * P::kStageBytes;
      mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
      if (threadIdx.x == 0) {
        if (kb == 0) gemm::TileSlots::put(slots.stage(s), tile);  // before the arrive
        if (nk > 0) {
          mbar_arrive_expect_tx(bars.full(s), P::kABytes);  // paired: two boxes from each CTA
          const int i0 = kPaired ? 2 * (int)slots.rank : 0;
#pragma unroll
          for (int i = i0; i < i0 + (kPaired ? 2 : 4); ++i) {
            const uint32_t box = stage + i * kBoxBytes;
            const int col = kTileM * tile.a_tile + 64 * i, row = tile.row0 + kBK * kb;
            if constexpr (kPaired)
              tma_load_2d_multicast(box, &tm.a, col, row, bars.full(s), 0x3);
            else
              tma_load_2d(box, &tm.a, col, row, bars.full(s));
          }
        } else {
          mbar_arrive(bars.full(s));
        }
      }
      if (nk > 0 && gather) {
#pragma unroll
        for (int j = 0; j < kRowsPerGather; ++j) {
          const int tok = __shfl_sync(0xffffffffu, id, 2 * j + (lane >> 4));
          const bool live = col_ok && tok >= 0;
          const __nv_bfloat16* src = p.b_rows + (live ? (int64_t)tok * p.n_b + col : 0);
          cp_async_16(stage + b_off + 8 * j * 128, src, live ? 16u : 0u);
        }
      }
      cp_async_arrive_noinc(bars.full(s));
      // The static order's next tile, a tile ahead: its expert's span once this stage's copies
      // are issued, its first two k-blocks' tokens a stage later (they wait for the span).
      if (!claimed && kb == 0) next = cta_tile<kPaired>(p, claim + units, slots.rank);
      if (!claimed && kb == (stages > 1 ? 1 : 0)) next_id0 = load_id(next, 0), next_id1 = load_id(next, 1);
    }
    if (!claimed) {
      claim += units;
      tile = next;
      id_next = next_id0;
      id_after = next_id1;
    }
  }
  // The end of the schedule: a stage whose slot says e = -1 (thread 0's arrive + the gatherers').
  const int s = it % kStages;
  mbar_wait(bars.empty(s), ((it / kStages) & 1) ^ 1);
  if (threadIdx.x == 0) {
    gemm::TileSlots::put(slots.stage(s), Tile{-1, 0, 0, 0, 0});
    mbar_arrive(bars.full(s));
  }
  mbar_arrive(bars.full(s));
  cp_async_wait_all();
}

// ---------------------------------------------------------------- consumers
// One 64 x 64 output box of the consumer warpgroup's tile: A features 64 block.. of its 128 (acc,
// that block's accumulators), B features 64 tb..; put in shared memory at `boxes` + tb * 8 KB and
// stored by TMA (thread 0 of the warpgroup; one bulk group per box, committed even when the box
// lies past the output).
template <Kind kKind>
__device__ __forceinline__ void store_box(const Maps& tm, const Params& p, const gemm::ConsumerThread& me,
                                          const Tile& tile, uint32_t boxes, int block, int tb,
                                          const float (&acc)[kWgmmaAccRegs]) {
  const int cw = me.cw;
  const uint32_t box = boxes + tb * kBoxBytes;
  gemm::put_box<kKind == Kind::kDownWgrad>(box, tb, me.w4, me.lane, [&](int a) { return acc[a]; });
  fence_proxy_async_shared();
  named_barrier_sync(kEpilogueBarrier + cw, 128);
  if ((threadIdx.x & 127) == 0) {
    const int fa = kTileM * tile.a_tile + 128 * cw + 64 * block, fb = kTileN * tile.b_tile + 64 * tb;
    if (fa < p.m_a && fb < p.n_b) {
      if constexpr (kKind == Kind::kDownWgrad)
        tma_store_3d(&tm.out, box, fa, fb, tile.e);  // grad_W2[e][fb..][fa..]
      else if (fa < p.split)
        tma_store_3d(&tm.out, box, fb, fa, tile.e);  // grad_W1[e][fa..][fb..]
      else
        tma_store_3d(&tm.out2, box, fb, fa - p.split, tile.e);
    }
    bulk_commit_group();
  }
}

// An idle CTA of a pair (kIdle) waits for and releases its tile's stages, computing and storing
// nothing.
template <Kind kKind, int kStages, bool kPaired>
__device__ void consume(const Maps& tm, const Params& p, uint32_t sbase, const gemm::Barriers<kStages>& bars,
                        const gemm::TileSlots& slots) {
  using P = Plan<kStages>;
  const gemm::ConsumerThread me;
  const int cw = me.cw, lane = me.lane, q = threadIdx.x & 127;
  float acc0[kWgmmaAccRegs], acc1[kWgmmaAccRegs];  // the wrapper's arrays; N = kTileN fills 64
  gemm::zero_fill(acc0);
  gemm::zero_fill(acc1);
  uint32_t it = 0;
  gemm::HeldStage<kStages> held;  // its two A blocks take output boxes
  for (;;) {
    mbar_wait(bars.full(it % kStages), (it / kStages) & 1);
    const Tile tile = gemm::TileSlots::get_lane0<Tile>(slots.stage(it % kStages));
    if (tile.e < 0) break;
    const int nk = __shfl_sync(0xffffffffu, k_blocks(tile.rows), 0);  // warp-uniform (see ConsumerThread)
    const bool idle = kPaired && (tile.flags & gemm::kIdle);
    for (int kb = 0; kb < (nk > 0 ? nk : 1); ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(bars.full(s), (it / kStages) & 1);
      const uint32_t stage = sbase + s * P::kStageBytes;
      if (nk > 0 && !idle) {
        const uint32_t a0 = stage + (2 * cw) * kBoxBytes, a1 = a0 + kBoxBytes, b = stage + P::kABytes;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {  // a k16 step is 16 rows of 128 bytes
          const uint64_t db = make_desc_sw128_mn(b + kk * 2048);
          const int sc = (kb > 0 || kk > 0) ? 1 : 0;
          wgmma_ss_bf16<kTileN, true, true>(acc0, make_desc_sw128_mn(a0 + kk * 2048), db, sc);
          wgmma_ss_bf16<kTileN, true, true>(acc1, make_desc_sw128_mn(a1 + kk * 2048), db, sc);
        }
        wgmma_commit();
      }
      held.after_k_block(bars, kb, it, cw, lane);
    }
    held.hold_last(it);
    if (idle) continue;
    if (nk == 0) {  // an expert without rows: its gradient is zero
      gemm::zero_fill(acc0);
      gemm::zero_fill(acc1);
    }

    // Box 2 block + tb: A features 64 block.. of the warpgroup's 128, B features 64 tb..;
    // the first two over the warpgroup's A blocks in the held stage, the last two in its own
    // boxes, so no store waits for another's read (the held stage's release waits for all four).
    const uint32_t held_a = sbase + held.stage * P::kStageBytes + (2 * cw) * kBoxBytes;
    const uint32_t own = sbase + P::kEpiOffset + (2 * cw) * kBoxBytes;
#pragma unroll
    for (int block = 0; block < 2; ++block)
#pragma unroll
      for (int tb = 0; tb < 2; ++tb)
        store_box<kKind>(tm, p, me, tile, block ? own : held_a, block, tb, block ? acc1 : acc0);
  }
  held.release(bars, cw);
  if (q == 0) bulk_wait_all();
}

// kPaired: launched in clusters of 2 CTAs (bpc = 2); see the header.
template <Kind kKind, int kStages, bool kPaired = false>
__global__ void __launch_bounds__(kThreads, 1) moe_wgrad_kernel(const __grid_constant__ Maps tm, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t rank = kPaired ? cluster_ctarank() : 0;
  gemm::Barriers<kStages> bars{sbase + Plan<kStages>::kBarOffset};
  if (kPaired) bars.peer = peer_smem(bars.base, rank ^ 1);
  gemm::TileSlots slots(sbase + Plan<kStages>::kSlotOffset, kStages, rank, kPaired);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars.full(s), kGatherers + 1);  // the gatherers' cp.async arrivals + thread 0's
      mbar_init(bars.empty(s), gemm::Barriers<kStages>::empty_arrivals(kPaired));
    }
    if (kPaired) slots.init_barriers();
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // A pair's CTAs arrive on and load into each other's barriers and stages: both must be set up.
  if (kPaired)
    cluster_sync();
  else
    __syncthreads();
  // The gate/up wgrad after the down wgrad reads nothing this one writes: it may take each SM this
  // one leaves (a programmatic dependent launch, which waits for this grid only at its end).
  griddep_launch_dependents();
  // Registers as the forward's kernel: (168 - 56) x 128 >= (224 - 168) x 256.
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    produce<kStages, kPaired>(tm, p, sbase, bars, slots);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    consume<kKind, kStages, kPaired>(tm, p, sbase, bars, slots);
  }
  // No CTA of a pair leaves while its peer may still arrive on its barriers.
  if (kPaired) cluster_sync();
  // This grid may finish before the down wgrad it was launched after: waiting for that one here
  // (all of it is resident by now, and nothing else is left to run) makes this grid's completion
  // imply the down wgrad's, so whatever follows in the stream or a captured graph sees grad_w2
  // whole without relying on how a dependent grid's completion is ordered.
  if constexpr (kKind == Kind::kGateUpWgrad) griddep_wait();
}

}  // namespace wgrad
}  // namespace flash_moe
