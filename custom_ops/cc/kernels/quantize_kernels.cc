// CPU kernels for stochastic bucketed quantization (QSGD / TernGrad). See
// quantize.h for the wire format and quantize_ops.cc for the op schemas.
//
// Performance notes. Quantization is dominated by generating one Philox
// uniform per element (10 rounds of two 32x32->64 multiplies per 4
// uniforms), so the generator runs 16 counters side by side in plain arrays
// that the compiler turns into SIMD code. Everything else per element is
// branch-free integer/float arithmetic on fixed 64-element blocks (a block
// is 16 Philox counters and a whole number of code words for every field
// width). Buckets that fit in cache are normed and quantized by the same
// task while they are hot; huge buckets (TernGrad's whole tensor) take two
// passes: parallel partial norms, then parallel quantization.
//
// No -march flags: the library must load on any x86-64 host that runs the
// TensorFlow wheel. On x86-64 the hot loops are additionally compiled for
// AVX2 and picked at run time; results are bit-identical across the variants
// (the same IEEE operations, no FMA contraction possible in the float code,
// and the only double arithmetic, the l2 sums, is exact squares added in a
// fixed order). float32 input on an AVX2 host, the common case, takes a
// fused register-only path (QuantizeFloatAvx2 below): per group of buckets
// the norms, then Philox, codes and packing without going through memory,
// with the input prefetched ahead and large code arrays written with
// streaming stores. Its generator uses two AVX-512VL instructions
// (vpternlogd, masked vpshufd) on 256-bit vectors where the host has them:
// a third fewer instructions per round. 512-bit vectors measured no faster
// (Zen 4 runs 512-bit multiplies as two 256-bit halves).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "custom_ops/cc/kernels/cpu_util.h"
#include "custom_ops/cc/kernels/quantize.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/random/philox_random.h"
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
using cpu::HasAvx2;
using cpu::HasAvx512Vl;
using cpu::ParallelFor;
using cpu::ScalarValue;
using cpu::Workers;

// Elements per block: 16 Philox counters, and a whole number of words for
// every field width (4 words of 2-bit codes ... 32 words of 16-bit codes).
constexpr int kBlock = 64;
constexpr int kGroups = kBlock / 4;
// Buckets whose lcm with kBlock is at most this many elements are normed and
// quantized by one task while they sit in L2.
constexpr int64_t kFusedMaxElems = int64_t{1} << 16;
// Chunk of a huge bucket summed by one task in the two-pass path.
constexpr int64_t kStatChunk = int64_t{1} << 15;

// Philox-4x32-10 constants (Salmon et al. 2011), as in
// tensorflow/core/lib/random/philox_random.h.
constexpr uint32_t kPhiloxW32A = 0x9E3779B9u;
constexpr uint32_t kPhiloxW32B = 0xBB67AE85u;
constexpr uint32_t kPhiloxM4x32A = 0xD2511F53u;
constexpr uint32_t kPhiloxM4x32B = 0xCD9E8D57u;

#if defined(__GNUC__) || defined(__clang__)
#define TFGC_Q_INLINE inline __attribute__((always_inline))
#else
#define TFGC_Q_INLINE inline
#endif

// SSE2 is part of x86-64, AVX2 is selected at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TFGC_Q_MULTIVERSION 1
#define TFGC_Q_TARGET_AVX2 __attribute__((target("avx2")))
#define TFGC_Q_TARGET_AVX512VL \
  __attribute__((target("avx2,avx512f,avx512vl")))
#include <immintrin.h>
#else
#define TFGC_Q_MULTIVERSION 0
#endif

// Vector ISA a kernel variant is compiled for.
constexpr int kIsaPortable = 0;
constexpr int kIsaSse2 = 1;
constexpr int kIsaAvx2 = 2;
constexpr int kIsaBase = TFGC_Q_MULTIVERSION ? kIsaSse2 : kIsaPortable;

// The input block as float32. Half types go through Eigen's exact
// conversions; float is copied so that the main loop always reads a full,
// zero-padded block.
template <typename T>
TFGC_Q_INLINE void LoadBlock(const T* x, int len, float* out) {
  for (int i = 0; i < len; ++i) out[i] = static_cast<float>(x[i]);
  for (int i = len; i < kBlock; ++i) out[i] = 0.0f;
}
template <>
TFGC_Q_INLINE void LoadBlock<float>(const float* x, int len, float* out) {
  std::memcpy(out, x, sizeof(float) * len);
  for (int i = len; i < kBlock; ++i) out[i] = 0.0f;
}

// The 64 raw Philox outputs for counters group .. group + 15: element
// 4 * j + m of the block gets output m of counter j, which is where
// tf.random.stateless_uniform puts it. Lanes are independent, so the inner
// loops vectorise (pmuludq-style widening multiplies).
TFGC_Q_INLINE void Philox16Portable(uint64_t group, const PhiloxStream& st,
                            uint32_t* out) {
  alignas(64) uint32_t c0[kGroups], c1[kGroups], c2[kGroups], c3[kGroups];
  for (int j = 0; j < kGroups; ++j) {
    const uint64_t g = group + static_cast<uint64_t>(j);
    c0[j] = static_cast<uint32_t>(g);
    c1[j] = static_cast<uint32_t>(g >> 32);
    c2[j] = st.counter_hi[0];
    c3[j] = st.counter_hi[1];
  }
  uint32_t k0 = st.key[0], k1 = st.key[1];
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    for (int j = 0; j < kGroups; ++j) {
      const uint64_t p0 = uint64_t{kPhiloxM4x32A} * c0[j];
      const uint64_t p1 = uint64_t{kPhiloxM4x32B} * c2[j];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[j] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[j] ^ k1;
      c1[j] = static_cast<uint32_t>(p1);
      c3[j] = static_cast<uint32_t>(p0);
      c0[j] = n0;
      c2[j] = n2;
    }
    k0 += kPhiloxW32A;
    k1 += kPhiloxW32B;
  }
  for (int j = 0; j < kGroups; ++j) {
    out[4 * j + 0] = c0[j];
    out[4 * j + 1] = c1[j];
    out[4 * j + 2] = c2[j];
    out[4 * j + 3] = c3[j];
  }
}

#if TFGC_Q_MULTIVERSION
// The same generator with explicit SIMD: compilers do not map the widening
// 32x32->64 multiplies of the portable loop onto pmuludq by themselves.
// mul_epu32 multiplies the even 32-bit lanes; a 64-bit shift brings the odd
// lanes down, and the high / low halves are merged back into 32-bit lanes.

// Low and high words of the 16 counters group .. group + 15 of a block.
struct PhiloxStart {
  alignas(64) uint32_t lo[kGroups];
  alignas(64) uint32_t hi[kGroups];
  explicit PhiloxStart(uint64_t group) {
    for (int j = 0; j < kGroups; ++j) {
      const uint64_t g = group + static_cast<uint64_t>(j);
      lo[j] = static_cast<uint32_t>(g);
      hi[j] = static_cast<uint32_t>(g >> 32);
    }
  }
};

// SSE2 (x86-64 baseline): four vectors of 4 counters.
TFGC_Q_INLINE void MulHiLoSse2(__m128i a, __m128i m, __m128i* hi,
                               __m128i* lo) {
  const __m128i even = _mm_mul_epu32(a, m);
  const __m128i odd = _mm_mul_epu32(_mm_srli_epi64(a, 32), m);
  const __m128i low_half = _mm_set1_epi64x(0xffffffffll);
  *hi = _mm_or_si128(_mm_srli_epi64(even, 32), _mm_andnot_si128(low_half, odd));
  *lo = _mm_or_si128(_mm_and_si128(even, low_half), _mm_slli_epi64(odd, 32));
}

// Writes the 4x4 block (c_m lane j = output m of counter j) counter-major.
TFGC_Q_INLINE void StoreTransposed4(__m128i c0, __m128i c1, __m128i c2,
                                    __m128i c3, __m128i* o) {
  const __m128i t0 = _mm_unpacklo_epi32(c0, c1);
  const __m128i t1 = _mm_unpackhi_epi32(c0, c1);
  const __m128i t2 = _mm_unpacklo_epi32(c2, c3);
  const __m128i t3 = _mm_unpackhi_epi32(c2, c3);
  _mm_store_si128(o + 0, _mm_unpacklo_epi64(t0, t2));
  _mm_store_si128(o + 1, _mm_unpackhi_epi64(t0, t2));
  _mm_store_si128(o + 2, _mm_unpacklo_epi64(t1, t3));
  _mm_store_si128(o + 3, _mm_unpackhi_epi64(t1, t3));
}

TFGC_Q_INLINE void Philox16Sse2(uint64_t group, const PhiloxStream& st,
                                uint32_t* out) {
  const PhiloxStart start(group);
  __m128i c0[4], c1[4], c2[4], c3[4];
  for (int v = 0; v < 4; ++v) {
    c0[v] = _mm_load_si128(reinterpret_cast<const __m128i*>(start.lo) + v);
    c1[v] = _mm_load_si128(reinterpret_cast<const __m128i*>(start.hi) + v);
    c2[v] = _mm_set1_epi32(static_cast<int>(st.counter_hi[0]));
    c3[v] = _mm_set1_epi32(static_cast<int>(st.counter_hi[1]));
  }
  const __m128i ma = _mm_set1_epi32(static_cast<int>(kPhiloxM4x32A));
  const __m128i mb = _mm_set1_epi32(static_cast<int>(kPhiloxM4x32B));
  uint32_t k0 = st.key[0], k1 = st.key[1];
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const __m128i vk0 = _mm_set1_epi32(static_cast<int>(k0));
    const __m128i vk1 = _mm_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < 4; ++v) {
      __m128i hi0, lo0, hi1, lo1;
      MulHiLoSse2(c0[v], ma, &hi0, &lo0);
      MulHiLoSse2(c2[v], mb, &hi1, &lo1);
      c0[v] = _mm_xor_si128(_mm_xor_si128(hi1, c1[v]), vk0);
      c2[v] = _mm_xor_si128(_mm_xor_si128(hi0, c3[v]), vk1);
      c1[v] = lo1;
      c3[v] = lo0;
    }
    k0 += kPhiloxW32A;
    k1 += kPhiloxW32B;
  }
  for (int v = 0; v < 4; ++v) {
    StoreTransposed4(c0[v], c1[v], c2[v], c3[v],
                     reinterpret_cast<__m128i*>(out) + 4 * v);
  }
}

// AVX2: Philox-4x32-10 for the 16 counters g .. g + 15 (g a multiple of 16,
// so the low words do not carry into the high word) as two interleaved
// 8-counter streams (one alone is latency-bound: each round is a multiply ->
// shift -> xor chain), with the low product halves from mullo instead of
// shift + blend: a[m] lane j = output m of counter g + j, b[m] the same for
// g + 8 + j.
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void Philox16x2Avx2(uint64_t g,
                                                     const PhiloxStream& st,
                                                     __m256i* a, __m256i* b) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i glo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g)));
  __m256i a0 = _mm256_add_epi32(glo, lane);
  __m256i b0 = _mm256_add_epi32(a0, _mm256_set1_epi32(8));
  __m256i a1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g >> 32)));
  __m256i b1 = a1;
  __m256i a2 = _mm256_set1_epi32(static_cast<int>(st.counter_hi[0]));
  __m256i b2 = a2;
  __m256i a3 = _mm256_set1_epi32(static_cast<int>(st.counter_hi[1]));
  __m256i b3 = a3;
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxM4x32A));
  const __m256i mb = _mm256_set1_epi32(static_cast<int>(kPhiloxM4x32B));
  uint32_t k0 = st.key[0], k1 = st.key[1];
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i vk1 = _mm256_set1_epi32(static_cast<int>(k1));
    // High halves: even lanes from a 64-bit shift of the even products, odd
    // lanes already in place in the odd products.
    const __m256i ae0 = _mm256_mul_epu32(a0, ma);
    const __m256i ao0 = _mm256_mul_epu32(_mm256_srli_epi64(a0, 32), ma);
    const __m256i ae2 = _mm256_mul_epu32(a2, mb);
    const __m256i ao2 = _mm256_mul_epu32(_mm256_srli_epi64(a2, 32), mb);
    const __m256i be0 = _mm256_mul_epu32(b0, ma);
    const __m256i bo0 = _mm256_mul_epu32(_mm256_srli_epi64(b0, 32), ma);
    const __m256i be2 = _mm256_mul_epu32(b2, mb);
    const __m256i bo2 = _mm256_mul_epu32(_mm256_srli_epi64(b2, 32), mb);
    const __m256i ahi0 = _mm256_blend_epi32(_mm256_srli_epi64(ae0, 32), ao0, 0xAA);
    const __m256i ahi2 = _mm256_blend_epi32(_mm256_srli_epi64(ae2, 32), ao2, 0xAA);
    const __m256i bhi0 = _mm256_blend_epi32(_mm256_srli_epi64(be0, 32), bo0, 0xAA);
    const __m256i bhi2 = _mm256_blend_epi32(_mm256_srli_epi64(be2, 32), bo2, 0xAA);
    const __m256i alo0 = _mm256_mullo_epi32(a0, ma);
    const __m256i alo2 = _mm256_mullo_epi32(a2, mb);
    const __m256i blo0 = _mm256_mullo_epi32(b0, ma);
    const __m256i blo2 = _mm256_mullo_epi32(b2, mb);
    a0 = _mm256_xor_si256(_mm256_xor_si256(ahi2, a1), vk0);
    a2 = _mm256_xor_si256(_mm256_xor_si256(ahi0, a3), vk1);
    a1 = alo2;
    a3 = alo0;
    b0 = _mm256_xor_si256(_mm256_xor_si256(bhi2, b1), vk0);
    b2 = _mm256_xor_si256(_mm256_xor_si256(bhi0, b3), vk1);
    b1 = blo2;
    b3 = blo0;
    k0 += kPhiloxW32A;
    k1 += kPhiloxW32B;
  }
  a[0] = a0; a[1] = a1; a[2] = a2; a[3] = a3;
  b[0] = b0; b[1] = b1; b[2] = b2; b[3] = b3;
}

// Philox16 for the generic block loop: the register generator above, with
// its outputs transposed to counter-major order in `out`. Not force-inlined:
// the callers are compiled for the baseline ISA too (only their AVX2
// instantiations call this), and one call per 64 elements is cheap. Block
// loops start on multiples of kBlock, so `group` is a multiple of 16.
TFGC_Q_TARGET_AVX2 void Philox16Avx2(uint64_t group, const PhiloxStream& st,
                                     uint32_t* out) {
  __m256i c[2][4];
  Philox16x2Avx2(group, st, c[0], c[1]);
  for (int v = 0; v < 2; ++v) {
    // 4x4 transposes within each 128-bit half: half h of o_m holds
    // counter 8v + 4h + m; the permutes put counters in order.
    const __m256i t0 = _mm256_unpacklo_epi32(c[v][0], c[v][1]);
    const __m256i t1 = _mm256_unpackhi_epi32(c[v][0], c[v][1]);
    const __m256i t2 = _mm256_unpacklo_epi32(c[v][2], c[v][3]);
    const __m256i t3 = _mm256_unpackhi_epi32(c[v][2], c[v][3]);
    const __m256i o0 = _mm256_unpacklo_epi64(t0, t2);
    const __m256i o1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i o2 = _mm256_unpacklo_epi64(t1, t3);
    const __m256i o3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* o = reinterpret_cast<__m256i*>(out) + 4 * v;
    _mm256_store_si256(o + 0, _mm256_permute2x128_si256(o0, o1, 0x20));
    _mm256_store_si256(o + 1, _mm256_permute2x128_si256(o2, o3, 0x20));
    _mm256_store_si256(o + 2, _mm256_permute2x128_si256(o0, o1, 0x31));
    _mm256_store_si256(o + 3, _mm256_permute2x128_si256(o2, o3, 0x31));
  }
}

#endif  // TFGC_Q_MULTIVERSION

// Philox16 for vector ISA kIsa.
template <int kIsa>
TFGC_Q_INLINE void Philox16(uint64_t group, const PhiloxStream& st,
                            uint32_t* out) {
#if TFGC_Q_MULTIVERSION
  if constexpr (kIsa == kIsaAvx2) {
    Philox16Avx2(group, st, out);
  } else if constexpr (kIsa == kIsaSse2) {
    Philox16Sse2(group, st, out);
  } else {
    Philox16Portable(group, st, out);
  }
#else
  Philox16Portable(group, st, out);
#endif
}

// Fills per-element copies of a per-bucket value for the block of `len`
// elements starting at e0, walking the (at most a few) buckets it overlaps.
// Written without (b + 1) * d, which could overflow for huge d.
template <typename Fn>
TFGC_Q_INLINE void FillPerElement(int64_t e0, int len, int64_t d, Fn value_of,
                                  float* out) {
  int pos = 0;
  int64_t b = e0 / d;
  int64_t left = d - e0 % d;  // elements of bucket b from e0 + pos on
  while (pos < len) {
    const int end = static_cast<int>(std::min<int64_t>(len, pos + left));
    const float v = value_of(b);
    for (int i = pos; i < end; ++i) out[i] = v;
    pos = end;
    ++b;
    left = d;
  }
  for (int i = len; i < kBlock; ++i) out[i] = 0.0f;
}

// Quantizes elements [e0, e1) of x (e0 a multiple of kBlock, e1 a multiple of
// kBlock or n) into their code words; scales[] already holds every bucket
// these elements belong to.
template <typename T, int kBits, int kIsa>
TFGC_Q_INLINE void QuantizeRangeImpl(const T* x, int64_t n, int64_t e0,
                                     int64_t e1, const float* scales,
                                     int64_t d, int s,
                                     const PhiloxStream& stream,
                                     int32_t* words) {
  constexpr int kPerWord = 32 / kBits;
  constexpr int kWordsPerBlock = kBlock / kPerWord;
  const float sf = static_cast<float>(s);
  const uint32_t s_bits = FloatToBits(sf);
  const uint32_t us = static_cast<uint32_t>(s);
  alignas(64) float xf[kBlock];
  alignas(64) float sc[kBlock];
  alignas(64) uint32_t rnd[kBlock];
  alignas(64) uint32_t codes[kBlock];
  alignas(64) uint32_t packed[kWordsPerBlock];
  for (int64_t b0 = e0; b0 < e1; b0 += kBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kBlock, n - b0));
    // Full float blocks are read in place; others go through the buffer.
    const float* xv = xf;
    if (std::is_same<T, float>::value && len == kBlock) {
      xv = reinterpret_cast<const float*>(x + b0);
    } else {
      LoadBlock<T>(x + b0, len, xf);
    }
    FillPerElement(b0, len, d, [&](int64_t b) { return scales[b]; }, sc);
    Philox16<kIsa>(static_cast<uint64_t>(b0 / 4), stream, rnd);
    for (int i = 0; i < kBlock; ++i) {
      const uint32_t vb = FloatToBits(xv[i]);
      const float scale = sc[i];
      // a = s |v| / scale, exactly the float32 operations of the reference.
      uint32_t a = FloatToBits((sf * BitsToFloat(vb & 0x7fffffffu)) / scale);
      // A zero scale (all-zero bucket) gives level 0 (divide_no_nan); a NaN
      // quotient (non-finite scale) too; +inf or rounding above s caps at s.
      // Masks instead of `?:`: GCC would sink the division into a branch
      // (it may trap) and then not vectorise the loop.
      const uint32_t keep =
          ~(0u - static_cast<uint32_t>(FloatToBits(scale) == 0)) &
          ~(0u - static_cast<uint32_t>(a > 0x7f800000u));
      a &= keep;
      const uint32_t cap = 0u - static_cast<uint32_t>(a > s_bits);
      a = (s_bits & cap) | (a & ~cap);
      const float af = BitsToFloat(a);
      const int32_t l = static_cast<int32_t>(af);  // floor: 0 <= af <= s
      const float frac = af - static_cast<float>(l);
      // The uniform in [0, 1) of tsl::random::Uint32ToFloat (low 23 bits).
      const float u = BitsToFloat(0x3f800000u | (rnd[i] & 0x7fffffu)) - 1.0f;
      // level = l + 1 with probability frac. Both are non-negative floats,
      // whose order is that of their bit patterns.
      const uint32_t level =
          static_cast<uint32_t>(l) +
          static_cast<uint32_t>(FloatToBits(u) < FloatToBits(frac));
      const uint32_t neg = 0u - (vb >> 31);
      codes[i] = us + ((level ^ neg) - neg);
    }
    for (int i = len; i < kBlock; ++i) codes[i] = 0;  // padding fields
    for (int w = 0; w < kWordsPerBlock; ++w) {
      uint32_t word = 0;
      for (int j = 0; j < kPerWord; ++j) {
        word |= codes[w * kPerWord + j] << (kBits * j);
      }
      packed[w] = word;
    }
    const int64_t first_word = b0 / kPerWord;
    const int nw = len == kBlock ? kWordsPerBlock
                                 : static_cast<int>(CeilDiv(len, kPerWord));
    std::memcpy(words + first_word, packed, sizeof(int32_t) * nw);
  }
}

// Decodes the block of `len` elements starting at b0 (a multiple of kBlock)
// into vals[0, kBlock) (entries past len are meaningless). Returns non-zero
// iff one of the len codes exceeds 2s.
template <int kBits>
TFGC_Q_INLINE uint32_t DecodeBlock(const float* scales, const int32_t* words,
                                   int64_t b0, int len, int64_t d, int s,
                                   float* vals) {
  constexpr int kPerWord = 32 / kBits;
  constexpr int kWordsPerBlock = kBlock / kPerWord;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const float sf = static_cast<float>(s);
  const uint32_t max_code = 2u * static_cast<uint32_t>(s);
  alignas(64) float so[kBlock];
  alignas(64) uint32_t packed[kWordsPerBlock];
  const int nw = len == kBlock ? kWordsPerBlock
                               : static_cast<int>(CeilDiv(len, kPerWord));
  std::memcpy(packed, words + b0 / kPerWord, sizeof(int32_t) * nw);
  for (int w = nw; w < kWordsPerBlock; ++w) packed[w] = 0;
  // Per element scale / s, the factor the Python QSGD decoder applies.
  FillPerElement(b0, len, d, [&](int64_t b) { return scales[b] / sf; }, so);
  uint32_t bad = 0;
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t code =
        (packed[i / kPerWord] >> (kBits * (i % kPerWord))) & kMask;
    // Padding fields (i >= len) are ignored, as with sign bits.
    bad |= static_cast<uint32_t>(code > max_code) &
           static_cast<uint32_t>(i < len);
    vals[i] = static_cast<float>(static_cast<int32_t>(code) - s) * so[i];
  }
  return bad;
}

// Decodes elements [e0, e1) (same alignment as above). Returns true iff some
// code exceeds 2s.
template <typename T, int kBits, int kIsa>
TFGC_Q_INLINE bool DequantizeRangeImpl(const float* scales, const int32_t* words,
                                       int64_t n, int64_t e0, int64_t e1,
                                       int64_t d, int s, T* out) {
  alignas(64) float vals[kBlock];
  uint32_t bad = 0;
  for (int64_t b0 = e0; b0 < e1; b0 += kBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kBlock, n - b0));
    bad |= DecodeBlock<kBits>(scales, words, b0, len, d, s, vals);
    T* o = out + b0;
    for (int i = 0; i < len; ++i) o[i] = static_cast<T>(vals[i]);
  }
  return bad != 0;
}

// Sum over `workers` payloads (scales [workers, nb], words [workers, nw]) of
// their decoded elements [e0, e1), added in worker order in float32 starting
// from +0, exactly like decoding each payload and adding the results one by
// one, but in one pass over the output. T is a dummy (always float).
template <typename T, int kBits, int kIsa>
TFGC_Q_INLINE bool DequantizeSumRangeImpl(const float* scales,
                                          const int32_t* words, int64_t workers,
                                          int64_t nb, int64_t nw, int64_t n,
                                          int64_t e0, int64_t e1, int64_t d,
                                          int s, float* out) {
  alignas(64) float vals[kBlock];
  alignas(64) float acc[kBlock];
  uint32_t bad = 0;
  for (int64_t b0 = e0; b0 < e1; b0 += kBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kBlock, n - b0));
    for (int i = 0; i < kBlock; ++i) acc[i] = 0.0f;
    for (int64_t k = 0; k < workers; ++k) {
      bad |= DecodeBlock<kBits>(scales + k * nb, words + k * nw, b0, len, d, s,
                                vals);
      for (int i = 0; i < kBlock; ++i) acc[i] += vals[i];
    }
    std::memcpy(out + b0, acc, sizeof(float) * len);
  }
  return bad != 0;
}

// Per-range statistics: the sum of squares (in double: float squares are
// exact in double, so only the additions round, in a fixed order) or the
// largest |v| bit pattern, stored as a double (exact for 32-bit integers).
// Comparing |v| bit patterns as integers makes NaN win over everything and
// +inf over every finite value.
template <typename T>
TFGC_Q_INLINE double RangeStatImpl(const T* x, int64_t len, bool max_norm) {
  constexpr int kLanes = 8;
  alignas(64) float buf[kBlock];
  alignas(64) double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  alignas(64) uint32_t mx[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t b0 = 0; b0 < len; b0 += kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(kBlock, len - b0));
    LoadBlock<T>(x + b0, m, buf);  // zero padded: adds 0 / max with 0
    if (max_norm) {
      for (int i = 0; i < kBlock; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          const uint32_t a = FloatToBits(buf[i + j]) & 0x7fffffffu;
          mx[j] = a > mx[j] ? a : mx[j];
        }
      }
    } else {
      for (int i = 0; i < kBlock; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          const double v = static_cast<double>(buf[i + j]);
          acc[j] += v * v;
        }
      }
    }
  }
  if (max_norm) {
    uint32_t r = 0;
    for (int j = 0; j < kLanes; ++j) r = std::max(r, mx[j]);
    return static_cast<double>(r);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline float ScaleFromStat(double stat, bool max_norm) {
  if (max_norm) return BitsToFloat(static_cast<uint32_t>(stat));
  return static_cast<float>(std::sqrt(stat));
}

#if TFGC_Q_MULTIVERSION
// ---------------------------------------------------------------------------
// Fused AVX2 quantizer for float32 input, the common case. Compared with the
// generic block loop above it keeps everything in registers: the input is
// transposed into Philox16x2Avx2's output order (lane j of vector m = element
// 4j + m) so no random numbers go through memory, and codes are packed with
// a few shifts instead of a scalar loop.
// Results are bit-identical to QuantizeRangeImpl: the same float operations,
// and the same Philox outputs paired with the same elements.

// The same generator with two AVX-512VL instructions on 256-bit vectors: a
// masked dword shuffle moves each product's high (or low) half into place in
// one step, and a three-input xor is one vpternlogd. That is 12 instead of
// 18 instructions per round; picked at run time where AVX-512VL exists.
TFGC_Q_TARGET_AVX512VL void Philox16x2Avx512(uint64_t g, const PhiloxStream& st,
                                             __m256i* a, __m256i* b) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i glo =
      _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g)));
  __m256i c0[2], c1[2], c2[2], c3[2];
  c0[0] = _mm256_add_epi32(glo, lane);
  c0[1] = _mm256_add_epi32(c0[0], _mm256_set1_epi32(8));
  for (int v = 0; v < 2; ++v) {
    c1[v] = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g >> 32)));
    c2[v] = _mm256_set1_epi32(static_cast<int>(st.counter_hi[0]));
    c3[v] = _mm256_set1_epi32(static_cast<int>(st.counter_hi[1]));
  }
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxM4x32A));
  const __m256i mb = _mm256_set1_epi32(static_cast<int>(kPhiloxM4x32B));
  uint32_t k0 = st.key[0], k1 = st.key[1];
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i vk1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < 2; ++v) {
      const __m256i e0 = _mm256_mul_epu32(c0[v], ma);
      const __m256i o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0[v], 32), ma);
      const __m256i e2 = _mm256_mul_epu32(c2[v], mb);
      const __m256i o2 = _mm256_mul_epu32(_mm256_srli_epi64(c2[v], 32), mb);
      // Even lanes take the swapped even product (its high half), odd lanes
      // keep the odd product's high half; the low halves the other way.
      const __m256i hi0 = _mm256_mask_shuffle_epi32(o0, 0x55, e0, _MM_PERM_CDAB);
      const __m256i hi2 = _mm256_mask_shuffle_epi32(o2, 0x55, e2, _MM_PERM_CDAB);
      const __m256i lo0 = _mm256_mask_shuffle_epi32(e0, 0xAA, o0, _MM_PERM_CDAB);
      const __m256i lo2 = _mm256_mask_shuffle_epi32(e2, 0xAA, o2, _MM_PERM_CDAB);
      c0[v] = _mm256_ternarylogic_epi32(hi2, c1[v], vk0, 0x96);
      c2[v] = _mm256_ternarylogic_epi32(hi0, c3[v], vk1, 0x96);
      c1[v] = lo2;
      c3[v] = lo0;
    }
    k0 += kPhiloxW32A;
    k1 += kPhiloxW32B;
  }
  a[0] = c0[0]; a[1] = c1[0]; a[2] = c2[0]; a[3] = c3[0];
  b[0] = c0[1]; b[1] = c1[1]; b[2] = c2[1]; b[3] = c3[1];
}


// Loads the 32 floats p[0, 32) as xm[m] lane j = p[4j + m] (the inverse of
// the transpose in Philox16Avx2): 128-bit halves are loaded straight into
// place, then 4x4 transposes within each half.
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void LoadTransposed32(const float* p,
                                                       __m256* xm) {
  const __m256 y0 = _mm256_loadu2_m128(p + 16, p + 0);
  const __m256 y1 = _mm256_loadu2_m128(p + 20, p + 4);
  const __m256 y2 = _mm256_loadu2_m128(p + 24, p + 8);
  const __m256 y3 = _mm256_loadu2_m128(p + 28, p + 12);
  const __m256 t0 = _mm256_unpacklo_ps(y0, y1);
  const __m256 t1 = _mm256_unpackhi_ps(y0, y1);
  const __m256 t2 = _mm256_unpacklo_ps(y2, y3);
  const __m256 t3 = _mm256_unpackhi_ps(y2, y3);
  xm[0] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  xm[1] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  xm[2] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  xm[3] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
}

// Codes of 8 elements v with raw uniforms r, as in QuantizeRangeImpl:
// a = min(s |v| / scale, s) with NaN (including 0 / 0 from an all-zero
// bucket) -> 0; a and s are non-negative, so the float min is the integer
// cap of the scalar code, and the float compare u < frac is its bit-pattern
// compare. _mm256_sign_epi32 applies the sign of v (v == +0 has level 0).
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE __m256i CodesAvx2(__m256 v, __m256i r,
                                                   __m256 sf, __m256 scale,
                                                   __m256i us) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 a = _mm256_div_ps(_mm256_mul_ps(sf, _mm256_and_ps(v, abs_mask)), scale);
  a = _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q));
  a = _mm256_min_ps(a, sf);
  const __m256i l = _mm256_cvttps_epi32(a);
  const __m256 frac = _mm256_sub_ps(a, _mm256_cvtepi32_ps(l));
  const __m256 u = _mm256_sub_ps(
      _mm256_castsi256_ps(_mm256_or_si256(
          _mm256_set1_epi32(0x3f800000),
          _mm256_and_si256(r, _mm256_set1_epi32(0x7fffff)))),
      _mm256_set1_ps(1.0f));
  // level = l + 1 where u < frac (the mask is -1 there).
  const __m256i level =
      _mm256_sub_epi32(l, _mm256_castps_si256(_mm256_cmp_ps(u, frac, _CMP_LT_OQ)));
  return _mm256_add_epi32(us, _mm256_sign_epi32(level, _mm256_castps_si256(v)));
}

// Code packing helpers for PackAndStore (lambdas would not inherit the
// target attribute).
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void StoreWords(int32_t* p, __m256i v,
                                                 bool nt) {
  if (nt) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

// c[0] | c[1] << k | c[2] << 2k | c[3] << 3k: the 4 outputs of each counter
// side by side.
template <int kShift>
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE __m256i MergeOutputs(const __m256i* c) {
  return _mm256_or_si256(
      _mm256_or_si256(c[0], _mm256_slli_epi32(c[1], kShift)),
      _mm256_or_si256(_mm256_slli_epi32(c[2], 2 * kShift),
                      _mm256_slli_epi32(c[3], 3 * kShift)));
}

// 16-bit codes of 8 counters: words 2j, 2j + 1 hold counter j.
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void Store16(const __m256i* c, int32_t* o,
                                              bool nt) {
  const __m256i p = _mm256_or_si256(c[0], _mm256_slli_epi32(c[1], 16));
  const __m256i q = _mm256_or_si256(c[2], _mm256_slli_epi32(c[3], 16));
  const __m256i lo = _mm256_unpacklo_epi32(p, q);
  const __m256i hi = _mm256_unpackhi_epi32(p, q);
  StoreWords(o, _mm256_permute2x128_si256(lo, hi, 0x20), nt);
  StoreWords(o + 8, _mm256_permute2x128_si256(lo, hi, 0x31), nt);
}

// Packs the codes of 16 counters (ca: counters 0..7, cb: 8..15, m-major) into
// the block's kBlock / (32 / kBits) words.
template <int kBits>
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void PackAndStore(const __m256i* ca,
                                                   const __m256i* cb,
                                                   int32_t* out, bool nt) {
  if constexpr (kBits == 8) {
    // Word j holds the 4 outputs of counter j: no lane movement at all.
    StoreWords(out, MergeOutputs<8>(ca), nt);
    StoreWords(out + 8, MergeOutputs<8>(cb), nt);
  } else if constexpr (kBits == 16) {
    Store16(ca, out, nt);
    Store16(cb, out + 16, nt);
  } else if constexpr (kBits == 4) {
    // Word w holds counters 2w (low half) and 2w + 1 (high half): fold each
    // 64-bit lane, then gather the low dwords.
    const __m256i pa = MergeOutputs<4>(ca);
    const __m256i pb = MergeOutputs<4>(cb);
    const __m256 w = _mm256_shuffle_ps(
        _mm256_castsi256_ps(_mm256_or_si256(pa, _mm256_srli_epi64(pa, 16))),
        _mm256_castsi256_ps(_mm256_or_si256(pb, _mm256_srli_epi64(pb, 16))),
        _MM_SHUFFLE(2, 0, 2, 0));
    StoreWords(out,
               _mm256_permute4x64_epi64(_mm256_castps_si256(w),
                                        _MM_SHUFFLE(3, 1, 2, 0)),
               nt);
  } else {
    static_assert(kBits == 2, "bits must be 2, 4, 8 or 16");
    // Word w holds counters 4w .. 4w + 3, one byte each.
    const __m256i p16 =
        _mm256_packus_epi32(MergeOutputs<2>(ca), MergeOutputs<2>(cb));
    const __m256i p8 = _mm256_packus_epi16(p16, p16);
    // Dwords 0, 1 | 4, 5 are counters a0-3, b0-3 | a4-7, b4-7.
    const __m256i w = _mm256_permutevar8x32_epi32(
        p8, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
    const __m128i w4 = _mm256_castsi256_si128(w);
    if (nt) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out), w4);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), w4);
    }
  }
}

// Quantizes elements [e0, e1) of float x (e0 a multiple of kBlock, e1 a
// multiple of kBlock or n). Full blocks inside one bucket take the register
// path; a partial last block or one that straddles buckets goes through the
// generic block code (same results).
// Prefetch distance of QuantizeFloatRangeAvx2, in elements (8 KiB).
constexpr int64_t kPrefetchElems = 2048;

template <int kBits, bool kAvx512Philox>
TFGC_Q_TARGET_AVX2 void QuantizeFloatRangeAvx2(const float* x, int64_t n,
                                               int64_t e0, int64_t e1,
                                               const float* scales, int64_t d,
                                               int s,
                                               const PhiloxStream& stream,
                                               int32_t* words, bool nt) {
  constexpr int kPerWord = 32 / kBits;
  const __m256 sf = _mm256_set1_ps(static_cast<float>(s));
  const __m256i us = _mm256_set1_epi32(s);
  int64_t b = e0 / d;
  int64_t bucket_end = std::min(n, b * d + std::min(d, n - b * d));
  __m256 scale = _mm256_set1_ps(scales[b]);
  for (int64_t b0 = e0; b0 < e1; b0 += kBlock) {
    while (b0 >= bucket_end) {
      ++b;
      bucket_end = b * d + std::min(d, n - b * d);
      scale = _mm256_set1_ps(scales[b]);
    }
    if (b0 + kBlock > bucket_end) {
      QuantizeRangeImpl<float, kBits, kIsaAvx2>(
          x, n, b0, std::min(b0 + kBlock, e1), scales, d, s, stream, words);
      continue;
    }
    // The loop is compute-bound: fetching the input further ahead lets the
    // memory transfers overlap the arithmetic (including the statistics of
    // the next group, which then read from cache). Prefetches past the end
    // of x are harmless (they never fault).
    for (int line = 0; line < kBlock; line += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(x + b0 + kPrefetchElems + line),
                   _MM_HINT_T0);
    }
    __m256i ra[4], rb[4];
    if constexpr (kAvx512Philox) {
      Philox16x2Avx512(static_cast<uint64_t>(b0 / 4), stream, ra, rb);
    } else {
      Philox16x2Avx2(static_cast<uint64_t>(b0 / 4), stream, ra, rb);
    }
    __m256 xa[4], xb[4];
    LoadTransposed32(x + b0, xa);
    LoadTransposed32(x + b0 + 32, xb);
    __m256i ca[4], cb[4];
    for (int m = 0; m < 4; ++m) {
      ca[m] = CodesAvx2(xa[m], ra[m], sf, scale, us);
      cb[m] = CodesAvx2(xb[m], rb[m], sf, scale, us);
    }
    PackAndStore<kBits>(ca, cb, words + b0 / kPerWord, nt);
  }
}

// Sum of squares (as RangeStatImpl: lane i % 8 of 8 double partial sums,
// added in element order, then combined pairwise) of two ranges at once:
// each range's two accumulator chains are add-latency-bound, so interleaving
// two ranges doubles the throughput. Entries past len0 / len1 read as 0,
// which leaves the sums unchanged (they are >= +0 or NaN).
TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE double CombineLanes(__m256d lo, __m256d hi) {
  alignas(32) double a[8];
  _mm256_store_pd(a, lo);
  _mm256_store_pd(a + 4, hi);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE void SquaresAdd(__m256 v, __m256d* lo,
                                                 __m256d* hi) {
  const __m256d l = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d h = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  *lo = _mm256_add_pd(*lo, _mm256_mul_pd(l, l));
  *hi = _mm256_add_pd(*hi, _mm256_mul_pd(h, h));
}

TFGC_Q_TARGET_AVX2 TFGC_Q_INLINE __m256 LoadPartial8(const float* p, int64_t m) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), idx);
  return _mm256_maskload_ps(p, mask);
}

TFGC_Q_TARGET_AVX2 void SumSquaresAvx2x2(const float* x0, int64_t len0,
                                         const float* x1, int64_t len1,
                                         double* out0, double* out1) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  __m256d b0 = _mm256_setzero_pd(), b1 = _mm256_setzero_pd();
  const int64_t both = std::min(len0, len1) & ~int64_t{7};
  int64_t i = 0;
  for (; i < both; i += 8) {
    SquaresAdd(_mm256_loadu_ps(x0 + i), &a0, &a1);
    SquaresAdd(_mm256_loadu_ps(x1 + i), &b0, &b1);
  }
  for (int64_t j = i; j < len0; j += 8) {
    SquaresAdd(len0 - j >= 8 ? _mm256_loadu_ps(x0 + j)
                             : LoadPartial8(x0 + j, len0 - j),
               &a0, &a1);
  }
  for (int64_t j = i; j < len1; j += 8) {
    SquaresAdd(len1 - j >= 8 ? _mm256_loadu_ps(x1 + j)
                             : LoadPartial8(x1 + j, len1 - j),
               &b0, &b1);
  }
  *out0 = CombineLanes(a0, a1);
  *out1 = CombineLanes(b0, b1);
}

// Largest |v| bit pattern of x[0, len), as a double (see RangeStatImpl).
TFGC_Q_TARGET_AVX2 double MaxAbsBitsAvx2(const float* x, int64_t len) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m256i* p = reinterpret_cast<const __m256i*>(x + i);
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(p), abs_mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), abs_mask));
    m2 = _mm256_max_epu32(m2, _mm256_and_si256(_mm256_loadu_si256(p + 2), abs_mask));
    m3 = _mm256_max_epu32(m3, _mm256_and_si256(_mm256_loadu_si256(p + 3), abs_mask));
  }
  for (; i < len; i += 8) {
    const __m256 v = len - i >= 8 ? _mm256_loadu_ps(x + i)
                                  : LoadPartial8(x + i, len - i);
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
  }
  m0 = _mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3));
  alignas(32) uint32_t a[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), m0);
  uint32_t r = 0;
  for (int j = 0; j < 8; ++j) r = std::max(r, a[j]);
  return static_cast<double>(r);
}

// Statistics of buckets [b_begin, b_end) into scales.
TFGC_Q_TARGET_AVX2 void BucketScalesAvx2(const float* x, int64_t n, int64_t d,
                                         int64_t b_begin, int64_t b_end,
                                         bool max_norm, float* scales) {
  auto len_of = [&](int64_t b) { return std::min(d, n - b * d); };
  int64_t b = b_begin;
  if (max_norm) {
    for (; b < b_end; ++b) {
      scales[b] = ScaleFromStat(MaxAbsBitsAvx2(x + b * d, len_of(b)), true);
    }
    return;
  }
  for (; b + 2 <= b_end; b += 2) {
    double s0, s1;
    SumSquaresAvx2x2(x + b * d, len_of(b), x + (b + 1) * d, len_of(b + 1),
                     &s0, &s1);
    scales[b] = ScaleFromStat(s0, false);
    scales[b + 1] = ScaleFromStat(s1, false);
  }
  if (b < b_end) {
    double s0, s1;
    SumSquaresAvx2x2(x + b * d, len_of(b), x, 0, &s0, &s1);
    scales[b] = ScaleFromStat(s0, false);
  }
}
#endif  // TFGC_Q_MULTIVERSION

// ---------------------------------------------------------------------------
// Run-time ISA dispatch. Each entry point is the same inline body compiled
// for the baseline ISA and (on x86-64 with GCC) for AVX2.


#define TFGC_Q_DEFINE_VARIANTS(NAME, IMPL, RET, PARAMS, ARGS)          \
  template <typename T, int kBits>                                     \
  RET NAME##Base PARAMS { return IMPL<T, kBits, kIsaBase> ARGS; }      \
  TFGC_Q_DEFINE_AVX2_VARIANT(NAME, IMPL, RET, PARAMS, ARGS)            \
  template <typename T, int kBits>                                     \
  RET NAME PARAMS {                                                    \
    TFGC_Q_DISPATCH_AVX2(NAME, ARGS)                                   \
    return NAME##Base<T, kBits> ARGS;                                  \
  }

#if TFGC_Q_MULTIVERSION
#define TFGC_Q_DEFINE_AVX2_VARIANT(NAME, IMPL, RET, PARAMS, ARGS) \
  template <typename T, int kBits>                                \
  TFGC_Q_TARGET_AVX2 RET NAME##Avx2 PARAMS {                      \
    return IMPL<T, kBits, kIsaAvx2> ARGS;                         \
  }
#define TFGC_Q_DISPATCH_AVX2(NAME, ARGS) \
  if (HasAvx2()) return NAME##Avx2<T, kBits> ARGS;
#else
#define TFGC_Q_DEFINE_AVX2_VARIANT(NAME, IMPL, RET, PARAMS, ARGS)
#define TFGC_Q_DISPATCH_AVX2(NAME, ARGS)
#endif

TFGC_Q_DEFINE_VARIANTS(QuantizeRange, QuantizeRangeImpl, void,
                       (const T* x, int64_t n, int64_t e0, int64_t e1,
                        const float* scales, int64_t d, int s,
                        const PhiloxStream& stream, int32_t* words),
                       (x, n, e0, e1, scales, d, s, stream, words))

TFGC_Q_DEFINE_VARIANTS(DequantizeRange, DequantizeRangeImpl, bool,
                       (const float* scales, const int32_t* words, int64_t n,
                        int64_t e0, int64_t e1, int64_t d, int s, T* out),
                       (scales, words, n, e0, e1, d, s, out))

TFGC_Q_DEFINE_VARIANTS(DequantizeSumRange, DequantizeSumRangeImpl, bool,
                       (const float* scales, const int32_t* words,
                        int64_t workers, int64_t nb, int64_t nw, int64_t n,
                        int64_t e0, int64_t e1, int64_t d, int s, float* out),
                       (scales, words, workers, nb, nw, n, e0, e1, d, s, out))

// The statistics have no field width; kBits is a dummy template argument so
// that they share the dispatch machinery.
template <typename T, int kBits, int kIsa>
TFGC_Q_INLINE double RangeStatImplB(const T* x, int64_t len, bool max_norm) {
  return RangeStatImpl<T>(x, len, max_norm);
}
TFGC_Q_DEFINE_VARIANTS(RangeStat, RangeStatImplB, double,
                       (const T* x, int64_t len, bool max_norm),
                       (x, len, max_norm))

// Bucket scales for buckets too large to quantise while they are in cache:
// partial statistics (stat(ptr, len): max |x| or sum of squares, as double)
// over fixed chunks of kStatChunk elements, so that the result does not
// depend on the thread count, combined per bucket in chunk order.
template <typename T, typename Stat>
absl::Status HugeBucketScales(OpKernelContext* ctx, const T* x, int64_t n,
                              int64_t d, bool max_norm, int64_t stat_cost,
                              float* scales, const Stat& stat) {
  const int64_t nb = NumBuckets(n, d);
  const int64_t per_bucket = CeilDiv(std::min(d, n), kStatChunk);
  Tensor partial_t;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_DOUBLE,
                                        TensorShape({nb * per_bucket}),
                                        &partial_t));
  double* partial = partial_t.flat<double>().data();
  ParallelFor(ctx, nb * per_bucket, kStatChunk * stat_cost,
              [&](int64_t tb, int64_t te) {
                for (int64_t t = tb; t < te; ++t) {
                  const int64_t b = t / per_bucket;
                  const int64_t c = t % per_bucket;
                  const int64_t len_b = std::min(d, n - b * d);
                  const int64_t off = c * kStatChunk;
                  const int64_t len = std::min(kStatChunk, len_b - off);
                  partial[t] = len > 0 ? stat(x + b * d + off, len) : 0.0;
                }
              });
  for (int64_t b = 0; b < nb; ++b) {
    double acc = 0.0;
    for (int64_t c = 0; c < per_bucket; ++c) {
      const double v = partial[b * per_bucket + c];
      acc = max_norm ? std::max(acc, v) : acc + v;
    }
    scales[b] = ScaleFromStat(acc, max_norm);
  }
  return absl::OkStatus();
}

#if TFGC_Q_MULTIVERSION
// Elements whose statistics are taken just before they are quantized, so
// that the second read comes from L1 / L2.
constexpr int64_t kFusedGroupElems = int64_t{1} << 11;

// QuantizeWithBits for float input on an AVX2 host (same task structure,
// same results). `unit` buckets start each task on a block boundary.
template <int kBits>
absl::Status QuantizeFloatAvx2(OpKernelContext* ctx, const float* x, int64_t n,
                               const PhiloxStream& stream,
                               const QuantizeParams& p, int64_t unit,
                               float* scales, int32_t* words) {
  const int64_t d = p.bucket_size;
  const int s = p.levels;
  const bool max_norm = p.max_norm;
  // Rough cycles per element: about half of the generic block loop's.
  constexpr int64_t kQuantCost = 12;
  constexpr int64_t kStatCost = 2;
  const auto quantize_range = HasAvx512Vl()
                                  ? QuantizeFloatRangeAvx2<kBits, true>
                                  : QuantizeFloatRangeAvx2<kBits, false>;
  const bool nt =
      NumCodeWords(n, kBits) * 4 >= cpu::kStreamMinBytes &&
      reinterpret_cast<uintptr_t>(words) % 32 == 0;
  if (d <= kFusedMaxElems / unit) {
    const int64_t span = unit * d;
    const int64_t units = CeilDiv(n, span);
    const int64_t group = std::max<int64_t>(1, kFusedGroupElems / span);
    ParallelFor(ctx, units, span * (kQuantCost + kStatCost),
                [&](int64_t ub, int64_t ue) {
                  for (int64_t u = ub; u < ue; u += group) {
                    const int64_t e0 = u * span;
                    const int64_t e1 = std::min(n, std::min(ue, u + group) * span);
                    BucketScalesAvx2(x, n, d, e0 / d, CeilDiv(e1, d), max_norm,
                                     scales);
                    quantize_range(x, n, e0, e1, scales, d, s, stream, words,
                                   nt);
                  }
                  if (nt) _mm_sfence();
                });
    return absl::OkStatus();
  }
  // Huge buckets: partial statistics over fixed chunks, as in
  // QuantizeWithBits, then one quantization pass.
  TF_RETURN_IF_ERROR(HugeBucketScales(
      ctx, x, n, d, max_norm, kStatCost, scales,
      [&](const float* xc, int64_t len) {
        if (max_norm) return MaxAbsBitsAvx2(xc, len);
        double v = 0.0, unused;
        SumSquaresAvx2x2(xc, len, xc, 0, &v, &unused);
        return v;
      }));
  ParallelFor(ctx, CeilDiv(n, kBlock), kBlock * kQuantCost,
              [&](int64_t bb, int64_t be) {
                quantize_range(x, n, bb * kBlock, std::min(n, be * kBlock),
                               scales, d, s, stream, words, nt);
                if (nt) _mm_sfence();
              });
  return absl::OkStatus();
}
#endif  // TFGC_Q_MULTIVERSION

template <typename T, int kBits>
absl::Status QuantizeWithBits(OpKernelContext* ctx, const T* x, int64_t n,
                              const PhiloxStream& stream,
                              const QuantizeParams& p, float* scales,
                              int32_t* words) {
  const int64_t d = p.bucket_size;
  const int s = p.levels;
  const bool max_norm = p.max_norm;
  // Rough cycles per element: ~25 for the Philox share and the arithmetic.
  constexpr int64_t kQuantCost = 25;
  constexpr int64_t kStatCost = 2;

  // Buckets per task so that each task starts on a block boundary.
  int64_t unit = 1;
  {
    int64_t g = d % kBlock, a = kBlock;
    while (g != 0) {  // gcd(d, kBlock)
      const int64_t t = a % g;
      a = g;
      g = t;
    }
    unit = kBlock / a;
  }
#if TFGC_Q_MULTIVERSION
  if constexpr (std::is_same<T, float>::value) {
    if (HasAvx2()) {
      return QuantizeFloatAvx2<kBits>(ctx, x, n, stream, p, unit, scales,
                                      words);
    }
  }
#endif
  if (d <= kFusedMaxElems / unit) {
    const int64_t span = unit * d;  // elements per task unit, <= 2^16
    const int64_t units = CeilDiv(n, span);
    ParallelFor(ctx, units, span * (kQuantCost + kStatCost),
                [&](int64_t ub, int64_t ue) {
                  for (int64_t u = ub; u < ue; ++u) {
                    const int64_t e0 = u * span;
                    const int64_t e1 = std::min(n, e0 + span);
                    for (int64_t b = e0 / d; b * d < e1; ++b) {
                      const int64_t len = std::min(d, n - b * d);
                      scales[b] = ScaleFromStat(
                          RangeStat<T, 0>(x + b * d, len, max_norm),
                          max_norm);
                    }
                    QuantizeRange<T, kBits>(x, n, e0, e1, scales, d, s, stream,
                                            words);
                  }
                });
    return absl::OkStatus();
  }

  // Huge buckets: partial statistics over fixed chunks, then one
  // quantization pass.
  TF_RETURN_IF_ERROR(HugeBucketScales(
      ctx, x, n, d, max_norm, kStatCost, scales,
      [&](const T* xc, int64_t len) {
        return RangeStat<T, 0>(xc, len, max_norm);
      }));
  ParallelFor(ctx, CeilDiv(n, kBlock), kBlock * kQuantCost,
              [&](int64_t bb, int64_t be) {
                QuantizeRange<T, kBits>(x, n, bb * kBlock,
                                        std::min(n, be * kBlock), scales, d, s,
                                        stream, words);
              });
  return absl::OkStatus();
}

template <typename T, int kBits>
absl::Status DequantizeWithBits(OpKernelContext* ctx, const float* scales,
                                const int32_t* words, int64_t n,
                                const QuantizeParams& p, T* out) {
  std::atomic<bool> bad{false};
  ParallelFor(ctx, CeilDiv(n, kBlock), kBlock * 4,
              [&](int64_t bb, int64_t be) {
                if (DequantizeRange<T, kBits>(scales, words, n, bb * kBlock,
                                              std::min(n, be * kBlock),
                                              p.bucket_size, p.levels, out)) {
                  bad.store(true, std::memory_order_relaxed);
                }
              });
  if (bad.load()) {
    return errors::InvalidArgument("words holds a code above 2 * levels = ",
                                   2 * p.levels);
  }
  return absl::OkStatus();
}

template <int kBits>
absl::Status DequantizeSumWithBits(OpKernelContext* ctx, const float* scales,
                                   const int32_t* words, int64_t workers,
                                   int64_t n, const QuantizeParams& p,
                                   float* out) {
  const int64_t nb = NumBuckets(n, p.bucket_size);
  const int64_t nw = NumCodeWords(n, p.bits);
  std::atomic<bool> bad{false};
  ParallelFor(ctx, CeilDiv(n, kBlock), kBlock * 4 * workers,
              [&](int64_t bb, int64_t be) {
                if (DequantizeSumRange<float, kBits>(
                        scales, words, workers, nb, nw, n, bb * kBlock,
                        std::min(n, be * kBlock), p.bucket_size, p.levels,
                        out)) {
                  bad.store(true, std::memory_order_relaxed);
                }
              });
  if (bad.load()) {
    return errors::InvalidArgument("words holds a code above 2 * levels = ",
                                   2 * p.levels);
  }
  return absl::OkStatus();
}

}  // namespace

namespace functor {

template <typename T>
struct QuantizeBucketedFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* x, int64_t n,
                          const PhiloxStream& stream, const QuantizeParams& p,
                          float* scales, int32_t* words) {
    if (n == 0) {
      scales[0] = 0.0f;
      return absl::OkStatus();
    }
    switch (p.bits) {
      case 2:
        return QuantizeWithBits<T, 2>(ctx, x, n, stream, p, scales, words);
      case 4:
        return QuantizeWithBits<T, 4>(ctx, x, n, stream, p, scales, words);
      case 8:
        return QuantizeWithBits<T, 8>(ctx, x, n, stream, p, scales, words);
      case 16:
        return QuantizeWithBits<T, 16>(ctx, x, n, stream, p, scales, words);
    }
    return errors::InvalidArgument("bits must be 2, 4, 8 or 16, got ", p.bits);
  }
};

template <typename T>
struct DequantizeBucketedFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const float* scales,
                          const int32_t* words, int64_t n,
                          const QuantizeParams& p, T* out) {
    if (n == 0) return absl::OkStatus();
    switch (p.bits) {
      case 2:
        return DequantizeWithBits<T, 2>(ctx, scales, words, n, p, out);
      case 4:
        return DequantizeWithBits<T, 4>(ctx, scales, words, n, p, out);
      case 8:
        return DequantizeWithBits<T, 8>(ctx, scales, words, n, p, out);
      case 16:
        return DequantizeWithBits<T, 16>(ctx, scales, words, n, p, out);
    }
    return errors::InvalidArgument("bits must be 2, 4, 8 or 16, got ", p.bits);
  }
};

template <>
struct DequantizeBucketedSumFunctor<CPUDevice> {
  absl::Status operator()(OpKernelContext* ctx, const float* scales,
                          const int32_t* words, int64_t workers, int64_t n,
                          const QuantizeParams& p, float* out) {
    if (n == 0) return absl::OkStatus();
    switch (p.bits) {
      case 2:
        return DequantizeSumWithBits<2>(ctx, scales, words, workers, n, p, out);
      case 4:
        return DequantizeSumWithBits<4>(ctx, scales, words, workers, n, p, out);
      case 8:
        return DequantizeSumWithBits<8>(ctx, scales, words, workers, n, p, out);
      case 16:
        return DequantizeSumWithBits<16>(ctx, scales, words, workers, n, p,
                                         out);
    }
    return errors::InvalidArgument("bits must be 2, 4, 8 or 16, got ", p.bits);
  }
};

}  // namespace functor

// ---------------------------------------------------------------------------
// OpKernels.

namespace {

// Reads and checks the static attributes shared by both ops.
absl::Status ReadQuantizeAttrs(OpKernelConstruction* ctx, QuantizeParams* p) {
  int64_t levels = 0, bucket_size = 0, bits = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("levels", &levels));
  TF_RETURN_IF_ERROR(ctx->GetAttr("bucket_size", &bucket_size));
  TF_RETURN_IF_ERROR(ctx->GetAttr("bits", &bits));
  if (levels < 1 || levels > kMaxQuantizeLevels) {
    return errors::InvalidArgument("levels must be in [1, ", kMaxQuantizeLevels,
                                   "], got ", levels);
  }
  if (bucket_size < 1) {
    return errors::InvalidArgument("bucket_size must be >= 1, got ",
                                   bucket_size);
  }
  if (bits != 2 && bits != 4 && bits != 8 && bits != 16) {
    return errors::InvalidArgument("bits must be 2, 4, 8 or 16, got ", bits);
  }
  if (!BitsHoldLevels(static_cast<int>(bits), static_cast<int>(levels))) {
    return errors::InvalidArgument(bits, "-bit fields cannot hold the ",
                                   2 * levels + 1, " codes of levels = ",
                                   levels);
  }
  p->levels = static_cast<int>(levels);
  p->bucket_size = bucket_size;
  p->bits = static_cast<int>(bits);
  p->max_norm = false;
  return absl::OkStatus();
}

// TensorFlow's stateless seed scrambling (GenerateKey in
// tensorflow/core/kernels/stateless_random_ops.cc): one Philox call on the
// seed under a fixed key yields the key and the upper counter half, and the
// lower counter half starts at 0. Matching it makes element i draw the same
// uniform as tf.random.stateless_uniform([N], seed)[i].
PhiloxStream StreamFromSeed(int64_t seed0_in, int64_t seed1_in) {
  const uint64_t seed0 = static_cast<uint64_t>(seed0_in);
  const uint64_t seed1 = static_cast<uint64_t>(seed1_in);
  tensorflow::random::PhiloxRandom::ResultType counter;
  tensorflow::random::PhiloxRandom::Key key;
  key[0] = 0x3ec8f720u;
  key[1] = 0x02461e29u;
  counter[0] = static_cast<uint32_t>(seed0);
  counter[1] = static_cast<uint32_t>(seed0 >> 32);
  counter[2] = static_cast<uint32_t>(seed1);
  counter[3] = static_cast<uint32_t>(seed1 >> 32);
  const auto mix = tensorflow::random::PhiloxRandom(counter, key)();
  PhiloxStream st;
  st.key[0] = mix[0];
  st.key[1] = mix[1];
  st.counter_hi[0] = mix[2];
  st.counter_hi[1] = mix[3];
  return st;
}

}  // namespace

template <typename Device, typename T>
class QuantizeBucketedOp : public OpKernel {
 public:
  explicit QuantizeBucketedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadQuantizeAttrs(ctx, &params_));
    std::string norm;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm", &norm));
    OP_REQUIRES(ctx, norm == "l2" || norm == "max",
                errors::InvalidArgument("norm must be 'l2' or 'max', got '",
                                        norm, "'"));
    params_.max_norm = norm == "max";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& seed = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(seed.shape()) &&
                         seed.dim_size(0) == 2,
                errors::InvalidArgument("seed must have shape [2], got ",
                                        seed.shape().DebugString()));
    const auto seed_v = seed.flat<int64_t>();
    const PhiloxStream stream = StreamFromSeed(seed_v(0), seed_v(1));
    const int64_t n = x.NumElements();
    Tensor* scales = nullptr;
    Tensor* words = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({NumBuckets(n, params_.bucket_size)}),
                            &scales));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({NumCodeWords(n, params_.bits)}),
                            &words));
    OP_REQUIRES_OK(ctx, functor::QuantizeBucketedFunctor<Device, T>()(
                            ctx, x.flat<T>().data(), n, stream, params_,
                            scales->flat<float>().data(),
                            words->flat<int32_t>().data()));
  }

 private:
  QuantizeParams params_;
};

template <typename Device, typename T>
class DequantizeBucketedOp : public OpKernel {
 public:
  explicit DequantizeBucketedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadQuantizeAttrs(ctx, &params_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& scales = ctx->input(0);
    const Tensor& words = ctx->input(1);
    const Tensor& num_elements = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(scales.shape()),
                errors::InvalidArgument("scales must be 1-D, got shape ",
                                        scales.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(words.shape()),
                errors::InvalidArgument("words must be 1-D, got shape ",
                                        words.shape().DebugString()));
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(num_elements, "num_elements", &n));
    OP_REQUIRES(ctx, n >= 0,
                errors::InvalidArgument("num_elements must be >= 0, got ", n));
    const int64_t nb = NumBuckets(n, params_.bucket_size);
    OP_REQUIRES(ctx, scales.dim_size(0) == nb,
                errors::InvalidArgument("scales has ", scales.dim_size(0),
                                        " entries but ", n,
                                        " elements in buckets of ",
                                        params_.bucket_size, " need ", nb));
    const int64_t nw = NumCodeWords(n, params_.bits);
    OP_REQUIRES(ctx, words.dim_size(0) == nw,
                errors::InvalidArgument("words has ", words.dim_size(0),
                                        " entries but ", nw, " are needed for ",
                                        n, " ", params_.bits, "-bit codes"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    OP_REQUIRES_OK(ctx, functor::DequantizeBucketedFunctor<Device, T>()(
                            ctx, scales.flat<float>().data(),
                            words.flat<int32_t>().data(), n, params_,
                            out->flat<T>().data()));
  }

 private:
  QuantizeParams params_;
};

template <typename Device>
class DequantizeBucketedSumOp : public OpKernel {
 public:
  explicit DequantizeBucketedSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadQuantizeAttrs(ctx, &params_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& scales = ctx->input(0);
    const Tensor& words = ctx->input(1);
    const Tensor& num_elements = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(scales.shape()),
                errors::InvalidArgument("scales must be 2-D [workers, buckets], "
                                        "got shape ",
                                        scales.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(words.shape()),
                errors::InvalidArgument("words must be 2-D [workers, words], "
                                        "got shape ",
                                        words.shape().DebugString()));
    OP_REQUIRES(ctx, scales.dim_size(0) == words.dim_size(0),
                errors::InvalidArgument(
                    "scales and words must have the same number of workers, "
                    "got ",
                    scales.dim_size(0), " and ", words.dim_size(0)));
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(num_elements, "num_elements", &n));
    OP_REQUIRES(ctx, n >= 0,
                errors::InvalidArgument("num_elements must be >= 0, got ", n));
    const int64_t nb = NumBuckets(n, params_.bucket_size);
    OP_REQUIRES(ctx, scales.dim_size(1) == nb,
                errors::InvalidArgument("scales has ", scales.dim_size(1),
                                        " buckets per worker but ", n,
                                        " elements in buckets of ",
                                        params_.bucket_size, " need ", nb));
    const int64_t nw = NumCodeWords(n, params_.bits);
    OP_REQUIRES(ctx, words.dim_size(1) == nw,
                errors::InvalidArgument("words has ", words.dim_size(1),
                                        " words per worker but ", nw,
                                        " are needed for ", n, " ",
                                        params_.bits, "-bit codes"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    float* o = out->flat<float>().data();
    const int64_t workers = scales.dim_size(0);
    if (workers == 0) {
      std::fill(o, o + n, 0.0f);
      return;
    }
    OP_REQUIRES_OK(ctx, functor::DequantizeBucketedSumFunctor<Device>()(
                            ctx, scales.flat<float>().data(),
                            words.flat<int32_t>().data(), workers, n, params_,
                            o));
  }

 private:
  QuantizeParams params_;
};

REGISTER_KERNEL_BUILDER(Name("TfgcDequantizeBucketedSum").Device(DEVICE_CPU),
                        DequantizeBucketedSumOp<CPUDevice>);

#define TFGC_REGISTER_QUANTIZE_CPU(T)                                        \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("TfgcQuantizeBucketed").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      QuantizeBucketedOp<CPUDevice, T>);                                     \
  REGISTER_KERNEL_BUILDER(Name("TfgcDequantizeBucketed")                     \
                              .Device(DEVICE_CPU)                            \
                              .TypeConstraint<T>("T"),                       \
                          DequantizeBucketedOp<CPUDevice, T>);

TFGC_REGISTER_QUANTIZE_CPU(float);
TFGC_REGISTER_QUANTIZE_CPU(Eigen::half);
TFGC_REGISTER_QUANTIZE_CPU(Eigen::bfloat16);

#undef TFGC_REGISTER_QUANTIZE_CPU

#if GOOGLE_CUDA
// GPU kernels (quantize_gpu.cu.cc), only in a CUDA-enabled TensorFlow build.
// The seed and num_elements are read on the host while validating (the seed
// is scrambled into the Philox key there, with TensorFlow's PhiloxRandom),
// so they stay in host memory.
using GPUDevice = Eigen::GpuDevice;

REGISTER_KERNEL_BUILDER(Name("TfgcDequantizeBucketedSum")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("num_elements"),
                        DequantizeBucketedSumOp<GPUDevice>);

#define TFGC_REGISTER_QUANTIZE_GPU(T)                                   \
  REGISTER_KERNEL_BUILDER(Name("TfgcQuantizeBucketed")                  \
                              .Device(tensorflow::DEVICE_GPU)           \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("seed"),                      \
                          QuantizeBucketedOp<GPUDevice, T>);            \
  REGISTER_KERNEL_BUILDER(Name("TfgcDequantizeBucketed")                \
                              .Device(tensorflow::DEVICE_GPU)           \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("num_elements"),              \
                          DequantizeBucketedOp<GPUDevice, T>);

TFGC_REGISTER_QUANTIZE_GPU(float);
TFGC_REGISTER_QUANTIZE_GPU(Eigen::half);
TFGC_REGISTER_QUANTIZE_GPU(Eigen::bfloat16);

#undef TFGC_REGISTER_QUANTIZE_GPU
#endif  // GOOGLE_CUDA

}  // namespace tfgc
