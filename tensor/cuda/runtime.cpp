#include "tensor/cuda/runtime.h"

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensor/error.h"

#ifdef DG_WITH_CUDA
#include "tensor/cuda/cuda_check.h"
#endif

namespace distgrad::tensor::cuda {

#ifdef DG_WITH_CUDA

int deviceCount() {
  // Asked once: the answer cannot change while the process runs, and cudaGetDeviceCount without a driver
  // is slow to fail.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the "no driver" error
      return 0;
    }
    return n;
  }();
  return count;
}

void requireDevice(int device, const char* what) {
  DG_CHECK(device >= 0 && device < deviceCount(), what, ": CUDA device ", device, " is not available (",
           deviceCount(), " CUDA devices", deviceCount() == 0 ? ": no GPU or no driver" : "", ")");
}

DeviceGuard::DeviceGuard(int device) {
  requireDevice(device, "DeviceGuard");
  DG_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    DG_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

namespace {

constexpr int kMaxDevices = 64;
constexpr int kPoolStreamsPerDevice = 32;

// The current stream per device of this thread (nullptr: the default stream).
thread_local std::array<void*, kMaxDevices> tCurrentStream{};

struct StreamPool {
  std::once_flag created[kMaxDevices];
  std::array<std::array<cudaStream_t, kPoolStreamsPerDevice>, kMaxDevices> streams{};
  std::array<std::atomic<uint32_t>, kMaxDevices> next{};
};

StreamPool& streamPool() {
  static StreamPool* pool = new StreamPool();  // never destroyed: streams outlive static destructors
  return *pool;
}

void checkIndex(int device, const char* what) {
  requireDevice(device, what);
  DG_ASSERT(device < kMaxDevices, "more CUDA devices than distgrad supports: ", device);
}

}  // namespace

Stream Stream::current(int device) {
  checkIndex(device, "Stream::current");
  return Stream(device, tCurrentStream[device]);
}

Stream Stream::defaultStream(int device) {
  checkIndex(device, "Stream::defaultStream");
  return Stream(device, nullptr);
}

Stream Stream::fromPool(int device) {
  checkIndex(device, "Stream::fromPool");
  StreamPool& pool = streamPool();
  std::call_once(pool.created[device], [&] {
    DeviceGuard guard(device);
    for (auto& s : pool.streams[device]) DG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  });
  uint32_t i = pool.next[device].fetch_add(1, std::memory_order_relaxed) % kPoolStreamsPerDevice;
  return Stream(device, pool.streams[device][i]);
}

void Stream::synchronize() const {
  DeviceGuard guard(device_);
  DG_CUDA_CHECK(cudaStreamSynchronize(rawStream(*this)));
}

bool Stream::query() const {
  DeviceGuard guard(device_);
  cudaError_t err = cudaStreamQuery(rawStream(*this));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  DG_CUDA_CHECK(err);
  return true;
}

std::string Stream::str() const {
  return "cuda:" + std::to_string(device_) + (isDefault() ? "/default" : "/pool");
}

StreamGuard::StreamGuard(const Stream& stream)
    : previous_(Stream::current(stream.device())), device_(stream.device()) {
  tCurrentStream[stream.device()] = stream.handle();
}

StreamGuard::~StreamGuard() { tCurrentStream[previous_.device()] = previous_.handle(); }

Event::~Event() {
  if (handle_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

Event::Event(Event&& other) noexcept
    : timing_(other.timing_), device_(std::exchange(other.device_, -1)), handle_(std::exchange(other.handle_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
    timing_ = other.timing_;
    device_ = std::exchange(other.device_, -1);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Event::record(const Stream& stream) {
  DG_CHECK(handle_ == nullptr || device_ == stream.device(), "Event::record: the event belongs to cuda:", device_,
           ", the stream to cuda:", stream.device());
  DeviceGuard guard(stream.device());
  if (handle_ == nullptr) {
    cudaEvent_t e = nullptr;
    DG_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    handle_ = e;
    device_ = stream.device();
  }
  DG_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), rawStream(stream)));
}

void Event::block(const Stream& stream) const {
  if (handle_ == nullptr) return;
  DeviceGuard guard(stream.device());
  DG_CUDA_CHECK(cudaStreamWaitEvent(rawStream(stream), static_cast<cudaEvent_t>(handle_), 0));
}

bool Event::query() const {
  if (handle_ == nullptr) return true;
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  DG_CUDA_CHECK(err);
  return true;
}

void Event::synchronize() const {
  if (handle_ != nullptr) DG_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

float Event::elapsedMs(const Event& end) const {
  DG_CHECK(timing_ && end.timing_, "Event::elapsedMs: both events must be created with timing = true");
  DG_CHECK(recorded() && end.recorded(), "Event::elapsedMs: both events must be recorded");
  float ms = 0;
  DG_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
  return ms;
}

void synchronizeDevice(int device) {
  DeviceGuard guard(device);
  DG_CUDA_CHECK(cudaDeviceSynchronize());
}

#else  // built without CUDA: every call that needs a device is a clear error

namespace {
[[noreturn]] void noCuda(const char* what) {
  throw ValueError(detail::concatMessage(what, ": distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

int deviceCount() { return 0; }
void requireDevice(int, const char* what) { noCuda(what); }
DeviceGuard::DeviceGuard(int) { noCuda("DeviceGuard"); }
DeviceGuard::~DeviceGuard() = default;
Stream Stream::current(int) { noCuda("Stream::current"); }
Stream Stream::defaultStream(int) { noCuda("Stream::defaultStream"); }
Stream Stream::fromPool(int) { noCuda("Stream::fromPool"); }
void Stream::synchronize() const { noCuda("Stream::synchronize"); }
bool Stream::query() const { noCuda("Stream::query"); }
std::string Stream::str() const { return "cuda:" + std::to_string(device_); }
StreamGuard::StreamGuard(const Stream& stream) : previous_(stream), device_(stream.device()) {}
StreamGuard::~StreamGuard() = default;
Event::~Event() = default;
Event::Event(Event&& other) noexcept = default;
Event& Event::operator=(Event&& other) noexcept = default;
void Event::record(const Stream&) { noCuda("Event::record"); }
void Event::block(const Stream&) const { noCuda("Event::block"); }
bool Event::query() const { return true; }
void Event::synchronize() const {}
float Event::elapsedMs(const Event&) const { noCuda("Event::elapsedMs"); }
void synchronizeDevice(int) { noCuda("synchronizeDevice"); }

#endif

bool isAvailable() { return deviceCount() > 0; }

}  // namespace distgrad::tensor::cuda
