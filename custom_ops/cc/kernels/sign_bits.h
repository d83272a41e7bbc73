// Functor declarations for the sign-bit op family (pack / unpack sign bits and
// Seide-style 1-bit quantization).
//
// The functors are declared here and specialised per device in separate
// translation units: sign_bits_kernels.cc holds the CPU specialisations, and a
// future sign_bits_kernels_gpu.cu.cc can add the GPU ones without touching the
// OpKernels, which only validate inputs and dispatch.
//
// Bit layout shared by every op (and by the Python references): the input is
// flattened row-major, element i lands in word i / 32 at bit position i % 32
// (least significant bit first). A bit is 1 iff the element compares
// `>= 0`, so -0.0 gives 1 and NaN (of either sign) gives 0. Padding bits of the
// last word are 0.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_SIGN_BITS_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_SIGN_BITS_H_

#include <cstdint>

// Kept light (no op_kernel.h) so that a future nvcc-compiled
// sign_bits_kernels_gpu.cu.cc can include it.
#include "absl/status/status.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tensorflow {
class OpKernelContext;
}  // namespace tensorflow

// The kernels look at half/bfloat16/float values through their raw bit
// patterns (integer compares and selects vectorise everywhere, software
// half<->float conversions do not). may_alias keeps that legal under strict
// aliasing without resorting to memcpy per element.
#if defined(__GNUC__) || defined(__clang__)
#define TFGC_MAY_ALIAS __attribute__((__may_alias__))
#else
#define TFGC_MAY_ALIAS
#endif

namespace tfgc {

typedef uint16_t TFGC_MAY_ALIAS AliasedU16;
typedef uint32_t TFGC_MAY_ALIAS AliasedU32;

// Number of 32-bit words needed for n sign bits. Written without `n + 31` so
// that it cannot overflow for n close to INT64_MAX.
inline int64_t NumSignWords(int64_t n) { return n / 32 + (n % 32 != 0 ? 1 : 0); }

// Raw-bit facts about each supported floating type.
//   kPosInf:   bit pattern of +inf. Unsigned patterns 0..kPosInf are exactly
//              the values that are >= +0.0 and not NaN.
//   kSignMask: sign bit; it is also the bit pattern of -0.0, the only value
//              with the sign bit set that still compares >= 0.
//   kOne:      bit pattern of +1.0; -1.0 is kOne | kSignMask.
template <typename T>
struct SignBitsTraits;

template <>
struct SignBitsTraits<float> {
  using Raw = uint32_t;
  using AliasedRaw = AliasedU32;
  static constexpr Raw kPosInf = 0x7f800000u;
  static constexpr Raw kSignMask = 0x80000000u;
  static constexpr Raw kOne = 0x3f800000u;
  static constexpr int kSignShift = 31;
};

template <>
struct SignBitsTraits<Eigen::half> {
  using Raw = uint16_t;
  using AliasedRaw = AliasedU16;
  static constexpr Raw kPosInf = 0x7c00u;
  static constexpr Raw kSignMask = 0x8000u;
  static constexpr Raw kOne = 0x3c00u;
  static constexpr int kSignShift = 15;
};

template <>
struct SignBitsTraits<Eigen::bfloat16> {
  using Raw = uint16_t;
  using AliasedRaw = AliasedU16;
  static constexpr Raw kPosInf = 0x7f80u;
  static constexpr Raw kSignMask = 0x8000u;
  static constexpr Raw kOne = 0x3f80u;
  static constexpr int kSignShift = 15;
};

namespace functor {

// words[NumSignWords(n)] <- sign bits of in[n]. n > 0.
template <typename Device, typename T>
struct PackSignBitsFunctor {
  void operator()(tensorflow::OpKernelContext* ctx, const T* in, int64_t n,
                  int32_t* words);
};

// out[n] <- +1 / -1 from the first n bits of words. n > 0, words already
// validated to hold exactly NumSignWords(n) entries.
template <typename Device, typename T>
struct UnpackSignBitsFunctor {
  void operator()(tensorflow::OpKernelContext* ctx, const int32_t* words,
                  int64_t n, T* out);
};

// 1-bit quantisation of a row-major [rows, cols] matrix, statistics per
// column. Outputs:
//   words[NumSignWords(rows*cols)]  sign bits, same layout as PackSignBits
//   pos_mean[cols], neg_mean[cols]  class means (float32); an empty class
//                                   has mean 0
//   residual[rows*cols]             T(x - T(mean of x's class))
// Returns a non-OK status only if scratch memory cannot be allocated.
template <typename Device, typename T>
struct OneBitQuantizeFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          int64_t rows, int64_t cols, int32_t* words,
                          float* pos_mean, float* neg_mean, T* residual);
};

// out[rows*cols] <- T(bit ? pos_mean[col] : neg_mean[col]). Inputs are
// already validated; rows*cols does not overflow.
template <typename Device, typename T>
struct OneBitDequantizeFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const int32_t* words, const float* pos_mean,
                          const float* neg_mean, int64_t rows, int64_t cols,
                          T* out);
};

}  // namespace functor
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_SIGN_BITS_H_
