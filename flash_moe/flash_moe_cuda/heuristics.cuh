// flash_moe's launch-geometry rules, in one place (evidence: flash_moe/DESIGN.md §5). The GEMMs
// are persistent: a CTA per SM, or a cluster per SM pair with CTA pairs (host::launch_persistent).
// The one rule chosen per call, bpc (CTA pairs or not), is Python's `preferred_bpc`
// (torch-ext/flash_moe/__init__.py): it is the tuning argument the caller passes, bpc=None
// taking it.
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

constexpr int kInverseThreads = 256, kInverseCtasPerSm = 4;  // inverse_kernel: a slot per thread
// The top-k reduce and the dequantize kernels: enough CTAs to keep every SM's load queue full.
constexpr int kReduceThreads = 256, kReduceCtasPerSm = 16;
constexpr int kConvertCtasPerSm = 16;

}  // namespace heuristics
}  // namespace flash_moe
