#include "tensor/cuda/cuda_memory.h"

#include "tensor/error.h"

#ifdef DG_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace distgrad::tensor::cuda {

#ifdef DG_WITH_CUDA
namespace {
void checkCuda(cudaError_t err, const char* what) {
  DG_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}
}  // namespace

int deviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

bool isAvailable() { return deviceCount() > 0; }

void* deviceAlloc(size_t nbytes, int device) {
  DG_CHECK(device >= 0 && device < deviceCount(), "CUDA device ", device, " is not available (",
           deviceCount(), " devices)");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  if (nbytes > 0) checkCuda(cudaMalloc(&p, nbytes), "cudaMalloc");
  return p;
}

void deviceFree(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  cudaFree(ptr);
}

void copyBytes(void* dst, const void* src, size_t nbytes, int device) {
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  checkCuda(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault), "cudaMemcpy");
}
#else
int deviceCount() { return 0; }
bool isAvailable() { return false; }
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
