// Pinned (page-locked) host memory for staging copies between host and CUDA devices, and the staged copies
// themselves. RPC sends a CUDA tensor by copying it device -> pinned -> the frame's host payload, and
// receives it host payload -> pinned -> device (docs/cuda.md, "CUDA over RPC"): DMA needs page-locked
// memory to run asynchronously, and cudaHostAlloc is far too slow (milliseconds) to call per message, so
// the buffers come from a caching pool.
//
// The pool: blocks are rounded up to a power of two (at least kMinPinnedBlockBytes) and kept per size class
// when released. A block released while an asynchronous copy may still use it (PinnedBlock::releaseAfter)
// waits, with that copy's event, until the event completes before anyone gets it again. Cached bytes beyond
// a limit (DISTGRAD_PINNED_CACHE_MB, default 256; 0 disables caching) are freed instead. The pool is one per
// process, like CUDA's own context: page-locked memory is a property of the process's address space, and
// every agent in the process shares the same GPUs. It is never destroyed (blocks may be released from
// static destructors); emptyPinnedCache() returns the idle blocks to the driver.
//
// Built without CUDA (DG_WITH_CUDA off), allocatePinned and the staged copies throw ValueError ("built
// without CUDA"); pinnedStats answers zeros.
// Thread-safety: every function is thread-safe; a PinnedBlock is owned by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/cuda/runtime.h"

namespace distgrad::tensor::cuda {

inline constexpr size_t kMinPinnedBlockBytes = 4096;
// Chunk size of the staged copies: a transfer holds at most kStagingChunksInFlight such chunks of pinned
// memory however big the tensor is, and the DMA of one chunk overlaps the host copy of another.
inline constexpr size_t kStagingChunkBytes = 4u << 20;
inline constexpr int kStagingChunksInFlight = 4;

struct PinnedStats {
  uint64_t bytesInUse = 0;       // held by live PinnedBlocks (capacity)
  uint64_t bytesCached = 0;      // idle in the pool, ready for reuse
  uint64_t bytesPending = 0;     // released, waiting for their last copy to finish
  uint64_t hostAllocs = 0;       // cudaHostAlloc calls so far
  uint64_t reuses = 0;           // allocations served from the cache
};

// A pinned buffer from the pool; goes back to the pool when destroyed. Move-only.
class PinnedBlock {
 public:
  PinnedBlock() = default;
  ~PinnedBlock();
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }          // as requested
  size_t capacity() const { return capacity_; }  // its size class
  bool defined() const { return data_ != nullptr; }
  // The work queued on `stream` so far (an async copy from or into this block) must finish before the
  // block is reused: records an event that the pool checks when the block comes back.
  void releaseAfter(const Stream& stream);

 private:
  friend PinnedBlock allocatePinned(size_t nbytes);
  void release() noexcept;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  Event lastUse_;
};

// A pinned block of at least nbytes (> 0). Throws ValueError without CUDA, or when the driver cannot
// page-lock that much memory (after freeing the cache once).
PinnedBlock allocatePinned(size_t nbytes);
PinnedStats pinnedStats();
// Frees the idle cached blocks (and pending ones whose copies finished).
void emptyPinnedCache();

// Copies nbytes from device memory `src` (on producer.device()) to host memory `dst` (any host memory).
// Ordering: the copy runs after all work queued on `producer` so far (an event, no host wait on the
// device); it goes through pinned chunks of kStagingChunkBytes on a pool stream, the DMA of one chunk
// overlapping the host copy of the previous. Returns when `dst` holds the bytes.
void copyDeviceToHostStaged(void* dst, const void* src, size_t nbytes, const Stream& producer);

// Copies nbytes from host memory `src` to device memory `dst` on `stream`'s device, queued on `stream`
// through pinned chunks. Returns once every byte of `src` was read (src may be freed); the device side
// completes in `stream` order (record an Event on `stream` to wait for it).
void copyHostToDeviceStaged(void* dst, const void* src, size_t nbytes, const Stream& stream);

}  // namespace distgrad::tensor::cuda
