// Storage: a refcounted, device-aware block of bytes that tensors view.
//
// CPU storage is 64-byte aligned so vector loops and transports (which read and write tensor bytes in
// place, see docs/wire_protocol.md) never need a staging copy. Storage can also wrap memory owned by
// someone else (a received buffer, a pinned region) with a deleter that runs when the last reference goes.
// Thread-safety: Storage handles may be copied and destroyed from any thread (the refcount is atomic);
// concurrent writes to the same bytes are the caller's business.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "tensor/dtype.h"

namespace distgrad::tensor {

inline constexpr size_t kStorageAlignment = 64;

class Storage {
 public:
  using Deleter = std::function<void(void*)>;

  Storage() = default;

  // Allocates nbytes on the device (uninitialised). Zero bytes gives a valid, empty storage. CUDA storage
  // comes from the caching allocator, for use on the device's current stream (tensor/cuda/cuda_memory.h).
  static Storage allocate(size_t nbytes, Device device = Device::cpu());
  // Wraps memory owned elsewhere; `deleter` (may be empty) runs once when the last reference drops.
  static Storage wrap(void* data, size_t nbytes, Device device, Deleter deleter);

  bool defined() const { return impl_ != nullptr; }
  void* data() const { return impl_ ? impl_->data : nullptr; }
  size_t nbytes() const { return impl_ ? impl_->nbytes : 0; }
  Device device() const { return impl_ ? impl_->device : Device::cpu(); }
  long useCount() const { return impl_.use_count(); }
  bool sameAs(const Storage& other) const { return impl_ == other.impl_; }

 private:
  struct Impl {
    void* data = nullptr;
    size_t nbytes = 0;
    Device device;
    Deleter deleter;
    Impl() = default;
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl();
  };
  std::shared_ptr<Impl> impl_;
};

// Bytes currently held by CPU storages allocated through Storage::allocate (for memory benchmarks/tests).
size_t cpuBytesInUse();
// Freed CPU blocks of 64 KiB and more are cached for reuse (Note [Large block cache] in storage.cpp; limit
// DISTGRAD_CPU_CACHE_MB, default 512, 0 = off). Bytes held by the cache now, and a way to return them.
size_t cpuBytesCached();
void emptyCpuCache();

}  // namespace distgrad::tensor
