// CUDA kernels for the sign-bit op family (see sign_bits.h for the layout and
// sign_bits_kernels.cc for the CPU semantics they reproduce).
//
// Two layers in one translation unit:
//   1. TensorFlow-free: __global__ kernels, C++ launchers in tfgc::cuda and
//      extern "C" wrappers taking raw device pointers and a cudaStream_t.
//      Plain `nvcc -c` compiles this part (scripts/check_cuda.sh) and the
//      harness in custom_ops/cuda_harness/ calls the wrappers through ctypes.
//   2. `#if GOOGLE_CUDA`: the GPU functor specialisations used by the
//      OpKernels in sign_bits_kernels.cc when TensorFlow is built with CUDA.
//
// Semantics match the CPU kernels: bit = (x >= 0) (NaN -> 0, -0.0 -> 1), LSB
// first, padding bits 0; 1-bit quantisation with per-column class means from
// double sums (short runs summed in float first, like the CPU), residual
// against the mean rounded to T. Sums run in a fixed order, so results are
// deterministic; they may differ from the CPU's in the last float32 ulp
// because the summation order differs. Unlike the CPU kernels (which run
// with TensorFlow's denormal flushing), subnormals are not flushed here.

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {
namespace {

// Rows summed in float before being added to the double totals (as the CPU
// kernels' kFlushRows).
constexpr int64_t kFlushRows = 128;
// The statistics pass views narrow matrices as [vrows, lanes] with lanes a
// multiple of cols, so that a warp always has enough adjacent columns to read
// coalesced.
constexpr int64_t kMinLanes = 128;
// View rows per statistics chunk; chunks are the second grid dimension.
constexpr int64_t kMinChunkRows = 256;
constexpr int64_t kMaxChunks = 16384;

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// Shape of the statistics pass for a [rows, cols] matrix (rows, cols > 0).
struct StatsPlan {
  int64_t lanes, vrows, chunk_rows, chunks;
  // True when every column is summed by a single thread, which can then
  // store its means directly (no scratch, no combine pass).
  bool direct;
  int64_t scratch_doubles;
};

StatsPlan PlanStats(int64_t rows, int64_t cols) {
  StatsPlan p;
  const int64_t n = rows * cols;
  p.lanes = cols >= kMinLanes ? cols : cols * CeilDiv(kMinLanes, cols);
  p.vrows = CeilDiv(n, p.lanes);
  p.chunk_rows = std::max(kMinChunkRows, CeilDiv(p.vrows, kMaxChunks));
  p.chunks = CeilDiv(p.vrows, p.chunk_rows);
  p.direct = p.chunks == 1 && p.lanes == cols;
  p.scratch_doubles = p.direct ? 0 : 3 * p.chunks * p.lanes;
  return p;
}

template <int D>
__global__ void PackSignBitsKernel(const typename Codec<D>::Raw* __restrict__ x,
                                   int64_t n, int64_t num_words,
                                   int32_t* __restrict__ words) {
  // One warp per word: lane b reads element 32 w + b (coalesced) and the
  // ballot assembles the word with lane b's vote in bit b, i.e. LSB first.
  const int lane = threadIdx.x & 31;
  const int64_t first = GlobalThread() >> 5;
  const int64_t stride = GlobalThreads() >> 5;
  for (int64_t w = first; w < num_words; w += stride) {
    const int64_t i = w * 32 + lane;
    const bool bit = i < n && Codec<D>::ToFloat(x[i]) >= 0.0f;
    const unsigned word = __ballot_sync(0xffffffffu, bit);
    if (lane == 0) words[w] = static_cast<int32_t>(word);
  }
}

template <int D>
__global__ void UnpackSignBitsKernel(const int32_t* __restrict__ words,
                                     int64_t n,
                                     typename Codec<D>::Raw* __restrict__ out) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    const bool bit = (static_cast<uint32_t>(words[i >> 5]) >> (i & 31)) & 1u;
    out[i] = Codec<D>::FromFloat(bit ? 1.0f : -1.0f);
  }
}

// Class sums of view lane `lane` over view rows [r0, r1) (element index
// r * lanes + lane, skipped past n). Float runs of kFlushRows, double totals.
// Out-of-class values contribute nothing, so an infinity stays in its class.
template <int D>
__device__ void SumLane(const typename Codec<D>::Raw* __restrict__ x,
                        int64_t n, int64_t lanes, int64_t lane, int64_t r0,
                        int64_t r1, double* ps, double* ns, double* pc) {
  double tps = 0.0, tns = 0.0, tpc = 0.0;
  for (int64_t rb = r0; rb < r1; rb += kFlushRows) {
    const int64_t re = min(r1, rb + kFlushRows);
    float fps = 0.0f, fns = 0.0f;
    int cnt = 0;
    for (int64_t r = rb; r < re; ++r) {
      const int64_t i = r * lanes + lane;
      if (i >= n) break;  // only the last view row is ragged
      const float f = Codec<D>::ToFloat(x[i]);
      if (f >= 0.0f) {
        fps += f;
        ++cnt;
      } else {
        fns += f;  // NaN lands here, as on the CPU
      }
    }
    tps += fps;
    tns += fns;
    tpc += cnt;
  }
  *ps = tps;
  *ns = tns;
  *pc = tpc;
}

// Mean of a class from its sum and count; an empty class has mean 0.
__device__ __forceinline__ float ClassMean(double sum, double count) {
  return static_cast<float>(sum / (count > 0.0 ? count : 1.0));
}

template <int D>
__global__ void ColumnStatsKernel(const typename Codec<D>::Raw* __restrict__ x,
                                  int64_t n, int64_t rows, int64_t lanes,
                                  int64_t vrows, int64_t chunk_rows,
                                  bool direct, double* __restrict__ partial,
                                  float* __restrict__ pos_mean,
                                  float* __restrict__ neg_mean) {
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * chunk_rows;
  const int64_t r1 = min(vrows, r0 + chunk_rows);
  for (int64_t lane = GlobalThread(); lane < lanes; lane += GlobalThreads()) {
    double ps, ns, pc;
    SumLane<D>(x, n, lanes, lane, r0, r1, &ps, &ns, &pc);
    if (direct) {
      pos_mean[lane] = ClassMean(ps, pc);
      neg_mean[lane] = ClassMean(ns, static_cast<double>(rows) - pc);
    } else {
      const int64_t chunks = gridDim.y;
      partial[chunk * lanes + lane] = ps;
      partial[(chunks + chunk) * lanes + lane] = ns;
      partial[(2 * chunks + chunk) * lanes + lane] = pc;
    }
  }
}

// Folds chunks and widened lanes back onto columns, always in the same
// order (chunk-major, then lane), so the means are deterministic.
__global__ void CombineStatsKernel(const double* __restrict__ partial,
                                   int64_t chunks, int64_t lanes, int64_t rows,
                                   int64_t cols, float* __restrict__ pos_mean,
                                   float* __restrict__ neg_mean) {
  for (int64_t j = GlobalThread(); j < cols; j += GlobalThreads()) {
    double ps = 0.0, ns = 0.0, pc = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t l = j; l < lanes; l += cols) {
        ps += partial[c * lanes + l];
        ns += partial[(chunks + c) * lanes + l];
        pc += partial[(2 * chunks + c) * lanes + l];
      }
    }
    pos_mean[j] = ClassMean(ps, pc);
    neg_mean[j] = ClassMean(ns, static_cast<double>(rows) - pc);
  }
}

template <int D>
__global__ void QuantizeResidualKernel(
    const typename Codec<D>::Raw* __restrict__ x, int64_t n, int64_t cols,
    int64_t num_words, const float* __restrict__ pos_mean,
    const float* __restrict__ neg_mean, int32_t* __restrict__ words,
    typename Codec<D>::Raw* __restrict__ residual) {
  const int lane = threadIdx.x & 31;
  const int64_t first = GlobalThread() >> 5;
  const int64_t stride = GlobalThreads() >> 5;
  for (int64_t w = first; w < num_words; w += stride) {
    const int64_t i = w * 32 + lane;
    bool bit = false;
    if (i < n) {
      const float f = Codec<D>::ToFloat(x[i]);
      bit = f >= 0.0f;
      const int64_t j = i % cols;
      // The residual is taken against what the receiver decodes: the mean
      // rounded to T.
      const float mean = Codec<D>::ToFloat(
          Codec<D>::FromFloat(bit ? pos_mean[j] : neg_mean[j]));
      residual[i] = Codec<D>::FromFloat(f - mean);
    }
    const unsigned word = __ballot_sync(0xffffffffu, bit);
    if (lane == 0) words[w] = static_cast<int32_t>(word);
  }
}

template <int D>
__global__ void DequantizeKernel(const int32_t* __restrict__ words,
                                 const float* __restrict__ pos_mean,
                                 const float* __restrict__ neg_mean, int64_t n,
                                 int64_t cols,
                                 typename Codec<D>::Raw* __restrict__ out) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    const bool bit = (static_cast<uint32_t>(words[i >> 5]) >> (i & 31)) & 1u;
    const int64_t j = i % cols;
    out[i] = Codec<D>::FromFloat(bit ? pos_mean[j] : neg_mean[j]);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free). All return the first CUDA error, or
// cudaSuccess; nothing is synchronised.

int64_t NumSignWords(int64_t n) { return n / 32 + (n % 32 != 0); }

template <int D>
cudaError_t PackSignBits(const void* x, int64_t n, int32_t* words,
                         cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t num_words = NumSignWords(n);
  PackSignBitsKernel<D><<<NumBlocks(num_words * 32), kThreads, 0, stream>>>(
      static_cast<const typename Codec<D>::Raw*>(x), n, num_words, words);
  return cudaGetLastError();
}

template <int D>
cudaError_t UnpackSignBits(const int32_t* words, int64_t n, void* out,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  UnpackSignBitsKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
      words, n, static_cast<typename Codec<D>::Raw*>(out));
  return cudaGetLastError();
}

int64_t OneBitQuantizeScratchBytes(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  return PlanStats(rows, cols).scratch_doubles *
         static_cast<int64_t>(sizeof(double));
}

template <int D>
cudaError_t OneBitQuantize(const void* x_v, int64_t rows, int64_t cols,
                           int32_t* words, float* pos_mean, float* neg_mean,
                           void* residual_v, void* scratch,
                           cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (cols <= 0) return cudaSuccess;
  if (rows <= 0) {
    cudaError_t err = cudaMemsetAsync(pos_mean, 0, cols * sizeof(float), stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(neg_mean, 0, cols * sizeof(float), stream);
  }
  const auto* x = static_cast<const Raw*>(x_v);
  const int64_t n = rows * cols;
  const StatsPlan p = PlanStats(rows, cols);
  auto* partial = static_cast<double*>(scratch);
  const dim3 grid(NumBlocks(p.lanes), static_cast<unsigned>(p.chunks));
  ColumnStatsKernel<D><<<grid, kThreads, 0, stream>>>(
      x, n, rows, p.lanes, p.vrows, p.chunk_rows, p.direct, partial, pos_mean,
      neg_mean);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (!p.direct) {
    CombineStatsKernel<<<NumBlocks(cols), kThreads, 0, stream>>>(
        partial, p.chunks, p.lanes, rows, cols, pos_mean, neg_mean);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t num_words = NumSignWords(n);
  QuantizeResidualKernel<D><<<NumBlocks(num_words * 32), kThreads, 0, stream>>>(
      x, n, cols, num_words, pos_mean, neg_mean, words,
      static_cast<Raw*>(residual_v));
  return cudaGetLastError();
}

template <int D>
cudaError_t OneBitDequantize(const int32_t* words, const float* pos_mean,
                             const float* neg_mean, int64_t rows, int64_t cols,
                             void* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t n = rows * cols;
  DequantizeKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
      words, pos_mean, neg_mean, n, cols,
      static_cast<typename Codec<D>::Raw*>(out));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers for callers without TensorFlow (ctypes). dtype is a
// tfgc::cuda::DTypeCode; the return value is a cudaError_t (0 = success).
// Inputs are trusted: validation is the OpKernels' job.

extern "C" {

int tfgc_cuda_pack_sign_bits(int dtype, const void* x, int64_t n,
                             int32_t* words, cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::PackSignBits, x, n, words,
                           stream);
}

int tfgc_cuda_unpack_sign_bits(int dtype, const int32_t* words, int64_t n,
                               void* out, cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::UnpackSignBits, words, n, out,
                           stream);
}

int64_t tfgc_cuda_onebit_quantize_scratch_bytes(int64_t rows, int64_t cols) {
  return tfgc::cuda::OneBitQuantizeScratchBytes(rows, cols);
}

int tfgc_cuda_onebit_quantize(int dtype, const void* x, int64_t rows,
                              int64_t cols, int32_t* words, float* pos_mean,
                              float* neg_mean, void* residual, void* scratch,
                              cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::OneBitQuantize, x, rows, cols,
                           words, pos_mean, neg_mean, residual, scratch,
                           stream);
}

int tfgc_cuda_onebit_dequantize(int dtype, const int32_t* words,
                                const float* pos_mean, const float* neg_mean,
                                int64_t rows, int64_t cols, void* out,
                                cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::OneBitDequantize, words,
                           pos_mean, neg_mean, rows, cols, out, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functors (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/sign_bits.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "custom_ops/cc/kernels/gpu_tf_util.h"

namespace tfgc {
namespace functor {

using GPUDevice = Eigen::GpuDevice;
using gpu_tf::CudaDType;
using gpu_tf::CudaStatus;
using gpu_tf::ScratchBytes;
using gpu_tf::StreamOf;

template <typename T>
struct PackSignBitsFunctor<GPUDevice, T> {
  void operator()(tensorflow::OpKernelContext* ctx, const T* in, int64_t n,
                  int32_t* words) {
    const absl::Status s = CudaStatus(
        cuda::PackSignBits<CudaDType<T>::kCode>(in, n, words, StreamOf(ctx)),
        "TfgcPackSignBits");
    if (!s.ok()) ctx->SetStatus(s);
  }
};

template <typename T>
struct UnpackSignBitsFunctor<GPUDevice, T> {
  void operator()(tensorflow::OpKernelContext* ctx, const int32_t* words,
                  int64_t n, T* out) {
    const absl::Status s = CudaStatus(
        cuda::UnpackSignBits<CudaDType<T>::kCode>(words, n, out, StreamOf(ctx)),
        "TfgcUnpackSignBits");
    if (!s.ok()) ctx->SetStatus(s);
  }
};

template <typename T>
struct OneBitQuantizeFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          int64_t rows, int64_t cols, int32_t* words,
                          float* pos_mean, float* neg_mean, T* residual) {
    tensorflow::Tensor scratch;
    void* scratch_ptr = nullptr;
    const int64_t bytes = cuda::OneBitQuantizeScratchBytes(rows, cols);
    if (bytes > 0) {
      TF_RETURN_IF_ERROR(ctx->allocate_temp(
          tensorflow::DT_INT8, tensorflow::TensorShape({bytes}), &scratch));
      scratch_ptr = scratch.flat<int8_t>().data();
    }
    return CudaStatus(cuda::OneBitQuantize<CudaDType<T>::kCode>(
                          x, rows, cols, words, pos_mean, neg_mean, residual,
                          scratch_ptr, StreamOf(ctx)),
                      "TfgcOneBitQuantize");
  }
};

template <typename T>
struct OneBitDequantizeFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const int32_t* words, const float* pos_mean,
                          const float* neg_mean, int64_t rows, int64_t cols,
                          T* out) {
    return CudaStatus(cuda::OneBitDequantize<CudaDType<T>::kCode>(
                          words, pos_mean, neg_mean, rows, cols, out,
                          StreamOf(ctx)),
                      "TfgcOneBitDequantize");
  }
};

#define TFGC_INSTANTIATE_SIGN_BITS_GPU(T)            \
  template struct PackSignBitsFunctor<GPUDevice, T>;   \
  template struct UnpackSignBitsFunctor<GPUDevice, T>; \
  template struct OneBitQuantizeFunctor<GPUDevice, T>; \
  template struct OneBitDequantizeFunctor<GPUDevice, T>;

TFGC_INSTANTIATE_SIGN_BITS_GPU(float);
TFGC_INSTANTIATE_SIGN_BITS_GPU(Eigen::half);
TFGC_INSTANTIATE_SIGN_BITS_GPU(Eigen::bfloat16);

#undef TFGC_INSTANTIATE_SIGN_BITS_GPU

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
