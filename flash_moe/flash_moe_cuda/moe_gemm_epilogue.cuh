// The bf16 path's epilogues: SwiGLU (gate/up GEMM) and the router weight (down GEMM), each
// consumer warpgroup's 64 x 128 block staged in shared memory and stored by TMA (StagedStore).
#pragma once

#include "moe_gemm_schedule.cuh"

namespace flash_moe {
namespace gemm {

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

// Transposed tiles (weights as M, tokens as N; moe_gemm_consumer_transposed.cuh): thread
// (w4, lane) holds features 16 w4 + lane/4 + 8h of a 64-feature block for tokens
// 8j + 2(lane%4) + e, in accumulator a = 4j + 2h + e. put_box_transposed writes tokens
// 64 tb .. 64 tb + 63 of the block, value(a) each, as a 64 x 64 bf16 box at `box` (1024-byte
// aligned): a 128-byte row per token in the 128-byte swizzle, as the output's TMA map reads it.
// stmatrix .trans stores fragment matrix (h, j) transposed: lane L addresses token row
// 8(j - 8 tb) + L%8 of matrix (h, j) = (L/8 % 2, j0 + L/16), whose 8 features are the 16-byte
// chunk 2 w4 + h of that row.
template <class Value>
__device__ __forceinline__ void put_box_transposed(uint32_t box, int tb, int w4, int lane, Value value) {
  const int mh = (lane >> 3) & 1, mj = lane >> 4, mi = lane & 7;
#pragma unroll
  for (int jj = 0; jj < 8; jj += 2) {
    uint32_t v[2][2];
#pragma unroll
    for (int dj = 0; dj < 2; ++dj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int a = 4 * (8 * tb + jj + dj) + 2 * h;
        v[dj][h] = bf16x2_bits(value(a), value(a + 1));
      }
    const int t = 8 * (jj + mj) + mi;
    stmatrix_x4_trans(box + t * 128 + (((2 * w4 + mh) ^ (t & 7)) << 4), v[0][0], v[0][1], v[1][0], v[1][1]);
  }
}

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

}  // namespace gemm
}  // namespace flash_moe
