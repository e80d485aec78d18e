// The CUDA runtime pieces every part of the backend shares: device guards, streams, events and pinned
// host memory. The header pulls in no CUDA headers, so it is usable from any module whether or not
// distgrad was built with CUDA. Without CUDA (DG_WITH_CUDA off) or without a usable driver, the queries
// (deviceCount, isAvailable) answer 0/false and never throw; anything that needs a device throws a
// ValueError naming the device and how many there are.
//
// Streams: like PyTorch, each thread has a current stream per device, initially that device's default
// (legacy) stream, so work submitted without a StreamGuard is ordered with everything else on the device.
// Extra streams come from a fixed per-device pool and are never destroyed, so a Stream is a plain value
// that stays valid for the life of the process.
//
// Thread-safety: the current device and the current streams are per thread. Stream and Event may be
// used from any thread; an Event must not be recorded concurrently from two threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace distgrad::tensor::cuda {

// Queries: never throw. deviceCount() is 0 without CUDA or without a driver.
int deviceCount();
bool isAvailable();
// Throws ValueError unless `device` names a usable CUDA device; `what` names the caller in the message.
void requireDevice(int device, const char* what);

// Sets the calling thread's current CUDA device for its lifetime; restores the previous one after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// A CUDA stream on one device (a value: copying it copies the handle, never the stream).
class Stream {
 public:
  // The stream this thread submits work for `device` to (the default stream unless a StreamGuard is live).
  static Stream current(int device);
  // The device's default (legacy) stream.
  static Stream defaultStream(int device);
  // A stream from the device's pool (round-robin over a fixed set of non-blocking streams).
  static Stream fromPool(int device);

  int device() const { return device_; }
  // The cudaStream_t, as an opaque pointer (nullptr is the legacy default stream).
  void* handle() const { return handle_; }
  bool isDefault() const { return handle_ == nullptr; }
  // Blocks the calling thread until all work queued on the stream has finished.
  void synchronize() const;
  // True when all work queued on the stream has finished.
  bool query() const;
  std::string str() const;

  friend bool operator==(const Stream&, const Stream&) = default;

 private:
  Stream(int device, void* handle) : device_(device), handle_(handle) {}
  int device_ = 0;
  void* handle_ = nullptr;
};

// Makes `stream` the calling thread's current stream for stream.device() (and that device current) for
// the guard's lifetime.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
  DeviceGuard device_;
};

// A CUDA event: marks a point in a stream that other streams or host threads can wait for. Created
// lazily on the first record(), on the recording stream's device. Move-only (it owns the cudaEvent_t).
class Event {
 public:
  // `timing` enables elapsedMs (events without timing are cheaper to record and wait for).
  explicit Event(bool timing = false) : timing_(timing) {}
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work queued on `stream` so far.
  void record(const Stream& stream);
  // Makes all future work on `stream` wait for the recorded point (no host blocking). A never-recorded
  // event is a no-op, as in CUDA.
  void block(const Stream& stream) const;
  // True when the recorded work has finished (or nothing was recorded).
  bool query() const;
  // Blocks the calling thread until the recorded work has finished.
  void synchronize() const;
  // Milliseconds between this event and `end` (both recorded, both created with timing).
  float elapsedMs(const Event& end) const;
  bool recorded() const { return handle_ != nullptr; }
  int device() const { return device_; }

 private:
  bool timing_ = false;
  int device_ = -1;
  void* handle_ = nullptr;  // cudaEvent_t
};

// Blocks until every stream of `device` is idle.
void synchronizeDevice(int device);

}  // namespace distgrad::tensor::cuda
