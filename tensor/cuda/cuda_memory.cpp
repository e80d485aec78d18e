#include "tensor/cuda/cuda_memory.h"

#include <cstdio>
#include <exception>

#include "tensor/error.h"

#ifdef DG_WITH_CUDA
#include "tensor/cuda/cuda_check.h"
#endif

namespace distgrad::tensor::cuda {

#ifdef DG_WITH_CUDA
namespace {

// The CUDA side of the caching allocator: cudaMalloc/cudaFree and events without timing.
class CudaBackend final : public AllocatorBackend {
 public:
  void* allocate(size_t nbytes, int device) override {
    DeviceGuard guard(device);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, nbytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it so the next call does not report it
      return nullptr;
    }
    DG_CUDA_CHECK(err);
    return p;
  }
  void release(void* ptr, int device) noexcept override {
    if (cudaSetDevice(device) != cudaSuccess || cudaFree(ptr) != cudaSuccess) {
      std::fprintf(stderr, "[distgrad] cudaFree on cuda:%d failed: %s\n", device, cudaGetErrorString(cudaGetLastError()));
    }
  }
  void* recordEvent(int device, void* stream) override {
    DeviceGuard guard(device);
    cudaEvent_t event = nullptr;
    DG_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) cudaEventDestroy(event);
    DG_CUDA_CHECK(err);
    return event;
  }
  bool eventCompleted(void* event) override {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    DG_CUDA_CHECK(err);
    return true;
  }
  void synchronizeEvent(void* event) override { DG_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }
  void destroyEvent(void* event) noexcept override { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }
};

// One allocator per process, like the device it manages. Leaked on purpose: storages may be freed during
// static destruction, after a static allocator would be gone.
CachingAllocator& allocator() {
  static CachingAllocator* instance = new CachingAllocator(std::make_unique<CudaBackend>());
  return *instance;
}

}  // namespace

void* deviceAlloc(size_t nbytes, int device) {
  requireDevice(device, "CUDA allocation");
  return allocator().allocate(nbytes, device, Stream::current(device).handle());
}

void deviceFree(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  try {
    allocator().free(ptr);
  } catch (const std::exception& e) {
    // A destructor path: the block is leaked rather than reused unsafely (caching_allocator.cpp, free()).
    std::fprintf(stderr, "[distgrad] freeing CUDA memory on cuda:%d failed: %s\n", device, e.what());
  }
}

void recordStream(const Storage& storage, const Stream& stream) {
  if (!storage.defined() || !storage.device().isCuda()) return;
  DG_CHECK(storage.device().index == stream.device(), "recordStream: the storage is on ", storage.device().str(),
           " but the stream on cuda:", stream.device());
  allocator().recordStream(storage.data(), stream.handle());
}

void recordStream(const Tensor& tensor, const Stream& stream) {
  if (tensor.defined()) recordStream(tensor.storage(), stream);
}

void emptyCache(int device) {
  requireDevice(device, "emptyCache");
  allocator().emptyCache(device);
}

MemoryStats memoryStats(int device) { return allocator().stats(device); }

void resetPeakMemoryStats(int device) { allocator().resetPeakStats(device); }

void copyBytesAsync(void* dst, const void* src, size_t nbytes, const Stream& stream) {
  if (nbytes == 0) return;
  DeviceGuard guard(stream.device());
  DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, rawStream(stream)));
}

void copyHostToDevice(void* dst, const void* src, size_t nbytes, const Stream& stream) {
  if (nbytes == 0) return;
  copyBytesAsync(dst, src, nbytes, stream);
  cudaPointerAttributes attributes{};
  DG_CUDA_CHECK(cudaPointerGetAttributes(&attributes, src));
  if (attributes.type == cudaMemoryTypeHost) stream.synchronize();  // pinned: the DMA reads src later
}

void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t nbytes, const Stream& stream) {
  if (nbytes == 0) return;
  DeviceGuard guard(stream.device());
  DG_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, nbytes, rawStream(stream)));
}

void copyBytes(void* dst, const void* src, size_t nbytes, int device) {
  Stream stream = Stream::current(device);
  copyBytesAsync(dst, src, nbytes, stream);
  stream.synchronize();
}

#else  // built without CUDA

namespace {
[[noreturn]] void noCuda(const char* what) {
  throw ValueError(detail::concatMessage(what, ": distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

void* deviceAlloc(size_t, int) { noCuda("CUDA allocation"); }
void deviceFree(void*, int) noexcept {}
void recordStream(const Storage& storage, const Stream&) {
  if (storage.defined() && storage.device().isCuda()) noCuda("recordStream");
}
void recordStream(const Tensor& tensor, const Stream& stream) {
  if (tensor.defined()) recordStream(tensor.storage(), stream);
}
void emptyCache(int) { noCuda("emptyCache"); }
MemoryStats memoryStats(int) { return {}; }
void resetPeakMemoryStats(int) {}
void copyBytesAsync(void*, const void*, size_t, const Stream&) { noCuda("CUDA copy"); }
void copyHostToDevice(void*, const void*, size_t, const Stream&) { noCuda("CUDA copy"); }
void copyPeerAsync(void*, int, const void*, int, size_t, const Stream&) { noCuda("CUDA copy"); }
void copyBytes(void*, const void*, size_t, int) { noCuda("CUDA copy"); }

#endif

}  // namespace distgrad::tensor::cuda
