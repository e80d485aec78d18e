// The caching allocator behind CUDA storage: the block, size-class and stream bookkeeping, written
// against an AllocatorBackend (raw device memory and events) so it runs and is tested without a GPU
// (tests/tensor/caching_allocator_test.cpp drives it with a fake backend); tensor/cuda/cuda_memory.cpp
// plugs in cudaMalloc/cudaFree and CUDA events.
//
// Note [Stream-ordered reuse]: cudaMalloc and cudaFree are slow and cudaFree synchronises the device, so
// freed blocks are kept per device, keyed by the stream they were allocated on and their rounded size. A
// block freed on the host while kernels that use it are still queued is safe to hand out again at once
// to the SAME stream: whatever that stream runs next is ordered after those kernels. Another stream could
// overtake them, so a block only ever goes back to its own stream. When a block was also used on other
// streams (recordStream, as PyTorch's CUDACachingAllocator::recordStream), freeing it records an event
// on each of those streams and the block is reusable only once all of them have completed (checked on
// later allocations, without blocking). Out of device memory, the allocator waits for those events,
// returns every cached block of the device to the backend and retries once; then it fails with a
// ValueError naming the size, the device and its allocated/reserved bytes.
//
// Sizes: requests round up to 512 bytes below 1 MiB, to 128 KiB below 64 MiB and to 2 MiB beyond; a cached
// block is reused for a request whose rounded size it exceeds by at most 1/8 (bounding the waste without
// splitting blocks). Blocks are never split or merged. TODO(perf): split large segments like PyTorch.
//
// Thread-safety: all members are thread-safe (one mutex; backend calls are made under it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

namespace distgrad::tensor::cuda {

// What the pool needs from the device. Streams and events are opaque handles (cudaStream_t, cudaEvent_t;
// nullptr is the default stream).
class AllocatorBackend {
 public:
  virtual ~AllocatorBackend() = default;
  // nbytes of device memory, or nullptr when the device is out of memory (any other failure throws).
  virtual void* allocate(size_t nbytes, int device) = 0;
  virtual void release(void* ptr, int device) noexcept = 0;
  // An event recorded now on `stream` of `device`; completed once the work queued so far has finished.
  virtual void* recordEvent(int device, void* stream) = 0;
  virtual bool eventCompleted(void* event) = 0;
  virtual void synchronizeEvent(void* event) = 0;
  virtual void destroyEvent(void* event) noexcept = 0;
};

// Per-device counters. Byte counts are of rounded block sizes except requestedBytes.
struct AllocatorStats {
  size_t allocatedBytes = 0;  // held by live blocks
  size_t requestedBytes = 0;  // what the live blocks' owners asked for
  size_t reservedBytes = 0;   // obtained from the backend and not yet returned (live + cached + pending)
  size_t cachedBytes = 0;     // free blocks ready for reuse
  size_t pendingBytes = 0;    // freed blocks waiting for other streams' events
  size_t peakAllocatedBytes = 0;
  size_t peakReservedBytes = 0;
  uint64_t allocations = 0;         // allocate() calls that returned a block
  uint64_t cacheHits = 0;           // ... of which served from the cache
  uint64_t backendAllocations = 0;  // backend allocate() calls that succeeded
  uint64_t backendReleases = 0;
  uint64_t oomRetries = 0;  // allocations retried after emptying the cache
};

class CachingAllocator {
 public:
  explicit CachingAllocator(std::unique_ptr<AllocatorBackend> backend);
  // Returns cached blocks to the backend. Live blocks are the owners' business (a process-lifetime
  // allocator is never destroyed, see cuda_memory.cpp).
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least nbytes for use on `stream` of `device` (nullptr for nbytes == 0). Throws
  // ValueError when the device is out of memory even after emptying the cache.
  void* allocate(size_t nbytes, int device, void* stream);
  // Returns a block to the cache (nullptr is a no-op). A pointer this allocator did not hand out is an
  // internal error (DG_ASSERT).
  void free(void* ptr);
  // Marks the live block holding `ptr` as used by `stream` too (see Note [Stream-ordered reuse]). A pointer
  // the allocator does not own (wrapped foreign memory) and the block's own stream are ignored.
  void recordStream(void* ptr, void* stream);
  // Returns the device's cached blocks to the backend (waiting for pending ones' events first).
  void emptyCache(int device);

  AllocatorStats stats(int device) const;
  void resetPeakStats(int device);
  // True when `ptr` is a live block of this allocator.
  bool owns(void* ptr) const;

  static size_t roundSize(size_t nbytes);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;       // rounded
    size_t requested = 0;  // while live
    int device = 0;
    void* stream = nullptr;          // the stream it was allocated on (the only one it is reused on)
    std::vector<void*> otherStreams;  // recordStream()'d streams while live
    std::vector<void*> events;        // while pending: one per other stream
    bool live = false;
  };
  // Free blocks ordered by (stream, size, address): lower_bound finds the smallest fitting block of a stream.
  struct FreeOrder {
    bool operator()(const Block* a, const Block* b) const;
  };
  struct DeviceState {
    std::set<Block*, FreeOrder> freeBlocks;
    std::vector<Block*> pending;  // freed, waiting for events
    AllocatorStats stats;
  };

  DeviceState& deviceState(int device);                 // REQUIRES(mutex_)
  Block* takeCached(DeviceState& state, size_t rounded, void* stream);  // REQUIRES(mutex_)
  void collectPending(DeviceState& state, bool wait);   // REQUIRES(mutex_)
  void releaseCached(DeviceState& state);               // REQUIRES(mutex_)

  std::unique_ptr<AllocatorBackend> backend_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;  // GUARDED_BY(mutex_): every block obtained from the backend
  std::map<int, DeviceState> devices_;       // GUARDED_BY(mutex_)
};

}  // namespace distgrad::tensor::cuda
