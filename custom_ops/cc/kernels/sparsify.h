// Functor declarations for the sparsification op family: top-k / DGC-style
// selection with error feedback, threshold selection, and the decode
// (scatter-add of (value, index) payloads).
//
// The functors are specialised per device in separate translation units
// (sparsify_kernels.cc holds the CPU ones); the OpKernels only validate their
// inputs and dispatch. Because the number of selected entries is only known
// once the data has been looked at, the selection functors allocate the
// variable-sized outputs themselves through the OpKernelContext.
//
// Ranking used by every selection: the key of v is |v| with NaN ranked below
// every number (including 0); equal keys are broken toward the lower flat
// (row-major) index. +-Inf therefore ranks first and -0.0 ties with +0.0.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_SPARSIFY_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_SPARSIFY_H_

#include <cstdint>

// Kept light (no op_kernel.h) so that the nvcc-compiled sparsify_gpu.cu.cc
// can include it.
#include "absl/status/status.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tensorflow {
class OpKernelContext;
}  // namespace tensorflow

namespace tfgc {

// Indices travel as int32, so a tensor may have at most 2^31 elements.
constexpr int64_t kMaxSparsifyElements = int64_t{1} << 31;

// Output slots shared by both selection ops.
enum SparsifyOutput : int {
  kSparsifyValues = 0,        // T [m]
  kSparsifyIndices = 1,       // int32 [m], ascending
  kSparsifyNewResidual = 2,   // T, shape of x
  kSparsifyMask = 3,          // bool [n], or [0] without with_mask
};

struct SparsifyTopKOptions {
  int64_t k = 0;          // >= 0, already validated
  uint64_t seed = 0;      // sampling seed
  bool exact = false;     // exactly min(k, n) entries vs DGC sampling
  float sample_ratio = 0.01f;  // in (0, 1]
  bool with_mask = false;
};

namespace functor {

// v = x + residual (n elements, 0 < n <= kMaxSparsifyElements) and the
// selection of its largest |v| described in sparsify_ops.cc. Writes
// new_residual[n] (preallocated) and allocates outputs kSparsifyValues,
// kSparsifyIndices and kSparsifyMask.
template <typename Device, typename T>
struct SparsifyTopKFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n,
                          const SparsifyTopKOptions& options, T* new_residual);
};

// Same outputs, selecting v >= pos_threshold or v <= neg_threshold (compared
// in float32; NaN never selected). pos_threshold >= 0 >= neg_threshold.
template <typename Device, typename T>
struct SparsifyByThresholdFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n, float pos_threshold,
                          float neg_threshold, bool with_mask,
                          T* new_residual);
};

// out[n] <- sum of values[j] over j with indices[j] == i, added in order of j
// (float32 accumulation for half types). Returns InvalidArgument if an index
// lies outside [0, n); out is then unspecified.
template <typename Device, typename T>
struct ScatterAddPayloadsFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* values,
                          const int32_t* indices, int64_t m, int64_t n,
                          T* out);
};

}  // namespace functor
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_SPARSIFY_H_
