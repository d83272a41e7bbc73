// CPU kernels for the sparsification op family. See sparsify.h for the
// ranking rule and sparsify_ops.cc for the op schemas.
//
// Performance notes. On large gradients everything is memory-bound, and the
// selected fraction is small (0.1% - 1% in top-k / DGC), so the kernels are
// built around a single "collect" pass over x and residual that
//   * computes v = x + residual and writes it to new_residual,
//   * tests every v against a threshold in the same branch-free,
//     vectorisable loop, recording one flag byte per element, and
//   * only for the rare groups of flags that are set, goes back to the
//     elements (still in L1) to append (index, v) to the shard's candidate
//     list and zero new_residual there;
//   * on large tensors, writes new_residual with streaming stores, which
//     skip the read-for-ownership of every output line.
// The threshold comes from a small sample of v taken before that pass (Lin
// et al. 2018, "Deep Gradient Compression"), so the common case reads x and
// residual once and writes new_residual once. The rare corrections (too many
// candidates: exact top-k among the candidates, which are few; too few: lower
// the threshold and collect again from new_residual) only cost extra passes
// when the sample was misleading. Exact mode is the same machinery with a
// conservative sample rank, so that the candidates almost surely contain the
// true top k, followed by an exact selection among them. Both the sample's
// quantile and that selection are radix selects on the integer keys. When
// the sample shows massive ties at the threshold (e.g. mostly-zero embedding
// gradients), only the entries strictly above it are collected and the ties
// are taken in index order by a scan that stops as soon as it has enough.
//
// Worst cases: a sample that misleads badly costs up to 10 extra read passes
// (sampled mode's 0.8x lowerings) and then a pass collecting every entry for
// an exact selection; all remain correct, just slower.
//
// Magnitudes are compared as integer keys derived from the raw bits (see
// KeyOf), which orders |v| exactly for every supported type, puts NaN last
// and keeps the hot loop free of float compares (GCC does not if-convert
// those, because they may trap, and would then not vectorise).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "custom_ops/cc/kernels/cpu_util.h"
#include "custom_ops/cc/kernels/sign_bits.h"
#include "custom_ops/cc/kernels/sparsify.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tsl/platform/threadpool.h"

#if defined(__GNUC__) || defined(__clang__)
#define TFGC_SPARSIFY_ALWAYS_INLINE __attribute__((always_inline))
#else
#define TFGC_SPARSIFY_ALWAYS_INLINE
#endif

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define TFGC_SPARSIFY_X86_DISPATCH 1
#else
#define TFGC_SPARSIFY_X86_DISPATCH 0
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
using cpu::ScalarValue;
using cpu::FloatCodec;
using cpu::FloatToBits;
using cpu::ParallelFor;
using cpu::Select;
using cpu::Workers;

// Elements per chunk of the collect pass: its flag bytes stay in L1.
constexpr int64_t kChunk = 2048;
// Shards smaller than this are not worth a task of their own.
constexpr int64_t kMinShardElems = int64_t{1} << 16;
// Sample size floor: below it the sampled quantile is too noisy to be useful.
constexpr int64_t kMinSample = 256;
// DGC's acceptance window around k, and how the threshold is lowered when too
// few entries pass it.
constexpr double kMinFraction = 0.8;
constexpr double kMaxFraction = 1.3;
constexpr float kSampledLowerFactor = 0.8f;
constexpr int kSampledMaxLowerings = 10;
constexpr float kExactLowerFactor = 0.5f;
constexpr int kExactMaxLowerings = 4;

// Raw bit patterns and their aliasing-safe pointer types (sign_bits.h).
template <typename T>
using RawTraits = SignBitsTraits<T>;

template <typename T>
using RawOf = typename RawTraits<T>::Raw;
template <typename T>
using AliasedRawOf = typename RawTraits<T>::AliasedRaw;

// x + residual exactly as TensorFlow's Add computes it: float32 addition,
// rounded once to T for the half types.
template <typename T>
inline RawOf<T> AddRaw(RawOf<T> a, RawOf<T> b) {
  using Codec = FloatCodec<T>;
  return static_cast<RawOf<T>>(Codec::FromF32Bits(FloatToBits(
      BitsToFloat(Codec::ToF32Bits(a)) + BitsToFloat(Codec::ToF32Bits(b)))));
}

// Ranking key: |v|'s bit pattern plus one, and 0 for NaN. For non-NaN values
// the unsigned order of the magnitude bits is the order of |v| (Inf on top),
// so keys compare exactly like |v| while NaN sorts below +-0.0.
template <typename T>
inline uint32_t KeyOf(RawOf<T> r) {
  const uint32_t a = r & (RawTraits<T>::kSignMask - 1u);
  return (a + 1u) & (0u - static_cast<uint32_t>(a <= RawTraits<T>::kPosInf));
}

// |value| whose key is `key` (key >= 1), as a float.
template <typename T>
inline float KeyMagnitude(uint32_t key) {
  return BitsToFloat(
      FloatCodec<T>::ToF32Bits(static_cast<RawOf<T>>(key - 1u)));
}

template <typename T>
struct KeyAtLeast {
  uint32_t threshold;
  inline uint32_t operator()(RawOf<T> v) const {
    return static_cast<uint32_t>(KeyOf<T>(v) >= threshold);
  }
};

// Order-preserving map of a float32 bit pattern to int32 (-0.0 and +0.0 both
// map to 0), valid for non-NaN values.
inline int32_t OrderedInt(uint32_t f) {
  const int32_t mag = static_cast<int32_t>(f & 0x7fffffffu);
  return (f >> 31) ? -mag : mag;
}

// v >= pos || v <= neg, on integers (see OrderedInt); NaN never passes.
template <typename T>
struct OutsideBand {
  int32_t pos, neg;
  inline uint32_t operator()(RawOf<T> v) const {
    const uint32_t f = FloatCodec<T>::ToF32Bits(v);
    const int32_t o = OrderedInt(f);
    const uint32_t not_nan = (f & 0x7fffffffu) <= 0x7f800000u;
    return not_nan & static_cast<uint32_t>((o >= pos) | (o <= neg));
  }
};

// A contiguous range of the flat input and the entries selected in it, in
// ascending index order.
template <typename T>
struct Shard {
  int64_t begin = 0;
  int64_t end = 0;
  // Whether the collect pass streams v past the cache (see CollectShardBody).
  bool stream_out = false;
  std::vector<int32_t> idx;
  std::vector<RawOf<T>> val;
};

template <typename T>
std::vector<Shard<T>> MakeShards(OpKernelContext* ctx, int64_t n) {
  // Many more shards than threads: on a shared (virtualised) host a core can
  // stall for a millisecond or more, and small shards let the other threads
  // take over its share instead of waiting for one long task.
  const int64_t threads = std::max(Workers(ctx)->NumThreads(), 1);
  const int64_t count =
      std::max<int64_t>(1, std::min(n / kMinShardElems, 16 * threads));
  std::vector<Shard<T>> shards(count);
  // Boundaries on multiples of 64 elements keep every chunk of the collect
  // pass cache-line aligned (tensor buffers are 64-byte aligned).
  auto boundary = [&](int64_t s) {
    return s == count ? n : (n * s / count) & ~int64_t{63};
  };
  const bool stream_out =
      n * static_cast<int64_t>(sizeof(RawOf<T>)) >= cpu::kStreamMinBytes;
  for (int64_t s = 0; s < count; ++s) {
    shards[s].begin = boundary(s);
    shards[s].end = boundary(s + 1);
    shards[s].stream_out = stream_out;
  }
  return shards;
}

// Runs fn(s) for s in [0, count), one task each, on the intra-op pool.
inline void ForEachShardIndex(OpKernelContext* ctx, int64_t count,
                              const std::function<void(int64_t)>& fn) {
  if (count == 1) {
    fn(0);
    return;
  }
  Workers(ctx)->ParallelFor(count, ThreadPool::SchedulingParams::Fixed(1),
                            [&](int64_t b, int64_t e) {
                              for (int64_t s = b; s < e; ++s) fn(s);
                            });
}

// Runs fn(shard) for every shard, one task per shard.
template <typename T>
void ForEachShard(OpKernelContext* ctx, std::vector<Shard<T>>& shards,
                  const std::function<void(Shard<T>&)>& fn) {
  ForEachShardIndex(ctx, static_cast<int64_t>(shards.size()),
                    [&](int64_t s) { fn(shards[s]); });
}

template <typename T>
int64_t TotalSelected(const std::vector<Shard<T>>& shards) {
  int64_t total = 0;
  for (const auto& s : shards) total += static_cast<int64_t>(s.idx.size());
  return total;
}

// Where each shard's selection starts in the concatenation of all of them;
// the last entry is the total.
template <typename T>
std::vector<int64_t> ShardOffsets(const std::vector<Shard<T>>& shards) {
  std::vector<int64_t> offsets(shards.size() + 1, 0);
  for (size_t s = 0; s < shards.size(); ++s) {
    offsets[s + 1] = offsets[s] + static_cast<int64_t>(shards[s].idx.size());
  }
  return offsets;
}

// The collect pass over one shard (see the file comment). With kFromInputs,
// v = x + residual is computed and stored to v_out; otherwise v_out already
// holds v and is only modified where entries are selected. Selected entries
// are appended to the shard and zeroed in v_out.
//
// Work goes chunk by chunk: a plain loop (which GCC vectorises) computes v
// and one flag byte per element, then the flags are scanned eight at a time
// and only the set ones are looked at individually. With
// kFromInputs the chunk of v is built in an L1 buffer, fixed up there, and
// then copied to v_out, for large tensors with streaming stores
// (StreamCopy): new_residual is then written once and never read for
// ownership, which is a quarter of this pass's traffic.
template <typename T, bool kFromInputs, typename Pred>
TFGC_SPARSIFY_ALWAYS_INLINE inline void CollectShardBody(
    const AliasedRawOf<T>* __restrict__ x,
                  const AliasedRawOf<T>* __restrict__ r,
                  AliasedRawOf<T>* __restrict__ v_out, const Pred& pred,
                  Shard<T>& shard) {
  using Raw = RawOf<T>;
  alignas(64) uint8_t flags[kChunk + 8];
  alignas(64) Raw vbuf[kFromInputs ? kChunk : 1];
  for (int64_t c = shard.begin; c < shard.end; c += kChunk) {
    const int64_t len = std::min(kChunk, shard.end - c);
    AliasedRawOf<T>* __restrict__ vp = kFromInputs ? vbuf : v_out + c;
    uint32_t count = 0;
    if (kFromInputs) {
      const AliasedRawOf<T>* __restrict__ xp = x + c;
      const AliasedRawOf<T>* __restrict__ rp = r + c;
      for (int64_t j = 0; j < len; ++j) {
        const Raw v = AddRaw<T>(xp[j], rp[j]);
        const uint32_t flag = pred(v);
        vp[j] = v;
        flags[j] = static_cast<uint8_t>(flag);
        count += flag;
      }
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const uint32_t flag = pred(vp[j]);
        flags[j] = static_cast<uint8_t>(flag);
        count += flag;
      }
    }
    if (count != 0) {
      // Grow the lists once per chunk, then append through raw pointers:
      // no capacity test per entry. Flags are 0 or 1, so in a group of
      // eight the set ones are bits 8t; walking them with ctz costs one
      // step per selected entry and no data-dependent branch per flag.
      std::memset(flags + len, 0, 8);
      const size_t base = shard.idx.size();
      shard.idx.resize(base + count);
      shard.val.resize(base + count);
      int32_t* ip = shard.idx.data() + base;
      Raw* vq = shard.val.data() + base;
      for (int64_t j = 0; j < len; j += 8) {
        uint64_t group;
        std::memcpy(&group, flags + j, 8);
        while (group != 0) {
          const int64_t t = j + (__builtin_ctzll(group) >> 3);
          group &= group - 1;
          *ip++ = static_cast<int32_t>(c + t);
          *vq++ = vp[t];
          vp[t] = 0;
        }
      }
    }
    if (kFromInputs) {
      if (shard.stream_out) {
        cpu::StreamCopy(v_out + c, vbuf, len * sizeof(Raw));
      } else {
        std::memcpy(v_out + c, vbuf, len * sizeof(Raw));
      }
    }
  }
  if (kFromInputs && shard.stream_out) cpu::StreamFence();
}

// The same pass compiled twice: for the baseline ISA, and on x86-64 also for
// AVX2, picked at run time. The library must load on any host the wheel runs
// on (so no -march flag), but the half-precision conversions in the hot loop
// are integer-heavy and run about twice as fast on 256-bit vectors.
template <typename T, bool kFromInputs, typename Pred>
void CollectShardBaseline(const AliasedRawOf<T>* x, const AliasedRawOf<T>* r,
                          AliasedRawOf<T>* v_out, const Pred& pred,
                          Shard<T>& shard) {
  CollectShardBody<T, kFromInputs>(x, r, v_out, pred, shard);
}

#if TFGC_SPARSIFY_X86_DISPATCH
template <typename T, bool kFromInputs, typename Pred>
__attribute__((target("avx2"))) void CollectShardAvx2(
    const AliasedRawOf<T>* x, const AliasedRawOf<T>* r,
    AliasedRawOf<T>* v_out, const Pred& pred, Shard<T>& shard) {
  CollectShardBody<T, kFromInputs>(x, r, v_out, pred, shard);
}

#endif

template <typename T, bool kFromInputs, typename Pred>
void CollectShard(const AliasedRawOf<T>* x, const AliasedRawOf<T>* r,
                  AliasedRawOf<T>* v_out, const Pred& pred, Shard<T>& shard) {
#if TFGC_SPARSIFY_X86_DISPATCH
  if (HasAvx2()) {
    CollectShardAvx2<T, kFromInputs>(x, r, v_out, pred, shard);
    return;
  }
#endif
  CollectShardBaseline<T, kFromInputs>(x, r, v_out, pred, shard);
}

// Puts every collected entry back into v (so that v_out == x + residual
// again) and forgets the selection.
template <typename T>
void RestoreAll(OpKernelContext* ctx, std::vector<Shard<T>>& shards,
                AliasedRawOf<T>* v_out) {
  ForEachShard<T>(ctx, shards, [&](Shard<T>& s) {
    for (size_t j = 0; j < s.idx.size(); ++j) v_out[s.idx[j]] = s.val[j];
    s.idx.clear();
    s.val.clear();
  });
}

// The q-th largest of keys (1 <= q <= keys.size()): a radix select in two
// 16-bit digits, i.e. two counting passes over the keys and two walks over a
// 65536-bin histogram. Unlike nth_element it neither moves nor copies the
// keys, and its cost does not grow with q: about 1 ns per key where a heap
// or a partitioning pass took 4-10. Small sets are partitioned instead.
uint32_t KthLargest(const std::vector<uint32_t>& keys, int64_t q) {
  constexpr uint32_t kBins = 1u << 16;
  if (keys.size() < kBins) {
    // Fewer keys than bins: clearing and walking the histograms would cost
    // more than partitioning a copy.
    std::vector<uint32_t> copy(keys);
    auto nth = copy.begin() + (copy.size() - q);
    std::nth_element(copy.begin(), nth, copy.end());
    return *nth;
  }
  std::vector<uint32_t> hist(kBins, 0);
  for (const uint32_t key : keys) ++hist[key >> 16];
  // Walk down from the largest digit until the bins above hold q keys.
  auto walk = [&](int64_t& rank) {
    uint32_t d = kBins - 1;
    for (; d > 0 && hist[d] < rank; --d) rank -= hist[d];
    return d;
  };
  int64_t rank = q;
  const uint32_t high = walk(rank);
  std::fill(hist.begin(), hist.end(), 0u);
  for (const uint32_t key : keys) {
    if ((key >> 16) == high) ++hist[key & (kBins - 1)];
  }
  const uint32_t low = walk(rank);
  return (high << 16) | low;
}

// Keeps exactly k of the `total` (> k) collected entries: the largest keys,
// ties going to the lower index. The others are restored into v_out. Every
// step but the radix select runs one task per shard: restoring the dropped
// entries writes to lines of v_out that are no longer cached, so it pays to
// have both cores' misses in flight. Ties are handed out by shard in index
// order, which gives them to the lowest indices as the ranking requires.
template <typename T>
void KeepTopK(OpKernelContext* ctx, std::vector<Shard<T>>& shards, int64_t k,
              AliasedRawOf<T>* v_out) {
  const int64_t count = static_cast<int64_t>(shards.size());
  const std::vector<int64_t> offset = ShardOffsets(shards);
  std::vector<uint32_t> keys(offset.back());
  ForEachShardIndex(ctx, count, [&](int64_t s) {
    uint32_t* out = keys.data() + offset[s];
    for (const auto v : shards[s].val) *out++ = KeyOf<T>(v);
  });
  const uint32_t kth = KthLargest(keys, k);
  std::vector<int64_t> greater(count, 0), equal(count, 0);
  ForEachShardIndex(ctx, count, [&](int64_t s) {
    int64_t g = 0, e = 0;
    for (int64_t j = offset[s]; j < offset[s + 1]; ++j) {
      g += keys[j] > kth;
      e += keys[j] == kth;
    }
    greater[s] = g;
    equal[s] = e;
  });
  int64_t ties = k;
  for (int64_t s = 0; s < count; ++s) ties -= greater[s];
  std::vector<int64_t> quota(count, 0);
  for (int64_t s = 0; s < count; ++s) {
    quota[s] = std::min(equal[s], ties);
    ties -= quota[s];
  }
  ForEachShardIndex(ctx, count, [&](int64_t s) {
    Shard<T>& sh = shards[s];
    const uint32_t* key = keys.data() + offset[s];
    int64_t quota_left = quota[s];
    size_t out = 0;
    constexpr size_t kAhead = 16;
    for (size_t j = 0; j < sh.idx.size(); ++j) {
      // Dropped entries go back to lines of v_out that left the cache long
      // ago; prefetching them keeps many of those misses in flight.
      if (j + kAhead < sh.idx.size() && key[j + kAhead] <= kth) {
        __builtin_prefetch(v_out + sh.idx[j + kAhead], 1);
      }
      bool keep = key[j] > kth;
      if (!keep && key[j] == kth && quota_left > 0) {
        keep = true;
        --quota_left;
      }
      if (keep) {
        sh.idx[out] = sh.idx[j];
        sh.val[out] = sh.val[j];
        ++out;
      } else {
        v_out[sh.idx[j]] = sh.val[j];
      }
    }
    sh.idx.resize(out);
    sh.val.resize(out);
  });
}

// Allocates values / indices / mask and fills them from the shards.
template <typename T>
absl::Status WriteSelection(OpKernelContext* ctx, std::vector<Shard<T>>& shards,
                            int64_t n, bool with_mask) {
  const std::vector<int64_t> offsets = ShardOffsets(shards);
  const int64_t total = offsets.back();
  Tensor *values = nullptr, *indices = nullptr, *mask = nullptr;
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(kSparsifyValues, TensorShape({total}), &values));
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(kSparsifyIndices, TensorShape({total}), &indices));
  TF_RETURN_IF_ERROR(ctx->allocate_output(
      kSparsifyMask, TensorShape({with_mask ? n : 0}), &mask));
  auto* const vp = reinterpret_cast<AliasedRawOf<T>*>(values->flat<T>().data());
  int32_t* const ip = indices->flat<int32_t>().data();
  bool* const mp = with_mask ? mask->flat<bool>().data() : nullptr;
  if (with_mask) {
    ParallelFor(ctx, n, 1, [&](int64_t b, int64_t e) {
      std::memset(mp + b, 0, e - b);
    });
  }
  ForEachShardIndex(ctx, static_cast<int64_t>(shards.size()), [&](int64_t s) {
    const Shard<T>& sh = shards[s];
    const size_t cnt = sh.idx.size();
    if (cnt == 0) return;
    std::memcpy(ip + offsets[s], sh.idx.data(), cnt * sizeof(int32_t));
    std::memcpy(vp + offsets[s], sh.val.data(), cnt * sizeof(RawOf<T>));
    if (mp != nullptr) {
      for (const int32_t i : sh.idx) mp[i] = true;
    }
  });
  return absl::OkStatus();
}

// 64-bit mixer (splitmix64's finaliser): cheap, and every output bit depends
// on every input bit, which is all the sampling needs.
inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Keys of v at a jittered-stratified sample of about s positions (at least
// s): [0, n) is cut into equal strata and each contributes one run of
// kSampleRun consecutive elements at a random offset. Stratification keeps
// the sample spread over the whole tensor (the layers of a flattened gradient
// often differ in scale); the random offset avoids aliasing with row lengths,
// which a fixed stride would hit; and runs of one (aligned) cache line cost
// one memory access instead of sixteen, which matters because a 1% sample of
// scattered single elements would touch a sixth of every cache line of x and
// residual. When the sample would cover most of v anyway, v is read whole.
constexpr int64_t kSampleRun = 16;

template <typename T>
std::vector<uint32_t> SampleKeys(OpKernelContext* ctx,
                                 const AliasedRawOf<T>* x,
                                 const AliasedRawOf<T>* r, int64_t n,
                                 int64_t s, uint64_t seed) {
  if (s * 4 >= n) {
    std::vector<uint32_t> keys(n);
    ParallelFor(ctx, n, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) keys[i] = KeyOf<T>(AddRaw<T>(x[i], r[i]));
    });
    return keys;
  }
  // Here n > 4 s and s >= kMinSample = 256, so with runs = ceil(s / 16)
  // every stratum holds at least 60 elements.
  const int64_t runs = (s + kSampleRun - 1) / kSampleRun;
  std::vector<uint32_t> keys(runs * kSampleRun);
  const uint64_t salt = Mix64(seed);
  // Runs start on multiples of kSampleRun, so each lies in one cache line of
  // x and one of r (buffers are 64-byte aligned). Stratum j is [lo, hi) with
  // hi - lo >= 60, which leaves at least two aligned starts inside it.
  auto run_start = [&](int64_t j) {
    const int64_t lo = j * n / runs;
    const int64_t hi = (j + 1) * n / runs;
    const int64_t first = (lo + kSampleRun - 1) / kSampleRun * kSampleRun;
    const int64_t slots = (hi - kSampleRun - first) / kSampleRun + 1;
    return first +
           kSampleRun * static_cast<int64_t>(
                            Mix64(salt ^ static_cast<uint64_t>(j)) %
                            static_cast<uint64_t>(slots));
  };
  // Every run is a cache miss in x and in r; prefetching a few runs ahead
  // keeps several of them in flight instead of waiting for each in turn.
  constexpr int64_t kAhead = 8;
  ParallelFor(ctx, runs, 300, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      if (j + kAhead < e) {
        const int64_t p = run_start(j + kAhead);
        __builtin_prefetch(x + p);
        __builtin_prefetch(r + p);
      }
      const int64_t start = run_start(j);
      for (int64_t t = 0; t < kSampleRun; ++t) {
        keys[j * kSampleRun + t] =
            KeyOf<T>(AddRaw<T>(x[start + t], r[start + t]));
      }
    }
  });
  return keys;
}

// Adds up to `need` entries whose key is exactly `key`, lowest indices first,
// to the shards (zeroing them in v_out); returns how many were found. The
// entries already collected are skipped by walking each shard's sorted index
// list alongside (a zeroed entry would otherwise look like a +0.0 tie). The
// scan is sequential and stops as soon as enough ties are found, which for
// massive ties (all-zero gradients, e.g. embeddings) means after ~need
// elements.
template <typename T>
int64_t CollectTies(std::vector<Shard<T>>& shards, AliasedRawOf<T>* v_out,
                    uint32_t key, int64_t need) {
  int64_t found = 0;
  std::vector<int32_t> tie_idx;
  std::vector<RawOf<T>> tie_val;
  for (auto& sh : shards) {
    if (found == need) break;
    tie_idx.clear();
    tie_val.clear();
    size_t p = 0;
    for (int64_t i = sh.begin; i < sh.end && found < need; ++i) {
      if (p < sh.idx.size() && sh.idx[p] == i) {
        ++p;
        continue;
      }
      if (KeyOf<T>(v_out[i]) == key) {
        tie_idx.push_back(static_cast<int32_t>(i));
        tie_val.push_back(v_out[i]);
        v_out[i] = 0;
        ++found;
      }
    }
    if (tie_idx.empty()) continue;
    // Merge the two ascending lists.
    std::vector<int32_t> idx(sh.idx.size() + tie_idx.size());
    std::vector<RawOf<T>> val(idx.size());
    size_t a = 0, b = 0;
    for (size_t o = 0; o < idx.size(); ++o) {
      if (b == tie_idx.size() || (a < sh.idx.size() && sh.idx[a] < tie_idx[b])) {
        idx[o] = sh.idx[a];
        val[o] = sh.val[a++];
      } else {
        idx[o] = tie_idx[b];
        val[o] = tie_val[b++];
      }
    }
    sh.idx.swap(idx);
    sh.val.swap(val);
  }
  return found;
}

// A key below `key`: |threshold| scaled by factor, or 0 (select everything)
// once the magnitude reaches zero.
template <typename T>
uint32_t LowerKey(uint32_t key, float factor) {
  if (key <= 1) return 0;
  const float mag = KeyMagnitude<T>(key) * factor;
  const uint32_t lowered =
      KeyOf<T>(static_cast<RawOf<T>>(FloatCodec<T>::FromF32Bits(FloatToBits(mag))));
  return std::min(lowered, key - 1);
}

}  // namespace

namespace functor {

template <typename T>
struct SparsifyTopKFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* x_in,
                          const T* residual_in, int64_t n,
                          const SparsifyTopKOptions& opt, T* new_residual) {
    const auto* x = reinterpret_cast<const AliasedRawOf<T>*>(x_in);
    const auto* r = reinterpret_cast<const AliasedRawOf<T>*>(residual_in);
    auto* v_out = reinterpret_cast<AliasedRawOf<T>*>(new_residual);
    std::vector<Shard<T>> shards = MakeShards<T>(ctx, n);
    const int64_t k = std::min(opt.k, n);

    // expected: rough number of entries the threshold lets through; each
    // shard reserves its share (plus slack) so that the candidate lists do
    // not keep reallocating inside the pass.
    auto reserve = [&](Shard<T>& s, int64_t expected) {
      const int64_t share = static_cast<int64_t>(
          1.25 * static_cast<double>(expected) * (s.end - s.begin) / n);
      const int64_t want = std::min(s.end - s.begin, share + 64);
      s.idx.reserve(want);
      s.val.reserve(want);
    };
    auto collect_from_inputs = [&](uint32_t thr, int64_t expected) {
      const KeyAtLeast<T> pred{thr};
      ForEachShard<T>(ctx, shards, [&](Shard<T>& s) {
        reserve(s, expected);
        CollectShard<T, true>(x, r, v_out, pred, s);
      });
    };
    auto collect_again = [&](uint32_t thr) {
      const KeyAtLeast<T> pred{thr};
      ForEachShard<T>(ctx, shards, [&](Shard<T>& s) {
        CollectShard<T, false>(nullptr, nullptr, v_out, pred, s);
      });
    };

    if (k == 0) {
      // No key reaches UINT32_MAX: this only computes new_residual = v.
      collect_from_inputs(~uint32_t{0}, 0);
      return WriteSelection(ctx, shards, n, opt.with_mask);
    }
    if (k == n) {
      collect_from_inputs(0, n);  // every key is >= 0
      return WriteSelection(ctx, shards, n, opt.with_mask);
    }

    // Acceptance window for the number of collected entries.
    int64_t lo = k, hi = k;
    if (!opt.exact) {
      lo = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(kMinFraction * k)));
      hi = std::max<int64_t>(k, static_cast<int64_t>(std::floor(kMaxFraction * k)));
    }

    // Threshold from the sample: the q-th largest sampled key, where q is
    // the sample's share of k. Exact mode aims above that share (a few
    // standard deviations of the binomial count) so that the candidates
    // contain the top k with high probability; a miss only costs a pass.
    int64_t s = std::min<int64_t>(
        n, std::max<int64_t>(
               static_cast<int64_t>(std::ceil(double{opt.sample_ratio} * n)),
               std::min<int64_t>(n, kMinSample)));
    std::vector<uint32_t> sample = SampleKeys<T>(ctx, x, r, n, s, opt.seed);
    s = static_cast<int64_t>(sample.size());
    const double expected = static_cast<double>(k) * s / n;
    int64_t q;
    if (s == n) {
      q = k;  // the sample is all of v: its k-th largest is exact
    } else if (opt.exact) {
      q = static_cast<int64_t>(
          std::ceil(1.25 * expected + 3.0 * std::sqrt(expected) + 8.0));
    } else {
      q = std::max<int64_t>(1, std::llround(expected));
    }
    uint32_t thr = q <= s ? KthLargest(sample, q) : 0;
    const int64_t expected_pass =
        q <= s ? static_cast<int64_t>(static_cast<double>(q) * n / s) : n;

    // Many sampled keys equal to the threshold announce massive ties (many
    // exact zeros, quantised values): `>= thr` would collect far too many
    // entries and then sort them out. Instead collect `> thr` and take the
    // missing entries among the ties in index order, which is also what the
    // ranking prescribes.
    int64_t sample_ties = 0;
    if (q <= s) {
      for (const uint32_t key : sample) sample_ties += (key == thr);
    }
    int64_t total = 0;
    if (sample_ties > std::max<int64_t>(2, q / 4)) {
      collect_from_inputs(thr + 1, expected_pass);
      total = TotalSelected(shards);
      if (total < lo) total += CollectTies<T>(shards, v_out, thr, k - total);
      // If that still falls short, the loop below lowers from thr itself.
    } else {
      collect_from_inputs(thr, expected_pass);
      total = TotalSelected(shards);
    }
    const int max_lowerings =
        opt.exact ? kExactMaxLowerings : kSampledMaxLowerings;
    const float factor = opt.exact ? kExactLowerFactor : kSampledLowerFactor;
    for (int tries = 0; total < lo; ++tries) {
      // Lower the threshold and collect from scratch. After the allowed
      // number of lowerings thr = 0 takes every entry, and the exact
      // selection below then yields exactly k (the fallback to exact mode).
      RestoreAll<T>(ctx, shards, v_out);
      thr = tries < max_lowerings ? LowerKey<T>(thr, factor) : 0;
      collect_again(thr);
      total = TotalSelected(shards);
    }
    if (total > hi) KeepTopK<T>(ctx, shards, k, v_out);
    return WriteSelection(ctx, shards, n, opt.with_mask);
  }
};

template <typename T>
struct SparsifyByThresholdFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* x_in,
                          const T* residual_in, int64_t n, float pos_threshold,
                          float neg_threshold, bool with_mask,
                          T* new_residual) {
    const auto* x = reinterpret_cast<const AliasedRawOf<T>*>(x_in);
    const auto* r = reinterpret_cast<const AliasedRawOf<T>*>(residual_in);
    auto* v_out = reinterpret_cast<AliasedRawOf<T>*>(new_residual);
    std::vector<Shard<T>> shards = MakeShards<T>(ctx, n);
    const OutsideBand<T> pred{OrderedInt(FloatToBits(pos_threshold)),
                              OrderedInt(FloatToBits(neg_threshold))};
    ForEachShard<T>(ctx, shards, [&](Shard<T>& s) {
      CollectShard<T, true>(x, r, v_out, pred, s);
    });
    return WriteSelection(ctx, shards, n, with_mask);
  }
};

template <typename T>
struct ScatterAddPayloadsFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* values,
                          const int32_t* indices, int64_t m, int64_t n,
                          T* out) {
    // One thread, in payload order: the sums are then reproducible bit for
    // bit whatever the pool size, and m is small next to n in practice (the
    // zero fill, which is parallel, dominates).
    auto bad_index = [&](int64_t j) {
      return errors::InvalidArgument("indices[", j, "] = ", indices[j],
                                     " is not in [0, ", n, ")");
    };
    if (std::is_same<T, float>::value) {
      float* const o = reinterpret_cast<float*>(out);
      ParallelFor(ctx, n, 1, [&](int64_t b, int64_t e) {
        std::fill(o + b, o + e, 0.0f);
      });
      const float* const v = reinterpret_cast<const float*>(values);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = indices[j];
        if (i < 0 || i >= n) return bad_index(j);
        o[i] += v[j];
      }
      return absl::OkStatus();
    }
    // Half types: accumulate in float32, round once at the end.
    Tensor acc_t;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(tensorflow::DT_FLOAT, TensorShape({n}), &acc_t));
    float* const acc = acc_t.flat<float>().data();
    ParallelFor(ctx, n, 1, [&](int64_t b, int64_t e) {
      std::fill(acc + b, acc + e, 0.0f);
    });
    const auto* v = reinterpret_cast<const AliasedRawOf<T>*>(values);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = indices[j];
      if (i < 0 || i >= n) return bad_index(j);
      acc[i] += BitsToFloat(FloatCodec<T>::ToF32Bits(v[j]));
    }
    auto* o = reinterpret_cast<AliasedRawOf<T>*>(out);
    ParallelFor(ctx, n, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        o[i] = static_cast<RawOf<T>>(
            FloatCodec<T>::FromF32Bits(FloatToBits(acc[i])));
      }
    });
    return absl::OkStatus();
  }
};

}  // namespace functor

// ---------------------------------------------------------------------------
// OpKernels: validate, allocate, dispatch.

namespace {

// Shared input checks of the two selection ops; sets *n on success.
absl::Status ValidateSelectionInputs(const Tensor& x, const Tensor& residual,
                                     int64_t* n) {
  if (x.shape() != residual.shape()) {
    return errors::InvalidArgument(
        "x and residual must have the same shape, got ", x.shape().DebugString(),
        " and ", residual.shape().DebugString());
  }
  *n = x.NumElements();
  if (*n > kMaxSparsifyElements) {
    return errors::InvalidArgument("x has ", *n,
                                   " elements; int32 indices address at most ",
                                   kMaxSparsifyElements);
  }
  return absl::OkStatus();
}

absl::Status EmptySelection(OpKernelContext* ctx) {
  Tensor* unused = nullptr;
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(kSparsifyValues, TensorShape({0}), &unused));
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(kSparsifyIndices, TensorShape({0}), &unused));
  return ctx->allocate_output(kSparsifyMask, TensorShape({0}), &unused);
}

}  // namespace

template <typename Device, typename T>
class SparsifyWithResidualOp : public OpKernel {
 public:
  explicit SparsifyWithResidualOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("exact", &exact_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sample_ratio", &sample_ratio_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_mask", &with_mask_));
    OP_REQUIRES(ctx, sample_ratio_ > 0.0f && sample_ratio_ <= 1.0f,
                errors::InvalidArgument("sample_ratio must be in (0, 1], got ",
                                        sample_ratio_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& k_t = ctx->input(2);
    const Tensor& seed_t = ctx->input(3);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ValidateSelectionInputs(x, residual, &n));
    SparsifyTopKOptions opt;
    int64_t seed = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(k_t, "k", &opt.k));
    OP_REQUIRES_OK(ctx, ScalarValue(seed_t, "seed", &seed));
    OP_REQUIRES(ctx, opt.k >= 0,
                errors::InvalidArgument("k must be >= 0, got ", opt.k));
    opt.seed = static_cast<uint64_t>(seed);
    opt.exact = exact_;
    opt.sample_ratio = sample_ratio_;
    opt.with_mask = with_mask_;
    Tensor* new_residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(kSparsifyNewResidual, x.shape(),
                                             &new_residual));
    if (n == 0) {
      OP_REQUIRES_OK(ctx, EmptySelection(ctx));
      return;
    }
    OP_REQUIRES_OK(ctx, functor::SparsifyTopKFunctor<Device, T>()(
                            ctx, x.flat<T>().data(), residual.flat<T>().data(),
                            n, opt, new_residual->flat<T>().data()));
  }

 private:
  bool exact_ = false;
  float sample_ratio_ = 0.01f;
  bool with_mask_ = false;
};

template <typename Device, typename T>
class SparsifyByThresholdOp : public OpKernel {
 public:
  explicit SparsifyByThresholdOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_mask", &with_mask_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& pos_t = ctx->input(2);
    const Tensor& neg_t = ctx->input(3);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ValidateSelectionInputs(x, residual, &n));
    float pos = 0.0f, neg = 0.0f;
    OP_REQUIRES_OK(ctx, ScalarValue(pos_t, "pos_threshold", &pos));
    OP_REQUIRES_OK(ctx, ScalarValue(neg_t, "neg_threshold", &neg));
    // Written so that NaN thresholds fail too.
    OP_REQUIRES(ctx, pos >= 0.0f && neg <= 0.0f,
                errors::InvalidArgument(
                    "need pos_threshold >= 0 >= neg_threshold, got ", pos,
                    " and ", neg));
    Tensor* new_residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(kSparsifyNewResidual, x.shape(),
                                             &new_residual));
    if (n == 0) {
      OP_REQUIRES_OK(ctx, EmptySelection(ctx));
      return;
    }
    OP_REQUIRES_OK(ctx, functor::SparsifyByThresholdFunctor<Device, T>()(
                            ctx, x.flat<T>().data(), residual.flat<T>().data(),
                            n, pos, neg, with_mask_,
                            new_residual->flat<T>().data()));
  }

 private:
  bool with_mask_ = false;
};

template <typename Device, typename T>
class ScatterAddPayloadsOp : public OpKernel {
 public:
  explicit ScatterAddPayloadsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    const Tensor& n_t = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(values.shape()),
                errors::InvalidArgument("values must be 1-D, got shape ",
                                        values.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument("indices must be 1-D, got shape ",
                                        indices.shape().DebugString()));
    OP_REQUIRES(ctx, values.dim_size(0) == indices.dim_size(0),
                errors::InvalidArgument("values and indices must have the same "
                                        "length, got ", values.dim_size(0),
                                        " and ", indices.dim_size(0)));
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ScalarValue(n_t, "num_elements", &n));
    OP_REQUIRES(ctx, n >= 0 && n <= kMaxSparsifyElements,
                errors::InvalidArgument("num_elements must be in [0, ",
                                        kMaxSparsifyElements, "], got ", n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    const int64_t m = values.dim_size(0);
    OP_REQUIRES(ctx, n > 0 || m == 0,
                errors::InvalidArgument("indices must be empty when "
                                        "num_elements is 0, got ", m));
    if (n == 0) return;
    OP_REQUIRES_OK(ctx, functor::ScatterAddPayloadsFunctor<Device, T>()(
                            ctx, values.flat<T>().data(),
                            indices.flat<int32_t>().data(), m, n,
                            out->flat<T>().data()));
  }
};

#define TFGC_REGISTER_SPARSIFY_CPU(T)                                       \
  REGISTER_KERNEL_BUILDER(Name("TfgcSparsifyWithResidual")                  \
                              .Device(DEVICE_CPU)                           \
                              .TypeConstraint<T>("T"),                      \
                          SparsifyWithResidualOp<CPUDevice, T>);            \
  REGISTER_KERNEL_BUILDER(Name("TfgcSparsifyByThreshold")                   \
                              .Device(DEVICE_CPU)                           \
                              .TypeConstraint<T>("T"),                      \
                          SparsifyByThresholdOp<CPUDevice, T>);             \
  REGISTER_KERNEL_BUILDER(Name("TfgcScatterAddPayloads")                    \
                              .Device(DEVICE_CPU)                           \
                              .TypeConstraint<T>("T"),                      \
                          ScatterAddPayloadsOp<CPUDevice, T>);

TFGC_REGISTER_SPARSIFY_CPU(float);
TFGC_REGISTER_SPARSIFY_CPU(Eigen::half);
TFGC_REGISTER_SPARSIFY_CPU(Eigen::bfloat16);

#undef TFGC_REGISTER_SPARSIFY_CPU

#if GOOGLE_CUDA
// GPU kernels (sparsify_gpu.cu.cc). The scalar inputs (k, seed, the
// thresholds, num_elements) are read on the host by Compute, so they stay in
// host memory. Differences from the CPU kernels: the GPU top-k always makes
// the exact selection, also in DGC (non-exact) mode, where that is one of
// the allowed results (the seed and sample_ratio go unused); and the decode
// sums repeated indices in a nondeterministic order (float atomics).
using GPUDevice = Eigen::GpuDevice;

#define TFGC_REGISTER_SPARSIFY_GPU(T)                                 \
  REGISTER_KERNEL_BUILDER(Name("TfgcSparsifyWithResidual")            \
                              .Device(tensorflow::DEVICE_GPU)         \
                              .TypeConstraint<T>("T")                 \
                              .HostMemory("k")                        \
                              .HostMemory("seed"),                    \
                          SparsifyWithResidualOp<GPUDevice, T>);      \
  REGISTER_KERNEL_BUILDER(Name("TfgcSparsifyByThreshold")             \
                              .Device(tensorflow::DEVICE_GPU)         \
                              .TypeConstraint<T>("T")                 \
                              .HostMemory("pos_threshold")            \
                              .HostMemory("neg_threshold"),           \
                          SparsifyByThresholdOp<GPUDevice, T>);       \
  REGISTER_KERNEL_BUILDER(Name("TfgcScatterAddPayloads")              \
                              .Device(tensorflow::DEVICE_GPU)         \
                              .TypeConstraint<T>("T")                 \
                              .HostMemory("num_elements"),            \
                          ScatterAddPayloadsOp<GPUDevice, T>);

TFGC_REGISTER_SPARSIFY_GPU(float);
TFGC_REGISTER_SPARSIFY_GPU(Eigen::half);
TFGC_REGISTER_SPARSIFY_GPU(Eigen::bfloat16);

#undef TFGC_REGISTER_SPARSIFY_GPU
#endif  // GOOGLE_CUDA

}  // namespace tfgc
