#pragma once

#include <torch/all.h>

torch::Tensor scale(torch::Tensor const& x, double alpha);
