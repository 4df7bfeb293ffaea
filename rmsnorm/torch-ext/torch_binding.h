#pragma once

#include <torch/all.h>

#include <tuple>

// docs/DESIGN.md §7.  branch, residual: (N, C) bf16; weight: (C,) bf16.
// Returns (vals (N, C) float8_e4m3fn, scales (roundup(N,128)*roundup(C/32,4),) float8_e8m0fnu in
// the blocked layout, rrms (N,) float32).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fused_rmsnorm_residual(
    const torch::Tensor& branch, const torch::Tensor& residual, const torch::Tensor& weight,
    double epsilon);

// Backward with the quantisation passed straight through.  grad_y, branch: (N, C) bf16;
// weight: (C,) bf16; rrms: (N,) float32.  Returns (grad_branch (N, C) bf16, grad_weight (C,) bf16).
// grad_residual is grad_y itself.
std::tuple<torch::Tensor, torch::Tensor> fused_rmsnorm_residual_backward(
    const torch::Tensor& grad_y, const torch::Tensor& branch, const torch::Tensor& weight,
    const torch::Tensor& rrms);

// Zero-cost bf16 (N, C) handle (a broadcast zero) whose autograd gradient is d loss / d y.
torch::Tensor fused_rmsnorm_residual_grad_port(const torch::Tensor& branch,
                                               const torch::Tensor& residual,
                                               const torch::Tensor& weight,
                                               const torch::Tensor& rrms);
