// CUDA kernel for the decode of sparse (value, index) payloads,
// TfgcScatterAddPayloads (see sparsify.h and sparsify_kernels.cc for the CPU
// semantics). The selection ops of the family (TfgcSparsifyWithResidual,
// TfgcSparsifyByThreshold) have no GPU kernels yet: they need a GPU
// radix-select.
//
// Layout as in sign_bits_gpu.cu.cc: a TensorFlow-free part (kernels, C++
// launchers, extern "C" wrappers for ctypes) and a `#if GOOGLE_CUDA` part with
// the TF functor specialisation.
//
// Decode = validate, then scatter:
//   1. every index is checked against [0, n) on the device; a bad one raises
//      a flag that is copied back to the host (one stream sync) before
//      anything is written, so a malformed payload is rejected with
//      InvalidArgument and never causes an out-of-bounds write;
//   2. the output (or, for float16 / bfloat16, a float32 scratch) is zeroed
//      and every value is added with a float32 atomicAdd;
//   3. half types: the float32 sums are rounded once to T.
// Difference from the CPU op: floating-point atomics add in whatever order
// the hardware serialises them, so entries named by several payload slots
// can differ from the CPU's in-order sum by rounding (and between runs).
// Entries named once are exact (+0 + v, so -0.0 becomes +0.0 as on the CPU),
// and NaN / Inf propagate the same way (an Inf - Inf pair gives NaN in any
// order).

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {
namespace {

constexpr int kBadIndex = 1;

__global__ void ValidateIndicesKernel(const int32_t* __restrict__ indices,
                                      int64_t m, int64_t n,
                                      int* __restrict__ flag) {
  int bad = 0;
  for (int64_t j = GlobalThread(); j < m; j += GlobalThreads()) {
    const int64_t i = indices[j];
    if (i < 0 || i >= n) bad = kBadIndex;
  }
  if (bad) atomicOr(flag, bad);
}

template <int D>
__global__ void ScatterAddKernel(const typename Codec<D>::Raw* __restrict__ values,
                                 const int32_t* __restrict__ indices, int64_t m,
                                 float* __restrict__ acc) {
  for (int64_t j = GlobalThread(); j < m; j += GlobalThreads()) {
    atomicAdd(acc + indices[j], Codec<D>::ToFloat(values[j]));
  }
}

template <int D>
__global__ void RoundKernel(const float* __restrict__ acc, int64_t n,
                            typename Codec<D>::Raw* __restrict__ out) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    out[i] = Codec<D>::FromFloat(acc[i]);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free).

// Float32 accumulator bytes the scatter needs for dtype (0 for float32,
// which accumulates in the output).
int64_t ScatterAddScratchBytes(int dtype, int64_t n) {
  return dtype == kFloat32 || n <= 0 ? 0 : n * static_cast<int64_t>(sizeof(float));
}

// *bad (host) <- 1 if some index is outside [0, n). flag_dev: one device int.
// Synchronises the stream.
cudaError_t ScatterAddValidate(const int32_t* indices, int64_t m, int64_t n,
                               int* flag_dev, int* bad, cudaStream_t stream) {
  *bad = 0;
  if (m <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(flag_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  ValidateIndicesKernel<<<NumBlocks(m), kThreads, 0, stream>>>(indices, m, n,
                                                               flag_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(bad, flag_dev, sizeof(int), cudaMemcpyDeviceToHost,
                        stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// out[n] <- scatter-add of already validated indices. scratch:
// ScatterAddScratchBytes(D, n) bytes (null for float32).
template <int D>
cudaError_t ScatterAdd(const void* values, const int32_t* indices, int64_t m,
                       int64_t n, void* scratch, void* out,
                       cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (n <= 0) return cudaSuccess;
  float* acc = D == kFloat32 ? static_cast<float*>(out)
                             : static_cast<float*>(scratch);
  cudaError_t err = cudaMemsetAsync(acc, 0, n * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (m > 0) {
    ScatterAddKernel<D><<<NumBlocks(m), kThreads, 0, stream>>>(
        static_cast<const Raw*>(values), indices, m, acc);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (D != kFloat32) {
    RoundKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
        acc, n, static_cast<Raw*>(out));
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers (ctypes). Return a cudaError_t, 0 = success.
//
// Call tfgc_cuda_scatter_add_validate (flag_dev: one device int; it
// synchronises) and reject the payload if *bad; otherwise call
// tfgc_cuda_scatter_add with tfgc_cuda_scatter_add_scratch_bytes(dtype, n)
// bytes of scratch. m and n as in the OpKernel: n <= 2^31, indices int32.

extern "C" {

int64_t tfgc_cuda_scatter_add_scratch_bytes(int dtype, int64_t n) {
  return tfgc::cuda::ScatterAddScratchBytes(dtype, n);
}

int tfgc_cuda_scatter_add_validate(const int32_t* indices, int64_t m,
                                   int64_t n, int* flag_dev, int* bad,
                                   cudaStream_t stream) {
  return tfgc::cuda::ScatterAddValidate(indices, m, n, flag_dev, bad, stream);
}

int tfgc_cuda_scatter_add(int dtype, const void* values, const int32_t* indices,
                          int64_t m, int64_t n, void* scratch, void* out,
                          cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::ScatterAdd, values, indices, m,
                           n, scratch, out, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functor (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/sparsify.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "custom_ops/cc/kernels/gpu_tf_util.h"

namespace tfgc {
namespace functor {
namespace {

using GPUDevice = Eigen::GpuDevice;
using gpu_tf::CudaDType;
using gpu_tf::CudaStatus;
using gpu_tf::ScratchBytes;
using gpu_tf::StreamOf;

}  // namespace

template <typename T>
struct ScatterAddPayloadsFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* values,
                          const int32_t* indices, int64_t m, int64_t n,
                          T* out) {
    constexpr int kCode = CudaDType<T>::kCode;
    const cudaStream_t stream = ctx->eigen_device<GPUDevice>().stream();
    tensorflow::Tensor flag;
    void* flag_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(ctx, sizeof(int), &flag, &flag_ptr));
    int bad = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::ScatterAddValidate(indices, m, n, static_cast<int*>(flag_ptr),
                                 &bad, stream),
        "TfgcScatterAddPayloads"));
    if (bad) {
      return tensorflow::errors::InvalidArgument(
          "an index of the payload is not in [0, ", n, ")");
    }
    tensorflow::Tensor acc;
    void* acc_ptr = nullptr;
    const int64_t bytes = cuda::ScatterAddScratchBytes(kCode, n);
    if (bytes > 0) {
      TF_RETURN_IF_ERROR(ScratchBytes(ctx, bytes, &acc, &acc_ptr));
    }
    return CudaStatus(
        cuda::ScatterAdd<kCode>(values, indices, m, n, acc_ptr, out, stream),
        "TfgcScatterAddPayloads");
  }
};

template struct ScatterAddPayloadsFunctor<GPUDevice, float>;
template struct ScatterAddPayloadsFunctor<GPUDevice, Eigen::half>;
template struct ScatterAddPayloadsFunctor<GPUDevice, Eigen::bfloat16>;

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
