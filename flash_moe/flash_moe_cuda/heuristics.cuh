// flash_moe's launch geometry: the grid sizes and pipeline depths the host picks (evidence:
// flash_moe/DESIGN.md §5). A block size that a kernel's indexing is written for (moe_align's
// count/place blocks, the MXFP8 conversions, pair_units_kernel's block scan) stays beside that
// kernel. The GEMMs are persistent: a CTA per SM, or a cluster per SM pair with CTA pairs
// (host::launch_persistent). The one rule chosen per call, bpc (CTA pairs or not), is Python's
// `preferred_bpc` (torch-ext/flash_moe/__init__.py): it is the tuning argument the caller
// passes, bpc=None taking it.
#pragma once

#include <cstdint>

#include "flash_moe.cuh"

namespace flash_moe {
namespace heuristics {

// Grid-stride kernels over `items`, `threads` per CTA: one item per thread, at most `per_sm`
// CTAs per SM (the loop covers the rest).
inline int capped_grid(int64_t items, int threads, int per_sm) {
  const int64_t want = (items + threads - 1) / threads, cap = (int64_t)sm_count() * per_sm;
  return (int)(want < cap ? want : cap);
}

// Grid-stride kernels with a slot or a sorted position per thread (inverse_kernel,
// score_sum_kernel, expert_spans_kernel).
constexpr int kPositionThreads = 256, kPositionCtasPerSm = 4;
// The top-k reduce and the dequantize kernels: enough CTAs to keep every SM's load queue full.
constexpr int kReduceThreads = 256, kReduceCtasPerSm = 16;
constexpr int kConvertCtasPerSm = 16;
// The backward's GEMMs: four stages, the most that fit beside their epilogue boxes (the dgrad's
// SmemPlan, the wgrad's 48 KB stages: wgrad::Plan).
constexpr int kDgradStages = 4, kWgradStages = 4;
// The wgrads' tile order (moe_wgrad.cuh): static where the experts average 4 k-blocks (256 rows) or
// more, else claimed from a counter. Against the counter (flash_moe/DESIGN.md §8.1 (j)): the wgrad
// op -0.6 to -3.7 % at 512 rows an expert, level at 1024-2048, +2 % at 64 if static there (one or
// two k-blocks a tile: a fixed share leaves CTAs unevenly loaded); 128-256 rows are unmeasured.
inline bool wgrad_static_order(int64_t slots, int64_t E) { return slots >= 4 * 64 * E; }

}  // namespace heuristics
}  // namespace flash_moe
