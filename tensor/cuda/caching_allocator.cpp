#include "tensor/cuda/caching_allocator.h"

#include <algorithm>
#include <tuple>

#include "tensor/error.h"

namespace distgrad::tensor::cuda {
namespace {

constexpr size_t kSmallGranule = 512;
constexpr size_t kSmallLimit = size_t{1} << 20;
constexpr size_t kMediumGranule = size_t{128} << 10;
constexpr size_t kMediumLimit = size_t{64} << 20;
constexpr size_t kLargeGranule = size_t{2} << 20;

size_t roundUp(size_t n, size_t granule) { return (n + granule - 1) / granule * granule; }

}  // namespace

bool CachingAllocator::FreeOrder::operator()(const Block* a, const Block* b) const {
  auto key = [](const Block* x) {
    return std::make_tuple(reinterpret_cast<uintptr_t>(x->stream), x->size, reinterpret_cast<uintptr_t>(x->ptr));
  };
  return key(a) < key(b);
}

CachingAllocator::CachingAllocator(std::unique_ptr<AllocatorBackend> backend) : backend_(std::move(backend)) {
  DG_ASSERT(backend_ != nullptr, "CachingAllocator needs a backend");
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [device, state] : devices_) {
    try {
      collectPending(state, /*wait=*/true);
    } catch (...) {
      // A failing device at teardown: keep going and free what we can.
    }
    releaseCached(state);
  }
}

size_t CachingAllocator::roundSize(size_t nbytes) {
  if (nbytes < kSmallLimit) return roundUp(std::max<size_t>(nbytes, 1), kSmallGranule);
  if (nbytes < kMediumLimit) return roundUp(nbytes, kMediumGranule);
  return roundUp(nbytes, kLargeGranule);
}

CachingAllocator::DeviceState& CachingAllocator::deviceState(int device) { return devices_[device]; }

CachingAllocator::Block* CachingAllocator::takeCached(DeviceState& state, size_t rounded, void* stream) {
  Block probe;
  probe.stream = stream;
  probe.size = rounded;
  probe.ptr = nullptr;
  auto it = state.freeBlocks.lower_bound(&probe);
  if (it == state.freeBlocks.end()) return nullptr;
  Block* block = *it;
  // Same stream only (Note [Stream-ordered reuse]), and not wastefully large.
  if (block->stream != stream || block->size > rounded + rounded / 8) return nullptr;
  state.freeBlocks.erase(it);
  state.stats.cachedBytes -= block->size;
  return block;
}

void CachingAllocator::collectPending(DeviceState& state, bool wait) {
  auto ready = [&](Block* block) {
    for (void* event : block->events) {
      if (wait) {
        backend_->synchronizeEvent(event);
      } else if (!backend_->eventCompleted(event)) {
        return false;
      }
    }
    return true;
  };
  auto it = state.pending.begin();
  while (it != state.pending.end()) {
    Block* block = *it;
    if (!ready(block)) {
      ++it;
      continue;
    }
    for (void* event : block->events) backend_->destroyEvent(event);
    block->events.clear();
    state.stats.pendingBytes -= block->size;
    state.stats.cachedBytes += block->size;
    state.freeBlocks.insert(block);
    it = state.pending.erase(it);
  }
}

void CachingAllocator::releaseCached(DeviceState& state) {
  for (Block* block : state.freeBlocks) {
    backend_->release(block->ptr, block->device);
    state.stats.reservedBytes -= block->size;
    state.stats.cachedBytes -= block->size;
    ++state.stats.backendReleases;
    blocks_.erase(block->ptr);  // invalidates `block`: nothing reads it after this
  }
  state.freeBlocks.clear();
}

void* CachingAllocator::allocate(size_t nbytes, int device, void* stream) {
  if (nbytes == 0) return nullptr;
  DG_CHECK(nbytes <= (size_t{1} << 62), "CUDA allocation of ", nbytes, " bytes on cuda:", device, " is too large");
  const size_t rounded = roundSize(nbytes);
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceState& state = deviceState(device);
  AllocatorStats& stats = state.stats;
  if (!state.pending.empty()) collectPending(state, /*wait=*/false);
  Block* block = takeCached(state, rounded, stream);
  if (block != nullptr) {
    ++stats.cacheHits;
  } else {
    void* ptr = backend_->allocate(rounded, device);
    if (ptr == nullptr) {
      // Cached blocks of other sizes or streams may be what stands between us and the memory.
      ++stats.oomRetries;
      collectPending(state, /*wait=*/true);
      releaseCached(state);
      ptr = backend_->allocate(rounded, device);
    }
    DG_CHECK(ptr != nullptr, "CUDA out of memory: cannot allocate ", nbytes, " bytes (", rounded,
             " rounded) on cuda:", device, "; the caching allocator holds ", stats.allocatedBytes,
             " bytes allocated and ", stats.reservedBytes,
             " bytes reserved on that device (cached blocks were returned to the driver before this retry)");
    ++stats.backendAllocations;
    stats.reservedBytes += rounded;
    stats.peakReservedBytes = std::max(stats.peakReservedBytes, stats.reservedBytes);
    auto [it, inserted] = blocks_.try_emplace(ptr);
    DG_ASSERT(inserted, "the allocation backend returned a pointer that is still in use");
    block = &it->second;
    block->ptr = ptr;
    block->size = rounded;
    block->device = device;
    block->stream = stream;
  }
  block->live = true;
  block->requested = nbytes;
  block->otherStreams.clear();
  ++stats.allocations;
  stats.allocatedBytes += block->size;
  stats.requestedBytes += nbytes;
  stats.peakAllocatedBytes = std::max(stats.peakAllocatedBytes, stats.allocatedBytes);
  return block->ptr;
}

void CachingAllocator::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  DG_ASSERT(it != blocks_.end() && it->second.live, "CachingAllocator::free of a pointer it does not own");
  Block& block = it->second;
  DeviceState& state = deviceState(block.device);
  state.stats.allocatedBytes -= block.size;
  state.stats.requestedBytes -= block.requested;
  block.live = false;
  block.requested = 0;
  if (block.otherStreams.empty()) {
    state.freeBlocks.insert(&block);
    state.stats.cachedBytes += block.size;
    return;
  }
  // Record first, then publish: if recording fails, the block is neither cached nor pending (leaked),
  // which is safe, unlike reusing memory other streams may still be reading.
  std::vector<void*> events;
  try {
    for (void* s : block.otherStreams) events.push_back(backend_->recordEvent(block.device, s));
  } catch (...) {
    for (void* e : events) backend_->destroyEvent(e);
    block.otherStreams.clear();
    throw;
  }
  block.otherStreams.clear();
  block.events = std::move(events);
  state.pending.push_back(&block);
  state.stats.pendingBytes += block.size;
}

void CachingAllocator::recordStream(void* ptr, void* stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.live) return;
  Block& block = it->second;
  if (stream == block.stream) return;
  if (std::find(block.otherStreams.begin(), block.otherStreams.end(), stream) == block.otherStreams.end()) {
    block.otherStreams.push_back(stream);
  }
}

void CachingAllocator::emptyCache(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceState& state = deviceState(device);
  collectPending(state, /*wait=*/true);
  releaseCached(state);
}

AllocatorStats CachingAllocator::stats(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = devices_.find(device);
  return it == devices_.end() ? AllocatorStats{} : it->second.stats;
}

void CachingAllocator::resetPeakStats(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  AllocatorStats& stats = deviceState(device).stats;
  stats.peakAllocatedBytes = stats.allocatedBytes;
  stats.peakReservedBytes = stats.reservedBytes;
}

bool CachingAllocator::owns(void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  return it != blocks_.end() && it->second.live;
}

}  // namespace distgrad::tensor::cuda
