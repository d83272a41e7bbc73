// CUDA kernels of the randomized block Hadamard rotation (TfgcBlockHadamard;
// the CPU kernel and the semantics are in rotation_kernels.cc, the Python side
// in tfgc/ops/rotation.py).
//
// Two layers, as in the other *_gpu.cu.cc files: a TensorFlow-free part
// (kernels, launchers, extern "C" wrappers for the harness in
// custom_ops/cuda_harness/) and, under GOOGLE_CUDA, the functor that the
// OpKernel calls.
//
// Bits. A pass h of the transform maps each pair (j, j + h) of a group of 2h
// to (a + b, a - b). Those sums do not depend on how passes are grouped or on
// which thread computes them, so the GPU may fuse passes differently from the
// CPU (which fuses h = 1, 2 and then pairs of passes) and still produce the
// same floats, provided each addition, subtraction and multiplication is a
// single rounded float32 operation with subnormals flushed as TensorFlow's CPU
// threads flush them. Every arithmetic operation below is therefore an
// explicit .rn.ftz instruction: no contraction into FMAs, whatever nvcc's
// flags.
//
// Layout. A segment of blocks of m elements (the whole blocks, then the short
// last block as a segment of its own) is cut into tiles of kTile elements.
// Each CUDA block of kTileThreads threads takes one tile (grid-stride over
// tiles): warp w holds elements [512 w, 512 w + 512) of the tile, lane l the
// sixteen elements 512 w + 32 r + l (r = 0..15), so loads and stores are
// coalesced. Passes h = 1..16 pair lanes (warp shuffles), h = 32..256 pair a
// thread's own registers, h = 512..2048 go through shared memory. Blocks of
// more than kTile elements continue with radix-4 passes over global memory
// (two passes per read and write), the last of them scaling.

#include <cmath>

#include "custom_ops/cc/kernels/gpu_common.cuh"

namespace tfgc {
namespace cuda {
namespace {

constexpr int kTileThreads = 256;
constexpr int kPerThread = 16;
constexpr int64_t kWarpSpan = 32 * kPerThread;                   // 512
constexpr int64_t kTile = kTileThreads * kPerThread;             // 4096

__device__ __forceinline__ float MulFlushed(float a, float b) {
  float p;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(p) : "f"(a), "f"(b));
  return p;
}

// The value an element leaves with: after the last pass, times the scale and
// (inverse) times its sign.
template <bool kInverse>
__device__ __forceinline__ float Finish(float v, float scale,
                                        const float* __restrict__ signs,
                                        int64_t k, int64_t m) {
  v = MulFlushed(v, scale);
  if (kInverse) v = MulFlushed(v, signs[k & (m - 1)]);
  return v;
}

// One tile: loads (forward: times the signs), runs the passes h < min(m,
// kTile), and stores, finishing when the block fits in the tile. `len` is a
// multiple of m (m a power of two); elements past it are zeros of the last
// tile, whose blocks are never stored.
template <bool kInverse>
__global__ void __launch_bounds__(kTileThreads)
    TileKernel(const float* __restrict__ x, const float* __restrict__ signs,
               int64_t len, int64_t m, float scale, bool finish,
               float* __restrict__ y) {
  __shared__ float tile[kTile];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t mt = m < kTile ? m : kTile;
  const int64_t tiles = len / kTile + (len % kTile != 0);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t start = t * kTile;
    const int64_t count = len - start < kTile ? len - start : kTile;
    const int64_t own = warp * kWarpSpan + lane;  // tile offset of v[0]
    float v[kPerThread];
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int64_t k = own + 32 * r;
      float f = 0.0f;
      if (k < count) {
        f = x[start + k];
        if (!kInverse) f = MulFlushed(f, signs[(start + k) & (m - 1)]);
      }
      v[r] = f;
    }
    // h = 1..16: the partner is lane ^ h; the lower lane keeps a + b, the
    // upper one a - b (a the lower lane's value).
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
      if (2 * h <= mt) {
        const bool upper = (lane & h) != 0;
#pragma unroll
        for (int r = 0; r < kPerThread; ++r) {
          const float other = __shfl_xor_sync(0xffffffffu, v[r], h);
          v[r] = upper ? SubFlushed(other, v[r]) : AddFlushed(v[r], other);
        }
      }
    }
    // h = 32..256: registers r and r + h / 32.
#pragma unroll
    for (int hr = 1; hr < kPerThread; hr <<= 1) {
      if (64 * hr <= mt) {
#pragma unroll
        for (int r = 0; r < kPerThread; ++r) {
          if ((r & hr) == 0) {
            const float a = v[r];
            const float b = v[r + hr];
            v[r] = AddFlushed(a, b);
            v[r + hr] = SubFlushed(a, b);
          }
        }
      }
    }
    if (mt > kWarpSpan) {
      // h = 512..2048 through shared memory; consecutive threads take
      // consecutive j, so no bank conflicts.
#pragma unroll
      for (int r = 0; r < kPerThread; ++r) tile[own + 32 * r] = v[r];
      __syncthreads();
      int64_t h = kWarpSpan;
      for (; 4 * h <= mt; h *= 4) {
        for (int64_t q = threadIdx.x; q < kTile / 4; q += kTileThreads) {
          const int64_t base = (q / h) * 4 * h + (q & (h - 1));
          float* a = tile + base;
          const float p = AddFlushed(a[0], a[h]);
          const float s = SubFlushed(a[0], a[h]);
          const float u = AddFlushed(a[2 * h], a[3 * h]);
          const float w = SubFlushed(a[2 * h], a[3 * h]);
          a[0] = AddFlushed(p, u);
          a[h] = AddFlushed(s, w);
          a[2 * h] = SubFlushed(p, u);
          a[3 * h] = SubFlushed(s, w);
        }
        __syncthreads();
      }
      if (h < mt) {
        for (int64_t q = threadIdx.x; q < kTile / 2; q += kTileThreads) {
          const int64_t base = (q / h) * 2 * h + (q & (h - 1));
          const float a = tile[base];
          const float b = tile[base + h];
          tile[base] = AddFlushed(a, b);
          tile[base + h] = SubFlushed(a, b);
        }
        __syncthreads();
      }
#pragma unroll
      for (int r = 0; r < kPerThread; ++r) v[r] = tile[own + 32 * r];
      __syncthreads();  // the next tile reuses the shared memory
    }
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int64_t k = own + 32 * r;
      if (k < count) {
        y[start + k] = finish ? Finish<kInverse>(v[r], scale, signs, start + k, m) : v[r];
      }
    }
  }
}

// Passes h and 2h over y in place (h >= kTile, 4h <= m): quad q holds the
// elements base + {0, h, 2h, 3h}.
template <bool kInverse>
__global__ void GlobalRadix4Kernel(float* __restrict__ y, int64_t len, int64_t h,
                                   const float* __restrict__ signs, int64_t m,
                                   float scale, bool finish) {
  const int64_t quads = len / 4;
  for (int64_t q = GlobalThread(); q < quads; q += GlobalThreads()) {
    const int64_t base = (q / h) * 4 * h + (q & (h - 1));
    const float a = y[base], b = y[base + h], c = y[base + 2 * h], d = y[base + 3 * h];
    const float p = AddFlushed(a, b);
    const float s = SubFlushed(a, b);
    const float u = AddFlushed(c, d);
    const float w = SubFlushed(c, d);
    float o[4] = {AddFlushed(p, u), AddFlushed(s, w), SubFlushed(p, u), SubFlushed(s, w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t k = base + i * h;
      y[k] = finish ? Finish<kInverse>(o[i], scale, signs, k, m) : o[i];
    }
  }
}

// The last pass h = m / 2 over y in place, finishing.
template <bool kInverse>
__global__ void GlobalRadix2Kernel(float* __restrict__ y, int64_t len, int64_t h,
                                   const float* __restrict__ signs, int64_t m,
                                   float scale) {
  const int64_t pairs = len / 2;
  for (int64_t q = GlobalThread(); q < pairs; q += GlobalThreads()) {
    const int64_t base = (q / h) * 2 * h + (q & (h - 1));
    const float a = y[base], b = y[base + h];
    y[base] = Finish<kInverse>(AddFlushed(a, b), scale, signs, base, m);
    y[base + h] = Finish<kInverse>(SubFlushed(a, b), scale, signs, base + h, m);
  }
}

__global__ void ValidateSignsKernel(const float* __restrict__ signs, int64_t m,
                                    int* __restrict__ bad) {
  for (int64_t k = GlobalThread(); k < m; k += GlobalThreads()) {
    const float s = signs[k];
    if (s != 1.0f && s != -1.0f) atomicOr(bad, 1);
  }
}

bool IsPowerOfTwo(int64_t m) { return m >= 1 && (m & (m - 1)) == 0; }

// One segment of len elements (a multiple of m) in blocks of m.
template <bool kInverse>
cudaError_t Segment(const float* x, const float* signs, int64_t len, int64_t m,
                    float* y, cudaStream_t stream) {
  // The CPU kernel's scale, computed the same way on the host.
  const float scale = 1.0f / std::sqrt(static_cast<float>(m));
  const int64_t tiles = len / kTile + (len % kTile != 0);
  const int grid = static_cast<int>(std::min<int64_t>(tiles, kMaxBlocks));
  TileKernel<kInverse><<<grid, kTileThreads, 0, stream>>>(x, signs, len, m, scale,
                                                         m <= kTile, y);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || m <= kTile) return err;
  int64_t h = kTile;
  for (; 4 * h <= m; h *= 4) {
    GlobalRadix4Kernel<kInverse><<<NumBlocks(len / 4), kThreads, 0, stream>>>(
        y, len, h, signs, m, scale, 4 * h == m);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (h < m) {
    GlobalRadix2Kernel<kInverse><<<NumBlocks(len / 2), kThreads, 0, stream>>>(
        y, len, h, signs, m, scale);
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace

// ---------------------------------------------------------------------------
// C++ launchers (TensorFlow-free).

// *bad (host) <- 1 if any of the m signs is neither +1 nor -1, else 0.
// bad_dev is one device int of scratch. Synchronises the stream.
cudaError_t BlockHadamardValidateSigns(const float* signs, int64_t m, int* bad_dev,
                                       int* bad, cudaStream_t stream) {
  *bad = 0;
  if (m <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(bad_dev, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  ValidateSignsKernel<<<NumBlocks(m), kThreads, 0, stream>>>(signs, m, bad_dev);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(bad, bad_dev, sizeof(int), cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

// y[n] <- the rotation of x[n] (inverse: its inverse), asynchronously. block a
// power of two up to 2^30, n % block zero or a power of two (else
// cudaErrorInvalidValue); signs (block floats, each +1 or -1) are trusted. x
// and y may be the same buffer.
cudaError_t BlockHadamard(const float* x, const float* signs, int64_t n, int64_t block,
                          bool inverse, float* y, cudaStream_t stream) {
  if (!IsPowerOfTwo(block) || block > (int64_t{1} << 30) || n < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t tail = n % block;
  if (tail != 0 && !IsPowerOfTwo(tail)) return cudaErrorInvalidValue;
  const int64_t whole = n - tail;
  auto segment = inverse ? &Segment<true> : &Segment<false>;
  if (whole > 0) {
    const cudaError_t err = segment(x, signs, whole, block, y, stream);
    if (err != cudaSuccess) return err;
  }
  if (tail > 0) return segment(x + whole, signs, tail, tail, y + whole, stream);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace tfgc

// ---------------------------------------------------------------------------
// extern "C" launchers for callers without TensorFlow (ctypes).

extern "C" {

int tfgc_cuda_block_hadamard_validate_signs(const float* signs, int64_t m, int* bad_dev,
                                            int* bad, cudaStream_t stream) {
  return tfgc::cuda::BlockHadamardValidateSigns(signs, m, bad_dev, bad, stream);
}

int tfgc_cuda_block_hadamard(const float* x, const float* signs, int64_t n, int64_t block,
                             int inverse, float* y, cudaStream_t stream) {
  return tfgc::cuda::BlockHadamard(x, signs, n, block, inverse != 0, y, stream);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// TensorFlow GPU functor (only in a CUDA-enabled TensorFlow build).

#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include "custom_ops/cc/kernels/gpu_tf_util.h"
#include "custom_ops/cc/kernels/rotation.h"

namespace tfgc {
namespace functor {

using GPUDevice = Eigen::GpuDevice;

template <>
absl::Status BlockHadamardFunctor<GPUDevice>::operator()(
    tensorflow::OpKernelContext* ctx, const float* x, const float* signs, int64_t n,
    int64_t block, bool inverse, float* y) {
  const cudaStream_t stream = gpu_tf::StreamOf(ctx);
  tensorflow::Tensor flag_scratch;
  void* flag_ptr = nullptr;
  TF_RETURN_IF_ERROR(gpu_tf::ScratchBytes(ctx, sizeof(int), &flag_scratch, &flag_ptr));
  int bad = 0;
  TF_RETURN_IF_ERROR(gpu_tf::CudaStatus(
      cuda::BlockHadamardValidateSigns(signs, block, static_cast<int*>(flag_ptr), &bad,
                                       stream),
      "TfgcBlockHadamard"));
  if (bad) {
    return tensorflow::errors::InvalidArgument("signs must be +1 or -1");
  }
  return gpu_tf::CudaStatus(cuda::BlockHadamard(x, signs, n, block, inverse, y, stream),
                            "TfgcBlockHadamard");
}

}  // namespace functor
}  // namespace tfgc

#endif  // GOOGLE_CUDA
