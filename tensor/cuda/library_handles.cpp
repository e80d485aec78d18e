// Built only with DG_WITH_CUDA (see library_handles.h); an empty translation unit otherwise.
#ifdef DG_WITH_CUDA

#include "tensor/cuda/library_handles.h"

#include <array>
#include <map>
#include <utility>

#include "tensor/cuda/cublas_api.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {

void checkCublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    throw ValueError(detail::concatMessage(what, " failed: ", cublasApi().cublasGetStatusName(status), " (",
                                           cublasApi().cublasGetStatusString(status), ")"));
  }
}

void checkCudnn(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) [[unlikely]] {
    char detailMessage[512] = {0};
    // cuDNN 9 keeps a per-thread log of the last error's cause; it is more specific than the status name.
    cudnnGetLastErrorString(detailMessage, sizeof(detailMessage));
    throw ValueError(detail::concatMessage(what, " failed: ", cudnnGetErrorString(status),
                                           detailMessage[0] != 0 ? " (" : "", detailMessage,
                                           detailMessage[0] != 0 ? ")" : ""));
  }
}

namespace {

constexpr int kMaxDevices = 64;

// One thread's handles. Destruction errors are ignored: at thread exit there is nobody to report to, and
// the driver may already be shutting down at process exit.
struct ThreadHandles {
  std::array<cublasHandle_t, kMaxDevices> blas{};
  std::array<cublasLtHandle_t, kMaxDevices> lt{};
  std::array<cudnnHandle_t, kMaxDevices> dnn{};
  // (device, stream) -> workspace
  std::map<std::pair<int, void*>, Tensor> blasWorkspaces;

  ThreadHandles() = default;
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;
  ~ThreadHandles() {
    for (int d = 0; d < kMaxDevices; ++d) {
      if (blas[d] == nullptr && lt[d] == nullptr && dnn[d] == nullptr) continue;
      if (cudaSetDevice(d) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      if (blas[d] != nullptr) cublasApi().cublasDestroy(blas[d]);
      if (lt[d] != nullptr) cublasApi().cublasLtDestroy(lt[d]);
      if (dnn[d] != nullptr) cudnnDestroy(dnn[d]);
    }
  }
};

ThreadHandles& threadHandles() {
  thread_local ThreadHandles handles;
  return handles;
}

void checkDeviceIndex(int device, const char* what) {
  requireDevice(device, what);
  DG_ASSERT(device < kMaxDevices, "more CUDA devices than distgrad supports: ", device);
}

}  // namespace

void* blasWorkspace(const Stream& stream) {
  ThreadHandles& h = threadHandles();
  auto key = std::make_pair(stream.device(), stream.handle());
  auto it = h.blasWorkspaces.find(key);
  if (it == h.blasWorkspaces.end()) {
    it = h.blasWorkspaces.emplace(key, workspaceTensor(stream.device(), kBlasWorkspaceBytes)).first;
  }
  return it->second.rawData();
}

cublasHandle_t cublasHandle(const Stream& stream) {
  const int device = stream.device();
  checkDeviceIndex(device, "cublasHandle");
  ThreadHandles& h = threadHandles();
  if (h.blas[device] == nullptr) {
    DeviceGuard guard(device);
    DG_CUBLAS_CHECK(cublasApi().cublasCreate(&h.blas[device]));
    // Results of reductions inside cuBLAS must not depend on scheduling (no atomics-based split-K).
    DG_CUBLAS_CHECK(cublasApi().cublasSetAtomicsMode(h.blas[device], CUBLAS_ATOMICS_NOT_ALLOWED));
  }
  cublasHandle_t handle = h.blas[device];
  DG_CUBLAS_CHECK(cublasApi().cublasSetStream(handle, rawStream(stream)));
  // cublasSetStream resets the workspace to cuBLAS's own default pool; point it at ours for this stream.
  DG_CUBLAS_CHECK(cublasApi().cublasSetWorkspace(handle, blasWorkspace(stream), kBlasWorkspaceBytes));
  return handle;
}

cublasLtHandle_t cublasLtHandle(int device) {
  checkDeviceIndex(device, "cublasLtHandle");
  ThreadHandles& h = threadHandles();
  if (h.lt[device] == nullptr) {
    DeviceGuard guard(device);
    DG_CUBLAS_CHECK(cublasApi().cublasLtCreate(&h.lt[device]));
  }
  return h.lt[device];
}

cudnnHandle_t cudnnHandle(const Stream& stream) {
  const int device = stream.device();
  checkDeviceIndex(device, "cudnnHandle");
  ThreadHandles& h = threadHandles();
  if (h.dnn[device] == nullptr) {
    DeviceGuard guard(device);
    DG_CUDNN_CHECK(cudnnCreate(&h.dnn[device]));
  }
  cudnnHandle_t handle = h.dnn[device];
  DG_CUDNN_CHECK(cudnnSetStream(handle, rawStream(stream)));
  return handle;
}

Tensor workspaceTensor(int device, size_t bytes) {
  // int64 elements keep the buffer 8-byte aligned in count; the allocator aligns the base far more.
  const auto elements = static_cast<int64_t>((bytes + sizeof(int64_t) - 1) / sizeof(int64_t));
  return Tensor::empty({elements}, DType::kInt64, Device::cuda(device));
}

}  // namespace distgrad::tensor::cuda

#endif  // DG_WITH_CUDA
