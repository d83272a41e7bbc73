// Op schemas and shape functions for threshold encoding. Kernels live in
// custom_ops/cc/kernels/threshold_kernels.cc (CPU) and threshold_gpu.cu.cc.
//
// As for the sign-bit ops, shape functions only infer and never reject: the
// kernels validate everything at run time, so a malformed payload fails the
// same way eagerly, inside tf.function and in the pure-TF reference.

#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfgc {
namespace {

using tensorflow::Tensor;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;

// Output length given by the scalar int64 num_elements input, or unknown if
// it is not a constant or not a valid size (the kernel reports that case).
DimensionHandle ThresholdNumElements(InferenceContext* c, int idx) {
  const Tensor* t = c->input_tensor(idx);
  if (t == nullptr || t->dims() != 0 || t->dtype() != tensorflow::DT_INT64) {
    return c->UnknownDim();
  }
  const int64_t v = t->scalar<int64_t>()();
  return (v >= 0 && v <= (int64_t{1} << 30)) ? c->MakeDim(v) : c->UnknownDim();
}

}  // namespace

REGISTER_OP("TfgcThresholdEncode")
    .Input("x: T")
    .Input("residual: T")
    .Input("pos_threshold: float")
    .Input("neg_threshold: float")
    .Output("words: int32")
    .Output("new_residual: T")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Threshold encoding with error feedback (Strom 2015; Dryden et al. 2016).

v = x + residual (flattened row-major, computed in T). With the thresholds
rounded to T, every v_i >= pos_threshold is sent as the word (i << 1) | 1 and
keeps residual v_i - pos_threshold; every v_i <= neg_threshold is sent as
(i << 1) | 0 and keeps v_i - neg_threshold; every other entry, NaN included,
is not sent and keeps v_i. Subtractions are done in float32 and rounded once
to T. Words are in ascending index order.

x, residual: same shape, at most 2^30 elements.
pos_threshold: scalar, > 0 and finite once rounded to T.
neg_threshold: scalar, < 0 and finite once rounded to T.
words: int32 [number of sent entries].
new_residual: shape of x.
)doc");

REGISTER_OP("TfgcThresholdDecode")
    .Input("words: int32")
    .Input("pos_value: float")
    .Input("neg_value: float")
    .Input("num_elements: int64")
    .Output("values: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(ThresholdNumElements(c, 3)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Inverse of TfgcThresholdEncode: a dense [num_elements] tensor with pos_value
at the indices of the positive words, neg_value at those of the negative ones
and 0 elsewhere. An index named cp times positively and cn times negatively
gets cp * pos_value + cn * neg_value (float32, rounded once to T), so repeated
words add up, in an order-independent, deterministic way.

words: 1-D; every word >= 0 and (word >> 1) < num_elements.
pos_value, neg_value: float32 scalars.
num_elements: scalar in [0, 2^30].
)doc");

}  // namespace tfgc
