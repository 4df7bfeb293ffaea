#include <torch/library.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <string>

#include "registration.h"
#include "torch_binding.h"
#include "torch_check.h"
#include "rmsnorm_cuda/rmsnorm.cuh"

namespace {

void check_cuda_bf16(const char* op, const char* name, const torch::Tensor& t, int64_t rank) {
  PK_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  PK_CHECK(t.scalar_type() == at::kBFloat16, op, ": ", name, " must be bfloat16, got ",
           t.scalar_type());
  PK_CHECK(t.dim() == rank, op, ": ", name, " must have rank ", rank, ", got rank ", t.dim(),
           " (shape ", t.sizes(), ")");
  PK_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

void check_hidden(const char* op, const char* name, int64_t C) {
  PK_CHECK(C >= 32 && C % 32 == 0, op, ": ", name,
           " must have a last dimension C that is a positive multiple of 32, got C=", C);
  PK_CHECK(C <= rmsnorm::kMaxC, op, ": ", name, " must have C <= ", rmsnorm::kMaxC,
           ", got C=", C);
}

void check_same_device(const char* op, const char* name, const torch::Tensor& t,
                       const torch::Tensor& ref, const char* ref_name) {
  PK_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ",
           ref_name, " (", ref.device(), "), got ", t.device());
}

// The checks the three ops share: `x` (residual or grad_y, named x_name) and branch are (N, C)
// bf16 CUDA tensors of one shape, weight is (C,) bf16, C a multiple of 32 up to kMaxC, all on
// branch's device.  The dtype/rank/contiguity checks run in the op's argument order
// (x_first: grad_y comes before branch in the backward), so each op reports the first bad
// argument first.  Returns C.
int64_t check_norm_inputs(const char* op, const torch::Tensor& branch, const char* x_name,
                          const torch::Tensor& x, const torch::Tensor& weight, bool x_first) {
  if (x_first) check_cuda_bf16(op, x_name, x, 2);
  check_cuda_bf16(op, "branch", branch, 2);
  if (!x_first) check_cuda_bf16(op, x_name, x, 2);
  check_cuda_bf16(op, "weight", weight, 1);
  const int64_t C = branch.size(1);
  check_hidden(op, "branch", C);
  PK_CHECK(x.sizes() == branch.sizes(), op, ": ", x_name, " must have the shape of branch ",
           branch.sizes(), ", got ", x.sizes());
  PK_CHECK(weight.size(0) == C, op, ": weight must have C=", C, " elements, got ",
           weight.size(0));
  check_same_device(op, x_name, x, branch, "branch");
  check_same_device(op, "weight", weight, branch, "branch");
  return C;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fused_rmsnorm_residual(
    const torch::Tensor& branch, const torch::Tensor& residual, const torch::Tensor& weight,
    double epsilon) {
  constexpr const char* op = "fused_rmsnorm_residual";
  const int64_t C = check_norm_inputs(op, branch, "residual", residual, weight, false);
  const int64_t N = branch.size(0);
  PK_CHECK(std::isfinite(epsilon) && epsilon >= 0.0, op,
           ": epsilon must be finite and >= 0, got ", std::to_string(epsilon));

  const c10::cuda::CUDAGuard guard(branch.device());
  auto opts = branch.options();
  torch::Tensor vals = torch::empty({N, C}, opts.dtype(at::kFloat8_e4m3fn));
  torch::Tensor scales =
      torch::empty({rmsnorm::scales_bytes(N, C)}, opts.dtype(at::kFloat8_e8m0fnu));
  torch::Tensor rrms = torch::empty({N}, opts.dtype(at::kFloat));
  if (N == 0) return {vals, scales, rrms};
  const cudaError_t err = rmsnorm::fused_rmsnorm_residual_forward(
      branch.data_ptr(), residual.data_ptr(), weight.data_ptr(),
      reinterpret_cast<uint8_t*>(vals.data_ptr()), reinterpret_cast<uint8_t*>(scales.data_ptr()),
      rrms.data_ptr<float>(), N, C, static_cast<float>(epsilon),
      at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {vals, scales, rrms};
}

std::tuple<torch::Tensor, torch::Tensor> fused_rmsnorm_residual_backward(
    const torch::Tensor& grad_y, const torch::Tensor& branch, const torch::Tensor& weight,
    const torch::Tensor& rrms) {
  constexpr const char* op = "fused_rmsnorm_residual_backward";
  const int64_t C = check_norm_inputs(op, branch, "grad_y", grad_y, weight, true);
  const int64_t N = branch.size(0);
  PK_CHECK(rrms.is_cuda(), op, ": rrms must be a CUDA tensor, got device ", rrms.device());
  PK_CHECK(rrms.scalar_type() == at::kFloat, op, ": rrms must be float32, got ",
           rrms.scalar_type());
  PK_CHECK(rrms.dim() == 1 && rrms.size(0) == N, op, ": rrms must have shape (N,) = (", N,
           ",), got ", rrms.sizes());
  PK_CHECK(rrms.is_contiguous(), op, ": rrms must be contiguous, got strides ", rrms.strides());
  check_same_device(op, "rrms", rrms, branch, "branch");

  const c10::cuda::CUDAGuard guard(branch.device());
  auto opts = branch.options();
  torch::Tensor grad_branch = torch::empty({N, C}, opts);
  torch::Tensor grad_weight = torch::empty({C}, opts);
  const int device = branch.get_device();
  const int64_t ws = rmsnorm::backward_workspace_floats(N, C, device);
  torch::Tensor workspace = torch::empty({ws > 0 ? ws : 1}, opts.dtype(at::kFloat));
  const cudaError_t err = rmsnorm::fused_rmsnorm_residual_backward(
      grad_y.data_ptr(), branch.data_ptr(), weight.data_ptr(), rrms.data_ptr<float>(),
      grad_branch.data_ptr(), grad_weight.data_ptr(), workspace.data_ptr<float>(), N, C, device,
      at::cuda::getCurrentCUDAStream());
  PK_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {grad_branch, grad_weight};
}

// A zero-cost bf16 (N, C) handle whose gradient is the STE gradient of y (see __init__.py): the
// value is a broadcast zero (no storage of its own); its autograd backward runs the backward op.
torch::Tensor fused_rmsnorm_residual_grad_port(const torch::Tensor& branch,
                                               const torch::Tensor& residual,
                                               const torch::Tensor& weight,
                                               const torch::Tensor& rrms) {
  constexpr const char* op = "fused_rmsnorm_residual_grad_port";
  const int64_t C = check_norm_inputs(op, branch, "residual", residual, weight, false);
  const int64_t N = branch.size(0);
  PK_CHECK(rrms.scalar_type() == at::kFloat && rrms.dim() == 1 && rrms.size(0) == N, op,
           ": rrms must be float32 of shape (", N, ",), got ", rrms.scalar_type(), " ",
           rrms.sizes());
  return torch::zeros({}, branch.options()).expand({N, C});
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def(
      "fused_rmsnorm_residual(Tensor branch, Tensor residual, Tensor weight, float epsilon=1e-06)"
      " -> (Tensor vals, Tensor scales, Tensor rrms)");
  ops.impl("fused_rmsnorm_residual", torch::kCUDA, &fused_rmsnorm_residual);
  ops.def(
      "fused_rmsnorm_residual_backward(Tensor grad_y, Tensor branch, Tensor weight, Tensor rrms)"
      " -> (Tensor grad_branch, Tensor grad_weight)");
  ops.impl("fused_rmsnorm_residual_backward", torch::kCUDA, &fused_rmsnorm_residual_backward);
  ops.def(
      "fused_rmsnorm_residual_grad_port(Tensor branch, Tensor residual, Tensor weight, Tensor rrms)"
      " -> Tensor");
  ops.impl("fused_rmsnorm_residual_grad_port", torch::kCUDA, &fused_rmsnorm_residual_grad_port);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
