#include "tensor/storage.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "tensor/cuda/cuda_memory.h"

namespace distgrad::tensor {
namespace {
std::atomic<size_t> gCpuBytes{0};
}

size_t cpuBytesInUse() { return gCpuBytes.load(std::memory_order_relaxed); }

Storage::Impl::~Impl() {
  if (deleter) deleter(data);
}

Storage Storage::allocate(size_t nbytes, Device device) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->nbytes = nbytes;
  s.impl_->device = device;
  if (device.isCpu()) {
    // aligned_alloc needs a size that is a multiple of the alignment.
    size_t rounded = (nbytes + kStorageAlignment - 1) / kStorageAlignment * kStorageAlignment;
    if (rounded == 0) rounded = kStorageAlignment;
    void* p = std::aligned_alloc(kStorageAlignment, rounded);
    if (p == nullptr) throw std::bad_alloc();
    gCpuBytes.fetch_add(nbytes, std::memory_order_relaxed);
    s.impl_->data = p;
    s.impl_->deleter = [nbytes](void* ptr) {
      gCpuBytes.fetch_sub(nbytes, std::memory_order_relaxed);
      std::free(ptr);
    };
  } else {
    s.impl_->data = cuda::deviceAlloc(nbytes, device.index);
    int index = device.index;
    s.impl_->deleter = [index](void* ptr) { cuda::deviceFree(ptr, index); };
  }
  return s;
}

Storage Storage::wrap(void* data, size_t nbytes, Device device, Deleter deleter) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->data = data;
  s.impl_->nbytes = nbytes;
  s.impl_->device = device;
  s.impl_->deleter = std::move(deleter);
  return s;
}

}  // namespace distgrad::tensor
