// Stands in for MLX's own device header when tests/test_cuda_compile.py compiles our kernels with
// NVRTC on a machine without MLX's CUDA backend: the parts our kernels use (the shape and strides
// types of mx.fast.cuda_kernel's parameters, as MLX 0.32 defines them) and the CUDA headers it
// includes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>

namespace mlx::core::cu {
#define MAX_NDIM 8
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
