// CUDA kernels for stochastic bucketed quantization (QSGD, Alistarh et al.
// 2017; TernGrad, Wen et al. 2017). See quantize.h for the wire format and
// quantize_kernels.cc for the CPU semantics reproduced here.
//
// Layout as in sign_bits_gpu.cu.cc: a TensorFlow-free part (kernels, C++
// launchers, extern "C" wrappers for ctypes) and a `#if GOOGLE_CUDA` part with
// the TF functor specialisations.
//
// Quantize runs in two or three launches:
//   1. statistics: one warp per (bucket, chunk of kStatChunk elements) item,
//      l2 as a double sum of exact float squares, max as the max of the
//      |v| bit patterns (so a NaN wins, as on the CPU). A bucket made of a
//      single chunk writes its scale directly;
//   2. (buckets of several chunks only) one thread per bucket folds the
//      chunk partials in chunk order;
//   3. one thread per code word: Philox-4x32-10 uniforms, the same float32
//      operations as the CPU kernel for the level, packing LSB first.
// Codes are bit-identical to the CPU op given the same scales. Max-norm
// scales are bit-identical too; l2 scales are the float32 rounding of a
// double sum taken in a different order than on the CPU, which can only
// change the result when that double lands within a rounding error of a
// float32 rounding boundary (not observed in the tests, but possible).
// Everything is deterministic (no atomics on data). Very small buckets
// (d << 32) leave most lanes of a statistics warp idle; that costs speed,
// not correctness.
//
// The uniforms are those of tf.random.stateless_uniform([N], seed): element
// i takes output i % 4 of Philox counter (lo64 = i / 4, hi64 = the stream's
// counter_hi), under the stream's key. In the TensorFlow build the key is
// derived on the host by the OpKernel with TensorFlow's own PhiloxRandom
// (StreamFromSeed in quantize_kernels.cc). The per-element generator on the
// device is this file's Philox10 in both builds rather than TF's class, so
// that the harness exercises exactly the code the TF build runs; it follows
// tensorflow::random::PhiloxRandom round for round (checked against
// tf.random.stateless_uniform through the harness' NumPy restatement). The
// ctypes entry point scrambles the seed with the same Philox10 on the host.
//
// Dequantize validates while it decodes: any used code above 2s raises a
// device flag that the launcher copies back (one stream sync) so the
// OpKernel can fail with InvalidArgument; writes stay within out[n] either
// way. The multi-worker sum adds workers in index order from +0.0f per
// element, bit for bit as the CPU op.
//
// Not reproduced: TensorFlow's CPU thread pool flushes subnormals, the GPU
// code does not (compile without -ftz / --use_fast_math); inputs whose
// s|v|/scale is subnormal may therefore get different codes.

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {

// Key and fixed upper counter half of a Philox stream (mirrors
// tfgc::PhiloxStream in quantize.h, which the TF-free part cannot include).
struct PhiloxKey {
  uint32_t key[2];
  uint32_t counter_hi[2];
};

namespace {

constexpr uint32_t kPhiloxW32A = 0x9E3779B9u;
constexpr uint32_t kPhiloxW32B = 0xBB67AE85u;
constexpr uint32_t kPhiloxM4x32A = 0xD2511F53u;
constexpr uint32_t kPhiloxM4x32B = 0xCD9E8D57u;

// Elements summed by one warp in the statistics pass.
constexpr int64_t kStatChunk = 4096;
// Bits of the dequantize error flag.
constexpr int kBadCode = 1;

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// Philox-4x32-10 (Salmon et al. 2011) with TensorFlow's round structure.
__host__ __device__ __forceinline__ void Philox10(uint32_t c[4], uint32_t k0,
                                                  uint32_t k1) {
  // No `#pragma unroll`: the host compiler sees this loop too (seed
  // scrambling) and would warn; nvcc unrolls a 10-trip loop by itself.
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM4x32A) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM4x32B) * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[1] = static_cast<uint32_t>(p1);
    c[3] = static_cast<uint32_t>(p0);
    c[0] = n0;
    c[2] = n2;
    k0 += kPhiloxW32A;
    k1 += kPhiloxW32B;
  }
}

__device__ __forceinline__ void CounterOutputs(uint64_t group,
                                               const PhiloxKey& st,
                                               uint32_t out[4]) {
  out[0] = static_cast<uint32_t>(group);
  out[1] = static_cast<uint32_t>(group >> 32);
  out[2] = st.counter_hi[0];
  out[3] = st.counter_hi[1];
  Philox10(out, st.key[0], st.key[1]);
}

// Statistic of one (bucket, chunk) item by one warp. The lanes' partials are
// combined by a fixed butterfly, so the result does not depend on timing.
template <int D>
__global__ void BucketStatsKernel(const typename Codec<D>::Raw* __restrict__ x,
                                  int64_t n, int64_t d, int64_t per_bucket,
                                  int64_t items, bool max_norm, bool direct,
                                  double* __restrict__ partial,
                                  float* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  const int64_t first = GlobalThread() >> 5;
  const int64_t stride = GlobalThreads() >> 5;
  for (int64_t t = first; t < items; t += stride) {
    const int64_t b = t / per_bucket;
    const int64_t c = t % per_bucket;
    const int64_t bucket_end = min(n, (b + 1) * d);
    const int64_t begin = b * d + c * kStatChunk;
    const int64_t end = min(bucket_end, begin + kStatChunk);
    double sum = 0.0;
    uint32_t mx = 0;
    for (int64_t i = begin + lane; i < end; i += 32) {
      const float f = Codec<D>::ToFloat(x[i]);
      if (max_norm) {
        const uint32_t a = __float_as_uint(f) & 0x7fffffffu;
        mx = a > mx ? a : mx;
      } else {
        const double v = static_cast<double>(f);
        sum = __dadd_rn(sum, __dmul_rn(v, v));
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      if (max_norm) {
        const uint32_t y = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = y > mx ? y : mx;
      } else {
        sum = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
      }
    }
    if (lane == 0) {
      const double stat = max_norm ? static_cast<double>(mx) : sum;
      if (direct) {
        scales[b] = max_norm ? __uint_as_float(mx)
                             : static_cast<float>(sqrt(stat));
      } else {
        partial[t] = stat;
      }
    }
  }
}

__global__ void CombineStatsKernel(const double* __restrict__ partial,
                                   int64_t nb, int64_t per_bucket,
                                   bool max_norm, float* __restrict__ scales) {
  for (int64_t b = GlobalThread(); b < nb; b += GlobalThreads()) {
    double acc = 0.0;
    for (int64_t c = 0; c < per_bucket; ++c) {
      const double v = partial[b * per_bucket + c];
      acc = max_norm ? fmax(acc, v) : __dadd_rn(acc, v);
    }
    scales[b] = max_norm ? __uint_as_float(static_cast<uint32_t>(acc))
                         : static_cast<float>(sqrt(acc));
  }
}

// Code 0..2s of one element: the CPU kernel's float32 operations, written
// with explicit round-to-nearest intrinsics so that nvcc cannot contract or
// approximate them.
__device__ __forceinline__ uint32_t CodeOf(float v, float scale, int s,
                                           uint32_t rnd) {
  const float sf = static_cast<float>(s);
  const uint32_t s_bits = __float_as_uint(sf);
  const uint32_t vb = __float_as_uint(v);
  uint32_t a = __float_as_uint(
      __fdiv_rn(__fmul_rn(sf, __uint_as_float(vb & 0x7fffffffu)), scale));
  // Zero scale or NaN quotient -> level 0; above s (+inf included) -> s.
  if (__float_as_uint(scale) == 0u || a > 0x7f800000u) a = 0u;
  if (a > s_bits) a = s_bits;
  const float af = __uint_as_float(a);
  const int32_t l = static_cast<int32_t>(af);
  const float frac = __fsub_rn(af, static_cast<float>(l));
  const float u =
      __fsub_rn(__uint_as_float(0x3f800000u | (rnd & 0x7fffffu)), 1.0f);
  const uint32_t level = static_cast<uint32_t>(l) +
                         (__float_as_uint(u) < __float_as_uint(frac) ? 1u : 0u);
  const uint32_t neg = 0u - (vb >> 31);
  return static_cast<uint32_t>(s) + ((level ^ neg) - neg);
}

// One thread per code word. kBits <= 8: the word spans whole Philox
// counters; kBits == 16: two words share a counter, each thread computes it
// and keeps its half.
template <int D, int kBits>
__global__ void QuantizeWordsKernel(const typename Codec<D>::Raw* __restrict__ x,
                                    int64_t n, int64_t d, int s,
                                    PhiloxKey st,
                                    const float* __restrict__ scales,
                                    int64_t num_words,
                                    int32_t* __restrict__ words) {
  constexpr int kPerWord = 32 / kBits;
  for (int64_t w = GlobalThread(); w < num_words; w += GlobalThreads()) {
    const int64_t i0 = w * kPerWord;
    uint32_t word = 0;
    uint32_t rnd[4];
#pragma unroll
    for (int j = 0; j < kPerWord; ++j) {
      const int64_t i = i0 + j;
      if ((i & 3) == 0 || j == 0) CounterOutputs(static_cast<uint64_t>(i >> 2), st, rnd);
      if (i < n) {
        const uint32_t code =
            CodeOf(Codec<D>::ToFloat(x[i]), scales[i / d], s, rnd[i & 3]);
        word |= code << (kBits * j);
      }
    }
    words[w] = static_cast<int32_t>(word);
  }
}

// Decoded value of element i, flagging codes above 2s.
__device__ __forceinline__ float DecodeOne(const float* __restrict__ scales,
                                           const int32_t* __restrict__ words,
                                           int64_t i, int64_t d, int s,
                                           int bits, int* bad) {
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  const uint32_t code =
      (static_cast<uint32_t>(words[i / per_word]) >> (bits * (i % per_word))) &
      mask;
  if (code > 2u * static_cast<uint32_t>(s)) *bad = kBadCode;
  const float so = __fdiv_rn(scales[i / d], static_cast<float>(s));
  return __fmul_rn(static_cast<float>(static_cast<int32_t>(code) - s), so);
}

template <int D>
__global__ void DequantizeKernel(const float* __restrict__ scales,
                                 const int32_t* __restrict__ words, int64_t n,
                                 int64_t d, int s, int bits,
                                 typename Codec<D>::Raw* __restrict__ out,
                                 int* __restrict__ flag) {
  int bad = 0;
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    out[i] = Codec<D>::FromFloat(DecodeOne(scales, words, i, d, s, bits, &bad));
  }
  if (bad) atomicOr(flag, bad);
}

__global__ void DequantizeSumKernel(const float* __restrict__ scales,
                                    const int32_t* __restrict__ words,
                                    int64_t workers, int64_t nb, int64_t nw,
                                    int64_t n, int64_t d, int s, int bits,
                                    float* __restrict__ out,
                                    int* __restrict__ flag) {
  int bad = 0;
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    float acc = 0.0f;
    for (int64_t k = 0; k < workers; ++k) {
      acc = __fadd_rn(acc, DecodeOne(scales + k * nb, words + k * nw, i, d, s,
                                     bits, &bad));
    }
    out[i] = acc;
  }
  if (bad) atomicOr(flag, bad);
}

int64_t NumBucketsOf(int64_t n, int64_t d) {
  const int64_t b = CeilDiv(n, d);
  return b > 0 ? b : 1;
}

int64_t ChunksPerBucket(int64_t n, int64_t d) {
  return CeilDiv(std::min(d, n), kStatChunk);
}

template <int D, int kBits>
cudaError_t LaunchQuantizeWords(const void* x, int64_t n, int64_t d, int s,
                                const PhiloxKey& st, const float* scales,
                                int32_t* words, cudaStream_t stream) {
  const int64_t nw = CeilDiv(n, 32 / kBits);
  QuantizeWordsKernel<D, kBits><<<NumBlocks(nw), kThreads, 0, stream>>>(
      static_cast<const typename Codec<D>::Raw*>(x), n, d, s, st, scales, nw,
      words);
  return cudaGetLastError();
}

// Copies the device flag to *flag and waits for it.
cudaError_t ReadFlag(const int* flag_dev, int* flag, cudaStream_t stream) {
  cudaError_t err = cudaMemcpyAsync(flag, flag_dev, sizeof(int),
                                    cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free). Inputs are trusted (the OpKernel validates
// attributes and sizes): levels in [1, 32767], bits in {2, 4, 8, 16} holding
// 2 levels + 1 codes, bucket_size >= 1.

// TensorFlow's stateless seed scrambling (GenerateKey in
// tensorflow/core/kernels/stateless_random_ops.cc), on the host.
PhiloxKey PhiloxKeyFromSeed(int64_t seed0_in, int64_t seed1_in) {
  const uint64_t seed0 = static_cast<uint64_t>(seed0_in);
  const uint64_t seed1 = static_cast<uint64_t>(seed1_in);
  uint32_t c[4] = {static_cast<uint32_t>(seed0),
                   static_cast<uint32_t>(seed0 >> 32),
                   static_cast<uint32_t>(seed1),
                   static_cast<uint32_t>(seed1 >> 32)};
  Philox10(c, 0x3ec8f720u, 0x02461e29u);
  PhiloxKey st;
  st.key[0] = c[0];
  st.key[1] = c[1];
  st.counter_hi[0] = c[2];
  st.counter_hi[1] = c[3];
  return st;
}

int64_t QuantizeBucketedScratchBytes(int64_t n, int64_t bucket_size) {
  if (n <= 0) return 0;
  const int64_t per_bucket = ChunksPerBucket(n, bucket_size);
  if (per_bucket <= 1) return 0;
  return NumBucketsOf(n, bucket_size) * per_bucket *
         static_cast<int64_t>(sizeof(double));
}

// scales[NumBuckets(n, d)], words[ceil(n / (32 / bits))]. scratch:
// QuantizeBucketedScratchBytes(n, d) bytes (may be null when that is 0).
template <int D>
cudaError_t QuantizeBucketed(const void* x, int64_t n, int64_t d, int levels,
                             int bits, bool max_norm, const PhiloxKey& st,
                             void* scratch, float* scales, int32_t* words,
                             cudaStream_t stream) {
  if (n <= 0) return cudaMemsetAsync(scales, 0, sizeof(float), stream);
  const int64_t nb = NumBucketsOf(n, d);
  const int64_t per_bucket = ChunksPerBucket(n, d);
  const int64_t items = nb * per_bucket;
  const bool direct = per_bucket <= 1;
  auto* partial = static_cast<double*>(scratch);
  BucketStatsKernel<D><<<NumBlocks(items * 32), kThreads, 0, stream>>>(
      static_cast<const typename Codec<D>::Raw*>(x), n, d, per_bucket, items,
      max_norm, direct, partial, scales);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (!direct) {
    CombineStatsKernel<<<NumBlocks(nb), kThreads, 0, stream>>>(
        partial, nb, per_bucket, max_norm, scales);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  switch (bits) {
    case 2:
      return LaunchQuantizeWords<D, 2>(x, n, d, levels, st, scales, words,
                                       stream);
    case 4:
      return LaunchQuantizeWords<D, 4>(x, n, d, levels, st, scales, words,
                                       stream);
    case 8:
      return LaunchQuantizeWords<D, 8>(x, n, d, levels, st, scales, words,
                                       stream);
    case 16:
      return LaunchQuantizeWords<D, 16>(x, n, d, levels, st, scales, words,
                                        stream);
  }
  return cudaErrorInvalidValue;
}

// out[n] <- decoded values; *bad (host) <- 1 if a used code exceeds
// 2 levels. flag_dev: one device int of scratch. Synchronises the stream.
template <int D>
cudaError_t DequantizeBucketed(const float* scales, const int32_t* words,
                               int64_t n, int64_t d, int levels, int bits,
                               void* out, int* flag_dev, int* bad,
                               cudaStream_t stream) {
  *bad = 0;
  if (n <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(flag_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  DequantizeKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
      scales, words, n, d, levels, bits,
      static_cast<typename Codec<D>::Raw*>(out), flag_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return ReadFlag(flag_dev, bad, stream);
}

// out[n] <- sum over workers in index order; scales [workers, nb], words
// [workers, nw] row-major. Same flag protocol as DequantizeBucketed.
cudaError_t DequantizeBucketedSum(const float* scales, const int32_t* words,
                                  int64_t workers, int64_t n, int64_t d,
                                  int levels, int bits, float* out,
                                  int* flag_dev, int* bad,
                                  cudaStream_t stream) {
  *bad = 0;
  if (n <= 0) return cudaSuccess;
  if (workers <= 0) return cudaMemsetAsync(out, 0, n * sizeof(float), stream);
  cudaError_t err = cudaMemsetAsync(flag_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  DequantizeSumKernel<<<NumBlocks(n), kThreads, 0, stream>>>(
      scales, words, workers, NumBucketsOf(n, d), CeilDiv(n, 32 / bits), n, d,
      levels, bits, out, flag_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return ReadFlag(flag_dev, bad, stream);
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers (ctypes). Return a cudaError_t, 0 = success.
//
// Quantize: scratch of tfgc_cuda_quantize_bucketed_scratch_bytes(n, d)
// bytes; the seed is the [2] int64 seed of the op (scrambled here exactly as
// TensorFlow does). Asynchronous.
// Dequantize / sum: flag_dev is one device int; they synchronise and set
// *bad to 1 if the payload holds a code above 2 * levels (reject it then).

extern "C" {

int64_t tfgc_cuda_quantize_bucketed_scratch_bytes(int64_t n,
                                                  int64_t bucket_size) {
  return tfgc::cuda::QuantizeBucketedScratchBytes(n, bucket_size);
}

int tfgc_cuda_quantize_bucketed(int dtype, const void* x, int64_t n,
                                int64_t bucket_size, int levels, int bits,
                                int max_norm, int64_t seed0, int64_t seed1,
                                void* scratch, float* scales, int32_t* words,
                                cudaStream_t stream) {
  const tfgc::cuda::PhiloxKey st = tfgc::cuda::PhiloxKeyFromSeed(seed0, seed1);
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::QuantizeBucketed, x, n,
                           bucket_size, levels, bits, max_norm != 0, st,
                           scratch, scales, words, stream);
}

int tfgc_cuda_dequantize_bucketed(int dtype, const float* scales,
                                  const int32_t* words, int64_t n,
                                  int64_t bucket_size, int levels, int bits,
                                  void* out, int* flag_dev, int* bad,
                                  cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::DequantizeBucketed, scales,
                           words, n, bucket_size, levels, bits, out, flag_dev,
                           bad, stream);
}

int tfgc_cuda_dequantize_bucketed_sum(const float* scales,
                                      const int32_t* words, int64_t workers,
                                      int64_t n, int64_t bucket_size,
                                      int levels, int bits, float* out,
                                      int* flag_dev, int* bad,
                                      cudaStream_t stream) {
  return tfgc::cuda::DequantizeBucketedSum(scales, words, workers, n,
                                           bucket_size, levels, bits, out,
                                           flag_dev, bad, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functors (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/quantize.h"
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

absl::Status BadCodeError(const QuantizeParams& p) {
  return tensorflow::errors::InvalidArgument(
      "words holds a code above 2 * levels = ", 2 * p.levels);
}

}  // namespace

template <typename T>
struct QuantizeBucketedFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          int64_t n, const PhiloxStream& stream,
                          const QuantizeParams& p, float* scales,
                          int32_t* words) {
    const cudaStream_t cu_stream = ctx->eigen_device<GPUDevice>().stream();
    tensorflow::Tensor scratch;
    void* scratch_ptr = nullptr;
    const int64_t bytes = cuda::QuantizeBucketedScratchBytes(n, p.bucket_size);
    if (bytes > 0) {
      TF_RETURN_IF_ERROR(ScratchBytes(ctx, bytes, &scratch, &scratch_ptr));
    }
    // The OpKernel derived the stream with TensorFlow's own PhiloxRandom;
    // the kernels only need its four words.
    cuda::PhiloxKey st;
    st.key[0] = stream.key[0];
    st.key[1] = stream.key[1];
    st.counter_hi[0] = stream.counter_hi[0];
    st.counter_hi[1] = stream.counter_hi[1];
    return CudaStatus(
        cuda::QuantizeBucketed<CudaDType<T>::kCode>(
            x, n, p.bucket_size, p.levels, p.bits, p.max_norm, st,
            scratch_ptr, scales, words, cu_stream),
        "TfgcQuantizeBucketed");
  }
};

template <typename T>
struct DequantizeBucketedFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const float* scales, const int32_t* words, int64_t n,
                          const QuantizeParams& p, T* out) {
    if (n == 0) return absl::OkStatus();
    tensorflow::Tensor flag;
    void* flag_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(ctx, sizeof(int), &flag, &flag_ptr));
    int bad = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::DequantizeBucketed<CudaDType<T>::kCode>(
            scales, words, n, p.bucket_size, p.levels, p.bits, out,
            static_cast<int*>(flag_ptr), &bad,
            ctx->eigen_device<GPUDevice>().stream()),
        "TfgcDequantizeBucketed"));
    return bad ? BadCodeError(p) : absl::OkStatus();
  }
};

// Defined out of the class body: an explicit specialisation has no
// explicit instantiation to emit inline members, and the OpKernel in
// quantize_kernels.cc needs the symbol.
template <>
struct DequantizeBucketedSumFunctor<GPUDevice> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const float* scales, const int32_t* words,
                          int64_t workers, int64_t n, const QuantizeParams& p,
                          float* out);
};

absl::Status DequantizeBucketedSumFunctor<GPUDevice>::operator()(
    tensorflow::OpKernelContext* ctx, const float* scales,
    const int32_t* words, int64_t workers, int64_t n, const QuantizeParams& p,
    float* out) {
  if (n == 0) return absl::OkStatus();
  tensorflow::Tensor flag;
  void* flag_ptr = nullptr;
  TF_RETURN_IF_ERROR(ScratchBytes(ctx, sizeof(int), &flag, &flag_ptr));
  int bad = 0;
  TF_RETURN_IF_ERROR(CudaStatus(
      cuda::DequantizeBucketedSum(scales, words, workers, n, p.bucket_size,
                                  p.levels, p.bits, out,
                                  static_cast<int*>(flag_ptr), &bad,
                                  ctx->eigen_device<GPUDevice>().stream()),
      "TfgcDequantizeBucketedSum"));
  return bad ? BadCodeError(p) : absl::OkStatus();
}

#define TFGC_INSTANTIATE_QUANTIZE_GPU(T)                 \
  template struct QuantizeBucketedFunctor<GPUDevice, T>; \
  template struct DequantizeBucketedFunctor<GPUDevice, T>;

TFGC_INSTANTIATE_QUANTIZE_GPU(float);
TFGC_INSTANTIATE_QUANTIZE_GPU(Eigen::half);
TFGC_INSTANTIATE_QUANTIZE_GPU(Eigen::bfloat16);

#undef TFGC_INSTANTIATE_QUANTIZE_GPU

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
