// Helpers shared by tfgc's CPU kernels: thread-pool loops, float bit
// patterns, and exact branch-free half/bfloat16 <-> float conversions.
// CPU only (includes op_kernel.h); CUDA code has gpu_common.cuh.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_CPU_UTIL_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_CPU_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/errors.h"
#include "tsl/platform/threadpool.h"
#include "unsupported/Eigen/CXX11/Tensor"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define TFGC_CPU_X86 1
#else
#define TFGC_CPU_X86 0
#endif

namespace tfgc {
namespace cpu {

using ThreadPool = tsl::thread::ThreadPool;
using tensorflow::OpKernelContext;

// Bit b of a word. Testing `word & kBit[b]` instead of `(word >> b) & 1`
// avoids per-lane variable shifts, which baseline SSE2 does not have, so the
// 32-element loops below vectorise.
alignas(64) inline constexpr uint32_t kBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,
    1u << 7,  1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13,
    1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20,
    1u << 21, 1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27,
    1u << 28, 1u << 29, 1u << 30, 1u << 31};

inline int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

inline ThreadPool* Workers(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->workers;
}

// Runs fn over [0, total) on the intra-op pool. cost_per_unit is a rough cycle
// count; the pool uses it to decide how finely to split (tiny inputs run
// inline on the calling thread).
inline void ParallelFor(OpKernelContext* ctx, int64_t total, int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (total <= 0) return;
  Workers(ctx)->ParallelFor(
      total,
      ThreadPool::SchedulingParams::Adaptive(std::max<int64_t>(cost_per_unit, 1)),
      fn);
}

// The value of a scalar op input; InvalidArgument naming the input unless it
// is a scalar. Every op's argument checks read their scalars through this.
template <typename V>
absl::Status ScalarValue(const tensorflow::Tensor& t, const char* name,
                         V* value) {
  if (!tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return tensorflow::errors::InvalidArgument(
        name, " must be a scalar, got shape ", t.shape().DebugString());
  }
  *value = t.scalar<V>()();
  return absl::OkStatus();
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Run-time ISA checks for the kernels' hot loops, which are compiled for the
// baseline ISA and, on x86-64, also for AVX2 (and AVX-512VL) through target
// attributes: the library must load on every host that runs the TensorFlow
// wheel, so no -march flag. Always false elsewhere.
inline bool HasAvx2() {
#if TFGC_CPU_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
#else
  return false;
#endif
}

inline bool HasAvx512Vl() {
#if TFGC_CPU_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 &&
           __builtin_cpu_supports("avx512f") != 0 &&
           __builtin_cpu_supports("avx512vl") != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Outputs at least this large are written with non-temporal ("streaming")
// stores, by StreamCopy or by a kernel's own vector loop. A plain store first
// reads the destination line into the cache ("read for ownership"), so
// writing an output costs two transfers per byte where a streaming store
// costs one: a quarter of the traffic of an x + r -> residual pass. Smaller
// outputs are likely still in the last-level cache when the next op reads
// them, and plain stores keep them there.
constexpr int64_t kStreamMinBytes = int64_t{4} << 20;

// Copies `bytes` from src (hot in cache) to dst (a large output that is not
// read again soon) with non-temporal stores where dst is 16-byte aligned.
// The stores are weakly ordered: call StreamFence() before another thread
// may read dst (the end of a thread-pool task is such a point).
inline void StreamCopy(void* dst, const void* src, size_t bytes) {
#if TFGC_CPU_X86
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = std::min(
      bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & size_t{15});
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline void StreamFence() {
#if TFGC_CPU_X86
  _mm_sfence();
#endif
}

// mask ? a : b for an all-ones / all-zero mask. Written with bit operations
// because GCC would otherwise sink the float arithmetic that feeds only one
// side of a `?:` into a branch, and then refuse to vectorise the loop (the
// arithmetic might trap).
inline uint32_t Select(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & mask) | (b & ~mask);
}

// Exact, branch-free conversions between T and float bit patterns. Eigen's
// scalar half conversions branch (and do not vectorise without F16C, which
// the portable build cannot assume); these select between precomputed
// candidates instead. Rounding is to nearest even and NaN becomes the same
// canonical quiet NaN as Eigen's conversion. The float arithmetic inside only
// ever sees normal floats or values that round to zero anyway, so
// TensorFlow's flush-to-zero mode cannot change a result.
template <typename T>
struct FloatCodec;

template <>
struct FloatCodec<float> {
  static inline uint32_t ToF32Bits(uint32_t r) { return r; }
  static inline uint32_t FromF32Bits(uint32_t f) { return f; }
};

template <>
struct FloatCodec<Eigen::bfloat16> {
  static inline uint32_t ToF32Bits(uint16_t r) {
    return static_cast<uint32_t>(r) << 16;
  }
  static inline uint16_t FromF32Bits(uint32_t f) {
    const uint32_t rounded = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
    const uint32_t nan = ((f >> 16) & 0x8000u) | 0x7fc0u;
    return static_cast<uint16_t>((f & 0x7fffffffu) > 0x7f800000u ? nan
                                                                 : rounded);
  }
};

template <>
struct FloatCodec<Eigen::half> {
  static inline uint32_t ToF32Bits(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    // Normal: rebias the exponent (15 -> 127). Inf/NaN: rebias to 255.
    const uint32_t normal = (em << 13) + 0x38000000u;
    const uint32_t inf_nan = normal + 0x38000000u;
    // Subnormal or zero: em * 2^-24 exactly, computed from an integer so no
    // float subnormal is involved.
    const uint32_t subnormal = FloatToBits(
        static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
    const uint32_t is_special = 0u - static_cast<uint32_t>(em >= 0x7c00u);
    const uint32_t is_normal = 0u - static_cast<uint32_t>(em >= 0x0400u);
    const uint32_t mag = Select(is_special, inf_nan,
                                Select(is_normal, normal, subnormal));
    return mag | (static_cast<uint32_t>(h & 0x8000u) << 16);
  }
  static inline uint16_t FromF32Bits(uint32_t f) {
    const uint32_t sign = f & 0x80000000u;
    const uint32_t a = f ^ sign;
    // |x| >= 65536 (or inf / NaN): infinity, or canonical NaN.
    const uint32_t big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
    // |x| < 2^-14 lands in half's subnormal range: adding 0.5f lines the
    // mantissa up so that the FPU's own round-to-nearest-even does the job.
    const uint32_t subnormal = FloatToBits(BitsToFloat(a) + 0.5f) - 0x3f000000u;
    // Normal: rebias (127 -> 15) and round the 13 dropped bits to even.
    const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    const uint32_t is_big = 0u - static_cast<uint32_t>(a >= 0x47800000u);
    const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < 0x38800000u);
    const uint32_t mag =
        Select(is_big, big, Select(is_subnormal, subnormal, normal));
    return static_cast<uint16_t>(mag | (sign >> 16));
  }
};

}  // namespace cpu
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_CPU_UTIL_H_
