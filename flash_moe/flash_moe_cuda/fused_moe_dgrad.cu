// fused_moe_bf16_dgrad (Hopper, sm_90a): the data gradients of the bf16 MoE, in stream order
// (the file of each step in brackets):
//
//   inverse     pos[slot] = p                                                  (routing_prep.cu)
//   GEMM1 down dgrad (kDownDgrad): dh[p] = grad_out[tok(p)] @ W2[e], epilogue with the saved
//               pre-activations: dA|dB[p], s*h[p], per-warp score partials  (moe_gemm_epilogue_dgrad.cuh)
//   score       score[slot] = sum over the partials at pos(slot), in a fixed order       (here)
//   GEMM2 gate/up dgrad (kGateUpDgrad): dx[p] = dA[p] @ W1[e] + dB[p] @ W3[e] (the down GEMM's roles)
//   reduce      grad_x[t] = sum_{k ascending} dx[pos(t*top_k + k)]  in fp32            (topk_reduce.cu)
//
// Both GEMMs are the forward's kernel (moe_gemm.cuh) with the weights read M-major, one CTA per
// SM, or as CTA pairs (bpc = 2), each CTA multicasting half of a stage's weight boxes to both.
// The gate/up dgrad's pairs split two m-blocks by live rows, as the bf16 forward's; the down
// dgrad's take a whole m-block each (pair_units without block_live), because its epilogue writes
// every m-block with a live row whole (padding rows as zeros), which the wgrads read. No float
// atomics: bit-identical results run to run, whatever bpc.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_moe.cuh"
#include "heuristics.cuh"
#include "launch.cuh"
#include "moe_gemm.cuh"
#include "workspace.cuh"

namespace flash_moe {
namespace {

using heuristics::kDgradStages;
using heuristics::kPositionThreads;
using heuristics::kPositionCtasPerSm;

using gemm::GemmParams;
using gemm::Kind;

// score[slot] = sum over q ascending of part[q][pos] at the slot's position pos; 0 for a slot
// without one. One thread per position, so a part's reads are contiguous across the warp (read
// per slot, at pos = inv[slot], each 4-byte load took a 32-byte sector of its own); a position
// is its slot's when inv says so (inverse_kernel's rule: live slot, valid expert, below ntpp).
__global__ void __launch_bounds__(kPositionThreads) score_sum_kernel(const float* __restrict__ part,
                                                                  const int32_t* __restrict__ sorted_ids,
                                                                  const int32_t* __restrict__ inv, int64_t n_slots,
                                                                  int64_t L, int parts, float* __restrict__ score) {
  const int64_t items = n_slots > L ? n_slots : L;
  for (int64_t i = blockIdx.x * (int64_t)kPositionThreads + threadIdx.x; i < items;
       i += (int64_t)gridDim.x * kPositionThreads) {
    if (i < L) {  // i as a position
      const int sid = sorted_ids[i];
      if (gemm::live_slot(sid, (int)n_slots) && inv[sid] == i) {
        float acc = 0.f;
        for (int q = 0; q < parts; ++q) acc += part[q * L + i];
        score[sid] = acc;
      }
    }
    if (i < n_slots && inv[i] < 0) score[i] = 0.f;  // i as a slot
  }
}

// The fields both GEMMs share.
GemmParams base_params(const FusedMoeBf16DgradArgs& a, const DgradWorkspace& ws) {
  GemmParams p{};
  p.sorted_ids = a.sorted_ids;
  p.expert_ids = a.expert_ids;
  p.ntpp = a.ntpp;
  p.L = (int)a.L;
  p.n_slots = (int)(a.M * a.top_k);
  p.top_k = a.top_k;
  p.E = (int)a.E;
  p.h_done = ws.h_done;  // never awaited: h_done_target stays 0
  return p;
}

// One of the two GEMMs, unpaired at bpc 1; at bpc 2 as CTA pairs on units pair_units makes now
// (block_live: two m-blocks split by live rows, as the bf16 forward's; null: a whole m-block per
// CTA). Both GEMMs' units share ws.units, so each GEMM plans its own just before it runs.
template <Kind kKind>
cudaError_t launch_dgrad_gemm(const FusedMoeBf16DgradArgs& a, const DgradWorkspace& ws, const gemm::Bf16Maps& maps,
                              GemmParams& p, const int32_t* block_live, cudaStream_t stream) {
  constexpr auto kW = gemm::Weights::kBf16;
  const int smem = gemm::StagePlan<kW, kDgradStages>::kLaunchBytes;
  if (a.bpc != 2)
    return host::launch_persistent(gemm::moe_gemm_kernel<kW, kKind, kDgradStages>, smem, maps, p, false, false,
                                   stream);
  p.pairs = {ws.units, ws.num_units};
  const cudaError_t err = pair_units(a.expert_ids, a.ntpp, a.L, a.E, block_live, ws.units, ws.num_units, stream);
  if (err != cudaSuccess) return err;
  return host::launch_persistent(gemm::moe_gemm_kernel<kW, kKind, kDgradStages, true>, smem, maps, p, false, true,
                                 stream);
}

}  // namespace

size_t fused_moe_bf16_dgrad_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
  return DgradWorkspace::bytes(M, K, I, L, top_k);
}

cudaError_t fused_moe_bf16_dgrad(const FusedMoeBf16DgradArgs& a, cudaStream_t stream) {
  // The binding's rules, restated for direct callers (topk_sum reads 8 features at a time).
  if (a.I <= 0 || a.I % 64 != 0 || a.K <= 0 || a.K % 8 != 0 || (a.bpc != 1 && a.bpc != 2) || !is_routing_length(a.L))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const DgradWorkspace ws(a.workspace, a.M, a.K, a.I, a.L, a.top_k);
  const int64_t n_slots = ws.n_slots;
  cudaError_t err = ws.clear(stream);
  if (err == cudaSuccess)
    err = slot_positions(a.sorted_ids, a.expert_ids, a.ntpp, a.L, n_slots, a.E, ws.inv, ws.block_live, stream);
  if (err != cudaSuccess) return err;

  using host::make_tmap;
  const uint32_t kRowsBox = gemm::kStoreRows, kMnBox = 64;
  // GEMM1: grad_out rows gathered (no token maps), w2 M-major; dA|dB and s*h out.
  gemm::Bf16Maps down{};
  if (!make_tmap(&down.weights, host::down_weights(a.w2, a.E, a.K, a.I, 2), false, kMnBox) ||
      !make_tmap(&down.out, host::row_major(a.dab, a.L, 2 * a.I), false, gemm::kDgradStoreRows) ||
      !make_tmap(&down.out2, host::row_major(a.sh, a.L, a.I), false, gemm::kDgradStoreRows))
    return cudaErrorInvalidValue;
  GemmParams p1 = base_params(a, ws);
  p1.out = static_cast<__nv_bfloat16*>(a.dab);
  p1.ldo = 2 * a.I;
  p1.K = (int)a.K;
  p1.n_out = (int)a.I;
  p1.num_n = (int)((a.I + 255) / 256);
  p1.tile_counter = ws.tile_counters;
  p1.gather.rows = static_cast<const __nv_bfloat16*>(a.grad_out);
  p1.gather.ld = a.K;
  p1.gather.preact = const_cast<uint4*>(static_cast<const uint4*>(a.preact));
  p1.down.topk_weights = a.topk_weights;
  p1.dgrad.score_part = ws.score_part;
  // a whole m-block per CTA: the epilogue writes every m-block with a live row whole
  if ((err = launch_dgrad_gemm<Kind::kDownDgrad>(a, ws, down, p1, nullptr, stream)) != cudaSuccess) return err;
  const int grid = heuristics::capped_grid(n_slots > a.L ? n_slots : a.L, kPositionThreads, kPositionCtasPerSm);
  // Parts are ordered by 64-feature group (4 warps each): those of groups past I are never
  // written, and the sum stops before them.
  score_sum_kernel<<<grid, kPositionThreads, 0, stream>>>(ws.score_part, a.sorted_ids, ws.inv, n_slots, a.L,
                                                           (int)(a.I / 16), a.score);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  // GEMM2: dA|dB rows by TMA, w M-major; dx slots out.
  gemm::Bf16Maps gate_up{};
  if (!make_tmap(&gate_up.tokens, host::row_major(a.dab, a.L, 2 * a.I), false) ||
      !make_tmap(&gate_up.tokens_tail, host::row_major(a.dab, a.L, 2 * a.I), false, gemm::kMaxRows - gemm::kBM) ||
      !make_tmap(&gate_up.weights, host::expert_rows(a.w1, a.E, a.I, a.K), false, kMnBox) ||
      !make_tmap(&gate_up.weights2, host::expert_rows(a.w3, a.E, a.I, a.K), false, kMnBox) ||
      !make_tmap(&gate_up.out, host::row_major(ws.dx, a.L, a.K), false, host::kStoreBoxRows) ||
      !make_tmap(&gate_up.out_rows, host::row_major(ws.dx, a.L, a.K), false, kRowsBox))
    return cudaErrorInvalidValue;
  GemmParams p2 = base_params(a, ws);
  p2.out = ws.dx;
  p2.ldo = a.K;
  p2.K = (int)(2 * a.I);
  p2.n_out = (int)a.K;
  p2.num_n = (int)((a.K + 255) / 256);
  p2.tile_counter = ws.tile_counters + 1;
  p2.b_second = (int)a.I;  // reduction rows I.. are w3's
  p2.down = {nullptr, 0};
  if ((err = launch_dgrad_gemm<Kind::kGateUpDgrad>(a, ws, gate_up, p2, ws.block_live, stream)) != cudaSuccess)
    return err;
  return topk_sum(ws.dx, ws.inv, a.grad_x, a.M, a.K, a.top_k, true, stream);
}

}  // namespace flash_moe
