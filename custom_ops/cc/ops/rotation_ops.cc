// Op schema for the randomized block Hadamard rotation that tfgc's rotated
// quantizers apply before quantizing (tfgc.ops.rotation). The kernel lives in
// custom_ops/cc/kernels/rotation_kernels.cc. As for the other ops, the shape
// function never rejects: the kernel checks attributes and inputs and reports
// InvalidArgument.

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

REGISTER_OP("TfgcBlockHadamard")
    .Input("x: float")
    .Input("signs: float")
    .Output("y: float")
    .Attr("block: int")
    .Attr("inverse: bool = false")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Randomized block Hadamard rotation of a float32 vector.

x (rank 1, n elements) is cut into blocks of `block` elements; the last block
may be shorter, but every block's length m must be a power of two. Forward:
y_blk = H_m (s_m * x_blk) / sqrt(m), with s_m the first m entries of `signs`
(each +1 or -1) and H_m the Sylvester Hadamard matrix. inverse = true applies
the inverse, x_blk = s_m * (H_m y_blk / sqrt(m)). The butterflies run in the
order of tfgc.ops.rotation.block_hadamard_reference, so both give the same
bits.
)doc");
