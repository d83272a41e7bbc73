// Shape-function helpers shared by tfgc's op schemas.

#ifndef TFGC_CUSTOM_OPS_CC_OPS_SHAPE_UTIL_H_
#define TFGC_CUSTOM_OPS_CC_OPS_SHAPE_UTIL_H_

#include <cstdint>

#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfgc {

// Dimension given by a scalar int64 input, or unknown if it is not a constant
// or is not a valid size (the kernel reports that case).
inline tensorflow::shape_inference::DimensionHandle DimFromScalarInput(
    tensorflow::shape_inference::InferenceContext* c, int idx) {
  const tensorflow::Tensor* t = c->input_tensor(idx);
  if (t == nullptr || t->dims() != 0 || t->dtype() != tensorflow::DT_INT64) {
    return c->UnknownDim();
  }
  const int64_t v = t->scalar<int64_t>()();
  return v >= 0 ? c->MakeDim(v) : c->UnknownDim();
}

// Shape function of ops whose only output is a vector of length input `idx`.
inline absl::Status VectorOfScalarInputLength(
    tensorflow::shape_inference::InferenceContext* c, int idx) {
  c->set_output(0, c->Vector(DimFromScalarInput(c, idx)));
  return absl::OkStatus();
}

}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_OPS_SHAPE_UTIL_H_
