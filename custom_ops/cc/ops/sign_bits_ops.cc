// Op schemas and shape functions for the sign-bit op family. Kernels live in
// custom_ops/cc/kernels/.
//
// The shape functions are deliberately permissive: they infer whatever output
// shape is knowable but never reject inputs. Word buffers and sizes usually
// arrive from another worker, and all validation is done by the kernels so
// that a malformed payload fails the same way (InvalidArgument at run time)
// in eager mode, inside tf.function and in the pure-TF references.

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

inline int64_t NumWords(int64_t n) { return n / 32 + (n % 32 != 0 ? 1 : 0); }

// Dimension 0 of a rank-1 input, or unknown.
DimensionHandle VectorLength(InferenceContext* c, int idx) {
  ShapeHandle s = c->input(idx);
  if (c->RankKnown(s) && c->Rank(s) == 1) return c->Dim(s, 0);
  return c->UnknownDim();
}

DimensionHandle WordsForDim(InferenceContext* c, DimensionHandle n) {
  if (!c->ValueKnown(n)) return c->UnknownDim();
  return c->MakeDim(NumWords(c->Value(n)));
}

}  // namespace

REGISTER_OP("TfgcPackSignBits")
    .Input("x: T")
    .Output("words: int32")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle n = c->UnknownDim();
      if (c->RankKnown(c->input(0))) {
        n = c->NumElements(c->input(0));
      }
      c->set_output(0, c->Vector(WordsForDim(c, n)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Packs the signs of `x` (flattened row-major) into 32-bit words.

Element i sets bit i % 32 (LSB first) of word i / 32 iff x_i >= 0, so -0.0
packs as 1 and NaN as 0. Padding bits of the last word are 0.

words: int32 [ceil(size(x) / 32)].
)doc");

REGISTER_OP("TfgcUnpackSignBits")
    .Input("words: int32")
    .Input("num_elements: int64")
    .Output("values: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(DimFromScalarInput(c, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Inverse of TfgcPackSignBits: +1 where the bit is set, -1 where it is not.

words: 1-D with exactly ceil(num_elements / 32) entries.
num_elements: scalar >= 0.
values: [num_elements].
)doc");

REGISTER_OP("TfgcOneBitQuantize")
    .Input("x: T")
    .Output("words: int32")
    .Output("pos_mean: float")
    .Output("neg_mean: float")
    .Output("residual: T")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x = c->input(0);
      DimensionHandle n = c->UnknownDim();
      DimensionHandle cols = c->UnknownDim();
      if (c->RankKnown(x)) {
        n = c->NumElements(x);
        if (c->Rank(x) == 2) cols = c->Dim(x, 1);
      }
      c->set_output(0, c->Vector(WordsForDim(c, n)));
      c->set_output(1, c->Vector(cols));
      c->set_output(2, c->Vector(cols));
      c->set_output(3, x);
      return absl::OkStatus();
    })
    .Doc(R"doc(
1-bit SGD quantisation (Seide et al. 2014) of a [rows, cols] matrix.

Per column j, pos_mean_j / neg_mean_j are the means of the entries >= 0 / < 0
(0 for an empty class). NaN entries fall in the negative class and make that
column's neg_mean NaN. words packs the signs exactly like TfgcPackSignBits.
residual = x - decoded, where decoded is the class mean rounded to T.
)doc");

REGISTER_OP("TfgcOneBitDequantize")
    .Input("words: int32")
    .Input("pos_mean: float")
    .Input("neg_mean: float")
    .Input("rows: int64")
    .Output("values: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .SetShapeFn([](InferenceContext* c) {
      DimensionHandle cols = VectorLength(c, 1);
      if (!c->ValueKnown(cols)) cols = VectorLength(c, 2);
      c->set_output(0, c->Matrix(DimFromScalarInput(c, 3), cols));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Inverse of TfgcOneBitQuantize: values[r, j] = pos_mean[j] if bit r*cols+j is
set, else neg_mean[j], with cols = size(pos_mean).

words: 1-D with exactly ceil(rows * cols / 32) entries.
pos_mean, neg_mean: 1-D of equal length.
rows: scalar >= 0; rows * cols must fit in int64.
)doc");

}  // namespace tfgc
