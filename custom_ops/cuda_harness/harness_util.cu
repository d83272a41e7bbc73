// Minimal device-memory helpers for harness.py, compiled into the same shared
// library as the kernels so that Python needs nothing but ctypes (no CuPy, no
// second copy of the CUDA runtime). All return a cudaError_t (0 = success).

#include <cuda_runtime.h>

#include <cstddef>

extern "C" {

int tfgc_harness_malloc(void** ptr, size_t bytes) {
  return cudaMalloc(ptr, bytes > 0 ? bytes : 1);
}

int tfgc_harness_free(void* ptr) { return cudaFree(ptr); }

int tfgc_harness_to_device(void* dst, const void* src, size_t bytes) {
  return bytes > 0 ? cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) : 0;
}

int tfgc_harness_to_host(void* dst, const void* src, size_t bytes) {
  return bytes > 0 ? cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) : 0;
}

int tfgc_harness_synchronize() { return cudaDeviceSynchronize(); }

const char* tfgc_harness_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

int tfgc_harness_device_name(char* buf, int len) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, 0);
  if (err != cudaSuccess) return err;
  int i = 0;
  for (; i + 1 < len && prop.name[i] != '\0'; ++i) buf[i] = prop.name[i];
  if (len > 0) buf[i] = '\0';
  return 0;
}

}  // extern "C"
