// Op schemas and shape functions for the sparsification op family. Kernels
// live in custom_ops/cc/kernels/sparsify_kernels.cc.
//
// As for the other tfgc ops, shape functions infer what they can and never
// reject inputs: all validation happens in the kernels, so that a bad
// argument fails the same way (InvalidArgument at run time) in eager mode,
// inside tf.function and in the pure-TF references.

#include <cstdint>

#include "custom_ops/cc/ops/shape_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfgc {
namespace {

using tensorflow::Tensor;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// values, indices: [?]; new_residual: shape of x; mask: [size(x)] with the
// with_mask attr, [0] without.
absl::Status SelectionShapes(InferenceContext* c) {
  c->set_output(0, c->Vector(c->UnknownDim()));
  c->set_output(1, c->Vector(c->UnknownDim()));
  c->set_output(2, c->input(0));
  bool with_mask = false;
  TF_RETURN_IF_ERROR(c->GetAttr("with_mask", &with_mask));
  DimensionHandle mask_len = c->MakeDim(0);
  if (with_mask) {
    mask_len = c->RankKnown(c->input(0)) ? c->NumElements(c->input(0))
                                         : c->UnknownDim();
  }
  c->set_output(3, c->Vector(mask_len));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfgcSparsifyWithResidual")
    .Input("x: T")
    .Input("residual: T")
    .Input("k: int64")
    .Input("seed: int64")
    .Output("values: T")
    .Output("indices: int32")
    .Output("new_residual: T")
    .Output("mask: bool")
    .Attr("T: {float, half, bfloat16}")
    .Attr("exact: bool = false")
    .Attr("sample_ratio: float = 0.01")
    .Attr("with_mask: bool = false")
    .SetShapeFn(SelectionShapes)
    .Doc(R"doc(
Top-k sparsification with error feedback (Strom 2015; Aji & Heafield 2017;
Lin et al. 2018, "Deep Gradient Compression").

v = x + residual (flattened row-major, at most 2^31 elements). Entries are
ranked by |v|, NaN below every number, ties toward the lower index.
exact: keep exactly min(k, n) entries, the top of that ranking.
Otherwise (DGC): estimate the threshold from a deterministic (given seed)
jittered-stratified sample of max(ceil(sample_ratio * n), min(n, 256))
entries, select |v| >= threshold, lower the threshold by 0.8x (up to 10
times) while fewer than ceil(0.8k) pass, and keep the exact top k of the
selection when more than floor(1.3k) pass; the count ends in
[ceil(0.8k), max(k, floor(1.3k))], or is exactly k after the fallback.
k = 0 selects nothing; k >= n selects everything.

values, indices: the selected v and their flat indices, ascending.
new_residual: v with the selected entries set to +0.
mask: bool [n] marking the selected entries when with_mask, else [0].
)doc");

REGISTER_OP("TfgcSparsifyByThreshold")
    .Input("x: T")
    .Input("residual: T")
    .Input("pos_threshold: float")
    .Input("neg_threshold: float")
    .Output("values: T")
    .Output("indices: int32")
    .Output("new_residual: T")
    .Output("mask: bool")
    .Attr("T: {float, half, bfloat16}")
    .Attr("with_mask: bool = false")
    .SetShapeFn(SelectionShapes)
    .Doc(R"doc(
Threshold sparsification with error feedback (Strom 2015; Dryden et al. 2016
use separate positive and negative thresholds).

v = x + residual; selects v >= pos_threshold or v <= neg_threshold, compared
in float32 (NaN is never selected). Requires pos_threshold >= 0 >=
neg_threshold. Outputs as in TfgcSparsifyWithResidual.
)doc");

REGISTER_OP("TfgcScatterAddPayloads")
    .Input("values: T")
    .Input("indices: int32")
    .Input("num_elements: int64")
    .Output("dense: T")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) { return VectorOfScalarInputLength(c, 2); })
    .Doc(R"doc(
Decodes sparse payloads: dense[i] = sum of values[j] over indices[j] == i,
added in order of j (in float32 for half types, rounded once), so duplicates
accumulate deterministically.

values, indices: 1-D of equal length; every index in [0, num_elements).
num_elements: scalar in [0, 2^31].
)doc");

}  // namespace tfgc
