// The grouped GEMM kernel of the forward (gate/up, down) and the backward's data gradients
// (kDownDgrad, kGateUpDgrad; Hopper, sm_90a): it wires one producer and one consumer role per
// weight format. The roles, a header each:
//
//   moe_gemm_schedule.cuh        parameters; tiles claimed in order from a global counter
//                                (TileOrder, claim_tile; claim_pair for CTA pairs) and handed
//                                over in TileSlots; the per-m-block h handoff from the gate/up
//                                to the down GEMM (HandOff)
//   moe_gemm_stages.cuh          what a shared-memory stage holds (SmemPlan, Mxfp8Plan) and
//                                the stage ring's mbarriers
//   moe_gemm_producer.cuh        token rows gathered from x (cp.async) or h rows (TMA); weights
//                                as bf16 boxes (TMA) or e4m3 boxes + blocked scales (TMA + bulk)
//   moe_gemm_consumer.cuh        bf16: two warpgroups, weights as M (two m64 blocks each),
//                                tokens as N (the tile's live rows, up to 144), fp32 accumulators
//   moe_gemm_epilogue.cuh        bf16: SwiGLU, and the output boxes staged in shared memory
//                                for TMA stores (stmatrix .trans)
//   moe_gemm_epilogue_dgrad.cuh  kDownDgrad: the SwiGLU backward, score partials, r*h; the
//                                forward's pre-activation store (training)
//   moe_gemm_consumer_mxfp8.cuh  MXFP8: weights dequantized in registers, stores from registers
//   moe_gemm_epilogue_mxfp8.cuh  MXFP8: its h and Y stores
//
// The weight gradients are a kernel of their own (moe_wgrad.cuh): both operands MN-major, the
// token rows on wgmma's N side gathered per stage.
//
// Both formats put the weights on wgmma's M side and the tokens on N: tiles of 128 tokens x
// 256 weight rows (128 gate + 128 up rows, or 256 output features) x 64. bf16
// (moe_gemm_kernel<Weights::kBf16>): both operands from shared memory, wgmma's N fitted to a
// tile's live tokens (up to 144 for a CTA pair's part of an expert's rows). MXFP8
// (Weights::kMxfp8): the e4m3 weights are dequantized in registers into wgmma's register
// operand.
// One producer warpgroup and two consumer warpgroups share a kStages-deep ring of shared-memory
// stages guarded by mbarriers.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "moe_gemm_consumer.cuh"
#include "moe_gemm_consumer_mxfp8.cuh"
#include "moe_gemm_producer.cuh"

namespace flash_moe {
namespace gemm {

// ---------------------------------------------------------------- kernel
// kMxfp8Window: the MXFP8 gate/up GEMM with f16 operands, for calls whose weight and token rows
// all fit the f16 scale window (mx::kWindow); its kDown is kMxfp8's. kMxfp8 and kMxfp8Window
// gate/up kernels are both launched; GemmParams::window_misfit makes one return at once.
enum class Weights { kBf16, kMxfp8, kMxfp8Window };

template <Weights kW, int kStages>
using StagePlan = std::conditional_t<kW == Weights::kBf16, SmemPlan<kStages>, Mxfp8Plan<kStages>>;

// The TMA tensor maps a GEMM kernel reads, one struct per weight format. The gate/up GEMM
// gathers its token rows with cp.async, so it reads no `tokens` map (nor `tokens_tail`).
struct Bf16Maps {
  CUtensorMap tokens;       // kDown: h rows, kBM-row boxes
  CUtensorMap tokens_tail;  // kDown: h rows kBM.. of a longer tile, (kMaxRows - kBM)-row boxes
  CUtensorMap weights;      // w (gate/up) or w2 (down), 128-row boxes
  CUtensorMap out;          // h or Y, the epilogue's 64 x 64 store boxes (kDownDgrad: dA|dB, 32 x 64)
  CUtensorMap out_rows;     // the same, kStoreRows-row boxes: output boxes with fewer live tokens
  CUtensorMap weights2;     // w3, `weights` being w1: kGateUp (box 1), kGateUpDgrad (reduction rows b_second..)
  CUtensorMap out2;         // kDownDgrad: s*h, 32-row x 64 boxes (kDgradStoreRows)
};
struct Mxfp8Maps {          // the MXFP8 epilogues store from registers: no output maps
  CUtensorMap tokens;       // kDown: h rows
  CUtensorMap weights;      // e4m3 w or w2, 128-row boxes
};
template <Weights kW>
using GemmMaps = std::conditional_t<kW == Weights::kBf16, Bf16Maps, Mxfp8Maps>;

// kPaired: launched in clusters of 2 CTAs (bpc = 2) that walk the same units in step; see Tile's
// kMulticast / kIdle, TileSlots and Barriers::release for what the pair shares.
template <Weights kW, Kind kKind, int kStages, bool kPaired = false>
__global__ void __launch_bounds__(kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ GemmMaps<kW> tm, const GemmParams p) {
  using Plan = StagePlan<kW, kStages>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  const uint32_t rank = kPaired ? cluster_ctarank() : 0;
  Barriers<kStages> bars{sbase + Plan::kBarOffset};
  if (kPaired) bars.peer = peer_smem(bars.base, rank ^ 1);
  TileSlots slots(sbase + Plan::kSlotOffset, kStages, rank, kPaired);
  const int nk = (p.K + kBK - 1) / kBK;  // k-blocks per tile: stages each tile takes
  if constexpr (kW != Weights::kBf16 && kKind == Kind::kGateUp)
    if ((*p.mx.window_misfit == 0u) != (kW == Weights::kMxfp8Window)) return;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bars.full(s), full_arrivals<kKind, kW != Weights::kBf16>());
      mbar_init(bars.empty(s), Barriers<kStages>::empty_arrivals(kPaired));  // one arrive per consumer warp
    }
    slots.init_barriers();
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // A pair's CTAs arrive on and load into each other's barriers and stages: both must be set up.
  if (kPaired)
    cluster_sync();
  else
    __syncthreads();
  // The next kernel (the down GEMM after the gate/up GEMM, the top-k sum after the down GEMM)
  // may start its CTAs as soon as SMs free up; HandOff and griddep_wait keep its reads correct.
  griddep_launch_dependents();

  // Register rebalancing: the CTA holds 168 x 384 registers; what the producer gives up
  // (168 - 56) x 128 covers what the consumers take (224 - 168) x 256 (if it did not,
  // setmaxnreg.inc would wait forever).
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if constexpr (kW == Weights::kBf16)
      produce_bf16<kKind, kStages>(tm, p, sbase, bars, slots, nk);
    else
      produce_mxfp8<kKind, kStages>(tm.tokens, tm.weights, p, sbase, bars, slots, nk);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    if constexpr (kW == Weights::kBf16)
      consume_bf16<kKind, kStages>(&tm.out, &tm.out_rows, &tm.out2, p, sbase, bars, slots, nk);
    else
      consume_mxfp8<kKind, kStages, kW == Weights::kMxfp8Window ? RsType::kF16 : RsType::kBf16>(p, sbase, bars,
                                                                                               slots, nk);
  }
  // No CTA of a pair leaves while its peer may still arrive on its barriers.
  if (kPaired) cluster_sync();
}

}  // namespace gemm
}  // namespace flash_moe
