#include "tensor/cuda/cuda_memory.h"

#include "tensor/error.h"

#ifdef DG_WITH_CUDA
#include "tensor/cuda/cuda_check.h"
#endif

namespace distgrad::tensor::cuda {

#ifdef DG_WITH_CUDA
void* deviceAlloc(size_t nbytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  if (nbytes > 0) DG_CUDA_CHECK(cudaMalloc(&p, nbytes));
  return p;
}

void deviceFree(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  cudaFree(ptr);
}

void copyBytes(void* dst, const void* src, size_t nbytes, int device) {
  DeviceGuard guard(device);
  DG_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
}
#else
void* deviceAlloc(size_t, int) {
  DG_CHECK(false, "CUDA storage requested but distgrad was built without CUDA (DG_WITH_CUDA=OFF)");
  return nullptr;
}
void deviceFree(void*, int) noexcept {}
void copyBytes(void*, const void*, size_t, int) {
  DG_CHECK(false, "CUDA copy requested but distgrad was built without CUDA (DG_WITH_CUDA=OFF)");
}
#endif

}  // namespace distgrad::tensor::cuda
