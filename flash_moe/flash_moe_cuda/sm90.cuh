// Hopper (sm_90a) PTX primitives used by the flash_moe GEMMs: mbarriers, named barriers, TMA
// and bulk copies, cp.async, and wgmma with its shared-memory descriptors. Thin wrappers only:
// no policy lives here.
#pragma once

#include <cstdint>
#include <cuda.h>

namespace flash_moe {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// The producer's arrive and copies take `issue` (default true): a whole warp may call them with
// the same, warp-uniform operands, which ptxas then keeps in uniform registers, and only the lane
// with issue = true executes the instruction. (Called from one divergent thread, every copy's
// operands go through an R2UR loop instead: ~10 instructions per copy.)
#define FM_PRED(INSTR) "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p " INSTR ";\n}"
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes, bool issue = true) {
  asm volatile(FM_PRED("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2") ::"r"((uint32_t)issue), "r"(bar),
               "r"(bytes)
               : "memory");
}
// kClusterAcquire: the barrier is arrived on by a peer CTA that wrote this CTA's shared memory
// first (mbar_arrive_peer), so the wait acquires at cluster scope.
#define FM_MBAR_TRY_WAIT(SEM)                                                                     \
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%1], %2;\n" \
               "selp.u32 %0, 1, 0, p;\n}"                                                         \
               : "=r"(ok)                                                                         \
               : "r"(bar), "r"(parity)                                                            \
               : "memory")
template <bool kClusterAcquire = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  if constexpr (kClusterAcquire)
    FM_MBAR_TRY_WAIT(".acquire.cluster");
  else
    FM_MBAR_TRY_WAIT("");
  return ok != 0;
}
#undef FM_MBAR_TRY_WAIT
template <bool kClusterAcquire = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait<kClusterAcquire>(bar, parity)) {
  }
}

// Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The number of the `threads` threads (named barrier `id`) whose pred is true.
__device__ __forceinline__ int named_barrier_popc(uint32_t id, uint32_t threads, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred pi;\nsetp.ne.b32 pi, %1, 0;\n"
      "barrier.red.popc.u32 %0, %2, %3, pi;\n}\n"
      : "=r"(r)
      : "r"((uint32_t)pred), "r"(id), "r"(threads)
      : "memory");
  return (int)r;
}

// ---------------------------------------------------------------- TMA and bulk copies
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* tm, int c0, int c1, uint32_t bar,
                                            bool issue = true) {
  asm volatile(
      FM_PRED("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2, {%3, %4}], [%5]")
      ::"r"((uint32_t)issue), "r"(dst), "l"(tm), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* tm, int c0, int c1, int c2, uint32_t bar,
                                            bool issue = true) {
  asm volatile(
      FM_PRED("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2, {%3, %4, %5}], [%6]")
      ::"r"((uint32_t)issue), "r"(dst), "l"(tm), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Contiguous global -> shared copy (16-byte aligned, size a multiple of 16), completes on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          bool issue = true) {
  asm volatile(FM_PRED("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2], %3, [%4]")
               ::"r"((uint32_t)issue), "r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Shared -> global tensor store (the epilogue); completion tracked by bulk groups.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* tm, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(tm), "r"(c0),
               "r"(c1), "r"(src)
               : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* tm, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(tm), "r"(c0),
               "r"(c1), "r"(c2), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most kPending of the committed store groups may still read their shared-memory
// source (0: every store has finished reading).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Start pulling `bytes` (a multiple of 16) of global memory into L2; nothing waits for it.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// Wait until every committed store has completed.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Make this thread's generic-proxy shared-memory writes visible to the async proxy (TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// volatile: kept in program order with the mbarrier waits (also volatile asm) it follows.
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// Lane 0 loads the 32 bytes at addr and the whole warp gets them (call with whole warps): the
// other lanes add zeros to an OR across the warp (redux.sync), whose result ptxas knows to be
// warp-uniform. Broadcast by __shfl_sync instead, after a branch on the lane, ptxas could not prove
// the warp converged: it moved the kernels' warp-uniform addresses out of uniform registers (one
// R2UR per wgmma) and kDownDgrad ran 5 % slower.
__device__ __forceinline__ void ld_shared_x8_lane0(uint32_t addr, uint32_t (&v)[8]) {
  const uint32_t lane0 = (threadIdx.x & 31) == 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = 0u;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %8, 0;\n"
      " @p ld.shared.v4.u32 {%0, %1, %2, %3}, [%9];\n @p ld.shared.v4.u32 {%4, %5, %6, %7}, [%9 + 16];\n}"
      : "+r"(v[0]), "+r"(v[1]), "+r"(v[2]), "+r"(v[3]), "+r"(v[4]), "+r"(v[5]), "+r"(v[6]), "+r"(v[7])
      : "r"(lane0), "r"(addr));
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __reduce_or_sync(0xffffffffu, v[i]);
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
// Four 8x8 b16 matrices from the mma accumulator layout (thread l: row l/4, columns 2(l%4),
// +1 in r[i] for matrix i), stored transposed: lane l gives the address of row l%8 of matrix
// l/8, and that smem row receives column l%8 of the matrix (8 b16, 16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// The same four matrices stored as they are: lane l gives the address of row l%8 of matrix l/8,
// which receives that matrix row (8 b16, 16 bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// ---------------------------------------------------------------- clusters
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The address of the same shared-memory location in CTA `rank` of this cluster.
__device__ __forceinline__ uint32_t peer_smem(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Arrive on an mbarrier of another CTA of the cluster (`bar` from peer_smem), release at
// cluster scope: what this thread wrote before (e.g. st_peer_v4) is visible to whoever then
// waits on it with mbar_wait<true>. Costly: a consumer warp doing this per k-block made the
// op 31-60 % slower than without pairs (flash_moe/DESIGN.md §5).
__device__ __forceinline__ void mbar_arrive_peer(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The same arrive at the default (CTA) scope: for signalling that this warp's wgmmas are done
// reading a stage, which orders no memory writes of this thread (CUTLASS's consumer_release of
// a multicast pipeline arrives the same way).
__device__ __forceinline__ void mbar_arrive_peer_relaxed(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void st_peer_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
// All threads of all CTAs of the cluster; not .aligned, so divergent warps may call it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// TMA loads of one box into the same shared-memory offset of every CTA in `cta_mask`, each
// CTA's `bar` (same offset) receiving the box's bytes.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* tm, int c0, int c1, uint32_t bar,
                                                      uint16_t cta_mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;"
               ::"r"(dst), "l"(tm), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
               : "memory");
}
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* tm, int c0, int c1, int c2,
                                                      uint32_t bar, uint16_t cta_mask, bool issue = true) {
  asm volatile(FM_PRED("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                       " [%1], [%2, {%3, %4, %5}], [%6], %7")
               ::"r"((uint32_t)issue), "r"(dst), "l"(tm), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
               : "memory");
}

// Bulk copy of `bytes` into the same shared-memory offset of every CTA in `cta_mask`.
__device__ __forceinline__ void bulk_load_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                    uint16_t cta_mask, bool issue = true) {
  asm volatile(
      FM_PRED("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%1], [%2], %3, [%4], %5")
      ::"r"((uint32_t)issue), "r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask)
      : "memory");
}
#undef FM_PRED

// ---------------------------------------------------------------- kernel-to-kernel handoff
// Programmatic dependent launch: once every CTA of this grid has executed this (or exited), the
// next kernel of the stream, if launched with cudaLaunchAttributeProgrammaticStreamSerialization,
// may start its CTAs on the SMs this grid leaves.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Wait until the grids this one depends on have completed and their writes are visible (a
// no-op when the kernel was launched without the attribute).
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// A flag in global memory, published and read across CTAs of different grids.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Order this thread's global-memory accesses of the generic proxy against those of the async
// proxy (TMA): between a TMA store and a flag, and between a flag and a TMA load.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---------------------------------------------------------------- cp.async (gathers)
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// The arrive fires once this thread's cp.asyncs issued so far have landed (no pending-count bump).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// 4 bytes global -> shared without a register; src_bytes 0 writes zero.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}


// ---------------------------------------------------------------- wgmma
// Descriptor of a K-major operand tile in the 128-byte swizzle: 8-row core groups 1024 bytes apart.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr) {
  uint64_t d = 0;
  d |= (uint64_t)((addr & 0x3FFFF) >> 4);
  d |= (uint64_t)1 << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

// Descriptor of an M-major (MN-major) operand tile in the 128-byte swizzle, as a TMA box of 64
// M-elements (one 128-byte row) by k rows lands: each k row is 128 bytes, 8-row groups of k are
// 1024 bytes apart (the stride byte offset); the leading byte offset is the stride between
// 64-element chunks of M (or N), one 64-row box (8 KB) apart: unused at m64 (one chunk), read by
// the weight gradients' N-major n128 operand (two boxes back to back).
__device__ __forceinline__ uint64_t make_desc_sw128_mn(uint32_t addr) {
  uint64_t d = 0;
  d |= (uint64_t)((addr & 0x3FFFF) >> 4);
  d |= (uint64_t)(8192 >> 4) << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// The wgmma wrappers' operands: FM_RLn, the register list "%0, .., %(n-1)" of the instruction
// text; FM_WGMMA_ACCn, the n accumulator operands d[0..n-1] behind it.
#define FM_RL4 "%0, %1, %2, %3"
#define FM_RL8 FM_RL4 ", %4, %5, %6, %7"
#define FM_RL12 FM_RL8 ", %8, %9, %10, %11"
#define FM_RL16 FM_RL12 ", %12, %13, %14, %15"
#define FM_RL20 FM_RL16 ", %16, %17, %18, %19"
#define FM_RL24 FM_RL20 ", %20, %21, %22, %23"
#define FM_RL28 FM_RL24 ", %24, %25, %26, %27"
#define FM_RL32 FM_RL28 ", %28, %29, %30, %31"
#define FM_RL36 FM_RL32 ", %32, %33, %34, %35"
#define FM_RL40 FM_RL36 ", %36, %37, %38, %39"
#define FM_RL44 FM_RL40 ", %40, %41, %42, %43"
#define FM_RL48 FM_RL44 ", %44, %45, %46, %47"
#define FM_RL52 FM_RL48 ", %48, %49, %50, %51"
#define FM_RL56 FM_RL52 ", %52, %53, %54, %55"
#define FM_RL60 FM_RL56 ", %56, %57, %58, %59"
#define FM_RL64 FM_RL60 ", %60, %61, %62, %63"
#define FM_RL68 FM_RL64 ", %64, %65, %66, %67"
#define FM_RL72 FM_RL68 ", %68, %69, %70, %71"
#define FM_WGMMA_ACC32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FM_WGMMA_ACC64 FM_WGMMA_ACC32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FM_WGMMA_ACC72 FM_WGMMA_ACC64, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])

// D(64x128, fp32) (+)= A(64x16, bf16, smem) * B(128x16, bf16, smem)^T; scale_d = 0 overwrites D.
// (The fp8 promotion microbenchmark's bf16 loop; the GEMMs use wgmma_ss_bf16.)
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FM_RL64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : FM_WGMMA_ACC64
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64 x kN, fp32) (+)= A(64x16, bf16, smem) * B(kN x 16, bf16, smem)^T for kN = 8, 16, .., 144:
// the first kN / 2 registers of d, in the m64n128 layout extended by column groups (j = 0 ..
// kN/8 - 1). Every wrapper lists all 72 registers as operands (the instruction names only the
// first kN / 2), so one operand numbering serves every N: desc_a %72, desc_b %73, scale_d %74.
// kTransA: A is M-major (imm-trans-a = 1): the backward's weight operands, whose M index (the
// output feature) is the contiguous one in memory (make_desc_sw128_mn). kTransB: B is N-major
// (imm-trans-b = 1): the weight gradients' token rows, features contiguous.
// The accumulator array every wgmma_ss_bf16 takes: N = 144 (the widest tile) needs all 72.
constexpr int kWgmmaAccRegs = 72;
#define FM_WGMMA_SS(N, REGS)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS "}, %72, %73, p, 1, 1, %75, %76;\n}\n" \
               : FM_WGMMA_ACC72                                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0))
template <int kN, bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_ss_bf16(float (&d)[kWgmmaAccRegs], uint64_t desc_a, uint64_t desc_b,
                                              int scale_d) {
  static_assert(kN % 8 == 0 && kN >= 8 && kN <= 144, "wgmma_ss_bf16: N = 8, 16, .., 144");
  if constexpr (kN == 8)
    FM_WGMMA_SS(8, FM_RL4);
  else if constexpr (kN == 16)
    FM_WGMMA_SS(16, FM_RL8);
  else if constexpr (kN == 24)
    FM_WGMMA_SS(24, FM_RL12);
  else if constexpr (kN == 32)
    FM_WGMMA_SS(32, FM_RL16);
  else if constexpr (kN == 40)
    FM_WGMMA_SS(40, FM_RL20);
  else if constexpr (kN == 48)
    FM_WGMMA_SS(48, FM_RL24);
  else if constexpr (kN == 56)
    FM_WGMMA_SS(56, FM_RL28);
  else if constexpr (kN == 64)
    FM_WGMMA_SS(64, FM_RL32);
  else if constexpr (kN == 72)
    FM_WGMMA_SS(72, FM_RL36);
  else if constexpr (kN == 80)
    FM_WGMMA_SS(80, FM_RL40);
  else if constexpr (kN == 88)
    FM_WGMMA_SS(88, FM_RL44);
  else if constexpr (kN == 96)
    FM_WGMMA_SS(96, FM_RL48);
  else if constexpr (kN == 104)
    FM_WGMMA_SS(104, FM_RL52);
  else if constexpr (kN == 112)
    FM_WGMMA_SS(112, FM_RL56);
  else if constexpr (kN == 120)
    FM_WGMMA_SS(120, FM_RL60);
  else if constexpr (kN == 128)
    FM_WGMMA_SS(128, FM_RL64);
  else if constexpr (kN == 136)
    FM_WGMMA_SS(136, FM_RL68);
  else if constexpr (kN == 144)
    FM_WGMMA_SS(144, FM_RL72);
}
#undef FM_WGMMA_SS

// The operand type of the register-A wgmmas: bf16, or f16 (MXFP8 in the scale window, see
// mx::f16x2_scale).
enum class RsType { kBf16, kF16 };

// One register-A wgmma: SHAPE and TY strings, the accumulator list, then the indices of the
// scale-d predicate and of "{A regs}, desc_b" in the operand list.
#define FM_WGMMA_RS(SHAPE, TY, REGS, ACC, PRED, AB)                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                   \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " REGS ", " AB ", p, 1, 1, 0;\n}\n" \
               : ACC                                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

// D(64xN, fp32) (+)= A(64x16, registers) * B(Nx16, smem)^T, A and B both bf16 or both f16;
// N = 128, or 64: the first 64 rows of the B tile, D as the first 32 registers of the m64n128
// layout (column group j = 0..7), for tiles whose last 64 token rows are padding.
// The A fragment of warp w, lane l: a[0] = rows 16w + l/4, k = 2(l%4) + {0,1}; a[1] = row + 8;
// a[2] = k + 8; a[3] = row + 8, k + 8 (the mma.m16n8k16 A layout per warp). The registers must
// not change until the wgmma has completed (wgmma_wait), and wgmma_fence must follow their
// last write.
template <RsType kT, int kN>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(kN == 128 || kN == 64, "wgmma_rs: N is 128 or 64");
  constexpr bool kF16 = kT == RsType::kF16;
  if constexpr (kN == 128 && kF16)
    FM_WGMMA_RS("m64n128k16", "f16", "{" FM_RL64 "}", FM_WGMMA_ACC64, "%69", "{%64, %65, %66, %67}, %68");
  else if constexpr (kN == 128)
    FM_WGMMA_RS("m64n128k16", "bf16", "{" FM_RL64 "}", FM_WGMMA_ACC64, "%69", "{%64, %65, %66, %67}, %68");
  else if constexpr (kF16)
    FM_WGMMA_RS("m64n64k16", "f16", "{" FM_RL32 "}", FM_WGMMA_ACC32, "%37", "{%32, %33, %34, %35}, %36");
  else
    FM_WGMMA_RS("m64n64k16", "bf16", "{" FM_RL32 "}", FM_WGMMA_ACC32, "%37", "{%32, %33, %34, %35}, %36");
}
#undef FM_WGMMA_RS
#undef FM_WGMMA_ACC32
#undef FM_WGMMA_ACC64
#undef FM_WGMMA_ACC72
#undef FM_RL4
#undef FM_RL8
#undef FM_RL12
#undef FM_RL16
#undef FM_RL20
#undef FM_RL24
#undef FM_RL28
#undef FM_RL32
#undef FM_RL36
#undef FM_RL40
#undef FM_RL44
#undef FM_RL48
#undef FM_RL52
#undef FM_RL56
#undef FM_RL60
#undef FM_RL64
#undef FM_RL68
#undef FM_RL72

}  // namespace sm90
}  // namespace flash_moe
