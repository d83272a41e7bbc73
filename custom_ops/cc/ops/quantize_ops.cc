// Op schemas and shape functions for stochastic bucketed quantization
// (QSGD / TernGrad). Kernels live in custom_ops/cc/kernels/quantize_kernels.cc.
//
// As for the sign-bit ops, shape functions only infer what is knowable and
// never reject: attributes are checked by the kernels' constructors and
// payloads by their Compute, so that errors are InvalidArgument at run time
// in eager mode, in tf.function and in the pure-TF references alike.

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

// Attributes valid enough to size the outputs; otherwise the kernel reports.
bool SaneAttrs(InferenceContext* c, int64_t* bucket_size, int64_t* bits) {
  if (!c->GetAttr("bucket_size", bucket_size).ok() ||
      !c->GetAttr("bits", bits).ok()) {
    return false;
  }
  return *bucket_size >= 1 &&
         (*bits == 2 || *bits == 4 || *bits == 8 || *bits == 16);
}

DimensionHandle QuantizeScalesDim(InferenceContext* c, DimensionHandle n,
                                  int64_t d) {
  if (!c->ValueKnown(n)) return c->UnknownDim();
  const int64_t v = c->Value(n);
  const int64_t b = v / d + (v % d != 0 ? 1 : 0);
  return c->MakeDim(b > 0 ? b : 1);
}

DimensionHandle QuantizeWordsDim(InferenceContext* c, DimensionHandle n,
                                 int64_t bits) {
  if (!c->ValueKnown(n)) return c->UnknownDim();
  const int64_t v = c->Value(n);
  const int64_t k = 32 / bits;
  return c->MakeDim(v / k + (v % k != 0 ? 1 : 0));
}

}  // namespace

REGISTER_OP("TfgcQuantizeBucketed")
    .Input("x: T")
    .Input("seed: int64")
    .Output("scales: float")
    .Output("words: int32")
    .Attr("T: {float, half, bfloat16}")
    .Attr("levels: int")
    .Attr("bucket_size: int")
    .Attr("bits: int")
    .Attr("norm: string = 'l2'")
    .SetShapeFn([](InferenceContext* c) {
      int64_t d = 0, bits = 0;
      DimensionHandle n = c->UnknownDim();
      if (c->RankKnown(c->input(0))) n = c->NumElements(c->input(0));
      if (!SaneAttrs(c, &d, &bits)) {
        c->set_output(0, c->Vector(c->UnknownDim()));
        c->set_output(1, c->Vector(c->UnknownDim()));
        return absl::OkStatus();
      }
      c->set_output(0, c->Vector(QuantizeScalesDim(c, n, d)));
      c->set_output(1, c->Vector(QuantizeWordsDim(c, n, bits)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Stochastic bucketed quantization (QSGD, Alistarh et al. 2017; TernGrad,
Wen et al. 2017, is levels = 1 with one bucket and norm = 'max').

x is flattened and cut into max(1, ceil(n / bucket_size)) buckets. For bucket
b, scale_b is its l2 norm (summed in float64) or max |v|. Element v gets
a = levels * |v| / scale_b (0 if scale_b is 0 or the quotient is NaN, capped
at levels), level = floor(a) + [u < a - floor(a)] with u the element's
tf.random.stateless_uniform draw for `seed`, and code = levels + sign(v) *
level, packed `bits` bits per code LSB first (32 / bits per word, padding 0).

seed: int64 [2].
levels: s in [1, 32767]; bits must hold the 2s + 1 codes.
bits: 2, 4, 8 or 16.
norm: 'l2' or 'max'.
scales: float32 [num_buckets].
words: int32 [ceil(n * bits / 32)].
)doc");

REGISTER_OP("TfgcDequantizeBucketed")
    .Input("scales: float")
    .Input("words: int32")
    .Input("num_elements: int64")
    .Output("values: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .Attr("levels: int")
    .Attr("bucket_size: int")
    .Attr("bits: int")
    .SetShapeFn([](InferenceContext* c) { return VectorOfScalarInputLength(c, 2); })
    .Doc(R"doc(
Inverse of TfgcQuantizeBucketed: values_i = T((code_i - levels) *
(scales[i / bucket_size] / levels)).

scales: 1-D with exactly max(1, ceil(num_elements / bucket_size)) entries.
words: 1-D with exactly ceil(num_elements * bits / 32) entries; every used
  code must be <= 2 * levels (padding fields are ignored).
num_elements: scalar >= 0.
)doc");

REGISTER_OP("TfgcDequantizeBucketedSum")
    .Input("scales: float")
    .Input("words: int32")
    .Input("num_elements: int64")
    .Output("values: float")
    .Attr("levels: int")
    .Attr("bucket_size: int")
    .Attr("bits: int")
    .SetShapeFn([](InferenceContext* c) { return VectorOfScalarInputLength(c, 2); })
    .Doc(R"doc(
Sum of N workers' TfgcQuantizeBucketed payloads in one pass: values =
((0 + decode(payload 0)) + decode(payload 1)) + ... in float32, in worker
order, bit-identical to decoding each with TfgcDequantizeBucketed (float) and
adding them one by one.

scales: [N, max(1, ceil(num_elements / bucket_size))].
words: [N, ceil(num_elements * bits / 32)]; every used code <= 2 * levels.
num_elements: scalar >= 0.
values: float32 [num_elements] (zeros for N = 0).
)doc");

}  // namespace tfgc
