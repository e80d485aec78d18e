// The caching allocator's bookkeeping (tensor/cuda/caching_allocator.h) against a fake backend: size
// classes, stream-ordered reuse, recordStream with events, the out-of-memory retry and its error, stats,
// emptyCache and concurrent use. Runs on every machine (no GPU involved).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {
namespace {

// Hands out fake addresses from a per-device byte budget; events are ids whose completion the test
// controls. Thread-safe (the allocator calls it under its own lock, but the test reads it concurrently).
class FakeBackend final : public AllocatorBackend {
 public:
  struct State {
    std::mutex mutex;
    size_t capacity = size_t{1} << 40;
    size_t inUse = 0;
    uintptr_t nextAddress = 0x10000;
    std::map<void*, size_t> live;
    uint64_t allocateCalls = 0;
    uint64_t releaseCalls = 0;
    uint64_t nextEvent = 1;
    std::map<uint64_t, void*> eventStream;  // live events -> the stream they were recorded on
    std::set<uint64_t> completed;
    uint64_t synchronizeCalls = 0;
  };
  explicit FakeBackend(State* state) : state_(state) {}

  void* allocate(size_t nbytes, int) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->allocateCalls;
    if (state_->inUse + nbytes > state_->capacity) return nullptr;
    void* p = reinterpret_cast<void*>(state_->nextAddress);
    state_->nextAddress += nbytes + 4096;
    state_->inUse += nbytes;
    state_->live[p] = nbytes;
    return p;
  }
  void release(void* ptr, int) noexcept override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->releaseCalls;
    auto it = state_->live.find(ptr);
    if (it == state_->live.end()) std::abort();  // a double release is a bug the test must see
    state_->inUse -= it->second;
    state_->live.erase(it);
  }
  void* recordEvent(int, void* stream) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    uint64_t id = state_->nextEvent++;
    state_->eventStream[id] = stream;
    return reinterpret_cast<void*>(id);
  }
  bool eventCompleted(void* event) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->completed.count(reinterpret_cast<uint64_t>(event)) > 0;
  }
  void synchronizeEvent(void* event) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->synchronizeCalls;
    state_->completed.insert(reinterpret_cast<uint64_t>(event));
  }
  void destroyEvent(void* event) noexcept override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->eventStream.erase(reinterpret_cast<uint64_t>(event));
  }

 private:
  State* state_;
};

void* streamHandle(uintptr_t id) { return reinterpret_cast<void*>(id); }
const auto kStreamA = streamHandle(0);  // the default stream
const auto kStreamB = streamHandle(0xB);
const auto kStreamC = streamHandle(0xC);

class CachingAllocatorTest : public ::testing::Test {
 protected:
  FakeBackend::State backend_;
  CachingAllocator allocator_{std::make_unique<FakeBackend>(&backend_)};
};

TEST(CachingAllocatorSizes, RoundsToSizeClasses) {
  EXPECT_EQ(CachingAllocator::roundSize(1), 512u);
  EXPECT_EQ(CachingAllocator::roundSize(512), 512u);
  EXPECT_EQ(CachingAllocator::roundSize(513), 1024u);
  EXPECT_EQ(CachingAllocator::roundSize((size_t{1} << 20) - 1), size_t{1} << 20);
  EXPECT_EQ(CachingAllocator::roundSize((size_t{1} << 20) + 1), (size_t{1} << 20) + (size_t{128} << 10));
  EXPECT_EQ(CachingAllocator::roundSize((size_t{64} << 20) + 1), size_t{66} << 20);
}

TEST_F(CachingAllocatorTest, ZeroBytesAndNullAreNoOps) {
  EXPECT_EQ(allocator_.allocate(0, 0, kStreamA), nullptr);
  allocator_.free(nullptr);
  EXPECT_EQ(backend_.allocateCalls, 0u);
  EXPECT_EQ(allocator_.stats(0).allocations, 0u);
}

TEST_F(CachingAllocatorTest, ReusesAFreedBlockOnTheSameStream) {
  void* p = allocator_.allocate(1000, 0, kStreamA);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(allocator_.owns(p));
  allocator_.free(p);
  EXPECT_FALSE(allocator_.owns(p));
  void* q = allocator_.allocate(900, 0, kStreamA);  // same size class (1024)
  EXPECT_EQ(q, p);
  AllocatorStats s = allocator_.stats(0);
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.cacheHits, 1u);
  EXPECT_EQ(s.backendAllocations, 1u);
  EXPECT_EQ(s.allocatedBytes, 1024u);
  EXPECT_EQ(s.requestedBytes, 900u);
  EXPECT_EQ(s.reservedBytes, 1024u);
  EXPECT_EQ(backend_.allocateCalls, 1u);
}

TEST_F(CachingAllocatorTest, NeverHandsABlockToAnotherStream) {
  void* p = allocator_.allocate(4096, 0, kStreamA);
  allocator_.free(p);
  void* q = allocator_.allocate(4096, 0, kStreamB);
  EXPECT_NE(q, p);
  EXPECT_EQ(allocator_.stats(0).cacheHits, 0u);
  // ...but stream A still gets its own block back.
  EXPECT_EQ(allocator_.allocate(4096, 0, kStreamA), p);
}

TEST_F(CachingAllocatorTest, KeepsDevicesApart) {
  void* p = allocator_.allocate(4096, 0, kStreamA);
  allocator_.free(p);
  void* q = allocator_.allocate(4096, 1, kStreamA);
  EXPECT_NE(q, p);
  EXPECT_EQ(allocator_.stats(0).cachedBytes, 4096u);
  EXPECT_EQ(allocator_.stats(1).allocatedBytes, 4096u);
  EXPECT_EQ(allocator_.stats(0).allocatedBytes, 0u);
}

TEST_F(CachingAllocatorTest, BestFitWithBoundedWaste) {
  void* big = allocator_.allocate(size_t{8} << 20, 0, kStreamA);
  void* mid = allocator_.allocate(size_t{2} << 20, 0, kStreamA);
  allocator_.free(big);
  allocator_.free(mid);
  // 1.9 MiB rounds to 1.875 MiB + ... : the 2 MiB block is within 1/8 of it, the 8 MiB one is not.
  void* p = allocator_.allocate((size_t{2} << 20) - (size_t{100} << 10), 0, kStreamA);
  EXPECT_EQ(p, mid);
  void* small = allocator_.allocate(4096, 0, kStreamA);  // must not take the 8 MiB block
  EXPECT_NE(small, big);
  EXPECT_EQ(allocator_.stats(0).cachedBytes, size_t{8} << 20);
}

TEST_F(CachingAllocatorTest, RecordStreamDelaysReuseUntilTheOtherStreamsEventsComplete) {
  void* p = allocator_.allocate(4096, 0, kStreamA);
  allocator_.recordStream(p, kStreamB);
  allocator_.recordStream(p, kStreamC);
  allocator_.recordStream(p, kStreamB);  // duplicates are recorded once
  allocator_.recordStream(p, kStreamA);  // the block's own stream needs no event
  allocator_.free(p);
  ASSERT_EQ(backend_.eventStream.size(), 2u);
  std::set<void*> streams;
  for (auto& [id, stream] : backend_.eventStream) streams.insert(stream);
  EXPECT_EQ(streams, (std::set<void*>{kStreamB, kStreamC}));
  EXPECT_EQ(allocator_.stats(0).pendingBytes, 4096u);

  // Events not completed: the block is not reused, even on its own stream.
  void* q = allocator_.allocate(4096, 0, kStreamA);
  EXPECT_NE(q, p);
  allocator_.free(q);
  // One of two completes: still pending.
  backend_.completed.insert(backend_.eventStream.begin()->first);
  void* r = allocator_.allocate(4096, 0, kStreamA);
  EXPECT_EQ(r, q);  // the plain cached block, not p
  // Both complete: p becomes reusable, its events are destroyed.
  for (auto& [id, stream] : backend_.eventStream) backend_.completed.insert(id);
  void* s = allocator_.allocate(4096, 0, kStreamA);
  EXPECT_EQ(s, p);
  EXPECT_TRUE(backend_.eventStream.empty());
  EXPECT_EQ(allocator_.stats(0).pendingBytes, 0u);
  EXPECT_EQ(backend_.synchronizeCalls, 0u);  // reuse never blocked the host
}

TEST_F(CachingAllocatorTest, RecordStreamIgnoresForeignPointers) {
  int foreign = 0;
  allocator_.recordStream(&foreign, kStreamB);
  allocator_.recordStream(nullptr, kStreamB);
  EXPECT_TRUE(backend_.eventStream.empty());
}

TEST_F(CachingAllocatorTest, OutOfMemoryFreesTheCacheAndRetriesOnce) {
  backend_.capacity = size_t{10} << 20;
  void* a = allocator_.allocate(size_t{4} << 20, 0, kStreamA);
  void* b = allocator_.allocate(size_t{4} << 20, 0, kStreamB);
  allocator_.recordStream(b, kStreamC);
  allocator_.free(a);  // cached
  allocator_.free(b);  // pending on an event that has not completed
  // 6 MiB does not fit next to 8 MiB held by the cache; after the cache is emptied (the pending event
  // waited for) it does.
  void* c = allocator_.allocate(size_t{6} << 20, 0, kStreamA);
  ASSERT_NE(c, nullptr);
  AllocatorStats s = allocator_.stats(0);
  EXPECT_EQ(s.oomRetries, 1u);
  EXPECT_EQ(s.reservedBytes, size_t{6} << 20);
  EXPECT_EQ(s.cachedBytes, 0u);
  EXPECT_EQ(s.pendingBytes, 0u);
  EXPECT_EQ(backend_.synchronizeCalls, 1u);
  EXPECT_EQ(backend_.releaseCalls, 2u);
}

TEST_F(CachingAllocatorTest, OutOfMemoryAfterTheRetryIsAClearError) {
  backend_.capacity = size_t{10} << 20;
  void* a = allocator_.allocate(size_t{8} << 20, 0, kStreamA);
  try {
    allocator_.allocate(size_t{4} << 20, 0, kStreamA);
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("out of memory"), std::string::npos) << message;
    EXPECT_NE(message.find("4194304 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
    EXPECT_NE(message.find("8388608 bytes allocated"), std::string::npos) << message;
    EXPECT_NE(message.find("8388608 bytes reserved"), std::string::npos) << message;
  }
  // The failure left the books straight: the live block is still there and can be freed and reused.
  EXPECT_EQ(allocator_.stats(0).allocatedBytes, size_t{8} << 20);
  allocator_.free(a);
  EXPECT_EQ(allocator_.allocate(size_t{8} << 20, 0, kStreamA), a);
}

TEST_F(CachingAllocatorTest, EmptyCacheReturnsOnlyCachedBlocks) {
  void* live = allocator_.allocate(4096, 0, kStreamA);
  void* cached = allocator_.allocate(8192, 0, kStreamA);
  void* pending = allocator_.allocate(16384, 0, kStreamA);
  allocator_.recordStream(pending, kStreamB);
  allocator_.free(cached);
  allocator_.free(pending);
  allocator_.emptyCache(0);
  AllocatorStats s = allocator_.stats(0);
  EXPECT_EQ(s.reservedBytes, 4096u);
  EXPECT_EQ(s.allocatedBytes, 4096u);
  EXPECT_EQ(s.cachedBytes, 0u);
  EXPECT_EQ(s.pendingBytes, 0u);
  EXPECT_EQ(backend_.live.size(), 1u);
  EXPECT_EQ(backend_.live.count(live), 1u);
  allocator_.free(live);
}

TEST_F(CachingAllocatorTest, TracksPeaksAndResetsThem) {
  void* a = allocator_.allocate(4096, 0, kStreamA);
  void* b = allocator_.allocate(4096, 0, kStreamA);
  allocator_.free(a);
  allocator_.free(b);
  AllocatorStats s = allocator_.stats(0);
  EXPECT_EQ(s.allocatedBytes, 0u);
  EXPECT_EQ(s.peakAllocatedBytes, 8192u);
  EXPECT_EQ(s.peakReservedBytes, 8192u);
  allocator_.resetPeakStats(0);
  s = allocator_.stats(0);
  EXPECT_EQ(s.peakAllocatedBytes, 0u);
  EXPECT_EQ(s.peakReservedBytes, 8192u);  // still reserved (cached)
}

TEST_F(CachingAllocatorTest, DestructorReturnsCachedBlocks) {
  FakeBackend::State state;
  {
    CachingAllocator allocator(std::make_unique<FakeBackend>(&state));
    void* p = allocator.allocate(4096, 0, kStreamA);
    allocator.recordStream(p, kStreamB);
    allocator.free(p);
    allocator.free(allocator.allocate(8192, 0, kStreamA));
  }
  EXPECT_TRUE(state.live.empty());
}

TEST_F(CachingAllocatorTest, ConcurrentUseKeepsTheBooksStraight) {
  constexpr int kThreads = 4;
  constexpr int kIterations = 2000;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      void* stream = streamHandle(static_cast<uintptr_t>(t));
      std::vector<void*> held;
      for (int i = 0; i < kIterations; ++i) {
        const size_t size = size_t{512} << (i % 6);
        void* p = allocator_.allocate(size, t % 2, stream);
        if (p == nullptr) ++failures;
        held.push_back(p);
        if (i % 3 == 0) allocator_.recordStream(p, streamHandle(0x100 + t));
        if (held.size() > 8) {
          allocator_.free(held.front());
          held.erase(held.begin());
        }
      }
      for (void* p : held) allocator_.free(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int device = 0; device < 2; ++device) {
    AllocatorStats s = allocator_.stats(device);
    EXPECT_EQ(s.allocatedBytes, 0u);
    EXPECT_EQ(s.requestedBytes, 0u);
    EXPECT_EQ(s.allocations, static_cast<uint64_t>(kThreads / 2 * kIterations));
    EXPECT_EQ(s.reservedBytes, s.cachedBytes + s.pendingBytes);
  }
  // No two live blocks ever overlapped: the backend saw each block handed out by one allocation at a time.
  for (int device = 0; device < 2; ++device) allocator_.emptyCache(device);
  EXPECT_TRUE(backend_.live.empty());
}

}  // namespace
}  // namespace distgrad::tensor::cuda
