// Epilogue pieces: SwiGLU's arithmetic (both formats), and the bf16 path's 64 x 64 output boxes
// the consumers stage in shared memory for TMA stores (put_box). The MXFP8 path's
// register stores are in moe_gemm_epilogue_mxfp8.cuh.
#pragma once

#include "moe_gemm_schedule.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- epilogues
// Rows per TMA store of a box that holds fewer than 64 live tokens (Bf16Maps::out_rows).
constexpr int kStoreRows = 8;
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// silu(g) * u in fp32 with the fast reciprocal (rcp.approx, within 1 ulp of fp32; the result
// is rounded to bf16): the epilogue runs while the tensor cores wait, and the IEEE division
// made it measurably longer (-4 to -8 % for the whole op at the issue shapes;
// flash_moe/DESIGN.md §5).
// e^-g is __expf's ex2.approx of -g log2(e), flushing results below 2^-126 to zero: 1 + e^-g is
// 1 for those either way, so this is __expf's result bit for bit, without its subnormal fix-up.
__device__ __forceinline__ float silu_times(float g, float u) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.4426950408889634f));
  return __fdividef(g, 1.f + e) * u;
}

// The consumers' tiles (features as M, columns as N: tokens in the forward and the dgrads,
// B's features in the wgrads): thread (w4, lane) holds features 16 w4 + lane/4 + 8h of a
// 64-feature block for columns 8j + 2(lane%4) + e, in accumulator a = 4j + 2h + e. put_box
// writes columns 64 tb .. 64 tb + 63 of the block, value(a) each, as a 64 x 64 bf16 box at `box`
// (1024-byte aligned) in the 128-byte swizzle the output's TMA map reads, fragment matrix (h, j)
// by fragment matrix, lane L addressing a row of matrix (h, j) = (L/8 % 2, j0 + L/16):
//   kTransposed (h, Y, grad_W2: features contiguous): a 128-byte row per column, stmatrix .trans;
//     lane L addresses column row 8(j - 8 tb) + L%8, whose 8 features are chunk 2 w4 + h;
//   else (grad_W1|W3: columns contiguous): a 128-byte row per feature, stmatrix; lane L addresses
//     feature row 16 w4 + 8h + L%8, whose 8 columns are chunk j - 8 tb.
template <bool kTransposed, class Value>
__device__ __forceinline__ void put_box(uint32_t box, int tb, int w4, int lane, Value value) {
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
    if constexpr (kTransposed) {
      const int t = 8 * (jj + mj) + mi;
      stmatrix_x4_trans(box + t * 128 + (((2 * w4 + mh) ^ (t & 7)) << 4), v[0][0], v[0][1], v[1][0], v[1][1]);
    } else {
      const int row = 16 * w4 + 8 * mh + mi;
      stmatrix_x4(box + row * 128 + (((jj + mj) ^ (row & 7)) << 4), v[0][0], v[0][1], v[1][0], v[1][1]);
    }
  }
}

}  // namespace gemm
}  // namespace flash_moe
