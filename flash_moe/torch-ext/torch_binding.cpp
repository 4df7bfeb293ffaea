// Torch binding of flash_moe: input rules (TORCH_CHECK naming argument, value and rule) and
// the calls into the raw-pointer launchers of flash_moe_cuda/flash_moe.cuh.
#include <torch/library.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "registration.h"
#include "torch_binding.h"
#include "torch_check.h"
#include "../flash_moe_cuda/flash_moe.cuh"

#include <cstdlib>
#include <string>
#include <vector>

namespace {

// moe_align's buffer length ceil((n_slots + E*(block_m-1))/block_m)*block_m (docs/DESIGN.md §5):
// the one C++ statement of it; the Python one is reference.aligned_length.
int64_t aligned_length(int64_t n_slots, int64_t E, int64_t block_m) {
  return (n_slots + E * (block_m - 1) + block_m - 1) / block_m * block_m;
}

void check_cuda_contig(const at::Tensor& t, const char* op, const char* name) {
  PK_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  PK_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides(), " for sizes ",
           t.sizes());
}

void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  PK_CHECK(t.scalar_type() == want, op, ": ", name, " must have dtype ", want, ", got ", t.scalar_type());
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                       const char* ref_name = "x") {
  PK_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ", ref_name, " (",
           ref.device(), "), got ", t.device());
}

void check_aligned16(const at::Tensor& t, const char* op, const char* name) {
  PK_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
           " must start at a 16-byte aligned address (TMA/vector loads), got data_ptr ", t.data_ptr());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align(const at::Tensor& topk_ids, int64_t num_experts,
                                                         int64_t block_m, int64_t bpc) {
  const char* op = "moe_align";
  check_cuda_contig(topk_ids, op, "topk_ids");
  check_dtype(topk_ids, at::kInt, op, "topk_ids");
  PK_CHECK(topk_ids.dim() == 2, op, ": topk_ids must be 2-D (M, top_k), got shape ", topk_ids.sizes());
  const int64_t top_k = topk_ids.size(1);
  PK_CHECK(top_k >= 1 && top_k <= flash_moe::kMaxTopK, op, ": topk_ids.size(1) (top_k) must be in [1, ",
           flash_moe::kMaxTopK, "], got ", top_k);
  PK_CHECK(num_experts >= 1 && num_experts <= flash_moe::kMaxExperts, op, ": num_experts must be in [1, ",
           flash_moe::kMaxExperts, "], got ", num_experts);
  PK_CHECK(block_m == flash_moe::kBlockM, op, ": block_m must be ", flash_moe::kBlockM,
           " (the only token block the Hopper kernel implements), got ", block_m);
  PK_CHECK(bpc == 1, op, ": bpc must be 1 (clusters of several blocks are not implemented), got ", bpc);
  const int64_t n = topk_ids.numel();
  PK_CHECK(n + num_experts * block_m < (int64_t(1) << 31), op, ": M*top_k must be below 2^31 - E*block_m, got ",
           n);
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const int64_t L = aligned_length(n, num_experts, block_m);
  auto iopt = topk_ids.options();
  at::Tensor sorted = at::empty({L}, iopt);
  at::Tensor experts = at::empty({L / block_m}, iopt);
  at::Tensor ntpp = at::empty({1}, iopt);
  at::Tensor ws = at::empty({flash_moe::moe_align_workspace_ints(n, (int)num_experts)}, iopt);
  const cudaError_t err = flash_moe::moe_align(topk_ids.data_ptr<int32_t>(), n, (int)num_experts, (int)block_m,
                                               sorted.data_ptr<int32_t>(), L, experts.data_ptr<int32_t>(),
                                               ntpp.data_ptr<int32_t>(), ws.data_ptr<int32_t>(),
                                               at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
  return {sorted, experts, ntpp};
}

namespace {

struct MoeDims {
  int64_t M, K, I, E, L;
};

// The routing buffers' shapes for M tokens, E experts and top_k (moe_align's layout); returns L,
// the length of sorted_token_ids.
int64_t check_routing_shapes(const char* op, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                             const at::Tensor& num_tokens_post_padded, int64_t M, int64_t E, int64_t top_k,
                             int64_t block_m) {
  PK_CHECK(M * top_k + E * block_m < (int64_t(1) << 31), op, ": M*top_k must be below 2^31 - E*block_m, got ",
           M * top_k);
  PK_CHECK(sorted_token_ids.dim() == 1, op, ": sorted_token_ids must be 1-D, got shape ",
           sorted_token_ids.sizes());
  const int64_t L = sorted_token_ids.size(0);
  const int64_t need = aligned_length(M * top_k, E, block_m);
  PK_CHECK(L >= need && L % block_m == 0, op,
           ": sorted_token_ids must have moe_align's length ceil((M*top_k + E*(block_m-1))/block_m)*block_m = ",
           need, " (or longer, a multiple of block_m), got ", L);
  PK_CHECK(L < (int64_t(1) << 31), op, ": sorted_token_ids length must be below 2^31, got ", L);
  PK_CHECK(expert_ids.dim() == 1 && expert_ids.size(0) >= L / block_m, op,
           ": expert_ids must be 1-D with at least len(sorted_token_ids)/block_m = ", L / block_m,
           " entries, got shape ", expert_ids.sizes());
  PK_CHECK(num_tokens_post_padded.numel() >= 1, op,
           ": num_tokens_post_padded must have at least 1 element, got shape ", num_tokens_post_padded.sizes());
  return L;
}

// top_k and the CTA pairs' switch, as every GEMM op takes them.
void check_top_k_and_bpc(const char* op, int64_t top_k, int64_t bpc) {
  PK_CHECK(top_k >= 1 && top_k <= flash_moe::kMaxTopK, op, ": top_k must be in [1, ", flash_moe::kMaxTopK,
           "], got ", top_k);
  PK_CHECK(bpc == 1 || bpc == 2, op, ": bpc (CTAs per cluster) must be 1 or 2, got ", bpc);
}

// Rules both fused ops share: tuning arguments, devices, contiguity, routing buffers and the
// shapes of x / w / w2 / out / topk_weights. The dtypes are each op's own.
MoeDims check_moe_inputs(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                         const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                         const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights,
                         const at::Tensor& out, int64_t top_k, int64_t block_m, int64_t block_n, int64_t warp_n,
                         int64_t bpc, int64_t cpc, const char* xn = "x", const at::Tensor* w3 = nullptr) {
  // w3 given (the backward, or the bf16 forward on separate weights): w is w1, gate rows only,
  // and w3 the up rows, each (E, I, K).
  const char* wn = w3 ? "w1" : "w";
  PK_CHECK(block_m == flash_moe::kBlockM, op, ": block_m must be ", flash_moe::kBlockM, ", got ", block_m);
  PK_CHECK(block_n == flash_moe::kBlockN, op, ": block_n must be ", flash_moe::kBlockN, ", got ", block_n);
  PK_CHECK(warp_n == flash_moe::kWarpN, op, ": warp_n must be ", flash_moe::kWarpN, ", got ", warp_n);
  PK_CHECK(cpc == 1, op, ": cpc must be 1, got ", cpc);
  check_top_k_and_bpc(op, top_k, bpc);

  check_cuda_contig(x, op, xn);
  check_cuda_contig(w, op, wn);
  check_cuda_contig(w2, op, "w2");
  check_cuda_contig(sorted_token_ids, op, "sorted_token_ids");
  check_cuda_contig(expert_ids, op, "expert_ids");
  check_cuda_contig(num_tokens_post_padded, op, "num_tokens_post_padded");
  check_cuda_contig(topk_weights, op, "topk_weights");
  check_cuda_contig(out, op, "out");
  check_same_device(w, x, op, wn, xn);
  check_same_device(w2, x, op, "w2", xn);
  check_same_device(sorted_token_ids, x, op, "sorted_token_ids", xn);
  check_same_device(expert_ids, x, op, "expert_ids", xn);
  check_same_device(num_tokens_post_padded, x, op, "num_tokens_post_padded", xn);
  check_same_device(topk_weights, x, op, "topk_weights", xn);
  check_same_device(out, x, op, "out", xn);
  check_dtype(out, at::kBFloat16, op, "out");
  check_dtype(sorted_token_ids, at::kInt, op, "sorted_token_ids");
  check_dtype(expert_ids, at::kInt, op, "expert_ids");
  check_dtype(num_tokens_post_padded, at::kInt, op, "num_tokens_post_padded");
  check_dtype(topk_weights, at::kFloat, op, "topk_weights");

  PK_CHECK(x.dim() == 2, op, ": ", xn, " must be 2-D (M, K), got shape ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  PK_CHECK(w.dim() == 3, op, ": ", wn, " must be 3-D (E, ", w3 ? "I" : "2*I", ", K), got shape ", w.sizes());
  const int64_t E = w.size(0), N = w3 ? 2 * w.size(1) : w.size(1);
  PK_CHECK(E >= 1 && E <= flash_moe::kMaxExperts, op, ": ", wn, ".size(0) (experts) must be in [1, ",
           flash_moe::kMaxExperts, "], got ", E);
  PK_CHECK(w.size(2) == K, op, ": ", wn, ".size(2) must equal ", xn, ".size(1) = ", K, ", got ", w.size(2));
  // With w3, N = 2 * w1.size(1) is even: only its sign can be wrong.
  PK_CHECK(N % 2 == 0 && N > 0, op, ": ",
           w3 ? "w1.size(1) (I) must be > 0" : "w.size(1) must be 2*I (gate rows then up rows), even and > 0",
           ", got ", w.size(1));
  const int64_t I = N / 2;
  if (w3) {
    check_cuda_contig(*w3, op, "w3");
    check_same_device(*w3, x, op, "w3", xn);
    PK_CHECK(w3->sizes() == w.sizes(), op, ": w3 must have w1's shape ", w.sizes(), ", got ", w3->sizes());
    check_aligned16(*w3, op, "w3");
  }
  PK_CHECK(K > 0 && K % 8 == 0, op, ": ", xn, ".size(1) (K) must be a positive multiple of 8, got ", K);
  PK_CHECK(I % 8 == 0, op, ": I = ", w3 ? "w1.size(1)" : "w.size(1)/2", " must be a multiple of 8, got ", I);
  PK_CHECK(w2.dim() == 3, op, ": w2 must be 3-D (E, K, I), got shape ", w2.sizes());
  PK_CHECK(w2.size(0) == E, op, ": w2.size(0) must equal ", wn, ".size(0) = ", E, ", got ", w2.size(0));
  PK_CHECK(w2.size(1) == K, op, ": w2.size(1) must equal ", xn, ".size(1) = ", K, ", got ", w2.size(1));
  PK_CHECK(w2.size(2) == I, op, ": w2.size(2) must equal ", w3 ? "w1.size(1)" : "w.size(1)/2", " = ", I, ", got ",
           w2.size(2));
  PK_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == K, op, ": out must have shape (", M, ", ", K,
           ") like x, got ", out.sizes());
  PK_CHECK(topk_weights.dim() == 2 && topk_weights.size(0) == M && topk_weights.size(1) == top_k, op,
           ": topk_weights must have shape (M, top_k) = (", M, ", ", top_k, "), got ", topk_weights.sizes());
  const int64_t L = check_routing_shapes(op, sorted_token_ids, expert_ids, num_tokens_post_padded, M, E, top_k,
                                         block_m);
  check_aligned16(x, op, xn);
  check_aligned16(w, op, wn);
  check_aligned16(w2, op, "w2");
  check_aligned16(out, op, "out");
  return MoeDims{M, K, I, E, L};
}

// An MXFP8 scale tensor: float8_e8m0fnu, contiguous, on x's device, `numel` bytes.
void check_scales(const at::Tensor& s, const at::Tensor& x, int64_t numel, const char* op, const char* name,
                  const char* layout) {
  check_cuda_contig(s, op, name);
  check_same_device(s, x, op, name);
  check_dtype(s, at::kFloat8_e8m0fnu, op, name);
  PK_CHECK(s.numel() == numel, op, ": ", name, " must hold ", numel, " scales (", layout, "), got ", s.numel(),
           " (shape ", s.sizes(), ")");
}

// Expert-batched weight scales: pack_scales_blocked of (E, R, S), each expert packed on its own.
// Packing the (E*R, S) flattening as one matrix gives other bytes when R % 128 != 0; its size
// differs then too, so that mistake is named rather than read as the wrong scales.
void check_weight_scales(const at::Tensor& s, const at::Tensor& x, int64_t E, int64_t R, int64_t S, const char* op,
                         const char* name, const char* shape) {
  const int64_t want = E * flash_moe::mxfp8_blocked_scale_bytes(R, S);
  const int64_t flat = flash_moe::mxfp8_blocked_scale_bytes(E * R, S);
  PK_CHECK(!(s.numel() == flat && flat != want), op, ": ", name, " holds ", s.numel(),
           " scales: the (E*R, S) flattening of its ", shape, " scales packed as one matrix, which differs from",
           " packing each expert on its own when R = ", R, " is not a multiple of 128; pass the 3-D scales to",
           " pack_scales_blocked (or quantize_mxfp8(weights, blocked=True)), which packs each expert on its own");
  const std::string layout = std::string("pack_scales_blocked of the ") + shape + " scales, each expert packed on its own";
  check_scales(s, x, want, op, name, layout.c_str());
}

// The routing and shape fields every launcher's arguments share.
template <class Args>
void set_routing(Args& a, const MoeDims& d, const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                 const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, int64_t top_k,
                 at::Tensor& ws) {
  a.sorted_ids = sorted_token_ids.data_ptr<int32_t>();
  a.expert_ids = expert_ids.data_ptr<int32_t>();
  a.ntpp = num_tokens_post_padded.data_ptr<int32_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.M = d.M;
  a.K = d.K;
  a.I = d.I;
  a.E = d.E;
  a.L = d.L;
  a.top_k = (int)top_k;
  a.workspace = ws.data_ptr();
}

// ... and the forward ops' output and tuning fields.
template <class Args>
void set_forward(Args& a, at::Tensor& out, int64_t stages, int64_t bpc, bool split) {
  a.out = out.data_ptr();
  a.stages = (int)stages;
  a.bpc = (int)bpc;
  a.split = split;
}

// The saved gate/up pre-activations (fused_moe_bf16's preact, fused_moe_bf16_dgrad's input).
void check_preact(const at::Tensor& preact, const at::Tensor& x, const MoeDims& d, const char* op) {
  PK_CHECK(d.I % 64 == 0, op, ": preact needs the hidden dim I to be a multiple of 64 (the backward's 64-feature ",
           "groups), got I = ", d.I);
  check_cuda_contig(preact, op, "preact");
  check_same_device(preact, x, op, "preact");
  check_dtype(preact, at::kBFloat16, op, "preact");
  const int64_t want = flash_moe::preact_bytes(d.L, d.I) / 2;
  PK_CHECK(preact.numel() == want, op, ": preact must hold 2 * len(sorted_token_ids) * I = ", want,
           " bf16 values, got ", preact.numel(), " (shape ", preact.sizes(), ")");
  check_aligned16(preact, op, "preact");
}

}  // namespace

void fused_moe_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor& out,
                    int64_t top_k, int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                    int64_t cpc, bool split, const std::optional<at::Tensor>& preact,
                    const std::optional<at::Tensor>& w3, bool preact_only) {
  const char* op = "fused_moe_bf16";
  PK_CHECK(preact || !preact_only, op, ": preact_only=True needs preact (the pre-activations are all it computes)");
  PK_CHECK(stages >= flash_moe::kStagesMin && stages <= flash_moe::kStagesMax, op, ": stages must be in [",
           flash_moe::kStagesMin, ", ", flash_moe::kStagesMax, "], got ", stages);
  const MoeDims d = check_moe_inputs(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                     topk_weights, out, top_k, block_m, block_n, warp_n, bpc, cpc, "x",
                                     w3 ? &*w3 : nullptr);
  check_dtype(x, at::kBFloat16, op, "x");
  check_dtype(w, at::kBFloat16, op, w3 ? "w1" : "w");
  if (w3) check_dtype(*w3, at::kBFloat16, op, "w3");
  check_dtype(w2, at::kBFloat16, op, "w2");
  if (preact) check_preact(*preact, x, d, op);  // before the M == 0 return: a bad preact fails at any M
  if (d.M == 0) return;

  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor ws = at::empty({(int64_t)flash_moe::fused_moe_bf16_workspace_bytes(d.M, d.K, d.I, d.L, (int)top_k)},
                            x.options().dtype(at::kByte));
  flash_moe::FusedMoeBf16Args a{};
  a.x = x.data_ptr();
  a.w = w.data_ptr();
  a.w2 = w2.data_ptr();
  if (w3) a.w3 = w3->data_ptr();
  set_routing(a, d, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, ws);
  set_forward(a, out, stages, bpc, split);
  if (preact) a.preact = preact->data_ptr();
  a.preact_only = preact_only;
  const cudaError_t err = flash_moe::fused_moe_bf16(a, at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_moe_bf16_dgrad(
    const at::Tensor& grad_out, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2, const at::Tensor& preact,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t bpc) {
  const char* op = "fused_moe_bf16_dgrad";
  check_dtype(grad_out, at::kBFloat16, op, "grad_out");  // first: the shared rules check it as `out` too
  const MoeDims d = check_moe_inputs(op, grad_out, w1, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                     topk_weights, grad_out, top_k, flash_moe::kBlockM, flash_moe::kBlockN,
                                     flash_moe::kWarpN, bpc, 1, "grad_out", &w3);
  check_dtype(w1, at::kBFloat16, op, "w1");
  check_dtype(w3, at::kBFloat16, op, "w3");
  check_dtype(w2, at::kBFloat16, op, "w2");
  check_preact(preact, grad_out, d, op);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  auto opt = grad_out.options();
  // dA|dB and s*h: every row of the m-blocks with a live row is written (padding rows as zeros);
  // the other rows are left as allocated.
  at::Tensor grad_x = at::empty({d.M, d.K}, opt);
  at::Tensor dab = at::empty({d.L, 2 * d.I}, opt);
  at::Tensor sh = at::empty({d.L, d.I}, opt);
  at::Tensor score = at::empty({d.M, top_k}, opt.dtype(at::kFloat));
  if (d.M == 0) return {grad_x, dab, sh, score};
  at::Tensor ws =
      at::empty({(int64_t)flash_moe::fused_moe_bf16_dgrad_workspace_bytes(d.M, d.K, d.I, d.L, (int)top_k)},
                opt.dtype(at::kByte));
  flash_moe::FusedMoeBf16DgradArgs a{};
  a.grad_out = grad_out.data_ptr();
  a.w1 = w1.data_ptr();
  a.w3 = w3.data_ptr();
  a.w2 = w2.data_ptr();
  a.preact = preact.data_ptr();
  set_routing(a, d, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, ws);
  a.grad_x = grad_x.data_ptr();
  a.dab = dab.data_ptr();
  a.sh = sh.data_ptr();
  a.score = score.data_ptr<float>();
  a.bpc = (int)bpc;
  const cudaError_t err = flash_moe::fused_moe_bf16_dgrad(a, at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
  return {grad_x, dab, sh, score};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_bf16_wgrad(
    const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dab, const at::Tensor& sh,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    int64_t num_experts, int64_t top_k, int64_t bpc) {
  const char* op = "fused_moe_bf16_wgrad";
  check_cuda_contig(x, op, "x");
  check_dtype(x, at::kBFloat16, op, "x");
  PK_CHECK(x.dim() == 2, op, ": x must be 2-D (M, K), got shape ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), E = num_experts;
  PK_CHECK(K > 0 && K % 8 == 0, op, ": x.size(1) (K) must be a positive multiple of 8, got ", K);
  PK_CHECK(E >= 1 && E <= flash_moe::kMaxExperts, op, ": num_experts must be in [1, ", flash_moe::kMaxExperts,
           "], got ", E);
  check_top_k_and_bpc(op, top_k, bpc);
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&grad_out, "grad_out"}, {&dab, "dab"}, {&sh, "sh"}, {&sorted_token_ids, "sorted_token_ids"},
      {&expert_ids, "expert_ids"}, {&num_tokens_post_padded, "num_tokens_post_padded"}};
  for (const auto& [t, name] : tensors) {
    check_cuda_contig(*t, op, name);
    check_same_device(*t, x, op, name);
  }
  check_dtype(grad_out, at::kBFloat16, op, "grad_out");
  check_dtype(dab, at::kBFloat16, op, "dab");
  check_dtype(sh, at::kBFloat16, op, "sh");
  check_dtype(sorted_token_ids, at::kInt, op, "sorted_token_ids");
  check_dtype(expert_ids, at::kInt, op, "expert_ids");
  check_dtype(num_tokens_post_padded, at::kInt, op, "num_tokens_post_padded");
  PK_CHECK(grad_out.sizes() == x.sizes(), op, ": grad_out must have x's shape ", x.sizes(), ", got ",
           grad_out.sizes());
  const int64_t L = check_routing_shapes(op, sorted_token_ids, expert_ids, num_tokens_post_padded, M, E, top_k,
                                         flash_moe::kBlockM);
  PK_CHECK(sh.dim() == 2 && sh.size(0) == L && sh.size(1) > 0, op,
           ": sh must have shape (len(sorted_token_ids), I) = (", L, ", I), got ", sh.sizes());
  const int64_t I = sh.size(1);
  PK_CHECK(I % 64 == 0, op, ": I = sh.size(1) must be a multiple of 64 (the backward's 64-feature groups), got ", I);
  PK_CHECK(dab.dim() == 2 && dab.size(0) == L && dab.size(1) == 2 * I, op,
           ": dab must have shape (len(sorted_token_ids), 2*I) = (", L, ", ", 2 * I, "), got ", dab.sizes());
  for (const auto& [t, name] : tensors) check_aligned16(*t, op, name);
  check_aligned16(x, op, "x");

  const c10::cuda::CUDAGuard guard(x.device());
  auto opt = x.options();
  at::Tensor grad_w1 = at::empty({E, I, K}, opt), grad_w3 = at::empty({E, I, K}, opt);
  at::Tensor grad_w2 = at::empty({E, K, I}, opt);
  at::Tensor ws = at::empty({(int64_t)flash_moe::fused_moe_bf16_wgrad_workspace_bytes(E, L)}, opt.dtype(at::kByte));
  flash_moe::FusedMoeBf16WgradArgs a{};
  a.x = x.data_ptr();
  a.grad_out = grad_out.data_ptr();
  a.dab = dab.data_ptr();
  a.sh = sh.data_ptr();
  a.sorted_ids = sorted_token_ids.data_ptr<int32_t>();
  a.expert_ids = expert_ids.data_ptr<int32_t>();
  a.ntpp = num_tokens_post_padded.data_ptr<int32_t>();
  a.grad_w1 = grad_w1.data_ptr();
  a.grad_w3 = grad_w3.data_ptr();
  a.grad_w2 = grad_w2.data_ptr();
  a.M = M;
  a.K = K;
  a.I = I;
  a.E = E;
  a.L = L;
  a.top_k = (int)top_k;
  a.bpc = (int)bpc;
  a.workspace = ws.data_ptr();
  const cudaError_t err = flash_moe::fused_moe_bf16_wgrad(a, at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
  return {grad_w1, grad_w3, grad_w2};
}

void fused_moe_mxfp8(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                     const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                     const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                     const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor& out,
                     int64_t top_k, int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                     int64_t cpc, bool split) {
  const char* op = "fused_moe_mxfp8";
  PK_CHECK(stages == flash_moe::kMxfp8Stages, op, ": stages must be ", flash_moe::kMxfp8Stages,
           " (the only pipeline depth the MXFP8 kernel is built for), got ", stages);
  const MoeDims d = check_moe_inputs(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                     topk_weights, out, top_k, block_m, block_n, warp_n, bpc, cpc);
  check_dtype(x, at::kFloat8_e4m3fn, op, "x");
  check_dtype(w, at::kFloat8_e4m3fn, op, "w");
  check_dtype(w2, at::kFloat8_e4m3fn, op, "w2");
  const int64_t blk = flash_moe::kMxfp8ScaleBlock, kblk = flash_moe::kMxfp8KBlock;
  PK_CHECK(d.K % kblk == 0, op, ": x.size(1) (K) must be a multiple of 64 (the MXFP8 kernel's K block), got ", d.K);
  PK_CHECK(d.I % kblk == 0, op, ": I = w.size(1)/2 must be a multiple of 64 (the MXFP8 kernel's K block), got ",
           d.I);
  PK_CHECK(x_scales.dim() == 2 && x_scales.size(0) == d.M && x_scales.size(1) == d.K / blk, op,
           ": x_scales must have shape (M, K/32) = (", d.M, ", ", d.K / blk, "), row-major, got ", x_scales.sizes());
  check_scales(x_scales, x, d.M * (d.K / blk), op, "x_scales", "row-major (M, K/32)");
  check_weight_scales(w_scales, x, d.E, 2 * d.I, d.K / blk, op, "w_scales", "(E, 2I, K/32)");
  check_weight_scales(w2_scales, x, d.E, d.K, d.I / blk, op, "w2_scales", "(E, K, I/32)");
  check_aligned16(w_scales, op, "w_scales");
  check_aligned16(w2_scales, op, "w2_scales");
  if (d.M == 0) return;

  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor ws = at::empty({(int64_t)flash_moe::fused_moe_mxfp8_workspace_bytes(d.M, d.K, d.I, d.E, d.L, (int)top_k)},
                            x.options().dtype(at::kByte));
  flash_moe::FusedMoeMxfp8Args a{};
  a.x = x.data_ptr();
  a.x_scales = static_cast<const uint8_t*>(x_scales.data_ptr());
  a.w = w.data_ptr();
  a.w_scales = static_cast<const uint8_t*>(w_scales.data_ptr());
  a.w2 = w2.data_ptr();
  a.w2_scales = static_cast<const uint8_t*>(w2_scales.data_ptr());
  set_routing(a, d, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k, ws);
  set_forward(a, out, stages, bpc, split);
  // Test and debug switch: FLASH_MOE_MXFP8_GENERAL=1 disables the f16 scale-window gate/up GEMM
  // (same output bits, slower; see the op's docstring).
  const char* general = std::getenv("FLASH_MOE_MXFP8_GENERAL");
  a.f16_window = !(general != nullptr && general[0] != '\0' && general[0] != '0');
  const cudaError_t err = flash_moe::fused_moe_mxfp8(a, at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& t, bool blocked) {
  const char* op = "quantize_mxfp8";
  check_cuda_contig(t, op, "t");
  PK_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, op,
           ": t must have dtype BFloat16 or Float, got ", t.scalar_type());
  PK_CHECK(t.dim() >= 1, op, ": t must have at least 1 dimension, got shape ", t.sizes());
  const int64_t K = t.size(-1);
  PK_CHECK(K > 0 && K % flash_moe::kMxfp8ScaleBlock == 0, op,
           ": t.size(-1) must be a positive multiple of 32 (the MXFP8 scale block), got ", K);
  check_aligned16(t, op, "t");
  const int64_t R = t.numel() / K, S = K / flash_moe::kMxfp8ScaleBlock;
  // blocked: each (mat_rows, S) matrix of the leading indices packed on its own; a 1-D t is one row.
  const int64_t mat_rows = t.dim() >= 2 ? t.size(-2) : 1;
  const int64_t mats = mat_rows > 0 ? R / mat_rows : 0;
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor vals = at::empty(t.sizes(), t.options().dtype(at::kFloat8_e4m3fn));
  std::vector<int64_t> sshape(t.sizes().begin(), t.sizes().end());
  sshape.back() = S;
  at::Tensor scales = blocked ? at::empty({mats * flash_moe::mxfp8_blocked_scale_bytes(mat_rows, S)},
                                          t.options().dtype(at::kFloat8_e8m0fnu))
                              : at::empty(sshape, t.options().dtype(at::kFloat8_e8m0fnu));
  const cudaError_t err = flash_moe::quantize_mxfp8(
      t.data_ptr(), t.scalar_type() == at::kBFloat16 ? flash_moe::FloatKind::kBf16 : flash_moe::FloatKind::kFp32, R,
      K, static_cast<uint8_t*>(vals.data_ptr()), static_cast<uint8_t*>(scales.data_ptr()), mat_rows, blocked,
      at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
  return {vals, scales};
}

at::Tensor dequantize_mxfp8(const at::Tensor& vals, const at::Tensor& scales) {
  const char* op = "dequantize_mxfp8";
  check_cuda_contig(vals, op, "vals");
  check_dtype(vals, at::kFloat8_e4m3fn, op, "vals");
  PK_CHECK(vals.dim() >= 1, op, ": vals must have at least 1 dimension, got shape ", vals.sizes());
  const int64_t K = vals.size(-1);
  PK_CHECK(K > 0 && K % flash_moe::kMxfp8ScaleBlock == 0, op,
           ": vals.size(-1) must be a positive multiple of 32 (the MXFP8 scale block), got ", K);
  std::vector<int64_t> sshape(vals.sizes().begin(), vals.sizes().end());
  sshape.back() = K / flash_moe::kMxfp8ScaleBlock;
  PK_CHECK(scales.sizes().vec() == sshape, op, ": scales must have shape vals.shape[:-1] + (K/32,) = ",
           at::IntArrayRef(sshape), " (row-major), got ", scales.sizes());
  check_cuda_contig(scales, op, "scales");
  check_same_device(scales, vals, op, "scales", "vals");
  check_dtype(scales, at::kFloat8_e8m0fnu, op, "scales");
  check_aligned16(vals, op, "vals");
  const c10::cuda::CUDAGuard guard(vals.device());
  at::Tensor out = at::empty(vals.sizes(), vals.options().dtype(at::kBFloat16));
  const cudaError_t err =
      flash_moe::dequantize_mxfp8(static_cast<const uint8_t*>(vals.data_ptr()),
                                  static_cast<const uint8_t*>(scales.data_ptr()), vals.numel() / K, K,
                                  out.data_ptr(), at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorString(err));
  return out;
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("moe_align(Tensor topk_ids, int num_experts, int block_m, int bpc) -> (Tensor, Tensor, Tensor)");
  ops.impl("moe_align", torch::kCUDA, &moe_align);
  // CPU tensors reach the same checks, so they get "<arg> must be a CUDA tensor" and never run.
  ops.impl("moe_align", torch::kCPU, &moe_align);
  ops.def(
      "fused_moe_bf16(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
      "Tensor num_tokens_post_padded, Tensor topk_weights, Tensor(a!) out, int top_k, int block_m, int block_n, "
      "int warp_n, int stages, int bpc, int cpc, bool split, Tensor(b!)? preact=None, Tensor? w3=None, "
      "bool preact_only=False) -> ()");
  ops.impl("fused_moe_bf16", torch::kCUDA, &fused_moe_bf16);
  ops.impl("fused_moe_bf16", torch::kCPU, &fused_moe_bf16);
  ops.def(
      "fused_moe_bf16_dgrad(Tensor grad_out, Tensor w1, Tensor w3, Tensor w2, Tensor preact, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, int top_k, int bpc) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  ops.impl("fused_moe_bf16_dgrad", torch::kCUDA, &fused_moe_bf16_dgrad);
  ops.impl("fused_moe_bf16_dgrad", torch::kCPU, &fused_moe_bf16_dgrad);
  ops.def(
      "fused_moe_bf16_wgrad(Tensor x, Tensor grad_out, Tensor dab, Tensor sh, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded, int num_experts, int top_k, int bpc) "
      "-> (Tensor, Tensor, Tensor)");
  ops.impl("fused_moe_bf16_wgrad", torch::kCUDA, &fused_moe_bf16_wgrad);
  ops.impl("fused_moe_bf16_wgrad", torch::kCPU, &fused_moe_bf16_wgrad);
  ops.def(
      "fused_moe_mxfp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor w2, Tensor w2_scales, "
      "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, "
      "Tensor(a!) out, int top_k, int block_m, int block_n, int warp_n, int stages, int bpc, int cpc, bool split) -> ()");
  ops.impl("fused_moe_mxfp8", torch::kCUDA, &fused_moe_mxfp8);
  ops.impl("fused_moe_mxfp8", torch::kCPU, &fused_moe_mxfp8);
  ops.def("quantize_mxfp8(Tensor t, bool blocked) -> (Tensor, Tensor)");
  ops.impl("quantize_mxfp8", torch::kCUDA, &quantize_mxfp8);
  ops.def("dequantize_mxfp8(Tensor vals, Tensor scales) -> Tensor");
  ops.impl("dequantize_mxfp8", torch::kCUDA, &dequantize_mxfp8);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
