// CPU kernels for the sign-bit op family. See sign_bits.h for the bit layout
// and sign_bits_ops.cc for the op schemas.
//
// Performance notes. All passes are memory-bound on large inputs, so the
// kernels aim at (a) touching the input as few times as possible and (b)
// keeping every hot loop a fixed-trip-count, branch-free loop over raw values
// that the compiler can auto-vectorise at -O3 for the baseline ISA (no
// -march flags: the library must load on any x86-64 / aarch64 host that can
// run the TensorFlow wheel). Work is spread over the device's intra-op thread
// pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "custom_ops/cc/kernels/sign_bits.h"
#include "custom_ops/cc/kernels/cpu_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/util/overflow.h"
#include "tsl/platform/threadpool.h"

// The 1-bit quantizer's sign / residual pass has an AVX2 variant for float32,
// picked at run time (no -march flag: the library must load on any x86-64
// host).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TFGC_SB_X86_DISPATCH 1
#include <immintrin.h>
#else
#define TFGC_SB_X86_DISPATCH 0
#endif

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
using cpu::HasAvx2;
using cpu::CeilDiv;
using cpu::FloatToBits;
using cpu::kBit;
using cpu::ParallelFor;
using cpu::ScalarValue;
using cpu::Workers;
using cpu::FloatCodec;
using cpu::Select;

// Below this width a per-column accumulation loop is too short to vectorise,
// so narrow matrices are viewed as wider ones (see ColumnMeans).
constexpr int64_t kMinLanes = 64;
// Column block width of the statistics pass. The per-block accumulators (two
// float sums and a count per column, plus their double totals) must stay in
// cache while a block of rows streams through.
constexpr int64_t kMaxBlockWidth = 2048;
constexpr int64_t kMinBlockWidth = 64;
// Rows summed in float before the partial sums are added to the double
// totals: float adds vectorise twice as wide as double ones (and need no
// conversion), while short float sums lose no meaningful precision.
constexpr int64_t kFlushRows = 128;
// Caps the per-shard partial sums at 3 * 2^20 doubles (24 MiB).
constexpr int64_t kMaxPartialElems = int64_t{1} << 20;
// Tiles smaller than this are not worth a separate task.
constexpr int64_t kMinTileElems = int64_t{1} << 15;
// Matrices with at most this many bytes per kShortMinWidth columns take the
// column-block quantisation path (see QuantizeColumnBlock): a block is small
// enough to be read a second time from cache.
constexpr int64_t kShortTileBytes = int64_t{256} << 10;
constexpr int64_t kShortMinWidth = 512;
// Dequantize payloads with fewer rows convert the means per element instead
// of precomputing converted copies.
constexpr int64_t kDirectDequantizeRows = 8;

template <typename T>
using RawOf = typename SignBitsTraits<T>::Raw;
template <typename T>
using AliasedRawOf = typename SignBitsTraits<T>::AliasedRaw;

// All-ones iff the value with bit pattern r satisfies `value >= 0` (NaN -> 0,
// -0.0 -> all-ones). Integer compares instead of a float `>=`: GCC will not
// if-convert a float compare that may trap on NaN, which blocks
// vectorisation, and the integer form works unchanged for half/bfloat16.
template <typename T>
inline uint32_t NonNegativeMask(RawOf<T> r) {
  using Tr = SignBitsTraits<T>;
  return 0u - static_cast<uint32_t>((r <= Tr::kPosInf) | (r == Tr::kSignMask));
}
inline uint32_t NonNegativeMaskF32(uint32_t f) {
  return NonNegativeMask<float>(f);
}

// ---------------------------------------------------------------------------
// Pack / unpack over a range of words [wb, we).

template <typename T>
void PackWords(const AliasedRawOf<T>* in, int64_t n, int32_t* words,
               int64_t wb, int64_t we) {
  const int64_t full = n / 32;
  const int64_t end = std::min(we, full);
  for (int64_t w = wb; w < end; ++w) {
    const AliasedRawOf<T>* p = in + w * 32;
    uint32_t word = 0;
    for (int b = 0; b < 32; ++b) {
      word |= NonNegativeMask<T>(p[b]) & kBit[b];
    }
    words[w] = static_cast<int32_t>(word);
  }
  if (we > full) {  // the partial last word; padding bits stay 0
    uint32_t word = 0;
    for (int64_t i = full * 32; i < n; ++i) {
      word |= NonNegativeMask<T>(in[i]) & kBit[i - full * 32];
    }
    words[full] = static_cast<int32_t>(word);
  }
}

template <typename T>
void UnpackWords(const int32_t* words, int64_t n, AliasedRawOf<T>* out,
                 int64_t wb, int64_t we) {
  using Tr = SignBitsTraits<T>;
  using Raw = RawOf<T>;
  // +1.0 and -1.0 differ only in the sign bit, set where the bit is 0.
  const int64_t full = n / 32;
  const int64_t end = std::min(we, full);
  for (int64_t w = wb; w < end; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    AliasedRawOf<T>* o = out + w * 32;
    for (int b = 0; b < 32; ++b) {
      o[b] = static_cast<Raw>(Tr::kOne | ((word & kBit[b]) ? 0u : Tr::kSignMask));
    }
  }
  if (we > full) {
    const uint32_t word = static_cast<uint32_t>(words[full]);
    for (int64_t i = full * 32; i < n; ++i) {
      out[i] = static_cast<Raw>(
          Tr::kOne | ((word & kBit[i - full * 32]) ? 0u : Tr::kSignMask));
    }
  }
}

// ---------------------------------------------------------------------------
// 1-bit quantisation helpers.

// Adds class sums and positive counts of a [num_rows, width] block (rows
// `stride` elements apart) to float/int32 partials ps/ns/pc[0, width). Four
// rows per sweep so each partial is loaded and stored once per four input
// rows. Values are masked rather than selected: a masked-out value is +0.0,
// and nothing is multiplied by 0/1, so an infinity cannot turn into NaN in
// the other class.
#if TFGC_SB_X86_DISPATCH

// All-ones lanes where NonNegativeMaskF32 is all-ones: bit patterns 0 ..
// +inf as signed integers, or -0.0.
__attribute__((target("avx2"))) inline __m256i NonNegativeMaskAvx2(__m256i v) {
  const __m256i outside =
      _mm256_or_si256(_mm256_cmpgt_epi32(v, _mm256_set1_epi32(0x7f800000)),
                      _mm256_cmpgt_epi32(_mm256_setzero_si256(), v));
  const __m256i neg_zero = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  return _mm256_andnot_si256(
      _mm256_andnot_si256(_mm256_cmpeq_epi32(v, neg_zero), outside),
      _mm256_set1_epi32(-1));
}

// AccumulateRows for float32 with 8-lane AVX2 vectors over the columns: the
// same additions in the same order (four rows, paired as in the portable
// loop), so the sums are bit-identical. Returns the first column it did not
// handle (width rounded down to a multiple of 8) for the portable loop.
__attribute__((target("avx2"))) int64_t AccumulateRowsF32Avx2(
    const float* x, int64_t num_rows, int64_t stride, int64_t width,
    float* __restrict__ ps, float* __restrict__ ns,
    int32_t* __restrict__ pc) {
  const int64_t w8 = width & ~int64_t{7};
  int64_t r = 0;
  for (; r + 4 <= num_rows; r += 4) {
    const float* x0 = x + r * stride;
    const float* x1 = x0 + stride;
    const float* x2 = x1 + stride;
    const float* x3 = x2 + stride;
    // The rows are short segments of long rows, which the hardware
    // prefetcher picks up late; fetch the next four rows' segments while
    // these are summed. Prefetches past the matrix never fault.
    const float* next = x3 + stride;
    for (int64_t j = 0; j < w8; j += 8) {
      if ((j & 15) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(next + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + stride + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + 2 * stride + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + 3 * stride + j), _MM_HINT_T0);
      }
      const __m256 f0 = _mm256_loadu_ps(x0 + j), f1 = _mm256_loadu_ps(x1 + j);
      const __m256 f2 = _mm256_loadu_ps(x2 + j), f3 = _mm256_loadu_ps(x3 + j);
      const __m256 m0 = _mm256_castsi256_ps(NonNegativeMaskAvx2(_mm256_castps_si256(f0)));
      const __m256 m1 = _mm256_castsi256_ps(NonNegativeMaskAvx2(_mm256_castps_si256(f1)));
      const __m256 m2 = _mm256_castsi256_ps(NonNegativeMaskAvx2(_mm256_castps_si256(f2)));
      const __m256 m3 = _mm256_castsi256_ps(NonNegativeMaskAvx2(_mm256_castps_si256(f3)));
      const __m256 pos = _mm256_add_ps(
          _mm256_add_ps(_mm256_and_ps(f0, m0), _mm256_and_ps(f1, m1)),
          _mm256_add_ps(_mm256_and_ps(f2, m2), _mm256_and_ps(f3, m3)));
      const __m256 neg = _mm256_add_ps(
          _mm256_add_ps(_mm256_andnot_ps(m0, f0), _mm256_andnot_ps(m1, f1)),
          _mm256_add_ps(_mm256_andnot_ps(m2, f2), _mm256_andnot_ps(m3, f3)));
      _mm256_storeu_ps(ps + j, _mm256_add_ps(_mm256_loadu_ps(ps + j), pos));
      _mm256_storeu_ps(ns + j, _mm256_add_ps(_mm256_loadu_ps(ns + j), neg));
      const __m256i cnt = _mm256_add_epi32(
          _mm256_add_epi32(_mm256_castps_si256(m0), _mm256_castps_si256(m1)),
          _mm256_add_epi32(_mm256_castps_si256(m2), _mm256_castps_si256(m3)));
      __m256i* pcv = reinterpret_cast<__m256i*>(pc + j);
      _mm256_storeu_si256(pcv, _mm256_sub_epi32(_mm256_loadu_si256(pcv), cnt));
    }
  }
  for (; r < num_rows; ++r) {
    const float* x0 = x + r * stride;
    for (int64_t j = 0; j < w8; j += 8) {
      const __m256 f = _mm256_loadu_ps(x0 + j);
      const __m256 m = _mm256_castsi256_ps(NonNegativeMaskAvx2(_mm256_castps_si256(f)));
      _mm256_storeu_ps(ps + j, _mm256_add_ps(_mm256_loadu_ps(ps + j), _mm256_and_ps(f, m)));
      _mm256_storeu_ps(ns + j, _mm256_add_ps(_mm256_loadu_ps(ns + j), _mm256_andnot_ps(m, f)));
      __m256i* pcv = reinterpret_cast<__m256i*>(pc + j);
      _mm256_storeu_si256(pcv, _mm256_sub_epi32(_mm256_loadu_si256(pcv),
                                                _mm256_castps_si256(m)));
    }
  }
  return w8;
}
#endif  // TFGC_SB_X86_DISPATCH

template <typename T>
void AccumulateRows(const AliasedRawOf<T>* x, int64_t num_rows, int64_t stride,
                    int64_t width, float* __restrict__ ps,
                    float* __restrict__ ns, int32_t* __restrict__ pc) {
  using Codec = FloatCodec<T>;
#if TFGC_SB_X86_DISPATCH
  if constexpr (std::is_same<T, float>::value) {
    if (HasAvx2()) {
      // The AVX2 loop takes whole groups of 8 columns; the rest (< 8) falls
      // through to the portable loops below.
      const int64_t done = AccumulateRowsF32Avx2(
          reinterpret_cast<const float*>(x), num_rows, stride, width, ps, ns,
          pc);
      x += done;
      ps += done;
      ns += done;
      pc += done;
      width -= done;
      if (width == 0) return;
    }
  }
#endif
  int64_t r = 0;
  for (; r + 4 <= num_rows; r += 4) {
    const AliasedRawOf<T>* __restrict__ x0 = x + r * stride;
    const AliasedRawOf<T>* __restrict__ x1 = x0 + stride;
    const AliasedRawOf<T>* __restrict__ x2 = x1 + stride;
    const AliasedRawOf<T>* __restrict__ x3 = x2 + stride;
    for (int64_t j = 0; j < width; ++j) {
      const uint32_t f0 = Codec::ToF32Bits(x0[j]);
      const uint32_t f1 = Codec::ToF32Bits(x1[j]);
      const uint32_t f2 = Codec::ToF32Bits(x2[j]);
      const uint32_t f3 = Codec::ToF32Bits(x3[j]);
      const uint32_t m0 = NonNegativeMaskF32(f0), m1 = NonNegativeMaskF32(f1);
      const uint32_t m2 = NonNegativeMaskF32(f2), m3 = NonNegativeMaskF32(f3);
      ps[j] += (BitsToFloat(f0 & m0) + BitsToFloat(f1 & m1)) +
               (BitsToFloat(f2 & m2) + BitsToFloat(f3 & m3));
      ns[j] += (BitsToFloat(f0 & ~m0) + BitsToFloat(f1 & ~m1)) +
               (BitsToFloat(f2 & ~m2) + BitsToFloat(f3 & ~m3));
      // Each mask is 0 or 0xffffffff == -1, so subtracting counts the 1s.
      pc[j] -= static_cast<int32_t>(m0 + m1 + m2 + m3);
    }
  }
  for (; r < num_rows; ++r) {
    const AliasedRawOf<T>* __restrict__ x0 = x + r * stride;
    for (int64_t j = 0; j < width; ++j) {
      const uint32_t f = Codec::ToF32Bits(x0[j]);
      const uint32_t m = NonNegativeMaskF32(f);
      ps[j] += BitsToFloat(f & m);
      ns[j] += BitsToFloat(f & ~m);
      pc[j] -= static_cast<int32_t>(m);
    }
  }
}

// Adds the statistics of a [num_rows, width] block to double totals, summing
// at most kFlushRows rows in float at a time. width <= kMaxBlockWidth.
template <typename T>
void AccumulateTile(const AliasedRawOf<T>* x, int64_t num_rows, int64_t stride,
                    int64_t width, double* __restrict__ ps,
                    double* __restrict__ ns, double* __restrict__ pc) {
  alignas(64) float fps[kMaxBlockWidth];
  alignas(64) float fns[kMaxBlockWidth];
  alignas(64) int32_t cnt[kMaxBlockWidth];
  for (int64_t r0 = 0; r0 < num_rows; r0 += kFlushRows) {
    const int64_t nr = std::min(kFlushRows, num_rows - r0);
    std::fill(fps, fps + width, 0.0f);
    std::fill(fns, fns + width, 0.0f);
    std::fill(cnt, cnt + width, 0);
    AccumulateRows<T>(x + r0 * stride, nr, stride, width, fps, fns, cnt);
    for (int64_t j = 0; j < width; ++j) {
      ps[j] += static_cast<double>(fps[j]);
      ns[j] += static_cast<double>(fns[j]);
      pc[j] += static_cast<double>(cnt[j]);
    }
  }
}

// Class means from sums and positive counts over `total` rows. An empty class
// divides its zero sum by 1, i.e. its mean is 0. The division is done in the
// precision of the sums: double for the long-column path, where it is
// amortised over many rows, and float for short blocks, where a double
// division per column would cost more than reading the input.
template <typename Sum, typename Count>
inline void StoreMeans(const Sum* ps, const Sum* ns, const Count* pc,
                       int64_t total, int64_t count, float* pos_mean,
                       float* neg_mean) {
  if (total == 1) {
    // Every class has 0 or 1 members, so the means are the sums ([1, n] is
    // how a 1-D gradient arrives).
    for (int64_t j = 0; j < count; ++j) {
      pos_mean[j] = static_cast<float>(ps[j]);
      neg_mean[j] = static_cast<float>(ns[j]);
    }
    return;
  }
  // Counts are clamped as integers: a float max is a possibly-trapping
  // compare that would keep the loop from vectorising.
  using Int = std::conditional_t<std::is_same<Count, int32_t>::value, int32_t,
                                 int64_t>;
  const Int rows = static_cast<Int>(total);
  for (int64_t j = 0; j < count; ++j) {
    const Int pos_cnt = static_cast<Int>(pc[j]);
    const Int neg_cnt = rows - pos_cnt;
    pos_mean[j] = static_cast<float>(
        ps[j] / static_cast<Sum>(std::max<Int>(pos_cnt, 1)));
    neg_mean[j] = static_cast<float>(
        ns[j] / static_cast<Sum>(std::max<Int>(neg_cnt, 1)));
  }
}

// Float bit pattern of a mean after rounding to T: the value the receiver's
// dequantize will produce, which the residual is taken against.
template <typename T>
inline uint32_t RoundedMeanBits(float mean) {
  using Codec = FloatCodec<T>;
  return Codec::ToF32Bits(Codec::FromF32Bits(FloatToBits(mean)));
}

// Residual of one element with float bits f and class mask m, given the
// rounded class means as float bits. Subtracted in float, rounded once to T.
template <typename T>
inline RawOf<T> ResidualOf(uint32_t f, uint32_t m, uint32_t pos_bits,
                           uint32_t neg_bits) {
  const float mean = BitsToFloat(Select(m, pos_bits, neg_bits));
  return static_cast<RawOf<T>>(
      FloatCodec<T>::FromF32Bits(FloatToBits(BitsToFloat(f) - mean)));
}

// Quantises columns [c0, c0 + w) of a short [rows, cols] matrix completely:
// statistics, means and residual. The block is read twice, the second time
// from cache (callers keep rows * w * sizeof(T) <= kShortTileBytes), and no
// per-column temporaries go through memory, which for e.g. a [1, 25M] matrix
// would cost several times the input. rows <= kFlushRows, so the float
// partial sums are as accurate as in the general path; w <= kMaxBlockWidth.
template <typename T>
void QuantizeColumnBlock(const AliasedRawOf<T>* x, int64_t rows, int64_t cols,
                         int64_t c0, int64_t w, float* pos_mean,
                         float* neg_mean, AliasedRawOf<T>* residual) {
  using Codec = FloatCodec<T>;
  alignas(64) float ps[kMaxBlockWidth];
  alignas(64) float ns[kMaxBlockWidth];
  alignas(64) int32_t pc[kMaxBlockWidth];
  std::fill(ps, ps + w, 0.0f);
  std::fill(ns, ns + w, 0.0f);
  std::fill(pc, pc + w, 0);
  AccumulateRows<T>(x + c0, rows, cols, w, ps, ns, pc);
  StoreMeans(ps, ns, pc, rows, w, pos_mean + c0, neg_mean + c0);

  // Reuse the sum buffers for the rounded means' bit patterns.
  auto* pm = reinterpret_cast<uint32_t*>(ps);
  auto* nm = reinterpret_cast<uint32_t*>(ns);
  for (int64_t j = 0; j < w; ++j) {
    pm[j] = RoundedMeanBits<T>(pos_mean[c0 + j]);
    nm[j] = RoundedMeanBits<T>(neg_mean[c0 + j]);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const AliasedRawOf<T>* __restrict__ xr = x + r * cols + c0;
    AliasedRawOf<T>* __restrict__ rr = residual + r * cols + c0;
    for (int64_t j = 0; j < w; ++j) {
      const uint32_t f = Codec::ToF32Bits(xr[j]);
      rr[j] = ResidualOf<T>(f, NonNegativeMaskF32(f), pm[j], nm[j]);
    }
  }
}

// Computes pos_mean / neg_mean of a row-major [rows, cols] matrix (rows, cols
// > 0), with double totals so that long columns keep their precision.
//
// The matrix is viewed as [vrows, lanes] with lanes a multiple of cols: for
// narrow matrices (e.g. cols == 1) several rows are folded into one view row
// so the inner loop stays long enough to vectorise; lane l belongs to column
// l % cols, and the few elements that do not fill a whole view row are
// handled separately. The view is cut into tiles (row shards x column
// blocks); each shard owns its partial totals, which are combined at the end.
template <typename T>
absl::Status ColumnMeans(OpKernelContext* ctx, const T* x_in, int64_t rows,
                         int64_t cols, float* pos_mean, float* neg_mean) {
  using Codec = FloatCodec<T>;
  const auto* x = reinterpret_cast<const AliasedRawOf<T>*>(x_in);
  const int64_t n = rows * cols;
  const int64_t lanes =
      cols >= kMinLanes ? cols : cols * CeilDiv(kMinLanes, cols);
  const int64_t vrows = n / lanes;
  const int64_t tail_begin = vrows * lanes;

  const int64_t threads = std::max(Workers(ctx)->NumThreads(), 1);
  const int64_t target_tiles = 4 * threads;
  const int64_t view_elems = vrows * lanes;

  int64_t col_blocks = CeilDiv(lanes, kMaxBlockWidth);
  int64_t row_shards = std::min(
      {std::max<int64_t>(vrows, 1), CeilDiv(target_tiles, col_blocks),
       std::max<int64_t>(kMaxPartialElems / lanes, 1),
       std::max<int64_t>(view_elems / (col_blocks * kMinTileElems), 1)});
  row_shards = std::max<int64_t>(row_shards, 1);
  if (row_shards * col_blocks < target_tiles) {
    // Few rows: get the parallelism from narrower column blocks instead.
    const int64_t wanted = CeilDiv(target_tiles, row_shards);
    const int64_t max_blocks = std::max<int64_t>(
        1, std::min(lanes / kMinBlockWidth,
                    view_elems / (row_shards * kMinTileElems)));
    col_blocks = std::max(col_blocks, std::min(wanted, max_blocks));
  }
  const int64_t block_width = CeilDiv(lanes, col_blocks);
  col_blocks = CeilDiv(lanes, block_width);
  const int64_t rows_per_shard =
      CeilDiv(std::max<int64_t>(vrows, 1), row_shards);
  row_shards = CeilDiv(std::max<int64_t>(vrows, 1), rows_per_shard);

  if (row_shards == 1 && lanes == cols) {
    // Every column is summed by exactly one tile, so tiles can finish their
    // columns on the spot. This matters for wide, short matrices, where
    // spilling per-column totals to memory would cost far more than the input.
    ParallelFor(ctx, col_blocks,
                /*cost_per_unit=*/std::max<int64_t>(rows, 1) * block_width * 4,
                [&](int64_t tb, int64_t te) {
                  alignas(64) double ps[kMaxBlockWidth];
                  alignas(64) double ns[kMaxBlockWidth];
                  alignas(64) double pc[kMaxBlockWidth];
                  for (int64_t t = tb; t < te; ++t) {
                    const int64_t c0 = t * block_width;
                    const int64_t w = std::min(cols, c0 + block_width) - c0;
                    std::fill(ps, ps + w, 0.0);
                    std::fill(ns, ns + w, 0.0);
                    std::fill(pc, pc + w, 0.0);
                    AccumulateTile<T>(x + c0, rows, cols, w, ps, ns, pc);
                    StoreMeans(ps, ns, pc, rows, w, pos_mean + c0,
                               neg_mean + c0);
                  }
                });
    return absl::OkStatus();
  }

  Tensor scratch;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      tensorflow::DT_DOUBLE, TensorShape({3, row_shards, lanes}), &scratch));
  double* const ps_all = scratch.flat<double>().data();
  double* const ns_all = ps_all + row_shards * lanes;
  double* const pc_all = ns_all + row_shards * lanes;

  ParallelFor(
      ctx, row_shards * col_blocks,
      /*cost_per_unit=*/std::max<int64_t>(rows_per_shard, 1) * block_width * 4,
      [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          const int64_t s = t / col_blocks;
          const int64_t c0 = (t % col_blocks) * block_width;
          const int64_t c1 = std::min(lanes, c0 + block_width);
          const int64_t r0 = std::min(vrows, s * rows_per_shard);
          const int64_t r1 = std::min(vrows, r0 + rows_per_shard);
          double* ps = ps_all + s * lanes + c0;
          double* ns = ns_all + s * lanes + c0;
          double* pc = pc_all + s * lanes + c0;
          std::fill(ps, ps + (c1 - c0), 0.0);
          std::fill(ns, ns + (c1 - c0), 0.0);
          std::fill(pc, pc + (c1 - c0), 0.0);
          AccumulateTile<T>(x + r0 * lanes + c0, r1 - r0, lanes, c1 - c0, ps,
                            ns, pc);
        }
      });

  // Combine the row shards into shard 0.
  if (row_shards > 1) {
    ParallelFor(ctx, lanes, row_shards * 6, [&](int64_t jb, int64_t je) {
      for (int64_t s = 1; s < row_shards; ++s) {
        for (int64_t j = jb; j < je; ++j) {
          ps_all[j] += ps_all[s * lanes + j];
          ns_all[j] += ns_all[s * lanes + j];
          pc_all[j] += pc_all[s * lanes + j];
        }
      }
    });
  }

  // Fold the extra lanes of a widened view back onto their columns, then add
  // the elements past the last full view row. Both are < 2 * kMinLanes wide.
  for (int64_t l = cols; l < lanes; ++l) {
    ps_all[l % cols] += ps_all[l];
    ns_all[l % cols] += ns_all[l];
    pc_all[l % cols] += pc_all[l];
  }
  for (int64_t i = tail_begin; i < n; ++i) {
    const int64_t j = i % cols;
    const uint32_t f = Codec::ToF32Bits(x[i]);
    const uint32_t m = NonNegativeMaskF32(f);
    ps_all[j] += static_cast<double>(BitsToFloat(f & m));
    ns_all[j] += static_cast<double>(BitsToFloat(f & ~m));
    pc_all[j] += m != 0 ? 1.0 : 0.0;
  }

  ParallelFor(ctx, cols, 20, [&](int64_t jb, int64_t je) {
    StoreMeans(ps_all + jb, ns_all + jb, pc_all + jb, rows, je - jb,
               pos_mean + jb, neg_mean + jb);
  });
  return absl::OkStatus();
}

// Fills ext[0, cols + 31) with f(src[l % cols]). The 31 wrapped entries let
// a 32-element chunk that starts at any column j0 < cols read ext[j0 + b]
// without a per-element modulo, which keeps the chunk loop vectorisable.
template <typename Out, typename F>
void FillWrapped(OpKernelContext* ctx, const float* src, int64_t cols, Out* ext,
                 F f) {
  ParallelFor(ctx, cols, 8, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) ext[j] = f(src[j]);
  });
  for (int64_t l = cols; l < cols + 31; ++l) ext[l] = ext[l % cols];
}

#if TFGC_SB_X86_DISPATCH
// Sign words [wb, we) (all full) and their residual elements for float32,
// with 8-lane compares, movemask for the bits and blends for the means:
// the same values as the portable loop in OneBitQuantizeFunctor. j0 is the
// column of element wb * 32; pos_ext / neg_ext are the wrapped mean bits.
// With `stream`, residual must be 32-byte aligned.
__attribute__((target("avx2"))) void SignsAndResidualF32Avx2(
    const float* x, int64_t cols, const uint32_t* pos_ext,
    const uint32_t* neg_ext, int64_t wb, int64_t we, int64_t j0,
    int32_t* words, float* residual, bool stream) {
  const int64_t step = 32 % cols;
  const __m256i pos_inf = _mm256_set1_epi32(0x7f800000);
  const __m256i neg_zero = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t w = wb; w < we; ++w) {
    const float* xp = x + w * 32;
    float* rp = residual + w * 32;
    const float* pm = reinterpret_cast<const float*>(pos_ext + j0);
    const float* nm = reinterpret_cast<const float*>(neg_ext + j0);
    uint32_t word = 0;
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(xp + 8 * k);
      const __m256i vi = _mm256_castps_si256(v);
      // value >= 0, as NonNegativeMask: bit patterns 0 .. +inf as signed
      // integers, or -0.0. NaNs and negatives fail.
      const __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(vi, pos_inf),
                                              _mm256_cmpgt_epi32(zero, vi));
      const __m256 m = _mm256_castsi256_ps(_mm256_andnot_si256(
          _mm256_andnot_si256(_mm256_cmpeq_epi32(vi, neg_zero), outside),
          _mm256_set1_epi32(-1)));
      word |= static_cast<uint32_t>(_mm256_movemask_ps(m)) << (8 * k);
      const __m256 mean = _mm256_blendv_ps(_mm256_loadu_ps(nm + 8 * k),
                                           _mm256_loadu_ps(pm + 8 * k), m);
      const __m256 r = _mm256_sub_ps(v, mean);
      if (stream) {
        _mm256_stream_ps(rp + 8 * k, r);
      } else {
        _mm256_storeu_ps(rp + 8 * k, r);
      }
    }
    words[w] = static_cast<int32_t>(word);
    j0 += step;
    if (j0 >= cols) j0 -= cols;
  }
  if (stream) _mm_sfence();
}
#endif  // TFGC_SB_X86_DISPATCH

}  // namespace

// ---------------------------------------------------------------------------
// CPU functor specialisations.

namespace functor {

template <typename T>
struct PackSignBitsFunctor<CPUDevice, T> {
  void operator()(OpKernelContext* ctx, const T* in, int64_t n,
                  int32_t* words) {
    const auto* raw = reinterpret_cast<const AliasedRawOf<T>*>(in);
    ParallelFor(ctx, NumSignWords(n), /*cost_per_unit=*/32 * 3,
                [&](int64_t wb, int64_t we) {
                  PackWords<T>(raw, n, words, wb, we);
                });
  }
};

template <typename T>
struct UnpackSignBitsFunctor<CPUDevice, T> {
  void operator()(OpKernelContext* ctx, const int32_t* words, int64_t n,
                  T* out) {
    auto* raw = reinterpret_cast<AliasedRawOf<T>*>(out);
    ParallelFor(ctx, NumSignWords(n), /*cost_per_unit=*/32 * 3,
                [&](int64_t wb, int64_t we) {
                  UnpackWords<T>(words, n, raw, wb, we);
                });
  }
};

template <typename T>
struct OneBitQuantizeFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* x_in, int64_t rows,
                          int64_t cols, int32_t* words, float* pos_mean,
                          float* neg_mean, T* residual_out) {
    using Codec = FloatCodec<T>;
    const int64_t n = rows * cols;
    if (cols == 0) return absl::OkStatus();
    if (rows == 0) {
      std::fill(pos_mean, pos_mean + cols, 0.0f);
      std::fill(neg_mean, neg_mean + cols, 0.0f);
      return absl::OkStatus();
    }
    const auto* x = reinterpret_cast<const AliasedRawOf<T>*>(x_in);
    auto* residual = reinterpret_cast<AliasedRawOf<T>*>(residual_out);

    const int64_t row_bytes = rows * static_cast<int64_t>(sizeof(T));
    if (cols >= kShortMinWidth && rows <= kFlushRows &&
        row_bytes * kShortMinWidth <= kShortTileBytes) {
      // Short, wide matrix: quantise independent column blocks, then pack the
      // signs in a separate flat pass (a block's bits do not fill whole
      // words, so blocks cannot write them without races).
      const int64_t threads = std::max(Workers(ctx)->NumThreads(), 1);
      const int64_t width = std::max<int64_t>(
          kMinLanes,
          std::min({kMaxBlockWidth, kShortTileBytes / row_bytes,
                    CeilDiv(cols, 4 * threads)}));
      ParallelFor(ctx, CeilDiv(cols, width),
                  /*cost_per_unit=*/rows * width * 8,
                  [&](int64_t tb, int64_t te) {
                    for (int64_t t = tb; t < te; ++t) {
                      const int64_t c0 = t * width;
                      QuantizeColumnBlock<T>(x, rows, cols, c0,
                                             std::min(width, cols - c0),
                                             pos_mean, neg_mean, residual);
                    }
                  });
      PackSignBitsFunctor<CPUDevice, T>()(ctx, x_in, n, words);
      return absl::OkStatus();
    }

    TF_RETURN_IF_ERROR(ColumnMeans(ctx, x_in, rows, cols, pos_mean, neg_mean));

    // Second and last pass over x: sign bits and residual together, flat over
    // words. Means are kept as float bit patterns so that picking one is an
    // integer select.
    Tensor scratch;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        tensorflow::DT_UINT32, TensorShape({2, cols + 31}), &scratch));
    uint32_t* const pos_ext = scratch.flat<uint32_t>().data();
    uint32_t* const neg_ext = pos_ext + cols + 31;
    FillWrapped(ctx, pos_mean, cols, pos_ext, RoundedMeanBits<T>);
    FillWrapped(ctx, neg_mean, cols, neg_ext, RoundedMeanBits<T>);

    const int64_t full = n / 32;
    const int64_t step = 32 % cols;
#if TFGC_SB_X86_DISPATCH
    const bool use_avx2 = std::is_same<T, float>::value && HasAvx2();
    const bool stream =
        n * static_cast<int64_t>(sizeof(T)) >= cpu::kStreamMinBytes &&
        reinterpret_cast<uintptr_t>(residual_out) % 32 == 0;
#endif
    ParallelFor(
        ctx, NumSignWords(n), /*cost_per_unit=*/32 * 6,
        [&](int64_t wb, int64_t we) {
          int64_t j0 = (wb * 32) % cols;
          const int64_t end = std::min(we, full);
          int64_t w = wb;
#if TFGC_SB_X86_DISPATCH
          if constexpr (std::is_same<T, float>::value) {
            if (use_avx2 && w < end) {
              SignsAndResidualF32Avx2(x_in, cols, pos_ext, neg_ext, w, end, j0,
                                      words, residual_out, stream);
              j0 = (end * 32) % cols;
              w = end;
            }
          }
#endif
          for (; w < end; ++w) {
            const AliasedRawOf<T>* __restrict__ xp = x + w * 32;
            AliasedRawOf<T>* __restrict__ rp = residual + w * 32;
            const uint32_t* __restrict__ pm = pos_ext + j0;
            const uint32_t* __restrict__ nm = neg_ext + j0;
            uint32_t word = 0;
            for (int b = 0; b < 32; ++b) {
              const uint32_t f = Codec::ToF32Bits(xp[b]);
              const uint32_t m = NonNegativeMaskF32(f);
              word |= m & kBit[b];
              rp[b] = ResidualOf<T>(f, m, pm[b], nm[b]);
            }
            words[w] = static_cast<int32_t>(word);
            j0 += step;
            if (j0 >= cols) j0 -= cols;
          }
          if (we > full) {
            uint32_t word = 0;
            for (int64_t i = full * 32; i < n; ++i) {
              const int64_t j = i % cols;
              const uint32_t f = Codec::ToF32Bits(x[i]);
              const uint32_t m = NonNegativeMaskF32(f);
              word |= m & kBit[i - full * 32];
              residual[i] = ResidualOf<T>(f, m, pos_ext[j], neg_ext[j]);
            }
            words[full] = static_cast<int32_t>(word);
          }
        });
    return absl::OkStatus();
  }
};

template <typename T>
struct OneBitDequantizeFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const int32_t* words,
                          const float* pos_mean, const float* neg_mean,
                          int64_t rows, int64_t cols, T* out_t) {
    using Codec = FloatCodec<T>;
    using Raw = RawOf<T>;
    const int64_t n = rows * cols;
    if (n == 0) return absl::OkStatus();
    auto* const out = reinterpret_cast<AliasedRawOf<T>*>(out_t);
    auto to_raw = [](float m) {
      return static_cast<Raw>(Codec::FromF32Bits(FloatToBits(m)));
    };
    const int64_t full = n / 32;
    const int64_t step = 32 % cols;

    if (rows < kDirectDequantizeRows) {
      // Few rows: converting per element beats building converted copies of
      // the means, which for a [1, n] payload would be several times the
      // output's traffic. Chunks that wrap past the last column (at most one
      // per row once cols >= 32) take the scalar path.
      ParallelFor(
          ctx, NumSignWords(n), /*cost_per_unit=*/32 * 4,
          [&](int64_t wb, int64_t we) {
            int64_t j0 = (wb * 32) % cols;
            for (int64_t w = wb; w < we; ++w) {
              const uint32_t word = static_cast<uint32_t>(words[w]);
              AliasedRawOf<T>* __restrict__ op = out + w * 32;
              if (w < full && j0 + 32 <= cols) {
                const float* __restrict__ pm = pos_mean + j0;
                const float* __restrict__ nm = neg_mean + j0;
                for (int b = 0; b < 32; ++b) {
                  const uint32_t m = 0u - static_cast<uint32_t>((word & kBit[b]) != 0);
                  op[b] = static_cast<Raw>(Codec::FromF32Bits(
                      Select(m, FloatToBits(pm[b]), FloatToBits(nm[b]))));
                }
              } else {
                const int64_t len = std::min<int64_t>(32, n - w * 32);
                for (int64_t b = 0; b < len; ++b) {
                  const int64_t j = (j0 + b) % cols;
                  op[b] = to_raw((word & kBit[b]) ? pos_mean[j] : neg_mean[j]);
                }
              }
              j0 += step;
              if (j0 >= cols) j0 -= cols;
            }
          });
      return absl::OkStatus();
    }

    // Per-column output values, already converted to T, as raw bits so the
    // inner loop is a plain integer select.
    Tensor scratch;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(tensorflow::DataTypeToEnum<T>::value,
                           TensorShape({2, cols + 31}), &scratch));
    auto* const pos_ext =
        reinterpret_cast<AliasedRawOf<T>*>(scratch.flat<T>().data());
    auto* const neg_ext = pos_ext + cols + 31;
    FillWrapped(ctx, pos_mean, cols, pos_ext, to_raw);
    FillWrapped(ctx, neg_mean, cols, neg_ext, to_raw);

    ParallelFor(
        ctx, NumSignWords(n), /*cost_per_unit=*/32 * 2,
        [&](int64_t wb, int64_t we) {
          int64_t j0 = (wb * 32) % cols;
          const int64_t end = std::min(we, full);
          for (int64_t w = wb; w < end; ++w) {
            const uint32_t word = static_cast<uint32_t>(words[w]);
            AliasedRawOf<T>* __restrict__ op = out + w * 32;
            const AliasedRawOf<T>* __restrict__ pe = pos_ext + j0;
            const AliasedRawOf<T>* __restrict__ ne = neg_ext + j0;
            for (int b = 0; b < 32; ++b) {
              const Raw m = (word & kBit[b]) ? static_cast<Raw>(~Raw{0}) : Raw{0};
              op[b] = static_cast<Raw>((pe[b] & m) | (ne[b] & ~m));
            }
            j0 += step;
            if (j0 >= cols) j0 -= cols;
          }
          if (we > full) {
            const uint32_t word = static_cast<uint32_t>(words[full]);
            for (int64_t i = full * 32; i < n; ++i) {
              const int64_t j = i % cols;
              out[i] = (word & kBit[i - full * 32]) ? pos_ext[j] : neg_ext[j];
            }
          }
        });
    return absl::OkStatus();
  }
};

}  // namespace functor

// ---------------------------------------------------------------------------
// OpKernels: validate, allocate, dispatch to the device functor.
//
// Inputs of unpack/dequantize may come straight off the wire from another
// worker, so every size relation the functors rely on is checked here and
// reported as InvalidArgument instead of being trusted.

template <typename Device, typename T>
class PackSignBitsOp : public OpKernel {
 public:
  explicit PackSignBitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t n = x.NumElements();
    Tensor* words = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({NumSignWords(n)}), &words));
    if (n == 0) return;
    functor::PackSignBitsFunctor<Device, T>()(ctx, x.flat<T>().data(), n,
                                              words->flat<int32_t>().data());
  }
};

template <typename Device, typename T>
class UnpackSignBitsOp : public OpKernel {
 public:
  explicit UnpackSignBitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& words = ctx->input(0);
    const Tensor& num_elements = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(words.shape()),
                errors::InvalidArgument("words must be 1-D, got shape ",
                                        words.shape().DebugString()));
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(num_elements, "num_elements", &n));
    OP_REQUIRES(ctx, n >= 0,
                errors::InvalidArgument("num_elements must be >= 0, got ", n));
    OP_REQUIRES(ctx, words.dim_size(0) == NumSignWords(n),
                errors::InvalidArgument(
                    "words has ", words.dim_size(0), " entries but ",
                    NumSignWords(n), " are needed for ", n, " elements"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    if (n == 0) return;
    functor::UnpackSignBitsFunctor<Device, T>()(
        ctx, words.flat<int32_t>().data(), n, out->flat<T>().data());
  }
};

template <typename Device, typename T>
class OneBitQuantizeOp : public OpKernel {
 public:
  explicit OneBitQuantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(x.shape()),
                errors::InvalidArgument("x must be 2-D [rows, cols], got shape ",
                                        x.shape().DebugString()));
    const int64_t rows = x.dim_size(0);
    const int64_t cols = x.dim_size(1);
    Tensor *words = nullptr, *pos_mean = nullptr, *neg_mean = nullptr,
           *residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({NumSignWords(rows * cols)}),
                            &words));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(1, TensorShape({cols}), &pos_mean));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(2, TensorShape({cols}), &neg_mean));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, x.shape(), &residual));
    OP_REQUIRES_OK(ctx,
                   functor::OneBitQuantizeFunctor<Device, T>()(
                       ctx, x.flat<T>().data(), rows, cols,
                       words->flat<int32_t>().data(),
                       pos_mean->flat<float>().data(),
                       neg_mean->flat<float>().data(),
                       residual->flat<T>().data()));
  }
};

template <typename Device, typename T>
class OneBitDequantizeOp : public OpKernel {
 public:
  explicit OneBitDequantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& words = ctx->input(0);
    const Tensor& pos_mean = ctx->input(1);
    const Tensor& neg_mean = ctx->input(2);
    const Tensor& rows_t = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(words.shape()),
                errors::InvalidArgument("words must be 1-D, got shape ",
                                        words.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(pos_mean.shape()),
                errors::InvalidArgument("pos_mean must be 1-D, got shape ",
                                        pos_mean.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(neg_mean.shape()),
                errors::InvalidArgument("neg_mean must be 1-D, got shape ",
                                        neg_mean.shape().DebugString()));
    OP_REQUIRES(ctx, pos_mean.dim_size(0) == neg_mean.dim_size(0),
                errors::InvalidArgument(
                    "pos_mean and neg_mean must have the same length, got ",
                    pos_mean.dim_size(0), " and ", neg_mean.dim_size(0)));
    int64_t rows = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(rows_t, "rows", &rows));
    const int64_t cols = pos_mean.dim_size(0);
    OP_REQUIRES(ctx, rows >= 0,
                errors::InvalidArgument("rows must be >= 0, got ", rows));
    const int64_t n = tensorflow::MultiplyWithoutOverflow(rows, cols);
    OP_REQUIRES(ctx, n >= 0,
                errors::InvalidArgument("rows * cols overflows int64: ", rows,
                                        " * ", cols));
    OP_REQUIRES(ctx, words.dim_size(0) == NumSignWords(n),
                errors::InvalidArgument(
                    "words has ", words.dim_size(0), " entries but ",
                    NumSignWords(n), " are needed for ", rows, " x ", cols,
                    " elements"));
    TensorShape out_shape;
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape({rows, cols}, &out_shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    OP_REQUIRES_OK(ctx, functor::OneBitDequantizeFunctor<Device, T>()(
                            ctx, words.flat<int32_t>().data(),
                            pos_mean.flat<float>().data(),
                            neg_mean.flat<float>().data(), rows, cols,
                            out->flat<T>().data()));
  }
};

#define TFGC_REGISTER_SIGN_BITS_CPU(T)                                    \
  REGISTER_KERNEL_BUILDER(                                                \
      Name("TfgcPackSignBits").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      PackSignBitsOp<CPUDevice, T>);                                      \
  REGISTER_KERNEL_BUILDER(                                                \
      Name("TfgcUnpackSignBits").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      UnpackSignBitsOp<CPUDevice, T>);                                    \
  REGISTER_KERNEL_BUILDER(                                                \
      Name("TfgcOneBitQuantize").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      OneBitQuantizeOp<CPUDevice, T>);                                    \
  REGISTER_KERNEL_BUILDER(Name("TfgcOneBitDequantize")                    \
                              .Device(DEVICE_CPU)                         \
                              .TypeConstraint<T>("T"),                    \
                          OneBitDequantizeOp<CPUDevice, T>);

TFGC_REGISTER_SIGN_BITS_CPU(float);
TFGC_REGISTER_SIGN_BITS_CPU(Eigen::half);
TFGC_REGISTER_SIGN_BITS_CPU(Eigen::bfloat16);

#undef TFGC_REGISTER_SIGN_BITS_CPU

#if GOOGLE_CUDA
// GPU kernels (sign_bits_gpu.cu.cc), only in a CUDA-enabled TensorFlow build.
// Sizes are read on the host while validating, so they stay in host memory.
#define TFGC_REGISTER_SIGN_BITS_GPU(T)                                      \
  REGISTER_KERNEL_BUILDER(Name("TfgcPackSignBits")                          \
                              .Device(tensorflow::DEVICE_GPU)               \
                              .TypeConstraint<T>("T"),                      \
                          PackSignBitsOp<Eigen::GpuDevice, T>);             \
  REGISTER_KERNEL_BUILDER(Name("TfgcUnpackSignBits")                        \
                              .Device(tensorflow::DEVICE_GPU)               \
                              .TypeConstraint<T>("T")                       \
                              .HostMemory("num_elements"),                  \
                          UnpackSignBitsOp<Eigen::GpuDevice, T>);           \
  REGISTER_KERNEL_BUILDER(Name("TfgcOneBitQuantize")                        \
                              .Device(tensorflow::DEVICE_GPU)               \
                              .TypeConstraint<T>("T"),                      \
                          OneBitQuantizeOp<Eigen::GpuDevice, T>);           \
  REGISTER_KERNEL_BUILDER(Name("TfgcOneBitDequantize")                      \
                              .Device(tensorflow::DEVICE_GPU)               \
                              .TypeConstraint<T>("T")                       \
                              .HostMemory("rows"),                          \
                          OneBitDequantizeOp<Eigen::GpuDevice, T>);

TFGC_REGISTER_SIGN_BITS_GPU(float);
TFGC_REGISTER_SIGN_BITS_GPU(Eigen::half);
TFGC_REGISTER_SIGN_BITS_GPU(Eigen::bfloat16);

#undef TFGC_REGISTER_SIGN_BITS_GPU
#endif  // GOOGLE_CUDA

}  // namespace tfgc
