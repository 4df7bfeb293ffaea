#pragma once

#include <optional>
#include <tuple>

#include <torch/all.h>

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align(const at::Tensor& topk_ids, int64_t num_experts,
                                                         int64_t block_m, int64_t bpc);

void fused_moe_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w2,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor& out,
                    int64_t top_k, int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                    int64_t cpc, bool split, const std::optional<at::Tensor>& preact,
                    const std::optional<at::Tensor>& w3, bool preact_only);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_moe_bf16_dgrad(
    const at::Tensor& grad_out, const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2, const at::Tensor& preact,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    const at::Tensor& topk_weights, int64_t top_k, int64_t bpc);

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_bf16_wgrad(
    const at::Tensor& x, const at::Tensor& grad_out, const at::Tensor& dab, const at::Tensor& sh,
    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded,
    int64_t num_experts, int64_t top_k, int64_t bpc);

void fused_moe_mxfp8(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                     const at::Tensor& w_scales, const at::Tensor& w2, const at::Tensor& w2_scales,
                     const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                     const at::Tensor& num_tokens_post_padded, const at::Tensor& topk_weights, at::Tensor& out,
                     int64_t top_k, int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                     int64_t cpc, bool split);

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& t, bool blocked);

at::Tensor dequantize_mxfp8(const at::Tensor& vals, const at::Tensor& scales);
