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
// Shared-memory pipeline depths the kernel is instantiated for.
constexpr int kStagesMin = 3;
constexpr int kStagesMax = 4;
constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 16;

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
  const void* w;             // (E, 2I, K) bf16, gate rows [0, I), up rows [I, 2I)
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
  bool split;                // true: out = result; false: out += result
  void* workspace;           // fused_moe_bf16_workspace_bytes(...) bytes, 256-byte aligned
};

size_t fused_moe_bf16_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k);

// Returns cudaSuccess or the first CUDA error (launch or tensor-map encoding failure ->
// cudaErrorInvalidValue).
cudaError_t fused_moe_bf16(const FusedMoeBf16Args& args, cudaStream_t stream);

}  // namespace flash_moe
