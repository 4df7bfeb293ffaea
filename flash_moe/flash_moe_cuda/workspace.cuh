// The device workspace of one fused MoE call: one table of regions, in order, each 256-byte
// aligned, that both sizes the allocation (the binding asks for `total`) and carves it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moe_gemm_schedule.cuh"

namespace flash_moe {

// Counters (int32), zeroed per call: the two GEMMs' tile counters, the scale window's misfit
// flag (MXFP8), then h_done per m-block (gemm::HandOff), then block_live per m-block
// (inverse_kernel).
constexpr int kTileCounterInts = 2;
constexpr int kCounterHeaderInts = kTileCounterInts + 1;  // + the misfit flag

// Offsets of consecutive regions, each 256-byte aligned; offset[N] is the total.
template <int N>
struct RegionTable {
  size_t offset[N + 1];
  explicit RegionTable(const size_t (&bytes)[N]) {
    size_t at = 0;
    for (int r = 0; r < N; ++r) {
      offset[r] = at;
      at += (bytes[r] + 255) / 256 * 256;
    }
    offset[N] = at;
  }
};

struct WorkspaceLayout {
  enum Region {
    kH,         // h (L, I) bf16: the gate/up GEMM's output
    kY,         // Y (L, K) bf16: the down GEMM's weighted rows
    kInv,       // inv (M * top_k) int32: each slot's sorted position
    kCounters,  // the counters above
    kUnits,     // CTA pairs: units (int2, one per m-block at most) and their count
    kX16,       // MXFP8 only: x as bf16 or f16 (M, K), K-permuted
    kWTop,      // MXFP8 only: the scale window's top byte per weight row (E * 2I)
    kXTop,      // MXFP8 only: ... and per token (M)
    kRegions
  };
  static int64_t blocks(int64_t L) { return (L + gemm::kBM - 1) / gemm::kBM; }
  static int64_t counter_ints(int64_t L) { return kCounterHeaderInts + 2 * blocks(L); }

  RegionTable<kRegions> table;

  // mx_w_rows: the MXFP8 op's weight rows E * 2I; 0 for the bf16 op (its MXFP8 regions are empty).
  WorkspaceLayout(int64_t M, int64_t K, int64_t I, int64_t L, int top_k, int64_t mx_w_rows)
      : table({(size_t)(L * I * 2), (size_t)(L * K * 2), (size_t)(M * top_k * 4), (size_t)counter_ints(L) * 4,
               (size_t)(2 * blocks(L) + 1) * 4, mx_w_rows > 0 ? (size_t)(M * K * 2) : 0, (size_t)mx_w_rows,
               mx_w_rows > 0 ? (size_t)M : 0}) {}
  size_t total() const { return table.offset[kRegions]; }
};

struct Workspace {
  __nv_bfloat16* h;
  __nv_bfloat16* Y;
  int32_t* inv;
  int32_t* tile_counters;
  int32_t* h_done;
  int32_t* block_live;
  int2* units;
  int32_t* num_units;
  void* x16 = nullptr;
  uint32_t* window_misfit = nullptr;
  uint8_t* w_top = nullptr;
  uint8_t* x_top = nullptr;
  int64_t n_slots;
  int64_t counter_ints;

  Workspace(void* base, int64_t M, int64_t K, int64_t I, int64_t L, int top_k, int64_t mx_w_rows)
      : n_slots(M * top_k), counter_ints(WorkspaceLayout::counter_ints(L)) {
    using R = WorkspaceLayout;
    const R layout(M, K, I, L, top_k, mx_w_rows);
    uint8_t* const b = static_cast<uint8_t*>(base);
    h = reinterpret_cast<__nv_bfloat16*>(b + layout.table.offset[R::kH]);
    Y = reinterpret_cast<__nv_bfloat16*>(b + layout.table.offset[R::kY]);
    inv = reinterpret_cast<int32_t*>(b + layout.table.offset[R::kInv]);
    tile_counters = reinterpret_cast<int32_t*>(b + layout.table.offset[R::kCounters]);
    window_misfit = reinterpret_cast<uint32_t*>(tile_counters + kTileCounterInts);
    h_done = tile_counters + kCounterHeaderInts;
    block_live = h_done + R::blocks(L);
    units = reinterpret_cast<int2*>(b + layout.table.offset[R::kUnits]);
    num_units = reinterpret_cast<int32_t*>(units + R::blocks(L));
    if (mx_w_rows > 0) {
      x16 = b + layout.table.offset[R::kX16];
      w_top = b + layout.table.offset[R::kWTop];
      x_top = b + layout.table.offset[R::kXTop];
    }
  }
  // Before the GEMMs: inv = -1 (no position), counters = 0.
  cudaError_t clear(cudaStream_t stream) const {
    cudaError_t err = cudaMemsetAsync(inv, 0xFF, (size_t)n_slots * 4, stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(tile_counters, 0, (size_t)counter_ints * 4, stream);
  }
};

}  // namespace flash_moe
