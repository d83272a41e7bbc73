// CUDA kernels for threshold encoding (see threshold.h for the word format and
// threshold_kernels.cc for the CPU semantics they reproduce).
//
// Layout as in sign_bits_gpu.cu.cc: a TensorFlow-free part (kernels, C++
// launchers, extern "C" wrappers for ctypes) and a `#if GOOGLE_CUDA` part with
// the TF functor specialisations.
//
// Encode is stream-compaction:
//   1. one warp per 32 elements: new residual, and __ballot_sync masks of the
//      sent / positive elements written to scratch (n / 16 bytes);
//   2. per tile of 256 mask words, the number of sent elements;
//   3. one block scans the tile counts (exclusive offsets + total);
//   4. the host reads the total (it sizes the output: one device-to-host copy
//      and a stream sync, as for tf.where), allocates the words;
//   5. one block per tile scans its words' counts and writes each word's
//      indices at tile offset + prefix, so words come out in index order.
// Decode validates every word on the device first (one flag word copied back
// before anything is written), then scatters. Payloads with strictly
// increasing indices (all encoder output) are a plain scatter; others go
// through 64-bit per-index counters updated with integer atomics, which are
// order independent, so the result is deterministic either way.

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {
namespace {

// Mask words per tile; a tile is one block of the count and emit kernels.
constexpr int kTileWords = kThreads;
// Flags written by the decode validation kernel.
constexpr int kBadWord = 1;
constexpr int kUnsorted = 2;

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

struct EncodeLayout {
  int64_t num_words, num_tiles;
  int64_t offsets_byte;  // start of the int64 [num_tiles + 1] offsets
  int64_t bytes;
};

EncodeLayout PlanEncode(int64_t n) {
  EncodeLayout l;
  l.num_words = CeilDiv(n, 32);
  l.num_tiles = CeilDiv(l.num_words, kTileWords);
  // sent and pos masks (2 * num_words uint32), then 8-byte aligned offsets.
  l.offsets_byte = CeilDiv(2 * l.num_words * 4, 8) * 8;
  l.bytes = l.offsets_byte + (l.num_tiles + 1) * 8;
  return l;
}

template <int D>
__global__ void EncodeMasksKernel(const typename Codec<D>::Raw* __restrict__ x,
                                  const typename Codec<D>::Raw* __restrict__ r,
                                  int64_t n, int64_t num_words, float pos_thr,
                                  float neg_thr,
                                  typename Codec<D>::Raw* __restrict__ new_res,
                                  uint32_t* __restrict__ sent_bits,
                                  uint32_t* __restrict__ pos_bits) {
  const int lane = threadIdx.x & 31;
  const int64_t first = GlobalThread() >> 5;
  const int64_t stride = GlobalThreads() >> 5;
  for (int64_t w = first; w < num_words; w += stride) {
    const int64_t i = w * 32 + lane;
    bool p = false, q = false;
    if (i < n) {
      // x + residual rounded to T, as TensorFlow's add does for half types,
      // and subnormals flushed as on the CPU (gpu_common.cuh).
      const float v = Codec<D>::ToFloat(Codec<D>::FromFloat(
          AddFlushed(Codec<D>::ToFloat(x[i]), Codec<D>::ToFloat(r[i]))));
      p = v >= pos_thr;  // NaN: neither
      q = v <= neg_thr;
      new_res[i] = Codec<D>::FromFloat(
          SubFlushed(v, p ? pos_thr : (q ? neg_thr : 0.0f)));
    }
    const unsigned sent = __ballot_sync(0xffffffffu, p || q);
    const unsigned pos = __ballot_sync(0xffffffffu, p);
    if (lane == 0) {
      sent_bits[w] = sent;
      pos_bits[w] = pos;
    }
  }
}

__global__ void TileCountsKernel(const uint32_t* __restrict__ sent_bits,
                                 int64_t num_words,
                                 int64_t* __restrict__ tile_counts) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kTileWords + threadIdx.x;
  const int64_t c = w < num_words ? __popc(sent_bits[w]) : 0;
  int64_t total;
  BlockExclusiveScan<int64_t>(c, &total);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

// Single block: offsets[t] <- sum of counts[0, t) in place, offsets[T] <-
// total. Each thread owns a contiguous run of tiles.
__global__ void ScanTilesKernel(int64_t* __restrict__ offsets,
                                int64_t num_tiles) {
  const int64_t per_thread = CeilDiv(num_tiles, kThreads);
  const int64_t b = min(num_tiles, threadIdx.x * per_thread);
  const int64_t e = min(num_tiles, b + per_thread);
  int64_t local = 0;
  for (int64_t t = b; t < e; ++t) local += offsets[t];
  int64_t total;
  int64_t running = BlockExclusiveScan<int64_t>(local, &total);
  for (int64_t t = b; t < e; ++t) {
    const int64_t c = offsets[t];
    offsets[t] = running;
    running += c;
  }
  if (threadIdx.x == 0) offsets[num_tiles] = total;
}

__global__ void EmitWordsKernel(const uint32_t* __restrict__ sent_bits,
                                const uint32_t* __restrict__ pos_bits,
                                int64_t num_words,
                                const int64_t* __restrict__ offsets,
                                int32_t* __restrict__ words) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kTileWords + threadIdx.x;
  uint32_t sent = w < num_words ? sent_bits[w] : 0u;
  int total;
  const int prefix = BlockExclusiveScan<int>(__popc(sent), &total);
  if (sent == 0) return;
  const uint32_t pos = pos_bits[w];
  int32_t* out = words + offsets[blockIdx.x] + prefix;
  while (sent != 0) {
    const int bit = __ffs(sent) - 1;
    // index < 2^30, so the word is a non-negative int32.
    *out++ = static_cast<int32_t>(((w * 32 + bit) << 1) | ((pos >> bit) & 1u));
    sent &= sent - 1;
  }
}

__global__ void ValidateWordsKernel(const int32_t* __restrict__ words,
                                    int64_t m, int64_t n,
                                    int* __restrict__ flags) {
  int local = 0;
  for (int64_t k = GlobalThread(); k < m; k += GlobalThreads()) {
    const int32_t w = words[k];
    const int64_t idx = w >> 1;
    if (w < 0 || idx >= n) local |= kBadWord;
    if (k > 0 && idx <= (words[k - 1] >> 1)) local |= kUnsorted;
  }
  if (local != 0) atomicOr(flags, local);
}

template <int D>
__global__ void ScatterUniqueKernel(const int32_t* __restrict__ words,
                                    int64_t m, float pos_value,
                                    float neg_value,
                                    typename Codec<D>::Raw* __restrict__ out) {
  const auto pos = Codec<D>::FromFloat(pos_value);
  const auto neg = Codec<D>::FromFloat(neg_value);
  for (int64_t k = GlobalThread(); k < m; k += GlobalThreads()) {
    const int32_t w = words[k];
    out[w >> 1] = (w & 1) ? pos : neg;
  }
}

// Counters: positive count in the low 32 bits, negative in the high 32.
__global__ void CountWordsKernel(const int32_t* __restrict__ words, int64_t m,
                                 unsigned long long* __restrict__ counts) {
  for (int64_t k = GlobalThread(); k < m; k += GlobalThreads()) {
    const int32_t w = words[k];
    atomicAdd(counts + (w >> 1), (w & 1) ? 1ull : (1ull << 32));
  }
}

template <int D>
__global__ void CountsToValuesKernel(
    const unsigned long long* __restrict__ counts, int64_t n, float pos_value,
    float neg_value, typename Codec<D>::Raw* __restrict__ out) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    const unsigned long long c = counts[i];
    const uint32_t cp = static_cast<uint32_t>(c);
    const uint32_t cn = static_cast<uint32_t>(c >> 32);
    const float p = static_cast<float>(cp) * pos_value;
    const float q = static_cast<float>(cn) * neg_value;
    const float v = cp > 0 ? (cn > 0 ? p + q : p) : (cn > 0 ? q : 0.0f);
    out[i] = Codec<D>::FromFloat(v);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free).

int64_t ThresholdEncodeScratchBytes(int64_t n) {
  return n > 0 ? PlanEncode(n).bytes : 0;
}

// Steps 1-4: new residual, masks, offsets; *num_sent receives the number of
// words (the stream is synchronised for that). pos_thr / neg_thr must
// already be rounded to T.
template <int D>
cudaError_t ThresholdEncodeCount(const void* x, const void* residual,
                                 int64_t n, float pos_thr, float neg_thr,
                                 void* new_residual, void* scratch,
                                 int64_t* num_sent, cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  *num_sent = 0;
  if (n <= 0) return cudaSuccess;
  const EncodeLayout l = PlanEncode(n);
  auto* sent_bits = static_cast<uint32_t*>(scratch);
  auto* pos_bits = sent_bits + l.num_words;
  auto* offsets = reinterpret_cast<int64_t*>(static_cast<char*>(scratch) +
                                             l.offsets_byte);
  EncodeMasksKernel<D><<<NumBlocks(l.num_words * 32), kThreads, 0, stream>>>(
      static_cast<const Raw*>(x), static_cast<const Raw*>(residual), n,
      l.num_words, pos_thr, neg_thr, static_cast<Raw*>(new_residual),
      sent_bits, pos_bits);
  TileCountsKernel<<<static_cast<unsigned>(l.num_tiles), kTileWords, 0,
                     stream>>>(sent_bits, l.num_words, offsets);
  ScanTilesKernel<<<1, kThreads, 0, stream>>>(offsets, l.num_tiles);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(num_sent, offsets + l.num_tiles, sizeof(int64_t),
                        cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// Step 5: words[num_sent] from the scratch filled by ThresholdEncodeCount.
cudaError_t ThresholdEncodeEmit(const void* scratch, int64_t n, int32_t* words,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const EncodeLayout l = PlanEncode(n);
  const auto* sent_bits = static_cast<const uint32_t*>(scratch);
  const auto* offsets = reinterpret_cast<const int64_t*>(
      static_cast<const char*>(scratch) + l.offsets_byte);
  EmitWordsKernel<<<static_cast<unsigned>(l.num_tiles), kTileWords, 0,
                    stream>>>(sent_bits, sent_bits + l.num_words, l.num_words,
                              offsets, words);
  return cudaGetLastError();
}

// Checks all m words against n. *flags (host) receives kBadWord if any word
// is negative or indexes past n, kUnsorted if indices do not strictly
// increase. flags_dev is one device int of scratch. Synchronises the stream.
cudaError_t ThresholdDecodeValidate(const int32_t* words, int64_t m, int64_t n,
                                    int* flags_dev, int* flags,
                                    cudaStream_t stream) {
  *flags = 0;
  if (m <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(flags_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  ValidateWordsKernel<<<NumBlocks(m), kThreads, 0, stream>>>(words, m, n,
                                                             flags_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(flags, flags_dev, sizeof(int), cudaMemcpyDeviceToHost,
                        stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// Decodes validated words. counts (n uint64 of scratch) is only used, and
// only needs to be non-null, when unsorted != 0.
template <int D>
cudaError_t ThresholdDecode(const int32_t* words, int64_t m, float pos_value,
                            float neg_value, int64_t n, int unsorted,
                            void* counts, void* out, cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (n <= 0) return cudaSuccess;
  auto* o = static_cast<Raw*>(out);
  if (!unsorted) {
    cudaError_t err = cudaMemsetAsync(out, 0, n * sizeof(Raw), stream);
    if (err != cudaSuccess || m <= 0) return err;
    ScatterUniqueKernel<D><<<NumBlocks(m), kThreads, 0, stream>>>(
        words, m, pos_value, neg_value, o);
    return cudaGetLastError();
  }
  auto* c = static_cast<unsigned long long*>(counts);
  cudaError_t err = cudaMemsetAsync(c, 0, n * sizeof(*c), stream);
  if (err != cudaSuccess) return err;
  CountWordsKernel<<<NumBlocks(m), kThreads, 0, stream>>>(words, m, c);
  CountsToValuesKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
      c, n, pos_value, neg_value, o);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers (ctypes). Return a cudaError_t, 0 = success.
//
// Encode: scratch of tfgc_cuda_threshold_encode_scratch_bytes(n); call
// tfgc_cuda_threshold_encode_count (synchronises, returns the word count in
// *num_sent), allocate num_sent int32, then tfgc_cuda_threshold_encode_emit
// with the same scratch. The thresholds must already be rounded to dtype and
// validated (pos > 0 > neg, finite), as the OpKernel does.
//
// Decode: tfgc_cuda_threshold_decode_validate (flags_dev: one device int);
// reject the payload if *flags & 1; otherwise call tfgc_cuda_threshold_decode
// with unsorted = *flags & 2 and, if unsorted, n uint64 of counts scratch.
// m must be < 2^32 on the unsorted path (32-bit counters).

extern "C" {

int64_t tfgc_cuda_threshold_encode_scratch_bytes(int64_t n) {
  return tfgc::cuda::ThresholdEncodeScratchBytes(n);
}

int tfgc_cuda_threshold_encode_count(int dtype, const void* x,
                                     const void* residual, int64_t n,
                                     float pos_thr, float neg_thr,
                                     void* new_residual, void* scratch,
                                     int64_t* num_sent, cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::ThresholdEncodeCount, x,
                           residual, n, pos_thr, neg_thr, new_residual,
                           scratch, num_sent, stream);
}

int tfgc_cuda_threshold_encode_emit(const void* scratch, int64_t n,
                                    int32_t* words, cudaStream_t stream) {
  return tfgc::cuda::ThresholdEncodeEmit(scratch, n, words, stream);
}

int tfgc_cuda_threshold_decode_validate(const int32_t* words, int64_t m,
                                        int64_t n, int* flags_dev, int* flags,
                                        cudaStream_t stream) {
  return tfgc::cuda::ThresholdDecodeValidate(words, m, n, flags_dev, flags,
                                             stream);
}

int tfgc_cuda_threshold_decode(int dtype, const int32_t* words, int64_t m,
                               float pos_value, float neg_value, int64_t n,
                               int unsorted, void* counts, void* out,
                               cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::ThresholdDecode, words, m,
                           pos_value, neg_value, n, unsorted, counts, out,
                           stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functors (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/threshold.h"
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
struct ThresholdEncodeFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n, float pos_threshold,
                          float neg_threshold, T* new_residual,
                          const AllocateWordsFn& allocate_words) {
    const cudaStream_t stream = ctx->eigen_device<GPUDevice>().stream();
    tensorflow::Tensor scratch;
    void* scratch_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(
        ctx, cuda::ThresholdEncodeScratchBytes(n), &scratch, &scratch_ptr));
    int64_t m = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::ThresholdEncodeCount<CudaDType<T>::kCode>(
            x, residual, n, pos_threshold, neg_threshold, new_residual,
            scratch_ptr, &m, stream),
        "TfgcThresholdEncode"));
    int32_t* words = nullptr;
    TF_RETURN_IF_ERROR(allocate_words(m, &words));
    if (m == 0) return absl::OkStatus();
    return CudaStatus(
        cuda::ThresholdEncodeEmit(scratch_ptr, n, words, stream),
        "TfgcThresholdEncode");
  }
};

template <typename T>
struct ThresholdDecodeFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const int32_t* words, int64_t m, float pos_value,
                          float neg_value, int64_t n, T* out) {
    const cudaStream_t stream = ctx->eigen_device<GPUDevice>().stream();
    tensorflow::Tensor flag_scratch;
    void* flag_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(ctx, sizeof(int), &flag_scratch, &flag_ptr));
    int flags = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::ThresholdDecodeValidate(words, m, n, static_cast<int*>(flag_ptr),
                                      &flags, stream),
        "TfgcThresholdDecode"));
    if (flags & 1) {
      return tensorflow::errors::InvalidArgument(
          "a threshold word is negative or its index is outside [0, ", n, ")");
    }
    const bool unsorted = (flags & 2) != 0;
    tensorflow::Tensor counts;
    void* counts_ptr = nullptr;
    if (unsorted) {
      if (m > int64_t{0xffffffff}) {
        return tensorflow::errors::InvalidArgument(
            "the GPU decoder takes at most 2^32 - 1 unsorted words, got ", m);
      }
      TF_RETURN_IF_ERROR(ScratchBytes(ctx, n * 8, &counts, &counts_ptr));
    }
    return CudaStatus(
        cuda::ThresholdDecode<CudaDType<T>::kCode>(
            words, m, pos_value, neg_value, n, unsorted ? 1 : 0, counts_ptr,
            out, stream),
        "TfgcThresholdDecode");
  }
};

#define TFGC_INSTANTIATE_THRESHOLD_GPU(T)                \
  template struct ThresholdEncodeFunctor<GPUDevice, T>; \
  template struct ThresholdDecodeFunctor<GPUDevice, T>;

TFGC_INSTANTIATE_THRESHOLD_GPU(float);
TFGC_INSTANTIATE_THRESHOLD_GPU(Eigen::half);
TFGC_INSTANTIATE_THRESHOLD_GPU(Eigen::bfloat16);

#undef TFGC_INSTANTIATE_THRESHOLD_GPU

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
