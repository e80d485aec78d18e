// CUDA device memory for Storage: a process-wide caching allocator (tensor/cuda/caching_allocator.h, Note
// [Stream-ordered reuse]) over plain cudaMalloc/cudaFree (never managed memory), and byte copies ordered
// on streams. Storage on a CUDA device allocates on the calling thread's current stream of that device
// (Stream::current); a tensor handed to another stream must be recordStream()'d there before its last
// reference is dropped, or its memory may be reused while that stream still reads it.
//
// Built without CUDA (DG_WITH_CUDA off), every call fails with a ValueError saying so, except the queries
// (memoryStats gives zeros) and deviceFree (a no-op: nothing can have been allocated).
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstddef>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/runtime.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

// nbytes (uninitialised) on `device`, for use on Stream::current(device). nullptr for 0 bytes, after
// checking that the device exists.
void* deviceAlloc(size_t nbytes, int device);
// Returns memory from deviceAlloc to the cache. Never throws (errors are reported on stderr).
void deviceFree(void* ptr, int device) noexcept;

// Marks the storage's memory as used by `stream` as well as the stream it was allocated on: when the last
// reference goes, the block is reused only after the work queued on `stream` so far has finished. No-op
// for CPU storage and for wrapped memory the allocator did not hand out.
void recordStream(const Storage& storage, const Stream& stream);
void recordStream(const Tensor& tensor, const Stream& stream);

// Returns the device's cached blocks to the driver (e.g. before handing memory to another library).
void emptyCache(int device);
using MemoryStats = AllocatorStats;
MemoryStats memoryStats(int device);
void resetPeakMemoryStats(int device);

// Copies nbytes between host and/or device memory (direction inferred by the runtime) in `stream`'s order,
// returning before the copy has finished (a device-to-pageable-host copy finishes before it returns, as
// CUDA does it; synchronize the stream before reading pinned host memory).
void copyBytesAsync(void* dst, const void* src, size_t nbytes, const Stream& stream);
// Host -> device in `stream`'s order, returning once `src` may be reused: a pageable source is staged by
// the driver before cudaMemcpyAsync returns; a pinned (page-locked) source is waited for.
void copyHostToDevice(void* dst, const void* src, size_t nbytes, const Stream& stream);
// Device `srcDevice` -> device `dstDevice` on `stream` (of dstDevice); the caller orders it after the
// source's producer (an Event) and keeps the source alive for the stream (recordStream).
void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t nbytes, const Stream& stream);
// copyBytesAsync on Stream::current(device), then waits for that stream: the copy is complete on return.
void copyBytes(void* dst, const void* src, size_t nbytes, int device);

}  // namespace distgrad::tensor::cuda
