// The entry points of fused_moe_bf16 and fused_moe_mxfp8 (Hopper, sm_90a): the launch sequence
// both ops share (the file of each step in brackets):
//
//   [mxfp8 only] scale window: can the gate/up GEMM run on f16 operands (mx::kWindow)?
//   [mxfp8 only] x -> f16 or bf16 accordingly, K-permuted (the gather then reads 2-byte rows)
//                  (mxfp8_convert.cu)
//   inverse        pos[slot] = p   (slot -> sorted position)                       (routing_prep.cu)
//   [bpc = 2 only] units: each expert's m-blocks in pairs for the CTA-pair GEMMs   (routing_prep.cu)
//   GEMM1 gate/up  h[p] = silu(x[tok(p)] @ Wg[e]^T) * (x[tok(p)] @ Wu[e]^T)      bf16 h
//   GEMM2 down     Y[p] = topk_weight[slot(p)] * (h[p] @ W2[e]^T)                 bf16 Y
//   reduce         out[t] (+)= sum_{k ascending} Y[pos(t*top_k + k)]   in fp32    (topk_reduce.cu)
//
// fused_moe_bf16 with preact_only stops after GEMM1 (it fills preact; out is not written).
//
// The GEMMs' tensor maps and launches are in launch.cuh, the workspace's regions in
// workspace.cuh.
//
// GEMM2 and reduce are programmatic dependent launches: each starts its CTAs on the SMs the
// kernel before it leaves idle at its end. GEMM2 waits per m-block for h (gemm::HandOff),
// reduce for the whole of GEMM2 (griddepcontrol.wait).
//
// The GEMM kernels are in moe_gemm.cuh: bf16 weights by TMA, or e4m3 weights + blocked scales
// dequantized in registers (MXFP8; x and h are then stored K-permuted, see kperm). No float
// atomics anywhere: bit-identical output run after run.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "flash_moe.cuh"
#include "launch.cuh"
#include "moe_gemm.cuh"
#include "workspace.cuh"

namespace flash_moe {
namespace {

using gemm::GemmParams;
using gemm::Kind;
using host::kStoreBoxRows;
using host::launch_persistent;
using host::make_tmap;

// Both bf16 GEMMs at one pipeline depth, with or without CTA pairs; the gate/up GEMM alone
// without `with_down`.
template <int kStages, bool kPaired>
cudaError_t launch_bf16_gemms(const gemm::Bf16Maps& gate_up, const gemm::Bf16Maps& down, const GemmParams& p1,
                              const GemmParams& p2, bool with_down, cudaStream_t stream) {
  constexpr auto kW = gemm::Weights::kBf16;
  const int smem = gemm::StagePlan<kW, kStages>::kLaunchBytes;
  cudaError_t err = launch_persistent(gemm::moe_gemm_kernel<kW, Kind::kGateUp, kStages, kPaired>, smem, gate_up, p1,
                                      false, kPaired, stream);
  if (err != cudaSuccess || !with_down) return err;
  return launch_persistent(gemm::moe_gemm_kernel<kW, Kind::kDown, kStages, kPaired>, smem, down, p2, true, kPaired,
                           stream);
}

// The MXFP8 op's GEMMs: two gate/up kernels, general (bf16 operands) and f16 (scale window),
// of which the one window_misfit does not select returns at once, then the down GEMM.
template <bool kPaired>
cudaError_t launch_mxfp8_gemms(const gemm::Mxfp8Maps& gate_up, const gemm::Mxfp8Maps& down, const GemmParams& p1,
                               const GemmParams& p2, cudaStream_t stream) {
  using gemm::Weights;
  constexpr int kS = kMxfp8Stages;
  const int smem = gemm::StagePlan<Weights::kMxfp8, kS>::kLaunchBytes;
  cudaError_t err = launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8, Kind::kGateUp, kS, kPaired>, smem,
                                      gate_up, p1, false, kPaired, stream);
  if (err == cudaSuccess)
    err = launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8Window, Kind::kGateUp, kS, kPaired>, smem, gate_up,
                            p1, false, kPaired, stream);
  if (err != cudaSuccess) return err;
  return launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8, Kind::kDown, kS, kPaired>, smem, down, p2, true,
                           kPaired, stream);
}

// The routing/shape fields both GEMMs share, then each GEMM's own; p2 is derived for the down
// GEMM.
void make_params(const __nv_bfloat16* x, const int32_t* sorted_ids, const int32_t* expert_ids, const int32_t* ntpp,
                 const float* topk_weights, const Workspace& ws, int64_t M, int64_t K, int64_t I, int64_t E,
                 int64_t L, int top_k, GemmParams& p1, GemmParams& p2) {
  p1 = GemmParams{};
  p1.sorted_ids = sorted_ids;
  p1.expert_ids = expert_ids;
  p1.ntpp = ntpp;
  p1.out = ws.h;
  p1.ldo = I;
  p1.L = (int)L;
  p1.n_slots = (int)(M * top_k);
  p1.top_k = top_k;
  p1.E = (int)E;
  p1.K = (int)K;
  p1.n_out = (int)I;
  p1.num_n = (int)((I + 127) / 128);
  p1.tile_counter = ws.tile_counters;
  p1.h_done = ws.h_done;
  p2 = p1;
  p2.out = ws.Y;
  p2.ldo = K;
  p2.K = (int)I;
  p2.n_out = (int)K;
  p2.num_n = (int)((K + 255) / 256);
  p2.tile_counter = ws.tile_counters + 1;
  p1.b_second = (int)I;  // MXFP8: up rows follow the I gate rows in w (bf16: Bf16Maps::weights2)
  p2.b_second = 128;     // the two 128-row halves of a 256-column tile
  p1.gather = {x, K};
  p2.down = {topk_weights, 2 * p1.num_n};  // gemm::HandOff: two consumer warpgroups per gate/up tile
  p1.mx.b_rows = (int)(2 * I);
  p2.mx.b_rows = (int)K;
}

// bpc = 2, after slot_positions: the CTA pairs' units. fit (the bf16 op, whose consumers fit
// wgmma's N to the rows): split each pair's rows evenly and carry short tails (pair_units_kernel
// reads inverse_kernel's live rows per block for that); else (MXFP8) a block per CTA.
cudaError_t plan_pairs(const int32_t* expert_ids, const int32_t* ntpp, const Workspace& ws, int64_t E, int64_t L,
                       GemmParams& p1, GemmParams& p2, cudaStream_t stream, bool fit) {
  p1.pairs.units = p2.pairs.units = ws.units;
  p1.pairs.num_units = p2.pairs.num_units = ws.num_units;
  return pair_units(expert_ids, ntpp, L, E, fit ? ws.block_live : nullptr, ws.units, ws.num_units, stream);
}

}  // namespace

size_t fused_moe_bf16_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
  return WorkspaceLayout(M, K, I, L, top_k, 0).total();
}

size_t fused_moe_mxfp8_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t E, int64_t L, int top_k) {
  return WorkspaceLayout(M, K, I, L, top_k, E * 2 * I).total();
}

cudaError_t fused_moe_bf16(const FusedMoeBf16Args& a, cudaStream_t stream) {
  if ((a.stages != 3 && a.stages != 4) || (a.bpc != 1 && a.bpc != 2) || !is_routing_length(a.L) ||
      (a.preact_only && !a.preact))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const Workspace ws(a.workspace, a.M, a.K, a.I, a.L, a.top_k, 0);
  cudaError_t err = ws.clear(stream);
  if (err == cudaSuccess)
    err = slot_positions(a.sorted_ids, a.expert_ids, a.ntpp, a.L, ws.n_slots, a.E, ws.inv, ws.block_live, stream);
  if (err != cudaSuccess) return err;
  gemm::Bf16Maps gate_up{}, down{};  // the gate/up GEMM gathers its tokens: no token maps
  const uint32_t kTailBox = gemm::kMaxRows - gemm::kBM, kRowsBox = gemm::kStoreRows;
  // The gate rows (w1) and the up rows (w3) through maps of their own: the two halves of w, or
  // two tensors, so a caller holding w1 and w3 need not concatenate them (a copy of all the
  // gate/up weights per call).
  const void* w3 = a.w3 ? a.w3 : static_cast<const __nv_bfloat16*>(a.w) + a.I * a.K;
  const int64_t expert_stride = a.w3 ? a.I * a.K : 2 * a.I * a.K;
  if (!make_tmap(&gate_up.weights, host::expert_rows(a.w, a.E, a.I, a.K, expert_stride), false) ||
      !make_tmap(&gate_up.weights2, host::expert_rows(w3, a.E, a.I, a.K, expert_stride), false) ||
      !make_tmap(&gate_up.out, host::row_major(ws.h, a.L, a.I), false, kStoreBoxRows) ||
      !make_tmap(&gate_up.out_rows, host::row_major(ws.h, a.L, a.I), false, kRowsBox) ||
      !make_tmap(&down.tokens, host::row_major(ws.h, a.L, a.I), false) ||
      !make_tmap(&down.tokens_tail, host::row_major(ws.h, a.L, a.I), false, kTailBox) ||
      !make_tmap(&down.weights, host::down_weights(a.w2, a.E, a.K, a.I, 2), false) ||
      !make_tmap(&down.out, host::row_major(ws.Y, a.L, a.K), false, kStoreBoxRows) ||
      !make_tmap(&down.out_rows, host::row_major(ws.Y, a.L, a.K), false, kRowsBox))
    return cudaErrorInvalidValue;
  GemmParams p1, p2;
  make_params(static_cast<const __nv_bfloat16*>(a.x), a.sorted_ids, a.expert_ids, a.ntpp, a.topk_weights, ws, a.M,
              a.K, a.I, a.E, a.L, a.top_k, p1, p2);
  p1.gather.preact = static_cast<uint4*>(a.preact);
  // pipeline depth x CTA pairs: the four kernel pairs
  const auto gemms = [&](auto paired) {
    constexpr bool kPaired = decltype(paired)::value;
    return a.stages == 4 ? launch_bf16_gemms<4, kPaired>(gate_up, down, p1, p2, !a.preact_only, stream)
                         : launch_bf16_gemms<3, kPaired>(gate_up, down, p1, p2, !a.preact_only, stream);
  };
  // CTA pairs split their experts' rows evenly and carry short tails (pair_units_kernel reads
  // inverse_kernel's live rows per block for that).
  if (a.bpc == 2) err = plan_pairs(a.expert_ids, a.ntpp, ws, a.E, a.L, p1, p2, stream, true);
  if (err == cudaSuccess) err = a.bpc == 2 ? gemms(std::true_type{}) : gemms(std::false_type{});
  if (err != cudaSuccess || a.preact_only) return err;
  return topk_sum(ws.Y, ws.inv, a.out, a.M, a.K, a.top_k, a.split, stream);
}

cudaError_t fused_moe_mxfp8(const FusedMoeMxfp8Args& a, cudaStream_t stream) {
  if (a.stages != kMxfp8Stages || a.K % 64 != 0 || a.I % 64 != 0 || (a.bpc != 1 && a.bpc != 2) ||
      !is_routing_length(a.L))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const Workspace ws(a.workspace, a.M, a.K, a.I, a.L, a.top_k, a.E * 2 * a.I);
  cudaError_t err = ws.clear(stream);
  if (err == cudaSuccess)
    err = slot_positions(a.sorted_ids, a.expert_ids, a.ntpp, a.L, ws.n_slots, a.E, ws.inv, ws.block_live, stream);
  if (err != cudaSuccess) return err;
  // Which gate/up GEMM runs: f16 operands if every row fits the scale window (mx::kWindow).
  // Then x, read top_k times by the gather, is dequantized once (M*K*3 bytes, ~1% of the op)
  // to f16 or bf16 accordingly.
  // The scan reads w_scales as one (E*2I, K/32) matrix: the same bytes as the per-expert
  // packing, since 2I is a multiple of 128 (I % 64 == 0).
  err = mxfp8_scale_window(static_cast<const uint8_t*>(a.w), a.w_scales, a.E * 2 * a.I,
                           static_cast<const uint8_t*>(a.x), a.x_scales, a.M, a.K, !a.f16_window, ws.w_top,
                           ws.x_top, ws.window_misfit, stream);
  if (err == cudaSuccess)
    err = dequantize_mxfp8_k64_permuted(static_cast<const uint8_t*>(a.x), a.x_scales, a.M, a.K, ws.x16, ws.x_top,
                                        ws.window_misfit, stream);
  if (err != cudaSuccess) return err;
  gemm::Mxfp8Maps gate_up{}, down{};
  if (!make_tmap(&gate_up.weights, host::gate_up_weights(a.w, a.E, a.K, a.I, 1), true) ||
      !make_tmap(&down.tokens, host::row_major(ws.h, a.L, a.I), false) ||
      !make_tmap(&down.weights, host::down_weights(a.w2, a.E, a.K, a.I, 1), true))
    return cudaErrorInvalidValue;
  GemmParams p1, p2;
  make_params(static_cast<const __nv_bfloat16*>(ws.x16), a.sorted_ids, a.expert_ids, a.ntpp, a.topk_weights, ws,
              a.M, a.K, a.I, a.E, a.L, a.top_k, p1, p2);
  p1.mx.b_scales = a.w_scales;
  p1.mx.scale_col_groups = (int)mxfp8_scale_col_groups(a.K / kMxfp8ScaleBlock);
  p1.mx.scale_rows = (int)mxfp8_blocked_rows(2 * a.I);
  p1.mx.scale_row_groups = (int)(a.E * mxfp8_scale_row_groups(2 * a.I));
  p1.mx.window_misfit = ws.window_misfit;
  p1.mx.w_top = ws.w_top;
  p1.mx.x_top = ws.x_top;
  p2.mx.b_scales = a.w2_scales;
  p2.mx.scale_col_groups = (int)mxfp8_scale_col_groups(a.I / kMxfp8ScaleBlock);
  p2.mx.scale_rows = (int)mxfp8_blocked_rows(a.K);
  p2.mx.scale_row_groups = (int)(a.E * mxfp8_scale_row_groups(a.K));
  if (a.bpc == 2) err = plan_pairs(a.expert_ids, a.ntpp, ws, a.E, a.L, p1, p2, stream, false);
  if (err == cudaSuccess)
    err = a.bpc == 2 ? launch_mxfp8_gemms<true>(gate_up, down, p1, p2, stream)
                     : launch_mxfp8_gemms<false>(gate_up, down, p1, p2, stream);
  if (err != cudaSuccess) return err;
  return topk_sum(ws.Y, ws.inv, a.out, a.M, a.K, a.top_k, a.split, stream);
}

}  // namespace flash_moe
