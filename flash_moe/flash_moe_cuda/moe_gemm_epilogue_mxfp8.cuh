// The MXFP8 path's epilogues: stores from registers, no shared-memory staging. In
// consume_mxfp8's transposed tiles a thread holds output features r0 = 16 w4 + lane/4 and
// r0 + 8 (one bf16 pair of physical columns) for tokens 8j + 2(lane%4) + e, j = 0..15, e = 0, 1:
// two output-row pointers (e) that step 8 rows per j, and the tile's per-token factors read from
// shared memory at wt_s + 4e + 32j (router weights, or the f16 window's token factors).
#pragma once

#include "moe_gemm_epilogue.cuh"

namespace flash_moe {
namespace gemm {

// Gate/up: h = silu(gate) * up. kF16: the products carry 2^(268 - top_w - top_x); fw holds the
// rows' factors, the tokens' come from wt_s (both multiplications exact, mx::kWindow).
template <RsType kT>
__device__ __forceinline__ void store_h_mxfp8(const float (&acc0)[64], const float (&acc1)[64],
                                              const float (&fw)[2][2], __nv_bfloat16* out, int64_t ldo,
                                              int64_t row_step, uint32_t wt_s) {
#pragma unroll
  for (int j = 0; j < 16; ++j, out += row_step)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float g0 = acc0[4 * j + e], g1 = acc0[4 * j + 2 + e];
      float u0 = acc1[4 * j + e], u1 = acc1[4 * j + 2 + e];
      if constexpr (kT == RsType::kF16) {
        const float fx = ld_shared_f32(wt_s + 4 * e + 32 * j);
        g0 = g0 * fw[0][0] * fx, g1 = g1 * fw[0][1] * fx;
        u0 = u0 * fw[1][0] * fx, u1 = u1 * fw[1][1] * fx;
      }
      *reinterpret_cast<__nv_bfloat162*>(out + e * ldo) = __floats2bfloat162_rn(silu_times(g0, u0), silu_times(g1, u1));
    }
}

// Down: Y = router weight x (h W2^T); block 0 at `out`, block 1 64 columns further, each stored
// where it holds a real output feature; half: the tile's last 64 tokens are padding.
__device__ __forceinline__ void store_y_mxfp8(const float (&acc0)[64], const float (&acc1)[64], __nv_bfloat16* out,
                                              int64_t ldo, int64_t row_step, uint32_t wt_s, bool store0, bool store1,
                                              bool half) {
#pragma unroll
  for (int j = 0; j < 16; ++j, out += row_step) {
    if (half && j >= 8) break;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float wv = ld_shared_f32(wt_s + 4 * e + 32 * j);  // one factor load for both blocks
      if (store0)
        *reinterpret_cast<__nv_bfloat162*>(out + e * ldo) =
            __floats2bfloat162_rn(acc0[4 * j + e] * wv, acc0[4 * j + 2 + e] * wv);
      if (store1)
        *reinterpret_cast<__nv_bfloat162*>(out + e * ldo + 64) =
            __floats2bfloat162_rn(acc1[4 * j + e] * wv, acc1[4 * j + 2 + e] * wv);
    }
  }
}

}  // namespace gemm
}  // namespace flash_moe
