// Functor declaration of the randomized block Hadamard rotation
// (TfgcBlockHadamard; schema in custom_ops/cc/ops/rotation_ops.cc).
//
// Light like the other functor headers (no op_kernel.h), so that the
// nvcc-compiled rotation_gpu.cu.cc can include it. The OpKernel in
// rotation_kernels.cc checks shapes and lengths; the functors check the signs
// where they live (host memory on the CPU, device memory on the GPU) and
// transform.

#ifndef TFGC_CUSTOM_OPS_CC_KERNELS_ROTATION_H_
#define TFGC_CUSTOM_OPS_CC_KERNELS_ROTATION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace tensorflow {
class OpKernelContext;
}  // namespace tensorflow

namespace tfgc {
namespace functor {

// y[n] <- the rotation of x[n] in blocks of `block` (inverse: its inverse).
// `block` is a power of two; n % block is 0 or a power of two (the OpKernel
// checked both). `signs` holds `block` floats, not yet validated: the functor
// returns InvalidArgument unless each is +1 or -1, before writing y.
// Every implementation applies the butterflies' additions, subtractions and
// scalings of the CPU kernel with float32 rounding and subnormals flushed, so
// all agree bit for bit.
template <typename Device>
struct BlockHadamardFunctor {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const float* x,
                          const float* signs, int64_t n, int64_t block,
                          bool inverse, float* y);
};

}  // namespace functor
}  // namespace tfgc

#endif  // TFGC_CUSTOM_OPS_CC_KERNELS_ROTATION_H_
