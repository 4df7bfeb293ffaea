// The top-k sum of grad_x folded into the gate/up dgrad (kGateUpDgrad launched with kFold;
// flash_moe/DESIGN.md §8.4), instead of reduce_kernel after it:
//
//   grad_x[t, chunk] = sum over k ascending of dx[pos(t * top_k + k), chunk]   in fp32
//
// per 128-feature chunk (a consumer warpgroup's half of an n-block: chunk = 2 nb + cw), summed as
// reduce_kernel sums (same bits) by the CTA that stores the token's last row of that chunk. Which
// one that is, an integer count per (token, chunk) says (FoldParams::count): score_sum_kernel sets
// it to the token's slots without a position (and zeroes grad_x of a token with none), and each
// stored row that is its slot's position adds one; the add that brings it to top_k completes the
// token. No float atomics.
//
// The producer warpgroup's warps 1-3 do the adds and the sums (in kGateUpDgrad its thread 0
// alone issues the TMA loads), off the consumers' path. A consumer warpgroup hands each tile to
// them one tile late, as HandOff does (its dx stores have long landed by then): its thread 0 waits
// for the stores, fences them, and writes the tile into a ring of kFoldSlots entries in shared
// memory (FoldRing), one entry per tile whose halves the two consumer warpgroups write; an entry
// is full after both halves (two arrivals) and vacated once the three helper warps have read it
// (three). Both warpgroups walk the same tiles and skip the same ones (no live rows, idle CTAs),
// so their halves meet in the same entry; the vacated barriers keep either from running more
// than kFoldSlots tiles ahead of the helpers.
#pragma once

#include "moe_gemm_epilogue.cuh"
#include "moe_gemm_stages.cuh"

namespace flash_moe {
namespace gemm {

constexpr int kFoldChunk = 128;  // features per count: a consumer warpgroup's part of an n-block
constexpr int kFoldHelpers = 96;  // producer warps 1-3

// The ring in shared memory: kFoldSlots entries of 32 bytes (per consumer warpgroup: m0, rows,
// nb, 0; m0 < 0 ends the schedule), then the full and the vacated mbarriers.
struct FoldRing {
  uint32_t base;
  __device__ uint32_t entry(int s) const { return base + 32 * s; }
  __device__ uint32_t full(int s) const { return base + 32 * kFoldSlots + 8 * s; }
  __device__ uint32_t vacated(int s) const { return base + 32 * kFoldSlots + 8 * (kFoldSlots + s); }
  __device__ void init_barriers() const {
    for (int s = 0; s < kFoldSlots; ++s) {
      mbar_init(full(s), 2);
      mbar_init(vacated(s), kFoldHelpers / 32);
    }
  }
};

// A consumer warpgroup's side: the tile whose dx it stored last, published at the next tile's
// epilogue (flush) or at the end (finish). All 128 threads call both.
struct FoldPublisher {
  int m0 = -1, rows = 0, nb = 0;
  bool regs = false;  // the tile stored rows kBM.. from registers (plain stores) too
  uint32_t published = 0;
  // Every thread waits for the slot (free at once unless the helpers are kFoldSlots tiles behind;
  // no spin loop inside a branch on the thread), thread 0 writes it.
  __device__ void put(const FoldRing& ring, int cw, int e_m0, int e_rows, int e_nb) {
    const int s = published % kFoldSlots;
    mbar_wait(ring.vacated(s), ((published / kFoldSlots) & 1) ^ 1);
    if ((threadIdx.x & 127) == 0) {
      st_shared_v4(ring.entry(s) + 16 * cw, (uint32_t)e_m0, (uint32_t)e_rows, (uint32_t)e_nb, 0u);
      mbar_arrive(ring.full(s));
    }
    ++published;
  }
  __device__ void flush(const FoldRing& ring, int cw, int bar_id) {
    if (m0 < 0) return;
    land_stores<true>(regs, bar_id);
    // The ring's arrive is a CTA-scope release: the fence orders the stores before the helpers'
    // gpu-scope count adds.
    if ((threadIdx.x & 127) == 0) __threadfence();
    put(ring, cw, m0, rows, nb);
    m0 = -1;
    regs = false;
  }
  __device__ void finish(const FoldRing& ring, int cw, int bar_id) {
    flush(ring, cw, bar_id);
    put(ring, cw, -1, 0, 0);
  }
};

// Half a helper warp (16 lanes, `sub` = lane % 16, 8 features each): grad_x[t] over chunk c's 128
// features from the token's top_k dx rows, fp32 adds in k order from 0 (reduce_kernel's sums and
// bits), kRowsInFlight rows' loads in flight at once (8 spilled in the producer's 56 registers);
// t < 0: nothing. The two halves sum two tokens at once,
// so a warp waits for one round trip per two completions. The count's acquire by the completing
// lane, then __syncwarp, orders these loads after the rows' stores.
constexpr int kRowsInFlight = 4;
__device__ __forceinline__ void sum_chunk(const GemmParams& p, int t, int c, int sub) {
  const int f = kFoldChunk * c + 8 * sub;
  const bool in = t >= 0 && f < p.n_out;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < p.top_k; k0 += kRowsInFlight) {
    uint4 v[kRowsInFlight];
    uint32_t loaded = 0;  // bit i: row k0 + i has a position (and the lane features)
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      const int pos = in && k0 + i < p.top_k ? p.fold.inv[(int64_t)t * p.top_k + k0 + i] : -1;
      if (pos >= 0) {
        v[i] = __ldcg(reinterpret_cast<const uint4*>(p.out + (int64_t)pos * p.ldo + f));
        loaded |= 1u << i;
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
      if ((loaded >> i) & 1u) add_bf16x8(acc, v[i]);
  }
  if (in)
    *reinterpret_cast<uint4*>(p.fold.grad_x + (int64_t)t * p.n_out + f) =
        make_uint4(bf16x2_bits(acc[0], acc[1]), bf16x2_bits(acc[2], acc[3]), bf16x2_bits(acc[4], acc[5]),
                   bf16x2_bits(acc[6], acc[7]));
}

// Producer warps 1-3: for each published tile, each helper thread counts rows h and h + 96 of
// both halves; the warp then sums the (token, chunk)s its threads completed. Returns at the
// schedule's end.
__device__ inline void fold_topk_sums(const GemmParams& p, const FoldRing& ring) {
  const int h = (int)threadIdx.x - 32, lane = threadIdx.x & 31;
  static_assert(2 * kFoldHelpers >= kMaxRows, "two rows per helper thread cover a tile");
  for (uint32_t j = 0;; ++j) {
    const int s = j % kFoldSlots;
    mbar_wait(ring.full(s), (j / kFoldSlots) & 1);
    uint32_t v[8];
    ld_shared_x8_lane0(ring.entry(s), v);  // lane 0 reads: its own arrive orders the read (racecheck)
    if (lane == 0) mbar_arrive(ring.vacated(s));
    if ((int)v[0] < 0) break;  // both halves end at the same entry
    int done_t[4];  // [2 half + i]: the token row h + 96 i of that half completed, or -1
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m0 = (int)v[4 * half], rows = (int)v[4 * half + 1], c = 2 * (int)v[4 * half + 2] + half;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = h + kFoldHelpers * i, q = 2 * half + i;
        done_t[q] = -1;
        if (r >= rows || c * kFoldChunk >= p.n_out) continue;
        // A row counts only as its slot's position (inv: inverse_kernel's rule, which set the
        // counts), so user-made routing buffers (a slot twice, one past num_tokens_post_padded)
        // cannot complete a token early.
        const int sid = p.sorted_ids[m0 + r];
        if (!live_slot(p, sid) || p.fold.inv[sid] != m0 + r) continue;
        const int t = sid / p.top_k;
        if (atom_add_acq_rel_gpu(p.fold.count + (int64_t)t * p.fold.chunks + c, 1) == p.top_k - 1) done_t[q] = t;
      }
    }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int c = 2 * (int)v[4 * (q / 2) + 2] + q / 2;
      // Two completions per pass, one per half warp; each completing lane's token reaches the
      // warp by redux.sync (as t + 1; 0: none): a __shfl_sync anywhere here made ptxas keep the
      // paired kernel's stage counter out of uniform registers (576 R2UR in its mainloop).
      for (uint32_t mask = __ballot_sync(0xffffffffu, done_t[q] >= 0); mask;) {
        const int src0 = __ffs(mask) - 1;
        mask &= mask - 1;
        const int src1 = mask ? __ffs(mask) - 1 : -1;
        mask &= mask - 1;  // 0 stays 0
        const int t0 = (int)__reduce_or_sync(0xffffffffu, lane == src0 ? (uint32_t)done_t[q] + 1u : 0u) - 1;
        const int t1 = (int)__reduce_or_sync(0xffffffffu, lane == src1 ? (uint32_t)done_t[q] + 1u : 0u) - 1;
        sum_chunk(p, lane < 16 ? t0 : t1, c, lane & 15);
      }
    }
  }
}

}  // namespace gemm
}  // namespace flash_moe
