// moe_align on the GPU: group flat slot ids t*top_k+k by expert, stable (ascending slot id
// inside each expert), pad every expert's run to a multiple of block_m with the sentinel
// n_slots, one expert id per block, -1 for unused tail blocks. Three launches, no host sync:
//   1. count:   per-chunk expert histograms (+ fill sorted_ids with the sentinel)
//   2. scan:    per-chunk exclusive offsets per expert, padded expert starts, expert_ids, ntpp
//   3. scatter: stable in-chunk ranks (warp match + per-warp counts, fixed order) -> positions
// Ids outside [0, E) (-1 = routed to another rank, or any out-of-range id) are dropped.
#include "flash_moe.cuh"

namespace flash_moe {
namespace {

constexpr int kChunk = 4096;    // slots per chunk (one block each in count/scatter)
constexpr int kThreads = 256;   // threads of count/scatter blocks
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 512;

__global__ void align_count_kernel(const int32_t* __restrict__ ids, int64_t n, int E,
                                   int32_t* __restrict__ sorted_ids, int64_t sorted_len,
                                   int32_t sentinel, int32_t* __restrict__ hist) {
  __shared__ int32_t h[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t base = (int64_t)blockIdx.x * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    const int64_t s = base + i;
    if (s < n) {
      const int e = ids[s];
      if (e >= 0 && e < E) atomicAdd(&h[e], 1);  // integer counts: order-independent
    }
  }
  // sentinel fill of the whole output buffer (grid-stride); the scatter launch overwrites
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < sorted_len;
       i += (int64_t)gridDim.x * blockDim.x)
    sorted_ids[i] = sentinel;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(int64_t)blockIdx.x * E + e] = h[e];
}

__global__ void align_scan_kernel(int32_t* __restrict__ hist, int nchunks, int E, int block_m,
                                  int32_t* __restrict__ start, int32_t* __restrict__ expert_ids,
                                  int64_t nblocks, int32_t* __restrict__ ntpp) {
  __shared__ int32_t padded[kScanThreads];
  __shared__ int32_t total_s;
  const int e = threadIdx.x;
  int32_t cnt = 0;
  if (e < E) {
    for (int c = 0; c < nchunks; ++c) {
      const int32_t v = hist[(int64_t)c * E + e];
      hist[(int64_t)c * E + e] = cnt;  // exclusive prefix over chunks
      cnt += v;
    }
  }
  const int32_t pad = (e < E) ? (cnt + block_m - 1) / block_m * block_m : 0;
  padded[e] = pad;
  __syncthreads();
  // Hillis-Steele inclusive scan over experts (E <= 512)
  for (int off = 1; off < kScanThreads; off <<= 1) {
    const int32_t v = (e >= off) ? padded[e - off] : 0;
    __syncthreads();
    padded[e] += v;
    __syncthreads();
  }
  const int32_t st = padded[e] - pad;  // exclusive start
  if (e < E) {
    start[e] = st;
    for (int32_t b = st / block_m; b < (st + pad) / block_m; ++b) expert_ids[b] = e;
  }
  if (e == kScanThreads - 1) {
    total_s = padded[e];
    ntpp[0] = padded[e];
  }
  __syncthreads();
  for (int64_t b = total_s / block_m + threadIdx.x; b < nblocks; b += blockDim.x) expert_ids[b] = -1;
}

__global__ void align_scatter_kernel(const int32_t* __restrict__ ids, int64_t n, int E,
                                     const int32_t* __restrict__ hist,
                                     const int32_t* __restrict__ start,
                                     int32_t* __restrict__ sorted_ids) {
  __shared__ int32_t running[kMaxExperts];
  __shared__ int32_t wcnt[kWarps][kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    running[e] = start[e] + hist[(int64_t)blockIdx.x * E + e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) wcnt[w][e] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = (int64_t)blockIdx.x * kChunk;
  for (int r = 0; r < kChunk; r += kThreads) {
    const int64_t s = base + r + threadIdx.x;
    int e = -1;
    if (s < n) {
      e = ids[s];
      if (e < 0 || e >= E) e = -1;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int lower = __popc(peers & ((1u << lane) - 1u));
    const bool leader = lower == 0;
    if (e >= 0 && leader) wcnt[warp][e] = __popc(peers);
    __syncthreads();
    bool last = false;
    int32_t total = 0;
    if (e >= 0) {
      int32_t before = 0;
      for (int w = 0; w < warp; ++w) before += wcnt[w][e];
      total = before;
      for (int w = warp; w < kWarps; ++w) total += wcnt[w][e];
      const int32_t rank = before + lower;
      sorted_ids[running[e] + rank] = (int32_t)s;
      last = (rank == total - 1);
    }
    __syncthreads();
    if (last) running[e] += total;
    if (e >= 0 && leader) wcnt[warp][e] = 0;
    __syncthreads();
  }
}

}  // namespace

int64_t moe_align_workspace_ints(int64_t n_slots, int num_experts) {
  const int64_t nchunks = (n_slots + kChunk - 1) / kChunk;
  return (nchunks > 0 ? nchunks : 1) * num_experts + num_experts;
}

cudaError_t moe_align(const int32_t* topk_ids, int64_t n_slots, int num_experts, int block_m,
                      int32_t* sorted_ids, int64_t sorted_len, int32_t* expert_ids, int32_t* ntpp,
                      int32_t* workspace, cudaStream_t stream) {
  if (num_experts <= 0 || num_experts > kMaxExperts || block_m <= 0 || sorted_len % block_m != 0)
    return cudaErrorInvalidValue;
  const int64_t nchunks = (n_slots + kChunk - 1) / kChunk;
  const int grid = (int)(nchunks > 0 ? nchunks : 1);
  int32_t* hist = workspace;
  int32_t* start = workspace + (int64_t)grid * num_experts;
  align_count_kernel<<<grid, kThreads, 0, stream>>>(topk_ids, n_slots, num_experts, sorted_ids,
                                                   sorted_len, (int32_t)n_slots, hist);
  align_scan_kernel<<<1, kScanThreads, 0, stream>>>(hist, grid, num_experts, block_m, start,
                                                   expert_ids, sorted_len / block_m, ntpp);
  if (n_slots > 0)
    align_scatter_kernel<<<grid, kThreads, 0, stream>>>(topk_ids, n_slots, num_experts, hist,
                                                       start, sorted_ids);
  return cudaGetLastError();
}

}  // namespace flash_moe
