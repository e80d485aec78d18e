#include "tensor/cuda/pinned.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "tensor/error.h"

#ifdef DG_WITH_CUDA
#include "tensor/cuda/cuda_check.h"
#endif

namespace distgrad::tensor::cuda {

PinnedBlock::~PinnedBlock() { release(); }

PinnedBlock::PinnedBlock(PinnedBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      capacity_(std::exchange(other.capacity_, 0)),
      lastUse_(std::move(other.lastUse_)) {}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    lastUse_ = std::move(other.lastUse_);
  }
  return *this;
}

#ifdef DG_WITH_CUDA

namespace {

// On an error with copies possibly still in flight: the blocks go back to the pool only after the stream's
// queued work, never straight to the idle list (best effort: the stream itself may be what failed).
template <size_t N>
void releaseAfterOnError(PinnedBlock (&blocks)[N], const Stream& stream) noexcept {
  for (auto& block : blocks) {
    if (!block.defined()) continue;
    try {
      block.releaseAfter(stream);
    } catch (const ValueError&) {
    }
  }
}

size_t cacheLimitBytes() {
  static const size_t limit = [] {
    const char* text = std::getenv("DISTGRAD_PINNED_CACHE_MB");
    if (text == nullptr || *text == '\0') return size_t{256} << 20;
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(text, &end, 10);
    // A malformed value cannot be reported from here (first use may be deep in a send); the default is safe.
    if (end == nullptr || *end != '\0' || mb > (1ull << 24)) return size_t{256} << 20;
    return static_cast<size_t>(mb) << 20;
  }();
  return limit;
}

struct PinnedPool {
  struct Pending {
    void* data = nullptr;
    size_t capacity = 0;
    Event lastUse;
  };
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> idle;  // GUARDED_BY(mutex), by capacity
  std::vector<Pending> pending;               // GUARDED_BY(mutex)
  PinnedStats stats;                          // GUARDED_BY(mutex)

  // Moves the pending blocks whose copies finished to the idle lists (or frees them past the limit).
  // Caller holds mutex.
  void reclaimLocked() {
    for (size_t i = 0; i < pending.size();) {
      bool done = false;
      try {
        done = pending[i].lastUse.query();
      } catch (const ValueError&) {
        // The event itself failed (a sticky device error): the block may still be written by a copy that
        // never finishes; keep it out of circulation rather than hand it out.
        done = false;
      }
      if (!done) {
        ++i;
        continue;
      }
      Pending p = std::move(pending[i]);
      pending[i] = std::move(pending.back());
      pending.pop_back();
      stats.bytesPending -= p.capacity;
      keepOrFreeLocked(p.data, p.capacity);
    }
  }

  void keepOrFreeLocked(void* data, size_t capacity) {
    if (stats.bytesCached + capacity <= cacheLimitBytes()) {
      idle[capacity].push_back(data);
      stats.bytesCached += capacity;
    } else {
      cudaFreeHost(data);  // best effort: nothing to report to, and the memory is ours alone
    }
  }

  void emptyLocked() {
    reclaimLocked();
    for (auto& [capacity, blocks] : idle) {
      for (void* p : blocks) cudaFreeHost(p);
      stats.bytesCached -= capacity * blocks.size();
    }
    idle.clear();
  }
};

PinnedPool& pool() {
  static PinnedPool* instance = new PinnedPool();  // never destroyed: blocks may come back from static dtors
  return *instance;
}

size_t sizeClass(size_t nbytes) { return std::bit_ceil(std::max(nbytes, kMinPinnedBlockBytes)); }

}  // namespace

PinnedBlock allocatePinned(size_t nbytes) {
  DG_CHECK(isAvailable(), "allocatePinned: pinned memory needs a CUDA device and driver (",
           deviceCount(), " CUDA devices)");
  DG_CHECK(nbytes > 0, "allocatePinned: nbytes must be > 0");
  DG_CHECK(nbytes <= (size_t{1} << 62), "allocatePinned: ", nbytes, " bytes is too large");
  const size_t capacity = sizeClass(nbytes);
  PinnedPool& p = pool();
  PinnedBlock block;
  block.size_ = nbytes;
  block.capacity_ = capacity;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    p.reclaimLocked();
    auto it = p.idle.find(capacity);
    if (it != p.idle.end() && !it->second.empty()) {
      block.data_ = it->second.back();
      it->second.pop_back();
      p.stats.bytesCached -= capacity;
      p.stats.bytesInUse += capacity;
      ++p.stats.reuses;
      return block;
    }
  }
  void* data = nullptr;
  // Portable: the buffer is pinned for every device's context (one pool stages for all GPUs).
  cudaError_t err = cudaHostAlloc(&data, capacity, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    emptyPinnedCache();
    DG_CUDA_CHECK(cudaHostAlloc(&data, capacity, cudaHostAllocPortable));
  }
  block.data_ = data;
  std::lock_guard<std::mutex> lock(p.mutex);
  p.stats.bytesInUse += capacity;
  ++p.stats.hostAllocs;
  return block;
}

void PinnedBlock::releaseAfter(const Stream& stream) {
  DG_CHECK(data_ != nullptr, "PinnedBlock::releaseAfter: the block is empty");
  lastUse_.record(stream);
}

void PinnedBlock::release() noexcept {
  if (data_ == nullptr) return;
  PinnedPool& p = pool();
  bool done = true;
  try {
    done = lastUse_.query();
  } catch (const ValueError&) {
    done = false;
  }
  std::lock_guard<std::mutex> lock(p.mutex);
  p.stats.bytesInUse -= capacity_;
  if (done) {
    p.keepOrFreeLocked(data_, capacity_);
  } else {
    p.pending.push_back(PinnedPool::Pending{data_, capacity_, std::move(lastUse_)});
    p.stats.bytesPending += capacity_;
  }
  data_ = nullptr;
  size_ = capacity_ = 0;
}

PinnedStats pinnedStats() {
  PinnedPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.reclaimLocked();
  return p.stats;
}

void emptyPinnedCache() {
  PinnedPool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.emptyLocked();
}

void copyDeviceToHostStaged(void* dst, const void* src, size_t nbytes, const Stream& producer) {
  if (nbytes == 0) return;
  DG_CHECK(dst != nullptr && src != nullptr, "copyDeviceToHostStaged: null pointer for ", nbytes, " bytes");
  const int device = producer.device();
  DeviceGuard guard(device);
  const Stream copyStream = Stream::fromPool(device);
  // Stream semantics: the copy reads what the producer's queued work writes, so it waits for that work
  // (an event on the device, never a host wait or a device-wide sync).
  Event produced;
  produced.record(producer);
  produced.block(copyStream);
  const size_t chunk = std::min(nbytes, kStagingChunkBytes);
  const size_t chunks = (nbytes + chunk - 1) / chunk;
  // Double buffering: chunk i+1 is in flight (DMA) while the host copies chunk i out of its block.
  PinnedBlock blocks[2];
  Event copied[2];
  auto issue = [&](size_t i) {
    const size_t offset = i * chunk;
    const size_t length = std::min(chunk, nbytes - offset);
    PinnedBlock& block = blocks[i % 2];
    if (!block.defined()) block = allocatePinned(chunk);
    DG_CUDA_CHECK(cudaMemcpyAsync(block.data(), static_cast<const uint8_t*>(src) + offset, length,
                                  cudaMemcpyDeviceToHost, rawStream(copyStream)));
    copied[i % 2].record(copyStream);
  };
  try {
    issue(0);
    if (chunks > 1) issue(1);
    for (size_t i = 0; i < chunks; ++i) {
      copied[i % 2].synchronize();
      const size_t offset = i * chunk;
      std::memcpy(static_cast<uint8_t*>(dst) + offset, blocks[i % 2].data(), std::min(chunk, nbytes - offset));
      if (i + 2 < chunks) issue(i + 2);
    }
  } catch (...) {
    releaseAfterOnError(blocks, copyStream);
    throw;
  }
  // Every copy was waited for: the blocks go back to the pool idle.
}

void copyHostToDeviceStaged(void* dst, const void* src, size_t nbytes, const Stream& stream) {
  if (nbytes == 0) return;
  DG_CHECK(dst != nullptr && src != nullptr, "copyHostToDeviceStaged: null pointer for ", nbytes, " bytes");
  DeviceGuard guard(stream.device());
  const size_t chunk = std::min(nbytes, kStagingChunkBytes);
  const size_t chunks = (nbytes + chunk - 1) / chunk;
  // A ring of kStagingChunksInFlight blocks: the host fills one while the DMA of the others runs; a slot is
  // refilled only after its previous copy finished (its event), so a huge tensor never holds more pinned
  // memory than the ring.
  PinnedBlock blocks[kStagingChunksInFlight];
  Event copied[kStagingChunksInFlight];
  try {
    for (size_t i = 0; i < chunks; ++i) {
      const size_t slot = i % kStagingChunksInFlight;
      const size_t offset = i * chunk;
      const size_t length = std::min(chunk, nbytes - offset);
      if (!blocks[slot].defined()) {
        blocks[slot] = allocatePinned(chunk);
      } else {
        copied[slot].synchronize();
      }
      std::memcpy(blocks[slot].data(), static_cast<const uint8_t*>(src) + offset, length);
      DG_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + offset, blocks[slot].data(), length,
                                    cudaMemcpyHostToDevice, rawStream(stream)));
      copied[slot].record(stream);
    }
  } catch (...) {
    releaseAfterOnError(blocks, stream);
    throw;
  }
  // The last copies may still run: each block goes back to the pool only after its own.
  for (auto& block : blocks) {
    if (block.defined()) block.releaseAfter(stream);
  }
}

#else  // built without CUDA

namespace {
[[noreturn]] void noCuda(const char* what) {
  throw ValueError(detail::concatMessage(what, ": distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

PinnedBlock allocatePinned(size_t) { noCuda("allocatePinned"); }
void PinnedBlock::releaseAfter(const Stream&) { noCuda("PinnedBlock::releaseAfter"); }
void PinnedBlock::release() noexcept {}
PinnedStats pinnedStats() { return {}; }
void emptyPinnedCache() {}
void copyDeviceToHostStaged(void*, const void*, size_t, const Stream&) { noCuda("copyDeviceToHostStaged"); }
void copyHostToDeviceStaged(void*, const void*, size_t, const Stream&) { noCuda("copyHostToDeviceStaged"); }

#endif

}  // namespace distgrad::tensor::cuda
