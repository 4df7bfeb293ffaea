// Host side of the fused ops' launches: TMA tensor maps of the GEMM operands, and kernel
// launches (programmatic dependent launches, CTA-pair clusters, persistent grids).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_moe.cuh"
#include "moe_gemm_schedule.cuh"

namespace flash_moe {
namespace host {

// ---------------------------------------------------------------- tensor maps
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn get_encode_fn() {
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
// bank half. A row order without that conflict measured no faster: flash_moe/DESIGN.md §5.)
struct Operand {
  const void* ptr;
  int rank;
  uint64_t dims[3];
  uint64_t row_bytes[2];  // strides of dims 1.. in bytes
};

inline bool make_tmap(CUtensorMap* tm, const Operand& o, bool e4m3, uint32_t box_rows = 128) {
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

// w (E, 2I, K), w2 (E, K, I): element size 2 (bf16) or 1 (e4m3).
inline Operand gate_up_weights(const void* w, int64_t E, int64_t K, int64_t I, int elem) {
  return Operand{w, 3, {(uint64_t)K, (uint64_t)(2 * I), (uint64_t)E}, {(uint64_t)(K * elem), (uint64_t)(2 * I * K * elem)}};
}
inline Operand down_weights(const void* w2, int64_t E, int64_t K, int64_t I, int elem) {
  return Operand{w2, 3, {(uint64_t)I, (uint64_t)K, (uint64_t)E}, {(uint64_t)(I * elem), (uint64_t)(K * I * elem)}};
}
// R bf16 rows of C per expert, the experts `expert_stride` elements apart (default R * C: one
// (E, R, C) tensor; 2 * R * C: a half of w (E, 2I, K)). w1, w3: R = I, C = K.
inline Operand expert_rows(const void* w, int64_t E, int64_t R, int64_t C, int64_t expert_stride = 0) {
  const int64_t stride = expert_stride ? expert_stride : R * C;
  return Operand{w, 3, {(uint64_t)C, (uint64_t)R, (uint64_t)E}, {(uint64_t)(C * 2), (uint64_t)(stride * 2)}};
}
// A (rows, cols) bf16 row-major matrix: h, Y, dA|dB, s*h, dx slots, by sorted position.
inline Operand row_major(const void* m, int64_t rows, int64_t cols) {
  return Operand{m, 2, {(uint64_t)cols, (uint64_t)rows, 1}, {(uint64_t)(cols * 2), 0}};
}
// The bf16 epilogues' TMA stores: 64 x 64 boxes (the down dgrad's: 32 x 64).
constexpr uint32_t kStoreBoxRows = 64;

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

// One persistent launch of a kernel with a CTA of gemm::kThreads per SM (or per tile when there
// are fewer of at most `max_tiles` tiles); with CTA pairs, a cluster per SM pair.
template <class Kernel, class... Args>
cudaError_t launch_persistent_tiles(Kernel kern, int smem, int64_t max_tiles, bool after_previous, bool paired,
                                    cudaStream_t stream, Args... args) {
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (max_tiles == 0) return cudaSuccess;
  const int64_t slots = paired ? max_pairs(reinterpret_cast<const void*>(kern), smem) : sm_count();
  const int grid = (int)(max_tiles < slots ? max_tiles : slots) * (paired ? 2 : 1);
  return launch(kern, grid, gemm::kThreads, smem, after_previous, paired ? 2 : 1, stream, args...);
}

// ... of a grouped GEMM kernel with its tensor maps (gemm::GemmMaps) and parameters.
template <class Kernel, class Maps>
cudaError_t launch_persistent(Kernel kern, int smem, const Maps& tm, const gemm::GemmParams& p, bool after_previous,
                              bool paired, cudaStream_t stream) {
  return launch_persistent_tiles(kern, smem, (int64_t)(p.L / gemm::kBM) * p.num_n, after_previous, paired, stream, tm,
                                 p);
}

}  // namespace host
}  // namespace flash_moe
