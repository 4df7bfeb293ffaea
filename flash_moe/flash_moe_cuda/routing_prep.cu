// Routing preparation for the fused GEMMs, after moe_align and before the GEMMs (both read only
// the routing buffers): each slot's position in sorted_ids and each m-block's live rows
// (inverse_kernel), and for CTA pairs (bpc = 2) the list of work units (pair_units_kernel).
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "flash_moe.cuh"
#include "heuristics.cuh"
#include "moe_gemm_schedule.cuh"

namespace flash_moe {
namespace {

// inv[slot] = position of slot in sorted_ids (only for valid slots in valid blocks), and
// block_live[b] = the live rows of m-block b (zeroed before): written by the block's last live
// row, the one followed by padding or the block's end (moe_align puts the padding after the
// live rows; with other buffers the value is some live row's offset + 1, in [1, kBlockM]).
__global__ void inverse_kernel(const int32_t* __restrict__ sorted_ids, const int32_t* __restrict__ expert_ids,
                               const int32_t* __restrict__ ntpp_ptr, int L, int n_slots, int E,
                               int32_t* __restrict__ inv, int32_t* __restrict__ block_live) {
  const int ntpp = gemm::used_length(ntpp_ptr, L);
  for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < ntpp; pos += gridDim.x * blockDim.x) {
    const int sid = sorted_ids[pos];
    const int e = expert_ids[pos / kBlockM];
    if (!gemm::live_slot(sid, n_slots) || e < 0 || e >= E) continue;
    inv[sid] = pos;
    if (gemm::ends_live_rows(sorted_ids, pos, ntpp, n_slots)) block_live[pos / kBlockM] = pos % kBlockM + 1;
  }
}

// ---------------------------------------------------------------- CTA-pair units (bpc = 2)
// One block: the units of gemm::claim_pair in m-block order. Within each run of m-blocks of one
// valid expert, the blocks at even offsets from the run's start lead: a pair (two units) when
// the next block is of the same expert, else a lone block (one unit). Blocks of invalid experts
// are in no unit (the GEMMs skip them, as without pairs). A pair's units carry the rows of its
// two CTAs' parts (gemm::unit_rows).
constexpr int kUnitThreads = 1024;
struct MaxOp {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
__global__ void __launch_bounds__(kUnitThreads) pair_units_kernel(const int32_t* __restrict__ expert_ids,
                                                                  const int32_t* __restrict__ ntpp_ptr, int L, int E,
                                                                  int2* __restrict__ units,
                                                                  int32_t* __restrict__ num_units,
                                                                  const int32_t* __restrict__ block_live) {
  using Scan = cub::BlockScan<int, kUnitThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int carry[2];  // the last block's run start, units so far
  const int ntpp = gemm::used_length(ntpp_ptr, L);
  const int num_m = (ntpp + gemm::kBM - 1) / gemm::kBM;
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (int base = 0; base < num_m; base += kUnitThreads) {
    const int mb = base + threadIdx.x;
    const bool in = mb < num_m;
    const int e = in ? expert_ids[mb] : -1;
    const bool starts = in && (mb == 0 || expert_ids[mb - 1] != e);
    int run_start;
    Scan(scan_tmp).InclusiveScan(starts ? mb : carry[0], run_start, MaxOp{});
    __syncthreads();
    const bool leads = in && e >= 0 && e < E && ((mb - run_start) & 1) == 0;
    const auto same = [&](int b) { return b < num_m && expert_ids[b] == e; };
    // Fitting (block_live given, inverse_kernel's live rows per block): an expert's last block
    // with at most kTailRows live rows, after a pair of its blocks, is computed by that pair's
    // tiles and gets no unit of its own; and a pair's live rows are split evenly between its two
    // CTAs (parts of at most kMaxRows rows, multiples of 8). Without: each CTA one block.
    const bool fit = block_live != nullptr;
    const auto live_rows = [&](int b) { return block_live[b]; };
    const auto short_tail = [&](int b) { return block_live[b] <= gemm::kTailRows; };
    const bool alone = !same(mb + 1);
    const bool carries = fit && leads && !alone && same(mb + 2) && !same(mb + 3) && short_tail(mb + 2);
    const bool carried = fit && leads && alone && mb - run_start >= 2 && short_tail(mb);
    int idx, added;
    Scan(scan_tmp).ExclusiveSum(leads && !carried ? (alone ? 1 : 2) : 0, idx, added);
    idx += carry[1];
    if (leads && alone && !carried) units[idx] = make_int2(mb | gemm::kUnitAlone, 0);
    if (leads && !alone) {
      int rows = gemm::unit_rows(gemm::kBM, gemm::kBM);
      if (fit) {
        // The rows of block mb are live (it is not the expert's last); the parts stay inside
        // the pair's blocks whatever the counts (user-made routing buffers included).
        int n = gemm::kBM + live_rows(mb + 1) + (carries ? live_rows(mb + 2) : 0);
        const int most = carries ? 2 * gemm::kMaxRows : 2 * gemm::kBM;
        n = n < most ? n : most;
        const int rows0 = ((n + 1) / 2 + 7) & ~7;
        rows = gemm::unit_rows(rows0, (n - rows0 + 7) & ~7);
      }
      units[idx] = make_int2(mb, rows);
      units[idx + 1] = make_int2(mb | gemm::kUnitSecondHalf, rows);
    }
    __syncthreads();
    if (threadIdx.x == kUnitThreads - 1) carry[0] = run_start, carry[1] += added;
    __syncthreads();
  }
  if (threadIdx.x == 0) *num_units = carry[1];
}

}  // namespace

cudaError_t slot_positions(const int32_t* sorted_ids, const int32_t* expert_ids, const int32_t* ntpp, int64_t L,
                           int64_t n_slots, int64_t E, int32_t* inv, int32_t* block_live, cudaStream_t stream) {
  if (L == 0) return cudaSuccess;
  using namespace heuristics;
  inverse_kernel<<<capped_grid(L, kPositionThreads, kPositionCtasPerSm), kPositionThreads, 0, stream>>>(
      sorted_ids, expert_ids, ntpp, (int)L, (int)n_slots, (int)E, inv, block_live);
  return cudaGetLastError();
}

cudaError_t pair_units(const int32_t* expert_ids, const int32_t* ntpp, int64_t L, int64_t E,
                       const int32_t* block_live, int2* units, int32_t* num_units, cudaStream_t stream) {
  pair_units_kernel<<<1, kUnitThreads, 0, stream>>>(expert_ids, ntpp, (int)L, (int)E, units, num_units, block_live);
  return cudaGetLastError();
}

}  // namespace flash_moe
