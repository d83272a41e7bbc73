// Functor declarations for threshold encoding (Strom 2015; Dryden et al. 2016).
//
// Like sign_bits.h this header stays light (no op_kernel.h) so that the
// nvcc-compiled threshold_gpu.cu.cc can include it; the OpKernels in
// threshold_kernels.cc validate shapes and scalars and dispatch to the
// per-device functors declared here.
//
// Word format shared by every implementation (CPU, GPU, Python reference):
// element i of the flattened input is sent as the int32 word (i << 1) | s,
// s = 1 for a value that reached the positive threshold and s = 0 for one that
// reached the negative threshold. Words are in ascending index order. The
// element count is limited to 2^30 so that every word is a non-negative int32.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_THRESHOLD_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_THRESHOLD_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tensorflow {
class OpKernelContext;
}  // namespace tensorflow

namespace tfgc {

// Largest element count a threshold payload can address: indices go up to
// 2^30 - 1, so (i << 1) | 1 <= 2^31 - 1.
constexpr int64_t kMaxThresholdElements = int64_t{1} << 30;

namespace functor {

// Allocates the words output once its length is known and returns its buffer.
// The encoders only learn the number of sent elements after a first pass, so
// the OpKernel hands them this instead of a preallocated buffer.
using AllocateWordsFn = std::function<absl::Status(int64_t m, int32_t** words)>;

// v = x + residual (in T); v >= pos_threshold is sent with s = 1 and keeps
// residual v - T(pos_threshold), v <= neg_threshold is sent with s = 0 and
// keeps v - T(neg_threshold), anything else (NaN included) keeps v.
// Comparisons and subtractions are in float32, rounded once to T.
// 0 < n <= kMaxThresholdElements; the thresholds are already validated.
template <typename Device, typename T>
struct ThresholdEncodeFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n, float pos_threshold,
                          float neg_threshold, T* new_residual,
                          const AllocateWordsFn& allocate_words);
};

// out[n] <- decoded words. `words` has m entries whose values are NOT yet
// validated: the functor returns InvalidArgument unless every word is >= 0
// and (word >> 1) < n, and must not write anything out of bounds before it
// knows. Index i receives cp * pos_value + cn * neg_value (float32, each term
// only if its count is non-zero, rounded once to T), cp / cn being how many
// positive / negative words name i; unnamed indices are 0.
// 0 <= n <= kMaxThresholdElements.
template <typename Device, typename T>
struct ThresholdDecodeFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx,
                          const int32_t* words, int64_t m, float pos_value,
                          float neg_value, int64_t n, T* out);
};

}  // namespace functor
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_THRESHOLD_H_
