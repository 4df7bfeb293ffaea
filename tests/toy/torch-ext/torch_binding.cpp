#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "registration.h"
#include "torch_binding.h"

cudaError_t launch_scale(const float* x, float* y, float alpha, int64_t n, cudaStream_t stream);

torch::Tensor scale(torch::Tensor const& x, double alpha) {
  TORCH_CHECK(x.is_cuda(), "scale: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scale: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "scale: x must be contiguous");
  // Numbers go into messages as strings: streaming an integer into a TORCH_CHECK message
  // segfaulted on the H200 image (see torch-ext/prime_kernels/builder.py).
  TORCH_CHECK(x.dim() == 1, "scale: x must be 1-D, got ", std::to_string(x.dim()), " dimensions");
  c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  auto err = launch_scale(x.data_ptr<float>(), y.data_ptr<float>(), static_cast<float>(alpha), x.numel(),
                          c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "scale: launch failed: ", cudaGetErrorString(err));
  return y;
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def("scale(Tensor x, float alpha) -> Tensor");
  ops.impl("scale", torch::kCUDA, &scale);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
