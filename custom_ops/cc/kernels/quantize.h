// Functor declarations for stochastic bucketed quantization (QSGD, Alistarh
// et al. 2017; TernGrad, Wen et al. 2017 is the case s = 1, one bucket) with
// b-bit code packing.
//
// As in sign_bits.h, the functors are declared here and specialised per
// device elsewhere (quantize_kernels.cc for the CPU); the OpKernels only
// validate and dispatch.
//
// Wire format (identical to tfgc.compressors.quantizers.QSGD and to
// tfgc.ops.packing.pack_codes):
//   * the input is flattened row-major and cut into buckets of bucket_size
//     consecutive elements (the last one partial); there are
//     NumBuckets(n, d) = max(1, ceil(n / d)) buckets, so n = 0 still sends one
//     (zero) scale;
//   * scales[b] (float32) is the l2 norm or the max |v| of bucket b;
//   * element i gets a signed level q_i in [-s, s] and the unsigned code
//     q_i + s, stored in `bits` bits (2, 4, 8 or 16): code i is field
//     i % (32 / bits) (least significant field first) of int32 word
//     i / (32 / bits). Padding fields of the last word are 0.
//
// Randomness: element i uses the i-th float of
// tf.random.stateless_uniform([N], seed) (Philox-4x32-10 with TensorFlow's
// seed scrambling; element i is output i % 4 of counter i / 4), so a result
// depends only on (seed, x) and never on how the work is sharded.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_QUANTIZE_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_QUANTIZE_H_

#include <cstdint>

// Kept light (no op_kernel.h) so that a future nvcc-compiled
// quantize_kernels_gpu.cu.cc can include it.
#include "absl/status/status.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tensorflow {
class OpKernelContext;
}  // namespace tensorflow

namespace tfgc {

// Largest number of levels s: codes 0..2s must fit in 16 bits.
constexpr int kMaxQuantizeLevels = 32767;

// Codes per int32 word for a field width of `bits` (2, 4, 8 or 16).
inline int64_t CodesPerWord(int bits) { return 32 / bits; }

// ceil(n / (32 / bits)) words; no overflow for any n >= 0.
inline int64_t NumCodeWords(int64_t n, int bits) {
  const int64_t k = CodesPerWord(bits);
  return n / k + (n % k != 0 ? 1 : 0);
}

// max(1, ceil(n / d)) buckets, as in the Python QSGD compressor; d >= 1.
inline int64_t NumBuckets(int64_t n, int64_t d) {
  const int64_t b = n / d + (n % d != 0 ? 1 : 0);
  return b > 0 ? b : 1;
}

// True iff every code 0..2s fits in a field of `bits` bits.
inline bool BitsHoldLevels(int bits, int levels) {
  return bits >= 1 && bits <= 16 &&
         int64_t{2} * levels + 1 <= (int64_t{1} << bits);
}

// Philox-4x32 key and the fixed upper half of the counter, derived from a
// 2 x int64 seed exactly as TensorFlow's stateless random ops do.
struct PhiloxStream {
  uint32_t key[2];
  uint32_t counter_hi[2];
};

struct QuantizeParams {
  int levels;           // s
  int64_t bucket_size;  // d
  int bits;             // field width
  bool max_norm;        // scale = max |v| instead of the l2 norm
};

namespace functor {

// scales[NumBuckets(n, d)], words[NumCodeWords(n, bits)] <- quantized x[n].
// n may be 0 (then the single scale is 0 and there are no words).
template <typename Device, typename T>
struct QuantizeBucketedFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          int64_t n, const PhiloxStream& stream,
                          const QuantizeParams& params, float* scales,
                          int32_t* words);
};

// out[n] <- T((code_i - s) * (scales[i / d] / s)). Sizes are already
// validated; returns InvalidArgument if any code exceeds 2s (out is then
// fully written but meaningless).
template <typename Device, typename T>
struct DequantizeBucketedFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const float* scales, const int32_t* words, int64_t n,
                          const QuantizeParams& params, T* out);
};

// out[n] <- sum over w in [0, workers), in that order, of worker w's decoded
// payload (scales + w * NumBuckets, words + w * NumCodeWords), in float32
// from +0. workers >= 1; sizes already validated.
template <typename Device>
struct DequantizeBucketedSumFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const float* scales, const int32_t* words,
                          int64_t workers, int64_t n,
                          const QuantizeParams& params, float* out);
};

}  // namespace functor
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_QUANTIZE_H_
