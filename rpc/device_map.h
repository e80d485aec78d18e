// Device maps (PyTorch's TensorPipeRpcBackendOptions.set_device_map): where a CUDA tensor sent to another
// worker lands. A DeviceMap belongs to one destination worker and maps this worker's cuda:i to the
// destination's cuda:j. It must be one-to-one: the reply to a call (and the gradients of distributed
// autograd) travel back with the inverse map, which two sources onto one target would make ambiguous.
// Only CUDA devices are mapped: CPU tensors always land on the receiver's CPU.
//
// Where maps come from (docs/cuda.md, "CUDA over RPC"):
//   - Options::deviceMaps[worker]: this worker's map for messages it sends to `worker` (checked when the
//     agent starts: every named worker must be in the job and have the target devices);
//   - CallOptions::deviceMap: replaces it for one call;
//   - a response (and a gradient sent back by distributed autograd) uses the inverse of the map its call
//     (forward message) carried; every message that maps devices carries its map in the envelope.
// Thread-safety: DeviceMap is a value type (const methods may be called concurrently).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "tensor/dtype.h"

namespace distgrad::rpc {

// Highest CUDA device index + 1 that a message may name (device maps, tensor descriptors): the wire's bound
// on indices, far above any machine's GPU count. A receiver checks indices against its real device count.
inline constexpr int kMaxCudaDevices = 64;

class DeviceMap {
 public:
  DeviceMap() = default;
  // Each pair is (local device, remote device); throws ValueError like set().
  DeviceMap(std::initializer_list<std::pair<tensor::Device, tensor::Device>> entries);

  // Maps local `from` to remote `to`. Throws ValueError when either is not a CUDA device, an index is outside
  // [0, kMaxCudaDevices), `from` is mapped already (to another device) or `to` is already the target of
  // another source (the inverse would be ambiguous). Setting an existing pair again is a no-op.
  DeviceMap& set(tensor::Device from, tensor::Device to);
  // The same from indices (`what` names the map in error messages).
  DeviceMap& setIndex(int from, int to, std::string_view what = "device map");

  // The remote index for local cuda:`local`, or nullopt when it is not mapped.
  std::optional<int> target(int local) const;
  // The map in the other direction (target -> source).
  DeviceMap inverse() const;
  bool empty() const { return forward_.empty(); }
  size_t size() const { return forward_.size(); }
  const std::map<int, int>& entries() const { return forward_; }
  // Highest target index + 1 (0 when empty): the fewest devices a receiver must have.
  int targetsNeeded() const;
  // "{cuda:0 -> cuda:1, cuda:1 -> cuda:0}".
  std::string str() const;

  friend bool operator==(const DeviceMap& a, const DeviceMap& b) { return a.forward_ == b.forward_; }

 private:
  std::map<int, int> forward_;
  std::map<int, int> backward_;
};

// Parses "cpu", "cuda" (= cuda:0) and "cuda:N" (N a decimal in [0, kMaxCudaDevices)). Throws ValueError
// naming `what` and the text otherwise.
tensor::Device parseDevice(std::string_view text, std::string_view what);

}  // namespace distgrad::rpc
