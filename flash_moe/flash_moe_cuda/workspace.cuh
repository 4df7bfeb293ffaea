// The device workspaces of the fused MoE ops (forward, dgrad, wgrad): each one table of regions,
// in order, each 256-byte aligned, that both sizes the allocation (the binding asks for its bytes)
// and carves it.
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

// What the forward's and the dgrad's launches share: each slot's position (inv), the counters
// (tile counters and a header, then h_done and block_live per m-block), the CTA pairs' units.
struct RoutingRegions {
  int32_t* inv;
  int32_t* tile_counters;
  int32_t* h_done;
  int32_t* block_live;
  int2* units;
  int32_t* num_units;
  int64_t n_slots;
  int64_t n_counters;  // the header and both per-m-block arrays

  RoutingRegions(uint8_t* inv_at, uint8_t* counters_at, uint8_t* units_at, int64_t slots, int header_ints,
                 int64_t L)
      : n_slots(slots), n_counters(header_ints + 2 * WorkspaceLayout::blocks(L)) {
    inv = reinterpret_cast<int32_t*>(inv_at);
    tile_counters = reinterpret_cast<int32_t*>(counters_at);
    h_done = tile_counters + header_ints;
    block_live = h_done + WorkspaceLayout::blocks(L);
    units = reinterpret_cast<int2*>(units_at);
    num_units = reinterpret_cast<int32_t*>(units + WorkspaceLayout::blocks(L));
  }
  // Before the GEMMs: inv = -1 (no position), counters = 0.
  cudaError_t clear(cudaStream_t stream) const {
    cudaError_t err = cudaMemsetAsync(inv, 0xFF, (size_t)n_slots * 4, stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(tile_counters, 0, (size_t)n_counters * 4, stream);
  }
};

struct Workspace : RoutingRegions {
  __nv_bfloat16* h;
  __nv_bfloat16* Y;
  void* x16 = nullptr;
  uint32_t* window_misfit;
  uint8_t* w_top = nullptr;
  uint8_t* x_top = nullptr;

  Workspace(void* base, int64_t M, int64_t K, int64_t I, int64_t L, int top_k, int64_t mx_w_rows)
      : Workspace(static_cast<uint8_t*>(base), WorkspaceLayout(M, K, I, L, top_k, mx_w_rows).table, M * top_k, L,
                  mx_w_rows > 0) {}

 private:
  using R = WorkspaceLayout;
  Workspace(uint8_t* b, const RegionTable<R::kRegions>& t, int64_t n_slots, int64_t L, bool mxfp8)
      : RoutingRegions(b + t.offset[R::kInv], b + t.offset[R::kCounters], b + t.offset[R::kUnits], n_slots,
                       kCounterHeaderInts, L) {
    h = reinterpret_cast<__nv_bfloat16*>(b + t.offset[R::kH]);
    Y = reinterpret_cast<__nv_bfloat16*>(b + t.offset[R::kY]);
    window_misfit = reinterpret_cast<uint32_t*>(tile_counters + kTileCounterInts);
    if (mxfp8) {
      x16 = b + t.offset[R::kX16];
      w_top = b + t.offset[R::kWTop];
      x_top = b + t.offset[R::kXTop];
    }
  }
};

// fused_moe_bf16_dgrad's: dx slots (L, K) bf16; the score partials; inv; the counters (the two
// tile counters, then h_done and block_live per m-block: slot_positions writes block_live, and the
// GEMMs' HandOff, unused here, needs its h_done); the CTA pairs' units, as the forward's.
struct DgradWorkspace : RoutingRegions {
  enum Region { kDx, kScorePart, kInv, kCounters, kUnits, kRegions };
  // Score partials per position: 2 consumer warpgroups x 2 blocks x 4 warps per 256-feature n-block.
  static int64_t score_parts(int64_t I) { return 16 * ((I + 255) / 256); }
  static int64_t counter_ints(int64_t L) { return kTileCounterInts + 2 * WorkspaceLayout::blocks(L); }
  static RegionTable<kRegions> table(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
    const int64_t blocks = WorkspaceLayout::blocks(L);
    return RegionTable<kRegions>({(size_t)(L * K * 2), (size_t)(score_parts(I) * L * 4), (size_t)(M * top_k * 4),
                                  (size_t)counter_ints(L) * 4, (size_t)(2 * blocks + 1) * 4});
  }
  static size_t bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
    return table(M, K, I, L, top_k).offset[kRegions];
  }

  __nv_bfloat16* dx;
  float* score_part;

  DgradWorkspace(void* base, int64_t M, int64_t K, int64_t I, int64_t L, int top_k)
      : DgradWorkspace(static_cast<uint8_t*>(base), table(M, K, I, L, top_k), M * top_k, L) {}

 private:
  DgradWorkspace(uint8_t* b, const RegionTable<kRegions>& t, int64_t n_slots, int64_t L)
      : RoutingRegions(b + t.offset[kInv], b + t.offset[kCounters], b + t.offset[kUnits], n_slots,
                       kTileCounterInts, L) {
    dx = reinterpret_cast<__nv_bfloat16*>(b + t.offset[kDx]);
    score_part = reinterpret_cast<float*>(b + t.offset[kScorePart]);
  }
};

// fused_moe_bf16_wgrad's (int32): the two GEMMs' tile counters and per expert its span (two ints,
// expert_spans_kernel's maxima), zeroed per call; then the token of each sorted position.
struct WgradWorkspace {
  enum Region { kCounters, kToken, kRegions };
  static int64_t counter_ints(int64_t E) { return kTileCounterInts + 2 * E; }
  static RegionTable<kRegions> table(int64_t E, int64_t L) {
    return RegionTable<kRegions>({(size_t)counter_ints(E) * 4, (size_t)L * 4});
  }
  static size_t bytes(int64_t E, int64_t L) { return table(E, L).offset[kRegions]; }

  int32_t* tile_counters;  // [0]: the down wgrad's, [1]: the gate/up wgrad's
  int32_t* span;           // (E, 2)
  int32_t* token;          // (L,)
  int64_t n_counters;

  WgradWorkspace(void* base, int64_t E, int64_t L) : n_counters(counter_ints(E)) {
    const RegionTable<kRegions> t = table(E, L);
    uint8_t* const b = static_cast<uint8_t*>(base);
    tile_counters = reinterpret_cast<int32_t*>(b + t.offset[kCounters]);
    span = tile_counters + kTileCounterInts;
    token = reinterpret_cast<int32_t*>(b + t.offset[kToken]);
  }
  cudaError_t clear(cudaStream_t stream) const {
    return cudaMemsetAsync(tile_counters, 0, (size_t)n_counters * 4, stream);
  }
};

}  // namespace flash_moe
