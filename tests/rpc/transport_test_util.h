// Helpers shared by the transport tests: collectors that record callbacks, bounded waits, frame builders.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rpc/transport/inproc/context.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport::testing {

inline constexpr auto kWait = std::chrono::seconds(60);

// Lets a callback that outlives its target (a loop still running after a test's locals are gone) see
// that the target is gone instead of touching freed memory.
template <typename T>
struct Guard {
  std::mutex mutex;
  T* target;
  explicit Guard(T* t) : target(t) {}
};

// Records what a started connection reports.
struct Collector {
  Collector() = default;
  Collector(const Collector&) = delete;
  ~Collector() {
    std::lock_guard lock(guard->mutex);
    guard->target = nullptr;
  }
  std::shared_ptr<Guard<Collector>> guard = std::make_shared<Guard<Collector>>(this);
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<IncomingFrame> frames;
  std::optional<Error> closed;
  int closeCount = 0;

  void start(const std::shared_ptr<Connection>& connection, PayloadAllocator allocate = nullptr) {
    connection->start(
        std::move(allocate),
        [g = guard](IncomingFrame&& frame) {
          std::lock_guard alive(g->mutex);
          Collector* self = g->target;
          if (self == nullptr) return;
          std::lock_guard lock(self->mutex);
          self->frames.push_back(std::move(frame));
          self->changed.notify_all();
        },
        [g = guard](const Error& error) {
          std::lock_guard alive(g->mutex);
          Collector* self = g->target;
          if (self == nullptr) return;
          std::lock_guard lock(self->mutex);
          self->closed = error;
          ++self->closeCount;
          self->changed.notify_all();
        });
  }
  bool waitFrames(size_t n) {
    std::unique_lock lock(mutex);
    return changed.wait_for(lock, kWait, [&] { return frames.size() >= n || closed.has_value(); }) &&
           frames.size() >= n;
  }
  bool waitClosed() {
    std::unique_lock lock(mutex);
    return changed.wait_for(lock, kWait, [&] { return closed.has_value(); });
  }
};

// Counts send completions and checks that each runs once.
struct SendTracker {
  std::mutex mutex;
  std::condition_variable changed;
  size_t ok = 0, failed = 0;
  std::vector<int> calls;  // per send id
  std::optional<Error> lastError;

  std::shared_ptr<Guard<SendTracker>> guard = std::make_shared<Guard<SendTracker>>(this);
  explicit SendTracker(size_t n = 0) : calls(n, 0) {}
  SendTracker(const SendTracker&) = delete;
  ~SendTracker() {
    std::lock_guard lock(guard->mutex);
    guard->target = nullptr;
  }
  SendCallback callback(size_t id) {
    return [g = guard, id](const Result<void>& r) {
      std::lock_guard alive(g->mutex);
      SendTracker* self = g->target;
      if (self == nullptr) return;
      self->record(id, r);
    };
  }
  void record(size_t id, const Result<void>& r) {
    {
      std::lock_guard lock(mutex);
      if (id < calls.size()) ++calls[id];
      if (r.ok()) {
        ++ok;
      } else {
        ++failed;
        lastError = r.error();
      }
      changed.notify_all();
    }
  }
  bool waitDone(size_t n) {
    std::unique_lock lock(mutex);
    return changed.wait_for(lock, kWait, [&] { return ok + failed >= n; });
  }
};

struct Bytes {
  std::shared_ptr<std::vector<uint8_t>> data;
  SendBuffer buffer() const {
    return {data->data(), data->size(), std::shared_ptr<const void>(data, data->data())};
  }
};

inline Bytes patternBytes(size_t n, uint32_t seed) {
  auto data = std::make_shared<std::vector<uint8_t>>(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    (*data)[i] = static_cast<uint8_t>(x >> 24);
  }
  return {data};
}

inline std::vector<uint8_t> envelopeWithIndex(uint64_t index, size_t size = 16) {
  std::vector<uint8_t> e(std::max<size_t>(size, 8), 0);
  std::memcpy(e.data(), &index, 8);
  for (size_t i = 8; i < e.size(); ++i) e[i] = static_cast<uint8_t>(i * 7 + index);
  return e;
}

inline uint64_t indexOf(const IncomingFrame& frame) {
  uint64_t index = 0;
  std::memcpy(&index, frame.envelope.data(), 8);
  return index;
}

}  // namespace distgrad::rpc::transport::testing
