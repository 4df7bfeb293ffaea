// moe_align on the GPU: group flat slot ids t*top_k+k by expert, stable (ascending slot id
// inside each expert), pad every expert's run to a multiple of block_m with the sentinel
// n_slots, one expert id per block, -1 for unused tail blocks. Two launches, no host sync:
//   1. count: per-chunk expert histograms (+ fill sorted_ids with the sentinel)
//   2. place: each chunk's CTA sums the histograms itself (its chunk's offset per expert and
//      every expert's total), scans the padded totals into expert starts (CTA 0 also writes
//      expert_ids and ntpp), then stable in-chunk ranks (warp match + per-warp counts, fixed
//      order) -> positions
// Ids outside [0, E) (-1 = routed to another rank, or any out-of-range id) are dropped.
// Chunks are small so that many CTAs share the work: the place loop is a few rounds of 256
// slots per CTA, and summing up to a few hundred histogram rows per CTA is cheaper than a
// separate scan launch (three launches with 4096-slot chunks took 29-33 us at the issue
// shapes on the H200, these two 13-17 us). Every CTA sums every chunk's histogram, so the
// chunk count is capped (kMaxChunks): beyond 256K slots the chunks grow instead, and the
// histogram reads stay linear in the slot count.
#include "flash_moe.cuh"

namespace flash_moe {
namespace {

constexpr int kMinChunk = 1024;  // slots per chunk (one block each in count/place), at least
constexpr int kMaxChunks = 256;
constexpr int kThreads = 256;    // threads of count/place blocks
constexpr int kWarps = kThreads / 32;
constexpr int kExpertsPerThread = kMaxExperts / kThreads;

// Slots per chunk for n slots: kMinChunk, or more (a multiple of kThreads) to stay within kMaxChunks.
int64_t chunk_slots(int64_t n) {
  const int64_t c = (n + kMaxChunks - 1) / kMaxChunks;
  return c <= kMinChunk ? kMinChunk : (c + kThreads - 1) / kThreads * kThreads;
}

__global__ void align_count_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t chunk, int E,
                                   int32_t* __restrict__ sorted_ids, int64_t sorted_len,
                                   int32_t sentinel, int32_t* __restrict__ hist) {
  __shared__ int32_t h[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t base = (int64_t)blockIdx.x * chunk;
  for (int64_t i = threadIdx.x; i < chunk; i += blockDim.x) {
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

// Every expert's padded start (exclusive scan over experts of the padded totals) and this
// chunk's offset inside each expert's run, from the histograms of all chunks. Thread t owns
// experts t * kExpertsPerThread + j. CTA 0 writes expert_ids and ntpp.
__device__ void expert_starts(const int32_t* __restrict__ hist, int nchunks, int E, int block_m,
                              int32_t* __restrict__ expert_ids, int64_t nblocks, int32_t* __restrict__ ntpp,
                              int32_t* running /* shared, out: start + chunk offset */) {
  __shared__ int32_t warp_sums[kWarps];
  int32_t total[kExpertsPerThread], before[kExpertsPerThread], pad[kExpertsPerThread];
  int32_t mine = 0;  // sum of this thread's padded totals
#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    const int e = threadIdx.x * kExpertsPerThread + j;
    total[j] = 0;
    before[j] = 0;
    if (e < E) {
#pragma unroll 8
      for (int c = 0; c < nchunks; ++c) {
        const int32_t v = hist[(int64_t)c * E + e];
        total[j] += v;
        before[j] += c < (int)blockIdx.x ? v : 0;
      }
    }
    pad[j] = (total[j] + block_m - 1) / block_m * block_m;
    mine += pad[j];
  }
  // exclusive scan of `mine` over the block: warp shuffles, then the warps' sums
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t incl = mine;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int32_t warp_base = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    warp_base += w < warp ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  int32_t st = warp_base + incl - mine;
#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    const int e = threadIdx.x * kExpertsPerThread + j;
    if (e < E) {
      running[e] = st + before[j];
      if (blockIdx.x == 0)
        for (int32_t b = st / block_m; b < (st + pad[j]) / block_m; ++b) expert_ids[b] = e;
    }
    st += pad[j];
  }
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) ntpp[0] = all;
    for (int64_t b = all / block_m + threadIdx.x; b < nblocks; b += blockDim.x) expert_ids[b] = -1;
  }
}

__global__ void align_place_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t chunk, int E, int block_m,
                                   const int32_t* __restrict__ hist, int nchunks,
                                   int32_t* __restrict__ expert_ids, int64_t nblocks, int32_t* __restrict__ ntpp,
                                   int32_t* __restrict__ sorted_ids) {
  __shared__ int32_t running[kMaxExperts];
  __shared__ int32_t wcnt[kWarps][kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) wcnt[w][e] = 0;
  expert_starts(hist, nchunks, E, block_m, expert_ids, nblocks, ntpp, running);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = (int64_t)blockIdx.x * chunk;
  for (int64_t r = 0; r < chunk && base + r < n; r += kThreads) {
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
  const int64_t chunk = chunk_slots(n_slots), nchunks = (n_slots + chunk - 1) / chunk;
  return (nchunks > 0 ? nchunks : 1) * num_experts;
}

cudaError_t moe_align(const int32_t* topk_ids, int64_t n_slots, int num_experts, int block_m,
                      int32_t* sorted_ids, int64_t sorted_len, int32_t* expert_ids, int32_t* ntpp,
                      int32_t* workspace, cudaStream_t stream) {
  if (num_experts <= 0 || num_experts > kMaxExperts || block_m <= 0 || sorted_len % block_m != 0)
    return cudaErrorInvalidValue;
  const int64_t chunk = chunk_slots(n_slots), nchunks = (n_slots + chunk - 1) / chunk;
  const int grid = (int)(nchunks > 0 ? nchunks : 1);
  int32_t* hist = workspace;
  align_count_kernel<<<grid, kThreads, 0, stream>>>(topk_ids, n_slots, chunk, num_experts, sorted_ids,
                                                   sorted_len, (int32_t)n_slots, hist);
  align_place_kernel<<<grid, kThreads, 0, stream>>>(topk_ids, n_slots, chunk, num_experts, block_m, hist, grid, expert_ids,
                                                   sorted_len / block_m, ntpp, sorted_ids);
  return cudaGetLastError();
}

}  // namespace flash_moe
