// The grouped GEMM's parameters and its schedule: which tile a CTA computes next (TileOrder,
// claim_tile: tiles claimed in order from a global counter; claim_pair for CTA pairs) and how
// the producer hands a tile to the consumers (TileSlots).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "flash_moe.cuh"
#include "sm90.cuh"

namespace flash_moe {
namespace gemm {

using namespace sm90;

constexpr int kBM = kBlockM;  // 128 rows (slots) per tile
constexpr int kBK = 64;       // 64 bf16 = 128 bytes: one swizzle-128B row
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups

// The forward's two GEMMs, and the backward's two data-gradient GEMMs, which run on the same
// kernel with the weights read transposed (M-major):
//   kDownDgrad    dh[p] = grad_out[tok(p)] @ W2[e]: the gate/up GEMM's token gather on grad_out,
//                 256 h features per tile, the SwiGLU backward in the epilogue
//                 (moe_gemm_epilogue_dgrad.cuh)
//   kGateUpDgrad  dx[p] = dA|dB[p] @ W[e]: the down GEMM's token rows (by TMA) from dA|dB, 256 x
//                 features per tile, the down GEMM's epilogue without router weights
enum class Kind { kGateUp, kDown, kDownDgrad, kGateUpDgrad };
// Token rows gathered from a (M, K) matrix by sorted id (cp.async), not loaded from (L, ..) rows.
__host__ __device__ constexpr bool gathers(Kind k) { return k == Kind::kGateUp || k == Kind::kDownDgrad; }
// Weights read M-major: four 64 x 64 boxes per stage (64 features contiguous by 64 reduction rows).
__host__ __device__ constexpr bool mn_major(Kind k) { return k == Kind::kDownDgrad || k == Kind::kGateUpDgrad; }
// The tile's output features: 128 (gate/up: 128 gate + 128 up weight rows), else 256.
__host__ __device__ constexpr int tile_features(Kind k) { return k == Kind::kGateUp ? 128 : 256; }

// Named barriers (bar.sync ids; 0 is __syncthreads): the producer warpgroup has one, each
// consumer warpgroup cw (0 or 1) two of its own, so the warpgroups never wait on each other.
enum NamedBarrier : int {
  kProducerBarrier = 1,  // the producer threads that read a claimed tile (TileSlots)
  kTileBarrier = 2,      // + cw: once per tile (live-row count, router weights, HandOff's count)
  kEpilogueBarrier = 4,  // + cw: the epilogue's box hand-offs and stage release (bf16)
};

// The parts of GemmParams that only one GEMM, one weight format or CTA pairs read.
// The token rows the cp.async gather reads by sorted id / top_k (kGateUp: x, kDownDgrad: grad_out),
// and the pre-activations the training gate/up GEMM writes and kDownDgrad reads, a per-position
// operand as well.
struct GatherParams {
  const __nv_bfloat16* rows;  // (M, K) bf16 (f16 on the MXFP8 scale-window path: the gather only
                              // moves 2-byte values)
  int64_t ld;                 // row stride of rows (= K)
  uint4* preact;              // bf16 training: a, u in fragment order (PreactLayout), or null
};
struct DownParams {
  const float* topk_weights;  // (M * top_k,) router weights, one per slot (kDown, kDownDgrad);
                              // null: weight 1 (kGateUpDgrad)
  int h_done_target;          // the HandOff count that makes an m-block's h rows complete
};
// kDownDgrad's epilogue (moe_gemm_epilogue_dgrad.cuh; n_out = I, a multiple of 64): dA|dB and
// s*h leave by TMA (Bf16Maps out, out2); the score gradient's per-warp partial sums go here.
struct DgradParams {
  float* score_part;  // (16 * num_n, L): [((nb * 2 + cw) * 2 + block) * 4 + w4][position]
};
// Weight scales, each expert's (b_rows, K/32) matrix in the blocked layout on its own
// (pack_scales_blocked of (E, b_rows, K/32)), so expert e's start at row e * scale_rows.
struct Mxfp8Params {
  const uint8_t* b_scales;
  int b_rows;            // rows of B per expert (2I for gate/up, Kd for down)
  int scale_rows;        // b_rows padded to 128: an expert's rows in the scale layout
  int scale_col_groups;  // ceil((K/32) / 4): 512-byte chunks per 128-row group
  int scale_row_groups;  // E * scale_rows / 128
  // Gate/up only. window_misfit: 0 when every weight and token row fits the f16 scale window
  // (mx::kWindow), set by mxfp8_scale_window; of the two gate/up kernels, the one it does not
  // select returns at once. w_top / x_top: each weight row's / token's top scale byte.
  const uint32_t* window_misfit;
  const uint8_t* w_top;
  const uint8_t* x_top;
};
// CTA pairs (bpc = 2): the work units pair_units_kernel lists, and their count; null without.
struct PairParams {
  const int2* units;
  const int32_t* num_units;
};

// One GEMM launch: the routing, shape and schedule every launch reads, then the role's, the
// format's and the pairs' own parts.
struct GemmParams {
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;           // num_tokens_post_padded: sorted_ids' used length (device)
  __nv_bfloat16* out;            // kGateUp: h (L, I); kDown: Y (L, Kd)
  int64_t ldo;                   // row stride of out
  int L;                         // sorted_ids length
  int n_slots;                   // M * top_k (the padding sentinel)
  int top_k;
  int E;
  int K;                         // reduction length
  int n_out;                     // valid output columns
  int num_n;                     // n-blocks per m-block
  int* tile_counter;             // tiles claimed so far (zero before the launch)
  int* h_done;                   // per m-block: gate/up warpgroup-tiles whose h is stored (HandOff)
  int b_second;                  // row offset of the second weight box from the first
  GatherParams gather;
  DownParams down;
  DgradParams dgrad;
  Mxfp8Params mx;
  PairParams pairs;
};

// A sorted id that names a routing slot; anything else (the padding sentinel n_slots, or a
// corrupted value) is padding: no token read, zero router weight. (The GemmParams form spells
// the test out: forwarding p.n_slots to the int form changed the GEMM kernels' PTX.)
__device__ __forceinline__ bool live_slot(int sid, int n_slots) { return sid >= 0 && sid < n_slots; }
__device__ __forceinline__ bool live_slot(const GemmParams& p, int sid) { return sid >= 0 && sid < p.n_slots; }
// num_tokens_post_padded as read from the device, clamped to [0, L]: the positions in use.
__device__ __forceinline__ int used_length(const int32_t* ntpp, int L) {
  const int n = *ntpp;
  return n < 0 ? 0 : (n > L ? L : n);
}
// Whether live position pos (< used) is its m-block's last live row: the block's last row, or
// followed by padding (moe_align puts an expert's padding after its live rows) or by the end.
__device__ __forceinline__ bool ends_live_rows(const int32_t* sorted_ids, int pos, int used, int n_slots) {
  return pos % kBlockM == kBlockM - 1 || pos + 1 >= used || !live_slot(sorted_ids[pos + 1], n_slots);
}

// ---------------------------------------------------------------- scheduler
// A tile: n-block nb of expert e for the token rows [m0, m0 + rows) of sorted_ids. Without CTA
// pairs, and for a pair's lone block, that is one m-block (rows = kBM); the consumers fit wgmma's
// N to the live rows in it. A CTA pair's tiles split the live rows of up to kBM + kBM +
// kTailRows of an expert's sorted rows between the two CTAs (pair_units_kernel), each part at
// most kMaxRows, so no SM computes more padding than its peer makes it wait for.
// `group`: the m-block that keys the gate/up -> down handoff (HandOff) for these rows.
struct Tile {
  int m0, nb, e;  // m0 < 0: the end of the schedule
  int flags = 0;  // CTA pairs: kMulticast, kIdle
  int rows = kBlockM;
  int group = 0;
  // As a tile slot's eight words (TileSlots), and back.
  __device__ void to_words(uint32_t (&v)[8]) const {
    const uint32_t w[8] = {(uint32_t)m0, (uint32_t)nb, (uint32_t)e, (uint32_t)flags, (uint32_t)rows, (uint32_t)group,
                           0u, 0u};
    for (int i = 0; i < 8; ++i) v[i] = w[i];
  }
  __device__ static Tile from_words(const uint32_t (&v)[8]) {
    return Tile{(int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5]};
  }
};
// CTA pairs (clusters of 2, bpc = 2). kMulticast: the two CTAs compute one n-block for two
// parts of one expert's rows, and each TMA-multicasts one of the stage's two weight boxes to
// both. kIdle: this CTA has no tile in the unit (the second CTA of a lone block with an odd
// n-block count); it loads and keeps its barriers in step with its peer but computes and
// stores nothing.
constexpr int kMulticast = 1;
constexpr int kIdle = 2;
// A token tile holds up to kMaxRows rows, 16 more than an m-block: a pair whose expert ends
// in a block of at most kTailRows live rows after the pair's two blocks computes that block
// too (it gets no tiles of its own). Computed on its own, such a tail cost 81-86 % of a full
// tile (flash_moe/DESIGN.md §5).
constexpr int kMaxRows = kBlockM + 16;
static_assert(kMaxRows / 2 == sm90::kWgmmaAccRegs, "a tile's accumulators are the wgmma wrapper's arrays");
constexpr int kTailRows = 2 * (kMaxRows - kBlockM);

// The work of CTA pairs as a list of units in m-block order, ceil(num_n / 2) claims each (so no
// claim is wasted on a lone block, which needs only half as many): each expert's m-blocks taken
// two at a time, a pair {mb, mb + 1} (and a short tail block mb + 2 it carries) being two units
// (its n-blocks j < ceil(num_n / 2), then the rest: kUnitSecondHalf) whose .y holds the rows of
// the two CTAs' parts (unit_rows), an odd last block one unit {mb | kUnitAlone, 0} whose
// n-blocks 2j and 2j + 1 go to the two CTAs. An expert's lone block follows its pairs, so it
// finds their weights in L2.
constexpr int kUnitAlone = 1 << 30;
constexpr int kUnitSecondHalf = 1 << 29;
constexpr int kUnitBlock = kUnitSecondHalf - 1;
__host__ __device__ constexpr int unit_rows(int rows0, int rows1) { return rows0 | rows1 << 16; }

// The order tiles are handed out in, as groups of claims. Single CTAs: the (m-block, n-block)
// grid that num_tokens_post_padded (read on the device) covers, the n-blocks of an m-block next
// to each other (they share its token rows), then the next m-block (an expert's m-blocks are
// consecutive, so its weight rows are shared num_n tiles apart). CTA pairs: the units, each
// ceil(num_n / 2) claims.
struct TileOrder {
  int groups, per_group;
  __device__ explicit TileOrder(const GemmParams& p) : per_group(p.num_n) {
    if (p.pairs.units) {
      groups = *p.pairs.num_units;
      per_group = (p.num_n + 1) / 2;
      return;
    }
    groups = (used_length(p.ntpp, p.L) + kBM - 1) / kBM;
  }
  __device__ int count() const { return groups * per_group; }
};

// Tiles are claimed in TileOrder from a counter in global memory (zeroed before the launch),
// so the tiles running at any moment are neighbours in that order and read their shared rows
// from L2 at nearly the same time. (A static split -- CTA b taking tiles b, b + grid, ... --
// let the CTAs drift apart: at E = 256 the bf16 weights were read 2.4 times from DRAM, 1.8
// times with the counter.) Blocks whose expert is outside [0, E) are skipped, so corrupted
// routing buffers cannot send a CTA out of bounds.
__device__ inline Tile claim_tile(const GemmParams& p, const TileOrder& order) {
  for (;;) {
    const int t = atomicAdd(p.tile_counter, 1);
    if (t >= order.count()) return Tile{-1, 0, 0};
    const int mb = t / order.per_group, nb = t - mb * order.per_group;
    const int e = p.expert_ids[mb];
    if (e >= 0 && e < p.E) return Tile{mb * kBM, nb, e, 0, kBM, mb};
  }
}

// CTA pairs: claim t is the (t % half)-th claim of unit t / half, half = ceil(num_n / 2) (see
// kUnitAlone). The second half of a pair has one claim too many when num_n is odd: skipped.
struct TilePair {
  Tile rank[2];
  __device__ TilePair(const Tile& a, const Tile& b) : rank{a, b} {}
};
__device__ inline TilePair claim_pair(const GemmParams& p, const TileOrder& order) {
  const int num_n = p.num_n, half = order.per_group;
  const Tile end{-1, 0, 0};
  for (;;) {
    const int t = atomicAdd(p.tile_counter, 1);
    if (t >= order.count()) return TilePair(end, end);
    const int u = t / half, c = t - u * half;
    const int2 unit = p.pairs.units[u];
    const int mb = unit.x & kUnitBlock;
    const int e = p.expert_ids[mb];
    if (e < 0 || e >= p.E) continue;
    if (unit.x & kUnitAlone) {
      const bool odd_end = 2 * c + 1 >= num_n;  // num_n odd: the last n-block has no partner
      return TilePair(Tile{mb * kBM, 2 * c, e, 0, kBM, mb}, Tile{mb * kBM, 2 * c + 1, e, odd_end ? kIdle : 0, kBM, mb});
    }
    const int j = (unit.x & kUnitSecondHalf) ? half + c : c;
    if (j >= num_n) continue;
    const int rows0 = unit.y & 0xFFFF, rows1 = unit.y >> 16;
    return TilePair(Tile{mb * kBM, j, e, kMulticast, rows0, mb}, Tile{mb * kBM + rows0, j, e, kMulticast, rows1, mb});
  }
}

// Shared-memory tile slots. The producer's thread 0 claims a tile and hands it to the other
// producer threads through `claim` (two slots alternate, so a write never meets a pending
// read); the tile then travels with its first k-block: the producer writes it into the slot of
// the stage that holds k-block 0 before arriving on that stage's full barrier, and the
// consumers read it after their wait. A stage whose slot says m0 < 0 ends the schedule.
//
// CTA pairs: rank 0's thread 0 claims for both and writes rank 1's tile into rank 1's claim
// slot (`full` barrier); rank 1 reads it and frees the slot (`free` barrier in rank 0).
struct TileSlots {
  uint32_t base;  // 32 bytes per slot: [2] claim slots, [stages] stage slots, then 4 mbarriers
  int stages;
  uint32_t rank;  // in the CTA pair; 0 without pairs
  bool paired;
  int claims = 0;
  int last = 0;  // claim_next's slot; (claims - 1) & 1 instead adds 8 instructions to paired forward kernels
  static constexpr int kSlotBytes = 32;
  static constexpr int bytes(int stages) { return (2 + stages) * kSlotBytes + 4 * 8; }
  __device__ TileSlots(uint32_t addr, int stages_, uint32_t rank_, bool paired_)
      : base(addr), stages(stages_), rank(rank_), paired(paired_) {}
  __device__ uint32_t claim(int i) const { return base + kSlotBytes * i; }
  __device__ uint32_t stage(int s) const { return base + kSlotBytes * (2 + s); }
  __device__ uint32_t claim_full(int i) const { return base + kSlotBytes * (2 + stages) + 8 * i; }
  __device__ uint32_t claim_free(int i) const { return base + kSlotBytes * (2 + stages) + 16 + 8 * i; }
  __device__ void init_barriers() const {
    for (int i = 0; i < 2; ++i) {
      mbar_init(claim_full(i), 1);
      mbar_init(claim_free(i), 1);
    }
  }
  // A slot holds any tile format with to_words / from_words (this Tile, wgrad::Tile); kPeer:
  // `slot` is in the other CTA of the pair (peer_smem).
  template <bool kPeer = false, class T>
  __device__ static void put(uint32_t slot, const T& t) {
    uint32_t v[8];
    t.to_words(v);
    if constexpr (kPeer) {
      st_peer_v4(slot, v[0], v[1], v[2], v[3]);
      st_peer_v4(slot + 16, v[4], v[5], v[6], v[7]);
    } else {
      st_shared_v4(slot, v[0], v[1], v[2], v[3]);
      st_shared_v4(slot + 16, v[4], v[5], v[6], v[7]);
    }
  }
  template <class T>
  __device__ static T get(uint32_t slot) {
    const uint4 a = ld_shared_v4(slot), b = ld_shared_v4(slot + 16);
    const uint32_t v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    return T::from_words(v);
  }
  // Whole warps: lane 0 reads the slot, the warp gets its words (wait_tile says why).
  template <class T>
  __device__ static T get_lane0(uint32_t slot) {
    uint32_t v[8];
    ld_shared_x8_lane0(slot, v);
    return T::from_words(v);
  }
  // The claim exchange, whatever the tile's format (the wgrad kernel's too): producer threads
  // (all `threads` of them call it) get the claim slot holding their next tile, once thread 0
  // has written it by `claim_one(slot)` or, for a pair, rank 0's thread 0 by
  // `claim_two(slot, rank 1's slot)`. After reading the slot, every caller calls claim_read.
  template <class ClaimOne, class ClaimTwo>
  __device__ uint32_t claim_next(int threads, ClaimOne claim_one, ClaimTwo claim_two) {
    const int i = last = claims & 1;
    const uint32_t use = (uint32_t)(claims >> 1);
    ++claims;
    const uint32_t slot = claim(i);
    if (threadIdx.x == 0) {
      if (!paired) {
        claim_one(slot);
      } else if (rank == 0) {
        mbar_wait<true>(claim_free(i), (use & 1) ^ 1);  // rank 1 has read this slot's last tile
        claim_two(slot, peer_smem(slot, 1));
        mbar_arrive_peer(peer_smem(claim_full(i), 1));
      } else {
        mbar_wait<true>(claim_full(i), use & 1);
      }
    }
    if (threads > 1) named_barrier_sync(kProducerBarrier, threads);
    return slot;
  }
  // Paired rank 1: once every producer thread has read the slot, rank 0 may claim into it again.
  __device__ void claim_read(int threads) const {
    if (paired && rank == 1) {
      if (threads > 1) named_barrier_sync(kProducerBarrier, threads);
      if (threadIdx.x == 0) mbar_arrive_peer(peer_smem(claim_free(last), 0));
    }
  }
  // Producer threads (all `threads` of them call it): the next tile, as claim_next's claims
  // wrote it.
  template <class T, class ClaimOne, class ClaimTwo>
  __device__ T next(int threads, ClaimOne claim_one, ClaimTwo claim_two) {
    const T t = get<T>(claim_next(threads, claim_one, claim_two));
    claim_read(threads);
    return t;
  }
  __device__ Tile next(const GemmParams& p, const TileOrder& order, int threads) {
    return next<Tile>(
        threads, [&](uint32_t own) { put(own, claim_tile(p, order)); },
        [&](uint32_t own, uint32_t peer) {
          const TilePair t = claim_pair(p, order);
          put(own, t.rank[0]);
          put<true>(peer, t.rank[1]);
        });
  }
};

// ---------------------------------------------------------------- published stores
// All 128 threads of a consumer warpgroup, before its thread 0 publishes a tile's output to other
// threads by a flag (HandOff's count): every thread's register stores
// (`regs`, or always without kTmaStores) fenced, and thread 0's TMA bulk stores (kTmaStores)
// landed and ordered before its generic-proxy accesses.
template <bool kTmaStores>
__device__ __forceinline__ void land_stores(bool regs, int bar_id) {
  if (!kTmaStores || regs) {
    __threadfence();
    named_barrier_sync(bar_id, 128);
  }
  if constexpr (kTmaStores) {
    if ((threadIdx.x & 127) == 0) {
      bulk_wait_all();
      fence_proxy_async_global();
    }
  }
}

// ---------------------------------------------------------------- gate/up -> down handoff
// The down GEMM is launched as a programmatic dependent of the gate/up GEMM, so its CTAs start
// on the SMs the gate/up GEMM's last tiles leave idle, and stream order no longer covers h.
// Instead every gate/up consumer warpgroup adds 1 to h_done[tile.group] for each tile once its
// h stores have landed, and the down producer waits for that count to reach h_done_target (2
// warpgroups x the gate/up n-blocks) before its first h load of the group, twice that for a
// CTA pair's tiles (kMulticast: both CTAs' parts count to the pair's group). Both GEMMs walk the
// same groups (same ntpp, same units, same expert check), so every awaited count is reached.
// The gate/up count is sent one tile late (`pending`): by then the stores have long landed and
// the wait before the release costs nothing.
struct HandOff {
  int pending = -1;  // group of this warpgroup's previous tile, not yet counted
  bool pending_regs = false;  // that tile stored rows from registers as well
  // Count `pending`, all 128 threads of the warpgroup. kTmaStores: thread 0 issued the tile's
  // stores as TMA bulk groups (and, if pending_regs, every thread stored some from registers);
  // else every thread stored from registers.
  template <bool kTmaStores>
  __device__ void flush(const GemmParams& p, int bar_id) {
    if (pending < 0) return;
    land_stores<kTmaStores>(pending_regs, bar_id);
    if ((threadIdx.x & 127) == 0) red_release_gpu_add(p.h_done + pending, 1);
    pending = -1;
    pending_regs = false;
  }
  // A warpgroup that stores nothing for a tile (all-padding rows) counts it at once.
  __device__ static void count_empty(const GemmParams& p, const Tile& t) {
    if ((threadIdx.x & 127) == 0) red_release_gpu_add(p.h_done + t.group, 1);
  }
  // Down producer thread: wait until the tile's h rows are complete.
  __device__ static void wait_ready(const GemmParams& p, const Tile& t) {
    const int target = (t.flags & kMulticast) ? 2 * p.down.h_done_target : p.down.h_done_target;
    while (ld_acquire_gpu(p.h_done + t.group) < target) __nanosleep(128);
    fence_proxy_async_global();
  }
};

template <Kind kKind>
__device__ __forceinline__ int n_origin(const Tile& t) {
  return t.nb * tile_features(kKind);
}

// The gate/up pre-activations a training forward saves for kDownDgrad, in the consumers'
// fragment order so that both write and read them as one 16-byte vector per thread straight
// from registers: chunk ((g * L/8 + J) * 4 + w4) * 32 + lane holds, for 64-feature group g,
// absolute 8-row group J (position 8J..8J+7) and consumer thread (w4, lane), the values of
// features 64g + 16w4 + lane/4 + 8h at positions 8J + 2(lane%4) + e as bf16
// {gate(h0,e0), gate(h0,e1), gate(h1,e0), gate(h1,e1), up(..)}: accumulator a = 4j + 2h + e of
// the gate/up tile (acc0 gate, acc1 up). Both GEMMs tile by m-blocks of kBM rows (or CTA-pair
// parts of multiples of 8 rows), so every 8-row group holding a live row is written by the
// forward and read back whole. Size: ceil(I/64) * 64 * 2 * L bf16.
__device__ __forceinline__ int64_t preact_chunk(int g, int J, int L, int w4, int lane) {
  return (((int64_t)g * (L / 8) + J) * 4 + w4) * 32 + lane;
}

}  // namespace gemm
}  // namespace flash_moe
