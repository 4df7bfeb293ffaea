// flash_moe: raw-pointer launcher API shared by the kernels and the torch binding.
// Pure CUDA C++ (no torch headers). All launchers are asynchronous on `stream`, never
// synchronise with the host, and are CUDA-graph capturable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace flash_moe {

// The only token-block size the Hopper kernel implements (rows of one GEMM tile).
constexpr int kBlockM = 128;
// Output columns of h per gate/up tile (the tile holds kBlockN gate + kBlockN up columns).
constexpr int kBlockN = 128;
// n-extent of one wgmma (m64nNk16) issued by a consumer warpgroup.
constexpr int kWarpN = 128;
// bf16 shared-memory pipeline depths the kernels are instantiated for.
constexpr int kStagesMin = 3;
constexpr int kStagesMax = 4;
// MXFP8: shared-memory stages of the kernel (token tile + e4m3 weights + scales, 34 KB each),
// the only depth instantiated; K and I must be multiples of kMxfp8KBlock.
constexpr int kMxfp8Stages = 6;
constexpr int kMxfp8ScaleBlock = 32;
constexpr int kMxfp8KBlock = 64;
constexpr int kMaxExperts = 512;

// Sizes of the blocked layout of an (R, S) MXFP8 scale matrix (docs/DESIGN.md §6): 512-byte chunks of
// 128 rows x 4 scale columns, R padded to 128 and S to 4 (the device-side offsets are
// mx::blocked_offset).
constexpr int64_t mxfp8_scale_row_groups(int64_t R) { return (R + 127) / 128; }
constexpr int64_t mxfp8_scale_col_groups(int64_t S) { return (S + 3) / 4; }
constexpr int64_t mxfp8_blocked_scale_bytes(int64_t R, int64_t S) {
  return mxfp8_scale_row_groups(R) * mxfp8_scale_col_groups(S) * 512;
}
// Rows of one matrix's pack (R padded to 128): expert e's scales start at row e * this.
constexpr int64_t mxfp8_blocked_rows(int64_t R) { return mxfp8_scale_row_groups(R) * 128; }
constexpr int kMaxTopK = 16;
// A length of moe_align's layout: a positive whole number of m-blocks. The GEMM launchers refuse
// any other (the binding's rule, restated for direct callers: the kernels index the layout, and
// the pre-activations' 8-row groups, by whole m-blocks).
constexpr bool is_routing_length(int64_t L) { return L > 0 && L % kBlockM == 0; }

// SMs of the current device (persistent grids are sized by it); read once per process.
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return n;
}

// ---------------------------------------------------------------- moe_align
// Workspace (int32 elements) moe_align needs for n_slots = M*top_k flat slots.
int64_t moe_align_workspace_ints(int64_t n_slots, int num_experts);

// topk_ids: (n_slots,) int32 flat. Ids outside [0, num_experts) (e.g. -1) are dropped.
// sorted_ids: (sorted_len,) int32, sorted_len = ceil((n_slots + E*(block_m-1))/block_m)*block_m.
// expert_ids: (sorted_len/block_m,) int32; -1 for blocks past the last expert's run.
// ntpp: (1,) int32, total padded length actually used.
cudaError_t moe_align(const int32_t* topk_ids, int64_t n_slots, int num_experts, int block_m,
                      int32_t* sorted_ids, int64_t sorted_len, int32_t* expert_ids, int32_t* ntpp,
                      int32_t* workspace, cudaStream_t stream);

// ---------------------------------------------------------------- fused_moe_bf16
struct FusedMoeBf16Args {
  const void* x;             // (M, K) bf16
  const void* w;             // (E, 2I, K) bf16, gate rows [0, I), up rows [I, 2I); with w3: w1 (E, I, K)
  const void* w2;            // (E, K, I) bf16
  const int32_t* sorted_ids; // (L,)
  const int32_t* expert_ids; // (L / block_m,)
  const int32_t* ntpp;       // (1,)
  const float* topk_weights; // (M * top_k,)
  void* out;                 // (M, K) bf16
  int64_t M;
  int64_t K;                 // model dim
  int64_t I;                 // expert hidden dim
  int64_t E;
  int64_t L;                 // sorted_ids length
  int top_k;
  int stages;
  int bpc;                   // CTAs per cluster: 1, or 2 (CTA pairs sharing weight loads)
  bool split;                // true: out = result; false: out += result
  void* workspace;           // fused_moe_bf16_workspace_bytes(...) bytes, 256-byte aligned
  // Training: the gate/up pre-activations for fused_moe_bf16_dgrad (preact_bytes(L, I) bytes,
  // I a multiple of 64, bpc any), or null.
  void* preact = nullptr;
  // The up rows as a tensor of their own, (E, I, K) bf16 (w is then w1), or null (w holds both).
  const void* w3 = nullptr;
  // Run the gate/up GEMM alone: preact (required) is filled, out is not written. The backward of
  // an MXFP8 forward reads the bf16 pre-activations and needs nothing else of the bf16 forward.
  bool preact_only = false;
};

size_t fused_moe_bf16_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k);
// The pre-activations' size: 2 * L * I bf16, in the GEMM's fragment order (gemm::preact_chunk).
constexpr int64_t preact_bytes(int64_t L, int64_t I) { return 2 * L * I * 2; }

// ---------------------------------------------------------------- fused_moe_bf16_dgrad
// The backward's data gradients, given grad_out and what fused_moe_bf16 saved (preact, with the
// same routing buffers): the SwiGLU-backward GEMM (dh = grad_out[tok] @ W2[e], then dA|dB, s*h
// and the score gradient), the input-gradient GEMM (dx slots = dA|dB @ W[e]) and the top-k sum
// of those slots. I must be a multiple of 64, K a positive multiple of 8, L moe_align's length
// (is_routing_length); otherwise cudaErrorInvalidValue before anything runs. No atomics on
// floats: bit-identical run to run.
struct FusedMoeBf16DgradArgs {
  const void* grad_out;       // (M, K) bf16
  const void* w1;             // (E, I, K) bf16 gate rows
  const void* w3;             // (E, I, K) bf16 up rows (two tensors: no (E, 2I, K) copy needed)
  const void* w2;             // (E, K, I) bf16
  const void* preact;         // fused_moe_bf16's preact
  const int32_t* sorted_ids;  // the forward's routing buffers
  const int32_t* expert_ids;
  const int32_t* ntpp;
  const float* topk_weights;  // (M * top_k,)
  void* grad_x;               // (M, K) bf16: sum over k of dx slots
  void* dab;                  // (L, 2I) bf16: s * dL/d(gate|up pre-activation) by sorted position
  void* sh;                   // (L, I) bf16: s * h by sorted position
  float* score;               // (M * top_k,) fp32: dL/d topk_weights (0 for a dropped slot)
  int64_t M, K, I, E, L;
  int top_k;
  int bpc = 1;                // the gate/up dgrad's CTAs per cluster: 1, or 2 (CTA pairs)
  void* workspace;            // fused_moe_bf16_dgrad_workspace_bytes(...) bytes, 256-byte aligned
};
size_t fused_moe_bf16_dgrad_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k);
cudaError_t fused_moe_bf16_dgrad(const FusedMoeBf16DgradArgs& args, cudaStream_t stream);

// Returns cudaSuccess or the first CUDA error (launch or tensor-map encoding failure ->
// cudaErrorInvalidValue).
cudaError_t fused_moe_bf16(const FusedMoeBf16Args& args, cudaStream_t stream);

// ---------------------------------------------------------------- fused_moe_bf16_wgrad
// The backward's weight gradients from fused_moe_bf16_dgrad's dab and sh (same routing
// buffers, moe_align's layout: an expert's m-blocks consecutive) and the token rows:
// grad_w2[e] = sum_p grad_out[tok(p)]^T sh[p], grad_w1|w3[e] = sum_p dab[p]^T x[tok(p)] over
// expert e's live positions p, fp32 sums in position order rounded once to bf16; zeros for an
// expert without rows. I a multiple of 64. No atomics on floats: bit-identical run to run.
struct FusedMoeBf16WgradArgs {
  const void* x;              // (M, K) bf16: the forward's tokens
  const void* grad_out;       // (M, K) bf16
  const void* dab;            // (L, 2I) bf16: fused_moe_bf16_dgrad's dA|dB
  const void* sh;             // (L, I) bf16: fused_moe_bf16_dgrad's s*h
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;
  void* grad_w1;              // (E, I, K) bf16
  void* grad_w3;              // (E, I, K) bf16
  void* grad_w2;              // (E, K, I) bf16
  int64_t M, K, I, E, L;
  int top_k;
  int bpc = 1;                // 1, or 2: both GEMMs as CTA pairs sharing the A operand's loads
  void* workspace;            // fused_moe_bf16_wgrad_workspace_bytes(E, L) bytes, 256-byte aligned
};
size_t fused_moe_bf16_wgrad_workspace_bytes(int64_t E, int64_t L);
cudaError_t fused_moe_bf16_wgrad(const FusedMoeBf16WgradArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------- fused_moe_mxfp8
struct FusedMoeMxfp8Args {
  const void* x;               // (M, K) e4m3; K and I multiples of kMxfp8KBlock
  const uint8_t* x_scales;     // (M, K/32) e8m0 bytes, row-major
  const void* w;               // (E, 2I, K) e4m3
  const uint8_t* w_scales;     // each expert's (2I, K/32) scales in the blocked layout, concatenated
  const void* w2;              // (E, K, I) e4m3
  const uint8_t* w2_scales;    // each expert's (K, I/32) scales in the blocked layout, concatenated
  const int32_t* sorted_ids;
  const int32_t* expert_ids;
  const int32_t* ntpp;
  const float* topk_weights;
  void* out;                   // (M, K) bf16
  int64_t M, K, I, E, L;
  int top_k;
  int stages;                  // kMxfp8Stages
  int bpc;                     // CTAs per cluster: 1, or 2 (CTA pairs sharing weight loads)
  bool split;
  bool f16_window = true;      // false: always the general (bf16-operand) gate/up GEMM
  void* workspace;             // fused_moe_mxfp8_workspace_bytes(...) bytes, 256-byte aligned
};

size_t fused_moe_mxfp8_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t E, int64_t L, int top_k);
cudaError_t fused_moe_mxfp8(const FusedMoeMxfp8Args& args, cudaStream_t stream);

// ---------------------------------------------------------------- MXFP8 conversions (docs/DESIGN.md §6)
enum class FloatKind { kBf16, kFp32 };
// src: (R, K) bf16 or fp32, K a multiple of 32. vals: (R, K) e4m3. scales: (R, K/32) row-major,
// or (blocked) the blocked layout of each (mat_rows, K/32) matrix of the R / mat_rows (a whole
// number) packed on its own and concatenated, padding zeroed here (pack_scales_blocked of the
// (..., mat_rows, K/32) scales).
cudaError_t quantize_mxfp8(const void* src, FloatKind kind, int64_t R, int64_t K, uint8_t* vals, uint8_t* scales,
                           int64_t mat_rows, bool blocked, cudaStream_t stream);
// vals (R, K) e4m3, scales (R, K/32) row-major -> out (R, K) bf16; byte 255 -> NaN block.
cudaError_t dequantize_mxfp8(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                             cudaStream_t stream);

// Internal to fused_moe_mxfp8 (K a multiple of 64):
// The f16 scale-window scan (mx::kWindow): each weight row's (blocked w_scales) and token's
// (row-major x_scales) top scale byte; *misfit, zero on entry, stays 0 when every row fits the
// window (becomes nonzero when one does not, when force_misfit, or when K is too long for it).
cudaError_t mxfp8_scale_window(const uint8_t* w, const uint8_t* w_scales, int64_t w_rows, const uint8_t* x,
                               const uint8_t* x_scales, int64_t x_rows, int64_t K, bool force_misfit,
                               uint8_t* w_top, uint8_t* x_top, uint32_t* misfit, cudaStream_t stream);
// dequantize_mxfp8 with every 64-wide K block stored K-permuted (the layout the MXFP8 GEMM's
// register-operand path reads): bf16, or f16 in the scale window when *window_misfit == 0.
cudaError_t dequantize_mxfp8_k64_permuted(const uint8_t* vals, const uint8_t* scales, int64_t R, int64_t K, void* out,
                                         const uint8_t* window_top, const uint32_t* window_misfit,
                                         cudaStream_t stream);

// Internal to both fused ops, before the GEMMs (routing_prep.cu): inv[slot] = the slot's position
// in sorted_ids (slots of live blocks only; inv is -1 elsewhere) and block_live[b] = m-block b's
// live rows (zero on entry); for CTA pairs (bpc = 2) the work units gemm::claim_pair walks, and
// their count. block_live null: a block per CTA (no fitting of the pairs' parts).
cudaError_t slot_positions(const int32_t* sorted_ids, const int32_t* expert_ids, const int32_t* ntpp, int64_t L,
                           int64_t n_slots, int64_t E, int32_t* inv, int32_t* block_live, cudaStream_t stream);
cudaError_t pair_units(const int32_t* expert_ids, const int32_t* ntpp, int64_t L, int64_t E,
                       const int32_t* block_live, int2* units, int32_t* num_units, cudaStream_t stream);
// ... and last (topk_reduce.cu): out[t] (+)= sum over k ascending of Y[inv[t * top_k + k]] (Y and
// out bf16), fp32;
// split: out = the sum, else out += it. A programmatic dependent launch after the down GEMM.
cudaError_t topk_sum(const void* Y, const int32_t* inv, void* out, int64_t M, int64_t K, int top_k,
                     bool split, cudaStream_t stream);

}  // namespace flash_moe
