// TensorFlow-side helpers shared by the GPU functors of tfgc's ops: dtype codes
// for the TF-free launchers, CUDA error -> Status, the op's stream, scratch
// memory. Only used (and only compiled) in a CUDA-enabled TensorFlow build;
// the launchers themselves live in gpu_common.cuh and the *_gpu.cu.cc files.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_GPU_TF_UTIL_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_GPU_TF_UTIL_H_

#if GOOGLE_CUDA
#ifndef EIGEN_USE_GPU
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <cstdint>

#include "custom_ops/cc/kernels/gpu_common.cuh"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"

namespace tfgc {
namespace gpu_tf {

using GPUDevice = Eigen::GpuDevice;

// The launchers' dtype code of a TensorFlow element type.
template <typename T>
struct CudaDType;
template <>
struct CudaDType<float> {
  static constexpr int kCode = cuda::kFloat32;
};
template <>
struct CudaDType<Eigen::half> {
  static constexpr int kCode = cuda::kFloat16;
};
template <>
struct CudaDType<Eigen::bfloat16> {
  static constexpr int kCode = cuda::kBFloat16;
};

inline cudaStream_t StreamOf(tensorflow::OpKernelContext* ctx) {
  return ctx->eigen_device<GPUDevice>().stream();
}

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return tensorflow::errors::Internal(what, ": ", cudaGetErrorString(err));
}

// Device scratch of at least `bytes` bytes, owned by `t` for the op's lifetime.
inline absl::Status ScratchBytes(tensorflow::OpKernelContext* ctx, int64_t bytes,
                                 tensorflow::Tensor* t, void** ptr) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      tensorflow::DT_INT8, tensorflow::TensorShape({std::max<int64_t>(bytes, 8)}), t));
  *ptr = t->flat<int8_t>().data();
  return absl::OkStatus();
}

}  // namespace gpu_tf
}  // namespace tfgc

#endif  // GOOGLE_CUDA
#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_GPU_TF_UTIL_H_
