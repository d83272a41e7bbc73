// CUDA kernels for the sparsification op family (see sparsify.h for the
// ranking rule and sparsify_kernels.cc for the CPU semantics they reproduce):
// top-k selection with error feedback (TfgcSparsifyWithResidual), threshold
// selection (TfgcSparsifyByThreshold) and the decode of sparse
// (value, index) payloads (TfgcScatterAddPayloads).
//
// Layout as in sign_bits_gpu.cu.cc: a TensorFlow-free part (kernels, C++
// launchers, extern "C" wrappers for ctypes) and a `#if GOOGLE_CUDA` part with
// the TF functor specialisations.
//
// Top-k = exact radix select on the 32-bit ranking keys, then a stable
// compaction. The key is the CPU op's (|v|'s bit pattern + 1, 0 for NaN), so
// comparing keys is comparing |v| with NaN below everything.
//   1. histogram passes, one digit of the key each (float32: 11 + 11 + 10
//      bits, float16 / bfloat16 keys fit in 16 bits: 8 + 8). Each block
//      counts into a shared-memory histogram (warp-aggregated atomics, since
//      real gradients pile into few bins) and adds it to a global one. The
//      first pass also computes v = x + residual and writes it to
//      new_residual; later passes read v back and only count the keys whose
//      higher digits equal the ones already chosen;
//   2. after each pass one block picks the bin holding the k-th largest key
//      and keeps, on the device, the key prefix and how many entries are
//      still wanted. After the last pass that is the exact k-th key K and
//      the number of entries equal to K to take (the lowest-index ties);
//   3. compaction in tiles of 8192 elements (one block per tile, a warp per
//      32 rows of 32): per tile, the number of keys above K and equal to K;
//      one block scans the tiles (tie ranks first, then output offsets); per
//      tile, __ballot_sync masks give every selected entry its slot, so
//      values / indices come out in ascending index order, new_residual is
//      zeroed there and the mask is written in the same pass.
// All of this stays on the stream without a host round trip: the output
// size is min(k, n), known up front. The DGC (sampled) mode of the op runs
// the same exact selection on the GPU: exactly k entries lies in the op's
// window [ceil(0.8k), max(k, floor(1.3k))] and ranks correctly, so seed and
// sample_ratio are simply not used there. k == 0 and k >= n take one pass.
// Memory traffic for float32 (3 digits): x and residual read once, v written
// once and read four more times (two histogram passes, count, emit); halves
// read v three more times. v = x + residual flushes float32 subnormals to
// zero, as TensorFlow does on both devices (see AddFlushed).
//
// Threshold selection is the same compaction with "v >= pos or v <= neg" as
// the predicate (no ties). Its count kernel computes v and writes
// new_residual; the total is copied to the host (one stream sync, as for
// tf.where) to size the outputs, then the emit kernel fills them.
//
// Decode = validate, then scatter:
//   1. every index is checked against [0, n) on the device; a bad one raises
//      a flag that is copied back to the host (one stream sync) before
//      anything is written, so a malformed payload is rejected with
//      InvalidArgument and never causes an out-of-bounds write;
//   2. the output (or, for float16 / bfloat16, a float32 scratch) is zeroed
//      and every value is added with a float32 atomicAdd;
//   3. half types: the float32 sums are rounded once to T.
// Difference from the CPU op: floating-point atomics add in whatever order
// the hardware serialises them, so entries named by several payload slots
// can differ from the CPU's in-order sum by rounding (and between runs).
// Entries named once are exact (+0 + v, so -0.0 becomes +0.0 as on the CPU),
// and NaN / Inf propagate the same way (an Inf - Inf pair gives NaN in any
// order).

#include <cstring>

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {
namespace {

constexpr int kBadIndex = 1;

__global__ void ValidateIndicesKernel(const int32_t* __restrict__ indices,
                                      int64_t m, int64_t n,
                                      int* __restrict__ flag) {
  int bad = 0;
  for (int64_t j = GlobalThread(); j < m; j += GlobalThreads()) {
    const int64_t i = indices[j];
    if (i < 0 || i >= n) bad = kBadIndex;
  }
  if (bad) atomicOr(flag, bad);
}

template <int D>
__global__ void ScatterAddKernel(const typename Codec<D>::Raw* __restrict__ values,
                                 const int32_t* __restrict__ indices, int64_t m,
                                 float* __restrict__ acc) {
  for (int64_t j = GlobalThread(); j < m; j += GlobalThreads()) {
    atomicAdd(acc + indices[j], Codec<D>::ToFloat(values[j]));
  }
}

template <int D>
__global__ void RoundKernel(const float* __restrict__ acc, int64_t n,
                            typename Codec<D>::Raw* __restrict__ out) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    out[i] = Codec<D>::FromFloat(acc[i]);
  }
}

// ---------------------------------------------------------------------------
// Selection kernels.

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kWarps = kThreads / 32;
// Histogram digits are 8 to 11 bits: 2048 32-bit shared counters (8 KiB)
// per block, and at least one bin per thread of the digit-select block.
constexpr int kMaxDigitBits = 11;
constexpr int kMaxBins = 1 << kMaxDigitBits;
constexpr int kMinDigitBits = 8;
// Bin counts are powers of two >= kThreads, so they split evenly over the
// threads of the digit-select block.
static_assert((1 << kMinDigitBits) >= kThreads && kThreads % 32 == 0,
              "every digit-select thread needs at least one bin");
// Compaction tiles: each warp owns 32 consecutive rows of 32 elements, so
// that lane j can keep the ballot masks of row j in registers between the
// counting and the writing sweep.
constexpr int kTileRows = 32;
constexpr int64_t kWarpElems = int64_t{32} * kTileRows;
constexpr int64_t kTileElems = kWarpElems * kWarps;
// Elements per thread of a histogram pass: enough that zeroing and flushing
// the block's shared histogram stays small next to the counting.
constexpr int64_t kHistPerThread = 32;

__host__ __device__ inline int64_t CeilDiv(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// The ranking key of sparsify.h on raw storage: |v|'s bit pattern + 1, and
// 0 for NaN, so that unsigned key order is |v| order with NaN last. Same
// formula as KeyOf in sparsify_kernels.cc.
template <int D>
struct KeyTraits;
template <>
struct KeyTraits<kFloat32> {
  static constexpr uint32_t kAbsMask = 0x7fffffffu;
  static constexpr uint32_t kPosInf = 0x7f800000u;
  __device__ __forceinline__ static uint32_t Bits(float r) {
    return __float_as_uint(r);
  }
};
template <>
struct KeyTraits<kFloat16> {
  static constexpr uint32_t kAbsMask = 0x7fffu;
  static constexpr uint32_t kPosInf = 0x7c00u;
  __device__ __forceinline__ static uint32_t Bits(uint16_t r) { return r; }
};
template <>
struct KeyTraits<kBFloat16> {
  static constexpr uint32_t kAbsMask = 0x7fffu;
  static constexpr uint32_t kPosInf = 0x7f80u;
  __device__ __forceinline__ static uint32_t Bits(uint16_t r) { return r; }
};

template <int D>
__device__ __forceinline__ uint32_t KeyOf(typename Codec<D>::Raw raw) {
  const uint32_t a = KeyTraits<D>::Bits(raw) & KeyTraits<D>::kAbsMask;
  return a <= KeyTraits<D>::kPosInf ? a + 1u : 0u;
}

// x + residual as TensorFlow computes it: in float32 (AddFlushed, see
// gpu_common.cuh), rounded once to T for the half types.
template <int D>
__device__ __forceinline__ typename Codec<D>::Raw AddRaw(
    typename Codec<D>::Raw a, typename Codec<D>::Raw b) {
  return Codec<D>::FromFloat(AddFlushed(Codec<D>::ToFloat(a), Codec<D>::ToFloat(b)));
}

// Order-preserving map of a float32 bit pattern to int32 (-0.0 and +0.0 both
// map to 0), valid for non-NaN values. The threshold test runs on these
// integers, as on the CPU, so that it is exact whatever the compiler's
// denormal mode (-ftz) and matches IEEE float comparison.
__host__ __device__ inline int32_t OrderedInt(uint32_t f) {
  const int32_t mag = static_cast<int32_t>(f & 0x7fffffffu);
  return (f >> 31) ? -mag : mag;
}

// Device-side state of the radix select, in scratch.
struct SelectState {
  // Key digits chosen so far; after the last pass, the k-th largest key.
  uint32_t prefix;
  uint32_t unused;
  // Entries still wanted among those whose key starts with `prefix`; after
  // the last pass, how many entries equal to the k-th key are taken (the
  // ones with the lowest indices).
  int64_t wanted;
};

// The selection a compaction pass applies. Top-k: "above" = key greater
// than the k-th key, "tie" = key equal to it (taken in index order while
// wanted). Threshold: "above" = v >= pos or v <= neg, never a tie.
template <int D, bool kTopK>
struct Classifier {
  uint32_t kth;
  int32_t pos, neg;

  __device__ __forceinline__ Classifier(const SelectState* state, int32_t p,
                                        int32_t q)
      : kth(0), pos(p), neg(q) {
    if constexpr (kTopK) kth = state->prefix;
  }

  __device__ __forceinline__ void operator()(typename Codec<D>::Raw raw,
                                             bool* above, bool* tie) const {
    if constexpr (kTopK) {
      const uint32_t key = KeyOf<D>(raw);
      *above = key > kth;
      *tie = key == kth;
    } else {
      const uint32_t f = __float_as_uint(Codec<D>::ToFloat(raw));
      const int32_t o = OrderedInt(f);
      *above = (f & 0x7fffffffu) <= 0x7f800000u && (o >= pos || o <= neg);
      *tie = false;
    }
  }
};

// k == 0: only new_residual = v.
template <int D>
__global__ void ComputeVKernel(const typename Codec<D>::Raw* __restrict__ x,
                               const typename Codec<D>::Raw* __restrict__ r,
                               int64_t n,
                               typename Codec<D>::Raw* __restrict__ v) {
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    v[i] = AddRaw<D>(x[i], r[i]);
  }
}

// k >= n: everything is selected, in index order.
template <int D>
__global__ void SelectAllKernel(const typename Codec<D>::Raw* __restrict__ x,
                                const typename Codec<D>::Raw* __restrict__ r,
                                int64_t n,
                                typename Codec<D>::Raw* __restrict__ new_res,
                                typename Codec<D>::Raw* __restrict__ values,
                                int32_t* __restrict__ indices,
                                bool* __restrict__ mask) {
  using Raw = typename Codec<D>::Raw;
  for (int64_t i = GlobalThread(); i < n; i += GlobalThreads()) {
    values[i] = AddRaw<D>(x[i], r[i]);
    indices[i] = static_cast<int32_t>(i);  // n <= 2^31
    new_res[i] = Raw(0);                   // +0
    if (mask != nullptr) mask[i] = true;
  }
}

// Zeroes the global histogram and starts the select at "k wanted, no digit
// chosen". One block.
__global__ void InitSelectKernel(SelectState* __restrict__ state,
                                 unsigned* __restrict__ hist, int64_t k) {
  for (int b = threadIdx.x; b < kMaxBins; b += blockDim.x) hist[b] = 0;
  if (threadIdx.x == 0) {
    state->prefix = 0;
    state->unused = 0;
    state->wanted = k;
  }
}

// One radix pass: hist[digit] += number of keys whose digit at
// [shift, shift + width) is `digit` and whose higher bits equal the prefix
// chosen so far. kFirst: v = x + residual is computed here and stored to v
// (new_residual), and every key counts (no digit chosen yet).
//
// The warp loop runs all 32 lanes together (base is a multiple of 32), so
// that __match_any_sync can merge the lanes that hit the same bin into one
// shared-memory atomic: gradients concentrate in a few exponents (and
// mostly-zero tensors in a single bin), which would otherwise serialise on
// the same counter.
template <int D, bool kFirst>
__global__ void __launch_bounds__(kThreads)
    HistogramKernel(const typename Codec<D>::Raw* __restrict__ x,
                    const typename Codec<D>::Raw* __restrict__ r,
                    typename Codec<D>::Raw* __restrict__ v, int64_t n,
                    int shift, int width, const SelectState* __restrict__ state,
                    unsigned* __restrict__ hist) {
  using Raw = typename Codec<D>::Raw;
  __shared__ unsigned counts[kMaxBins];
  const int bins = 1 << width;
  for (int b = threadIdx.x; b < bins; b += blockDim.x) counts[b] = 0;
  __syncthreads();
  const uint32_t prefix = kFirst ? 0u : state->prefix;
  const int lane = threadIdx.x & 31;
  for (int64_t base = GlobalThread() - lane; base < n; base += GlobalThreads()) {
    const int64_t i = base + lane;
    int bin = -1;
    if (i < n) {
      Raw raw;
      if constexpr (kFirst) {
        raw = AddRaw<D>(x[i], r[i]);
        v[i] = raw;
      } else {
        raw = v[i];
      }
      const uint32_t key = KeyOf<D>(raw);
      // Later passes have shift + width <= 21: the shift is well defined.
      if (kFirst || (key >> (shift + width)) == prefix) {
        bin = static_cast<int>((key >> shift) & static_cast<uint32_t>(bins - 1));
      }
    }
#if __CUDA_ARCH__ >= 700
    const unsigned peers = __match_any_sync(kFullWarp, bin);
    if (bin >= 0 && lane == __ffs(peers) - 1) {
      atomicAdd(&counts[bin], static_cast<unsigned>(__popc(peers)));
    }
#else
    // No __match_any_sync before Volta (e.g. nvcc 12's default sm_52 target).
    if (bin >= 0) atomicAdd(&counts[bin], 1u);
#endif
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    if (counts[b] != 0) atomicAdd(&hist[b], counts[b]);
  }
}

// One block after each histogram pass: finds the bin b holding the wanted-th
// largest remaining key (the entries in bins above b number fewer than
// `wanted`, those in b and above at least `wanted`), appends b to the prefix,
// subtracts the entries above it from `wanted`, and zeroes the histogram for
// the next pass. Counts fit in 32 bits (n <= 2^31); sums are 64-bit.
__global__ void __launch_bounds__(kThreads)
    DigitSelectKernel(unsigned* __restrict__ hist, int width,
                      SelectState* __restrict__ state) {
  const int per = (1 << width) / kThreads;  // >= 1: width >= kMinDigitBits
  const int b0 = threadIdx.x * per;
  // Read before the scan's barriers; written (by one thread) after them.
  const int64_t wanted = state->wanted;
  const uint32_t prefix = state->prefix;
  int64_t local = 0;
  for (int j = 0; j < per; ++j) local += hist[b0 + j];
  int64_t total;
  const int64_t before = BlockExclusiveScan<int64_t>(local, &total);
  // Entries in the bins above this thread's chunk.
  int64_t above = total - before - local;
  for (int b = b0 + per - 1; b >= b0; --b) {
    const int64_t c = hist[b];
    // True for exactly one bin of the whole block, as `above` only grows
    // downwards and total >= wanted >= 1.
    if (above < wanted && above + c >= wanted) {
      state->prefix = (prefix << width) | static_cast<uint32_t>(b);
      state->wanted = wanted - above;
    }
    above += c;
    hist[b] = 0;
  }
}

// Per tile (one block, kTileElems elements): how many entries are "above"
// and how many are ties under Classifier. kFromInputs (threshold op): v =
// x + residual is computed here and stored to v (new_residual); otherwise v
// already holds it.
template <int D, bool kTopK, bool kFromInputs>
__global__ void __launch_bounds__(kThreads)
    TileCountKernel(const typename Codec<D>::Raw* __restrict__ x,
                    const typename Codec<D>::Raw* __restrict__ r,
                    typename Codec<D>::Raw* __restrict__ v, int64_t n,
                    const SelectState* __restrict__ state, int32_t pos,
                    int32_t neg, int64_t* __restrict__ tile_sel,
                    int64_t* __restrict__ tile_ties) {
  using Raw = typename Codec<D>::Raw;
  const Classifier<D, kTopK> classify(state, pos, neg);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t base =
      static_cast<int64_t>(blockIdx.x) * kTileElems + warp * kWarpElems;
  // Rows of this warp that hold elements (warp-uniform).
  const int rows = static_cast<int>(
      n > base ? min(int64_t{kTileRows}, CeilDiv(n - base, 32)) : 0);
  int above_count = 0, tie_count = 0;
#pragma unroll 4
  for (int row = 0; row < rows; ++row) {
    const int64_t i = base + row * 32 + lane;
    bool above = false, tie = false;
    if (i < n) {
      Raw raw;
      if constexpr (kFromInputs) {
        raw = AddRaw<D>(x[i], r[i]);
        v[i] = raw;
      } else {
        raw = v[i];
      }
      classify(raw, &above, &tie);
    }
    above_count += __popc(__ballot_sync(kFullWarp, above));
    if constexpr (kTopK) tie_count += __popc(__ballot_sync(kFullWarp, tie));
  }
  __shared__ int warp_above[kWarps], warp_ties[kWarps];
  if (lane == 0) {
    warp_above[warp] = above_count;
    warp_ties[warp] = tie_count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t a = 0, t = 0;
    for (int w = 0; w < kWarps; ++w) {
      a += warp_above[w];
      t += warp_ties[w];
    }
    tile_sel[blockIdx.x] = a;
    tile_ties[blockIdx.x] = t;
  }
}

// One block over all tiles. In: tile_sel = "above" counts, tile_ties = tie
// counts. Out: tile_ties = the tie rank of each tile's first tie (exclusive
// prefix), tile_sel = each tile's first output slot (exclusive prefix of
// above + ties taken, a tile taking its ties while the running rank is
// below `wanted`), tile_sel[num_tiles] = number selected. state == nullptr:
// no ties wanted. Each thread owns a contiguous run of tiles.
__global__ void __launch_bounds__(kThreads)
    TileScanKernel(int64_t* __restrict__ tile_sel,
                   int64_t* __restrict__ tile_ties, int64_t num_tiles,
                   const SelectState* __restrict__ state) {
  const int64_t wanted = state != nullptr ? state->wanted : 0;
  const int64_t per_thread = CeilDiv(num_tiles, kThreads);
  const int64_t b = min(num_tiles, threadIdx.x * per_thread);
  const int64_t e = min(num_tiles, b + per_thread);
  int64_t local = 0;
  for (int64_t t = b; t < e; ++t) local += tile_ties[t];
  int64_t total;
  int64_t rank = BlockExclusiveScan<int64_t>(local, &total);
  int64_t local_sel = 0;
  for (int64_t t = b; t < e; ++t) {
    const int64_t c = tile_ties[t];
    tile_ties[t] = rank;
    const int64_t take = min(c, max(int64_t{0}, wanted - rank));
    tile_sel[t] += take;
    local_sel += tile_sel[t];
    rank += c;
  }
  int64_t total_sel;
  int64_t slot = BlockExclusiveScan<int64_t>(local_sel, &total_sel);
  for (int64_t t = b; t < e; ++t) {
    const int64_t c = tile_sel[t];
    tile_sel[t] = slot;
    slot += c;
  }
  if (threadIdx.x == 0) tile_sel[num_tiles] = total_sel;
}

// Per tile: writes the selected entries' values and indices at their slots
// (ascending index order), zeroes them in v and writes the mask (when
// non-null) for every element of the tile. Slots at or past `capacity`
// (the outputs' length) are never written, whatever the counts say.
//
// Sweep 1 recomputes the per-row ballots (lane j keeps row j's masks) and
// the warp's counts; the block then derives each warp's first slot and tie
// rank from the tile's; sweep 2 turns the masks into slots with popc.
template <int D, bool kTopK>
__global__ void __launch_bounds__(kThreads)
    TileEmitKernel(typename Codec<D>::Raw* __restrict__ v, int64_t n,
                   const SelectState* __restrict__ state, int32_t pos,
                   int32_t neg, const int64_t* __restrict__ tile_sel,
                   const int64_t* __restrict__ tile_ties, int64_t capacity,
                   typename Codec<D>::Raw* __restrict__ values,
                   int32_t* __restrict__ indices, bool* __restrict__ mask) {
  using Raw = typename Codec<D>::Raw;
  const Classifier<D, kTopK> classify(state, pos, neg);
  int64_t wanted = 0;
  if constexpr (kTopK) wanted = state->wanted;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t base =
      static_cast<int64_t>(blockIdx.x) * kTileElems + warp * kWarpElems;
  const int rows = static_cast<int>(
      n > base ? min(int64_t{kTileRows}, CeilDiv(n - base, 32)) : 0);

  unsigned my_above = 0, my_ties = 0;  // masks of row `lane`
  int above_count = 0, tie_count = 0;
#pragma unroll 4
  for (int row = 0; row < rows; ++row) {
    const int64_t i = base + row * 32 + lane;
    bool above = false, tie = false;
    if (i < n) classify(v[i], &above, &tie);
    const unsigned am = __ballot_sync(kFullWarp, above);
    const unsigned tm = kTopK ? __ballot_sync(kFullWarp, tie) : 0u;
    if (lane == row) {
      my_above = am;
      my_ties = tm;
    }
    above_count += __popc(am);
    tie_count += __popc(tm);
  }

  __shared__ int warp_above[kWarps], warp_ties[kWarps];
  if (lane == 0) {
    warp_above[warp] = above_count;
    warp_ties[warp] = tie_count;
  }
  __syncthreads();
  int64_t slot = tile_sel[blockIdx.x];
  int64_t rank = tile_ties[blockIdx.x];
  for (int w = 0; w < warp; ++w) {
    const int64_t t = warp_ties[w];
    slot += warp_above[w] + min(t, max(int64_t{0}, wanted - rank));
    rank += t;
  }

  for (int row = 0; row < rows; ++row) {
    const unsigned am = __shfl_sync(kFullWarp, my_above, row);
    const unsigned tm = __shfl_sync(kFullWarp, my_ties, row);
    const int64_t i = base + row * 32 + lane;
    const bool tie = (tm >> lane) & 1u;
    const bool selected =
        ((am >> lane) & 1u) != 0 ||
        (tie && rank + __popc(tm & lower_lanes) < wanted);
    const unsigned sm = __ballot_sync(kFullWarp, selected);
    bool taken = false;
    if (selected) {
      const int64_t s = slot + __popc(sm & lower_lanes);
      if (s < capacity) {
        values[s] = v[i];
        indices[s] = static_cast<int32_t>(i);  // i < n <= 2^31
        v[i] = Raw(0);                         // +0
        taken = true;
      }
    }
    if (mask != nullptr && i < n) mask[i] = taken;
    slot += __popc(sm);
    rank += __popc(tm);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free).

// Float32 accumulator bytes the scatter needs for dtype (0 for float32,
// which accumulates in the output).
int64_t ScatterAddScratchBytes(int dtype, int64_t n) {
  return dtype == kFloat32 || n <= 0 ? 0 : n * static_cast<int64_t>(sizeof(float));
}

// *bad (host) <- 1 if some index is outside [0, n). flag_dev: one device int.
// Synchronises the stream.
cudaError_t ScatterAddValidate(const int32_t* indices, int64_t m, int64_t n,
                               int* flag_dev, int* bad, cudaStream_t stream) {
  *bad = 0;
  if (m <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(flag_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  ValidateIndicesKernel<<<NumBlocks(m), kThreads, 0, stream>>>(indices, m, n,
                                                               flag_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(bad, flag_dev, sizeof(int), cudaMemcpyDeviceToHost,
                        stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// out[n] <- scatter-add of already validated indices. scratch:
// ScatterAddScratchBytes(D, n) bytes (null for float32).
template <int D>
cudaError_t ScatterAdd(const void* values, const int32_t* indices, int64_t m,
                       int64_t n, void* scratch, void* out,
                       cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (n <= 0) return cudaSuccess;
  float* acc = D == kFloat32 ? static_cast<float*>(out)
                             : static_cast<float*>(scratch);
  cudaError_t err = cudaMemsetAsync(acc, 0, n * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (m > 0) {
    ScatterAddKernel<D><<<NumBlocks(m), kThreads, 0, stream>>>(
        static_cast<const Raw*>(values), indices, m, acc);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (D != kFloat32) {
    RoundKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
        acc, n, static_cast<Raw*>(out));
    err = cudaGetLastError();
  }
  return err;
}

// Scratch of the selection launchers: the select state, the global
// histogram, then per-tile slot offsets (num_tiles + 1) and tie ranks.
struct SelectLayout {
  int64_t num_tiles;
  int64_t hist_byte, sel_byte, ties_byte, bytes;
};

SelectLayout PlanSelect(int64_t n) {
  SelectLayout l;
  l.num_tiles = CeilDiv(n, kTileElems);
  l.hist_byte = CeilDiv(sizeof(SelectState), 16) * 16;
  l.sel_byte = l.hist_byte + kMaxBins * static_cast<int64_t>(sizeof(unsigned));
  l.ties_byte = l.sel_byte + (l.num_tiles + 1) * 8;
  l.bytes = l.ties_byte + l.num_tiles * 8;
  return l;
}

struct SelectScratch {
  SelectState* state;
  unsigned* hist;
  int64_t* tile_sel;
  int64_t* tile_ties;
};

SelectScratch CarveSelect(const SelectLayout& l, void* scratch) {
  char* p = static_cast<char*>(scratch);
  return {reinterpret_cast<SelectState*>(p),
          reinterpret_cast<unsigned*>(p + l.hist_byte),
          reinterpret_cast<int64_t*>(p + l.sel_byte),
          reinterpret_cast<int64_t*>(p + l.ties_byte)};
}

// Radix digits (shift, width) of the keys, most significant first. float32
// keys are at most 0x7f800001 (31 bits); float16 / bfloat16 keys at most
// 0x7f81 (15 bits).
struct RadixDigit {
  int shift, width;
};
constexpr RadixDigit kFloat32Digits[] = {{21, 11}, {10, 11}, {0, 10}};
constexpr RadixDigit kHalfDigits[] = {{8, 8}, {0, 8}};

int32_t OrderedThreshold(float t) {
  uint32_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  return OrderedInt(bits);
}

int64_t SparsifyScratchBytes(int64_t n) {
  return n > 0 ? PlanSelect(n).bytes : 0;
}

// Exact top-k of v = x + residual (n <= 2^31 elements): new_residual[n] <- v
// with the selected entries zeroed; values / indices [min(k, n)] <- the
// selected entries in ascending index order; mask[n] (may be null) <- which
// were selected. scratch: SparsifyScratchBytes(n) bytes, only used (and only
// needed) when 0 < k < n. Asynchronous: no host round trip.
template <int D>
cudaError_t SparsifyTopK(const void* x, const void* residual, int64_t n,
                         int64_t k, void* scratch, void* new_residual,
                         void* values, int32_t* indices, bool* mask,
                         cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (n <= 0) return cudaSuccess;
  k = std::max<int64_t>(0, std::min(k, n));
  const auto* xr = static_cast<const Raw*>(x);
  const auto* rr = static_cast<const Raw*>(residual);
  auto* v = static_cast<Raw*>(new_residual);
  auto* out = static_cast<Raw*>(values);
  if (k == 0) {
    ComputeVKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(xr, rr, n, v);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || mask == nullptr) return err;
    return cudaMemsetAsync(mask, 0, n * sizeof(bool), stream);
  }
  if (k == n) {
    SelectAllKernel<D><<<NumBlocks(n), kThreads, 0, stream>>>(
        xr, rr, n, v, out, indices, mask);
    return cudaGetLastError();
  }
  const SelectLayout l = PlanSelect(n);
  const SelectScratch s = CarveSelect(l, scratch);
  const RadixDigit* digits = D == kFloat32 ? kFloat32Digits : kHalfDigits;
  const int passes = D == kFloat32 ? 3 : 2;
  const int hist_blocks = NumBlocks(n, kThreads * kHistPerThread);
  const auto tiles = static_cast<unsigned>(l.num_tiles);

  InitSelectKernel<<<1, kThreads, 0, stream>>>(s.state, s.hist, k);
  for (int p = 0; p < passes; ++p) {
    const RadixDigit d = digits[p];
    if (p == 0) {
      HistogramKernel<D, true><<<hist_blocks, kThreads, 0, stream>>>(
          xr, rr, v, n, d.shift, d.width, s.state, s.hist);
    } else {
      HistogramKernel<D, false><<<hist_blocks, kThreads, 0, stream>>>(
          nullptr, nullptr, v, n, d.shift, d.width, s.state, s.hist);
    }
    DigitSelectKernel<<<1, kThreads, 0, stream>>>(s.hist, d.width, s.state);
  }
  TileCountKernel<D, true, false><<<tiles, kThreads, 0, stream>>>(
      nullptr, nullptr, v, n, s.state, 0, 0, s.tile_sel, s.tile_ties);
  TileScanKernel<<<1, kThreads, 0, stream>>>(s.tile_sel, s.tile_ties,
                                             l.num_tiles, s.state);
  TileEmitKernel<D, true><<<tiles, kThreads, 0, stream>>>(
      v, n, s.state, 0, 0, s.tile_sel, s.tile_ties, k, out, indices, mask);
  return cudaGetLastError();
}

// Threshold selection, step 1: new_residual[n] <- v = x + residual, the
// per-tile counts and slots in scratch (SparsifyScratchBytes(n) bytes), and
// *num_selected (host) <- how many entries satisfy v >= pos_threshold or
// v <= neg_threshold (float32 comparison, NaN never). Synchronises the
// stream to read the count.
template <int D>
cudaError_t SparsifyByThresholdCount(const void* x, const void* residual,
                                     int64_t n, float pos_threshold,
                                     float neg_threshold, void* new_residual,
                                     void* scratch, int64_t* num_selected,
                                     cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  *num_selected = 0;
  if (n <= 0) return cudaSuccess;
  const SelectLayout l = PlanSelect(n);
  const SelectScratch s = CarveSelect(l, scratch);
  TileCountKernel<D, false, true>
      <<<static_cast<unsigned>(l.num_tiles), kThreads, 0, stream>>>(
          static_cast<const Raw*>(x), static_cast<const Raw*>(residual),
          static_cast<Raw*>(new_residual), n, nullptr,
          OrderedThreshold(pos_threshold), OrderedThreshold(neg_threshold),
          s.tile_sel, s.tile_ties);
  TileScanKernel<<<1, kThreads, 0, stream>>>(s.tile_sel, s.tile_ties,
                                             l.num_tiles, nullptr);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(num_selected, s.tile_sel + l.num_tiles,
                        sizeof(int64_t), cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// Step 2, with the same thresholds and scratch: values / indices
// [num_selected] in ascending index order, the selected entries zeroed in
// new_residual, mask[n] (may be null). num_selected is the outputs' length:
// nothing is written past it.
template <int D>
cudaError_t SparsifyByThresholdEmit(int64_t n, float pos_threshold,
                                    float neg_threshold, const void* scratch,
                                    int64_t num_selected, void* new_residual,
                                    void* values, int32_t* indices, bool* mask,
                                    cudaStream_t stream) {
  using Raw = typename Codec<D>::Raw;
  if (n <= 0 || (num_selected <= 0 && mask == nullptr)) return cudaSuccess;
  const SelectLayout l = PlanSelect(n);
  const SelectScratch s = CarveSelect(l, const_cast<void*>(scratch));
  TileEmitKernel<D, false>
      <<<static_cast<unsigned>(l.num_tiles), kThreads, 0, stream>>>(
          static_cast<Raw*>(new_residual), n, nullptr,
          OrderedThreshold(pos_threshold), OrderedThreshold(neg_threshold),
          s.tile_sel, s.tile_ties, std::max<int64_t>(0, num_selected),
          static_cast<Raw*>(values), indices, mask);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers (ctypes). Return a cudaError_t, 0 = success.
// Sizes as in the OpKernels: 0 < n <= 2^31, indices int32; mask may be null
// (no mask wanted), otherwise n bytes.
//
// Top-k: tfgc_cuda_sparsify_topk with tfgc_cuda_sparsify_scratch_bytes(n)
// bytes of scratch and values / indices of min(k, n) entries; exact
// selection, asynchronous.
//
// Threshold: tfgc_cuda_sparsify_by_threshold_count (synchronises, returns
// the number selected in *num_selected), allocate that many values and
// indices, then tfgc_cuda_sparsify_by_threshold_emit with the same
// thresholds and scratch.
//
// Decode: call tfgc_cuda_scatter_add_validate (flag_dev: one device int; it
// synchronises) and reject the payload if *bad; otherwise call
// tfgc_cuda_scatter_add with tfgc_cuda_scatter_add_scratch_bytes(dtype, n)
// bytes of scratch. m and n as in the OpKernel: n <= 2^31, indices int32.

extern "C" {

int64_t tfgc_cuda_sparsify_scratch_bytes(int64_t n) {
  return tfgc::cuda::SparsifyScratchBytes(n);
}

int tfgc_cuda_sparsify_topk(int dtype, const void* x, const void* residual,
                            int64_t n, int64_t k, void* scratch,
                            void* new_residual, void* values, int32_t* indices,
                            bool* mask, cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::SparsifyTopK, x, residual, n, k,
                           scratch, new_residual, values, indices, mask,
                           stream);
}

int tfgc_cuda_sparsify_by_threshold_count(int dtype, const void* x,
                                          const void* residual, int64_t n,
                                          float pos_threshold,
                                          float neg_threshold,
                                          void* new_residual, void* scratch,
                                          int64_t* num_selected,
                                          cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::SparsifyByThresholdCount, x,
                           residual, n, pos_threshold, neg_threshold,
                           new_residual, scratch, num_selected, stream);
}

int tfgc_cuda_sparsify_by_threshold_emit(int dtype, int64_t n,
                                         float pos_threshold,
                                         float neg_threshold,
                                         const void* scratch,
                                         int64_t num_selected,
                                         void* new_residual, void* values,
                                         int32_t* indices, bool* mask,
                                         cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::SparsifyByThresholdEmit, n,
                           pos_threshold, neg_threshold, scratch, num_selected,
                           new_residual, values, indices, mask, stream);
}

int64_t tfgc_cuda_scatter_add_scratch_bytes(int dtype, int64_t n) {
  return tfgc::cuda::ScatterAddScratchBytes(dtype, n);
}

int tfgc_cuda_scatter_add_validate(const int32_t* indices, int64_t m,
                                   int64_t n, int* flag_dev, int* bad,
                                   cudaStream_t stream) {
  return tfgc::cuda::ScatterAddValidate(indices, m, n, flag_dev, bad, stream);
}

int tfgc_cuda_scatter_add(int dtype, const void* values, const int32_t* indices,
                          int64_t m, int64_t n, void* scratch, void* out,
                          cudaStream_t stream) {
  TFGC_CUDA_DISPATCH_DTYPE(dtype, tfgc::cuda::ScatterAdd, values, indices, m,
                           n, scratch, out, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functor (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/sparsify.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "custom_ops/cc/kernels/gpu_tf_util.h"

namespace tfgc {
namespace functor {
namespace {

using GPUDevice = Eigen::GpuDevice;
using gpu_tf::CudaDType;
using gpu_tf::CudaStatus;
using gpu_tf::ScratchBytes;
using gpu_tf::StreamOf;

}  // namespace

// Allocates the variable-length outputs of a selection: values and indices
// of m entries, the mask of mask_len (n or 0).
template <typename T>
absl::Status AllocateSelection(tensorflow::OpKernelContext* ctx, int64_t m,
                               int64_t mask_len, T** values, int32_t** indices,
                               bool** mask) {
  tensorflow::Tensor *v = nullptr, *i = nullptr, *b = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(
      kSparsifyValues, tensorflow::TensorShape({m}), &v));
  TF_RETURN_IF_ERROR(ctx->allocate_output(
      kSparsifyIndices, tensorflow::TensorShape({m}), &i));
  TF_RETURN_IF_ERROR(ctx->allocate_output(
      kSparsifyMask, tensorflow::TensorShape({mask_len}), &b));
  *values = v->flat<T>().data();
  *indices = i->flat<int32_t>().data();
  *mask = mask_len > 0 ? b->flat<bool>().data() : nullptr;
  return absl::OkStatus();
}

// The GPU always selects exactly min(k, n) entries: in DGC (non-exact) mode
// that count lies in the op's window [ceil(0.8k), max(k, floor(1.3k))] and
// the selection ranks as required, so sampling would only add work here
// (seed and sample_ratio go unused). The output size is then known before
// any kernel runs, and the whole op is asynchronous.
template <typename T>
struct SparsifyTopKFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n,
                          const SparsifyTopKOptions& options,
                          T* new_residual) {
    const int64_t k = std::min(options.k, n);
    T* values = nullptr;
    int32_t* indices = nullptr;
    bool* mask = nullptr;
    TF_RETURN_IF_ERROR(AllocateSelection(ctx, k, options.with_mask ? n : 0,
                                         &values, &indices, &mask));
    tensorflow::Tensor scratch;
    void* scratch_ptr = nullptr;
    if (k > 0 && k < n) {
      TF_RETURN_IF_ERROR(ScratchBytes(ctx, cuda::SparsifyScratchBytes(n),
                                      &scratch, &scratch_ptr));
    }
    return CudaStatus(
        cuda::SparsifyTopK<CudaDType<T>::kCode>(x, residual, n, k, scratch_ptr,
                                                new_residual, values, indices,
                                                mask, StreamOf(ctx)),
        "TfgcSparsifyWithResidual");
  }
};

template <typename T>
struct SparsifyByThresholdFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* x,
                          const T* residual, int64_t n, float pos_threshold,
                          float neg_threshold, bool with_mask,
                          T* new_residual) {
    constexpr int kCode = CudaDType<T>::kCode;
    const cudaStream_t stream = StreamOf(ctx);
    tensorflow::Tensor scratch;
    void* scratch_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(ctx, cuda::SparsifyScratchBytes(n),
                                    &scratch, &scratch_ptr));
    int64_t m = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::SparsifyByThresholdCount<kCode>(x, residual, n, pos_threshold,
                                              neg_threshold, new_residual,
                                              scratch_ptr, &m, stream),
        "TfgcSparsifyByThreshold"));
    T* values = nullptr;
    int32_t* indices = nullptr;
    bool* mask = nullptr;
    TF_RETURN_IF_ERROR(AllocateSelection(ctx, m, with_mask ? n : 0, &values,
                                         &indices, &mask));
    return CudaStatus(
        cuda::SparsifyByThresholdEmit<kCode>(n, pos_threshold, neg_threshold,
                                             scratch_ptr, m, new_residual,
                                             values, indices, mask, stream),
        "TfgcSparsifyByThreshold");
  }
};

template <typename T>
struct ScatterAddPayloadsFunctor<GPUDevice, T> {
  absl::Status operator()(tensorflow::OpKernelContext* ctx, const T* values,
                          const int32_t* indices, int64_t m, int64_t n,
                          T* out) {
    constexpr int kCode = CudaDType<T>::kCode;
    const cudaStream_t stream = ctx->eigen_device<GPUDevice>().stream();
    tensorflow::Tensor flag;
    void* flag_ptr = nullptr;
    TF_RETURN_IF_ERROR(ScratchBytes(ctx, sizeof(int), &flag, &flag_ptr));
    int bad = 0;
    TF_RETURN_IF_ERROR(CudaStatus(
        cuda::ScatterAddValidate(indices, m, n, static_cast<int*>(flag_ptr),
                                 &bad, stream),
        "TfgcScatterAddPayloads"));
    if (bad) {
      return tensorflow::errors::InvalidArgument(
          "an index of the payload is not in [0, ", n, ")");
    }
    tensorflow::Tensor acc;
    void* acc_ptr = nullptr;
    const int64_t bytes = cuda::ScatterAddScratchBytes(kCode, n);
    if (bytes > 0) {
      TF_RETURN_IF_ERROR(ScratchBytes(ctx, bytes, &acc, &acc_ptr));
    }
    return CudaStatus(
        cuda::ScatterAdd<kCode>(values, indices, m, n, acc_ptr, out, stream),
        "TfgcScatterAddPayloads");
  }
};

#define TFGC_INSTANTIATE_SPARSIFY_GPU(T)                    \
  template struct SparsifyTopKFunctor<GPUDevice, T>;        \
  template struct SparsifyByThresholdFunctor<GPUDevice, T>; \
  template struct ScatterAddPayloadsFunctor<GPUDevice, T>;

TFGC_INSTANTIATE_SPARSIFY_GPU(float);
TFGC_INSTANTIATE_SPARSIFY_GPU(Eigen::half);
TFGC_INSTANTIATE_SPARSIFY_GPU(Eigen::bfloat16);

#undef TFGC_INSTANTIATE_SPARSIFY_GPU

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
