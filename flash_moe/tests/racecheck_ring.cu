// Which hand-offs compute-sanitizer's racecheck accepts through an mbarrier ring (flash_moe/DESIGN.md
// §8.1 (g); the reason wait_tile reads the tile slot in lane 0 only).
// One producer thread writes slot[s] at a tile's first stage and arrives on full[s]; two consumer
// groups of 4 warps wait full[s] and read slot[s], then release empty[s]:
//   mode 0: bar.sync per group, then lane 0 of each warp arrives (8 arrivals; ordered per the PTX
//           memory model): racecheck reported 1 hazard at nk = 3 and 4 (compute-sanitizer, CUDA 13.0);
//   mode 1: every reading thread arrives (256 arrivals): 0 hazards.
// Not a pytest file. On an sm_90 GPU:
//   nvcc -arch=sm_90a -o /tmp/ring flash_moe/tests/racecheck_ring.cu
//   for mode in 0 1; do compute-sanitizer --tool racecheck /tmp/ring 4 $mode; done   # nk = 4 k-blocks per tile
#include <cstdio>
#include <cstdlib>
#include <cstdint>
constexpr int S = 4;
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void init(uint32_t b, int n) { asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(b), "r"(n)); }
__device__ __forceinline__ void arrive(uint32_t b) { asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(b) : "memory"); }
__device__ __forceinline__ void wait(uint32_t b, uint32_t par) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" ::"r"(b), "r"(par) : "memory");
}
__global__ void ring(int tiles, int nk, int mode, int* out) {
  const int arrivals = mode == 1 ? 256 : 8;
  __shared__ __align__(8) uint64_t full[S], empty[S];
  __shared__ int slot[S];
  if (threadIdx.x == 0) { for (int s = 0; s < S; ++s) { init(smem_u32(&full[s]), 1); init(smem_u32(&empty[s]), arrivals); } }
  __syncthreads();
  if (threadIdx.x < 32) {  // producer warp, lane 0 works
    if (threadIdx.x != 0) return;
    uint32_t it = 0;
    for (int t = 0; t < tiles; ++t)
      for (int kb = 0; kb < nk; ++kb, ++it) {
        const int s = it % S;
        wait(smem_u32(&empty[s]), ((it / S) & 1) ^ 1);
        if (kb == 0) slot[s] = t;
        arrive(smem_u32(&full[s]));
      }
    return;
  }
  const int cw = (threadIdx.x - 32) / 128, lane = threadIdx.x & 31;
  int acc = 0;
  uint32_t it = 0;
  for (int t = 0; t < tiles; ++t)
    for (int kb = 0; kb < nk; ++kb, ++it) {
      const int s = it % S;
      wait(smem_u32(&full[s]), (it / S) & 1);
      if (kb == 0) acc += slot[s];
      if (mode == 1) { arrive(smem_u32(&empty[s])); continue; }
      asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
      if (lane == 0) arrive(smem_u32(&empty[s]));
    }
  if ((threadIdx.x & 127) == 0) out[cw] = acc;
}
int main(int argc, char** argv) {
  const int nk = argc > 1 ? atoi(argv[1]) : 4, mode = argc > 2 ? atoi(argv[2]) : 0, tiles = 16;
  int* out; cudaMalloc(&out, 8);
  ring<<<1, 32 + 256>>>(tiles, nk, mode, out);
  int h[2]; cudaMemcpy(h, out, 8, cudaMemcpyDeviceToHost);
  printf("nk=%d sums %d %d (want %d) %s\n", nk, h[0], h[1], tiles * (tiles - 1) / 2, cudaGetErrorString(cudaGetLastError()));
  return 0;
}
