// CPU kernels for threshold encoding (Strom 2015, "Scalable distributed DNN
// training using commodity GPU cloud computing"; Dryden et al. 2016,
// "Communication quantization for data-parallel training of deep neural
// networks", LBANN). See threshold.h for the word format and
// threshold_ops.cc for the op schemas.
//
// Encoding has a data-dependent output length, so it runs in two passes over
// fixed blocks of the input: pass 1 computes the new residual and records,
// per 32 elements, a "sent" mask and a "positive" mask in a small scratch
// buffer (n / 16 bytes) plus a count per block; after a prefix sum over the
// block counts, pass 2 turns the masks into words at each block's offset. Pass
// 2 reads only the masks, never the input again, and skips empty mask words,
// which is most of them at the sparsities threshold encoding is used at.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "custom_ops/cc/kernels/cpu_util.h"
#include "custom_ops/cc/kernels/threshold.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tsl/platform/threadpool.h"

namespace tfgc {

using CPUDevice = Eigen::ThreadPoolDevice;
using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::TensorShapeUtils;
namespace errors = tensorflow::errors;

namespace {

using ThreadPool = tsl::thread::ThreadPool;
// Shared helpers (cpu_util.h).
using cpu::BitsToFloat;
using cpu::CeilDiv;
using cpu::FloatToBits;
using cpu::kBit;
using cpu::ParallelFor;
using cpu::ScalarValue;
using cpu::Workers;

// Encode block: 1024 mask words = 32768 elements. Large enough that the
// per-block bookkeeping is noise, small enough to balance 25M elements over
// many threads.
constexpr int64_t kEncodeBlockWords = 1024;
// Decode validation chunk, in words.
constexpr int64_t kDecodeChunk = int64_t{1} << 16;

// T <-> float through Eigen's conversions (round to nearest even), the same
// ones TensorFlow's Cast and AddV2 use, so that the kernels agree bit for bit
// with the pure-TF reference.
template <typename T>
inline float ToF(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T FromF(float f) {
  return static_cast<T>(f);
}

// x + residual in T, as TensorFlow's AddV2 computes it (half types add in
// float and round once).
template <typename T>
inline float SumAsFloat(T a, T b) {
  return ToF<T>(static_cast<T>(a + b));
}
template <>
inline float SumAsFloat<float>(float a, float b) {
  return a + b;
}

// Encodes elements [w * 32, min(n, w * 32 + 32)) of every word w in [wb, we):
// new residual written, masks returned through sent/pos. Returns the number
// of elements sent. The loop is branch-free: thresholds are picked with bit
// selects, and the "nothing sent" case subtracts +0.0, which leaves every
// value (-0.0, NaN, Inf included) unchanged. With `stream`, the new residual
// is written with streaming stores (cpu::kStreamMinBytes).
template <typename T>
int64_t EncodeWords(const T* x, const T* residual, int64_t n, float pos_thr,
                    float neg_thr, T* new_residual, uint32_t* sent_bits,
                    uint32_t* pos_bits, int64_t wb, int64_t we, bool stream) {
  const uint32_t pos_bits_f = FloatToBits(pos_thr);
  const uint32_t neg_bits_f = FloatToBits(neg_thr);
  int64_t count = 0;
  const int64_t full = n / 32;
  // The new residual of kStreamWords words is built in an L1 buffer and then
  // copied out, streamed past the cache for large tensors.
  constexpr int64_t kStreamWords = 64;
  alignas(64) T buf[kStreamWords * 32];
  for (int64_t gw = wb; gw < std::min(we, full); gw += kStreamWords) {
    const int64_t gend = std::min({we, full, gw + kStreamWords});
    for (int64_t w = gw; w < gend; ++w) {
      const int64_t base = w * 32;
      const T* __restrict__ xp = x + base;
      const T* __restrict__ rp = residual + base;
      T* __restrict__ op = buf + (w - gw) * 32;
      uint32_t sent = 0, pos = 0;
      for (int b = 0; b < 32; ++b) {
        const float v = SumAsFloat<T>(xp[b], rp[b]);
        const uint32_t p = 0u - static_cast<uint32_t>(v >= pos_thr);
        const uint32_t q = 0u - static_cast<uint32_t>(v <= neg_thr);
        const uint32_t sub = (pos_bits_f & p) | (neg_bits_f & q);
        op[b] = FromF<T>(v - BitsToFloat(sub));
        sent |= (p | q) & kBit[b];
        pos |= p & kBit[b];
      }
      sent_bits[w] = sent;
      pos_bits[w] = pos;
      count += __builtin_popcount(sent);
    }
    const size_t bytes = (gend - gw) * 32 * sizeof(T);
    if (stream) {
      cpu::StreamCopy(new_residual + gw * 32, buf, bytes);
    } else {
      std::memcpy(new_residual + gw * 32, buf, bytes);
    }
  }
  if (stream) cpu::StreamFence();
  if (we > full && full >= wb) {
    // The last, partial word.
    const int64_t base = full * 32;
    uint32_t sent = 0, pos = 0;
    for (int64_t i = base; i < n; ++i) {
      const float v = SumAsFloat<T>(x[i], residual[i]);
      const bool p = v >= pos_thr;
      const bool q = v <= neg_thr;
      const float sub = p ? pos_thr : (q ? neg_thr : 0.0f);
      new_residual[i] = FromF<T>(v - sub);
      if (p || q) sent |= kBit[i - base];
      if (p) pos |= kBit[i - base];
    }
    sent_bits[full] = sent;
    pos_bits[full] = pos;
    count += __builtin_popcount(sent);
  }
  return count;
}

// Index-space value of one decoded element from its counts (see threshold.h).
inline float DecodedValue(int64_t cp, int64_t cn, float pos_value,
                          float neg_value) {
  const float p = static_cast<float>(cp) * pos_value;
  const float q = static_cast<float>(cn) * neg_value;
  if (cp > 0 && cn > 0) return p + q;
  if (cp > 0) return p;
  if (cn > 0) return q;
  return 0.0f;
}

}  // namespace

// ---------------------------------------------------------------------------
// CPU functor specialisations.

namespace functor {

template <typename T>
struct ThresholdEncodeFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* x, const T* residual,
                          int64_t n, float pos_threshold, float neg_threshold,
                          T* new_residual,
                          const AllocateWordsFn& allocate_words) {
    const int64_t num_words = CeilDiv(n, 32);
    const int64_t num_blocks = CeilDiv(num_words, kEncodeBlockWords);
    Tensor scratch;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        tensorflow::DT_UINT32, TensorShape({2, num_words}), &scratch));
    uint32_t* const sent_bits = scratch.flat<uint32_t>().data();
    uint32_t* const pos_bits = sent_bits + num_words;
    std::vector<int64_t> offsets(num_blocks + 1, 0);

    const bool stream =
        n * static_cast<int64_t>(sizeof(T)) >= cpu::kStreamMinBytes;
    ParallelFor(ctx, num_blocks, kEncodeBlockWords * 32 * 6,
                [&](int64_t bb, int64_t be) {
                  for (int64_t b = bb; b < be; ++b) {
                    const int64_t wb = b * kEncodeBlockWords;
                    const int64_t we = std::min(num_words, wb + kEncodeBlockWords);
                    offsets[b + 1] =
                        EncodeWords<T>(x, residual, n, pos_threshold,
                                       neg_threshold, new_residual, sent_bits,
                                       pos_bits, wb, we, stream);
                  }
                });
    for (int64_t b = 0; b < num_blocks; ++b) offsets[b + 1] += offsets[b];

    int32_t* words = nullptr;
    TF_RETURN_IF_ERROR(allocate_words(offsets[num_blocks], &words));
    if (offsets[num_blocks] == 0) return absl::OkStatus();

    ParallelFor(ctx, num_blocks, kEncodeBlockWords * 4,
                [&](int64_t bb, int64_t be) {
                  for (int64_t b = bb; b < be; ++b) {
                    int32_t* out = words + offsets[b];
                    const int64_t wb = b * kEncodeBlockWords;
                    const int64_t we = std::min(num_words, wb + kEncodeBlockWords);
                    for (int64_t w = wb; w < we; ++w) {
                      uint32_t sent = sent_bits[w];
                      const uint32_t pos = pos_bits[w];
                      while (sent != 0) {
                        const int bit = __builtin_ctz(sent);
                        // i < 2^30, so the word fits a non-negative int32.
                        const int64_t i = w * 32 + bit;
                        *out++ = static_cast<int32_t>((i << 1) |
                                                      ((pos >> bit) & 1u));
                        sent &= sent - 1;
                      }
                    }
                  }
                });
    return absl::OkStatus();
  }
};

template <typename T>
struct ThresholdDecodeFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const int32_t* words,
                          int64_t m, float pos_value, float neg_value,
                          int64_t n, T* out) {
    // Validate every word before writing anything. Each chunk also reports
    // whether its indices strictly increase, which every payload produced by
    // the encoder does: those are decoded by a parallel scatter, anything
    // else (repeats, any order) by a sort, which keeps the sum deterministic.
    const int64_t num_chunks = CeilDiv(m, kDecodeChunk);
    std::vector<char> chunk_bad(num_chunks, 0), chunk_sorted(num_chunks, 1);
    ParallelFor(ctx, num_chunks, kDecodeChunk * 2, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t b = c * kDecodeChunk;
        const int64_t e = std::min(m, b + kDecodeChunk);
        bool bad = false, unsorted = false;
        int64_t prev = b > 0 ? (static_cast<int64_t>(words[b - 1]) >> 1) : -1;
        for (int64_t k = b; k < e; ++k) {
          const int64_t w = words[k];
          const int64_t idx = w >> 1;  // arithmetic: negative words stay < 0
          bad |= (w < 0) | (idx >= n);
          unsorted |= idx <= prev;
          prev = idx;
        }
        chunk_bad[c] = bad;
        chunk_sorted[c] = !unsorted;
      }
    });
    bool sorted = true;
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (chunk_bad[c]) {
        for (int64_t k = c * kDecodeChunk; k < m; ++k) {
          if (words[k] < 0 || (words[k] >> 1) >= n) {
            return errors::InvalidArgument(
                "threshold word ", k, " is ", words[k], ": index ",
                words[k] >> 1, " is outside [0, ", n, ")");
          }
        }
      }
      sorted &= chunk_sorted[c] != 0;
    }

    const T zero = FromF<T>(0.0f);
    ParallelFor(ctx, n, 1, [&](int64_t b, int64_t e) {
      std::fill(out + b, out + e, zero);
    });
    if (m == 0) return absl::OkStatus();

    if (sorted) {
      // Distinct indices: every written value is a single pos/neg value.
      const T pos_t = FromF<T>(pos_value);
      const T neg_t = FromF<T>(neg_value);
      ParallelFor(ctx, m, 4, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
          const int32_t w = words[k];
          out[w >> 1] = (w & 1) ? pos_t : neg_t;
        }
      });
      return absl::OkStatus();
    }

    // General payload: sorting the words groups each index's words together
    // (negative ones first), so each index's counts come out of one run.
    std::vector<int32_t> sorted_words(words, words + m);
    std::sort(sorted_words.begin(), sorted_words.end());
    for (int64_t k = 0; k < m;) {
      const int32_t idx = sorted_words[k] >> 1;
      int64_t cp = 0, cn = 0;
      for (; k < m && (sorted_words[k] >> 1) == idx; ++k) {
        if (sorted_words[k] & 1) {
          ++cp;
        } else {
          ++cn;
        }
      }
      out[idx] = FromF<T>(DecodedValue(cp, cn, pos_value, neg_value));
    }
    return absl::OkStatus();
  }
};

}  // namespace functor

// ---------------------------------------------------------------------------
// OpKernels: validate, allocate, dispatch to the device functor.

template <typename Device, typename T>
class ThresholdEncodeOp : public OpKernel {
 public:
  explicit ThresholdEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    OP_REQUIRES(ctx, x.shape() == residual.shape(),
                errors::InvalidArgument(
                    "x and residual must have the same shape, got ",
                    x.shape().DebugString(), " and ",
                    residual.shape().DebugString()));
    float pos_thr = 0.0f, neg_thr = 0.0f;
    OP_REQUIRES_OK(ctx,
                   ScalarValue(ctx->input(2), "pos_threshold", &pos_thr));
    OP_REQUIRES_OK(ctx,
                   ScalarValue(ctx->input(3), "neg_threshold", &neg_thr));
    // The thresholds act as rounded to T: that is the value a receiver
    // decoding in T adds back, so the residual must be taken against it.
    // Requiring them finite and non-zero after rounding rules out thresholds
    // that would send everything or poison the residual with inf.
    const float pos_t = static_cast<float>(static_cast<T>(pos_thr));
    const float neg_t = static_cast<float>(static_cast<T>(neg_thr));
    OP_REQUIRES(ctx, std::isfinite(pos_t) && pos_t > 0.0f,
                errors::InvalidArgument(
                    "pos_threshold must be > 0 and finite in ",
                    tensorflow::DataTypeString(x.dtype()), ", got ", pos_thr));
    OP_REQUIRES(ctx, std::isfinite(neg_t) && neg_t < 0.0f,
                errors::InvalidArgument(
                    "neg_threshold must be < 0 and finite in ",
                    tensorflow::DataTypeString(x.dtype()), ", got ", neg_thr));
    const int64_t n = x.NumElements();
    OP_REQUIRES(ctx, n <= kMaxThresholdElements,
                errors::InvalidArgument(
                    "threshold encoding addresses at most 2^30 elements, got ",
                    n));
    Tensor* new_residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, x.shape(), &new_residual));
    if (n == 0) {
      Tensor* words = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({0}), &words));
      return;
    }
    auto allocate_words = [ctx](int64_t m, int32_t** data) -> absl::Status {
      Tensor* words = nullptr;
      TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({m}), &words));
      *data = words->flat<int32_t>().data();
      return absl::OkStatus();
    };
    OP_REQUIRES_OK(ctx, functor::ThresholdEncodeFunctor<Device, T>()(
                            ctx, x.flat<T>().data(), residual.flat<T>().data(),
                            n, pos_t, neg_t, new_residual->flat<T>().data(),
                            allocate_words));
  }
};

template <typename Device, typename T>
class ThresholdDecodeOp : public OpKernel {
 public:
  explicit ThresholdDecodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& words = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(words.shape()),
                errors::InvalidArgument("words must be 1-D, got shape ",
                                        words.shape().DebugString()));
    float pos_value = 0.0f, neg_value = 0.0f;
    OP_REQUIRES_OK(ctx,
                   ScalarValue(ctx->input(1), "pos_value", &pos_value));
    OP_REQUIRES_OK(ctx,
                   ScalarValue(ctx->input(2), "neg_value", &neg_value));
    const Tensor& num_elements = ctx->input(3);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(num_elements, "num_elements", &n));
    OP_REQUIRES(ctx, n >= 0 && n <= kMaxThresholdElements,
                errors::InvalidArgument(
                    "num_elements must be in [0, 2^30], got ", n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    OP_REQUIRES_OK(ctx, functor::ThresholdDecodeFunctor<Device, T>()(
                            ctx, words.flat<int32_t>().data(),
                            words.dim_size(0), pos_value, neg_value, n,
                            out->flat<T>().data()));
  }
};

#define TFGC_REGISTER_THRESHOLD_CPU(T)                                       \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("TfgcThresholdEncode").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      ThresholdEncodeOp<CPUDevice, T>);                                      \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("TfgcThresholdDecode").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      ThresholdDecodeOp<CPUDevice, T>);

TFGC_REGISTER_THRESHOLD_CPU(float);
TFGC_REGISTER_THRESHOLD_CPU(Eigen::half);
TFGC_REGISTER_THRESHOLD_CPU(Eigen::bfloat16);

#undef TFGC_REGISTER_THRESHOLD_CPU

#if GOOGLE_CUDA
// GPU kernels (threshold_gpu.cu.cc). The scalars stay in host memory: the
// kernels read them while validating, before launching anything.
using GPUDevice = Eigen::GpuDevice;

#define TFGC_REGISTER_THRESHOLD_GPU(T)                         \
  REGISTER_KERNEL_BUILDER(Name("TfgcThresholdEncode")          \
                              .Device(tensorflow::DEVICE_GPU)  \
                              .TypeConstraint<T>("T")          \
                              .HostMemory("pos_threshold")     \
                              .HostMemory("neg_threshold"),    \
                          ThresholdEncodeOp<GPUDevice, T>);    \
  REGISTER_KERNEL_BUILDER(Name("TfgcThresholdDecode")          \
                              .Device(tensorflow::DEVICE_GPU)  \
                              .TypeConstraint<T>("T")          \
                              .HostMemory("pos_value")         \
                              .HostMemory("neg_value")         \
                              .HostMemory("num_elements"),     \
                          ThresholdDecodeOp<GPUDevice, T>);

TFGC_REGISTER_THRESHOLD_GPU(float);
TFGC_REGISTER_THRESHOLD_GPU(Eigen::half);
TFGC_REGISTER_THRESHOLD_GPU(Eigen::bfloat16);

#undef TFGC_REGISTER_THRESHOLD_GPU
#endif  // GOOGLE_CUDA

}  // namespace tfgc
