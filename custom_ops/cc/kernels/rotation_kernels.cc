// OpKernel and CPU functor of the randomized block Hadamard rotation
// (TfgcBlockHadamard; schema in custom_ops/cc/ops/rotation_ops.cc, Python in
// tfgc/ops/rotation.py, the GPU functor in rotation_gpu.cu.cc).
//
// Each block is copied, multiplied by its signs (forward), transformed in
// place by the fast Walsh-Hadamard butterflies (log2(m) passes over a block
// that stays in cache), scaled by 1/sqrt(m), and multiplied by its signs
// after the transform instead (inverse). Blocks are independent and are
// spread over the intra-op pool. The butterfly order (h = 1, 2, 4, ...; in each
// pass the pairs (j, j + h) of every group of 2h) and the final scaling are
// those of the pure-TensorFlow reference, so the two agree bit for bit.

#include <cmath>
#include <cstdint>
#include <vector>

#include "custom_ops/cc/kernels/cpu_util.h"
#include "custom_ops/cc/kernels/rotation.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"

namespace tfgc {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShapeUtils;
namespace errors = tensorflow::errors;

namespace {

using cpu::CeilDiv;
using cpu::ParallelFor;

bool IsPowerOfTwo(int64_t m) { return m >= 1 && (m & (m - 1)) == 0; }

#define TFGC_R_INLINE inline __attribute__((always_inline))

// The butterflies of passes h and 2h over four disjoint runs of h elements
// (restrict-qualified parameters, so that the loop vectorises without alias
// checks).
TFGC_R_INLINE void Radix4(float* __restrict a, float* __restrict b,
                          float* __restrict c, float* __restrict d, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const float p = a[j] + b[j];
    const float q = a[j] - b[j];
    const float r = c[j] + d[j];
    const float t = c[j] - d[j];
    a[j] = p + r;
    b[j] = q + t;
    c[j] = p - r;
    d[j] = q - t;
  }
}

// One pass h over two disjoint runs of h elements.
TFGC_R_INLINE void Radix2(float* __restrict a, float* __restrict b, int64_t h) {
  for (int64_t j = 0; j < h; ++j) {
    const float x = a[j];
    const float y = b[j];
    a[j] = x + y;
    b[j] = x - y;
  }
}

// In-place unnormalized Walsh-Hadamard transform of v[0, m), m a power of two.
// The first two passes (h = 1, 2) run fused on groups of four, computing the
// same sums as the two passes would; from h = 4 on the inner loops run over
// contiguous runs and vectorise.
TFGC_R_INLINE void Butterflies(float* v, int64_t m) {
  int64_t h = 1;
  if (m >= 4) {
    for (int64_t i = 0; i < m; i += 4) {
      const float p = v[i] + v[i + 1];
      const float q = v[i] - v[i + 1];
      const float r = v[i + 2] + v[i + 3];
      const float t = v[i + 2] - v[i + 3];
      v[i] = p + r;
      v[i + 1] = q + t;
      v[i + 2] = p - r;
      v[i + 3] = q - t;
    }
    h = 4;
  }
  // Two passes at a time (h and 2h) while two are left: the same sums, half
  // the loads and stores.
  for (; 4 * h <= m; h *= 4) {
    for (int64_t i = 0; i < m; i += 4 * h) {
      Radix4(v + i, v + i + h, v + i + 2 * h, v + i + 3 * h, h);
    }
  }
  if (h < m) {  // one pass left
    for (int64_t i = 0; i < m; i += 2 * h) Radix2(v + i, v + i + h, h);
  }
}

// One block of m elements from `in` to `out` through the scratch `buf` (so the
// butterflies run in cache and `out` is written once): signs first (forward)
// or last (inverse), the scaling by 1/sqrt(m) after the transform.
TFGC_R_INLINE void RotateBlock(const float* __restrict in, float* __restrict out,
                               float* __restrict buf, const float* __restrict s,
                               int64_t m, bool inverse) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(m));
  if (inverse) {
    for (int64_t k = 0; k < m; ++k) buf[k] = in[k];
  } else {
    for (int64_t k = 0; k < m; ++k) buf[k] = in[k] * s[k];
  }
  Butterflies(buf, m);
  if (inverse) {
    for (int64_t k = 0; k < m; ++k) out[k] = (buf[k] * scale) * s[k];
  } else {
    for (int64_t k = 0; k < m; ++k) out[k] = buf[k] * scale;
  }
}

// Blocks [first, last) of the n elements (the last block may be shorter).
TFGC_R_INLINE void RotateRange(const float* in, float* out, float* buf, const float* s,
                               int64_t n, int64_t block, int64_t first, int64_t last,
                               bool inverse) {
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * block;
    RotateBlock(in + start, out + start, buf, s, std::min(block, n - start), inverse);
  }
}

void RotateBlocks(const float* in, float* out, float* buf, const float* s,
                  int64_t n, int64_t block, int64_t first, int64_t last,
                  bool inverse) {
  RotateRange(in, out, buf, s, n, block, first, last, inverse);
}

#if TFGC_CPU_X86
// The same code compiled for AVX2 (eight lanes; add, subtract and multiply
// round alike in every width, so the bits are the same).
__attribute__((target("avx2"))) void RotateBlocksAvx2(
    const float* in, float* out, float* buf, const float* s, int64_t n,
    int64_t block, int64_t first, int64_t last, bool inverse) {
  RotateRange(in, out, buf, s, n, block, first, last, inverse);
}
#endif

}  // namespace

namespace functor {

using CPUDevice = Eigen::ThreadPoolDevice;

template <>
absl::Status BlockHadamardFunctor<CPUDevice>::operator()(
    OpKernelContext* ctx, const float* x, const float* signs, int64_t n,
    int64_t block, bool inverse, float* y) {
  for (int64_t k = 0; k < block; ++k) {
    if (signs[k] != 1.0f && signs[k] != -1.0f) {
      return errors::InvalidArgument("signs must be +1 or -1, got ", signs[k],
                                     " at ", k);
    }
  }
  const int64_t blocks = CeilDiv(n, block);
  int log2 = 0;
  while ((int64_t{1} << log2) < block) ++log2;
  auto* rotate = &RotateBlocks;
#if TFGC_CPU_X86
  if (cpu::HasAvx2()) rotate = &RotateBlocksAvx2;
#endif
  ParallelFor(ctx, blocks, block * (log2 + 4), [&](int64_t first, int64_t last) {
    std::vector<float> buf(block);
    rotate(x, y, buf.data(), signs, n, block, first, last, inverse);
  });
  return absl::OkStatus();
}

#if GOOGLE_CUDA
template <>
absl::Status BlockHadamardFunctor<Eigen::GpuDevice>::operator()(
    OpKernelContext* ctx, const float* x, const float* signs, int64_t n,
    int64_t block, bool inverse, float* y);
#endif  // GOOGLE_CUDA

}  // namespace functor

namespace {

template <typename Device>
class BlockHadamardOp : public OpKernel {
 public:
  explicit BlockHadamardOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block", &block_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("inverse", &inverse_));
    OP_REQUIRES(ctx, IsPowerOfTwo(block_) && block_ <= (int64_t{1} << 20),
                errors::InvalidArgument(
                    "block must be a power of two from 1 to 2^20, got ", block_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& signs = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(x.shape()),
                errors::InvalidArgument("x must be a vector, got shape ",
                                        x.shape().DebugString()));
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(signs.shape()) &&
                    signs.NumElements() == block_,
                errors::InvalidArgument("signs must be a vector of block = ", block_,
                                        " entries, got shape ",
                                        signs.shape().DebugString()));
    const int64_t n = x.NumElements();
    const int64_t tail = n % block_;
    OP_REQUIRES(ctx, tail == 0 || IsPowerOfTwo(tail),
                errors::InvalidArgument(
                    "the last block of x must have a power-of-two length: ", n,
                    " elements in blocks of ", block_, " leave ", tail));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &out));
    if (n == 0) return;
    OP_REQUIRES_OK(ctx, functor::BlockHadamardFunctor<Device>()(
                            ctx, x.flat<float>().data(), signs.flat<float>().data(), n,
                            block_, inverse_, out->flat<float>().data()));
  }

 private:
  int64_t block_ = 0;
  bool inverse_ = false;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfgcBlockHadamard").Device(DEVICE_CPU),
                        BlockHadamardOp<functor::CPUDevice>);

#if GOOGLE_CUDA
// GPU kernels (rotation_gpu.cu.cc); x and the signs stay on the device, which
// checks the signs itself.
REGISTER_KERNEL_BUILDER(Name("TfgcBlockHadamard").Device(tensorflow::DEVICE_GPU),
                        BlockHadamardOp<Eigen::GpuDevice>);
#endif  // GOOGLE_CUDA

}  // namespace tfgc
