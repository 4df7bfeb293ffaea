// Host side of fused_moe_bf16 and fused_moe_mxfp8 (Hopper, sm_90a): tensor maps, workspace,
// and the launch sequence shared by both ops:
//
//   [mxfp8 only] scale window: can the gate/up GEMM run on f16 operands (mx::kWindow)?
//   [mxfp8 only] x -> f16 or bf16 accordingly, K-permuted (the gather then reads 2-byte rows)
//   inverse        pos[slot] = p   (slot -> sorted position)
//   [bpc = 2 only] units: each expert's m-blocks in pairs for the CTA-pair GEMMs
//   GEMM1 gate/up  h[p] = silu(x[tok(p)] @ Wg[e]^T) * (x[tok(p)] @ Wu[e]^T)      bf16 h
//   GEMM2 down     Y[p] = topk_weight[slot(p)] * (h[p] @ W2[e]^T)                 bf16 Y
//   reduce         out[t] (+)= sum_{k ascending} Y[pos(t*top_k + k)]   in fp32
//
// GEMM2 and reduce are programmatic dependent launches: each starts its CTAs on the SMs the
// kernel before it leaves idle at its end. GEMM2 waits per m-block for h (gemm::HandOff),
// reduce for the whole of GEMM2 (griddepcontrol.wait).
//
// The GEMM kernels are in moe_gemm.cuh: bf16 weights by TMA, or e4m3 weights + blocked scales
// dequantized in registers (MXFP8; x and h are then stored K-permuted, see kperm). No float
// atomics anywhere: bit-identical output run after run.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "flash_moe.cuh"
#include "moe_gemm.cuh"

namespace flash_moe {
namespace {

using gemm::GemmParams;
using gemm::Kind;

// ---------------------------------------------------------------- top-k sum
// inv[slot] = position of slot in sorted_ids (only for valid slots in valid blocks), and
// block_live[b] = the live rows of m-block b (zeroed before): written by the block's last live
// row, the one followed by padding or the block's end (moe_align puts the padding after the
// live rows; with other buffers the value is some live row's offset + 1, in [1, kBlockM]).
__global__ void inverse_kernel(const int32_t* __restrict__ sorted_ids, const int32_t* __restrict__ expert_ids,
                               const int32_t* __restrict__ ntpp_ptr, int L, int n_slots, int E,
                               int32_t* __restrict__ inv, int32_t* __restrict__ block_live) {
  int ntpp = *ntpp_ptr;
  ntpp = ntpp < 0 ? 0 : (ntpp > L ? L : ntpp);
  for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < ntpp; pos += gridDim.x * blockDim.x) {
    const int sid = sorted_ids[pos];
    const int e = expert_ids[pos / kBlockM];
    if (!gemm::live_slot(sid, n_slots) || e < 0 || e >= E) continue;
    inv[sid] = pos;
    const int r = pos % kBlockM;
    if (r == kBlockM - 1 || pos + 1 >= ntpp || !gemm::live_slot(sorted_ids[pos + 1], n_slots))
      block_live[pos / kBlockM] = r + 1;
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
  int ntpp = *ntpp_ptr;
  ntpp = ntpp < 0 ? 0 : (ntpp > L ? L : ntpp);
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

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(b[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

// out[t, :] (+)= sum_k Y[inv[t*top_k+k], :], fp32, k ascending. 8 columns per thread.
__global__ void reduce_kernel(const __nv_bfloat16* __restrict__ Y, const int32_t* __restrict__ inv,
                              __nv_bfloat16* __restrict__ out, int64_t M, int K, int top_k, bool accumulate) {
  sm90::griddep_wait();  // launched while the down GEMM still runs: Y is complete after this
  const int cpr = K / 8;
  const int64_t total = M * cpr;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / cpr;
    const int c = (int)(i - t * cpr) * 8;
    float acc[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = 0.f;
    for (int k = 0; k < top_k; ++k) {
      const int pos = inv[t * top_k + k];
      if (pos >= 0) add_bf16x8(acc, *reinterpret_cast<const uint4*>(Y + (int64_t)pos * K + c));
    }
    __nv_bfloat16* o = out + t * K + c;
    if (accumulate) add_bf16x8(acc, *reinterpret_cast<const uint4*>(o));
    uint4 r;
    __nv_bfloat162* rb = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int q = 0; q < 4; ++q) rb[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    *reinterpret_cast<uint4*>(o) = r;
  }
}


// ---------------------------------------------------------------- tensor maps
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn get_encode_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return (EncodeTiledFn) nullptr;
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// A K-major operand: innermost dim first; box {64 elements, 128 rows, 1...}; out-of-bounds
// elements read as zeros. bf16 boxes (128-byte rows) use the 128-byte swizzle wgmma reads;
// e4m3 boxes (64-byte rows) the 64-byte swizzle. (The dequantizing threads' 16-byte loads of
// e4m3 rows still take two wavefronts each: a quarter-warp's two row groups share a 64-byte
// bank half. A row order without that conflict measured no faster: flash_moe/NOTES.md,
// session 12.)
struct Operand {
  const void* ptr;
  int rank;
  uint64_t dims[3];
  uint64_t row_bytes[2];  // strides of dims 1.. in bytes
};

bool make_tmap(CUtensorMap* tm, const Operand& o, bool e4m3, uint32_t box_rows = 128) {
  EncodeTiledFn fn = get_encode_fn();
  if (!fn) return false;
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t box[3], estr[3];
  for (int i = 0; i < o.rank; ++i) {
    gdim[i] = o.dims[i];
    box[i] = i == 0 ? gemm::kBK : (i == 1 ? box_rows : 1);
    estr[i] = 1;
  }
  for (int i = 0; i < o.rank - 1; ++i) gstride[i] = o.row_bytes[i];
  return fn(tm, e4m3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, o.rank,
            const_cast<void*>(o.ptr), gdim, gstride, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            e4m3 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// w (E, 2I, K), w2 (E, K, I), h (L, I): element size 2 (bf16) or 1 (e4m3).
Operand gate_up_weights(const void* w, int64_t E, int64_t K, int64_t I, int elem) {
  return Operand{w, 3, {(uint64_t)K, (uint64_t)(2 * I), (uint64_t)E}, {(uint64_t)(K * elem), (uint64_t)(2 * I * K * elem)}};
}
Operand down_weights(const void* w2, int64_t E, int64_t K, int64_t I, int elem) {
  return Operand{w2, 3, {(uint64_t)I, (uint64_t)K, (uint64_t)E}, {(uint64_t)(I * elem), (uint64_t)(K * I * elem)}};
}
Operand h_rows(const void* h, int64_t L, int64_t I) {
  return Operand{h, 2, {(uint64_t)I, (uint64_t)L, 1}, {(uint64_t)(I * 2), 0}};
}
// The bf16 epilogues' TMA stores: (rows, cols) bf16 row-major, 64 x 64 boxes.
constexpr uint32_t kStoreBoxRows = 64;
Operand out_rows(const void* out, int64_t rows, int64_t cols) {
  return Operand{out, 2, {(uint64_t)cols, (uint64_t)rows, 1}, {(uint64_t)(cols * 2), 0}};
}

// ---------------------------------------------------------------- launches
// after_previous: a programmatic dependent launch, which may start while the previous kernel of
// the stream still runs (the kernel itself waits for what it reads: HandOff, griddep_wait).
// cluster: CTAs per cluster (1 or 2).
template <class Kernel, class... Args>
cudaError_t launch(Kernel kern, int grid, int block, int smem, bool after_previous, int cluster, cudaStream_t stream,
                   Args... args) {
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  if (after_previous) {
    attrs[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attrs[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attrs[cfg.numAttrs++].val.clusterDim = {(unsigned)cluster, 1, 1};
  }
  return cudaLaunchKernelEx(&cfg, kern, args...);
}

// CTA pairs that fit on the device at once (some GPCs may leave an SM without a partner). Every
// GEMM kernel here takes a whole SM per CTA, so the count is the same for all of them: it is
// computed once per process (like sm_count), for the first kernel asked about.
inline int max_pairs(const void* kern, int smem) {
  static const int n = [&] {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim = {2, 1, 1};
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2 * (sm_count() / 2));
    cfg.blockDim = dim3(gemm::kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg) != cudaSuccess || clusters < 1) {
      (void)cudaGetLastError();
      clusters = sm_count() / 2;
    }
    return clusters;
  }();
  return n;
}

// One persistent launch: a CTA per SM (or per tile when there are fewer tiles); with CTA pairs,
// a cluster per SM pair.
template <class Kernel>
cudaError_t launch_persistent(Kernel kern, int smem, const CUtensorMap& tmA, const CUtensorMap& tmB,
                              const CUtensorMap& tmC, const CUtensorMap& tmT, const CUtensorMap& tmS,
                              const GemmParams& p, bool after_previous, bool paired, cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int64_t max_tiles = (int64_t)(p.L / gemm::kBM) * p.num_n;
  if (max_tiles == 0) return cudaSuccess;
  const int64_t slots = paired ? max_pairs(reinterpret_cast<const void*>(kern), smem) : sm_count();
  const int grid = (int)(max_tiles < slots ? max_tiles : slots) * (paired ? 2 : 1);
  return launch(kern, grid, gemm::kThreads, smem, after_previous, paired ? 2 : 1, stream, tmA, tmB, tmC, tmT, tmS,
                p);
}

// The bf16 op's tensor maps. h_tail: h in (kMaxRows - kBM)-row boxes, the down GEMM's token rows
// past kBM; *_out: the TMA stores' 64 x 64 boxes; *_out_rows: kStoreRows-row boxes, for output
// boxes with fewer live tokens.
struct Bf16Maps {
  CUtensorMap w, h, h_tail, w2, h_out, h_out_rows, y_out, y_out_rows;
};

// Both GEMMs of one op at one pipeline depth, with or without CTA pairs. The gate/up GEMM reads
// neither tmA nor tmT (tm.w stands in).
template <gemm::Weights kW, int kStages, bool kPaired>
cudaError_t launch_gemms(const Bf16Maps& tm, const GemmParams& p1, const GemmParams& p2, cudaStream_t stream) {
  const int smem = gemm::StagePlan<kW, kStages>::kLaunchBytes;
  cudaError_t err = launch_persistent(gemm::moe_gemm_kernel<kW, Kind::kGateUp, kStages, kPaired>, smem, tm.w, tm.w,
                                      tm.h_out, tm.w, tm.h_out_rows, p1, false, kPaired, stream);
  if (err != cudaSuccess) return err;
  return launch_persistent(gemm::moe_gemm_kernel<kW, Kind::kDown, kStages, kPaired>, smem, tm.h, tm.w2, tm.y_out,
                           tm.h_tail, tm.y_out_rows, p2, true, kPaired, stream);
}

// The MXFP8 op's GEMMs: two gate/up kernels, general (bf16 operands) and f16 (scale window),
// of which the one window_misfit does not select returns at once, then the down GEMM. The
// MXFP8 epilogues store from registers: no output maps.
template <bool kPaired>
cudaError_t launch_mxfp8_gemms(const CUtensorMap& tm_w, const CUtensorMap& tm_h, const CUtensorMap& tm_w2,
                               const GemmParams& p1, const GemmParams& p2, cudaStream_t stream) {
  using gemm::Weights;
  constexpr int kS = kMxfp8Stages;
  const int smem = gemm::StagePlan<Weights::kMxfp8, kS>::kLaunchBytes;
  const CUtensorMap no_map{};
  cudaError_t err = launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8, Kind::kGateUp, kS, kPaired>, smem, tm_w,
                                      tm_w, no_map, no_map, no_map, p1, false, kPaired, stream);
  if (err == cudaSuccess)
    err = launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8Window, Kind::kGateUp, kS, kPaired>, smem, tm_w, tm_w,
                            no_map, no_map, no_map, p1, false, kPaired, stream);
  if (err != cudaSuccess) return err;
  return launch_persistent(gemm::moe_gemm_kernel<Weights::kMxfp8, Kind::kDown, kS, kPaired>, smem, tm_h, tm_w2, no_map,
                           no_map, no_map, p2, true, kPaired, stream);
}

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// Workspace: h (L, I) bf16 | Y (L, K) bf16 | inv (M*top_k) int32 | counters, int32, zeroed per
// call: the two GEMMs' tile counters, the scale window's misfit flag (MXFP8), then h_done per
// m-block (gemm::HandOff), then block_live per m-block (inverse_kernel) | CTA pairs: units
// (int2, one per m-block at most), their count (pair_units_kernel) | MXFP8 only: x as bf16 or
// f16 (M, K), the scale window's top bytes per weight row (E * 2I) and per token (M).
constexpr int kTileCounterInts = 2;
constexpr int kCounterHeaderInts = kTileCounterInts + 1;  // + the misfit flag
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
  static int64_t blocks(int64_t L) { return (L + gemm::kBM - 1) / gemm::kBM; }
  static int64_t counters(int64_t L) { return kCounterHeaderInts + 2 * blocks(L); }
  // mx_w_rows: the MXFP8 op's weight rows E * 2I; 0 for the bf16 op (no MXFP8 regions).
  static size_t bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k, int64_t mx_w_rows) {
    size_t b = align256((size_t)L * I * 2) + align256((size_t)L * K * 2) + align256((size_t)M * top_k * 4) +
               align256((size_t)counters(L) * 4) + align256((size_t)(2 * blocks(L) + 1) * 4);
    if (mx_w_rows > 0) b += align256((size_t)M * K * 2) + align256((size_t)mx_w_rows) + align256((size_t)M);
    return b;
  }
  Workspace(void* base, int64_t M, int64_t K, int64_t I, int64_t L, int top_k, int64_t mx_w_rows)
      : n_slots(M * top_k), counter_ints(counters(L)) {
    uint8_t* p = static_cast<uint8_t*>(base);
    h = reinterpret_cast<__nv_bfloat16*>(p);
    p += align256((size_t)L * I * 2);
    Y = reinterpret_cast<__nv_bfloat16*>(p);
    p += align256((size_t)L * K * 2);
    inv = reinterpret_cast<int32_t*>(p);
    p += align256((size_t)n_slots * 4);
    tile_counters = reinterpret_cast<int32_t*>(p);
    window_misfit = reinterpret_cast<uint32_t*>(tile_counters + kTileCounterInts);
    h_done = tile_counters + kCounterHeaderInts;
    block_live = h_done + blocks(L);
    p += align256((size_t)counter_ints * 4);
    units = reinterpret_cast<int2*>(p);
    num_units = reinterpret_cast<int32_t*>(units + blocks(L));
    p += align256((size_t)(2 * blocks(L) + 1) * 4);
    if (mx_w_rows > 0) {
      x16 = p;
      p += align256((size_t)M * K * 2);
      w_top = p;
      p += align256((size_t)mx_w_rows);
      x_top = p;
    }
  }
  // Before the GEMMs: inv = -1 (no position), counters = 0.
  cudaError_t clear(cudaStream_t stream) const {
    cudaError_t err = cudaMemsetAsync(inv, 0xFF, (size_t)n_slots * 4, stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(tile_counters, 0, (size_t)counter_ints * 4, stream);
  }
};

// The routing/shape fields both GEMMs share; p2 is derived for the down GEMM.
void make_params(const __nv_bfloat16* x, const int32_t* sorted_ids, const int32_t* expert_ids, const int32_t* ntpp,
                 const float* topk_weights, const Workspace& ws, int64_t M, int64_t K, int64_t I, int64_t E,
                 int64_t L, int top_k, GemmParams& p1, GemmParams& p2) {
  p1 = GemmParams{};
  p1.x = x;
  p1.sorted_ids = sorted_ids;
  p1.expert_ids = expert_ids;
  p1.ntpp = ntpp;
  p1.topk_weights = topk_weights;
  p1.out = ws.h;
  p1.lda = K;
  p1.ldo = I;
  p1.L = (int)L;
  p1.n_slots = (int)(M * top_k);
  p1.top_k = top_k;
  p1.E = (int)E;
  p1.K = (int)K;
  p1.n_out = (int)I;
  p1.num_n = (int)((I + 127) / 128);
  p1.tile_counter = ws.tile_counters;
  p1.h_done = ws.h_done;
  p1.b_second = (int)I;  // up rows follow the I gate rows
  p1.b_rows = (int)(2 * I);
  p2 = p1;
  p2.out = ws.Y;
  p2.ldo = K;
  p2.K = (int)I;
  p2.n_out = (int)K;
  p2.num_n = (int)((K + 255) / 256);
  p2.tile_counter = ws.tile_counters + 1;
  p2.h_done_target = 2 * p1.num_n;  // gemm::HandOff: two consumer warpgroups per gate/up tile
  p2.b_second = 128;  // the two 128-row halves of a 256-column tile
  p2.b_rows = (int)K;
}

// Before the GEMMs (it reads only the routing): the sorted position of every slot, and each
// m-block's live rows.
cudaError_t slot_positions(const int32_t* sorted_ids, const int32_t* expert_ids, const int32_t* ntpp,
                           const Workspace& ws, int64_t E, int64_t L, cudaStream_t stream) {
  if (L == 0) return cudaSuccess;
  const int ib = 256;
  int ig = (int)((L + ib - 1) / ib);
  if (ig > 4 * sm_count()) ig = 4 * sm_count();
  inverse_kernel<<<ig, ib, 0, stream>>>(sorted_ids, expert_ids, ntpp, (int)L, (int)ws.n_slots, (int)E, ws.inv,
                                        ws.block_live);
  return cudaGetLastError();
}

// bpc = 2, after slot_positions: the CTA pairs' units (they read only the routing). fit (the
// bf16 op, whose consumers fit wgmma's N to the rows): split each pair's rows evenly and carry
// short tails, see pair_units_kernel; else (MXFP8) a block per CTA.
cudaError_t pair_units(const int32_t* expert_ids, const int32_t* ntpp, const Workspace& ws, int64_t E, int64_t L,
                       GemmParams& p1, GemmParams& p2, cudaStream_t stream, bool fit) {
  pair_units_kernel<<<1, kUnitThreads, 0, stream>>>(expert_ids, ntpp, (int)L, (int)E, ws.units, ws.num_units,
                                                    fit ? ws.block_live : nullptr);
  p1.units = p2.units = ws.units;
  p1.num_units = p2.num_units = ws.num_units;
  return cudaGetLastError();
}

cudaError_t topk_sum(const Workspace& ws, void* out, int64_t M, int64_t K, int top_k, bool split, cudaStream_t stream) {
  const int64_t work = M * (K / 8);
  const int rb = 256;
  int64_t rg = (work + rb - 1) / rb;
  if (rg > 16 * sm_count()) rg = 16 * sm_count();
  return launch(reduce_kernel, (int)rg, rb, 0, true, 1, stream, (const __nv_bfloat16*)ws.Y, (const int32_t*)ws.inv,
                static_cast<__nv_bfloat16*>(out), M, (int)K, top_k, !split);
}

}  // namespace

size_t fused_moe_bf16_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t L, int top_k) {
  return Workspace::bytes(M, K, I, L, top_k, 0);
}

size_t fused_moe_mxfp8_workspace_bytes(int64_t M, int64_t K, int64_t I, int64_t E, int64_t L, int top_k) {
  return Workspace::bytes(M, K, I, L, top_k, E * 2 * I);
}

cudaError_t fused_moe_bf16(const FusedMoeBf16Args& a, cudaStream_t stream) {
  if ((a.stages != 3 && a.stages != 4) || (a.bpc != 1 && a.bpc != 2)) return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const Workspace ws(a.workspace, a.M, a.K, a.I, a.L, a.top_k, 0);
  cudaError_t err = ws.clear(stream);
  if (err == cudaSuccess) err = slot_positions(a.sorted_ids, a.expert_ids, a.ntpp, ws, a.E, a.L, stream);
  if (err != cudaSuccess) return err;
  if (a.L > 0) {
    Bf16Maps tm;
    const uint32_t kTailBox = gemm::kMaxRows - gemm::kBM, kRowsBox = gemm::kStoreRows;
    if (!make_tmap(&tm.w, gate_up_weights(a.w, a.E, a.K, a.I, 2), false) ||
        !make_tmap(&tm.h, h_rows(ws.h, a.L, a.I), false) ||
        !make_tmap(&tm.h_tail, h_rows(ws.h, a.L, a.I), false, kTailBox) ||
        !make_tmap(&tm.w2, down_weights(a.w2, a.E, a.K, a.I, 2), false) ||
        !make_tmap(&tm.h_out, out_rows(ws.h, a.L, a.I), false, kStoreBoxRows) ||
        !make_tmap(&tm.h_out_rows, out_rows(ws.h, a.L, a.I), false, kRowsBox) ||
        !make_tmap(&tm.y_out, out_rows(ws.Y, a.L, a.K), false, kStoreBoxRows) ||
        !make_tmap(&tm.y_out_rows, out_rows(ws.Y, a.L, a.K), false, kRowsBox))
      return cudaErrorInvalidValue;
    GemmParams p1, p2;
    make_params(static_cast<const __nv_bfloat16*>(a.x), a.sorted_ids, a.expert_ids, a.ntpp, a.topk_weights, ws, a.M,
                a.K, a.I, a.E, a.L, a.top_k, p1, p2);
    // pipeline depth x CTA pairs: the four kernel pairs
    const auto gemms = [&](auto paired) {
      constexpr auto kBf16 = gemm::Weights::kBf16;
      constexpr bool kPaired = decltype(paired)::value;
      return a.stages == 4 ? launch_gemms<kBf16, 4, kPaired>(tm, p1, p2, stream)
                           : launch_gemms<kBf16, 3, kPaired>(tm, p1, p2, stream);
    };
    // CTA pairs split their experts' rows evenly and carry short tails (pair_units_kernel reads
    // inverse_kernel's live rows per block for that).
    if (a.bpc == 2) err = pair_units(a.expert_ids, a.ntpp, ws, a.E, a.L, p1, p2, stream, true);
    if (err == cudaSuccess) err = a.bpc == 2 ? gemms(std::true_type{}) : gemms(std::false_type{});
    if (err != cudaSuccess) return err;
  }
  return topk_sum(ws, a.out, a.M, a.K, a.top_k, a.split, stream);
}

cudaError_t fused_moe_mxfp8(const FusedMoeMxfp8Args& a, cudaStream_t stream) {
  if (a.stages != kMxfp8Stages || a.K % 64 != 0 || a.I % 64 != 0 || (a.bpc != 1 && a.bpc != 2))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const Workspace ws(a.workspace, a.M, a.K, a.I, a.L, a.top_k, a.E * 2 * a.I);
  cudaError_t err = ws.clear(stream);
  if (err == cudaSuccess) err = slot_positions(a.sorted_ids, a.expert_ids, a.ntpp, ws, a.E, a.L, stream);
  if (err != cudaSuccess) return err;
  if (a.L > 0) {
    // Which gate/up GEMM runs: f16 operands if every row fits the scale window (mx::kWindow).
    // Then x, read top_k times by the gather, is dequantized once (M*K*3 bytes, ~1% of the op)
    // to f16 or bf16 accordingly.
    // The scan reads w_scales as one (E*2I, K/32) matrix: the same bytes as the per-expert
    // packing, since 2I is a multiple of 128 (I % 64 == 0).
    err = mxfp8_scale_window(static_cast<const uint8_t*>(a.w), a.w_scales, a.E * 2 * a.I,
                             static_cast<const uint8_t*>(a.x), a.x_scales, a.M, a.K, !a.f16_window, ws.w_top,
                             ws.x_top, ws.window_misfit, stream);
    if (err == cudaSuccess)
      err = dequantize_mxfp8_k64_permuted(static_cast<const uint8_t*>(a.x), a.x_scales, a.M, a.K, ws.x16, ws.x_top,
                                          ws.window_misfit, stream);
    if (err != cudaSuccess) return err;
    CUtensorMap tm_w, tm_h, tm_w2;
    if (!make_tmap(&tm_w, gate_up_weights(a.w, a.E, a.K, a.I, 1), true) ||
        !make_tmap(&tm_h, h_rows(ws.h, a.L, a.I), false) ||
        !make_tmap(&tm_w2, down_weights(a.w2, a.E, a.K, a.I, 1), true))
      return cudaErrorInvalidValue;
    GemmParams p1, p2;
    make_params(static_cast<const __nv_bfloat16*>(ws.x16), a.sorted_ids, a.expert_ids, a.ntpp, a.topk_weights, ws,
                a.M, a.K, a.I, a.E, a.L, a.top_k, p1, p2);
    p1.b_scales = a.w_scales;
    p1.scale_col_groups = (int)mxfp8_scale_col_groups(a.K / kMxfp8ScaleBlock);
    p1.scale_rows = (int)mxfp8_blocked_rows(2 * a.I);
    p1.scale_row_groups = (int)(a.E * mxfp8_scale_row_groups(2 * a.I));
    p1.window_misfit = ws.window_misfit;
    p1.w_top = ws.w_top;
    p1.x_top = ws.x_top;
    p2.b_scales = a.w2_scales;
    p2.scale_col_groups = (int)mxfp8_scale_col_groups(a.I / kMxfp8ScaleBlock);
    p2.scale_rows = (int)mxfp8_blocked_rows(a.K);
    p2.scale_row_groups = (int)(a.E * mxfp8_scale_row_groups(a.K));
    if (a.bpc == 2) err = pair_units(a.expert_ids, a.ntpp, ws, a.E, a.L, p1, p2, stream, false);
    if (err == cudaSuccess)
      err = a.bpc == 2 ? launch_mxfp8_gemms<true>(tm_w, tm_h, tm_w2, p1, p2, stream)
                       : launch_mxfp8_gemms<false>(tm_w, tm_h, tm_w2, p1, p2, stream);
    if (err != cudaSuccess) return err;
  }
  return topk_sum(ws, a.out, a.M, a.K, a.top_k, a.split, stream);
}

}  // namespace flash_moe
