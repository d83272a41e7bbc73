// Device helpers shared by the tfgc CUDA kernels (*_gpu.cu.cc).
//
// Deliberately free of TensorFlow headers: the kernels and their extern "C"
// launchers are compiled by plain nvcc (scripts/check_cuda.sh and the
// standalone harness in custom_ops/cuda_harness/), and only the
// `#if GOOGLE_CUDA` sections of the .cu.cc files pull in TensorFlow.
//
// Element types travel as raw storage (float, or uint16_t bit patterns for
// float16 / bfloat16) so that the launchers can take void pointers from
// ctypes and the TF functors can reinterpret Eigen::half / Eigen::bfloat16
// buffers without either side knowing the other's types.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_GPU_COMMON_CUH_
#define TFGC_CUSTOM_OPS_CC_KERNELS_GPU_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace tfgc {
namespace cuda {

// dtype codes of the extern "C" launchers.
enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kThreads = 256;
// Grid-stride loops cover any size; more blocks than this only add
// scheduling overhead.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

inline int NumBlocks(int64_t work_items, int64_t per_block = kThreads) {
  const int64_t blocks = work_items / per_block + (work_items % per_block != 0);
  return static_cast<int>(std::max<int64_t>(1, std::min(blocks, kMaxBlocks)));
}

// Conversions are the CUDA round-to-nearest-even intrinsics, the same
// rounding as Eigen's on the CPU (NaN payloads may differ).
template <int D>
struct Codec;

template <>
struct Codec<kFloat32> {
  using Raw = float;
  __device__ __forceinline__ static float ToFloat(Raw r) { return r; }
  __device__ __forceinline__ static Raw FromFloat(float f) { return f; }
};

template <>
struct Codec<kFloat16> {
  using Raw = uint16_t;
  __device__ __forceinline__ static float ToFloat(Raw r) {
    return __half2float(__ushort_as_half(r));
  }
  __device__ __forceinline__ static Raw FromFloat(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};

template <>
struct Codec<kBFloat16> {
  using Raw = uint16_t;
  __device__ __forceinline__ static float ToFloat(Raw r) {
    return __bfloat162float(__ushort_as_bfloat16(r));
  }
  __device__ __forceinline__ static Raw FromFloat(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

// First thread / thread count of a 1-D grid-stride loop, in 64 bits.
__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GlobalThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Block-wide exclusive prefix sum of one value per thread, for blocks of
// kThreads threads; returns this thread's prefix and sets *total. Every
// thread of the block must call it. The trailing barrier lets a kernel call
// it again straight away (the shared warp totals are reused).
template <typename V>
__device__ V BlockExclusiveScan(V value, V* total) {
  constexpr int kWarpsPerBlock = kThreads / 32;
  __shared__ V warp_sums[kWarpsPerBlock];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  V inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    const V y = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += y;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    V s = lane < kWarpsPerBlock ? warp_sums[lane] : V(0);
    for (int d = 1; d < 32; d <<= 1) {
      const V y = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += y;
    }
    if (lane < kWarpsPerBlock) warp_sums[lane] = s;  // inclusive warp totals
  }
  __syncthreads();
  const V warp_prefix = warp > 0 ? warp_sums[warp - 1] : V(0);
  *total = warp_sums[kWarpsPerBlock - 1];
  const V result = warp_prefix + inclusive - value;
  __syncthreads();
  return result;
}

// a + b and a - b in float32 with subnormals flushed to (signed) zero on
// input and output. TensorFlow's CPU threads run with FTZ / DAZ set, so the
// CPU ops flush (a float32 or bfloat16 subnormal in x gives 0 in x + r), and
// TensorFlow's own GPU kernels are compiled with flush-to-zero; the explicit
// .ftz instructions reproduce that whatever -ftz setting nvcc gets.
__device__ __forceinline__ float AddFlushed(float a, float b) {
  float sum;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(sum) : "f"(a), "f"(b));
  return sum;
}
__device__ __forceinline__ float SubFlushed(float a, float b) {
  float diff;
  asm("sub.rn.ftz.f32 %0, %1, %2;" : "=f"(diff) : "f"(a), "f"(b));
  return diff;
}

// Calls fn<D>(args...) for a runtime dtype code; unknown codes give
// cudaErrorInvalidValue.
#define TFGC_CUDA_DISPATCH_DTYPE(dtype, fn, ...)                         \
  switch (dtype) {                                                     \
    case ::tfgc::cuda::kFloat32:                                       \
      return fn<::tfgc::cuda::kFloat32>(__VA_ARGS__);                  \
    case ::tfgc::cuda::kFloat16:                                       \
      return fn<::tfgc::cuda::kFloat16>(__VA_ARGS__);                  \
    case ::tfgc::cuda::kBFloat16:                                      \
      return fn<::tfgc::cuda::kBFloat16>(__VA_ARGS__);                 \
    default:                                                           \
      return cudaErrorInvalidValue;                                    \
  }

}  // namespace cuda
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_GPU_COMMON_CUH_
