// fused_moe_bf16_wgrad (Hopper, sm_90a): the weight gradients of the bf16 MoE from what
// fused_moe_bf16_dgrad wrote (dA|dB and s*h by sorted position) and the token rows, in stream
// order:
//
//   spans              per expert: its first m-block and the end of its live rows; per
//                      position its token (or -1)                                    (here)
//   GEMM kDownWgrad    grad_W2[e] = sum_p grad_out[tok(p)]^T (s h)[p]               (moe_wgrad.cuh)
//   GEMM kGateUpWgrad  grad_W1|W3[e] = sum_p (dA|dB)[p]^T x[tok(p)]
//
// No float atomics: each output tile is one CTA's, summed in position order, whatever bpc (CTA
// pairs share the A operand's loads, not tiles).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "flash_moe.cuh"
#include "heuristics.cuh"
#include "launch.cuh"
#include "moe_wgrad.cuh"
#include "workspace.cuh"

namespace flash_moe {
namespace {

using heuristics::kWgradStages;
using heuristics::kPositionThreads;
using heuristics::kPositionCtasPerSm;

// span[2e] = INT_MAX - (expert e's first m-block), span[2e + 1] = 1 + its last live position:
// integer maxima, so the result is the same whatever the order. moe_align's layout makes an
// expert's blocks one run; with other routing buffers a span may take in other experts' blocks
// (reads stay in bounds, the gradients are then undefined). Written at block starts and at
// each block's last live row. token[pos] = sorted id / top_k, or -1 for padding (positions below
// num_tokens_post_padded; the GEMMs read no others).
__global__ void __launch_bounds__(kPositionThreads) expert_spans_kernel(const int32_t* __restrict__ sorted_ids,
                                                                    const int32_t* __restrict__ expert_ids,
                                                                    const int32_t* __restrict__ ntpp_ptr, int L,
                                                                    int n_slots, int top_k, int E,
                                                                    int32_t* __restrict__ span,
                                                                    int32_t* __restrict__ token) {
  const int ntpp = gemm::used_length(ntpp_ptr, L);
  for (int pos = blockIdx.x * kPositionThreads + threadIdx.x; pos < ntpp; pos += gridDim.x * kPositionThreads) {
    const int b = pos / gemm::kBM, e = expert_ids[b], sid = sorted_ids[pos];
    const bool live = gemm::live_slot(sid, n_slots);
    token[pos] = live ? sid / top_k : -1;
    if (e < 0 || e >= E) continue;
    if (pos % gemm::kBM == 0) atomicMax(span + 2 * e, INT_MAX - b);
    if (!live) continue;
    if (gemm::ends_live_rows(sorted_ids, pos, ntpp, n_slots)) atomicMax(span + 2 * e + 1, pos + 1);
  }
}

// bpc = 2: CTA pairs, each taking two B tiles of one claim (wgrad::tile_at<true>); with a
// single B tile (K <= 128) every pair's second CTA would idle, so those calls run unpaired.
// The gate/up wgrad is a programmatic dependent launch after the down wgrad: the two touch
// disjoint memory, and what both read was complete before the down wgrad started, so it waits
// for the down wgrad only at its end (so that its completion implies the down wgrad's) and fills
// the SMs the down wgrad's last tiles leave idle (in the static order a CTA's share is fixed: one
// that starts later ends later, by at most about a down-wgrad tile).
template <wgrad::Kind kKind>
cudaError_t launch_wgrad(const wgrad::Maps& tm, const wgrad::Params& p, int bpc, cudaStream_t stream) {
  constexpr int kSmem = wgrad::Plan<kWgradStages>::kLaunchBytes;
  constexpr bool kAfterPrevious = kKind == wgrad::Kind::kGateUpWgrad;
  if (p.b_tiles < 2) bpc = 1;
  const int64_t claims = (int64_t)p.E * p.a_tiles * (bpc == 2 ? (p.b_tiles + 1) / 2 : p.b_tiles);
  if (bpc == 2)
    return host::launch_persistent_tiles(wgrad::moe_wgrad_kernel<kKind, kWgradStages, true>, kSmem, claims,
                                         kAfterPrevious, true, stream, tm, p);
  return host::launch_persistent_tiles(wgrad::moe_wgrad_kernel<kKind, kWgradStages, false>, kSmem, claims,
                                       kAfterPrevious, false, stream, tm, p);
}

}  // namespace

size_t fused_moe_bf16_wgrad_workspace_bytes(int64_t E, int64_t L) { return WgradWorkspace::bytes(E, L); }

cudaError_t fused_moe_bf16_wgrad(const FusedMoeBf16WgradArgs& a, cudaStream_t stream) {
  // The binding's rules, restated for direct callers: a refusal before anything is launched.
  if (a.I <= 0 || a.I % 64 != 0 || a.K <= 0 || a.K % 8 != 0 || a.E <= 0 || !is_routing_length(a.L) || a.M < 0 ||
      (a.bpc != 1 && a.bpc != 2))
    return cudaErrorInvalidValue;
  using host::make_tmap;
  constexpr uint32_t kBox = 64;
  // grad_W2 (E, K, I): A = s*h (L, I), B = grad_out rows. grad_W1, grad_W3 (E, I, K): A = dA|dB
  // (L, 2I), B = x rows.
  wgrad::Maps down{}, gate_up{};
  if (!make_tmap(&down.a, host::row_major(a.sh, a.L, a.I), false, kBox) ||
      !make_tmap(&down.out, host::down_weights(a.grad_w2, a.E, a.K, a.I, 2), false, kBox) ||
      !make_tmap(&gate_up.a, host::row_major(a.dab, a.L, 2 * a.I), false, kBox) ||
      !make_tmap(&gate_up.out, host::expert_rows(a.grad_w1, a.E, a.I, a.K), false, kBox) ||
      !make_tmap(&gate_up.out2, host::expert_rows(a.grad_w3, a.E, a.I, a.K), false, kBox))
    return cudaErrorInvalidValue;

  const WgradWorkspace ws(a.workspace, a.E, a.L);
  cudaError_t err = ws.clear(stream);
  if (err != cudaSuccess) return err;
  const int grid = heuristics::capped_grid(a.L, kPositionThreads, kPositionCtasPerSm);
  expert_spans_kernel<<<grid, kPositionThreads, 0, stream>>>(a.sorted_ids, a.expert_ids, a.ntpp, (int)a.L,
                                                        (int)(a.M * a.top_k), a.top_k, (int)a.E, ws.span, ws.token);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  wgrad::Params p{};
  p.token = ws.token;
  p.E = (int)a.E;
  p.n_b = (int)a.K;
  p.b_tiles = (int)((a.K + wgrad::kTileN - 1) / wgrad::kTileN);
  p.span = ws.span;
  const bool static_order = heuristics::wgrad_static_order(a.M * a.top_k, a.E);

  wgrad::Params p1 = p;
  p1.b_rows = static_cast<const __nv_bfloat16*>(a.grad_out);
  p1.m_a = (int)a.I;
  p1.a_tiles = (int)((a.I + wgrad::kTileM - 1) / wgrad::kTileM);
  p1.tile_counter = static_order ? nullptr : ws.tile_counters;
  if ((err = launch_wgrad<wgrad::Kind::kDownWgrad>(down, p1, a.bpc, stream)) != cudaSuccess) return err;

  wgrad::Params p2 = p;
  p2.b_rows = static_cast<const __nv_bfloat16*>(a.x);
  p2.m_a = (int)(2 * a.I);
  p2.split = (int)a.I;
  p2.a_tiles = (int)((2 * a.I + wgrad::kTileM - 1) / wgrad::kTileM);
  p2.tile_counter = static_order ? nullptr : ws.tile_counters + 1;
  return launch_wgrad<wgrad::Kind::kGateUpWgrad>(gate_up, p2, a.bpc, stream);
}

}  // namespace flash_moe
