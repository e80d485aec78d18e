#include "rpc/transport/loop_connection.h"

#include <cstdlib>

namespace distgrad::rpc::transport {

Result<std::vector<PayloadBuffer>> defaultAllocate(const char* transport, std::span<const uint64_t> sizes) {
  std::vector<PayloadBuffer> buffers;
  buffers.reserve(sizes.size());
  for (uint64_t size : sizes) {
    size_t rounded = static_cast<size_t>(size) + paddingTo64(static_cast<size_t>(size));
    void* data = std::aligned_alloc(kPayloadAlignment, rounded == 0 ? kPayloadAlignment : rounded);
    if (data == nullptr) {
      return Error::failed(std::string(transport) + ": cannot allocate " + std::to_string(size) + " payload bytes");
    }
    buffers.push_back({data, static_cast<size_t>(size), std::shared_ptr<void>(data, std::free)});
  }
  return buffers;
}

std::string sizeTableProblem(const FramePrefix& prefix, std::span<const uint64_t> sizes, const FrameLimits& limits) {
  uint64_t sum = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Compared against what is left of the total, so the running sum cannot overflow.
    if (sizes[i] > limits.maxPayloadBytes || sizes[i] > prefix.payloadBytes - sum) {
      return "payload " + std::to_string(i) + " declares " + std::to_string(sizes[i]) +
             " bytes, more than the frame's total of " + std::to_string(prefix.payloadBytes);
    }
    sum += sizes[i];
  }
  if (sum != prefix.payloadBytes) {
    return "payload sizes sum to " + std::to_string(sum) + " bytes but the prefix declares " +
           std::to_string(prefix.payloadBytes);
  }
  return "";
}

}  // namespace distgrad::rpc::transport
